"""Serving: recurrent KDA over a state pool, updated in place (``kda_decode``), and the kernel
behind ``fused_recurrent_kda``'s FLA serving arguments (``fused_recurrent_kda_serving``).

The pool and its indices (the layout ``chunk_kda(..., state_indices=...)`` shares for prefill):

* ``state_pool``: ``[P, HV, V, K]``, value-first (row ``p`` holds one sequence's state,
  ``S^T`` per value head, K contiguous), fp32 or bf16. ``P`` is the engine's number of cache
  slots. Rows are read through the row stride, so a pool with padded rows (row stride above
  ``HV * V * K``, 16-byte aligned, e.g. a slice of a wider cache) works without a copy;
  each row itself must be dense.
* ``state_indices``: int32 (int64 accepted) with one entry per sequence, ``[N]``: sequence
  ``n`` reads row ``state_indices[n]``, runs its tokens and writes the final state back to
  that row. ``-1`` marks a padded sequence: its pool rows are left untouched (bitwise) and
  its outputs are zero.
* Speculative decoding: ``state_indices`` ``[N, S]`` holds one row per token: the state
  after token ``j`` of sequence ``n`` is written to row ``state_indices[n, j]`` (skipped when
  ``-1``), and the initial state is read from column ``num_accepted_tokens[n] - 1`` (column 0
  without ``num_accepted_tokens``). The sequence is padded when that column holds ``-1``.
  This is the row scheme of FLA's ``ssm_state_indices`` / ``num_accepted_tokens``.

Each step may carry several tokens per sequence: q ``[N, T, H, K]`` (T tokens each) or, with
``cu_seqlens``, ``[1, total, H, K]`` packed. Rows used by different sequences must be
distinct (``check_indices`` checks it); a sequence's own read and write rows may coincide.

Numerics: the update is the recurrence of docs/spec.md §2.1 in fp32. A bf16 pool is read once per
call (bf16 -> fp32), each token's updated state is rounded to bf16 once (fp32 math,
round-to-nearest-even, as if stored), the output ``o_t`` is computed from that rounded
state, and the state is written back once per call (per token with per-token rows). So
an S-token step gives the same bits as S one-token steps. An fp32 pool is never rounded.
(The FLA-compatible serving path does not round the running state, as FLA does not: only
the stored copies are rounded.)

Kernel: ``recurrent_forward._recurrent_kernel``, the recurrence of every recurrent path, on the grid
``(N * HV, cdiv(V, BV))``; each program moves a ``[BV, K]`` tile of one state (read once, written once
per step), so a step moves ``2 * N * HV * V * K`` state elements. Both entry points here launch it;
constexpr flags choose the state layout (value-first or ``[K, V]``), where states are written
(``WRITE_*``) and the bf16 rounding. A
one-token step updated in place with ``[N]`` indices (plain decode) runs instead on the mask-free
1-D-grid kernel of ``decode_step.py``, the same math and bits (its docstring says why).
"""

from __future__ import annotations

import torch
import triton

from kdakit.ops.kda.backend import select_backend, triton_interpreting
from kdakit.ops.kda.compiled import kda_decode_via_op
from kdakit.ops.kda.serving.step import launch_pool_step, step_kernel_applies
from kdakit.ops.kda.options import KDAOptions, kda_options
from kdakit.ops.kda.recurrent.kernels import (
    OUT_O,
    WRITE_FINAL_TO_READ_ROW,
    WRITE_NONE,
    WRITE_PER_TOKEN_PACKED,
    WRITE_PER_TOKEN_ROWS,
    _recurrent_kernel,
    check_kernel_layout,
    token_strides,
)
from kdakit.ops.kda.reference.preprocess import compute_dtype, kda_beta, kda_gate, l2norm
from kdakit.ops.kda.validate import STATE_DTYPES, check_index_tensor, check_pool_rows, check_triton_dtypes
from kdakit.ops.kda.recurrent.workspace import (
    Workspace,
    call_signature,
    check_capturable_offsets,
    check_out,
    forward_workspace,
    is_capturing,
)

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

# Launch configs of the pool kernel (``decode_launch_config``), from a sweep of block_v 8-64 x 1-8 warps (one
# token, CUDA-graph replays; docs/perf_notes.md, "Launch configs"): a [16, K] tile per one-warp program for small
# grids; [64, K] tiles on two warps once the grid has WIDE_DECODE_MIN_PROGRAMS programs, for one-token steps only
# (longer steps were not swept). One-token in-place steps with [N] indices run on serving/step.py's kernel (its
# own launch config): a loop-free path inside this kernel was slower than as a kernel of its own.
DECODE_BLOCK_V = 16
DECODE_NUM_WARPS = 1
WIDE_DECODE_BLOCK_V = 64
WIDE_DECODE_NUM_WARPS = 2
WIDE_DECODE_MIN_PROGRAMS = 16384


def decode_launch_config(N: int, tokens: float, HV: int, V: int) -> tuple[int, int]:
    """``(block_v, num_warps)`` of the pool kernel for N sequences of ``tokens`` tokens each on average
    (packed: the total over N), HV value heads of V. A performance choice: the warp count changes the
    order of the key reductions, so outputs differ between configs in their last bits (the sweep gated
    every config against the reference within the same limits)."""
    if tokens == 1 and N * HV * triton.cdiv(V, WIDE_DECODE_BLOCK_V) >= WIDE_DECODE_MIN_PROGRAMS:
        return WIDE_DECODE_BLOCK_V, WIDE_DECODE_NUM_WARPS
    return DECODE_BLOCK_V, DECODE_NUM_WARPS


POOL_DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Launcher and PyTorch reference
# ---------------------------------------------------------------------------------------------

def launch_pool_recurrent(q, k, v, g, beta, o, opts: KDAOptions, *, h0, ht, state_indices, num_accepted_tokens,
                          write, round_state, A_log, dt_bias, cu_seqlens, N,
                          block_v: int | None = None, num_warps: int | None = None) -> None:
    """Launch the pool kernel: states read from row(s) of ``h0`` and written to ``ht`` as ``write`` says.
    ``block_v`` / ``num_warps`` (None: ``decode_launch_config``'s) are for benchmarks' sweeps.

    ``h0``/``ht`` rows are read through their row stride (padded rows need no copy); within a
    row the layout is dense ``[HV, V, K]`` (``opts.state_v_first``) or ``[HV, K, V]``. ``A_log`` /
    ``dt_bias`` are the flat views of the in-kernel gate's parameters (None without it).
    """
    if N == 0:
        return  # no sequence: nothing to run (a zero-sized grid is not a launch)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if step_kernel_applies(T=T, cu_seqlens=cu_seqlens, state_indices=state_indices, h0=h0, ht=ht,
                           write_final_to_read_row=write == WRITE_FINAL_TO_READ_ROW,
                           state_v_first=opts.state_v_first, K=K, V=V, block_v=block_v):
        launch_pool_step(q, k, v, g, beta, o, opts, pool=h0, state_indices=state_indices, round_state=round_state,
                         A_log=A_log, dt_bias=dt_bias, N=N, block_v=block_v, num_warps=num_warps)
        return
    rule_v, rule_warps = decode_launch_config(N, T if cu_seqlens is None else T / N, HV, V)
    block_v = rule_v if block_v is None else block_v
    num_warps = rule_warps if num_warps is None else num_warps
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), block_v)
    idx, acc = state_indices, num_accepted_tokens
    if idx is None:
        idx_strides, idx_cols = (0, 0), 1
    elif idx.dim() == 1:
        idx_strides, idx_cols = (idx.stride(0), 0), 1
    else:
        idx_strides, idx_cols = tuple(idx.stride()), idx.shape[1]
    round_store = ht is not None and ht.dtype == torch.bfloat16 and not round_state
    dummy = q  # pointer for absent optional tensors; never dereferenced (constexpr flags)
    _recurrent_kernel[(N * HV, triton.cdiv(V, BV))](
        q, k, v, g, beta,
        A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        idx if idx is not None else dummy, acc if acc is not None else dummy, o,
        cu_seqlens if cu_seqlens is not None else dummy,
        opts.scale, opts.kernel_lower_bound, T,
        h0.shape[0] if h0 is not None else 0, ht.shape[0] if ht is not None else 0,
        h0.stride(0) if h0 is not None else 0, ht.stride(0) if ht is not None else 0,
        idx_strides[0], idx_strides[1], acc.stride(0) if acc is not None else 0,
        *token_strides(q), *token_strides(k), *token_strides(v), *token_strides(g), *token_strides(beta),
        *token_strides(o),
        H=H, HV=HV, K=K, V=V, IDX_COLS=idx_cols, BK=BK, BV=BV,
        HAS_INDICES=idx is not None, USE_H0=h0 is not None, WRITE=write, OUT=OUT_O, HAS_ACCEPTED=acc is not None,
        ROUND_STATE=round_state, ROUND_STORE=round_store, IS_VARLEN=cu_seqlens is not None,
        NATIVE_ROUND=not triton_interpreting(), **opts.recurrent_constexprs(), num_warps=num_warps,
    )


@torch.no_grad()
def pool_recurrent_reference(q, k, v, g, beta, o, opts: KDAOptions, *, h0, ht, state_indices, num_accepted_tokens,
                             write, round_state, A_log, dt_bias, cu_seqlens, N) -> None:
    """``launch_pool_recurrent`` in PyTorch (fp32 math, float64 for float64 inputs), the same semantics."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v, g, beta)
    # dense copies of strided views, as naive_recurrent_kda: a view gives its contiguous copy's bits
    q, k, v, g, beta = (x.contiguous().to(dt) for x in (q, k, v, g, beta))
    if opts.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    a = kda_gate(g, A_log, dt_bias, opts.lower_bound) if opts.use_gate_in_kernel else g
    b = kda_beta(beta, opts.use_beta_sigmoid_in_kernel, opts.allow_neg_eigval)
    scale, state_v_first = opts.scale, opts.state_v_first
    q = q.repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K)
    k = k.repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K)
    v, a, b = v.reshape(B * T, HV, V), a.reshape(B * T, HV, K), b.reshape(B * T, HV)
    # o may be a strided view (the kernels write it through its strides): rows of a dense copy, then copied in
    o_flat = o.view(B * T, HV, V) if o.is_contiguous() else o.new_empty(B * T, HV, V)
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [n * T for n in range(B + 1)]
    idx = state_indices.tolist() if state_indices is not None else None
    if idx is not None and state_indices.dim() == 1:
        idx = [[i] for i in idx]
    acc = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    P_read = h0.shape[0] if h0 is not None else 0
    P_write = ht.shape[0] if ht is not None else 0

    # the computation holds S^T [HV, V, K]; rows of a [HV, K, V] pool are transposed on the way in and out
    def load(row):
        s = row.to(dt)
        return s if state_v_first else s.transpose(-1, -2)

    def store(dst, S):
        if round_state:
            S = S.to(torch.bfloat16).to(dt)  # kda_decode's bf16 pool: already rounded, stored exactly
        dst.copy_(S if state_v_first else S.transpose(-1, -2))

    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        slot = n
        if h0 is not None:
            if idx is not None:
                col = min(max(acc[n] - 1, 0), len(idx[n]) - 1) if acc is not None else 0
                slot = idx[n][col]
            if not 0 <= slot < P_read:
                o_flat[bos:eos] = 0
                continue
            S = load(h0[slot])                                                            # [HV, V, K]
        else:
            S = q.new_zeros(HV, V, K)
        for j, t in enumerate(range(bos, eos)):
            S = S * torch.exp(a[t])[:, None, :]
            u = b[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
            S = S + u[:, :, None] * k[t][:, None, :]
            if round_state:
                S = S.to(torch.bfloat16).to(dt)
            o_flat[t] = (scale * torch.einsum("hvk,hk->hv", S, q[t])).to(o.dtype)
            if write == WRITE_PER_TOKEN_ROWS:
                w = idx[n][j] if j < len(idx[n]) else -1
                if 0 <= w < P_write:
                    store(ht[w], S)
            elif write == WRITE_PER_TOKEN_PACKED and t < P_write:
                store(ht[t], S)
        if write == WRITE_FINAL_TO_READ_ROW:
            store(ht[slot], S)
    if not o.is_contiguous():
        o.copy_(o_flat.view(B, T, HV, V))


def launch_kda_decode(q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, o, opts: KDAOptions,
                      **kw) -> None:
    """kda_decode's step on the Triton kernel (``kw``: launch_pool_recurrent's arguments but the pool's)."""
    launch_pool_recurrent(q, k, v, g, beta, o, opts, **_decode_pool_args(state_pool, state_indices, num_accepted_tokens),
                          **kw)


def kda_decode_reference(q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, o, opts: KDAOptions,
                         **kw) -> None:
    """kda_decode's step in PyTorch (fp32 math, float64 for float64 inputs), the same semantics as the kernel."""
    pool_recurrent_reference(q, k, v, g, beta, o, opts,
                             **_decode_pool_args(state_pool, state_indices, num_accepted_tokens), **kw)


def _decode_pool_args(state_pool, state_indices, num_accepted_tokens) -> dict:
    """kda_decode's scheme: a value-first pool (``opts.state_v_first``) updated in place, bf16 state rounded
    per token."""
    per_token = state_indices.dim() == 2
    return dict(h0=state_pool, ht=state_pool, state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                write=WRITE_PER_TOKEN_ROWS if per_token else WRITE_FINAL_TO_READ_ROW,
                round_state=state_pool.dtype == torch.bfloat16)


def decode_options(q, k, v, g, beta, *, A_log=None, dt_bias=None, scale=None, use_qk_l2norm_in_kernel=False,
                   use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                   lower_bound=None, safe_gate=False, cu_seqlens=None, cu_seqlens_cpu=None,
                   validate: bool = True) -> KDAOptions:
    """``kda_options`` for a decode step: a value-first pool, FLA's engine shapes of A_log / dt_bias."""
    return kda_options(
        q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, state_v_first=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        engine_gate_shapes=True, validate=validate)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_indices: bool = True,
    workspace: Workspace | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""One KDA decode step over a state pool; the pool is updated in place (see the module docstring).

    Args:
        q, k: ``[N, T, H, K]`` (T tokens per sequence, T >= 1) or ``[1, total, H, K]`` with
            ``cu_seqlens``; v ``[.., HV, V]``; g ``[.., HV, K]``; beta ``[.., HV]``; token
            tensors in fp16/bf16/fp32 (fp64 on the PyTorch path). They may be views of wider tensors
            (a fused projection's ``split``...): the kernels read them through their strides, with a
            unit stride in the last dimension (beta: any strides), and give the contiguous call's bits.
        state_pool: ``[P, HV, V, K]`` fp32 or bf16, value-first, rows dense (the row stride may
            be padded, 16-byte aligned); updated in place.
        state_indices: int32 ``[N]`` (one row per sequence) or ``[N, S]`` (one row per token,
            S >= tokens per sequence); ``-1`` = padded/skip.
        A_log, dt_bias, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, safe_gate: as ``chunk_kda``;
            A_log may also be ``[HV, 1]`` or ``[1, 1, HV, 1]`` and dt_bias ``[HV, K]`` (dense; read
            through a flat view).
        cu_seqlens: int ``[N + 1]`` offsets when sequences carry different token counts.
        cu_seqlens_cpu: the same offsets in a CPU tensor (as ``chunk_kda``): validation reads
            this host copy and never ``cu_seqlens``, so with ``check_indices=False`` (or during
            capture) the call makes no device->host synchronization.
        num_accepted_tokens: int32 ``[N]`` with ``[N, S]`` indices: read column
            ``num_accepted_tokens[n] - 1``.
        out: preallocated output ``[B, T, HV, V]`` in v's dtype: contiguous, or a view of a wider tensor
            with a unit last stride (written through its strides).
        check_indices: check index values on the host (a device sync): range ``[-1, P)``,
            rows disjoint across sequences, ``num_accepted_tokens`` in ``[1, S]``. Skipped
            during CUDA-graph capture (the warm-up iterations check); pass False in a serving
            loop that guarantees them. Unchecked out-of-range rows are treated as padded.
        workspace: ``kdakit.Workspace`` recording prepared calls for CUDA graphs (default:
            the stream-local one). Not needed to capture: the step uses no scratch, so it
            captures in a plain ``torch.cuda.graph`` like any PyTorch op (``out`` optional,
            see ``kdakit/ops/kda/recurrent/workspace.py``).

    Returns:
        o ``[B, T, HV, V]`` in v's dtype (zeros for padded sequences).
    """
    if torch.compiler.is_compiling():
        # torch.compile traces the registered op torch.ops.kdakit.kda_decode, not this Python (compiled.py)
        return kda_decode_via_op(
            q, k, v, g, beta, state_pool, state_indices, A_log=A_log, dt_bias=dt_bias, scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            lower_bound=lower_bound, safe_gate=safe_gate, cu_seqlens=cu_seqlens,
            num_accepted_tokens=num_accepted_tokens, out=out, check_indices=check_indices, workspace=workspace,
            cu_seqlens_cpu=cu_seqlens_cpu)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    backend = select_backend(device)
    given = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 lower_bound=lower_bound, safe_gate=safe_gate)
    ws, prepared, signature = None, False, None
    capturing = is_capturing(device)
    if backend == "triton":
        ws = forward_workspace(workspace, device)
        signature = call_signature("kda_decode", q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias,
                                   cu_seqlens, num_accepted_tokens, out, check_indices, tuple(sorted(given.items())))
        # a call an eager warm-up prepared on this stream skips validation; any other capture validates
        # from metadata and host copies only
        prepared = capturing and ws is not None and ws.is_prepared(signature)
    if capturing and not prepared:
        check_capturable_offsets("kda_decode", cu_seqlens, cu_seqlens_cpu)
    opts = decode_options(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                          cu_seqlens_cpu=cu_seqlens_cpu, validate=not prepared, **given)
    if not prepared:
        _check_pool(state_pool, state_indices, num_accepted_tokens, opts.shape, cu_seqlens, device)
        if check_indices and not capturing:
            _check_index_values(state_pool.shape[0], state_indices, num_accepted_tokens, opts.shape)
        if out is not None:
            check_out("out", out, v.shape, v.dtype, device, token_view=True)
    A_log, dt_bias = opts.kernel_gate_params(A_log, dt_bias)
    o = out if out is not None else v.new_empty(v.shape)  # dense, whatever v's strides
    args = (q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, o, opts)
    kw = dict(A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, N=opts.shape.N)
    if backend == "torch":
        # a host loop: it reads the indices, and the offsets from their host copy when there is one
        kda_decode_reference(*args, **dict(kw, cu_seqlens=cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu))
        return o
    if not prepared:
        # the pool and the index tensors are read through their strides
        check_kernel_layout(opts.shape.K, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log,
                                           "dt_bias": dt_bias, "cu_seqlens": cu_seqlens})
    launch_kda_decode(*args, **kw)
    if not capturing:
        ws.mark_prepared(signature)
    return o


# ---------------------------------------------------------------------------------------------
# fused_recurrent_kda's serving arguments (FLA 0.6.0's fused_recurrent_kda_fwd semantics)
# ---------------------------------------------------------------------------------------------

def fused_recurrent_kda_serving(q, k, v, g, beta, *, A_log, dt_bias, initial_state, output_final_state, scale,
                                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                allow_neg_eigval, lower_bound, safe_gate, state_v_first, cu_seqlens, out,
                                final_state_out, workspace, ssm_state_indices, num_accepted_tokens,
                                inplace_final_state, check_indices, cu_seqlens_cpu=None):
    """``fused_recurrent_kda`` with ``ssm_state_indices`` / ``num_accepted_tokens`` / ``inplace_final_state``
    (its arguments as ``fused_recurrent_kda`` received them; the call's ``KDAOptions`` is built here, once).

    Semantics (FLA 0.6.0's ``fused_recurrent_kda_fwd``):

    * ``initial_state`` is a pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with state_v_first) when
      ``ssm_state_indices`` is given: ``[N]`` (column 0 only) or ``[N, S]``. Sequence ``n``
      starts from row ``ssm_state_indices[n, c]``, ``c = num_accepted_tokens[n] - 1`` (0
      without it); without initial_state it starts from zeros.
    * ``inplace_final_state=True``: the state after token ``t`` of sequence ``n`` is written to
      row ``ssm_state_indices[n, t]`` of initial_state (so a sequence carries at most S
      tokens); without indices, the final state of sequence ``n`` overwrites row ``n``.
      Returns ``(o, initial_state)``.
    * ``inplace_final_state=False`` with indices and ``output_final_state``: FLA writes the
      state after packed token ``t`` to row ``t`` of a new ``[N, ...]`` fp32 tensor, which is
      defined only when the batch holds exactly N tokens (one per sequence in plain decode);
      other token counts raise. Without ``output_final_state`` no state is written.
    * A sequence with no tokens reads and writes nothing. Index entries that are never read
      (columns past a sequence's tokens, sequences with no tokens, the read column without
      initial_state) may hold anything, e.g. FLA's ``PAD_SLOT_ID = -1``; an entry that is read
      must lie in ``[0, P)`` (FLA would address memory outside the pool), checked on the host
      with ``check_indices``.
    * Forward only, as FLA's: inputs that require grad raise.
    """
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    backend = select_backend(device)
    for name, flag in (("inplace_final_state", inplace_final_state), ("check_indices", check_indices),
                       ("output_final_state", output_final_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if num_accepted_tokens is not None and ssm_state_indices is None:
        # FLA 0.6.0 ignores num_accepted_tokens without indices; a count nobody reads is a caller bug
        raise ValueError("num_accepted_tokens picks the column of ssm_state_indices to read the initial state "
                         "from and needs ssm_state_indices, got ssm_state_indices=None")
    given = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 lower_bound=lower_bound, safe_gate=safe_gate, state_v_first=state_v_first)
    ws, prepared, signature = None, False, None
    capturing = is_capturing(device)
    if backend == "triton":
        ws = forward_workspace(workspace, device)
        signature = call_signature("fused_recurrent_kda_serving", q, k, v, g, beta, A_log, dt_bias, initial_state,
                                   cu_seqlens, out, final_state_out, ssm_state_indices, num_accepted_tokens,
                                   inplace_final_state, output_final_state, check_indices, tuple(sorted(given.items())))
        # as kda_decode: a prepared call skips validation, any other capture validates from host data only
        prepared = capturing and ws is not None and ws.is_prepared(signature)
    if capturing and not prepared:
        check_capturable_offsets("fused_recurrent_kda", cu_seqlens, cu_seqlens_cpu)
    # with indices, initial_state is a pool of rows (checked by _check_serving_args), not [N, ...] states
    opts = kda_options(q, k, v, g, beta, initial_state=initial_state if ssm_state_indices is None else None,
                       output_final_state=output_final_state,
                       A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                       engine_gate_shapes=True, validate=not prepared, **given)
    shape = opts.shape
    N, K = shape.N, shape.K
    if not prepared:
        _check_serving_args(q, k, v, g, beta, A_log, dt_bias, shape, initial_state, ssm_state_indices,
                            num_accepted_tokens, inplace_final_state, output_final_state, out, final_state_out,
                            state_v_first, device)
        if check_indices and ssm_state_indices is not None and not capturing:
            lengths = shape.seqlens if shape.seqlens is not None else (shape.T,) * N
            _check_serving_index_values(initial_state.shape[0] if initial_state is not None else 0,
                                        ssm_state_indices, num_accepted_tokens, lengths,
                                        reads=initial_state is not None, writes=inplace_final_state)
    HV, V = v.shape[2], v.shape[3]
    A_log, dt_bias = opts.kernel_gate_params(A_log, dt_bias)
    o = out if out is not None else v.new_empty(v.shape)  # dense, whatever v's strides
    if inplace_final_state:
        final = ht = initial_state
        write = WRITE_PER_TOKEN_ROWS if ssm_state_indices is not None else WRITE_FINAL_TO_READ_ROW
    elif output_final_state:
        # fp32 as FLA; the PyTorch path keeps float64 for float64 inputs, as fused_recurrent_kda does
        dtype = torch.float32 if backend == "triton" else compute_dtype(q, k, v, g, beta)
        shape_s = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final = ht = final_state_out if final_state_out is not None else q.new_empty(shape_s, dtype=dtype)
        write = WRITE_PER_TOKEN_PACKED
    else:
        final = ht = None
        write = WRITE_NONE
    kw = dict(h0=initial_state, ht=ht, state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
              write=write, round_state=False, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, N=N)
    if backend == "torch":
        # a host loop, as kda_decode's: the offsets from their host copy when there is one
        pool_recurrent_reference(q, k, v, g, beta, o, opts,
                                 **dict(kw, cu_seqlens=cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu))
        return o, final
    if not prepared:
        # the pool (initial_state) is read through its row stride: its dtype alone is checked here
        check_triton_dtypes({"initial_state": initial_state})
        check_kernel_layout(K, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                                "cu_seqlens": cu_seqlens})
    launch_pool_recurrent(q, k, v, g, beta, o, opts, **kw)
    if not capturing:
        ws.mark_prepared(signature)
    return o, final


def _check_serving_args(q, k, v, g, beta, A_log, dt_bias, shape, initial_state, idx, acc, inplace,
                        output_final_state, out, final_state_out, state_v_first, device) -> None:
    """Metadata and token-count checks of the serving arguments (no device read)."""
    N, HV, K, V = shape.N, shape.HV, shape.K, shape.V
    if inplace and initial_state is None:
        raise ValueError("inplace_final_state=True writes the final states into initial_state, "
                         "got initial_state=None")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)):
        raise ValueError("ssm_state_indices, num_accepted_tokens and inplace_final_state are forward-only "
                         "(serving), as in FLA: call under torch.no_grad() or pass tensors that do not require "
                         "grad, got an input with requires_grad=True")
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    layout = "[P, HV, V, K] (state_v_first=True)" if state_v_first else "[P, HV, K, V]"
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        if initial_state.dtype not in STATE_DTYPES:
            raise TypeError(f"initial_state must be float32, bfloat16 or float64, got {initial_state.dtype}")
        if initial_state.device != device:
            raise ValueError(f"initial_state must be on q's device {device}, got {initial_state.device}")
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != inner:
            raise ValueError(f"initial_state (the state pool) must have shape {layout} = [P, "
                             f"{', '.join(map(str, inner))}], got {list(initial_state.shape)}")
        check_state_rows("initial_state", initial_state)
    for name, t in (("ssm_state_indices", idx), ("num_accepted_tokens", acc)):
        if t is not None:
            check_index_tensor(name, t, device)
    if idx is not None and (idx.dim() not in (1, 2) or idx.shape[0] != N):
        raise ValueError(f"ssm_state_indices must be [N] or [N, S] with N={N} sequences, got {list(idx.shape)}")
    if acc is not None and tuple(acc.shape) != (N,):
        raise ValueError(f"num_accepted_tokens must have shape [N] = [{N}], got {list(acc.shape)}")
    lengths = shape.seqlens if shape.seqlens is not None else (shape.T,) * N
    if idx is not None and inplace:
        S = idx.shape[1] if idx.dim() == 2 else 1
        longest = max(lengths, default=0)
        if longest > S:
            raise ValueError(f"inplace_final_state=True writes the state after token t of sequence n to "
                             f"ssm_state_indices[n, t], so a sequence may carry at most S={S} tokens, got a "
                             f"sequence of {longest} tokens")
    if out is not None:
        check_out("out", out, v.shape, v.dtype, device, token_view=True)
    if final_state_out is not None:
        if inplace:
            raise ValueError("final_state_out is not used with inplace_final_state=True (the states go into "
                             "initial_state), got a final_state_out tensor")
        if not output_final_state:
            raise ValueError("final_state_out needs output_final_state=True, got output_final_state=False")
        check_out("final_state_out", final_state_out, (N, *inner), torch.float32, device)
    if idx is not None and not inplace and output_final_state and sum(lengths) != N:
        raise ValueError(f"with ssm_state_indices and inplace_final_state=False, FLA writes the state after packed "
                         f"token t to row t of an [N, ...] final_state, so the batch must hold exactly N={N} tokens "
                         f"(one per sequence in decode), got {sum(lengths)}; use inplace_final_state=True")


def _check_serving_index_values(P, idx_t, acc_t, lengths, *, reads: bool, writes: bool) -> None:
    """Host check of the index entries the kernel reads (one device->host copy of the indices).

    Entries never read may hold anything (FLA's PAD_SLOT_ID = -1 included); read entries must
    lie in [0, P); a row written by one sequence must be neither written nor read by another
    (the result would depend on the order the programs run in).
    """
    idx = idx_t.tolist()
    if idx_t.dim() == 1:
        idx = [[i] for i in idx]
    S = idx_t.shape[1] if idx_t.dim() == 2 else 1
    acc = acc_t.tolist() if acc_t is not None else None
    readers, writer = {}, {}
    for n, L in enumerate(lengths):
        if L == 0:
            continue  # FLA skips a sequence without tokens: none of its entries are read
        if reads:
            c = 0
            if acc is not None:
                if not 1 <= acc[n] <= S:
                    raise ValueError(f"num_accepted_tokens[{n}] must lie in [1, {S}] (a column of ssm_state_indices), "
                                     f"got {acc[n]}")
                c = acc[n] - 1
            r = idx[n][c]
            if not 0 <= r < P:
                raise ValueError(f"ssm_state_indices[{n}, {c}] (sequence {n}'s initial-state row) must lie in "
                                 f"[0, {P - 1}] for a pool of {P} rows, got {r}")
            readers.setdefault(r, set()).add(n)
        if writes:
            for j in range(L):
                r = idx[n][j]
                if not 0 <= r < P:
                    raise ValueError(f"ssm_state_indices[{n}, {j}] (the row that receives the state after token {j} "
                                     f"of sequence {n}) must lie in [0, {P - 1}] for a pool of {P} rows, got {r}")
                if writer.setdefault(r, n) != n:
                    raise ValueError(f"ssm_state_indices: row {r} is written by sequences {writer[r]} and {n}; "
                                     f"rows written by different sequences must be distinct")
    for r, ns in readers.items():
        others = sorted(n for n in ns if r in writer and n != writer[r])
        if others:
            raise ValueError(f"ssm_state_indices: row {r} is read by sequence {others[0]} and written by sequence "
                             f"{writer[r]}; a row one sequence writes cannot be another's initial state")


def _check_pool(pool, state_indices, num_accepted_tokens, shape, cu_seqlens, device) -> None:
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"state_pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype not in POOL_DTYPES:
        raise TypeError(f"state_pool must be float32 or bfloat16, got {pool.dtype}")
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (shape.HV, shape.V, shape.K):
        raise ValueError(f"state_pool must have shape [P, HV, V, K] = [P, {shape.HV}, {shape.V}, {shape.K}] "
                         f"(value-first), got {list(pool.shape)}")
    if pool.device != device:
        raise ValueError(f"state_pool must be on q's device {device}, got {pool.device}")
    check_state_rows("state_pool", pool)
    check_index_tensor("state_indices", state_indices, pool.device, "the pool's device")
    if num_accepted_tokens is not None:
        check_index_tensor("num_accepted_tokens", num_accepted_tokens, pool.device, "the pool's device")
    if state_indices.dim() not in (1, 2) or state_indices.shape[0] != shape.N:
        raise ValueError(f"state_indices must be [N] or [N, S] with N={shape.N} sequences, got {list(state_indices.shape)}")
    if state_indices.dim() == 2 and cu_seqlens is None and state_indices.shape[1] < shape.T:
        raise ValueError(f"state_indices [N, S] needs S >= tokens per sequence T={shape.T}, got S={state_indices.shape[1]}")
    if num_accepted_tokens is not None:
        if state_indices.dim() != 2:
            raise ValueError("num_accepted_tokens needs per-token state_indices [N, S], got 1-D state_indices")
        if tuple(num_accepted_tokens.shape) != (shape.N,):
            raise ValueError(f"num_accepted_tokens must have shape [N] = [{shape.N}], got {list(num_accepted_tokens.shape)}")


def _check_index_values(P, state_indices, num_accepted_tokens, shape) -> None:
    """Host check of the index values: ``check_pool_rows``'s range and distinct rows (one device->host
    copy of the indices), then the columns of ``[N, S]`` indices (the sequence lengths come from
    validation's host copy, never from ``cu_seqlens``)."""
    host = check_pool_rows("state_indices", state_indices, P)
    if state_indices.dim() == 1:
        return  # one row per sequence (_check_pool refused num_accepted_tokens with 1-D indices)
    S = len(host[0]) if host else 0
    if shape.seqlens is not None:
        longest = max(shape.seqlens, default=0)
        if longest > S:
            raise ValueError(f"state_indices [N, S] needs S >= the longest sequence ({longest} tokens), got S={S}")
    if num_accepted_tokens is not None:
        for n, a in enumerate(num_accepted_tokens.tolist()):
            if not 1 <= a <= S:
                raise ValueError(f"num_accepted_tokens must lie in [1, {S}], got {a} for sequence {n}")


def check_state_rows(name: str, pool: torch.Tensor) -> None:
    """A pool's rows may be padded (row stride above the row size, e.g. a slice of a wider cache),
    but each row must be dense: the kernels address a row as ``base + slot * stride(0)``."""
    row = pool.shape[1] * pool.shape[2] * pool.shape[3]
    if pool.shape[0] and not pool[0].is_contiguous():
        raise ValueError(f"{name} rows must be dense [{', '.join(map(str, pool.shape[1:]))}] blocks (only the row "
                         f"stride may differ from a contiguous tensor's), got strides {tuple(pool.stride())}")
    if pool.shape[0] <= 1 or pool.stride(0) == row:
        return  # one row (its stride is never used) or contiguous rows
    if pool.stride(0) < row:
        raise ValueError(f"{name} rows must not overlap: row stride >= the row size {row} elements, "
                         f"got row stride {pool.stride(0)}")
    if (pool.stride(0) * pool.element_size()) % 16:
        raise ValueError(f"{name} padded rows need a 16-byte aligned row stride, got {pool.stride(0)} elements "
                         f"({pool.stride(0) * pool.element_size()} bytes)")
