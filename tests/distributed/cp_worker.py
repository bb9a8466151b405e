"""One rank of the context-parallel chunk_kda tests (run as a script by tests/distributed/test_cp.py and
tests/gpu/distributed/test_cp_gpu.py; not collected by pytest).

Every rank builds the same global inputs from a seed, runs the one-process chunk_kda on all of
them (the reference), then its CP share through ``chunk_kda(..., cp_context=ctx)``, and checks
outputs and every gradient: token tensors against its slice of the reference, replicated ones
(A_log, dt_bias, initial_state) and final states summed over ranks (all_reduce) against the
whole. The loss includes the final states, so their gradient path is exercised too. Writes one
JSON file of per-case errors (or the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

FULL = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)

# (layout, global cu_seqlens, options, initial_state, output_final_state, state_v_first), per world size.
# Sequences spanning 1, 2, 3 and 4 ranks, offsets on interval boundaries and inside them, zero-length
# sequences; both state layouts; both gate forms.
CPU_CASES = {
    2: [
        ("contiguous", [0, 12], FULL, True, True, False),            # one sequence over both ranks
        ("contiguous", [0, 6, 12], {}, False, False, False),         # one sequence per rank: no exchange
        ("contiguous", [0, 2, 9, 9, 12], FULL, True, True, True),   # mixed, a zero-length one
        ("zigzag", [0, 16], FULL, True, True, False),                # ranks 0, 1, 1, 0
        ("zigzag", [0, 3, 8, 16], {}, False, True, False),
        ("zigzag", [0, 4, 4, 13, 16], FULL, True, True, True),
    ],
    4: [
        ("contiguous", [0, 20], FULL, True, True, False),            # over all four ranks
        ("contiguous", [0, 3, 13, 20], {}, True, True, False),       # 1, 3 and 2 ranks
        ("contiguous", [0, 5, 10, 12, 20, 20], FULL, True, True, True),
        ("zigzag", [0, 24], FULL, True, True, False),
        ("zigzag", [0, 7, 7, 19, 24], {}, False, False, False),
        ("zigzag", [0, 2, 10, 11, 24], FULL, True, True, True),
    ],
}
# float32 CUDA tensors through the Triton kernels, against the one-process op on the same GPU.
GPU_CASES = {
    2: [
        ("contiguous", [0, 512], FULL, True, True, False),
        ("contiguous", [0, 100, 300, 512], FULL, True, True, True),
        ("zigzag", [0, 512], FULL, True, True, False),
        ("zigzag", [0, 70, 200, 201, 512], {}, True, True, False),
    ],
}


def make_inputs(cu, opts, with_h0, v_first, *, H, HV, K, V, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    t = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V))
    if opts.get("use_gate_in_kernel"):
        t["g"] = rnd(1, T, HV, K)
        t["beta"] = rnd(1, T, HV)
        t["A_log"] = rnd(HV) * 0.5
        t["dt_bias"] = rnd(HV * K) * 0.5
    else:
        # pre-computed log-decay and beta; keys scaled so that beta |k|^2 < 2 (a contraction)
        t["k"] = t["k"] / (K ** 0.5 * 1.5)
        t["g"] = -torch.nn.functional.softplus(rnd(1, T, HV, K)) * 0.5
        t["beta"] = torch.sigmoid(rnd(1, T, HV))
    if with_h0:
        t["initial_state"] = rnd(N, HV, V, K) if v_first else rnd(N, HV, K, V)
    grads = dict(do=rnd(1, T, HV, V), dfinal=rnd(N, HV, V, K) if v_first else rnd(N, HV, K, V))
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    for name in t:
        dt = sdt if name in ("A_log", "dt_bias", "initial_state") else dtype
        t[name] = t[name].to(device=device, dtype=dt)
    grads = {n: x.to(device=device, dtype=dtype) for n, x in grads.items()}
    return t, grads


def run_op(tensors, grads, cu_kw, out_final, v_first, opts):
    from kdakit import chunk_kda

    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
    extra = {n: leaves[n] for n in ("A_log", "dt_bias") if n in leaves}
    o, final = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         initial_state=leaves.get("initial_state"), output_final_state=out_final,
                         state_v_first=v_first, **opts, **extra, **cu_kw)
    loss = (o * grads["do"]).sum()
    if out_final:
        loss = loss + (final * grads["dfinal"].to(final.dtype)).sum()
    loss.backward()
    return o.detach(), (final.detach() if out_final else None), {n: x.grad for n, x in leaves.items()}


def rel_err(a, b):
    scale = b.abs().max().item()
    assert scale > 0, "a reference of zeros proves nothing"
    return (a.double() - b.double()).abs().max().item() / scale


def run_case(case, *, world, rank, group, H, HV, K, V, dtype, device, seed):
    import kdakit

    layout, cu, opts, with_h0, out_final, v_first = case
    tensors, grads = make_inputs(cu, opts, with_h0, v_first, H=H, HV=HV, K=K, V=V, dtype=dtype, device=device,
                                 seed=seed)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    o_ref, f_ref, g_ref = run_op(tensors, grads, dict(cu_seqlens=cu_t), out_final, v_first, opts)

    ctx = kdakit.build_cp_context(cu_t, group, layout=layout)
    local = {n: (kdakit.shard_tokens(x, ctx) if n in ("q", "k", "v", "g", "beta") else x) for n, x in tensors.items()}
    local_grads = dict(do=kdakit.shard_tokens(grads["do"], ctx), dfinal=grads["dfinal"])
    o, final, gr = run_op(local, local_grads, dict(cp_context=ctx), out_final, v_first, opts)

    errs = {"o": rel_err(o, kdakit.shard_tokens(o_ref, ctx))}
    if out_final:
        dist.all_reduce(final, group=group)  # each rank holds the sequences that end on it
        errs["final"] = rel_err(final, f_ref)
    for n, gx in gr.items():
        if n in ("q", "k", "v", "g", "beta"):
            errs["d" + n] = rel_err(gx, kdakit.shard_tokens(g_ref[n], ctx))
        else:
            dist.all_reduce(gx, group=group)  # per-rank contributions, summed as DDP would
            errs["d" + n] = rel_err(gx, g_ref[n])

    # inference: no graph, the same forward
    with torch.no_grad():
        from kdakit import chunk_kda
        extra = {n: local[n] for n in ("A_log", "dt_bias") if n in local}
        o2, _ = chunk_kda(local["q"], local["k"], local["v"], local["g"], local["beta"],
                          initial_state=local.get("initial_state"), state_v_first=v_first, cp_context=ctx,
                          **opts, **extra)
    errs["o_no_grad"] = rel_err(o2, kdakit.shard_tokens(o_ref, ctx))
    return errs


def check_refusals(world, rank, group):
    """Rank-local refusals that need a live group (they raise before any collective); 0.0 = refused as expected."""
    import kdakit

    ctx = kdakit.build_cp_context(torch.tensor([0, 4 * world]), group)
    t, _ = make_inputs([0, 4 * world], {}, False, False, H=1, HV=1, K=4, V=3, dtype=torch.float64, device="cpu",
                       seed=0)
    local = [kdakit.shard_tokens(t[n], ctx) for n in ("q", "k", "v", "g", "beta")]
    probes = {
        "refuse_T": (dict(), [x[:, :-1] for x in local], "this rank's \\[1, 4, H, K\\] tokens"),
        "refuse_local_h0": (dict(initial_state=torch.randn(2, 1, 4, 3, dtype=torch.float64)), local,
                            "global \\[1, 1, 4, 3\\]"),
        "refuse_h0_dtype": (dict(initial_state=torch.randn(1, 1, 4, 3).half()), local, "initial_state must be"),
    }
    out = {}
    for name, (kw, xs, match) in probes.items():
        try:
            kdakit.chunk_kda(*xs, cp_context=ctx, **kw)
            out[name] = 1.0
        except (ValueError, TypeError) as e:
            out[name] = 0.0 if re.search(match, str(e)) else 2.0
    # a second backward would run the collectives again on a consumed graph: refused on every rank alike
    leaves = [x.detach().clone().requires_grad_() for x in local]
    o, _ = kdakit.chunk_kda(*leaves, cp_context=ctx)
    loss = (o * o).sum()
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        out["refuse_second_backward"] = 1.0
    except RuntimeError as e:
        out["refuse_second_backward"] = 0.0 if "one backward per forward" in str(e) else 2.0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    a = ap.parse_args()
    result = {}
    try:
        torch.set_num_threads(1)
        if a.suite == "gpu":
            device, dtype, cases, dims = "cuda", torch.float32, GPU_CASES[a.world], dict(H=2, HV=4, K=64, V=64)
        else:
            device, dtype, cases, dims = "cpu", torch.float64, CPU_CASES[a.world], dict(H=1, HV=2, K=4, V=3)
        # gloo carries CPU and CUDA tensors alike (NCCL refuses two ranks on one GPU)
        dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world,
                                timeout=timedelta(seconds=60))
        for i, case in enumerate(cases):
            name = f"{case[0]} cu={case[1]} full={bool(case[2])} h0={case[3]} final={case[4]} v_first={case[5]}"
            result[name] = run_case(case, world=a.world, rank=a.rank, group=None, dtype=dtype, device=device,
                                    seed=1234 + i, **dims)
        if a.suite == "cpu":
            result["refusals"] = check_refusals(a.world, a.rank, None)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        result["__error__"] = traceback.format_exc()
    Path(a.out).write_text(json.dumps(result))


def launch(world: int, tmp: Path, *, suite: str = "cpu", timeout: float = 120.0) -> list[dict]:
    """Run ``world`` ranks of this script; return each rank's result. A hang fails after ``timeout``."""
    store = tmp / "store"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--store",
                               str(store), "--out", str(tmp / f"rank{r}.json"), "--suite", suite], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        raise AssertionError(f"CP ranks still running after {timeout} s (a hang in a collective?)")
    results = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        path = tmp / f"rank{r}.json"
        if p.returncode != 0 or not path.exists():
            raise AssertionError(f"rank {r} exited with {p.returncode}:\n{log}")
        res = json.loads(path.read_text())
        if "__error__" in res:
            raise AssertionError(f"rank {r} raised:\n{res['__error__']}")
        results.append(res)
    return results


if __name__ == "__main__":
    main()
