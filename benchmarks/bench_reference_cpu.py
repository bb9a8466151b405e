"""Time kdakit's chunked PyTorch path (the CPU path) forward+backward on this machine's CPU.

    python benchmarks/bench_reference_cpu.py [--seq 4096] [--heads 4] [--dim 128] [--runs 3]

bf16 inputs, docs/spec.md §3 flags (l2norm, beta sigmoid, safe gate -5 in kernel); prints the median of
``--runs`` timed runs after one warm-up and the torch thread count.
"""

import argparse
import statistics
import time

import torch

from kdakit import chunk_kda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    T, H, D = args.seq, args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v, g = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D)
    beta = mk(1, T, H)
    A_log = torch.zeros(H, requires_grad=True)
    dt_bias = torch.zeros(H * D, requires_grad=True)
    do = torch.randn(1, T, H, D, generator=gen).to(torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)
    fwd, fb = [], []
    for i in range(args.runs + 1):
        t0 = time.perf_counter()
        o, _ = chunk_kda(q, k, v, g, beta, **kw)
        t1 = time.perf_counter()
        o.backward(do)
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            fb.append(t2 - t0)
    print(f"chunked PyTorch path, CPU, {torch.get_num_threads()} threads, B=1 T={T} H={H} K=V={D} bf16: "
          f"forward {statistics.median(fwd):.2f} s, forward+backward {statistics.median(fb):.2f} s "
          f"(median of {args.runs})")


if __name__ == "__main__":
    main()
