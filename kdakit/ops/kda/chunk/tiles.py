"""Shared pieces of the 64-token chunk pipeline's kernels (docs/chunk_pipeline.md): the chunk geometry, the
chunk table's row, a token tensor's base pointer through its strides, the fp32 tile -> ``tl.dot`` operand and
bf16-store rounding, the masked row tiles; and the launchers' host-side argument checks.

A chunk table row is ``(n, b, t0, L)``: sequence, batch row, first token within the batch row, length
(1..CHUNK). Token tensors are addressed as ``x[b, t, h, :]`` at ``b * sb + t * st + h * sh`` (elements, int64);
the last dimension has unit stride (checked on the host, ``check_token_strides``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import round_to_bf16
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions

CHUNK = 64  # tokens per chunk (C)
SUB = 16  # tokens per sub-chunk: the diagonal blocks formed token-parallel


def launch_values(launch, **shipped) -> tuple:
    """The launch constants a launcher reads, in the order given: each ``shipped`` value (its kernel file's named
    config) unless ``launch`` (a ``chunk.launch.Launch``, or None for the shipped configs) overrides that name."""
    if launch is None:
        return tuple(shipped.values())
    return tuple(launch.get(name, value) for name, value in shipped.items())


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


@triton.jit
def dot_operand(x, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """A ``tl.dot`` operand from an fp32 tile: bf16 (OP_BF16; rounded to nearest in fp32 under the interpreter,
    EMULATE_BF16, whose bf16 casts truncate and whose bf16 dots are wrong) or the fp32 tile itself."""
    if OP_BF16:
        if EMULATE_BF16:
            y = round_to_bf16(x)
        else:
            y = x.to(tl.bfloat16)
    else:
        y = x
    return y


@triton.jit
def as_stored(x, base, INTERPRETED: tl.constexpr):
    """x rounded to nearest bf16 when ``base`` points to bf16 under the interpreter (whose bf16 store truncates),
    so that the stored value is the GPU's; x itself otherwise."""
    if INTERPRETED:
        if base.dtype.element_ty == tl.bfloat16:
            x = round_to_bf16(x)
    return x


@triton.jit
def load_tile(base, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """``x[r, col0 + c]`` of a row-major slab at ``base`` (row 0, int64 already) as ``[BR, BC]`` in the storage
    dtype; rows ``>= n_rows`` and columns ``>= n_cols`` read as 0 (int32 in-tile offsets)."""
    r = tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return tl.load(base + (r[:, None] * stride_row + c[None, :]), mask=mask, other=0.0)  # [BR, BC]


@triton.jit
def store_tile(base, x, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Store ``x`` ``[BR, BC]`` (cast to the pointer's type) into rows ``< n_rows``, columns ``col0 + c < n_cols``."""
    r = tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    tl.store(base + (r[:, None] * stride_row + c[None, :]), x.to(base.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------
# host-side checks of the launchers
# ---------------------------------------------------------------------------------------


def check_token_strides(name: str, x: torch.Tensor) -> None:
    """The kernels read token tensors through their strides; only the last dimension must be unit-stride."""
    if x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a unit stride in its last dimension (a view of a wider tensor is fine), "
            f"got strides {tuple(x.stride())}"
        )


def check_table(table) -> int:
    """The chunk table (contiguous int32 ``[n, 4]``); returns n."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"table must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[1] != 4 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous int32 [n, 4] tensor, got {table.dtype} {tuple(table.shape)}")
    return table.shape[0]


def token_dims(name: str, x, ndim: int, unit_last: bool = True) -> tuple:
    """A token tensor's shape after checking that it is an ``ndim``-D tensor in a dtype the kernels take, with a
    unit last stride (``unit_last``; beta's rows are read through all three strides)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if unit_last:
        check_token_strides(name, x)
    return tuple(x.shape)


def check_token(name: str, x, shape: tuple) -> None:
    """A token tensor of the given shape (token_dims' checks; a 3-D one, beta, may have any strides)."""
    if token_dims(name, x, len(shape), unit_last=len(shape) == 4) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_slot(name: str, x, shape: tuple, dtype) -> None:
    """A slot tensor: contiguous, of the given shape and dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape) or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of shape {tuple(shape)}, got {tuple(x.shape)} "
                         f"with strides {tuple(x.stride())}")


def check_pairs(aqk, tinv, B: int | None, T: int | None, HV: int, dtype) -> tuple[int, int, int]:
    """aqk and tinv, the chunks' pair matrices in token layout: ``[B, T, HV, C]`` each in the token dtype, row t
    holding token t's row of its chunk's matrix (``chunk.forward.pair_rows``: two views of one tensor), unit last
    stride and the same strides; returns their (batch, token, head) element strides. B, T None: any."""
    for name, x in (("aqk", aqk), ("tinv", tinv)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
        want = (B if B is not None else x.shape[0] if x.dim() == 4 else -1,
                T if T is not None else x.shape[1] if x.dim() == 4 else -1, HV, CHUNK)
        if tuple(x.shape) != want or x.stride(-1) != 1:
            raise ValueError(f"{name} must be a [B, T, HV, {CHUNK}] token-layout tensor of shape {want} with a unit "
                             f"last stride, got {tuple(x.shape)} with strides {tuple(x.stride())}")
    if aqk.stride() != tinv.stride() or aqk.device != tinv.device:
        raise ValueError(f"aqk and tinv must be views of one pair tensor with the same strides, got "
                         f"{tuple(aqk.stride())} and {tuple(tinv.stride())}")
    return token_strides(aqk)


def gate_params(opts: KDAOptions, A_log, dt_bias, HV: int, K: int):
    """The flat gate parameters the options use (contiguous ``[HV]`` / ``[HV * K]``), None for the unused ones."""
    out = []
    for name, x, used, numel in (("A_log", A_log, opts.has_A_log, HV), ("dt_bias", dt_bias, opts.has_dt_bias, HV * K)):
        if not used:
            out.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (the options use it), got {type(x).__name__}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if tuple(x.shape) != (numel,) or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{numel}] view (opts.kernel_gate_params), got "
                             f"{tuple(x.shape)}")
        out.append(x)
    return tuple(out)


def head_group(H: int, HV: int, K: int, V: int) -> int:
    """HV // H after checking the head counts and head sizes."""
    if H <= 0 or HV <= 0 or HV % H:
        raise ValueError(f"HV must be a positive multiple of H, got H={H}, HV={HV}")
    if K > CHUNK_MAX_HEAD_DIM or V > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"K and V must be <= {CHUNK_MAX_HEAD_DIM}, got K={K}, V={V}")
    return HV // H


def token_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, head) element strides of a token tensor."""
    return x.stride(0), x.stride(1), x.stride(2)
