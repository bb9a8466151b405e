"""Experimental Triton backward of chunked KDA at 64-token chunks: three whole-sequence launches
(``KDAKIT_CHUNK_PIPELINE=chunk64``; the default is the windowed backward of ``chunk_bwd.py``).

Status (``docs/perf_notes.md``): exact to fp32 round-off under the interpreter for every option. On the
H200 at 1 x 8K, H = HV = 96, bf16, docs/spec.md §3 flags, with the gradients in one fused kernel (2485f0a):
forward+backward 40.9 ms (the windowed backward then: 41.5 ms; FLA 0.6.0: 13.3 ms), prep 7.3, serial
passes 1.55, gradients 26.9 ms, the prep and gradient kernels holding too many ``[64, 128]`` fp32 tiles at
once (ptxas: 255 registers, 3 KB and 20 KB of spill code). The gradients are now split in two kernels
(state products, then pairwise terms; ptxas: 8.1 KB and 7.5 KB of spill code) that have not run on a GPU.
It keeps per-chunk buffers (states, state gradients, W, kd, Aqk, Akk, the inverse: about 1.9 KB per token
and value head in bf16) and the split's fp32 intermediates (about 2 KB more), so it is far above the
memory target: it is the verified reference of the 64-token math for the next design, not a product path.
Without a bounded gate (the EXACT diagonal blocks, e.g. the softplus gate) its gradient kernel did not finish
compiling for sm_90a in 20 minutes on the 2-core CPU machine, nor its accuracy check in ~8 minutes on the
H200: on a GPU, use it with the safe gate only.

Per chunk of C = 64 tokens (``chunk_tiles.py`` for the sub-chunk numerics), with S the state entering
the chunk and dS' the state gradient leaving it::

    Tinv = (I + beta Akk)^-1    W = Tinv (beta k Γ)    U = Tinv (beta v)    V' = U - W S
    O = scale (qΓ S + Aqk V')   S' = exp(g_C) S + kd^T V',  kd = k exp(g_C - G)
    dS = exp(g_C) dS' + P - W^T (kd dS'),   P = scale (qΓ^T dO - W^T Aqk^T dO)

1. the prep stage (``chunk_prep64.py``), grid ``(chunks, HV)``: Akk, Aqk, the inverse, W, kd, exp(g_C) and P
   (into the chunk's state-gradient slot): everything S-independent that the serial passes need.
2. ``chunk_kda_bwd_states_kernel``, grid ``(N*HV, cdiv(V, BV), 2)``: role 0 walks each sequence forward
   from h0 and stores the state entering every chunk; role 1 walks it backward from dht, reading P and
   storing the state gradient leaving every chunk (it needs no state), and writes dh0. Both roles
   recompute only kd, W and U per step (one small dot each) from the stored inverse.
3. ``chunk_kda_bwd_state_grads_kernel``, grid ``(chunks, HV)``: the products with the chunk's stored S and
   dS' (dv, final) and everything through the inverse, into fp32 intermediates; then
   ``chunk_kda_bwd_pair_grads_kernel``, grid ``(chunks, H)``: the pairwise terms and every token
   transform's gradient (a group of HV/H value heads shares its q/k head, so dq and dk are summed in
   registers), written once in the token dtype; A_log / dt_bias partials per chunk, summed in torch.

Slots: ``[chunks, HV, K, V]`` in the token dtype (K-major), one pair per chunk of every sequence.
Layouts: q, k ``[B, T, H, K]``; v, dO ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]`` (all
contiguous, token-major); A_log and dt_bias read through their element strides; dht / dh0 in the state
layout (K-major or ``state_v_first``) through strides. K, V <= 128; int64 offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import (
    beta_activation_bwd,
    gate_from_preact,
    gate_log_decay_bwd_floored,
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
    load_step_operands,
    run_prep,
    sequence_program,
    state_recurrence,
    state_row,
    state_strides,
)
from kdakit.ops.kda.chunk_tiles import (
    CHUNK,
    SUB,
    dot_operand,
    gate_preact,
    l2norm_bwd,
    load_beta,
    load_gate,
    load_unit_rows,
    mm,
    pairwise_diag_exact_bwd,
    pairwise_diag_safe_bwd,
    pairwise_offdiag_bwd,
)

STATES_NUM_WARPS = 8
GRADS_NUM_WARPS = 8
PAIR_NUM_WARPS = 8
STATES_BLOCK_V = 64
GRADS_BLOCK_V = 64  # the gradient kernel's V loop step (32-wide tiles faulted on the H200: illegal address)


# ---------------------------------------------------------------------------------------
# shared per-chunk pieces
# ---------------------------------------------------------------------------------------


@triton.jit
def _pairwise_bwd(dA, x, y, G, dx, dy, dG, x_base, y_base, rx, ry, g_base, bias_ptr, t0, seq_len, stride_x, stride_g,
                  K, expA, lower_bound, stride_bias, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr,
                  BKS: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, SAFE: tl.constexpr,
                  OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """Adds the strictly-lower pairwise terms' (dx, dy, dG) to the accumulators (the diagonal is the caller's)."""
    dx, dy, dG = pairwise_offdiag_bwd(dA, x, y, G, dx, dy, dG, C, SUBC, OP_BF16, EMULATE_BF16, DOT_PREC)
    if SAFE:
        dx, dy, dG = pairwise_diag_safe_bwd(dA, x, y, G, dx, dy, dG, C, SUBC, OP_BF16, EMULATE_BF16, DOT_PREC)
    else:
        dx, dy, dG = pairwise_diag_exact_bwd(dA, x_base, y_base, rx, ry, g_base, bias_ptr, t0, seq_len, stride_x,
                                             stride_g, K, expA, lower_bound, stride_bias, dx, dy, dG, C, SUBC, BK,
                                             BKS, GATE, HAS_BIAS)
    return dx, dy, dG


# ---------------------------------------------------------------------------------------
# kernel 2: states forward (role 0) and state gradients backward (role 1)
# ---------------------------------------------------------------------------------------


@triton.jit
def _reverse_step(dS, i_c, c0, w_base, kd_base, tinv_base, egc, dhs, i_hv, seq_len, HV, v0,
                  K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    t0 = i_c * C
    row = (c0 + i_c) * HV + i_hv
    slot = dhs + row * (K * V)
    P = load_matrix(slot, V, 1, K, V, v0, BK, BV)  # [BK, BV]
    tl.debug_barrier()  # every thread has read P before any overwrites it
    store_matrix(slot, round_to_bf16_if(dS, EMULATE_BF16), V, 1, K, V, v0, BK, BV)
    WT = dot_operand(load_rows_t(w_base, t0, seq_len, HV * K, K, C, BK), OP_BF16, EMULATE_BF16)  # [BK, C]
    kd = dot_operand(load_rows(kd_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)  # [C, BK]
    cols = tl.arange(0, BK)
    egc_c = tl.load(egc + row * K + cols, mask=cols < K, other=0.0)
    kdS = tl.dot(kd, dot_operand(dS, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)  # [C, BV]
    return dS * egc_c[:, None] + P - tl.dot(WT, dot_operand(kdS, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)


@triton.jit
def chunk_kda_bwd_states_kernel(
    v, beta, w, kd, tinv, egc, hs, dhs, h0, dht, dh0, cu_seqlens, chunk_offsets, T, HV, NTS,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v, s_dht_n, s_dht_h, s_dht_k, s_dht_v, s_dh0_n, s_dh0_h, s_dh0_k, s_dh0_v,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr,
    DOT_PREC: tl.constexpr, LOOP_WHILE: tl.constexpr,
):
    # role 0: the states forward, 1: the state gradients backward
    i_n, i_hv, v0, role, bos, seq_len, c0 = sequence_program(cu_seqlens, chunk_offsets, T, HV, NTS, BV, IS_VARLEN)
    v_base = v + (bos * HV + i_hv) * V
    b_base = beta + bos * HV + i_hv
    w_base = w + (bos * HV + i_hv) * K
    kd_base = kd + (bos * HV + i_hv) * K
    tinv_base = tinv + (bos * HV + i_hv) * C
    n_chunks = tl.cdiv(seq_len, C)

    if role == 0:
        state_recurrence(state_row(h0, i_n, i_hv, s_h0_n, s_h0_h, HAS_H0), s_h0_k, s_h0_v, c0, i_hv, seq_len, HV, v0,
                         v_base, b_base, w_base, kd_base, tinv_base, egc, hs, K, V, C, BK, BV,
                         BETA_SIGMOID, NEG_EIGVAL, OP_BF16, EMULATE_BF16, DOT_PREC, HAS_H0, LOOP_WHILE)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_DHT:
            dS = load_matrix(dht + i_n.to(tl.int64) * s_dht_n + i_hv * s_dht_h, s_dht_k, s_dht_v, K, V, v0, BK, BV)
        if LOOP_WHILE:
            i_c = n_chunks - 1
            while i_c >= 0:
                dS = _reverse_step(dS, i_c, c0, w_base, kd_base, tinv_base, egc, dhs, i_hv, seq_len, HV, v0,
                                   K, V, C, BK, BV, OP_BF16, EMULATE_BF16, DOT_PREC)
                i_c -= 1
        else:
            for step in range(0, n_chunks):
                dS = _reverse_step(dS, n_chunks - 1 - step, c0, w_base, kd_base, tinv_base, egc, dhs, i_hv, seq_len,
                                   HV, v0, K, V, C, BK, BV, OP_BF16, EMULATE_BF16, DOT_PREC)
        if STORE_DH0:
            store_matrix(dh0 + i_n.to(tl.int64) * s_dh0_n + i_hv * s_dh0_h, dS, s_dh0_k, s_dh0_v, K, V, v0, BK, BV)


# ---------------------------------------------------------------------------------------
# kernel 3: every gradient of one chunk
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_kda_bwd_state_grads_kernel(
    q, k, v, g, beta, A_log, dt_bias, do, tinv, w, kd, egc, aqk, akk, hs, dhs,
    dv, inter, dA2, db_buf, dgc_buf, cu_seqlens, chunk_table,
    scale, lower_bound, T, H, HV, NTS, stride_alog, stride_bias, TOK_PLANE, A_PLANE,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVS: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr, USE_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, IS_VARLEN: tl.constexpr, OP_BF16: tl.constexpr,
    EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Kernel 3a, grid ``(chunks, HV)``: the products with the chunk's state S and state gradient dS' (dv,
    final) and everything through the inverse; writes fp32 intermediates for kernel 3b: the inter-chunk
    parts of dq, dk and the decay gradient ``inter [3, B, T, HV, K]``, dAqk and dAkk ``dA2 [2, B, T, HV, C]``,
    the beta gradient ``db_buf [B, T, HV]`` and d exp(g_C) ``dgc_buf [chunks, HV, K]``."""
    i_t, i_hv, i_h, bos, seq_len, t0 = chunk_program(cu_seqlens, chunk_table, T, NTS, H, HV, C, IS_VARLEN)
    q_base = q + (bos * H + i_h) * K
    k_base = k + (bos * H + i_h) * K
    rows = tl.arange(0, C)
    real = (t0 + rows) < seq_len  # [C]
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    cols = tl.arange(0, BK)
    tok_k = (bos * HV + i_hv) * K
    tok_v = (bos * HV + i_hv) * V
    tok_c = (bos * HV + i_hv) * C
    bias_ptr = bias_row(dt_bias, i_hv, K, stride_bias, HAS_BIAS)
    expA = gate_scalar(A_log, i_hv, stride_alog, HAS_A_LOG)
    bt, _ = load_beta(beta + bos * HV + i_hv, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]

    # ---- operands of the V loop, as the prep kernel stored them (bf16 with OP_BF16)
    Aqk = dot_operand(tl.where(causal, load_rows(aqk + tok_c, t0, seq_len, HV * C, 0, C, C, C), 0.0),
                      OP_BF16, EMULATE_BF16)  # [C, C]
    Ti, W, kdo, egc_c = load_step_operands(w + tok_k, kd + tok_k, tinv + tok_c, egc + (i_t * HV + i_hv) * K, t0,
                                           seq_len, HV, K, C, BK, OP_BF16, EMULATE_BF16)

    # ---- the V loop: products with the state S entering the chunk and the state gradient dS' leaving it
    dqg = tl.zeros([C, BK], dtype=tl.float32)  # d(qΓ)
    dkd = tl.zeros([C, BK], dtype=tl.float32)
    dW = tl.zeros([C, BK], dtype=tl.float32)
    dAqk = tl.zeros([C, C], dtype=tl.float32)
    dTi = tl.zeros([C, C], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    dgc = tl.zeros([BK], dtype=tl.float32)
    slot = (i_t * HV + i_hv) * (K * V)
    for v0 in tl.static_range(0, BV, BVS):
        h = load_matrix(hs + slot, V, 1, K, V, v0, BK, BVS)  # [BK, BVS]
        dhn = load_matrix(dhs + slot, V, 1, K, V, v0, BK, BVS)
        dgc += tl.sum(h * dhn, axis=1)
        ho = dot_operand(h, OP_BF16, EMULATE_BF16)
        dho = dot_operand(dhn, OP_BF16, EMULATE_BF16)
        vt = load_rows(v + tok_v, t0, seq_len, HV * V, v0, V, C, BVS)  # [C, BVS]
        sdo = dot_operand(scale * load_rows(do + tok_v, t0, seq_len, HV * V, v0, V, C, BVS), OP_BF16, EMULATE_BF16)
        vb = dot_operand(vt * bt[:, None], OP_BF16, EMULATE_BF16)
        vn = dot_operand(tl.dot(Ti, vb, input_precision=DOT_PREC) - tl.dot(W, ho, input_precision=DOT_PREC),
                         OP_BF16, EMULATE_BF16)  # V' [C, BVS]
        dqg += tl.dot(sdo, tl.trans(ho), input_precision=DOT_PREC)
        dkd += tl.dot(vn, tl.trans(dho), input_precision=DOT_PREC)
        dAqk += tl.dot(sdo, tl.trans(vn), input_precision=DOT_PREC)
        dvn = dot_operand(tl.dot(tl.trans(Aqk), sdo, input_precision=DOT_PREC)
                          + tl.dot(kdo, dho, input_precision=DOT_PREC), OP_BF16, EMULATE_BF16)  # dV'
        dW -= tl.dot(dvn, tl.trans(ho), input_precision=DOT_PREC)
        dXv = tl.dot(tl.trans(Ti), dvn, input_precision=DOT_PREC)  # [C, BVS]
        db += tl.sum(vt * dXv, axis=1)
        dTi += tl.dot(dvn, tl.trans(vb), input_precision=DOT_PREC)
        store_rows(dv + tok_v, dXv * bt[:, None], t0, seq_len, HV * V, v0, V, C, BVS)
    dgc = dgc * egc_c

    # ---- W = Tinv (beta kΓ), Tinv = (I + A)^-1 with A = beta Akk: dA = -Tinv^T dTinv Tinv^T (strictly lower)
    qn, _ = load_unit_rows(q_base, t0, seq_len, H * K, K, C, BK, USE_L2NORM)
    kn, _ = load_unit_rows(k_base, t0, seq_len, H * K, K, C, BK, USE_L2NORM)
    a = load_gate(g + tok_k, bias_ptr, t0, seq_len, HV * K, 0, K, expA, lower_bound, C, BK, GATE, HAS_BIAS,
                  stride_bias)
    G = tl.cumsum(a, axis=0)
    gam = tl.exp(G)
    edec = tl.where(real[:, None], tl.exp(tl.sum(a, axis=0)[None, :] - G), 0.0)
    kg = kn * gam
    dXk = tl.dot(tl.trans(Ti), dot_operand(dW, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)  # [C, BK]
    db += tl.sum(kg * dXk, axis=1)
    dTi += mm(dW, tl.trans(kg * bt[:, None]), OP_BF16, EMULATE_BF16, DOT_PREC)
    dAm = -mm(tl.trans(Ti), mm(dTi, tl.trans(Ti), OP_BF16, EMULATE_BF16, DOT_PREC), OP_BF16, EMULATE_BF16,
              DOT_PREC)
    dAm = tl.where(strict, dAm, 0.0)
    db += tl.sum(dAm * load_rows(akk + tok_c, t0, seq_len, HV * C, 0, C, C, C), axis=1)

    # ---- the inter-chunk (state) terms of dq, dk and the decay gradient
    dkg = dXk * bt[:, None]
    kdf = kn * edec
    dgc += tl.sum(kdf * dkd, axis=0)
    tp = TOK_PLANE.to(tl.int64)  # 2 planes of T*HV*K can pass 2^31
    store_rows(inter + tok_k, dqg * gam, t0, seq_len, HV * K, 0, K, C, BK)
    store_rows(inter + tp + tok_k, dkg * gam + dkd * edec, t0, seq_len, HV * K, 0, K, C, BK)
    store_rows(inter + 2 * tp + tok_k, qn * gam * dqg + kg * dkg - kdf * dkd, t0, seq_len, HV * K, 0, K,
               C, BK)
    store_rows(dA2 + tok_c, tl.where(causal, dAqk, 0.0), t0, seq_len, HV * C, 0, C, C, C)
    store_rows(dA2 + A_PLANE.to(tl.int64) + tok_c, dAm * bt[:, None], t0, seq_len, HV * C, 0, C, C, C)
    tl.store(db_buf + (bos + t0 + rows).to(tl.int64) * HV + i_hv, db, mask=real)
    tl.store(dgc_buf + (i_t * HV + i_hv) * K + cols, dgc, mask=cols < K)


@triton.jit
def _pair_head_grads(
    q_base, k_base, qn, rq, kn, rk, g, beta, A_log, dt_bias, inter, dA2, db_buf, dgc_buf, dg, dbeta, dA_part,
    dbias_part, i_t, i_hv, bos, seq_len, t0, lower_bound, H, HV, stride_alog, stride_bias, TOK_PLANE, A_PLANE,
    K: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    SAFE: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One value head of kernel 3b: the pairwise terms, the gate and beta chains; writes dg, dbeta and the
    parameter partials, returns this head's (dq, dk) w.r.t. the normalized q, k."""
    rows = tl.arange(0, C)
    real = (t0 + rows) < seq_len
    cols = tl.arange(0, BK)
    tok_k = (bos * HV + i_hv) * K
    tok_c = (bos * HV + i_hv) * C
    g_base = g + tok_k
    bias_ptr = bias_row(dt_bias, i_hv, K, stride_bias, HAS_BIAS)
    expA = gate_scalar(A_log, i_hv, stride_alog, HAS_A_LOG)
    G = tl.cumsum(load_gate(g_base, bias_ptr, t0, seq_len, HV * K, 0, K, expA, lower_bound, C, BK, GATE, HAS_BIAS,
                            stride_bias), axis=0)  # [C, BK]
    tp = TOK_PLANE.to(tl.int64)  # 2 planes of T*HV*K can pass 2^31
    dqn = load_rows(inter + tok_k, t0, seq_len, HV * K, 0, K, C, BK)
    dkn = load_rows(inter + tp + tok_k, t0, seq_len, HV * K, 0, K, C, BK)
    dG = load_rows(inter + 2 * tp + tok_k, t0, seq_len, HV * K, 0, K, C, BK)
    dAqk = load_rows(dA2 + tok_c, t0, seq_len, HV * C, 0, C, C, C)
    dAkk = load_rows(dA2 + A_PLANE.to(tl.int64) + tok_c, t0, seq_len, HV * C, 0, C, C, C)
    # pairwise terms: x dx - y dy of each pairwise matrix into the decay gradient (its i = j terms cancel
    # exactly and are left out)
    dkn, dky, dG = _pairwise_bwd(dAkk, kn, kn, G, dkn, tl.zeros_like(dkn), dG, k_base, k_base, rk, rk, g_base,
                                 bias_ptr, t0, seq_len, H * K, HV * K, K, expA, lower_bound, stride_bias, C, SUBC,
                                 BK, BKS, GATE, HAS_BIAS, SAFE, OP_BF16, EMULATE_BF16, DOT_PREC)
    dkn += dky
    dqn, dkn, dG = _pairwise_bwd(dAqk, qn, kn, G, dqn, dkn, dG, q_base, k_base, rq, rk, g_base, bias_ptr, t0,
                                 seq_len, H * K, HV * K, K, expA, lower_bound, stride_bias, C, SUBC, BK, BKS, GATE,
                                 HAS_BIAS, SAFE, OP_BF16, EMULATE_BF16, DOT_PREC)
    dgc = tl.load(dgc_buf + (i_t * HV + i_hv) * K + cols, mask=cols < K, other=0.0)
    da = tl.where(real[:, None], tl.cumsum(dG, axis=0, reverse=True) + dgc[None, :], 0.0)
    # the gate's input and output again (not held across the pairwise terms)
    x = gate_preact(g_base, bias_ptr, t0, seq_len, HV * K, 0, K, stride_bias, C, BK, HAS_BIAS)  # [C, BK]
    a = gate_from_preact(x, t0, seq_len, 0, K, expA, lower_bound, C, BK, GATE)
    dx, dlog = gate_log_decay_bwd_floored(da, x, a, expA, lower_bound, GATE)
    store_rows(dg + tok_k, dx, t0, seq_len, HV * K, 0, K, C, BK)
    if HAS_A_LOG:
        tl.store(dA_part + i_t * HV + i_hv, tl.sum(tl.sum(dlog, axis=1), axis=0))
    if HAS_BIAS:
        tl.store(dbias_part + (i_t * HV + i_hv) * K + cols, tl.sum(dx, axis=0), mask=cols < K)
    r_b = (bos + t0 + rows).to(tl.int64)
    _, braw = load_beta(beta + bos * HV + i_hv, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)
    db = tl.load(db_buf + r_b * HV + i_hv, mask=real, other=0.0)
    tl.store(dbeta + r_b * HV + i_hv, beta_activation_bwd(db, braw, BETA_SIGMOID, NEG_EIGVAL).to(dbeta.dtype.element_ty),
             mask=real)
    # the diagonal of Aqk (exp(0) = 1): Aqk_ii = q_i . k_i
    dd = tl.sum(tl.where(rows[:, None] == rows[None, :], dAqk, 0.0), axis=1)  # [C]
    return dqn + dd[:, None] * kn, dkn + dd[:, None] * qn


@triton.jit
def chunk_kda_bwd_pair_grads_kernel(
    q, k, g, beta, A_log, dt_bias, inter, dA2, db_buf, dgc_buf, dq, dk, dg, dbeta, dA_part, dbias_part,
    cu_seqlens, chunk_table, lower_bound, T, H, HV, NTS, stride_alog, stride_bias, TOK_PLANE, A_PLANE,
    K: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, GROUP: tl.constexpr,
    GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr, USE_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Kernel 3b, grid ``(chunks, H)``: from kernel 3a's intermediates, the pairwise terms and every token
    transform's gradient; a group of HV/H value heads shares its q/k head (dq, dk summed here, written once)."""
    i_t, i_h, _, bos, seq_len, t0 = chunk_program(cu_seqlens, chunk_table, T, NTS, 1, 1, C, IS_VARLEN)
    q_base = q + (bos * H + i_h) * K
    k_base = k + (bos * H + i_h) * K
    qn, rq = load_unit_rows(q_base, t0, seq_len, H * K, K, C, BK, USE_L2NORM)  # [C, BK], [C]
    kn, rk = load_unit_rows(k_base, t0, seq_len, H * K, K, C, BK, USE_L2NORM)
    if GROUP == 1:
        dqn, dkn = _pair_head_grads(
            q_base, k_base, qn, rq, kn, rk, g, beta, A_log, dt_bias, inter, dA2, db_buf, dgc_buf, dg, dbeta,
            dA_part, dbias_part, i_t, i_h, bos, seq_len, t0, lower_bound, H, HV, stride_alog, stride_bias,
            TOK_PLANE, A_PLANE, K, C, SUBC, BK, BKS, GATE, HAS_A_LOG, HAS_BIAS, BETA_SIGMOID, NEG_EIGVAL, SAFE,
            OP_BF16, EMULATE_BF16, DOT_PREC)
    else:
        dqn = tl.zeros([C, BK], dtype=tl.float32)
        dkn = tl.zeros([C, BK], dtype=tl.float32)
        for j in range(GROUP):
            dqj, dkj = _pair_head_grads(
                q_base, k_base, qn, rq, kn, rk, g, beta, A_log, dt_bias, inter, dA2, db_buf, dgc_buf, dg, dbeta,
                dA_part, dbias_part, i_t, i_h * GROUP + j, bos, seq_len, t0, lower_bound, H, HV, stride_alog,
                stride_bias, TOK_PLANE, A_PLANE, K, C, SUBC, BK, BKS, GATE, HAS_A_LOG, HAS_BIAS, BETA_SIGMOID,
                NEG_EIGVAL, SAFE, OP_BF16, EMULATE_BF16, DOT_PREC)
            dqn += dqj
            dkn += dkj
    store_rows(dq + (bos * H + i_h) * K, l2norm_bwd(dqn, qn, rq, USE_L2NORM), t0, seq_len, H * K, 0, K, C, BK)
    store_rows(dk + (bos * H + i_h) * K, l2norm_bwd(dkn, kn, rk, USE_L2NORM), t0, seq_len, H * K, 0, K, C, BK)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def chunk_kda_bwd64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    do: torch.Tensor, dht: torch.Tensor | None, *,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    seqlens,
    opts: Chunk64Options,
):
    """Gradients of chunked KDA from the inputs, dO and dht (the forward saves nothing else).

    Shapes: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``
    (contiguous, same dtype); dht ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None;
    ``seqlens``: the per-sequence lengths of ``cu_seqlens`` on the host; ``opts`` from ``chunk64_options``.

    Returns ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)``: the first five in the token dtype;
    dA_log ``[HV]`` and ddt_bias ``[HV * K]`` fp32 (None when A_log / dt_bias is None); dh0 fp32 in
    initial_state's layout (None without an initial state).
    """
    if do.shape != v.shape or do.dtype != v.dtype:
        raise ValueError(f"do must match v ({list(v.shape)}, {v.dtype}), got {list(do.shape)}, {do.dtype}")
    if not do.is_contiguous():
        raise ValueError(f"do must be contiguous for the Triton backward, got strides {tuple(do.stride())}")
    o = opts
    B, T, H, HV, K, V, N, NT, NTS = o.B, o.T, o.H, o.HV, o.K, o.V, o.N, o.NT, o.NTS
    C, BK, BV = CHUNK, o.BK, o.BV
    cx = o.constexprs
    dev, f32 = q.device, torch.float32
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    pairs, firsts = chunk64_tables(o, seqlens, dev)
    dA_part = torch.empty((NT, HV), dtype=f32, device=dev) if cx["HAS_A_LOG"] else None
    dbias_part = torch.empty((NT, HV, K), dtype=f32, device=dev) if cx["HAS_BIAS"] else None
    dh0 = None
    if initial_state is not None:
        dh0 = torch.empty((N, HV, V, K) if o.state_v_first else (N, HV, K, V), dtype=f32, device=dev)
    hs = torch.empty((NT, HV, K, V), dtype=o.slot_dtype, device=dev)
    dhs = torch.empty((NT, HV, K, V), dtype=o.slot_dtype, device=dev)
    p = run_prep(q, k, g, beta, A_log, dt_bias, cu_seqlens, pairs, o, do=do, dhs=dhs)

    if N * HV > 0:
        bv = min(STATES_BLOCK_V, BV)
        chunk_kda_bwd_states_kernel[(N * HV, triton.cdiv(V, bv), 2)](
            v, beta, p["w"], p["kd"], p["tinv"], p["egc"], hs, dhs, initial_state, dht, dh0, cu_seqlens, firsts,
            T, HV, NTS, *state_strides(initial_state, o.state_v_first), *state_strides(dht, o.state_v_first),
            *state_strides(dh0, o.state_v_first),
            K=K, V=V, C=C, BK=BK, BV=bv, HAS_H0=initial_state is not None, HAS_DHT=dht is not None,
            STORE_DH0=dh0 is not None, LOOP_WHILE=o.interpreting, BETA_SIGMOID=cx["BETA_SIGMOID"],
            NEG_EIGVAL=cx["NEG_EIGVAL"], IS_VARLEN=o.varlen, OP_BF16=cx["OP_BF16"], EMULATE_BF16=cx["EMULATE_BF16"],
            DOT_PREC=cx["DOT_PREC"], num_warps=STATES_NUM_WARPS, num_stages=1,
        )
    if NT * HV > 0:
        inter = torch.empty((3, B, T, HV, K), dtype=f32, device=dev)
        dA2 = torch.empty((2, B, T, HV, C), dtype=f32, device=dev)
        db_buf = torch.empty((B, T, HV), dtype=f32, device=dev)
        dgc_buf = torch.empty((NT, HV, K), dtype=f32, device=dev)
        planes = (B * T * HV * K, B * T * HV * C)
        chunk_kda_bwd_state_grads_kernel[(NT, HV)](
            q, k, v, g, beta, A_log, dt_bias, do, p["tinv"], p["w"], p["kd"], p["egc"], p["aqk"], p["akk"], hs, dhs,
            dv, inter, dA2, db_buf, dgc_buf, cu_seqlens, pairs,
            o.scale, o.lower_bound, T, H, HV, NTS, o.stride_alog, o.stride_bias, *planes,
            K=K, V=V, C=C, BK=BK, BV=BV, BVS=min(GRADS_BLOCK_V, BV), **cx,
            num_warps=GRADS_NUM_WARPS, num_stages=1,
        )
        chunk_kda_bwd_pair_grads_kernel[(NT, H)](
            q, k, g, beta, A_log, dt_bias, inter, dA2, db_buf, dgc_buf, dq, dk, dg, dbeta, dA_part, dbias_part,
            cu_seqlens, pairs, o.lower_bound, T, H, HV, NTS, o.stride_alog, o.stride_bias, *planes,
            K=K, C=C, SUBC=SUB, BK=BK, BKS=min(EXACT_KEY_SLICE, BK), GROUP=HV // H, SAFE=o.safe, **cx,
            num_warps=PAIR_NUM_WARPS, num_stages=1,
        )
        del inter, dA2, db_buf, dgc_buf
    del p, hs, dhs, pairs, firsts

    dA_log = ddt_bias = None
    if A_log is not None:
        dA_log = dA_part.sum(0) if cx["HAS_A_LOG"] else torch.zeros(HV, dtype=f32, device=dev)
    if dt_bias is not None:
        ddt_bias = dbias_part.sum(0).view(HV * K) if cx["HAS_BIAS"] else torch.zeros(HV * K, dtype=f32, device=dev)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
