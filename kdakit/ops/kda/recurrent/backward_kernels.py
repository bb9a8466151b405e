"""Backward kernels of recurrent KDA and their one-pass launcher (``launch_recurrent_backward``).

The math, the three passes over the tokens and the scratch memory are described in
``recurrent_backward.py``'s docstring (the public ``recurrent_kda_backward``). This module holds
the Triton kernels, ``scratch_shapes``, ``grad_outputs`` and ``KDAGrads``; it builds on
``recurrent_forward`` (the replay of pass 1 and the per-token Triton functions) and is imported
by ``recurrent_backward_segmented`` and ``recurrent_backward``, never the other way round.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import GATE_NONE, gate_log_decay_bwd, l2norm_rows, l2norm_rows_bwd, seq_bounds
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.recurrent.kernels import (
    beta_value,
    delta_rule_tile,
    key_value_offsets,
    launch_recurrent_forward,
    load_qk_token,
    log_decay,
    program_sequence,
    sequence_row,
    state_row_tile,
    state_tile,
    token_strides,
)
from kdakit.ops.kda.recurrent.workspace import Workspace, check_out

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

# V columns per recurrence program (the dq/dk/Z partials scale with cdiv(V, BWD_BLOCK_V)): 32 columns on 2 warps
# were faster than 16 or 64 (docs/perf_notes.md, "Launch configs").
BWD_BLOCK_V = 32
BWD_NUM_WARPS = 2
REDUCE_BLOCK_T = 16     # tokens per block in the token-parallel reductions
REDUCE_NUM_WARPS = 4

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")


class KDAGrads(NamedTuple):
    """Gradients of recurrent KDA w.r.t. its raw inputs (None where the input is absent)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None
    dh0: torch.Tensor | None


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def load_token(p_q, p_k, p_g, p_b, j, s_qt, s_kt, s_gt, s_bt, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound,
               K: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
               BETA: tl.constexpr):
    """Token j of the sequence (``sequence_row``'s rows ``p_*``, token strides ``s_*t``): its q, k [BK]
    (l2-normalized when asked), log-decay a [BK] and beta, as both token passes read them (in place, where the
    forward requests them one token ahead). -> (q, k, a, beta)"""
    b_q = load_qk_token(p_q + j * s_qt, offs_k, mask_k, L2NORM)                           # [BK]
    b_k = load_qk_token(p_k + j * s_kt, offs_k, mask_k, L2NORM)                           # [BK]
    b_g = tl.load(p_g + j * s_gt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_a = log_decay(b_g, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound, K, GATE, HAS_A, HAS_BIAS)
    b_beta = beta_value(tl.load(p_b + j * s_bt).to(tl.float32), BETA)
    return b_q, b_k, b_a, b_beta


@triton.jit(do_not_specialize=["T", "TT", "s_bb"])  # s_bb: as recurrent_forward._recurrent_kernel's
def _recurrent_bwd_reverse_kernel(
    q, k, g, beta, A_log, dt_bias, do, dht, ud, dv, dh0, x_part, cu_seqlens,
    scale, lower_bound, T, TT,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_db, s_dt, s_dh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    """Pass 2: dS backwards through the tokens. Reads u_t from ``ud`` and overwrites it with du_t."""
    i_n, i_hv, i_h, i_v, bos, eos = program_sequence(cu_seqlens, T, H, HV, IS_VARLEN)
    offs_k, offs_v, mask_k, mask_v = key_value_offsets(i_v, K, V, BK, BV)
    mask_s, state_base, offs_s = state_tile(i_n, i_hv, offs_k, offs_v, mask_k, mask_v, HV, K, V, STATE_V_FIRST)
    p_q = sequence_row(q, i_n, bos, i_h, s_qb, s_qt, s_qh, IS_VARLEN)
    p_k = sequence_row(k, i_n, bos, i_h, s_kb, s_kt, s_kh, IS_VARLEN)
    p_g = sequence_row(g, i_n, bos, i_hv, s_gb, s_gt, s_gh, IS_VARLEN)
    p_b = sequence_row(beta, i_n, bos, i_hv, s_bb, s_bt, s_bh, IS_VARLEN)
    p_do = sequence_row(do, i_n, bos, i_hv, s_db, s_dt, s_dh, IS_VARLEN)

    dS = tl.zeros([BK, BV], dtype=tl.float32)                                             # [BK, BV]
    if HAS_DHT:
        dS += tl.load(dht + state_base + offs_s, mask=mask_s, other=0.0).to(tl.float32)

    # while loops: the interpreter cannot take range() of a program-dependent bound.
    t = eos - 1
    while t >= bos:
        hv_row = t * HV + i_hv
        j = t - bos
        b_q, b_k, b_a, b_beta = load_token(p_q, p_k, p_g, p_b, j, s_qt, s_kt, s_gt, s_bt, A_log, dt_bias, i_hv,
                                           offs_k, mask_k, lower_bound, K, L2NORM, GATE, HAS_A, HAS_BIAS, BETA)
        b_do = tl.load(p_do + j * s_dt + offs_v, mask=mask_v, other=0.0).to(tl.float32)   # [BV]
        b_u = tl.load(ud + hv_row * V + offs_v, mask=mask_v, other=0.0)                   # [BV] fp32

        dS += (scale * b_q)[:, None] * b_do[None, :]
        b_du = tl.sum(dS * b_k[:, None], axis=0)                                          # [BV]
        b_x = tl.sum(dS * b_u[None, :], axis=1)                                           # [BK]
        tl.store(x_part + ((i_v * TT + t) * HV + i_hv) * K + offs_k, b_x, mask=mask_k)
        tl.store(dv + hv_row * V + offs_v, (b_beta * b_du).to(dv.dtype.element_ty), mask=mask_v)
        tl.store(ud + hv_row * V + offs_v, b_du, mask=mask_v)
        dS = (dS - (b_beta * b_k)[:, None] * b_du[None, :]) * tl.exp(b_a)[:, None]
        t -= 1

    if STORE_DH0:
        tl.store(dh0 + state_base + offs_s, dS.to(dh0.dtype.element_ty), mask=mask_s)


@triton.jit(do_not_specialize=["T", "TT", "s_bb"])
def _recurrent_bwd_replay_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, do, dht, ud, dq_part, dk_part, z_part, dbeta_part, term_part,
    cu_seqlens, scale, lower_bound, T, TT,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_db, s_dt, s_dh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    """Pass 3: the forward again, with du_t and X_t from pass 2; V-block partials of dq, dk, Z, dbeta.

    The state is the recurrence kernel's S^T tile [BV, BK] stepped by its own ``delta_rule_tile``, so a replay
    from a checkpoint the forward wrote (the segmented backward) continues with the forward's bits."""
    i_n, i_hv, i_h, i_v, bos, eos = program_sequence(cu_seqlens, T, H, HV, IS_VARLEN)
    offs_k, offs_v, mask_k, mask_v = key_value_offsets(i_v, K, V, BK, BV)
    mask_s = mask_v[:, None] & mask_k[None, :]                                            # [BV, BK]
    offs_s = (i_n * HV).to(tl.int64) * K * V + state_row_tile(i_hv, offs_k, offs_v, HV, K, V, STATE_V_FIRST)
    p_q = sequence_row(q, i_n, bos, i_h, s_qb, s_qt, s_qh, IS_VARLEN)
    p_k = sequence_row(k, i_n, bos, i_h, s_kb, s_kt, s_kh, IS_VARLEN)
    p_v = sequence_row(v, i_n, bos, i_hv, s_vb, s_vt, s_vh, IS_VARLEN)
    p_g = sequence_row(g, i_n, bos, i_hv, s_gb, s_gt, s_gh, IS_VARLEN)
    p_b = sequence_row(beta, i_n, bos, i_hv, s_bb, s_bt, s_bh, IS_VARLEN)
    p_do = sequence_row(do, i_n, bos, i_hv, s_db, s_dt, s_dh, IS_VARLEN)

    S = tl.zeros([BV, BK], dtype=tl.float32)                                              # S^T tile
    if USE_H0:
        S += tl.load(h0 + offs_s, mask=mask_s, other=0.0).to(tl.float32)

    t = bos
    while t < eos:
        hv_row = t * HV + i_hv
        part_row = ((i_v * TT + t) * HV + i_hv) * K
        j = t - bos
        b_q, b_k, b_a, b_beta = load_token(p_q, p_k, p_g, p_b, j, s_qt, s_kt, s_gt, s_bt, A_log, dt_bias, i_hv,
                                           offs_k, mask_k, lower_bound, K, L2NORM, GATE, HAS_A, HAS_BIAS, BETA)
        b_v = tl.load(p_v + j * s_vt + offs_v, mask=mask_v, other=0.0).to(tl.float32)     # [BV]
        b_do = tl.load(p_do + j * s_dt + offs_v, mask=mask_v, other=0.0).to(tl.float32)   # [BV]
        b_du = tl.load(ud + hv_row * V + offs_v, mask=mask_v, other=0.0)                  # [BV]
        b_x = tl.load(dk_part + part_row + offs_k, mask=mask_k, other=0.0)                # [BK] X_t

        S_dec, S, b_r, _ = delta_rule_tile(S, b_k, b_v, b_a, b_beta)                      # S', S, v - S' k
        b_y = b_beta * tl.sum(S_dec * b_du[:, None], axis=0)                              # [BK]
        b_dbeta = tl.sum(b_du * b_r, axis=0)
        b_dq = scale * tl.sum(S * b_do[:, None], axis=0)                                  # [BK]

        tl.store(dq_part + part_row + offs_k, b_dq, mask=mask_k)
        tl.store(dk_part + part_row + offs_k, b_x - b_y, mask=mask_k)
        tl.store(z_part + part_row + offs_k, b_q * b_dq - b_k * (b_x + b_y), mask=mask_k)
        tl.store(dbeta_part + i_v * TT * HV + hv_row, b_dbeta)
        t += 1

    if HAS_DHT:
        b_dht = tl.load(dht + offs_s, mask=mask_s, other=0.0).to(tl.float32)
        tl.store(term_part + ((i_v * (tl.num_programs(0) // HV) + i_n) * HV + i_hv) * K + offs_k,
                 tl.sum(b_dht * S, axis=0), mask=mask_k)


@triton.jit(do_not_specialize=["T", "TT", "s_bb"])
def _recurrent_bwd_gate_kernel(
    g, beta, A_log, dt_bias, z_part, dbeta_part, term_part, dg, dbeta, dA_part, dbias_part, cu_seqlens,
    lower_bound, T, TT, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    NV: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    """da = reverse cumsum of Z (plus rowsum(dht * S_T)), then the gate and beta backward."""
    i_nh = tl.program_id(0)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    p_g0 = sequence_row(g, i_n, bos, i_hv, s_gb, s_gt, s_gh, IS_VARLEN)
    p_b0 = sequence_row(beta, i_n, bos, i_hv, s_bb, s_bt, s_bh, IS_VARLEN)

    carry = tl.zeros([BK], dtype=tl.float32)                                              # da_{t+1}
    if HAS_DHT:
        for i_v in tl.static_range(NV):
            carry += tl.load(term_part + ((i_v * (tl.num_programs(0) // HV) + i_n) * HV + i_hv) * K + offs_k,
                             mask=mask_k, other=0.0)
    if HAS_A:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        b_A = 1.0
    dA_acc = tl.zeros([BK], dtype=tl.float32)
    dbias_acc = tl.zeros([BK], dtype=tl.float32)

    end = eos
    while end > bos:
        rows = end - BT + tl.arange(0, BT)                                                # [BT]
        mask_t = rows >= bos
        mask_tk = mask_t[:, None] & mask_k[None, :]
        z = tl.zeros([BT, BK], dtype=tl.float32)
        db = tl.zeros([BT], dtype=tl.float32)
        for i_v in tl.static_range(NV):
            z += tl.load(z_part + ((i_v * TT + rows[:, None]) * HV + i_hv) * K + offs_k[None, :],
                         mask=mask_tk, other=0.0)
            db += tl.load(dbeta_part + (i_v * TT + rows) * HV + i_hv, mask=mask_t, other=0.0)
        da = tl.cumsum(z, axis=0, reverse=True) + carry[None, :]                          # [BT, BK]
        carry += tl.sum(z, axis=0)

        p_g = p_g0 + (rows - bos)[:, None] * s_gt + offs_k[None, :]
        if GATE == 0:
            b_dg = da
        else:
            b_graw = tl.load(p_g, mask=mask_tk, other=0.0).to(tl.float32)
            x = b_graw
            if HAS_BIAS:
                x = x + tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            # the chunk kernels' gate backward: dg (= the ddt_bias term) and the dA_log element terms
            b_dg, dlog = gate_log_decay_bwd(da, x, b_A, lower_bound, GATE)
            dA_acc += tl.sum(tl.where(mask_tk, dlog, 0.0), axis=0)
            dbias_acc += tl.sum(tl.where(mask_tk, b_dg, 0.0), axis=0)
        tl.store(dg + (rows[:, None] * HV + i_hv) * K + offs_k[None, :], b_dg.to(dg.dtype.element_ty), mask=mask_tk)

        p_beta = p_b0 + (rows - bos) * s_bt
        if BETA == 0:
            b_db = db
        else:
            s_b = tl.sigmoid(tl.load(p_beta, mask=mask_t, other=0.0).to(tl.float32))
            b_db = db * s_b * (1.0 - s_b)
            if BETA == 2:
                b_db = 2.0 * b_db
        tl.store(dbeta + rows * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=mask_t)
        end -= BT

    if GATE != 0:
        tl.store(dA_part + i_nh, tl.sum(dA_acc, axis=0))
        tl.store(dbias_part + i_nh.to(tl.int64) * K + offs_k, dbias_acc, mask=mask_k)


@triton.jit(do_not_specialize=["T", "TT"])
def _recurrent_bwd_qk_kernel(
    q, k, dq_part, dk_part, dq, dk, T, TT, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
    NV: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """dq, dk of a block of tokens and one q/k head: sum V-blocks and value heads, l2norm backward."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    G: tl.constexpr = HV // H
    rows = (i_t * BT + tl.arange(0, BT)).to(tl.int64)                                    # [BT]
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    mask = (rows < TT)[:, None] & mask_k[None, :]                                         # [BT, BK]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in tl.static_range(NV):
        for j in tl.static_range(G):
            p = ((i_v * TT + rows[:, None]) * HV + i_h * G + j) * K + offs_k[None, :]
            b_dq += tl.load(dq_part + p, mask=mask, other=0.0)
            b_dk += tl.load(dk_part + p, mask=mask, other=0.0)
    p_x = (rows[:, None] * H + i_h) * K + offs_k[None, :]
    if L2NORM:
        # y = x r with the forward's r (qk_activation's l2norm_rstd), then dx = r (dy - y (dy . y)); q and k through
        # their strides: flat token row = b * T + t (packed: b = 0); an int32 division (rows < B * T < 2^31), whose
        # int64 form would hold over twice the registers
        flat = i_t * BT + tl.arange(0, BT)
        b = (flat // T).to(tl.int64)
        t = rows - b * T
        p_q = q + (b * s_qb + t * s_qt + i_h.to(tl.int64) * s_qh)[:, None] + offs_k[None, :]
        p_k = k + (b * s_kb + t * s_kt + i_h.to(tl.int64) * s_kh)[:, None] + offs_k[None, :]
        y_q, r_q = l2norm_rows(tl.load(p_q, mask=mask, other=0.0).to(tl.float32))            # [BT, BK], [BT]
        b_dq = l2norm_rows_bwd(b_dq, y_q, r_q)
        y_k, r_k = l2norm_rows(tl.load(p_k, mask=mask, other=0.0).to(tl.float32))
        b_dk = l2norm_rows_bwd(b_dk, y_k, r_k)
    tl.store(dq + p_x, b_dq.to(dq.dtype.element_ty), mask=mask)
    tl.store(dk + p_x, b_dk.to(dk.dtype.element_ty), mask=mask)


@triton.jit
def _recurrent_bwd_param_kernel(
    dA_part, dbias_part, dA_log, ddt_bias, N,
    HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """dA_log[hv] and dt_bias[hv, :]: sums over sequences of the per-sequence partials, in order."""
    i_hv = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    acc_a = tl.zeros([1], dtype=tl.float32)
    acc_b = tl.zeros([BK], dtype=tl.float32)
    n = 0
    while n < N:
        acc_a += tl.load(dA_part + n * HV + i_hv + tl.arange(0, 1))
        acc_b += tl.load(dbias_part + (n * HV + i_hv) * K + offs_k, mask=mask_k, other=0.0)
        n += 1
    if HAS_A:
        tl.store(dA_log + i_hv + tl.arange(0, 1), acc_a.to(dA_log.dtype.element_ty))
    if HAS_BIAS:
        tl.store(ddt_bias + i_hv * K + offs_k, acc_b.to(ddt_bias.dtype.element_ty), mask=mask_k)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def scratch_shapes(B: int, T: int, HV: int, K: int, V: int, N: int) -> dict:
    """Name -> (shape, dtype) of the backward's scratch buffers (all fp32)."""
    NV = triton.cdiv(V, min(triton.next_power_of_2(V), BWD_BLOCK_V))
    TT = B * T
    f = torch.float32
    return {
        "ud": ((TT, HV, V), f),
        "dq_part": ((NV, TT, HV, K), f),
        "dk_part": ((NV, TT, HV, K), f),
        "z_part": ((NV, TT, HV, K), f),
        "dbeta_part": ((NV, TT, HV), f),
        "term_part": ((NV, N, HV, K), f),
        "dA_part": ((N, HV), f),
        "dbias_part": ((N, HV, K), f),
    }


def launch_recurrent_backward(
    q, k, v, g, beta, do, dht, *, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions,
    workspace: Workspace, out=None,
) -> KDAGrads:
    """Run the five backward kernels. ``A_log``/``dt_bias`` are None unless the gate is in the kernel;
    ``cu_seqlens`` is the launch's own (a segment's, from the segmented driver)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    TT = B * T
    # the kernels read do through its strides; autograd may hand over an expanded one (stride 0 everywhere, from
    # a reduction such as o.sum()), whose last dimension is materialized
    if do.shape[-1] > 1 and do.stride(-1) != 1:
        do = do.contiguous()
    if dht is not None and not dht.is_contiguous():
        dht = dht.contiguous()

    grads = grad_outputs(q, k, v, g, beta, A_log, dt_bias, initial_state, out)
    shapes = scratch_shapes(B, T, HV, K, V, N)
    buf = {name: workspace.buffer("recurrent_bwd." + name, shp, dt) for name, (shp, dt) in shapes.items()}

    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), BWD_BLOCK_V)
    NV = triton.cdiv(V, BV)
    scale, lb = opts.scale, opts.kernel_lower_bound
    dummy = buf["ud"]
    A = A_log if A_log is not None else dummy
    bias = dt_bias if dt_bias is not None else dummy
    cu = cu_seqlens if cu_seqlens is not None else dummy
    passes = dict(IS_VARLEN=cu_seqlens is not None, **opts.recurrent_constexprs())  # the two token passes
    grid = (N * HV, NV)

    # 1. replay: u_t
    launch_recurrent_forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                             cu_seqlens=cu_seqlens, N=N, opts=opts, u=buf["ud"], block_v=BV)
    # 2. reverse: dv, du_t, X_t, dh0
    _recurrent_bwd_reverse_kernel[grid](
        q, k, g, beta, A, bias, do, dht if dht is not None else dummy, buf["ud"], grads.dv,
        grads.dh0 if grads.dh0 is not None else dummy, buf["dk_part"], cu,
        scale, lb, T, TT, *token_strides(q), *token_strides(k), *token_strides(g), *token_strides(beta),
        *token_strides(do), H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        HAS_DHT=dht is not None, STORE_DH0=grads.dh0 is not None, **passes, num_warps=BWD_NUM_WARPS,
    )
    # 3. replay with adjoint terms: partial dq, dk, Z, dbeta, rowsum(dht * S_T)
    _recurrent_bwd_replay_kernel[grid](
        q, k, v, g, beta, A, bias, initial_state if initial_state is not None else dummy, do,
        dht if dht is not None else dummy, buf["ud"], buf["dq_part"], buf["dk_part"], buf["z_part"],
        buf["dbeta_part"], buf["term_part"], cu, scale, lb, T, TT, *token_strides(q), *token_strides(k),
        *token_strides(v), *token_strides(g), *token_strides(beta), *token_strides(do),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_H0=initial_state is not None, HAS_DHT=dht is not None,
        **passes, num_warps=BWD_NUM_WARPS,
    )
    # 4. dq, dk (token-parallel)
    _recurrent_bwd_qk_kernel[(triton.cdiv(TT, REDUCE_BLOCK_T), H)](
        q, k, buf["dq_part"], buf["dk_part"], grads.dq, grads.dk, T, TT, *token_strides(q), *token_strides(k),
        NV=NV, H=H, HV=HV, K=K, BK=BK, BT=REDUCE_BLOCK_T, L2NORM=opts.use_qk_l2norm_in_kernel,
        num_warps=REDUCE_NUM_WARPS,
    )
    # 5. dg, dbeta and per-sequence parameter partials
    _recurrent_bwd_gate_kernel[(N * HV,)](
        g, beta, A, bias, buf["z_part"], buf["dbeta_part"], buf["term_part"], grads.dg, grads.dbeta,
        buf["dA_part"], buf["dbias_part"], cu, lb, T, TT, *token_strides(g), *token_strides(beta),
        NV=NV, HV=HV, K=K, BK=BK, BT=REDUCE_BLOCK_T, HAS_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
        GATE=opts.gate, HAS_A=opts.has_A_log, HAS_BIAS=opts.has_dt_bias, BETA=opts.beta, num_warps=REDUCE_NUM_WARPS,
    )
    # 6. dA_log, ddt_bias
    if opts.gate != GATE_NONE and (grads.dA_log is not None or grads.ddt_bias is not None):
        _recurrent_bwd_param_kernel[(HV,)](
            buf["dA_part"], buf["dbias_part"], grads.dA_log if A_log is not None else dummy,
            grads.ddt_bias if dt_bias is not None else dummy, N,
            HV=HV, K=K, BK=BK, HAS_A=opts.has_A_log, HAS_BIAS=opts.has_dt_bias, num_warps=1,
        )
    return grads


def _new_grad(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous tensor of x's shape and dtype (x itself may be a strided view): the kernels write dense
    gradients."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def grad_outputs(q, k, v, g, beta, A_log, dt_bias, initial_state, out) -> KDAGrads:
    """The eight gradient tensors: the caller's (``out``, checked: contiguous) or new contiguous ones."""
    like = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    if out is None:
        return KDAGrads(*(None if x is None else _new_grad(x) for x in like))
    if not isinstance(out, (tuple, list)) or len(out) != 8:
        raise ValueError(f"out must be a sequence of 8 gradient tensors {GRAD_NAMES}, got {type(out).__name__}"
                         + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    res = []
    for name, x, o in zip(GRAD_NAMES, like, out):
        if x is None:
            if o is not None:
                raise ValueError(f"out[{GRAD_NAMES.index(name)}] ({name}) must be None: its input is absent")
            res.append(None)
        elif o is None:
            res.append(_new_grad(x))
        else:
            res.append(check_out(f"out[{GRAD_NAMES.index(name)}] ({name})", o, x.shape, x.dtype, x.device))
    return KDAGrads(*res)
