"""KDA operators: the naive definition, the chunked op (Triton on CUDA), the recurrent op,
the serving decode step and the execution plan."""

# custom_ops registers torch.ops.kdakit.* (what torch.compile traces); imported first so the ops exist
# whichever kdakit module a caller imports (this package's __init__ runs before any of them)
from kdakit.ops.kda import custom_ops  # noqa: F401
from kdakit.ops.kda.chunk.api import chunk_kda
from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.ops.kda.plan import KDAPlan, plan_kda
from kdakit.ops.kda.recurrent.backward import KDAGrads, recurrent_kda_backward
from kdakit.ops.kda.recurrent.workspace import Workspace

__all__ = ["chunk_kda", "fused_recurrent_kda", "recurrent_kda_backward", "KDAGrads", "kda_decode", "Workspace",
           "naive_recurrent_kda", "plan_kda", "KDAPlan"]
