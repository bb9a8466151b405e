"""kdakit vs FLA 0.6.0 chunk_kda on the GPU: correctness gate, then peak memory and time.

Protocol: SPEC §3 (``kdakit.memory.measure``: one fresh process per backend x shape, median of
three steady-state forward+backward peaks, expandable_segments off, FLA with
FLA_DISABLE_BACKEND_DISPATCH=1 and the same flags). Beside each figure: the memory floor
(inputs + dO + O + gradients) and two time floors:

* bytes floor: forward reads q, k, v, g, beta and writes o (10·T·H·D + 2·T·H bytes in bf16);
  forward+backward also reads them and dO again and writes five gradients
  (28·T·H·D + 6·T·H bytes), at the 4.3 TB/s measured H200 copy bandwidth;
* FLOPs floor: the matmul FLOPs of the chunked form at C = 64 (FLA's chunk), per token and
  head 2·C·(3K + 2V) + 6·K·V forward, three times that for forward+backward, at 790 TFLOP/s.

Usage: python benchmarks/bench_chunk.py --out results.json [--backends kdakit,fla]
       [--shapes 1x8192:96,8x8192:16,1x8192:128,1x131072:96] [--skip-gate]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

SHAPES = "1x8192:96,8x8192:16,1x8192:128,1x131072:96"
COPY_BW = 4.3e12     # bytes/s, measured device-to-device copy on the H200 (SPEC §7)
MATMUL_RATE = 790e12  # FLOP/s, measured bf16 8192^3 matmul on the H200 (SPEC §7)

def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        mbs_seq, heads = item.split(":")
        mbs, seq = mbs_seq.lower().split("x")
        out.append((int(mbs), int(seq), int(heads)))
    return out


def time_floors_ms(mbs: int, seq: int, heads: int, d: int = 128, chunk: int = 64) -> dict:
    th = mbs * seq * heads
    fwd_bytes = 10 * th * d + 2 * th
    fb_bytes = 28 * th * d + 6 * th
    fwd_flops = th * (2 * chunk * (3 * d + 2 * d) + 6 * d * d)
    return {
        "fwd_bytes_floor_ms": 1e3 * fwd_bytes / COPY_BW,
        "fwd_flops_floor_ms": 1e3 * fwd_flops / MATMUL_RATE,
        "fwd_bwd_bytes_floor_ms": 1e3 * fb_bytes / COPY_BW,
        "fwd_bwd_flops_floor_ms": 1e3 * 3 * fwd_flops / MATMUL_RATE,
    }


def correctness_gate(T: int = 2048, H: int = 4, seed: int = 0) -> dict:
    """kdakit's Triton path (bf16, SPEC §3 flags plus states) against the float64 chunked reference."""
    from kdakit import chunk_kda
    from kdakit.testing import SPEC_RMS_LIMITS, error_report, float64_copy, make_kda_inputs, run_kda

    inp = make_kda_inputs(T=T, H=H, HV=H, K=128, V=128, dtype=torch.bfloat16, device="cuda", gate="safe",
                          seqlens=[T // 4, T // 2 + 5, T // 4 - 5], initial_state="kv",
                          generator=torch.Generator().manual_seed(seed))
    got = run_kda(chunk_kda, inp, seed=seed)
    ref_inp = float64_copy(inp)

    def ref_fn(*a, **kw):
        os.environ["KDAKIT_BACKEND"] = "torch"
        try:
            return chunk_kda(*a, **kw)
        finally:
            os.environ.pop("KDAKIT_BACKEND")

    ref = run_kda(ref_fn, ref_inp, seed=seed)
    rows = {}
    for name, lim in SPEC_RMS_LIMITS.items():
        rep = error_report(name, ref[name], got[name])
        rows[name] = {"max_abs": rep.max_abs, "rms_ratio": rep.rms_ratio, "limit": lim, "ok": rep.rms_ratio <= lim}
    return {"shape": f"T={T} (3 packed sequences) H={H} K=V=128 bf16", "errors": rows,
            "ok": all(r["ok"] for r in rows.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", default="kdakit,fla")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--cell-timeout", type=float, default=420.0)
    ap.add_argument("--skip-gate", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_chunk: no CUDA device", file=sys.stderr)
        return 2

    from kdakit.memory.measure import MeasureOptions, markdown_table, run_measure

    # The device copy of the tree has no .git: run_gpu.sh's caller passes the commit in KDAKIT_GIT_SHA.
    sha = os.environ.get("KDAKIT_GIT_SHA") or "unknown"
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "git_sha": sha,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "protocol": "SPEC §3: bf16, D=128, l2norm + beta sigmoid + safe gate (lb -5) in kernel, cu_seqlens, "
                    "no states, 7 inputs differentiated; median of 3 fwd+bwd peaks; fresh process per cell",
    }
    if not args.skip_gate:
        gate = correctness_gate()
        result["correctness_gate"] = gate
        print(json.dumps({"correctness_gate": gate}, indent=1), flush=True)
        if not gate["ok"]:
            print("bench_chunk: correctness gate FAILED; no timings taken", file=sys.stderr)
            json.dump(result, open(args.out, "w"), indent=1)
            return 1
        torch.cuda.empty_cache()

    shapes = parse_shapes(args.shapes)
    done = []

    def keep(record):
        # Written after every cell, so a run cut short by its time limit keeps what it measured.
        record.update(time_floors_ms(record["mbs"], record["seq"], record["heads"]))
        done.append(record)
        with open(args.out, "w") as f:
            json.dump(dict(result, records=done), f, indent=1)

    records = run_measure(args.backends.split(","), shapes, MeasureOptions(timeout_s=args.cell_timeout),
                          on_result=keep)
    by = {(r["backend"], r["mbs"], r["seq"], r["heads"]): r for r in records}
    comparisons = []
    for mbs, seq, heads in shapes:
        a, b = by.get(("kdakit", mbs, seq, heads)), by.get(("fla", mbs, seq, heads))
        if a and b and a.get("status") == "ok" and b.get("status") == "ok":
            comparisons.append({
                "shape": f"{mbs}x{seq}:{heads}",
                "peak_alloc_ratio_kdakit_over_fla": a["peak_alloc_gib"] / b["peak_alloc_gib"],
                "fwd_ratio_kdakit_over_fla": a["fwd_ms"] / b["fwd_ms"],
                "fwd_bwd_ratio_kdakit_over_fla": a["fwd_bwd_ms"] / b["fwd_bwd_ms"],
            })
    result["records"] = records
    result["comparisons"] = comparisons
    result["markdown"] = markdown_table(records)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(result["markdown"])
    for c in comparisons:
        print(json.dumps(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
