"""``kdakit serve-mem``: the serving-memory estimator of ``kdakit.memory.serving`` on the command line.

``register(subparsers)`` adds the subcommand to an argparse subparsers object; the handler it installs
(``args.func(args)``) prints a table, or one JSON object with ``--json``, and returns exit code 0.
Every option overrides the chosen ``--preset`` (default ``kimi-linear-48b-a3b``). Bad values stop with
a one-line message through ``parser.error`` (exit code 2), and so do configurations kdakit's ops refuse
(value heads not a multiple of the q/k heads, a recurrent-state dtype other than fp32 or bf16). A budget
that holds nothing is an answer, not an error: the table says "nothing fits" and what one sequence
needs (with ``--json``, the same sentence goes to stderr). ``--plot`` imports matplotlib only when asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import List, Optional

from kdakit.memory.serving import (
    CONV_STATE_COLUMNS,
    DTYPE_BYTES,
    GIB,
    PRESETS,
    SCOPE_NOTE,
    TP_NOTE,
    HybridModelConfig,
    ServingEstimate,
    crossover_tokens,
    estimate,
    m_hybrid_bytes,
    m_mla_bytes,
    get_preset,
    pattern_from_counts,
    pattern_from_ratio,
    sweep,
)

__all__ = ["register", "run_serve_mem", "format_table", "plot_serving_memory", "main"]

PLOT_FORMATS = (".png", ".svg")


# ---------------------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError, which argparse turns into a one-line usage error.
# ---------------------------------------------------------------------------------------------------


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _ratio(text: str):
    parts = text.split(":")
    try:
        kda, mla = (int(p, 10) for p in parts)
    except ValueError:
        kda = mla = -1
    if len(parts) != 2 or kda < 0 or mla < 0 or kda + mla == 0:
        raise argparse.ArgumentTypeError(f"expected KDA:MLA such as 3:1, got {text!r}")
    return kda, mla


def _layer_list(text: str) -> List[int]:
    """``0,1,2,4-6`` -> [0, 1, 2, 4, 5, 6] (0-based layer indices; an empty string is no layers)."""
    ids: List[int] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo, 10), int(hi or lo, 10)
        except ValueError:
            first, last = 0, -1
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"expected 0-based layer indices like 0,1,2,4-6, got {text!r}")
        ids.extend(range(first, last + 1))
    return ids


def _dtype(text: str) -> str:
    if text.lower() not in DTYPE_BYTES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPE_BYTES)}, got {text!r}")
    return text.lower()


# The recurrent-state dtypes kdakit's kernels keep (kda_decode's state pool, chunk_kda's initial/final
# states): fp32 or bf16. The estimator itself can size others; the command refuses what the ops refuse.
STATE_DTYPES = ("fp32", "float32", "bf16", "bfloat16")


def _state_dtype(text: str) -> str:
    if text.lower() not in STATE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(STATE_DTYPES)} (the recurrent-state dtypes kdakit's kernels support), "
            f"got {text!r}")
    return text.lower()


def _preset(text: str) -> str:
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r} (known: {', '.join(PRESETS)})")
    return text


# ---------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve-mem`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = subparsers.add_parser(
        "serve-mem",
        help="active attention-state memory of a KDA/MLA hybrid vs an all-MLA model (docs/memory.md)",
        description=(
            "Estimate the active attention state of a KDA/MLA hybrid when serving, against an all-MLA "
            "model with the same layer count: M_MLA, M_hybrid, their ratio, the crossover context "
            "T* = sigma/kappa and, for a memory budget, the largest batch and longest context. "
            f"Scope: {SCOPE_NOTE}. With --tp: {TP_NOTE}."
        ),
    )
    p.add_argument("--preset", type=_preset, default="kimi-linear-48b-a3b",
                   help=f"base model, overridden by the options below ({', '.join(PRESETS)}; "
                        "default kimi-linear-48b-a3b)")
    g = p.add_argument_group("layer pattern (give at most one of --ratio, counts, explicit lists)")
    g.add_argument("--layers", type=_int_at_least(1), help="total layer count L")
    g.add_argument("--ratio", type=_ratio, help="repeating KDA:MLA cycle, e.g. 3:1 (uses --layers or the preset's L)")
    g.add_argument("--kda-count", type=_int_at_least(0), help="number of KDA layers")
    g.add_argument("--mla-count", type=_int_at_least(0), help="number of MLA layers")
    g.add_argument("--kda-layers", type=_layer_list, help="0-based KDA layer indices, e.g. 0-2,4-6")
    g.add_argument("--mla-layers", type=_layer_list, help="0-based MLA layer indices, e.g. 3,7,11")
    k = p.add_argument_group("KDA layers")
    k.add_argument("--kda-heads", type=_int_at_least(1), help="q/k heads")
    k.add_argument("--kda-value-heads", type=_int_at_least(1),
                   help="value heads, a multiple of --kda-heads (default: --kda-heads)")
    k.add_argument("--head-dim", type=_int_at_least(1), help="sets both key and value head dims")
    k.add_argument("--head-k-dim", type=_int_at_least(1), help="key head dim K")
    k.add_argument("--head-v-dim", type=_int_at_least(1), help="value head dim V")
    k.add_argument("--conv-width", type=_int_at_least(1), help="short-convolution kernel width")
    k.add_argument("--conv-state-columns", choices=CONV_STATE_COLUMNS,
                   help="past inputs kept per conv channel: width-1 (vLLM/SGLang, default) or width (FLA)")
    k.add_argument("--state-dtype", type=_state_dtype, help="recurrent state dtype: fp32 (default) or bf16")
    k.add_argument("--conv-dtype", type=_dtype, help="conv state dtype (default bf16)")
    m = p.add_argument_group("MLA layers")
    m.add_argument("--kv-lora-rank", type=_int_at_least(1), help="latent (compressed KV) width")
    m.add_argument("--rope-dim", type=_int_at_least(0), help="decoupled RoPE key width")
    m.add_argument("--mla-cache-dtype", type=_dtype, help="MLA cache dtype (default bf16)")
    s = p.add_argument_group("serving")
    s.add_argument("--batch", type=_int_at_least(1), default=1, help="sequences served at once (default 1)")
    s.add_argument("--context", type=_int_at_least(1), default=131072, help="tokens per sequence (default 131072)")
    s.add_argument("--tp", type=_int_at_least(1), default=1, help="tensor-parallel degree (default 1)")
    s.add_argument("--budget-gib", type=_positive_float,
                   help="per-device memory for attention state (device memory minus weights), GiB")
    o = p.add_argument_group("output")
    o.add_argument("--plot", type=Path, metavar="PATH", help="draw ratio and memory vs context (.png or .svg)")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.error = functools.partial(_one_line_error, p)
    p.set_defaults(func=functools.partial(run_serve_mem, parser=p))
    return p


def _one_line_error(parser: argparse.ArgumentParser, message: str):
    # argparse's default prints the whole 15-line usage first; one line points to --help instead.
    parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")


# ---------------------------------------------------------------------------------------------------
# Building the configuration from the options
# ---------------------------------------------------------------------------------------------------


def _pattern(args, base: HybridModelConfig):
    """(num_layers, kda_layers, mla_layers) from the pattern options; raises ValueError on conflicts."""
    explicit = args.kda_layers is not None or args.mla_layers is not None
    counts = args.kda_count is not None or args.mla_count is not None
    ratio = args.ratio is not None
    if explicit + counts + ratio > 1:
        raise ValueError("give only one of --ratio, --kda-count/--mla-count, --kda-layers/--mla-layers")
    if explicit:
        if args.layers is not None:
            n = args.layers
        elif args.kda_layers is not None and args.mla_layers is not None:
            n = max(args.kda_layers + args.mla_layers, default=-1) + 1
        else:
            n = base.num_layers
        kda = args.kda_layers if args.kda_layers is not None else [i for i in range(n) if i not in set(args.mla_layers)]
        mla = args.mla_layers if args.mla_layers is not None else [i for i in range(n) if i not in set(args.kda_layers)]
        return n, tuple(kda), tuple(mla)
    if counts:
        nk, nm = args.kda_count, args.mla_count
        if nk is None or nm is None:
            if args.layers is None:
                raise ValueError("--kda-count/--mla-count: give both, or one of them with --layers")
            nk = args.layers - nm if nk is None else nk
            nm = args.layers - nk if nm is None else nm
            if nk < 0 or nm < 0:
                raise ValueError(f"--kda-count/--mla-count: a count exceeds --layers {args.layers}")
        if args.layers is not None and nk + nm != args.layers:
            raise ValueError(f"--layers {args.layers}: expected --kda-count + --mla-count = {args.layers}, got {nk + nm}")
        kda, mla = pattern_from_counts(nk, nm)
        return nk + nm, kda, mla
    if ratio:
        n = args.layers if args.layers is not None else base.num_layers
        kda, mla = pattern_from_ratio(n, *args.ratio)
        return n, kda, mla
    if args.layers is not None and args.layers != base.num_layers:
        raise ValueError(
            f"--layers {args.layers} changes the preset's {base.num_layers} layers: "
            "give --ratio, --kda-count/--mla-count or --kda-layers/--mla-layers as well"
        )
    return base.num_layers, base.kda_layers, base.mla_layers


def config_from_args(args) -> HybridModelConfig:
    """The model configuration the options describe (the preset with every given option applied)."""
    base = get_preset(args.preset)
    n, kda, mla = _pattern(args, base)
    changes = dict(num_layers=n, kda_layers=kda, mla_layers=mla)
    if args.head_dim is not None:
        changes.update(head_k_dim=args.head_dim, head_v_dim=args.head_dim)
    for field in ("kda_heads", "kda_value_heads", "head_k_dim", "head_v_dim", "conv_width", "conv_state_columns",
                  "state_dtype", "conv_dtype", "kv_lora_rank", "rope_dim", "mla_cache_dtype"):
        if getattr(args, field) is not None:
            changes[field] = getattr(args, field)
    modified = any(getattr(base, f) != v for f, v in changes.items())
    changes["name"] = f"custom (from {base.name})" if modified else base.name
    return dataclasses.replace(base, **changes)


# ---------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------


def _bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.3f} {unit})"
    return f"{n:,} B"


def _ranges(ids) -> str:
    """[0, 1, 2, 4] -> '0-2,4'."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out) or "none"


def _tokens(t: Optional[int]) -> str:
    return "unbounded" if t is None else f"{t:,} tokens"


def _state_bytes(est: ServingEstimate, design: str, batch: int, context: int) -> int:
    fn = m_hybrid_bytes if design == "hybrid" else m_mla_bytes
    return fn(est.model, batch, context, est.tp)


def _short_bytes(n: int) -> str:
    return f"{n / GIB:.3f} GiB" if n >= GIB // 1000 else f"{n:,} B"


def _fit_batch(est: ServingEstimate, design: str) -> str:
    n = est.max_batch_hybrid if design == "hybrid" else est.max_batch_mla
    if n:
        return f"{n:,}"
    need = _state_bytes(est, design, 1, est.context)
    return f"0 (nothing fits: one sequence needs {_short_bytes(need)})"


def _fit_context(est: ServingEstimate, design: str) -> str:
    t = est.max_context_hybrid if design == "hybrid" else est.max_context_mla
    if t != 0:
        return _tokens(t)
    need = _state_bytes(est, design, est.batch, 1)
    return f"0 tokens (nothing fits: batch {est.batch:,} needs {_short_bytes(need)} at one token)"


def budget_bytes_of(gib: float) -> int:
    """The bytes of a ``--budget-gib`` figure (whole bytes, rounded down: a budget is not exceeded)."""
    return int(gib * GIB)


def budget_text(budget_bytes: int) -> str:
    """A budget in GiB as a person writes it: the decimal with the fewest places that ``budget_bytes_of`` turns
    back into these bytes ("0.001" for ``--budget-gib 0.001``, whose bytes / 2^30 print as 0.000999999)."""
    low = Decimal(budget_bytes) / GIB  # the figures that give these bytes lie in [low, high)
    high = Decimal(budget_bytes + 1) / GIB
    for places in range(20):
        text = low.quantize(Decimal(1).scaleb(-places), rounding=ROUND_CEILING)
        if text < high and budget_bytes_of(float(text)) == budget_bytes:
            return format(text, "f")
    return f"{budget_bytes / GIB:g}"


def nothing_fits(est: ServingEstimate) -> Optional[str]:
    """A plain sentence when the budget holds not one sequence of ``est.context`` tokens in the hybrid, else None."""
    if est.budget_bytes is None or est.max_batch_hybrid:
        return None
    hybrid = _state_bytes(est, "hybrid", 1, est.context)
    mla = _state_bytes(est, "mla", 1, est.context)
    return (f"the {budget_text(est.budget_bytes)} GiB budget per device does not hold one sequence of "
            f"{est.context:,} tokens: the hybrid needs {_short_bytes(hybrid)}, all-MLA {_short_bytes(mla)}; "
            "raise --budget-gib or lower --context")


def format_table(est: ServingEstimate) -> str:
    """The human-readable report of ``kdakit serve-mem``."""
    c = est.model
    rows = [
        ("model", f"{c.name}: {c.num_layers} layers = {c.num_kda} KDA + {c.num_mla} MLA "
                  f"(MLA layers {_ranges(c.mla_layers)}, 0-based); baseline: {c.num_layers} MLA layers"),
        ("KDA layer", f"{c.kda_heads} q/k heads x K={c.head_k_dim}, {c.value_heads} value heads x V={c.head_v_dim}; "
                      f"state {c.state_dtype}; conv width {c.conv_width}, {c.conv_columns} columns kept "
                      f"({c.conv_state_columns}), {c.conv_dtype}"),
        ("MLA layer", f"kv_lora_rank {c.kv_lora_rank} + rope {c.rope_dim}, cache {c.mla_cache_dtype}"),
        ("serving", f"batch {est.batch}, context {est.context:,} tokens, tp {est.tp} (figures per rank)"),
        ("", ""),
        ("sigma  KDA state / seq / layer", f"{_bytes(est.kda_state_bytes_per_seq)} = recurrent "
                                           f"{est.kda_recurrent_bytes_per_seq:,} + conv {est.kda_conv_bytes_per_seq:,}"),
        ("kappa  MLA cache / token / layer", _bytes(est.mla_bytes_per_token)),
        ("M_MLA     all-MLA baseline", _bytes(est.m_mla_bytes)),
        ("M_hybrid  KDA/MLA hybrid", _bytes(est.m_hybrid_bytes)),
        ("ratio  M_hybrid / M_MLA", f"{est.ratio:.4f} (long-context limit {c.num_mla}/{c.num_layers} = {est.ratio_limit:.4f})"),
        ("crossover  T* = sigma/kappa", f"{est.crossover_tokens:,.1f} tokens (the hybrid holds less state above T*)"),
    ]
    if est.budget_bytes is not None:
        rows += [
            (f"budget {budget_text(est.budget_bytes)} GiB per device", ""),
            (f"  largest batch at {est.context:,} tokens",
             f"hybrid {_fit_batch(est, 'hybrid')}, all-MLA {_fit_batch(est, 'mla')}"),
            (f"  longest context at batch {est.batch}",
             f"hybrid {_fit_context(est, 'hybrid')}, all-MLA {_fit_context(est, 'mla')}"),
        ]
        note = nothing_fits(est)
        if note:
            rows.append(("  nothing fits", note))
    width = max(len(name) for name, _ in rows)
    lines = ["kdakit serve-mem: active attention-state memory, KDA/MLA hybrid vs all-MLA (docs/memory.md)"]
    lines += [f"{name:<{width}}  {value}".rstrip() for name, value in rows]
    lines += ["", f"scope: {SCOPE_NOTE}.", f"tp: {TP_NOTE}."]
    return "\n".join(lines)


def plot_serving_memory(cfg: HybridModelConfig, batch: int, context: int, path, tp: int = 1,
                        budget_bytes: Optional[int] = None) -> Path:
    """Draw memory (both designs) and their ratio against context to ``path`` (.png or .svg)."""
    path = Path(path)
    fmt = path.suffix.lower()
    if fmt not in PLOT_FORMATS:
        raise ValueError(f"plot: expected a path ending in {' or '.join(PLOT_FORMATS)}, got {str(path)!r}")
    from matplotlib.figure import Figure  # lazily: only --plot needs matplotlib

    t_star = crossover_tokens(cfg, tp)
    lo = max(1, int(min(context, t_star) / 32))
    hi = int(max(context, t_star) * 32)
    steps = 240
    contexts = sorted({round(lo * (hi / lo) ** (i / steps)) for i in range(steps + 1)} | {context})
    rows = sweep(cfg, batch, contexts, tp)
    ts = [r[0] for r in rows]

    fig = Figure(figsize=(7.5, 7.5), layout="constrained")
    ax_mem, ax_ratio = fig.subplots(2, 1, sharex=True)
    ax_mem.loglog(ts, [r[1] / GIB for r in rows], label=f"all-MLA ({cfg.num_layers} MLA layers)")
    ax_mem.loglog(ts, [r[2] / GIB for r in rows], label=f"hybrid ({cfg.num_kda} KDA + {cfg.num_mla} MLA)")
    if budget_bytes is not None:
        ax_mem.axhline(budget_bytes / GIB, color="tab:red", lw=1, label=f"budget {budget_text(budget_bytes)} GiB")
    ax_mem.set_ylabel(f"active attention state (GiB)\nbatch {batch}, per rank, tp {tp}")
    ax_ratio.loglog(ts, [r[3] for r in rows], color="tab:green", label="M_hybrid / M_MLA")
    ax_ratio.axhline(1.0, color="gray", lw=1)
    ax_ratio.axhline(cfg.num_mla / cfg.num_layers, color="tab:green", lw=1, ls="--",
                     label=f"limit {cfg.num_mla}/{cfg.num_layers} = {cfg.num_mla / cfg.num_layers:.3f}")
    ax_ratio.set_ylabel("ratio")
    ax_ratio.set_xlabel("context T (tokens per sequence)")
    for ax in (ax_mem, ax_ratio):
        ax.axvline(t_star, color="black", lw=1, ls="--", label=f"T* = {t_star:,.0f}")
        ax.axvline(context, color="black", lw=1, ls=":", label=f"context {context:,}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{cfg.name}: active attention state only (weights, activations excluded)", fontsize=10)
    fig.savefig(path, format=fmt[1:])
    return path


def run_serve_mem(args, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Handler of ``kdakit serve-mem``; returns the exit code (usage errors exit 2 via ``parser.error``)."""

    def fail(message: str):
        if parser is not None:
            parser.error(message)
        print(f"kdakit serve-mem: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    try:
        cfg = config_from_args(args)
        budget = None
        if args.budget_gib is not None:
            budget = budget_bytes_of(args.budget_gib)
            if budget < 1:
                raise ValueError(f"--budget-gib: expected at least one byte, got {args.budget_gib!r}")
        if args.plot is not None and args.plot.suffix.lower() not in PLOT_FORMATS:
            raise ValueError(f"--plot: expected a path ending in {' or '.join(PLOT_FORMATS)}, got {str(args.plot)!r}")
        est = estimate(cfg, args.batch, args.context, args.tp, budget_bytes=budget)
    except (ValueError, TypeError) as err:
        fail(str(err))

    if args.plot is not None:
        try:
            plot_serving_memory(cfg, args.batch, args.context, args.plot, args.tp, budget)
        except ImportError:
            fail("--plot needs matplotlib, which is not installed: run pip install -e '.[plot]' in the kdakit "
                 "source tree (or pip install 'matplotlib>=3.7')")
        except OSError as err:
            fail(f"--plot: cannot write {str(args.plot)!r}: {err.strerror or err}")

    note = nothing_fits(est)
    if note and args.json:  # the table says it in its own rows; with --json, stdout stays one JSON object
        print(f"kdakit serve-mem: nothing fits: {note}", file=sys.stderr)
    if args.json:
        out = est.to_dict()
        if args.plot is not None:
            out["plot"] = str(args.plot)
        print(json.dumps(out))
    else:
        print(format_table(est))
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0


def main(argv=None) -> int:
    """Run ``serve-mem`` on its own: ``python -m kdakit.memory.serving_cli serve-mem ...``."""
    parser = argparse.ArgumentParser(prog="kdakit")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
