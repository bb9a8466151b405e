"""``kdakit mem measure``: the memory protocol of docs/spec.md §3 over backends x shapes.

Every backend x shape cell runs in a fresh subprocess
(:mod:`kdakit.memory.measure_worker`) started with the protocol's environment
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``, ``FLA_DISABLE_BACKEND_DISPATCH=1``,
``KDAKIT_BACKEND``). A cell that runs out of memory is recorded as ``oom``; one that
exceeds its time limit is killed and recorded as ``timeout``; either way the run goes on.
Each finished cell is reported at once (a JSON line, or a row of the markdown table at the
end), with the floor (docs/spec.md §3), the overhead above it and, where a model exists
(:mod:`kdakit.memory.model`), the model's peak and its deviation.

Backends: ``kdakit`` (``kdakit.chunk_kda``, Triton kernels), ``fla`` (FLA 0.6.0
``fla.ops.kda.chunk_kda``, imported from the environment / PYTHONPATH) and ``reference``
(``kdakit.chunk_kda`` with ``KDAKIT_BACKEND=torch``, the chunked PyTorch path).

Shapes are ``(mbs, seq, heads)`` tuples or ``kdakit.memory.measure_worker.Cell`` objects
(grouped value heads, the softplus gate). ``run_measure(..., shared_process=True)`` runs all
cells of one backend in one worker process instead (cheaper; each record says so), and
``deadline`` (a ``time.monotonic()`` value) bounds the whole run: a cell's limit never goes
past it and cells that would start after it are recorded as ``skipped``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass, field

from kdakit.memory.measure_worker import DEFAULT_WARMUP_SEQ, RESULT_MARKER, Cell, as_cell, protocol_env
from kdakit.memory.model import GIB, BACKENDS, ModelUnsupported, floor_bytes, model, protocol_spec

DEFAULT_TIMEOUT_S = 900.0
HEARTBEAT_S = 60.0
OK_STATUSES = ("ok", "oom")
_TAIL_LINES = 40


class MeasureError(RuntimeError):
    """The run cannot start (no CUDA device, a backend missing, bad options)."""


@dataclass
class MeasureOptions:
    device: str = "cuda"
    dry_run: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    reps: int = 3
    timing_runs: int = 10
    warmup_seq: int = DEFAULT_WARMUP_SEQ
    warmup_iters: int = 2
    seed: int = 0
    head_dim: int = 128
    checkpoint_every: int | None = None
    cu_seqlens_cpu: bool = True
    python: str = field(default_factory=lambda: sys.executable)

    def validate(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise MeasureError(f"device must be cuda or cpu, got {self.device!r}")
        if self.device == "cpu" and not self.dry_run:
            raise MeasureError(
                "--device cpu has no allocator peak statistics: add --dry-run to exercise the protocol on CPU")
        if self.dry_run and self.device != "cpu":
            raise MeasureError("--dry-run runs the protocol's bookkeeping on CPU: use --device cpu --dry-run")
        for name in ("reps", "timing_runs", "head_dim"):
            if getattr(self, name) <= 0:
                raise MeasureError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.warmup_seq < 0 or self.warmup_iters < 0:
            raise MeasureError(f"warm-up sizes must be >= 0, got seq {self.warmup_seq}, iters {self.warmup_iters}")
        if self.timeout_s <= 0:
            raise MeasureError(f"timeout must be positive seconds, got {self.timeout_s}")


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fla_present() -> bool:
    """Whether ``fla.ops.kda`` can be found, without importing FLA (its import touches the GPU)."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return False
    return any(os.path.isdir(os.path.join(loc, "ops", "kda")) for loc in (spec.submodule_search_locations or ()))


def preflight(backends: list[str], options: MeasureOptions) -> None:
    """Fail early, with one clear message, when the run cannot produce any figure."""
    options.validate()
    for name in backends:
        if name not in BACKENDS:
            raise MeasureError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")
    if options.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise MeasureError(
                "no CUDA device is visible (torch.cuda.is_available() is False): `kdakit mem measure` reads the CUDA "
                "allocator's peaks; run it on a GPU machine, or use --device cpu --dry-run to exercise the protocol"
            )
    if "fla" in backends and not _fla_present():
        raise MeasureError("backend 'fla' is not importable: install fla-core 0.6.0 or put its source on PYTHONPATH")
    triton_path = "kdakit.ops.kda.chunk_triton"
    if "kdakit" in backends and options.device == "cuda" and importlib.util.find_spec(triton_path) is None:
        raise MeasureError(f"backend 'kdakit' needs kdakit's Triton kernels ({triton_path}), which are not installed")


def _common_args(options: MeasureOptions) -> list[str]:
    cmd = ["--head-dim", str(options.head_dim), "--device", options.device, "--reps", str(options.reps),
           "--timing-runs", str(options.timing_runs), "--warmup-seq", str(options.warmup_seq),
           "--warmup-iters", str(options.warmup_iters), "--seed", str(options.seed)]
    if options.dry_run:
        cmd.append("--dry-run")
    if options.checkpoint_every is not None:
        cmd += ["--checkpoint-every", str(options.checkpoint_every)]
    if not options.cu_seqlens_cpu:
        cmd.append("--no-cu-seqlens-cpu")
    return cmd


def worker_command(backend: str, shape, options: MeasureOptions) -> list[str]:
    """The command of a fresh worker process for one cell (a Cell or an ``(mbs, seq, heads)`` tuple)."""
    cell = as_cell(shape)
    cmd = [options.python, "-m", "kdakit.memory.measure_worker", "--backend", backend,
           "--mbs", str(cell.mbs), "--seq", str(cell.seq), "--heads", str(cell.heads)]
    if cell.value_heads is not None:
        cmd += ["--value-heads", str(cell.value_heads)]
    if cell.gate != "safe":
        cmd += ["--gate", cell.gate]
    return cmd + _common_args(options)


def shared_worker_command(backend: str, cells, options: MeasureOptions, warmup_only: bool = False) -> list[str]:
    """The command of one worker process that runs ``cells`` one after the other."""
    cmd = [options.python, "-m", "kdakit.memory.measure_worker", "--backend", backend,
           "--cells", ",".join(as_cell(c).label for c in cells)] + _common_args(options)
    if warmup_only:
        cmd.append("--warmup-only")
    return cmd


def worker_env(backend: str, device: str = "cuda") -> dict:
    env = protocol_env(backend)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # compiled kernels only: the interpreter would time numpy
    elif backend == "kdakit":
        # The kdakit backend on CPU tensors runs its Triton kernels under the interpreter, which triton
        # reads when it is first imported. Setting it in this (parent) process would be too late: the CLI
        # imports kdakit, and with it triton, before any command runs. Every cell already runs in a fresh
        # worker process, so the worker's environment is the one place where the variable is in force
        # from the start, and the user's own shell is left untouched.
        env["TRITON_INTERPRET"] = "1"
    root = _repo_root()
    # The child must import this kdakit (also when it is run from a source tree).
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _pump(stream, sink, tail: list[str]) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))
        del tail[:-_TAIL_LINES]
        if sink is not None:
            sink.write("    " + line)
            sink.flush()


# Worker processes lead their own sessions (so a timeout can end them and their compilers); the
# parent keeps them here so that a parent ended by a signal can end them too (kill_active_workers).
_ACTIVE: set = set()


def kill_active_workers() -> int:
    """SIGKILL the process group of every worker still running; returns how many were signalled."""
    n = 0
    for proc in list(_ACTIVE):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
    return n


def _run_worker(cmd: list[str], env: dict, timeout_s: float, label: str, progress, on_stdout=None) -> dict:
    """Run one worker process; returns ``{"timed_out", "returncode", "tail", "stdout", "wall_s"}``.

    ``on_stdout(line)`` is called for every stdout line as it arrives (from a reader thread).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    _ACTIVE.add(proc)
    tail: list[str] = []
    pump = threading.Thread(target=_pump, args=(proc.stderr, progress, tail), daemon=True)
    pump.start()
    out_lines: list[str] = []

    def read():
        for line in proc.stdout:
            out_lines.append(line)
            if on_stdout is not None:
                on_stdout(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + timeout_s
    timed_out = False
    try:
        # Wait in slices so a long silent stretch (FLA autotuning) still shows signs of life.
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout_s)
            try:
                proc.wait(timeout=min(left, HEARTBEAT_S))
                break
            except subprocess.TimeoutExpired:
                if progress is not None and time.perf_counter() < deadline:
                    progress.write(f"    ... {label} running for {time.perf_counter() - t0:.0f} s "
                                   f"(limit {timeout_s:.0f} s)\n")
                    progress.flush()
    except subprocess.TimeoutExpired:
        # The child leads its own session: end it and anything it started (compilers).
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    finally:
        _ACTIVE.discard(proc)
    reader.join(5 if timed_out else 30)
    pump.join(5 if timed_out else 30)
    return {"timed_out": timed_out, "returncode": proc.returncode, "tail": tail, "stdout": out_lines,
            "wall_s": time.perf_counter() - t0}


def _base(backend: str, cell: Cell, options: MeasureOptions) -> dict:
    return {"backend": backend, **cell.fields(), "head_dim": options.head_dim}


def run_cell(backend: str, shape, options: MeasureOptions, progress=sys.stderr) -> dict:
    """Run one cell in a fresh subprocess and return its result record (never raises for cell failures)."""
    cell = as_cell(shape)
    base = _base(backend, cell, options)
    run = _run_worker(worker_command(backend, shape, options), worker_env(backend, options.device), options.timeout_s,
                      f"{backend} {cell.label}", progress)
    if run["timed_out"]:
        return {**base, "status": "timeout", "wall_s": run["wall_s"],
                "message": f"cell exceeded its {options.timeout_s:.0f} s limit and was killed"}
    for line in reversed(run["stdout"]):
        if line.startswith(RESULT_MARKER):
            record = json.loads(line[len(RESULT_MARKER):])
            record.setdefault("wall_s", run["wall_s"])
            return {**base, **record}
    return {**base, "status": "crashed", "returncode": run["returncode"], "wall_s": run["wall_s"],
            "message": "worker ended without a result; last stderr lines: " + " | ".join(run["tail"][-5:])}


def run_shared(backend: str, cells, options: MeasureOptions, progress=sys.stderr, on_result=None,
               timeout_s: float | None = None, warmup_only: bool = False) -> list[dict]:
    """Run all ``cells`` of one backend in one worker process, in order.

    Records arrive as the worker finishes each cell (``on_result`` is called then, from the
    reader thread); a cell the process did not finish (time limit, crash) gets status
    ``timeout`` or ``crashed``. ``timeout_s`` (default ``options.timeout_s``) bounds the process.
    """
    cells = [as_cell(c) for c in cells]
    limit = options.timeout_s if timeout_s is None else timeout_s
    done: list[dict] = []
    lock = threading.Lock()

    def on_stdout(line: str) -> None:
        if not line.startswith(RESULT_MARKER):
            return
        with lock:
            record = json.loads(line[len(RESULT_MARKER):])
            i = len(done)
            cell = cells[i] if i < len(cells) else as_cell((record["mbs"], record["seq"], record["heads"]))
            full = {**_base(backend, cell, options), **record}
            done.append(full)
        if on_result is not None:
            on_result(full)

    run = _run_worker(shared_worker_command(backend, cells, options, warmup_only=warmup_only),
                      worker_env(backend, options.device), limit, f"{backend} ({len(cells)} cells)", progress,
                      on_stdout=on_stdout)
    out = list(done)
    for cell in cells[len(out):]:
        if run["timed_out"]:
            rec = {**_base(backend, cell, options), "status": "timeout", "process": "shared",
                   "message": f"the shared {backend} process exceeded its {limit:.0f} s limit before this cell ended"}
        else:
            rec = {**_base(backend, cell, options), "status": "crashed", "process": "shared",
                   "returncode": run["returncode"],
                   "message": "worker ended before this cell; last stderr lines: " + " | ".join(run["tail"][-5:])}
        out.append(rec)
        if on_result is not None:
            on_result(rec)
    return out


def annotate(record: dict) -> dict:
    """Add the floor, the overhead above it and (when modelled) the model's peak to a record."""
    hv = record.get("value_heads") or record["heads"]
    extra = {"qk_heads": record["heads"]} if hv != record["heads"] else {}
    if record.get("gate", "safe") != "safe":
        extra["gate"] = record["gate"]
    spec = protocol_spec(record["mbs"], record["seq"], hv, head_dim=record.get("head_dim", 128), **extra)
    out = dict(record)
    for key in ("peak_alloc_gib", "peak_reserved_gib", "fwd_ms", "fwd_bwd_ms"):
        out.setdefault(key, None)
    out["floor_gib"] = floor_bytes(spec) / GIB
    peak = out.get("peak_alloc_gib")
    out["overhead_gib"] = peak - out["floor_gib"] if peak is not None else None
    try:
        out["model_peak_alloc_gib"] = model(record["backend"], spec).peak_gib
    except ModelUnsupported:
        out["model_peak_alloc_gib"] = None
    except Exception as exc:  # a model failure must not lose a measured cell
        out["model_peak_alloc_gib"] = None
        out["model_message"] = f"{type(exc).__name__}: {exc}"
    mp = out["model_peak_alloc_gib"]
    out["model_error_pct"] = 100.0 * (mp - peak) / peak if (mp is not None and peak) else None
    return out


def _skipped(backend: str, cell: Cell, options: MeasureOptions) -> dict:
    return {**_base(backend, cell, options), "status": "skipped", "wall_s": 0.0,
            "message": "not started: the run's time budget was spent"}


MIN_CELL_S = 5.0  # a cell is not started with less time than this left before the deadline


def run_measure(backends: list[str], shapes, options: MeasureOptions, progress=sys.stderr, on_result=None,
                shared_process: bool = False, deadline: float | None = None) -> list[dict]:
    """Measure every backend x shape cell; ``on_result(record)`` is called as each cell finishes.

    Fresh process per cell (docs/spec.md §3), cells in shape order, backends interleaved; with
    ``shared_process`` one process per backend runs all of its cells (backend by backend).
    ``deadline`` (``time.monotonic()``) caps every limit; see the module docstring.
    """
    preflight(backends, options)
    cells_in = [as_cell(s) for s in shapes]
    results = []

    def left() -> float:
        return float("inf") if deadline is None else deadline - time.monotonic()

    def finish(record, tag):
        record = annotate(record)
        if progress is not None:
            progress.write(f"{tag}: {summary(record)}\n")
            progress.flush()
        results.append(record)
        if on_result is not None:
            on_result(record)

    if shared_process:
        for bi, backend in enumerate(backends):
            remaining = left()
            if remaining < MIN_CELL_S:
                for cell in cells_in:
                    finish(_skipped(backend, cell, options), f"{backend} {cell.label}")
                continue
            # Leave later backends a fair share of what is left (the first ones are often cheaper and end early).
            share = remaining / (len(backends) - bi) if deadline is not None else remaining
            limit = min(options.timeout_s, share if bi < len(backends) - 1 else remaining)
            if progress is not None:
                progress.write(f"[{backend}] {len(cells_in)} cells in one process (limit {limit:.0f} s): "
                               f"{', '.join(c.label for c in cells_in)}\n")
                progress.flush()
            run_shared(backend, cells_in, options, progress, timeout_s=limit,
                       on_result=lambda r, b=backend: finish(r, f"[{b}] {r.get('cell', '')}"))
        return results

    cells = [(b, c) for c in cells_in for b in backends]
    for i, (backend, cell) in enumerate(cells, 1):
        label = f"{backend} {cell.label}"
        remaining = left()
        if remaining < MIN_CELL_S:
            finish(_skipped(backend, cell, options), f"[{i}/{len(cells)}] {label}")
            continue
        opts = options if remaining >= options.timeout_s else dataclasses.replace(options, timeout_s=remaining)
        if progress is not None:
            progress.write(f"[{i}/{len(cells)}] {label} (limit {opts.timeout_s:.0f} s)\n")
            progress.flush()
        finish(run_cell(backend, cell, opts, progress), f"[{i}/{len(cells)}] {label}")
    return results


def summary(r: dict) -> str:
    if r["status"] == "warm":
        return f"warm (small warm-up {r.get('warmup_s', 0):.0f} s) after {r.get('wall_s', 0):.0f} s"
    if r["status"] != "ok":
        return f"{r['status'].upper()} ({r.get('message', '')}) after {r.get('wall_s', 0):.0f} s"
    peak = "n/a (dry run)" if r.get("peak_alloc_gib") is None else f"{r['peak_alloc_gib']:.3f} GiB"
    if r.get("peak_reserved_gib") is not None:
        peak += f" (reserved {r['peak_reserved_gib']:.3f})"
    return f"ok, peak {peak}, fwd {r['fwd_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms, {r.get('wall_s', 0):.0f} s"


def json_record(r: dict) -> dict:
    """The JSON line of a record: rounded figures, stable keys first."""
    keys = ("backend", "mbs", "seq", "heads", "head_dim", "status", "peak_alloc_gib", "peak_reserved_gib",
            "floor_gib", "overhead_gib", "model_peak_alloc_gib", "model_error_pct", "fwd_ms", "fwd_bwd_ms")
    out = {k: _round(r.get(k)) for k in keys}
    for k, v in r.items():
        if k not in out:
            out[k] = _round(v)
    return out


def _round(v):
    return float(f"{v:.10g}") if isinstance(v, float) else v


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(records: list[dict]) -> str:
    """The measured table: floor, peak, overhead above the floor, reserved, model and times."""
    lines = [
        "| backend | shape (MBS x seq : heads) | floor GiB | peak alloc GiB | overhead GiB | peak reserved GiB "
        "| model GiB | model vs measured | fwd ms | fwd+bwd ms | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        err = r.get("model_error_pct")
        shape = f"{r['mbs']} x {r['seq']} : {r['heads']}"
        if r.get("value_heads") not in (None, r["heads"]):
            shape += f"/{r['value_heads']}"
        if r.get("gate", "safe") != "safe":
            shape += f" {r['gate']}"
        lines.append(
            f"| {r['backend']} | {shape} | {_fmt(r.get('floor_gib'), '.3f')} "
            f"| {_fmt(r.get('peak_alloc_gib'), '.3f')} | {_fmt(r.get('overhead_gib'), '.3f')} "
            f"| {_fmt(r.get('peak_reserved_gib'), '.3f')} | {_fmt(r.get('model_peak_alloc_gib'), '.3f')} "
            f"| {'-' if err is None else f'{err:+.2f}%'} | {_fmt(r.get('fwd_ms'), '.2f')} "
            f"| {_fmt(r.get('fwd_bwd_ms'), '.2f')} | {r['status']} |"
        )
    return "\n".join(lines)


def load_records(path: str) -> list[dict]:
    """Read JSON lines written by ``kdakit mem measure --json``."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
    return records
