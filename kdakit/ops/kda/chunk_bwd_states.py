"""The backward's window states from the windows' own intermediates (stages 1 and 2 when HV == H).

``chunk_bwd_windowed``'s stage 2 walks each window twice (role 0: states forward, role 1: state
gradients in reverse) and re-derives, in every dependent step, the chunk's S-independent work: gate
cumsum, Akk, its inverse, W (~255 registers a thread).

Here that work is done once per window, in parallel, by the forward's intra kernel
(``chunk_fwd.chunk_kda_fwd_intra_kernel`` in WINDOW mode), into memory that is already paid for: the
window's own rows of the gradient outputs, which stage 3 of the same window overwrites with the final
gradients afterwards (windows run last first, so no other window's rows are touched):

    W -> dq rows, qΓ -> dk rows, kd -> dg rows, U -> dv rows (token dtype, as the forward keeps them),
    Aqk -> ``[N_SUB, N * SUB, HV, C, C]`` and exp(g_C) -> ``[N_SUB, N * SUB, HV, K]`` fp32: one slot set
    per window of a checkpoint segment (set = window % N_SUB), slot n * SUB + j for chunk j of sequence n.

Stage 1 of a segment (``run_lean_window_starts``) computes the intermediates of windows 0 .. N_SUB - 2
(their rows stay untouched until each window's own stage 3) and walks them from the checkpoint,
storing the start states of windows 1 .. (as ``chunk_bwd_windowed``'s window-starts kernel, without its
per-step re-derivation); those windows' stage 2 then reuses them, and only the segment's last window
runs the intra kernel in its stage 2. Stage 2 (``run_lean_window_states``), grid (N * HV, cdiv(V, BV),
2), walks the window with the forward state kernel's products only:

    role 0, forward: store S_c;   S <- gC S + kd^T (U - W S)   (bf16 operands for bf16 inputs, as forward)
    role 1, reverse: store dS;    dV' = scale Aqk^T dO + kd dS,
                                  dS <- gC dS + scale qΓ^T dO - W^T dV'  (the same operands)

into the same ``ws_s`` / ``ws_ds`` slots stage 3 reads, and updates the carried dS. Needs HV == H: dq
and dk have H heads, the intermediates HV (GVA keeps ``chunk_bwd_windowed``'s stage 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk_bwd_common import CHUNK, state_program, state_strides
from kdakit.ops.kda.chunk_common import (
    block_size,
    dot_operand,
    load_matrix,
    load_rows,
    load_rows_native,
    round_to_bf16_if,
    store_matrix,
)
from kdakit.ops.kda.chunk_fwd import EXACT_KEY_SLICE, INTRA_NUM_WARPS, chunk_kda_fwd_intra_kernel
from kdakit.ops.kda.options import KDAOptions

# sm_90a (compile_sm90.py --only lean): 255 registers, 128 B of spills at BV = 64 and 4 warps (role 0
# alone: 192), so two programs an SM: 2 x N*HV*V/64 programs (384 at 1x8K H96) in two waves. BV = 32 is
# 212 registers without spills but twice the programs; 8 warps fit one program an SM.
LEAN_BLOCK_V = 64
LEAN_NUM_WARPS = 4


@triton.jit
def _slot(c, n, N, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr):
    """Row of chunk c of sequence n in the slot sets: set (window % N_SUB), slot n * SUB + chunk % SUB."""
    return (((c // SUB_CHUNKS) % N_SUB).to(tl.int64) * N + n) * SUB_CHUNKS + c % SUB_CHUNKS


@triton.jit
def _lean_state_step(S, c, n, N, hv, n_rows, w_b, kd_b, u_b, gc, HV, K, V, v0,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB_CHUNKS: tl.constexpr,
                     N_SUB: tl.constexpr, DOT_PREC: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """State after chunk c from the intermediates: ``gC S + kd^T (U - W S)``, S ``[BK, BV]`` fp32."""
    t0 = c * C
    cols = tl.arange(0, BK)
    wt = dot_operand(load_rows_native(w_b, t0, n_rows, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)  # [C, BK]
    kdt = dot_operand(load_rows_native(kd_b, t0, n_rows, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
    ut = load_rows(u_b, t0, n_rows, HV * V, v0, V, C, BV)  # [C, BV]
    gct = tl.load(gc + (_slot(c, n, N, SUB_CHUNKS, N_SUB) * HV + hv) * K + cols, mask=cols < K, other=0.0)  # [BK]
    vn = ut - tl.dot(wt, dot_operand(S, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)  # [C, BV]
    return tl.dot(tl.trans(kdt), dot_operand(vn, OP_BF16, EMULATE_BF16), acc=S * gct[:, None],
                  input_precision=DOT_PREC)


@triton.jit
def chunk_kda_bwd_lean_starts_kernel(
    w, kd, u, gc, ckpt, ckpt_off, cu_seqlens, ws_win, seg, N, T, HV, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """Stage 1 of segment ``seg``, grid (N * HV, cdiv(V, BV)): the start states of windows 1 .. of the
    segment into ``ws_win`` (fp32 ``[N * HV, N_SUB - 1, K, V]``), walked from its checkpoint."""
    item, v0, n, hv, bos, n_rows, n_chunks = state_program(cu_seqlens, T, HV, C, BV, IS_VARLEN)
    c0 = seg * (N_SUB * SUB_CHUNKS)
    if c0 < n_chunks:
        KV = K.to(tl.int64) * V
        n_win = (tl.minimum(n_chunks, c0 + N_SUB * SUB_CHUNKS) - c0 + SUB_CHUNKS - 1) // SUB_CHUNKS
        tok_k = bos * (HV * K) + hv * K
        u_b = u + bos * (HV * V) + hv * V
        slots = ws_win + item.to(tl.int64) * (N_SUB - 1) * KV
        S = load_matrix(ckpt + ((tl.load(ckpt_off + n) + seg) * HV + hv) * KV, V, 1, K, V, v0, BK, BV)  # [BK, BV]
        c = c0
        while c < c0 + (n_win - 1) * SUB_CHUNKS:
            S = _lean_state_step(S, c, n, N, hv, n_rows, w + tok_k, kd + tok_k, u_b, gc, HV, K, V, v0, C, BK, BV,
                                 SUB_CHUNKS, N_SUB, DOT_PREC, OP_BF16, EMULATE_BF16)
            c += 1
            if (c - c0) % SUB_CHUNKS == 0:
                store_matrix(slots + ((c - c0) // SUB_CHUNKS - 1) * KV, S, V, 1, K, V, v0, BK, BV)


@triton.jit
def chunk_kda_bwd_lean_states_kernel(
    w, qg, kd, u, aqk, gc, do, ckpt, ckpt_off, cu_seqlens, ws_win, ws_s, ws_ds, carry,
    win, N, scale, T, HV, K, V, s_c_n, s_c_h, s_c_k, s_c_v,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr,
    ROUND_STAGE: tl.constexpr,
):
    """Stage 2 of window ``win`` from its intermediates: role 0 stores every chunk's start state S_c
    into ``ws_s``, role 1 every chunk's dS after it into ``ws_ds`` and then updates ``carry``.
    ROUND_STAGE (interpreter, bf16 slots) rounds to nearest before the store, as the GPU's cast does."""
    item, v0, n, hv, bos, n_rows, n_chunks = state_program(cu_seqlens, T, HV, C, BV, IS_VARLEN)
    role = tl.program_id(2)
    d0 = win * SUB_CHUNKS
    if d0 < n_chunks:
        KV = K.to(tl.int64) * V
        d1 = tl.minimum(n_chunks, d0 + SUB_CHUNKS)
        tok_k = bos * (HV * K) + hv * K
        w_b = w + tok_k
        kd_b = kd + tok_k
        cols = tl.arange(0, BK)
        if role == 0:
            sub = win % N_SUB
            if sub == 0:
                S = load_matrix(ckpt + ((tl.load(ckpt_off + n) + win // N_SUB) * HV + hv) * KV, V, 1, K, V, v0,
                                BK, BV)  # [BK, BV]
            else:
                S = load_matrix(ws_win + (item.to(tl.int64) * (N_SUB - 1) + sub - 1) * KV, V, 1, K, V, v0, BK, BV)
            slots = ws_s + item.to(tl.int64) * SUB_CHUNKS * KV
            u_b = u + bos * (HV * V) + hv * V
            c = d0
            while c < d1:
                store_matrix(slots + (c - d0) * KV, round_to_bf16_if(S, ROUND_STAGE), V, 1, K, V, v0, BK, BV)
                S = _lean_state_step(S, c, n, N, hv, n_rows, w_b, kd_b, u_b, gc, HV, K, V, v0, C, BK, BV,
                                     SUB_CHUNKS, N_SUB, DOT_PREC, OP_BF16, EMULATE_BF16)
                c += 1
        else:
            qg_b = qg + tok_k
            do_b = do + bos * (HV * V) + hv * V
            c_ptr = carry + n.to(tl.int64) * s_c_n + hv * s_c_h
            dS = load_matrix(c_ptr, s_c_k, s_c_v, K, V, v0, BK, BV)  # [BK, BV]
            slots = ws_ds + item.to(tl.int64) * SUB_CHUNKS * KV
            c = d1 - 1
            while c >= d0:
                store_matrix(slots + (c - d0) * KV, round_to_bf16_if(dS, ROUND_STAGE), V, 1, K, V, v0, BK, BV)
                t0 = c * C
                slot = _slot(c, n, N, SUB_CHUNKS, N_SUB)
                wt = dot_operand(load_rows_native(w_b, t0, n_rows, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                kdt = dot_operand(load_rows_native(kd_b, t0, n_rows, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                qgt = dot_operand(load_rows_native(qg_b, t0, n_rows, HV * K, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                # The slot's base less t0 rows: the loads' row mask is then the sequence's.
                a_b = aqk + (slot * HV + hv) * (C * C) - t0.to(tl.int64) * C
                at = dot_operand(load_rows_native(a_b, t0, n_rows, C, 0, C, C, C), OP_BF16, EMULATE_BF16)  # [C, C]
                sdo = dot_operand(scale * load_rows(do_b, t0, n_rows, HV * V, v0, V, C, BV), OP_BF16,
                                  EMULATE_BF16)  # [C, BV]
                gct = tl.load(gc + (slot * HV + hv) * K + cols, mask=cols < K, other=0.0)  # [BK]
                dvp = tl.dot(tl.trans(at), sdo, input_precision=DOT_PREC) \
                    + tl.dot(kdt, dot_operand(dS, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)  # [C, BV]
                # Accumulated in place (acc=): one [BK, BV] fp32 tile live instead of three (255 registers
                # with 440 B of spills -> see compile_sm90.py --only lean).
                dS = tl.dot(tl.trans(qgt), sdo, acc=gct[:, None] * dS, input_precision=DOT_PREC)
                dS = tl.dot(tl.trans(wt), dot_operand(-dvp, OP_BF16, EMULATE_BF16), acc=dS,
                            input_precision=DOT_PREC)  # [BK, BV]
                c -= 1
            store_matrix(c_ptr, dS, s_c_k, s_c_v, K, V, v0, BK, BV)


def _intra(win, set_, *, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, cu, dq, dk, dv, dg, ws_aqk, ws_gc,
           N, sub, opts: KDAOptions, dummy):
    """The forward's intra kernel on window ``win``: W, qΓ, kd, U into its gradient rows, Aqk and exp(g_C)
    into slot set ``set_``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK = block_size(K)
    chunk_kda_fwd_intra_kernel[(N * sub, HV)](
        q, k, v, g, beta, A_log if opts.has_A_log else dummy, dt_bias if opts.has_dt_bias else dummy,
        dq, dk, dg, dv, ws_aqk[set_], ws_gc[set_], cu, cu, opts.kernel_lower_bound, T, H, HV,
        triton.cdiv(T, CHUNK), win,
        K=K, V=V, C=CHUNK, BK=BK, BV=block_size(V), BKS=min(EXACT_KEY_SLICE, BK), **opts.intra_constexprs(),
        SAFE=opts.safe, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(q.dtype),
        EMULATE_BF16=triton_interpreting() and q.dtype == torch.bfloat16, WINDOW=True, SUB=sub,
        num_warps=INTRA_NUM_WARPS, num_stages=1,
    )


def run_lean_window_starts(seg, last_win, *, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, ckpt, ckpt_offsets,
                           ws_win, ws_aqk, ws_gc, dq, dk, dv, dg, N, sub, n_sub, opts: KDAOptions, dummy):
    """Stage 1 of segment ``seg`` (HV == H): the intermediates of its windows before ``last_win`` (the
    segment's last window that any sequence has; its own are made in its stage 2), then the walk that
    stores the window start states."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu = cu_seqlens if cu_seqlens is not None else ckpt_offsets
    first = seg * n_sub
    for win in range(first, last_win + 1):
        if win % n_sub == n_sub - 1:
            break  # the segment's last window makes its own intermediates in stage 2
        _intra(win, win % n_sub, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
               cu=cu, dq=dq, dk=dk, dv=dv, dg=dg, ws_aqk=ws_aqk, ws_gc=ws_gc, N=N, sub=sub, opts=opts, dummy=dummy)
    BK = block_size(K)
    BV = min(LEAN_BLOCK_V, block_size(V))
    chunk_kda_bwd_lean_starts_kernel[(N * HV, triton.cdiv(V, BV))](
        dq, dg, dv, ws_gc, ckpt, ckpt_offsets, cu, ws_win, seg, N, T, HV, K, V,
        C=CHUNK, BK=BK, BV=BV, SUB_CHUNKS=sub, N_SUB=n_sub, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(q.dtype), OP_BF16=q.dtype == torch.bfloat16,
        EMULATE_BF16=triton_interpreting() and q.dtype == torch.bfloat16, num_warps=LEAN_NUM_WARPS, num_stages=1,
    )


def run_lean_window_states(win, *, q, k, v, g, beta, do, A_log, dt_bias, cu_seqlens, ckpt, ckpt_offsets,
                           ws_win, ws_s, ws_ds, ws_aqk, ws_gc, carry, dq, dk, dv, dg, N, sub, n_sub,
                           opts: KDAOptions, stage_dtype):
    """Stage 2 of window ``win`` (HV == H): the intra kernel into the window's gradient rows (unless stage
    1 made them: every window of a segment but its last), then the walk."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    interp = triton_interpreting()
    dummy = carry
    cu = cu_seqlens if cu_seqlens is not None else ckpt_offsets
    if win % n_sub == n_sub - 1:
        _intra(win, win % n_sub, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
               cu=cu, dq=dq, dk=dk, dv=dv, dg=dg, ws_aqk=ws_aqk, ws_gc=ws_gc, N=N, sub=sub, opts=opts, dummy=dummy)
    BK = block_size(K)
    BV = min(LEAN_BLOCK_V, block_size(V))
    chunk_kda_bwd_lean_states_kernel[(N * HV, triton.cdiv(V, BV), 2)](
        dq, dk, dg, dv, ws_aqk, ws_gc, do, ckpt, ckpt_offsets, cu, ws_win if ws_win is not None else dummy,
        ws_s, ws_ds, carry, win, N, opts.scale, T, HV, K, V, *state_strides(carry, opts.state_v_first),
        C=CHUNK, BK=BK, BV=BV, SUB_CHUNKS=sub, N_SUB=n_sub, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(q.dtype), OP_BF16=q.dtype == torch.bfloat16,
        EMULATE_BF16=interp and q.dtype == torch.bfloat16,
        ROUND_STAGE=interp and stage_dtype == torch.bfloat16, num_warps=LEAN_NUM_WARPS, num_stages=1,
    )
