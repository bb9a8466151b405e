"""KDA operators: the naive definition, the chunked op and (on CUDA) its Triton kernels."""

from kdakit.ops.kda.chunk import chunk_kda
from kdakit.ops.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda"]
