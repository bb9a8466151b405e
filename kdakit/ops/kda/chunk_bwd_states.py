"""The backward's window states from the window's own intermediates (stage 2 when HV == H).

``chunk_bwd_windowed``'s stage 2 walks each window twice (role 0: states forward, role 1: state
gradients in reverse) and re-derives, in every dependent step, the chunk's S-independent work: gate
cumsum, Akk, its inverse, W (~255 registers a thread). Measured at 1x8K H96 (H200): 10.0 ms of 27.8.

Here that work is done once per window, in parallel, by the forward's intra kernel
(``chunk_fwd.chunk_kda_fwd_intra_kernel`` in WINDOW mode), into memory that is already paid for: the
window's own rows of the gradient outputs, which stage 3 of the same window overwrites with the final
gradients afterwards (windows run last first, so no other window's rows are touched):

    W -> dq rows, qΓ -> dk rows, kd -> dg rows, U -> dv rows (token dtype, as the forward keeps them),
    Aqk -> ``[N * SUB, HV, C, C]`` and exp(g_C) -> ``[N * SUB, HV, K]`` fp32 (per-window slots).

Then one launch, grid (N * HV, cdiv(V, BV), 2), walks the window with the forward state kernel's
products only:

    role 0, forward: store S_c;   S <- gC S + kd^T (U - W S)   (bf16 operands for bf16 inputs, as forward)
    role 1, reverse: store dS;    dV' = scale Aqk^T dO + kd dS,
                                  dS <- gC dS + scale qΓ^T dO - W^T dV'  (the same operands)

into the same ``ws_s`` / ``ws_ds`` slots stage 3 reads, and updates the carried dS. Needs HV == H: dq
and dk have H heads, the intermediates HV (GVA keeps ``chunk_bwd_windowed``'s stage 2).

Floors per window at 1x8K H96 (32 windows): intra ~1.8 ms in all (the forward's intra kernel on the
same chunks), the walk ~2 x 16 dependent steps of 2-3 [16, 128] x [128, 64] products, like the forward
state kernel (0.93 ms for 512 steps). Prediction: stage 2 from 10.0 ms to ~3-4 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_bwd_common import CHUNK, interpreting, state_strides
from kdakit.ops.kda.chunk_common import (
    block_size,
    load_matrix,
    load_rows,
    load_rows_native,
    round_to_bf16_if,
    seq_bounds,
    store_matrix,
)
from kdakit.ops.kda.chunk_fwd import EXACT_KEY_SLICE, INTRA_NUM_WARPS, _dot_precision, chunk_kda_fwd_intra_kernel
from kdakit.ops.kda.chunk_tiles import dot_operand

# sm_90a (compile_sm90.py --only lean): 255 registers, 128 B of spills at BV = 64 and 4 warps (role 0
# alone: 192), so two programs an SM: 2 x N*HV*V/64 programs (384 at 1x8K H96) in two waves. BV = 32 is
# 212 registers without spills but twice the programs; 8 warps fit one program an SM.
LEAN_BLOCK_V = 64
LEAN_NUM_WARPS = 4


@triton.jit
def chunk_kda_bwd_lean_states_kernel(
    w, qg, kd, u, aqk, gc, do, ckpt, ckpt_off, cu_seqlens, ws_win, ws_s, ws_ds, carry,
    win, scale, T, HV, K, V, s_c_n, s_c_h, s_c_k, s_c_v,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr,
    ROUND_STAGE: tl.constexpr,
):
    """Stage 2 of window ``win`` from its intermediates: role 0 stores every chunk's start state S_c
    into ``ws_s``, role 1 every chunk's dS after it into ``ws_ds`` and then updates ``carry``.
    ROUND_STAGE (interpreter, bf16 slots) rounds to nearest before the store, as the GPU's cast does."""
    item = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    role = tl.program_id(2)
    n = item // HV
    hv = item % HV
    bos, eos = seq_bounds(cu_seqlens, n, T, IS_VARLEN)
    n_rows = (eos - bos).to(tl.int32)
    n_chunks = (n_rows + C - 1) // C
    d0 = win * SUB_CHUNKS
    if d0 < n_chunks:
        KV = K.to(tl.int64) * V
        d1 = tl.minimum(n_chunks, d0 + SUB_CHUNKS)
        row_k = HV * K
        tok_k = bos * row_k + hv * K
        w_b = w + tok_k
        kd_b = kd + tok_k
        slot0 = n.to(tl.int64) * SUB_CHUNKS  # window slot of chunk d0
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
                t0 = c * C
                wt = dot_operand(load_rows_native(w_b, t0, n_rows, row_k, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                kdt = dot_operand(load_rows_native(kd_b, t0, n_rows, row_k, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                ut = load_rows(u_b, t0, n_rows, HV * V, v0, V, C, BV)  # [C, BV]
                gct = tl.load(gc + ((slot0 + c - d0) * HV + hv) * K + cols, mask=cols < K, other=0.0)  # [BK]
                vn = ut - tl.dot(wt, dot_operand(S, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)  # [C, BV]
                S = tl.dot(tl.trans(kdt), dot_operand(vn, OP_BF16, EMULATE_BF16), acc=S * gct[:, None],
                           input_precision=DOT_PREC)
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
                wt = dot_operand(load_rows_native(w_b, t0, n_rows, row_k, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                kdt = dot_operand(load_rows_native(kd_b, t0, n_rows, row_k, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                qgt = dot_operand(load_rows_native(qg_b, t0, n_rows, row_k, 0, K, C, BK), OP_BF16, EMULATE_BF16)
                # The slot's base less t0 rows: the loads' row mask is then the sequence's.
                a_b = aqk + ((slot0 + c - d0) * HV + hv) * (C * C) - t0.to(tl.int64) * C
                at = dot_operand(load_rows_native(a_b, t0, n_rows, C, 0, C, C, C), OP_BF16, EMULATE_BF16)  # [C, C]
                sdo = dot_operand(scale * load_rows(do_b, t0, n_rows, HV * V, v0, V, C, BV), OP_BF16,
                                  EMULATE_BF16)  # [C, BV]
                gct = tl.load(gc + ((slot0 + c - d0) * HV + hv) * K + cols, mask=cols < K, other=0.0)  # [BK]
                dvp = tl.dot(tl.trans(at), sdo, input_precision=DOT_PREC) \
                    + tl.dot(kdt, dot_operand(dS, OP_BF16, EMULATE_BF16), input_precision=DOT_PREC)  # [C, BV]
                # Accumulated in place (acc=): one [BK, BV] fp32 tile live instead of three (255 registers
                # with 440 B of spills -> see compile_sm90.py --only lean).
                dS = tl.dot(tl.trans(qgt), sdo, acc=gct[:, None] * dS, input_precision=DOT_PREC)
                dS = tl.dot(tl.trans(wt), dot_operand(-dvp, OP_BF16, EMULATE_BF16), acc=dS,
                            input_precision=DOT_PREC)  # [BK, BV]
                c -= 1
            store_matrix(c_ptr, dS, s_c_k, s_c_v, K, V, v0, BK, BV)


def run_lean_window_states(win, *, q, k, v, g, beta, do, A_log, dt_bias, cu_seqlens, ckpt, ckpt_offsets,
                           ws_win, ws_s, ws_ds, ws_aqk, ws_gc, carry, dq, dk, dv, dg, scale, lower_bound,
                           state_v_first, N, sub, n_sub, consts, stage_dtype):
    """Stage 2 of window ``win`` (HV == H): the intra kernel into the window's gradient rows, then the walk."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C, interp = CHUNK, interpreting()
    BK, BVI = block_size(K), block_size(V)
    dummy = carry
    cu = cu_seqlens if cu_seqlens is not None else ckpt_offsets
    emulate = interp and q.dtype == torch.bfloat16
    chunk_kda_fwd_intra_kernel[(N * sub, HV)](
        q, k, v, g, beta, A_log if consts["HAS_A"] else dummy, dt_bias if consts["HAS_BIAS"] else dummy,
        dq, dk, dg, dv, ws_aqk, ws_gc, cu, cu, lower_bound, T, H, HV, triton.cdiv(T, C), win,
        K=K, V=V, C=C, BK=BK, BV=BVI, BKS=min(EXACT_KEY_SLICE, BK), GATE=consts["GATE"],
        HAS_A_LOG=consts["HAS_A"], HAS_BIAS=consts["HAS_BIAS"], USE_L2NORM=consts["L2NORM"],
        BETA_SIGMOID=consts["BETA_SIGMOID"], NEG_EIGVAL=consts["NEG_EIGVAL"], SAFE=consts["SAFE"],
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=_dot_precision(q.dtype), EMULATE_BF16=emulate,
        WINDOW=True, SUB=sub, num_warps=INTRA_NUM_WARPS, num_stages=1,
    )
    BV = min(LEAN_BLOCK_V, BVI)
    chunk_kda_bwd_lean_states_kernel[(N * HV, triton.cdiv(V, BV), 2)](
        dq, dk, dg, dv, ws_aqk, ws_gc, do, ckpt, ckpt_offsets, cu, ws_win if ws_win is not None else dummy,
        ws_s, ws_ds, carry, win, scale, T, HV, K, V, *state_strides(carry, state_v_first),
        C=C, BK=BK, BV=BV, SUB_CHUNKS=sub, N_SUB=n_sub, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=_dot_precision(q.dtype), OP_BF16=q.dtype == torch.bfloat16, EMULATE_BF16=emulate,
        ROUND_STAGE=interp and stage_dtype == torch.bfloat16, num_warps=LEAN_NUM_WARPS, num_stages=1,
    )
