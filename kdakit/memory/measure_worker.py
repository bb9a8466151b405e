"""One cell of ``kdakit mem measure``: one backend at one shape, in a fresh process.

Run by :mod:`kdakit.memory.measure` as ``python -m kdakit.memory.measure_worker ...``;
prints progress on stderr and, on stdout, one line ``KDAKIT_MEM_RESULT {json}`` per cell.

The SPEC §3 protocol, step by step:

1. Environment before torch/FLA load: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``;
   ``FLA_DISABLE_BACKEND_DISPATCH=1`` (FLA's native Triton path); ``KDAKIT_BACKEND=triton``
   for ``kdakit`` and ``torch`` for ``reference`` (no silent switch between them).
2. Inputs from a generator seeded identically for every backend: bf16 q, k, v, raw g,
   raw beta and dO; fp32 zero A_log and dt_bias; ``mbs`` equal sequences packed with
   cu_seqlens (and the same offsets on the host as ``cu_seqlens_cpu``, passed to both
   backends unless ``--no-cu-seqlens-cpu``); all seven inputs differentiated; in-kernel
   l2norm, beta sigmoid and safe gate with lower bound -5; no initial or final state.
   Beyond SPEC §3 (defaults unchanged): ``--value-heads HV`` for grouped value heads
   (q/k have ``--heads`` H heads; v, g, beta, A_log, dt_bias, dO have HV) and
   ``--gate softplus`` (``use_gate_in_kernel=True, safe_gate=False, lower_bound=None``
   with A_log and dt_bias given: the unbounded gate).
3. Warm-up outside the measurement: one forward+backward at a small shape (1 x
   ``warmup_seq`` tokens, default 1024: compilation, autotuning), then ``warmup_iters``
   steps at the target shape; outputs and gradients released. The allocator cache is
   *not* emptied after the small step, so the reserved figure is that of a process in
   which a 1K-token call ran first (as a training job that sees several lengths).
4. Three measured steps: ``reset_peak_memory_stats``; forward; ``o.backward(dO)``;
   synchronize; read ``max_memory_allocated`` / ``max_memory_reserved``. Finite checks run
   after the reading, in small slices so they barely touch the allocator.
5. Timing after the memory runs, identical for every backend (each called through its
   public ``chunk_kda``, host-side validation included in the timed interval): CUDA events
   around the forward with autograd recording (``fwd_ms``), around the forward under
   ``torch.no_grad()`` (``fwd_nograd_ms``) and around forward+backward (``fwd_bwd_ms``),
   each the median of ``timing_runs`` runs after one untimed run, from a synchronized,
   idle device. ``*_host_ms``: host time until the call returned (launch-bound if close
   to the event time).
6. Last, ``torch.cuda.empty_cache()`` and one more forward+backward: ``peak_reserved_clean_gib``
   is the reserved peak without the small warm-up's cached blocks.

``--cells A,B,...`` runs several cells in one process, one after the other (releasing
everything and emptying the allocator cache between cells, each with its own small warm-up);
each record then says ``"process": "shared"``. ``--warmup-only`` runs only the small warm-up
and one step at the cell's shape (compilation and autotuning for later processes; no figures).

An out-of-memory error anywhere ends the cell with status ``oom`` (the peak reached so far
is reported); any other exception with status ``error``. ``--device cpu --dry-run`` runs
the same bookkeeping on CPU (wall-clock times, no peaks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

RESULT_MARKER = "KDAKIT_MEM_RESULT "
ALLOC_CONF = "expandable_segments:False"
LOWER_BOUND = -5.0
BACKEND_ENV = {"kdakit": "triton", "reference": "torch"}
GIB = float(2 ** 30)
_FINITE_SLICE = 1 << 24  # elements per isfinite() slice: a 16 MiB bool temporary at most


def protocol_env(backend: str, base: dict | None = None) -> dict:
    """The environment a worker for ``backend`` must start with."""
    env = dict(os.environ if base is None else base)
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    if backend == "fla":
        env["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    if backend in BACKEND_ENV:
        env["KDAKIT_BACKEND"] = BACKEND_ENV[backend]
    return env


class _Progress:
    def __init__(self, label: str):
        self.label = label
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{self.label} +{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def load_backend(name: str, checkpoint_every: int | None):
    """Return ``(call, versions)``; ``call(inputs)`` runs the protocol's forward. Raises ImportError."""
    import torch

    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    extra = {}
    if name == "fla":
        import fla
        from fla.ops.kda import chunk_kda as fn

        versions["fla"] = getattr(fla, "__version__", None)
        extra["disable_recompute"] = False
    elif name in ("kdakit", "reference"):
        import kdakit
        from kdakit import chunk_kda as fn

        versions["kdakit"] = getattr(kdakit, "__version__", None)
        if checkpoint_every is not None:
            extra["checkpoint_every_n_tokens"] = checkpoint_every
    else:
        raise ValueError(f"unknown backend {name!r}: expected kdakit, fla or reference")

    def call(x):
        return fn(
            x["q"], x["k"], x["v"], x["g"], x["beta"],
            A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=x["cu_seqlens"],
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=True, lower_bound=LOWER_BOUND, **extra,
        )

    return call, versions


def make_inputs(mbs: int, seq: int, heads: int, dim: int, device: str, seed: int) -> dict:
    """SPEC §3 inputs, packed as B = 1 with cu_seqlens; identical for every backend at a seed."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    T = mbs * seq

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)

    x = {
        "q": randn(1, T, heads, dim), "k": randn(1, T, heads, dim), "v": randn(1, T, heads, dim),
        "g": randn(1, T, heads, dim), "beta": randn(1, T, heads),
        "A_log": torch.zeros(heads, dtype=torch.float32, device=device),
        "dt_bias": torch.zeros(heads * dim, dtype=torch.float32, device=device),
    }
    for t in x.values():
        t.requires_grad_(True)
    x["cu_seqlens"] = torch.arange(0, T + 1, seq, dtype=torch.int64, device=device)
    x["do"] = randn(1, T, heads, dim)
    return x


LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def release_grads(x: dict) -> None:
    for name in LEAVES:
        x[name].grad = None


def all_finite(t) -> bool:
    import torch

    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), _FINITE_SLICE):
        if not bool(torch.isfinite(flat[i:i + _FINITE_SLICE]).all()):
            return False
    return True


def check_finite(o, x: dict) -> list[str]:
    """Names of the output / gradients that are missing or not finite."""
    bad = [] if all_finite(o) else ["o"]
    for name in LEAVES:
        grad = x[name].grad
        if grad is None or not all_finite(grad):
            bad.append(f"d{name}")
    return bad


def step(call, x: dict):
    o, _ = call(x)
    o.backward(x["do"])
    return o


class Clock:
    """CUDA events on CUDA, wall clock on CPU; milliseconds."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def time(self, fn, prepare) -> float:
        import torch

        prepare()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            keep = fn()
            end.record()
            end.synchronize()
            del keep
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        keep = fn()
        ms = (time.perf_counter() - t0) * 1e3
        del keep
        return ms


def run_cell(args, say) -> dict:
    import torch

    device = args.device
    result: dict = {"backend": args.backend, "mbs": args.mbs, "seq": args.seq, "heads": args.heads,
                    "head_dim": args.head_dim, "device": device, "dry_run": args.dry_run}
    if device == "cuda" and not torch.cuda.is_available():
        return {**result, "status": "no-cuda", "message": "no CUDA device is visible (torch.cuda.is_available() is False)"}
    try:
        call, versions = load_backend(args.backend, args.checkpoint_every)
    except ImportError as exc:
        return {**result, "status": "missing-backend", "message": f"backend {args.backend!r} cannot be imported: {exc}"}
    result["versions"] = versions
    cuda = device == "cuda"
    if cuda:
        result["device_name"] = torch.cuda.get_device_name()
        result["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        if args.warmup_seq > 0:
            wseq = min(args.warmup_seq, args.seq)
            say(f"warm-up (compile/autotune) at 1x{wseq}:{args.heads}")
            small = make_inputs(1, wseq, args.heads, args.head_dim, device, args.seed)
            o = step(call, small)
            sync()
            bad = check_finite(o, small)
            del o, small
            if bad:
                return {**result, "status": "error", "message": f"non-finite warm-up results: {', '.join(bad)}"}
            if cuda:
                torch.cuda.empty_cache()  # the target's reserved figure should not inherit warm-up blocks
        say(f"inputs {args.mbs}x{args.seq}:{args.heads} (seed {args.seed})")
        x = make_inputs(args.mbs, args.seq, args.heads, args.head_dim, device, args.seed)
        for i in range(args.warmup_iters):
            say(f"warm-up at the target shape {i + 1}/{args.warmup_iters}")
            release_grads(x)
            o = step(call, x)
            sync()
            del o
        release_grads(x)

        allocs, reserveds, residents = [], [], []
        for i in range(args.reps):
            release_grads(x)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                residents.append(torch.cuda.memory_allocated())
            o = step(call, x)
            sync()
            if cuda:
                allocs.append(torch.cuda.max_memory_allocated())
                reserveds.append(torch.cuda.max_memory_reserved())
            bad = check_finite(o, x)  # outside the measured interval
            del o
            if bad:
                return {**result, "status": "error",
                        "message": f"non-finite results in measured run {i + 1}: {', '.join(bad)}"}
            say(f"measured run {i + 1}/{args.reps}" + (f": peak {allocs[-1] / GIB:.3f} GiB" if cuda else ""))
        release_grads(x)
        result["finite"] = True
        if cuda:
            result["peak_alloc_bytes_runs"] = allocs
            result["peak_reserved_bytes_runs"] = reserveds
            result["peak_alloc_gib"] = statistics.median(allocs) / GIB
            result["peak_reserved_gib"] = statistics.median(reserveds) / GIB
            result["resident_gib"] = statistics.median(residents) / GIB
        else:
            result["peak_alloc_gib"] = None
            result["peak_reserved_gib"] = None

        say(f"timing: {args.timing_runs} runs each")
        clock = Clock(device)
        prep = lambda: (release_grads(x), sync())  # noqa: E731
        fwd = lambda: call(x)[0]  # noqa: E731
        full = lambda: step(call, x)  # noqa: E731
        clock.time(fwd, prep)
        fwd_ms = [clock.time(fwd, prep) for _ in range(args.timing_runs)]
        clock.time(full, prep)
        full_ms = [clock.time(full, prep) for _ in range(args.timing_runs)]
        release_grads(x)
        result["fwd_ms"] = statistics.median(fwd_ms)
        result["fwd_bwd_ms"] = statistics.median(full_ms)
        result["status"] = "ok"
        return result
    except torch.cuda.OutOfMemoryError as exc:
        out = {**result, "status": "oom", "message": str(exc).splitlines()[0] if str(exc) else "out of memory"}
        if cuda:
            out["peak_alloc_gib_at_oom"] = torch.cuda.max_memory_allocated() / GIB
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kdakit.memory.measure_worker",
                                description="one backend x shape cell of the SPEC §3 memory protocol")
    p.add_argument("--backend", required=True, choices=["kdakit", "fla", "reference"])
    p.add_argument("--mbs", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timing-runs", type=int, default=10)
    p.add_argument("--warmup-seq", type=int, default=2048)
    p.add_argument("--warmup-iters", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cpu" and not args.dry_run:
        print("measure_worker: --device cpu needs --dry-run (CPU has no allocator peak statistics)", file=sys.stderr)
        return 2
    # The protocol's environment must be in place before torch (allocator) or FLA load.
    os.environ.update(protocol_env(args.backend, {}))
    say = _Progress(f"{args.backend} {args.mbs}x{args.seq}:{args.heads}")
    t0 = time.perf_counter()
    try:
        result = run_cell(args, say)
    except Exception as exc:  # report, do not crash silently: the parent records the cell
        result = {"backend": args.backend, "mbs": args.mbs, "seq": args.seq, "heads": args.heads,
                  "status": "error", "message": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc(file=sys.stderr)
    result["wall_s"] = time.perf_counter() - t0
    say(f"done: {result['status']}")
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0 if result["status"] in ("ok", "oom") else 1


if __name__ == "__main__":
    sys.exit(main())
