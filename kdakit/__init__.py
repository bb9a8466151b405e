"""kdakit: Kimi Delta Attention kernels and memory tools with FLA's API."""

from kdakit.ops.kda import chunk_kda, naive_recurrent_kda

__version__ = "0.1.0"

__all__ = ["chunk_kda", "naive_recurrent_kda", "__version__"]
