"""Time variants of the 64-token forward's intra kernel alone on the GPU (development tool).

Each variant is chunk_fwd64.py's source with parts switched off (timing only: the results of an ablated
kernel are not the operator's), loaded as its own module; run_intra is timed on the docs/spec.md §3 inputs
(median of 20 CUDA-event runs after 3 warm-ups).

Usage: python benchmarks/dev_intra64.py --out intra.json [--shape 1x8192:96] [--variants full,nopair,...]
       [--old-source path/to/other/chunk_fwd64.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dev_chunk_gpu import kernel_times, timed  # noqa: E402
from profile_chunk import protocol_inputs  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kdakit", "ops", "kda", "chunk_fwd64.py")

ABLATIONS = {
    # the pairwise matrices: two plain dots instead
    "nopair": ("        dqk, dkk = pairwise_qk_kk_block(qn, kn, G, SAFE, C, SUBC, OP_BF16, EMULATE_BF16, DOT_PREC)\n",
               "        dqk = tl.dot(qn.to(tl.bfloat16), tl.trans(kn.to(tl.bfloat16)))\n"
               "        dkk = tl.dot(kn.to(tl.bfloat16), tl.trans(kn.to(tl.bfloat16)))\n"),
    "noinv": ("    unit_lower_inverse_in_place(scratch + (i_t * HV + i_hv) * (C * C), C, SUBC)\n", "    pass\n"),
    "nowu": ("    for k0 in tl.static_range(0, K, BK):\n        X = dot_operand(", "    for k0 in tl.static_range(0, 0, BK):\n        X = dot_operand("),
    "nou": ("    for v0 in tl.static_range(0, V, BV):\n        vb =", "    for v0 in tl.static_range(0, 0, BV):\n        vb ="),
}


def load_variant(name: str, src: str):
    for part in filter(None, name.split("+")):
        if part in ("full", "old") or (part[:1] in "psuwr" and part[1:].isdigit()):
            continue
        old, new = ABLATIONS[part]
        if old not in src:
            raise SystemExit(f"ablation {part}: pattern not found")
        src = src.replace(old, new)
    path = f"/tmp/kdakit_intra_{abs(hash(name))}.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"kdakit.ops.kda._intra_{abs(hash(name))}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1x8192:96")
    ap.add_argument("--variants", default="full")
    ap.add_argument("--old-source", default="")
    ap.add_argument("--forward", action="store_true", help="also time chunk_kda's forward (no grad) on both pipelines")
    a = ap.parse_args()
    from kdakit.ops.kda.chunk_prep64 import chunk64_options, chunk64_tables
    from kdakit.ops.kda.options import kda_options

    mbs_seq, heads = a.shape.split(":")
    mbs, seq = (int(s) for s in mbs_seq.split("x"))
    x, A_log, dt_bias, cu, _ = protocol_inputs(mbs, seq, int(heads))
    seqlens = [seq] * mbs
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 allow_neg_eigval=False, safe_gate=True, lower_bound=-5.0, state_v_first=False)
    q, k, v, g, beta = (x[n].detach() for n in ("q", "k", "v", "g", "beta"))
    call = kda_options(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, **flags)
    opts = chunk64_options(call, q, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, seqlens=seqlens,
                           tensors=dict(q=q, k=k, v=v, g=g, beta=beta))
    pairs, _ = chunk64_tables(opts, seqlens, q.device)
    out = torch.empty_like(v)
    res = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("KDAKIT_GIT_SHA", "unknown"),
           "shape": a.shape, "variants": {}}
    for name in a.variants.split(","):
        t = time.time()
        src = open(a.old_source if name.startswith("old") and a.old_source else SRC).read()
        try:
            mod = load_variant(name, src)
            for part in name.split("+"):
                # launch knobs: p<warps> pair kernel, s<warps> solve kernel, u<warps> wu kernel, w<warps> the
                # fused kernel of an older source
                for pre, attr in (("p", "PAIR_NUM_WARPS"), ("s", "SOLVE_NUM_WARPS"), ("u", "WU_NUM_WARPS"),
                                  ("w", "INTRA_NUM_WARPS"), ("r", "PAIR_REFS_BY_RESHAPE")):
                    if part.startswith(pre) and part[1:].isdigit():
                        setattr(mod, attr, int(part[1:]))

            def fn():
                mod.run_intra(q, k, v, g, beta, A_log, dt_bias, cu, pairs, out, opts)

            res["variants"][name] = {"ms": timed(fn, reps=20, warmup=3)}
        except Exception as e:  # report and go on: one variant's failure must not hide the others
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, res["variants"][name], f"({time.time() - t:.0f}s)", flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.forward:
        res["forward"] = forward_times(x, A_log, dt_bias, cu)
        print("forward", res["forward"], flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def forward_times(x, A_log, dt_bias, cu) -> dict:
    """chunk_kda without grad per pipeline: median of 20 CUDA-event runs and per-kernel CUDA ms."""
    from kdakit import chunk_kda

    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
              lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)
    out = {}
    for pipe in ("windowed", "chunk64"):
        os.environ["KDAKIT_CHUNK_PIPELINE"] = pipe

        def fn():
            with torch.no_grad():
                chunk_kda(**x, **kw)

        out[pipe] = {"ms": timed(fn, reps=20, warmup=3),
                     "kernels_ms": {n: r["ms"] for n, r in kernel_times(fn).items() if r["ms"] > 0.005}}
    del os.environ["KDAKIT_CHUNK_PIPELINE"]
    return out


if __name__ == "__main__":
    main()
