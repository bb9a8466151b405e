"""Chunked KDA forward in Triton: a parallel intra-chunk kernel, then a lean sequential state kernel.

Per chunk of C = 16 tokens, with ``G`` the inclusive cumsum of the log-decay ``a`` over the
chunk rows, ``Γ = exp(G)``, ``g_C = G[C-1]``, ``E[i, j, c] = exp(G[i,c] - G[j,c])`` and the
state ``S`` ``[K, V]`` (fp32) at the chunk start::

    Akk[i, j] = beta_i sum_c k_i k_j E_ij  (j < i)     Aqk[i, j] = sum_c q_i k_j E_ij  (j <= i)
    Tinv = (I + Akk)^-1    W = Tinv (beta k Γ)  [C, K]    U = Tinv (beta v)  [C, V]
    V'   = U - W S         O = scale (qΓ S + Aqk V')      S <- exp(g_C) S + kd^T V',  kd = k exp(g_C - G)

Everything but the last line's three products is independent of S, so it is split out:

1. ``chunk_kda_fwd_intra_kernel``, grid ``(chunks, HV)`` over every chunk of every sequence
   (packed sequences map a chunk to (sequence, chunk) through ``plan.forward_chunk_table``):
   l2norm, gate, cumsum, the pairwise matrices (SAFE or EXACT path, see ``chunk_common``),
   the 16x16 inverse, then writes W, qΓ, kd ``[B, T, HV, K]`` and Aqk ``[B, T, HV, C]`` in
   the token dtype, ``exp(g_C)`` fp32 ``[chunks, HV, K]``, and U into the output buffer ``o``.
2. ``chunk_kda_fwd_state_kernel``, grid ``(N*HV, cdiv(V, BV))``: one program walks its
   sequence; a step loads W, qΓ, kd, Aqk, exp(g_C) and its U columns, computes V', O (written
   over U in place: the same program owns those rows and columns and reads them first) and
   the new S. Checkpoints and the final state are stored as before.

Memory: the forward-only temporaries are ``(3K + C) * b + 4K / C`` bytes per token and value
head (b = token dtype bytes; 832 B at K = 128, bf16), about 6.5 T·HV·D bytes, freed before
the launcher returns. U needs nothing of its own (it lives in ``o``). The backward later holds
dq, dk, dv, dg, dbeta (8 T·H·D + 2 T·H bytes) plus its workspace, none of which exist during
the forward, so the forward's peak stays below the backward's for every sequence length
(``plan.forward_peak_bytes`` is exact; ``plan.predicted_peak_bytes`` is the max over both).
Keeping U in a separate buffer would cost 2 T·HV·V bytes more and put the forward above the
backward beyond about 25K tokens per sequence (0.6 GiB more at 1 x 128K, H = 96).

Precision: the intra kernel computes in fp32 (``tl.dot`` in TF32 with bf16/fp16 inputs, TF32x3
with fp32; the 16x16 inverse in exact fp32) and rounds once on store; TF32's 10 mantissa bits
sit below the bf16 storage rounding. The state kernel keeps S in fp32; with bf16 inputs its products
take bf16 operands (S and V' rounded to bf16, fp32 accumulation); fp16 inputs use TF32 and
fp32 inputs TF32x3 on fp32 operands. Under the interpreter bf16 rounding is emulated exactly
(``round_to_bf16``), so the CPU tests see the GPU's numerics.

Layouts: q, k ``[B, T, H, K]``; v, o ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta
``[B, T, HV]`` (all contiguous, token-major); packed sequences via ``cu_seqlens`` (B = 1);
value head ``hv`` reads q/k head ``hv // (HV // H)``. Initial state fp32 or bf16 in either
layout (read through its strides); final state fp32 in the requested layout. Checkpoints:
``[num_checkpoints, HV, K, V]`` (K-major) in ``plan.checkpoint_dtype`` (bf16 for bf16 training), row ``offsets[n] + j`` is sequence n's state
before its token ``j * L`` (``plan.checkpoint_offsets``). All addressing is int64.

Limits: K, V <= 128 (other sizes are padded to a power of two >= 16 by masking).

Floors at 1 x 8K, H = HV = 96, K = V = 128, bf16 (H200: ~4.3 TB/s reachable, 790 TFLOP/s bf16):
* bytes any forward must move: q, k, v, g, o (5 x 201 MB) + beta (1.6 MB) + checkpoints
  (25 MB) = 1.03 GB -> 0.24 ms. This design moves about 3.4 GB (intra: reads 0.81 GB, writes
  W, qΓ, kd, U 0.81 GB + Aqk, exp(g_C) 0.05 GB; state: W, qΓ, kd read once per V block
  (2 x 0.6 GB, the second read mostly from L2), U 0.2 GB, o 0.2 GB) -> 0.5 to 0.8 ms.
* FLOPs (2 m n k per chunk and head): W S, qΓ S, kd^T V' = 3 x 2 x 16 x 128 x 128; Akk, Aqk,
  Tinv (beta k Γ), Tinv (beta v), Aqk V' = 5 x 2 x 16 x 16 x 128, inverse 6 x 2 x 16^3 ->
  2.4 MFLOP x 512 chunks x 96 heads = 0.12 TFLOP -> 0.15 ms at the bf16 peak.
* latency: 512 dependent state steps per program (two products in a row on the critical
  path, ~1 us a step) -> ~0.5 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk_common import (
    block_size,
    dot_operand,
    l2norm_rows,
    load_chunk_beta,
    load_chunk_gate,
    load_matrix,
    load_rows,
    load_rows_native,
    locate_chunk,
    pairwise_dot,
    pairwise_exact,
    round_to_bf16_if,
    row_of,
    safe_gate_factors,
    seq_bounds,
    store_matrix,
    store_rows,
    unit_lower_inverse_doubling,
)
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan import CHUNK_SIZE, KDAPlan, forward_chunk_table, plan_kda

EXACT_KEY_SLICE = 16  # BKS: [C, C, BKS] fp32 per pairwise slice stays at 16 registers a thread
INTRA_NUM_WARPS = 4
# Two stages let the pipeliner fetch the next chunk's W, qΓ, kd, Aqk and U while this chunk's
# products run: those loads do not depend on S.
STATE_NUM_STAGES = 2
# bf16 inputs: the state kernel's products take bf16 operands (S and V' rounded); False runs
# them in TF32 on fp32 operands instead (slower, for accuracy comparisons).
STATE_BF16_OPERANDS = True
# fp32 inputs: TF32x3 products triple the operand registers; BV = 64 spills 2.4 KB at K = 128.
FP32_MAX_BLOCK_V = 32


def state_num_warps(BK: int, BV: int) -> int:
    """4 warps up to a [128, 64] state tile (64 fp32 registers a thread for S), 8 above."""
    return 8 if BK * BV > 128 * 64 else 4


# ---------------------------------------------------------------------------------------
# kernel 1: everything of a chunk that does not depend on the state
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_kda_fwd_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, w, qg, kd, uo, aqk, gc, cu_seqlens, chunk_table,
    lower_bound, T, H, HV, NTS, win,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKS: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    SAFE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, EMULATE_BF16: tl.constexpr,
    WINDOW: tl.constexpr = False, SUB: tl.constexpr = 1,
):
    """One (chunk, value head): W, qΓ, kd, Aqk, exp(g_C) to the temporaries, U into o.

    WINDOW (the backward, ``chunk_bwd_states``): grid (N * SUB, HV), program (n * SUB + j) takes chunk
    ``win * SUB + j`` of sequence n (all its stores masked when the sequence has no such chunk); W, qΓ,
    kd, U go to token rows as in the forward, Aqk to slot ``[n * SUB + j, hv]`` of ``[N * SUB, HV, C, C]``
    and exp(g_C) to row n * SUB + j of gc.
    """
    i_t = tl.program_id(0).to(tl.int64)  # global chunk index (WINDOW: the window slot): the row of gc
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    if WINDOW:
        i_n = i_t // SUB
        i_c = (win * SUB + i_t % SUB).to(tl.int32)
        bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
        seq_len = (eos - bos).to(tl.int32)
        t0 = i_c * C
    else:
        bos, seq_len, t0 = locate_chunk(i_t, cu_seqlens, chunk_table, T, NTS, C, IS_VARLEN)

    q_base = q + (bos * H + i_h) * K
    k_base = k + (bos * H + i_h) * K
    g_base = g + (bos * HV + i_hv) * K
    b_base = beta + bos * HV + i_hv
    v_base = v + (bos * HV + i_hv) * V
    if HAS_BIAS:
        bias_ptr = dt_bias + i_hv * K
    else:
        bias_ptr = dt_bias
    if HAS_A_LOG:
        expA = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        expA = 1.0

    qt = load_rows(q_base, t0, seq_len, H * K, 0, K, C, BK)  # [C, BK]
    kt = load_rows(k_base, t0, seq_len, H * K, 0, K, C, BK)  # [C, BK]
    if USE_L2NORM:
        qt, rq = l2norm_rows(qt)
        kt, rk = l2norm_rows(kt)
    a = load_chunk_gate(g_base, bias_ptr, t0, seq_len, HV * K, 0, K, expA, lower_bound,
                        C, BK, GATE, HAS_BIAS)  # [C, BK]
    Gc = tl.cumsum(a, axis=0)  # [C, BK]
    bt = load_chunk_beta(b_base, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]

    if SAFE:
        eg, egi = safe_gate_factors(Gc, C)  # [C, BK] each
        ki = kt * egi
        Akk = pairwise_dot(kt * eg, ki, C, False, DOT_PREC)  # [C, C]
        Aqk = pairwise_dot(qt * eg, ki, C, True, DOT_PREC)  # [C, C]
    else:
        # Key slices re-read from memory: register tiles cannot be sliced by column.
        Akk = tl.zeros([C, C], dtype=tl.float32)
        Aqk = tl.zeros([C, C], dtype=tl.float32)
        for ks in tl.static_range(0, BK, BKS):
            qs = load_rows(q_base, t0, seq_len, H * K, ks, K, C, BKS)  # [C, BKS]
            kss = load_rows(k_base, t0, seq_len, H * K, ks, K, C, BKS)  # [C, BKS]
            if USE_L2NORM:
                qs = qs * rq[:, None]
                kss = kss * rk[:, None]
            a_s = load_chunk_gate(g_base, bias_ptr, t0, seq_len, HV * K, ks, K, expA, lower_bound,
                                  C, BKS, GATE, HAS_BIAS)
            G_s = tl.cumsum(a_s, axis=0)  # [C, BKS]
            Akk += pairwise_exact(kss, kss, G_s, C, False)
            Aqk += pairwise_exact(qs, kss, G_s, C, True)
    Tinv = unit_lower_inverse_doubling(Akk * bt[:, None], C)  # [C, C]

    gam = tl.exp(Gc)  # [C, BK], <= 1
    g_last = row_of(Gc, C - 1, C)  # [BK]; padded rows add 0, so this is the last real token's
    wt = tl.dot(Tinv, kt * gam * bt[:, None], input_precision=DOT_PREC)  # [C, BK]
    vt = load_rows(v_base, t0, seq_len, HV * V, 0, V, C, BV)  # [C, BV]
    ut = tl.dot(Tinv, vt * bt[:, None], input_precision=DOT_PREC)  # [C, BV]

    row_k = HV * K
    tok = (bos * HV + i_hv) * K
    store_rows(w + tok, round_to_bf16_if(wt, EMULATE_BF16), t0, seq_len, row_k, 0, K, C, BK)
    store_rows(qg + tok, round_to_bf16_if(qt * gam, EMULATE_BF16), t0, seq_len, row_k, 0, K, C, BK)
    store_rows(kd + tok, round_to_bf16_if(kt * tl.exp(g_last[None, :] - Gc), EMULATE_BF16),
               t0, seq_len, row_k, 0, K, C, BK)
    if WINDOW:
        # The slot's base less t0 rows, so store_rows' row t0 is the slot's row 0 and its mask the sequence's.
        store_rows(aqk + (i_t * HV + i_hv) * (C * C) - t0.to(tl.int64) * C, round_to_bf16_if(Aqk, EMULATE_BF16),
                   t0, seq_len, C, 0, C, C, C)
    else:
        store_rows(aqk + (bos * HV + i_hv) * C, round_to_bf16_if(Aqk, EMULATE_BF16), t0, seq_len, HV * C, 0, C,
                   C, C)
    store_rows(uo + (bos * HV + i_hv) * V, round_to_bf16_if(ut, EMULATE_BF16), t0, seq_len, HV * V, 0, V, C, BV)
    c = tl.arange(0, BK)
    tl.store(gc + (i_t * HV + i_hv) * K + c, tl.exp(g_last), mask=c < K)


# ---------------------------------------------------------------------------------------
# kernel 2: the state recurrence
# ---------------------------------------------------------------------------------------


@triton.jit
def _state_step(
    S, t0, seq_len, w_base, qg_base, kd_base, a_base, uo_base, gc_base, ckpt, ck_row0, i_hv,
    scale, HV, v0, L_CKPT, s_ck_k, s_ck_v,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_CKPT: tl.constexpr, CKPT_BF16: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One chunk (rows t0 .. t0 + C - 1 of the sequence): O over U, maybe a checkpoint; returns the new S."""
    if STORE_CKPT:
        if t0 % L_CKPT == 0:
            row = ck_row0 + t0 // L_CKPT
            store_matrix(ckpt + (row * HV + i_hv) * (K * V), round_to_bf16_if(S, CKPT_BF16), s_ck_k, s_ck_v, K, V,
                         v0, BK, BV)

    wt = dot_operand(load_rows_native(w_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)  # [C, BK]
    qgt = dot_operand(load_rows_native(qg_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
    kdt = dot_operand(load_rows_native(kd_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
    at = dot_operand(load_rows_native(a_base, t0, seq_len, HV * C, 0, C, C, C), OP_BF16, EMULATE_BF16)  # [C, C]
    ut = load_rows(uo_base, t0, seq_len, HV * V, v0, V, C, BV)  # [C, BV]
    c = tl.arange(0, BK)
    chunk = tl.zeros([BK], dtype=tl.int64) + t0 // C  # int64: chunks * HV * K may pass 2^31
    gct = tl.load(gc_base + chunk * (HV * K) + c, mask=c < K, other=0.0)  # [BK]

    Sb = dot_operand(S, OP_BF16, EMULATE_BF16)  # [BK, BV]
    vn = ut - tl.dot(wt, Sb, input_precision=DOT_PREC)  # [C, BV] = V'
    vb = dot_operand(vn, OP_BF16, EMULATE_BF16)
    ot = scale * (tl.dot(qgt, Sb, input_precision=DOT_PREC) + tl.dot(at, vb, input_precision=DOT_PREC))
    store_rows(uo_base, round_to_bf16_if(ot, EMULATE_BF16), t0, seq_len, HV * V, v0, V, C, BV)
    return S * gct[:, None] + tl.dot(tl.trans(kdt), vb, input_precision=DOT_PREC)  # [BK, BV]


@triton.jit
def chunk_kda_fwd_state_kernel(
    w, qg, kd, aqk, gc, uo, h0, ht, ckpt, cu_seqlens, chunk_offsets, ckpt_offsets,
    scale, T, HV, NTS,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v,
    s_ht_n, s_ht_h, s_ht_k, s_ht_v,
    L_CKPT, s_ck_k, s_ck_v,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_CKPT: tl.constexpr,
    CKPT_BF16: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, LOOP_WHILE: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)  # global index of the sequence's first chunk
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NTS
    seq_len = (eos - bos).to(tl.int32)
    v0 = i_v * BV

    tok = (bos * HV + i_hv) * K
    w_base = w + tok
    qg_base = qg + tok
    kd_base = kd + tok
    a_base = aqk + (bos * HV + i_hv) * C
    uo_base = uo + (bos * HV + i_hv) * V
    gc_base = gc + c0 * (HV * K) + i_hv * K

    S = tl.zeros([BK, BV], dtype=tl.float32)  # state columns [v0, v0 + BV), K-major
    if HAS_H0:
        S = load_matrix(h0 + i_n.to(tl.int64) * s_h0_n + i_hv * s_h0_h, s_h0_k, s_h0_v, K, V, v0, BK, BV)
    if STORE_CKPT:
        ck_row0 = tl.load(ckpt_offsets + i_n)  # int64
    else:
        ck_row0 = 0

    n_chunks = tl.cdiv(seq_len, C)
    if LOOP_WHILE:
        # The interpreter cannot take range() of a program-dependent bound; a while loop it can.
        i_c = 0
        while i_c < n_chunks:
            S = _state_step(S, i_c * C, seq_len, w_base, qg_base, kd_base, a_base, uo_base, gc_base,
                            ckpt, ck_row0, i_hv, scale, HV, v0, L_CKPT, s_ck_k, s_ck_v, K, V, C, BK, BV,
                            STORE_CKPT, CKPT_BF16, OP_BF16, EMULATE_BF16, DOT_PREC)
            i_c += 1
    else:
        for i_c in range(0, n_chunks):
            S = _state_step(S, i_c * C, seq_len, w_base, qg_base, kd_base, a_base, uo_base, gc_base,
                            ckpt, ck_row0, i_hv, scale, HV, v0, L_CKPT, s_ck_k, s_ck_v, K, V, C, BK, BV,
                            STORE_CKPT, CKPT_BF16, OP_BF16, EMULATE_BF16, DOT_PREC)

    if STORE_HT:
        store_matrix(ht + i_n.to(tl.int64) * s_ht_n + i_hv * s_ht_h, S, s_ht_k, s_ht_v, K, V, v0, BK, BV)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def _state_strides(t: torch.Tensor, state_v_first: bool) -> tuple[int, int, int, int]:
    """(n, hv, k, v) element strides of a state tensor in either layout."""
    sn, sh, s2, s3 = t.stride()
    return (sn, sh, s3, s2) if state_v_first else (sn, sh, s2, s3)


def chunk_kda_fwd_intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor, *,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, cu_seqlens: torch.Tensor | None, plan: KDAPlan,
    opts: KDAOptions,
) -> tuple[torch.Tensor, ...]:
    """Kernel 1 on validated inputs (see chunk_kda_fwd): allocates the temporaries and writes U into ``o``.

    Returns ``(w, qg, kd, aqk, gc, table)``: W, qΓ, kd ``[B, T, HV, K]`` and Aqk
    ``[B, T, HV, C]`` (row i of a chunk holds ``Aqk[i, :]``; tail rows are not written) in q's
    dtype, ``exp(g_C)`` fp32 ``[plan.num_chunks, HV, K]`` (global chunk order: sequence by
    sequence), and the int32 chunk table of ``plan.forward_chunk_table`` (None without
    cu_seqlens). ``o`` ``[B, T, HV, V]`` receives ``U = Tinv (beta v)`` in its dtype.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = CHUNK_SIZE
    BK, BV = block_size(K), block_size(V)
    dev = q.device
    varlen = cu_seqlens is not None
    NT = plan.num_chunks
    table = pairs = None
    if varlen:
        table = forward_chunk_table(plan.seqlens, device=dev)
        pairs = table[: 2 * NT]
    w = torch.empty((B, T, HV, K), dtype=q.dtype, device=dev)
    qg = torch.empty_like(w)
    kd = torch.empty_like(w)
    aqk = torch.empty((B, T, HV, C), dtype=q.dtype, device=dev)
    gc = torch.empty((NT, HV, K), dtype=torch.float32, device=dev)
    if NT * HV == 0:
        return w, qg, kd, aqk, gc, table
    chunk_kda_fwd_intra_kernel[(NT, HV)](
        q, k, v, g, beta, A_log, dt_bias, w, qg, kd, o, aqk, gc, cu_seqlens, pairs,
        opts.kernel_lower_bound, T, H, HV, triton.cdiv(T, C), 0,
        K=K, V=V, C=C, BK=BK, BV=BV, BKS=min(EXACT_KEY_SLICE, BK), **opts.intra_constexprs(), SAFE=opts.safe,
        IS_VARLEN=varlen,
        DOT_PREC=dot_precision(q.dtype), EMULATE_BF16=triton_interpreting() and q.dtype == torch.bfloat16,
        num_warps=INTRA_NUM_WARPS, num_stages=1,
    )
    return w, qg, kd, aqk, gc, table


def chunk_kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    opts: KDAOptions,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    plan: KDAPlan | None = None,
    save_checkpoints: bool = True,
    ckpt_offsets: torch.Tensor | None = None,
    checkpoint_dtype: torch.dtype | None = None,
    checkpoint_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the chunked KDA forward kernels on validated inputs.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta
    ``[B, T, HV]`` (contiguous; fp16/bf16/fp32); A_log ``[HV]``, dt_bias ``[HV*K]`` (fp32);
    initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first; fp32 or bf16, any
    strides); cu_seqlens int32/int64 ``[N + 1]`` with B = 1. ``opts``: the call's ``KDAOptions``
    (``kdakit.ops.kda.options.kda_options``): scale, the in-kernel options, their kernel encodings,
    ``output_final_state`` and the state layout.

    Returns ``o`` ``[B, T, HV, V]`` in v's dtype, the final state (fp32, requested layout)
    or None, and the checkpoints ``[plan.num_checkpoints, HV, K, V]`` (``[.., V, K]`` with
    checkpoint_v_first) in ``checkpoint_dtype`` (None: the plan's, ``training_checkpoint_dtype`` for the
    backward; the token dtype for
    ``chunk_kda(..., return_intermediate_states=True)``, which is FLA's h at a 64-token cadence) or
    None (see ``plan.checkpoint_offsets`` for their rows). ``plan`` defaults to ``plan_kda`` of the
    shapes (it fixes the checkpoint cadence and the V block). ``ckpt_offsets`` (int64
    ``[N + 1]`` on the device, ``plan.checkpoint_offsets``) is made here when not given; a caller
    that also runs the backward passes its own so one tensor serves both. Allocates, in this order, what
    ``plan.allocations`` lists for the forward; the intra-chunk temporaries are freed on return.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton forward, got strides {tuple(t.stride())}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32 for the Triton forward, got {q.dtype}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > CHUNK_MAX_HEAD_DIM or V > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"the Triton forward supports K, V <= {CHUNK_MAX_HEAD_DIM}, got K={K}, V={V}")
    if plan is None:
        plan = plan_kda(q, v, cu_seqlens=cu_seqlens, initial_state=initial_state is not None,
                        output_final_state=opts.output_final_state, gate_params=A_log is not None)
    if (plan.B, plan.T, plan.H, plan.HV, plan.K, plan.V) != (B, T, H, HV, K, V):
        raise ValueError(
            f"plan was made for B,T,H,HV,K,V = {(plan.B, plan.T, plan.H, plan.HV, plan.K, plan.V)}, "
            f"got {(B, T, H, HV, K, V)}"
        )
    N = plan.num_sequences
    L = plan.checkpoint_every_n_tokens
    C = CHUNK_SIZE
    BK = block_size(K)
    BV = min(plan.block_v, block_size(V))
    if q.dtype == torch.float32:
        BV = min(BV, FP32_MAX_BLOCK_V)
    dev = q.device

    o = torch.empty_like(v)
    final = None
    if opts.output_final_state:
        final = torch.empty((N, HV, V, K) if opts.state_v_first else (N, HV, K, V), dtype=torch.float32, device=dev)
    ckpts = offsets = None
    if save_checkpoints:
        offsets = ckpt_offsets if ckpt_offsets is not None else plan.checkpoint_offsets(dev)
        if checkpoint_dtype is None:
            checkpoint_dtype = plan.checkpoint_dtype
        if checkpoint_dtype != plan.checkpoint_dtype:
            raise ValueError(f"checkpoint_dtype {checkpoint_dtype} differs from the plan's {plan.checkpoint_dtype}")
        ckpts = torch.empty((plan.num_checkpoints, HV, V, K) if checkpoint_v_first else
                            (plan.num_checkpoints, HV, K, V), dtype=checkpoint_dtype, device=dev)
    if N * HV == 0 or T == 0:
        if final is not None:
            final.copy_(_initial_or_zeros(initial_state, final))
        return o, final, ckpts

    varlen = cu_seqlens is not None
    interp = triton_interpreting()
    w, qg, kd, aqk, gc, table = chunk_kda_fwd_intra(q, k, v, g, beta, o, A_log=A_log, dt_bias=dt_bias,
                                                    cu_seqlens=cu_seqlens, plan=plan, opts=opts)
    chunk_offsets = table[2 * plan.num_chunks:] if varlen else None

    h0_strides = _state_strides(initial_state, opts.state_v_first) if initial_state is not None else (0, 0, 0, 0)
    ht_strides = _state_strides(final, opts.state_v_first) if final is not None else (0, 0, 0, 0)
    chunk_kda_fwd_state_kernel[(N * HV, triton.cdiv(V, BV))](
        w, qg, kd, aqk, gc, o, initial_state, final, ckpts, cu_seqlens, chunk_offsets, offsets,
        opts.scale, T, HV, triton.cdiv(T, C), *h0_strides, *ht_strides, L,
        *((1, K) if checkpoint_v_first else (V, 1)),
        K=K, V=V, C=C, BK=BK, BV=BV, IS_VARLEN=varlen, HAS_H0=initial_state is not None,
        STORE_HT=final is not None, STORE_CKPT=ckpts is not None,
        CKPT_BF16=interp and checkpoint_dtype == torch.bfloat16,
        OP_BF16=STATE_BF16_OPERANDS and q.dtype == torch.bfloat16, EMULATE_BF16=interp and q.dtype == torch.bfloat16,
        DOT_PREC=dot_precision(q.dtype),
        LOOP_WHILE=interp, num_warps=state_num_warps(BK, BV), num_stages=STATE_NUM_STAGES,
    )
    del w, qg, kd, aqk, gc, table, chunk_offsets
    return o, final, ckpts


def _initial_or_zeros(initial_state, like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros_like(like)
    return initial_state.to(torch.float32)
