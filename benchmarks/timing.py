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
