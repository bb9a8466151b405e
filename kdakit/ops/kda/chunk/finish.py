"""The last stage of the 64-token chunk pipeline's backward (docs/chunk_pipeline.md): from the per-chunk gradients
w.r.t. the transformed inputs (q^, k^, G, g_C, beta) to the gradients of the raw inputs, written once each in the
inputs' dtypes.

Per chunk row i = (n, b, t0, L) of the chunk table and q/k head h with its value heads hv = h*G .. h*G+G-1
(G = HV // H), fp32 math, rows r < L only:

    dq = rq * (dq^ - q^ (dq^ . q^)),  dq^ = sum_hv dqh[i, hv],  q^ = rq q   (dq = dq^ without the l2norm);  same for dk
    da[r] = sum_{r <= s < L} dgs[i, hv, s] + dgc[i, hv]                 (per value head; G = cumsum a, g_C = G[C-1])
    dg    = da * d a / d(g + dt_bias)    0 where the clamp a >= -110 holds (gate_log_decay_bwd_floored); NaN stays NaN
    dalog[i, hv]    = sum_{r, c} da * d a / d A_log                      (partials: the caller sums over i)
    dbias[i, hv, c] = sum_r dg[r, c]
    dbeta = beta_activation_bwd(dbs[i, hv], raw beta)

and, once per call, ``partial_sums``: the partials of every chunk row summed over the rows (dA_log ``[HV]``,
ddt_bias ``[HV * K]``) in a fixed order, into the output alone (no staging buffer beside it, so the plan's
allocation model stays exact, and reruns are bitwise equal).

Token tensors (q, k [B, T, H, K]; g [B, T, HV, K]; beta [B, T, HV]; dq, dk, dg, dbeta likewise) are read and
written through their strides; slot tensors are contiguous (rq, rk fp32 [n, H, C]; dqh, dkh, dgs fp32
[n, HV, C, K]; dgc fp32 [n, HV, K]; dbs fp32 [n, HV, C]; dalog fp32 [n, HV]; dbias fp32 [n, HV, K]); their
padded rows r >= L are never read. K <= 128.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk.tiles import (
    CHUNK,
    as_stored,
    check_slot,
    check_table,
    check_token,
    chunk_row,
    gate_params,
    head_group,
    launch_values,
    token_base,
    token_dims,
    token_strides,
)
from kdakit.ops.kda.chunk_common import (
    beta_activation_bwd,
    block_size,
    gate_from_preact,
    gate_log_decay_bwd_floored,
    l2norm_rows_bwd,
    load_row_scalars,
    load_rows,
    store_row_scalars,
    store_rows,
)
from kdakit.ops.kda.options import KDAOptions

# Launch config: dq / dk in [FINISH_ROWS, K] row blocks (the l2norm backward reduces over K); the gate's reverse
# cumsum in [C, FINISH_BLOCK_K] column blocks (it reduces over rows).
FINISH_ROWS = 16
FINISH_BLOCK_K = 32
FINISH_NUM_WARPS = 4
# The partials' column sums: [SUM_ROWS, SUM_BLOCK] tiles, one program per SUM_BLOCK columns.
SUM_ROWS = 32
SUM_BLOCK = 128
SUM_NUM_WARPS = 4
# the constants above that a tuning run may override by name (``chunk.launch.Launch``, ``tiles.launch_values``)
LAUNCH_CONSTANTS = ("FINISH_ROWS", "FINISH_BLOCK_K", "FINISH_NUM_WARPS", "SUM_ROWS", "SUM_BLOCK",
                    "SUM_NUM_WARPS")


@triton.jit
def _qk_grad(x, rx, dxh, dx, i, b, t0, h, L, s_b, s_t, s_h, s_db, s_dt, s_dh, H,
             HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BKF: tl.constexpr,
             GROUP: tl.constexpr, USE_L2NORM: tl.constexpr, INTERPRETED: tl.constexpr):
    """dx rows (x = q or k) of one chunk and q/k head: the group's dxh slots summed, then the l2norm backward
    through x^ = rx x; BR rows at a time."""
    zero = L * 0
    x_base = token_base(x, b, t0, h, s_b, s_t, s_h)
    dx_base = token_base(dx, b, t0, h, s_db, s_dt, s_dh)
    for r0 in range(0, C, BR):
        rows = r0 + tl.arange(0, BR)
        d = tl.zeros([BR, BKF], dtype=tl.float32)
        for j in range(GROUP):
            d += load_rows(dxh + ((i * HV + h * GROUP + j) * C) * K, zero + r0, L, K, 0, K, BR, BKF)  # [BR, BKF]
        if USE_L2NORM:
            rs = tl.load(rx + (i * H + h) * C + rows, mask=rows < L, other=0.0)  # [BR]
            xh = load_rows(x_base, zero + r0, L, s_t, 0, K, BR, BKF) * rs[:, None]  # [BR, BKF] x^
            d = l2norm_rows_bwd(d, xh, rs)
        store_rows(dx_base, as_stored(d, dx_base, INTERPRETED), zero + r0, L, s_dt, 0, K, BR, BKF)


@triton.jit
def chunk_finish_kernel(
    table, q, k, g, beta, A_log, dt_bias, rq, rk, dqh, dkh, dgs, dgc, dbs, dq, dk, dg, dbeta, dalog, dbias,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    s_dqb, s_dqt, s_dqh, s_dkb, s_dkt, s_dkh, s_dgb, s_dgt, s_dgh, s_dbb, s_dbt, s_dbh,
    lower_bound, H,
    HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BKF: tl.constexpr, BK: tl.constexpr,
    GROUP: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    STORE_DALOG: tl.constexpr, STORE_DBIAS: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One (table row i, q/k head h): dq, dk rows, and per value head of the group dg, dbeta rows and the dA_log /
    ddt_bias partials."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _, b, t0, L = chunk_row(table, i)
    zero = L * 0
    r = tl.arange(0, C)

    _qk_grad(q, rq, dqh, dq, i, b, t0, h, L, s_qb, s_qt, s_qh, s_dqb, s_dqt, s_dqh, H, HV, K, C, BR, BKF, GROUP,
             USE_L2NORM, INTERPRETED)
    _qk_grad(k, rk, dkh, dk, i, b, t0, h, L, s_kb, s_kt, s_kh, s_dkb, s_dkt, s_dkh, H, HV, K, C, BR, BKF, GROUP,
             USE_L2NORM, INTERPRETED)

    for j in range(GROUP):
        hv = h * GROUP + j
        slot = i * HV + hv
        # ---- the gate: da = reverse cumsum of dG over the chunk's rows + dg_C, then the gate's derivative
        if HAS_A_LOG:
            expA = tl.exp(tl.load(A_log + hv).to(tl.float32))
        else:
            expA = 1.0
        g_base = token_base(g, b, t0, hv, s_gb, s_gt, s_gh)
        dg_base = token_base(dg, b, t0, hv, s_dgb, s_dgt, s_dgh)
        dlog_acc = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            c = k0 + tl.arange(0, BK)
            m2 = (r < L)[:, None] & (c < K)[None, :]  # [C, BK]
            d = load_rows(dgs + slot * (C * K), zero, L, K, k0, K, C, BK)  # [C, BK], 0 on padded rows
            dgc_c = tl.load(dgc + slot * K + c, mask=c < K, other=0.0)  # [BK]
            da = tl.cumsum(d, axis=0, reverse=True) + dgc_c[None, :]
            x = load_rows(g_base, zero, L, s_gt, k0, K, C, BK)  # [C, BK] pre-activation
            if HAS_BIAS:
                x += tl.load(dt_bias + hv * K + c, mask=c < K, other=0.0).to(tl.float32)[None, :]
            a = gate_from_preact(x, zero, L, k0, K, expA, lower_bound, C, BK, GATE)
            dx, dlog = gate_log_decay_bwd_floored(da, x, a, expA, lower_bound, GATE)
            dx = tl.where(m2, dx, 0.0)
            store_rows(dg_base, as_stored(dx, dg_base, INTERPRETED), zero, L, s_dgt, k0, K, C, BK)
            # the partials exist only for the in-kernel gate (GATE != 0, GATE_NONE): zeros without it
            if STORE_DBIAS:
                if GATE != 0:
                    tl.store(dbias + slot * K + c, tl.sum(dx, axis=0), mask=c < K)
                else:
                    tl.store(dbias + slot * K + c, tl.zeros([BK], dtype=tl.float32), mask=c < K)
            if STORE_DALOG:
                if GATE != 0:
                    dlog_acc += tl.sum(tl.where(m2, dlog, 0.0), axis=0)
        if STORE_DALOG:
            tl.store(dalog + slot, tl.sum(dlog_acc, axis=0))
        # ---- beta
        b_raw = load_row_scalars(token_base(beta, b, t0, hv, s_bb, s_bt, s_bh), zero, L, s_bt, C)  # [C]
        db = tl.load(dbs + slot * C + r, mask=r < L, other=0.0)
        db_base = token_base(dbeta, b, t0, hv, s_dbb, s_dbt, s_dbh)
        db = beta_activation_bwd(db, b_raw, BETA_SIGMOID, NEG_EIGVAL)  # [C]
        store_row_scalars(db_base, as_stored(db, db_base, INTERPRETED), zero, L, s_dbt, C)


@triton.jit
def partial_sums_kernel(x, out, n, W, BR: tl.constexpr, BW: tl.constexpr):
    """out[c] = sum_i x[i, c] for BW columns of the contiguous fp32 ``x [n, W]``, rows in order."""
    cols = tl.program_id(0).to(tl.int64) * BW + tl.arange(0, BW)  # [BW]
    acc = tl.zeros([BR, BW], dtype=tl.float32)
    r0 = 0
    while r0 < n:  # a while loop: the interpreter cannot range() over an integer argument
        rows = r0 + tl.arange(0, BR)  # [BR]
        m = (rows < n)[:, None] & (cols < W)[None, :]
        acc += tl.load(x + rows.to(tl.int64)[:, None] * W + cols[None, :], mask=m, other=0.0)  # [BR, BW]
        r0 += BR
    tl.store(out + cols, tl.sum(acc, axis=0), mask=cols < W)


def partial_sums(rows: torch.Tensor, *, launch=None) -> torch.Tensor:
    """fp32 ``[n, *shape]`` contiguous partials -> fp32 ``[prod(shape)]``, their sum over the n rows (zeros for
    n == 0)."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dtype != torch.float32 or rows.dim() < 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous fp32 tensor of two or more dimensions, got {rows.dtype} "
                         f"{tuple(rows.shape)} with strides {rows.stride()}")
    n, W = rows.shape[0], math.prod(rows.shape[1:])
    out = torch.empty(W, dtype=torch.float32, device=rows.device)
    if W:
        br, bw, warps = launch_values(launch, SUM_ROWS=SUM_ROWS, SUM_BLOCK=SUM_BLOCK, SUM_NUM_WARPS=SUM_NUM_WARPS)
        partial_sums_kernel[(triton.cdiv(W, bw),)](rows, out, n, W, BR=br, BW=bw, num_warps=warps, num_stages=1)
    return out


def run_finish(opts: KDAOptions, table, q, k, g, beta, A_log, dt_bias, rq, rk, dqh, dkh, dgs, dgc, dbs,
               dq, dk, dg, dbeta, dalog, dbias, *, launch=None) -> None:
    """dq, dk, dg, dbeta rows of the table's chunks, and the per-chunk partials dalog / dbias (None: not written;
    zeros without the in-kernel gate)."""
    if not isinstance(opts, KDAOptions):
        raise TypeError(f"opts must be a KDAOptions, got {type(opts).__name__}")
    n = check_table(table)
    B, T, H, K = token_dims("q", q, 4)
    HV = token_dims("g", g, 4)[2]
    group = head_group(H, HV, K, 0)
    for name, x, shape in (("k", k, (B, T, H, K)), ("g", g, (B, T, HV, K)), ("beta", beta, (B, T, HV)),
                           ("dq", dq, (B, T, H, K)), ("dk", dk, (B, T, H, K)), ("dg", dg, (B, T, HV, K)),
                           ("dbeta", dbeta, (B, T, HV))):
        check_token(name, x, shape)
    A_log, dt_bias = gate_params(opts, A_log, dt_bias, HV, K)
    f32 = torch.float32
    for name, x, shape in (("rq", rq, (n, H, CHUNK)), ("rk", rk, (n, H, CHUNK)), ("dqh", dqh, (n, HV, CHUNK, K)),
                           ("dkh", dkh, (n, HV, CHUNK, K)), ("dgs", dgs, (n, HV, CHUNK, K)), ("dgc", dgc, (n, HV, K)),
                           ("dbs", dbs, (n, HV, CHUNK))):
        check_slot(name, x, shape, f32)
    if dalog is not None:
        check_slot("dalog", dalog, (n, HV), f32)
    if dbias is not None:
        check_slot("dbias", dbias, (n, HV, K), f32)
    if n == 0:
        return
    BKF = block_size(K)
    rows_block, block_k, warps = launch_values(launch, FINISH_ROWS=FINISH_ROWS, FINISH_BLOCK_K=FINISH_BLOCK_K,
                                               FINISH_NUM_WARPS=FINISH_NUM_WARPS)
    chunk_finish_kernel[(n, H)](
        table, q, k, g, beta, A_log, dt_bias, rq, rk, dqh, dkh, dgs, dgc, dbs, dq, dk, dg, dbeta, dalog, dbias,
        *token_strides(q), *token_strides(k), *token_strides(g), *token_strides(beta),
        *token_strides(dq), *token_strides(dk), *token_strides(dg), *token_strides(dbeta),
        opts.kernel_lower_bound, H,
        HV=HV, K=K, C=CHUNK, BR=rows_block, BKF=BKF, BK=min(block_k, BKF), GROUP=group,
        GATE=opts.gate, HAS_A_LOG=opts.has_A_log, HAS_BIAS=opts.has_dt_bias,
        USE_L2NORM=opts.use_qk_l2norm_in_kernel, BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
        NEG_EIGVAL=opts.neg_eigval, STORE_DALOG=dalog is not None, STORE_DBIAS=dbias is not None,
        INTERPRETED=triton_interpreting(), num_warps=warps, num_stages=1,
    )
