"""Windowed, parallel backward of chunked KDA (run by ``chunk_bwd.chunk_kda_bwd``).

Two facts make most of the work parallel: the state-gradient recurrence
  ``dS_prev = gC dS + scale (q Gam)^T dO - W^T (scale Aqk^T dO + kd dS)`` needs no state S (and its
  value columns are independent, so it splits over V), and given S before a chunk and dS after it,
  a chunk's token gradients depend on no other chunk. Windows of ``Lw = plan.recompute_every_n_tokens``
  tokens (``L2 = gcd(256, L)``: the plan's recompute cadence keeps its meaning: states are recomputed
  at that granularity) tile each checkpoint segment of L tokens. Every (sequence, value head) pair
  runs in each launch; a sequence without the launch's segment or window skips it. Host loop over
  global window indices, last first:
    1. ``window_starts`` (once per segment, grid (N*HV, V/BVs)): walk from the segment's checkpoint,
       store the states at the starts of windows 1.. of the segment (fp32 ``[N*HV, L/Lw - 1, K, V]``).
    2. ``window_states`` (grid (N*HV, V/BVs, 2)): role 0 walks the window forward and stores every
       chunk's start state S_c; role 1 walks it in reverse from the carried dS (``[N, HV, K, V]`` fp32;
       dh0 itself when there is an initial state, initialised from dht) and stores every chunk's
       dS_{c+1}; both into ``[N*HV, Lw/C, K, V]`` slots (bf16 for 16-bit inputs). With H == HV
       (``uses_lean_states``) stage 2 is ``chunk_bwd_states``' instead: the window's intermediates
       computed once into its own gradient rows, then the same two walks without re-deriving them.
    3. ``window_grads`` (grid (N*H, Lw/C)): one chunk of one q/k head per program, looping over its
       GVA group: every gradient from S_c and dS_{c+1} (dq, dk summed over the group in registers, so
       no GVA partial buffers); dA_log / ddt_bias partials accumulate into ``[N*HV, Lw/C(, K)]``
       slots (one writer per slot and launch: deterministic) and are summed with torch at the end.
  Workspace (``plan.backward_workspace_allocations``): sized by windows, never by T. At 1x8K, H=HV=96,
  K=V=128, bf16, L=2048, Lw=256: window starts 44.0 MB, S_c 50.3 MB, dS 50.3 MB, carry 6.3 MB,
  parameter partials 0.8 MB = 151.8 MB (+ checkpoints 25.2 MB saved by the forward); the same
  151.8 MB at 1x128K H96 (checkpoints 402.7 MB); 202.4 MB at 8x8K H16 and 1x8K H128 (+33.6 MB).
  Matmul precision of the products that feed the decay gradient (GRAD_OP / GRAD_PREC,
  ``chunk_bwd_common.grad_operands``): bf16 operands rounded to nearest for bf16 inputs, with the
  decay gradient formed from the same rounded operands so its cancelling pairs cancel exactly;
  3xTF32 for fp16 / fp32 inputs: plain (truncating) TF32 there was faster but fails the GPU tier's ddt_bias
  limit (docs/perf_notes.md, "Launch configs").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk_bwd_common import (
    CHUNK,
    USE_DOUBLING_INVERSE,
    chunk_keys_gate_beta,
    decay_scale,
    exact_pairwise_bwd,
    exact_qk_kk,
    grad_operand,
    grad_operands,
    sequence_chunks,
    state_program,
    state_step,
    state_strides,
)
from kdakit.ops.kda.chunk_bwd_states import run_lean_window_starts, run_lean_window_states
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan import H200_SMS, lean_workspace_allocations, uses_lean_states
from kdakit.ops.kda.chunk_common import (
    beta_activation,
    beta_activation_bwd,
    beta_lower_inverse,
    block_size,
    causal_mask,
    gate_from_preact,
    gate_log_decay_bwd_floored,
    l2norm_rows,
    l2norm_rows_bwd,
    load_matrix,
    load_row_scalars,
    load_rows,
    round_to_bf16_if,
    row_of,
    safe_gate_factors,
    store_matrix,
    store_row_scalars,
    store_rows,
)


@triton.jit
def _safe_qk_kk(q, k, G, C: tl.constexpr, GRAD_OP: tl.constexpr, GRAD_PREC: tl.constexpr):
    """The SAFE gate's Aqk (causal) and Akk (strictly lower) [C, C] from the mid-chunk-referenced operands, which
    the window gradient reuses for its own dots, and the factors. -> (Aqk, Akk, qr, kr, ki, eg, egi)

    In the window gradient's order, so that kernel's sm_90a PTX (timed in every speed-table cell) is unchanged; the
    dS walk's SAFE build (grouped value heads only) changed by instruction order (no order keeps both). The masked
    dots are spelled out rather than chunk_common.pairwise_dot's: its dot-then-mask order changed this kernel's
    PTX, and a mask-then-dot pairwise_dot kept it but changed the forward intra kernel's (sm_90a, 2026-12-02)."""
    eg, egi = safe_gate_factors(G, C)
    qr = grad_operand(q * eg, GRAD_OP)
    kr = grad_operand(k * eg, GRAD_OP)
    ki = grad_operand(k * egi, GRAD_OP)
    Aqk = tl.where(causal_mask(C, True), tl.dot(qr, tl.trans(ki), input_precision=GRAD_PREC), 0.0)
    Akk = tl.where(causal_mask(C, False), tl.dot(kr, tl.trans(ki), input_precision=GRAD_PREC), 0.0)
    return Aqk, Akk, qr, kr, ki, eg, egi


@triton.jit
def _dstate_step(dS, q_base, k_base, g_base, b_base, bias_ptr, do_base, t0, n_rows, s_qk, s_v, s_g, s_b,
                 K, n_vcols, scale, expA, lower_bound, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                 BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
                 DOT_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, GRAD_OP: tl.constexpr, INV_DOUBLING: tl.constexpr):
    """dL/dS before the chunk at row t0 from dL/dS after it; needs no state (S-free)::

        dV' = scale Aqk^T dO + kd dS,   dS_prev = gC dS + scale (q Gam)^T dO - W^T dV'

    dS ``[BK, BV]`` fp32 holds value columns ``[0, n_vcols)`` of do_base (already offset to
    the block); value columns are independent, so the V-split is exact.
    """
    q = load_rows(q_base, t0, n_rows, s_qk, 0, K, C, BK)  # [C, BK]
    if L2NORM:
        q, _ = l2norm_rows(q)
    k, b, G, GC = chunk_keys_gate_beta(k_base, g_base, b_base, bias_ptr, t0, n_rows, s_qk, s_g, s_b, K, expA,
                                       lower_bound, C, BK, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID, NEG_EIGVAL)
    do = load_rows(do_base, t0, n_rows, s_v, 0, n_vcols, C, BV)  # [C, BV]
    Gam = tl.exp(G)
    if SAFE:
        Aqk, Akk, _, _, _, _, _ = _safe_qk_kk(q, k, G, C, GRAD_OP, GRAD_PREC)
    else:
        Aqk, Akk = exact_qk_kk(q, k, G, C)
    Tinv = beta_lower_inverse(b, Akk, C, INV_DOUBLING)  # [C, C]
    W = tl.dot(Tinv, b[:, None] * k * Gam, input_precision=DOT_PREC)  # [C, BK]
    kd = k * tl.exp(GC[None, :] - G)  # [C, BK]
    sdo = scale * do
    dVp = tl.dot(tl.trans(Aqk), sdo, input_precision=DOT_PREC) + tl.dot(kd, dS, input_precision=DOT_PREC)
    return tl.exp(GC)[:, None] * dS + tl.dot(tl.trans(q * Gam), sdo, input_precision=DOT_PREC) \
        - tl.dot(tl.trans(W), dVp, input_precision=DOT_PREC)  # [BK, BV]


@triton.jit
def chunk_kda_bwd_window_starts_kernel(
    k, v, g, beta, ckpt, ckpt_off, cu_seqlens, A_log, dt_bias, ws_win,
    seg, lower_bound, T, H, HV, K, V,
    GROUP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SEG_CHUNKS: tl.constexpr, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr,
):
    """Stage 1, grid (N*HV, cdiv(V, BV)): states at the start of windows 1.. of checkpoint segment
    ``seg`` (window 0 starts at the checkpoint), walked forward from the checkpoint.
    """
    item, v0, n, hv, bos, n_rows, n_chunks = state_program(cu_seqlens, T, HV, C, BV, IS_VARLEN)
    h = hv // GROUP
    c0 = seg * SEG_CHUNKS
    if c0 < n_chunks:
        KV = K.to(tl.int64) * V
        c1 = tl.minimum(n_chunks, c0 + SEG_CHUNKS)
        n_sub = (c1 - c0 + SUB_CHUNKS - 1) // SUB_CHUNKS
        expA = decay_scale(A_log, hv, HAS_A)
        k_b = k + bos * (H * K) + h * K
        v_b = v + bos * (HV * V) + hv * V + v0
        g_b = g + bos * (HV * K) + hv * K
        b_b = beta + bos * HV + hv
        slots = ws_win + item.to(tl.int64) * (N_SUB - 1) * KV
        S = load_matrix(ckpt + ((tl.load(ckpt_off + n) + seg) * HV + hv) * KV, V, 1, K, V, v0, BK, BV)
        c = c0
        while c < c0 + (n_sub - 1) * SUB_CHUNKS:
            S = state_step(S, k_b, v_b, g_b, b_b, dt_bias + hv * K, c * C, n_rows, H * K, HV * V, HV * K, HV,
                            K, V - v0, expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID,
                            NEG_EIGVAL, SAFE, DOT_PREC, INV_DOUBLING)
            c += 1
            if (c - c0) % SUB_CHUNKS == 0:
                store_matrix(slots + ((c - c0) // SUB_CHUNKS - 1) * KV, S, V, 1, K, V, v0, BK, BV)


@triton.jit
def chunk_kda_bwd_window_states_kernel(
    q, k, v, g, beta, do, ckpt, ckpt_off, cu_seqlens, A_log, dt_bias, ws_win, ws_s, ws_ds, carry,
    win, scale, lower_bound, T, H, HV, K, V, s_c_n, s_c_h, s_c_k, s_c_v,
    GROUP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, GRAD_OP: tl.constexpr, INV_DOUBLING: tl.constexpr, ROUND_STAGE: tl.constexpr,
):
    """Stage 2, grid (N*HV, cdiv(V, BV), 2) for window ``win`` (global window index of every sequence).

    Role 0 walks the window forward from its start state and stores every chunk's start state
    S_c into ``ws_s``; role 1 walks it in reverse from the carried dS (``carry``, state layout
    strides) and stores every chunk's dS after it into ``ws_ds``, then updates the carry. The
    two roles are independent (the dS recurrence is S-free). ROUND_STAGE (interpreter, bf16 slots)
    rounds to nearest before the store, as the GPU's cast does (the interpreter's cast truncates).
    """
    item, v0, n, hv, bos, n_rows, n_chunks = state_program(cu_seqlens, T, HV, C, BV, IS_VARLEN)
    role = tl.program_id(2)
    h = hv // GROUP
    d0 = win * SUB_CHUNKS
    if d0 < n_chunks:
        KV = K.to(tl.int64) * V
        d1 = tl.minimum(n_chunks, d0 + SUB_CHUNKS)
        expA = decay_scale(A_log, hv, HAS_A)
        k_b = k + bos * (H * K) + h * K
        g_b = g + bos * (HV * K) + hv * K
        b_b = beta + bos * HV + hv
        bias_p = dt_bias + hv * K
        if role == 0:
            w = win % N_SUB
            if w == 0:
                S = load_matrix(ckpt + ((tl.load(ckpt_off + n) + win // N_SUB) * HV + hv) * KV, V, 1, K, V, v0,
                                BK, BV)
            else:
                S = load_matrix(ws_win + (item.to(tl.int64) * (N_SUB - 1) + w - 1) * KV, V, 1, K, V, v0, BK, BV)
            slots = ws_s + item.to(tl.int64) * SUB_CHUNKS * KV
            v_b = v + bos * (HV * V) + hv * V + v0
            c = d0
            while c < d1 - 1:
                store_matrix(slots + (c - d0) * KV, round_to_bf16_if(S, ROUND_STAGE), V, 1, K, V, v0, BK, BV)
                S = state_step(S, k_b, v_b, g_b, b_b, bias_p, c * C, n_rows, H * K, HV * V, HV * K, HV,
                                K, V - v0, expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID,
                                NEG_EIGVAL, SAFE, DOT_PREC, INV_DOUBLING)
                c += 1
            store_matrix(slots + (d1 - 1 - d0) * KV, round_to_bf16_if(S, ROUND_STAGE), V, 1, K, V, v0, BK, BV)
        else:
            q_b = q + bos * (H * K) + h * K
            do_b = do + bos * (HV * V) + hv * V + v0
            c_ptr = carry + n.to(tl.int64) * s_c_n + hv * s_c_h
            dS = load_matrix(c_ptr, s_c_k, s_c_v, K, V, v0, BK, BV)  # [BK, BV]
            slots = ws_ds + item.to(tl.int64) * SUB_CHUNKS * KV
            c = d1 - 1
            while c >= d0:
                store_matrix(slots + (c - d0) * KV, round_to_bf16_if(dS, ROUND_STAGE), V, 1, K, V, v0, BK, BV)
                dS = _dstate_step(dS, q_b, k_b, g_b, b_b, bias_p, do_b, c * C, n_rows, H * K, HV * V, HV * K, HV,
                                  K, V - v0, scale, expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM,
                                  BETA_SIGMOID, NEG_EIGVAL, SAFE, DOT_PREC, GRAD_PREC, GRAD_OP, INV_DOUBLING)
                c -= 1
            store_matrix(c_ptr, dS, s_c_k, s_c_v, K, V, v0, BK, BV)


@triton.jit
def _chunk_grads_vloop(s_base, ds_base, q_base, k_base, v_base, g_base, b_base, bias_ptr, do_base,
                       dv_base, dg_base, db_base, t0, n_rows, s_qk, s_v, s_g, s_b, K, V, scale, expA, lower_bound,
                       C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                       BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
                       DOT_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, GRAD_OP: tl.constexpr, INV_DOUBLING: tl.constexpr):
    """The gradients of ``chunk_grads`` (not dS_prev) with S and dS read in value blocks of BV.

    S and dS are K-major ``[K, V]`` slots at s_base / ds_base. Only ``[BK, BV]`` pieces of them and
    ``[C, BV]`` value tiles are live at a time; everything that sums over V (dAqk, dqΓ, dW, dkd,
    dgC, the dV' Y^T part of dT, dbeta's value term) accumulates across the blocks, and dv is
    stored per block. Stores dv, dg, dbeta; returns (dA_log term, ddt_bias term ``[BK]``, dq, dk
    ``[C, BK]`` raw-input gradients).
    """
    r = tl.arange(0, C)
    cols = tl.arange(0, BK)
    rmask = (t0 + r) < n_rows  # [C]
    m2 = rmask[:, None] & (cols < K)[None, :]  # [C, BK]

    q_raw = load_rows(q_base, t0, n_rows, s_qk, 0, K, C, BK)  # [C, BK]
    k_raw = load_rows(k_base, t0, n_rows, s_qk, 0, K, C, BK)
    if L2NORM:
        q, rq = l2norm_rows(q_raw)
        k, rk = l2norm_rows(k_raw)
    else:
        q = q_raw
        k = k_raw
    x = load_rows(g_base, t0, n_rows, s_g, 0, K, C, BK)  # [C, BK] gate pre-activation
    if HAS_BIAS:
        x = x + tl.load(bias_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
    # [C, BK]: clamped to >= LOG_DECAY_FLOOR as the forward and the state walks load it (load_chunk_gate), so the
    # gradient below is the derivative of what they computed and G keeps its precision after a reset-level decay
    a = gate_from_preact(x, t0, n_rows, 0, K, expA, lower_bound, C, BK, GATE)
    b_raw = load_row_scalars(b_base, t0, n_rows, s_b, C)  # [C]
    b = tl.where(rmask, beta_activation(b_raw, BETA_SIGMOID, NEG_EIGVAL), 0.0)

    G = tl.cumsum(a, axis=0)  # [C, BK]
    Gam = tl.exp(G)
    GC = row_of(G, C - 1, C)  # [BK]
    gC = tl.exp(GC)
    eC = tl.exp(GC[None, :] - G)  # [C, BK]
    kd = k * eC
    if SAFE:
        Aqk, Akk, qr, kr, ki, eg, egi = _safe_qk_kk(q, k, G, C, GRAD_OP, GRAD_PREC)
    else:
        Aqk, Akk = exact_qk_kk(q, k, G, C)
    Tinv = beta_lower_inverse(b, Akk, C, INV_DOUBLING)  # [C, C]
    TinvT = tl.trans(Tinv)
    X = b[:, None] * k * Gam  # [C, BK]
    W = tl.dot(Tinv, X, input_precision=DOT_PREC)  # [C, BK]

    # ---- the value dimension, one block at a time
    dAqk = tl.zeros([C, C], dtype=tl.float32)
    dTY = tl.zeros([C, C], dtype=tl.float32)  # dV' Y^T part of dT
    dqG = tl.zeros([C, BK], dtype=tl.float32)
    dW = tl.zeros([C, BK], dtype=tl.float32)
    dkd = tl.zeros([C, BK], dtype=tl.float32)
    dgC = tl.zeros([BK], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    v0 = 0
    while v0 < V:
        vt = load_rows(v_base, t0, n_rows, s_v, v0, V, C, BV)  # [C, BV]
        sdo = scale * load_rows(do_base, t0, n_rows, s_v, v0, V, C, BV)  # [C, BV]
        S = load_matrix(s_base, V, 1, K, V, v0, BK, BV)  # [BK, BV]
        dS = load_matrix(ds_base, V, 1, K, V, v0, BK, BV)
        Y = b[:, None] * vt
        Vp = tl.dot(Tinv, Y, input_precision=DOT_PREC) - tl.dot(W, S, input_precision=DOT_PREC)  # [C, BV]
        dVp = tl.dot(tl.trans(Aqk), sdo, input_precision=DOT_PREC) + tl.dot(kd, dS, input_precision=DOT_PREC)
        dAqk += tl.dot(sdo, tl.trans(Vp), input_precision=DOT_PREC)
        dqG += tl.dot(grad_operand(sdo, GRAD_OP), tl.trans(grad_operand(S, GRAD_OP)), input_precision=GRAD_PREC)
        dW -= tl.dot(dVp, tl.trans(S), input_precision=DOT_PREC)
        dkd += tl.dot(grad_operand(Vp, GRAD_OP), tl.trans(grad_operand(dS, GRAD_OP)), input_precision=GRAD_PREC)
        dgC += tl.sum(S * dS, axis=1)
        dTY += tl.dot(dVp, tl.trans(Y), input_precision=DOT_PREC)
        dY = tl.dot(TinvT, dVp, input_precision=DOT_PREC)  # [C, BV]
        store_rows(dv_base, b[:, None] * dY, t0, n_rows, s_v, v0, V, C, BV)
        db += tl.sum(vt * dY, axis=1)
        v0 += BV
    dAqk = tl.where(causal_mask(C, True), dAqk, 0.0)

    # ---- through Tinv = (I + beta Araw)^-1
    dT = tl.dot(dW, tl.trans(X), input_precision=DOT_PREC) + dTY
    dX = tl.dot(grad_operand(TinvT, GRAD_OP), grad_operand(dW, GRAD_OP), input_precision=GRAD_PREC)  # [C, BK]
    dM = -tl.dot(tl.dot(TinvT, dT, input_precision=DOT_PREC), TinvT, input_precision=DOT_PREC)
    dM = tl.where(causal_mask(C, False), dM, 0.0)  # [C, C]
    dAkk = b[:, None] * dM
    db += tl.sum(dM * Akk, axis=1)

    # ---- pairwise terms
    if SAFE:
        # With bf16 operands the decay gradient multiplies the dots' results by the same rounded
        # operands the dots used, so each pair's two terms (and the i = j terms) cancel exactly.
        dAo = grad_operand(dAqk, GRAD_OP)
        dAko = grad_operand(dAkk, GRAD_OP)
        dqr = tl.dot(dAo, ki, input_precision=GRAD_PREC)  # [C, BK]
        dkr = tl.dot(dAko, ki, input_precision=GRAD_PREC)
        dki = tl.dot(tl.trans(dAo), qr, input_precision=GRAD_PREC) \
            + tl.dot(tl.trans(dAko), kr, input_precision=GRAD_PREC)
        dq = dqr * eg
        dk = dkr * eg + dki * egi
        dG = dqr * qr.to(tl.float32) + dkr * kr.to(tl.float32) - dki * ki.to(tl.float32)
    else:
        dq, dk, dG = exact_pairwise_bwd(dAqk, dAkk, q, k, G, C)

    # ---- elementwise terms
    db += tl.sum(k * Gam * dX, axis=1)
    dk += b[:, None] * Gam * dX
    dG += dX * X
    dq += dqG * Gam
    dG += dqG * q * Gam
    dk += dkd * eC
    dG -= dkd * kd
    last = tl.sum(dkd * kd, axis=0) + dgC * gC  # [BK]: d/dG[C-1] through G[C-1] - G and gC
    dG += tl.where((r == C - 1)[:, None], last[None, :], 0.0)
    da = tl.cumsum(dG, axis=0, reverse=True)  # [C, BK]

    # ---- token transforms
    dx, dlog = gate_log_decay_bwd_floored(da, x, a, expA, lower_bound, GATE)  # 0 where the clamp holds
    dx = tl.where(m2, dx, 0.0)
    dA_term = tl.sum(tl.sum(tl.where(m2, dlog, 0.0), axis=1), axis=0)
    ddt_term = tl.sum(dx, axis=0)  # [BK]
    if L2NORM:
        dq = l2norm_rows_bwd(dq, q, rq)
        dk = l2norm_rows_bwd(dk, k, rk)
    store_rows(dg_base, dx, t0, n_rows, s_g, 0, K, C, BK)
    store_row_scalars(db_base, beta_activation_bwd(db, b_raw, BETA_SIGMOID, NEG_EIGVAL), t0, n_rows, s_b, C)
    return dA_term, ddt_term, dq, dk


@triton.jit
def chunk_kda_bwd_window_grads_kernel(
    q, k, v, g, beta, do, cu_seqlens, A_log, dt_bias, ws_s, ws_ds,
    dq, dk, dv, dg, dbeta, dA_part, ddt_part,
    win, scale, lower_bound, T, H, HV, K, V,
    GROUP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB_CHUNKS: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, GRAD_OP: tl.constexpr, INV_DOUBLING: tl.constexpr,
):
    """Stage 3, grid (N*H, SUB_CHUNKS) for window ``win``: every gradient of one chunk, for the
    GROUP value heads of one q/k head (dq, dk summed over them in registers, stored once), from
    S_c and dS_{c+1} of stage 2. Parameter partials accumulate into their (item, chunk slot).
    """
    i_nh = tl.program_id(0)
    j = tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    bos, n_rows, n_chunks = sequence_chunks(cu_seqlens, n, T, C, IS_VARLEN)
    c = win * SUB_CHUNKS + j
    if c < n_chunks:
        KV = K.to(tl.int64) * V
        cols = tl.arange(0, BK)
        t0 = c * C
        q_b = q + bos * (H * K) + h * K
        k_b = k + bos * (H * K) + h * K
        dq_acc = tl.zeros([C, BK], dtype=tl.float32)
        dk_acc = tl.zeros([C, BK], dtype=tl.float32)
        for gi in range(GROUP):
            hv = h * GROUP + gi
            item = (n * HV + hv).to(tl.int64)
            expA = decay_scale(A_log, hv, HAS_A)
            slot = (item * SUB_CHUNKS + j) * KV
            vo = bos * (HV * V) + hv * V
            go = bos * (HV * K) + hv * K
            dA_t, ddt_t, dq_t, dk_t = _chunk_grads_vloop(
                ws_s + slot, ws_ds + slot, q_b, k_b, v + vo, g + go, beta + bos * HV + hv, dt_bias + hv * K,
                do + vo, dv + vo, dg + go, dbeta + bos * HV + hv, t0, n_rows,
                H * K, HV * V, HV * K, HV, K, V, scale, expA, lower_bound,
                C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID, NEG_EIGVAL, SAFE, DOT_PREC, GRAD_PREC, GRAD_OP,
                INV_DOUBLING)
            dq_acc += dq_t
            dk_acc += dk_t
            if HAS_A:
                pa = dA_part + item * SUB_CHUNKS + j
                tl.store(pa, tl.load(pa) + dA_t)
            if HAS_BIAS:
                pb = ddt_part + (item * SUB_CHUNKS + j) * K + cols
                tl.store(pb, tl.load(pb, mask=cols < K, other=0.0) + ddt_t, mask=cols < K)
        store_rows(dq + bos * (H * K) + h * K, dq_acc, t0, n_rows, H * K, 0, K, C, BK)
        store_rows(dk + bos * (H * K) + h * K, dk_acc, t0, n_rows, H * K, 0, K, C, BK)



# ---------------------------------------------------------------- launcher ----------------------

# Value block of the gradient stage's loop over V (S and dS are read [K, BV] at a time) and its warps.
# sm_90a builds (ptxas 12.8, K = 128, bf16): every stage sits at 255 registers a thread; the gradient
# stage spills ~3.3 KB (SAFE) / 3.5 KB (EXACT) at 4 warps and BV 32, vs 2.7 / 3.4 KB at 8 warps and
# BV 64 (one program per SM instead of two); stage 2 spills 2.5 KB at BV 64 and 3.5 KB at BV 128
# (4 warps), stage 1 0.5 KB at BV 64. Most of it is the 16-row chunk: a [16, K] tile feeding tl.dot
# as its left operand is held whole by every warp.
GRADS_BLOCK_V = 32
GRADS_NUM_WARPS = 4
# The EXACT gate path (unbounded softplus gate; FLA's layer default) at 8 warps. sm_90a builds (ptxas -O3,
# K = 128, bf16): at 4 warps ptxas falls back to 32 registers with 15-17 KB of spill code, with the
# pairwise backward in one column loop or in two; at 8 warps the one-loop form still does (13 KB), the
# two-loop form (exact_pairwise_bwd) takes 128 registers and 4.6 KB, and is the faster (docs/perf_notes.md).
GRADS_EXACT_NUM_WARPS = 8
GRADS_NUM_STAGES = 1
STATE_NUM_WARPS = 4  # the sequential stages (one [K, BV] state tile, BV = state_block_v)
# Tuning overrides of the sequential stages' value block (None: state_block_v's one-wave rule);
# benchmarks/tune_windowed.py sweeps them with the constants above.
STARTS_BLOCK_V: int | None = None
STATES_BLOCK_V: int | None = None
STARTS_NUM_WARPS: int | None = None  # None: STATE_NUM_WARPS


def state_block_v(units: int, V: int, num_sms: int = H200_SMS) -> int:
    """V block of a sequential stage with ``units`` programs per value block (stage 1: N*HV; stage 2:
    2*N*HV): the smallest of 32, 64, 128 whose grid fits one wave (2 programs per SM: 4 warps at
    about 255 registers). Every program walks the same number of dependent chunk steps, so a second
    wave doubles the stage's time while a wider block only adds work to each step.
    """
    full = block_size(V)
    for bv in (32, 64):
        if bv >= full or units * (-(-V // bv)) <= 2 * num_sms:
            return min(bv, full)
    return min(128, full)


def run_windowed(q, k, v, g, beta, do, dht, *, checkpoints, ckpt_offsets, cu_seqlens, A_log, dt_bias, initial_state,
                 N: int, plan, stage_dtype: torch.dtype, opts: KDAOptions):
    """The windowed pipeline: per checkpoint segment stage 1, per window (last first) stages 2 and 3.

    Checked by ``chunk_bwd.chunk_kda_bwd``; the cadences come from ``plan`` (L its checkpoints', L2 its
    recompute window) and every option, with its kernel encoding, from ``opts``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C, dev, f32 = CHUNK, q.device, torch.float32
    L, L2 = int(plan.checkpoint_every_n_tokens), int(plan.recompute_every_n_tokens)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv, dg, dbeta = torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
    items, sub, n_sub = N * HV, L2 // C, L // L2
    dA_part = torch.zeros(items, sub, dtype=f32, device=dev) if opts.has_A_log else None
    ddt_part = torch.zeros(items, sub, K, dtype=f32, device=dev) if opts.has_dt_bias else None
    # The carried dS lives in dh0 itself (state layout, read through strides) when there is one.
    state_shape = (N, HV, V, K) if opts.state_v_first else (N, HV, K, V)
    if initial_state is not None:
        if tuple(initial_state.shape) != state_shape:
            raise ValueError(f"initial_state must have shape {list(state_shape)}, got {list(initial_state.shape)}")
        dh0 = torch.empty(state_shape, dtype=f32, device=dev)
        carry = dh0
    else:
        dh0 = None
        carry = torch.empty(state_shape, dtype=f32, device=dev)
    if dht is not None:
        carry.copy_(dht)
    else:
        carry.zero_()
    ws_win = torch.empty(items, n_sub - 1, K, V, dtype=f32, device=dev) if n_sub > 1 else None
    ws_s = torch.empty(items, sub, K, V, dtype=stage_dtype, device=dev)
    ws_ds = torch.empty(items, sub, K, V, dtype=stage_dtype, device=dev)
    lean = uses_lean_states(H, HV)
    if lean:
        ws_aqk, ws_gc = (torch.empty(shape, dtype=dt, device=dev)
                         for _, shape, dt in lean_workspace_allocations(N, HV, K, sub, n_sub, q.dtype))

    max_len = max(plan.seqlens, default=0) if cu_seqlens is not None else T
    n_win = -(-max_len // L2)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else H200_SMS
    BK, BVG = block_size(K), min(block_size(V), GRADS_BLOCK_V)
    BV1 = STARTS_BLOCK_V or state_block_v(items, V, sms)
    BV2 = STATES_BLOCK_V or state_block_v(2 * items, V, sms)
    dummy = carry
    cu = cu_seqlens if cu_seqlens is not None else ckpt_offsets
    a_ptr = A_log if opts.has_A_log else dummy
    b_ptr = dt_bias if opts.has_dt_bias else dummy
    c_str = state_strides(carry, opts.state_v_first)
    scale, lower_bound = opts.scale, opts.kernel_lower_bound
    seq = dict(**opts.chunk_constexprs(), IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(q.dtype),
               INV_DOUBLING=USE_DOUBLING_INVERSE)
    grad_op, grad_prec = grad_operands(q.dtype)
    for win in reversed(range(n_win)):
        seg = win // n_sub
        # Stage 1 runs before the segment's first processed (= last existing) window.
        if n_sub > 1 and win == min(n_win - 1, seg * n_sub + n_sub - 1) and lean:
            run_lean_window_starts(
                seg, win, q=q, k=k, v=v, g=g, beta=beta, A_log=a_ptr, dt_bias=b_ptr, cu_seqlens=cu_seqlens,
                ckpt=checkpoints, ckpt_offsets=ckpt_offsets, ws_win=ws_win, ws_aqk=ws_aqk, ws_gc=ws_gc, dq=dq, dk=dk,
                dv=dv, dg=dg, N=N, sub=sub, n_sub=n_sub, opts=opts, dummy=dummy)
        elif n_sub > 1 and win == min(n_win - 1, seg * n_sub + n_sub - 1):
            chunk_kda_bwd_window_starts_kernel[(items, triton.cdiv(V, BV1))](
                k, v, g, beta, checkpoints, ckpt_offsets, cu, a_ptr, b_ptr, ws_win,
                seg, lower_bound, T, H, HV, K, V,
                GROUP=HV // H, C=C, BK=BK, BV=BV1, SEG_CHUNKS=L // C, SUB_CHUNKS=sub, N_SUB=n_sub, **seq,
                num_warps=STARTS_NUM_WARPS or STATE_NUM_WARPS, num_stages=1)
        if lean:
            run_lean_window_states(
                win, q=q, k=k, v=v, g=g, beta=beta, do=do, A_log=a_ptr, dt_bias=b_ptr, cu_seqlens=cu_seqlens,
                ckpt=checkpoints, ckpt_offsets=ckpt_offsets, ws_win=ws_win, ws_s=ws_s, ws_ds=ws_ds, ws_aqk=ws_aqk,
                ws_gc=ws_gc, carry=carry, dq=dq, dk=dk, dv=dv, dg=dg, N=N, sub=sub, n_sub=n_sub, opts=opts,
                stage_dtype=stage_dtype)
        else:
            chunk_kda_bwd_window_states_kernel[(items, triton.cdiv(V, BV2), 2)](
                q, k, v, g, beta, do, checkpoints, ckpt_offsets, cu, a_ptr, b_ptr,
                ws_win if ws_win is not None else dummy, ws_s, ws_ds, carry,
                win, scale, lower_bound, T, H, HV, K, V, *c_str,
                GROUP=HV // H, C=C, BK=BK, BV=BV2, SUB_CHUNKS=sub, N_SUB=n_sub, **seq, GRAD_PREC=grad_prec,
                GRAD_OP=grad_op, ROUND_STAGE=triton_interpreting() and stage_dtype == torch.bfloat16,
                num_warps=STATE_NUM_WARPS, num_stages=1)
        chunk_kda_bwd_window_grads_kernel[(N * H, sub)](
            q, k, v, g, beta, do, cu, a_ptr, b_ptr, ws_s, ws_ds,
            dq, dk, dv, dg, dbeta, dA_part if dA_part is not None else dummy,
            ddt_part if ddt_part is not None else dummy,
            win, scale, lower_bound, T, H, HV, K, V,
            C=C, BK=BK, BV=BVG, SUB_CHUNKS=sub, GROUP=HV // H, **seq, GRAD_PREC=grad_prec, GRAD_OP=grad_op,
            num_warps=GRADS_NUM_WARPS if opts.safe else GRADS_EXACT_NUM_WARPS, num_stages=GRADS_NUM_STAGES)
    del ws_win, ws_s, ws_ds, carry
    if lean:
        del ws_aqk, ws_gc
    return dq, dk, dv, dg, dbeta, dA_part, ddt_part, dh0


