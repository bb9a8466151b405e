"""The ``kdakit`` command line: ``demo`` (the main job), ``mem`` and ``serve-mem``."""

from __future__ import annotations

import argparse
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _cmd_demo(args) -> int:
    from kdakit.demo import run_demo

    result = run_demo(device=args.device, seq=args.seq, heads=args.heads, value_heads=args.value_heads,
                      dim=args.dim, dtype=args.dtype, seed=args.seed)
    print(result.text)
    return 0 if result.ok else 1


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
