"""Launch-config sweep of the 64-token pipeline on the GPU: forward and forward+backward medians (CUDA events) of
``chunk64_kda`` for each named variant of the kernels' launch constants, at one shape and gate per row.

A variant patches module-level launch constants (the ones each launcher reads at call time) for its rows only and
restores them after; the baseline row of each (shape, gate, window) runs first. Inputs are dev_chunk64's (FLA's
layer init for the unbounded gates). Results: one JSON with a row per (shape, gate, window, variant).

Usage: python benchmarks/sweep_chunk64.py --out FILE [--rows 1x8192:96:softplus:1024,...] [--variants a,b]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kdakit.ops.kda.chunk.grads_intra as grads_intra  # noqa: E402
import kdakit.ops.kda.chunk.intra as intra  # noqa: E402
import kdakit.ops.kda.chunk.prep as prep  # noqa: E402
from dev_chunk64 import kdakit64, make_inputs, timing  # noqa: E402

# name -> [(module, attribute, value)]
VARIANTS = {
    "base": [],
    "solve_bk16": [(intra, "SOLVE_CONFIG", {"bf16": (16, 1, 2), "fp32": (16, 2, 1)})],
    "diag_bh4": [(intra, "DIAG_BLOCK_H", 4)],
    "diag_bh8": [(intra, "DIAG_BLOCK_H", 8)],
    "diag_w2": [(intra, "DIAG_NUM_WARPS", 2)],
    "gintra_w4": [(grads_intra, "GRADS_INTRA_NUM_WARPS", {"bf16": 4, "fp32": 4})],
    "wu_w4": [(prep, "WU_CONFIG", {"bf16": (64, 4), "fp32": (32, 4)})],
    "prep_w8": [(prep, "PREP_NUM_WARPS", 8)],
}
ROWS = ("1x8192:96:softplus:1024,1x8192:96:safe:1024,1x8192:16:softplus:1024,1x8192:16:softplus:2048,"
        "1x8192:16:softplus:4096,1x8192:16:softplus:none,8x8192:16:softplus:1024")


def parse_row(text: str):
    shape, heads, gate, window = text.split(":")
    B, T = (int(x) for x in shape.split("x"))
    return B, T, int(heads), gate, None if window == "none" else int(window)


def run(rows, variants) -> list[dict]:
    out = []
    for text in rows:
        B, T, H, gate, window = parse_row(text)
        x = make_inputs(B, T, H, H, 128, gate, seed=0)
        for name in variants:
            patches = VARIANTS[name]
            if gate == "safe" and name.startswith("diag"):
                continue  # the diag kernel does not run with the safe gate
            saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
            try:
                for m, a, v in patches:
                    setattr(m, a, v)
                res = timing(kdakit64(window), x)
            except Exception as e:  # noqa: BLE001 - report the variant's failure and go on
                res = {"error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                for m, a, v in saved:
                    setattr(m, a, v)
            row = {"row": text, "variant": name, **res}
            print(json.dumps(row), flush=True)
            out.append(row)
        del x
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    for name in variants:
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown {name!r}; known: {', '.join(VARIANTS)}")
    rows = run(args.rows.split(","), variants)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "git_sha": os.environ.get("KDAKIT_GIT_SHA", "unknown")}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
