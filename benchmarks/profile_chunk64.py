"""The 64-token pipeline (``kdakit.ops.kda.chunk``) on the GPU, beside FLA 0.6.0 and kdakit's current default, in
one process per gate: accuracy against a float64 reference (all three on the same inputs), per-kernel CUDA time
of one forward+backward (torch.profiler), forward and forward+backward medians (CUDA events), and the peaks of
one step (allocated and reserved; not the fresh-process protocol of bench_chunk.py).

Gates: ``safe`` (in-kernel lower_bound -5 sigmoid gate, A_log = dt_bias = 0: the memory protocol's), ``softplus``
(in-kernel unbounded gate, A_log / dt_bias drawn as FLA's layer initialises them), ``raw`` (the same softplus
log-decay computed outside in fp32 and passed with use_gate_in_kernel=False, as Kimi Linear does).

Usage: python benchmarks/profile_chunk64.py --out DIR [--shape 1x8192:96] [--gates safe,softplus,raw]
       [--windows none,2048] [--no-fla] [--no-default] [--skip-accuracy]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kdakit.ops.kda.chunk.autograd import chunk64_kda  # noqa: E402
from kdakit.ops.kda.options import kda_options  # noqa: E402
from timing import median_ms  # noqa: E402

TIMING = dict(warmup=3, iters=10, sync_each=True)  # timing.median_ms: each step synced (fwd+bwd steps)

LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def gate_flags(gate: str) -> dict:
    if gate == "safe":
        return dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    if gate == "softplus":
        return dict(use_gate_in_kernel=True, safe_gate=False, lower_bound=None)
    return dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None)


def make_inputs(mbs: int, seq: int, H: int, HV: int, D: int, gate: str, seed: int, dtype=torch.bfloat16,
                lengths: list[int] | None = None) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = mbs * seq if lengths is None else sum(lengths)

    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)

    x = dict(q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, HV, D), g=randn(1, T, HV, D),
             beta=randn(1, T, HV))
    if gate == "safe":
        A_log = torch.zeros(HV, device="cuda")
        dt_bias = torch.zeros(HV * D, device="cuda")
    else:  # FLA's KimiDeltaAttention init: A ~ U(1, 16), dt log-uniform in [1e-3, 0.1]
        A = torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen)
        A_log = torch.log(A)
        dt = torch.exp(torch.rand(HV * D, device="cuda", generator=gen) * (math.log(0.1) - math.log(1e-3))
                       + math.log(1e-3))
        dt_bias = dt + torch.log(-torch.expm1(-dt))
    if gate == "raw":
        g = x["g"].float() + dt_bias.view(HV, D)
        x["g"] = (-A_log.exp().view(HV, 1) * torch.nn.functional.softplus(g)).float()
        A_log = dt_bias = None
    x["A_log"], x["dt_bias"] = A_log, dt_bias
    for name in LEAVES:
        if x[name] is not None:
            x[name].requires_grad_(True)
    starts = [0] + list(torch.tensor(lengths).cumsum(0).tolist()) if lengths else list(range(0, T + 1, seq))
    x["cu_seqlens"] = torch.tensor(starts, dtype=torch.int64, device="cuda")
    x["cu_seqlens_cpu"] = torch.tensor(starts, dtype=torch.int64)
    x["do"] = randn(1, T, HV, D)
    x["gate"] = gate
    return x


def kdakit64(window, keep=False, launch=None):
    def call(x):
        flags = gate_flags(x["gate"])
        opts = kda_options(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                           cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"], **flags)
        A_log, dt_bias = opts.kernel_gate_params(x["A_log"], x["dt_bias"])
        return chunk64_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=A_log, dt_bias=dt_bias,
                           initial_state=None, cu_seqlens=x["cu_seqlens"], opts=opts, window_tokens=window,
                           keep_intermediates=keep, launch=launch)
    return call


def library(fn, extra=None):
    def call(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"], use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, **gate_flags(x["gate"]), **(extra or {}))
    return call


def reference_call(x):
    from kdakit.ops.kda.reference.chunk import chunked_kda_reference
    f = gate_flags(x["gate"])
    return chunked_kda_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["q"].shape[-1] ** -0.5, A_log=x["A_log"],
        dt_bias=x["dt_bias"], cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=f["use_gate_in_kernel"], use_beta_sigmoid_in_kernel=True, lower_bound=f["lower_bound"])


def step(call, x):
    for name in LEAVES:
        if x[name] is not None:
            x[name].grad = None
    o, _ = call(x)
    o.backward(x["do"])
    return o


def grads(x) -> dict:
    return {name: x[name].grad.detach().clone() for name in LEAVES if x[name] is not None}


def rel_rms(ref, got) -> float:
    ref, got = ref.double(), got.double()
    den = ref.pow(2).mean().sqrt().item()
    return (got - ref).pow(2).mean().sqrt().item() / max(den, 1e-30)


def accuracy(gate: str, calls: dict, seed: int, forward_only: bool = False) -> dict:
    x = make_inputs(1, 0, 4, 4, 128, gate, seed, lengths=[1500, 64, 2532])
    ref_in = {k: (v.detach().double().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
                  and v.is_floating_point() else v) for k, v in x.items()}
    ref_in["do"] = x["do"].double()  # the same cotangent for every side
    if forward_only:
        with torch.no_grad():
            o_ref = reference_call(ref_in)[0]
        g_ref = {}
    else:
        o_ref = step(reference_call, ref_in).detach()
        g_ref = grads(ref_in)
    out = {}
    for name, call in calls.items():
        try:
            if forward_only:
                with torch.no_grad():
                    o = call(x)[0]
            else:
                o = step(call, x).detach()
        except Exception as e:  # noqa: BLE001 - report and go on to the next implementation
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            continue
        g = {} if forward_only else grads(x)
        row = {"o": rel_rms(o_ref, o)}
        row.update({f"d{k}": rel_rms(g_ref[k], g[k]) for k in g_ref})
        row["finite"] = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(t).all()) for t in g.values())
        out[name] = row
    return out


def timing(call, x, forward_only: bool = False) -> dict:
    def fwd():
        with torch.no_grad():
            call(x)

    def fwd_grad():
        call(x)

    res = {"fwd_nograd_ms": median_ms(fwd, **TIMING), "fwd_ms": median_ms(fwd_grad, **TIMING)}
    if not forward_only:
        res["fwd_bwd_ms"] = median_ms(lambda: step(call, x), **TIMING)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fwd() if forward_only else step(call, x)
    torch.cuda.synchronize()
    res["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return res


def profile(call, x, steps: int = 3, forward_only: bool = False) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile as prof

    def one():
        if forward_only:
            with torch.no_grad():
                call(x)
        else:
            step(call, x)
    one()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": e.key[:90], "calls": e.count // steps, "ms": t / 1000 / steps})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:25]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1x8192:96")
    ap.add_argument("--gates", default="safe,softplus,raw")
    ap.add_argument("--windows", default="none", help="comma-separated: none | N (recomputing, windows of N tokens) | "
                    "fastN / fastnone (the forward keeps its intermediates)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-default", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--forward-only", action="store_true", help="time forwards only (no backward anywhere)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    mbs_seq, heads = args.shape.split(":")
    mbs, seq = (int(s) for s in mbs_seq.split("x"))
    H = int(heads)
    calls = {}
    for w in args.windows.split(","):  # "fast2048": keep the forward's intermediates, backward windows of 2048
        keep = w.startswith("fast")
        size = w[4:] if keep else w
        calls[f"kdakit64_{'fast' if keep else 'w'}{size}"] = kdakit64(None if size in ("none", "") else int(size), keep)
    if not args.no_default:
        from kdakit import chunk_kda
        calls["kdakit_default"] = library(chunk_kda)
    if not args.no_fla:
        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
        from fla.ops.kda import chunk_kda as fla_chunk
        calls["fla"] = library(fla_chunk)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "shape": args.shape,
              "git_sha": os.environ.get("KDAKIT_GIT_SHA"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "gates": {}}
    path = os.path.join(args.out, "profile_chunk64.json")
    for gate in args.gates.split(","):
        cell = result["gates"].setdefault(gate, {})
        if not args.skip_accuracy:
            cell["accuracy"] = accuracy(gate, calls, args.seed, args.forward_only)
            print(gate, "accuracy", json.dumps(cell["accuracy"]), flush=True)
        x = make_inputs(mbs, seq, H, H, 128, gate, args.seed)
        for name, call in calls.items():
            try:
                cell[name] = timing(call, x, args.forward_only)
                if not args.skip_profile and (name.startswith("kdakit64") or name == "fla"):
                    cell[name]["profile"] = profile(call, x, forward_only=args.forward_only)
            except Exception as e:  # noqa: BLE001
                cell[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(gate, name, json.dumps({k: v for k, v in cell[name].items() if k != "profile"}), flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        for name in calls:
            for r in cell[name].get("profile", [])[:14]:
                print(f"  {gate} {name:18s} {r['kernel'][:60]:60s} {r['calls']:4d} {r['ms']:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
