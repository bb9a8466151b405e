"""The KDA layer at long context on the GPU: kdakit.nn.KimiDeltaAttention vs FLA 0.6.0's
fla.layers.kda.KimiDeltaAttention (when fla imports): peak memory and forward+backward time.

Each backend runs in a fresh process (its own allocator, so the reserved peaks do not mix). In
it: the layer in bf16 with FLA's KimiDeltaAttention defaults (hidden 2048, 16 heads of 128,
expand_v 1, conv 4; the same seed, so the same weights: kdakit loads FLA's initialization),
x ``[1, T, hidden]`` requiring grad and dy held by the caller; ``warmup`` forward+backward
steps, then one measured step for memory (``max_memory_allocated`` minus the bytes allocated
before the step: weights, their grads, x, dy; ``max_memory_reserved`` as it stands) and
``--runs`` CUDA-event timed steps (median) of forward alone (no grad) and forward+backward.
kdakit's figures come with the floor of tests/gpu/nn/test_nn_layer_gpu.py (the op's planned peak
less O, the pre-conv q/k/v, the f_proj bottleneck, y and dx).

Usage: python benchmarks/bench_layer.py --out results/layer.json [--tokens 131072]
       [--backends kdakit,kdakit_chunk64,kdakit_chunk64_fast,fla] [--runs 5] [--warmup 2] [--timeout 500]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from timing import median_ms  # noqa: E402
CONFIG = dict(hidden_size=2048, expand_v=1, head_dim=128, num_heads=16, layer_idx=0)
GIB = 2.0 ** 30
BACKENDS = ("kdakit", "kdakit_chunk64", "kdakit_chunk64_fast", "fla")


def layer_floor(layer, T) -> dict:
    """The bytes that must be live at kdakit's layer peak (tests/gpu/nn/test_nn_layer_gpu.py)."""
    from kdakit.memory.model import allocated_bytes, kdakit_model, protocol_spec

    spec = protocol_spec(1, T, layer.num_v_heads, qk_heads=layer.num_heads, head_dim=layer.head_dim,
                         value_dim=layer.head_v_dim, varlen=False, gate="softplus")
    op = kdakit_model(spec)
    parts = {
        "op_peak_less_o": op.peak_bytes - allocated_bytes((1, T, layer.num_v_heads, layer.head_v_dim), "bf16"),
        "pre_conv_qkv": 2 * allocated_bytes((1, T, layer.key_dim), "bf16")
        + allocated_bytes((1, T, layer.value_dim), "bf16"),
        "f_proj_bottleneck": allocated_bytes((1, T, layer.head_v_dim), "bf16"),
        "y_and_dx": 2 * allocated_bytes((1, T, layer.hidden_size), "bf16"),
    }
    return {k: v / GIB for k, v in parts.items()} | {"floor_gib": sum(parts.values()) / GIB}


def worker(backend: str, T: int, runs: int, warmup: int) -> dict:
    import torch

    extra = {}
    if backend.startswith("kdakit"):
        sys.path.insert(0, ROOT)
        from kdakit.nn import KimiDeltaAttention
        if backend != "kdakit":  # kdakit_chunk64, kdakit_chunk64_fast: chunk_kda's pipeline option
            extra["pipeline"] = backend[len("kdakit_"):]
    else:
        from fla.layers.kda import KimiDeltaAttention
    torch.manual_seed(0)
    layer = KimiDeltaAttention(**CONFIG, **extra).to("cuda").bfloat16()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, CONFIG["hidden_size"], device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()

    def step():
        x.grad = None
        layer(x)[0].backward(dy)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    out = {"backend": backend, "tokens": T, **CONFIG,
           "peak_alloc_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
           "baseline_alloc_gib": base / GIB, "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}

    def forward():
        with torch.no_grad():
            layer(x)

    out["fwd_ms"] = median_ms(forward, warmup=0, iters=runs, sync_each=True)
    out["fwd_bwd_ms"] = median_ms(step, warmup=0, iters=runs, sync_each=True)
    if backend == "kdakit":
        out |= layer_floor(layer, T)
        out["peak_over_floor"] = out["peak_alloc_gib"] / out["floor_gib"]
    out["device"] = torch.cuda.get_device_name()
    out["torch"] = torch.__version__
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="results JSON path (required)")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--backends", default="kdakit,fla")
    ap.add_argument("--runs", type=int, default=5, help="timed steps per figure (median)")
    ap.add_argument("--warmup", type=int, default=2, help="forward+backward steps before measuring")
    ap.add_argument("--timeout", type=float, default=500.0, help="seconds per backend process")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.runs, args.warmup)))
        return 0
    if not args.out:
        ap.error("--out is required")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"--backends: expected some of {BACKENDS}, got {b!r}")
    results = []
    for b in backends:
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", b, "--tokens", str(args.tokens),
               "--runs", str(args.runs), "--warmup", str(args.warmup)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            results.append({"backend": b, "tokens": args.tokens, "error": f"timed out after {args.timeout} s"})
            continue
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            rec = json.loads(lines[-1]) | {"wall_s": time.time() - t0}
        else:
            rec = {"backend": b, "tokens": args.tokens, "error": (proc.stderr or proc.stdout)[-2000:]}
        results.append(rec)
        print(json.dumps(rec), flush=True)
    by = {r["backend"]: r for r in results if "error" not in r}
    summary = {}
    for name in BACKENDS[:-1]:
        if name in by and "fla" in by:
            a, f = by[name], by["fla"]
            summary |= {f"{k}_{name}_over_fla": a[k] / f[k] for k in ("peak_alloc_gib", "peak_reserved_gib",
                                                                       "fwd_ms", "fwd_bwd_ms")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"results": results, "summary": summary}, fh, indent=2)
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results if r["backend"].startswith("kdakit")) else 1


if __name__ == "__main__":
    sys.exit(main())
