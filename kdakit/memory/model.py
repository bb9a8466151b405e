"""Analytic peak-memory model of one KDA forward+backward step, tensor by tensor, on CPU.

The step is the memory protocol of docs/spec.md §3: the caller holds q, k, v, g, beta, A_log, dt_bias
(all differentiated), cu_seqlens and dO; it runs ``o = chunk_kda(...)`` and
``o.backward(dO)``. The model replays every device allocation of that step in program
order on a :class:`Timeline` (allocate, free), tracks the live bytes, and reports the
peak and which tensors are live at the peak, sorted into storage groups:

============================  ==========================================================
inputs/dO/O                   the caller's inputs, dO, the output O (and a final state)
saved forward activations     tensors kept from forward to backward beyond the inputs
recompute intermediates       full-sequence tensors rebuilt in backward (w, u, qg, ...)
state series                  per-chunk states h and their gradients dh; kdakit's sparse
                              state checkpoints are counted here too
stage buffers                 partial gradients passed between backward stages
gradient outputs              gradients in their final dtype (dq, dk, dv, dg, dbeta, ...)
workspace                     scratch, reduction partials and chunk-index metadata
============================  ==========================================================

Group bytes at the peak always sum to the peak. Sizes are rounded up to 512 bytes, the
granule of PyTorch's CUDA caching allocator, so the figures compare with
``torch.cuda.max_memory_allocated()``. GiB = 2^30 bytes.

Backends:

* ``fla``: FLA 0.6.0 ``chunk_kda`` in recompute mode (``disable_recompute=False``, chunk 64,
  native Triton path), reconstructed from its source: ``fla/ops/kda/chunk.py``
  (``ChunkKDAFunction``), ``chunk_fwd.py``, ``chunk_bwd.py``, ``chunk_intra.py``,
  ``wy_fast.py``, ``fla/ops/common/chunk_delta_h.py``, ``fla/ops/gla/chunk.py``
  (output), ``fla/ops/kda/gate.py``, ``fla/ops/common/gate.py``,
  ``fla/modules/norm/l2norm.py`` and ``fla/ops/utils/cumsum.py``. Python locals keep a
  tensor alive until the function that holds it returns or rebinds the name; the replay
  follows those lifetimes. With the protocol's flags the peak falls inside
  ``chunk_kda_bwd_intra``, when ``db2.sum(0)`` is allocated while the fp32 stage buffers
  of two backward stages, every recomputed intermediate, h and dh are all alive.
* ``kdakit``: built from the plan the kernels themselves use,
  ``kdakit.ops.kda.plan.plan_kda(...)``: every allocation's shape, dtype, group and
  phase, replayed in the plan's program order (``KDAPlan.events``).
* ``reference``: kdakit's chunked PyTorch path keeps its backward working set inside
  autograd (one segment at a time), which no allocation list describes; its peak is not
  modelled (:class:`ModelUnsupported`). Its saved-for-backward bytes are:
  :func:`reference_saved_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GIB = float(2 ** 30)
# PyTorch's CUDA caching allocator hands out blocks in multiples of 512 bytes.
ALLOC_GRANULE = 512

GROUP_INPUTS = "inputs/dO/O"
GROUP_SAVED = "saved forward activations"
GROUP_RECOMPUTE = "recompute intermediates"
GROUP_STATES = "state series"
GROUP_STAGE = "stage buffers"
GROUP_GRADS = "gradient outputs"
GROUP_WORKSPACE = "workspace"
GROUPS = (GROUP_INPUTS, GROUP_SAVED, GROUP_RECOMPUTE, GROUP_STATES, GROUP_STAGE, GROUP_GRADS, GROUP_WORKSPACE)
# Group names other components use for the same storage.
GROUP_ALIASES = {"state checkpoints": GROUP_STATES, "inputs": GROUP_INPUTS, "saved": GROUP_SAVED}

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "int32": 4, "int64": 8, "bool": 1}
_DTYPE_NAMES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float64": "fp64", "double": "fp64", "int32": "int32", "int": "int32", "int64": "int64", "long": "int64",
    "bool": "bool",
}
GATES = ("safe", "softplus", "precomputed")
# The Triton pipelines a modelled call may name (None: the one chunk_kda runs for its gate).
PIPELINES = ("windowed16", "chunk64", "chunk64_fast")
BACKENDS = ("kdakit", "fla", "reference")

FLA_CHUNK = 64          # FLA's chunk_kda chunk size (default, and what the docs/spec.md §3 figures used)
FLA_SUB_CHUNK = 16      # fp32 diagonal-block buffer width in chunk_kda_fwd_intra
FLA_GATE_BWD_ROWS = 32  # token rows per program in kda_gate_bwd (its partial-sum count)


class ModelUnsupported(ValueError):
    """The backend has no analytic model for the requested quantity."""


def dtype_name(dtype) -> str:
    """Canonical short name (``bf16``, ``fp32``, ...) of a torch dtype or a dtype string."""
    text = str(dtype).replace("torch.", "").lower()
    if text in DTYPE_BYTES:
        return text
    if text in _DTYPE_NAMES:
        return _DTYPE_NAMES[text]
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or a torch dtype), got {dtype!r}")


def nbytes(shape, dtype) -> int:
    """Bytes of a dense tensor, before allocator rounding."""
    return math.prod(int(s) for s in shape) * DTYPE_BYTES[dtype_name(dtype)]


def allocated_bytes(shape, dtype) -> int:
    """Bytes the CUDA caching allocator books for the tensor (0 for an empty tensor)."""
    raw = nbytes(shape, dtype)
    return -(-raw // ALLOC_GRANULE) * ALLOC_GRANULE


def canonical_group(group: str) -> str:
    return GROUP_ALIASES.get(group, group)


# ---------------------------------------------------------------------------------------
# The call being modelled


def parse_backends(text: str, allowed=BACKENDS) -> list[str]:
    """Comma-separated backend names, each one of ``allowed``, without repeats."""
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError(f"backends must be a comma-separated list of {', '.join(allowed)}, got {text!r}")
    for name in names:
        if name not in allowed:
            raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(allowed)}")
    if len(set(names)) != len(names):
        raise ValueError(f"backends must not repeat, got {text!r}")
    return names


@dataclass(frozen=True)
class CallSpec:
    """One ``chunk_kda`` call in the docs/spec.md §3 protocol; defaults are the protocol's flags.

    ``mbs`` sequences of ``seq`` tokens each, packed as B = 1 with ``cu_seqlens``
    (``varlen=True``) or laid out as ``[mbs, seq, ...]`` (``varlen=False``). ``heads`` is
    the value-head count HV; ``qk_heads`` (default ``heads``) the q/k head count H.
    ``gate``: ``safe`` (lower_bound * sigmoid, in kernel), ``softplus`` (in kernel) or
    ``precomputed`` (g is already the log-decay). ``gate_dtype``: g's dtype (and dg's); None: fp32 for
    ``precomputed`` (Kimi Linear computes the log-decay outside the kernel in fp32), else ``dtype``.
    ``pipeline``: kdakit's Triton pipeline (``windowed16``, ``chunk64``, ``chunk64_fast``); None: the default
    for the gate (``kdakit.ops.kda.plan.DEFAULT_PIPELINE``). With a 64-token pipeline
    ``checkpoint_every_n_tokens`` is its window (a multiple of 64; default 1024, 2048 for ``chunk64_fast``).
    """

    mbs: int
    seq: int
    heads: int
    head_dim: int = 128
    value_dim: int | None = None
    qk_heads: int | None = None
    dtype: str = "bf16"
    varlen: bool = True
    use_qk_l2norm: bool = True
    gate: str = "safe"
    lower_bound: float = -5.0
    use_beta_sigmoid: bool = True
    gate_params: bool = True
    initial_state: bool = False
    output_final_state: bool = False
    checkpoint_every_n_tokens: int | None = None
    gate_dtype: str | None = None
    pipeline: str | None = None

    def __post_init__(self):
        for name in ("mbs", "seq", "heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("value_dim", "qk_heads", "checkpoint_every_n_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.heads % self.H != 0:
            raise ValueError(f"heads (HV={self.heads}) must be a multiple of qk_heads (H={self.H})")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.dtype not in ("bf16", "fp16", "fp32", "fp64"):
            raise ValueError(f"dtype must be bf16, fp16, fp32 or fp64, got {self.dtype!r}")
        if self.gate_dtype is not None:
            object.__setattr__(self, "gate_dtype", dtype_name(self.gate_dtype))
            if self.gate_dtype not in ("bf16", "fp16", "fp32", "fp64"):
                raise ValueError(f"gate_dtype must be bf16, fp16, fp32 or fp64, got {self.gate_dtype!r}")
        if self.pipeline is not None and self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES} or None, got {self.pipeline!r}")

    @property
    def g_dtype(self) -> str:
        """g's (and dg's) dtype name."""
        if self.gate_dtype is not None:
            return self.gate_dtype
        return "fp32" if self.gate == "precomputed" else self.dtype

    @property
    def H(self) -> int:
        return self.qk_heads or self.heads

    @property
    def HV(self) -> int:
        return self.heads

    @property
    def K(self) -> int:
        return self.head_dim

    @property
    def V(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def B(self) -> int:
        return 1 if self.varlen else self.mbs

    @property
    def T(self) -> int:
        """Token dimension of the tensors (all packed tokens when ``varlen``)."""
        return self.mbs * self.seq if self.varlen else self.seq

    @property
    def N(self) -> int:
        return self.mbs

    @property
    def tokens(self) -> int:
        return self.mbs * self.seq

    @property
    def seqlens(self) -> list[int]:
        return [self.seq] * self.mbs

    @property
    def use_gate_in_kernel(self) -> bool:
        return self.gate != "precomputed"

    @property
    def label(self) -> str:
        """The call in the cell notation of docs/spec.md §3: ``MBSxSEQ:H[/HV][:gate]``."""
        heads = str(self.HV) if self.H == self.HV else f"{self.H}/{self.HV}"
        return f"{self.mbs}x{self.seq}:{heads}" + (f":{self.gate}" if self.gate != "safe" else "")


def protocol_spec(mbs: int, seq: int, heads: int, **options) -> CallSpec:
    """The docs/spec.md §3 configuration at one shape, with optional overrides."""
    return CallSpec(mbs=mbs, seq=seq, heads=heads, **options)


def floor_bytes(spec: CallSpec) -> int:
    """The floor of docs/spec.md §3: inputs + dO + O + their gradients (q, k, v, g, beta; state and gate params excluded).

    For K = V = D and H = HV this is ``20 T H D + 4 T H`` bytes in bf16; g and dg count in ``spec.g_dtype``.
    """
    B, T, H, HV, K, V, dt = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.dtype
    per = 2 * nbytes((B, T, H, K), dt) + nbytes((B, T, HV, V), dt) + nbytes((B, T, HV, K), spec.g_dtype) \
        + nbytes((B, T, HV), dt)
    return 2 * per + 2 * nbytes((B, T, HV, V), dt)  # inputs and their grads; dO and O


# ---------------------------------------------------------------------------------------
# Replay machinery


@dataclass(frozen=True)
class Block:
    """One live tensor: its name, storage group and allocated bytes."""

    name: str
    group: str
    nbytes: int


class Timeline:
    """Program-order replay of allocations; remembers the live set at the highest point."""

    def __init__(self):
        self.live: dict[str, Block] = {}
        self.current = 0
        self.peak = 0
        self.peak_stage = ""
        self.peak_blocks: tuple[Block, ...] = ()
        self.stage = ""

    def at(self, stage: str) -> "Timeline":
        self.stage = stage
        return self

    def alloc(self, name: str, shape, dtype, group: str) -> None:
        if name in self.live:
            raise RuntimeError(f"model bug: tensor {name!r} allocated twice")
        block = Block(name, canonical_group(group), allocated_bytes(shape, dtype))
        self.live[name] = block
        self.current += block.nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.peak_stage = f"{self.stage}: {name}" if self.stage else name
            self.peak_blocks = tuple(self.live.values())

    def free(self, *names: str) -> None:
        for name in names:
            block = self.live.pop(name, None)
            if block is None:
                raise RuntimeError(f"model bug: tensor {name!r} freed but not live")
            self.current -= block.nbytes


@dataclass(frozen=True)
class MemoryModel:
    """Result of a model: the peak, where it happens and the live tensors there."""

    backend: str
    spec: CallSpec
    peak_bytes: int
    peak_stage: str
    blocks: tuple[Block, ...]
    floor_bytes: int
    saved_bytes: int
    notes: tuple[str, ...] = field(default=())

    def groups(self) -> dict[str, int]:
        """Bytes per storage group at the peak, canonical groups first (zeros kept)."""
        out = {g: 0 for g in GROUPS}
        for b in self.blocks:
            out[b.group] = out.get(b.group, 0) + b.nbytes
        return out

    def groups_gib(self) -> dict[str, float]:
        return {g: v / GIB for g, v in self.groups().items()}

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def floor_gib(self) -> float:
        return self.floor_bytes / GIB

    @property
    def overhead_gib(self) -> float:
        return (self.peak_bytes - self.floor_bytes) / GIB

    def to_json(self) -> dict:
        s = self.spec
        return {
            "backend": self.backend, "mbs": s.mbs, "seq": s.seq, "heads": s.heads, "qk_heads": s.H,
            "head_dim": s.K, "value_dim": s.V, "dtype": s.dtype, "gate": s.gate, "gate_dtype": s.g_dtype,
            "pipeline": _pipeline_of(self),
            "peak_alloc_gib": round(self.peak_gib, 6), "peak_alloc_bytes": self.peak_bytes,
            "floor_gib": round(self.floor_gib, 6), "overhead_gib": round(self.overhead_gib, 6),
            "saved_gib": round(self.saved_bytes / GIB, 6), "peak_stage": self.peak_stage,
            "groups": {g: round(v, 6) for g, v in self.groups_gib().items()},
            "notes": list(self.notes),
        }


def _pipeline_of(m: "MemoryModel") -> str | None:
    """The kdakit pipeline a model priced (from its notes), None for another backend."""
    if m.backend != "kdakit":
        return None
    for note in m.notes:
        if note.startswith("kdakit plan: "):
            return note[len("kdakit plan: "):].split(",")[0]
    return m.spec.pipeline


def _harness(tl: Timeline, spec: CallSpec) -> None:
    """What the protocol's caller holds before the step: inputs (and dO)."""
    B, T, H, HV, K, V, N, dt = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.N, spec.dtype
    tl.at("caller")
    tl.alloc("q", (B, T, H, K), dt, GROUP_INPUTS)
    tl.alloc("k", (B, T, H, K), dt, GROUP_INPUTS)
    tl.alloc("v", (B, T, HV, V), dt, GROUP_INPUTS)
    tl.alloc("g", (B, T, HV, K), spec.g_dtype, GROUP_INPUTS)
    tl.alloc("beta", (B, T, HV), dt, GROUP_INPUTS)
    if spec.gate_params and spec.use_gate_in_kernel:
        tl.alloc("A_log", (HV,), "fp32", GROUP_INPUTS)
        tl.alloc("dt_bias", (HV * K,), "fp32", GROUP_INPUTS)
    if spec.varlen:
        tl.alloc("cu_seqlens", (N + 1,), "int64", GROUP_INPUTS)
    if spec.initial_state:
        tl.alloc("initial_state", (N, HV, K, V), "fp32", GROUP_INPUTS)
    tl.alloc("dO", (B, T, HV, V), dt, GROUP_INPUTS)


# ---------------------------------------------------------------------------------------
# FLA 0.6.0 chunk_kda, recompute mode


def _fla_num_chunks(spec: CallSpec, chunk: int) -> int:
    if spec.varlen:
        return sum(-(-n // chunk) for n in spec.seqlens)
    return -(-spec.T // chunk)


def fla_model(spec: CallSpec) -> MemoryModel:
    """Replay FLA 0.6.0 ``chunk_kda`` forward+backward (recompute mode) for ``spec``."""
    B, T, H, HV, K, V, N, dt = spec.B, spec.T, spec.H, spec.HV, spec.K, spec.V, spec.N, spec.dtype
    BT = FLA_CHUNK
    NT = _fla_num_chunks(spec, BT)  # h/dh rows: [B, NT, ...] (B = 1 with cu_seqlens)
    gate_in_kernel = spec.use_gate_in_kernel
    has_params = spec.gate_params and gate_in_kernel
    NK = -(-K // min(32, 1 << (K - 1).bit_length()))  # key blocks of chunk_kda_bwd_intra (BK <= 32)
    tl = Timeline()
    _harness(tl, spec)
    if spec.varlen:
        # prepare_lens / prepare_chunk_indices / prepare_chunk_offsets results live in FLA's
        # tensor cache from the warm-up on, so they are resident before the measured step.
        tl.at("index cache")
        tl.alloc("seq_lens", (N,), "int64", GROUP_WORKSPACE)
        tl.alloc("chunk_indices", (NT, 2), "int64", GROUP_WORKSPACE)
        tl.alloc("chunk_offsets", (N + 1,), "int64", GROUP_WORKSPACE)

    # ---- forward: ChunkKDAFunction.forward (fla/ops/kda/chunk.py)
    tl.at("forward l2norm_fwd")
    if spec.use_qk_l2norm:
        tl.alloc("q_norm", (B, T, H, K), dt, GROUP_SAVED)
        tl.alloc("q_rstd", (B * T * H,), "fp32", GROUP_SAVED)
        tl.alloc("k_norm", (B, T, H, K), dt, GROUP_SAVED)
        tl.alloc("k_rstd", (B * T * H,), "fp32", GROUP_SAVED)
    if spec.use_beta_sigmoid:
        tl.at("forward fused_beta_sigmoid").alloc("beta_act", (B, T, HV), "fp32", GROUP_SAVED)
    # chunk_kda_fwd (chunk_fwd.py): the gate activation + chunk cumsum, fp32 (RCP_LN2-scaled).
    tl.at("forward gate cumsum")
    tl.alloc("g_cumsum", (B, T, HV, K), "fp32", GROUP_RECOMPUTE if gate_in_kernel else GROUP_SAVED)
    # chunk_kda_fwd_intra (chunk_intra.py): Aqk, Akk kept; fp32 diagonal blocks until it returns.
    tl.at("forward chunk_kda_fwd_intra")
    tl.alloc("Aqk", (B, T, HV, BT), dt, GROUP_SAVED)
    tl.alloc("Akk", (B, T, HV, BT), dt, GROUP_SAVED)
    tl.alloc("Akk_diag", (B, T, HV, FLA_SUB_CHUNK), "fp32", GROUP_WORKSPACE)
    # recompute_w_u_fwd (wy_fast.py) without q: w, u, kg.
    tl.at("forward recompute_w_u_fwd")
    tl.alloc("fwd_w", (B, T, HV, K), dt, GROUP_RECOMPUTE)
    tl.alloc("fwd_u", (B, T, HV, V), dt, GROUP_RECOMPUTE)
    tl.alloc("fwd_kg", (B, T, HV, K), dt, GROUP_RECOMPUTE)
    tl.free("Akk_diag")
    # chunk_gated_delta_rule_fwd_h (common/chunk_delta_h.py): h in the token dtype, v_new.
    tl.at("forward chunk_gated_delta_rule_fwd_h")
    tl.alloc("fwd_h", (B, NT, HV, K, V), dt, GROUP_STATES)
    if spec.output_final_state:
        tl.alloc("final_state", (N, HV, K, V), "fp32", GROUP_INPUTS)
    tl.alloc("fwd_v_new", (B, T, HV, V), dt, GROUP_RECOMPUTE)
    # chunk_gla_fwd_o_gk (gla/chunk.py): the output, zero-filled, v_new's dtype.
    tl.at("forward chunk_gla_fwd_o_gk").alloc("O", (B, T, HV, V), dt, GROUP_INPUTS)
    # Recompute mode drops w, u, kg, v_new, h (and the gate cumsum when the gate is in kernel).
    tl.at("forward return")
    tl.free("fwd_w", "fwd_u", "fwd_kg", "fwd_v_new", "fwd_h")
    if gate_in_kernel:
        tl.free("g_cumsum")
    saved_bytes = sum(b.nbytes for b in tl.live.values() if b.group == GROUP_SAVED)

    # ---- backward: ChunkKDAFunction.backward -> chunk_kda_bwd (chunk_bwd.py)
    if spec.output_final_state:
        # autograd materializes a zero gradient for the unused final state
        tl.at("backward dht").alloc("dht", (N, HV, K, V), "fp32", GROUP_STAGE)
    if gate_in_kernel:
        tl.at("backward kda_gate_chunk_cumsum").alloc("bwd_g_cumsum", (B, T, HV, K), "fp32", GROUP_RECOMPUTE)
    tl.at("backward recompute_w_u_fwd")  # now with q: w, u, qg, kg
    tl.alloc("bwd_w", (B, T, HV, K), dt, GROUP_RECOMPUTE)
    tl.alloc("bwd_u", (B, T, HV, V), dt, GROUP_RECOMPUTE)
    tl.alloc("bwd_qg", (B, T, HV, K), dt, GROUP_RECOMPUTE)
    tl.alloc("bwd_kg", (B, T, HV, K), dt, GROUP_RECOMPUTE)
    tl.at("backward chunk_gated_delta_rule_fwd_h")
    tl.alloc("bwd_h", (B, NT, HV, K, V), dt, GROUP_STATES)
    tl.alloc("bwd_v_new", (B, T, HV, V), dt, GROUP_RECOMPUTE)
    tl.at("backward chunk_kda_bwd_dAv")
    tl.alloc("dAqk", (B, T, HV, BT), "fp32", GROUP_STAGE)
    tl.alloc("dv_dAv", (B, T, HV, V), dt, GROUP_STAGE)
    tl.at("backward chunk_gated_delta_rule_bwd_dhu")
    tl.alloc("dh", (B, NT, HV, K, V), dt, GROUP_STATES)
    if spec.initial_state:
        tl.alloc("dh0", (N, HV, K, V), "fp32", GROUP_GRADS)
    tl.alloc("dv_dhu", (B, T, HV, V), dt, GROUP_STAGE)
    tl.free("dv_dAv")
    tl.at("backward chunk_kda_bwd_wy_dqkg_fused")
    tl.alloc("dq_wy", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.alloc("dk_wy", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.alloc("dv", (B, T, HV, V), dt, GROUP_GRADS)  # the final dv
    tl.alloc("dg_wy", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.alloc("db_wy", (B, T, HV), "fp32", GROUP_STAGE)
    tl.alloc("dAkk", (B, T, HV, BT), "fp32", GROUP_STAGE)
    tl.free("dv_dhu")
    # chunk_kda_bwd_intra (chunk_intra.py): new fp32 dq2/dk2/dg2 and NK beta partials while
    # the caller still holds the wy-stage buffers; then db2.sum(0) is allocated.
    tl.at("backward chunk_kda_bwd_intra")
    tl.alloc("dq_intra", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.alloc("dk_intra", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.alloc("db_partials", (NK, B, T, HV), "fp32", GROUP_STAGE)
    tl.alloc("dg_intra", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.alloc("db_sum", (B, T, HV), "fp32", GROUP_STAGE)
    tl.free("db_partials", "dq_wy", "dk_wy", "db_wy", "dg_wy")
    dq_name, dk_name = "dq_intra", "dk_intra"
    if HV > H:  # GVA: sum the per-value-head dq/dk over each group
        tl.at("backward GVA reduction")
        tl.alloc("dq_gva", (B, T, H, K), "fp32", GROUP_STAGE)
        tl.free("dq_intra")
        tl.alloc("dk_gva", (B, T, H, K), "fp32", GROUP_STAGE)
        tl.free("dk_intra")
        dq_name, dk_name = "dq_gva", "dk_gva"
    tl.at("backward reverse chunk_local_cumsum").alloc("dg_cumsum", (B, T, HV, K), "fp32", GROUP_STAGE)
    tl.free("dg_intra")
    dg_name = "dg_cumsum"
    if gate_in_kernel:
        tl.at("backward kda_gate_bwd")
        tl.alloc("dg", (B, T, HV, K), dt, GROUP_GRADS)
        rows = -(-(B * T) // FLA_GATE_BWD_ROWS)
        if has_params:
            tl.alloc("dA_log_partials", (rows, HV), "fp32", GROUP_WORKSPACE)
            tl.alloc("ddt_bias_partials", (rows, HV * K), "fp32", GROUP_WORKSPACE)
            tl.alloc("dA_log", (HV,), "fp32", GROUP_GRADS)
            tl.free("dA_log_partials")
            tl.alloc("ddt_bias", (HV * K,), "fp32", GROUP_GRADS)
            tl.free("ddt_bias_partials")
        tl.free("dg_cumsum")
        dg_name = "dg"
    # chunk_kda_bwd returns: its recomputed tensors, h, dh and the chunk-matrix grads go.
    tl.at("backward chunk_kda_bwd return")
    tl.free("bwd_w", "bwd_u", "bwd_qg", "bwd_kg", "bwd_h", "bwd_v_new", "dAqk", "dh", "dAkk")
    if gate_in_kernel:
        tl.free("bwd_g_cumsum")
    # ChunkKDAFunction.backward: l2norm and beta-sigmoid backward, then casts to input dtypes.
    if spec.use_qk_l2norm:
        tl.at("backward l2norm_bwd")
        tl.alloc("dq", (B, T, H, K), dt, GROUP_GRADS)
        tl.free(dq_name)
        tl.alloc("dk", (B, T, H, K), dt, GROUP_GRADS)
        tl.free(dk_name)
        dq_name, dk_name = "dq", "dk"
    if spec.use_beta_sigmoid:
        tl.at("backward fused_beta_sigmoid_bwd").alloc("dbeta", (B, T, HV), dt, GROUP_GRADS)
        tl.free("db_sum")
        db_name = "dbeta"
    else:
        db_name = "db_sum"
    tl.at("backward return casts")
    casts = []
    for name, shape, src, want in (("dq", (B, T, H, K), dq_name, dt), ("dk", (B, T, H, K), dk_name, dt),
                                   ("dg", (B, T, HV, K), dg_name, spec.g_dtype), ("dbeta", (B, T, HV), db_name, dt)):
        if src == "dg_cumsum" and want == "fp32":
            continue  # .to(g) of an fp32 gradient for an fp32 g returns it as it is
        if src != name:  # an fp32 buffer still to be cast to the input dtype by .to(...)
            tl.alloc(name, shape, want, GROUP_GRADS)
            casts.append(src)
    tl.free(*casts)
    notes = (
        "FLA 0.6.0 chunk_kda, native Triton path (FLA_DISABLE_BACKEND_DISPATCH=1), chunk 64, recompute mode",
    )
    return MemoryModel("fla", spec, tl.peak, tl.peak_stage, tl.peak_blocks, floor_bytes(spec), saved_bytes, notes)


# ---------------------------------------------------------------------------------------
# kdakit: from the kernels' own plan


def _plan_for(spec: CallSpec):
    try:
        from kdakit.ops.kda.plan import plan_kda
    except ImportError as exc:
        raise ModelUnsupported(
            f"the kdakit model needs kdakit.ops.kda.plan.plan_kda, which is not available ({exc})") from None
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
    # The gate kind picks the pipeline (plan.DEFAULT_PIPELINE) unless the spec names one; within a pipeline the
    # byte counts do not depend on the token transforms (l2norm, gate, beta sigmoid): they run on registers.
    return plan_kda(
        B=spec.B, T=spec.T, H=spec.H, HV=spec.HV, K=spec.K, V=spec.V, dtype=dtypes[spec.dtype],
        seqlens=spec.seqlens if spec.varlen else None,
        checkpoint_every_n_tokens=spec.checkpoint_every_n_tokens,
        initial_state=spec.initial_state, output_final_state=spec.output_final_state,
        gate_params=spec.gate_params and spec.use_gate_in_kernel, backend="triton",
        gate=plan_gate(spec), pipeline=spec.pipeline, g_dtype=dtypes[spec.g_dtype],
    )


def plan_gate(spec: CallSpec) -> str:
    """The plan's gate kind of a modelled call (``kdakit.ops.kda.plan.gate_kind``): safe, softplus or raw."""
    return {"safe": "safe", "softplus": "softplus", "precomputed": "raw"}[spec.gate]


def kdakit_plan(spec: CallSpec):
    """``plan_kda`` for ``spec`` (raises :class:`ModelUnsupported` when the plan is unavailable)."""
    return _plan_for(spec)


# Tensors the protocol's caller creates; _harness adds them, so the plan's copies are skipped.
_HARNESS_NAMES = {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state", "dO", "do"}


def kdakit_model(spec: CallSpec, plan=None) -> MemoryModel:
    """Peak of kdakit's Triton ``chunk_kda`` from its plan.

    Replays the plan's program-order timeline (``plan.events``: ``("alloc" | "free" |
    "mark", name)`` pairs over ``plan.allocations``). The caller's inputs and dO come from
    the protocol (the same as for FLA), so the plan's copies of them are skipped.
    """
    plan = plan if plan is not None else _plan_for(spec)
    by_name = {a.name: a for a in getattr(plan, "allocations", ())}
    events = getattr(plan, "events", None)
    if not by_name or not events:
        raise ModelUnsupported("kdakit's plan lists no allocation timeline (allocations and events), "
                               "so there is nothing to replay")
    tl = Timeline()
    _harness(tl, spec)
    for kind, name in events:
        if name in _HARNESS_NAMES:
            continue
        if kind == "alloc":
            a = by_name[name]
            # the plan's marks close a phase; label each allocation by its own phase
            tl.at(f"kdakit {'forward' if a.phase == 'saved' else a.phase}")
            tl.alloc(name, tuple(a.shape), a.dtype, a.group)
        elif kind == "free":
            tl.free(name)
        elif kind != "mark":
            raise ModelUnsupported(f"plan event {kind!r} for {name!r}: expected alloc, free or mark")
    saved = sum(allocated_bytes(tuple(a.shape), a.dtype) for a in by_name.values()
                if a.phase == "saved" and a.name not in _HARNESS_NAMES)
    pipeline = getattr(plan, "pipeline", "windowed16")
    if pipeline == "windowed16":
        notes = (f"kdakit plan: windowed16, chunk {plan.chunk_size}, checkpoint every "
                 f"{plan.checkpoint_every_n_tokens} tokens, recompute every {plan.recompute_every_n_tokens} tokens",)
    else:
        notes = (f"kdakit plan: {pipeline}, chunk {plan.chunk_size}, windows of {plan.window_tokens} tokens "
                 f"({plan.num_windows} windows, {plan.max_slots} slot rows)",)
    return MemoryModel("kdakit", spec, tl.peak, tl.peak_stage, tl.peak_blocks, floor_bytes(spec), saved, notes)


# ---------------------------------------------------------------------------------------
# kdakit's PyTorch reference path


def reference_saved_bytes(spec: CallSpec, chunk_size: int | None = None,
                          checkpoint_every_n_tokens: int | None = None) -> int:
    """Bytes the chunked PyTorch path saves for backward beyond its inputs: the state checkpoints.

    ``ChunkedKDAFunction`` stores the state at the start of every segment of
    ``checkpoint_every_n_tokens`` tokens (rounded up to the chunk) of the longest
    sequence, for all N sequences: ``[segments, N, HV, K, V]`` in the compute dtype
    (fp32, fp64 for fp64 inputs). Raw byte count (no allocator rounding).
    """
    from kdakit.ops.kda.reference import chunk as ref

    C = chunk_size or ref.DEFAULT_CHUNK_SIZE
    seg = checkpoint_every_n_tokens or spec.checkpoint_every_n_tokens or ref.DEFAULT_CHECKPOINT_TOKENS
    seg = max(C, -(-seg // C) * C)
    longest = max(spec.seqlens) if spec.varlen else spec.T
    padded = -(-longest // C) * C
    segments = -(-padded // seg)
    compute = "fp64" if spec.dtype == "fp64" else "fp32"
    return nbytes((segments, spec.N, spec.HV, spec.K, spec.V), compute)


def model(backend: str, spec: CallSpec) -> MemoryModel:
    """The peak-memory model of ``backend`` (``kdakit`` or ``fla``) for ``spec``."""
    if backend == "fla":
        return fla_model(spec)
    if backend == "kdakit":
        return kdakit_model(spec)
    if backend == "reference":
        raise ModelUnsupported(
            "backend 'reference' has no analytic peak model: its backward working set lives in autograd, one "
            "segment at a time; measure it with `kdakit mem measure --backends reference` "
            f"(its saved-for-backward state checkpoints are {reference_saved_bytes(spec) / GIB:.3f} GiB)"
        )
    raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def with_options(spec: CallSpec, **options) -> CallSpec:
    """A copy of ``spec`` with some fields changed (validated)."""
    return replace(spec, **options)
