"""kdakit vs FLA 0.6.0 chunk_kda on the GPU: correctness gate, then peak memory and time.

Protocol: docs/spec.md §3 (``kdakit.memory.measure``: one fresh process per backend x shape, median of
three steady-state forward+backward peaks, expandable_segments off, FLA with
FLA_DISABLE_BACKEND_DISPATCH=1 and the same flags, ``cu_seqlens_cpu`` passed to both; a
1K-token forward+backward runs first in every cell, so the reserved peak is that of a process
that saw a small call first). Beside each figure: the memory floor (inputs + dO + O +
gradients) and two time floors:

* bytes floor: forward reads q, k, v, g, beta and writes o (10·T·H·D + 2·T·H bytes in bf16);
  forward+backward also reads them and dO again and writes five gradients
  (28·T·H·D + 6·T·H bytes), at the 4.3 TB/s measured H200 copy bandwidth;
* FLOPs floor: the matmul FLOPs of the chunked form at C = 64 (FLA's chunk), per token and
  value head 2·C·(3K + 2V) + 6·K·V forward, three times that for forward+backward, at 790 TFLOP/s.
  (With grouped value heads, H q/k heads and HV value heads, the bytes count each tensor at its
  own head count and the FLOPs count value heads.)

Cells are ``MBSxSEQ:H`` (docs/spec.md §3), ``MBSxSEQ:H/HV`` (grouped value heads: q/k H heads, v/g/beta
HV) or ``...:softplus`` (the unbounded gate: use_gate_in_kernel, safe_gate=False,
lower_bound=None, A_log and dt_bias given).

Usage: python benchmarks/bench_chunk.py --out results.json [--backends kdakit,fla]
       [--shapes 1x8192:96,8x8192:16,1x8192:128,1x131072:96] [--skip-gate | --gate-only | --gate-from F]
       [--reps 3] [--timing-runs 10] [--warmup-iters 2] [--shared-process] [--budget-s S]
       python benchmarks/bench_chunk.py --warm-cells SHAPES   # the cells whose kernels differ
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    from kdakit.memory.measure_worker import Cell, cell_of_record, parse_cells  # noqa: E402
except ImportError:  # no torch in this interpreter (--help, --warm-cells): that module itself needs only the stdlib
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_kdakit_measure_worker",
                                                   os.path.join(ROOT, "kdakit", "memory", "measure_worker.py"))
    _mw = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mw  # dataclasses look their module up while building the class
    _spec.loader.exec_module(_mw)
    Cell, cell_of_record, parse_cells = _mw.Cell, _mw.cell_of_record, _mw.parse_cells

SHAPES = "1x8192:96,8x8192:16,1x8192:128,1x131072:96"
COPY_BW = 4.3e12     # bytes/s, measured device-to-device copy on the H200 (docs/spec.md §7)
MATMUL_RATE = 790e12  # FLOP/s, measured bf16 8192^3 matmul on the H200 (docs/spec.md §7)

def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        mbs_seq, heads = item.split(":")
        mbs, seq = mbs_seq.lower().split("x")
        out.append((int(mbs), int(seq), int(heads)))
    return out


def time_floors_ms(mbs: int, seq: int, heads: int, d: int = 128, chunk: int = 64,
                   value_heads: int | None = None) -> dict:
    """Bytes and FLOPs floors (ms) of the forward and forward+backward; ``heads`` is H, ``value_heads`` HV."""
    T = mbs * seq
    hv = value_heads or heads
    inputs = 2 * (2 * T * heads * d + 2 * T * hv * d + T * hv)  # q, k, v, g, beta in bf16
    out = 2 * T * hv * d                                        # o (and dO)
    fwd_bytes = inputs + out
    fb_bytes = fwd_bytes + inputs + out + inputs                # read inputs and dO again, write 5 gradients
    fwd_flops = T * hv * (2 * chunk * (3 * d + 2 * d) + 6 * d * d)
    return {
        "fwd_bytes_floor_ms": 1e3 * fwd_bytes / COPY_BW,
        "fwd_flops_floor_ms": 1e3 * fwd_flops / MATMUL_RATE,
        "fwd_bwd_bytes_floor_ms": 1e3 * fb_bytes / COPY_BW,
        "fwd_bwd_flops_floor_ms": 1e3 * 3 * fwd_flops / MATMUL_RATE,
    }


def warm_cells(cells: list[Cell], seq: int = 1024) -> list[Cell]:
    """Small cells (1 x ``seq``) for the kernel variants that ``cells`` need beyond the docs/spec.md §3 cells.

    One per distinct (H, HV, gate) among the cells with grouped value heads or the softplus
    gate: FLA's autotune keys and constexprs hold H and HV (its keys do not hold T), kdakit's
    constexprs hold the gate; run in the background before the timed stages (run_gpu.sh `warm`).
    """
    out, seen = [], set()
    for c in cells:
        if c.value_heads is None and c.gate == "safe":
            continue
        key = (c.heads, c.hv, c.gate)
        if key not in seen:
            seen.add(key)
            out.append(Cell(1, seq, c.heads, c.value_heads, c.gate))
    return out


def correctness_gate(T: int = 2048, H: int = 4, seed: int = 0) -> dict:
    """kdakit's Triton path (bf16, docs/spec.md §3 flags plus states) against the float64 chunked reference."""
    import torch

    from kdakit import chunk_kda
    from kdakit.testing import SPEC_RMS_LIMITS, error_report, float64_copy, make_kda_inputs, run_kda

    inp = make_kda_inputs(T=T, H=H, HV=H, K=128, V=128, dtype=torch.bfloat16, device="cuda", gate="safe",
                          seqlens=[T // 4, T // 2 + 5, T // 4 - 5], initial_state="kv",
                          generator=torch.Generator().manual_seed(seed))
    got = run_kda(chunk_kda, inp, seed=seed)
    ref_inp = float64_copy(inp)

    def ref_fn(*a, **kw):
        os.environ["KDAKIT_BACKEND"] = "torch"
        try:
            return chunk_kda(*a, **kw)
        finally:
            os.environ.pop("KDAKIT_BACKEND")

    ref = run_kda(ref_fn, ref_inp, seed=seed)
    rows = {}
    for name, lim in SPEC_RMS_LIMITS.items():
        rep = error_report(name, ref[name], got[name])
        rows[name] = {"max_abs": rep.max_abs, "rms_ratio": rep.rms_ratio, "limit": lim, "ok": rep.rms_ratio <= lim}
    return {"shape": f"T={T} (3 packed sequences) H={H} K=V=128 bf16", "errors": rows,
            "ok": all(r["ok"] for r in rows.values())}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Cells: MBSxSEQ:H, MBSxSEQ:H/HV (grouped value heads), ...:softplus (unbounded gate).")
    ap.add_argument("--out", help="results JSON (required unless --warm-cells)")
    ap.add_argument("--backends", default="kdakit,fla")
    ap.add_argument("--shapes", default=SHAPES, help=f"cells, comma-separated (default {SHAPES})")
    ap.add_argument("--cell-timeout", type=float, default=420.0,
                    help="seconds per cell (with --shared-process: per backend process)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run: no cell's limit goes past it, later cells are skipped")
    ap.add_argument("--skip-gate", action="store_true", help="no correctness gate")
    ap.add_argument("--gate-only", action="store_true", help="run only the correctness gate")
    ap.add_argument("--gate-from", default=None,
                    help="a --gate-only results file: its gate is recorded; a failed gate drops kdakit's timings")
    ap.add_argument("--reps", type=int, default=3, help="measured forward+backward peaks per cell (median)")
    ap.add_argument("--timing-runs", type=int, default=10, help="CUDA-event runs per time (median)")
    ap.add_argument("--warmup-seq", type=int, default=1024, help="tokens of the small warm-up call (default 1024)")
    ap.add_argument("--warmup-iters", type=int, default=2, help="warm-up steps at the target shape")
    ap.add_argument("--shared-process", action="store_true",
                    help="one process per backend runs all its cells (instead of a fresh process per cell)")
    ap.add_argument("--no-cu-seqlens-cpu", action="store_true", help="do not pass cu_seqlens_cpu to the backends")
    ap.add_argument("--warm-cells", default=None, metavar="SHAPES",
                    help="print the small warm-up cells of SHAPES' GVA / softplus variants (comma-separated) and exit")
    return ap


def _write(path: str, data: dict) -> None:
    # Records arrive on a reader thread (shared processes) and a signal handler may save too: own temp names.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def comparisons_of(records: list[dict]) -> list[dict]:
    """kdakit / FLA ratios per cell where both backends have an ok record."""
    by = {}
    for r in records:
        if r.get("status") == "ok":
            by[(r["backend"], cell_of_record(r).label)] = r
    out = []
    labels = list(dict.fromkeys(cell_of_record(r).label for r in records))
    for label in labels:
        a, b = by.get(("kdakit", label)), by.get(("fla", label))
        if a and b:
            c = {"shape": label,
                 "peak_alloc_ratio_kdakit_over_fla": a["peak_alloc_gib"] / b["peak_alloc_gib"],
                 "fwd_ratio_kdakit_over_fla": a["fwd_ms"] / b["fwd_ms"],
                 "fwd_bwd_ratio_kdakit_over_fla": a["fwd_bwd_ms"] / b["fwd_bwd_ms"]}
            if a.get("fwd_nograd_ms") and b.get("fwd_nograd_ms"):
                c["fwd_nograd_ratio_kdakit_over_fla"] = a["fwd_nograd_ms"] / b["fwd_nograd_ms"]
            if a.get("peak_reserved_gib") and b.get("peak_reserved_gib"):
                c["peak_reserved_ratio_kdakit_over_fla"] = a["peak_reserved_gib"] / b["peak_reserved_gib"]
            out.append(c)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.warm_cells is not None:
        print(",".join(c.label for c in warm_cells(parse_cells(args.warm_cells), seq=args.warmup_seq)))
        return 0
    if not args.out:
        build_parser().error("--out is required")
    cells = parse_cells(args.shapes)
    backends = [b for b in args.backends.split(",") if b]
    t_start = time.monotonic()
    deadline = None if args.budget_s is None else t_start + args.budget_s
    import torch

    if not torch.cuda.is_available():
        print("bench_chunk: no CUDA device", file=sys.stderr)
        return 2

    from kdakit.memory import measure

    # The device copy of the tree has no .git: run_gpu.sh's caller passes the commit in KDAKIT_GIT_SHA.
    sha = os.environ.get("KDAKIT_GIT_SHA") or "unknown"
    process = ("one process per backend for all its cells, in the order given (allocator cache emptied and the "
               "1K-token warm-up rerun between cells)" if args.shared_process else "fresh process per cell")
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "git_sha": sha,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "protocol": (f"docs/spec.md §3: bf16, D=128, l2norm + beta sigmoid + in-kernel gate (safe, lb -5, unless the cell "
                     f"says softplus), cu_seqlens{'' if args.no_cu_seqlens_cpu else ' + cu_seqlens_cpu'}, no states, "
                     f"7 inputs differentiated; 1x{args.warmup_seq} fwd+bwd first, then {args.warmup_iters} at the "
                     f"target; median of {args.reps} fwd+bwd peaks; times: median of {args.timing_runs} CUDA-event "
                     f"runs; {process}"),
        "process_mode": "shared" if args.shared_process else "fresh",
        "reps": args.reps, "timing_runs": args.timing_runs, "warmup_seq": args.warmup_seq,
        "warmup_iters": args.warmup_iters, "cu_seqlens_cpu": not args.no_cu_seqlens_cpu,
    }
    done: list[dict] = []

    def save():
        _write(args.out, dict(result, records=done, comparisons=comparisons_of(done)))

    def on_term(signum, frame):
        # run_gpu.sh's `timeout` ends this process; its workers lead their own sessions: end them too.
        measure.kill_active_workers()
        result["interrupted"] = f"signal {signum} after {time.monotonic() - t_start:.0f} s"
        save()
        os._exit(128 + signum)

    previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _measure(args, result, done, save, backends, cells, deadline, measure)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _measure(args, result, done, save, backends, cells, deadline, measure) -> int:
    import torch

    from kdakit.memory.measure import MeasureOptions, markdown_table

    if args.gate_from:
        try:
            with open(args.gate_from) as f:
                gate = json.load(f).get("correctness_gate")
        except (OSError, ValueError) as exc:
            gate = {"ok": False, "message": f"cannot read {args.gate_from}: {exc}"}
        result["correctness_gate"] = gate or {"ok": False, "message": f"no correctness_gate in {args.gate_from}"}
        if "kdakit" in backends and not result["correctness_gate"].get("ok"):
            print("bench_chunk: the correctness gate did not pass; kdakit is not timed", file=sys.stderr)
            backends = [b for b in backends if b != "kdakit"]
            result["kdakit_dropped"] = "correctness gate not passed"
    elif not args.skip_gate:
        gate = correctness_gate()
        result["correctness_gate"] = gate
        print(json.dumps({"correctness_gate": gate}, indent=1), flush=True)
        if not gate["ok"]:
            print("bench_chunk: correctness gate FAILED; no timings taken", file=sys.stderr)
            save()
            return 1
        torch.cuda.empty_cache()
    if args.gate_only:
        save()
        return 0 if result.get("correctness_gate", {}).get("ok") else 1
    if not backends:
        save()
        return 1

    def keep(record):
        # Written after every cell, so a run cut short by its time limit keeps what it measured.
        record.update(time_floors_ms(record["mbs"], record["seq"], record["heads"],
                                     value_heads=record.get("value_heads")))
        done.append(record)
        save()

    options = MeasureOptions(timeout_s=args.cell_timeout, reps=args.reps, timing_runs=args.timing_runs,
                             warmup_seq=args.warmup_seq, warmup_iters=args.warmup_iters,
                             cu_seqlens_cpu=not args.no_cu_seqlens_cpu)
    measure.run_measure(backends, cells, options, on_result=keep, shared_process=args.shared_process,
                        deadline=deadline)
    result["markdown"] = markdown_table(done)
    save()
    print(result["markdown"])
    for c in comparisons_of(done):
        print(json.dumps(c))
    return 0 if all(r.get("status") in ("ok", "oom") for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
