"""kdakit: Kimi Delta Attention kernels and memory tools with FLA's API."""

from kdakit.distributed import CPContext, build_cp_context, shard_tokens
from kdakit.ops.kda import (
    KDAGrads,
    KDAPlan,
    Workspace,
    chunk_kda,
    fused_recurrent_kda,
    kda_decode,
    naive_recurrent_kda,
    plan_kda,
    recurrent_kda_backward,
)

__version__ = "0.1.0"

__all__ = ["chunk_kda", "fused_recurrent_kda", "recurrent_kda_backward", "KDAGrads", "kda_decode", "Workspace",
           "naive_recurrent_kda", "plan_kda", "KDAPlan", "build_cp_context", "CPContext", "shard_tokens",
           "__version__"]
