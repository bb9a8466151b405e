"""Benchmark of recurrent KDA on one GPU: decode steps over a state pool, and recurrent
forward+backward against the chunked path. Writes a JSON results file.

    python benchmarks/bench_recurrent.py --out results/recurrent_h200.json
    python benchmarks/bench_recurrent.py --sweep --train-t --out results/recurrent_sweep_h200.json

1. Device copy bandwidth (bytes read + written / median time of a 2 GiB device-to-device copy).
2. Decode step (``kdakit.kda_decode``), N in {64, 256, 1024, 4096} sequences, H = HV = 32,
   K = V = 128, one token, fp32 and bf16 state pools: state bandwidth = state bytes read +
   written / median kernel time, against the copy bandwidth. Timed as CUDA-graph replays (the
   kernel alone) and as eager calls (with the Python launch path). FLA 0.6.0's
   ``fused_recurrent_kda`` kernel on the same pool in the same run when ``fla`` imports
   (its vLLM entry ``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` and
   ``inplace_final_state``). Both are also timed with GRAPH_STEPS steps in one graph
   (``*_graph_steps_ms``, ``kdakit_steps_fraction_of_copy``, ``kdakit_steps_speedup_vs_fla``): a
   one-kernel graph's replay pays its own launch, ~4 us, which an engine's whole-step graph spreads
   over its kernels (benchmarks/timing.py). Targets (issue #13): state bandwidth >= 85% of the copy's and
   >= 1.3x FLA's speed, each recorded per row in ``meets_target``.
   Speculative steps (``speculative`` rows, ``--spec-n``): S = 4 tokens per sequence, N in {64, 256},
   the same heads and pools, ``state_indices`` ``[N, S]`` (the state after token t of sequence n goes
   to row ``state_indices[n, t]``; the initial state is read from row
   ``state_indices[n, num_accepted_tokens[n] - 1]``) with ``num_accepted_tokens`` a mix of 1..S over a
   pool of N * S rows; FLA's call with the same ``ssm_state_indices`` and ``num_accepted_tokens``.
   State bytes: the N rows read once plus the N * S rows written.
   With ``--sweep``, each decode cell also times the kernel at every launch config of a small
   grid (block_v x num_warps, through the launcher kda_decode calls), each config gated like
   the row, with fewer timed replays than the row; the fastest config per cell and per state
   dtype is recorded.
3. Recurrent forward+backward (``kdakit.fused_recurrent_kda`` with autograd, eager) at
   T in {1, 17, 1024} against ``kdakit.ops.kda.chunk.api.chunk_kda`` at the same shapes, plus
   the recurrent kernels alone (direct calls replayed from a CUDA graph) and the backward's
   scratch size.

Every measurement is the median of CUDA-event timings of many runs after warm-up, and
each case passes a correctness gate first (against the PyTorch reference or the naive
definition); a failed gate is recorded and the case is not timed. A missing competitor
(FLA not importable, chunked Triton path missing) is recorded, not fatal.

The launch-config sweep and the speculative cells are in bench_recurrent_cells.py (imported here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import traceback

import torch

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's native Triton path, as in the docs/spec.md §3 protocol

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdakit.ops.kda.serving.decode import decode_options, kda_decode, kda_decode_reference  # noqa: E402
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda  # noqa: E402
from kdakit.ops.kda.reference.naive import naive_recurrent_kda  # noqa: E402
from kdakit.ops.kda.recurrent.backward import recurrent_kda_backward  # noqa: E402
from kdakit.ops.kda.recurrent.workspace import Workspace  # noqa: E402
from kdakit.testing import ErrorReport, error_report  # noqa: E402

import bench_recurrent_cells as cells  # noqa: E402
from timing import graphed, graphed_steps_ms, median_ms  # noqa: E402  (bench_recurrent_cells reads graphed and median_ms from here)
from bench_recurrent_cells import (  # noqa: E402
    SPEC_N,
    SPEC_S,
    SWEEP_BLOCK_V,
    SWEEP_NUM_WARPS,
    SweepPlan,
    bench_speculative,
    best_config,
    overall_best,
    sweep_decode,
)

# The launch-config sweep and the speculative cells live in bench_recurrent_cells.py; these names of theirs,
# which this module does not use itself, stay reachable here as they were (tests/test_benchmark_tools.py).
SPEC_BYTES, SWEEP_WARMUP = cells.SPEC_BYTES, cells.SWEEP_WARMUP
sweep_configs, spec_indices, spec_state_bytes = cells.sweep_configs, cells.spec_indices, cells.spec_state_bytes
decode_launch_config = cells.decode_launch_config
cells.bind(sys.modules[__name__])  # the cells read median_ms, graphed, DEV, ... from this module at call time


DEV = "cuda"
# issue #13: decode state bandwidth >= 85% of a device copy's, and >= 1.3x FLA 0.6.0's fused_recurrent decode
TARGET_FRACTION = 0.85
TARGET_SPEEDUP_VS_FLA = 1.3
DECODE_GATE_RATIO = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
TRAIN_GATE_RATIO = 2e-2  # bf16 inputs and gradients vs float64 (or vs the chunked path)
DECODE_N = (64, 256, 1024, 4096)
GRAPH_STEPS = 20  # decode steps per graph for the *_graph_steps_ms figures (timing.graphed_steps_ms)
FLA_GATE_RATIO = 1e-2  # FLA keeps bf16 state unrounded within a step; it differs from the reference by bf16 rounding


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

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

def _decode_inputs(N, H, K, V, seed=0, T=1):
    """One step's inputs: ``T`` tokens for each of ``N`` sequences (``[N, T, ...]``), H = HV heads."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    t = {
        "q": r(N, T, H, K).bfloat16(), "k": r(N, T, H, K).bfloat16(), "v": r(N, T, H, V).bfloat16(),
        "g": r(N, T, H, K).bfloat16(), "beta": r(N, T, H).bfloat16(),
        "A_log": 0.5 * r(H), "dt_bias": 0.5 * r(H * K),
    }
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-5.0)
    return t, opts


def _fla_decode_fn(t, opts, pool, idx, out, acc=None):
    """FLA's vLLM entry on ``pool`` in place: ``idx`` ``[N]``, or ``[N, S]`` with ``acc`` (num_accepted_tokens)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def run():
        fused_recurrent_kda_fwd(
            q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
            initial_state=pool, inplace_final_state=True, ssm_state_indices=idx, num_accepted_tokens=acc,
            state_v_first=True, out=out, **opts,
        )
    return run


def device_error_report(name: str, ref: torch.Tensor, got: torch.Tensor, chunk_elems: int = 1 << 26) -> ErrorReport:
    """``kdakit.testing.error_report`` (max abs error, rms ratio, both in float64) computed on the
    tensors' device, ``chunk_elems`` elements at a time.

    error_report copies both tensors to the host in float64: 16 GiB each for the fp32 pool of the
    N=4096 cell, seconds of copying and tens of GiB of host memory per call, too slow to gate every
    sweep config. The same quantities in the same precision; only the summation order differs.
    """
    if ref.shape != got.shape:
        raise ValueError(f"{name}: shape mismatch, reference {list(ref.shape)} vs got {list(got.shape)}")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    if got.numel() == 0:
        return ErrorReport(name, 0.0, 0.0)
    zero = torch.zeros((), dtype=torch.float64, device=got.device)
    finite, max_abs, err_sq, ref_sq = torch.ones((), dtype=torch.bool, device=got.device), zero, zero, zero
    for r, x in zip(ref.detach().reshape(-1).split(chunk_elems), got.detach().reshape(-1).split(chunk_elems)):
        r, x = r.to(torch.float64), x.to(torch.float64)
        finite = finite & torch.isfinite(x).all()
        err = x - r
        max_abs = torch.maximum(max_abs, err.abs().max())
        err_sq = err_sq + err.pow(2).sum()
        ref_sq = ref_sq + r.pow(2).sum()
    finite, max_abs, err_sq, ref_sq = torch.stack([finite.double(), max_abs, err_sq, ref_sq]).tolist()
    if not finite:
        return ErrorReport(name, float("inf"), float("inf"))
    n = got.numel()
    ref_rms, err_rms = math.sqrt(ref_sq / n), math.sqrt(err_sq / n)
    if ref_rms == 0.0:
        return ErrorReport(name, max_abs, 0.0 if err_rms == 0.0 else float("inf"))
    return ErrorReport(name, max_abs, err_rms / ref_rms)


def _decode_reference(t, opts, pool, idx, acc=None):
    """One step of the PyTorch reference from ``pool`` (left as it is): (output, pool after the step).
    ``acc``: num_accepted_tokens with ``[N, S]`` indices."""
    N, K = t["q"].shape[0], t["q"].shape[3]
    ref_pool, ref_o = pool.clone(), torch.empty_like(t["v"])
    kopts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                           scale=K ** -0.5, **opts)
    kda_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, idx, acc, ref_o, kopts,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], cu_seqlens=None, N=N)
    return ref_o, ref_pool


def _decode_gate(ref_o, ref_pool, o, state):
    """The decode correctness gate: (report strings, passed)."""
    reps = [device_error_report("o", ref_o, o), device_error_report("state", ref_pool, state)]
    return [str(r) for r in reps], all(r.rms_ratio <= DECODE_GATE_RATIO[state.dtype] for r in reps)


def decode_targets(fraction_of_copy: float, speedup_vs_fla: float | None) -> dict:
    """Issue #13's two decode targets, each on its own (None: FLA was not measured)."""
    return {"fraction_of_copy": fraction_of_copy >= TARGET_FRACTION,
            "speedup_vs_fla": None if speedup_vs_fla is None else speedup_vs_fla >= TARGET_SPEEDUP_VS_FLA}


def bench_decode(N: int, pool_dtype: torch.dtype, copy_GBps: float, iters: int, sweep: SweepPlan | None = None) -> dict:
    H, K, V = 32, 128, 128
    t, opts = _decode_inputs(N, H, K, V)
    P = N
    gen = torch.Generator(device=DEV).manual_seed(1)  # the same pool and rows every run (and in the sweep)
    pool = (0.3 * torch.randn(P, H, V, K, device=DEV, generator=gen)).to(pool_dtype)
    idx = torch.randperm(P, device=DEV, generator=gen).to(torch.int32)
    out = torch.empty_like(t["v"])
    state_bytes = 2 * N * H * V * K * pool.element_size()
    res = {"N": N, "H": H, "HV": H, "K": K, "V": V, "state_dtype": str(pool_dtype).replace("torch.", ""),
           "state_bytes_read_plus_written": state_bytes}

    # correctness gate: one step against the PyTorch reference on a copy of the pool
    ref_o, ref_pool = _decode_reference(t, opts, pool, idx)
    gate_pool = pool.clone()
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], gate_pool, idx, A_log=t["A_log"],
                   dt_bias=t["dt_bias"], **opts)
    res["gate"], ok = _decode_gate(ref_o, ref_pool, o, gate_pool)
    del gate_pool
    if not ok:
        res["error"] = "correctness gate failed"
        return res
    if sweep is not None:
        # before the row's timing, which updates the pool in place: each config is gated from the reference's start
        res["sweep"] = sweep_decode(t, opts, pool, idx, ref_o, ref_pool, copy_GBps, sweep)
        res["sweep_best"] = best_config(res["sweep"])
    del ref_o, ref_pool

    def ours():
        kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
                   out=out, check_indices=False, **opts)

    replay, _graph = graphed(ours)
    ms = median_ms(replay, warmup=20, iters=iters)
    res["kdakit_graph_ms"] = ms
    res["kdakit_state_GBps"] = state_bytes / ms / 1e6
    res["kdakit_fraction_of_copy"] = res["kdakit_state_GBps"] / copy_GBps
    res["meets_target"] = decode_targets(res["kdakit_fraction_of_copy"], None)
    res["kdakit_eager_ms"] = median_ms(ours, warmup=10, iters=max(20, iters // 4))
    # GRAPH_STEPS steps in one graph: the step's time without the one-kernel replay's own launch
    res["kdakit_graph_steps_ms"] = graphed_steps_ms(ours, GRAPH_STEPS, iters)
    res["kdakit_steps_fraction_of_copy"] = state_bytes / res["kdakit_graph_steps_ms"] / 1e6 / copy_GBps

    try:
        fla_pool = pool.clone()
        fla_out = torch.empty_like(out)
        ref2_o = _decode_reference(t, opts, fla_pool, idx)[0]
        run_fla = _fla_decode_fn(t, opts, fla_pool, idx, fla_out)
        run_fla()
        torch.cuda.synchronize()
        rep = device_error_report("fla o", ref2_o, fla_out)
        res["fla_gate"] = str(rep)
        # FLA keeps bf16 state unrounded within a step; one step differs by bf16 rounding only
        if rep.rms_ratio > FLA_GATE_RATIO:
            res["fla_error"] = "FLA output disagrees with the reference"
        else:
            replay_fla, _g2 = graphed(run_fla)
            fms = median_ms(replay_fla, warmup=20, iters=iters)
            res["fla_graph_ms"] = fms
            res["fla_state_GBps"] = state_bytes / fms / 1e6
            res["fla_fraction_of_copy"] = res["fla_state_GBps"] / copy_GBps
            res["kdakit_speedup_vs_fla"] = fms / ms
            res["fla_graph_steps_ms"] = graphed_steps_ms(run_fla, GRAPH_STEPS, iters)
            res["kdakit_steps_speedup_vs_fla"] = res["fla_graph_steps_ms"] / res["kdakit_graph_steps_ms"]
            res["meets_target"] = decode_targets(res["kdakit_fraction_of_copy"], res["kdakit_speedup_vs_fla"])
            if res.get("sweep_best"):
                res["sweep_best"]["speedup_vs_fla"] = fms / res["sweep_best"]["graph_ms"]
    except Exception as exc:  # noqa: BLE001 - record any FLA failure (not installed, API mismatch)
        res["fla_error"] = f"{type(exc).__name__}: {exc}"
    if res.get("sweep_best"):
        best = res["sweep_best"]
        best["meets_target"] = decode_targets(best["fraction_of_copy"], best.get("speedup_vs_fla"))
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
    from kdakit.ops.kda.chunk.api import chunk_kda

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

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--iters", type=int, default=200, help="timed runs per decode measurement")
    parser.add_argument("--train-iters", type=int, default=20, help="timed runs per fwd/fwd+bwd measurement")
    parser.add_argument("--decode-n", type=int, nargs="*", default=list(DECODE_N),
                        help="decode batch sizes (sequences per step; each in fp32 and bf16 state); the flag alone "
                             "skips the one-token decode rows")
    parser.add_argument("--spec-n", type=int, nargs="*", default=list(SPEC_N),
                        help=f"speculative-step batch sizes (S={SPEC_S} tokens per sequence, [N, S] state_indices "
                             f"and num_accepted_tokens; each in fp32 and bf16 state); the flag alone skips them")
    parser.add_argument("--train-t", type=int, nargs="*", default=[1, 17, 1024],
                        help="fwd+bwd sequence lengths; the flag alone (no values) skips fwd+bwd")
    parser.add_argument("--sweep", action="store_true",
                        help=f"also time every decode launch config block_v in {SWEEP_BLOCK_V} x num_warps in "
                             f"{SWEEP_NUM_WARPS} per decode cell")
    parser.add_argument("--sweep-iters", type=int, default=30,
                        help="timed replays per sweep config (fewer than --iters, to keep the sweep short)")
    parser.add_argument("--sweep-budget-s", type=float, default=90.0,
                        help="seconds the whole sweep may take; configs reached later are recorded as skipped")
    return parser


def summary_lines(results: dict) -> list[str]:
    """The printed verdict: each decode row against both targets, and the sweep's picks."""
    def verdict(ok):
        return "meets" if ok else "misses"

    lines = [f"targets: decode state bandwidth >= {TARGET_FRACTION:.0%} of copy, "
             f">= {TARGET_SPEEDUP_VS_FLA}x FLA fused_recurrent decode"]
    def target_line(cell, r):
        if "meets_target" not in r:
            return f"{cell}: {r.get('error', 'not measured')}"
        m = r["meets_target"]
        speed = (f"{r['kdakit_speedup_vs_fla']:.2f}x FLA ({verdict(m['speedup_vs_fla'])} {TARGET_SPEEDUP_VS_FLA}x)"
                 if m["speedup_vs_fla"] is not None else f"FLA not measured ({r.get('fla_error', 'no FLA row')})")
        return (f"{cell}: {r['kdakit_fraction_of_copy']:.3f} of copy ({verdict(m['fraction_of_copy'])} "
                f"{TARGET_FRACTION}), {speed}")

    for r in results.get("decode", []):
        lines.append(target_line(f"decode N={r['N']} {r['state_dtype']}", r))
        if "meets_target" not in r:
            continue
        best = r.get("sweep_best")
        if "sweep" in r:
            if best is None:
                lines.append("  sweep: no config timed")
                continue
            vs_fla = f", {best['speedup_vs_fla']:.2f}x FLA" if "speedup_vs_fla" in best else ""
            vs_default = f", {best['speedup_vs_default']:.2f}x default" if "speedup_vs_default" in best else ""
            lines.append(f"  sweep best: block_v={best['block_v']} num_warps={best['num_warps']} "
                         f"{best['graph_ms']:.4f} ms, {best['fraction_of_copy']:.3f} of copy{vs_default}{vs_fla}")
    for r in results.get("speculative", []):
        lines.append(target_line(f"speculative S={r['S']} N={r['N']} {r['state_dtype']}", r))
    for dtype, pick in (results.get("sweep_overall_best") or {}).items():
        if pick is None:
            lines.append(f"sweep pick {dtype}: no config timed in every cell")
        else:
            lines.append(f"sweep pick {dtype}: block_v={pick['block_v']} num_warps={pick['num_warps']} "
                         f"(geomean {pick['geomean_slowdown_vs_cell_best']:.3f}x, worst "
                         f"{pick['worst_slowdown_vs_cell_best']:.3f}x of each cell's fastest; "
                         f"kdakit's default: decode_launch_config)")
    return lines


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("iters", "train_iters", "sweep_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad_n = [n for n in args.decode_n + args.spec_n if n < 1]
    if bad_n:
        parser.error(f"--decode-n and --spec-n values must be >= 1, got {bad_n}")
    if not args.sweep_budget_s > 0:
        parser.error(f"--sweep-budget-s must be > 0, got {args.sweep_budget_s}")
    if not torch.cuda.is_available():
        print("bench_recurrent needs a CUDA device", file=sys.stderr)
        return 2

    results = {"benchmark": "recurrent KDA: decode state bandwidth and recurrent fwd+bwd",
               "env": environment(), "target_fraction_of_copy": TARGET_FRACTION,
               "target_speedup_vs_fla": TARGET_SPEEDUP_VS_FLA,
               "default_launch_config": "one-token steps with [N] indices: serving/step.py's STEP_BLOCK_V x "
                                        "STEP_NUM_WARPS; others: serving/decode.py's decode_launch_config (per cell: the "
                                        "sweep rows' default)",
               "graph_steps_note": f"*_graph_steps_ms: GRAPH_STEPS ({GRAPH_STEPS}) steps captured in one CUDA graph, "
                                   "per step (benchmarks/timing.graphed_steps_ms); kdakit_graph_ms / fla_graph_ms: "
                                   "one step per graph replay"}
    sweep = None
    if args.sweep:
        sweep = SweepPlan(iters=args.sweep_iters, left_s=args.sweep_budget_s)
        results["sweep_protocol"] = {
            "block_v": list(SWEEP_BLOCK_V), "num_warps": list(SWEEP_NUM_WARPS), "skip": "block_v > V",
            "warmup_replays": sweep.warmup, "timed_replays": sweep.iters, "row_timed_replays": args.iters,
            "budget_s": args.sweep_budget_s,
            "method": "launch_kda_decode (kda_decode's launcher, without its validation) at each config on a copy "
                      "of the cell's pool, one step gated against the reference as the row is, then the median of "
                      "CUDA-event timings of CUDA-graph replays; fewer timed replays than the row's, so a config's "
                      "graph_ms is noisier than the row's kdakit_graph_ms",
        }
    results["copy"] = copy_bandwidth()
    print(f"copy bandwidth {results['copy']['GBps']:.0f} GB/s", flush=True)

    results["decode"] = []
    for N in args.decode_n:
        for dt in (torch.float32, torch.bfloat16):
            try:
                r = bench_decode(N, dt, results["copy"]["GBps"], args.iters, sweep)
            except Exception as exc:  # noqa: BLE001 - keep the other cases
                r = {"N": N, "state_dtype": str(dt).replace("torch.", ""), "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=5)}
            results["decode"].append(r)
            print(json.dumps(r), flush=True)
    if sweep is not None:
        results["sweep_protocol"]["spent_s"] = args.sweep_budget_s - sweep.left_s
        results["sweep_overall_best"] = overall_best(results["decode"])

    results["speculative"] = []
    for N in args.spec_n:
        for dt in (torch.float32, torch.bfloat16):
            try:
                r = bench_speculative(N, dt, results["copy"]["GBps"], args.iters)
            except Exception as exc:  # noqa: BLE001 - keep the other cases
                r = {"N": N, "S": SPEC_S, "state_dtype": str(dt).replace("torch.", ""),
                     "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=5)}
            results["speculative"].append(r)
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
    print("\n".join(summary_lines(results)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
