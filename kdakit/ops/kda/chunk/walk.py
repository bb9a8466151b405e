"""The state walks of the 64-token chunk pipeline and the per-chunk dAv products (docs/chunk_pipeline.md).

Per chunk of L <= 64 tokens and value head (fp32 math; S, dS the state and its gradient, [K, V], K-major):

    forward   V' = U - W S                     (stored over U in the ``u`` slot)
              O  = scale qg S + Aqk V'          (the ``aqk`` slot already holds the scale)
              S  = exp(g_C) ⊙_rows S + kd^T V'
    dAv       dAqk = dO V'^T (j <= i, 0 above)   dvs = Aqk^T dO
    backward  dV' = dvs + kd dS                 (stored over dvs; dS = the gradient leaving the chunk)
              dS  = exp(g_C) ⊙_rows dS + scale qg^T dO - W^T dV'

Kernels:

* ``chunk_walk_fwd_kernel``, grid ``(N * HV, cdiv(V, BV))``: one sequence, value head and value block walks the
  sequence's chunks in n_win consecutive windows (window i: slots ``seq_rows[i, n, 0] - row0`` on, for
  ``seq_rows[i, n, 1]`` chunks, in order) with S ``[K, BV]`` in fp32 registers, read from ``carry[n, hv]`` at the
  start and written back at the end (STORE_CARRY; the backward's recompute starts from a checkpoint and keeps
  it); S entering each window goes into ``ckpt[i, n, hv]`` (STORE_CKPT: the recomputing forward's
  checkpoints); per chunk it stores S (the state entering the chunk) into the ``h`` slot and V' over ``u``
  (STORE_STATES: for a backward; the recomputing forward stores neither), and O into the ``o`` token tensor
  (rows < L, when STORE_O).
* ``chunk_walk_bwd_kernel``, same grid, one window's chunks in reverse (slots ``seq_rows[n, 0] - row0`` on),
  dS from and back into the carry; per chunk it stores dS into the ``dh`` slot and dV' over ``dvs``.
* ``chunk_dav_kernel``, grid ``(n, HV)``: one chunk and value head, a loop over value blocks; dAqk into the
  fp32 ``daqk`` slot, Aqk^T dO into the fp32 ``dvs`` slot.

Layouts: slot tensors are contiguous and indexed by the window's slot (= table row) s: w, qg, kd ``[n, HV, C, K]``,
u ``[n, HV, C, V]``, gc ``[n, HV, C, K]`` fp32, h, dh ``[n, HV, K, V]``
(token dtype), dvs ``[n, HV, C, V]`` and daqk ``[n, HV, C, C]`` fp32; carry ``[N, HV, K, V]`` fp32. o and do
``[B, T, HV, V]`` are read through their strides at the table row's ``(b, t0)``, and so is aqk ``[B, T, HV, C]``
(token dtype, token layout: row r of a chunk's Aqk at its token t0 + r, rows < L; ``tiles.check_pairs``).

Padded rows (r >= L) of the slots are never read: the row-indexed tiles load as 0 there, aqk loads with its
upper triangle masked, and g_C is the gc row L - 1. So V' (over u), dvs, dV' and daqk hold 0 on padded rows.

Limits: K, V <= 128. Operands of ``tl.dot`` are bf16 for 16-bit token dtypes (the interpreter rounds them in
fp32 instead: its bf16 casts truncate and its bf16 dots are wrong), fp32 with ``dot_precision`` otherwise. The
fp32 builds (3xTF32 products of [64, 128] fp32 operands) exceed the register file at these configs and spill;
they would need the K dimension split in 64-wide halves.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import dot_precision, triton_interpreting
from kdakit.ops.kda.chunk.tiles import (
    CHUNK,
    as_stored,
    check_pairs,
    check_slot,
    check_token_strides,
    chunk_row,
    dot_operand,
    launch_values,
    token_base,
)
from kdakit.ops.kda.chunk_common import block_size
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions

# ---- launch configs, by operand kind: "bf16" (16-bit inputs, bf16 dot operands) or "fp32" (3xTF32 operands)
# The walks split V across programs; the forward walk prefetches the next chunk's operands (two stages), the
# backward's two stages would need about twice the shared memory of two programs per SM, so it runs one.
# fp32 operands do not fit the register file at any block tried (V blocks 16-64, one or two stages; K is not split):
# every fp32 walk keeps a spill, the least at 16-wide V blocks and one stage (sm_90a ptxas, K = V = 128), within
# WALK_SPILL_BUDGET, which the build test checks. Their speed has not been measured.
# The V block of a walk is the widest candidate whose grid (sequences x value heads x V blocks) still gives every SM a
# program: a walk is one serial chain of chunks per program, so with few (sequence, head) pairs (one sequence of 16
# heads, the layer's shape) narrower blocks buy parallelism, while with many pairs wider blocks load W, qg, kd and
# the gate fewer times per state element.
WALK_FWD_WARPS = 4
WALK_FWD_STAGES = {"bf16": 2, "fp32": 1}
WALK_FWD_BLOCK_V = {"bf16": (64, 32, 16), "fp32": (16,)}  # candidates, widest first
WALK_BWD_WARPS = 4
WALK_BWD_STAGES = 1
WALK_BWD_BLOCK_V = {"bf16": (32, 16), "fp32": (16,)}
DAV_WARPS = 4
DAV_STAGES = 1
DAV_BLOCK_V = {"bf16": 128, "fp32": 32}
# the constants above that a tuning run may override by name (``chunk.launch.Launch``, ``tiles.launch_values``)
LAUNCH_CONSTANTS = ("WALK_FWD_WARPS", "WALK_FWD_STAGES", "WALK_FWD_BLOCK_V", "WALK_BWD_WARPS", "WALK_BWD_STAGES",
                    "WALK_BWD_BLOCK_V", "DAV_WARPS", "DAV_STAGES", "DAV_BLOCK_V")
# bytes of spill stores + loads per kernel. bf16: the forward walk that stores states and o (the fast workspace's
# one launch over every window) keeps 56 B at 64-wide V blocks since the walk loops over windows; not timed apart.
WALK_SPILL_BUDGET = {"bf16": 64, "fp32": 960}

TOKEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def operand_kind(slot_dtype: torch.dtype) -> str:
    """The launch-config key of a slot dtype: 16-bit slots take bf16 dot operands, fp32 slots 3xTF32."""
    return "fp32" if slot_dtype == torch.float32 else "bf16"


# ---------------------------------------------------------------------------------------
# tile helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _load_tile(base, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """``x[r, col0 + c]`` of a row-major slab at ``base`` (row 0) as fp32 ``[BR, BC]``; rows ``>= n_rows`` and
    columns ``>= n_cols`` read as 0. In-tile offsets are int32 (the caller's base carries the int64 part).
    Not tiles.load_tile: the pointer is advanced by rows, then columns (two adds), which builds other code."""
    r = tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return tl.load(base + r[:, None] * stride_row + c[None, :], mask=mask, other=0.0).to(tl.float32)  # [BR, BC]


@triton.jit
def _store_tile(base, x, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Store ``x`` ``[BR, BC]`` into rows ``< n_rows``, columns ``col0 + c < n_cols`` (cast to the target dtype)."""
    r = tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    tl.store(base + r[:, None] * stride_row + c[None, :], x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows_t(base, n_rows, stride_row, n_cols, BC: tl.constexpr, BR: tl.constexpr):
    """The transpose of a row-major slab's tile: ``x[r, c]`` at ``[c, r]`` as fp32 ``[BC, BR]``; rows ``>= n_rows``
    and columns ``>= n_cols`` read as 0."""
    c = tl.arange(0, BC)
    r = tl.arange(0, BR)
    mask = (c < n_cols)[:, None] & (r < n_rows)[None, :]
    return tl.load(base + c[:, None] + r[None, :] * stride_row, mask=mask, other=0.0).to(tl.float32)  # [BC, BR]


@triton.jit
def _decay_row(gc_slot, L, K, BK: tl.constexpr):
    """``exp(g_C)`` ``[BK]`` (1 for columns >= K) from the chunk's gc slot: row L - 1, the last real token."""
    cols = tl.arange(0, BK)
    g_last = tl.load(gc_slot + (L - 1).to(tl.int64) * K + cols, mask=cols < K, other=0.0)
    return tl.exp(g_last)


# ---------------------------------------------------------------------------------------
# forward walk
# ---------------------------------------------------------------------------------------


@triton.jit
def _walk_fwd_step(S, s, hv, v0, table, w, u, qg, kd, aqk, gc, h, o, scale, HV, s_ob, s_ot, s_oh,
                   s_pb, s_pt, s_ph,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   STORE_O: tl.constexpr, STORE_STATES: tl.constexpr, OP_BF16: tl.constexpr, EMULATE: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """One chunk (slot s) of the forward walk: stores h and V' (STORE_STATES), O (STORE_O); returns the state
    leaving the chunk."""
    _, b, t0, L = chunk_row(table, s)
    slot = s.to(tl.int64) * HV + hv
    if STORE_STATES:
        h_slot = h + slot * (K * V)
        _store_tile(h_slot, as_stored(S, h_slot, EMULATE), K, V, v0, V, BK, BV)
    Sb = dot_operand(S, OP_BF16, EMULATE)  # [BK, BV]
    Wn = dot_operand(-_load_tile(w + slot * (C * K), L, K, 0, K, C, BK), OP_BF16, EMULATE)  # -W [C, BK]
    u_slot = u + slot * (C * V)
    Vn = tl.dot(Wn, Sb, acc=_load_tile(u_slot, L, V, v0, V, C, BV), input_precision=DOT_PREC)  # V' [C, BV]
    Vn = as_stored(Vn, u_slot, EMULATE)
    if STORE_STATES:
        _store_tile(u_slot, Vn, C, V, v0, V, C, BV)
    Vb = dot_operand(Vn, OP_BF16, EMULATE)  # [C, BV]
    if STORE_O:
        Qg = dot_operand(_load_tile(qg + slot * (C * K), L, K, 0, K, C, BK), OP_BF16, EMULATE)  # [C, BK]
        rows = tl.arange(0, C)
        cols = tl.arange(0, C)
        causal = (rows[:, None] >= cols[None, :]) & (rows < L)[:, None]
        a_base = token_base(aqk, b, t0, hv, s_pb, s_pt, s_ph)
        A = tl.load(a_base + rows[:, None] * s_pt + cols[None, :], mask=causal, other=0.0)
        A = dot_operand(A.to(tl.float32), OP_BF16, EMULATE)  # [C, C]
        O = tl.dot(A, Vb, acc=tl.dot(Qg, Sb, input_precision=DOT_PREC) * scale, input_precision=DOT_PREC)  # [C, BV]
        o_base = token_base(o, b, t0, hv, s_ob, s_ot, s_oh)
        _store_tile(o_base, as_stored(O, o_base, EMULATE), L, s_ot, v0, V, C, BV)
    kdT = dot_operand(_load_rows_t(kd + slot * (C * K), L, K, K, BK, C), OP_BF16, EMULATE)  # [BK, C]
    decay = _decay_row(gc + slot * (C * K), L, K, BK)  # [BK]
    return tl.dot(kdT, Vb, acc=S * decay[:, None], input_precision=DOT_PREC)  # [BK, BV]


@triton.jit
def _walk_fwd_window(S, wi, i_nh, n_hv, v0, n, hv, table, seq_rows, w, u, qg, kd, aqk, gc, ckpt, h, o, scale, HV, row0,
                     s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr,
                     BV: tl.constexpr, STORE_O: tl.constexpr, STORE_STATES: tl.constexpr, STORE_CKPT: tl.constexpr,
                     OP_BF16: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr, LOOP_WHILE: tl.constexpr):
    """Window wi of the forward walk: its checkpoint (STORE_CKPT), then its chunks; returns the state leaving it."""
    if STORE_CKPT:  # the state entering window wi
        _store_tile(ckpt + (wi * n_hv + i_nh).to(tl.int64) * (K * V), S, K, V, v0, V, BK, BV)
    pair = seq_rows + (wi * (n_hv // HV) + n).to(tl.int64) * 2
    first = tl.load(pair) - row0
    count = tl.load(pair + 1)
    if LOOP_WHILE:
        j = 0
        while j < count:
            S = _walk_fwd_step(S, first + j, hv, v0, table, w, u, qg, kd, aqk, gc, h, o, scale, HV, s_ob, s_ot, s_oh,
                               s_pb, s_pt, s_ph,
                               K, V, C, BK, BV, STORE_O, STORE_STATES, OP_BF16, EMULATE, DOT_PREC)
            j += 1
    else:
        for j in range(0, count):
            S = _walk_fwd_step(S, first + j, hv, v0, table, w, u, qg, kd, aqk, gc, h, o, scale, HV, s_ob, s_ot, s_oh,
                               s_pb, s_pt, s_ph,
                               K, V, C, BK, BV, STORE_O, STORE_STATES, OP_BF16, EMULATE, DOT_PREC)
    return S


@triton.jit
def chunk_walk_fwd_kernel(
    table, seq_rows, w, u, qg, kd, aqk, gc, carry, ckpt, h, o, scale, HV, row0, n_win, s_ob, s_ot, s_oh,
    s_pb, s_pt, s_ph,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_O: tl.constexpr, STORE_STATES: tl.constexpr, STORE_CKPT: tl.constexpr, STORE_CARRY: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr, LOOP_WHILE: tl.constexpr,
):
    """One (sequence n, value head hv, value block): S over the sequence's chunks in n_win consecutive windows."""
    i_nh = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    n_hv = tl.num_programs(0)
    n = i_nh // HV
    hv = i_nh % HV
    carry_nh = carry + i_nh.to(tl.int64) * (K * V)
    S = _load_tile(carry_nh, K, V, v0, V, BK, BV)  # [BK, BV]
    if LOOP_WHILE:  # the interpreter cannot range() over a loaded bound or an integer argument
        wi = 0
        while wi < n_win:
            S = _walk_fwd_window(S, wi, i_nh, n_hv, v0, n, hv, table, seq_rows, w, u, qg, kd, aqk, gc, ckpt, h, o,
                                 scale, HV, row0, s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, K, V, C, BK, BV, STORE_O,
                                 STORE_STATES, STORE_CKPT,
                                 OP_BF16, EMULATE, DOT_PREC, LOOP_WHILE)
            wi += 1
    else:
        for wi in range(0, n_win):
            S = _walk_fwd_window(S, wi, i_nh, n_hv, v0, n, hv, table, seq_rows, w, u, qg, kd, aqk, gc, ckpt, h, o,
                                 scale, HV, row0, s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, K, V, C, BK, BV, STORE_O,
                                 STORE_STATES, STORE_CKPT,
                                 OP_BF16, EMULATE, DOT_PREC, LOOP_WHILE)
    if STORE_CARRY:
        _store_tile(carry_nh, S, K, V, v0, V, BK, BV)


# ---------------------------------------------------------------------------------------
# backward walk
# ---------------------------------------------------------------------------------------


@triton.jit
def _walk_bwd_step(dS, s, hv, v0, table, w, qg, kd, gc, do, dh, dvs, scale, HV, s_db, s_dt, s_dh,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   OP_BF16: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr):
    """One chunk (slot s) of the reverse walk: stores dh, dV'; returns the gradient entering the chunk."""
    _, b, t0, L = chunk_row(table, s)
    slot = s.to(tl.int64) * HV + hv
    dh_slot = dh + slot * (K * V)
    _store_tile(dh_slot, as_stored(dS, dh_slot, EMULATE), K, V, v0, V, BK, BV)
    dSb = dot_operand(dS, OP_BF16, EMULATE)  # [BK, BV]
    Kd = dot_operand(_load_tile(kd + slot * (C * K), L, K, 0, K, C, BK), OP_BF16, EMULATE)  # [C, BK]
    dvs_slot = dvs + slot * (C * V)
    dVn = tl.dot(Kd, dSb, acc=_load_tile(dvs_slot, L, V, v0, V, C, BV), input_precision=DOT_PREC)  # dV' [C, BV]
    _store_tile(dvs_slot, dVn, C, V, v0, V, C, BV)
    dVb = dot_operand(-dVn, OP_BF16, EMULATE)  # -dV'
    dO = dot_operand(_load_tile(token_base(do, b, t0, hv, s_db, s_dt, s_dh), L, s_dt, v0, V, C, BV),
                  OP_BF16, EMULATE)  # [C, BV]
    QgT = dot_operand(_load_rows_t(qg + slot * (C * K), L, K, K, BK, C), OP_BF16, EMULATE)  # [BK, C]
    WT = dot_operand(_load_rows_t(w + slot * (C * K), L, K, K, BK, C), OP_BF16, EMULATE)  # [BK, C]
    decay = _decay_row(gc + slot * (C * K), L, K, BK)  # [BK]
    # dS exp(g_C) + scale qg^T dO as scale (dS exp(g_C) / scale + qg^T dO): both products accumulate in place
    dS = tl.dot(QgT, dO, acc=dS * (decay / scale)[:, None], input_precision=DOT_PREC)  # [BK, BV]
    return tl.dot(WT, dVb, acc=dS * scale, input_precision=DOT_PREC)  # [BK, BV]


@triton.jit
def chunk_walk_bwd_kernel(
    table, seq_rows, w, qg, kd, gc, do, carry, dh, dvs, scale, HV, row0, s_db, s_dt, s_dh,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr, LOOP_WHILE: tl.constexpr,
):
    """One (sequence n, value head hv, value block): dS over the sequence's chunks in the window, last first."""
    i_nh = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    n = i_nh // HV
    hv = i_nh % HV
    first = tl.load(seq_rows + 2 * n) - row0
    count = tl.load(seq_rows + 2 * n + 1)
    if count > 0:
        carry_nh = carry + i_nh.to(tl.int64) * (K * V)
        dS = _load_tile(carry_nh, K, V, v0, V, BK, BV)  # [BK, BV]
        last = first + count - 1
        if LOOP_WHILE:  # the interpreter cannot range() over a loaded bound
            j = 0
            while j < count:
                dS = _walk_bwd_step(dS, last - j, hv, v0, table, w, qg, kd, gc, do, dh, dvs, scale, HV, s_db, s_dt,
                                    s_dh, K, V, C, BK, BV, OP_BF16, EMULATE, DOT_PREC)
                j += 1
        else:
            for j in range(0, count):
                dS = _walk_bwd_step(dS, last - j, hv, v0, table, w, qg, kd, gc, do, dh, dvs, scale, HV, s_db, s_dt,
                                    s_dh, K, V, C, BK, BV, OP_BF16, EMULATE, DOT_PREC)
        _store_tile(carry_nh, dS, K, V, v0, V, BK, BV)


# ---------------------------------------------------------------------------------------
# dAv
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_dav_kernel(
    table, do, u, aqk, daqk, dvs, HV, s_db, s_dt, s_dh, s_pb, s_pt, s_ph,
    V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    OP_BF16: tl.constexpr, EMULATE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One (chunk slot s, value head hv): dAqk = dO V'^T (lower incl. diagonal) and dvs = Aqk^T dO."""
    s = tl.program_id(0)
    hv = tl.program_id(1)
    _, b, t0, L = chunk_row(table, s)
    slot = s.to(tl.int64) * HV + hv
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    causal = rows[:, None] >= cols[None, :]  # [C, C]
    a_base = token_base(aqk, b, t0, hv, s_pb, s_pt, s_ph)
    # Aqk's real rows i < L (lower incl. diagonal) as stored, row-contiguous; its transpose in registers
    A = tl.load(a_base + rows[:, None] * s_pt + cols[None, :], mask=causal & (rows < L)[:, None], other=0.0)
    At = dot_operand(tl.trans(A).to(tl.float32), OP_BF16, EMULATE)  # [C, C]
    do_base = token_base(do, b, t0, hv, s_db, s_dt, s_dh)
    u_slot = u + slot * (C * V)
    dvs_slot = dvs + slot * (C * V)
    dA = tl.zeros([C, C], dtype=tl.float32)
    for v0 in tl.static_range(0, V, BV):
        dO = dot_operand(_load_tile(do_base, L, s_dt, v0, V, C, BV), OP_BF16, EMULATE)  # [C, BV]
        VnT = dot_operand(_load_rows_t(u_slot + v0, L, V, V - v0, BV, C), OP_BF16, EMULATE)  # [BV, C]
        dA += tl.dot(dO, VnT, input_precision=DOT_PREC)
        _store_tile(dvs_slot, tl.dot(At, dO, input_precision=DOT_PREC), C, V, v0, V, C, BV)
    _store_tile(daqk + slot * (C * C), tl.where(causal, dA, 0.0), C, C, 0, C, C, C)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _check_tokens(name: str, x, HV: int, V: int) -> None:
    """A ``[B, T, HV, V]`` token tensor read or written through its strides."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name} must be one of {TOKEN_DTYPES}, got {x.dtype}")
    if x.dim() != 4 or x.shape[2] != HV or x.shape[3] != V:
        raise ValueError(f"{name} must have shape [B, T, {HV}, {V}], got {tuple(x.shape)}")
    check_token_strides(name, x)


def _slot_dims(name: str, x, rows: int) -> tuple:
    """``(n, HV, width)`` of a ``[n, HV, C, width]`` slot tensor of a token dtype, width <= CHUNK_MAX_HEAD_DIM."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 4 or x.shape[2] != rows or not 0 < x.shape[3] <= CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"{name} must have shape [n, HV, {rows}, 1..{CHUNK_MAX_HEAD_DIM}], got {tuple(x.shape)}")
    return x.shape[0], x.shape[1], x.shape[3]


def _table_dims(table, seq_rows) -> int:
    """N, the sequence count of seq_rows ``[N, 2]``; checks the table's kind (its shape by the caller)."""
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32:
        raise TypeError(f"table must be an int32 tensor, got {getattr(table, 'dtype', type(table).__name__)}")
    if not isinstance(seq_rows, torch.Tensor) or seq_rows.dtype != torch.int32:
        raise TypeError(f"seq_rows must be an int32 tensor, got {getattr(seq_rows, 'dtype', type(seq_rows).__name__)}")
    if seq_rows.dim() != 2:
        raise ValueError(f"seq_rows must have shape [N, 2], got {tuple(seq_rows.shape)}")
    return seq_rows.shape[0]


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int | None:
    """The device's SM count (None off CUDA: the interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def walk_block_v(candidates: tuple, pairs: int, V: int, sms: int | None) -> int:
    """The walk's V block: the widest of ``candidates`` (each capped at V's block) whose grid of ``pairs``
    (sequence, value head) chains times ``cdiv(V, BV)`` covers ``sms`` SMs, else the narrowest; the widest when
    ``sms`` is None."""
    blocks = [min(bv, block_size(V)) for bv in candidates]
    if sms is None:
        return blocks[0]
    for bv in blocks:
        if pairs * triton.cdiv(V, bv) >= sms:
            return bv
    return blocks[-1]


def _flags(dtype: torch.dtype) -> dict:
    """Constexprs of the token dtype: bf16 dot operands for 16-bit slots, the interpreter's emulation."""
    if dtype not in TOKEN_DTYPES:
        raise TypeError(f"the slot tensors must be one of {TOKEN_DTYPES}, got {dtype}")
    return dict(OP_BF16=dtype != torch.float32, EMULATE=triton_interpreting(), DOT_PREC=dot_precision(dtype))


def run_walk_fwd(opts: KDAOptions, table: torch.Tensor, seq_rows: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                 qg: torch.Tensor, kd: torch.Tensor, aqk: torch.Tensor, gc: torch.Tensor, carry: torch.Tensor,
                 h: torch.Tensor | None, o: torch.Tensor | None, *, row0: int = 0,
                 checkpoints: torch.Tensor | None = None, store_carry: bool = True, launch=None) -> None:
    """The forward state walk over consecutive windows (``seq_rows`` int32 ``[n_win, N, 2]``: per window and
    sequence, its first row of the chunk table and its chunk count; the slots and ``table`` hold rows ``row0``
    on): h and V' (over u) when h is given, o's rows when o is given, the state entering each window into
    ``checkpoints`` fp32 ``[n_win, N, HV, K, V]`` when given, and the carry (read at the start) written back
    when ``store_carry``."""
    n, HV, K = _slot_dims("w", w, CHUNK)
    V = _slot_dims("u", u, CHUNK)[2]
    if not isinstance(seq_rows, torch.Tensor) or seq_rows.dtype != torch.int32 or seq_rows.dim() != 3 \
            or seq_rows.shape[2] != 2:
        raise TypeError(f"seq_rows must be an int32 tensor of shape [n_win, N, 2], got "
                        f"{getattr(seq_rows, 'dtype', type(seq_rows).__name__)} "
                        f"{tuple(getattr(seq_rows, 'shape', ()))}")
    n_win, N = seq_rows.shape[0], seq_rows.shape[1]
    dt = w.dtype
    flags = _flags(dt)
    for name, x, shape, dtype in (("table", table, (n, 4), torch.int32),
                                  ("seq_rows", seq_rows, (n_win, N, 2), torch.int32),
                                  ("w", w, (n, HV, CHUNK, K), dt), ("u", u, (n, HV, CHUNK, V), dt),
                                  ("qg", qg, (n, HV, CHUNK, K), dt), ("kd", kd, (n, HV, CHUNK, K), dt),
                                  ("gc", gc, (n, HV, CHUNK, K), torch.float32),
                                  ("carry", carry, (N, HV, K, V), torch.float32)):
        check_slot(name, x, shape, dtype)
    sp = check_pairs(aqk, aqk, None, None, HV, dt)
    if h is not None:
        check_slot("h", h, (n, HV, K, V), dt)
    elif o is None:
        raise ValueError("run_walk_fwd needs h or o: with neither it would store nothing but the carry")
    if o is not None:
        _check_tokens("o", o, HV, V)
    if checkpoints is not None:
        check_slot("checkpoints", checkpoints, (n_win, N, HV, K, V), torch.float32)
    if N * HV == 0 or n_win == 0:
        return
    if n == 0:  # windows without a chunk: the state passes through
        if checkpoints is not None:
            checkpoints.copy_(carry.expand_as(checkpoints))
        return
    kind = operand_kind(u.dtype)
    warps, stages, blocks = launch_values(launch, WALK_FWD_WARPS=WALK_FWD_WARPS, WALK_FWD_STAGES=WALK_FWD_STAGES,
                                          WALK_FWD_BLOCK_V=WALK_FWD_BLOCK_V)
    BV = walk_block_v(blocks[kind], N * HV, V, sm_count(u.device))
    so = o.stride()[:3] if o is not None else (0, 0, 0)
    chunk_walk_fwd_kernel[(N * HV, triton.cdiv(V, BV))](
        table, seq_rows, w, u, qg, kd, aqk, gc, carry, checkpoints if checkpoints is not None else carry,
        h if h is not None else u, o if o is not None else u, float(opts.scale), HV, int(row0), n_win, *so, *sp,
        K=K, V=V, C=CHUNK, BK=block_size(K), BV=BV, STORE_O=o is not None, STORE_STATES=h is not None,
        STORE_CKPT=checkpoints is not None, STORE_CARRY=bool(store_carry), **flags,
        LOOP_WHILE=triton_interpreting(), num_warps=warps, num_stages=stages[kind],
    )


def run_walk_bwd(opts: KDAOptions, table: torch.Tensor, seq_rows: torch.Tensor, w: torch.Tensor, qg: torch.Tensor,
                 kd: torch.Tensor, gc: torch.Tensor, do: torch.Tensor, carry: torch.Tensor, dh: torch.Tensor,
                 dvs: torch.Tensor, *, row0: int = 0, launch=None) -> None:
    """The reverse state-gradient walk over one window (``seq_rows`` int32 ``[N, 2]``: per sequence, its first row
    of the chunk table and its chunk count; the slots and ``table`` hold rows ``row0`` on): dh, dV' (over dvs),
    the carry (dS) in place."""
    n, HV, K = _slot_dims("w", w, CHUNK)
    V = _slot_dims("dvs", dvs, CHUNK)[2]
    N = _table_dims(table, seq_rows)
    dt = w.dtype
    flags = _flags(dt)
    for name, x, shape, dtype in (("table", table, (n, 4), torch.int32), ("seq_rows", seq_rows, (N, 2), torch.int32),
                                  ("w", w, (n, HV, CHUNK, K), dt), ("qg", qg, (n, HV, CHUNK, K), dt),
                                  ("kd", kd, (n, HV, CHUNK, K), dt), ("gc", gc, (n, HV, CHUNK, K), torch.float32),
                                  ("carry", carry, (N, HV, K, V), torch.float32), ("dh", dh, (n, HV, K, V), dt),
                                  ("dvs", dvs, (n, HV, CHUNK, V), torch.float32)):
        check_slot(name, x, shape, dtype)
    _check_tokens("do", do, HV, V)
    if N * HV == 0 or n == 0:
        return
    warps, stages, blocks = launch_values(launch, WALK_BWD_WARPS=WALK_BWD_WARPS, WALK_BWD_STAGES=WALK_BWD_STAGES,
                                          WALK_BWD_BLOCK_V=WALK_BWD_BLOCK_V)
    BV = walk_block_v(blocks[operand_kind(w.dtype)], N * HV, V, sm_count(w.device))
    chunk_walk_bwd_kernel[(N * HV, triton.cdiv(V, BV))](
        table, seq_rows, w, qg, kd, gc, do, carry, dh, dvs, float(opts.scale), HV, int(row0), *do.stride()[:3],
        K=K, V=V, C=CHUNK, BK=block_size(K), BV=BV, **flags, LOOP_WHILE=triton_interpreting(),
        num_warps=warps, num_stages=stages,
    )


def run_dav(opts: KDAOptions, table: torch.Tensor, do: torch.Tensor, u: torch.Tensor, aqk: torch.Tensor,
            daqk: torch.Tensor, dvs: torch.Tensor, *, launch=None) -> None:
    """dAqk (fp32 into daqk) and Aqk^T dO (fp32 into dvs) of every chunk of a window; u holds V'."""
    n, HV, V = _slot_dims("u", u, CHUNK)
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"table must be a tensor, got {type(table).__name__}")
    dt = u.dtype
    flags = _flags(dt)
    sp = check_pairs(aqk, aqk, None, None, HV, dt)
    for name, x, shape, dtype in (("table", table, (n, 4), torch.int32), ("u", u, (n, HV, CHUNK, V), dt),
                                  ("daqk", daqk, (n, HV, CHUNK, CHUNK), torch.float32),
                                  ("dvs", dvs, (n, HV, CHUNK, V), torch.float32)):
        check_slot(name, x, shape, dtype)
    _check_tokens("do", do, HV, V)
    if n * HV == 0:
        return
    warps, stages, blocks = launch_values(launch, DAV_WARPS=DAV_WARPS, DAV_STAGES=DAV_STAGES, DAV_BLOCK_V=DAV_BLOCK_V)
    chunk_dav_kernel[(n, HV)](
        table, do, u, aqk, daqk, dvs, HV, *do.stride()[:3], *sp,
        V=V, C=CHUNK, BV=min(blocks[operand_kind(u.dtype)], block_size(V)), **flags, num_warps=warps,
        num_stages=stages,
    )
