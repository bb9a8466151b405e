"""Triton backward of chunked KDA: one streaming pass per (sequence, value head), recomputing from checkpoints.

Math (one chunk of C = 16 rows, state S ``[K, V]`` before it; see ``chunk_bwd_reference.py``, the
float64 twin checked against autograd)::

    G = cumsum(a), Gam = exp(G), gC = exp(G[C-1]), kd = k exp(G[C-1] - G)
    Araw = sum_c k_i k_j E_ij (j < i), Aqk = sum_c q_i k_j E_ij (j <= i), E_ij = exp(G_i - G_j)
    Tinv = (I + beta Araw)^-1, W = Tinv (beta k Gam), U = Tinv (beta v), V' = U - W S
    forward:  O = scale ((q Gam) S + Aqk V'),  S_next = gC S + kd^T V'
    backward: dAqk = scale dO V'^T, dV' = scale Aqk^T dO + kd dS_next,
              dS = gC dS_next + scale (q Gam)^T dO - W^T dV', then dW, dU, dTinv -> dAraw, and the
              pairwise, decay and transform terms (l2norm, gate, beta sigmoid) of the design note.

Algorithm (grid: programs over the N * HV (sequence, value head) items; a program owns all of V):
for each checkpoint segment of L tokens, last first: load its checkpoint, recompute the states at
every L2 tokens into workspace slots ``ws_seg[slot]`` (level 1); then for each L2 sub-segment, last
first: recompute its chunk start states into ``ws_chunk[slot]`` (level 2) and walk its chunks in
reverse, computing every gradient of the chunk's tokens and carrying dS ``[BK, BV]`` fp32 in
registers. Every gradient is written once, in its input's dtype; nothing grows with T except the
checkpoints (made by the forward). Workspace: ``programs * (L/L2 + L2/C) * K * V`` state slots.

Pairwise matrices: SAFE (``safe_gate``: a >= -5) factors E through a mid-chunk reference and uses
``tl.dot``; EXACT (any gate) forms ``exp(G_i - G_j)`` for one column j at a time on ``[C, BK]``
tiles, never ``exp(-G)``, so log-decays of -1000 stay finite.

Layouts: q, k ``[B, T, H, K]``; v, dO ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``, all
contiguous (token-major); checkpoints fp32 ``[rows, HV, K, V]``; dht / dh0 in the state layout
(K-major or ``state_v_first``), read and written through strides. With GVA (HV > H) dq and dk are
first written as fp32 per-value-head partials ``[B, T, HV, K]`` and summed over the group.
Limits: K, V <= 128 (powers of two are fastest; others are masked). Offsets are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import (
    beta_activation,
    beta_activation_bwd,
    block_size,
    causal_mask,
    gate_log_decay,
    gate_log_decay_bwd,
    gate_mode,
    l2norm_rows,
    l2norm_rows_bwd,
    load_chunk_beta,
    load_chunk_gate,
    load_matrix,
    load_row_scalars,
    load_rows,
    row_of,
    safe_gate_factors,
    store_matrix,
    store_row_scalars,
    store_rows,
    unit_lower_inverse,
    unit_lower_inverse_doubling,
)
from kdakit.ops.kda.chunk_fwd import uses_safe_path
from kdakit.ops.kda.plan import checkpoint_offsets

CHUNK = 16
MAX_HEAD_DIM = 128
# (I + A)^-1 by repeated squaring (six small dots) instead of 15 dependent row updates.
USE_DOUBLING_INVERSE = True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Matmuls of fp32 tiles: TF32 for 16-bit inputs (already rounded coarser than TF32), 3xTF32 for
# fp32 inputs, exact in the interpreter (the forward makes the same choice).
def _dot_precision(dtype: torch.dtype) -> str:
    if _interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


# The products that feed the decay gradient (pairwise terms, dkd, dqG, dX) lose too much to TF32
# rounding (dg / ddt_bias RMS ratio 6e-3 / 2e-2 measured at 2K tokens): 3xTF32 there.
def _grad_precision() -> str:
    return "ieee" if _interpreting() else "tf32x3"


def _num_warps(BK: int, BV: int) -> int:
    # S and dS ([BK, BV] fp32 each) live in registers together: 8 warps keep them at 64 registers
    # per thread each for 128 x 128.
    return 8 if BK * BV >= 64 * 64 else 4


# ---------------------------------------------------------------- per-chunk helpers -------------

@triton.jit
def _exact_kk(k, G, C: tl.constexpr):
    """EXACT ``Araw[i, j] = sum_c k_i k_j exp(G_i - G_j)`` for j < i, one column j at a time. -> [C, C]."""
    r = tl.arange(0, C)
    A = tl.zeros([C, C], dtype=tl.float32)
    for j in range(C):
        Gj = row_of(G, j, C)  # [BK]
        kj = row_of(k, j, C)  # [BK]
        keep = (r > j)[:, None]
        E = tl.where(keep, tl.exp(tl.where(keep, G - Gj[None, :], 0.0)), 0.0)  # [C, BK]
        col = tl.sum(k * kj[None, :] * E, axis=1)  # [C]
        A = tl.where((r == j)[None, :], col[:, None], A)
    return A


@triton.jit
def _exact_qk_kk(q, k, G, C: tl.constexpr):
    """EXACT (Aqk masked j <= i, Araw masked j < i), one column j at a time. -> ([C, C], [C, C])."""
    r = tl.arange(0, C)
    Aqk = tl.zeros([C, C], dtype=tl.float32)
    Akk = tl.zeros([C, C], dtype=tl.float32)
    for j in range(C):
        Gj = row_of(G, j, C)
        kj = row_of(k, j, C)
        keep = (r >= j)[:, None]
        E = tl.where(keep, tl.exp(tl.where(keep, G - Gj[None, :], 0.0)), 0.0)  # [C, BK]
        ke = kj[None, :] * E
        cq = tl.sum(q * ke, axis=1)  # [C]
        ck = tl.where(r > j, tl.sum(k * ke, axis=1), 0.0)  # [C]
        is_j = (r == j)[None, :]
        Aqk = tl.where(is_j, cq[:, None], Aqk)
        Akk = tl.where(is_j, ck[:, None], Akk)
    return Aqk, Akk


@triton.jit
def _exact_pairwise_bwd(dAqk, dAkk, q, k, G, C: tl.constexpr):
    """Gradients of Aqk (x = q) and Araw (x = k) through the EXACT pairwise form. -> (dq, dk, dG) [C, BK].

    For column j: dx_i += dA_ij k_j E_ij; dk_j += sum_i dA_ij x_i E_ij; dG_i += dA_ij x_i k_j E_ij,
    dG_j -= the same summed over i.
    """
    r = tl.arange(0, C)
    dq = tl.zeros(q.shape, dtype=tl.float32)
    dk = tl.zeros(q.shape, dtype=tl.float32)
    dG = tl.zeros(q.shape, dtype=tl.float32)
    for j in range(C):
        Gj = row_of(G, j, C)
        kj = row_of(k, j, C)
        keep = (r >= j)[:, None]
        E = tl.where(keep, tl.exp(tl.where(keep, G - Gj[None, :], 0.0)), 0.0)  # [C, BK]
        is_j = (r == j)[None, :]
        cq = tl.sum(tl.where(is_j, dAqk, 0.0), axis=1)  # [C] column j
        ck = tl.sum(tl.where(is_j, dAkk, 0.0), axis=1)
        Pq = cq[:, None] * E
        Pk = ck[:, None] * E
        dq += Pq * kj[None, :]
        dk += Pk * kj[None, :]
        t = Pq * q + Pk * k  # [C, BK]
        tsum = tl.sum(t, axis=0)  # [BK]: d k_j
        dG += t * kj[None, :]
        row_j = (r == j)[:, None]
        dk += tl.where(row_j, tsum[None, :], 0.0)
        dG -= tl.where(row_j, (tsum * kj)[None, :], 0.0)
    return dq, dk, dG


@triton.jit
def _state_step(S, k_base, v_base, g_base, b_base, bias_ptr, t0, n_rows, s_qk, s_v, s_g, s_b, K, V,
                expA, lower_bound, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
                DOT_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr):
    """State after the chunk starting at row t0: ``gC S + kd^T (U - W S)``. S ``[BK, BV]`` fp32."""
    k = load_rows(k_base, t0, n_rows, s_qk, 0, K, C, BK)  # [C, BK]
    if L2NORM:
        k, _ = l2norm_rows(k)
    v = load_rows(v_base, t0, n_rows, s_v, 0, V, C, BV)  # [C, BV]
    a = load_chunk_gate(g_base, bias_ptr, t0, n_rows, s_g, 0, K, expA, lower_bound, C, BK, GATE, HAS_BIAS)
    b = load_chunk_beta(b_base, t0, n_rows, s_b, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]
    G = tl.cumsum(a, axis=0)  # [C, BK]
    GC = row_of(G, C - 1, C)  # [BK]
    if SAFE:
        eg, egi = safe_gate_factors(G, C)
        Araw = tl.dot(k * eg, tl.trans(k * egi), input_precision=DOT_PREC)
        Araw = tl.where(causal_mask(C, False), Araw, 0.0)  # [C, C]
    else:
        Araw = _exact_kk(k, G, C)
    if INV_DOUBLING:
        Tinv = unit_lower_inverse_doubling(b[:, None] * Araw, C)  # [C, C]
    else:
        Tinv = unit_lower_inverse(b[:, None] * Araw, C)
    W = tl.dot(Tinv, b[:, None] * k * tl.exp(G), input_precision=DOT_PREC)  # [C, BK]
    U = tl.dot(Tinv, b[:, None] * v, input_precision=DOT_PREC)  # [C, BV]
    Vp = U - tl.dot(W, S, input_precision=DOT_PREC)  # [C, BV]
    kd = k * tl.exp(GC[None, :] - G)  # [C, BK]
    return tl.exp(GC)[:, None] * S + tl.dot(tl.trans(kd), Vp, input_precision=DOT_PREC)


@triton.jit
def _chunk_grads(S, dS, q_base, k_base, v_base, g_base, b_base, bias_ptr, do_base,
                 dq_base, dk_base, dv_base, dg_base, db_base, t0, n_rows,
                 s_qk, s_v, s_g, s_b, s_dqk, K, V, scale, expA, lower_bound,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                 BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
                 DOT_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr):
    """Every gradient of one chunk's tokens (stored), and dS before the chunk.

    S: state before the chunk, dS: dL/dS after it, both ``[BK, BV]`` fp32.
    Returns (dS_prev ``[BK, BV]``, dA_log term (scalar), ddt_bias term ``[BK]``).
    """
    r = tl.arange(0, C)
    cols = tl.arange(0, BK)
    rmask = (t0 + r) < n_rows  # [C]
    m2 = rmask[:, None] & (cols < K)[None, :]  # [C, BK]

    # ---- recompute the chunk's forward
    q_raw = load_rows(q_base, t0, n_rows, s_qk, 0, K, C, BK)  # [C, BK]
    k_raw = load_rows(k_base, t0, n_rows, s_qk, 0, K, C, BK)
    if L2NORM:
        q, rq = l2norm_rows(q_raw)
        k, rk = l2norm_rows(k_raw)
    else:
        q = q_raw
        k = k_raw
    v = load_rows(v_base, t0, n_rows, s_v, 0, V, C, BV)  # [C, BV]
    do = load_rows(do_base, t0, n_rows, s_v, 0, V, C, BV)  # [C, BV]
    x = load_rows(g_base, t0, n_rows, s_g, 0, K, C, BK)  # [C, BK] gate pre-activation
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
    a = tl.where(m2, gate_log_decay(x, expA, lower_bound, GATE), 0.0)  # [C, BK]
    b_raw = load_row_scalars(b_base, t0, n_rows, s_b, C)  # [C]
    b = tl.where(rmask, beta_activation(b_raw, BETA_SIGMOID, NEG_EIGVAL), 0.0)

    G = tl.cumsum(a, axis=0)  # [C, BK]
    Gam = tl.exp(G)
    GC = row_of(G, C - 1, C)  # [BK]
    gC = tl.exp(GC)
    eC = tl.exp(GC[None, :] - G)  # [C, BK]
    kd = k * eC
    if SAFE:
        eg, egi = safe_gate_factors(G, C)
        qr = q * eg
        kr = k * eg
        ki = k * egi
        Aqk = tl.where(causal_mask(C, True), tl.dot(qr, tl.trans(ki), input_precision=GRAD_PREC), 0.0)
        Akk = tl.where(causal_mask(C, False), tl.dot(kr, tl.trans(ki), input_precision=GRAD_PREC), 0.0)
    else:
        Aqk, Akk = _exact_qk_kk(q, k, G, C)
    if INV_DOUBLING:
        Tinv = unit_lower_inverse_doubling(b[:, None] * Akk, C)  # [C, C]
    else:
        Tinv = unit_lower_inverse(b[:, None] * Akk, C)
    X = b[:, None] * k * Gam  # [C, BK]
    Y = b[:, None] * v  # [C, BV]
    W = tl.dot(Tinv, X, input_precision=DOT_PREC)  # [C, BK]
    U = tl.dot(Tinv, Y, input_precision=DOT_PREC)  # [C, BV]
    Vp = U - tl.dot(W, S, input_precision=DOT_PREC)  # [C, BV]
    qG = q * Gam

    # ---- state-level backward
    dAqk = tl.where(causal_mask(C, True), scale * tl.dot(do, tl.trans(Vp), input_precision=DOT_PREC), 0.0)
    dVp = scale * tl.dot(tl.trans(Aqk), do, input_precision=DOT_PREC) \
        + tl.dot(kd, dS, input_precision=DOT_PREC)  # [C, BV]
    dqG = scale * tl.dot(do, tl.trans(S), input_precision=GRAD_PREC)  # [C, BK]
    dW = -tl.dot(dVp, tl.trans(S), input_precision=DOT_PREC)  # [C, BK]
    dkd = tl.dot(Vp, tl.trans(dS), input_precision=GRAD_PREC)  # [C, BK]
    dgC = tl.sum(S * dS, axis=1)  # [BK]
    dS_prev = gC[:, None] * dS + tl.dot(tl.trans(scale * qG), do, input_precision=DOT_PREC) \
        - tl.dot(tl.trans(W), dVp, input_precision=DOT_PREC)  # [BK, BV]

    # ---- through Tinv = (I + beta Araw)^-1
    dT = tl.dot(dW, tl.trans(X), input_precision=DOT_PREC) + tl.dot(dVp, tl.trans(Y), input_precision=DOT_PREC)
    TinvT = tl.trans(Tinv)
    dX = tl.dot(TinvT, dW, input_precision=GRAD_PREC)  # [C, BK]
    dY = tl.dot(TinvT, dVp, input_precision=DOT_PREC)  # [C, BV]
    dM = -tl.dot(tl.dot(TinvT, dT, input_precision=DOT_PREC), TinvT, input_precision=DOT_PREC)
    dM = tl.where(causal_mask(C, False), dM, 0.0)  # [C, C]
    dAkk = b[:, None] * dM
    db = tl.sum(dM * Akk, axis=1)  # [C]

    # ---- pairwise terms
    if SAFE:
        dqr = tl.dot(dAqk, ki, input_precision=GRAD_PREC)  # [C, BK]
        dkr = tl.dot(dAkk, ki, input_precision=GRAD_PREC)
        dki = tl.dot(tl.trans(dAqk), qr, input_precision=GRAD_PREC) + tl.dot(tl.trans(dAkk), kr, input_precision=GRAD_PREC)
        dq = dqr * eg
        dk = dkr * eg + dki * egi
        dG = dqr * qr + dkr * kr - dki * ki
    else:
        dq, dk, dG = _exact_pairwise_bwd(dAqk, dAkk, q, k, G, C)

    # ---- elementwise terms
    dv = b[:, None] * dY
    db += tl.sum(v * dY, axis=1) + tl.sum(k * Gam * dX, axis=1)
    dk += b[:, None] * Gam * dX
    dG += dX * X
    dq += dqG * Gam
    dG += dqG * qG
    dk += dkd * eC
    dG -= dkd * kd
    last = tl.sum(dkd * kd, axis=0) + dgC * gC  # [BK]: d/dG[C-1] through G[C-1] - G and gC
    dG += tl.where((r == C - 1)[:, None], last[None, :], 0.0)
    da = tl.cumsum(dG, axis=0, reverse=True)  # [C, BK]

    # ---- token transforms
    dx, dlog = gate_log_decay_bwd(da, x, expA, lower_bound, GATE)
    dx = tl.where(m2, dx, 0.0)
    dA_term = tl.sum(tl.sum(tl.where(m2, dlog, 0.0), axis=1), axis=0)
    ddt_term = tl.sum(dx, axis=0)  # [BK]
    if L2NORM:
        dq = l2norm_rows_bwd(dq, q, rq)
        dk = l2norm_rows_bwd(dk, k, rk)
    db_raw = beta_activation_bwd(db, b_raw, BETA_SIGMOID, NEG_EIGVAL)

    store_rows(dq_base, dq, t0, n_rows, s_dqk, 0, K, C, BK)
    store_rows(dk_base, dk, t0, n_rows, s_dqk, 0, K, C, BK)
    store_rows(dv_base, dv, t0, n_rows, s_v, 0, V, C, BV)
    store_rows(dg_base, dx, t0, n_rows, s_g, 0, K, C, BK)
    store_row_scalars(db_base, db_raw, t0, n_rows, s_b, C)
    return dS_prev, dA_term, ddt_term


# ---------------------------------------------------------------- the kernel --------------------

@triton.jit
def chunk_kda_bwd_kernel(
    q, k, v, g, beta, do, dht, ckpt, ckpt_off, cu_seqlens, A_log, dt_bias,
    dq, dk, dv, dg, dbeta, dh0, dA_part, ddt_part, ws_seg, ws_chunk,
    scale, lower_bound, T, H, HV, K, V, n_items, n_prog,
    s_dht_n, s_dht_h, s_dht_k, s_dht_v, s_dh0_n, s_dh0_h, s_dh0_k, s_dh0_v,
    GROUP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SEG_CHUNKS: tl.constexpr, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, GVA_PARTIAL: tl.constexpr, DOT_PREC: tl.constexpr,
    GRAD_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BK)
    KV = K.to(tl.int64) * V
    seg_slots = ws_seg + pid.to(tl.int64) * N_SUB * KV  # this program's level-1 states
    chunk_slots = ws_chunk + pid.to(tl.int64) * SUB_CHUNKS * KV  # this program's level-2 states
    s_qk = H * K
    s_v = HV * V
    s_g = HV * K
    if GVA_PARTIAL:
        s_dqk = HV * K
    else:
        s_dqk = H * K
    # Items are (sequence, value head) pairs; a program takes pid, pid + n_prog, ... so the
    # workspace is bounded by the grid, not by the number of sequences. Loops are while loops
    # because the interpreter cannot take range() of a program-dependent bound.
    item = pid
    while item < n_items:
        n = item // HV
        hv = item % HV
        h = hv // GROUP
        if IS_VARLEN:
            bos = tl.load(cu_seqlens + n).to(tl.int64)
            eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        else:
            bos = n.to(tl.int64) * T
            eos = bos + T
        n_rows = (eos - bos).to(tl.int32)
        q_b = q + bos * s_qk + h * K
        k_b = k + bos * s_qk + h * K
        v_b = v + bos * s_v + hv * V
        do_b = do + bos * s_v + hv * V
        dv_b = dv + bos * s_v + hv * V
        g_b = g + bos * s_g + hv * K
        dg_b = dg + bos * s_g + hv * K
        b_b = beta + bos * HV + hv
        db_b = dbeta + bos * HV + hv
        if GVA_PARTIAL:
            dq_b = dq + bos * s_dqk + hv * K
            dk_b = dk + bos * s_dqk + hv * K
        else:
            dq_b = dq + bos * s_dqk + h * K
            dk_b = dk + bos * s_dqk + h * K
        bias_p = dt_bias + hv * K
        if HAS_A:
            expA = tl.exp(tl.load(A_log + hv).to(tl.float32))
        else:
            expA = 1.0

        if HAS_DHT:
            dS = load_matrix(dht + n.to(tl.int64) * s_dht_n + hv * s_dht_h, s_dht_k, s_dht_v, K, V, 0, BK, BV)
        else:
            dS = tl.zeros([BK, BV], dtype=tl.float32)
        dA_acc = tl.sum(tl.zeros([BK], dtype=tl.float32), axis=0)
        ddt_acc = tl.zeros([BK], dtype=tl.float32)

        n_chunks = (n_rows + C - 1) // C
        first_ckpt = tl.load(ckpt_off + n)
        s = (n_chunks + SEG_CHUNKS - 1) // SEG_CHUNKS - 1
        while s >= 0:  # checkpoint segments, last first
            c0 = s * SEG_CHUNKS
            c1 = tl.minimum(n_chunks, c0 + SEG_CHUNKS)
            n_sub = (c1 - c0 + SUB_CHUNKS - 1) // SUB_CHUNKS
            # Level 1: states at every SUB_CHUNKS chunks of the segment, from its checkpoint.
            S = load_matrix(ckpt + ((first_ckpt + s) * HV + hv) * KV, V, 1, K, V, 0, BK, BV)  # [BK, BV]
            store_matrix(seg_slots, S, V, 1, K, V, 0, BK, BV)
            c = c0
            while c < c0 + (n_sub - 1) * SUB_CHUNKS:
                S = _state_step(S, k_b, v_b, g_b, b_b, bias_p, c * C, n_rows, s_qk, s_v, s_g, HV, K, V,
                                expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID,
                                NEG_EIGVAL, SAFE, DOT_PREC, INV_DOUBLING)
                c += 1
                if (c - c0) % SUB_CHUNKS == 0:
                    store_matrix(seg_slots + ((c - c0) // SUB_CHUNKS) * KV, S, V, 1, K, V, 0, BK, BV)
            tl.debug_barrier()
            u = n_sub - 1
            while u >= 0:  # sub-segments, last first
                d0 = c0 + u * SUB_CHUNKS
                d1 = tl.minimum(c1, d0 + SUB_CHUNKS)
                # Level 2: the start state of every chunk of the sub-segment.
                S = load_matrix(seg_slots + u * KV, V, 1, K, V, 0, BK, BV)
                c = d0
                while c < d1 - 1:
                    store_matrix(chunk_slots + (c - d0) * KV, S, V, 1, K, V, 0, BK, BV)
                    S = _state_step(S, k_b, v_b, g_b, b_b, bias_p, c * C, n_rows, s_qk, s_v, s_g, HV, K, V,
                                    expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID,
                                    NEG_EIGVAL, SAFE, DOT_PREC, INV_DOUBLING)
                    c += 1
                store_matrix(chunk_slots + (d1 - 1 - d0) * KV, S, V, 1, K, V, 0, BK, BV)
                tl.debug_barrier()
                c = d1 - 1
                while c >= d0:  # chunks, last first
                    S = load_matrix(chunk_slots + (c - d0) * KV, V, 1, K, V, 0, BK, BV)
                    dS, dA_t, ddt_t = _chunk_grads(
                        S, dS, q_b, k_b, v_b, g_b, b_b, bias_p, do_b, dq_b, dk_b, dv_b, dg_b, db_b,
                        c * C, n_rows, s_qk, s_v, s_g, HV, s_dqk, K, V, scale, expA, lower_bound,
                        C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID, NEG_EIGVAL, SAFE, DOT_PREC, GRAD_PREC,
                        INV_DOUBLING)
                    dA_acc += dA_t
                    ddt_acc += ddt_t
                    c -= 1
                # The next sub-segment (or segment) overwrites the slots just read.
                tl.debug_barrier()
                u -= 1
            s -= 1

        if HAS_DH0:
            store_matrix(dh0 + n.to(tl.int64) * s_dh0_n + hv * s_dh0_h, dS, s_dh0_k, s_dh0_v, K, V, 0, BK, BV)
        if HAS_A:
            tl.store(dA_part + item, dA_acc)
        if HAS_BIAS:
            tl.store(ddt_part + item.to(tl.int64) * K + cols, ddt_acc, mask=cols < K)
        item += n_prog


# ---------------------------------------------------------------- launcher ----------------------

# The last compiled launch (register and spill counts for the GPU tests and tuning).
_LAST_LAUNCH: dict = {}


def _state_strides(x: torch.Tensor, state_v_first: bool) -> tuple[int, int, int, int]:
    """(n, hv, k, v) element strides of a state tensor in either layout."""
    if state_v_first:
        return x.stride(0), x.stride(1), x.stride(3), x.stride(2)
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


def chunk_kda_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    do: torch.Tensor, dht: torch.Tensor | None, *,
    checkpoints: torch.Tensor,
    scale: float,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    safe_gate: bool,
    lower_bound: float | None,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    plan,
    ckpt_offsets: torch.Tensor | None = None,
    stage_dtype: torch.dtype = torch.float32,
    max_programs: int | None = None,
):
    """Gradients of chunked KDA from the inputs, dO, dht and the forward's sparse state checkpoints.

    Shapes: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``
    (all contiguous, same dtype); dht ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``)
    or None; checkpoints fp32 ``[plan.num_checkpoints, HV, K, V]`` (layout of ``plan.py``).
    ``plan`` supplies ``checkpoint_every_n_tokens`` (L) and ``recompute_every_n_tokens`` (L2);
    ``ckpt_offsets`` (int64 ``[N + 1]``, on the device) is computed when not given.
    ``stage_dtype`` stores the per-chunk state slots (fp32 default; bf16 halves that workspace).
    ``max_programs`` caps the grid (each program loops over (sequence, head) items), which bounds
    the workspace when there are many sequences.

    Returns ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)``: the first five in the token dtype;
    dA_log ``[HV]`` and ddt_bias ``[HV * K]`` fp32 (None when A_log / dt_bias is None); dh0 fp32 in
    initial_state's layout (None without an initial state).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("do", do)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton backward, got strides {tuple(t.stride())}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton backward supports K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}")
    if do.shape != v.shape or do.dtype != v.dtype:
        raise ValueError(f"do must match v ({list(v.shape)}, {v.dtype}), got {list(do.shape)}, {do.dtype}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    C = CHUNK
    L, L2 = int(plan.checkpoint_every_n_tokens), int(plan.recompute_every_n_tokens)
    if plan.chunk_size != C or L % L2 or L2 % C:
        raise ValueError(f"plan must have chunk_size {C} and L2 | L with C | L2, got chunk {plan.chunk_size}, "
                         f"L={L}, L2={L2}")
    if checkpoints.dtype != torch.float32 or tuple(checkpoints.shape[1:]) != (HV, K, V) \
            or not checkpoints.is_contiguous():
        raise ValueError(f"checkpoints must be contiguous fp32 [rows, {HV}, {K}, {V}], got "
                         f"{checkpoints.dtype} {list(checkpoints.shape)}")
    if checkpoints.shape[0] != plan.num_checkpoints:
        raise ValueError(f"checkpoints must have plan.num_checkpoints={plan.num_checkpoints} rows, "
                         f"got {checkpoints.shape[0]}")
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    if gate == 1 and A_log is None:
        raise ValueError("use_gate_in_kernel without lower_bound needs A_log, got None")
    if dht is not None and dht.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"dht must be a floating tensor, got {dht.dtype}")
    if ckpt_offsets is None:
        ckpt_offsets = checkpoint_offsets(cu_seqlens, B=B, T=T, every_n_tokens=L, device=q.device)

    dev = q.device
    f32 = torch.float32
    gva = HV > H
    if gva:
        dq = torch.empty(B, T, HV, K, dtype=f32, device=dev)
        dk = torch.empty(B, T, HV, K, dtype=f32, device=dev)
    else:
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    has_a = use_gate_in_kernel and A_log is not None
    has_bias = use_gate_in_kernel and dt_bias is not None
    dA_part = torch.empty(N * HV, dtype=f32, device=dev) if has_a else None
    ddt_part = torch.empty(N * HV, K, dtype=f32, device=dev) if has_bias else None
    dh0 = torch.empty(initial_state.shape, dtype=f32, device=dev) if initial_state is not None else None
    n_items = N * HV
    n_prog = max(1, n_items if max_programs is None else min(n_items, int(max_programs)))
    ws_seg = torch.empty(n_prog, L // L2, K, V, dtype=f32, device=dev)
    ws_chunk = torch.empty(n_prog, L2 // C, K, V, dtype=stage_dtype, device=dev)

    dht_strides = _state_strides(dht, state_v_first) if dht is not None else (0, 0, 0, 0)
    dh0_strides = _state_strides(dh0, state_v_first) if dh0 is not None else (0, 0, 0, 0)
    BK, BV = block_size(K), block_size(V)
    if n_items > 0:
        _LAST_LAUNCH["kernel"] = chunk_kda_bwd_kernel[(n_prog,)](
            q, k, v, g, beta, do, dht if dht is not None else q, checkpoints, ckpt_offsets,
            cu_seqlens if cu_seqlens is not None else ckpt_offsets,
            A_log if has_a else q, dt_bias if has_bias else q,
            dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else dv,
            dA_part if has_a else dv, ddt_part if has_bias else dv, ws_seg, ws_chunk,
            float(scale), float(lower_bound if lower_bound is not None else 0.0), T, H, HV, K, V, n_items, n_prog,
            *dht_strides, *dh0_strides,
            GROUP=HV // H, C=C, BK=BK, BV=BV, SEG_CHUNKS=L // C, SUB_CHUNKS=L2 // C, N_SUB=L // L2,
            GATE=gate, HAS_A=has_a, HAS_BIAS=has_bias, L2NORM=use_qk_l2norm_in_kernel,
            BETA_SIGMOID=use_beta_sigmoid_in_kernel, NEG_EIGVAL=allow_neg_eigval, SAFE=uses_safe_path(safe_gate, use_gate_in_kernel, lower_bound),
            IS_VARLEN=cu_seqlens is not None, HAS_DHT=dht is not None, HAS_DH0=dh0 is not None,
            GVA_PARTIAL=gva, DOT_PREC=_dot_precision(q.dtype), GRAD_PREC=_grad_precision(),
            INV_DOUBLING=USE_DOUBLING_INVERSE, num_warps=_num_warps(BK, BV), num_stages=1,
        )
    elif dh0 is not None:
        dh0.zero_()
    del ws_seg, ws_chunk
    if gva:
        dq = dq.view(B, T, H, HV // H, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, HV // H, K).sum(3).to(k.dtype)

    dA_log = ddt_bias = None
    if A_log is not None:
        dA_log = dA_part.view(N, HV).sum(0) if has_a else torch.zeros(HV, dtype=f32, device=dev)
    if dt_bias is not None:
        ddt_bias = ddt_part.view(N, HV * K).sum(0) if has_bias else torch.zeros(HV * K, dtype=f32, device=dev)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
