"""Recurrent (token-by-token) KDA forward in Triton: the kernel, its launcher and the per-token
Triton functions shared with the backward and the decode kernels.

Per sequence, value head and token (docs/spec.md §2.1; state ``S`` is ``[K, V]``, fp32)::

    S'  = Diag(exp(a_t)) S
    u_t = beta_t (v_t - S'^T k_t)
    S   = S' + k_t u_t^T
    o_t = scale * S^T q_t

with ``q_t, k_t`` l2-normalized, ``a_t`` the gate and ``beta_t`` the (sigmoid) beta when
the in-kernel options ask for it.

The kernel (``_recurrent_kernel``) is the one recurrence of every recurrent path: ``fused_recurrent_kda``'s
forward, the backward's replays (``u_t`` instead of ``o_t``, and the segment checkpoints) and the serving
entry points of ``decode.py`` (state pools read and written through row indices). Grid ``(N * HV,
cdiv(V, BV))``; each program keeps ``S^T[v-block, :]`` as a ``[BV, BK]`` fp32 tile in registers
(``BK = next_pow2(K)``, so K <= 256) and walks its sequence's tokens. V rows evolve independently, so
programs never communicate. Token tensors (FLA's ``q [B, T, H, K]``...) and the per-token output are read and
written through their (batch, token, head) strides (``token_strides``), so a view of a wider tensor costs no copy;
only their last dimension must have unit stride (``check_kernel_layout``). States in either ``[., HV, K, V]`` or
value-first ``[., HV, V, K]`` rows. Constexpr flags choose where states are read and written (``WRITE_*``),
which per-token row is written (``OUT_*``: ``o_t`` or ``u_t``) and the bf16 pool's rounding (``decode.py``'s
docstring has the serving semantics). The forward saves nothing for backward except the inputs: the backward
recomputes the recurrence from the initial state.

Layering (no module imports one that imports it back): this module imports no other recurrent
module; ``recurrent_backward_kernels``, ``recurrent_backward_segmented``, ``decode_step`` and ``decode`` build on
it, and ``recurrent_backward`` / ``fused_recurrent`` (the public ops, autograd) on all of them.
``options`` (a call's ``KDAOptions``) imports its beta modes, so the launcher here takes that object
without importing its class.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk_common import l2norm_rstd, round_to_bf16, round_to_bf16_if, seq_bounds, softplus_fp32
from kdakit.ops.kda.validate import check_token_strides, check_triton_dtypes

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

MAX_HEAD_DIM = 256          # BK = next_pow2(K) lives in registers with a [BV, BK] state tile
# State rows per program and warps of the forward: 16 value rows on 4 warps put more programs in flight than 32
# and were faster (docs/perf_notes.md, "Launch configs").
FWD_BLOCK_V = 16
FWD_NUM_WARPS = 4

# Beta modes (constexpr BETA); the gate modes (constexpr GATE) are chunk_common's. A call's mode is
# encoded once, into its KDAOptions (options.py).
BETA_RAW, BETA_SIGMOID, BETA_SIGMOID_X2 = 0, 1, 2


# The backward's segment length: sequences longer than this are recomputed segment by segment from
# state checkpoints, so its scratch scales with segment_tokens, not T (recurrent_backward.py).
DEFAULT_SEGMENT_TOKENS = 1024


def check_segment_tokens(segment_tokens) -> int:
    if isinstance(segment_tokens, bool) or not isinstance(segment_tokens, int):
        raise TypeError(f"segment_tokens must be an int, got {type(segment_tokens).__name__}")
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    return segment_tokens


def beta_mode(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> int:
    if not use_beta_sigmoid_in_kernel:
        return BETA_RAW
    return BETA_SIGMOID_X2 if allow_neg_eigval else BETA_SIGMOID


# ---------------------------------------------------------------------------------------------
# A program's place on the recurrent grid (shared with the backward and decode kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def program_sequence(cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """This program's sequence, value head, query/key head, value block and tokens ``[bos, eos)`` on the
    grid ``(N * HV, cdiv(V, BV))``. -> (i_n, i_hv, i_h, i_v, bos, eos)"""
    i_nh = tl.program_id(0)  # N * HV on axis 0: axes 1 and 2 hold at most 65535 programs
    i_v = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    return i_n, i_hv, i_h, i_v, bos, eos


@triton.jit
def key_value_offsets(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The key offsets [BK] and value block ``i_v``'s offsets [BV], with their masks."""
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    return offs_k, offs_v, offs_k < K, offs_v < V


@triton.jit
def state_tile(i_n, i_hv, offs_k, offs_v, mask_k, mask_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               STATE_V_FIRST: tl.constexpr):
    """The program's [BK, BV] tile of state (sequence, value head) in a dense ``[N, HV, K, V]`` (or, value-first,
    ``[N, HV, V, K]``) tensor. -> (mask [BK, BV], the state's base offset, the tile's offsets [BK, BV])"""
    mask_s = mask_k[:, None] & mask_v[None, :]                                            # [BK, BV]
    state_base = (i_n * HV + i_hv).to(tl.int64) * K * V
    if STATE_V_FIRST:
        offs_s = offs_v[None, :] * K + offs_k[:, None]                                    # [BK, BV]
    else:
        offs_s = offs_k[:, None] * V + offs_v[None, :]
    return mask_s, state_base, offs_s


# ---------------------------------------------------------------------------------------------
# Per-token activations (shared with the backward and decode kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def qk_activation(x, L2NORM: tl.constexpr):
    """``x / sqrt(sum x^2 + 1e-6)`` when asked (the chunk kernels' l2norm_rstd), else x."""
    if L2NORM:
        x = x * l2norm_rstd(tl.sum(x * x, axis=0))
    return x


@triton.jit
def load_qk_token(ptr, offs_k, mask_k, L2NORM: tl.constexpr):
    """One q or k row as fp32, l2-normalized when asked."""
    return qk_activation(tl.load(ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32), L2NORM)


@triton.jit
def sequence_row(x, i_n, bos, h, sb, st, sh, IS_VARLEN: tl.constexpr):
    """Pointer to row ``x[b, t0, h, :]`` of a token tensor read through its (batch, token, head) element strides
    ``sb, st, sh``: sequence i_n's first token (packed: b = 0, t0 = bos; fixed length: b = i_n, t0 = 0). Token
    ``bos + j`` of the sequence is ``j * st`` elements further. int64 offsets."""
    if IS_VARLEN:
        off = bos * st
    else:
        off = i_n.to(tl.int64) * sb
    return x + off + h.to(tl.int64) * sh


@triton.jit
def load_token_raw(p_q, p_k, p_g, p_v, p_b, j, live, s_qt, s_kt, s_gt, s_vt, s_bt, offs_k, mask_k, offs_v, mask_v):
    """Token j of the sequence (``sequence_row``'s rows ``p_*``, token strides ``s_*t``): its raw q, k, g rows
    [BK], v block [BV] and beta as fp32 (zeros unless ``live``).

    Issued one token ahead of its use, so that the loads overlap the previous token's math.
    """
    b_q = tl.load(p_q + j * s_qt + offs_k, mask=mask_k & live, other=0.0).to(tl.float32)
    b_k = tl.load(p_k + j * s_kt + offs_k, mask=mask_k & live, other=0.0).to(tl.float32)
    b_g = tl.load(p_g + j * s_gt + offs_k, mask=mask_k & live, other=0.0).to(tl.float32)
    b_v = tl.load(p_v + j * s_vt + offs_v, mask=mask_v & live, other=0.0).to(tl.float32)
    b_b = tl.load(p_b + j * s_bt + tl.zeros([1], dtype=tl.int64), mask=live, other=0.0).to(tl.float32)
    return b_q, b_k, b_g, b_v, tl.sum(b_b, axis=0)


@triton.jit
def gate_preactivation(g_raw, dt_bias, i_hv, offs_k, mask_k, K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``g + dt_bias[hv]`` (the gate's input), fp32."""
    x = g_raw
    if HAS_BIAS:
        x = x + tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    return x


@triton.jit
def log_decay(g_raw, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound,
              K: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The per-channel log-decay ``a_t`` from the raw gate row ``g_raw`` [BK] (docs/spec.md §2.3)."""
    if GATE == 0:
        a = g_raw
    else:
        x = gate_preactivation(g_raw, dt_bias, i_hv, offs_k, mask_k, K, HAS_BIAS)
        if GATE == 1:
            a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus_fp32(x)
        else:
            if HAS_A:
                x = tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * x
            a = lower_bound * tl.sigmoid(x)
    return a


@triton.jit
def beta_value(b_raw, BETA: tl.constexpr):
    """``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)``."""
    if BETA == 0:
        b = b_raw
    else:
        b = tl.sigmoid(b_raw)
        if BETA == 2:
            b = 2.0 * b
    return b


@triton.jit
def token_activations(b_q, b_k, b_g, b_beta, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound, K: tl.constexpr,
                      L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BETA: tl.constexpr):
    """A token's raw q, k [BK], gate row [BK] and beta as the recurrence uses them: q and k l2-normalized
    when asked, the log-decay a [BK] and beta. -> (q, k, a, beta)"""
    b_q = qk_activation(b_q, L2NORM)                                                      # [BK]
    b_k = qk_activation(b_k, L2NORM)                                                      # [BK]
    b_a = log_decay(b_g, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound, K, GATE, HAS_A, HAS_BIAS)
    return b_q, b_k, b_a, beta_value(b_beta, BETA)


# ---------------------------------------------------------------------------------------------
# One token on an S^T tile (shared with decode_step.py's kernel)
# ---------------------------------------------------------------------------------------------

@triton.jit
def delta_rule_tile(S, b_k, b_v, b_a, b_beta):
    """One token's delta rule on an S^T tile [BV, K] (fp32), the recurrence's own and the backward replay's.
    -> (S' = S D, S' + u k^T, r = v - S' k, u = beta r)"""
    S_dec = S * tl.exp(b_a)[None, :]                                                      # S' = S D
    b_r = b_v - tl.sum(S_dec * b_k[None, :], axis=1)                                      # [BV]
    b_u = b_beta * b_r
    return S_dec, S_dec + b_u[:, None] * b_k[None, :], b_r, b_u


@triton.jit
def state_tile_step(S, b_q, b_k, b_v, b_a, b_beta, scale, ROUND_STATE: tl.constexpr, NATIVE_ROUND: tl.constexpr):
    """One token's update of an S^T tile [BV, K] (fp32) and its output rows [BV]: the delta rule, the bf16
    pool's rounding when ROUND_STATE, then ``o = scale * S q``. -> (S, u, o)"""
    _, S, _, b_u = delta_rule_tile(S, b_k, b_v, b_a, b_beta)
    if ROUND_STATE:
        if NATIVE_ROUND:
            # the GPU's round-to-nearest-even cast (one instruction per two elements); the integer recipe, which
            # the interpreter needs, gives the same bits for finite values and is slower on the GPU
            S = S.to(tl.bfloat16).to(tl.float32)
        else:
            S = round_to_bf16(S)
    return S, b_u, scale * tl.sum(S * b_q[None, :], axis=1)                               # [BV]


@triton.jit
def state_row_tile(i_hv, offs_k, offs_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   STATE_V_FIRST: tl.constexpr):
    """Offsets [BV, BK] of value head ``i_hv``'s S^T tile within one state row: ``[HV, V, K]`` (value-first) or
    ``[HV, K, V]``."""
    if STATE_V_FIRST:
        offs_s = (i_hv * V + offs_v[:, None]) * K + offs_k[None, :]                       # [BV, BK]
    else:
        offs_s = (i_hv * K + offs_k[None, :]) * V + offs_v[:, None]
    return offs_s


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------

# Where a program writes states (constexpr WRITE):
WRITE_FINAL_TO_READ_ROW = 0  # the final state to the row it read (the forward's final state; kda_decode [N])
WRITE_PER_TOKEN_ROWS = 1     # the state after token j to row indices[n, j] (kda_decode [N, S]; FLA in place)
WRITE_PER_TOKEN_PACKED = 2   # the state after packed token t to row t of ht (FLA with indices, not in place)
WRITE_NONE = 3
# Which per-token row a program writes to ``out`` (constexpr OUT):
OUT_NONE = 0
OUT_O = 1  # o_t, in out's dtype (the forward, the serving paths)
OUT_U = 2  # u_t, fp32 (the backward's replay)


# beta's batch stride (T * HV when dense) is not specialized, as T is not: it would recompile as T changes, and beta's
# one-element loads gain nothing from its alignment; the other batch strides keep their divisibility hint (the
# rows' vector loads need it) and are multiples of 16 whenever the head size is.
@triton.jit(do_not_specialize=["T", "P_read", "P_write", "s_bb"])
def _recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, ht, state_indices, num_accepted, out, cu_seqlens,
    scale, lower_bound, T, P_read, P_write, h0_row_stride, ht_row_stride, idx_stride_n, idx_stride_s, acc_stride,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, IDX_COLS: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INDICES: tl.constexpr, USE_H0: tl.constexpr, WRITE: tl.constexpr, OUT: tl.constexpr,
    HAS_ACCEPTED: tl.constexpr, ROUND_STATE: tl.constexpr, ROUND_STORE: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
    BETA: tl.constexpr, NATIVE_ROUND: tl.constexpr,
):
    i_n, i_hv, i_h, i_v, bos, eos = program_sequence(cu_seqlens, T, H, HV, IS_VARLEN)
    offs_k, offs_v, mask_k, mask_v = key_value_offsets(i_v, K, V, BK, BV)
    # token tensors through their strides: each one's row of this sequence's first token
    p_q = sequence_row(q, i_n, bos, i_h, s_qb, s_qt, s_qh, IS_VARLEN)
    p_k = sequence_row(k, i_n, bos, i_h, s_kb, s_kt, s_kh, IS_VARLEN)
    p_v = sequence_row(v, i_n, bos, i_hv, s_vb, s_vt, s_vh, IS_VARLEN)
    p_g = sequence_row(g, i_n, bos, i_hv, s_gb, s_gt, s_gh, IS_VARLEN)
    p_b = sequence_row(beta, i_n, bos, i_hv, s_bb, s_bt, s_bh, IS_VARLEN)
    p_o = sequence_row(out, i_n, bos, i_hv, s_ob, s_ot, s_oh, IS_VARLEN)
    # the first token's inputs are requested before the row index and the state that depends on it
    n_q, n_k, n_g, n_v, n_b = load_token_raw(p_q, p_k, p_g, p_v, p_b, 0, bos < eos, s_qt, s_kt, s_gt, s_vt, s_bt,
                                             offs_k, mask_k, offs_v, mask_v)

    idx_row = state_indices + i_n.to(tl.int64) * idx_stride_n
    slot = i_n.to(tl.int64)  # without indices, sequence n owns row n
    valid = slot >= 0        # true: with no state to read there is no read row to check
    if USE_H0:
        if HAS_INDICES:
            if HAS_ACCEPTED:
                # clamped so that an unchecked bad count cannot read outside this sequence's row
                read_col = tl.load(num_accepted + i_n.to(tl.int64) * acc_stride).to(tl.int64) - 1
                read_col = tl.minimum(tl.maximum(read_col, 0), IDX_COLS - 1)
            else:
                read_col = 0
            slot = tl.load(idx_row + read_col * idx_stride_s).to(tl.int64)
        # -1 marks a padded sequence (kda_decode); out-of-range rows are treated the same so
        # that an unchecked bad index can never touch memory outside the pool.
        valid = (slot >= 0) & (slot < P_read)

    mask_s = (mask_v[:, None] & mask_k[None, :]) & valid                                  # [BV, BK]
    offs_s = state_row_tile(i_hv, offs_k, offs_v, HV, K, V, STATE_V_FIRST)                # [BV, BK]
    S = tl.zeros([BV, BK], dtype=tl.float32)                                              # S^T tile
    if USE_H0:
        S += tl.load(h0 + slot * h0_row_stride + offs_s, mask=mask_s, other=0.0).to(tl.float32)

    # while, not range(): the interpreter cannot take range() of a program-dependent bound.
    t = bos
    while t < eos:
        b_q, b_k, b_g, b_v, b_beta = n_q, n_k, n_g, n_v, n_b
        j = t - bos
        n_q, n_k, n_g, n_v, n_b = load_token_raw(p_q, p_k, p_g, p_v, p_b, j + 1, t + 1 < eos, s_qt, s_kt, s_gt, s_vt,
                                                 s_bt, offs_k, mask_k, offs_v, mask_v)
        b_q, b_k, b_a, b_beta = token_activations(b_q, b_k, b_g, b_beta, A_log, dt_bias, i_hv, offs_k, mask_k,
                                                  lower_bound, K, L2NORM, GATE, HAS_A, HAS_BIAS, BETA)

        S, b_u, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_beta, scale, ROUND_STATE, NATIVE_ROUND)
        if OUT == 1:
            b_o = tl.where(valid, b_o, 0.0)
            tl.store(p_o + j * s_ot + offs_v, b_o.to(out.dtype.element_ty), mask=mask_v)
        if OUT == 2:
            tl.store(p_o + j * s_ot + offs_v, b_u.to(out.dtype.element_ty), mask=mask_v)
        if WRITE == 1:
            col = t - bos
            # masked so that an unchecked long sequence cannot read past its index row
            w_slot = tl.load(idx_row + col * idx_stride_s, mask=col < IDX_COLS, other=-1).to(tl.int64)
            w_ok = valid & (w_slot >= 0) & (w_slot < P_write)
            tl.store(ht + w_slot * ht_row_stride + offs_s,
                     round_to_bf16_if(S, ROUND_STORE).to(ht.dtype.element_ty), mask=mask_s & w_ok)
        if WRITE == 2:
            tl.store(ht + t * ht_row_stride + offs_s,
                     round_to_bf16_if(S, ROUND_STORE).to(ht.dtype.element_ty), mask=mask_s & (t < P_write))
        t += 1

    if WRITE == 0:
        tl.store(ht + slot * ht_row_stride + offs_s,
                 round_to_bf16_if(S, ROUND_STORE).to(ht.dtype.element_ty), mask=mask_s)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

# Token tensors: read through their (batch, token, head) strides, so only their last dimension must have unit stride
# (beta, a scalar per head, any strides).
TOKEN_TENSORS = ("q", "k", "v", "g", "beta", "do", "out")


def token_strides(x: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, token, head) element strides of a ``[B, T, heads, ...]`` token tensor; zeros for an absent one (the
    kernels then never read it)."""
    return (0, 0, 0) if x is None else (x.stride(0), x.stride(1), x.stride(2))


def check_kernel_layout(K: int, tensors: dict) -> None:
    """The Triton kernels read the dtypes they compute (no float64: ``check_triton_dtypes``) and keep K in registers;
    they read token tensors (``TOKEN_TENSORS``) through their strides, with a unit stride in the last dimension
    (``check_token_strides``), and every other tensor (states, gate parameters, offsets) dense. Raise otherwise,
    naming the tensor (no hidden copies, no silent fp32 for float64)."""
    check_triton_dtypes(tensors)
    if K > MAX_HEAD_DIM:
        raise ValueError(f"the recurrent Triton kernels support K <= {MAX_HEAD_DIM}, got K={K}")
    for name, t in tensors.items():
        if t is None:
            continue
        if name in TOKEN_TENSORS:
            if name != "beta":
                check_token_strides(name, t)
        elif not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernels, got strides {tuple(t.stride())}")


def launch_recurrent_forward(
    q, k, v, g, beta, *, A_log, dt_bias, initial_state, cu_seqlens, N, opts, o=None,
    final_state=None, u=None, block_v: int = FWD_BLOCK_V, num_warps: int = FWD_NUM_WARPS,
) -> None:
    """Launch the recurrence for the forward; writes ``o`` (v's dtype) or ``u`` (fp32), and ``final_state``,
    when given. Dense ``[N, HV, K, V]`` (value-first: ``[N, HV, V, K]``) initial / final states, row n for
    sequence n. Token tensors and ``o`` through their strides (``check_kernel_layout``); ``u`` a dense
    ``[B * T, HV, V]`` buffer.

    ``opts``: the call's ``options.KDAOptions`` (not imported here: options.py builds on this module's
    beta modes). ``A_log`` / ``dt_bias``: None unless the gate is in the kernel (``opts.has_A_log``,
    ``opts.has_dt_bias``). ``cu_seqlens`` and ``N`` are the launch's own (a segment of the backward has
    its own offsets)."""
    if o is not None and u is not None:
        raise ValueError("launch_recurrent_forward writes o or u, not both (one per-token output row)")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), block_v)
    out = o if o is not None else (None if u is None else u.view(B, T, HV, V))
    h0, ht = initial_state, final_state
    dummy = q  # pointer for absent optional tensors; never dereferenced (constexpr flags)
    _recurrent_kernel[(N * HV, triton.cdiv(V, BV))](
        q, k, v, g, beta,
        A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        h0 if h0 is not None else dummy, ht if ht is not None else dummy, dummy, dummy,
        out if out is not None else dummy, cu_seqlens if cu_seqlens is not None else dummy,
        opts.scale, opts.kernel_lower_bound, T, N if h0 is not None else 0, N if ht is not None else 0,
        h0.stride(0) if h0 is not None else 0, ht.stride(0) if ht is not None else 0, 0, 0, 0,
        *token_strides(q), *token_strides(k), *token_strides(v), *token_strides(g), *token_strides(beta),
        *token_strides(out),
        H=H, HV=HV, K=K, V=V, IDX_COLS=1, BK=BK, BV=BV,
        HAS_INDICES=False, USE_H0=h0 is not None, WRITE=WRITE_FINAL_TO_READ_ROW if ht is not None else WRITE_NONE,
        OUT=OUT_O if o is not None else (OUT_U if u is not None else OUT_NONE), HAS_ACCEPTED=False,
        ROUND_STATE=False, ROUND_STORE=ht is not None and ht.dtype == torch.bfloat16,
        IS_VARLEN=cu_seqlens is not None, NATIVE_ROUND=not triton_interpreting(), **opts.recurrent_constexprs(),
        num_warps=num_warps,
    )
