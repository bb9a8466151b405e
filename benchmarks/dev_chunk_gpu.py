"""Development check of the experimental 64-token pipeline (KDAKIT_CHUNK_PIPELINE=chunk64) on the GPU:
accuracy against the float64 chunked reference at real head sizes, then per-kernel CUDA times and step
times at one shape, for a few launch configurations.

Usage: python benchmarks/dev_chunk_gpu.py --out dev.json [--shape 1x8192:96] [--variants grads=8,states=4;grads=4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_chunk import protocol_inputs  # noqa: E402  (the protocol's inputs, shared with the profiler)
from timing import median_ms  # noqa: E402


def accuracy(gate: str, T_lens, H: int, seed: int = 0) -> dict:
    from kdakit import chunk_kda
    from kdakit.testing import error_report, float64_copy, make_kda_inputs, run_kda

    gen = torch.Generator().manual_seed(seed)
    inp = make_kda_inputs(T=sum(T_lens), H=H, HV=H, K=128, V=128, dtype=torch.bfloat16, device="cuda", gate=gate,
                          seqlens=list(T_lens), initial_state="kv", generator=gen)
    got = run_kda(chunk_kda, inp, seed=1)
    os.environ["KDAKIT_BACKEND"] = "torch"
    try:
        ref = run_kda(chunk_kda, float64_copy(inp), seed=1)
    finally:
        del os.environ["KDAKIT_BACKEND"]
    return {n: error_report(n, ref[n], got[n]).rms_ratio for n in got if n in ref}


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


def perf(mbs, seq, heads) -> dict:
    from kdakit import chunk_kda

    x, A_log, dt_bias, cu, do = protocol_inputs(mbs, seq, heads)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
              lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)
    params = list(x.values()) + [A_log, dt_bias]

    def fwd():
        with torch.no_grad():
            chunk_kda(**x, **kw)

    def fwdbwd():
        o, _ = chunk_kda(**x, **kw)
        torch.autograd.grad(o, params, do)

    t_f = timed(fwd)
    t_fb = timed(fwdbwd)
    kern = kernel_times(fwdbwd)
    return {"fwd_ms": t_f, "fwd_bwd_ms": t_fb, "kernels": kern}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1x8192:96")
    ap.add_argument("--variants", default="")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--gates", default="safe,softplus")
    a = ap.parse_args()
    import kdakit.ops.kda.chunk_bwd64 as M
    import kdakit.ops.kda.chunk_fwd64 as F
    import kdakit.ops.kda.chunk_prep64 as P

    os.environ.setdefault("KDAKIT_CHUNK_PIPELINE", "chunk64")

    res = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("KDAKIT_GIT_SHA", "unknown")}

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    if not a.skip_accuracy:
        for gate in a.gates.split(","):
            t = time.time()
            res[f"accuracy_{gate}"] = accuracy(gate, (1000, 3000, 96), 4)
            print(gate, "accuracy", {k: f"{v:.2e}" for k, v in res[f"accuracy_{gate}"].items()},
                  f"{time.time() - t:.0f}s", flush=True)
            save()
    mbs_seq, heads = a.shape.split(":")
    mbs, seq = (int(s) for s in mbs_seq.split("x"))
    # launch-configuration knobs of the 64-token pipeline, name -> (module, attribute)
    knobs = {"prep": (P, "PREP_NUM_WARPS"), "fwd": (F, "STATE_NUM_WARPS"), "fbv": (F, "STATE_BLOCK_V"),
             "states": (M, "STATES_NUM_WARPS"), "sbv": (M, "STATES_BLOCK_V"), "grads": (M, "GRADS_NUM_WARPS"),
             "gbv": (M, "GRADS_BLOCK_V"), "pair": (M, "PAIR_NUM_WARPS"), "pair64": (F, "PAIR_NUM_WARPS"),
             "solve": (F, "SOLVE_NUM_WARPS"), "wu": (F, "WU_NUM_WARPS"),
             "ibk": (F, "INTRA_BLOCK_K"), "fst": (F, "STATE_NUM_STAGES")}
    variants = [""] + [v for v in a.variants.split(";") if v]
    for var in variants:
        for item in filter(None, var.split(",")):
            name, val = item.split("=")
            mod, attr = knobs[name]
            setattr(mod, attr, int(val))
        t = time.time()
        r = perf(mbs, seq, int(heads))
        r["config"] = {name: getattr(mod, attr) for name, (mod, attr) in knobs.items()}
        res.setdefault("perf", []).append(r)
        print(a.shape, r["config"], f"fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms ({time.time() - t:.0f}s)",
              flush=True)
        for k, v in list(r["kernels"].items())[:8]:
            print(f"   {v['ms']:8.3f} ms  x{v['calls']}  {k[:90]}", flush=True)
        save()


if __name__ == "__main__":
    main()
