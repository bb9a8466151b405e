"""Forward of chunked KDA at 64-token chunks (``KDAKIT_CHUNK_PIPELINE=chunk64``; the default is the 16-token
forward of ``chunk_fwd.py``): three parallel intra kernels, then one serial state kernel.

Per chunk of C = 64 tokens and value head, with G the chunk cumsum of the log-decay, Γ = exp(G),
g_C = G at the last row and S ``[K, V]`` the state entering the chunk (fp32)::

    Akk, Aqk (pairwise, 16-token sub-chunks), qΓ, kd = k exp(g_C - G), beta k Γ     (pair kernel)
    Tinv = (I + beta Akk)^-1                                                          (solve kernel)
    W = Tinv (beta k Γ)    U = Tinv (beta v)                                          (wu kernel)
    V' = U - W S    O = scale (qΓ S + Aqk V')    S <- exp(g_C) S + kd^T V'            (state kernel)

The intra kernels have grid ``(chunks, HV)``. The pair kernel works on K in BK-column blocks (no tile wider
than ``[64, BK]``); the l2norm scales are per-row factors of the pairwise sums, so they scale the block tiles
directly. beta Akk goes to an fp32 scratch slot of the chunk; the solve kernel inverts it in place from
memory (the four 16 x 16 diagonal blocks by forward substitution on rows loaded from the slot, the
off-diagonal blocks by block substitution with exact fp32 dots); beta k Γ is parked in W's slot until the
wu kernel replaces it by W, and U is written into ``o``.

``chunk_kda_fwd64_state_kernel``, grid ``(N * HV, cdiv(V, BV))``: one program walks a sequence for a block
of value columns; a step only loads W, U, qΓ, kd, Aqk, exp(g_C) and runs four products (o is written over
U: the same program reads those rows and columns first).

Temporaries (freed on return): W, kd, qΓ ``[B, T, HV, K]`` and Aqk ``[B, T, HV, C]`` in the token dtype, the
fp32 scratch ``[chunks, HV, C, C]`` (the bytes of one more ``[B, T, HV, K]`` bf16 tensor at K = 128) and
exp(g_C) fp32 ``[chunks, HV, K]``: 1.15 KB per token and value head at K = V = 128 in bf16, which the
backward's dq, dk, dv, dg (same sizes) reuse. Saves nothing for the backward (it recomputes).

Measured (H200, 1 x 8K H96, docs/spec.md §3 flags, ``benchmarks/dev_intra64.py`` and ``dev_chunk_gpu.py``; results in
``benchmarks/results/chunk64_dev_h200.json``): state kernel 0.67 ms (5.3 us a step; the 16-token forward's
state kernel takes 0.95 ms). The three intra stages fused in one kernel took 5.0 ms (the inverse 1.5 of it;
FLA 0.6.0 does the same intra work in ~1.7 ms): at 255 registers one 8-warp program runs per SM and its
dependent steps (row extractions, the 15-step substitution, barriers) are latency nothing else hides,
hence the split into three kernels. Forming the sub-chunk references as 0/+-1 dots with tf32x3 instead of
row extractions measured 13.5 ms (not kept).

Gates: SAFE (log-decay >= -5: one dot per matrix for the diagonal blocks) or EXACT (any gate: per-pair
exponentials on the diagonal blocks, ``chunk_tiles.pairwise_diag_exact``). Layouts as ``chunk_fwd.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import (
    l2norm_rstd,
    load_matrix,
    load_rows,
    round_to_bf16_if,
    store_matrix,
    store_rows,
)
from kdakit.ops.kda.chunk_prep64 import (
    EXACT_KEY_SLICE,
    Chunk64Options,
    bias_row,
    chunk64_tables,
    chunk_program,
    gate_scalar,
    load_rows_t,
    sequence_program,
    state_row,
    state_strides,
)
from kdakit.ops.kda.chunk_tiles import (
    CHUNK,
    SUB,
    dot_operand,
    load_beta,
    load_gate,
    pairwise_diag_exact,
    pairwise_qk_kk_block,
    unit_lower_inverse_offdiag,
)

# H200, 1x8K H96: the three stages fused in one kernel took 5.0 ms at 8 warps (5.5 at 4), the inverse 1.5 of it
PAIR_NUM_WARPS = 8
PAIR_REFS_BY_RESHAPE = True
SOLVE_NUM_WARPS = 4  # sm_90a: 215 registers, no spills (2 warps: 255 and spills)
WU_NUM_WARPS = 4
INTRA_BLOCK_K = 64  # 32: 6.6 ms
STATE_NUM_WARPS = 4  # H200, 1x8K H96: 0.67 ms at 4 warps, 0.98 at 8 (2 stages; 1.10 with 1 stage)
STATE_BLOCK_V = 64
STATE_NUM_STAGES = 2


# ---------------------------------------------------------------------------------------
# intra-chunk pieces
# ---------------------------------------------------------------------------------------


@triton.jit
def _load_block(base, I: tl.constexpr, J: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr):
    """Block (I, J) ``[SUBC, SUBC]`` of a row-major fp32 ``[C, C]`` slot."""
    r = tl.arange(0, SUBC)
    return tl.load(base + (SUBC * I + r)[:, None] * C + SUBC * J + r[None, :])


@triton.jit
def _store_block(base, X, I: tl.constexpr, J: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr):
    r = tl.arange(0, SUBC)
    tl.store(base + (SUBC * I + r)[:, None] * C + SUBC * J + r[None, :], X)


@triton.jit
def _substitution_step(slot, X, s: tl.constexpr, I: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr):
    """Row s of X = (I + L_II)^-1 - I: ``X[s] = -L[s] - sum_j L[s, j] X[j]`` (rows j < s final, the rest 0)."""
    r = tl.arange(0, SUBC)
    lrow = tl.load(slot + (SUBC * I + s) * C + SUBC * I + r)  # [SUBC], zero from column s on
    new = -lrow - tl.sum(lrow[:, None] * X, axis=0)
    return tl.where((r == s)[:, None], new[None, :], X)


@triton.jit
def unit_lower_inverse_in_place(slot, C: tl.constexpr, SUBC: tl.constexpr):
    """``(I + L)^-1`` of the strictly lower fp32 ``[C, C]`` matrix L in ``slot`` (row-major, zero on and above
    the diagonal), written back over it (C = 4 SUBC). The caller puts a barrier between its store of L and
    this call, and before it re-reads the slot.

    Diagonal blocks: X = T - I by forward substitution, ``X[s] = -L[s] - L[s, :s] X[:s]``, the four blocks
    side by side on rows loaded from the slot (SUBC - 1 dependent steps). Off-diagonal blocks:
    ``T_IJ = -T_II sum_{J <= M < I} L_IM T_MJ`` with exact fp32 dots (chunk_tiles.unit_lower_inverse_offdiag)."""
    r = tl.arange(0, SUBC)
    X0 = tl.zeros([SUBC, SUBC], dtype=tl.float32)
    X1 = tl.zeros([SUBC, SUBC], dtype=tl.float32)
    X2 = tl.zeros([SUBC, SUBC], dtype=tl.float32)
    X3 = tl.zeros([SUBC, SUBC], dtype=tl.float32)
    # four separate [SUBC, SUBC] tiles: a batched [4, SUBC, SUBC] tile measured 215 sm_90a registers at 4 warps
    for s in tl.static_range(1, SUBC):
        X0 = _substitution_step(slot, X0, s, 0, C, SUBC)
        X1 = _substitution_step(slot, X1, s, 1, C, SUBC)
        X2 = _substitution_step(slot, X2, s, 2, C, SUBC)
        X3 = _substitution_step(slot, X3, s, 3, C, SUBC)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    T00 = X0 + eye
    T11 = X1 + eye
    T22 = X2 + eye
    T33 = X3 + eye
    L10 = _load_block(slot, 1, 0, C, SUBC)
    L20 = _load_block(slot, 2, 0, C, SUBC)
    L21 = _load_block(slot, 2, 1, C, SUBC)
    L30 = _load_block(slot, 3, 0, C, SUBC)
    L31 = _load_block(slot, 3, 1, C, SUBC)
    L32 = _load_block(slot, 3, 2, C, SUBC)
    T10, T20, T21, T30, T31, T32 = unit_lower_inverse_offdiag(T00, T11, T22, T33, L10, L20, L21, L30, L31, L32)
    tl.debug_barrier()  # every thread has read L before any block of it is overwritten
    _store_block(slot, T00, 0, 0, C, SUBC)
    _store_block(slot, T10, 1, 0, C, SUBC)
    _store_block(slot, T11, 1, 1, C, SUBC)
    _store_block(slot, T20, 2, 0, C, SUBC)
    _store_block(slot, T21, 2, 1, C, SUBC)
    _store_block(slot, T22, 2, 2, C, SUBC)
    _store_block(slot, T30, 3, 0, C, SUBC)
    _store_block(slot, T31, 3, 1, C, SUBC)
    _store_block(slot, T32, 3, 2, C, SUBC)
    _store_block(slot, T33, 3, 3, C, SUBC)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_kda_fwd64_pair_kernel(
    q, k, g, beta, A_log, dt_bias, w, kd, qg, aqk, egc, scratch, cu_seqlens, chunk_table,
    lower_bound, T, H, HV, NTS, stride_alog, stride_bias,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BKF: tl.constexpr,
    BKS: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
    IS_VARLEN: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
    REFS_BY_RESHAPE: tl.constexpr,
):
    """One (chunk, value head), stage 1 of 3: qΓ, kd, exp(g_C), Aqk, beta k Γ (into W's slot) and beta Akk
    (fp32, into the chunk's scratch slot). BK: key block of the tiles; BKF: the padded K (the EXACT diagonal
    blocks' width)."""
    i_t, i_hv, i_h, bos, seq_len, t0 = chunk_program(cu_seqlens, chunk_table, T, NTS, H, HV, C, IS_VARLEN)
    q_base = q + (bos * H + i_h) * K
    k_base = k + (bos * H + i_h) * K
    g_base = g + (bos * HV + i_hv) * K
    tok_k = (bos * HV + i_hv) * K
    tok_c = (bos * HV + i_hv) * C
    bias_ptr = bias_row(dt_bias, i_hv, K, stride_bias, HAS_BIAS)
    expA = gate_scalar(A_log, i_hv, stride_alog, HAS_A_LOG)
    rows = tl.arange(0, C)

    rq = tl.zeros([C], dtype=tl.float32) + 1.0
    rk = tl.zeros([C], dtype=tl.float32) + 1.0
    if USE_L2NORM:
        sq = tl.zeros([C], dtype=tl.float32)
        sk = tl.zeros([C], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BK):
            xq = load_rows(q_base, t0, seq_len, H * K, k0, K, C, BK)
            xk = load_rows(k_base, t0, seq_len, H * K, k0, K, C, BK)
            sq += tl.sum(xq * xq, axis=1)
            sk += tl.sum(xk * xk, axis=1)
        rq = l2norm_rstd(sq)
        rk = l2norm_rstd(sk)
    bt, _ = load_beta(beta + bos * HV + i_hv, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]

    Aqk = tl.zeros([C, C], dtype=tl.float32)
    Akk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BK):
        qn = load_rows(q_base, t0, seq_len, H * K, k0, K, C, BK) * rq[:, None]  # [C, BK]
        kn = load_rows(k_base, t0, seq_len, H * K, k0, K, C, BK) * rk[:, None]
        a = load_gate(g_base, bias_ptr, t0, seq_len, HV * K, k0, K, expA, lower_bound, C, BK, GATE, HAS_BIAS,
                      stride_bias)
        G = tl.cumsum(a, axis=0)  # [C, BK]
        gc = tl.sum(a, axis=0)  # [BK]: G at the last real row (padded rows add 0)
        cols = k0 + tl.arange(0, BK)
        tl.store(egc + (i_t * HV + i_hv) * K + cols, tl.exp(gc), mask=cols < K)
        gam = tl.exp(G)
        store_rows(qg + tok_k, round_to_bf16_if(qn * gam, EMULATE_BF16), t0, seq_len, HV * K, k0, K, C, BK)
        store_rows(kd + tok_k, round_to_bf16_if(kn * tl.exp(gc[None, :] - G), EMULATE_BF16), t0, seq_len, HV * K,
                   k0, K, C, BK)
        store_rows(w + tok_k, round_to_bf16_if(kn * gam * bt[:, None], EMULATE_BF16), t0, seq_len, HV * K, k0, K,
                   C, BK)
        dqk, dkk = pairwise_qk_kk_block(qn, kn, G, SAFE, C, SUBC, BK, OP_BF16, EMULATE_BF16, DOT_PREC,
                                        REFS_BY_RESHAPE)
        Aqk += dqk
        Akk += dkk
    if not SAFE:
        Aqk += pairwise_diag_exact(q_base, k_base, rq, rk, g_base, bias_ptr, t0, seq_len, H * K, HV * K, K, expA,
                                   lower_bound, stride_bias, C, SUBC, BKF, BKS, GATE, HAS_BIAS, True)
        Akk += pairwise_diag_exact(k_base, k_base, rk, rk, g_base, bias_ptr, t0, seq_len, H * K, HV * K, K, expA,
                                   lower_bound, stride_bias, C, SUBC, BKF, BKS, GATE, HAS_BIAS, False)
    store_rows(aqk + tok_c, round_to_bf16_if(Aqk, EMULATE_BF16), t0, seq_len, HV * C, 0, C, C, C)

    slot = scratch + (i_t * HV + i_hv) * (C * C)
    tl.store(slot + rows[:, None] * C + rows[None, :], Akk * bt[:, None])  # beta_i Akk[i, j], strictly lower


@triton.jit
def chunk_kda_fwd64_solve_kernel(scratch, C: tl.constexpr, SUBC: tl.constexpr):
    """Stage 2 of 3, one (chunk, value head): ``(I + beta Akk)^-1`` over the scratch slot, in place. Its own
    launch so that its 15 dependent substitution steps run at a small register footprint, many programs to
    an SM, instead of inside the 255-register fused kernel (there the inverse cost 1.5 ms at 1 x 8K H96)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    HV = tl.num_programs(1)
    unit_lower_inverse_in_place(scratch + (i_t * HV + i_hv) * (C * C), C, SUBC)


@triton.jit
def chunk_kda_fwd64_wu_kernel(
    v, beta, u, w, scratch, cu_seqlens, chunk_table, T, HV, NTS,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, IS_VARLEN: tl.constexpr, OP_BF16: tl.constexpr,
    EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Stage 3 of 3, one (chunk, value head): ``W = Tinv (beta k Γ)`` over its slot and ``U = Tinv (beta v)``
    into ``u`` (o's buffer)."""
    i_t, i_hv, _, bos, seq_len, t0 = chunk_program(cu_seqlens, chunk_table, T, NTS, 1, 1, C, IS_VARLEN)
    tok_k = (bos * HV + i_hv) * K
    tok_v = (bos * HV + i_hv) * V
    rows = tl.arange(0, C)
    bt, _ = load_beta(beta + bos * HV + i_hv, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]
    slot = scratch + (i_t * HV + i_hv) * (C * C)
    Ti = dot_operand(tl.load(slot + rows[:, None] * C + rows[None, :]), OP_BF16, EMULATE_BF16)  # [C, C]
    for k0 in tl.static_range(0, K, BK):
        X = dot_operand(load_rows(w + tok_k, t0, seq_len, HV * K, k0, K, C, BK), OP_BF16, EMULATE_BF16)
        Wb = tl.dot(Ti, X, input_precision=DOT_PREC)
        tl.debug_barrier()  # all of this block of beta k Γ is read before W overwrites it
        store_rows(w + tok_k, round_to_bf16_if(Wb, EMULATE_BF16), t0, seq_len, HV * K, k0, K, C, BK)
    for v0 in tl.static_range(0, V, BV):
        vb = load_rows(v + tok_v, t0, seq_len, HV * V, v0, V, C, BV) * bt[:, None]
        Ub = tl.dot(Ti, dot_operand(vb, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)
        store_rows(u + tok_v, round_to_bf16_if(Ub, EMULATE_BF16), t0, seq_len, HV * V, v0, V, C, BV)


@triton.jit
def chunk_kda_fwd64_state_kernel(
    o, w, kd, qg, aqk, egc, h0, ht, cu_seqlens, chunk_offsets, scale, T, HV, NTS,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v, s_ht_n, s_ht_h, s_ht_k, s_ht_v,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, OP_BF16: tl.constexpr,
    EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, LOOP_WHILE: tl.constexpr,
):
    """One (sequence, value head, value block): the state walk; o (holding U on entry) is overwritten."""
    i_n, i_hv, v0, _, bos, seq_len, c0 = sequence_program(cu_seqlens, chunk_offsets, T, HV, NTS, BV, IS_VARLEN)
    w_base = w + (bos * HV + i_hv) * K
    kd_base = kd + (bos * HV + i_hv) * K
    qg_base = qg + (bos * HV + i_hv) * K
    o_base = o + (bos * HV + i_hv) * V
    aqk_base = aqk + (bos * HV + i_hv) * C
    S = tl.zeros([BK, BV], dtype=tl.float32)  # state columns [v0, v0 + BV), K-major
    if HAS_H0:
        S = load_matrix(state_row(h0, i_n, i_hv, s_h0_n, s_h0_h, HAS_H0), s_h0_k, s_h0_v, K, V, v0, BK, BV)
    n_chunks = tl.cdiv(seq_len, C)
    if LOOP_WHILE:
        # The interpreter cannot take range() of a program-dependent bound; a while loop it can.
        i_c = 0
        while i_c < n_chunks:
            S = _state_step(S, i_c * C, (c0 + i_c) * HV + i_hv, seq_len, HV, v0, scale, w_base, kd_base, qg_base,
                            aqk_base, o_base, egc, K, V, C, BK, BV, OP_BF16, EMULATE_BF16, DOT_PREC)
            i_c += 1
    else:
        for i_c in range(0, n_chunks):
            S = _state_step(S, i_c * C, (c0 + i_c) * HV + i_hv, seq_len, HV, v0, scale, w_base, kd_base, qg_base,
                            aqk_base, o_base, egc, K, V, C, BK, BV, OP_BF16, EMULATE_BF16, DOT_PREC)
    if STORE_HT:
        store_matrix(ht + i_n.to(tl.int64) * s_ht_n + i_hv * s_ht_h, S, s_ht_k, s_ht_v, K, V, v0, BK, BV)


@triton.jit
def _state_step(S, t0, row, seq_len, HV, v0, scale, w_base, kd_base, qg_base, aqk_base, o_base, egc,
                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """``V' = U - W S``, ``o = scale (qΓ S + Aqk V')`` (over U), ``S <- exp(g_C) S + kd^T V'``."""
    W = dot_operand(load_rows(w_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)  # [C, BK]
    qgt = dot_operand(load_rows(qg_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)  # [C, BK]
    kdT = dot_operand(load_rows_t(kd_base, t0, seq_len, HV * K, K, C, BK), OP_BF16, EMULATE_BF16)  # [BK, C]
    Aqk = dot_operand(load_rows(aqk_base, t0, seq_len, HV * C, 0, C, C, C), OP_BF16, EMULATE_BF16)  # [C, C]
    Ut = load_rows(o_base, t0, seq_len, HV * V, v0, V, C, BV)  # [C, BV]
    cols = tl.arange(0, BK)
    egc_c = tl.load(egc + row * K + cols, mask=cols < K, other=0.0)  # [BK]
    So = dot_operand(S, OP_BF16, EMULATE_BF16)
    vn = dot_operand(Ut - tl.dot(W, So, input_precision=DOT_PREC), OP_BF16, EMULATE_BF16)  # V' [C, BV]
    ot = scale * (tl.dot(qgt, So, input_precision=DOT_PREC) + tl.dot(Aqk, vn, input_precision=DOT_PREC))
    store_rows(o_base, round_to_bf16_if(ot, EMULATE_BF16), t0, seq_len, HV * V, v0, V, C, BV)
    return S * egc_c[:, None] + tl.dot(kdT, vn, input_precision=DOT_PREC)  # [BK, BV]


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def run_intra(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, pairs, out: torch.Tensor, o: Chunk64Options) -> dict:
    """Allocate the intra stage's temporaries, run its three kernels (U into ``out``) and return name -> tensor."""
    dev, C = q.device, CHUNK
    t = dict(w=torch.empty((o.B, o.T, o.HV, o.K), dtype=o.slot_dtype, device=dev),
             kd=torch.empty((o.B, o.T, o.HV, o.K), dtype=o.slot_dtype, device=dev),
             qg=torch.empty((o.B, o.T, o.HV, o.K), dtype=o.slot_dtype, device=dev),
             aqk=torch.empty((o.B, o.T, o.HV, C), dtype=o.slot_dtype, device=dev),
             egc=torch.empty((o.NT, o.HV, o.K), dtype=torch.float32, device=dev))
    scratch = torch.empty((o.NT, o.HV, C, C), dtype=torch.float32, device=dev)
    if o.NT * o.HV > 0:
        grid = (o.NT, o.HV)
        cx = o.constexprs
        chunk_kda_fwd64_pair_kernel[grid](
            q, k, g, beta, A_log, dt_bias, t["w"], t["kd"], t["qg"], t["aqk"], t["egc"], scratch, cu_seqlens,
            pairs, o.lower_bound, o.T, o.H, o.HV, o.NTS, o.stride_alog, o.stride_bias,
            K=o.K, V=o.V, C=C, SUBC=SUB, BK=min(INTRA_BLOCK_K, o.BK), BKF=o.BK, BKS=min(EXACT_KEY_SLICE, o.BK),
            SAFE=o.safe, REFS_BY_RESHAPE=PAIR_REFS_BY_RESHAPE, **cx, num_warps=PAIR_NUM_WARPS, num_stages=1,
        )
        chunk_kda_fwd64_solve_kernel[grid](scratch, C=C, SUBC=SUB, num_warps=SOLVE_NUM_WARPS, num_stages=1)
        chunk_kda_fwd64_wu_kernel[grid](
            v, beta, out, t["w"], scratch, cu_seqlens, pairs, o.T, o.HV, o.NTS,
            K=o.K, V=o.V, C=C, BK=min(INTRA_BLOCK_K, o.BK), BV=min(64, o.BV), BETA_SIGMOID=cx["BETA_SIGMOID"],
            NEG_EIGVAL=cx["NEG_EIGVAL"], IS_VARLEN=o.varlen, OP_BF16=cx["OP_BF16"], EMULATE_BF16=cx["EMULATE_BF16"],
            DOT_PREC=cx["DOT_PREC"], num_warps=WU_NUM_WARPS, num_stages=1,
        )
    del scratch
    return t


def chunk_kda_fwd64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    seqlens,
    opts: Chunk64Options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o [B, T, HV, V] in v's dtype, final state fp32 in the requested layout or None)``.

    Shapes and layouts as ``chunk_fwd.chunk_kda_fwd``; ``opts`` from ``chunk64_options`` (the final state
    when ``opts.kda.output_final_state``)."""
    ob = opts
    dev = q.device
    out = torch.empty_like(v)
    final = None
    if ob.kda.output_final_state:
        final = torch.empty((ob.N, ob.HV, ob.V, ob.K) if ob.state_v_first else (ob.N, ob.HV, ob.K, ob.V),
                            dtype=torch.float32, device=dev)
    pairs, firsts = chunk64_tables(ob, seqlens, dev)
    p = run_intra(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, pairs, out, ob)
    cx = ob.constexprs
    if ob.N * ob.HV > 0:
        bv = min(STATE_BLOCK_V, ob.BV)
        chunk_kda_fwd64_state_kernel[(ob.N * ob.HV, triton.cdiv(ob.V, bv))](
            out, p["w"], p["kd"], p["qg"], p["aqk"], p["egc"], initial_state, final, cu_seqlens, firsts, ob.scale,
            ob.T, ob.HV, ob.NTS, *state_strides(initial_state, ob.state_v_first),
            *state_strides(final, ob.state_v_first),
            K=ob.K, V=ob.V, C=CHUNK, BK=ob.BK, BV=bv, IS_VARLEN=ob.varlen, HAS_H0=initial_state is not None,
            STORE_HT=final is not None, OP_BF16=cx["OP_BF16"], EMULATE_BF16=cx["EMULATE_BF16"],
            DOT_PREC=cx["DOT_PREC"], LOOP_WHILE=ob.interpreting, num_warps=STATE_NUM_WARPS,
            num_stages=STATE_NUM_STAGES,
        )
    del p, pairs, firsts
    return out, final
