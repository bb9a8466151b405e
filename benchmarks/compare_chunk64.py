"""Join ``dev_chunk64.py`` results (one file per shape, kdakit's 64-token pipeline and FLA 0.6.0 in the same
process) and ``bench_layer.py`` results into the comparison files the README's table is made from:
``chunk_vs_fla`` rows per (gate, shape) and ``layer_vs_fla`` rows per shape, with the floor beside each cell.

Usage: python benchmarks/compare_chunk64.py --chunk F [F ...] [--layer F [F ...]] [--variant kdakit64_fast2048]
       --out-chunk chunk_vs_fla_h200.json [--out-layer layer_vs_fla_h200.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json

GIB = 2 ** 30


def floor_gib(shape: str, gate: str) -> float:
    """Inputs + dO + O + gradients in their own dtypes (docs/spec.md §3), bf16 tokens, D = 128; the raw gate's
    log-decay and its gradient are fp32 and it has no A_log / dt_bias."""
    mbs_seq, heads = shape.split(":")
    mbs, seq = (int(s) for s in mbs_seq.split("x"))
    T, H, D = mbs * seq, int(heads), 128
    g_bytes = 4 if gate == "raw" else 2
    tokens = T * H * (2 * D * 2 * 3 + 2 * D * 2 + 2 * D * g_bytes + 2 * 2)  # q k v and grads, o dO, g dg, beta dbeta
    params = 0 if gate == "raw" else 2 * H * (1 + D) * 4  # A_log, dt_bias and their gradients
    return (tokens + params) / GIB


def chunk_rows(paths: list[str], variant: str) -> tuple[list[dict], set]:
    rows, shas = [], set()
    for path in paths:
        data = json.load(open(path))
        shas.add(data.get("git_sha"))
        for gate, cell in data["gates"].items():
            ours, fla = cell.get(variant, {}), cell.get("fla", {})
            if "fwd_bwd_ms" not in ours:
                continue
            rows.append(dict(
                gate=gate, shape=data["shape"], floor_gib=floor_gib(data["shape"], gate),
                kdakit_fwd_ms=ours["fwd_ms"], kdakit_fwd_bwd_ms=ours["fwd_bwd_ms"],
                fla_fwd_ms=fla.get("fwd_ms"), fla_fwd_bwd_ms=fla.get("fwd_bwd_ms"),
                kdakit_peak_alloc_gib=ours["peak_alloc_gib"], kdakit_peak_reserved_gib=ours["peak_reserved_gib"],
                fla_peak_alloc_gib=fla.get("peak_alloc_gib"), fla_peak_reserved_gib=fla.get("peak_reserved_gib"),
                date=data["date"]))
    return rows, shas


def layer_rows(paths: list[str], variant: str) -> list[dict]:
    rows = []
    for path in paths:
        by = {r["backend"]: r for r in json.load(open(path))["results"] if "error" not in r}
        ours, fla = by.get(variant), by.get("fla")
        if ours is None or fla is None:
            continue
        rows.append(dict(shape=f"1x{ours['tokens']}", kdakit_fwd_bwd_ms=ours["fwd_bwd_ms"],
                         fla_fwd_bwd_ms=fla["fwd_bwd_ms"], kdakit_fwd_ms=ours["fwd_ms"], fla_fwd_ms=fla["fwd_ms"],
                         kdakit_peak_alloc_gib=ours["peak_alloc_gib"], fla_peak_alloc_gib=fla["peak_alloc_gib"],
                         kdakit_peak_reserved_gib=ours["peak_reserved_gib"],
                         fla_peak_reserved_gib=fla["peak_reserved_gib"]))
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| gate | shape | floor GiB | kdakit / FLA fwd ms | kdakit / FLA fwd+bwd ms | fwd+bwd ratio | "
           "kdakit / FLA peak GiB |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['gate']} | {r['shape']} | {r['floor_gib']:.3f} | {r['kdakit_fwd_ms']:.2f} / "
                   f"{r['fla_fwd_ms']:.2f} | {r['kdakit_fwd_bwd_ms']:.1f} / {r['fla_fwd_bwd_ms']:.1f} | "
                   f"{r['kdakit_fwd_bwd_ms'] / r['fla_fwd_bwd_ms']:.2f}x | {r['kdakit_peak_alloc_gib']:.2f} / "
                   f"{r['fla_peak_alloc_gib']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", nargs="+", required=True)
    ap.add_argument("--layer", nargs="*", default=[])
    ap.add_argument("--variant", default="kdakit64_fast2048")
    ap.add_argument("--layer-variant", default="kdakit_chunk64_fast")
    ap.add_argument("--out-chunk", required=True)
    ap.add_argument("--out-layer")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    rows, shas = chunk_rows(args.chunk, args.variant)
    sha = ",".join(sorted(s for s in shas if s))
    meta = {"git_sha": sha, "variant": args.variant, "sources": args.chunk}
    with open(args.out_chunk, "w") as f:
        json.dump({"kdakit": meta, "fla": {"version": "0.6.0", "git_sha": sha}, "rows": rows}, f, indent=1)
    if args.out_layer:
        with open(args.out_layer, "w") as f:
            json.dump({"kdakit": {"variant": args.layer_variant, "sources": args.layer},
                       "rows": layer_rows(args.layer, args.layer_variant)}, f, indent=1)
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
