"""Development measurement on the GPU: what the checkpoint cadence costs and saves, and where reserved
memory goes after a short warm-up call.

1. ``--cadences``: forward+backward time, per-kernel CUDA time and peak allocated of the default chunk
   path at one shape for several ``checkpoint_every_n_tokens`` (at L = 256 = the backward's window the
   window-start stage has nothing to do).
2. ``--snapshot``: in this process, a 1K-token step first (the docs/spec.md §3 protocol's warm-up), then the
   shape's step with the allocator's history recorded; the segments reserved at the peak and the trace
   are written to ``--out-dir`` (``snapshot_<shape>.pickle``, readable with torch.cuda._memory_viz).

Usage: python benchmarks/dev_cadence.py --out-dir DIR [--shape 1x8192:96] [--cadences 2048,512,256] [--snapshot]
(a cadence of 0 is the plan's default)
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_chunk import protocol_inputs  # noqa: E402
from profile_chunk import step as protocol_step  # noqa: E402
from timing import median_ms  # noqa: E402


def timed(fn, reps=10, warmup=2):
    """Median CUDA-event time of ``fn`` in ms over ``reps`` runs after ``warmup`` runs."""
    return median_ms(fn, warmup=warmup, iters=reps, sync_each=True)


def kernel_times(fn, runs=3) -> dict:
    """Per-kernel CUDA time of one call of ``fn`` (torch.profiler, mean of ``runs``): name -> {calls, ms},
    slowest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    kern = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kern.setdefault(e.name, [0, 0.0])
            kern[e.name][0] += 1
            kern[e.name][1] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
    return {k: {"calls": c // runs, "ms": round(t / runs, 4)}
            for k, (c, t) in sorted(kern.items(), key=lambda kv: -kv[1][1])}


def step_fn(mbs, seq, heads, cadence):
    x, A_log, dt_bias, cu, do = protocol_inputs(mbs, seq, heads)

    def step():
        for t in (*x.values(), A_log, dt_bias):
            t.grad = None  # as the docs/spec.md §3 protocol: no gradient accumulation kernels in the timing
        protocol_step(x, A_log, dt_bias, cu, do, checkpoint_every_n_tokens=cadence)
    return step, x


def cadence_row(mbs, seq, heads, cadence) -> dict:
    step, x = step_fn(mbs, seq, heads, cadence)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - base
    ms = timed(step, reps=10, warmup=1)
    kt = kernel_times(step, runs=2)
    return {"cadence": cadence, "fwd_bwd_ms": ms, "peak_above_held_gib": peak_extra / 2**30,
            "kernels": kt}


def snapshot(mbs, seq, heads, out_dir) -> dict:
    tag = f"{mbs}x{seq}_{heads}"
    small, _ = step_fn(1, 1024, heads, None)
    small()
    torch.cuda.synchronize()
    del small
    after_warm = torch.cuda.memory_snapshot()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=200000)
    step, x = step_fn(mbs, seq, heads, None)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(os.path.join(out_dir, f"snapshot_{tag}.pickle"), "wb") as f:
        pickle.dump({"after_warmup_segments": after_warm, "snapshot": snap}, f)
    return {"shape": tag, "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "warmup_segments_mb": sorted((s["total_size"] / 2**20 for s in after_warm), reverse=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--shape", default="1x8192:96")
    ap.add_argument("--cadences", default="")
    ap.add_argument("--snapshot", action="store_true")
    a = ap.parse_args()
    mbs, rest = a.shape.split("x")
    seq, heads = (int(s) for s in rest.split(":"))
    mbs = int(mbs)
    os.makedirs(a.out_dir, exist_ok=True)
    res = {"shape": a.shape}
    if a.snapshot:
        res["snapshot"] = snapshot(mbs, seq, heads, a.out_dir)
    if a.cadences:
        res["cadences"] = [cadence_row(mbs, seq, heads, int(c) or None) for c in a.cadences.split(",")]  # 0: the plan's
    name = "cadence" if a.cadences else "snapshot"
    with open(os.path.join(a.out_dir, f"{name}_{a.shape.replace(':', '_')}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "cadences"}, indent=1)[:3000])
    for r in res.get("cadences", []):
        print(r["cadence"], f"{r['fwd_bwd_ms']:.2f} ms", f"peak+{r['peak_above_held_gib']:.3f} GiB",
              [(k, round(v["ms"], 2)) for k, v in list(r["kernels"].items())[:6]])


if __name__ == "__main__":
    main()
