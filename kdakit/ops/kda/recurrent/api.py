"""The public recurrent KDA op ``fused_recurrent_kda`` and its autograd Function.

The kernels live in ``recurrent_forward.py`` (the recurrence kernel of every recurrent path, per-token
Triton functions), ``recurrent_backward_kernels.py`` / ``recurrent_backward_segmented.py`` (backward) and
``decode_step.py`` (one-token decode steps); ``decode.py`` launches the recurrence for the serving
arguments' pools. This module is the top of that layering
and imports all of them (none imports it). The forward saves nothing for backward except
the inputs: the backward recomputes the recurrence from the initial state.

Names that lived here before the split (``launch_recurrent_forward``, the constants, the
per-token Triton functions...) are re-exported below.
"""

from __future__ import annotations

import warnings

import torch

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.compiled import fused_recurrent_kda_via_op
from kdakit.ops.kda.serving.decode import fused_recurrent_kda_serving
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.ops.kda.options import kda_options
from kdakit.ops.kda.recurrent.backward import run_recurrent_backward
from kdakit.ops.kda.recurrent.kernels import (
    BETA_RAW,
    BETA_SIGMOID,
    BETA_SIGMOID_X2,
    DEFAULT_SEGMENT_TOKENS,
    FWD_BLOCK_V,
    FWD_NUM_WARPS,
    MAX_HEAD_DIM,
    beta_mode,
    beta_value,
    check_kernel_layout,
    check_segment_tokens,
    gate_preactivation,
    launch_recurrent_forward,
    load_qk_token,
    load_token_raw,
    log_decay,
    qk_activation,
    softplus_fp32,
)
from kdakit.ops.kda.constants import L2NORM_EPS, SOFTPLUS_THRESHOLD
from kdakit.ops.kda.recurrent.workspace import (
    Workspace,
    call_signature,
    check_capturable_offsets,
    check_out,
    forward_workspace,
    is_capturing,
    resolve_workspace,
)

# Public here: the op, and the names this module defined before the kernels moved out (re-exported).
__all__ = [
    "FusedRecurrentKDAFunction",
    "fused_recurrent_kda",
    "BETA_RAW",
    "BETA_SIGMOID",
    "BETA_SIGMOID_X2",
    "DEFAULT_SEGMENT_TOKENS",
    "FWD_BLOCK_V",
    "FWD_NUM_WARPS",
    "L2NORM_EPS",
    "MAX_HEAD_DIM",
    "SOFTPLUS_THRESHOLD",
    "beta_mode",
    "beta_value",
    "check_kernel_layout",
    "check_segment_tokens",
    "gate_preactivation",
    "launch_recurrent_forward",
    "load_qk_token",
    "load_token_raw",
    "log_decay",
    "qk_activation",
    "softplus_fp32",
]

# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------

class FusedRecurrentKDAFunction(torch.autograd.Function):
    """Triton forward; the backward replays the recurrence (``run_recurrent_backward``).

    Saves only the inputs (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens) and the call's
    ``KDAOptions`` (``opts``), which the backward takes whole. ``outputs`` is the pair
    ``(o, final_state or None)`` of tensors to write; ``segment_tokens`` bounds the backward's scratch
    (it recomputes longer sequences segment by segment).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, outputs, workspace,
                segment_tokens):
        o, final = outputs
        ctx.opts = opts
        ctx.workspace = workspace
        ctx.segment_tokens = segment_tokens
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        launch_recurrent_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, N=opts.shape.N, opts=opts, o=o, final_state=final)
        return o if final is None else (o, final)

    @staticmethod
    def backward(ctx, do, *rest):
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = ctx.saved_tensors
        dht = rest[0] if rest else None
        grads = run_recurrent_backward(
            q, k, v, g, beta, do, dht, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
            cu_seqlens=cu_seqlens, opts=ctx.opts, segment_tokens=ctx.segment_tokens,
            workspace=resolve_workspace(ctx.workspace, q.device),
        )
        return (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, grads.dA_log, grads.ddt_bias, grads.dh0,
                None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    safe_gate: bool = False,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    check_indices: bool = True,
    cu_seqlens_cpu: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Recurrent Kimi Delta Attention with FLA 0.6.0's ``fused_recurrent_kda`` arguments, differentiable.

    Args (FLA's names and order):
        q, k: ``[B, T, H, K]`` (fp16/bf16/fp32/fp64), K <= 256 on the Triton path. Token tensors (q, k, v,
            g, beta) may be views of wider tensors (a fused projection's ``split``, a ``transpose``d
            batch/time, a slice of heads): the Triton kernels read them through their strides, with no
            copy, and need a unit stride in the last dimension only (beta: any strides); the result is
            the contiguous call's, bit for bit. Gradients come back as new contiguous tensors.
        v: ``[B, T, HV, V]``; HV a multiple of H (value head i uses q/k head ``i // (HV // H)``).
        g: ``[B, T, HV, K]`` log-decay, or the raw gate with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` beta, or logits with ``use_beta_sigmoid_in_kernel``.
        A_log: ``[HV]`` fp32; dt_bias: ``[HV * K]`` fp32 (used with ``use_gate_in_kernel``). The
            engine shapes ``[HV, 1]`` / ``[1, 1, HV, 1]`` and ``[HV, K]`` are read through a flat
            view (dense tensors only; gradients come back in the caller's shape).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), fp32 or bf16.
        output_final_state: also return the final state (fp32, same layout as initial_state).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, lower_bound, state_v_first, cu_seqlens: as ``kdakit.chunk_kda``.

    kdakit keyword arguments:
        safe_gate: as ``chunk_kda``: checks ``lower_bound`` lies in [-5, 0).
        out: preallocated ``o`` (v's shape and dtype): contiguous, or a view of a wider tensor with a unit
            last stride (written through its strides on the Triton path).
        final_state_out: preallocated fp32 final state (with ``output_final_state``).
        workspace: ``kdakit.Workspace`` the backward uses (default: stream-local scratch).
        segment_tokens: the backward recomputes sequences longer than this segment by
            segment from state checkpoints, so its scratch scales with segment_tokens, not T
            (``kdakit.recurrent_kda_backward``).
        cu_seqlens_cpu: the host copy of ``cu_seqlens`` (as ``chunk_kda``): validation reads it
            and never ``cu_seqlens``, so the forward makes no device->host synchronization and
            captures in a plain ``torch.cuda.graph`` (see ``kdakit/ops/kda/recurrent/workspace.py``).

    Serving arguments (FLA 0.6.0's ``fused_recurrent_kda_fwd``, the vLLM entry; forward only):
        ssm_state_indices: int32/int64 ``[N]`` or ``[N, S]``: initial_state is then a state
            pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with state_v_first; rows may be padded,
            16-byte aligned row stride) and sequence ``n`` starts from row
            ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without counts).
        num_accepted_tokens: int ``[N]`` (needs ssm_state_indices).
        inplace_final_state: write states into initial_state instead of a new tensor: the
            state after token ``t`` of sequence ``n`` goes to row ``ssm_state_indices[n, t]``
            (without indices, sequence n's final state to row n); returns
            ``(o, initial_state)``. Default False, as FLA's ``fused_recurrent_kda``
            (``fused_recurrent_kda_fwd`` defaults to True).
        check_indices: check the index entries the kernel reads on the host (a device sync;
            skipped during CUDA-graph capture): they must lie in ``[0, P)`` and rows written
            by one sequence must not be used by another. Entries never read (FLA's
            ``PAD_SLOT_ID = -1`` in unused columns, sequences without tokens) may hold
            anything. FLA does not check; its kernel addresses memory outside the pool for a
            negative entry it reads, which kdakit refuses. Unchecked, a read row outside the
            pool is never dereferenced: that sequence gets zeros and writes nothing.
        See ``kdakit.ops.kda.serving.decode.fused_recurrent_kda_serving`` for the full contract (it
        shares ``kdakit.kda_decode``'s kernel).

    Gradients flow to q, k, v, g, beta, A_log, dt_bias and initial_state; the backward
    (``kdakit.recurrent_kda_backward``) recomputes the recurrence, see its docstring for
    its scratch memory.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 (float64 on
        the PyTorch path for float64 inputs) or None.
    """
    if torch.compiler.is_compiling():
        # torch.compile traces the registered ops torch.ops.kdakit.*, not this Python (compiled.py)
        return fused_recurrent_kda_via_op(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, safe_gate=safe_gate, out=out, final_state_out=final_state_out, workspace=workspace,
            segment_tokens=segment_tokens, ssm_state_indices=ssm_state_indices,
            num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state,
            check_indices=check_indices, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs)
    if "transpose_state_layout" in kwargs:
        warnings.warn("transpose_state_layout is deprecated; use state_v_first", DeprecationWarning, stacklevel=2)
        if state_v_first:
            raise ValueError("pass state_v_first or its old name transpose_state_layout, not both")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if kwargs:
        raise TypeError(f"fused_recurrent_kda got unexpected keyword argument(s) {sorted(kwargs)}")
    if ssm_state_indices is not None or num_accepted_tokens is not None or inplace_final_state is not False:
        return fused_recurrent_kda_serving(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
            output_final_state=output_final_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, safe_gate=safe_gate,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, out=out,
            final_state_out=final_state_out, workspace=workspace, ssm_state_indices=ssm_state_indices,
            num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state,
            check_indices=check_indices, cu_seqlens_cpu=cu_seqlens_cpu)

    check_segment_tokens(segment_tokens)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    backend = select_backend(device)
    # the options as given: the key of a call that an eager warm call prepared for a capture
    given = (scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
             lower_bound, state_v_first)
    ws, prepared, signature = None, False, None
    capturing = is_capturing(device)
    if backend == "triton":
        # the forward needs no scratch (the backward resolves its own workspace when it runs)
        ws = forward_workspace(workspace, device)
        signature = call_signature("fused_recurrent_kda", q, k, v, g, beta, A_log, dt_bias, initial_state,
                                   cu_seqlens, out, final_state_out, output_final_state, safe_gate, given)
        prepared = capturing and ws is not None and ws.is_prepared(signature)
    if capturing and not prepared:
        check_capturable_offsets("fused_recurrent_kda", cu_seqlens, cu_seqlens_cpu)
    # a prepared capture skips the checks (the warm call made them) and reads sizes off metadata only
    opts = kda_options(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, engine_gate_shapes=True, validate=not prepared,
    )
    shape = opts.shape
    N, K = shape.N, shape.K
    if not prepared:
        if out is not None:
            check_out("out", out, v.shape, v.dtype, device, token_view=True)
        if final_state_out is not None:
            if not output_final_state:
                raise ValueError("final_state_out needs output_final_state=True, got output_final_state=False")
            if backend != "triton":
                raise ValueError("final_state_out is taken by the Triton path only, got the PyTorch backend")
            want = (N, shape.HV, shape.V, K) if state_v_first else (N, shape.HV, K, shape.V)
            check_out("final_state_out", final_state_out, want, torch.float32, device)
    A_log_k, dt_bias_k = opts.kernel_gate_params(A_log, dt_bias)

    if backend == "torch":
        # the PyTorch loop reads the offsets on the host: the host copy when there is one (validated
        # above, equal to cu_seqlens by the caller's promise), so cu_seqlens is not read back either
        o, ht = naive_recurrent_kda(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            A_log=A_log_k, dt_bias=dt_bias_k, cu_seqlens=cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu,
            **opts.reference_kwargs(),
        )
        if out is not None:
            # out receives the values; the returned o stays the differentiable tensor.
            with torch.no_grad():
                out.copy_(o)
            if not o.requires_grad:
                o = out
        return o, ht

    if not prepared:
        check_kernel_layout(K, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                                "A_log": A_log_k, "dt_bias": dt_bias_k, "cu_seqlens": cu_seqlens})
    HV, V = v.shape[2], v.shape[3]
    o = out if out is not None else v.new_empty(v.shape)  # dense, whatever v's strides
    final = None
    if output_final_state:
        shape_s = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final = final_state_out if final_state_out is not None else q.new_empty(shape_s, dtype=torch.float32)

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log_k, dt_bias_k, initial_state))
    if needs_grad:
        res = FusedRecurrentKDAFunction.apply(q, k, v, g, beta, A_log_k, dt_bias_k, initial_state, cu_seqlens,
                                              opts, (o, final), workspace, segment_tokens)
        o, ht = (res, None) if final is None else res
    else:
        launch_recurrent_forward(q, k, v, g, beta, A_log=A_log_k, dt_bias=dt_bias_k, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, N=N, opts=opts, o=o, final_state=final)
        ht = final
    if not capturing:
        ws.mark_prepared(signature)
    return o, ht
