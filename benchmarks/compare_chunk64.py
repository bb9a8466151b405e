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


# each kdakit kernel and the FLA 0.6.0 kernels that do the same work (FLA's names; all their calls in one step,
# its backward's recomputation included; chunk_local_cumsum is FLA's reverse cumsum in the backward, and also
# its forward cumsum of a precomputed log-decay)
COUNTERPARTS = {
    "chunk_prep_kernel": ["kda_gate_chunk_cumsum_vector_kernel", "l2norm_fwd_kernel", "fused_beta_sigmoid_fwd_kernel"],
    "chunk_intra_diag_kernel+chunk_intra_dots_kernel": ["chunk_kda_fwd_kernel_intra_token_parallel",
                                                        "chunk_kda_fwd_kernel_intra_sub_chunk"],
    "chunk_intra_solve_kernel": ["chunk_kda_fwd_kernel_inter_solve_fused"],
    "chunk_wu_kernel": ["recompute_w_u_fwd_kda_kernel"],
    "chunk_walk_fwd_kernel": ["chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gla_fwd_kernel_o"],
    "chunk_dav_kernel": ["chunk_kda_bwd_kernel_dAv"],
    "chunk_walk_bwd_kernel": ["chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"],
    "chunk_grads_wy_kernel+chunk_grads_wy_dv_kernel": ["chunk_kda_bwd_kernel_wy_dqkg_fused"],
    "chunk_grads_intra_kernel": ["chunk_kda_bwd_kernel_intra"],
    "chunk_finish_kernel": ["l2norm_bwd_kernel", "kda_gate_bwd_kernel", "chunk_local_cumsum_vector_kernel",
                            "fused_beta_sigmoid_bwd_kernel"],
}


def profile_rows(path: str, variant: str) -> dict:
    """Per gate: each kdakit kernel's CUDA ms in one forward+backward beside its FLA counterparts' (same run)."""
    data = json.load(open(path))
    out = {}
    for gate, cell in data["gates"].items():
        ours = {r["kernel"]: r for r in cell.get(variant, {}).get("profile", [])}
        theirs = {r["kernel"]: r for r in cell.get("fla", {}).get("profile", [])}
        if not ours:
            continue
        rows = []
        for mine, fla_names in COUNTERPARTS.items():
            ms = sum(ours[k]["ms"] for k in mine.split("+") if k in ours)
            fla_ms = sum(theirs[k]["ms"] for k in fla_names if k in theirs)
            rows.append(dict(kdakit=mine, kdakit_ms=ms, fla=[k for k in fla_names if k in theirs], fla_ms=fla_ms,
                             ratio=ms / fla_ms if fla_ms else None))
        out[gate] = dict(shape=data["shape"], git_sha=data.get("git_sha"), date=data["date"], variant=variant,
                         kdakit_total_ms=sum(r["ms"] for r in ours.values()),
                         fla_total_ms=sum(r["ms"] for r in theirs.values()), kernels=rows)
    return out


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
    ap.add_argument("--profile", help="a dev_chunk64.py result with profiles: write profile_chunk64_<gate>_h200.json "
                    "beside --out-chunk")
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
    if args.profile:
        import os
        for gate, prof in profile_rows(args.profile, args.variant).items():
            path = os.path.join(os.path.dirname(args.out_chunk) or ".", f"profile_chunk64_{gate}_h200.json")
            with open(path, "w") as f:
                json.dump(prof, f, indent=1)
            print(f"{gate}: kdakit {prof['kdakit_total_ms']:.2f} ms, FLA {prof['fla_total_ms']:.2f} ms")
            for r in prof["kernels"]:
                print(f"  {r['kdakit']:48s} {r['kdakit_ms']:6.2f}  FLA {r['fla_ms']:6.2f}  "
                      f"{'%.2fx' % r['ratio'] if r['ratio'] else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
