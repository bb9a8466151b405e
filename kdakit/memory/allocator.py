"""Reserved memory, predicted: a replay of PyTorch's CUDA caching allocator over the measure protocol.

``torch.cuda.max_memory_reserved`` counts the segments the caching allocator holds from the driver, and
which segments exist depends on the order and sizes of every allocation since the process started, not on
the peak alone. This module replays the allocator's rules (PyTorch 2.x defaults: no
``expandable_segments``, no ``max_split_size_mb``) on the allocations of the measure protocol
(``measure_worker``: a 1K-token step first, the inputs, two warm-up steps, three measured steps with the
finite checks between them, then ``empty_cache()`` and one more step), taking kdakit's allocations from
``plan_kda``'s timeline, which is exact to the byte.

The rules replayed (``c10/cuda/CUDACachingAllocator.cpp``):

* a request is rounded up to 512 B; up to 1 MiB it is served from the small pool, above from the large one;
* a request takes the smallest cached free block of its pool that is large enough (ties: the older
  segment, the lower address); with none, a new segment of 2 MiB (small pool), 20 MiB (requests under
  10 MiB) or the request rounded up to 2 MiB;
* the block is split when what remains is at least 512 B (small pool) or more than 1 MiB (large pool),
  otherwise it is handed out and counted whole;
* a freed block merges with free neighbours of its segment; ``empty_cache()`` returns whole free
  segments to the driver.

Checked against the H200 (``tests/memory/test_allocator.py``): the reserved peaks of
``benchmarks/results/chunk_h200.json`` at the four protocol shapes, to the byte, with and without the
1K-token step first (the measured runs after the first add one 2 MiB small-pool segment at two shapes,
from host-side allocations this replay does not see).
"""

from __future__ import annotations

import dataclasses

import torch

from kdakit.ops.kda.plan import plan_kda

MIB = 1 << 20
MIN_BLOCK = 512
SMALL_SIZE = MIB            # requests up to this size use the small pool
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB    # the segment for large-pool requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB
FINITE_SLICE = 1 << 24      # measure_worker's isfinite() slice (elements)


def round_size(n: int) -> int:
    return MIN_BLOCK * max(1, -(-int(n) // MIN_BLOCK))


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next", "small")

    def __init__(self, segment: int, offset: int, size: int, small: bool):
        self.segment, self.offset, self.size, self.small = segment, offset, size, small
        self.free = True
        self.prev = self.next = None


class CachingAllocator:
    """The caching allocator's bookkeeping, one stream: ``malloc`` returns a handle for ``free``."""

    def __init__(self):
        self._free = {True: set(), False: set()}
        self._segments: dict[int, int] = {}
        self._next_segment = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        fits = [b for b in pool if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.segment, b.offset))
            pool.discard(block)
        else:
            seg = segment_size(size)
            block = _Block(self._next_segment, 0, seg, small)
            self._segments[self._next_segment] = seg
            self._next_segment += 1
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(block.segment, block.offset + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            pool.add(tail)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        if block.free:
            raise ValueError("block freed twice")
        self.allocated -= block.size
        block.free = True
        pool = self._free[block.small]
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            pool.discard(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            pool.discard(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        pool.add(block)

    def empty_cache(self) -> None:
        for pool in self._free.values():
            for block in [b for b in pool if b.prev is None and b.next is None]:
                pool.discard(block)
                self.reserved -= self._segments.pop(block.segment)

    def reset_peak(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


@dataclasses.dataclass(frozen=True)
class ReservedPrediction:
    shape: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int          # a measured step after the 1K-token step and the warm-ups
    peak_reserved_clean_bytes: int    # after empty_cache(), one more step
    floor_bytes: int


_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "do")
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias")
_FP32 = ("dA_log", "ddt_bias")  # the fp32 gradients among those the finite checks read


def _protocol_plan(mbs: int, seq: int, heads: int, dtype: torch.dtype):
    T = mbs * seq
    return plan_kda(T=T, H=heads, K=128, dtype=dtype, cu_seqlens=list(range(0, T + 1, seq)))


def _step(alloc: CachingAllocator, plan, size: dict, finite_checks: bool) -> dict:
    """One forward+backward of the protocol on ``plan``'s timeline; returns the gradients' blocks."""
    live = {}
    for kind, name in plan.events:
        if kind == "alloc" and name not in _INPUTS:
            live[name] = alloc.malloc(size[name])
        elif kind == "free":
            alloc.free(live.pop(name))
    alloc.free(live.pop("checkpoints"))  # autograd releases the saved tensors when backward returns
    o = live.pop("o")
    grads = {n: live.pop(n) for n in _GRADS}
    if live:
        raise ValueError(f"plan timeline left allocations live after the step: {sorted(live)}")
    if finite_checks:  # measure_worker.check_finite: isfinite() of slices, then .all()
        for name in ("o", *_GRADS):
            elements = size[name] // (4 if name in _FP32 else 2)
            for i in range(0, elements, FINITE_SLICE):
                mask, flag = alloc.malloc(min(FINITE_SLICE, elements - i)), alloc.malloc(1)
                alloc.free(mask)
                alloc.free(flag)
    alloc.free(o)
    return grads


def predict_protocol_reserved(mbs: int, seq: int, heads: int, *, warmup_seq: int = 1024, target_warmups: int = 2,
                              reps: int = 3, dtype: torch.dtype = torch.bfloat16) -> ReservedPrediction:
    """Peak allocated and reserved of kdakit's measure protocol at ``mbs x seq : heads`` (HV = H, D = 128,
    the protocol's flags), replayed from ``plan_kda``'s timelines (``warmup_seq`` 0: no short step first)."""
    alloc = CachingAllocator()
    if warmup_seq:
        small = _protocol_plan(1, min(warmup_seq, seq), heads, dtype)
        size = {a.name: a.allocated_bytes for a in small.allocations}
        inputs = {n: alloc.malloc(size[n]) for n in _INPUTS}
        grads = _step(alloc, small, size, finite_checks=True)
        for block in (*inputs.values(), *grads.values()):
            alloc.free(block)
    plan = _protocol_plan(mbs, seq, heads, dtype)
    size = {a.name: a.allocated_bytes for a in plan.allocations}
    inputs = {n: alloc.malloc(size[n]) for n in _INPUTS}
    grads: dict = {}
    peaks = []
    for i in range(target_warmups + reps):
        for block in grads.values():
            alloc.free(block)
        measured = i >= target_warmups
        if measured:
            alloc.reset_peak()
        grads = _step(alloc, plan, size, finite_checks=measured)
        if measured:
            peaks.append((alloc.peak_allocated, alloc.peak_reserved))
    for block in grads.values():
        alloc.free(block)
    alloc.empty_cache()
    alloc.reset_peak()
    _step(alloc, plan, size, finite_checks=False)
    return ReservedPrediction(shape=f"{mbs}x{seq}:{heads}", peak_allocated_bytes=peaks[0][0],
                              peak_reserved_bytes=peaks[0][1], peak_reserved_clean_bytes=alloc.peak_reserved,
                              floor_bytes=plan.floor_bytes)
