"""Launch-config sweep of the 64-token pipeline's kernels on the GPU: for each variant (some of one kernel's
launch constants overridden by name, passed to ``chunk64_kda(..., launch=...)``; ``kdakit/ops/kda/chunk/launch.py``),
the per-kernel CUDA time of one forward+backward (torch.profiler, mean of 3 steps) at one shape, gate and window.
The chosen values go back into the kernel files.

Usage: python benchmarks/tune_chunk64.py --out DIR [--shape 1x8192:96] [--gate softplus] [--window 1024]
       [--only chunk_prep_kernel,chunk_walk_fwd_kernel]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.profile_chunk64 import kdakit64, make_inputs, step  # noqa: E402

# kernel name in the profile -> (its module, variants: launch overrides); the first variant is the shipped config
VARIANTS = {
    "chunk_prep_kernel": ("prep", [{}, {"PREP_BLOCK_K": 64}, {"PREP_BLOCK_K": 64, "PREP_NUM_WARPS": 8},
                                   {"PREP_BLOCK_K": 128, "PREP_NUM_WARPS": 8}, {"PREP_NUM_WARPS": 2}]),
    "chunk_walk_fwd_kernel": ("walk", [{}, {"WALK_FWD_WARPS": 8},
                                       {"WALK_FWD_BLOCK_V": {"bf16": (128,), "fp32": (16,)}, "WALK_FWD_WARPS": 8}]),
    "chunk_intra_diag_kernel": ("intra", [{}, {"DIAG_BLOCK_H": 16, "DIAG_NUM_WARPS": 4},
                                          {"DIAG_BLOCK_H": 8, "DIAG_NUM_WARPS": 1}]),
    "chunk_intra_solve_kernel": ("intra", [{}, {"SOLVE_CONFIG": {"bf16": (16, 1, 2), "fp32": (16, 2, 1)}},
                                           {"SOLVE_CONFIG": {"bf16": (32, 1, 1), "fp32": (16, 2, 1)}}]),
    "chunk_intra_dots_kernel": ("intra", [{}, {"DOTS_CONFIG": {"bf16": (32, 1), "fp32": (32, 2)}}]),
    "chunk_wu_kernel": ("prep", [{}, {"WU_CONFIG": {"bf16": (64, 4), "fp32": (32, 4)}}]),
    "chunk_walk_bwd_kernel": ("walk", [{}, {"WALK_BWD_WARPS": 2}, {"WALK_BWD_BLOCK_V": {"bf16": (64,), "fp32": (16,)}}]),
    "chunk_grads_wy_kernel": ("grads", [
        {}, {"GRADS_WY_NUM_WARPS": 8, "GRADS_WY_BLOCKS": {"bf16": (32, 64), "fp32": (32, 32)}},
        {"GRADS_WY_NUM_STAGES": 3}, {"GRADS_WY_BLOCKS": {"bf16": (64, 64), "fp32": (32, 32)}, "GRADS_WY_NUM_WARPS": 8}]),
    "chunk_grads_wy_dv_kernel": ("grads", [{}, {"GRADS_WY_DV_BLOCKS": {"bf16": (64, 128), "fp32": (64, 32)}},
                                           {"GRADS_WY_DV_BLOCKS": {"bf16": (128, 64), "fp32": (64, 32)}}]),
    "chunk_grads_intra_kernel": ("grads_intra", [
        {}, {"GRADS_INTRA_BLOCK_K": 64}, {"GRADS_INTRA_NUM_WARPS": {"bf16": 4, "fp32": 4}},
        {"GRADS_INTRA_NUM_WARPS": {"bf16": 8, "fp32": 8}},
        {"GRADS_INTRA_BLOCK_K": 64, "GRADS_INTRA_NUM_WARPS": {"bf16": 4, "fp32": 4}},
        {"GRADS_INTRA_BLOCK_K": 64, "GRADS_INTRA_NUM_WARPS": {"bf16": 8, "fp32": 8}}]),
    "chunk_finish_kernel": ("finish", [{}, {"FINISH_NUM_WARPS": 8}, {"FINISH_NUM_WARPS": 2}]),
    "chunk_dav_kernel": ("walk", [{}, {"DAV_BLOCK_V": {"bf16": 64, "fp32": 32}}]),
}


def kernel_times(call, x) -> dict:
    from torch.profiler import ProfilerActivity, profile
    step(call, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step(call, x)
        torch.cuda.synchronize()
    out = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        out[e.key] = out.get(e.key, 0.0) + t / 1000 / 3
    return out


def compiled(fn) -> list:
    """(registers, spills, warps) of the kernel's compiled variants on the device (Triton's JIT cache)."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        for kern in cache[0].values():
            out.append([getattr(kern, "n_regs", None), getattr(kern, "n_spills", None),
                        getattr(getattr(kern, "metadata", None), "num_warps", None)])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1x8192:96")
    ap.add_argument("--gate", default="softplus")
    ap.add_argument("--window", type=int, default=1024, help="window tokens (the default pipeline's at 96 heads)")
    ap.add_argument("--only", default=None)
    args = ap.parse_args(argv)
    mbs_seq, heads = args.shape.split(":")
    mbs, seq = (int(s) for s in mbs_seq.split("x"))
    x = make_inputs(mbs, seq, int(heads), int(heads), 128, args.gate, 0)
    results = {"shape": args.shape, "gate": args.gate, "window": args.window, "kernels": {}}
    order = ["chunk_prep_kernel", "chunk_grads_intra_kernel", "chunk_intra_solve_kernel", "chunk_grads_wy_kernel",
             "chunk_walk_fwd_kernel", "chunk_intra_diag_kernel", "chunk_wu_kernel", "chunk_walk_bwd_kernel",
             "chunk_finish_kernel", "chunk_dav_kernel", "chunk_grads_wy_dv_kernel"]
    names = args.only.split(",") if args.only else order
    for kernel in names:
        mod_name, variants = VARIANTS[kernel]
        mod = importlib.import_module(f"kdakit.ops.kda.chunk.{mod_name}")
        rows = []
        for over in variants:
            row = {"override": {k: str(v) for k, v in over.items()}}
            try:
                row.update(ms=kernel_times(kdakit64(args.window, launch=over or None), x).get(kernel),
                           compiled=compiled(getattr(mod, kernel)))
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(kernel, json.dumps(row), flush=True)
            if "illegal memory access" in row.get("error", ""):
                break  # the context is gone
        results["kernels"][kernel] = rows
        with open(os.path.join(args.out, f"tune_chunk64_{args.gate}.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
