"""The backward's pairwise gradients (docs/chunk_pipeline.md, "Backward", item 5): ``grads_intra``.

Per chunk (table row i) and value head hv, with q̂ = rq q, k̂ = rk k, G = ``gc``, β = ``bt``,
e_ijc = exp(G_ic - G_jc), the forward's pairwise matrices are

    Aqk[i, j] = scale Σ_c q̂_ic k̂_jc e_ijc  (j <= i)        Akk[i, j] = Σ_c k̂_ic k̂_jc e_ijc  (j < i)

and, with P = scale ``daqk`` (gradient w.r.t. the unscaled sum) and M[i, j] = β_i ``dakk``[i, j] (``dakk`` is the
gradient w.r.t. A = diag(β) Akk), this kernel adds with '+=' to the fp32 slots that grads_wy filled:

    dqh_i += Σ_j P_ij k̂_j e_ij                                                        [C, K]
    dkh_j += Σ_i P_ij q̂_i e_ij + Σ_i M_ij k̂_i e_ij;   dkh_i += Σ_j M_ij k̂_j e_ij      [C, K]
    dgs_i += q̂_i ⊙ Σ_j P_ij k̂_j e_ij + k̂_i ⊙ Σ_j M_ij k̂_j e_ij                        [C, K]
    dgs_j -= k̂_j ⊙ (Σ_i P_ij q̂_i e_ij + Σ_i M_ij k̂_i e_ij)
    dbs_i += Σ_j dakk_ij Akk_ij = Σ_c k̂_ic Σ_j dakk_ij k̂_jc e_ijc                       [C]

One program per (table row, sub-chunk s of 16 rows, value head): it owns rows 16s..16s+15 of the slots, as the
rows i of the matrices (the "row side", pairs j <= i) and as their columns j (the "column side", pairs i >= j),
and loops over K blocks (BK columns), summing dbs's K blocks itself (no atomics). Grid (n * 4, HV): axis 0 is
4 i + s, so a chunk's four programs run side by side. Sub-chunks wholly past the chunk's length exit at once;
no padded row (r >= L) of a slot is written.

Numerics (FLA's decomposition):

* blocks below the diagonal 16 x 16 blocks, by dots: the pair block (row sub-chunk u, column sub-chunk t < u)
  uses the reference r_u = G[16 u] (the first row of u), so exp(G_i - r_u) <= 1 and exp(r_u - G_j) <= 1 for any
  gate. The row side (in program u) and the column side (in program t) form the very same rounded operands
  xq = op(q̂ exp(G - r_u)), xk = op(β k̂ exp(G - r_u)), ye = op(k̂ exp(r_u - G)) and add ``x ⊙ (dA ye)`` and
  ``-ye ⊙ (dA^T x)`` to dgs: every pair's two decay-gradient terms are products of the same factors, so the
  dgs rows sum to zero to fp32 accumulation rounding whatever the operand rounding (bf16 operands included);
* the diagonal blocks, per K block, by one of two paths chosen at run time from the sub-chunk's G tile (padded
  rows as the row L - 1) and its reference row G_mid, mid = min(16 s + 8, L - 1):
  - by dots with G_mid as reference, factors exp(G - G_mid) and exp(G_mid - G), when max |G - G_mid| over the
    tile is <= DOT_SPAN_LIMIT = 40: the factors then stay within exp(+-40), the safe gate's envelope, and each
    pair's product exp(G_i - G_j) <= 1 is formed from two factors of fp32 range. With SAFE (the log-decay is
    known to be >= -5 per token) the bound holds by construction and the check is skipped;
  - otherwise (large log-decays, down to -110 per token; a NaN fails the check) token-parallel: a loop over the
    16 tokens m of the sub-chunk with ``[16, BK]`` elementwise tiles, exp(G_i - G_m) for rows i > m (row side)
    and exp(G_m - G_j) for rows j < m (column side) from one exponential of the same difference;
* P's diagonal (i = j, e_ii = 1) enters dqh and dkh as ``P_ii k̂_i`` and ``P_ii q̂_i`` and never dgs, where its
  two terms cancel exactly.

Products: bf16 and fp16 inputs take bf16 operands (rounded to nearest; the interpreter rounds fp32 tiles so),
fp32 inputs fp32 operands at ``dot_precision``. Everything else is fp32.

Layouts: q, k ``[B, T, H, K]`` through their strides (unit last stride); slots contiguous and indexed by the
program's table row: gc, dqh, dkh, dgs ``[n, HV, C, K]``; bt, dbs ``[n, HV, C]``; rq, rk ``[n, H, C]``;
daqk, dakk ``[n, HV, C, C]`` (fp32; entries outside the chunk's L x L block are not read). Padded slot rows
of gc are not read either (the chunk's last row stands in). K <= 128; offsets that scale with T or the window
are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk.tiles import (CHUNK, SUB, check_token_strides, chunk_row, dot_operand, launch_values,
                                        token_base)
from kdakit.ops.kda.chunk_common import block_size, load_row_scalars
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions

# ---------------------------------------------------------------------------------------
# launch config
# ---------------------------------------------------------------------------------------

# sm_90a at K = 128: 245-255 registers, no spills, for the four variants (SAFE x bf16 / fp32 operands; without
# SAFE the kernel holds both diagonal paths and the span check); at 1 warp the same [16, 32] tiles spill (the
# dots' operand layouts and the per-token vectors dominate, not the tiles), and BK = 64 at 4 warps spills with
# fp32 operands.
GRADS_INTRA_NUM_WARPS = {"bf16": 2, "fp32": 4}  # by operand kind (fp32 operands spill at 2 warps)
GRADS_INTRA_NUM_STAGES = 1
GRADS_INTRA_BLOCK_K = 32  # K-loop step: the [16, BK] accumulators dq, dkr, dkt, dg live with the sub-chunk's G
# the constants above that a tuning run may override by name (``chunk.launch.Launch``, ``tiles.launch_values``)
LAUNCH_CONSTANTS = ("GRADS_INTRA_NUM_WARPS", "GRADS_INTRA_NUM_STAGES", "GRADS_INTRA_BLOCK_K")

# The run-time check of the diagonal blocks (without SAFE): a K block whose |G - G_mid| stays <= 40 over the
# sub-chunk's tile takes the dots, whose factors exp(G - G_mid) and exp(G_mid - G) then lie within exp(+-40): the
# envelope of the safe gate (8 tokens x 5 per token on either side of the middle row), the one the SAFE dots use
# and the GPU tier validates. Wider spans (and NaN, which fails the comparison) take the token-parallel loop.
DOT_SPAN_LIMIT = 40.0
DOT_SPAN_LIMIT_TL = tl.constexpr(DOT_SPAN_LIMIT)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _hat(x_base, r_base, r0, L, stride_t, col0, K: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr):
    """Rows ``r0 + [0, SUBC)`` of a token tensor times their l2norm scales (q̂ or k̂), 0 on rows >= L.
    Returns ``[SUBC, BK]`` fp32 (the one form of every program, so that shared operands are bit-equal)."""
    rows = r0 + tl.arange(0, SUBC)
    cols = col0 + tl.arange(0, BK)
    mask = (rows < L)[:, None] & (cols < K)[None, :]
    x = tl.load(x_base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32) * tl.load(r_base + rows, mask=rows < L, other=0.0)[:, None]  # [SUBC, BK]


@triton.jit
def _gate_rows(gc_b, r0, L, col0, K: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr):
    """G on rows ``r0 + [0, SUBC)`` with each padded row (>= L) replaced by the row ``L - 1``, so that every
    exponent the kernel forms is of real values. Returns ``[SUBC, BK]`` fp32."""
    rows = r0 + tl.arange(0, SUBC)
    cols = col0 + tl.arange(0, BK)
    G = tl.load(gc_b + rows[:, None] * K + cols[None, :], mask=(cols < K)[None, :], other=0.0)  # [SUBC, BK]
    g_last = tl.load(gc_b + (L - 1) * K + cols, mask=cols < K, other=0.0)  # [BK]
    return tl.where((rows < L)[:, None], G, g_last[None, :])


@triton.jit
def _block(a_b, r0, c0, L, scale, C: tl.constexpr, SUBC: tl.constexpr, TRANS: tl.constexpr):
    """``scale * A[r0 + a, c0 + b]`` of a ``[C, C]`` slot as ``[SUBC, SUBC]`` (its transpose with TRANS), 0
    outside the chunk's L x L block."""
    a = tl.arange(0, SUBC)
    if TRANS:
        ptrs = a_b + (r0 + a)[None, :] * C + (c0 + a)[:, None]  # [SUBC] columns x [SUBC] rows of A
        mask = ((r0 + a) < L)[None, :] & ((c0 + a) < L)[:, None]
    else:
        ptrs = a_b + (r0 + a)[:, None] * C + (c0 + a)[None, :]
        mask = ((r0 + a) < L)[:, None] & ((c0 + a) < L)[None, :]
    return scale * tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _diag_exact(gc_b, q_b, k_b, rq_b, rk_b, bt_b, da_b, dk_b, G, r0, L, sqt, skt, col0, scale,
                K: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr):
    """The diagonal block of sub-chunk rows ``r0 + [0, SUBC)``, token-parallel, strictly below the diagonal.

    For each token m of the sub-chunk: e = exp(G_i - G_m) on rows i > m (row side), exp(G_m - G_j) on rows
    j < m (column side), both from one exponential. Returns (dq, dkr, dkt) ``[SUBC, BK]``:
    dq_i = Σ_{m<i} P_im k̂_m e_im, dkr_i = Σ_{m<i} dakk_im k̂_m e_im,
    dkt_j = Σ_{m>j} (P_mj q̂_m + β_m dakk_mj k̂_m) e_mj."""
    rl = tl.arange(0, SUBC)
    rows = r0 + rl
    rmask = rows < L
    cols = col0 + tl.arange(0, BK)
    cmask = cols < K
    dq = tl.zeros([SUBC, BK], dtype=tl.float32)
    dkr = tl.zeros([SUBC, BK], dtype=tl.float32)
    dkt = tl.zeros([SUBC, BK], dtype=tl.float32)
    for m in range(0, SUBC):  # a constexpr bound and a guard: the interpreter cannot range() over a loaded one
        if r0 + m < L:
            rm = r0 + m
            gm = tl.load(gc_b + rm * K + cols, mask=cmask, other=0.0)  # [BK]
            km = tl.load(k_b + rm.to(tl.int64) * skt + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(rk_b + rm)
            qm = tl.load(q_b + rm.to(tl.int64) * sqt + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(rq_b + rm)
            below = rl > m  # [SUBC] rows i > m: the row side
            above = rl < m  # [SUBC] rows j < m: the column side
            # [SUBC] column m / row m of P and dakk, zero outside the side that uses them (the other side's
            # exponential is finite, so masking the vectors suffices)
            pcol = tl.where(below, scale * tl.load(da_b + rows * C + rm, mask=rmask, other=0.0), 0.0)
            mcol = tl.where(below, tl.load(dk_b + rows * C + rm, mask=rmask, other=0.0), 0.0)
            prow = tl.where(above, scale * tl.load(da_b + rm * C + rows, mask=rmask, other=0.0), 0.0)
            mrow = tl.where(above, tl.load(bt_b + rm) * tl.load(dk_b + rm * C + rows, mask=rmask, other=0.0), 0.0)
            d = G - gm[None, :]  # [SUBC, BK]
            e = tl.exp(tl.where(below[:, None], d, -d))
            ke = km[None, :] * e
            dq += pcol[:, None] * ke
            dkr += mcol[:, None] * ke
            dkt += (prow[:, None] * qm[None, :] + mrow[:, None] * km[None, :]) * e
    return dq, dkr, dkt


@triton.jit
def _dot_span_ok(G, gm):
    """True when every entry of the ``[SUBC, BK]`` tile G lies within DOT_SPAN_LIMIT of the reference row gm
    ``[BK]`` (a NaN fails: the comparison is false). A scalar."""
    bad = tl.where(tl.abs(G - gm[None, :]) <= DOT_SPAN_LIMIT_TL, 0, 1)  # [SUBC, BK]
    return tl.max(tl.max(bad, axis=1), axis=0) == 0


@triton.jit
def _diag_dots(da_b, dk_b, G, gm, qh, kh, btv, r0, L, scale,
               C: tl.constexpr, SUBC: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """The diagonal block by dots, with the reference row gm ``[BK]`` (G at the sub-chunk's middle row, the last
    real row when the chunk ends before it), for a tile within DOT_SPAN_LIMIT of it. Returns (dq, dkr, dkt, dg)
    ``[SUBC, BK]`` as _diag_exact plus the block's decay gradient, formed from the rounded operands."""
    a = tl.arange(0, SUBC)
    strict = a[:, None] > a[None, :]
    strict_t = a[:, None] < a[None, :]
    ef = tl.exp(G - gm[None, :])  # [SUBC, BK]
    eb = tl.exp(gm[None, :] - G)
    xq = dot_operand(qh * ef, OP_BF16, EMULATE_BF16)
    xk = dot_operand((kh * btv[:, None]) * ef, OP_BF16, EMULATE_BF16)
    ye = dot_operand(kh * eb, OP_BF16, EMULATE_BF16)
    P = dot_operand(tl.where(strict, _block(da_b, r0, r0, L, scale, C, SUBC, False), 0.0), OP_BF16, EMULATE_BF16)
    M = dot_operand(tl.where(strict, _block(dk_b, r0, r0, L, 1.0, C, SUBC, False), 0.0), OP_BF16, EMULATE_BF16)
    PT = dot_operand(tl.where(strict_t, _block(da_b, r0, r0, L, scale, C, SUBC, True), 0.0), OP_BF16, EMULATE_BF16)
    MT = dot_operand(tl.where(strict_t, _block(dk_b, r0, r0, L, 1.0, C, SUBC, True), 0.0), OP_BF16, EMULATE_BF16)
    D1q = tl.dot(P, ye, input_precision=DOT_PREC)  # [SUBC, BK]
    D1k = tl.dot(M, ye, input_precision=DOT_PREC)
    D2 = tl.dot(PT, xq, input_precision=DOT_PREC)
    D2 = tl.dot(MT, xk, acc=D2, input_precision=DOT_PREC)
    dg = xq.to(tl.float32) * D1q + xk.to(tl.float32) * D1k - ye.to(tl.float32) * D2
    return ef * D1q, ef * D1k, eb * D2, dg


@triton.jit
def chunk_grads_intra_kernel(
    table, q, k, gc, bt, rq, rk, daqk, dakk, dqh, dkh, dgs, dbs,
    sqb, sqt, sqh, skb, skt, skh, scale, H, HV,
    K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, SAFE: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    NSUB: tl.constexpr = C // SUBC
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    i = pid // NSUB
    s = pid % NSUB
    _n, b, t0, L = chunk_row(table, i)
    r0 = s * SUBC
    if r0 >= L:
        return
    h = hv // (HV // H)
    slot = i.to(tl.int64) * HV + hv
    gc_b = gc + slot * (C * K)
    dqh_b = dqh + slot * (C * K)
    dkh_b = dkh + slot * (C * K)
    dgs_b = dgs + slot * (C * K)
    da_b = daqk + slot * (C * C)
    dk_b = dakk + slot * (C * C)
    bt_b = bt + slot * C
    dbs_b = dbs + slot * C
    rq_b = rq + (i.to(tl.int64) * H + h) * C
    rk_b = rk + (i.to(tl.int64) * H + h) * C
    q_b = token_base(q, b, t0, h, sqb, sqt, sqh)
    k_b = token_base(k, b, t0, h, skb, skt, skh)

    rl = tl.arange(0, SUBC)
    rows = r0 + rl
    rmask = rows < L
    btv = load_row_scalars(bt_b, r0, L, 1, SUBC)  # [SUBC]
    pdiag = scale * tl.load(da_b + rows * (C + 1), mask=rmask, other=0.0)  # [SUBC] P_ii
    mid = tl.minimum(r0 + SUBC // 2, L - 1)  # the diagonal dots' reference row
    db = tl.zeros([SUBC], dtype=tl.float32)
    for col0 in range(0, K, BK):
        cols = col0 + tl.arange(0, BK)
        offs = rows[:, None] * K + cols[None, :]  # [SUBC, BK]
        mask = rmask[:, None] & (cols < K)[None, :]
        # ---- the diagonal block (strictly lower; P's diagonal is added to dqh / dkh below)
        G = _gate_rows(gc_b, r0, L, col0, K, SUBC, BK)  # [SUBC, BK]
        gm = tl.load(gc_b + mid * K + cols, mask=cols < K, other=0.0)  # [BK] the dots' reference row
        if SAFE:
            dots = True  # the bound holds by construction (8 tokens x 5 on either side of the middle row)
        else:
            dots = _dot_span_ok(G, gm)
        qh = _hat(q_b, rq_b, r0, L, sqt, col0, K, SUBC, BK)
        kh = _hat(k_b, rk_b, r0, L, skt, col0, K, SUBC, BK)
        if dots:
            dq, dkr, dkt, dg = _diag_dots(da_b, dk_b, G, gm, qh, kh, btv, r0, L, scale,
                                          C, SUBC, OP_BF16, EMULATE_BF16, DOT_PREC)
        else:
            dq, dkr, dkt = _diag_exact(gc_b, q_b, k_b, rq_b, rk_b, bt_b, da_b, dk_b, G, r0, L, sqt, skt, col0,
                                       scale, K, C, SUBC, BK)
            dg = qh * dq + (kh * btv[:, None]) * dkr - kh * dkt
        # ---- row side below the diagonal blocks: columns j in sub-chunks t < s, reference G[r0]:
        # D1 = dA[rows, j] (k̂_j exp(G[r0] - G_j)), the two [SUBC, BK] sums over the earlier sub-chunks
        ref = tl.load(gc_b + r0 * K + cols, mask=cols < K, other=0.0)  # [BK]
        D1q = tl.zeros([SUBC, BK], dtype=tl.float32)
        D1k = tl.zeros([SUBC, BK], dtype=tl.float32)
        for t in range(0, NSUB - 1):  # constexpr bounds and guards (the interpreter ranges over no runtime bound)
            if t < s:
                ye = dot_operand(_hat(k_b, rk_b, t * SUBC, L, skt, col0, K, SUBC, BK)
                              * tl.exp(ref[None, :] - _gate_rows(gc_b, t * SUBC, L, col0, K, SUBC, BK)),
                              OP_BF16, EMULATE_BF16)  # [SUBC, BK]
                P = dot_operand(_block(da_b, r0, t * SUBC, L, scale, C, SUBC, False), OP_BF16, EMULATE_BF16)
                M = dot_operand(_block(dk_b, r0, t * SUBC, L, 1.0, C, SUBC, False), OP_BF16, EMULATE_BF16)
                D1q = tl.dot(P, ye, acc=D1q, input_precision=DOT_PREC)
                D1k = tl.dot(M, ye, acc=D1k, input_precision=DOT_PREC)
        # ---- the row side's results (exp(G_i - G[r0]) <= 1; zero sums when s = 0), then dqh
        fx = tl.exp(G - ref[None, :])  # [SUBC, BK]
        xq = dot_operand(qh * fx, OP_BF16, EMULATE_BF16)
        xk = dot_operand((kh * btv[:, None]) * fx, OP_BF16, EMULATE_BF16)
        dg += xq.to(tl.float32) * D1q + xk.to(tl.float32) * D1k
        dq += fx * D1q + pdiag[:, None] * kh
        tl.store(dqh_b + offs, tl.load(dqh_b + offs, mask=mask, other=0.0) + dq, mask=mask)
        dkr += fx * D1k
        db += tl.sum(kh * dkr, axis=1)
        dk = btv[:, None] * dkr + dkt + pdiag[:, None] * qh
        # ---- column side below the diagonal blocks: rows i in sub-chunks u > s, reference G[16 u]
        for u in range(1, NSUB):
            if (u > s) & (u * SUBC < L):
                ref = tl.load(gc_b + (u * SUBC) * K + cols, mask=cols < K, other=0.0)  # [BK]
                fx = tl.exp(_gate_rows(gc_b, u * SUBC, L, col0, K, SUBC, BK) - ref[None, :])  # [SUBC, BK], <= 1
                btu = load_row_scalars(bt_b, u * SUBC, L, 1, SUBC)
                xq = dot_operand(_hat(q_b, rq_b, u * SUBC, L, sqt, col0, K, SUBC, BK) * fx, OP_BF16, EMULATE_BF16)
                xk = dot_operand((_hat(k_b, rk_b, u * SUBC, L, skt, col0, K, SUBC, BK) * btu[:, None]) * fx,
                              OP_BF16, EMULATE_BF16)
                PT = dot_operand(_block(da_b, u * SUBC, r0, L, scale, C, SUBC, True), OP_BF16, EMULATE_BF16)
                MT = dot_operand(_block(dk_b, u * SUBC, r0, L, 1.0, C, SUBC, True), OP_BF16, EMULATE_BF16)
                D2 = tl.dot(PT, xq, input_precision=DOT_PREC)  # [SUBC, BK]
                D2 = tl.dot(MT, xk, acc=D2, input_precision=DOT_PREC)
                fy = tl.exp(ref[None, :] - G)  # [SUBC, BK], <= 1
                ye = dot_operand(kh * fy, OP_BF16, EMULATE_BF16)
                dk += fy * D2
                dg -= ye.to(tl.float32) * D2
        # ---- read-modify-write of dkh, dgs
        tl.store(dkh_b + offs, tl.load(dkh_b + offs, mask=mask, other=0.0) + dk, mask=mask)
        tl.store(dgs_b + offs, tl.load(dgs_b + offs, mask=mask, other=0.0) + dg, mask=mask)
    tl.store(dbs_b + rows, tl.load(dbs_b + rows, mask=rmask, other=0.0) + db, mask=rmask)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def _check_slot(name, x, shape, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (a slot tensor), got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a slot tensor), got strides {tuple(x.stride())}")


def run_grads_intra(opts: KDAOptions, table, q, k, gc, bt, rq, rk, daqk, dakk, dqh, dkh, dgs, dbs, *,
                    launch=None) -> None:
    """Add the pairwise gradients of Aqk (from ``daqk``) and A = diag(β) Akk (from ``dakk``) of the table's chunks
    to the slots dqh, dkh, dgs, dbs (slot i = table row i; their padded rows are left as they are)."""
    if not isinstance(opts, KDAOptions):
        raise TypeError(f"opts must be a KDAOptions, got {type(opts).__name__}")
    for name, x in (("table", table), ("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, K] of one shape, got {list(q.shape)} and {list(k.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype among bf16, fp16, fp32, got {q.dtype} and {k.dtype}")
    check_token_strides("q", q)
    check_token_strides("k", k)
    H, K = q.shape[2], q.shape[3]
    if K > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"q's head dimension K must be <= {CHUNK_MAX_HEAD_DIM}, got {K}")
    device = q.device
    if k.device != device:
        raise ValueError(f"k must be on {device}, got {k.device}")
    if table.dim() != 2 or table.shape[1] != 4 or table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous int32 [n, 4] tensor, got {table.dtype} {list(table.shape)}")
    if table.device != device:
        raise ValueError(f"table must be on {device}, got {table.device}")
    if not isinstance(gc, torch.Tensor) or gc.dim() != 4:
        raise ValueError(f"gc must be an [n, HV, C, K] tensor, got {getattr(gc, 'shape', type(gc).__name__)}")
    n, HV, C = table.shape[0], gc.shape[1], CHUNK
    if H == 0 or HV % H != 0:
        raise ValueError(f"gc's HV ({HV}) must be a multiple of q's H ({H})")
    for name, x, shape in (
        ("gc", gc, (n, HV, C, K)), ("bt", bt, (n, HV, C)), ("rq", rq, (n, H, C)), ("rk", rk, (n, H, C)),
        ("daqk", daqk, (n, HV, C, C)), ("dakk", dakk, (n, HV, C, C)), ("dqh", dqh, (n, HV, C, K)),
        ("dkh", dkh, (n, HV, C, K)), ("dgs", dgs, (n, HV, C, K)), ("dbs", dbs, (n, HV, C)),
    ):
        _check_slot(name, x, shape, device)
    if n == 0 or HV == 0:
        return
    op_bf16 = q.dtype != torch.float32
    warps, stages, block_k = launch_values(launch, GRADS_INTRA_NUM_WARPS=GRADS_INTRA_NUM_WARPS,
                                           GRADS_INTRA_NUM_STAGES=GRADS_INTRA_NUM_STAGES,
                                           GRADS_INTRA_BLOCK_K=GRADS_INTRA_BLOCK_K)
    chunk_grads_intra_kernel[(n * (C // SUB), HV)](
        table, q, k, gc, bt, rq, rk, daqk, dakk, dqh, dkh, dgs, dbs,
        *q.stride()[:3], *k.stride()[:3], float(opts.scale), H, HV,
        K=K, BK=min(block_k, block_size(K)), C=C, SUBC=SUB, SAFE=bool(opts.safe),
        OP_BF16=op_bf16, EMULATE_BF16=op_bf16 and triton_interpreting(), DOT_PREC=dot_precision(q.dtype),
        num_warps=warps["bf16" if op_bf16 else "fp32"], num_stages=stages,
    )
