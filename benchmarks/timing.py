"""CUDA-event timing shared by the benchmarks: the median of many timed runs after warm-up, and a
CUDA-graph capture whose replay times the kernels alone (no Python launch path)."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, warmup: int, iters: int, sync_each: bool = False) -> float:
    """Median of CUDA-event timings of ``fn`` (ms) after ``warmup`` untimed calls.

    ``sync_each=False`` queues the timed runs back to back (one host sync at the end), so a short
    kernel's time is not padded by the host's launch gap; ``sync_each=True`` waits for each run, for
    steps long enough (a layer's forward+backward) that the host must not run ahead of the allocator.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if sync_each:
            torch.cuda.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graphed(fn, warmup: int = 3):
    """Capture ``fn`` in a CUDA graph after ``warmup`` calls on the capture stream; returns (replay, graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph.replay, graph


def graphed_steps_ms(fn, steps: int, iters: int, warmup: int = 5) -> float:
    """Median GPU time (ms) of one ``fn`` call with ``steps`` calls captured in one CUDA graph.

    A replay of a one-kernel graph also pays the replay's launch (about 4 us on the H200: a same-size
    copy of a 64 MiB pool took 37.6 us a replay and 33.6 us a call at 20 calls a graph,
    results/dev_decode_h200.json); an engine replays a whole model step, where that cost is spread
    over its kernels. This is that figure for ``fn`` alone.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")

    def many():
        for _ in range(steps):
            fn()
    replay, graph = graphed(many)
    ms = median_ms(replay, warmup, max(iters // steps, 10)) / steps
    del graph
    return ms
