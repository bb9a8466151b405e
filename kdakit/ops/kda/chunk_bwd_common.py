"""Per-chunk pieces of the chunked-KDA backward (``chunk_bwd_windowed.py``): matmul precision,
the EXACT pairwise products and one state step. Every gradient of one chunk given the state
before it and the state gradient after it is ``chunk_bwd_windowed._chunk_grads_vloop``.

Math (one chunk of C = 16 rows, state S ``[K, V]`` before it; see ``reference/chunk_bwd.py``, the
float64 twin checked against autograd)::

    G = cumsum(a), Gam = exp(G), gC = exp(G[C-1]), kd = k exp(G[C-1] - G)
    Araw = sum_c k_i k_j E_ij (j < i), Aqk = sum_c q_i k_j E_ij (j <= i), E_ij = exp(G_i - G_j)
    Tinv = (I + beta Araw)^-1, W = Tinv (beta k Gam), U = Tinv (beta v), V' = U - W S
    forward:  O = scale ((q Gam) S + Aqk V'),  S_next = gC S + kd^T V'
    backward: dAqk = scale dO V'^T, dV' = scale Aqk^T dO + kd dS_next,
              dS = gC dS_next + scale (q Gam)^T dO - W^T dV', then dW, dU, dTinv -> dAraw, and the
              pairwise, decay and transform terms (l2norm, gate, beta sigmoid), derived in reference/chunk_bwd.py.

Pairwise matrices: SAFE (``safe_gate``: a >= -5) factors E through a mid-chunk reference and uses
``tl.dot``; EXACT (any gate) forms ``exp(G_i - G_j)`` for one column j at a time on ``[C, BK]``
tiles, never ``exp(-G)``, so log-decays of -1000 stay finite.

Layouts: q, k ``[B, T, H, K]``; v, dO ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``, all
contiguous (token-major); checkpoints ``[rows, HV, K, V]`` (``plan.checkpoint_dtype``); dht / dh0 in the state layout
(K-major or ``state_v_first``), read and written through strides.
Limits: K, V <= 128 (powers of two are fastest; others are masked). Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk_common import (
    beta_lower_inverse,
    l2norm_rows,
    load_chunk_beta,
    load_chunk_gate,
    load_rows,
    pairwise_dot,
    round_to_bf16,
    row_of,
    safe_gate_factors,
    seq_bounds,
)
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
CHUNK = 16
# (I + A)^-1 by repeated squaring (six small dots) instead of 15 dependent row updates.
USE_DOUBLING_INVERSE = True


# The products that feed the decay gradient (pairwise terms, dkd, dqG, dX) lose too much to TF32
# rounding: with TF32 there the windowed backward fails the GPU tier's ddt_bias limit (docs/perf_notes.md,
# "Launch configs"); 3xTF32 there.
def grad_precision() -> str:
    return "ieee" if triton_interpreting() else "tf32x3"


# bf16 inputs: those products take bf16 operands (rounded to nearest: unbiased, unlike Triton's
# truncating TF32) and fp32 accumulation, the decay gradient being formed from the same rounded
# operands so its cancelling terms cancel exactly; fp16 and fp32 inputs keep 3xTF32.
GRAD_OP_FP32, GRAD_OP_BF16, GRAD_OP_BF16_EMULATED = 0, 1, 2


def grad_operands(dtype: torch.dtype) -> tuple[int, str]:
    """(GRAD_OP, GRAD_PREC) of the decay-gradient products for inputs of ``dtype``."""
    if dtype != torch.bfloat16:
        return GRAD_OP_FP32, grad_precision()
    if triton_interpreting():
        return GRAD_OP_BF16_EMULATED, "ieee"
    return GRAD_OP_BF16, "tf32"  # the precision is unused with bf16 operands


@triton.jit
def grad_operand(x, GRAD_OP: tl.constexpr):
    """An operand of a decay-gradient product: bf16 (GRAD_OP 1), fp32 rounded like bf16 (2, the
    interpreter, whose bf16 dot is wrong), or fp32 (0)."""
    if GRAD_OP == 1:
        y = x.to(tl.bfloat16)
    elif GRAD_OP == 2:
        y = round_to_bf16(x.to(tl.float32))
    else:
        y = x.to(tl.float32)
    return y


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

    With E_ij = exp(G_i - G_j) (j <= i): the query-side terms dx_i = sum_j dA_ij k_j E_ij and the
    key-side terms dk_j = sum_i (dAqk_ij q_i + dAkk_ij k_i) E_ij, in two loops over the columns j;
    the decay gradient follows from them, dG = q dq + k dk_query - k dk_key, since each pair's
    dA_ij x_i k_j E_ij enters dG_i with + and dG_j with -. (One loop carrying dq, dk and dG made the
    8-warp sm_90a build of the window-gradient kernel fall back to 32 registers: see
    ``chunk_bwd_windowed.GRADS_EXACT_NUM_WARPS``.)
    """
    r = tl.arange(0, C)
    dq = tl.zeros(q.shape, dtype=tl.float32)
    dkq = tl.zeros(q.shape, dtype=tl.float32)
    for j in range(C):
        Gj = row_of(G, j, C)
        kj = row_of(k, j, C)
        keep = (r >= j)[:, None]
        E = tl.where(keep, tl.exp(tl.where(keep, G - Gj[None, :], 0.0)), 0.0)  # [C, BK]
        is_j = (r == j)[None, :]
        cq = tl.sum(tl.where(is_j, dAqk, 0.0), axis=1)  # [C] column j
        ck = tl.sum(tl.where(is_j, dAkk, 0.0), axis=1)
        kE = kj[None, :] * E
        dq += cq[:, None] * kE
        dkq += ck[:, None] * kE
    dkk = tl.zeros(q.shape, dtype=tl.float32)
    for j in range(C):
        Gj = row_of(G, j, C)
        keep = (r >= j)[:, None]
        E = tl.where(keep, tl.exp(tl.where(keep, G - Gj[None, :], 0.0)), 0.0)  # [C, BK]
        is_j = (r == j)[None, :]
        cq = tl.sum(tl.where(is_j, dAqk, 0.0), axis=1)
        ck = tl.sum(tl.where(is_j, dAkk, 0.0), axis=1)
        tsum = tl.sum((cq[:, None] * q + ck[:, None] * k) * E, axis=0)  # [BK]: d k_j
        dkk += tl.where((r == j)[:, None], tsum[None, :], 0.0)
    dG = q * dq + k * dkq - k * dkk
    return dq, dkq + dkk, dG


@triton.jit
def sequence_chunks(cu_seqlens, n, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence n's first token (int64), its token count and its number of C-token chunks (int32)."""
    bos, eos = seq_bounds(cu_seqlens, n, T, IS_VARLEN)
    n_rows = (eos - bos).to(tl.int32)
    return bos, n_rows, (n_rows + C - 1) // C


@triton.jit
def state_program(cu_seqlens, T, HV, C: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A state-walk program's place on the grid ``(N * HV, cdiv(V, BV), ...)``: its (sequence, value head)
    item, first value column, sequence, value head, and its sequence's first token, token count and chunk
    count. -> (item, v0, n, hv, bos, n_rows, n_chunks)"""
    item = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    n = item // HV
    hv = item % HV
    bos, n_rows, n_chunks = sequence_chunks(cu_seqlens, n, T, C, IS_VARLEN)
    return item, v0, n, hv, bos, n_rows, n_chunks


@triton.jit
def decay_scale(A_log, hv, HAS_A: tl.constexpr):
    """``exp(A_log[hv])``, the softplus gate's scale of value head hv (1 without A_log), fp32."""
    if HAS_A:
        expA = tl.exp(tl.load(A_log + hv).to(tl.float32))
    else:
        expA = 1.0
    return expA


@triton.jit
def chunk_keys_gate_beta(k_base, g_base, b_base, bias_ptr, t0, n_rows, s_qk, s_g, s_b, K, expA, lower_bound,
                         C: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """The token side of a 16-token chunk that both state walks (forward state and dS) start from:
    -> (k ``[C, BK]``, l2-normalized with L2NORM; beta ``[C]``; G ``[C, BK]``, the in-chunk cumsum of the
    clamped log-decay; GC ``[BK]``, its last row)."""
    k = load_rows(k_base, t0, n_rows, s_qk, 0, K, C, BK)  # [C, BK]
    if L2NORM:
        k, _ = l2norm_rows(k)
    a = load_chunk_gate(g_base, bias_ptr, t0, n_rows, s_g, 0, K, expA, lower_bound, C, BK, GATE, HAS_BIAS)
    b = load_chunk_beta(b_base, t0, n_rows, s_b, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]
    G = tl.cumsum(a, axis=0)  # [C, BK]
    return k, b, G, row_of(G, C - 1, C)


@triton.jit
def state_step(S, k_base, v_base, g_base, b_base, bias_ptr, t0, n_rows, s_qk, s_v, s_g, s_b, K, V,
                expA, lower_bound, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
                DOT_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr):
    """State after the chunk starting at row t0: ``gC S + kd^T (U - W S)``. S ``[BK, BV]`` fp32."""
    k, b, G, GC = chunk_keys_gate_beta(k_base, g_base, b_base, bias_ptr, t0, n_rows, s_qk, s_g, s_b, K, expA,
                                       lower_bound, C, BK, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID, NEG_EIGVAL)
    v = load_rows(v_base, t0, n_rows, s_v, 0, V, C, BV)  # [C, BV]
    if SAFE:
        eg, egi = safe_gate_factors(G, C)
        Araw = pairwise_dot(k * eg, k * egi, C, False, DOT_PREC)  # [C, C]
    else:
        Araw = exact_kk(k, G, C)
    Tinv = beta_lower_inverse(b, Araw, C, INV_DOUBLING)  # [C, C]
    W = tl.dot(Tinv, b[:, None] * k * tl.exp(G), input_precision=DOT_PREC)  # [C, BK]
    U = tl.dot(Tinv, b[:, None] * v, input_precision=DOT_PREC)  # [C, BV]
    Vp = U - tl.dot(W, S, input_precision=DOT_PREC)  # [C, BV]
    kd = k * tl.exp(GC[None, :] - G)  # [C, BK]
    return tl.exp(GC)[:, None] * S + tl.dot(tl.trans(kd), Vp, input_precision=DOT_PREC)


def state_strides(x: torch.Tensor, state_v_first: bool) -> tuple[int, int, int, int]:
    """(n, hv, k, v) element strides of a state tensor in either layout."""
    if state_v_first:
        return x.stride(0), x.stride(1), x.stride(3), x.stride(2)
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


