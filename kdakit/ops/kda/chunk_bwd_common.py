"""Per-chunk backward pieces shared by both chunked-KDA backward algorithms (``chunk_bwd.py``,
``chunk_bwd_windowed.py``): precision and warp settings, the EXACT pairwise products, one state
step, and every gradient of one chunk given the state before it and the state gradient after it.

Math (one chunk of C = 16 rows, state S ``[K, V]`` before it; see ``chunk_bwd_reference.py``, the
float64 twin checked against autograd)::

    G = cumsum(a), Gam = exp(G), gC = exp(G[C-1]), kd = k exp(G[C-1] - G)
    Araw = sum_c k_i k_j E_ij (j < i), Aqk = sum_c q_i k_j E_ij (j <= i), E_ij = exp(G_i - G_j)
    Tinv = (I + beta Araw)^-1, W = Tinv (beta k Gam), U = Tinv (beta v), V' = U - W S
    forward:  O = scale ((q Gam) S + Aqk V'),  S_next = gC S + kd^T V'
    backward: dAqk = scale dO V'^T, dV' = scale Aqk^T dO + kd dS_next,
              dS = gC dS_next + scale (q Gam)^T dO - W^T dV', then dW, dU, dTinv -> dAraw, and the
              pairwise, decay and transform terms (l2norm, gate, beta sigmoid) of the design note.

Pairwise matrices: SAFE (``safe_gate``: a >= -5) factors E through a mid-chunk reference and uses
``tl.dot``; EXACT (any gate) forms ``exp(G_i - G_j)`` for one column j at a time on ``[C, BK]``
tiles, never ``exp(-G)``, so log-decays of -1000 stay finite.

Layouts: q, k ``[B, T, H, K]``; v, dO ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``, all
contiguous (token-major); checkpoints fp32 ``[rows, HV, K, V]``; dht / dh0 in the state layout
(K-major or ``state_v_first``), read and written through strides.
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
    causal_mask,
    gate_log_decay,
    gate_log_decay_bwd,
    l2norm_rows,
    l2norm_rows_bwd,
    load_chunk_beta,
    load_chunk_gate,
    load_row_scalars,
    load_rows,
    row_of,
    safe_gate_factors,
    store_row_scalars,
    store_rows,
    unit_lower_inverse,
    unit_lower_inverse_doubling,
)
CHUNK = 16
MAX_HEAD_DIM = 128
# (I + A)^-1 by repeated squaring (six small dots) instead of 15 dependent row updates.
USE_DOUBLING_INVERSE = True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Matmuls of fp32 tiles: TF32 for 16-bit inputs (already rounded coarser than TF32), 3xTF32 for
# fp32 inputs, exact in the interpreter (the forward makes the same choice).
def dot_precision(dtype: torch.dtype) -> str:
    if interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


# The products that feed the decay gradient (pairwise terms, dkd, dqG, dX) lose too much to TF32
# rounding (dg / ddt_bias RMS ratio 6e-3 / 2e-2 measured at 2K tokens): 3xTF32 there.
def grad_precision() -> str:
    return "ieee" if interpreting() else "tf32x3"


def streaming_num_warps(BK: int, BV: int) -> int:
    # S and dS ([BK, BV] fp32 each) live in registers together: 8 warps keep them at 64 registers
    # per thread each for 128 x 128.
    return 8 if BK * BV >= 64 * 64 else 4


# ---------------------------------------------------------------- per-chunk helpers -------------

@triton.jit
def exact_kk(k, G, C: tl.constexpr):
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
def exact_qk_kk(q, k, G, C: tl.constexpr):
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
def exact_pairwise_bwd(dAqk, dAkk, q, k, G, C: tl.constexpr):
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
def state_step(S, k_base, v_base, g_base, b_base, bias_ptr, t0, n_rows, s_qk, s_v, s_g, s_b, K, V,
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
        Araw = exact_kk(k, G, C)
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
def chunk_grads(S, dS, q_base, k_base, v_base, g_base, b_base, bias_ptr, do_base,
                 dq_base, dk_base, dv_base, dg_base, db_base, t0, n_rows,
                 s_qk, s_v, s_g, s_b, s_dqk, K, V, scale, expA, lower_bound,
                 C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                 BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
                 DOT_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr,
                 STORE_QK: tl.constexpr):
    """Every gradient of one chunk's tokens (stored), and dS before the chunk.

    S: state before the chunk, dS: dL/dS after it, both ``[BK, BV]`` fp32.
    Returns (dS_prev ``[BK, BV]``, dA_log term (scalar), ddt_bias term ``[BK]``, dq, dk ``[C, BK]``
    (raw-input gradients)). Without STORE_QK, dq and dk are only returned (the caller sums a
    GVA group in registers and stores once).
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
        Aqk, Akk = exact_qk_kk(q, k, G, C)
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
        dq, dk, dG = exact_pairwise_bwd(dAqk, dAkk, q, k, G, C)

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

    if STORE_QK:
        store_rows(dq_base, dq, t0, n_rows, s_dqk, 0, K, C, BK)
        store_rows(dk_base, dk, t0, n_rows, s_dqk, 0, K, C, BK)
    store_rows(dv_base, dv, t0, n_rows, s_v, 0, V, C, BV)
    store_rows(dg_base, dx, t0, n_rows, s_g, 0, K, C, BK)
    store_row_scalars(db_base, db_raw, t0, n_rows, s_b, C)
    return dS_prev, dA_term, ddt_term, dq, dk




# The last compiled launch (register and spill counts for the GPU tests and tuning).
LAST_LAUNCH: dict = {}


def state_strides(x: torch.Tensor, state_v_first: bool) -> tuple[int, int, int, int]:
    """(n, hv, k, v) element strides of a state tensor in either layout."""
    if state_v_first:
        return x.stride(0), x.stride(1), x.stride(3), x.stride(2)
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


