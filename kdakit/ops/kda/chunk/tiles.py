"""Shared pieces of the 64-token chunk pipeline's kernels (docs/chunk_pipeline.md): the chunk geometry, the
chunk table's row, and a token tensor's base pointer through its strides.

A chunk table row is ``(n, b, t0, L)``: sequence, batch row, first token within the batch row, length
(1..CHUNK). Token tensors are addressed as ``x[b, t, h, :]`` at ``b * sb + t * st + h * sh`` (elements, int64);
the last dimension has unit stride (checked on the host, ``check_token_strides``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk (C)
SUB = 16  # tokens per sub-chunk: the diagonal blocks formed token-parallel
MAX_HEAD_DIM = 128  # K and V limit of the register tiles


@triton.jit
def chunk_row(table, i):
    """Row ``i`` of the chunk table -> (n, b, t0, L): int64 sequence, batch row and first token, int32 length."""
    row = table + i.to(tl.int64) * 4
    n = tl.load(row).to(tl.int64)
    b = tl.load(row + 1).to(tl.int64)
    t0 = tl.load(row + 2).to(tl.int64)
    L = tl.load(row + 3)
    return n, b, t0, L


@triton.jit
def token_base(ptr, b, t0, h, sb, st, sh):
    """Pointer to ``x[b, t0, h, 0]`` (int64 offset arithmetic)."""
    return ptr + b * sb + t0 * st + h.to(tl.int64) * sh


def check_token_strides(name: str, x: torch.Tensor) -> None:
    """The kernels read token tensors through their strides; only the last dimension must be unit-stride."""
    if x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a unit stride in its last dimension (a view of a wider tensor is fine), "
            f"got strides {tuple(x.stride())}"
        )
