"""How fast can any kernel read and write a decode pool in place? The ceiling under issue #13's fp32 target.

FLA's fp32 step (20 steps a graph) runs at 69-73 % of the device copy rate at N = 64 / 256 (HV = 32,
K = V = 128; results/recurrent_h200.json), so 1.3x it needs the step at ~93 / ~96 % of copy. kdakit's step
kernel (serving/step.py) levels off at ~92 %. This script separates what the step's math costs from what
its memory access pattern allows, on the same pools, as CUDA-graph replays (one step a replay, and
``--amortize`` steps in one graph divided by their number):

* ``copy``: ``dst.copy_(src)``, the bench's yardstick (out of place);
* ``neg_``: PyTorch's in-place elementwise kernel over the pool (read and write the same bytes);
* ``flat``: a Triton in-place negation over contiguous blocks of ``block`` elements, ``hints``: the load
  ``evict_first`` and the store streaming (``.cs``), as the step kernel does;
* ``flat_oop``: the same kernel out of place (a Triton copy, beside PyTorch's);
* ``tile``: the negation on the step kernel's own grid and indexing ([BV, K] tiles of row
  ``state_indices[n]``, the index loaded first), so only the math is missing;
* ``tma_tile``: the same tiles through a TMA tensor descriptor (``cp.async.bulk.tensor`` load and store);
* ``step``: serving/step.py's kernel at a (block_v, num_warps);
* ``tma_step``: the step kernel's math with the state tile loaded and stored through a TMA descriptor;
* ``dev_step`` (``--grid step``): the step kernel with the hints a switch, at more warps a tile; ``tile``
  there also without the hints and without the index load (row n), to split the tile's cost;
* ``--grid index``: the tile and the step at one warp under four memory hints, the tile's index load split
  into its latency (index loaded, used only in the mask) and the rows' order (identity indices);
* ``--grid math``: the step's fp32 math in one round of reductions (``o = scale * (S' q + u k.q)``);
* ``--grid order``: the program order, ``group`` sequences' rows interleaved tile by tile.

Every row is gated: the negations against ``-pool`` (bitwise), the step variants against kda_decode's
output and pool. ``--ncu`` instead runs each of a few kernels twice at one cell, for Nsight Compute to
count DRAM bytes and throughput (run it under ``ncu``). GPU only.

    python benchmarks/dev_decode_ceiling.py --out results/dev_decode_ceiling.json [--grid step]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_recurrent import _decode_inputs, _fla_decode_fn, copy_bandwidth, environment  # noqa: E402
from dev_decode import _timed, copy_cell, launch_step  # noqa: E402
from kdakit.ops.kda.serving.decode import decode_options, kda_decode  # noqa: E402
from kdakit.ops.kda.recurrent.kernels import delta_rule_tile, state_tile_step, token_activations  # noqa: E402

DEV = "cuda"
HV, K, V = 32, 128, 128


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

# Memory hints (constexpr HINTS) of the tile and dev_step kernels' state load / store
HINTS_NONE, HINTS_EVICT_STREAM, HINTS_CG_STREAM, HINTS_CG = 0, 1, 2, 3
# How the tile kernel finds its row (constexpr INDEX): row n with no index load; the loaded index as the row;
# the index loaded but used only in the mask (its latency before the state load, row n's addresses)
INDEX_NONE, INDEX_ROW, INDEX_MASK_ONLY = 0, 1, 2


@triton.jit
def _tile_coords(pid, HV: tl.constexpr, NVT: tl.constexpr, GROUP: tl.constexpr):
    """Program -> (sequence, value head, v-block): GROUP sequences' tiles interleaved one tile each (GROUP = 1:
    one sequence's row after another, the step kernel's order)."""
    TPR: tl.constexpr = HV * NVT
    i_grp = pid // (GROUP * TPR)
    rem = pid % (GROUP * TPR)
    j = rem // GROUP
    return i_grp * GROUP + rem % GROUP, j // NVT, j % NVT


@triton.jit
def _token_inputs(q, k, v, g, beta, i_n, i_hv, offs_k, offs_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr):
    """One tile's raw token inputs as fp32, loaded as decode_step._pool_step_kernel loads them:
    -> (q [K], k [K], g [K], v [BV], beta)"""
    i_h = i_hv // (HV // H)
    b_q = tl.load(q + (i_n * H + i_h) * K + offs_k).to(tl.float32)
    b_k = tl.load(k + (i_n * H + i_h) * K + offs_k).to(tl.float32)
    b_g = tl.load(g + (i_n * HV + i_hv) * K + offs_k).to(tl.float32)
    b_v = tl.load(v + (i_n * HV + i_hv) * V + offs_v).to(tl.float32)
    return b_q, b_k, b_g, b_v, tl.load(beta + i_n * HV + i_hv).to(tl.float32)


@triton.jit
def _load_state(ptrs, valid, HINTS: tl.constexpr):
    if HINTS == 1:
        S = tl.load(ptrs, mask=valid, other=0.0, eviction_policy="evict_first")
    elif HINTS >= 2:
        S = tl.load(ptrs, mask=valid, other=0.0, cache_modifier=".cg")
    else:
        S = tl.load(ptrs, mask=valid, other=0.0)
    return S


@triton.jit
def _store_state(ptrs, S, valid, HINTS: tl.constexpr):
    if HINTS == 1 or HINTS == 2:
        tl.store(ptrs, S, mask=valid, cache_modifier=".cs")
    else:
        tl.store(ptrs, S, mask=valid)


@triton.jit
def _flat_kernel(src, dst, n, BLOCK: tl.constexpr, HINTS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    _store_state(dst + offs, -_load_state(src + offs, m, HINTS), m, HINTS)


@triton.jit
def _tile_kernel(pool, idx, P, row_stride, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, HINTS: tl.constexpr = 1, INDEX: tl.constexpr = 1, GROUP: tl.constexpr = 1):
    NVT: tl.constexpr = V // BV
    i_n, i_hv, i_v = _tile_coords(tl.program_id(0).to(tl.int64), HV, NVT, GROUP)
    if INDEX == 0:
        slot = i_n
        r = i_n
    elif INDEX == 1:
        slot = tl.load(idx + i_n).to(tl.int64)
        r = slot
    else:
        slot = tl.load(idx + i_n).to(tl.int64)
        r = i_n
    valid = (slot >= 0) & (slot < P)
    offs_s = (i_hv * V + i_v * BV + tl.arange(0, BV)[:, None]) * K + tl.arange(0, K)[None, :]   # [BV, K]
    row = pool + r * row_stride
    S = _load_state(row + offs_s, valid, HINTS)
    _store_state(row + offs_s, -S, valid, HINTS)


@triton.jit
def _dev_step_kernel(q, k, v, g, beta, A_log, dt_bias, pool, state_indices, o, scale, lower_bound, P, row_stride,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     ROUND_STATE: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BETA: tl.constexpr, HINTS: tl.constexpr, EARLY_STORE: tl.constexpr = False,
                     ONE_ROUND: tl.constexpr = False, GROUP: tl.constexpr = 1):
    """decode_step._pool_step_kernel with the memory hints a constexpr (the math is the shipped functions');
    EARLY_STORE: the state stored before ``o = scale * S q`` is formed (the shipped kernel stores o first);
    ONE_ROUND (fp32 pools): ``o = scale * (S' q + u (k . q))``, so both of the tile's reductions over K
    (S' k and S' q) read S' = S D at once and none waits on u; ``k . q`` does not wait on the state;
    GROUP: _tile_coords' program order."""
    NVT: tl.constexpr = V // BV
    i_n, i_hv, i_v = _tile_coords(tl.program_id(0).to(tl.int64), HV, NVT, GROUP)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    b_q, b_k, b_g, b_v, b_beta = _token_inputs(q, k, v, g, beta, i_n, i_hv, offs_k, offs_v, H, HV, K, V)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    valid = (slot >= 0) & (slot < P)
    offs_s = (i_hv * V + offs_v[:, None]) * K + offs_k[None, :]                           # [BV, K]
    row = pool + slot * row_stride
    S = _load_state(row + offs_s, valid, HINTS).to(tl.float32)
    b_q, b_k, b_a, b_beta = token_activations(b_q, b_k, b_g, b_beta, A_log, dt_bias, i_hv, offs_k, offs_k < K,
                                              lower_bound, K, L2NORM, GATE, HAS_A, HAS_BIAS, BETA)
    if ONE_ROUND:
        tl.static_assert(not ROUND_STATE, "ONE_ROUND forms o from the unrounded state: fp32 pools only")
        b_kq = tl.sum(b_k * b_q, axis=0)
        S_dec = S * tl.exp(b_a)[None, :]
        b_u = b_beta * (b_v - tl.sum(S_dec * b_k[None, :], axis=1))                        # [BV]
        b_o = scale * (tl.sum(S_dec * b_q[None, :], axis=1) + b_u * b_kq)
        _store_state(row + offs_s, (S_dec + b_u[:, None] * b_k[None, :]).to(pool.dtype.element_ty), valid, HINTS)
        tl.store(o + (i_n * HV + i_hv) * V + offs_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty))
    elif EARLY_STORE:
        _, S, _, _ = delta_rule_tile(S, b_k, b_v, b_a, b_beta)
        S = S.to(pool.dtype.element_ty)
        _store_state(row + offs_s, S, valid, HINTS)
        b_o = scale * tl.sum(S.to(tl.float32) * b_q[None, :], axis=1)                      # [BV]
        tl.store(o + (i_n * HV + i_hv) * V + offs_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty))
    else:
        S, _, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_beta, scale, ROUND_STATE, True)
        tl.store(o + (i_n * HV + i_hv) * V + offs_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty))
        _store_state(row + offs_s, S.to(pool.dtype.element_ty), valid, HINTS)


@triton.jit
def _tma_tile_kernel(desc, idx, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    NVT: tl.constexpr = V // BV
    i_n, i_hv, i_v = _tile_coords(tl.program_id(0), HV, NVT, 1)
    slot = tl.load(idx + i_n)
    r0 = (slot * HV + i_hv) * V + i_v * BV
    S = desc.load([r0, 0])                                                                   # [BV, K]
    desc.store([r0, 0], -S)


@triton.jit
def _tma_step_kernel(q, k, v, g, beta, A_log, dt_bias, desc, state_indices, o, scale, lower_bound,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     ROUND_STATE: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BETA: tl.constexpr):
    NVT: tl.constexpr = V // BV
    i_n, i_hv, i_v = _tile_coords(tl.program_id(0), HV, NVT, 1)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    b_q, b_k, b_g, b_v, b_beta = _token_inputs(q, k, v, g, beta, i_n, i_hv, offs_k, offs_v, H, HV, K, V)
    slot = tl.load(state_indices + i_n)
    r0 = (slot * HV + i_hv) * V + i_v * BV
    S = desc.load([r0, 0]).to(tl.float32)                                                   # [BV, K]
    b_q, b_k, b_a, b_beta = token_activations(b_q, b_k, b_g, b_beta, A_log, dt_bias, i_hv, offs_k, offs_k < K,
                                              lower_bound, K, L2NORM, GATE, HAS_A, HAS_BIAS, BETA)
    S, _, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_beta, scale, ROUND_STATE, True)
    tl.store(o + (i_n * HV + i_hv) * V + offs_v, b_o.to(o.dtype.element_ty))
    desc.store([r0, 0], S.to(desc.dtype))


# ---------------------------------------------------------------------------------------------
# Launchers (each returns a zero-argument launch, so a row is timed and gated the same way)
# ---------------------------------------------------------------------------------------------

def _descriptor(pool, block_v):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(pool, [pool.numel() // K, K], [K, 1], [block_v, K])


def make_launch(kind, params, t, opts, pool, idx, out, dst=None):
    """``params["identity"]``: the rows in order (state_indices = arange) instead of the cell's permutation."""
    N = pool.shape[0]
    rows = torch.arange(N, device=idx.device, dtype=idx.dtype) if params.get("identity") else idx
    if kind == "neg_":
        return lambda: pool.neg_()
    if kind in ("flat", "flat_oop"):
        n, blk = pool.numel(), params["block"]
        target = pool if kind == "flat" else dst
        hints = HINTS_EVICT_STREAM if params["hints"] else HINTS_NONE
        return lambda: _flat_kernel[(triton.cdiv(n, blk),)](pool, target, n, BLOCK=blk, HINTS=hints,
                                                            num_warps=params["num_warps"])
    if kind == "tile":
        bv = params["block_v"]
        return lambda: _tile_kernel[(N * HV * (V // bv),)](
            pool, rows, pool.shape[0], pool.stride(0), HV=HV, K=K, V=V,
            BV=bv, HINTS=int(params.get("hints", HINTS_EVICT_STREAM)), INDEX=params.get("index", INDEX_ROW),
            GROUP=params.get("group", 1), num_warps=params["num_warps"])
    if kind == "tma_tile":
        bv = params["block_v"]
        desc = _descriptor(pool, bv)
        return lambda: _tma_tile_kernel[(N * HV * (V // bv),)](desc, idx, HV=HV, V=V, BV=bv,
                                                              num_warps=params["num_warps"])
    if kind == "step":
        return lambda: launch_step(t, opts, pool, idx, out, params["block_v"], params["num_warps"], False)
    if kind in ("tma_step", "dev_step"):
        bv = params["block_v"]
        desc = _descriptor(pool, bv) if kind == "tma_step" else None
        kopts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                               **opts)
        A_log, dt_bias = kopts.kernel_gate_params(t["A_log"], t["dt_bias"])
        cx = kopts.recurrent_constexprs()
        cx.pop("STATE_V_FIRST")

        if kind == "dev_step":
            def run():
                return _dev_step_kernel[(N * HV * (V // bv),)](
                    t["q"], t["k"], t["v"], t["g"], t["beta"], A_log, dt_bias, pool, rows, out, kopts.scale,
                    kopts.kernel_lower_bound, pool.shape[0], pool.stride(0), H=HV, HV=HV, K=K, V=V, BV=bv,
                    ROUND_STATE=pool.dtype == torch.bfloat16, HINTS=int(params["hints"]),
                    EARLY_STORE=bool(params.get("early_store")), ONE_ROUND=bool(params.get("one_round")),
                    GROUP=params.get("group", 1),
                    num_warps=params["num_warps"],
                    **cx)
            return run

        def run():
            return _tma_step_kernel[(N * HV * (V // bv),)](
                t["q"], t["k"], t["v"], t["g"], t["beta"], A_log, dt_bias, desc, idx, out, kopts.scale,
                kopts.kernel_lower_bound, H=HV, HV=HV, K=K, V=V, BV=bv, ROUND_STATE=pool.dtype == torch.bfloat16,
                num_warps=params["num_warps"], **cx)
        return run
    raise ValueError(f"unknown kind {kind!r}")


def step_grid():
    """The second run's grid (results/dev_decode_ceiling_step_h200.json): the step's math at more warps a tile,
    with and without the hints (0 / 1), beside the tiled negation with and without the index load."""
    rows = [("flat", dict(block=1024, num_warps=8, hints=False)), ("flat", dict(block=1024, num_warps=1, hints=False))]
    for hints in (HINTS_EVICT_STREAM, HINTS_NONE):
        for index in (INDEX_ROW, INDEX_NONE):
            rows.append(("tile", dict(block_v=8, num_warps=1, hints=hints, index=index)))
    for bv, w in ((8, 2), (8, 4), (8, 8)):
        rows.append(("tile", dict(block_v=bv, num_warps=w, hints=HINTS_NONE, index=INDEX_ROW)))
    for bv in (4, 8, 16, 32):
        for w in (1, 2, 4, 8):
            if bv * K // (32 * w) < 2:
                continue
            for hints in (HINTS_EVICT_STREAM, HINTS_NONE):
                rows.append(("dev_step", dict(block_v=bv, num_warps=w, hints=hints)))
    rows.append(("step", dict(block_v=8, num_warps=1)))
    return rows


def index_grid():
    """The third run's grid: where the index load's cost comes from (its latency, INDEX_MASK_ONLY; the rows'
    order, identity) and whether L1 matters (the state through .cg, which leaves L1 to the index and the
    token's inputs), on the one-warp [8, K] tile."""
    rows = [("flat", dict(block=1024, num_warps=8, hints=False))]
    for hints in (HINTS_NONE, HINTS_EVICT_STREAM, HINTS_CG_STREAM, HINTS_CG):
        for index in (INDEX_NONE, INDEX_ROW, INDEX_MASK_ONLY):
            rows.append(("tile", dict(block_v=8, num_warps=1, hints=hints, index=index)))
        rows.append(("tile", dict(block_v=8, num_warps=1, hints=hints, index=INDEX_ROW, identity=True)))
        for bv in (4, 8):
            rows.append(("dev_step", dict(block_v=bv, num_warps=1, hints=hints)))
        rows.append(("dev_step", dict(block_v=8, num_warps=1, hints=hints, identity=True)))
        rows.append(("dev_step", dict(block_v=8, num_warps=1, hints=hints, early_store=True)))
    rows.append(("step", dict(block_v=8, num_warps=1)))
    return rows


def math_grid():
    """The fourth run's grid: the step's math in one round of reductions (fp32), at both hints and both row
    orders, beside the math-free tile."""
    rows = []
    for hints in (HINTS_NONE, HINTS_EVICT_STREAM):
        for identity in (False, True):
            rows.append(("tile", dict(block_v=8, num_warps=1, hints=hints, index=INDEX_ROW, identity=identity)))
            for bv in (4, 8):
                rows.append(("dev_step", dict(block_v=bv, num_warps=1, hints=hints, identity=identity)))
                rows.append(("dev_step", dict(block_v=bv, num_warps=1, hints=hints, identity=identity,
                                              one_round=True)))
    rows.append(("step", dict(block_v=8, num_warps=1)))
    return rows


def order_grid():
    """The fifth run's grid: the program order. GROUP sequences' rows interleaved tile by tile (1: the step
    kernel's row after row; N: every row's tile j before any row's tile j + 1), on the math-free tile and the
    step, with the bench's random rows and in order."""
    rows = []
    for identity in (False, True):
        for group in (1, 2, 4, 16, 64):
            rows.append(("tile", dict(block_v=8, num_warps=1, hints=HINTS_NONE, index=INDEX_ROW, identity=identity,
                                      group=group)))
            for hints in (HINTS_NONE, HINTS_EVICT_STREAM):
                rows.append(("dev_step", dict(block_v=8, num_warps=1, hints=hints, identity=identity, group=group)))
    rows.append(("step", dict(block_v=8, num_warps=1)))
    return rows


def variant_grid():
    """The first run's grid (results/dev_decode_ceiling_h200.json)."""
    rows = [("neg_", {})]
    for blk in (1024, 4096, 8192):
        for w in (1, 4, 8):
            for hints in (False, True):
                rows.append(("flat", dict(block=blk, num_warps=w, hints=hints)))
    rows += [("flat_oop", dict(block=4096, num_warps=4, hints=False)),
             ("flat_oop", dict(block=4096, num_warps=4, hints=True))]
    for bv, w in ((8, 1), (16, 1), (32, 1), (32, 4), (64, 4)):
        rows.append(("tile", dict(block_v=bv, num_warps=w)))
        rows.append(("tma_tile", dict(block_v=bv, num_warps=w)))
    for bv, w in ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4)):
        rows.append(("tma_step", dict(block_v=bv, num_warps=w)))
    rows.append(("step", dict(block_v=8, num_warps=1)))
    return rows


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------

def cell_inputs(N, pool_dtype):
    t, opts = _decode_inputs(N, HV, K, V)
    gen = torch.Generator(device=DEV).manual_seed(7)
    pool0 = (0.3 * torch.randn(N, HV, V, K, device=DEV, generator=gen)).to(pool_dtype)
    idx = torch.randperm(N, device=DEV, generator=gen).to(torch.int32)
    return t, opts, pool0, idx


def run_cell(N, pool_dtype, variants, iters, amortize, copy_GBps):
    t, opts, pool0, idx = cell_inputs(N, pool_dtype)
    cell, floor_us = copy_cell(N, pool0, copy_GBps, iters, amortize)
    refs = {}
    for identity, rows_idx in ((False, idx), (True, torch.arange(N, device=DEV, dtype=idx.dtype))):
        ref_pool, ref_o = pool0.clone(), torch.empty_like(t["v"])
        kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, rows_idx, A_log=t["A_log"],
                   dt_bias=t["dt_bias"], out=ref_o, check_indices=False, **opts)
        refs[identity] = (ref_pool, ref_o)
    fpool, fout = pool0.clone(), torch.empty_like(t["v"])
    try:
        cell["fla_us"], cell["fla_amortized_us"] = _timed(_fla_decode_fn(t, opts, fpool, idx, fout), iters, amortize)
    except Exception as exc:  # noqa: BLE001 - the rows stand without FLA's
        cell["fla_error"] = f"{type(exc).__name__}: {exc}"
    del fpool
    rows = []
    for kind, params in variants:
        if params.get("one_round") and pool_dtype != torch.float32:
            continue  # the one-round form is for fp32 pools (a bf16 pool's o reads the rounded state)
        r = dict(kind=kind, **params)
        p, o, d = pool0.clone(), torch.empty_like(t["v"]), torch.empty_like(pool0)
        try:
            launch = make_launch(kind, params, t, opts, p, idx, o, d)
            compiled = launch()
            torch.cuda.synchronize()
            if hasattr(compiled, "n_regs"):
                r["registers"], r["spills"] = compiled.n_regs, compiled.n_spills
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not the end
            r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(r)
            print(f"N={N} {cell['state_dtype']} {r}", flush=True)
            continue
        if kind in ("step", "tma_step", "dev_step"):
            ref_pool, ref_o = refs[bool(params.get("identity"))]
            r["max_abs_o"] = (o.float() - ref_o.float()).abs().max().item()
            r["max_abs_state"] = (p.float() - ref_pool.float()).abs().max().item()
            r["ok"] = r["max_abs_o"] < 1e-2 and r["max_abs_state"] < 2e-2
        else:
            got = d if kind == "flat_oop" else p
            r["ok"] = bool(torch.equal(got, -pool0))
        if r["ok"]:
            r["us"], r["amortized_us"] = _timed(launch, iters, amortize)
            r["fraction_of_copy"] = floor_us / r["us"]
            r["amortized_fraction_of_copy"] = floor_us / r["amortized_us"]
            if "fla_amortized_us" in cell:
                r["amortized_speedup_vs_fla"] = cell["fla_amortized_us"] / r["amortized_us"]
        rows.append(r)
        print(f"N={N} {cell['state_dtype']} {r}", flush=True)
        del p, o, d
    cell["rows"] = rows
    print(f"N={N} {cell['state_dtype']}: floor {floor_us:.1f} us, copy {cell['copy_us']:.1f} "
          f"({cell['copy_amortized_us']:.1f}), FLA {cell.get('fla_us', float('nan')):.1f} "
          f"({cell.get('fla_amortized_us', float('nan')):.1f})", flush=True)
    return cell


def ncu_targets(N, pool_dtype):
    """Two launches each of the copy, the in-place negation, the tiled negation and the step kernel."""
    t, opts, pool0, idx = cell_inputs(N, pool_dtype)
    p, o, d = pool0.clone(), torch.empty_like(t["v"]), torch.empty_like(pool0)
    rows = [("neg_", {}), ("flat", dict(block=1024, num_warps=8, hints=False)), ("tile", dict(block_v=8, num_warps=1)),
            ("tile", dict(block_v=8, num_warps=1, hints=HINTS_NONE, index=INDEX_NONE)),
            ("tile", dict(block_v=8, num_warps=1, hints=HINTS_NONE, index=INDEX_MASK_ONLY)),
            ("tile", dict(block_v=8, num_warps=1, hints=HINTS_CG, index=INDEX_ROW)),
            ("step", dict(block_v=8, num_warps=1)), ("dev_step", dict(block_v=8, num_warps=1, hints=HINTS_NONE)),
            ("dev_step", dict(block_v=8, num_warps=1, hints=HINTS_CG))]
    for _ in range(2):
        d.copy_(pool0)
    for kind, params in rows:
        try:
            launch = make_launch(kind, params, t, opts, p, idx, o, d)
            for _ in range(2):
                launch()
        except Exception as exc:  # noqa: BLE001
            print(f"{kind}: {type(exc).__name__}: {exc}")
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ns", default="64,256")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--amortize", type=int, default=20)
    ap.add_argument("--grid", choices=("ceiling", "step", "index", "math", "order"), default="ceiling")
    ap.add_argument("--ncu", default=None, help="N,dtype (e.g. 256,float32): launch a few kernels for ncu only")
    args = ap.parse_args()
    if args.ncu:
        n, dt = args.ncu.split(",")
        ncu_targets(int(n), getattr(torch, dt))
        return
    grid = {"ceiling": variant_grid, "step": step_grid, "index": index_grid, "math": math_grid, "order": order_grid}[args.grid]()
    res = {"env": environment(), "copy": copy_bandwidth(), "grid": args.grid, "cells": []}
    print(f"copy bandwidth {res['copy']['GBps']:.0f} GB/s", flush=True)
    for N in (int(n) for n in args.ns.split(",")):
        for dt in (torch.float32, torch.bfloat16):
            res["cells"].append(run_cell(N, dt, grid, args.iters, args.amortize, res["copy"]["GBps"]))
            json.dump(res, open(args.out, "w"), indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
