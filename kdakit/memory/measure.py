"""``kdakit mem measure``: the SPEC §3 memory protocol over backends x shapes.

Every backend x shape cell runs in a fresh subprocess
(:mod:`kdakit.memory.measure_worker`) started with the protocol's environment
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``, ``FLA_DISABLE_BACKEND_DISPATCH=1``,
``KDAKIT_BACKEND``). A cell that runs out of memory is recorded as ``oom``; one that
exceeds its time limit is killed and recorded as ``timeout``; either way the run goes on.
Each finished cell is reported at once (a JSON line, or a row of the markdown table at the
end), with the SPEC §3 floor, the overhead above it and, where a model exists
(:mod:`kdakit.memory.model`), the model's peak and its deviation.

Backends: ``kdakit`` (``kdakit.chunk_kda``, Triton kernels), ``fla`` (FLA 0.6.0
``fla.ops.kda.chunk_kda``, imported from the environment / PYTHONPATH) and ``reference``
(``kdakit.chunk_kda`` with ``KDAKIT_BACKEND=torch``, the chunked PyTorch path).
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
from dataclasses import dataclass, field

from kdakit.memory.measure_worker import RESULT_MARKER, protocol_env
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
    warmup_seq: int = 2048
    warmup_iters: int = 2
    seed: int = 0
    head_dim: int = 128
    checkpoint_every: int | None = None
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


def worker_command(backend: str, shape: tuple[int, int, int], options: MeasureOptions) -> list[str]:
    mbs, seq, heads = shape
    cmd = [options.python, "-m", "kdakit.memory.measure_worker", "--backend", backend,
           "--mbs", str(mbs), "--seq", str(seq), "--heads", str(heads), "--head-dim", str(options.head_dim),
           "--device", options.device, "--reps", str(options.reps), "--timing-runs", str(options.timing_runs),
           "--warmup-seq", str(options.warmup_seq), "--warmup-iters", str(options.warmup_iters),
           "--seed", str(options.seed)]
    if options.dry_run:
        cmd.append("--dry-run")
    if options.checkpoint_every is not None:
        cmd += ["--checkpoint-every", str(options.checkpoint_every)]
    return cmd


def worker_env(backend: str, device: str = "cuda") -> dict:
    env = protocol_env(backend)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # compiled kernels only: the interpreter would time numpy
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


def run_cell(backend: str, shape: tuple[int, int, int], options: MeasureOptions, progress=sys.stderr) -> dict:
    """Run one cell in a fresh subprocess and return its result record (never raises for cell failures)."""
    mbs, seq, heads = shape
    base = {"backend": backend, "mbs": mbs, "seq": seq, "heads": heads, "head_dim": options.head_dim}
    t0 = time.perf_counter()
    proc = subprocess.Popen(worker_command(backend, shape, options), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=worker_env(backend, options.device), start_new_session=True)
    tail: list[str] = []
    pump = threading.Thread(target=_pump, args=(proc.stderr, progress, tail), daemon=True)
    pump.start()
    out_lines: list[str] = []
    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = t0 + options.timeout_s
    try:
        # Wait in slices so a long silent stretch (FLA autotuning) still shows signs of life.
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, options.timeout_s)
            try:
                proc.wait(timeout=min(left, HEARTBEAT_S))
                break
            except subprocess.TimeoutExpired:
                if progress is not None and time.perf_counter() < deadline:
                    progress.write(f"    ... {backend} {mbs}x{seq}:{heads} running for "
                                   f"{time.perf_counter() - t0:.0f} s (limit {options.timeout_s:.0f} s)\n")
                    progress.flush()
    except subprocess.TimeoutExpired:
        # The child leads its own session: end it and anything it started (compilers).
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        pump.join(5)
        return {**base, "status": "timeout", "wall_s": time.perf_counter() - t0,
                "message": f"cell exceeded its {options.timeout_s:.0f} s limit and was killed"}
    reader.join(30)
    pump.join(30)
    for line in reversed(out_lines):
        if line.startswith(RESULT_MARKER):
            record = json.loads(line[len(RESULT_MARKER):])
            record.setdefault("wall_s", time.perf_counter() - t0)
            return {**base, **record}
    return {**base, "status": "crashed", "returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
            "message": "worker ended without a result; last stderr lines: " + " | ".join(tail[-5:])}


def annotate(record: dict) -> dict:
    """Add the floor, the overhead above it and (when modelled) the model's peak to a record."""
    spec = protocol_spec(record["mbs"], record["seq"], record["heads"], head_dim=record.get("head_dim", 128))
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


def run_measure(backends: list[str], shapes: list[tuple[int, int, int]], options: MeasureOptions,
                progress=sys.stderr, on_result=None) -> list[dict]:
    """Measure every backend x shape cell; ``on_result(record)`` is called as each cell finishes."""
    preflight(backends, options)
    cells = [(b, s) for s in shapes for b in backends]
    results = []
    for i, (backend, shape) in enumerate(cells, 1):
        label = f"{backend} {shape[0]}x{shape[1]}:{shape[2]}"
        if progress is not None:
            progress.write(f"[{i}/{len(cells)}] {label} (limit {options.timeout_s:.0f} s)\n")
            progress.flush()
        record = annotate(run_cell(backend, shape, options, progress))
        if progress is not None:
            progress.write(f"[{i}/{len(cells)}] {label}: {summary(record)}\n")
            progress.flush()
        results.append(record)
        if on_result is not None:
            on_result(record)
    return results


def summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status'].upper()} ({r.get('message', '')}) after {r.get('wall_s', 0):.0f} s"
    peak = "n/a (dry run)" if r.get("peak_alloc_gib") is None else f"{r['peak_alloc_gib']:.3f} GiB"
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
        lines.append(
            f"| {r['backend']} | {r['mbs']} x {r['seq']} : {r['heads']} | {_fmt(r.get('floor_gib'), '.3f')} "
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
