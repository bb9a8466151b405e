"""Serving decode: one step of recurrent KDA over a state pool, updated in place (``kda_decode``).

The pool and its indices (the layout ``chunk_kda(..., state_indices=...)`` shares for prefill):

* ``state_pool``: ``[P, HV, V, K]``, value-first (row ``p`` holds one sequence's state,
  ``S^T`` per value head, K contiguous), fp32 or bf16, contiguous. ``P`` is the engine's
  number of cache slots.
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

Numerics: the update is the recurrence of SPEC §2 in fp32. A bf16 pool is read once per
call (bf16 -> fp32), each token's updated state is rounded to bf16 once (fp32 math,
round-to-nearest-even, as if stored), the output ``o_t`` is computed from that rounded
state, and the state is written back once per call (per token with per-token rows). So
an S-token step gives the same bits as S one-token steps. An fp32 pool is never rounded.

Kernel: grid ``(N * HV, cdiv(V, BV))``; each program moves a ``[BV, K]`` tile of one state
(read once, written once per step), so a step moves ``2 * N * HV * V * K`` state elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.chunk_common import gate_mode, round_to_bf16, seq_bounds
from kdakit.ops.kda.fused_recurrent import (
    beta_mode,
    beta_value,
    check_kernel_layout,
    load_token_raw,
    log_decay,
    qk_activation,
)
from kdakit.ops.kda.preprocess import compute_dtype, kda_beta, kda_gate, l2norm
from kdakit.ops.kda.validate import validate_kda_inputs
from kdakit.ops.kda.workspace import (
    Workspace,
    call_signature,
    check_out,
    check_prepared_for_capture,
    is_capturing,
    resolve_workspace,
)

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

# A [16, K] tile per one-warp program. Measured on the H200 (N=64/256, H=32, K=V=128, one token,
# CUDA-graph replay) against a 4.28 TB/s device copy: fp32 state 86% / 92%, bf16 state 69% / 78%;
# 4 warps gave 85% / 91% (fp32) but 53% / 57% (bf16), wider tiles no better.
DECODE_BLOCK_V = 16
DECODE_NUM_WARPS = 1
POOL_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T", "P"])
def _kda_decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, pool, state_indices, num_accepted, o, cu_seqlens,
    scale, lower_bound, T, P,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, IDX_COLS: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    PER_TOKEN_ROWS: tl.constexpr, HAS_ACCEPTED: tl.constexpr, ROUND_BF16: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    i_nh = tl.program_id(0)  # N * HV on axis 0: axes 1 and 2 hold at most 65535 programs
    i_v = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    # the first token's inputs are requested before the row index and the state that depends on it
    n_q, n_k, n_g, n_v, n_b = load_token_raw(q, k, g, v, beta, bos, eos, i_h, i_hv, offs_k, mask_k, offs_v, mask_v,
                                             H, HV, K, V)

    idx_row = state_indices + i_n.to(tl.int64) * IDX_COLS
    if HAS_ACCEPTED:
        # clamped so that an unchecked bad count cannot read outside this sequence's row
        read_col = tl.load(num_accepted + i_n).to(tl.int64) - 1
        read_col = tl.minimum(tl.maximum(read_col, 0), IDX_COLS - 1)
    else:
        read_col = 0
    slot = tl.load(idx_row + read_col).to(tl.int64)
    # -1 marks a padded sequence; out-of-range rows are treated the same so that an
    # unchecked bad index can never write outside the pool.
    valid = (slot >= 0) & (slot < P)

    mask_s = (mask_v[:, None] & mask_k[None, :]) & valid                                  # [BV, BK]
    offs_s = (i_hv * V + offs_v[:, None]) * K + offs_k[None, :]                           # [BV, BK]
    S = tl.load(pool + slot * (HV * V * K) + offs_s, mask=mask_s, other=0.0).to(tl.float32)

    t = bos
    while t < eos:
        b_q, b_k, b_g, b_v, b_beta = n_q, n_k, n_g, n_v, n_b
        n_q, n_k, n_g, n_v, n_b = load_token_raw(q, k, g, v, beta, t + 1, eos, i_h, i_hv, offs_k, mask_k,
                                                 offs_v, mask_v, H, HV, K, V)
        hv_row = t * HV + i_hv
        b_q = qk_activation(b_q, L2NORM)                                                  # [BK]
        b_k = qk_activation(b_k, L2NORM)                                                  # [BK]
        b_a = log_decay(b_g, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound, K, GATE, HAS_A, HAS_BIAS)
        b_beta = beta_value(b_beta, BETA)

        S = S * tl.exp(b_a)[None, :]                                                      # S' = D S
        b_u = b_beta * (b_v - tl.sum(S * b_k[None, :], axis=1))                           # [BV]
        S = S + b_u[:, None] * b_k[None, :]
        if ROUND_BF16:
            S = round_to_bf16(S)
        b_o = scale * tl.sum(S * b_q[None, :], axis=1)                                    # [BV]
        b_o = tl.where(valid, b_o, 0.0)
        tl.store(o + hv_row * V + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if PER_TOKEN_ROWS:
            w_slot = tl.load(idx_row + (t - bos)).to(tl.int64)
            w_ok = valid & (w_slot >= 0) & (w_slot < P)
            tl.store(pool + w_slot * (HV * V * K) + offs_s, S.to(pool.dtype.element_ty), mask=mask_s & w_ok)
        t += 1

    if not PER_TOKEN_ROWS:
        tl.store(pool + slot * (HV * V * K) + offs_s, S.to(pool.dtype.element_ty), mask=mask_s)


# ---------------------------------------------------------------------------------------------
# Launcher and PyTorch reference
# ---------------------------------------------------------------------------------------------

def launch_kda_decode(q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, o, *, A_log, dt_bias,
                      scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound, cu_seqlens, N, block_v: int = DECODE_BLOCK_V,
                      num_warps: int = DECODE_NUM_WARPS) -> None:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), block_v)
    per_token = state_indices.dim() == 2
    dummy = state_indices
    _kda_decode_kernel[(N * HV, triton.cdiv(V, BV))](
        q, k, v, g, beta,
        A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        state_pool, state_indices, num_accepted_tokens if num_accepted_tokens is not None else dummy, o,
        cu_seqlens if cu_seqlens is not None else dummy,
        float(scale), float(lower_bound) if lower_bound is not None else 0.0, T, state_pool.shape[0],
        H=H, HV=HV, K=K, V=V, IDX_COLS=state_indices.shape[1] if per_token else 1, BK=BK, BV=BV,
        PER_TOKEN_ROWS=per_token, HAS_ACCEPTED=num_accepted_tokens is not None,
        ROUND_BF16=state_pool.dtype == torch.bfloat16, IS_VARLEN=cu_seqlens is not None,
        L2NORM=use_qk_l2norm_in_kernel, GATE=gate_mode(use_gate_in_kernel, lower_bound),
        HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
        BETA=beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval), num_warps=num_warps,
    )


@torch.no_grad()
def kda_decode_reference(q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, o, *, A_log, dt_bias,
                         scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, lower_bound, cu_seqlens, N) -> None:
    """The decode step in PyTorch (fp32 math, float64 for float64 inputs), same semantics as the kernel."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    dt = compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    a = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g
    b = kda_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    q = q.repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K)
    k = k.repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K)
    v, a, b = v.reshape(B * T, HV, -1), a.reshape(B * T, HV, K), b.reshape(B * T, HV)
    o_flat = o.view(B * T, HV, -1)
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [n * T for n in range(B + 1)]
    idx = state_indices.tolist()
    acc = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    P = state_pool.shape[0]
    round_bf16 = state_pool.dtype == torch.bfloat16
    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        row = idx[n] if isinstance(idx[n], list) else [idx[n]]
        slot = row[acc[n] - 1] if acc is not None else row[0]
        if not 0 <= slot < P:
            o_flat[bos:eos] = 0
            continue
        S = state_pool[slot].to(dt)                                                       # [HV, V, K]
        for j, t in enumerate(range(bos, eos)):
            S = S * torch.exp(a[t])[:, None, :]
            u = b[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
            S = S + u[:, :, None] * k[t][:, None, :]
            if round_bf16:
                S = S.to(torch.bfloat16).to(dt)
            o_flat[t] = (scale * torch.einsum("hvk,hk->hv", S, q[t])).to(o.dtype)
            if state_indices.dim() == 2 and 0 <= row[j] < P:
                state_pool[row[j]] = S.to(state_pool.dtype)
        if state_indices.dim() == 1:
            state_pool[slot] = S.to(state_pool.dtype)


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
) -> torch.Tensor:
    r"""One KDA decode step over a state pool; the pool is updated in place (see the module docstring).

    Args:
        q, k: ``[N, T, H, K]`` (T tokens per sequence, T >= 1) or ``[1, total, H, K]`` with
            ``cu_seqlens``; v ``[.., HV, V]``; g ``[.., HV, K]``; beta ``[.., HV]``; token
            tensors in fp16/bf16/fp32 (fp64 on the PyTorch path).
        state_pool: ``[P, HV, V, K]`` fp32 or bf16, contiguous, value-first; updated in place.
        state_indices: int32 ``[N]`` (one row per sequence) or ``[N, S]`` (one row per token,
            S >= tokens per sequence); ``-1`` = padded/skip.
        A_log, dt_bias, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, safe_gate: as ``chunk_kda``.
        cu_seqlens: int ``[N + 1]`` offsets when sequences carry different token counts.
        num_accepted_tokens: int32 ``[N]`` with ``[N, S]`` indices: read column
            ``num_accepted_tokens[n] - 1``.
        out: preallocated output ``[B, T, HV, V]`` in v's dtype.
        check_indices: check index values on the host (a device sync): range ``[-1, P)``,
            rows disjoint across sequences, ``num_accepted_tokens`` in ``[1, S]``. Skipped
            during CUDA-graph capture (the warm call checks); pass False in a serving loop
            that guarantees them. Unchecked out-of-range rows are treated as padded.
        workspace: ``kdakit.Workspace`` recording prepared calls for CUDA graphs (default:
            the stream-local one).

    Returns:
        o ``[B, T, HV, V]`` in v's dtype (zeros for padded sequences).
    """
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    backend = select_backend(device)
    opts = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound)
    ws, prepared, signature = None, False, None
    if backend == "triton":
        ws = resolve_workspace(workspace, device)
        signature = call_signature("kda_decode", q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias,
                                   cu_seqlens, num_accepted_tokens, out, scale, safe_gate, check_indices,
                                   tuple(sorted(opts.items())))
        prepared = check_prepared_for_capture(ws, signature, "kda_decode")
        if prepared and out is None:
            raise RuntimeError("capturing kda_decode in a CUDA graph needs out= so that the capture allocates nothing")
    if prepared:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        K = q.shape[3]
    else:
        shape = validate_kda_inputs(
            q, k, v, g, beta, scale=scale, initial_state=None, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias, state_v_first=True,
            cu_seqlens=cu_seqlens,
        )
        N, K = shape.N, shape.K
        _check_pool(state_pool, state_indices, num_accepted_tokens, shape, cu_seqlens)
        if check_indices and not is_capturing(device):
            _check_index_values(state_pool.shape[0], state_indices, num_accepted_tokens, cu_seqlens, shape)
        if out is not None:
            check_out("out", out, v.shape, v.dtype, device)
    scale = float(K ** -0.5 if scale is None else scale)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
        opts["lower_bound"] = None
    o = out if out is not None else torch.empty_like(v)
    args = (q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, o)
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, cu_seqlens=cu_seqlens, N=N, **opts)
    if backend == "torch":
        kda_decode_reference(*args, **kw)
        return o
    if not prepared:
        check_kernel_layout(K, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                                "cu_seqlens": cu_seqlens, "state_indices": state_indices,
                                "num_accepted_tokens": num_accepted_tokens})
    launch_kda_decode(*args, **kw)
    if not prepared:
        ws.mark_prepared(signature)
    return o


def _check_pool(pool, state_indices, num_accepted_tokens, shape, cu_seqlens) -> None:
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"state_pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype not in POOL_DTYPES:
        raise TypeError(f"state_pool must be float32 or bfloat16, got {pool.dtype}")
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (shape.HV, shape.V, shape.K):
        raise ValueError(f"state_pool must have shape [P, HV, V, K] = [P, {shape.HV}, {shape.V}, {shape.K}] "
                         f"(value-first), got {list(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError(f"state_pool must be contiguous (it is updated in place), got strides {tuple(pool.stride())}")
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(state_indices).__name__}")
    for name, t in (("state_indices", state_indices), ("num_accepted_tokens", num_accepted_tokens)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
        if t.device != pool.device:
            raise ValueError(f"{name} must be on the pool's device {pool.device}, got {t.device}")
    if state_indices.dim() not in (1, 2) or state_indices.shape[0] != shape.N:
        raise ValueError(f"state_indices must be [N] or [N, S] with N={shape.N} sequences, got {list(state_indices.shape)}")
    if state_indices.dim() == 2 and cu_seqlens is None and state_indices.shape[1] < shape.T:
        raise ValueError(f"state_indices [N, S] needs S >= tokens per sequence T={shape.T}, got S={state_indices.shape[1]}")
    if num_accepted_tokens is not None:
        if state_indices.dim() != 2:
            raise ValueError("num_accepted_tokens needs per-token state_indices [N, S], got 1-D state_indices")
        if tuple(num_accepted_tokens.shape) != (shape.N,):
            raise ValueError(f"num_accepted_tokens must have shape [N] = [{shape.N}], got {list(num_accepted_tokens.shape)}")


def _check_index_values(P, state_indices, num_accepted_tokens, cu_seqlens, shape) -> None:
    idx = state_indices.tolist()
    if state_indices.dim() == 1:
        idx = [[i] for i in idx]
    S = len(idx[0]) if idx else 0
    flat = [i for row in idx for i in row]
    if flat and (min(flat) < -1 or max(flat) >= P):
        raise ValueError(f"state_indices must lie in [-1, {P - 1}] for a pool of {P} rows, got {state_indices.tolist()}")
    if cu_seqlens is not None and state_indices.dim() == 2:
        cu = cu_seqlens.tolist()
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if longest > S:
            raise ValueError(f"state_indices [N, S] needs S >= the longest sequence ({longest} tokens), got S={S}")
    acc = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    owner = {}
    for n, row in enumerate(idx):
        if acc is not None and not 1 <= acc[n] <= S:
            raise ValueError(f"num_accepted_tokens must lie in [1, {S}], got {acc[n]} for sequence {n}")
        for r in set(row):
            if r >= 0 and owner.setdefault(r, n) != n:
                raise ValueError(f"state_indices rows must be distinct across sequences: row {r} is used by "
                                 f"sequences {owner[r]} and {n}")
