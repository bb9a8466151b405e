"""kdakit vs FLA from bench_chunk.py results files: tables with ratios and floors.

* The docs/spec.md §3 shapes (``--kdakit`` and ``--fla``): run_gpu.sh's `chunk` and `fla` stages write separate
  files (each cell is its own process either way); this joins them per shape, keeps each side's
  provenance (git sha, date, versions), and prints the markdown table of the README: peak allocated
  (and reserved) beside the floor and the 1.10 x floor target, forward and forward+backward times
  with the bytes / FLOPs floors, and the kdakit / FLA ratios.
* Sweep (``--sweep``, one or more files holding kdakit and/or FLA records, e.g. run_gpu.sh's
  `sweep` stage): one row per cell (``MBSxSEQ:H[/HV][:gate]``) with both backends' peaks
  (allocated, reserved after a 1K-token call ran first, reserved after ``empty_cache``), the
  reserved target (``1.15 x floor``), forward (no grad), forward (autograd recording) and
  forward+backward times and the kdakit / FLA ratios; a cell measured by only one backend keeps
  the other side's status.

The output JSON carries the commit (``git_sha``) and the environment (GPU, versions, date):
from ``--env`` (run_gpu.sh's env.json) when given, else from the results files.

Usage: python benchmarks/compare_chunk.py [--kdakit chunk_kdakit.json --fla chunk_fla.json]
       [--sweep sweep.json ...] [--env env.json] --out chunk_vs_fla.json
"""

from __future__ import annotations

import argparse
import json
import sys

PROVENANCE = ("gpu", "torch", "triton", "git_sha", "date")
RESERVED_TARGET = 1.15  # peak reserved <= 1.15 x floor when a 1K-token call ran first in the process
ALLOC_TARGET = 1.10


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def cell_label(r: dict) -> str:
    """``MBSxSEQ:H[/HV][:gate]`` of a record (records without value_heads / gate are docs/spec.md §3 cells)."""
    out = f"{r['mbs']}x{r['seq']}:{r['heads']}"
    hv = r.get("value_heads")
    if hv is not None and int(hv) != int(r["heads"]):
        out += f"/{hv}"
    gate = r.get("gate") or "safe"
    if gate != "safe":
        out += f":{gate}"
    return out


def _cells(path: str, backend: str) -> tuple[dict, dict]:
    data = _load(path)
    cells = {cell_label(r): r for r in data.get("records", [])
             if r.get("backend") == backend and r.get("status") == "ok"}
    return cells, {k: data.get(k) for k in PROVENANCE}


def compare(kdakit_path: str, fla_path: str) -> dict:
    ours, ours_env = _cells(kdakit_path, "kdakit")
    theirs, theirs_env = _cells(fla_path, "fla")
    rows = []
    for shape, a in ours.items():
        b = theirs.get(shape)
        row = {"shape": shape, "floor_gib": a["floor_gib"], "target_gib": ALLOC_TARGET * a["floor_gib"],
               "kdakit_peak_alloc_gib": a["peak_alloc_gib"], "kdakit_peak_reserved_gib": a["peak_reserved_gib"],
               "kdakit_fwd_ms": a["fwd_ms"], "kdakit_fwd_bwd_ms": a["fwd_bwd_ms"],
               "fwd_bwd_bytes_floor_ms": a.get("fwd_bwd_bytes_floor_ms"),
               "fwd_bwd_flops_floor_ms": a.get("fwd_bwd_flops_floor_ms")}
        if b is not None:
            row.update(fla_peak_alloc_gib=b["peak_alloc_gib"], fla_fwd_ms=b["fwd_ms"], fla_fwd_bwd_ms=b["fwd_bwd_ms"],
                       peak_ratio=a["peak_alloc_gib"] / b["peak_alloc_gib"], fwd_ratio=a["fwd_ms"] / b["fwd_ms"],
                       fwd_bwd_ratio=a["fwd_bwd_ms"] / b["fwd_bwd_ms"])
            if b.get("peak_reserved_gib") is not None:
                row["fla_peak_reserved_gib"] = b["peak_reserved_gib"]
        if a.get("fwd_nograd_ms") is not None:
            row["kdakit_fwd_nograd_ms"] = a["fwd_nograd_ms"]
            if b is not None and b.get("fwd_nograd_ms") is not None:
                row["fla_fwd_nograd_ms"] = b["fwd_nograd_ms"]
                row["fwd_nograd_ratio"] = a["fwd_nograd_ms"] / b["fwd_nograd_ms"]
        rows.append(row)
    return {"kdakit": dict(ours_env, file=kdakit_path), "fla": dict(theirs_env, file=fla_path), "rows": rows}


def _ratio(a, b):
    return a / b if (a is not None and b) else None


_SIDE_KEYS = ("peak_alloc_gib", "peak_reserved_gib", "peak_reserved_clean_gib", "fwd_nograd_ms", "fwd_ms",
              "fwd_bwd_ms", "fwd_host_ms", "fwd_bwd_host_ms", "warmup_s", "wall_s", "process")


def compare_sweep(paths: list[str]) -> dict:
    """Join kdakit and FLA records of one or more sweep files per cell."""
    records, files = [], []
    for path in paths:
        data = _load(path)
        files.append(dict({k: data.get(k) for k in PROVENANCE}, file=path,
                          process_mode=data.get("process_mode"), protocol=data.get("protocol"),
                          interrupted=data.get("interrupted")))
        records += data.get("records", [])
    order: list[str] = []
    by: dict = {}
    for r in records:
        if r.get("backend") not in ("kdakit", "fla"):
            continue
        label = cell_label(r)
        if label not in order:
            order.append(label)
        prev = by.get((r["backend"], label))
        if prev is None or (prev.get("status") != "ok" and r.get("status") == "ok"):  # an ok record wins
            by[(r["backend"], label)] = r
    rows = []
    for label in order:
        a, b = by.get(("kdakit", label)), by.get(("fla", label))
        ref = a or b
        floor = ref.get("floor_gib")
        row = {"shape": label, "mbs": ref["mbs"], "seq": ref["seq"], "tokens": ref["mbs"] * ref["seq"],
               "heads": ref["heads"], "value_heads": ref.get("value_heads") or ref["heads"],
               "gate": ref.get("gate") or "safe", "floor_gib": floor,
               "reserved_target_gib": RESERVED_TARGET * floor if floor is not None else None}
        for k in ("fwd_bytes_floor_ms", "fwd_flops_floor_ms", "fwd_bwd_bytes_floor_ms", "fwd_bwd_flops_floor_ms"):
            row[k] = ref.get(k)
        for side, r in (("kdakit", a), ("fla", b)):
            if r is None:
                row[f"{side}_status"] = "not run"
                continue
            row[f"{side}_status"] = r.get("status")
            if r.get("status") != "ok":
                row[f"{side}_message"] = r.get("message")
                continue
            for k in _SIDE_KEYS:
                if r.get(k) is not None:
                    row[f"{side}_{k}"] = r[k]
            if floor:
                row[f"{side}_reserved_over_floor"] = r["peak_reserved_gib"] / floor if r.get(
                    "peak_reserved_gib") is not None else None
                row[f"{side}_reserved_target_met"] = (r.get("peak_reserved_gib") is not None
                                                      and r["peak_reserved_gib"] <= RESERVED_TARGET * floor)
        if row["kdakit_status"] == "ok" and row["fla_status"] == "ok":
            row.update(
                peak_ratio=_ratio(a.get("peak_alloc_gib"), b.get("peak_alloc_gib")),
                reserved_ratio=_ratio(a.get("peak_reserved_gib"), b.get("peak_reserved_gib")),
                fwd_nograd_ratio=_ratio(a.get("fwd_nograd_ms"), b.get("fwd_nograd_ms")),
                fwd_ratio=_ratio(a.get("fwd_ms"), b.get("fwd_ms")),
                fwd_bwd_ratio=_ratio(a.get("fwd_bwd_ms"), b.get("fwd_bwd_ms")),
            )
        rows.append(row)
    versions = {}
    for r in records:
        for k, v in (r.get("versions") or {}).items():
            if v is not None:
                versions.setdefault(k, v)
    return {"files": files, "versions": versions, "rows": rows}


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    lines = ["| shape | floor | target | kdakit peak (reserved) | FLA peak (reserved) | ratio | kdakit fwd | FLA fwd | "
             "kdakit fwd+bwd | FLA fwd+bwd | ratio | fwd+bwd floors bytes / FLOPs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        fla = "fla_fwd_ms" in r
        fla_res = f" ({r['fla_peak_reserved_gib']:.3f})" if r.get("fla_peak_reserved_gib") is not None else ""
        lines.append(
            f"| {r['shape']} | {r['floor_gib']:.3f} | {r['target_gib']:.2f} | {r['kdakit_peak_alloc_gib']:.3f} "
            f"({r['kdakit_peak_reserved_gib']:.3f}) | "
            + (f"{r['fla_peak_alloc_gib']:.3f}{fla_res} | {r['peak_ratio']:.2f}x | " if fla else "- | - | ")
            + f"{r['kdakit_fwd_ms']:.2f} | " + (f"{r['fla_fwd_ms']:.2f} | " if fla else "- | ")
            + f"{r['kdakit_fwd_bwd_ms']:.1f} | " + (f"{r['fla_fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio']:.2f}x | "
                                                   if fla else "- | - | ")
            + f"{r['fwd_bwd_bytes_floor_ms']:.2f} / {r['fwd_bwd_flops_floor_ms']:.2f} |")
    return "\n".join(lines)


def sweep_markdown(sweep: dict) -> str:
    lines = ["| cell | tokens | floor GiB | kdakit alloc (reserved, after empty_cache) | FLA alloc (reserved) | "
             "kdakit reserved / floor | kdakit fwd no-grad | FLA fwd no-grad | ratio | kdakit fwd+bwd | FLA fwd+bwd "
             "| ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def side(r, s):
        if r.get(f"{s}_status") != "ok":
            return r.get(f"{s}_status") or "-"
        return (f"{_f(r.get(f'{s}_peak_alloc_gib'), '.3f')} ({_f(r.get(f'{s}_peak_reserved_gib'), '.3f')}"
                + (f", {r[f'{s}_peak_reserved_clean_gib']:.3f}" if s == "kdakit" and r.get(
                    f"{s}_peak_reserved_clean_gib") is not None else "") + ")")

    for r in sweep["rows"]:
        ro = r.get("kdakit_reserved_over_floor")
        mark = "" if ro is None else (" ok" if r.get("kdakit_reserved_target_met") else " over")
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {_f(r['floor_gib'], '.3f')} | {side(r, 'kdakit')} | {side(r, 'fla')} "
            f"| {_f(ro, '.3f')}{mark} | {_f(r.get('kdakit_fwd_nograd_ms'), '.2f')} "
            f"| {_f(r.get('fla_fwd_nograd_ms'), '.2f')} | {_f(r.get('fwd_nograd_ratio'), '.2f')}x "
            f"| {_f(r.get('kdakit_fwd_bwd_ms'), '.2f')} | {_f(r.get('fla_fwd_bwd_ms'), '.2f')} "
            f"| {_f(r.get('fwd_bwd_ratio'), '.2f')}x |".replace("-x |", "- |"))
    return "\n".join(lines)


def environment(env_path: str | None, sources: list[dict], versions: dict | None = None) -> dict:
    """GPU, versions, date and git sha: env.json when given, else the first results file that has them."""
    env = {}
    if env_path:
        try:
            env.update(_load(env_path))
        except (OSError, ValueError) as exc:  # e.g. the env stage failed and left an empty file
            env["env_error"] = f"{env_path}: {exc}"
    for src in sources:
        for k in PROVENANCE:
            if env.get(k) in (None, "unknown") and src.get(k) not in (None, "unknown"):
                env[k] = src[k]
    for k, v in (versions or {}).items():
        env.setdefault(k, v)
    return env


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kdakit", help="bench_chunk.py results of kdakit at the docs/spec.md §3 shapes")
    ap.add_argument("--fla", help="bench_chunk.py results of FLA at the docs/spec.md §3 shapes")
    ap.add_argument("--sweep", action="append", default=[], help="sweep results file(s) (kdakit and/or FLA records)")
    ap.add_argument("--env", default=None, help="run_gpu.sh's env.json (GPU, versions, git sha, date)")
    ap.add_argument("--out", required=True)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if bool(args.kdakit) != bool(args.fla):
        ap.error("--kdakit and --fla go together")
    if not args.kdakit and not args.sweep:
        ap.error("nothing to join: give --kdakit and --fla, or --sweep")
    result: dict = {}
    sources: list[dict] = []
    if args.kdakit:
        result.update(compare(args.kdakit, args.fla))
        result["markdown"] = markdown(result)
        sources += [result["kdakit"], result["fla"]]
        print(result["markdown"])
    versions = {}
    if args.sweep:
        sweep = compare_sweep(args.sweep)
        sweep["markdown"] = sweep_markdown(sweep)
        result["sweep"] = sweep
        sources += sweep["files"]
        versions = sweep["versions"]
        print(sweep["markdown"])
    result["env"] = environment(args.env, sources, versions)
    result["git_sha"] = result["env"].get("git_sha") or "unknown"
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
