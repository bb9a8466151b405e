"""Numbers of the operator's definition that every path shares (no imports: the PyTorch reference and the Triton
kernels both read them here)."""

# The token transforms' constants, for the PyTorch paths (reference/preprocess.py) and, as tl.constexpr, for the
# Triton kernels (chunk_common.py): the l2norm's epsilon; softplus(x) = x above the threshold, as in FLA's gate kernels.
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
# The floor of every log-decay in the chunked paths, Triton kernels and PyTorch alike (reference/preprocess.py's
# floor_log_decay, chunk_common.gate_from_preact). Every factor they form is exp of a sum of non-positive log-decays, and
# exp(-110) is below float32's smallest denormal, so in fp32 a sum containing a floored term gives exactly 0
# either way (in float64, a factor below 1e-47 instead of 0). The floor keeps the chunk cumsum small, so that
# the differences G_i - G_j after a reset (-inf, or a reset-level -1000) keep their precision, and turns
# -inf - -inf = NaN into a finite difference.
LOG_DECAY_FLOOR = -110.0
# K and V limit of the chunk pipelines' Triton kernels: a [*, K] row block lives in registers.
CHUNK_MAX_HEAD_DIM = 128
