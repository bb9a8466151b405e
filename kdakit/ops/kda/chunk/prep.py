"""The state-independent per-chunk stages of the 64-token chunk pipeline (docs/chunk_pipeline.md): ``prep``
(the gate's chunk cumsum, activated beta, l2norm scales) and ``wu`` (W, U, qg, kd from Tinv).

Per chunk row i = (n, b, t0, L) of the chunk table and value head hv (q/k head h = hv // (HV // H)), fp32 math:

    a      = gate_from_preact(g + dt_bias)         log-decay, clamped >= -110, 0 on padded rows r >= L
    G[r]   = sum_{s <= r} a[s]                      -> gc[i, hv]  fp32 [C, K] (padded rows hold G[L-1])
    beta   = activation(raw beta)                   -> bt[i, hv]  fp32 [C]    (0 on padded rows)
    rq, rk = 1 / sqrt(sum x^2 + 1e-6) (or 1)        -> rq[i, h], rk[i, h] fp32 [C] (0 on padded rows),
                                                       by the programs of hv % (HV // H) == 0
    W  = Tinv diag(beta) (k^ * exp(G))    U  = Tinv diag(beta) v         -> w, u   token dtype [C, K], [C, V]
    qg = q^ * exp(G)                      kd = k^ * exp(g_C - G)         -> qg, kd token dtype [C, K]

with q^ = rq q, k^ = rk k, g_C = G[C-1] and Tinv from ``tinv`` (token layout ``[B, T, HV, C]``, rows < L). Token tensors are read through their strides
(q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]); slot tensors are contiguous and indexed
by the program's table row. K, V <= 128; columns beyond K / V are masked. The W and U products take bf16
operands for 16-bit inputs (fp16 too: exponent range) and fp32 ones (``dot_precision``) for fp32 inputs; under
the interpreter, whose bf16 arithmetic and bf16 stores are wrong, the operands and the bf16 stores are rounded
to bf16 in fp32 instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk.tiles import (
    CHUNK,
    as_stored,
    check_pairs,
    check_slot,
    check_table,
    check_token,
    chunk_row,
    dot_operand,
    gate_params,
    head_group,
    launch_values,
    token_base,
    token_dims,
    token_strides,
)
from kdakit.ops.kda.chunk_common import (
    beta_activation,
    block_size,
    gate_from_preact,
    l2norm_rstd,
    load_row_scalars,
    load_rows,
    store_rows,
)
from kdakit.ops.kda.options import KDAOptions

# Launch configs. prep: [C, PREP_BLOCK_K] fp32 tiles (gate, cumsum): the whole row at K = 128 on 8 warps keeps the
# most loads in flight (the fastest of block K 32-128 x 2-8 warps; docs/perf_notes.md); wu: one [C, C] x [C, BK]
# dot per output block, Tinv held as a dot operand across the blocks.
PREP_BLOCK_K = 128
PREP_NUM_WARPS = 8
WU_CONFIG = {"bf16": (64, 8), "fp32": (32, 4)}  # the wu kernel's (BK = BV, warps) by operand kind
# the constants above that a tuning run may override by name (``chunk.launch.Launch``, ``tiles.launch_values``)
LAUNCH_CONSTANTS = ("PREP_BLOCK_K", "PREP_NUM_WARPS", "WU_CONFIG")


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_prep_kernel(
    table, q, k, g, beta, A_log, dt_bias, gc, bt, rq, rk,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    lower_bound, H,
    HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr, USE_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
):
    """One (table row i, value head hv): gc[i, hv], bt[i, hv] and, for the first value head of a group,
    rq[i, h], rk[i, h]."""
    i = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    _, b, t0, L = chunk_row(table, i)
    r = tl.arange(0, C)
    valid = r < L  # [C]
    zero = L * 0  # the tiles' first row (a tensor: load_rows widens it)
    slot = i * HV + hv

    # ---- the gate: log-decay and its inclusive cumsum, BK key columns at a time (columns are independent)
    if HAS_A_LOG:
        expA = tl.exp(tl.load(A_log + hv).to(tl.float32))
    else:
        expA = 1.0
    g_base = token_base(g, b, t0, hv, s_gb, s_gt, s_gh)
    gc_base = gc + slot * (C * K)
    for k0 in range(0, K, BK):
        x = load_rows(g_base, zero, L, s_gt, k0, K, C, BK)  # [C, BK] pre-activation
        if HAS_BIAS:
            c = k0 + tl.arange(0, BK)
            x += tl.load(dt_bias + hv * K + c, mask=c < K, other=0.0).to(tl.float32)[None, :]
        a = gate_from_preact(x, zero, L, k0, K, expA, lower_bound, C, BK, GATE)  # [C, BK], 0 on padded rows
        store_rows(gc_base, tl.cumsum(a, axis=0), zero, C, K, k0, K, C, BK)

    # ---- beta
    b_raw = load_row_scalars(token_base(beta, b, t0, hv, s_bb, s_bt, s_bh), zero, L, s_bt, C)  # [C]
    tl.store(bt + slot * C + r, tl.where(valid, beta_activation(b_raw, BETA_SIGMOID, NEG_EIGVAL), 0.0))

    # ---- l2norm scales of the q/k head, once per group of value heads
    if hv % GROUP == 0:
        h = hv // GROUP
        qk_slot = (i * H + h) * C
        if USE_L2NORM:
            q_base = token_base(q, b, t0, h, s_qb, s_qt, s_qh)
            k_base = token_base(k, b, t0, h, s_kb, s_kt, s_kh)
            sq = tl.zeros([C], dtype=tl.float32)
            sk = tl.zeros([C], dtype=tl.float32)
            for k0 in range(0, K, BK):
                xq = load_rows(q_base, zero, L, s_qt, k0, K, C, BK)  # [C, BK]
                sq += tl.sum(xq * xq, axis=1)
                xk = load_rows(k_base, zero, L, s_kt, k0, K, C, BK)
                sk += tl.sum(xk * xk, axis=1)
            sq = l2norm_rstd(sq)
            sk = l2norm_rstd(sk)
        else:
            sq = tl.full([C], 1.0, dtype=tl.float32)
            sk = sq
        tl.store(rq + qk_slot + r, tl.where(valid, sq, 0.0))
        tl.store(rk + qk_slot + r, tl.where(valid, sk, 0.0))


@triton.jit
def chunk_wu_kernel(
    table, q, k, v, gc, bt, rq, rk, tinv, w, u, qg, kd,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_pb, s_pt, s_ph,
    H,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GROUP: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, INTERPRETED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One (table row i, value head hv): W, U, qg, kd into their slots, one Tinv dot per output block."""
    i = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // GROUP
    _, b, t0, L = chunk_row(table, i)
    r = tl.arange(0, C)
    zero = L * 0
    slot = i * HV + hv
    qk_slot = (i * H + h) * C
    beta = tl.load(bt + slot * C + r)  # [C]
    scale_q = tl.load(rq + qk_slot + r)  # [C]
    scale_k = tl.load(rk + qk_slot + r)
    # [C, C] Tinv, rows r < L at their tokens (padded rows 0: the products below are 0 there either way)
    Ti = dot_operand(load_rows(token_base(tinv, b, t0, hv, s_pb, s_pt, s_ph), zero, L, s_pt, 0, C, C, C),
                     OP_BF16, EMULATE_BF16)

    q_base = token_base(q, b, t0, h, s_qb, s_qt, s_qh)
    k_base = token_base(k, b, t0, h, s_kb, s_kt, s_kh)
    gc_base = gc + slot * (C * K)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        G = load_rows(gc_base, zero, C, K, k0, K, C, BK)  # [C, BK]
        gC = tl.load(gc_base + (C - 1) * K + c, mask=c < K, other=0.0)  # [BK]
        eG = tl.exp(G)
        kh = load_rows(k_base, zero, L, s_kt, k0, K, C, BK) * scale_k[:, None]  # [C, BK] k^, 0 on padded rows
        X = dot_operand(kh * eG * beta[:, None], OP_BF16, EMULATE_BF16)
        Wb = tl.dot(Ti, X, input_precision=DOT_PREC)  # [C, BK]
        store_rows(w + slot * (C * K), as_stored(Wb, w, INTERPRETED), zero, C, K, k0, K, C, BK)
        kdb = kh * tl.exp(gC[None, :] - G)  # [C, BK]
        store_rows(kd + slot * (C * K), as_stored(kdb, kd, INTERPRETED), zero, C, K, k0, K, C, BK)
        qh = load_rows(q_base, zero, L, s_qt, k0, K, C, BK) * scale_q[:, None]  # [C, BK] q^
        store_rows(qg + slot * (C * K), as_stored(qh * eG, qg, INTERPRETED), zero, C, K, k0, K, C, BK)

    v_base = token_base(v, b, t0, hv, s_vb, s_vt, s_vh)
    for v0 in range(0, V, BV):
        Y = dot_operand(load_rows(v_base, zero, L, s_vt, v0, V, C, BV) * beta[:, None], OP_BF16, EMULATE_BF16)
        Ub = tl.dot(Ti, Y, input_precision=DOT_PREC)  # [C, BV]
        store_rows(u + slot * (C * V), as_stored(Ub, u, INTERPRETED), zero, C, V, v0, V, C, BV)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def run_prep(opts: KDAOptions, table, q, k, g, beta, A_log, dt_bias, gc, bt, rq, rk, *, launch=None) -> None:
    """gc, bt, rq, rk of the table's chunks (A_log / dt_bias: ``opts.kernel_gate_params`` views or None)."""
    block_k, warps = launch_values(launch, PREP_BLOCK_K=PREP_BLOCK_K, PREP_NUM_WARPS=PREP_NUM_WARPS)
    if not isinstance(opts, KDAOptions):
        raise TypeError(f"opts must be a KDAOptions, got {type(opts).__name__}")
    n = check_table(table)
    B, T, H, K = token_dims("q", q, 4)
    HV = token_dims("g", g, 4)[2]
    group = head_group(H, HV, K, 0)
    check_token("k", k, (B, T, H, K))
    check_token("g", g, (B, T, HV, K))
    check_token("beta", beta, (B, T, HV))
    A_log, dt_bias = gate_params(opts, A_log, dt_bias, HV, K)
    f32 = torch.float32
    check_slot("gc", gc, (n, HV, CHUNK, K), f32)
    check_slot("bt", bt, (n, HV, CHUNK), f32)
    check_slot("rq", rq, (n, H, CHUNK), f32)
    check_slot("rk", rk, (n, H, CHUNK), f32)
    if n == 0:
        return
    chunk_prep_kernel[(n, HV)](
        table, q, k, g, beta, A_log, dt_bias, gc, bt, rq, rk,
        *token_strides(q), *token_strides(k), *token_strides(g), *token_strides(beta),
        opts.kernel_lower_bound, H,
        HV=HV, K=K, C=CHUNK, BK=min(block_k, block_size(K)), GROUP=group,
        GATE=opts.gate, HAS_A_LOG=opts.has_A_log, HAS_BIAS=opts.has_dt_bias,
        USE_L2NORM=opts.use_qk_l2norm_in_kernel, BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
        NEG_EIGVAL=opts.neg_eigval, num_warps=warps, num_stages=1,
    )


def run_wu(opts: KDAOptions, table, q, k, v, gc, bt, rq, rk, tinv, w, u, qg, kd, *, launch=None) -> None:
    """W, U, qg, kd of the table's chunks from the prep slots and Tinv."""
    if not isinstance(opts, KDAOptions):
        raise TypeError(f"opts must be a KDAOptions, got {type(opts).__name__}")
    n = check_table(table)
    B, T, H, K = token_dims("q", q, 4)
    HV, V = token_dims("v", v, 4)[2:]
    group = head_group(H, HV, K, V)
    check_token("k", k, (B, T, H, K))
    check_token("v", v, (B, T, HV, V))
    f32, dt = torch.float32, q.dtype
    check_slot("gc", gc, (n, HV, CHUNK, K), f32)
    check_slot("bt", bt, (n, HV, CHUNK), f32)
    check_slot("rq", rq, (n, H, CHUNK), f32)
    check_slot("rk", rk, (n, H, CHUNK), f32)
    try:
        pair_strides = check_pairs(tinv, tinv, B, T, HV, dt)
    except (TypeError, ValueError) as e:  # check_pairs names its first tensor aqk: here it is tinv
        raise type(e)(str(e).replace("aqk", "tinv")) from None
    check_slot("w", w, (n, HV, CHUNK, K), dt)
    check_slot("u", u, (n, HV, CHUNK, V), dt)
    check_slot("qg", qg, (n, HV, CHUNK, K), dt)
    check_slot("kd", kd, (n, HV, CHUNK, K), dt)
    if n == 0:
        return
    op_bf16 = dt != torch.float32
    block, warps = launch_values(launch, WU_CONFIG=WU_CONFIG)[0]["bf16" if op_bf16 else "fp32"]
    chunk_wu_kernel[(n, HV)](
        table, q, k, v, gc, bt, rq, rk, tinv, w, u, qg, kd,
        *token_strides(q), *token_strides(k), *token_strides(v), *pair_strides,
        H,
        HV=HV, K=K, V=V, C=CHUNK, BK=min(block, block_size(K)), BV=min(block, block_size(V)),
        GROUP=group,
        OP_BF16=op_bf16, EMULATE_BF16=op_bf16 and triton_interpreting(),
        INTERPRETED=triton_interpreting(), DOT_PREC=dot_precision(dt),
        num_warps=warps, num_stages=1,
    )
