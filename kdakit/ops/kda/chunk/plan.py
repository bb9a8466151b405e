"""The 64-token pipeline's plan: the chunk table, and the windows the pipeline walks (docs/chunk_pipeline.md).

``chunk_table`` lists every chunk of every sequence in order as ``(n, b, t0, L)`` int32 rows. It is built on the
host from the sequence lengths (``cu_seqlens_cpu`` for packed calls, so no device value is read), then copied
to the device once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from kdakit.ops.kda.chunk.tiles import CHUNK
from kdakit.ops.kda.plan_chunk64 import chunk64_forward_groups


def chunk_table_rows(B: int, T: int, seqlens: list[int] | None) -> list[tuple[int, int, int, int]]:
    """Rows ``(n, b, t0, L)``: fixed-length calls (``seqlens`` None) have B sequences of T tokens in batch rows
    0..B-1; packed calls (B == 1) have ``seqlens[n]`` tokens starting at their cumulative offset in row 0."""
    rows = []
    if seqlens is None:
        for b in range(B):
            for t0 in range(0, T, CHUNK):
                rows.append((b, b, t0, min(CHUNK, T - t0)))
        return rows
    start = 0
    for n, length in enumerate(seqlens):
        for t0 in range(0, int(length), CHUNK):
            rows.append((n, 0, start + t0, min(CHUNK, int(length) - t0)))
        start += int(length)
    return rows


def chunk_table(B: int, T: int, seqlens: list[int] | None, device) -> torch.Tensor:
    """The chunk table as an int32 ``[n_chunks, 4]`` tensor on ``device``."""
    rows = chunk_table_rows(B, T, seqlens)
    table = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 4)
    return table.to(device)


@dataclass(frozen=True)
class ChunkPlan:
    """How one call walks its chunks: the chunk table in window order, the windows, the scratch size.

    A window holds the chunks at positions ``[w * window_chunks, (w + 1) * window_chunks)`` of every sequence,
    so that each launch runs every sequence (the walks' parallelism); within a window the rows are grouped by
    sequence, in order. ``seq_rows[w, n]`` = (sequence n's first row of the table in window w, its chunk count
    there).
    The recomputing forward runs its state-independent stages once per group of consecutive windows
    (``forward_groups``: ``[w0, w1)`` window ranges; ``plan_chunk64.chunk64_forward_groups``) into slots of
    ``forward_slots`` rows; the backward's slots hold one window (``max_slots`` rows).
    """

    table: torch.Tensor  # int32 [n_chunks, 4], window-major
    window_rows: tuple[tuple[int, int], ...]  # each window's [start, stop) rows of the table
    seq_rows: torch.Tensor  # int32 [n_windows, N, 2]
    n_seqs: int
    window_chunks: int
    max_slots: int  # the largest window's chunk count: the backward's scratch's leading size
    forward_groups: tuple[tuple[int, int], ...]  # the forward's groups of windows
    forward_slots: int  # the largest group's chunk count: the recomputing forward's scratch's leading size
    launch: object = None  # the kernels' launch overrides (``chunk.launch.Launch``), None: the shipped configs

    @property
    def n_windows(self) -> int:
        return len(self.window_rows)


def make_chunk_plan(B: int, T: int, seqlens, device, window_tokens: int | None = None,
                    slot_geometry: tuple | None = None, launch=None) -> ChunkPlan:
    """The plan of a call with B x T tokens (``seqlens``: packed lengths, B == 1). ``window_tokens``: the
    window's length, a positive multiple of CHUNK (None: one window holding every chunk). ``slot_geometry``:
    ``(H, HV, K, V, dtype, g_dtype)`` of the call, which sizes the forward's groups of windows
    (``chunk64_forward_groups``); None: one window a group. ``launch``: the kernels' launch overrides
    (``chunk.launch.launch_of``), carried to every launcher; None: the shipped configs.

    Memoized by the call's geometry, so that a CUDA-graph capture after an eager warm call of the same shape
    copies nothing to the device."""
    if window_tokens is not None and (isinstance(window_tokens, bool) or not isinstance(window_tokens, int)
                                      or window_tokens <= 0 or window_tokens % CHUNK):
        raise ValueError(f"window_tokens must be a positive multiple of {CHUNK} or None, got {window_tokens!r}")
    key = None if seqlens is None else tuple(int(x) for x in seqlens)
    plan = _plan(int(B), int(T), key, str(torch.device(device)), window_tokens, slot_geometry)
    return plan if launch is None else replace(plan, launch=launch)


@lru_cache(maxsize=64)
def _plan(B: int, T: int, seqlens: tuple | None, device: str, window_tokens: int | None,
          slot_geometry: tuple | None) -> ChunkPlan:
    lengths = [T] * B if seqlens is None else [int(x) for x in seqlens]
    starts, acc = [], 0
    for n, length in enumerate(lengths):
        starts.append(n * T if seqlens is None else acc)
        acc += length
    n_chunks = [-(-length // CHUNK) for length in lengths]
    most = max(n_chunks, default=0)
    wc = max(most, 1) if window_tokens is None else window_tokens // CHUNK
    n_windows = max(-(-most // wc), 1)
    rows, window_rows, seq_rows = [], [], []
    for w in range(n_windows):
        first = len(rows)
        per_seq = []
        for n, length in enumerate(lengths):
            c0, c1 = w * wc, min((w + 1) * wc, n_chunks[n])
            per_seq.append((len(rows), max(c1 - c0, 0)))
            for c in range(c0, c1):
                t0 = c * CHUNK
                b, base = (n, 0) if seqlens is None else (0, starts[n])
                rows.append((n, b, base + t0, min(CHUNK, length - t0)))
        window_rows.append((first, len(rows)))
        seq_rows.append(per_seq)
    table = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 4).to(device)
    seq = torch.tensor(seq_rows, dtype=torch.int32).reshape(n_windows, len(lengths), 2).to(device)
    counts = [b - a for a, b in window_rows]
    max_slots = max(counts, default=0)
    if slot_geometry is None:
        groups, forward_slots = tuple((w, w + 1) for w in range(n_windows)), max_slots
    else:
        H, HV, K, V, dtype, g_dtype = slot_geometry
        groups, forward_slots = chunk64_forward_groups(counts, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype,
                                                       g_dtype=g_dtype)
    return ChunkPlan(table=table, window_rows=tuple(window_rows), seq_rows=seq, n_seqs=len(lengths),
                     window_chunks=wc, max_slots=max_slots, forward_groups=groups, forward_slots=forward_slots)
