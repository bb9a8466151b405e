"""The 64-token pipeline's pair matrices (Aqk, Tinv) in the token layout the kernels read and write, for the
stage tests: per chunk and value head a ``[C, C]`` matrix whose row r lives at ``x[b, t0 + r, hv, :]`` of a
``[B, T, HV, C]`` tensor, rows r < L only (padded rows of a partial chunk have no storage; the kernels load them
as 0). aqk and tinv are two views of one pair tensor (the same strides, unit last stride:
``kdakit/ops/kda/chunk/tiles.py::check_pairs``).

``pair_views`` builds them inside a poisoned backing buffer with room past the views (GUARD_T tokens after T in
every batch row, GUARD_C columns after tinv in every head), so that a kernel storing a padded row past a chunk at
the end of its batch row, or a column past C, lands in memory a test can check (``assert_outside_untouched``);
``to_tokens`` scatters a slot-layout ``[n, HV, C, C]`` reference into the token layout and ``from_tokens``
gathers it back (rows >= L as 0) for the float64 comparisons."""

import math

import torch

from kdakit.ops.kda.chunk.tiles import CHUNK

C = CHUNK
GUARD_T = C  # a padded row of a chunk ending at T reaches token T + C - 2 at most
GUARD_C = 8


def pair_views(B: int, T: int, HV: int, dtype: torch.dtype, fill: float = math.nan):
    """(buf, aqk, tinv): the backing buffer ``[B, T + GUARD_T, HV, 2C + GUARD_C]`` filled with ``fill`` and the
    two ``[B, T, HV, C]`` views (aqk first) of its pair tensor ``buf[:, :T, :, :2C]``."""
    buf = torch.full((B, T + GUARD_T, HV, 2 * C + GUARD_C), fill, dtype=dtype)
    pairs = buf[:, :T, :, :2 * C]
    return buf, pairs[..., :C], pairs[..., C:]


def covered(B: int, T: int, rows, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """bool ``[B, T]``: the tokens of the chunk rows ``rows[r0:r1]`` (their real rows t0 .. t0 + L - 1)."""
    out = torch.zeros(B, T, dtype=torch.bool)
    for _, b, t0, L in rows[r0:r1]:
        out[b, t0:t0 + L] = True
    return out


def to_tokens(slot: torch.Tensor, rows, out: torch.Tensor) -> torch.Tensor:
    """Rows r < L of each chunk's ``slot[i]`` (``[n, HV, C, C]``) into the token tensor ``out`` ``[B, T, HV, C]``
    at ``out[b, t0 + r]`` (cast to out's dtype); returns out."""
    for i, (_, b, t0, L) in enumerate(rows):
        out[b, t0:t0 + L] = slot[i, :, :L].transpose(0, 1).to(out.dtype)
    return out


def from_tokens(x: torch.Tensor, rows, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The slot layout ``[n, HV, C, C]`` of the token tensor x ``[B, T, HV, C]`` (x's dtype unless ``dtype``):
    chunk i's rows r < L from ``x[b, t0 + r]``, rows r >= L 0."""
    HV = x.shape[2]
    out = torch.zeros(len(rows), HV, C, C, dtype=dtype or x.dtype)
    for i, (_, b, t0, L) in enumerate(rows):
        out[i, :, :L] = x[b, t0:t0 + L].transpose(0, 1).to(out.dtype)
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same bits (NaN fills included)."""
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def assert_outside_untouched(buf: torch.Tensor, T: int, rows, name: str, r0: int = 0, r1: int | None = None,
                             before: torch.Tensor | None = None) -> None:
    """Nothing of ``buf`` (``pair_views``' buffer) changed outside the rows of the chunk rows ``rows[r0:r1]``:
    the tokens of no such chunk (other chunks' rows included), the guard tokens past T and the guard columns
    past tinv keep their fill (NaN, or ``before``'s bits when given; a NaN fill checks with isnan)."""
    B = buf.shape[0]
    inside = torch.zeros(buf.shape[:2], dtype=torch.bool)
    inside[:, :T] = covered(B, T, rows, r0, r1)
    if before is None:
        out_tok = buf[~inside]  # [tokens, HV, 2C + GUARD_C]
        assert torch.isnan(out_tok.float()).all(), f"{name}: a store outside the chunks' rows"
        assert torch.isnan(buf[..., 2 * C:].float()).all(), f"{name}: a store past the pair tensor's columns"
    else:
        same = _bits(buf) == _bits(before)
        assert same[~inside].all(), f"{name}: a store outside the chunks' rows"
        assert same[..., 2 * C:].all(), f"{name}: a store past the pair tensor's columns"
