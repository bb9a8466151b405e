"""Active attention-state memory of a KDA/MLA hybrid when serving (docs/spec.md §6).

A hybrid has ``L`` layers: ``n_kda`` Kimi Delta Attention layers and ``n_mla`` Multi-head Latent
Attention layers. Serving ``b`` sequences of ``T`` tokens keeps, per device:

    sigma  = KDA recurrent state + short-conv state, bytes per sequence per KDA layer (independent of T)
    kappa  = MLA latent cache, bytes per token per MLA layer
    M_MLA    = b * L * kappa * T                       (all-MLA baseline with the same layer count L)
    M_hybrid = b * (n_mla * kappa * T + n_kda * sigma)
    ratio    = M_hybrid / M_MLA = n_mla / L + n_kda * sigma / (L * kappa * T)
    T*       = sigma / kappa                           (the hybrid holds less state exactly when T > T*)

For the 3:1 pattern of docs/spec.md §6 (``L = 4l``, ``n_kda = 3l``, ``n_mla = l``) these are
``M_MLA = 4 b l kappa T``, ``M_hybrid = b l (kappa T + 3 sigma)`` and ``ratio = 1/4 + 3 sigma / (4 kappa T)``.
T* does not depend on the pattern: every KDA layer trades ``sigma`` fixed bytes for ``kappa T``.

Per-layer sizes, following the serving engines (vLLM / SGLang):

    recurrent state : value_heads * head_k_dim * head_v_dim elements of ``state_dtype`` (default fp32)
    conv state      : (heads * head_k_dim [q] + heads * head_k_dim [k] + value_heads * head_v_dim [v])
                      channels * C columns of ``conv_dtype`` (default bf16), where C = conv_width - 1
                      (``conv_state_columns="width-1"``: the engines keep only the past width-1 inputs)
                      or C = conv_width (``"width"``: FLA's ShortConvolution cache keeps the full window)
    MLA cache       : (kv_lora_rank + rope_dim) elements of ``mla_cache_dtype`` (default bf16) per token,
                      shared by all heads of the layer

Tensor parallelism (``tp``): every figure is **per rank**. KDA heads (and with them the recurrent state
and the q/k/v conv channels) are split evenly across the ``tp`` ranks, so sigma is divided by ``tp``;
the heads must divide evenly. The MLA latent cache is **replicated** on every rank, as vLLM and SGLang
do without decode-context parallelism, so kappa is not divided. A budget is therefore per device.

Scope: active attention state only. Weights, activations, workspaces, allocator padding, paged-cache
block rounding and saved prefix/snapshot states are outside this estimate; it is a sizing hypothesis
for serving, not a training-memory formula and not a speed prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Optional, Sequence, Tuple

__all__ = [
    "DTYPE_BYTES",
    "CONV_STATE_COLUMNS",
    "PRESETS",
    "SCOPE_NOTE",
    "TP_NOTE",
    "HybridModelConfig",
    "KDAStateBytes",
    "ServingEstimate",
    "dtype_bytes",
    "pattern_from_ratio",
    "pattern_from_counts",
    "get_preset",
    "kda_state_breakdown",
    "kda_state_bytes_per_seq",
    "mla_bytes_per_token",
    "m_mla_bytes",
    "m_hybrid_bytes",
    "memory_ratio",
    "crossover_tokens",
    "max_batch_at_context",
    "max_context_at_batch",
    "estimate",
    "sweep",
]

GIB = 1 << 30

# Bytes per element of the dtypes a state or cache is stored in. fp8 covers the 1-byte KV-cache
# formats engines offer for MLA (e4m3 / e5m2).
DTYPE_BYTES = {
    "fp32": 4, "float32": 4,
    "bf16": 2, "bfloat16": 2,
    "fp16": 2, "float16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}

# How many past inputs the short-convolution state keeps per channel.
CONV_STATE_COLUMNS = ("width-1", "width")

SCOPE_NOTE = (
    "active attention state only (docs/spec.md §6): weights, activations, workspaces, allocator padding, "
    "paged-cache block rounding and saved prefix states are not included"
)
TP_NOTE = (
    "per-rank figures: KDA heads and q/k/v conv channels are split across the tp ranks; the MLA latent "
    "cache is replicated on every rank (vLLM/SGLang without context parallelism)"
)


def dtype_bytes(name: str, *, arg: str = "dtype") -> int:
    """Bytes per element of a dtype given by name (``fp32``, ``bf16``, ``fp16``, ``fp8`` and aliases)."""
    if not isinstance(name, str) or name.lower() not in DTYPE_BYTES:
        raise ValueError(f"{arg}: expected one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name.lower()]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


# ---------------------------------------------------------------------------------------------------
# Layer patterns
# ---------------------------------------------------------------------------------------------------


def pattern_from_ratio(num_layers: int, kda: int, mla: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """KDA and MLA layer indices (0-based) for a repeating ``kda:mla`` cycle.

    Each cycle of ``kda + mla`` layers starts with ``kda`` KDA layers and ends with ``mla`` MLA layers
    (Kimi Linear's order). A trailing partial cycle follows the same rule, so 27 layers at 3:1 give 21
    KDA + 6 MLA; use explicit lists for other layouts.
    """
    _check_int("num_layers", num_layers, 1)
    _check_int("kda (ratio)", kda, 0)
    _check_int("mla (ratio)", mla, 0)
    if kda + mla == 0:
        raise ValueError(f"ratio: expected kda + mla > 0, got {kda}:{mla}")
    period = kda + mla
    kda_ids = tuple(i for i in range(num_layers) if i % period < kda)
    mla_ids = tuple(i for i in range(num_layers) if i % period >= kda)
    return kda_ids, mla_ids


def pattern_from_counts(num_kda: int, num_mla: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """KDA and MLA layer indices for given counts, the MLA layers spread evenly and the last one last.

    Only the counts enter the memory estimate; the placement is for display.
    """
    _check_int("num_kda", num_kda, 0)
    _check_int("num_mla", num_mla, 0)
    total = num_kda + num_mla
    if total == 0:
        raise ValueError("num_kda + num_mla: expected at least one layer, got 0")
    # MLA layer i (1-based) sits at ceil(i * total / num_mla) - 1, so the gaps differ by at most one.
    mla_ids = tuple(-(-(i * total) // num_mla) - 1 for i in range(1, num_mla + 1))
    taken = set(mla_ids)
    kda_ids = tuple(i for i in range(total) if i not in taken)
    return kda_ids, mla_ids


# ---------------------------------------------------------------------------------------------------
# Model configuration
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridModelConfig:
    """Attention-state geometry of a KDA/MLA hybrid (per-layer sizes and the layer pattern).

    ``kda_layers`` / ``mla_layers`` are 0-based layer indices that together cover ``range(num_layers)``
    exactly once. ``kda_value_heads`` defaults to ``kda_heads`` (no grouped value heads).
    """

    num_layers: int
    kda_layers: Tuple[int, ...]
    mla_layers: Tuple[int, ...]
    kda_heads: int = 32
    kda_value_heads: Optional[int] = None
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_width: int = 4
    conv_state_columns: str = "width-1"
    state_dtype: str = "fp32"
    conv_dtype: str = "bf16"
    kv_lora_rank: int = 512
    rope_dim: int = 64
    mla_cache_dtype: str = "bf16"
    name: str = "custom"

    def __post_init__(self):
        _check_int("num_layers", self.num_layers, 1)
        object.__setattr__(self, "kda_layers", tuple(self.kda_layers))
        object.__setattr__(self, "mla_layers", tuple(self.mla_layers))
        for arg in ("kda_layers", "mla_layers"):
            for i in getattr(self, arg):
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
                    raise ValueError(f"{arg}: expected layer indices in [0, {self.num_layers}), got {i!r}")
            ids = getattr(self, arg)
            if len(set(ids)) != len(ids):
                raise ValueError(f"{arg}: expected distinct layer indices, got {list(ids)}")
        both = set(self.kda_layers) & set(self.mla_layers)
        if both:
            raise ValueError(f"kda_layers/mla_layers: layers {sorted(both)} are listed as both KDA and MLA")
        missing = set(range(self.num_layers)) - set(self.kda_layers) - set(self.mla_layers)
        if missing:
            raise ValueError(
                f"kda_layers/mla_layers: expected every layer of {self.num_layers} to be KDA or MLA, "
                f"layers {sorted(missing)} are neither"
            )
        if not self.kda_layers:
            raise ValueError("kda_layers: expected at least one KDA layer (the baseline is all-MLA), got none")
        _check_int("kda_heads", self.kda_heads, 1)
        if self.kda_value_heads is not None:
            _check_int("kda_value_heads", self.kda_value_heads, 1)
            if self.kda_value_heads % self.kda_heads:
                # Grouped value heads: value head i reads q/k head i // (HV // H); chunk_kda and kda_decode
                # reject any other count.
                raise ValueError(
                    f"kda_value_heads: expected a multiple of kda_heads={self.kda_heads} (each q/k head serves "
                    f"a group of value heads; kdakit's ops reject other counts), got {self.kda_value_heads}"
                )
        _check_int("head_k_dim", self.head_k_dim, 1)
        _check_int("head_v_dim", self.head_v_dim, 1)
        _check_int("conv_width", self.conv_width, 1)
        if self.conv_state_columns not in CONV_STATE_COLUMNS:
            raise ValueError(
                f"conv_state_columns: expected one of {', '.join(CONV_STATE_COLUMNS)}, "
                f"got {self.conv_state_columns!r}"
            )
        _check_int("kv_lora_rank", self.kv_lora_rank, 1)
        _check_int("rope_dim", self.rope_dim, 0)
        dtype_bytes(self.state_dtype, arg="state_dtype")
        dtype_bytes(self.conv_dtype, arg="conv_dtype")
        dtype_bytes(self.mla_cache_dtype, arg="mla_cache_dtype")

    @property
    def value_heads(self) -> int:
        return self.kda_heads if self.kda_value_heads is None else self.kda_value_heads

    @property
    def num_kda(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla(self) -> int:
        return len(self.mla_layers)

    @property
    def conv_columns(self) -> int:
        """Past inputs kept per conv channel."""
        return self.conv_width - 1 if self.conv_state_columns == "width-1" else self.conv_width

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kda_layers"] = list(self.kda_layers)
        d["mla_layers"] = list(self.mla_layers)
        d["kda_value_heads"] = self.value_heads
        return d


def _kimi_linear_48b_a3b() -> HybridModelConfig:
    # Kimi-Linear-48B-A3B: full-attention (MLA) layers 4, 8, 12, 16, 20, 24, 27 in the checkpoint's
    # 1-based numbering; the other 20 are KDA. 32 KDA heads of 128, conv width 4, MLA latent 512 + 64.
    mla = (3, 7, 11, 15, 19, 23, 26)
    return HybridModelConfig(
        num_layers=27,
        kda_layers=tuple(i for i in range(27) if i not in mla),
        mla_layers=mla,
        kda_heads=32, head_k_dim=128, head_v_dim=128, conv_width=4,
        kv_lora_rank=512, rope_dim=64,
        name="kimi-linear-48b-a3b",
    )


def _generic_4l_3to1() -> HybridModelConfig:
    # The docs/spec.md §6 model: 4l layers with l = 8 (32 layers, a common depth), every fourth layer MLA.
    # Per-layer sizes equal Kimi Linear's, so comparing the two presets isolates the pattern.
    kda, mla = pattern_from_ratio(32, 3, 1)
    return HybridModelConfig(
        num_layers=32, kda_layers=kda, mla_layers=mla,
        kda_heads=32, head_k_dim=128, head_v_dim=128, conv_width=4,
        kv_lora_rank=512, rope_dim=64,
        name="generic-4l-3to1",
    )


PRESETS = {
    "kimi-linear-48b-a3b": _kimi_linear_48b_a3b,
    "generic-4l-3to1": _generic_4l_3to1,
}


def get_preset(name: str) -> HybridModelConfig:
    """The preset configuration ``name`` (one of ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------------
# Per-sequence and per-token bytes
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KDAStateBytes:
    """Bytes of one sequence's state in one KDA layer on one rank."""

    recurrent: int
    conv: int

    @property
    def total(self) -> int:
        return self.recurrent + self.conv


def _check_tp(cfg: HybridModelConfig, tp: int) -> int:
    _check_int("tp", tp, 1)
    for arg, heads in (("kda_heads", cfg.kda_heads), ("kda_value_heads", cfg.value_heads)):
        if heads % tp:
            raise ValueError(f"tp: expected a divisor of {arg}={heads} (heads are split across ranks), got {tp}")
    return tp


def kda_state_breakdown(cfg: HybridModelConfig, tp: int = 1) -> KDAStateBytes:
    """Recurrent and conv state bytes of one sequence in one KDA layer, per rank."""
    _check_tp(cfg, tp)
    hv = cfg.value_heads // tp
    h = cfg.kda_heads // tp
    recurrent = hv * cfg.head_k_dim * cfg.head_v_dim * dtype_bytes(cfg.state_dtype)
    channels = 2 * h * cfg.head_k_dim + hv * cfg.head_v_dim  # q, k, v short convolutions
    conv = channels * cfg.conv_columns * dtype_bytes(cfg.conv_dtype)
    return KDAStateBytes(recurrent=recurrent, conv=conv)


def kda_state_bytes_per_seq(cfg: HybridModelConfig, tp: int = 1) -> int:
    """sigma: KDA recurrent + conv state bytes of one sequence in one KDA layer, per rank."""
    return kda_state_breakdown(cfg, tp).total


def mla_bytes_per_token(cfg: HybridModelConfig, tp: int = 1) -> int:
    """kappa: MLA latent-cache bytes of one token in one MLA layer (replicated, so the same on every rank)."""
    _check_tp(cfg, tp)
    return (cfg.kv_lora_rank + cfg.rope_dim) * dtype_bytes(cfg.mla_cache_dtype)


# ---------------------------------------------------------------------------------------------------
# Totals, ratio, crossover
# ---------------------------------------------------------------------------------------------------


def m_mla_bytes(cfg: HybridModelConfig, batch: int, context: int, tp: int = 1) -> int:
    """All-MLA baseline with ``cfg.num_layers`` layers: ``b * L * kappa * T`` bytes per rank."""
    _check_int("batch", batch, 1)
    _check_int("context", context, 1)
    return batch * cfg.num_layers * mla_bytes_per_token(cfg, tp) * context


def m_hybrid_bytes(cfg: HybridModelConfig, batch: int, context: int, tp: int = 1) -> int:
    """Hybrid: ``b * (n_mla * kappa * T + n_kda * sigma)`` bytes per rank."""
    _check_int("batch", batch, 1)
    _check_int("context", context, 1)
    return batch * _hybrid_per_seq(cfg, context, tp)


def _hybrid_per_seq(cfg: HybridModelConfig, context: int, tp: int) -> int:
    return cfg.num_mla * mla_bytes_per_token(cfg, tp) * context + cfg.num_kda * kda_state_bytes_per_seq(cfg, tp)


def memory_ratio(cfg: HybridModelConfig, context: int, tp: int = 1) -> float:
    """``M_hybrid / M_MLA`` (independent of the batch); tends to ``n_mla / L`` as the context grows."""
    _check_int("context", context, 1)
    return float(Fraction(_hybrid_per_seq(cfg, context, tp), cfg.num_layers * mla_bytes_per_token(cfg, tp) * context))


def crossover_tokens(cfg: HybridModelConfig, tp: int = 1) -> float:
    """T* = sigma / kappa: the hybrid holds less state than the all-MLA baseline exactly when T > T*."""
    return kda_state_bytes_per_seq(cfg, tp) / mla_bytes_per_token(cfg, tp)


# ---------------------------------------------------------------------------------------------------
# Budget solvers
# ---------------------------------------------------------------------------------------------------

_DESIGNS = ("hybrid", "mla")


def _check_design(design: str) -> str:
    if design not in _DESIGNS:
        raise ValueError(f"design: expected one of {', '.join(_DESIGNS)}, got {design!r}")
    return design


def max_batch_at_context(
    cfg: HybridModelConfig, budget_bytes: int, context: int, tp: int = 1, design: str = "hybrid"
) -> int:
    """Largest batch whose active state fits ``budget_bytes`` per rank at ``context`` tokens (0 if none)."""
    _check_int("budget_bytes", budget_bytes, 1)
    _check_int("context", context, 1)
    if _check_design(design) == "hybrid":
        per_seq = _hybrid_per_seq(cfg, context, tp)
    else:
        per_seq = cfg.num_layers * mla_bytes_per_token(cfg, tp) * context
    return budget_bytes // per_seq


def max_context_at_batch(
    cfg: HybridModelConfig, budget_bytes: int, batch: int, tp: int = 1, design: str = "hybrid"
) -> Optional[int]:
    """Longest context (tokens) whose active state for ``batch`` sequences fits ``budget_bytes`` per rank.

    Returns 0 when not even the fixed KDA state fits, and ``None`` when the context is unbounded
    (a hybrid without MLA layers whose fixed state fits).
    """
    _check_int("budget_bytes", budget_bytes, 1)
    _check_int("batch", batch, 1)
    kappa = mla_bytes_per_token(cfg, tp)
    if _check_design(design) == "mla":
        return budget_bytes // (batch * cfg.num_layers * kappa)
    left = budget_bytes - batch * cfg.num_kda * kda_state_bytes_per_seq(cfg, tp)
    if left < 0:
        return 0
    if cfg.num_mla == 0:
        return None
    return left // (batch * cfg.num_mla * kappa)


# ---------------------------------------------------------------------------------------------------
# One-call estimate
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingEstimate:
    """Everything ``kdakit serve-mem`` reports, per rank. Byte counts are exact integers.

    ``kda_state_bytes_per_seq`` is sigma (one KDA layer) and ``mla_bytes_per_token`` is kappa (one MLA
    layer), so ``crossover_tokens == kda_state_bytes_per_seq / mla_bytes_per_token``.
    """

    model: HybridModelConfig
    batch: int
    context: int
    tp: int
    kda_recurrent_bytes_per_seq: int
    kda_conv_bytes_per_seq: int
    kda_state_bytes_per_seq: int
    mla_bytes_per_token: int
    m_mla_bytes: int
    m_hybrid_bytes: int
    ratio: float
    ratio_limit: float
    crossover_tokens: float
    budget_bytes: Optional[int] = None
    max_batch_hybrid: Optional[int] = None
    max_batch_mla: Optional[int] = None
    max_context_hybrid: Optional[int] = None
    max_context_mla: Optional[int] = None

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "model"}
        d["model"] = self.model.to_dict()
        d["preset"] = self.model.name
        d["num_layers"] = self.model.num_layers
        d["num_kda_layers"] = self.model.num_kda
        d["num_mla_layers"] = self.model.num_mla
        d["kda_state_bytes_per_seq_all_layers"] = self.model.num_kda * self.kda_state_bytes_per_seq
        d["mla_bytes_per_token_all_layers"] = self.model.num_mla * self.mla_bytes_per_token
        d["per_rank"] = True
        d["scope"] = SCOPE_NOTE
        d["tp_assumption"] = TP_NOTE
        return d


def estimate(
    cfg: HybridModelConfig, batch: int, context: int, tp: int = 1, budget_bytes: Optional[int] = None
) -> ServingEstimate:
    """All serving-memory figures for ``batch`` sequences of ``context`` tokens on ``tp`` ranks.

    With ``budget_bytes`` (device memory minus weights, per rank) it also solves for the largest batch
    at ``context`` and the longest context at ``batch``, for the hybrid and the all-MLA baseline.
    """
    parts = kda_state_breakdown(cfg, tp)
    kappa = mla_bytes_per_token(cfg, tp)
    budget = {}
    if budget_bytes is not None:
        budget = dict(
            budget_bytes=budget_bytes,
            max_batch_hybrid=max_batch_at_context(cfg, budget_bytes, context, tp, "hybrid"),
            max_batch_mla=max_batch_at_context(cfg, budget_bytes, context, tp, "mla"),
            max_context_hybrid=max_context_at_batch(cfg, budget_bytes, batch, tp, "hybrid"),
            max_context_mla=max_context_at_batch(cfg, budget_bytes, batch, tp, "mla"),
        )
    return ServingEstimate(
        model=cfg, batch=batch, context=context, tp=tp,
        kda_recurrent_bytes_per_seq=parts.recurrent,
        kda_conv_bytes_per_seq=parts.conv,
        kda_state_bytes_per_seq=parts.total,
        mla_bytes_per_token=kappa,
        m_mla_bytes=m_mla_bytes(cfg, batch, context, tp),
        m_hybrid_bytes=m_hybrid_bytes(cfg, batch, context, tp),
        ratio=memory_ratio(cfg, context, tp),
        ratio_limit=cfg.num_mla / cfg.num_layers,
        crossover_tokens=parts.total / kappa,
        **budget,
    )


def sweep(cfg: HybridModelConfig, batch: int, contexts: Sequence[int], tp: int = 1):
    """``(context, m_mla_bytes, m_hybrid_bytes, ratio)`` for each context (used by ``--plot``)."""
    return [
        (t, m_mla_bytes(cfg, batch, t, tp), m_hybrid_bytes(cfg, batch, t, tp), memory_ratio(cfg, t, tp))
        for t in contexts
    ]
