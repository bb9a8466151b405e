"""Prototype of the one-token decode step (issue #13 item 9), timed beside kda_decode on synthetic inputs.

Floor: a step moves 2 * N * HV * V * K state elements (one read, one write); at the H200's 4.27 TB/s device
copy (benchmarks/results/recurrent_h200.json) that is 31.4 us for a bf16 pool at N = 64, HV = 32, K = V = 128,
62.9 us for fp32. kda_decode measured 45.5 / 77.6 us there: a ~15 us excess that is the same for both state
dtypes (and ~44 us at N = 256, again for both), so it is not the bytes. This script times, on the same
pool and inputs (kda_decode's serving options: l2norm, the safe gate, sigmoid beta), as CUDA-graph replays:

* ``copy``: a device copy of the pool's bytes (what a step at that size could reach);
* ``kda_decode``: the shipped kernel at its launch config;
* ``proto``: a one-token kernel with no token loop, at each (block_v, num_warps, native_round, tiles)
  of a small grid. ``native_round``: bf16 rounding by the GPU's cvt instead of the integer recipe the
  interpreter needs; ``tiles`` > 1: a persistent grid where each program walks ``tiles`` state tiles and
  loads the next tile's state while it computes the current one.
* ``step``: serving/step.py's kernel (what kda_decode runs for this step), launched directly at each config;
* ``seq``: the same math on a grid where each program takes ``tiles`` consecutive tiles of ONE
  sequence's pool row (one index load, then a contiguous ``tiles * block_v * K`` run of the row), the
  next tile's state requested before the current one is computed, so only a program's first tile
  waits on the index -> state chain; ``evict``: the state read with ``evict_first`` and written with
  streaming stores (``.cs``), since each byte is touched once.

Each kernel is timed two ways: one step per graph replay (what bench_recurrent reports) and ``--amortize``
steps in one graph divided by their number (the step's GPU time without the replay's own launch; the copy
is timed the same two ways, so the ratios compare like with like).

The prototypes' per-token math is the shipped kernels' own (recurrent_forward.token_activations,
recurrent_forward.state_tile_step); what they vary is the grid, tiles and memory hints. (The committed runs of
2026-12-01 had the math inline, with the l2norm as ``x * rsqrt`` where the kernels now use ``1 / sqrt``.)

Each prototype config is gated against kda_decode's own output and pool on the same start (bf16 pools:
bitwise equal rows where the rounding agrees; the max abs difference is recorded). GPU only.

    python benchmarks/dev_decode.py --out results/dev_decode.json
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

from bench_recurrent import _decode_inputs, copy_bandwidth, environment  # noqa: E402
from timing import graphed, graphed_steps_ms, median_ms  # noqa: E402
from kdakit.ops.kda.serving.decode import decode_options, kda_decode  # noqa: E402
from kdakit.ops.kda.serving.step import launch_pool_step  # noqa: E402
from kdakit.ops.kda.chunk_common import GATE_LOWER_BOUND  # noqa: E402
from kdakit.ops.kda.recurrent.kernels import BETA_SIGMOID, state_tile_step, token_activations  # noqa: E402

DEV = "cuda"
# the serving options' gate and beta modes, as constexprs (the form a @triton.jit function reads a global in)
SAFE_GATE = tl.constexpr(GATE_LOWER_BOUND)
SIGMOID_BETA = tl.constexpr(BETA_SIGMOID)


@triton.jit
def _tile_token(q, k, v, g, beta, A_log, dt_bias, i_n, i_hv, i_v, lower_bound, offs_k,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Tile (n, hv, v-block)'s token inputs with kda_decode's serving options (l2norm, the safe gate with A_log and
    dt_bias, sigmoid beta), through the shipped token_activations. -> (q, k, v, a, beta, offs_v)"""
    i_h = i_hv // (HV // H)
    b_q = tl.load(q + (i_n * H + i_h) * K + offs_k).to(tl.float32)
    b_k = tl.load(k + (i_n * H + i_h) * K + offs_k).to(tl.float32)
    b_g = tl.load(g + (i_n * HV + i_hv) * K + offs_k).to(tl.float32)
    offs_v = i_v * BV + tl.arange(0, BV)
    b_v = tl.load(v + (i_n * HV + i_hv) * V + offs_v).to(tl.float32)
    b_b = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
    b_q, b_k, b_a, b_b = token_activations(b_q, b_k, b_g, b_b, A_log, dt_bias, i_hv, offs_k, offs_k < K, lower_bound,
                                           K, True, SAFE_GATE, True, True, SIGMOID_BETA)
    return b_q, b_k, b_v, b_a, b_b, offs_v


@triton.jit
def _dev_decode_kernel(q, k, v, g, beta, A_log, dt_bias, pool, idx, o, scale, lower_bound, row_stride, n_tiles,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                       TILES: tl.constexpr, NATIVE_ROUND: tl.constexpr, ROUND: tl.constexpr):
    NVT: tl.constexpr = V // BV
    offs_k = tl.arange(0, K)
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    # tile -> (n, hv, iv); the state tile's load is issued one tile ahead of its use
    tile = pid
    i_n = tile // (HV * NVT)
    i_hv = (tile // NVT) % HV
    i_v = tile % NVT
    slot = tl.load(idx + i_n, mask=tile < n_tiles, other=0).to(tl.int64)
    offs_s = (i_hv * V + i_v * BV + tl.arange(0, BV)[:, None]) * K + offs_k[None, :]              # [BV, K]
    S_next = tl.load(pool + slot * row_stride + offs_s, mask=(tile < n_tiles) & (offs_s >= 0), other=0.0)
    for _ in range(TILES):
        cur_ok = tile < n_tiles
        S = S_next.to(tl.float32)
        c_n, c_hv, c_v, c_slot, c_offs = i_n, i_hv, i_v, slot, offs_s
        tile += nprog
        if TILES > 1:
            i_n = tile // (HV * NVT)
            i_hv = (tile // NVT) % HV
            i_v = tile % NVT
            slot = tl.load(idx + i_n, mask=tile < n_tiles, other=0).to(tl.int64)
            offs_s = (i_hv * V + i_v * BV + tl.arange(0, BV)[:, None]) * K + offs_k[None, :]
            S_next = tl.load(pool + slot * row_stride + offs_s, mask=(tile < n_tiles) & (offs_s >= 0), other=0.0)
        b_q, b_k, b_v, b_a, b_b, offs_v = _tile_token(q, k, v, g, beta, A_log, dt_bias, c_n, c_hv, c_v, lower_bound,
                                                      offs_k, H, HV, K, V, BV)
        S, _, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_b, scale, ROUND, NATIVE_ROUND)
        tl.store(o + (c_n * HV + c_hv) * V + offs_v, b_o.to(o.dtype.element_ty), mask=cur_ok)
        tl.store(pool + c_slot * row_stride + c_offs, S.to(pool.dtype.element_ty), mask=cur_ok & (c_offs >= 0))


@triton.jit
def _dev_decode_seq_kernel(q, k, v, g, beta, A_log, dt_bias, pool, idx, o, scale, lower_bound, row_stride,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                           TILES: tl.constexpr, NATIVE_ROUND: tl.constexpr, ROUND: tl.constexpr,
                           EVICT: tl.constexpr):
    NVT: tl.constexpr = V // BV
    TPN: tl.constexpr = HV * NVT                      # tiles of one sequence's row; TILES divides it
    offs_k = tl.arange(0, K)
    offs_r = tl.arange(0, BV)
    tile0 = tl.program_id(0).to(tl.int64) * TILES
    i_n = tile0 // TPN
    j0 = tile0 % TPN                                  # tile j of the row: state rows [j * BV, (j + 1) * BV)
    slot = tl.load(idx + i_n).to(tl.int64)
    row = pool + slot * row_stride
    offs_t = offs_r[:, None] * K + offs_k[None, :]                                                  # [BV, K]
    if EVICT:
        S_next = tl.load(row + j0 * BV * K + offs_t, eviction_policy="evict_first")
    else:
        S_next = tl.load(row + j0 * BV * K + offs_t)
    for t in tl.static_range(TILES):
        S = S_next.to(tl.float32)
        j = j0 + t
        if t + 1 < TILES:
            if EVICT:
                S_next = tl.load(row + (j + 1) * BV * K + offs_t, eviction_policy="evict_first")
            else:
                S_next = tl.load(row + (j + 1) * BV * K + offs_t)
        i_hv = j // NVT
        i_v = j % NVT
        b_q, b_k, b_v, b_a, b_b, offs_v = _tile_token(q, k, v, g, beta, A_log, dt_bias, i_n, i_hv, i_v, lower_bound,
                                                      offs_k, H, HV, K, V, BV)
        S, _, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_b, scale, ROUND, NATIVE_ROUND)
        tl.store(o + (i_n * HV + i_hv) * V + offs_v, b_o.to(o.dtype.element_ty))
        if EVICT:
            tl.store(row + j * BV * K + offs_t, S.to(pool.dtype.element_ty), cache_modifier=".cs")
        else:
            tl.store(row + j * BV * K + offs_t, S.to(pool.dtype.element_ty))


@triton.jit
def _dev_decode_pipe_kernel(q, k, v, g, beta, A_log, dt_bias, pool, idx, o, scale, lower_bound, row_stride, n_tiles,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                            STAGES: tl.constexpr, NATIVE_ROUND: tl.constexpr, ROUND: tl.constexpr):
    NVT: tl.constexpr = V // BV
    offs_k = tl.arange(0, K)
    offs_r = tl.arange(0, BV)
    # a persistent grid; Triton's loop pipeliner turns the loads into cp.async into shared memory, STAGES - 1 tiles
    # ahead, so a program's loads in flight do not hold registers (sm_90a PTX: 51 / 77 cp.async at 2 / 3 stages)
    for tile32 in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        tile = tile32.to(tl.int64)
        i_n = tile // (HV * NVT)
        i_hv = (tile // NVT) % HV
        i_v = tile % NVT
        slot = tl.load(idx + i_n).to(tl.int64)
        offs_s = (i_hv * V + i_v * BV + offs_r[:, None]) * K + offs_k[None, :]                     # [BV, K]
        S = tl.load(pool + slot * row_stride + offs_s, eviction_policy="evict_first").to(tl.float32)
        b_q, b_k, b_v, b_a, b_b, offs_v = _tile_token(q, k, v, g, beta, A_log, dt_bias, i_n, i_hv, i_v, lower_bound,
                                                      offs_k, H, HV, K, V, BV)
        S, _, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_b, scale, ROUND, NATIVE_ROUND)
        tl.store(o + (i_n * HV + i_hv) * V + offs_v, b_o.to(o.dtype.element_ty))
        tl.store(pool + slot * row_stride + offs_s, S.to(pool.dtype.element_ty), cache_modifier=".cs")


def launch_seq(t, opts, pool, idx, out, block_v, num_warps, native_round, tiles, evict):
    N, _, H, K = t["q"].shape
    HV, V = t["v"].shape[2], t["v"].shape[3]
    tiles_per_row = HV * (V // block_v)
    if tiles_per_row % tiles:
        raise ValueError(f"tiles={tiles} must divide the {tiles_per_row} tiles of a row")
    _dev_decode_seq_kernel[(N * tiles_per_row // tiles,)](
        t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, idx, out,
        float(K ** -0.5), float(opts["lower_bound"]), pool.stride(0),
        H=H, HV=HV, K=K, V=V, BV=block_v, TILES=tiles, NATIVE_ROUND=native_round,
        ROUND=pool.dtype == torch.bfloat16, EVICT=evict, num_warps=num_warps)


def launch_pipe(t, opts, pool, idx, out, block_v, num_warps, stages, progs_per_sm):
    N, _, H, K = t["q"].shape
    HV, V = t["v"].shape[2], t["v"].shape[3]
    n_tiles = N * HV * (V // block_v)
    sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
    _dev_decode_pipe_kernel[(min(n_tiles, sms * progs_per_sm),)](
        t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, idx, out,
        float(K ** -0.5), float(opts["lower_bound"]), pool.stride(0), n_tiles,
        H=H, HV=HV, K=K, V=V, BV=block_v, STAGES=stages, NATIVE_ROUND=True, ROUND=pool.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=stages)


def launch_step(t, opts, pool, idx, out, block_v, num_warps, native_round, maxnreg=None):
    """serving/step.py's kernel as kda_decode launches it, at a given tile and warp count (``native_round``
    unused: the shipped kernel picks its rounding itself)."""
    kopts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"], **opts)
    A_log, dt_bias = kopts.kernel_gate_params(t["A_log"], t["dt_bias"])
    launch_pool_step(t["q"], t["k"], t["v"], t["g"], t["beta"], out, kopts, pool=pool, state_indices=idx,
                     round_state=pool.dtype == torch.bfloat16, A_log=A_log, dt_bias=dt_bias, N=t["q"].shape[0],
                     block_v=block_v, num_warps=num_warps, maxnreg=maxnreg)


def amortized_us(fn, steps, iters):
    """GPU time of one ``fn`` with ``steps`` of them in one CUDA graph (timing.graphed_steps_ms), in us."""
    return 1e3 * graphed_steps_ms(fn, steps, iters)


def launch_dev(t, opts, pool, idx, out, block_v, num_warps, native_round, tiles):
    N, _, H, K = t["q"].shape
    HV, V = t["v"].shape[2], t["v"].shape[3]
    n_tiles = N * HV * (V // block_v)
    grid = (triton.cdiv(n_tiles, tiles),)
    _dev_decode_kernel[grid](t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, idx, out,
                             float(K ** -0.5), float(opts["lower_bound"]), pool.stride(0), n_tiles,
                             H=H, HV=HV, K=K, V=V, BV=block_v, TILES=tiles, NATIVE_ROUND=native_round,
                             ROUND=pool.dtype == torch.bfloat16, num_warps=num_warps)


def _timed(fn, iters, amortize):
    """(one step per graph replay, amortized over ``amortize`` steps in one graph), both in us."""
    replay, graph = graphed(fn)
    one = 1e3 * median_ms(replay, 20, iters)
    del graph
    return one, amortized_us(fn, amortize, iters)


def copy_cell(N, pool0, copy_GBps, iters, amortize):
    """A cell's record with its floor (the pool read and written once at the copy rate) and a device copy of the
    pool's bytes timed both ways. -> (cell, floor in us)"""
    nbytes = 2 * pool0.numel() * pool0.element_size()
    floor_us = nbytes / copy_GBps / 1e3
    cell = {"N": N, "state_dtype": str(pool0.dtype).replace("torch.", ""), "state_bytes": nbytes,
            "floor_us_at_copy_rate": floor_us}
    src, dst = pool0.clone(), torch.empty_like(pool0)
    cell["copy_us"], cell["copy_amortized_us"] = _timed(lambda: dst.copy_(src), iters, amortize)
    return cell, floor_us


def run_cell(N, pool_dtype, variants, iters, amortize, copy_GBps, with_fla):
    H, K, V = 32, 128, 128
    t, opts = _decode_inputs(N, H, K, V)
    gen = torch.Generator(device=DEV).manual_seed(7)
    pool0 = (0.3 * torch.randn(N, H, V, K, device=DEV, generator=gen)).to(pool_dtype)
    idx = torch.randperm(N, device=DEV, generator=gen).to(torch.int32)
    cell, floor_us = copy_cell(N, pool0, copy_GBps, iters, amortize)

    ref_pool, ref_o = pool0.clone(), torch.empty_like(t["v"])
    kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
               out=ref_o, check_indices=False, **opts)
    pool, out = pool0.clone(), torch.empty_like(t["v"])
    cell["kda_decode_us"], cell["kda_decode_amortized_us"] = _timed(
        lambda: kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"],
                           dt_bias=t["dt_bias"], out=out, check_indices=False, **opts), iters, amortize)
    if with_fla:
        try:
            from bench_recurrent import _fla_decode_fn
            fpool, fout = pool0.clone(), torch.empty_like(t["v"])
            cell["fla_us"], cell["fla_amortized_us"] = _timed(_fla_decode_fn(t, opts, fpool, idx, fout), iters,
                                                              amortize)
        except Exception as exc:  # noqa: BLE001 - the prototype rows stand without FLA's
            cell["fla_error"] = f"{type(exc).__name__}: {exc}"
    rows = []
    for kind, params in variants:
        if kind == "seq" and (H * (V // params["block_v"])) % params["tiles"]:
            continue
        if kind == "proto" and params["native_round"] and pool_dtype != torch.bfloat16:
            continue  # an fp32 pool is never rounded: the same kernel as native_round=False
        launch = {"seq": launch_seq, "proto": launch_dev, "step": launch_step, "pipe": launch_pipe}[kind]
        r = dict(kind=kind, **params)
        p, o = pool0.clone(), torch.empty_like(t["v"])
        try:
            launch(t, opts, p, idx, o, **params)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not the end
            r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(r)
            print(f"N={N} {cell['state_dtype']} {r}", flush=True)
            continue
        r["max_abs_o"] = (o.float() - ref_o.float()).abs().max().item()
        r["max_abs_state"] = (p.float() - ref_pool.float()).abs().max().item()
        r["ok"] = r["max_abs_o"] < 1e-2 and r["max_abs_state"] < 2e-2
        if r["ok"]:
            r["us"], r["amortized_us"] = _timed(lambda: launch(t, opts, p, idx, o, **params), iters, amortize)
            r["fraction_of_copy"] = floor_us / r["us"]
            r["amortized_fraction_of_copy"] = floor_us / r["amortized_us"]
        rows.append(r)
        print(f"N={N} {cell['state_dtype']} {r}", flush=True)
    cell["proto"] = rows
    ok = [r for r in rows if "us" in r]
    cell["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    print(f"N={N} {cell['state_dtype']}: floor {floor_us:.1f} us, copy {cell['copy_us']:.1f} "
          f"({cell['copy_amortized_us']:.1f} amortized), kda_decode {cell['kda_decode_us']:.1f} "
          f"({cell['kda_decode_amortized_us']:.1f}), FLA {cell.get('fla_us', float('nan')):.1f} "
          f"({cell.get('fla_amortized_us', float('nan')):.1f}); best proto {cell['best']}", flush=True)
    return cell


def variant_grid():
    """The loop-free kernel's best config, then the per-sequence kernel and the shipped step kernel
    (serving/step.py, launched directly) at one tile a program over block_v x num_warps. (The run of
    2026-12-01 18:06 had tiles 1-8 and both evict settings: tiles > 1 was slower in every cell it
    finished, and evict helped the one-tile rows; results/dev_decode_h200.json.)"""
    out = [("proto", dict(block_v=16, num_warps=1, native_round=True, tiles=1)),
           ("seq", dict(block_v=16, num_warps=1, native_round=True, tiles=1, evict=False))]
    for bv, w in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (64, 2), (64, 4)):
        out.append(("seq", dict(block_v=bv, num_warps=w, native_round=True, tiles=1, evict=True)))
        out.append(("step", dict(block_v=bv, num_warps=w, native_round=False)))
    return out


def parse_configs(text):
    out = []
    for item in text.split(","):
        kind, cfg = item.split(":")
        bv, w = (int(x) for x in cfg.split("x"))
        if kind == "step":
            out.append(("step", dict(block_v=bv, num_warps=w, native_round=False)))
        elif kind == "stepreg":  # the step kernel with ptxas capped at 64 registers (bf16 at 8 x 1: 72 -> 64)
            out.append(("step", dict(block_v=bv, num_warps=w, native_round=False, maxnreg=64)))
        elif kind.startswith("pipe"):  # pipe<stages>p<programs per SM>, e.g. pipe3p8:8x1
            st, pps = (int(x) for x in kind[4:].split("p"))
            out.append(("pipe", dict(block_v=bv, num_warps=w, stages=st, progs_per_sm=pps)))
        elif kind == "seq":
            out.append(("seq", dict(block_v=bv, num_warps=w, native_round=True, tiles=1, evict=True)))
        else:
            raise ValueError(f"--configs: kind must be step, stepreg, seq or pipe<S>p<P>, got {kind!r}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default="64,256")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--amortize", type=int, default=20, help="steps per graph for the amortized timing")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--configs", default=None,
                    help="only these rows, e.g. 'step:8x1,seq:4x1' (kind:block_v x num_warps; seq: one tile, evict)")
    args = ap.parse_args()
    grid = variant_grid() if args.configs is None else parse_configs(args.configs)
    res = {"env": environment(), "copy": copy_bandwidth(), "cells": []}
    print(f"copy bandwidth {res['copy']['GBps']:.0f} GB/s", flush=True)
    for N in (int(n) for n in args.ns.split(",")):
        for dt in (torch.bfloat16, torch.float32):
            res["cells"].append(run_cell(N, dt, grid, args.iters, args.amortize, res["copy"]["GBps"],
                                         not args.no_fla))
            json.dump(res, open(args.out, "w"), indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
