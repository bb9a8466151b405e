"""Triton tiles of one 64-token chunk, shared by the chunk backward's three kernels.

A chunk of ``C = 64`` tokens is handled as whole ``[C, BK]`` register tiles; its pairwise matrices are
built from ``SUB = 16``-token sub-chunks so that every exponential stays inside float32 range for any
gate (FLA's numerics):

    G = cumsum(a) over the chunk rows, A[i, j] = sum_c x_i[c] y_j[c] exp(G_i[c] - G_j[c])

* off-diagonal sub-chunk blocks (j in an earlier sub-chunk than i): with the reference
  ``r_I = G[SUB*I - 1]`` (the last row before sub-chunk I) both ``exp(G_i - r_I)`` and ``exp(r_I - G_j)``
  are <= 1, so one masked ``[C, BK] x [BK, C]`` dot per sub-chunk I gives those blocks for any gate;
* diagonal blocks, SAFE (log-decay >= -5 per token): a mid-sub-chunk reference keeps the exponents
  within +-40, one dot for all four blocks;
* diagonal blocks, EXACT (any gate, e.g. the unbounded softplus gate): ``exp(G_i - G_j)`` is formed
  per pair on ``[SUB, SUB, BKS]`` slices of sub-chunk tiles re-read from memory (only differences
  within a sub-chunk are exponentiated, so -1000 log-decays stay finite).

The gradient of such a matrix follows the same split. Its decay gradient uses the identity
``dG = x * dx - y * dy`` with the diagonal (i = j) terms left out of the dots: they cancel exactly
in dG, so they are added to dx and dy separately in fp32 and never enter dG.

``(I + A)^-1`` of a strictly lower ``[C, C]`` matrix: the four ``[SUB, SUB]`` diagonal blocks by
forward substitution (batched as one ``[4, SUB, SUB]`` tile), the off-diagonal blocks by block
substitution with exact fp32 dots, stored block by block.

Tiles are fp32; loads upcast; padded tail rows are zero (a = 0, beta = 0, k = q = 0), so they are
identity steps. Pointer bases are already advanced to the sequence start and head (int64).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import (
    beta_activation,
    gate_from_preact,
    l2norm_rows_bwd,
    l2norm_rstd,
    load_row_scalars,
    load_rows,
    pairwise_exact,
    round_to_bf16,
)

CHUNK = 64  # tokens per chunk (C)
SUB = 16  # tokens per sub-chunk (the pairwise matrices' numerically safe block)


@triton.jit
def dot_operand(x, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """A ``tl.dot`` operand: bf16 rounded to nearest when OP_BF16 (the interpreter keeps fp32 but
    rounds like the GPU), else fp32."""
    if OP_BF16:
        if EMULATE_BF16:
            y = round_to_bf16(x.to(tl.float32))
        else:
            y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def mm(a, b, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """``a @ b`` with fp32 accumulation on operands made by dot_operand."""
    return tl.dot(dot_operand(a, OP_BF16, EMULATE_BF16), dot_operand(b, OP_BF16, EMULATE_BF16),
                  input_precision=DOT_PREC)


@triton.jit
def take_row(x, i, BR: tl.constexpr):
    """Row ``i`` of ``x`` ``[BR, BC]`` -> ``[BC]``."""
    r = tl.arange(0, BR)
    return tl.sum(tl.where((r == i)[:, None], x, 0.0), axis=0)


# ---------------------------------------------------------------------------------------
# pairwise matrices of a chunk and their gradients
# ---------------------------------------------------------------------------------------


@triton.jit
def _mid_reference(G, C: tl.constexpr, SUBC: tl.constexpr):
    """``[C, BK]``: row i holds G at the middle row of i's sub-chunk."""
    rows = tl.arange(0, C)
    ref = tl.zeros_like(G)
    for I in tl.static_range(C // SUBC):
        r = take_row(G, SUBC * I + SUBC // 2 - 1, C)
        ref = tl.where((rows // SUBC == I)[:, None], r[None, :], ref)
    return ref


@triton.jit
def _block_rows(G, ROW: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr):
    """``[C // SUBC, BK]``: row ROW of each sub-chunk of G ``[C, BK]``, all sub-chunks in one reduction."""
    G3 = tl.reshape(G, (C // SUBC, SUBC, BK))
    sub = tl.arange(0, SUBC)
    return tl.sum(tl.where((sub == ROW)[None, :, None], G3, 0.0), axis=1)


@triton.jit
def _spread(R, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr):
    """``[C, BK]`` whose row i holds row ``i // SUBC`` of R ``[C // SUBC, BK]``."""
    return tl.reshape(tl.broadcast_to(R[:, None, :], (C // SUBC, SUBC, BK)), (C, BK))


@triton.jit
def pairwise_qk_kk_block(qn, kn, G, SAFE: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr,
                         OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
                         REFS_BY_RESHAPE: tl.constexpr):
    """One key block's share of ``Aqk`` (causal, with the diagonal) and ``Akk`` (strictly causal) ``[C, C]``
    from ``[C, BK]`` tiles: off-diagonal sub-chunk blocks for any gate (reference row ``G[SUBC*I - 1]``,
    both factors <= 1), and with SAFE the diagonal blocks from a mid-sub-chunk reference (exponents within
    +-40 at log-decay >= -5). Without SAFE the diagonal blocks are the caller's (exact path).

    REFS_BY_RESHAPE: the reference rows of all sub-chunks from one reduction of G seen as
    ``[C // SUBC, SUBC, BK]`` instead of one row extraction (a cross-warp reduction) per reference."""
    rows = tl.arange(0, C)
    blk = rows // SUBC
    NB: tl.constexpr = C // SUBC
    if REFS_BY_RESHAPE:
        last = _block_rows(G, SUBC - 1, C, SUBC, BK)  # [NB, BK]: G at the last row of each sub-chunk
        # row i: G at the last row before its sub-chunk (0 for the first sub-chunk)
        bi = tl.arange(0, NB)
        prev = tl.sum(tl.where((bi[:, None] == bi[None, :] + 1)[:, :, None], last[None, :, :], 0.0), axis=1)
        ref = _spread(prev, C, SUBC, BK)
    else:
        ref = tl.zeros_like(G)
        for I in tl.static_range(1, NB):
            ref = tl.where((blk == I)[:, None], take_row(G, SUBC * I - 1, C)[None, :], ref)
    fx = tl.exp(G - ref)  # [C, BK], <= 1: every row's own block reference
    xq = dot_operand(qn * fx, OP_BF16, EMULATE_BF16)
    xk = dot_operand(kn * fx, OP_BF16, EMULATE_BF16)
    Aqk = tl.zeros([C, C], dtype=tl.float32)
    Akk = tl.zeros([C, C], dtype=tl.float32)
    for I in tl.static_range(1, NB):
        r = take_row(ref, SUBC * I, C)  # [BK] = G[SUBC*I - 1]
        before = (rows < SUBC * I)[:, None]
        yT = tl.trans(dot_operand(tl.where(before, kn * tl.exp(tl.where(before, r[None, :] - G, 0.0)), 0.0),
                                  OP_BF16, EMULATE_BF16))  # [BK, C], <= |k|
        inI = (blk == I)[:, None]
        Aqk += tl.where(inI, tl.dot(xq, yT, input_precision=DOT_PREC), 0.0)
        Akk += tl.where(inI, tl.dot(xk, yT, input_precision=DOT_PREC), 0.0)
    if SAFE:
        if REFS_BY_RESHAPE:
            mid = _spread(_block_rows(G, SUBC // 2 - 1, C, SUBC, BK), C, SUBC, BK)
        else:
            mid = tl.zeros_like(G)
            for I in tl.static_range(NB):
                mid = tl.where((blk == I)[:, None], take_row(G, SUBC * I + SUBC // 2 - 1, C)[None, :], mid)
        ex = tl.exp(G - mid)
        yT = tl.trans(dot_operand(kn * tl.exp(mid - G), OP_BF16, EMULATE_BF16))
        same = blk[:, None] == blk[None, :]
        Aqk += tl.where(same & (rows[:, None] >= rows[None, :]),
                        tl.dot(dot_operand(qn * ex, OP_BF16, EMULATE_BF16), yT, input_precision=DOT_PREC), 0.0)
        Akk += tl.where(same & (rows[:, None] > rows[None, :]),
                        tl.dot(dot_operand(kn * ex, OP_BF16, EMULATE_BF16), yT, input_precision=DOT_PREC), 0.0)
    return Aqk, Akk


@triton.jit
def _embed_block(Bk, I, C: tl.constexpr, SUBC: tl.constexpr):
    """``[C, C]`` holding ``Bk`` ``[SUBC, SUBC]`` at diagonal block I, zero elsewhere (exact fp32)."""
    rows = tl.arange(0, C)
    sub = tl.arange(0, SUBC)
    P = tl.where(rows[:, None] == SUBC * I + sub[None, :], 1.0, 0.0)  # [C, SUBC]
    return tl.dot(tl.dot(P, Bk, input_precision="ieee"), tl.trans(P), input_precision="ieee")


@triton.jit
def _diag_block(M, I, C: tl.constexpr, SUBC: tl.constexpr):
    """Diagonal block I of ``M`` ``[C, C]`` -> ``[SUBC, SUBC]`` (exact fp32)."""
    rows = tl.arange(0, C)
    sub = tl.arange(0, SUBC)
    P = tl.where(rows[:, None] == SUBC * I + sub[None, :], 1.0, 0.0)  # [C, SUBC]
    return tl.dot(tl.trans(P), tl.dot(M, P, input_precision="ieee"), input_precision="ieee")


@triton.jit
def _embed_rows(Xs, I, C: tl.constexpr, SUBC: tl.constexpr):
    """``[C, BC]`` holding ``Xs`` ``[SUBC, BC]`` at rows of sub-chunk I (exact fp32)."""
    rows = tl.arange(0, C)
    sub = tl.arange(0, SUBC)
    P = tl.where(rows[:, None] == SUBC * I + sub[None, :], 1.0, 0.0)  # [C, SUBC]
    return tl.dot(P, Xs, input_precision="ieee")


@triton.jit
def _sub_row_scales(rx, ry, I, C: tl.constexpr, SUBC: tl.constexpr):
    """The l2norm scales ``rx``, ``ry`` ``[C]`` of sub-chunk I's rows -> (rxi, ryi) ``[SUBC]``."""
    rows = tl.arange(0, C)
    sub = tl.arange(0, SUBC)
    sel = (rows[None, :] == SUBC * I + sub[:, None])  # [SUBC, C]
    rxi = tl.sum(tl.where(sel, rx[None, :], 0.0), axis=1)  # [SUBC]
    ryi = tl.sum(tl.where(sel, ry[None, :], 0.0), axis=1)
    return rxi, ryi


@triton.jit
def _sub_slice(x_base, y_base, rxi, ryi, g_base, bias_ptr, t0, n_rows, stride_x, stride_g, ks, K, expA, lower_bound,
               stride_bias, SUBC: tl.constexpr, BKS: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One sub-chunk (first row t0) and key slice ``[ks, ks + BKS)`` of the EXACT diagonal blocks, re-read from
    memory: (xs, ys) the normalized x, y rows and Gs the sub-chunk's own cumsum of the log-decay, all
    ``[SUBC, BKS]`` (0 on padded rows/columns)."""
    xs = load_rows(x_base, t0, n_rows, stride_x, ks, K, SUBC, BKS) * rxi[:, None]
    ys = load_rows(y_base, t0, n_rows, stride_x, ks, K, SUBC, BKS) * ryi[:, None]
    a_s = load_gate(g_base, bias_ptr, t0, n_rows, stride_g, ks, K, expA, lower_bound, SUBC, BKS, GATE, HAS_BIAS,
                    stride_bias)
    return xs, ys, tl.cumsum(a_s, axis=0)


@triton.jit
def pairwise_diag_exact(x_base, y_base, rx, ry, g_base, bias_ptr, t0, n_rows, stride_x, stride_g, K,
                        expA, lower_bound, stride_bias,
                        C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                        GATE: tl.constexpr, HAS_BIAS: tl.constexpr, INCLUDE_DIAG: tl.constexpr):
    """Diagonal sub-chunk blocks for any gate, from sub-chunk tiles re-read from memory.

    x_base, y_base: raw rows (q or k); rx, ry ``[C]``: their l2norm scales (1 without l2norm).
    -> ``[C, C]``, zero outside the diagonal blocks.
    """
    A = tl.zeros([C, C], dtype=tl.float32)
    for I in tl.static_range(C // SUBC):
        rxi, ryi = _sub_row_scales(rx, ry, I, C, SUBC)
        blk = tl.zeros([SUBC, SUBC], dtype=tl.float32)
        for ks in tl.static_range(0, BK, BKS):
            xs, ys, Gs = _sub_slice(x_base, y_base, rxi, ryi, g_base, bias_ptr, t0 + SUBC * I, n_rows, stride_x,
                                    stride_g, ks, K, expA, lower_bound, stride_bias, SUBC, BKS, GATE, HAS_BIAS)
            blk += pairwise_exact(xs, ys, Gs, SUBC, INCLUDE_DIAG)
        A += _embed_block(blk, I, C, SUBC)
    return A


@triton.jit
def pairwise_offdiag_bwd(dA, x, y, G, dx, dy, dG, C: tl.constexpr, SUBC: tl.constexpr,
                         OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """Gradient of pairwise_offdiag: dA ``[C, C]``; adds to and returns the accumulators (dx, dy, dG) ``[C, BK]``.

    dG multiplies the dots' results by the very operands (rounded as the dots saw them) that the other
    side's dot used, so each pair's two terms cancel exactly in the decay gradient's running sums
    whatever the operand rounding: bf16 operands then perturb the inputs, not the cancellation.
    """
    rows = tl.arange(0, C)
    dAo = dot_operand(dA, OP_BF16, EMULATE_BF16)
    for I in tl.static_range(1, C // SUBC):
        r = take_row(G, SUBC * I - 1, C)  # [BK]
        inI = (rows // SUBC == I)[:, None]
        before = (rows < SUBC * I)[:, None]
        fx = tl.where(inI, tl.exp(tl.where(inI, G - r[None, :], 0.0)), 0.0)  # [C, BK]
        fy = tl.where(before, tl.exp(tl.where(before, r[None, :] - G, 0.0)), 0.0)
        xe = dot_operand(x * fx, OP_BF16, EMULATE_BF16)
        ye = dot_operand(y * fy, OP_BF16, EMULATE_BF16)
        dAI = tl.where(inI & tl.trans(before), dAo, 0.0)  # rows in I, columns before I
        D1 = tl.dot(dAI, ye, input_precision=DOT_PREC)  # [C, BK]
        D2 = tl.dot(tl.trans(dAI), xe, input_precision=DOT_PREC)
        dx += fx * D1
        dy += fy * D2
        dG += xe.to(tl.float32) * D1 - ye.to(tl.float32) * D2
    return dx, dy, dG


@triton.jit
def pairwise_diag_safe_bwd(dA, x, y, G, dx, dy, dG, C: tl.constexpr, SUBC: tl.constexpr,
                           OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """Gradient of the strictly-lower part of pairwise_diag_safe (the i = j terms are the caller's):
    adds to (dx, dy, dG) as pairwise_offdiag_bwd does."""
    rows = tl.arange(0, C)
    ref = _mid_reference(G, C, SUBC)
    ex = tl.exp(G - ref)
    ey = tl.exp(ref - G)
    same = (rows[:, None] // SUBC) == (rows[None, :] // SUBC)
    dAs = dot_operand(tl.where(same & (rows[:, None] > rows[None, :]), dA, 0.0), OP_BF16, EMULATE_BF16)
    xe = dot_operand(x * ex, OP_BF16, EMULATE_BF16)
    ye = dot_operand(y * ey, OP_BF16, EMULATE_BF16)
    D1 = tl.dot(dAs, ye, input_precision=DOT_PREC)
    D2 = tl.dot(tl.trans(dAs), xe, input_precision=DOT_PREC)
    return dx + ex * D1, dy + ey * D2, dG + (xe.to(tl.float32) * D1 - ye.to(tl.float32) * D2)


@triton.jit
def pairwise_diag_exact_bwd(dA, x_base, y_base, rx, ry, g_base, bias_ptr, t0, n_rows, stride_x, stride_g, K,
                            expA, lower_bound, stride_bias, dx, dy, dG,
                            C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                            GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Gradient of the strictly-lower part of pairwise_diag_exact w.r.t. the normalized x, y.

    Adds to and returns (dx, dy, dG) ``[C, BK]`` (fp32 throughout). Exponentials are of
    within-sub-chunk differences only.
    """
    sub = tl.arange(0, SUBC)
    cols = tl.arange(0, BK)
    keep = (sub[:, None] > sub[None, :])[:, :, None]  # [SUBC, SUBC, 1] strictly causal
    for I in tl.static_range(C // SUBC):
        rxi, ryi = _sub_row_scales(rx, ry, I, C, SUBC)
        dAb = _diag_block(dA, I, C, SUBC)  # [SUBC, SUBC]
        dxI = tl.zeros([SUBC, BK], dtype=tl.float32)
        dyI = tl.zeros([SUBC, BK], dtype=tl.float32)
        dGI = tl.zeros([SUBC, BK], dtype=tl.float32)
        for ks in tl.static_range(0, BK, BKS):
            xs, ys, Gs = _sub_slice(x_base, y_base, rxi, ryi, g_base, bias_ptr, t0 + SUBC * I, n_rows, stride_x,
                                    stride_g, ks, K, expA, lower_bound, stride_bias, SUBC, BKS, GATE, HAS_BIAS)
            d = Gs[:, None, :] - Gs[None, :, :]
            E = tl.where(keep, tl.exp(tl.where(keep, d, 0.0)), 0.0)  # [SUBC, SUBC, BKS]
            w = dAb[:, :, None] * E
            dxs = tl.sum(w * ys[None, :, :], axis=1)  # [SUBC, BKS]
            dys = tl.sum(w * xs[:, None, :], axis=0)  # [SUBC, BKS]
            # place the slice's columns: [SUBC, BKS] -> [SUBC, BK]
            Q = tl.where(tl.arange(0, BKS)[:, None] + ks == cols[None, :], 1.0, 0.0)  # [BKS, BK]
            dxI += tl.dot(dxs, Q, input_precision="ieee")
            dyI += tl.dot(dys, Q, input_precision="ieee")
            dGI += tl.dot(xs * dxs - ys * dys, Q, input_precision="ieee")
        dx += _embed_rows(dxI, I, C, SUBC)
        dy += _embed_rows(dyI, I, C, SUBC)
        dG += _embed_rows(dGI, I, C, SUBC)
    return dx, dy, dG


# ---------------------------------------------------------------------------------------
# token transforms of a chunk
# ---------------------------------------------------------------------------------------


@triton.jit
def gate_preact(g_base, bias_ptr, t0, n_rows, stride_g, col0, K, stride_bias,
                BR: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``x = g + dt_bias`` ``[BR, BC]`` fp32 (dt_bias read through its element stride)."""
    x = load_rows(g_base, t0, n_rows, stride_g, col0, K, BR, BC)
    if HAS_BIAS:
        c = col0 + tl.arange(0, BC)
        bias = tl.load(bias_ptr + c.to(tl.int64) * stride_bias, mask=c < K, other=0.0).to(tl.float32)
        x = x + bias[None, :]
    return x


@triton.jit
def load_gate(g_base, bias_ptr, t0, n_rows, stride_g, col0, K, expA, lower_bound,
              BR: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, stride_bias):
    x = gate_preact(g_base, bias_ptr, t0, n_rows, stride_g, col0, K, stride_bias, BR, BC, HAS_BIAS)
    return gate_from_preact(x, t0, n_rows, col0, K, expA, lower_bound, BR, BC, GATE)


@triton.jit
def load_beta(b_base, t0, n_rows, stride_b, BR: tl.constexpr, BETA_SIGMOID: tl.constexpr,
              NEG_EIGVAL: tl.constexpr):
    """(activated beta, raw beta) ``[BR]``, both 0 on padded rows."""
    r = t0 + tl.arange(0, BR)
    raw = load_row_scalars(b_base, t0, n_rows, stride_b, BR)
    return tl.where(r < n_rows, beta_activation(raw, BETA_SIGMOID, NEG_EIGVAL), 0.0), raw


@triton.jit
def load_unit_rows(base, t0, n_rows, stride_row, K, BR: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """(x normalized, x raw, rstd ``[BR]``) of q or k rows; rstd = 1 without l2norm."""
    x = load_rows(base, t0, n_rows, stride_row, 0, K, BR, BK)
    if USE_L2NORM:
        rstd = l2norm_rstd(tl.sum(x * x, axis=1))
    else:
        rstd = tl.zeros([BR], dtype=tl.float32) + 1.0
    return x * rstd[:, None], rstd


@triton.jit
def l2norm_bwd(dxn, xn, rstd, USE_L2NORM: tl.constexpr):
    if USE_L2NORM:
        d = l2norm_rows_bwd(dxn, xn, rstd)
    else:
        d = dxn
    return d


# ---------------------------------------------------------------------------------------
# (I + A)^-1 of a strictly lower [C, C] matrix, by sub-chunk blocks
# ---------------------------------------------------------------------------------------


@triton.jit
def _blocks(M, C: tl.constexpr, SUBC: tl.constexpr):
    """All sub-chunk blocks of M ``[C, C]`` as ``[C//SUBC, C//SUBC, SUBC, SUBC]``-indexable pieces:
    returns M reshaped to ``[NB, SUBC, NB, SUBC]``."""
    return tl.reshape(M, (C // SUBC, SUBC, C // SUBC, SUBC))


@triton.jit
def _block(M4, I: tl.constexpr, J: tl.constexpr, NB: tl.constexpr):
    """Block (I, J) ``[SUBC, SUBC]`` of a ``[NB, SUBC, NB, SUBC]`` tile."""
    bi = tl.arange(0, NB)
    x = tl.sum(tl.where((bi == I)[:, None, None, None], M4, 0.0), axis=0)  # [SUBC, NB, SUBC]
    return tl.sum(tl.where((bi == J)[None, :, None], x, 0.0), axis=1)  # [SUBC, SUBC]


@triton.jit
def _unit_lower_inverse_batched(A3, NB: tl.constexpr, SUBC: tl.constexpr):
    """``(I + A_b)^-1`` for each strictly lower ``A_b`` of ``A3`` ``[NB, SUBC, SUBC]`` (forward
    substitution, SUBC - 1 dependent steps shared by the NB blocks)."""
    r = tl.arange(0, SUBC)
    X = -A3
    for i in tl.static_range(1, SUBC):
        row = tl.sum(tl.where((r == i)[None, :, None], X, 0.0), axis=1)  # [NB, SUBC] = -A_i
        row = row + tl.sum(row[:, :, None] * X, axis=1)  # rows j < i of X are final; columns >= i of row are 0
        X = tl.where((r == i)[None, :, None], row[:, None, :], X)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    return X + eye[None, :, :]


@triton.jit
def mm_exact(a, b):
    """``a @ b`` in exact fp32 (the inverse's block products)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def unit_lower_inverse_offdiag(T00, T11, T22, T33, A10, A20, A21, A30, A31, A32):
    """The blocks below the diagonal of ``(I + A)^-1``, A strictly lower of 4 x 4 sub-chunk blocks ``[SUBC, SUBC]``,
    from the diagonal blocks' inverses ``T_II`` and A's blocks below the diagonal:
    ``T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ`` (exact fp32 dots). -> (T10, T20, T21, T30, T31, T32)"""
    T10 = -mm_exact(T11, mm_exact(A10, T00))
    T21 = -mm_exact(T22, mm_exact(A21, T11))
    T32 = -mm_exact(T33, mm_exact(A32, T22))
    T20 = -mm_exact(T22, mm_exact(A20, T00) + mm_exact(A21, T10))
    T31 = -mm_exact(T33, mm_exact(A31, T11) + mm_exact(A32, T21))
    T30 = -mm_exact(T33, mm_exact(A30, T00) + mm_exact(A31, T10) + mm_exact(A32, T20))
    return T10, T20, T21, T30, T31, T32


@triton.jit
def store_unit_lower_inverse(A, out_base, t0, n_rows, stride_row, C: tl.constexpr, SUBC: tl.constexpr,
                             EMULATE_BF16: tl.constexpr):
    """Store ``(I + A)^-1`` (A strictly lower ``[C, C]``, C = 4 SUBC) into rows ``t0 + i`` columns j of
    ``out`` (row i of the chunk holds row i of the inverse; blocks above the diagonal are not written)."""
    NB: tl.constexpr = C // SUBC
    M4 = _blocks(A, C, SUBC)
    bi = tl.arange(0, NB)
    # diagonal blocks [NB, SUBC, SUBC]
    D = tl.sum(tl.where((bi[:, None] == bi[None, :])[:, None, :, None], M4, 0.0), axis=2)
    Tdiag = _unit_lower_inverse_batched(D, NB, SUBC)
    T00 = tl.sum(tl.where((bi == 0)[:, None, None], Tdiag, 0.0), axis=0)
    T11 = tl.sum(tl.where((bi == 1)[:, None, None], Tdiag, 0.0), axis=0)
    T22 = tl.sum(tl.where((bi == 2)[:, None, None], Tdiag, 0.0), axis=0)
    T33 = tl.sum(tl.where((bi == 3)[:, None, None], Tdiag, 0.0), axis=0)
    A10 = _block(M4, 1, 0, NB)
    A20 = _block(M4, 2, 0, NB)
    A21 = _block(M4, 2, 1, NB)
    A30 = _block(M4, 3, 0, NB)
    A31 = _block(M4, 3, 1, NB)
    A32 = _block(M4, 3, 2, NB)
    T10, T20, T21, T30, T31, T32 = unit_lower_inverse_offdiag(T00, T11, T22, T33, A10, A20, A21, A30, A31, A32)
    _store_block(out_base, T00, t0, 0, 0, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T10, t0, 1, 0, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T11, t0, 1, 1, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T20, t0, 2, 0, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T21, t0, 2, 1, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T22, t0, 2, 2, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T30, t0, 3, 0, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T31, t0, 3, 1, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T32, t0, 3, 2, n_rows, stride_row, SUBC, EMULATE_BF16)
    _store_block(out_base, T33, t0, 3, 3, n_rows, stride_row, SUBC, EMULATE_BF16)


@triton.jit
def _store_block(out_base, X, t0, I: tl.constexpr, J: tl.constexpr, n_rows, stride_row, SUBC: tl.constexpr,
                 EMULATE_BF16: tl.constexpr):
    r = t0 + SUBC * I + tl.arange(0, SUBC)
    c = SUBC * J + tl.arange(0, SUBC)
    if EMULATE_BF16:
        X = round_to_bf16(X)
    ptrs = out_base + r.to(tl.int64)[:, None] * stride_row + c[None, :]
    tl.store(ptrs, X.to(out_base.dtype.element_ty), mask=(r < n_rows)[:, None])


@triton.jit
def load_unit_lower(base, t0, n_rows, stride_row, C: tl.constexpr):
    """The stored inverse ``[C, C]`` fp32 (lower triangle incl. the diagonal; zero above and on padded rows)."""
    r = tl.arange(0, C)
    rr = t0 + r
    keep = (rr < n_rows)[:, None] & (r[:, None] >= r[None, :])
    ptrs = base + rr.to(tl.int64)[:, None] * stride_row + r[None, :]
    return tl.load(ptrs, mask=keep, other=0.0).to(tl.float32)
