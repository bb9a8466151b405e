"""Context-parallel partition metadata: ``build_cp_context`` with FLA 0.6.0's signature.

The packed tokens (global ``cu_seqlens``, total T) are cut into equal chain intervals of
``part_len`` tokens. ``layout='contiguous'``: W intervals, rank r holds interval r.
``layout='zigzag'``: 2W intervals, rank r holds intervals r and 2W-1-r, concatenated as
``[front; back]`` in its local buffer (the zigzag balances causal work across ranks). Each
rank's ``cu_seqlens`` is the global packing clamped to its interval(s), zero-length pieces
removed, offsets relative to its local buffer (FLA's convention).

The context holds FLA's fields (same names and meanings: ``pre_num_ranks`` counts the earlier
intervals that the first local sequence spans, ``post_num_ranks`` the later ones the last local
sequence spans, per part for zigzag) plus what kdakit's chunk_kda needs to route states: the
global offsets, the global sequence id of every local sequence and the chain of all intervals,
so that every rank can compose the boundary states of all ranks without asking them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kdakit.ops.kda.chunk.cp import LAYOUTS, ChainSlot, CPContext

__all__ = ["LAYOUTS", "ChainSlot", "CPContext", "build_cp_context", "shard_tokens"]


def _slot_meta(cu: list[int], index: int, part_len: int, num_slots: int, rank: int, part: int) -> ChainSlot:
    start, end = index * part_len, (index + 1) * part_len
    n = len(cu) - 1
    ids = tuple(j for j in range(n) if cu[j + 1] > cu[j] and cu[j] < end and cu[j + 1] > start)
    # a zero-length sequence at offset p belongs to the interval holding token p (the last one for p = T)
    empty = tuple(j for j in range(n) if cu[j + 1] == cu[j] and min(cu[j] // part_len, num_slots - 1) == index)
    first, last = ids[0], ids[-1]
    pre = index - cu[first] // part_len
    post = (cu[last + 1] - 1) // part_len - index
    return ChainSlot(index=index, start=start, end=end, seq_ids=ids, pre=pre, post=post, empty_ids=empty,
                     rank=rank, part=part)


def _local_offsets(cu: list[int], slot: ChainSlot) -> list[int]:
    """The slot's pieces as offsets relative to its start: ``[0, e_0, e_1, ..., part_len]``."""
    return [0] + [min(cu[j + 1], slot.end) - slot.start for j in slot.seq_ids]


def _check_cu(cu_seqlens, name: str) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {str(cu_seqlens.dtype).replace('torch.', '')}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got shape {list(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {cu}")
    return cu


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_tf32x3_affine_chain: bool = True,
    layout: str = "contiguous",
    *,
    world_size: int | None = None,
    rank: int | None = None,
) -> CPContext:
    """Partition the global packing ``cu_seqlens`` over the ranks of ``group`` (FLA 0.6.0's
    ``fla.ops.cp.build_cp_context``).

    Args:
        cu_seqlens: global cumulative sequence lengths (int32/int64), before partitioning. Its
            device is where the local ``cu_seqlens`` goes.
        group: the CP process group (every rank of it must call ``chunk_kda`` and its backward
            with the same global packing). ``None``: the default group.
        conv1d_kernel_size: kept for FLA's short-convolution CP (``pre_num_conv_tokens``).
        cu_seqlens_cpu: the same offsets on the host, to avoid a device->host read.
        use_tf32x3_affine_chain: FLA's legacy flag; must be True.
        layout: ``'contiguous'`` or ``'zigzag'`` (see the module docstring).
        world_size, rank: FLA's ``get_cp_cu_seqlens`` arguments; given together they replace the
            group's (for building metadata without a process group).

    The total token count must be a positive multiple of the interval count (W, or 2W for zigzag).
    """
    if use_tf32x3_affine_chain is not True:
        raise ValueError(f"use_tf32x3_affine_chain must be True (FLA's legacy flag), got {use_tf32x3_affine_chain!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if conv1d_kernel_size is not None and (isinstance(conv1d_kernel_size, bool)
                                           or not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1):
        raise ValueError(f"conv1d_kernel_size must be a positive int or None, got {conv1d_kernel_size!r}")
    if (world_size is None) != (rank is None):
        raise ValueError(f"world_size and rank go together, got world_size={world_size!r}, rank={rank!r}")
    if world_size is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("build_cp_context needs an initialized torch.distributed process group "
                             "(or world_size and rank), got none")
        world_size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    for name, val in (("world_size", world_size), ("rank", rank)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size) with world_size >= 1, got rank={rank}, "
                         f"world_size={world_size}")

    if cu_seqlens_cpu is not None:
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be a CPU tensor, got device {cu_seqlens_cpu.device}")
        cu = _check_cu(cu_seqlens_cpu, "cu_seqlens_cpu")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.numel() != len(cu):
            raise ValueError(f"cu_seqlens must have cu_seqlens_cpu's length {len(cu)}, "
                             f"got {getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}")
    else:
        cu = _check_cu(cu_seqlens, "cu_seqlens")  # the one device read without cu_seqlens_cpu

    num_slots = world_size if layout == "contiguous" else 2 * world_size
    total = cu[-1]
    if total < num_slots or total % num_slots:
        what = "world_size" if layout == "contiguous" else "2 * world_size"
        raise ValueError(f"the total token count cu_seqlens[-1] must be a positive multiple of {what} = {num_slots} "
                         f"for layout={layout!r}, got {total}")
    part_len = total // num_slots

    def owner(c: int) -> tuple[int, int]:
        if layout == "contiguous":
            return c, 0
        return (c, 0) if c < world_size else (num_slots - 1 - c, 1)

    chain = tuple(_slot_meta(cu, c, part_len, num_slots, *owner(c)) for c in range(num_slots))
    mine = (rank,) if layout == "contiguous" else (rank, num_slots - 1 - rank)
    offsets = _local_offsets(cu, chain[mine[0]])
    for p, c in enumerate(mine[1:], start=1):
        offsets += [o + p * part_len for o in _local_offsets(cu, chain[c])[1:]]
    local_cpu = torch.tensor(offsets, dtype=torch.int32)
    local = local_cpu.to(cu_seqlens.device)
    slots = [chain[c] for c in mine]
    conv = [max(0, s.start - cu[s.seq_ids[0]]) for s in slots]
    ctx = CPContext(group=group, cu_seqlens=local, cu_seqlens_cpu=local_cpu, conv1d_kernel_size=conv1d_kernel_size,
                    layout=layout, part_len=part_len, world_size=world_size, rank=rank,
                    global_cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long), chain=chain, local_slots=mine)
    if layout == "contiguous":
        s = slots[0]
        ctx.pre_num_ranks, ctx.post_num_ranks = s.pre, s.post
        ctx.is_first_rank, ctx.is_last_rank = s.pre == 0, s.post == 0
        ctx.pre_num_conv_tokens = conv[0]
    else:
        ctx.front_num_seqs = len(slots[0].seq_ids)
        ctx.pre_num_ranks_by_part = (slots[0].pre, slots[1].pre)
        ctx.post_num_ranks_by_part = (slots[0].post, slots[1].post)
        ctx.is_first_by_part = (slots[0].pre == 0, slots[1].pre == 0)
        ctx.is_last_by_part = (slots[0].post == 0, slots[1].post == 0)
        ctx.pre_num_conv_tokens_by_part = (conv[0], conv[1])
    return ctx


def shard_tokens(x: torch.Tensor, ctx: CPContext, dim: int = 1) -> torch.Tensor:
    """This rank's slice of a globally packed tensor (tokens along ``dim``), in the local buffer
    order of ``ctx``: a view for the contiguous layout, a new tensor (``torch.cat`` of the two
    parts) for zigzag. For data loading and tests; chunk_kda never moves tokens between ranks."""
    if not isinstance(ctx, CPContext):
        raise TypeError(f"ctx must be a kdakit CPContext, got {type(ctx).__name__}")
    T = ctx.part_len * len(ctx.chain)
    if x.shape[dim] != T:
        raise ValueError(f"x must hold all {T} global tokens along dim {dim}, got shape {list(x.shape)}")
    parts = [x.narrow(dim, ctx.chain[c].start, ctx.part_len) for c in ctx.local_slots]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
