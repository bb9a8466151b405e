"""The ``kdakit`` command line: ``demo`` (the main job), ``mem``, ``serve-mem`` and ``train-demo``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

# `kdakit demo` warns before a float64 reference estimated to take longer than this (seconds).
SLOW_DEMO_S = 30.0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class DemoProgress:
    """Prints ``kdakit demo``'s reference progress on ``stream`` (stderr): rewritten in place on a
    terminal, otherwise one line at the start and end of each phase and at most one every ``every_s``
    seconds in between (logs stay short)."""

    def __init__(self, stream=None, every_s: float = 5.0):
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.phase = None
        self.t0 = self.last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if phase != self.phase:
            self.phase, self.t0, self.last = phase, now, -float("inf")
        elapsed = now - self.t0
        if done >= total:
            text = f"{phase}: {total}/{total} tokens in {elapsed:.1f} s"
        elif done:
            text = f"{phase}: {done}/{total} tokens, {elapsed:.0f} s, about {_duration(elapsed * (total - done) / done)} left"
        else:
            text = f"{phase}: 0/{total} tokens"
        if not (self.tty or done in (0, total) or now - self.last >= self.every_s):
            return
        self.last = now
        if self.tty:
            self.stream.write(f"\r\x1b[Kkdakit demo: {text}" + ("\n" if done >= total else ""))
        else:
            self.stream.write(f"kdakit demo: {text}\n")
        self.stream.flush()


def demo_warning(seq: int, heads: int, value_heads: int | None, dim: int) -> str | None:
    """A warning when the float64 reference of this shape will take long (None when it will not)."""
    from kdakit.demo import estimate_reference_s

    hv = value_heads or heads
    est = estimate_reference_s(seq, hv, dim)
    if est < SLOW_DEMO_S:
        return None
    quick = 1 << max(6, int(seq * SLOW_DEMO_S / est).bit_length() - 1)  # a power of two under the limit
    return (f"kdakit demo: warning: the float64 reference runs token by token on the CPU; at T={seq}, HV={hv}, "
            f"K=V={dim} it takes roughly {_duration(est)} (estimated from the shape; --seq {quick} takes about "
            f"{_duration(estimate_reference_s(quick, hv, dim))})")


def _cmd_demo(args) -> int:
    from kdakit.demo import run_demo

    warning = demo_warning(args.seq, args.heads, args.value_heads, args.dim)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    result = run_demo(device=args.device, seq=args.seq, heads=args.heads, value_heads=args.value_heads,
                      dim=args.dim, dtype=args.dtype, seed=args.seed, progress=DemoProgress(sys.stderr))
    print(result.text)
    return 0 if result.ok else 1


# `kdakit train-demo` runs this example script of the source tree (an editable install has it).
TRAIN_TINY = Path(__file__).resolve().parent.parent / "examples" / "train_tiny.py"


def _load_train_tiny():
    """``(module, None)`` for examples/train_tiny.py, or ``(None, why not)`` (not a source checkout, or the
    script fails to load: the other commands keep working)."""
    if not TRAIN_TINY.is_file():
        return None, (f"{TRAIN_TINY} is not here; train-demo runs the source tree's example (clone the repository "
                      "and pip install -e .)")
    try:
        spec = importlib.util.spec_from_file_location("kdakit_examples_train_tiny", TRAIN_TINY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:
        return None, f"{TRAIN_TINY} failed to load: {type(exc).__name__}: {exc}"
    return module, None


def _register_train_demo(sub) -> None:
    help_ = "train a tiny KDA model on associative recall (examples/train_tiny.py; --device cuda: long context vs FLA)"
    module, why = _load_train_tiny()
    train = sub.add_parser("train-demo", help=help_, description=help_ if module else f"{help_}: unavailable: {why}")
    if module is None:
        def missing(args) -> int:
            print(f"kdakit train-demo: error: {why}", file=sys.stderr)
            return 2
        train.set_defaults(func=missing)
        return
    module.add_arguments(train)

    def run(args) -> int:
        module.run(args)
        return 0
    train.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdakit", description="Kimi Delta Attention kernels and memory tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="run KDA forward+backward on the best device and check it against the naive reference")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.add_argument("--seq", type=_positive_int, default=256, help="tokens (default 256)")
    demo.add_argument("--heads", type=_positive_int, default=2, help="q/k heads H (default 2)")
    demo.add_argument("--value-heads", type=_positive_int, default=None, help="value heads HV, a multiple of H (default H)")
    demo.add_argument("--dim", type=_positive_int, default=64, help="head dim K = V (default 64)")
    demo.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)

    from kdakit.memory.mem_cli import register as register_mem
    from kdakit.memory.serving_cli import register as register_serve_mem

    register_mem(sub)
    register_serve_mem(sub)
    _register_train_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"kdakit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
