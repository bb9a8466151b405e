"""The 64-token pipeline's plan: the chunk table, and the windows the pipeline walks (docs/chunk_pipeline.md).

``chunk_table`` lists every chunk of every sequence in order as ``(n, b, t0, L)`` int32 rows. It is built on the
host from the sequence lengths (``cu_seqlens_cpu`` for packed calls, so no device value is read), then copied
to the device once.
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.chunk.tiles import CHUNK


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
