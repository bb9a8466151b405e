"""kdakit vs FLA from two bench_chunk.py results files: one table with ratios and floors.

run_gpu.sh's `chunk` and `fla` stages write separate files (each cell is its own process either
way); this joins them per shape, keeps each side's provenance (git sha, date, versions), and
prints the markdown table of the README: peak allocated (and reserved) beside the floor and the
1.10 x floor target, forward and forward+backward times with the bytes / FLOPs floors, and the
kdakit / FLA ratios.

Usage: python benchmarks/compare_chunk.py --kdakit chunk_kdakit.json --fla chunk_fla.json --out chunk_vs_fla.json
"""

from __future__ import annotations

import argparse
import json
import sys

PROVENANCE = ("gpu", "torch", "triton", "git_sha", "date")


def _cells(path: str, backend: str) -> tuple[dict, dict]:
    with open(path) as f:
        data = json.load(f)
    cells = {f"{r['mbs']}x{r['seq']}:{r['heads']}": r for r in data.get("records", [])
             if r.get("backend") == backend and r.get("status") == "ok"}
    return cells, {k: data.get(k) for k in PROVENANCE}


def compare(kdakit_path: str, fla_path: str) -> dict:
    ours, ours_env = _cells(kdakit_path, "kdakit")
    theirs, theirs_env = _cells(fla_path, "fla")
    rows = []
    for shape, a in ours.items():
        b = theirs.get(shape)
        row = {"shape": shape, "floor_gib": a["floor_gib"], "target_gib": 1.10 * a["floor_gib"],
               "kdakit_peak_alloc_gib": a["peak_alloc_gib"], "kdakit_peak_reserved_gib": a["peak_reserved_gib"],
               "kdakit_fwd_ms": a["fwd_ms"], "kdakit_fwd_bwd_ms": a["fwd_bwd_ms"],
               "fwd_bwd_bytes_floor_ms": a.get("fwd_bwd_bytes_floor_ms"),
               "fwd_bwd_flops_floor_ms": a.get("fwd_bwd_flops_floor_ms")}
        if b is not None:
            row.update(fla_peak_alloc_gib=b["peak_alloc_gib"], fla_fwd_ms=b["fwd_ms"], fla_fwd_bwd_ms=b["fwd_bwd_ms"],
                       peak_ratio=a["peak_alloc_gib"] / b["peak_alloc_gib"], fwd_ratio=a["fwd_ms"] / b["fwd_ms"],
                       fwd_bwd_ratio=a["fwd_bwd_ms"] / b["fwd_bwd_ms"])
        rows.append(row)
    return {"kdakit": dict(ours_env, file=kdakit_path), "fla": dict(theirs_env, file=fla_path), "rows": rows}


def markdown(result: dict) -> str:
    lines = ["| shape | floor | target | kdakit peak (reserved) | FLA peak | ratio | kdakit fwd | FLA fwd | "
             "kdakit fwd+bwd | FLA fwd+bwd | ratio | fwd+bwd floors bytes / FLOPs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        fla = "fla_fwd_ms" in r
        lines.append(
            f"| {r['shape']} | {r['floor_gib']:.3f} | {r['target_gib']:.2f} | {r['kdakit_peak_alloc_gib']:.3f} "
            f"({r['kdakit_peak_reserved_gib']:.3f}) | "
            + (f"{r['fla_peak_alloc_gib']:.3f} | {r['peak_ratio']:.2f}x | " if fla else "- | - | ")
            + f"{r['kdakit_fwd_ms']:.2f} | " + (f"{r['fla_fwd_ms']:.2f} | " if fla else "- | ")
            + f"{r['kdakit_fwd_bwd_ms']:.1f} | " + (f"{r['fla_fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio']:.2f}x | "
                                                   if fla else "- | - | ")
            + f"{r['fwd_bwd_bytes_floor_ms']:.2f} / {r['fwd_bwd_flops_floor_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kdakit", required=True)
    ap.add_argument("--fla", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = compare(args.kdakit, args.fla)
    result["markdown"] = markdown(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(result["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
