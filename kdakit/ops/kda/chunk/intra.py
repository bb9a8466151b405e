"""The forward's intra-chunk stage of the 64-token pipeline (docs/chunk_pipeline.md): the pairwise matrices of
a chunk and the inverse of its WY system.

Per table row i (a chunk of L <= 64 tokens) and value head hv, with q̂ = rq * q, k̂ = rk * k (q/k head
h = hv // (HV // H)) and G the chunk cumsum of the log-decay (``gc``):

    Aqk[r, j]  = scale * sum_c q̂[r, c] k̂[j, c] exp(G[r, c] - G[j, c])    j <= r   (0 above the diagonal)
    Akk[r, j]  =         sum_c k̂[r, c] k̂[j, c] exp(G[r, c] - G[j, c])    j <  r
    Tinv       = (I + diag(bt) Akk)^-1                                     unit lower triangular

The diagonal 16 x 16 blocks take one of two forms, chosen per (chunk, sub-chunk, value head) at run time by
the **span check**: with G_mid = G at the sub-chunk's middle row mid = min(16 I + 8, L - 1), the sub-chunk
passes when every key channel has |G - G_mid| <= DIAG_DOT_SPAN (40) on every row of the sub-chunk (padded rows
count as row L - 1). G is non-increasing along the rows (log-decays <= 0, the premise of the strips' bound
below too), so per channel the largest |G - G_mid| sits at the first or the last row: the check reads those two
rows and mid. A NaN gate makes G NaN from its row on, up to the sub-chunk's last row, and a NaN compares false:
such a sub-chunk fails. With SAFE (the gate is known to be >= -5 per token, so 8 tokens span at most 40) every
sub-chunk is taken as passing and the diag kernel is not launched.

* passing sub-chunks, by dots in the solve kernel (the backward's SAFE form, grads_intra._diag_safe):
  ``(x_I exp(G_I - G_mid)) (k̂_I exp(G_mid - G_I))^T``, both factors within exp(+-40), so the 16-bit operands
  neither overflow nor flush; Aqk's block lower incl. the diagonal, Akk's strictly lower.
* failing sub-chunks (log-decays reach -110 per token), token-parallel in ``chunk_intra_diag_kernel``: one
  program per (chunk row r, group of BH value heads) runs the same check and exits at once unless one of its
  heads fails; then it forms row r of the diagonal blocks pair by pair, ``exp(G_r - G_j)`` for the <= 16
  earlier tokens j of r's sub-chunk (never exp(-G) of a running sum), and stores each pair as it is formed:
  aqk's row r over the diagonal block's columns (zeros right of the diagonal; all zeros on padded rows r >= L)
  and akk_d's row r (``Akk[r, 16 * (r // 16) + jj]``, 0 for jj >= r % 16). Rows of passing sub-chunks of akk_d
  are not written.

Kernels:

* ``chunk_intra_diag_kernel`` (above), launched before the solve kernel unless SAFE.
* ``chunk_intra_solve_kernel``, grid (n, HV): the six blocks strictly below the diagonal blocks of Aqk and
  Akk by tensor-core dots, as three column strips ``[64, 16]`` (M = 64 spreads a dot over the warps; a
  16-row dot is replicated in every warp). Strip J holds the blocks (I, J), I > J, with the reference
  ``ref_J = G[16 J + 15]``, the last row of sub-chunk J: ``(x_i exp(G_i - ref_J)) (k̂_j exp(ref_J - G_j))^T``,
  both factors <= 1 for any gate (G is non-increasing along the rows); the row factor is formed once per key
  block as ``exp(G_i - R_i)`` (R_i = G at the last row before row i's sub-chunk) times the per-sub-chunk
  vector ``exp(R_i - ref_J) <= 1``. Then the diagonal blocks of the passing sub-chunks by dots (Aqk's stored,
  Akk's kept in registers; a failing sub-chunk's Akk block is read from akk_d), after the strips so that
  their tiles are not live together. Then Tinv: the four diagonal blocks ``(I + diag(bt) Akk_II)^-1`` by
  forward substitution on rows of those Akk blocks, the off-diagonal blocks by block substitution
  ``T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ`` (A = diag(bt) Akk) with fp32 dots. It stores aqk's blocks below
  and above the diagonal blocks (zeros above) and the whole of tinv (exact zeros above the diagonal; padded
  rows are unit rows, bt being 0 there).

Layouts: q, k ``[B, T, H, K]`` token tensors read through their strides (unit last stride); slots (contiguous)
gc fp32 ``[n, HV, C, K]``, bt fp32 ``[n, HV, C]``, rq, rk fp32 ``[n, H, C]``; outputs aqk, tinv
``[n, HV, C, C]`` in the token dtype; akk_d fp32 ``[n, HV, C, 16]``, the channel from the diag kernel to the
solve kernel (rows of failing sub-chunks only). Limits: K <= 128, HV a multiple of H.

Products of 16-bit inputs use bf16 dot operands (fp16 too, for the exponent range); fp32 inputs use fp32
operands at ``backend.dot_precision``; the token-parallel pairs are fp32 sums. The inverse stays fp32, its dots at fp32 precision (3xTF32 on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk.tiles import CHUNK, MAX_HEAD_DIM, SUB, check_token_strides, chunk_row, dot_operand, token_base
from kdakit.ops.kda.chunk_common import block_size, load_row_scalars, round_to_bf16_if

# The span check's bound: a sub-chunk whose |G - G_mid| stays <= 40 on every row and channel has its diagonal
# blocks formed by dots, with factors within exp(+-40): the envelope of the safe gate (8 tokens x 5 per token on
# either side of the middle row), the one the backward's SAFE dots use and the GPU tier validates.
DIAG_DOT_SPAN = 40.0
DIAG_DOT_SPAN_TL = tl.constexpr(DIAG_DOT_SPAN)

# launch configs
DIAG_BLOCK_H = 2  # value heads per token-parallel program ([BH, BK] tiles)
DIAG_NUM_WARPS = 1
SOLVE_BLOCK_K = 32  # key channels per step of the off-diagonal dots, 16-bit inputs (bf16 operands)
SOLVE_BLOCK_K_FP32 = 16  # fp32 inputs (3xTF32 operands: 32 takes 238 sm_90a registers, 16 takes 180)
SOLVE_NUM_WARPS = {"bf16": 2, "fp32": 4}  # by operand kind
# The bf16 solve kernel keeps a small spill at 2 warps (sm_90a ptxas: ~300 B; the diagonal blocks' dots, formed
# after the strips, do not raise it by more than a few dozen bytes in either SAFE variant): measured on the H200
# the 2-warp build was faster than the spill-free 4-warp one (docs/perf_notes.md, "Launch configs").
SOLVE_SPILL_BUDGET = {"bf16": 340, "fp32": 0}  # bytes of spill stores + loads the build test allows


def solve_block_k(op_bf16: bool, BK: int) -> int:
    """The solve kernel's key block: SOLVE_BLOCK_K (bf16 operands) or SOLVE_BLOCK_K_FP32, at most BK."""
    return min(SOLVE_BLOCK_K if op_bf16 else SOLVE_BLOCK_K_FP32, BK)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _load_tile(base, ROW0: tl.constexpr, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """``x[ROW0 + r, col0 + c]`` of a row-major slab (unit column stride) as fp32 ``[BR, BC]``; rows ``>= n_rows``
    and columns ``>= n_cols`` read as 0 (ROW0 < C: the int32 offsets stay small)."""
    rl = tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (ROW0 + rl < n_rows)[:, None] & (c < n_cols)[None, :]
    ptrs = base + (ROW0 + rl)[:, None] * stride_row + c[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # [BR, BC]


@triton.jit
def _load_block(base, I: tl.constexpr, SB: tl.constexpr):
    """Rows ``SB * I + [0, SB)`` of a contiguous fp32 ``[C, SB]`` slot (akk_d's diagonal block I)."""
    r = tl.arange(0, SB)
    return tl.load(base + (SB * I + r)[:, None] * SB + r[None, :])  # [SB, SB]


@triton.jit
def _store_block(base, x, I: tl.constexpr, J: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
                 ROUND: tl.constexpr):
    """Block (I, J) ``[SB, SB]`` of a contiguous ``[C, C]`` slot, cast to its dtype (bf16 rounding emulated
    under the interpreter when ROUND)."""
    r = tl.arange(0, SB)
    ptrs = base + (SB * I + r)[:, None] * C + (SB * J + r)[None, :]
    tl.store(ptrs, round_to_bf16_if(x, ROUND).to(base.dtype.element_ty))


@triton.jit
def _col_operand(k_base, g_base, rk_base, ref, ROW0: tl.constexpr, L, skt, c0, K: tl.constexpr,
                 SB: tl.constexpr, BK: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Column sub-chunk ROW0 // SB as the right operand: ``(k̂_J exp(ref - G_J))^T`` ``[BK, SB]``, ref = G at
    the sub-chunk's last row (factors <= 1)."""
    g = _load_tile(g_base, ROW0, ROW0 + SB, K, c0, K, SB, BK)  # [SB, BK]
    rk_j = load_row_scalars(rk_base, ROW0, L, 1, SB)  # [SB]
    y = _load_tile(k_base, ROW0, L, skt, c0, K, SB, BK) * rk_j[:, None] * tl.exp(ref[None, :] - g)
    return dot_operand(tl.trans(y), OP_BF16, EMULATE_BF16)  # [BK, SB]


@triton.jit
def _store_strip(base, x, J: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, ROUND: tl.constexpr):
    """Rows ``>= SB (J + 1)`` of column strip J ``[C, SB]`` into columns ``SB J + [0, SB)`` of a ``[C, C]`` slot."""
    r = tl.arange(0, C)
    cc = tl.arange(0, SB)
    ptrs = base + r[:, None] * C + (SB * J + cc)[None, :]
    tl.store(ptrs, round_to_bf16_if(x, ROUND).to(base.dtype.element_ty), mask=(r >= SB * (J + 1))[:, None])


@triton.jit
def _row_blocks(x, SB: tl.constexpr):
    """The four ``[SB, SB]`` row blocks of a ``[4 SB, SB]`` strip."""
    y = tl.permute(tl.reshape(x, (2, 2, SB, SB)), (2, 3, 0, 1))  # [SB, SB, 2, 2], block 2 a + b at [.., a, b]
    even, odd = tl.split(y)  # b = 0, 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _substitution_row(akk_t, b_s, X, s, r):
    """Row s of ``X = (I + A)^-1 - I`` for a diagonal block, A = b * Akk strictly lower, from the block's
    transpose ``akk_t[j, i] = Akk[i, j]`` ``[SB, SB]``: ``X[s] = -A[s] - sum_j A[s, j] X[j]`` (rows j < s of X
    final). Column s of akk_t is picked by a masked sum (exact: one term per entry)."""
    a = -b_s * tl.sum(tl.where((r == s)[None, :], akk_t, 0.0), axis=1)  # [SB] A[s, j] by j
    a = tl.where(r < s, a, 0.0)
    a = a + tl.sum(a[:, None] * X, axis=0)  # [SB]
    return tl.where((r == s)[:, None], a[None, :], X)


@triton.jit
def _span_bad(g_first, g_mid, g_last):
    """1 where a key channel fails the span check (|G - G_mid| > DIAG_DOT_SPAN at the sub-chunk's first or last
    row, or a NaN), else 0 (int32, elementwise). The one form of both kernels, so that they agree bit for bit."""
    ok = (tl.abs(g_first - g_mid) <= DIAG_DOT_SPAN_TL) & (tl.abs(g_last - g_mid) <= DIAG_DOT_SPAN_TL)
    return tl.where(ok, 0, 1)


@triton.jit
def _diag_block(q_base, k_base, g_base, rq_base, rk_base, aqk_base, d_base, scale, L, sqt, skt,
                I: tl.constexpr, K: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
                OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, ROUND: tl.constexpr,
                SAFE: tl.constexpr):
    """Sub-chunk I's diagonal block of Akk, transposed (``[SB, SB]``, entry [j, i] = Akk[16 I + i, 16 I + j]).

    Passing the span check (always with SAFE): by dots with the middle row as reference, storing aqk's diagonal
    block (lower incl. the diagonal, zeros above) too. Failing: read from akk_d, whose rows (and aqk's block)
    the diag kernel wrote."""
    r0 = SB * I
    a = tl.arange(0, SB)
    rows = tl.minimum(r0 + a, L - 1)  # [SB] padded rows read G as row L - 1
    mid = tl.minimum(r0 + SB // 2, L - 1)
    passed = True
    if not SAFE:
        bad = tl.zeros([BK], dtype=tl.int32)
        for c0 in range(0, K, BK):
            c = c0 + tl.arange(0, BK)
            m_c = c < K
            bad += _span_bad(tl.load(g_base + tl.minimum(r0, L - 1) * K + c, mask=m_c, other=0.0),
                             tl.load(g_base + mid * K + c, mask=m_c, other=0.0),
                             tl.load(g_base + tl.minimum(r0 + SB - 1, L - 1) * K + c, mask=m_c, other=0.0))
        passed = tl.sum(bad) == 0
    if passed:
        acc_q = tl.zeros([SB, SB], dtype=tl.float32)
        acc_k = tl.zeros([SB, SB], dtype=tl.float32)  # transposed
        rq_i = load_row_scalars(rq_base, r0, L, 1, SB)  # [SB]
        rk_i = load_row_scalars(rk_base, r0, L, 1, SB)
        for c0 in range(0, K, BK):
            c = c0 + tl.arange(0, BK)
            m_c = c < K
            g = tl.load(g_base + rows[:, None] * K + c[None, :], mask=m_c[None, :], other=0.0)  # [SB, BK]
            g_mid = tl.load(g_base + mid * K + c, mask=m_c, other=0.0)[None, :]  # [1, BK]
            ef = tl.exp(g - g_mid)  # [SB, BK] within exp(+-40)
            eb = tl.exp(g_mid - g)
            k_i = _load_tile(k_base, r0, L, skt, c0, K, SB, BK) * rk_i[:, None]  # [SB, BK]
            x_q = dot_operand(_load_tile(q_base, r0, L, sqt, c0, K, SB, BK) * rq_i[:, None] * ef, OP_BF16,
                              EMULATE_BF16)
            x_k = dot_operand(k_i * ef, OP_BF16, EMULATE_BF16)
            y = dot_operand(k_i * eb, OP_BF16, EMULATE_BF16)
            acc_q = tl.dot(x_q, tl.trans(y), acc=acc_q, input_precision=DOT_PREC)  # [SB, SB] Aqk_II / scale
            acc_k = tl.dot(y, tl.trans(x_k), acc=acc_k, input_precision=DOT_PREC)  # [SB, SB] Akk_II^T
        _store_block(aqk_base, tl.where(a[:, None] >= a[None, :], acc_q * scale, 0.0), I, I, C, SB, ROUND)
        akk_t = tl.where(a[:, None] < a[None, :], acc_k, 0.0)  # Akk strictly lower
    else:
        akk_t = tl.load(d_base + (r0 + a)[None, :] * SB + a[:, None])  # [SB, SB] akk_d[r0 + i, j] at [j, i]
    return akk_t


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_intra_diag_kernel(
    table, q, k, gc, rq, rk, aqk, akk_d, scale,
    sqb, sqt, sqh, skb, skt, skh, H, HV,
    K: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Program (table row i and chunk row r, BH value heads): row r of the diagonal blocks of Aqk and Akk of the
    heads whose sub-chunk fails the span check, each pair (r, j) stored as it is formed."""
    pid = tl.program_id(0)
    i = pid // C
    r = pid % C  # the program's chunk row
    n, b, t0, L = chunk_row(table, i)
    hv = tl.program_id(1) * BH + tl.arange(0, BH)  # [BH]
    m_h = hv < HV
    h = hv // (HV // H)  # [BH] q/k heads
    c = tl.arange(0, BK)
    m_hk = m_h[:, None] & (c < K)[None, :]  # [BH, BK]
    live = r < L
    s0 = (r // SB) * SB  # the sub-chunk's first row

    slot_h = i.to(tl.int64) * HV + hv  # [BH] (slot, value head) rows
    qk_h = i.to(tl.int64) * H + h  # [BH] (slot, q/k head) rows
    q_ptr = q + b * sqb + t0 * sqt + (h.to(tl.int64) * sqh)[:, None] + c[None, :]  # [BH, BK] at row 0
    k_ptr = k + b * skb + t0 * skt + (h.to(tl.int64) * skh)[:, None] + c[None, :]
    g_ptr = gc + (slot_h * (C * K))[:, None] + c[None, :]  # [BH, BK] at row 0
    aqk_row = aqk + (slot_h * C + r) * C  # [BH] row r of each head's Aqk
    akk_row = akk_d + (slot_h * C + r) * SB  # [BH] row r of each head's akk_d

    # the span check of r's sub-chunk per head (the solve kernel forms the passing ones by dots)
    bad = _span_bad(tl.load(g_ptr + tl.minimum(s0, L - 1) * K, mask=m_hk, other=0.0),
                    tl.load(g_ptr + tl.minimum(s0 + SB // 2, L - 1) * K, mask=m_hk, other=0.0),
                    tl.load(g_ptr + tl.minimum(s0 + SB - 1, L - 1) * K, mask=m_hk, other=0.0))  # [BH, BK]
    m_h = m_h & (tl.sum(bad, axis=1) > 0)
    if tl.sum(m_h.to(tl.int32)) == 0:
        return
    m_hk = m_h[:, None] & (c < K)[None, :]

    # zeros: the diagonal block's row right of the diagonal (all of it on padded rows); the pairs below write
    # the rest
    jj = tl.arange(0, SB)
    first_zero = tl.where(live, r + 1, s0) - s0  # [] first zero column within the block
    tl.store(aqk_row[:, None] + (s0 + jj)[None, :], tl.zeros([BH, SB], dtype=aqk.dtype.element_ty),
             mask=m_h[:, None] & (jj >= first_zero)[None, :])
    tl.store(akk_row[:, None] + jj[None, :], tl.zeros([BH, SB], dtype=tl.float32),
             mask=m_h[:, None] & (jj >= first_zero)[None, :])

    m_r = m_hk & live
    q_r = tl.load(q_ptr + r.to(tl.int64) * sqt, mask=m_r, other=0.0).to(tl.float32)  # [BH, BK]
    k_r = tl.load(k_ptr + r.to(tl.int64) * skt, mask=m_r, other=0.0).to(tl.float32)
    g_r = tl.load(g_ptr + r * K, mask=m_r, other=0.0)  # [BH, BK]
    rq_r = tl.load(rq + qk_h * C + r, mask=m_h & live, other=0.0)  # [BH]
    rk_r = tl.load(rk + qk_h * C + r, mask=m_h & live, other=0.0)
    q_r = q_r * (scale * rq_r)[:, None]
    k_r = k_r * rk_r[:, None]

    hi = r + 1
    if not live:
        hi = s0  # padded rows: no pair
    j = s0
    while j < hi:  # a while loop: the interpreter cannot take range() of a program-dependent bound
        k_j = tl.load(k_ptr + j.to(tl.int64) * skt, mask=m_hk, other=0.0).to(tl.float32)  # [BH, BK]
        g_j = tl.load(g_ptr + j * K, mask=m_hk, other=0.0)
        rk_j = tl.load(rk + qk_h * C + j, mask=m_h, other=0.0)  # [BH]
        kg = k_j * tl.exp(g_r - g_j) * rk_j[:, None]  # [BH, BK], exponent <= 0
        s_qk = tl.sum(q_r * kg, axis=1)  # [BH]
        tl.store(aqk_row + j, round_to_bf16_if(s_qk, ROUND).to(aqk.dtype.element_ty), mask=m_h)
        s_kk = tl.sum(k_r * kg, axis=1)
        tl.store(akk_row + (j - s0), tl.where(j < r, s_kk, 0.0), mask=m_h)
        j += 1


@triton.jit
def chunk_intra_solve_kernel(
    table, q, k, gc, bt, rq, rk, aqk, akk_d, tinv, scale,
    sqb, sqt, sqh, skb, skt, skh, H, HV,
    K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
    ROUND: tl.constexpr, SAFE: tl.constexpr,
):
    """Program (table row i, value head hv): Aqk's blocks but the failing sub-chunks' diagonal ones, Tinv."""
    i = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    n, b, t0, L = chunk_row(table, i)
    slot = i.to(tl.int64) * HV + hv
    q_base = token_base(q, b, t0, h, sqb, sqt, sqh)
    k_base = token_base(k, b, t0, h, skb, skt, skh)
    g_base = gc + slot * (C * K)
    rq_base = rq + (i.to(tl.int64) * H + h) * C
    rk_base = rk + (i.to(tl.int64) * H + h) * C
    rows = tl.arange(0, C)
    sub = (rows // SB)[:, None]  # [C, 1] row sub-chunk I
    m_rows = rows < L
    rqs = tl.load(rq_base + rows, mask=m_rows, other=0.0)  # [C]
    rks = tl.load(rk_base + rows, mask=m_rows, other=0.0)
    ref_rows = tl.maximum(rows // SB * SB - 1, 0)  # [C] the last row of sub-chunk I - 1 (row 0 for I = 0)

    # the off-diagonal blocks as column strips: strip J [C, SB] holds blocks (I, J), I > J, in rows >= 16 (J + 1);
    # with ref_J = G[16 (J + 1) - 1] (the last row of sub-chunk J) a block is
    # (x_I exp(G_I - ref_J)) (k̂_J exp(ref_J - G_J))^T, both factors <= 1; the row factor is formed as
    # exp(G_i - R_i) exp(R_i - ref_J), R_i = G at the last row before row i's sub-chunk (R_i - ref_J <= 0)
    q0 = tl.zeros([C, SB], dtype=tl.float32)
    q1 = tl.zeros([C, SB], dtype=tl.float32)
    q2 = tl.zeros([C, SB], dtype=tl.float32)
    k0 = tl.zeros([C, SB], dtype=tl.float32)
    k1 = tl.zeros([C, SB], dtype=tl.float32)
    k2 = tl.zeros([C, SB], dtype=tl.float32)
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)
        m_c = c < K
        g_rows = _load_tile(g_base, 0, C, K, c0, K, C, BK)  # [C, BK]
        g_ref = tl.load(g_base + ref_rows[:, None] * K + c[None, :], mask=m_c[None, :], other=0.0)  # [C, BK] R_i
        e_rows = tl.exp(g_rows - g_ref)  # <= 1
        x_q = _load_tile(q_base, 0, L, sqt, c0, K, C, BK) * rqs[:, None] * e_rows  # [C, BK]
        x_k = _load_tile(k_base, 0, L, skt, c0, K, C, BK) * rks[:, None] * e_rows
        ref1 = tl.load(g_base + (SB - 1) * K + c, mask=m_c, other=0.0)  # [BK]
        ref2 = tl.load(g_base + (2 * SB - 1) * K + c, mask=m_c, other=0.0)
        ref3 = tl.load(g_base + (3 * SB - 1) * K + c, mask=m_c, other=0.0)
        d21 = tl.exp(ref2 - ref1)[None, :]  # [1, BK] exp(R_i - ref_J) of rows in sub-chunk I
        d31 = tl.exp(ref3 - ref1)[None, :]
        d32 = tl.exp(ref3 - ref2)[None, :]

        # strip 0: rows of sub-chunks 1..3 against columns 0..15
        f = tl.where(sub == 1, 1.0, tl.where(sub == 2, d21, d31))
        f = tl.where(sub >= 1, f, 0.0)  # [C, BK]
        y = _col_operand(k_base, g_base, rk_base, ref1, 0, L, skt, c0, K, SB, BK, OP_BF16, EMULATE_BF16)
        q0 += tl.dot(dot_operand(x_q * f, OP_BF16, EMULATE_BF16), y, input_precision=DOT_PREC)
        k0 += tl.dot(dot_operand(x_k * f, OP_BF16, EMULATE_BF16), y, input_precision=DOT_PREC)
        # strip 1: rows of sub-chunks 2..3 against columns 16..31
        f = tl.where(sub == 2, 1.0, tl.where(sub == 3, d32, 0.0))
        y = _col_operand(k_base, g_base, rk_base, ref2, SB, L, skt, c0, K, SB, BK, OP_BF16, EMULATE_BF16)
        q1 += tl.dot(dot_operand(x_q * f, OP_BF16, EMULATE_BF16), y, input_precision=DOT_PREC)
        k1 += tl.dot(dot_operand(x_k * f, OP_BF16, EMULATE_BF16), y, input_precision=DOT_PREC)
        # strip 2: rows of sub-chunk 3 against columns 32..47
        f = tl.where(sub == 3, 1.0, 0.0)
        y = _col_operand(k_base, g_base, rk_base, ref3, 2 * SB, L, skt, c0, K, SB, BK, OP_BF16, EMULATE_BF16)
        q2 += tl.dot(dot_operand(x_q * f, OP_BF16, EMULATE_BF16), y, input_precision=DOT_PREC)
        k2 += tl.dot(dot_operand(x_k * f, OP_BF16, EMULATE_BF16), y, input_precision=DOT_PREC)

    aqk_base = aqk + slot * (C * C)
    _store_strip(aqk_base, q0 * scale, 0, C, SB, ROUND)
    _store_strip(aqk_base, q1 * scale, 1, C, SB, ROUND)
    _store_strip(aqk_base, q2 * scale, 2, C, SB, ROUND)

    # A = diag(bt) Akk: the off-diagonal blocks
    bt_base = bt + slot * C
    bts = tl.load(bt_base + rows)[:, None]  # [C, 1]
    _, a10, a20, a30 = _row_blocks(k0 * bts, SB)
    _, _, a21, a31 = _row_blocks(k1 * bts, SB)
    _, _, _, a32 = _row_blocks(k2 * bts, SB)

    # zeros above the diagonal blocks
    zero = tl.zeros([SB, SB], dtype=tl.float32)
    _store_block(aqk_base, zero, 0, 1, C, SB, ROUND)
    _store_block(aqk_base, zero, 0, 2, C, SB, ROUND)
    _store_block(aqk_base, zero, 0, 3, C, SB, ROUND)
    _store_block(aqk_base, zero, 1, 2, C, SB, ROUND)
    _store_block(aqk_base, zero, 1, 3, C, SB, ROUND)
    _store_block(aqk_base, zero, 2, 3, C, SB, ROUND)

    # the diagonal blocks of Akk (transposed; by dots when the sub-chunk passes, storing Aqk's too)
    d_base = akk_d + slot * (C * SB)
    d0 = _diag_block(q_base, k_base, g_base, rq_base, rk_base, aqk_base, d_base, scale, L, sqt, skt, 0, K, C, SB,
                     BK, OP_BF16, EMULATE_BF16, DOT_PREC, ROUND, SAFE)
    d1 = _diag_block(q_base, k_base, g_base, rq_base, rk_base, aqk_base, d_base, scale, L, sqt, skt, 1, K, C, SB,
                     BK, OP_BF16, EMULATE_BF16, DOT_PREC, ROUND, SAFE)
    d2 = _diag_block(q_base, k_base, g_base, rq_base, rk_base, aqk_base, d_base, scale, L, sqt, skt, 2, K, C, SB,
                     BK, OP_BF16, EMULATE_BF16, DOT_PREC, ROUND, SAFE)
    d3 = _diag_block(q_base, k_base, g_base, rq_base, rk_base, aqk_base, d_base, scale, L, sqt, skt, 3, K, C, SB,
                     BK, OP_BF16, EMULATE_BF16, DOT_PREC, ROUND, SAFE)

    # the inverse's diagonal blocks: X = (I + A_II)^-1 - I by forward substitution (row 0 of X is 0)
    r = tl.arange(0, SB)
    x0 = zero
    x1 = zero
    x2 = zero
    x3 = zero
    for s in range(1, SB):
        x0 = _substitution_row(d0, tl.load(bt_base + s), x0, s, r)
        x1 = _substitution_row(d1, tl.load(bt_base + SB + s), x1, s, r)
        x2 = _substitution_row(d2, tl.load(bt_base + 2 * SB + s), x2, s, r)
        x3 = _substitution_row(d3, tl.load(bt_base + 3 * SB + s), x3, s, r)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t00 = x0 + eye
    t11 = x1 + eye
    t22 = x2 + eye
    t33 = x3 + eye

    # off-diagonal blocks of the inverse: T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=INV_PREC), input_precision=INV_PREC)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=INV_PREC), input_precision=INV_PREC)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=INV_PREC) + tl.dot(a21, t10, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=INV_PREC), input_precision=INV_PREC)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=INV_PREC) + tl.dot(a32, t21, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=INV_PREC) + tl.dot(a31, t10, input_precision=INV_PREC)
                  + tl.dot(a32, t20, input_precision=INV_PREC), input_precision=INV_PREC)

    t_base = tinv + slot * (C * C)
    _store_block(t_base, t00, 0, 0, C, SB, ROUND)
    _store_block(t_base, zero, 0, 1, C, SB, ROUND)
    _store_block(t_base, zero, 0, 2, C, SB, ROUND)
    _store_block(t_base, zero, 0, 3, C, SB, ROUND)
    _store_block(t_base, t10, 1, 0, C, SB, ROUND)
    _store_block(t_base, t11, 1, 1, C, SB, ROUND)
    _store_block(t_base, zero, 1, 2, C, SB, ROUND)
    _store_block(t_base, zero, 1, 3, C, SB, ROUND)
    _store_block(t_base, t20, 2, 0, C, SB, ROUND)
    _store_block(t_base, t21, 2, 1, C, SB, ROUND)
    _store_block(t_base, t22, 2, 2, C, SB, ROUND)
    _store_block(t_base, zero, 2, 3, C, SB, ROUND)
    _store_block(t_base, t30, 3, 0, C, SB, ROUND)
    _store_block(t_base, t31, 3, 1, C, SB, ROUND)
    _store_block(t_base, t32, 3, 2, C, SB, ROUND)
    _store_block(t_base, t33, 3, 3, C, SB, ROUND)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def _check(name: str, x, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a slot tensor)")


def run_intra(opts, table, q, k, gc, bt, rq, rk, aqk, akk_d, tinv) -> None:
    """Aqk, Tinv of the table's chunks into the caller's aqk, tinv (slot i = table row i); akk_d is the diag
    kernel's scratch for the sub-chunks that fail the span check (rows of the others are not written).
    ``opts.safe``: the gate is >= -5 per token, every diagonal block is formed by dots."""
    for name, x in (("q", q), ("k", k), ("table", table)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] of one shape, got {list(q.shape)} and {list(k.shape)}")
    if k.dtype != q.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q and k must share a dtype among bf16, fp16, fp32, got {q.dtype} and {k.dtype}")
    check_token_strides("q", q)
    check_token_strides("k", k)
    if table.dim() != 2 or table.shape[1] != 4 or table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous int32 [n, 4] tensor, got {table.dtype} {list(table.shape)}")
    H, K = q.shape[2], q.shape[3]
    if K > MAX_HEAD_DIM:
        raise ValueError(f"q's head dimension K must be <= {MAX_HEAD_DIM}, got {K}")
    n, dev, C = table.shape[0], q.device, CHUNK
    if gc.dim() != 4:
        raise ValueError(f"gc must be [n, HV, C, K], got {list(gc.shape)}")
    HV = gc.shape[1]
    if H == 0 or HV % H != 0:
        raise ValueError(f"gc's HV ({HV}) must be a multiple of q's H ({H})")
    if table.device != dev:
        raise ValueError(f"table must be on {dev}, got {table.device}")
    _check("gc", gc, (n, HV, C, K), torch.float32, dev)
    _check("bt", bt, (n, HV, C), torch.float32, dev)
    _check("rq", rq, (n, H, C), torch.float32, dev)
    _check("rk", rk, (n, H, C), torch.float32, dev)
    _check("aqk", aqk, (n, HV, C, C), q.dtype, dev)
    _check("akk_d", akk_d, (n, HV, C, SUB), torch.float32, dev)
    _check("tinv", tinv, (n, HV, C, C), q.dtype, dev)
    if n == 0 or HV == 0:
        return
    interp = triton_interpreting()
    op_bf16 = q.dtype != torch.float32
    strides = (*q.stride()[:3], *k.stride()[:3])
    BK = block_size(K)
    round_out = interp and q.dtype == torch.bfloat16
    safe = bool(opts.safe)
    if not safe:
        chunk_intra_diag_kernel[(n * C, triton.cdiv(HV, DIAG_BLOCK_H))](
            table, q, k, gc, rq, rk, aqk, akk_d, opts.scale, *strides, H, HV,
            K=K, BK=BK, BH=DIAG_BLOCK_H, C=C, SB=SUB, ROUND=round_out, num_warps=DIAG_NUM_WARPS, num_stages=1,
        )
    chunk_intra_solve_kernel[(n, HV)](
        table, q, k, gc, bt, rq, rk, aqk, akk_d, tinv, opts.scale, *strides, H, HV,
        K=K, BK=solve_block_k(op_bf16, BK), C=C, SB=SUB, OP_BF16=op_bf16, EMULATE_BF16=op_bf16 and interp,
        DOT_PREC=dot_precision(q.dtype), INV_PREC=dot_precision(torch.float32), ROUND=round_out, SAFE=safe,
        num_warps=SOLVE_NUM_WARPS["bf16" if op_bf16 else "fp32"], num_stages=1,
    )
