"""The ``kdakit mem`` command: ``measure``, ``model`` and ``plot``.

``register(subparsers)`` adds it to the ``kdakit`` parser. Shapes are comma lists of cells in the
notation of docs/spec.md §3, ``MBSxSEQ:H[/HV][:gate]`` (``1x8192:96,8x8192:16``, ``1x8192:16/32``,
``1x8k:96:softplus``), read by the one cell parser of every command (``measure_worker.parse_cells``);
backends are comma lists (``kdakit,fla``). Both are parsed by the command itself so a bad value gives
one line on stderr and exit status 2.

Exit status: 0 success; 1 ``measure`` finished but a cell failed (error, crash, timeout;
an OOM is a result, not a failure); 2 bad arguments or a run that cannot start (no CUDA
device, a backend missing, a backend without a model).
"""

from __future__ import annotations

import argparse
import json
import sys

from kdakit.memory.measure_worker import GATES as CELL_GATES
from kdakit.memory.measure_worker import Cell, cell_of_record, parse_cell, parse_cells

SPEC_SHAPES = "1x8192:96,8x8192:16,1x8192:128,1x131072:96"
SHAPES_HELP = "comma list of cells MBSxSEQ:H[/HV][:gate] (docs/spec.md §3)"
# The token dtypes ``--dtype`` documents (those chunk_kda takes for q, k, v, g, beta).
TOKEN_DTYPES = ("bf16", "fp16", "fp32")


class CommandError(Exception):
    """A one-line error for the user."""


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("call options (defaults: the memory protocol of docs/memory.md)")
    g.add_argument("--head-dim", type=int, default=128, help="K (and V unless --value-dim), default 128")
    g.add_argument("--value-dim", type=int, default=None, help="V, default = --head-dim")
    g.add_argument("--qk-heads", type=int, default=None,
                   help="q/k heads H of cells written MBSxSEQ:HEADS (HEADS is then HV), default = HEADS")
    g.add_argument("--dtype", default="bf16", help=f"token dtype: {', '.join(TOKEN_DTYPES)} (default bf16)")
    g.add_argument("--gate", default=None,
                   help="safe (lower bound -5), softplus or precomputed, for cells that name no gate (default safe)")
    g.add_argument("--gate-dtype", default=None,
                   help="g's dtype (and dg's): bf16, fp16, fp32 (default fp32 for precomputed, else --dtype)")
    g.add_argument("--pipeline", default=None, choices=("windowed16", "chunk64", "chunk64_fast"),
                   help="kdakit's Triton pipeline (default: chunk_kda's for the gate: windowed16 for safe, chunk64 "
                        "for softplus and precomputed); --checkpoint-every is a 64-token pipeline's window")
    g.add_argument("--no-l2norm", action="store_true", help="without in-kernel q/k l2norm")
    g.add_argument("--no-beta-sigmoid", action="store_true", help="without in-kernel beta sigmoid")
    g.add_argument("--no-gate-params", action="store_true", help="without A_log and dt_bias")
    g.add_argument("--initial-state", action="store_true", help="with a differentiated fp32 initial state")
    g.add_argument("--output-final-state", action="store_true", help="with a final-state output")
    g.add_argument("--no-varlen", action="store_true", help="[MBS, SEQ, ...] tensors instead of packed cu_seqlens")
    g.add_argument("--checkpoint-every", type=int, default=None, help="kdakit state-checkpoint cadence in tokens")


def _spec(args, cell: Cell):
    """The modelled call of one cell: the heads ``H/HV`` and the gate the cell writes, else ``--qk-heads`` (the
    cell's heads are then HV, as in ``MBSxSEQ:HEADS``) and ``--gate``; an option contradicting the cell raises."""
    from kdakit.memory.model import protocol_spec

    if args.dtype.lower() not in TOKEN_DTYPES:
        raise CommandError(f"--dtype must be one of {', '.join(TOKEN_DTYPES)}, got {args.dtype!r}")
    gate_dtype = getattr(args, "gate_dtype", None)
    if gate_dtype is not None and gate_dtype.lower() not in TOKEN_DTYPES:
        raise CommandError(f"--gate-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {gate_dtype!r}")
    qk_heads = args.qk_heads
    if cell.value_heads is not None:
        if qk_heads is not None and qk_heads != cell.heads:
            raise CommandError(f"--qk-heads must match the q/k heads H={cell.heads} of cell {cell.label}, "
                               f"got {qk_heads}")
        qk_heads = cell.heads
    gate = args.gate if args.gate is not None else cell.gate
    if cell.gate != "safe" and gate != cell.gate:
        raise CommandError(f"--gate must match the gate {cell.gate} of cell {cell.label}, got {args.gate!r}")
    return protocol_spec(
        cell.mbs, cell.seq, cell.hv, head_dim=args.head_dim, value_dim=args.value_dim, qk_heads=qk_heads,
        dtype=args.dtype.lower(), gate=gate, use_qk_l2norm=not args.no_l2norm,
        use_beta_sigmoid=not args.no_beta_sigmoid, gate_params=not args.no_gate_params,
        initial_state=args.initial_state, output_final_state=args.output_final_state, varlen=not args.no_varlen,
        checkpoint_every_n_tokens=args.checkpoint_every,
        gate_dtype=gate_dtype.lower() if gate_dtype else None, pipeline=getattr(args, "pipeline", None),
    )


def _models(args, backends, cells):
    from kdakit.memory.model import ModelUnsupported, model

    out = []
    for cell in cells:
        spec = _spec(args, cell)
        for backend in backends:
            try:
                out.append(model(backend, spec))
            except ModelUnsupported as exc:
                raise CommandError(str(exc)) from None
    return out


def _spec_cell(spec) -> str | None:
    """The label of the measured cell a modelled call is (``mem measure`` records name theirs), None when the
    call is not one (a precomputed gate)."""
    if spec.gate not in CELL_GATES:
        return None
    return Cell(spec.mbs, spec.seq, spec.H, spec.HV, spec.gate).label


def _shape_text(spec) -> str:
    """The table's shape column: ``MBS x SEQ : H[/HV][ : gate]`` (heads alone when H = HV, as the protocol's)."""
    heads = str(spec.HV) if spec.H == spec.HV else f"{spec.H}/{spec.HV}"
    return f"{spec.mbs} x {spec.seq} : {heads}" + (f" : {spec.gate}" if spec.gate != "safe" else "")


# ---------------------------------------------------------------------------------------
# mem model


def _cmd_model(args) -> int:
    from kdakit.memory.measure import load_records
    from kdakit.memory.model import GROUPS, parse_backends

    backends = parse_backends(args.backends)
    models = _models(args, backends, parse_cells(args.shapes))
    measured = {}
    if args.measured:
        for r in load_records(args.measured):
            if r.get("status") == "ok" and r.get("peak_alloc_gib") is not None:
                measured[(r["backend"], cell_of_record(r).label)] = float(r["peak_alloc_gib"])
    if args.reserved:
        _check_reserved_models(models)
    if args.json:
        for m in models:
            rec = m.to_json()
            if args.reserved and m.backend == "kdakit":
                r = _reserved(m)
                rec["reserved_after_short_step_gib"] = r.peak_reserved_bytes / 2 ** 30
                rec["reserved_clean_gib"] = r.peak_reserved_clean_bytes / 2 ** 30
            got = measured.get((m.backend, _spec_cell(m.spec)))
            if got is not None:
                rec["measured_peak_alloc_gib"] = got
                rec["model_error_pct"] = round(100.0 * (m.peak_gib - got) / got, 4)
            if args.tensors:
                rec["tensors"] = [{"name": b.name, "group": b.group, "gib": round(b.nbytes / 2 ** 30, 6)}
                                  for b in m.blocks]
            print(json.dumps(rec))
        return 0
    groups = list(GROUPS)
    head = ["backend", "shape", "floor", "peak"] + (["measured", "model vs measured"] if measured else []) \
        + ["overhead"] + groups
    print("Modelled peak allocated memory, GiB (2^30 B), live storage groups at the peak:\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|")
    for m in models:
        s = m.spec
        row = [m.backend, _shape_text(s), f"{m.floor_gib:.3f}", f"{m.peak_gib:.3f}"]
        if measured:
            got = measured.get((m.backend, _spec_cell(s)))
            row += ["-", "-"] if got is None else [f"{got:.3f}", f"{100.0 * (m.peak_gib - got) / got:+.2f}%"]
        gg = m.groups_gib()
        row += [f"{m.overhead_gib:.3f}"] + [f"{gg.get(g, 0.0):.3f}" for g in groups]
        print("| " + " | ".join(row) + " |")
    print()
    if args.reserved:
        _print_reserved(models)
    for m in models:
        print(f"{m.backend} {m.spec.label}: peak during {m.peak_stage}"
              + (f" ({m.notes[0][len('kdakit plan: '):]})" if m.backend == "kdakit" and m.notes else ""))
        if args.tensors:
            for b in sorted(m.blocks, key=lambda b: (-b.nbytes, b.name)):
                print(f"    {b.name:<24} {b.group:<28} {b.nbytes / 2 ** 30:10.4f} GiB")
    return 0


def _check_reserved_models(models) -> None:
    """``--reserved`` replays the measure protocol's configuration only (kdakit.memory.allocator)."""
    from kdakit.memory.model import protocol_spec

    for m in models:
        s = m.spec
        if m.backend == "kdakit" and s != protocol_spec(s.mbs, s.seq, s.heads):
            raise CommandError("--reserved replays the measure protocol's own call (bf16, D = 128, HV = H, safe "
                               "gate, l2norm, beta sigmoid, packed sequences); drop the other model options")


def _reserved(m):
    from kdakit.memory.allocator import predict_protocol_reserved

    return predict_protocol_reserved(m.spec.mbs, m.spec.seq, m.spec.heads)


def _print_reserved(models) -> None:
    print("Replayed reserved memory (the caching allocator over the measure protocol, kdakit.memory.allocator), GiB:\n")
    print("| backend | shape | floor | peak allocated | reserved after a 1K-token step | reserved after empty_cache |")
    print("|---|---|---:|---:|---:|---:|")
    for m in models:
        if m.backend != "kdakit":
            continue
        r = _reserved(m)
        f = r.floor_bytes
        print(f"| kdakit | {m.spec.mbs} x {m.spec.seq} : {m.spec.heads} | {f / 2 ** 30:.3f} "
              f"| {r.peak_allocated_bytes / 2 ** 30:.3f} | {r.peak_reserved_bytes / 2 ** 30:.3f} "
              f"({r.peak_reserved_bytes / f:.3f}x) | {r.peak_reserved_clean_bytes / 2 ** 30:.3f} "
              f"({r.peak_reserved_clean_bytes / f:.3f}x) |")
    print()


# ---------------------------------------------------------------------------------------
# mem measure


def _cmd_measure(args) -> int:
    from kdakit.memory.measure import (MeasureError, MeasureOptions, json_record, markdown_table,
                                       run_measure)
    from kdakit.memory.model import parse_backends

    backends = parse_backends(args.backends)
    cells = parse_cells(args.shapes)
    options = MeasureOptions(
        device=args.device, dry_run=args.dry_run, timeout_s=args.timeout, reps=args.reps,
        timing_runs=args.timing_runs, warmup_seq=args.warmup_seq, warmup_iters=args.warmup_iters,
        seed=args.seed, head_dim=args.head_dim, checkpoint_every=args.checkpoint_every,
    )
    sink = open(args.output, "a") if args.output else None

    def emit(record):
        line = json.dumps(json_record(record))
        if args.json:
            print(line, flush=True)
        if sink is not None:
            sink.write(line + "\n")
            sink.flush()

    try:
        results = run_measure(backends, cells, options, progress=None if args.quiet else sys.stderr, on_result=emit)
    except MeasureError as exc:
        raise CommandError(str(exc)) from None
    finally:
        if sink is not None:
            sink.close()
    table = markdown_table(results)
    if not args.json:
        print(table)
    elif not args.quiet:  # JSON on stdout; the human-readable table on the progress stream
        print(table, file=sys.stderr)
    if args.table:
        with open(args.table, "w") as f:
            f.write(table + "\n")
    return 0 if all(r["status"] in ("ok", "oom") for r in results) else 1


# ---------------------------------------------------------------------------------------
# mem plot


def _cmd_plot(args) -> int:
    from kdakit.memory.measure import load_records
    from kdakit.memory.model import parse_backends
    from kdakit.memory.plot import FORMATS, measured_peaks, plot_groups

    backends = parse_backends(args.backends)
    cell = parse_cell(args.shape)
    formats = [f.strip().lower() for f in args.format.split(",") if f.strip()]
    for fmt in formats:
        if fmt not in FORMATS:
            raise CommandError(f"unknown format {fmt!r}: expected png and/or svg")
    models = _models(args, backends, [cell])
    spec = models[0].spec
    measured = measured_peaks(load_records(args.measured), _spec_cell(spec)) if args.measured else None
    stem = args.out or f"kdakit_mem_{spec.mbs}x{spec.seq}_h{spec.H}" + (
        f"_hv{spec.HV}" if spec.HV != spec.H else "") + (f"_{spec.gate}" if spec.gate != "safe" else "")
    try:
        paths = plot_groups(models, stem, measured=measured, formats=formats, title=args.title)
    except ImportError as exc:
        raise CommandError(str(exc)) from None
    for p in paths:
        print(p)
    return 0


# ---------------------------------------------------------------------------------------


def _run(func):
    def handler(args) -> int:
        try:
            return func(args)
        except (CommandError, ValueError, TypeError, OSError) as exc:
            print(f"kdakit mem {args.mem_command}: error: {exc}", file=sys.stderr)
            return 2
    return handler


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``mem`` (with ``measure``, ``model``, ``plot``) to a ``kdakit`` subparsers object."""
    mem = subparsers.add_parser("mem", help="measure, model and plot KDA training memory (protocol: docs/memory.md)",
                                description="Peak memory of one KDA forward+backward step: measured, modelled, drawn.")
    sub = mem.add_subparsers(dest="mem_command", metavar="SUBCOMMAND")
    sub.required = True

    m = sub.add_parser("measure", help="measure peaks by the memory protocol of docs/memory.md (one fresh process per cell, CUDA)")
    m.add_argument("--backends", default="kdakit,fla", help="comma list of kdakit, fla, reference (default kdakit,fla)")
    m.add_argument("--shapes", default=SPEC_SHAPES, help=f"{SHAPES_HELP} (default {SPEC_SHAPES})")
    m.add_argument("--json", action="store_true", help="print one JSON object per cell as it finishes")
    m.add_argument("--timeout", type=float, default=900.0, help="seconds per cell, warm-up included (default 900)")
    m.add_argument("--reps", type=int, default=3, help="measured steps per cell; the median is reported (default 3)")
    m.add_argument("--timing-runs", type=int, default=10, help="timed runs per figure (default 10)")
    m.add_argument("--warmup-seq", type=int, default=2048, help="tokens of the small warm-up shape, 0 = none (default 2048)")
    m.add_argument("--warmup-iters", type=int, default=2, help="warm-up steps at the target shape (default 2)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--head-dim", type=int, default=128, help="D = K = V (default 128)")
    m.add_argument("--checkpoint-every", type=int, default=None, help="kdakit state-checkpoint cadence in tokens")
    m.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    m.add_argument("--dry-run", action="store_true",
                   help="with --device cpu: run the protocol on CPU, times only (the kdakit backend's Triton "
                        "kernels run under the interpreter: each worker gets TRITON_INTERPRET=1)")
    m.add_argument("--output", help="also append the JSON lines to this file")
    m.add_argument("--table", help="also write the markdown table to this file")
    m.add_argument("--quiet", action="store_true", help="no progress display on stderr")
    m.set_defaults(func=_run(_cmd_measure))

    d = sub.add_parser("model", help="analytic peak and storage groups at the peak, on CPU, for any shape")
    d.add_argument("--backends", default="kdakit,fla", help="comma list of kdakit, fla (default kdakit,fla)")
    d.add_argument("--shapes", default=SPEC_SHAPES, help=f"{SHAPES_HELP} (default {SPEC_SHAPES})")
    d.add_argument("--json", action="store_true", help="one JSON object per backend x shape")
    d.add_argument("--tensors", action="store_true", help="also list every tensor live at the peak")
    d.add_argument("--measured", help="JSON lines from `kdakit mem measure --json` to compare against")
    d.add_argument("--reserved", action="store_true",
                   help="also kdakit's reserved peak, replaying the caching allocator over the measure protocol "
                        "(its own call only; a few seconds a shape)")
    _add_model_options(d)
    d.set_defaults(func=_run(_cmd_model))

    p = sub.add_parser("plot", help="stacked bar chart of the storage groups at the peak (PNG and SVG)")
    p.add_argument("--backends", default="kdakit,fla", help="comma list of kdakit, fla (default kdakit,fla)")
    p.add_argument("--shape", default="1x131072:96", help="one cell MBSxSEQ:H[/HV][:gate] (default 1x131072:96)")
    p.add_argument("--out", help="output path without extension (default kdakit_mem_<shape>)")
    p.add_argument("--format", default="png,svg", help="png, svg or png,svg (default png,svg)")
    p.add_argument("--measured", help="JSON lines from `kdakit mem measure --json`: measured peaks as markers")
    p.add_argument("--title")
    _add_model_options(p)
    p.set_defaults(func=_run(_cmd_plot))
    return mem


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m kdakit.memory.mem_cli mem model ...``."""
    parser = argparse.ArgumentParser(prog="kdakit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
