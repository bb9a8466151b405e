"""Sweep the windowed backward's launch configs on the GPU, one table of per-stage CUDA time.

Each variant sets every stage's config at once (stage 1 window starts: value block and warps;
stage 2 window states: value block and warps; stage 3 gradients: value block, warps, pipeline
stages and the decay-gradient matmul precision). The stages are separate kernels, so the
per-kernel times of all variants give each stage's best config independently.

Phases: (1) compile every variant in parallel processes (Triton's disk cache keeps the binaries;
the CPU cores compile side by side), (2) time the variants one after another in this process
(``profile_chunk.profile_one``: per-kernel CUDA time, median step time), (3) the correctness gate
(bf16 vs the float64 reference) for each distinct precision.

Usage: python benchmarks/tune_windowed.py --out tune.json [--shape 1x8192:96] [--compile-all]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

# (starts BV, starts warps), (states BV, states warps), (grads BV, grads warps, grads stages, precision)
VARIANTS = [
    ((64, 4), (128, 4), (32, 4, 1, "tf32x3")),  # the defaults
    ((64, 8), (64, 4), (64, 4, 1, "tf32x3")),
    ((32, 4), (64, 8), (64, 8, 1, "tf32x3")),
    ((32, 8), (128, 8), (32, 8, 1, "tf32x3")),
    ((128, 8), (32, 4), (32, 4, 2, "tf32x3")),
    ((64, 4), (32, 8), (128, 8, 1, "tf32x3")),
    ((64, 4), (128, 4), (16, 4, 1, "tf32x3")),
    ((64, 4), (128, 4), (32, 4, 1, "tf32")),  # 32.1 vs 41.9 ms a step, but ddt_bias fails the GPU tier
]


def apply(i: int) -> dict:
    import kdakit.ops.kda.chunk_bwd_windowed as W

    (b1, w1), (b2, w2), (bg, wg, sg, prec) = VARIANTS[i]
    W.STARTS_BLOCK_V, W.STARTS_NUM_WARPS = b1, w1
    W.STATES_BLOCK_V, W.STATE_NUM_WARPS = b2, w2
    W.GRADS_BLOCK_V, W.GRADS_NUM_WARPS, W.GRADS_NUM_STAGES = bg, wg, sg
    W.grad_precision = lambda: prec  # the decay-gradient products' precision
    return {"variant": i, "starts": f"BV{b1} w{w1}", "states": f"BV{b2} w{w2}",
            "grads": f"BV{bg} w{wg} s{sg} {prec}"}


def stage_ms(res: dict) -> dict:
    out = {}
    for r in res.get("kernels", []):
        for key, tag in (("starts", "window_starts"), ("states", "window_states"), ("grads", "window_grads"),
                         ("fwd_intra", "fwd_intra"), ("fwd_state", "fwd_state")):
            if tag in r["kernel"]:
                out[key + "_ms"] = out.get(key + "_ms", 0.0) + r["ms_per_step"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1x8192:96")
    ap.add_argument("--compile-only", type=int, default=None, help="(internal) compile variant N and exit")
    ap.add_argument("--compile-all", action="store_true", help="only phase (1), then exit")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    from bench_chunk import correctness_gate, parse_shapes
    from profile_chunk import protocol_inputs, step

    (mbs, seq, heads), = parse_shapes(args.shape)
    if args.compile_only is not None:
        apply(args.compile_only)
        x, A_log, dt_bias, cu, do = protocol_inputs(mbs, seq, heads)
        step(x, A_log, dt_bias, cu, do)
        torch.cuda.synchronize()
        return 0

    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--out", os.devnull, "--shape", args.shape,
                               "--compile-only", str(i)]) for i in range(len(VARIANTS))]
    codes = [p.wait() for p in procs]
    print(f"compiled {len(VARIANTS)} variants in {time.time() - t0:.0f} s, exit codes {codes}", flush=True)
    if args.compile_all:
        return 0

    from profile_chunk import profile_one

    rows = []
    for i in range(len(VARIANTS)):
        row = apply(i)
        try:
            res = profile_one(mbs, seq, heads, args.steps)
            row.update(step_ms=res["fwd_bwd_ms_median"], **stage_ms(res))
        except Exception as e:  # a variant that fails to compile or run is reported, the sweep goes on
            row["error"] = repr(e)[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    gates = {}
    first_of = {}
    for i, v in enumerate(VARIANTS):
        first_of.setdefault(v[2][3], i)
    for prec, i in first_of.items():
        apply(i)
        g = correctness_gate()
        gates[prec] = {"ok": g["ok"], **{k: round(v["rms_ratio"], 5) for k, v in g["errors"].items()}}
        print(json.dumps({"precision": prec, **gates[prec]}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "shape": args.shape,
                   "git_sha": os.environ.get("KDAKIT_GIT_SHA", "unknown"), "rows": rows, "gates": gates}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
