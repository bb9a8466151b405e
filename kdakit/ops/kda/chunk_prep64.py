"""The backward's prep stage of the 64-token chunk pipeline (``KDAKIT_CHUNK_PIPELINE=chunk64``), and the pieces its
forward (``chunk_fwd64.py``) shares (chunk location, options, the table): everything of a chunk that does not
depend on the state.

Per chunk of C = 64 tokens and value head (sub-chunk numerics in ``chunk_tiles.py``), with G the chunk cumsum
of the log-decay, Γ = exp(G) and g_C = G at the last row::

    Akk, Aqk (pairwise, 16-token sub-chunks)    Tinv = (I + beta Akk)^-1 (by blocks, stored)
    W = Tinv (beta k Γ)    kd = k exp(g_C - G)    exp(g_C)    P = scale (qΓ^T dO - W^T Aqk^T dO)

Stored in the token dtype (fp32 for fp32 inputs): Tinv, Aqk, Akk ``[B, T, HV, C]`` (row i of a chunk holds
row i of the matrix), W, kd ``[B, T, HV, K]``; exp(g_C) fp32 ``[chunks, HV, K]``; P into the chunk's
state-gradient slot ``[chunks, HV, K, V]``. The serial passes then only load operands (on the H200 a
step that loads them took 12 us, one that re-derived them 50 us).

Launch options are derived once, by ``chunk64_options`` from the call's ``KDAOptions``, into one frozen object
the launchers take whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk_common import (
    block_size,
    GATE_SOFTPLUS,
    load_matrix,
    load_rows,
    locate_chunk,
    round_to_bf16_if,
    seq_bounds,
    store_matrix,
    store_rows,
)
from kdakit.ops.kda.chunk_tiles import (
    CHUNK,
    SUB,
    dot_operand,
    load_beta,
    load_gate,
    load_unit_lower,
    load_unit_rows,
    mm,
    pairwise_diag_exact,
    pairwise_qk_kk_block,
    store_unit_lower_inverse,
)
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan import host_to_device

MAX_HEAD_DIM = 128
EXACT_KEY_SLICE = 16  # BKS of the EXACT diagonal blocks: [16, 16, 16] fp32 per slice
PREP_NUM_WARPS = 8


# ---------------------------------------------------------------------------------------
# shared per-chunk pieces
# ---------------------------------------------------------------------------------------


@triton.jit
def locate_sequence(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN: tl.constexpr):
    """Sequence i_n -> (bos int64, length int32, global index of its first chunk int64)."""
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    if IS_VARLEN:
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        c0 = i_n.to(tl.int64) * NTS
    return bos, (eos - bos).to(tl.int32), c0


@triton.jit
def chunk_program(cu_seqlens, chunk_table, T, NTS, H, HV, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """This program's place on a chunk grid ``(chunks, heads)``: (global chunk i_t int64, the head on axis 1,
    its q/k head ``head // (HV // H)``, the sequence's first token bos, its length, the chunk's first row t0).
    H, HV: q/k and value heads on a grid of value heads; 1, 1 on a grid of q/k heads."""
    i_t = tl.program_id(0).to(tl.int64)
    i_head = tl.program_id(1)
    i_h = i_head // (HV // H)
    bos, seq_len, t0 = locate_chunk(i_t, cu_seqlens, chunk_table, T, NTS, C, IS_VARLEN)
    return i_t, i_head, i_h, bos, seq_len, t0


@triton.jit
def sequence_program(cu_seqlens, chunk_offsets, T, HV, NTS, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """This program's place on a state-walk grid ``(N * HV, cdiv(V, BV)[, roles])``: (sequence i_n, value head,
    the value block's first column v0, the index on axis 2 (the role, where the grid has roles), bos, the
    sequence's length, its first chunk's global index c0)."""
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    role = tl.program_id(2)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos, seq_len, c0 = locate_sequence(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN)
    return i_n, i_hv, i_v * BV, role, bos, seq_len, c0


@triton.jit
def gate_scalar(A_log, i_hv, stride_alog, HAS_A_LOG: tl.constexpr):
    """exp(A_log[hv]) (1 without A_log)."""
    if HAS_A_LOG:
        e = tl.exp(tl.load(A_log + i_hv.to(tl.int64) * stride_alog).to(tl.float32))
    else:
        e = 1.0
    return e


@triton.jit
def bias_row(dt_bias, i_hv, K, stride_bias, HAS_BIAS: tl.constexpr):
    """dt_bias[hv * K] (the pointer itself without a bias)."""
    if HAS_BIAS:
        p = dt_bias + i_hv.to(tl.int64) * K * stride_bias
    else:
        p = dt_bias
    return p


@triton.jit
def load_rows_t(base, t0, n_rows, stride_row, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """``x[t0 + r, c]`` loaded transposed as ``[BC, BR]`` fp32 (a transposed dot operand straight from
    memory, no register transpose). Rows ``>= n_rows`` and columns ``>= n_cols`` read as 0."""
    r = t0 + tl.arange(0, BR)
    c = tl.arange(0, BC)
    ptrs = base + r.to(tl.int64)[None, :] * stride_row + c[:, None]
    return tl.load(ptrs, mask=(r < n_rows)[None, :] & (c < n_cols)[:, None], other=0.0).to(tl.float32)


@triton.jit
def load_step_operands(w_base, kd_base, tinv_base, egc_row, t0, seq_len, HV, K,
                       C: tl.constexpr, BK: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """A serial step's S-independent operands as the prep kernel stored them:
    (Tinv [C, C], W [C, BK], kd [C, BK] as dot operands, exp(g_C) [BK] fp32)."""
    Ti = dot_operand(load_unit_lower(tinv_base, t0, seq_len, HV * C, C), OP_BF16, EMULATE_BF16)
    W = dot_operand(load_rows(w_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
    kd = dot_operand(load_rows(kd_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
    c = tl.arange(0, BK)
    egc = tl.load(egc_row + c, mask=c < K, other=0.0)
    return Ti, W, kd, egc


@triton.jit
def state_step(S, i_c, c0, i_hv, seq_len, HV, v0, v_base, b_base, w_base, kd_base, tinv_base, egc, hs,
               K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, OP_BF16: tl.constexpr,
               EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr):
    """One chunk of the state recurrence for value columns ``[v0, v0 + BV)`` from the prep stage's operands:
    stores the entering S into its slot of ``hs``, then ``V' = Tinv (beta v) - W S``,
    ``S <- exp(g_C) S + kd^T V'``. Returns the new S."""
    t0 = i_c * C
    row = (c0 + i_c) * HV + i_hv
    store_matrix(hs + row * (K * V), round_to_bf16_if(S, EMULATE_BF16), V, 1, K, V, v0, BK, BV)
    Ti = dot_operand(load_unit_lower(tinv_base, t0, seq_len, HV * C, C), OP_BF16, EMULATE_BF16)  # [C, C]
    W = dot_operand(load_rows(w_base, t0, seq_len, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)  # [C, BK]
    kdT = dot_operand(load_rows_t(kd_base, t0, seq_len, HV * K, K, C, BK), OP_BF16, EMULATE_BF16)  # [BK, C]
    cols = tl.arange(0, BK)
    egc_c = tl.load(egc + row * K + cols, mask=cols < K, other=0.0)  # [BK]
    bt, _ = load_beta(b_base, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)
    vt = load_rows(v_base, t0, seq_len, HV * V, v0, V, C, BV)  # [C, BV]
    So = dot_operand(S, OP_BF16, EMULATE_BF16)
    vn = dot_operand(tl.dot(Ti, dot_operand(vt * bt[:, None], OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)
                     - tl.dot(W, So, input_precision=DOT_PREC), OP_BF16, EMULATE_BF16)  # V' [C, BV]
    return S * egc_c[:, None] + tl.dot(kdT, vn, input_precision=DOT_PREC)  # [BK, BV]


@triton.jit
def state_row(base, i_n, i_hv, s_n, s_h, PRESENT: tl.constexpr):
    """Sequence i_n, value head i_hv of a state tensor (the pointer itself when the tensor is absent)."""
    if PRESENT:
        p = base + i_n.to(tl.int64) * s_n + i_hv * s_h
    else:
        p = base
    return p


@triton.jit
def state_recurrence(h0_base, s_h0_k, s_h0_v, c0, i_hv, seq_len, HV, v0, v_base, b_base, w_base, kd_base,
                     tinv_base, egc, hs,
                     K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, OP_BF16: tl.constexpr,
                     EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr, HAS_H0: tl.constexpr,
                     LOOP_WHILE: tl.constexpr):
    """Walk one sequence's chunks with state_step from h0 (or zeros), storing every chunk's entering state in
    ``hs``; returns the final state ``[BK, BV]``."""
    S = tl.zeros([BK, BV], dtype=tl.float32)  # state columns [v0, v0 + BV), K-major
    if HAS_H0:
        S = load_matrix(h0_base, s_h0_k, s_h0_v, K, V, v0, BK, BV)
    n_chunks = tl.cdiv(seq_len, C)
    if LOOP_WHILE:
        # The interpreter cannot take range() of a program-dependent bound; a while loop it can.
        i_c = 0
        while i_c < n_chunks:
            S = state_step(S, i_c, c0, i_hv, seq_len, HV, v0, v_base, b_base, w_base, kd_base, tinv_base, egc, hs,
                           K, V, C, BK, BV, BETA_SIGMOID, NEG_EIGVAL, OP_BF16, EMULATE_BF16, DOT_PREC)
            i_c += 1
    else:
        for i_c in range(0, n_chunks):
            S = state_step(S, i_c, c0, i_hv, seq_len, HV, v0, v_base, b_base, w_base, kd_base, tinv_base, egc, hs,
                           K, V, C, BK, BV, BETA_SIGMOID, NEG_EIGVAL, OP_BF16, EMULATE_BF16, DOT_PREC)
    return S


# ---------------------------------------------------------------------------------------
# the prep kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_kda_prep64_kernel(
    q, k, g, beta, A_log, dt_bias, do, tinv, w, kd, egc, aqk, akk, dhs, cu_seqlens, chunk_table,
    scale, lower_bound, T, H, HV, NTS, stride_alog, stride_bias,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, SUBC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKS: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr,
    IS_VARLEN: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One (chunk, value head): the inverse, W, kd, exp(g_C), Aqk, Akk and P (into the chunk's state-gradient
    slot)."""
    i_t, i_hv, i_h, bos, seq_len, t0 = chunk_program(cu_seqlens, chunk_table, T, NTS, H, HV, C, IS_VARLEN)
    q_base = q + (bos * H + i_h) * K
    k_base = k + (bos * H + i_h) * K
    g_base = g + (bos * HV + i_hv) * K
    bias_ptr = bias_row(dt_bias, i_hv, K, stride_bias, HAS_BIAS)
    expA = gate_scalar(A_log, i_hv, stride_alog, HAS_A_LOG)

    qn, rq = load_unit_rows(q_base, t0, seq_len, H * K, K, C, BK, USE_L2NORM)  # [C, BK], [C]
    kn, rk = load_unit_rows(k_base, t0, seq_len, H * K, K, C, BK, USE_L2NORM)
    a = load_gate(g_base, bias_ptr, t0, seq_len, HV * K, 0, K, expA, lower_bound, C, BK, GATE, HAS_BIAS, stride_bias)
    G = tl.cumsum(a, axis=0)  # [C, BK]
    bt, _ = load_beta(beta + bos * HV + i_hv, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]

    Aqk, Akk = pairwise_qk_kk_block(qn, kn, G, SAFE, C, SUBC, BK, OP_BF16, EMULATE_BF16, DOT_PREC, True)  # [C, C]
    if not SAFE:
        Aqk += pairwise_diag_exact(q_base, k_base, rq, rk, g_base, bias_ptr, t0, seq_len, H * K, HV * K, K, expA,
                                   lower_bound, stride_bias, C, SUBC, BK, BKS, GATE, HAS_BIAS, True)
        Akk += pairwise_diag_exact(k_base, k_base, rk, rk, g_base, bias_ptr, t0, seq_len, H * K, HV * K, K, expA,
                                   lower_bound, stride_bias, C, SUBC, BK, BKS, GATE, HAS_BIAS, False)
    tinv_base = tinv + (bos * HV + i_hv) * C
    store_unit_lower_inverse(Akk * bt[:, None], tinv_base, t0, seq_len, HV * C, C, SUBC, EMULATE_BF16)
    tok_c = (bos * HV + i_hv) * C
    store_rows(akk + tok_c, round_to_bf16_if(Akk, EMULATE_BF16), t0, seq_len, HV * C, 0, C, C, C)
    tl.debug_barrier()  # the stored inverse is re-read below by other threads of this program
    Ti = load_unit_lower(tinv_base, t0, seq_len, HV * C, C)  # [C, C], as the later kernels see it

    store_rows(aqk + tok_c, round_to_bf16_if(Aqk, EMULATE_BF16), t0, seq_len, HV * C, 0, C, C, C)
    gam = tl.exp(G)
    W = round_to_bf16_if(mm(Ti, kn * gam * bt[:, None], OP_BF16, EMULATE_BF16, DOT_PREC), EMULATE_BF16)  # [C, BK]
    gcs = tl.sum(a, axis=0)  # [BK]: G at the last real row (padded rows add 0)
    tok_k = (bos * HV + i_hv) * K
    store_rows(w + tok_k, W, t0, seq_len, HV * K, 0, K, C, BK)
    store_rows(kd + tok_k, round_to_bf16_if(kn * tl.exp(gcs[None, :] - G), EMULATE_BF16), t0, seq_len, HV * K, 0, K,
               C, BK)
    cols = tl.arange(0, BK)
    tl.store(egc + (i_t * HV + i_hv) * K + cols, tl.exp(gcs), mask=cols < K)
    sdo = scale * load_rows(do + (bos * HV + i_hv) * V, t0, seq_len, HV * V, 0, V, C, BV)  # [C, BV]
    P = mm(tl.trans(qn * gam), sdo, OP_BF16, EMULATE_BF16, DOT_PREC) \
        - mm(tl.trans(W), mm(tl.trans(Aqk), sdo, OP_BF16, EMULATE_BF16, DOT_PREC), OP_BF16, EMULATE_BF16, DOT_PREC)
    store_matrix(dhs + (i_t * HV + i_hv) * (K * V), round_to_bf16_if(P, EMULATE_BF16), V, 1, K, V, 0, BK, BV)


# ---------------------------------------------------------------------------------------
# options and launcher
# ---------------------------------------------------------------------------------------


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(bf16 operands?, fp32-operand precision): bf16 inputs multiply bf16 operands (rounded to nearest,
    fp32 accumulation, as FLA); fp16 and fp32 inputs use 3xTF32; the interpreter is exact."""
    if triton_interpreting():
        return dtype == torch.bfloat16, "ieee"
    if dtype == torch.bfloat16:
        return True, "tf32"
    return False, "tf32x3"


def state_strides(t: torch.Tensor | None, state_v_first: bool) -> tuple[int, int, int, int]:
    """(n, hv, k, v) element strides of a state tensor in either layout (zeros for None)."""
    if t is None:
        return (0, 0, 0, 0)
    sn, sh, s2, s3 = t.stride()
    return (sn, sh, s3, s2) if state_v_first else (sn, sh, s2, s3)


def chunk_chunk_table(lengths, chunk: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pairs int32 [2*NT]: (sequence, chunk within it) of every global chunk, first int32 [N+1]: each
    sequence's first global chunk, NT) for packed sequences, built on the host from known lengths."""
    counts = torch.tensor([-(-int(n) // chunk) for n in lengths], dtype=torch.int64)
    firsts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    firsts[1:] = torch.cumsum(counts, 0)
    nt = int(firsts[-1])
    if nt + len(counts) >= 2**31:
        raise ValueError(f"the chunk table needs int32 entries, got {nt} chunks")
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    local = torch.arange(nt) - firsts[:-1].repeat_interleave(counts)
    table = host_to_device(torch.cat([torch.stack([seq, local], 1).reshape(-1), firsts]).to(torch.int32), device)
    return table[: 2 * nt], table[2 * nt:], nt



@dataclass(frozen=True)
class Chunk64Options:
    """The 64-token pipeline's launch configuration for one call, derived once from its ``KDAOptions``
    (``kda``, kept whole; the sizes and option encodings below are read from it) plus the pipeline's own
    chunk counts, blocks, strides and dot settings."""

    kda: KDAOptions
    NT: int  # 64-token chunks over all sequences
    NTS: int  # chunks per sequence of a fixed-length batch
    BK: int
    BV: int
    varlen: bool
    stride_alog: int
    stride_bias: int
    slot_dtype: torch.dtype
    interpreting: bool
    constexprs: dict  # kda.intra_constexprs() (GATE, HAS_A_LOG, ...) and IS_VARLEN, OP_BF16, EMULATE_BF16, DOT_PREC

    B = property(lambda self: self.kda.shape.B)
    T = property(lambda self: self.kda.shape.T)
    H = property(lambda self: self.kda.shape.H)
    HV = property(lambda self: self.kda.shape.HV)
    K = property(lambda self: self.kda.shape.K)
    V = property(lambda self: self.kda.shape.V)
    N = property(lambda self: self.kda.shape.N)  # sequences
    scale = property(lambda self: self.kda.scale)
    lower_bound = property(lambda self: self.kda.kernel_lower_bound)
    safe = property(lambda self: self.kda.safe)
    state_v_first = property(lambda self: self.kda.state_v_first)


def chunk64_options(opts: KDAOptions, q: torch.Tensor, *, A_log, dt_bias, cu_seqlens, seqlens,
                    tensors: dict) -> Chunk64Options:
    """Checks what the kernels need beyond ``kdakit.chunk_kda``'s validation (``tensors``: name -> the
    token-major tensors that must be contiguous) and derives the launch configuration from ``opts``."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernels, got strides {tuple(t.stride())}")
    B, T, K, V = opts.shape.B, opts.shape.T, opts.shape.K, opts.shape.V
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels support K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}")
    if opts.gate == GATE_SOFTPLUS and A_log is None:
        raise ValueError("use_gate_in_kernel without lower_bound needs A_log, got None")
    varlen = cu_seqlens is not None
    lengths = list(seqlens) if varlen else [T] * B
    NT = sum(-(-int(n) // CHUNK) for n in lengths)
    op_bf16, prec = dot_config(q.dtype)
    interp = triton_interpreting()
    return Chunk64Options(
        kda=opts, NT=NT, NTS=triton.cdiv(T, CHUNK), BK=block_size(K), BV=block_size(V), varlen=varlen,
        stride_alog=A_log.stride(0) if opts.has_A_log else 0, stride_bias=dt_bias.stride(0) if opts.has_dt_bias else 0,
        slot_dtype=torch.float32 if q.dtype == torch.float32 else q.dtype, interpreting=interp,
        constexprs=dict(**opts.intra_constexprs(), IS_VARLEN=varlen, OP_BF16=op_bf16,
                        EMULATE_BF16=interp and q.dtype == torch.bfloat16, DOT_PREC=prec),
    )


def chunk64_tables(o: Chunk64Options, seqlens, device):
    """(pairs, firsts) of ``chunk_chunk_table`` for packed sequences, (None, None) otherwise."""
    if not o.varlen:
        return None, None
    pairs, firsts, _ = chunk_chunk_table(seqlens, CHUNK, device)
    return pairs, firsts


def run_prep(q, k, g, beta, A_log, dt_bias, cu_seqlens, pairs, o: Chunk64Options, *, do, dhs) -> dict:
    """Allocate the backward prep stage's outputs and run it (P into ``dhs``). Returns name -> tensor."""
    dev, C = q.device, CHUNK
    out = dict(tinv=torch.empty((o.B, o.T, o.HV, C), dtype=o.slot_dtype, device=dev),
               aqk=torch.empty((o.B, o.T, o.HV, C), dtype=o.slot_dtype, device=dev),
               akk=torch.empty((o.B, o.T, o.HV, C), dtype=o.slot_dtype, device=dev),
               w=torch.empty((o.B, o.T, o.HV, o.K), dtype=o.slot_dtype, device=dev),
               kd=torch.empty((o.B, o.T, o.HV, o.K), dtype=o.slot_dtype, device=dev),
               egc=torch.empty((o.NT, o.HV, o.K), dtype=torch.float32, device=dev))
    if o.NT * o.HV > 0:
        chunk_kda_prep64_kernel[(o.NT, o.HV)](
            q, k, g, beta, A_log, dt_bias, do, out["tinv"], out["w"], out["kd"], out["egc"], out["aqk"],
            out["akk"], dhs, cu_seqlens, pairs,
            o.scale, o.lower_bound, o.T, o.H, o.HV, o.NTS, o.stride_alog, o.stride_bias,
            K=o.K, V=o.V, C=C, SUBC=SUB, BK=o.BK, BV=o.BV, BKS=min(EXACT_KEY_SLICE, o.BK), SAFE=o.safe,
            **o.constexprs, num_warps=PREP_NUM_WARPS, num_stages=1,
        )
    return out
