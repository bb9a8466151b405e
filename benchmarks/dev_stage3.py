"""Development measurement on the GPU: the backward's stage 3 (window gradients) reading the window's
intermediates from stage 2's rows and slots (``chunk_bwd_windowed.STAGE3_FROM_ROWS``) against re-deriving
them, at the protocol shapes with HV == H; forward+backward time (median of CUDA events, runs of both
variants interleaved), per-kernel CUDA time and the largest gradient difference between the two.

Usage: python benchmarks/dev_stage3.py --out FILE [--shapes 1x8192:96,8x8192:16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kdakit.ops.kda.chunk_bwd_windowed as WG  # noqa: E402
from dev_cadence import step_fn  # noqa: E402
from dev_chunk_gpu import kernel_times, timed  # noqa: E402


def grads(x):
    return {n: t.grad.detach().float().clone() for n, t in x.items() if t.grad is not None}


def shape_row(shape: str, rounds: int) -> dict:
    mbs, rest = shape.split("x")
    seq, heads = (int(s) for s in rest.split(":"))
    step, x = step_fn(int(mbs), seq, heads, None)
    out = {"shape": shape, "variants": {}}
    got = {}
    for from_rows in (True, False):
        WG.STAGE3_FROM_ROWS = from_rows
        step()  # compile
        torch.cuda.synchronize()
        got[from_rows] = grads(x)
    out["grad_diff_max_abs"] = {n: float((got[True][n] - got[False][n]).abs().max()) for n in got[True]}
    out["grad_diff_rms_ratio"] = {n: float((got[True][n] - got[False][n]).pow(2).mean().sqrt()
                                           / got[False][n].pow(2).mean().sqrt().clamp_min(1e-30)) for n in got[True]}
    times = {True: [], False: []}
    for _ in range(rounds):
        for from_rows in (True, False):
            WG.STAGE3_FROM_ROWS = from_rows
            times[from_rows].append(timed(step, reps=10, warmup=1))
    for from_rows in (True, False):
        WG.STAGE3_FROM_ROWS = from_rows
        kt = kernel_times(step, runs=2)
        out["variants"]["from_rows" if from_rows else "re_derived"] = {
            "fwd_bwd_ms": sorted(times[from_rows]), "kernels": dict(list(kt.items())[:8])}
    WG.STAGE3_FROM_ROWS = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1x8192:96,8x8192:16")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for shape in a.shapes.split(","):
        rows.append(shape_row(shape, a.rounds))
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        r = rows[-1]
        print(shape, {k: v["fwd_bwd_ms"] for k, v in r["variants"].items()}, "grad diff rms",
              {k: f"{v:.1e}" for k, v in r["grad_diff_rms_ratio"].items()}, flush=True)
        for k, v in r["variants"].items():
            print(" ", k, [(n[:40], d["calls"], d["ms"]) for n, d in list(v["kernels"].items())[:6]], flush=True)


if __name__ == "__main__":
    main()
