"""Benchmark of recurrent KDA on one GPU: decode steps over a state pool, and recurrent
forward+backward against the chunked path. Writes a JSON results file.

    python benchmarks/bench_recurrent.py --out results/recurrent_h200.json

1. Device copy bandwidth (bytes read + written / median time of a 2 GiB device-to-device copy).
2. Decode step (``kdakit.kda_decode``), N in {64, 256} sequences, H = HV = 32, K = V = 128,
   one token, fp32 and bf16 state pools: state bandwidth = state bytes read + written /
   median kernel time, against the copy bandwidth (target >= 75%). Timed as CUDA-graph
   replays (the kernel alone) and as eager calls (with the Python launch path). FLA 0.6.0's
   ``fused_recurrent_kda`` kernel on the same pool in the same run when ``fla`` imports
   (its vLLM entry ``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` and
   ``inplace_final_state``).
3. Recurrent forward+backward (``kdakit.fused_recurrent_kda`` with autograd, eager) at
   T in {1, 17, 1024} against ``kdakit.ops.kda.chunk.chunk_kda`` at the same shapes, plus
   the recurrent kernels alone (direct calls replayed from a CUDA graph) and the backward's
   scratch size.

Every measurement is the median of CUDA-event timings of many runs after warm-up, and
each case passes a correctness gate first (against the PyTorch reference or the naive
definition); a failed gate is recorded and the case is not timed. A missing competitor
(FLA not importable, chunked Triton path missing) is recorded, not fatal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback

import torch

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's native Triton path, as in the docs/spec.md §3 protocol

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdakit.ops.kda.decode import kda_decode, kda_decode_reference  # noqa: E402
from kdakit.ops.kda.fused_recurrent import fused_recurrent_kda  # noqa: E402
from kdakit.ops.kda.naive import naive_recurrent_kda  # noqa: E402
from kdakit.ops.kda.recurrent_backward import recurrent_kda_backward  # noqa: E402
from kdakit.ops.kda.workspace import Workspace  # noqa: E402
from kdakit.testing import error_report  # noqa: E402

DEV = "cuda"
TARGET_FRACTION = 0.75
DECODE_GATE_RATIO = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
TRAIN_GATE_RATIO = 2e-2  # bf16 inputs and gradients vs float64 (or vs the chunked path)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def median_ms(fn, warmup: int, iters: int) -> float:
    """Median of CUDA-event timings of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graphed(fn, warmup: int = 3):
    """Capture ``fn`` (already warm on the capture stream) in a CUDA graph; returns replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph.replay, graph


def copy_bandwidth(nbytes: int = 2 << 30) -> dict:
    src = torch.empty(nbytes // 4, device=DEV).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=5, iters=30)
    return {"bytes_per_copy_read_plus_written": 2 * nbytes, "median_ms": ms, "GBps": 2 * nbytes / ms / 1e6}


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------

def environment() -> dict:
    import triton

    sha = os.environ.get("KDAKIT_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                 cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - any import failure means FLA is unavailable
        fla_version = f"unavailable: {type(exc).__name__}: {exc}"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "fla": fla_version,
        "python": platform.python_version(),
        "git_sha": sha,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------

def _decode_inputs(N, H, K, V, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    t = {
        "q": r(N, 1, H, K).bfloat16(), "k": r(N, 1, H, K).bfloat16(), "v": r(N, 1, H, V).bfloat16(),
        "g": r(N, 1, H, K).bfloat16(), "beta": r(N, 1, H).bfloat16(),
        "A_log": 0.5 * r(H), "dt_bias": 0.5 * r(H * K),
    }
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0)
    return t, opts


def _fla_decode_fn(t, opts, pool, idx, out):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def run():
        fused_recurrent_kda_fwd(
            q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
            initial_state=pool, inplace_final_state=True, ssm_state_indices=idx, state_v_first=True,
            out=out, **opts,
        )
    return run


def bench_decode(N: int, pool_dtype: torch.dtype, copy_GBps: float, iters: int) -> dict:
    H, K, V = 32, 128, 128
    t, opts = _decode_inputs(N, H, K, V)
    P = N
    pool = (0.3 * torch.randn(P, H, V, K, device=DEV)).to(pool_dtype)
    idx = torch.randperm(P, device=DEV).to(torch.int32)
    out = torch.empty_like(t["v"])
    state_bytes = 2 * N * H * V * K * pool.element_size()
    res = {"N": N, "H": H, "HV": H, "K": K, "V": V, "state_dtype": str(pool_dtype).replace("torch.", ""),
           "state_bytes_read_plus_written": state_bytes}

    # correctness gate: one step against the PyTorch reference on a copy of the pool
    ref_pool, ref_o = pool.clone(), torch.empty_like(out)
    kda_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, idx, None, ref_o,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], scale=K ** -0.5, cu_seqlens=None, N=N,
                         allow_neg_eigval=False, **opts)
    gate_pool = pool.clone()
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], gate_pool, idx, A_log=t["A_log"],
                   dt_bias=t["dt_bias"], **opts)
    reps = [error_report("o", ref_o, o), error_report("state", ref_pool.float(), gate_pool.float())]
    res["gate"] = [str(r) for r in reps]
    if not all(r.rms_ratio <= DECODE_GATE_RATIO[pool_dtype] for r in reps):
        res["error"] = "correctness gate failed"
        return res

    def ours():
        kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
                   out=out, check_indices=False, **opts)

    replay, _graph = graphed(ours)
    ms = median_ms(replay, warmup=20, iters=iters)
    res["kdakit_graph_ms"] = ms
    res["kdakit_state_GBps"] = state_bytes / ms / 1e6
    res["kdakit_fraction_of_copy"] = res["kdakit_state_GBps"] / copy_GBps
    res["meets_target"] = res["kdakit_fraction_of_copy"] >= TARGET_FRACTION
    res["kdakit_eager_ms"] = median_ms(ours, warmup=10, iters=max(20, iters // 4))

    try:
        fla_pool = pool.clone()
        fla_out = torch.empty_like(out)
        ref2_pool, ref2_o = fla_pool.clone(), torch.empty_like(out)
        kda_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], ref2_pool, idx, None, ref2_o,
                             A_log=t["A_log"], dt_bias=t["dt_bias"], scale=K ** -0.5, cu_seqlens=None, N=N,
                             allow_neg_eigval=False, **opts)
        run_fla = _fla_decode_fn(t, opts, fla_pool, idx, fla_out)
        run_fla()
        torch.cuda.synchronize()
        rep = error_report("fla o", ref2_o, fla_out)
        res["fla_gate"] = str(rep)
        # FLA keeps bf16 state unrounded within a step; one step differs by bf16 rounding only
        if rep.rms_ratio > 1e-2:
            res["fla_error"] = "FLA output disagrees with the reference"
        else:
            replay_fla, _g2 = graphed(run_fla)
            fms = median_ms(replay_fla, warmup=20, iters=iters)
            res["fla_graph_ms"] = fms
            res["fla_state_GBps"] = state_bytes / fms / 1e6
            res["fla_fraction_of_copy"] = res["fla_state_GBps"] / copy_GBps
            res["kdakit_speedup_vs_fla"] = fms / ms
    except Exception as exc:  # noqa: BLE001 - record any FLA failure (not installed, API mismatch)
        res["fla_error"] = f"{type(exc).__name__}: {exc}"
    return res


# ---------------------------------------------------------------------------------------------
# Forward + backward
# ---------------------------------------------------------------------------------------------

def _train_inputs(B, T, H, K, V, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    t = {
        "q": r(B, T, H, K).bfloat16(), "k": r(B, T, H, K).bfloat16(), "v": r(B, T, H, V).bfloat16(),
        "g": r(B, T, H, K).bfloat16(), "beta": r(B, T, H).bfloat16(),
        "A_log": 0.5 * r(H), "dt_bias": 0.5 * r(H * K), "initial_state": 0.3 * r(B, H, V, K),
    }
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                safe_gate=True, lower_bound=-5.0, state_v_first=True, output_final_state=True)
    do = r(B, T, H, V).bfloat16()
    dht = r(B, H, V, K)
    return t, opts, do, dht


def _fwd_bwd(fn, t, opts, do, dht):
    leaves = {n: x.detach().clone().requires_grad_() for n, x in t.items()}

    def fwd():
        with torch.no_grad():
            return fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves["A_log"],
                      dt_bias=leaves["dt_bias"], initial_state=leaves["initial_state"], **opts)

    def fwd_bwd():
        for x in leaves.values():
            x.grad = None
        o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves["A_log"],
                   dt_bias=leaves["dt_bias"], initial_state=leaves["initial_state"], **opts)
        torch.autograd.backward([o, ht], [do, dht])
        return o, ht

    def results():
        o, ht = fwd_bwd()
        return {"o": o.detach(), "final_state": ht.detach(), **{"d" + n: x.grad for n, x in leaves.items()}}

    return fwd, fwd_bwd, results


def _direct_fwd_bwd(t, opts, do, dht, ws):
    """Forward and backward through the direct entry points with preallocated outputs (capturable)."""
    o = torch.empty_like(t["v"])
    ht = torch.empty_like(dht)
    grads = [torch.empty_like(t[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    bwd_opts = {n: x for n, x in opts.items() if n != "output_final_state"}
    named = {n: t[n] for n in ("A_log", "dt_bias", "initial_state")}

    def run():
        with torch.no_grad():
            fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], out=o, final_state_out=ht, workspace=ws,
                                **named, **opts)
        recurrent_kda_backward(t["q"], t["k"], t["v"], t["g"], t["beta"], do, dht, workspace=ws, out=grads,
                               **named, **bwd_opts)
    return run


def _graphed_fwd_bwd(t, opts, do, dht):
    """The forward+backward kernels alone: the direct calls replayed from a CUDA graph."""
    run = _direct_fwd_bwd(t, opts, do, dht, Workspace(DEV))
    replay, _graph = graphed(run)
    # the returned function keeps run's buffers and workspace (which the graph writes) alive
    return lambda: (replay(), run)[0]


def _scratch_MiB(t, opts, do, dht) -> float:
    ws = Workspace(DEV)
    _direct_fwd_bwd(t, opts, do, dht, ws)()
    return ws.nbytes / 2**20


def _chunk_fn():
    from kdakit.ops.kda.chunk import chunk_kda

    return chunk_kda


def bench_fwd_bwd(T: int, iters: int) -> dict:
    B, H, K, V = 4, 16, 128, 128
    t, opts, do, dht = _train_inputs(B, T, H, K, V)
    res = {"B": B, "T": T, "H": H, "HV": H, "K": K, "V": V, "dtype": "bfloat16",
           "options": "l2norm, safe gate lb=-5, beta sigmoid, value-first fp32 initial/final state"}
    fwd, fwd_bwd, results = _fwd_bwd(fused_recurrent_kda, t, opts, do, dht)
    ours = results()

    # correctness gate: the naive definition in float64 (short T), else the chunked path below
    if T <= 17:
        ref_fwd, _, ref_results = _fwd_bwd(
            lambda *a, **kw: naive_recurrent_kda(*a, **{n: x for n, x in kw.items() if n != "safe_gate"}),
            {n: x.double() for n, x in t.items()}, opts, do.double(), dht.double())
        ref = ref_results()
        reps = [error_report(n, ref[n], ours[n]) for n in ref]
        res["gate_vs_naive"] = [str(r) for r in reps]
        if not all(r.rms_ratio <= TRAIN_GATE_RATIO for r in reps):
            res["error"] = "correctness gate failed"
            return res
    res["kdakit_recurrent_fwd_ms"] = median_ms(fwd, warmup=5, iters=iters)
    res["kdakit_recurrent_fwd_bwd_ms"] = median_ms(fwd_bwd, warmup=5, iters=iters)
    res["kdakit_recurrent_fwd_bwd_graph_ms"] = median_ms(_graphed_fwd_bwd(t, opts, do, dht), warmup=3, iters=iters)
    res["kdakit_recurrent_bwd_scratch_MiB"] = _scratch_MiB(t, opts, do, dht)

    try:
        chunk = _chunk_fn()
        cfwd, cfwd_bwd, cresults = _fwd_bwd(chunk, t, opts, do, dht)
        theirs = cresults()
        reps = [error_report(n, theirs[n], ours[n]) for n in theirs]
        res["gate_vs_chunk"] = [str(r) for r in reps]
        if not all(r.rms_ratio <= TRAIN_GATE_RATIO for r in reps):
            res["chunk_error"] = "recurrent and chunked results disagree"
            if T > 17:
                res["error"] = "correctness gate failed"
            return res
        res["chunk_fwd_ms"] = median_ms(cfwd, warmup=5, iters=iters)
        res["chunk_fwd_bwd_ms"] = median_ms(cfwd_bwd, warmup=5, iters=iters)
        res["recurrent_over_chunk_fwd_bwd"] = res["kdakit_recurrent_fwd_bwd_ms"] / res["chunk_fwd_bwd_ms"]
    except Exception as exc:  # noqa: BLE001 - a missing or failing chunked path is recorded
        res["chunk_error"] = f"{type(exc).__name__}: {exc}"
    return res


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--iters", type=int, default=200, help="timed runs per decode measurement")
    parser.add_argument("--train-iters", type=int, default=20, help="timed runs per fwd/fwd+bwd measurement")
    parser.add_argument("--decode-n", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--train-t", type=int, nargs="+", default=[1, 17, 1024])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_recurrent needs a CUDA device", file=sys.stderr)
        return 2

    results = {"benchmark": "recurrent KDA: decode state bandwidth and recurrent fwd+bwd",
               "env": environment(), "target_fraction_of_copy": TARGET_FRACTION}
    results["copy"] = copy_bandwidth()
    print(f"copy bandwidth {results['copy']['GBps']:.0f} GB/s", flush=True)

    results["decode"] = []
    for N in args.decode_n:
        for dt in (torch.float32, torch.bfloat16):
            try:
                r = bench_decode(N, dt, results["copy"]["GBps"], args.iters)
            except Exception as exc:  # noqa: BLE001 - keep the other cases
                r = {"N": N, "state_dtype": str(dt), "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=5)}
            results["decode"].append(r)
            print(json.dumps(r), flush=True)

    results["fwd_bwd"] = []
    for T in args.train_t:
        try:
            r = bench_fwd_bwd(T, args.train_iters)
        except Exception as exc:  # noqa: BLE001
            r = {"T": T, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=5)}
        results["fwd_bwd"].append(r)
        print(json.dumps(r), flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
