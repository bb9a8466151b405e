"""Backward of recurrent KDA in Triton: ``recurrent_kda_backward`` returns all eight gradients.

The kernels and the one-pass launcher are in ``recurrent_backward_kernels.py``, the segmented
driver in ``recurrent_backward_segmented.py``; this module (public function, dispatch between
the two) imports both and is imported by ``fused_recurrent.py`` (the autograd backward).

Notation per sequence and value head (``S_t`` the state after token t, ``S'_t = D_t S_{t-1}``,
``D_t = Diag(exp(a_t))``, ``u_t = beta_t (v_t - S'_t^T k_t)``, ``dS_t`` the total adjoint of
``S_t``, starting from ``dS_T = dht``)::

    dS_t    += scale q_t dO_t^T                   du_t = dS_t^T k_t            dv_t = beta_t du_t
    X_t      = dS_t u_t                            Y_t  = beta_t S'_t du_t
    dk_t     = X_t - Y_t                           dq_t = scale S_t dO_t
    dbeta_t  = du_t . (v_t - S'_t^T k_t)
    dS_{t-1} = D_t (dS_t - beta_t k_t du_t^T)      dh0  = dS_0

and the gate gradient ``da_t = rowsum(dS'_t * S'_t)`` through the identity (it follows
from ``rowsum(dS_{t-1} * S_{t-1}) = da_t + q_{t-1} * dq_{t-1}``)::

    da_t = rowsum(dht * S_T) + sum_{s >= t} (q_s * dq_s - k_s * (X_s + Y_s))

so no pass needs the state and its adjoint at the same token. Three passes over the
tokens, each a program per ``(V-block, sequence, value head)`` holding one fp32 tile of V-block
x K (grid ``(N * HV, cdiv(V, BV))``; the replays hold ``S^T`` [BV, BK] and step it with the
recurrence's own ``delta_rule_tile``, the reverse pass holds ``dS`` [BK, BV]):

1. replay (the recurrence kernel of ``recurrent_forward.py`` writing ``u_t``, ``OUT_U``): ``u_t``;
2. reverse: ``dS`` from ``dht`` back to ``dh0``; writes ``dv``, ``du_t`` (over ``u_t``), ``X_t``;
3. replay with the adjoint terms: ``dq_t``, ``dk_t``, ``Z_t = q*dq - k*(X+Y)``, ``dbeta_t``
   and ``rowsum(dht * S_T)``, each a partial sum over its V-block.

Then a token-parallel kernel sums the V-block partials and the value heads of a q/k
head and applies the l2norm backward (dq, dk); a kernel per ``(sequence, value head)``
reverse-cumsums ``Z`` into ``da`` in blocks of tokens and applies the gate and beta
backward (dg, dbeta, per-sequence partials of dA_log and dt_bias); a last kernel sums
those partials over sequences. Every sum has a fixed order: results are bitwise
reproducible and graph replays equal eager calls.

Memory: nothing is saved by the forward besides its inputs, and no state series is
stored (the replays start from the initial state). All scratch comes from the workspace.

One pass (every sequence has at most ``segment_tokens`` = L tokens): with ``TT = B*T`` and
``NV = cdiv(V, 32)``, ``4 * TT * HV * (V + NV * (3 K + 1)) + 4 * N * HV * (NV + 1) * (K + 1)``
bytes (about 6.6 KiB per token and value head at K = V = 128; 417 MiB at TT = 4096, HV = 16).

Segmented (a sequence longer than L): segment s holds tokens ``[s L, (s + 1) L)`` of every
sequence. The states at segment starts are recomputed by the forward kernel, segment by
segment, into ``S - 1`` checkpoints (``S = cdiv(max length, L)``); then the segments are
walked last to first, each gathered into a packed launch of the one-pass backward that
starts from its checkpoint and ends on the carried state gradient (its dh0 is the previous
segment's dht); the gradients are scattered back and dA_log / dt_bias summed over segments.
With ``M = max_s sum_n min(max(len_n - s L, 0), L) <= N L`` (B L for fixed length) and
``e`` the token dtype's size, the bytes are::

    4 M HV (V + NV (3 K + 1)) + 4 N HV (NV + 1) (K + 1)    one-pass scratch of a segment
  + e M (4 H K + HV (3 V + 2 K + 2))                       gathered inputs, do and gradients
  + 4 (S + 1) N HV K V                                     S - 1 checkpoints, 2 carried dS
  + 8 HV (K + 1)                                           gate-parameter partials

Only the checkpoints grow with T: 4 HV K V / L bytes per token of the longest sequence
(2 KiB at HV = 32, K = V = 128, L = 1024, a quarter of the bf16 q). Example, N = 1,
T = 32K, H = HV = 32, K = V = 128, bf16, L = 1024: 347 MiB instead of 6.5 GiB in one
pass. ``recurrent_backward_segmented.backward_scratch_bytes`` computes these figures. Each token is gathered twice
and its recurrence replayed three times (checkpoints, then passes 1 and 3).
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.ops.kda.options import KDAOptions, kda_options
from kdakit.ops.kda.recurrent.backward_kernels import (
    BWD_BLOCK_V,
    BWD_NUM_WARPS,
    GRAD_NAMES,
    REDUCE_BLOCK_T,
    REDUCE_NUM_WARPS,
    KDAGrads,
    grad_outputs,
    launch_recurrent_backward,
    scratch_shapes,
)
from kdakit.ops.kda.recurrent.segmented import launch_segmented_backward, segment_plan
from kdakit.ops.kda.recurrent.kernels import DEFAULT_SEGMENT_TOKENS, check_kernel_layout, check_segment_tokens
from kdakit.ops.kda.recurrent.workspace import (
    Workspace,
    call_signature,
    check_out,
    check_prepared_for_capture,
    resolve_workspace,
)

# Public here: the op, and the names this module defined before the kernels moved out (re-exported).
__all__ = [
    "run_recurrent_backward",
    "recurrent_kda_backward",
    "BWD_BLOCK_V",
    "BWD_NUM_WARPS",
    "GRAD_NAMES",
    "REDUCE_BLOCK_T",
    "REDUCE_NUM_WARPS",
    "KDAGrads",
    "grad_outputs",
    "launch_recurrent_backward",
    "scratch_shapes",
]

# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

def run_recurrent_backward(
    q, k, v, g, beta, do, dht, *, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions,
    segment_tokens: int, workspace: Workspace, out=None,
) -> KDAGrads:
    """One launch when every sequence fits in ``segment_tokens`` tokens, else the segmented driver."""
    plan = segment_plan(q.shape[0], q.shape[1], cu_seqlens, segment_tokens, workspace)
    tensors = dict(A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if plan is None:
        return launch_recurrent_backward(q, k, v, g, beta, do, dht, **tensors, opts=opts, workspace=workspace,
                                         out=out)
    return launch_segmented_backward(q, k, v, g, beta, do, dht, plan=plan, **tensors, opts=opts,
                                     workspace=workspace, out=out)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def recurrent_kda_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    out=None,
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
) -> KDAGrads:
    r"""All eight gradients of recurrent KDA (the forward of ``kdakit.fused_recurrent_kda``).

    Args:
        q, k, v, g, beta, A_log, dt_bias, initial_state, options: exactly as given to the
            forward (raw inputs; shapes and dtypes as ``fused_recurrent_kda``).
        do: ``[B, T, HV, V]`` gradient of ``o``; read through its strides (unit last stride) on the Triton
            path, as q, k, v, g and beta are (views of wider tensors cost no copy).
        dht: gradient of the final state (``[N, HV, K, V]``, or ``[N, HV, V, K]`` with
            ``state_v_first``), or None.
        workspace: ``kdakit.Workspace``; default: the stream-local one.
        out: optional sequence of 8 preallocated gradients in ``KDAGrads`` order, each
            contiguous with its input's shape and dtype, None for an absent input (or to
            allocate that one: a new contiguous tensor, whatever the input's strides).
        segment_tokens: when every sequence has at most this many tokens, one pass over
            the whole input (scratch grows with B*T); otherwise the sequences are split into
            segments of this many tokens, recomputed from state checkpoints, and the scratch
            scales with N * segment_tokens (see this module's docstring for the bytes).

    Returns ``KDAGrads(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)`` in the inputs'
    dtypes; ``dA_log``, ``ddt_bias`` and ``dh0`` are None when their input is None, and
    zeros when given but unused (gate not in the kernel). Gradients are w.r.t. the raw
    inputs (through l2norm, gate and sigmoid).

    Any T >= 1 (and zero-length varlen sequences), N, H, HV. Bitwise deterministic.
    CUDA graphs: see ``kdakit/ops/kda/recurrent/workspace.py`` (pass ``out`` with all gradients
    and one workspace; make one eager warm call first). The segmented path is capturable
    too: its gather buffers and checkpoints are workspace buffers sized by the warm call,
    and with ``cu_seqlens`` its segment plan is read on the host by the warm call and
    reused by the capture, so replays assume the warm call's ``cu_seqlens`` values.
    """
    check_segment_tokens(segment_tokens)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    backend = select_backend(device)
    # the options as given: the key of a call that an eager warm call prepared for a capture
    given = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
             state_v_first)
    ws, prepared, signature = None, False, None
    if backend == "triton":
        ws = resolve_workspace(workspace, device)
        signature = call_signature("recurrent_kda_backward", q, k, v, g, beta, do, dht, A_log, dt_bias,
                                   initial_state, cu_seqlens, scale, safe_gate, given,
                                   tuple(out) if isinstance(out, (list, tuple)) else out, segment_tokens)
        prepared = check_prepared_for_capture(ws, signature, "recurrent_kda_backward")
        if prepared and (out is None or any(
                o is None for o, x in zip(out, (q, k, v, g, beta, A_log, dt_bias, initial_state)) if x is not None)):
            raise RuntimeError("capturing recurrent_kda_backward in a CUDA graph needs out= with every gradient "
                               "so that the capture allocates nothing")
    # a prepared capture skips the checks (the warm call made them) and reads sizes off metadata only
    opts = kda_options(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, state_v_first=state_v_first, cu_seqlens=cu_seqlens, validate=not prepared,
    )
    if not prepared:
        _check_cotangents(do, dht, v, opts.shape, state_v_first)

    if backend == "torch":
        return _reference_backward(q, k, v, g, beta, do, dht, A_log, dt_bias, initial_state, cu_seqlens, opts, out)

    if not prepared:
        check_kernel_layout(opts.shape.K, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "do": do, "dht": dht,
                                "initial_state": initial_state, "A_log": A_log, "dt_bias": dt_bias,
                                "cu_seqlens": cu_seqlens})
    gate_args = (A_log, dt_bias) if use_gate_in_kernel else (None, None)
    grads = run_recurrent_backward(
        q, k, v, g, beta, do, dht, A_log=gate_args[0], dt_bias=gate_args[1], initial_state=initial_state,
        cu_seqlens=cu_seqlens, opts=opts, segment_tokens=segment_tokens, workspace=ws,
        out=_kernel_out(out, use_gate_in_kernel),
    )
    grads = _fill_unused_params(grads, A_log, dt_bias, out, use_gate_in_kernel)
    if not prepared:
        ws.mark_prepared(signature)
    return grads


def _check_cotangents(do, dht, v, shape, state_v_first) -> None:
    if not isinstance(do, torch.Tensor):
        raise TypeError(f"do must be a torch.Tensor, got {type(do).__name__}")
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do must have o's shape [B, T, HV, V] = {list(v.shape)}, got {list(do.shape)}")
    if not do.is_floating_point():
        raise TypeError(f"do must be a floating tensor, got {do.dtype}")
    if dht is not None:
        if not isinstance(dht, torch.Tensor):
            raise TypeError(f"dht must be a torch.Tensor or None, got {type(dht).__name__}")
        want = (shape.N, shape.HV, shape.V, shape.K) if state_v_first else (shape.N, shape.HV, shape.K, shape.V)
        if tuple(dht.shape) != want:
            raise ValueError(f"dht must have the final state's shape {list(want)}, got {list(dht.shape)}")


def _kernel_out(out, use_gate_in_kernel):
    """Without the in-kernel gate, the kernels do not produce dA_log / ddt_bias (they are zero)."""
    if out is None or use_gate_in_kernel:
        return out
    out = list(out)
    return (*out[:5], None, None, out[7]) if len(out) == 8 else out


def _fill_unused_params(grads: KDAGrads, A_log, dt_bias, out, use_gate_in_kernel) -> KDAGrads:
    if use_gate_in_kernel:
        return grads
    filled = {}
    for i, (name, x) in enumerate((("dA_log", A_log), ("ddt_bias", dt_bias)), start=5):
        if x is None:
            continue
        dst = out[i] if out is not None and out[i] is not None else None
        if dst is None:
            dst = torch.zeros_like(x)
        else:
            dst = check_out(f"out[{i}] ({name})", dst, x.shape, x.dtype, x.device)
            dst.zero_()
        filled[name] = dst
    return grads._replace(**filled)


def _reference_backward(q, k, v, g, beta, do, dht, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions,
                        out) -> KDAGrads:
    """Gradients through autograd of the naive recurrence (the PyTorch backend)."""
    leaves = [None if x is None else x.detach().requires_grad_() for x in
              (q, k, v, g, beta, A_log, dt_bias, initial_state)]
    gate = opts.use_gate_in_kernel
    with torch.enable_grad():
        o, ht = naive_recurrent_kda(
            *leaves[:5], initial_state=leaves[7], output_final_state=dht is not None,
            A_log=leaves[5] if gate else None, dt_bias=leaves[6] if gate else None, cu_seqlens=cu_seqlens,
            **opts.reference_kwargs(),
        )
        outs, cots = [o], [do]
        if dht is not None:
            outs.append(ht)
            cots.append(dht.to(ht.dtype))
        present = [x for x in leaves if x is not None]
        got = iter(torch.autograd.grad(outs, present, cots, allow_unused=True))
    res = []
    for i, x in enumerate(leaves):
        if x is None:
            res.append(None)
            continue
        gr = next(got)
        # contiguous, as the Triton path's: the gradient of a strided view is a fresh dense tensor of its shape
        gr = x.new_zeros(x.shape) if gr is None else gr.to(x.dtype).contiguous()
        if out is not None and out[i] is not None:
            check_out(f"out[{i}] ({GRAD_NAMES[i]})", out[i], x.shape, x.dtype, x.device).copy_(gr)
            gr = out[i]
        res.append(gr.detach())
    return KDAGrads(*res)
