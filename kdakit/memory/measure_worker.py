"""One cell of ``kdakit mem measure``: one backend at one shape, in a fresh process.

Run by :mod:`kdakit.memory.measure` as ``python -m kdakit.memory.measure_worker ...``;
prints progress on stderr and, on stdout, one line ``KDAKIT_MEM_RESULT {json}`` per cell.

The protocol of docs/spec.md §3, step by step:

1. Environment before torch/FLA load: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``;
   ``FLA_DISABLE_BACKEND_DISPATCH=1`` (FLA's native Triton path); ``KDAKIT_BACKEND=triton``
   for ``kdakit`` and ``torch`` for ``reference`` (no silent switch between them).
2. Inputs from a generator seeded identically for every backend: bf16 q, k, v, raw g,
   raw beta and dO; fp32 zero A_log and dt_bias; ``mbs`` equal sequences packed with
   cu_seqlens (and the same offsets on the host as ``cu_seqlens_cpu``, passed to both
   backends unless ``--no-cu-seqlens-cpu``); all seven inputs differentiated; in-kernel
   l2norm, beta sigmoid and safe gate with lower bound -5; no initial or final state.
   Beyond the protocol (defaults unchanged): ``--value-heads HV`` for grouped value heads
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
import dataclasses
import gc
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
GATES = ("safe", "softplus")
DEFAULT_WARMUP_SEQ = 1024


def protocol_env(backend: str, base: dict | None = None) -> dict:
    """The environment a worker for ``backend`` must start with."""
    env = dict(os.environ if base is None else base)
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    if backend == "fla":
        env["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    if backend in BACKEND_ENV:
        env["KDAKIT_BACKEND"] = BACKEND_ENV[backend]
    return env


# ---------------------------------------------------------------------------------------
# Cells: ``MBSxSEQ:H[/HV][:gate]``


@dataclasses.dataclass(frozen=True)
class Cell:
    """One measured shape: ``mbs`` sequences of ``seq`` tokens, H q/k heads, HV value heads, gate mode.

    Written ``MBSxSEQ:H`` (the protocol's cells, docs/spec.md §3: HV = H, safe gate), ``MBSxSEQ:H/HV`` (grouped value heads)
    and ``...:softplus`` (the unbounded in-kernel gate); ``SEQ`` may be written ``8k``.
    """

    mbs: int
    seq: int
    heads: int
    value_heads: int | None = None
    gate: str = "safe"

    def __post_init__(self):
        for name in ("mbs", "seq", "heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.value_heads is not None:
            if not isinstance(self.value_heads, int) or self.value_heads <= 0:
                raise ValueError(f"value heads must be a positive int, got {self.value_heads!r}")
            if self.value_heads % self.heads:
                raise ValueError(f"value heads (HV={self.value_heads}) must be a multiple of q/k heads "
                                 f"(H={self.heads})")
            if self.value_heads == self.heads:
                object.__setattr__(self, "value_heads", None)
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {', '.join(GATES)}, got {self.gate!r}")

    @property
    def hv(self) -> int:
        return self.value_heads or self.heads

    @property
    def tokens(self) -> int:
        return self.mbs * self.seq

    @property
    def label(self) -> str:
        out = f"{self.mbs}x{self.seq}:{self.heads}"
        if self.value_heads is not None:
            out += f"/{self.value_heads}"
        if self.gate != "safe":
            out += f":{self.gate}"
        return out

    def fields(self) -> dict:
        """The record fields that identify the cell (``heads`` is H, ``value_heads`` HV)."""
        return {"mbs": self.mbs, "seq": self.seq, "heads": self.heads, "value_heads": self.hv, "gate": self.gate,
                "cell": self.label}


def _int(text: str, what: str) -> int:
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        t, mult = t[:-1], 1024
    try:
        v = int(t) * mult
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None
    return v


def parse_cell(text: str) -> Cell:
    """``"2x65536:32"``, ``"1x8192:16/32"``, ``"1x8k:96:softplus"`` -> :class:`Cell`."""
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or "x" not in parts[0].lower():
        raise ValueError(f"a cell is MBSxSEQ:H[/HV][:gate], got {text!r}")
    mbs, seq = parts[0].lower().split("x", 1)
    heads = parts[1].split("/")
    if len(heads) > 2:
        raise ValueError(f"heads are H or H/HV, got {parts[1]!r} in {text!r}")
    gate = parts[2].strip().lower() if len(parts) == 3 else "safe"
    return Cell(_int(mbs, "MBS"), _int(seq, "SEQ"), _int(heads[0], "H"),
                _int(heads[1], "HV") if len(heads) == 2 else None, gate)


def parse_cells(text: str) -> list[Cell]:
    cells = [parse_cell(item) for item in text.split(",") if item.strip()]
    if not cells:
        raise ValueError("no cells given")
    return cells


def as_cell(shape) -> Cell:
    """A :class:`Cell` from a Cell, a ``(mbs, seq, heads)`` tuple or a cell string."""
    if isinstance(shape, Cell):
        return shape
    if isinstance(shape, str):
        return parse_cell(shape)
    if hasattr(shape, "label"):  # a Cell of another copy of this module
        return parse_cell(shape.label)
    return Cell(*shape)


def cell_of_record(r: dict) -> Cell:
    """The cell a result record belongs to (records written before GVA/gate support are protocol cells: HV = H, safe gate)."""
    return Cell(int(r["mbs"]), int(r["seq"]), int(r["heads"]), r.get("value_heads"), r.get("gate") or "safe")


# ---------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, label: str):
        self.label = label
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{self.label} +{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def load_backend(name: str, checkpoint_every: int | None):
    """Return ``(call, versions)``; ``call(inputs)`` runs the protocol's forward. Raises ImportError.

    The gate mode and ``cu_seqlens_cpu`` travel in the inputs (:func:`make_inputs`), so both
    backends get exactly the same arguments.
    """
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
        gate = x.get("gate", "safe")
        flags = (dict(safe_gate=True, lower_bound=LOWER_BOUND) if gate == "safe"
                 else dict(safe_gate=False, lower_bound=None))
        return fn(
            x["q"], x["k"], x["v"], x["g"], x["beta"],
            A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=x["cu_seqlens"],
            cu_seqlens_cpu=x.get("cu_seqlens_cpu"),
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            **flags, **extra,
        )

    return call, versions


def make_inputs(mbs: int, seq: int, heads: int, dim: int, device: str, seed: int,
                value_heads: int | None = None, gate: str = "safe", cu_seqlens_cpu: bool = True) -> dict:
    """The protocol's inputs (docs/spec.md §3), packed as B = 1 with cu_seqlens; identical for every backend at a seed.

    ``heads`` is the q/k head count H, ``value_heads`` (default H) the value head count HV of
    v, g, beta, A_log, dt_bias and dO. With HV = H the tensors are exactly the protocol's.
    """
    import torch

    hv = value_heads or heads
    if hv % heads:
        raise ValueError(f"value_heads ({hv}) must be a multiple of heads ({heads})")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    T = mbs * seq

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)

    x = {
        "q": randn(1, T, heads, dim), "k": randn(1, T, heads, dim), "v": randn(1, T, hv, dim),
        "g": randn(1, T, hv, dim), "beta": randn(1, T, hv),
        "A_log": torch.zeros(hv, dtype=torch.float32, device=device),
        "dt_bias": torch.zeros(hv * dim, dtype=torch.float32, device=device),
    }
    for t in x.values():
        t.requires_grad_(True)
    x["cu_seqlens"] = torch.arange(0, T + 1, seq, dtype=torch.int64, device=device)
    x["cu_seqlens_cpu"] = torch.arange(0, T + 1, seq, dtype=torch.int64) if cu_seqlens_cpu else None
    x["do"] = randn(1, T, hv, dim)
    x["gate"] = gate
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
        return self.time2(fn, prepare)[0]

    def time2(self, fn, prepare) -> tuple[float, float]:
        """``(device_ms, host_ms)``: event time of ``fn`` from an idle device, and host time until it returned."""
        import torch

        prepare()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            keep = fn()
            host = (time.perf_counter() - t0) * 1e3
            end.record()
            end.synchronize()
            del keep
            return start.elapsed_time(end), host
        t0 = time.perf_counter()
        keep = fn()
        ms = (time.perf_counter() - t0) * 1e3
        del keep
        return ms, ms


def _cell_args(args) -> Cell:
    return Cell(args.mbs, args.seq, args.heads, args.value_heads, args.gate)


def run_cell(args, say) -> dict:
    import torch

    device = args.device
    cell = _cell_args(args)
    value_heads = cell.hv
    gate = cell.gate
    use_cpu_offsets = not getattr(args, "no_cu_seqlens_cpu", False)
    warmup_only = getattr(args, "warmup_only", False)
    result: dict = {"backend": args.backend, **cell.fields(), "head_dim": args.head_dim, "device": device,
                    "dry_run": args.dry_run, "cu_seqlens_cpu": use_cpu_offsets,
                    "warmup_seq": min(args.warmup_seq, args.seq), "process": getattr(args, "process", "fresh")}
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

    def inputs(mbs, seq):
        return make_inputs(mbs, seq, args.heads, args.head_dim, device, args.seed, value_heads=value_heads,
                           gate=gate, cu_seqlens_cpu=use_cpu_offsets)

    try:
        if args.warmup_seq > 0:
            wseq = min(args.warmup_seq, args.seq)
            say(f"warm-up (compile/autotune) at 1x{wseq}:{args.heads}" + (f"/{value_heads}" if value_heads != args.heads
                                                                          else "") + f" gate {gate}")
            t0 = time.perf_counter()
            small = inputs(1, wseq)
            o = step(call, small)
            sync()
            result["warmup_s"] = time.perf_counter() - t0
            bad = check_finite(o, small)
            del o, small
            if bad:
                return {**result, "status": "error", "message": f"non-finite warm-up results: {', '.join(bad)}"}
            # No empty_cache() here: the reserved figure is that of a process in which a small call ran first.
        say(f"inputs {cell.label} (seed {args.seed})")
        x = inputs(args.mbs, args.seq)
        t0 = time.perf_counter()
        n_target = 1 if warmup_only else args.warmup_iters
        for i in range(n_target):
            say(f"warm-up at the target shape {i + 1}/{n_target}")
            release_grads(x)
            o = step(call, x)
            sync()
            del o
        result["target_warmup_s"] = time.perf_counter() - t0
        release_grads(x)
        if warmup_only:
            del x
            result["status"] = "warm"
            return result

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
            say(f"measured run {i + 1}/{args.reps}" + (f": peak {allocs[-1] / GIB:.3f} GiB, reserved "
                                                       f"{reserveds[-1] / GIB:.3f} GiB" if cuda else ""))
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

        def fwd_nograd():
            with torch.no_grad():
                return call(x)[0]

        full = lambda: step(call, x)  # noqa: E731
        for key, fn in (("fwd", fwd), ("fwd_nograd", fwd_nograd), ("fwd_bwd", full)):
            clock.time2(fn, prep)
            runs = [clock.time2(fn, prep) for _ in range(args.timing_runs)]
            result[f"{key}_ms"] = statistics.median(r[0] for r in runs)
            result[f"{key}_host_ms"] = statistics.median(r[1] for r in runs)
        release_grads(x)

        if cuda:
            # The same step once more after emptying the allocator cache: reserved without the warm-up's blocks.
            torch.cuda.empty_cache()
            sync()
            torch.cuda.reset_peak_memory_stats()
            o = step(call, x)
            sync()
            result["peak_alloc_clean_gib"] = torch.cuda.max_memory_allocated() / GIB
            result["peak_reserved_clean_gib"] = torch.cuda.max_memory_reserved() / GIB
            del o
            release_grads(x)
        result["status"] = "ok"
        return result
    except torch.cuda.OutOfMemoryError as exc:
        out = {**result, "status": "oom", "message": str(exc).splitlines()[0] if str(exc) else "out of memory"}
        if cuda:
            out["peak_alloc_gib_at_oom"] = torch.cuda.max_memory_allocated() / GIB
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kdakit.memory.measure_worker",
                                description="one backend x shape cell of the memory protocol (docs/memory.md) "
                                            "(or several cells in one process with --cells)")
    p.add_argument("--backend", required=True, choices=["kdakit", "fla", "reference"])
    p.add_argument("--mbs", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--heads", type=int, help="q/k heads H")
    p.add_argument("--value-heads", type=int, default=None, help="value heads HV, a multiple of H (default H)")
    p.add_argument("--gate", choices=GATES, default="safe",
                   help="safe: lower_bound -5 * sigmoid (the protocol's gate); softplus: the unbounded gate, "
                        "safe_gate=False, lower_bound=None")
    p.add_argument("--cells", default=None,
                   help="MBSxSEQ:H[/HV][:gate],... run in this one process, one after the other "
                        "(instead of --mbs/--seq/--heads/--value-heads/--gate)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timing-runs", type=int, default=10)
    p.add_argument("--warmup-seq", type=int, default=DEFAULT_WARMUP_SEQ)
    p.add_argument("--warmup-iters", type=int, default=2)
    p.add_argument("--warmup-only", action="store_true",
                   help="only the small warm-up and one step at the cell's shape (compile / autotune), no figures")
    p.add_argument("--no-cu-seqlens-cpu", action="store_true",
                   help="do not pass cu_seqlens_cpu (the host copy of the offsets) to the backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=None)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Cell]]:
    """The parsed arguments and the cells they name (one cell unless ``--cells``)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.cells is not None:
        if any(getattr(args, n) is not None for n in ("mbs", "seq", "heads", "value_heads")) or args.gate != "safe":
            p.error("--cells replaces --mbs/--seq/--heads/--value-heads/--gate")
        try:
            cells = parse_cells(args.cells)
        except ValueError as exc:
            p.error(str(exc))
    else:
        missing = [f"--{n}" for n in ("mbs", "seq", "heads") if getattr(args, n) is None]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)} (or --cells)")
        try:
            cells = [Cell(args.mbs, args.seq, args.heads, args.value_heads, args.gate)]
        except ValueError as exc:
            p.error(str(exc))
    if args.reps <= 0 or args.timing_runs <= 0:
        p.error("--reps and --timing-runs must be positive")
    return args, cells


def _release_all() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort between cells
        pass


def main(argv: list[str] | None = None) -> int:
    args, cells = parse_args(argv)
    if args.device == "cpu" and not args.dry_run:
        print("measure_worker: --device cpu needs --dry-run (CPU has no allocator peak statistics)", file=sys.stderr)
        return 2
    # The protocol's environment must be in place before torch (allocator) or FLA load.
    os.environ.update(protocol_env(args.backend, {}))
    shared = len(cells) > 1
    worst = 0
    for i, cell in enumerate(cells):
        cargs = argparse.Namespace(**vars(args))
        cargs.mbs, cargs.seq, cargs.heads, cargs.value_heads, cargs.gate = (
            cell.mbs, cell.seq, cell.heads, cell.value_heads, cell.gate)
        cargs.process = f"shared ({i + 1} of {len(cells)} cells in one process)" if shared else "fresh"
        if i:
            _release_all()
        say = _Progress(f"{args.backend} {cell.label}")
        t0 = time.perf_counter()
        try:
            result = run_cell(cargs, say)
        except Exception as exc:  # report, do not crash silently: the parent records the cell
            result = {"backend": args.backend, **cell.fields(), "status": "error",
                      "message": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc(file=sys.stderr)
        result["wall_s"] = time.perf_counter() - t0
        say(f"done: {result['status']}")
        print(RESULT_MARKER + json.dumps(result), flush=True)
        if result["status"] not in ("ok", "oom", "warm"):
            worst = 1
    return worst


if __name__ == "__main__":
    sys.exit(main())
