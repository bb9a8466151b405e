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

from bench_recurrent import _decode_inputs, environment  # noqa: E402
from timing import graphed, median_ms  # noqa: E402
from kdakit.ops.kda.chunk_common import round_to_bf16  # noqa: E402
from kdakit.ops.kda.decode import kda_decode  # noqa: E402

DEV = "cuda"


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
        i_h = c_hv // (HV // H)
        b_q = tl.load(q + (c_n * H + i_h) * K + offs_k).to(tl.float32)
        b_k = tl.load(k + (c_n * H + i_h) * K + offs_k).to(tl.float32)
        b_g = tl.load(g + (c_n * HV + c_hv) * K + offs_k).to(tl.float32)
        offs_v = c_v * BV + tl.arange(0, BV)
        b_v = tl.load(v + (c_n * HV + c_hv) * V + offs_v).to(tl.float32)
        b_b = tl.sigmoid(tl.load(beta + c_n * HV + c_hv).to(tl.float32))
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        x = b_g + tl.load(dt_bias + c_hv * K + offs_k).to(tl.float32)
        b_a = lower_bound * tl.sigmoid(tl.exp(tl.load(A_log + c_hv).to(tl.float32)) * x)
        S = S * tl.exp(b_a)[None, :]
        b_u = b_b * (b_v - tl.sum(S * b_k[None, :], axis=1))
        S = S + b_u[:, None] * b_k[None, :]
        if ROUND:
            if NATIVE_ROUND:
                S = S.to(tl.bfloat16).to(tl.float32)
            else:
                S = round_to_bf16(S)
        b_o = scale * tl.sum(S * b_q[None, :], axis=1)
        tl.store(o + (c_n * HV + c_hv) * V + offs_v, b_o.to(o.dtype.element_ty), mask=cur_ok)
        tl.store(pool + c_slot * row_stride + c_offs, S.to(pool.dtype.element_ty), mask=cur_ok & (c_offs >= 0))


def launch_dev(t, opts, pool, idx, out, block_v, num_warps, native_round, tiles):
    N, _, H, K = t["q"].shape
    HV, V = t["v"].shape[2], t["v"].shape[3]
    n_tiles = N * HV * (V // block_v)
    grid = (triton.cdiv(n_tiles, tiles),)
    _dev_decode_kernel[grid](t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, idx, out,
                             float(K ** -0.5), float(opts["lower_bound"]), pool.stride(0), n_tiles,
                             H=H, HV=HV, K=K, V=V, BV=block_v, TILES=tiles, NATIVE_ROUND=native_round,
                             ROUND=pool.dtype == torch.bfloat16, num_warps=num_warps)


def run_cell(N, pool_dtype, grid, iters):
    H, K, V = 32, 128, 128
    t, opts = _decode_inputs(N, H, K, V)
    gen = torch.Generator(device=DEV).manual_seed(7)
    pool0 = (0.3 * torch.randn(N, H, V, K, device=DEV, generator=gen)).to(pool_dtype)
    idx = torch.randperm(N, device=DEV, generator=gen).to(torch.int32)
    nbytes = 2 * pool0.numel() * pool0.element_size()
    cell = {"N": N, "state_dtype": str(pool_dtype).replace("torch.", ""), "state_bytes": nbytes}

    src, dst = pool0.clone(), torch.empty_like(pool0)
    replay, _g0 = graphed(lambda: dst.copy_(src))
    cell["copy_us"] = 1e3 * median_ms(replay, 20, iters)

    ref_pool, ref_o = pool0.clone(), torch.empty_like(t["v"])
    kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
               out=ref_o, check_indices=False, **opts)
    pool, out = pool0.clone(), torch.empty_like(t["v"])
    replay, _g1 = graphed(lambda: kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"],
                                             dt_bias=t["dt_bias"], out=out, check_indices=False, **opts))
    cell["kda_decode_us"] = 1e3 * median_ms(replay, 20, iters)
    rows = []
    for block_v, num_warps, native_round, tiles in grid:
        r = dict(block_v=block_v, num_warps=num_warps, native_round=native_round, tiles=tiles)
        p, o = pool0.clone(), torch.empty_like(t["v"])
        launch_dev(t, opts, p, idx, o, block_v, num_warps, native_round, tiles)
        r["max_abs_o"] = (o.float() - ref_o.float()).abs().max().item()
        r["max_abs_state"] = (p.float() - ref_pool.float()).abs().max().item()
        r["ok"] = r["max_abs_o"] < 1e-2 and r["max_abs_state"] < 2e-2
        if r["ok"]:
            replay, _g = graphed(lambda: launch_dev(t, opts, p, idx, o, block_v, num_warps, native_round, tiles))
            r["us"] = 1e3 * median_ms(replay, 20, iters)
            r["fraction_of_same_size_copy"] = cell["copy_us"] / r["us"]
            del _g
        rows.append(r)
        print(f"N={N} {cell['state_dtype']} {r}", flush=True)
    cell["proto"] = rows
    ok = [r for r in rows if "us" in r]
    cell["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    print(f"N={N} {cell['state_dtype']}: copy {cell['copy_us']:.1f} us, kda_decode {cell['kda_decode_us']:.1f} us, "
          f"best proto {cell['best']}", flush=True)
    return cell


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default="64,256")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    grid = [(bv, w, nr, tiles) for bv, w in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4))
            for nr in (False, True) for tiles in (1, 2, 4)]
    res = {"env": environment(), "cells": []}
    for N in (int(n) for n in args.ns.split(",")):
        for dt in (torch.bfloat16, torch.float32):
            g = grid if dt == torch.bfloat16 else [c for c in grid if not c[2]]
            res["cells"].append(run_cell(N, dt, g, args.iters))
            json.dump(res, open(args.out, "w"), indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
