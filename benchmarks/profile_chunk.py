"""Per-kernel CUDA time of kdakit's chunk forward and backward (torch.profiler), on the GPU.

Answers "which kernel owns the time" before tuning: for each shape, one warm-up step then ``--steps`` profiled forward+backward steps with the docs/spec.md §3 flags (bf16,
K = V = 128, l2norm, beta sigmoid, safe gate lb -5, cu_seqlens). Prints and writes a table of
kernel name, calls per step and CUDA milliseconds per step.

``--gate softplus``: the unbounded gate instead (safe_gate False, no lower bound: FLA's layer default,
the kernels' EXACT path; at 1 x 32K H16 its window-gradient kernel measured 40x the safe path's time per
token, results/profile_layer_32k_h200.txt).

Usage: python benchmarks/profile_chunk.py --out prof.json [--shapes 1x8192:96] [--gate safe|softplus]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_chunk import parse_shapes  # noqa: E402
from timing import median_ms  # noqa: E402


def protocol_inputs(mbs: int, seq: int, heads: int, d: int = 128, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = mbs * seq
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    x = dict(q=r(1, T, heads, d), k=r(1, T, heads, d), v=r(1, T, heads, d), g=r(1, T, heads, d), beta=r(1, T, heads))
    for t in x.values():
        t.requires_grad_(True)
    A_log = torch.randn(heads, device="cuda", generator=g).mul_(0.3).requires_grad_(True)
    dt_bias = torch.randn(heads * d, device="cuda", generator=g).mul_(0.3).requires_grad_(True)
    cu = torch.arange(0, T + 1, seq, device="cuda", dtype=torch.int64)
    do = r(1, T, heads, d)
    return x, A_log, dt_bias, cu, do


GATES = {"safe": dict(safe_gate=True, lower_bound=-5.0), "softplus": dict(safe_gate=False, lower_bound=None)}


def step(x, A_log, dt_bias, cu, do, gate="safe", **options):
    """One protocol forward+backward (``gate``: a key of GATES); ``options`` go to chunk_kda (e.g.
    checkpoint_every_n_tokens)."""
    from kdakit import chunk_kda

    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     **GATES[gate], **options)
    o.backward(do)


def profile_one(mbs, seq, heads, steps, gate="safe"):
    x, A_log, dt_bias, cu, do = protocol_inputs(mbs, seq, heads)
    step(x, A_log, dt_bias, cu, do, gate)  # compile and warm up
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step(x, A_log, dt_bias, cu, do, gate)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.time_range.elapsed_us()
    rows = sorted(({"kernel": k, "calls_per_step": c / steps, "ms_per_step": t / steps / 1e3}
                   for k, (c, t) in per.items()), key=lambda r: -r["ms_per_step"])
    # Wall time of the same step by CUDA events, for the sum-of-kernels vs end-to-end gap.
    wall_ms = median_ms(lambda: step(x, A_log, dt_bias, cu, do, gate), warmup=0, iters=steps, sync_each=True)
    return {"shape": f"{mbs}x{seq}:{heads}", "gate": gate, "steps": steps,
            "fwd_bwd_ms_median": wall_ms,
            "kernel_ms_sum": sum(r["ms_per_step"] for r in rows), "kernels": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="1x8192:96")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gate", choices=sorted(GATES), default="safe")
    args = ap.parse_args(argv)
    results = []
    for mbs, seq, heads in parse_shapes(args.shapes):
        try:
            res = profile_one(mbs, seq, heads, args.steps, args.gate)
        except Exception as e:  # keep the other shapes' figures; the error is the result of this one
            res = {"shape": f"{mbs}x{seq}:{heads}", "error": repr(e)[:2000]}
        results.append(res)
        print(f"== {res['shape']}: " + (f"step {res['fwd_bwd_ms_median']:.2f} ms, kernels {res['kernel_ms_sum']:.2f} ms"
                                      if "error" not in res else res["error"]), flush=True)
        for r in res.get("kernels", [])[:14]:
            print(f"  {r['ms_per_step']:9.3f} ms  x{r['calls_per_step']:<6g} {r['kernel'][:90]}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("KDAKIT_GIT_SHA", "unknown"),
                       "results": results}, f, indent=1)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
