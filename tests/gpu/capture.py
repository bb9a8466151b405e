"""The GPU tier's CUDA-graph capture scaffolds, in the two ways its tests capture:

- ``capture_like_an_engine``: warm-up calls on a side stream, then one plain ``torch.cuda.graph(g)``
  (its own capture stream, default capture mode, no call made on that stream before capturing), the way
  engines capture a serving step; outputs come from the graph's pool.
- ``capture_after_warm_call``: kdakit's zero-allocation contract (``out=`` buffers, a caller-owned
  ``Workspace``): one eager call on the capture stream sizes the workspace, then the capture on that stream
  must allocate nothing.

Only the GPU tier imports this module; it touches CUDA only when a function is called.
"""

from __future__ import annotations

import torch


def allocation_counts() -> tuple[int, int]:
    """(allocations, segments) the caching allocator has made so far: equal before and after a call that
    allocated nothing."""
    s = torch.cuda.memory_stats()
    return s.get("allocation.all.allocated", 0), s.get("segment.all.allocated", 0)


def capture_like_an_engine(fn, *, warmup: int = 2, reset=None):
    """``warmup`` calls of ``fn`` on a side stream (compilation, autotuning, the eager index checks), each
    after ``reset()`` when given (state that ``fn`` updates in place), then ``fn`` captured in a plain
    ``torch.cuda.graph``. Returns (graph, what the captured call returned: the static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            if reset is not None:
                reset()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # plain: its own capture stream, nothing prepared on it
        static_out = fn()
    return graph, static_out


def capture_after_warm_call(fn, *, after_warm=None):
    """One eager call of ``fn`` on a new stream (it sizes the workspace ``fn`` passes), then ``fn`` captured
    on that stream; raises AssertionError if the capture allocated memory. ``after_warm()``, when given, runs
    once the eager call has finished and before the capture (to keep its results, restore a pool).
    Returns (graph, the capture stream, what ``after_warm`` returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # the eager warm call on the capture stream
    stream.synchronize()
    kept = after_warm() if after_warm is not None else None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        # counted inside the block: capture_begin itself allocates the generator's graph state
        before = allocation_counts()
        fn()
        during = allocation_counts()
    assert during == before, "the capture allocated memory"
    return graph, stream, kept
