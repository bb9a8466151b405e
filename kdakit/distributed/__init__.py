"""Context parallelism for ``chunk_kda`` (FLA 0.6.0's ``cp_context`` API): ``build_cp_context``
partitions the packed tokens over a process group; ``chunk_kda(..., cp_context=ctx)`` runs it."""

from kdakit.distributed.context import ChainSlot, CPContext, build_cp_context, shard_tokens

__all__ = ["build_cp_context", "CPContext", "ChainSlot", "shard_tokens"]
