"""The forward's intra-chunk stage of the 64-token pipeline (docs/chunk_pipeline.md): the pairwise matrices of
a chunk and the inverse of its WY system.

Per table row i (a chunk of L <= 64 tokens) and value head hv, with q̂ = rq * q, k̂ = rk * k (q/k head
h = hv // (HV // H)) and G the chunk cumsum of the log-decay (``gc``):

    Aqk[r, j]  = scale * sum_c q̂[r, c] k̂[j, c] exp(G[r, c] - G[j, c])    j <= r   (0 above the diagonal)
    Akk[r, j]  =         sum_c k̂[r, c] k̂[j, c] exp(G[r, c] - G[j, c])    j <  r
    Tinv       = (I + diag(bt) Akk)^-1                                     unit lower triangular

Three kernels, each with few live tiles (FLA's split of the same work):

* ``chunk_intra_dots_kernel``, grid (4 n, HV), one program per (chunk, sub-chunk, value head): the 16 x 16
  diagonal blocks by dots, with G_mid = G at the sub-chunk's middle row mid = min(16 I + 8, L - 1) as reference,
  ``(x_I exp(G_I - G_mid)) (k̂_I exp(G_mid - G_I))^T``. It stores aqk's diagonal block (lower incl. the
  diagonal) and akk_d's rows (Akk's strictly lower block). Without SAFE it takes only the sub-chunks that pass
  the **span check**: every key channel has |G - G_mid| <= DIAG_DOT_SPAN (40) on every row of the sub-chunk
  (padded rows count as row L - 1), so both factors stay within exp(+-40) and the 16-bit operands neither
  overflow nor flush. G is non-increasing along the rows (log-decays <= 0), so per channel the largest
  |G - G_mid| sits at the first or the last row: the check reads those two rows and mid. A NaN gate makes G NaN
  from its row on and a NaN compares false: such a sub-chunk fails. With SAFE (the gate is >= -5 per token, so 8
  tokens span at most 40) every sub-chunk passes and the token-parallel kernel is not launched.
* ``chunk_intra_diag_kernel`` (not with SAFE), token-parallel: one program per (chunk row r, group of BH value
  heads) runs the same check and exits at once unless one of its heads fails; then it forms row r of the
  diagonal blocks pair by pair, ``exp(G_r - G_j)`` for the <= 16 earlier tokens j of r's sub-chunk (never
  exp(-G) of a running sum), and stores each pair as it is formed: aqk's row r over the diagonal block's
  columns (zeros right of the diagonal; padded rows r >= L have no aqk row) and akk_d's row r
  (``Akk[r, 16 * (r // 16) + jj]``, 0 for jj >= r % 16).
* ``chunk_intra_solve_kernel``, grid (n, HV), after both: the six blocks below the diagonal blocks of Aqk and
  Akk by [16, 16] tensor-core dots in one pass over the key channels, then Tinv. Block (I, J), I > J, takes the
  reference n_I = G at sub-chunk I's first row: ``(x_I exp(G_I - n_I)) (k̂_J exp(n_I - G_J))^T``, both factors
  <= 1 for any gate. The column operand is formed once per sub-chunk J as ``k̂_J exp(n_{J+1} - G_J)`` and scaled
  per pair by the [BK] vector ``exp(n_I - n_{J+1}) <= 1``, so a channel block costs six exp tiles. Tinv: the four
  diagonal blocks ``(I + diag(bt) Akk_II)^-1`` by forward substitution on akk_d's rows, the off-diagonal blocks
  by block substitution ``T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ`` (A = diag(bt) Akk) with fp32 dots. It stores
  aqk's blocks below and above the diagonal blocks (zeros above) and the whole of tinv (exact zeros above the
  diagonal; padded rows are not stored).

Layouts: q, k ``[B, T, H, K]`` token tensors read through their strides (unit last stride); slots (contiguous)
gc fp32 ``[n, HV, C, K]`` (padded rows hold G[L-1]), bt fp32 ``[n, HV, C]``, rq, rk fp32 ``[n, H, C]``; outputs
aqk, tinv ``[B, T, HV, C]`` in the token dtype, token layout: row r of a chunk's matrix at the chunk's token
t0 + r, rows r < L only (two views of one pair tensor, ``chunk.forward.pair_rows``); akk_d fp32 ``[n, HV, C, 16]``, the diagonal blocks of Akk from
the first two kernels to the solve kernel. Limits: K <= 128, HV a multiple of H.

Products of 16-bit inputs use bf16 dot operands (fp16 too, for the exponent range); fp32 inputs use fp32
operands at ``backend.dot_precision``; the token-parallel pairs are fp32 sums. The inverse stays fp32, its dots
at fp32 precision (3xTF32 on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk.tiles import (CHUNK, SUB, check_pairs, check_token_strides, chunk_row, dot_operand,
                                        launch_values, token_base)
from kdakit.ops.kda.chunk_common import block_size, load_row_scalars, round_to_bf16_if
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM

# The span check's bound: a sub-chunk whose |G - G_mid| stays <= 40 on every row and channel has its diagonal
# blocks formed by dots, with factors within exp(+-40): the envelope of the safe gate (8 tokens x 5 per token on
# either side of the middle row), the one the backward's SAFE dots use and the GPU tier validates.
DIAG_DOT_SPAN = 40.0
DIAG_DOT_SPAN_TL = tl.constexpr(DIAG_DOT_SPAN)

# launch configs, by operand kind ("bf16": 16-bit inputs, "fp32")
DIAG_BLOCK_H = 2  # value heads per token-parallel program ([BH, BK] tiles)
DIAG_NUM_WARPS = 1
DOTS_CONFIG = {"bf16": (64, 1), "fp32": (32, 2)}  # the dots kernel's (BLOCK_K, warps)
SOLVE_CONFIG = {"bf16": (32, 1, 2), "fp32": (16, 2, 1)}  # the solve kernel's (BLOCK_K, warps, stages)
# the constants above that a tuning run may override by name (``chunk.launch.Launch``, ``tiles.launch_values``)
LAUNCH_CONSTANTS = ("DIAG_BLOCK_H", "DIAG_NUM_WARPS", "DOTS_CONFIG", "SOLVE_CONFIG")
# The solve kernel keeps small spills: bf16 at (32, 1, 2) ~36 B, measured on an H100 faster than the spill-free
# (16, 1, 2) on the unbounded gate's inputs (docs/perf_notes.md); fp32 at (16, 2, 1) ~150 B with the masked
# token-layout pair stores (no 1-8 warp config builds under 48 B; its inverse dots at 3xTF32), not timed.
SOLVE_SPILL_BUDGET = {"bf16": 64, "fp32": 160}  # bytes of spill stores + loads the build test allows


def solve_block_k(op_bf16: bool, BK: int, launch=None) -> int:
    """The solve kernel's key block for the operand kind, at most BK."""
    return min(launch_values(launch, SOLVE_CONFIG=SOLVE_CONFIG)[0]["bf16" if op_bf16 else "fp32"][0], BK)


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
def _store_block(base, x, I: tl.constexpr, J: tl.constexpr, stride_row, n_rows, SB: tl.constexpr,
                 ROUND: tl.constexpr):
    """Block (I, J) ``[SB, SB]`` of a chunk's ``[C, C]`` pair matrix stored in token layout (row r at
    ``base + r * stride_row``), rows ``>= n_rows`` not stored, cast to its dtype (bf16 rounding emulated under the
    interpreter when ROUND)."""
    r = tl.arange(0, SB)
    row = base + SB * I * stride_row + SB * J + r * stride_row  # [SB] the block's row pointers
    tl.store(row[:, None] + r[None, :], round_to_bf16_if(x, ROUND).to(base.dtype.element_ty),
             mask=(r < n_rows - SB * I)[:, None])


@triton.jit
def _span_bad(g_first, g_mid, g_last):
    """1 where a key channel fails the span check (|G - G_mid| > DIAG_DOT_SPAN at the sub-chunk's first or last
    row, or a NaN), else 0 (int32, elementwise). The one form of both kernels, so that they agree bit for bit."""
    ok = (tl.abs(g_first - g_mid) <= DIAG_DOT_SPAN_TL) & (tl.abs(g_last - g_mid) <= DIAG_DOT_SPAN_TL)
    return tl.where(ok, 0, 1)


@triton.jit
def _substitution_row(d_base, bt_base, I: tl.constexpr, X, s, r, SB: tl.constexpr):
    """Row s of X = (I + A_II)^-1 - I, A = diag(bt) Akk strictly lower, Akk's row read from akk_d."""
    b_s = tl.load(bt_base + SB * I + s)
    a = -b_s * tl.load(d_base + (SB * I + s) * SB + r, mask=r < s, other=0.0)  # [SB]
    a = a + tl.sum(a[:, None] * X, axis=0)
    return tl.where((r == s)[:, None], a[None, :], X)




# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_intra_diag_kernel(
    table, q, k, gc, rq, rk, aqk, akk_d, scale,
    sqb, sqt, sqh, skb, skt, skh, spb, spt, sph, H, HV,
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
    aqk_row = aqk + b * spb + (t0 + r) * spt + hv.to(tl.int64) * sph  # [BH] row r of each head's Aqk (token r)
    akk_row = akk_d + (slot_h * C + r) * SB  # [BH] row r of each head's akk_d

    # the span check of r's sub-chunk per head (the solve kernel forms the passing ones by dots)
    bad = _span_bad(tl.load(g_ptr + tl.minimum(s0, L - 1) * K, mask=m_hk, other=0.0),
                    tl.load(g_ptr + tl.minimum(s0 + SB // 2, L - 1) * K, mask=m_hk, other=0.0),
                    tl.load(g_ptr + tl.minimum(s0 + SB - 1, L - 1) * K, mask=m_hk, other=0.0))  # [BH, BK]
    m_h = m_h & (tl.sum(bad, axis=1) > 0)
    if tl.sum(m_h.to(tl.int32)) == 0:
        return
    m_hk = m_h[:, None] & (c < K)[None, :]

    # zeros: the diagonal block's row right of the diagonal (all of akk_d's row on padded rows, which have no
    # aqk row); the pairs below write the rest
    jj = tl.arange(0, SB)
    first_zero = tl.where(live, r + 1, s0) - s0  # [] first zero column within the block
    tl.store(aqk_row[:, None] + (s0 + jj)[None, :], tl.zeros([BH, SB], dtype=aqk.dtype.element_ty),
             mask=(m_h & live)[:, None] & (jj >= first_zero)[None, :])
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
def chunk_intra_dots_kernel(
    table, q, k, gc, rq, rk, aqk, akk_d, scale,
    sqb, sqt, sqh, skb, skt, skh, spb, spt, sph, H, HV,
    K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, ROUND: tl.constexpr,
    SAFE: tl.constexpr,
):
    """Program (table row i, sub-chunk I, value head hv): the diagonal blocks of Aqk (stored) and Akk (akk_d rows)
    by dots with the middle row as reference; without SAFE only sub-chunks passing the span check."""
    pid = tl.program_id(0)
    i = pid // 4
    I = pid % 4
    hv = tl.program_id(1)
    h = hv // (HV // H)
    n, b, t0, L = chunk_row(table, i)
    r0 = SB * I
    slot = i.to(tl.int64) * HV + hv
    a = tl.arange(0, SB)
    if r0 >= L:  # a padded sub-chunk: zero akk_d rows (aqk has no rows there)
        tl.store(akk_d + slot * (C * SB) + (r0 + a)[:, None] * SB + a[None, :], tl.zeros([SB, SB], dtype=tl.float32))
        return
    q_base = token_base(q, b, t0, h, sqb, sqt, sqh)
    k_base = token_base(k, b, t0, h, skb, skt, skh)
    g_base = gc + slot * (C * K)
    rows = r0 + a  # padded rows of gc hold G[L - 1]
    mid = tl.minimum(r0 + SB // 2, L - 1)
    if not SAFE:
        bad = tl.zeros([BK], dtype=tl.int32)
        for c0 in range(0, K, BK):
            c = c0 + tl.arange(0, BK)
            m_c = c < K
            bad += _span_bad(tl.load(g_base + r0 * K + c, mask=m_c, other=0.0),
                             tl.load(g_base + mid * K + c, mask=m_c, other=0.0),
                             tl.load(g_base + (r0 + SB - 1) * K + c, mask=m_c, other=0.0))
        if tl.sum(bad) > 0:
            return
    rq_i = tl.load(rq + (i.to(tl.int64) * H + h) * C + rows)  # [SB] 0 on padded rows
    rk_i = tl.load(rk + (i.to(tl.int64) * H + h) * C + rows)
    acc_q = tl.zeros([SB, SB], dtype=tl.float32)
    acc_k = tl.zeros([SB, SB], dtype=tl.float32)
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)
        m_c = c < K
        g = tl.load(g_base + rows[:, None] * K + c[None, :], mask=m_c[None, :], other=0.0)  # [SB, BK]
        g_mid = tl.load(g_base + mid * K + c, mask=m_c, other=0.0)[None, :]
        ef = tl.exp(g - g_mid)
        eb = tl.exp(g_mid - g)
        k_i = _load_tile(k_base, r0, L, skt, c0, K, SB, BK) * rk_i[:, None]
        x_q = dot_operand(_load_tile(q_base, r0, L, sqt, c0, K, SB, BK) * rq_i[:, None] * ef, OP_BF16, EMULATE_BF16)
        x_k = dot_operand(k_i * ef, OP_BF16, EMULATE_BF16)
        y = dot_operand(tl.trans(k_i * eb), OP_BF16, EMULATE_BF16)  # [BK, SB]
        acc_q = tl.dot(x_q, y, acc=acc_q, input_precision=DOT_PREC)
        acc_k = tl.dot(x_k, y, acc=acc_k, input_precision=DOT_PREC)
    aqk_base = token_base(aqk, b, t0, hv, spb, spt, sph)
    _store_block(aqk_base, tl.where(a[:, None] >= a[None, :], acc_q * scale, 0.0), I, I, spt, L, SB, ROUND)
    d_ptr = akk_d + slot * (C * SB) + rows[:, None] * SB + a[None, :]
    tl.store(d_ptr, tl.where(a[:, None] > a[None, :], acc_k, 0.0))



@triton.jit
def chunk_intra_solve_kernel(
    table, q, k, gc, bt, rq, rk, aqk, akk_d, tinv, scale,
    sqb, sqt, sqh, skb, skt, skh, spb, spt, sph, H, HV,
    K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Program (table row i, value head hv): Aqk's off-diagonal blocks and Tinv; the diagonal blocks come from the
    diag kernels (aqk's stored there, Akk's in akk_d)."""
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
    r = tl.arange(0, SB)
    q10 = tl.zeros([SB, SB], dtype=tl.float32)
    k10 = tl.zeros([SB, SB], dtype=tl.float32)
    q20 = tl.zeros([SB, SB], dtype=tl.float32)
    k20 = tl.zeros([SB, SB], dtype=tl.float32)
    q21 = tl.zeros([SB, SB], dtype=tl.float32)
    k21 = tl.zeros([SB, SB], dtype=tl.float32)
    q30 = tl.zeros([SB, SB], dtype=tl.float32)
    k30 = tl.zeros([SB, SB], dtype=tl.float32)
    q31 = tl.zeros([SB, SB], dtype=tl.float32)
    k31 = tl.zeros([SB, SB], dtype=tl.float32)
    q32 = tl.zeros([SB, SB], dtype=tl.float32)
    k32 = tl.zeros([SB, SB], dtype=tl.float32)
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)
        m_c = c < K
        n1 = tl.load(g_base + SB * K + c, mask=m_c, other=0.0)[None, :]  # [1, BK] G at sub-chunk I's first row
        n2 = tl.load(g_base + 2 * SB * K + c, mask=m_c, other=0.0)[None, :]
        n3 = tl.load(g_base + 3 * SB * K + c, mask=m_c, other=0.0)[None, :]
        # column bases k^_J exp(n_{J+1} - G_J) <= 1; the pair (I, J) scales by exp(n_I - n_{J+1}) <= 1
        cb0 = (_load_tile(k_base, 0, L, skt, c0, K, SB, BK) * load_row_scalars(rk_base, 0, L, 1, SB)[:, None]
               * tl.exp(n1 - _load_tile(g_base, 0, C, K, c0, K, SB, BK)))
        # row sub-chunk 1
        e = tl.exp(_load_tile(g_base, SB, C, K, c0, K, SB, BK) - n1)
        k_i = _load_tile(k_base, SB, L, skt, c0, K, SB, BK) * load_row_scalars(rk_base, SB, L, 1, SB)[:, None]
        xq = dot_operand(_load_tile(q_base, SB, L, sqt, c0, K, SB, BK)
                         * load_row_scalars(rq_base, SB, L, 1, SB)[:, None] * e, OP_BF16, EMULATE_BF16)
        xk = dot_operand(k_i * e, OP_BF16, EMULATE_BF16)
        y = dot_operand(tl.trans(cb0), OP_BF16, EMULATE_BF16)
        q10 = tl.dot(xq, y, acc=q10, input_precision=DOT_PREC)
        k10 = tl.dot(xk, y, acc=k10, input_precision=DOT_PREC)
        cb1 = k_i * tl.exp(n2 - _load_tile(g_base, SB, C, K, c0, K, SB, BK))
        # row sub-chunk 2
        g_i = _load_tile(g_base, 2 * SB, C, K, c0, K, SB, BK)
        e = tl.exp(g_i - n2)
        k_i = _load_tile(k_base, 2 * SB, L, skt, c0, K, SB, BK) * load_row_scalars(rk_base, 2 * SB, L, 1, SB)[:, None]
        xq = dot_operand(_load_tile(q_base, 2 * SB, L, sqt, c0, K, SB, BK)
                         * load_row_scalars(rq_base, 2 * SB, L, 1, SB)[:, None] * e, OP_BF16, EMULATE_BF16)
        xk = dot_operand(k_i * e, OP_BF16, EMULATE_BF16)
        y = dot_operand(tl.trans(cb0 * tl.exp(n2 - n1)), OP_BF16, EMULATE_BF16)
        q20 = tl.dot(xq, y, acc=q20, input_precision=DOT_PREC)
        k20 = tl.dot(xk, y, acc=k20, input_precision=DOT_PREC)
        y = dot_operand(tl.trans(cb1), OP_BF16, EMULATE_BF16)
        q21 = tl.dot(xq, y, acc=q21, input_precision=DOT_PREC)
        k21 = tl.dot(xk, y, acc=k21, input_precision=DOT_PREC)
        cb2 = k_i * tl.exp(n3 - g_i)
        # row sub-chunk 3
        e = tl.exp(_load_tile(g_base, 3 * SB, C, K, c0, K, SB, BK) - n3)
        k_i = _load_tile(k_base, 3 * SB, L, skt, c0, K, SB, BK) * load_row_scalars(rk_base, 3 * SB, L, 1, SB)[:, None]
        xq = dot_operand(_load_tile(q_base, 3 * SB, L, sqt, c0, K, SB, BK)
                         * load_row_scalars(rq_base, 3 * SB, L, 1, SB)[:, None] * e, OP_BF16, EMULATE_BF16)
        xk = dot_operand(k_i * e, OP_BF16, EMULATE_BF16)
        y = dot_operand(tl.trans(cb0 * tl.exp(n3 - n1)), OP_BF16, EMULATE_BF16)
        q30 = tl.dot(xq, y, acc=q30, input_precision=DOT_PREC)
        k30 = tl.dot(xk, y, acc=k30, input_precision=DOT_PREC)
        y = dot_operand(tl.trans(cb1 * tl.exp(n3 - n2)), OP_BF16, EMULATE_BF16)
        q31 = tl.dot(xq, y, acc=q31, input_precision=DOT_PREC)
        k31 = tl.dot(xk, y, acc=k31, input_precision=DOT_PREC)
        y = dot_operand(tl.trans(cb2), OP_BF16, EMULATE_BF16)
        q32 = tl.dot(xq, y, acc=q32, input_precision=DOT_PREC)
        k32 = tl.dot(xk, y, acc=k32, input_precision=DOT_PREC)

    aqk_base = token_base(aqk, b, t0, hv, spb, spt, sph)
    zero = tl.zeros([SB, SB], dtype=tl.float32)
    _store_block(aqk_base, q10 * scale, 1, 0, spt, L, SB, ROUND)
    _store_block(aqk_base, q20 * scale, 2, 0, spt, L, SB, ROUND)
    _store_block(aqk_base, q21 * scale, 2, 1, spt, L, SB, ROUND)
    _store_block(aqk_base, q30 * scale, 3, 0, spt, L, SB, ROUND)
    _store_block(aqk_base, q31 * scale, 3, 1, spt, L, SB, ROUND)
    _store_block(aqk_base, q32 * scale, 3, 2, spt, L, SB, ROUND)
    _store_block(aqk_base, zero, 0, 1, spt, L, SB, ROUND)
    _store_block(aqk_base, zero, 0, 2, spt, L, SB, ROUND)
    _store_block(aqk_base, zero, 0, 3, spt, L, SB, ROUND)
    _store_block(aqk_base, zero, 1, 2, spt, L, SB, ROUND)
    _store_block(aqk_base, zero, 1, 3, spt, L, SB, ROUND)
    _store_block(aqk_base, zero, 2, 3, spt, L, SB, ROUND)

    bt_base = bt + slot * C
    b1 = tl.load(bt_base + SB + r)[:, None]
    b2 = tl.load(bt_base + 2 * SB + r)[:, None]
    b3 = tl.load(bt_base + 3 * SB + r)[:, None]
    a10 = k10 * b1
    a20 = k20 * b2
    a21 = k21 * b2
    a30 = k30 * b3
    a31 = k31 * b3
    a32 = k32 * b3

    d_base = akk_d + slot * (C * SB)
    x0 = zero
    x1 = zero
    x2 = zero
    x3 = zero
    for s in range(1, SB):
        x0 = _substitution_row(d_base, bt_base, 0, x0, s, r, SB)
        x1 = _substitution_row(d_base, bt_base, 1, x1, s, r, SB)
        x2 = _substitution_row(d_base, bt_base, 2, x2, s, r, SB)
        x3 = _substitution_row(d_base, bt_base, 3, x3, s, r, SB)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t00 = x0 + eye
    t11 = x1 + eye
    t22 = x2 + eye
    t33 = x3 + eye
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=INV_PREC), input_precision=INV_PREC)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=INV_PREC), input_precision=INV_PREC)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=INV_PREC) + tl.dot(a21, t10, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=INV_PREC), input_precision=INV_PREC)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=INV_PREC) + tl.dot(a32, t21, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=INV_PREC) + tl.dot(a31, t10, input_precision=INV_PREC)
                  + tl.dot(a32, t20, input_precision=INV_PREC), input_precision=INV_PREC)
    t_base = token_base(tinv, b, t0, hv, spb, spt, sph)
    _store_block(t_base, t00, 0, 0, spt, L, SB, ROUND)
    _store_block(t_base, zero, 0, 1, spt, L, SB, ROUND)
    _store_block(t_base, zero, 0, 2, spt, L, SB, ROUND)
    _store_block(t_base, zero, 0, 3, spt, L, SB, ROUND)
    _store_block(t_base, t10, 1, 0, spt, L, SB, ROUND)
    _store_block(t_base, t11, 1, 1, spt, L, SB, ROUND)
    _store_block(t_base, zero, 1, 2, spt, L, SB, ROUND)
    _store_block(t_base, zero, 1, 3, spt, L, SB, ROUND)
    _store_block(t_base, t20, 2, 0, spt, L, SB, ROUND)
    _store_block(t_base, t21, 2, 1, spt, L, SB, ROUND)
    _store_block(t_base, t22, 2, 2, spt, L, SB, ROUND)
    _store_block(t_base, zero, 2, 3, spt, L, SB, ROUND)
    _store_block(t_base, t30, 3, 0, spt, L, SB, ROUND)
    _store_block(t_base, t31, 3, 1, spt, L, SB, ROUND)
    _store_block(t_base, t32, 3, 2, spt, L, SB, ROUND)
    _store_block(t_base, t33, 3, 3, spt, L, SB, ROUND)


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


def run_intra(opts, table, q, k, gc, bt, rq, rk, aqk, akk_d, tinv, *, launch=None) -> None:
    """Aqk, Tinv of the table's chunks into the caller's aqk, tinv (token layout ``[B, T, HV, C]``: each of a
    chunk's rows < L at its token; ``tiles.check_pairs``); akk_d is the scratch
    that carries Akk's diagonal blocks from the diagonal kernels to the solve kernel (every row written).
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
    if K > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"q's head dimension K must be <= {CHUNK_MAX_HEAD_DIM}, got {K}")
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
    pair_strides = check_pairs(aqk, tinv, q.shape[0], q.shape[1], HV, q.dtype)
    if aqk.device != dev:
        raise ValueError(f"aqk must be on {dev}, got {aqk.device}")
    _check("akk_d", akk_d, (n, HV, C, SUB), torch.float32, dev)
    if n == 0 or HV == 0:
        return
    interp = triton_interpreting()
    op_bf16 = q.dtype != torch.float32
    strides = (*q.stride()[:3], *k.stride()[:3], *pair_strides)
    BK = block_size(K)
    round_out = interp and q.dtype == torch.bfloat16
    safe = bool(opts.safe)
    diag_h, diag_warps, dots, solve = launch_values(launch, DIAG_BLOCK_H=DIAG_BLOCK_H, DIAG_NUM_WARPS=DIAG_NUM_WARPS,
                                                    DOTS_CONFIG=DOTS_CONFIG, SOLVE_CONFIG=SOLVE_CONFIG)
    if not safe:
        chunk_intra_diag_kernel[(n * C, triton.cdiv(HV, diag_h))](
            table, q, k, gc, rq, rk, aqk, akk_d, opts.scale, *strides, H, HV,
            K=K, BK=BK, BH=diag_h, C=C, SB=SUB, ROUND=round_out, num_warps=diag_warps, num_stages=1,
        )
    kind = "bf16" if op_bf16 else "fp32"
    dots_bk, dots_warps = dots[kind]
    chunk_intra_dots_kernel[(n * (C // SUB), HV)](
        table, q, k, gc, rq, rk, aqk, akk_d, opts.scale, *strides, H, HV,
        K=K, BK=min(dots_bk, BK), C=C, SB=SUB, OP_BF16=op_bf16, EMULATE_BF16=op_bf16 and interp,
        DOT_PREC=dot_precision(q.dtype), ROUND=round_out, SAFE=safe, num_warps=dots_warps, num_stages=1,
    )
    solve_bk, solve_warps, solve_stages = solve[kind]
    chunk_intra_solve_kernel[(n, HV)](
        table, q, k, gc, bt, rq, rk, aqk, akk_d, tinv, opts.scale, *strides, H, HV,
        K=K, BK=min(solve_bk, BK), C=C, SB=SUB, OP_BF16=op_bf16, EMULATE_BF16=op_bf16 and interp,
        DOT_PREC=dot_precision(q.dtype), INV_PREC=dot_precision(torch.float32), ROUND=round_out,
        num_warps=solve_warps, num_stages=solve_stages,
    )
