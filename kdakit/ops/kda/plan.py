"""The execution plan of a chunked KDA call: chunk size, checkpoint cadence, and every byte.

``plan_kda(...)`` works from shapes alone (no tensors, no GPU) so the memory model can
price any shape; the Triton launchers use the same object, so what is predicted is what
runs. Byte arithmetic follows PyTorch's CUDA caching allocator: every allocation is
rounded up to a multiple of 512 bytes (``Allocation.allocated_bytes``) and a zero-size
tensor costs nothing; ``torch.cuda.max_memory_allocated`` counts those rounded sizes.

Timeline modelled, allocation by allocation in program order (docs/spec.md §3 protocol: inputs
and dO exist before the call; the launchers ``chunk_fwd.chunk_kda_fwd`` and
``chunk_bwd.chunk_kda_bwd`` allocate in this order):

* forward: O, the optional final state, the checkpoint row offsets (freed when the launcher
  returns) and the checkpoints (saved for backward); then the forward-only temporaries of the
  intra-chunk kernel: the packed-sequence chunk table (int32, varlen only), W, qΓ, kd
  ``[B, T, HV, K]`` and Aqk ``[B, T, HV, C]`` in the token dtype, ``exp(g_C)`` fp32
  ``[chunks, HV, K]`` (U is written into O). The two forward kernels run (``forward_peak_bytes``
  is the running total here) and the temporaries are freed before the launcher returns. They
  take ``(3K + C)·b + 4K/C`` bytes per token and value head (b = token dtype bytes; about
  6.5·T·HV·D at K = V = D = 128, bf16) while the backward later adds dq, dk, dv, dg, dbeta
  (8·T·H·D + 2·T·H bytes) and its workspace, so for the usual shapes the forward stays below
  the backward at any T; the plan does not assume it: the peak is the max over the timeline;
* backward: the offsets again, every gradient once (with GVA, HV > H, dq/dk start as fp32
  per-value-head partials ``[B, T, HV, K]``), the parameter partials, the fp32 dh0, then the
  workspace (per-program state slots, bounded by the number of programs, not by T); the
  kernel runs; the workspace is freed; GVA partials are summed over the group (an fp32
  ``[B, T, H, K]`` temporary, then the dtype cast); parameter sums; dh0 cast to the
  initial state's dtype when that is not fp32.
* ``predicted_peak_bytes`` is the maximum of the running total over both phases;
  ``transient_bytes`` is what it exceeds floor (inputs + dO + O + gradients) + saved +
  backward workspace by: the GVA partials, or slightly negative without GVA (dA_log and
  ddt_bias are allocated after the workspace is freed).

Checkpoint layout (shared with the kernels): ``[num_checkpoints, HV, K, V]`` (always K-major) in
``plan.checkpoint_dtype`` (``training_checkpoint_dtype``: bf16 for bf16 inputs, else fp32); sequence n's checkpoint j is the state before its token ``j * L`` and sits at row
``offsets[n] + j`` with ``offsets = checkpoint_offsets(...)`` (int64 ``[N + 1]``);
``ceil(len_n / L)`` checkpoints per sequence (none for an empty one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kdakit.ops.kda.plan_chunk64 import (CHUNK64, chunk64_backward_slots, chunk64_forward_groups,
                                        chunk64_forward_slots, chunk64_step, chunk64_window_rows, chunk64_windows)

CHUNK_SIZE = 16
DEFAULT_CHECKPOINT_TOKENS = 2048
DEFAULT_RECOMPUTE_TOKENS = 256
# The default cadence is the densest of these whose predicted peak stays within PEAK_BUDGET x the floor
# (the SPEC's allocated-memory target). A denser cadence leaves the backward's window-start stage less to walk
# (at L = 256, the backward's window, nothing), so the densest that fits is the fastest.
DENSE_CHECKPOINT_TOKENS = (256, 512, 1024)
PEAK_BUDGET = 1.10
H200_SMS = 132  # the SM count a shapes-only plan assumes (the launchers read the device's)
_ALLOC_ROUND = 512

# The Triton chunk pipelines, the gate kinds that pick among them by default, and the 64-token pipelines' default
# windows in tokens (docs/chunk_pipeline.md). The safe gate keeps the 16-token path; the unbounded gates (softplus
# in kernel, a precomputed log-decay) run the 64-token pipeline.
PIPELINES = ("windowed16", "chunk64", "chunk64_fast")
GATE_KINDS = ("safe", "softplus", "raw")
DEFAULT_PIPELINE = {"safe": "windowed16", "softplus": "chunk64", "raw": "chunk64"}
CHUNK64_WINDOW = {"chunk64": 1024, "chunk64_fast": 2048}
WINDOW_ROWS = 1536  # the least (chunk, value head) rows of a default window: 16 chunks of 96 heads

GROUPS = (
    "inputs/dO/O",
    "saved forward activations",
    "recompute intermediates",
    "state checkpoints",
    "stage buffers",
    "gradient outputs",
    "workspace",
)
PHASES = ("forward", "backward", "saved")


@dataclass(frozen=True)
class Allocation:
    """One tensor the call allocates (or, for group 'inputs/dO/O', holds)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: str
    phase: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def allocated_bytes(self) -> int:
        """Size as the CUDA caching allocator counts it (multiple of 512 bytes; 0 if empty)."""
        n = self.nbytes
        return 0 if n == 0 else -(-n // _ALLOC_ROUND) * _ALLOC_ROUND


@dataclass(frozen=True)
class KDAPlan:
    """How a chunked KDA call runs and what it allocates (all byte counts are allocator-rounded)."""

    backend: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype
    seqlens: tuple[int, ...]
    chunk_size: int
    checkpoint_every_n_tokens: int
    recompute_every_n_tokens: int
    recompute_in_backward: bool
    block_v: int
    num_sequences: int
    num_checkpoints: int
    checkpoint_bytes: int
    saved_bytes: int  # state checkpoints (+ their 512-byte row offsets)
    forward_workspace_bytes: int  # forward-only temporaries (intra-chunk outputs, chunk table)
    backward_workspace_bytes: int
    transient_bytes: int  # predicted peak - (floor + saved + backward workspace)
    floor_bytes: int
    forward_peak_bytes: int
    predicted_peak_bytes: int
    allocations: tuple[Allocation, ...] = field(repr=False)
    peak_model: str = "exact"
    peak_at: str = ""
    # Program order: ("alloc" | "free" | "mark", name) over ``allocations`` (a name may be
    # allocated, freed and allocated again, e.g. checkpoint_offsets); marks name phases.
    events: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    num_chunks: int = 0  # chunks of C tokens over all sequences (the forward intra kernel's grid)
    checkpoint_dtype: torch.dtype = torch.float32
    pipeline: str = "windowed16"
    gate: str = "safe"
    g_dtype: torch.dtype | None = None  # g's and dg's dtype (None: the token dtype)
    window_tokens: int = 0  # the 64-token pipelines' window (0 for windowed16)
    num_windows: int = 0
    max_slots: int = 0  # rows of the 64-token pipelines' window scratch (chunk.plan.ChunkPlan.max_slots)
    forward_slots: int = 0  # rows of their forward's scratch (chunk.plan.ChunkPlan.forward_slots; fast: every chunk)

    @property
    def workspace_bytes(self) -> int:
        return self.backward_workspace_bytes

    def checkpoint_offsets(self, device=None) -> torch.Tensor:
        """Row offsets of each sequence's checkpoints (int64 ``[N + 1]``) from the planned lengths:
        no read of ``cu_seqlens`` on the device."""
        return _offsets_tensor(self.seqlens, self.checkpoint_every_n_tokens, device)

    def bytes_by_group(self) -> dict[str, int]:
        out = {g: 0 for g in GROUPS}
        for a in self.allocations:
            out[a.group] += a.allocated_bytes
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round(n: int) -> int:
    return 0 if n == 0 else -(-n // _ALLOC_ROUND) * _ALLOC_ROUND


def sequence_lengths(B: int, T: int, cu_seqlens=None) -> list[int]:
    """Per-sequence token counts: B sequences of T tokens, or the spans of ``cu_seqlens`` (list or tensor)."""
    if cu_seqlens is None:
        return [int(T)] * int(B)
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(x) for x in cu_seqlens]
    return [b - a for a, b in zip(cu, cu[1:])]


def checkpoint_counts(lengths: Sequence[int], every_n_tokens: int) -> list[int]:
    """``ceil(len_n / L)`` checkpoints per sequence (0 for an empty sequence)."""
    L = int(every_n_tokens)
    return [-(-int(n) // L) for n in lengths]


def checkpoint_offsets(cu_seqlens=None, *, B: int | None = None, T: int | None = None,
                       every_n_tokens: int, device=None) -> torch.Tensor:
    """Row offsets of each sequence's checkpoints: int64 ``[N + 1]``, ``offsets[-1]`` = total rows.

    Give ``cu_seqlens`` (tensor or list) for packed sequences, else ``B`` and ``T``. The result
    lives on ``device`` (default: cu_seqlens' device, else CPU).
    """
    if cu_seqlens is None and (B is None or T is None):
        raise ValueError("checkpoint_offsets needs cu_seqlens or both B and T, got neither")
    _check_cadence(every_n_tokens)
    if device is None and isinstance(cu_seqlens, torch.Tensor):
        device = cu_seqlens.device
    return _offsets_tensor(sequence_lengths(B or 1, T or 0, cu_seqlens), every_n_tokens, device)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Copy a small host-built tensor to ``device`` without synchronizing: on CUDA through pinned memory
    with ``non_blocking`` (a pageable copy waits for the stream to drain); elsewhere a plain copy."""
    if device is None:
        return t
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _offsets_tensor(lengths: Sequence[int], every_n_tokens: int, device) -> torch.Tensor:
    offs = [0]
    for c in checkpoint_counts(lengths, every_n_tokens):
        offs.append(offs[-1] + c)
    return host_to_device(torch.tensor(offs, dtype=torch.int64), device)


def chunk_counts(lengths: Sequence[int]) -> list[int]:
    """``ceil(len_n / C)`` chunks per sequence (0 for an empty sequence)."""
    return [-(-int(n) // CHUNK_SIZE) for n in lengths]


def forward_chunk_table(lengths: Sequence[int], device=None) -> torch.Tensor:
    """The forward's packed-sequence chunk table: int32 ``[2 * NT + N + 1]``.

    Entries ``2 i`` and ``2 i + 1`` are (sequence, chunk within it) of global chunk ``i``
    (sequences in order, chunks in order, none for an empty sequence); the last ``N + 1``
    entries are each sequence's first global chunk (the last one is NT). Built on the host
    from the lengths the plan already holds and copied once (one allocation on ``device``).
    """
    counts = torch.tensor(chunk_counts(lengths), dtype=torch.int64)
    firsts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    firsts[1:] = torch.cumsum(counts, 0)
    nt = int(firsts[-1])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    local = torch.arange(nt) - firsts[:-1].repeat_interleave(counts)
    table = torch.cat([torch.stack([seq, local], 1).reshape(-1), firsts])
    if nt + len(counts) >= 2**31:
        raise ValueError(f"the chunk table needs int32 entries, got {nt} chunks")
    return host_to_device(table.to(torch.int32), device)


def gate_kind(use_gate_in_kernel: bool = False, safe_gate: bool = False, lower_bound: float | None = None, *,
              opts=None) -> str:
    """The call's gate as the pipeline choice sees it: ``"raw"`` (``use_gate_in_kernel=False``: g is the
    log-decay), ``"safe"`` (the in-kernel gate on the SAFE path, ``KDAOptions.safe``: ``safe_gate`` or a
    ``lower_bound`` in [-5, 0)) or ``"softplus"`` (any other in-kernel gate: unbounded per token). ``opts``: a
    ``KDAOptions`` to read instead of the flags."""
    if opts is not None:
        return "raw" if not opts.use_gate_in_kernel else ("safe" if opts.safe else "softplus")
    if not use_gate_in_kernel:
        return "raw"
    if lower_bound is not None and not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
    return "safe" if bool(safe_gate) or (lower_bound is not None and lower_bound >= -5.0) else "softplus"


def resolve_pipeline(pipeline: str | None, gate: str) -> str:
    """The pipeline a call runs: ``pipeline`` as named, or ``DEFAULT_PIPELINE[gate]`` for None."""
    if gate not in GATE_KINDS:
        raise ValueError(f"gate must be one of {GATE_KINDS}, got {gate!r}")
    if pipeline is None:
        return DEFAULT_PIPELINE[gate]
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {(None,) + PIPELINES}, got {pipeline!r}")
    return pipeline


def chunk64_window(pipeline: str, window_tokens: int | None = None, pairs: int | None = None) -> int:
    """The window of a 64-token pipeline in tokens: ``window_tokens``, else the default for ``pairs`` (sequence,
    value head) chains: ``CHUNK64_WINDOW[pipeline]``, doubled until a window holds at least ``WINDOW_ROWS``
    (chunk, value head) rows (``pairs`` None: the base window).

    Every window costs the host a fixed number of launches (about fifteen in the backward); at few pairs (one
    sequence of 16 heads, a layer's shape) a base window's kernels finish before the host has queued the next
    window's, and the step runs at the host's speed. The larger window costs scratch in proportion."""
    if pipeline not in CHUNK64_WINDOW:
        raise ValueError(f"pipeline must be one of {tuple(CHUNK64_WINDOW)} for a 64-token window, got {pipeline!r}")
    if window_tokens is None:
        window = CHUNK64_WINDOW[pipeline]
        if pairs:
            while pairs * (window // CHUNK64) < WINDOW_ROWS:
                window *= 2
        return window
    if isinstance(window_tokens, bool) or not isinstance(window_tokens, int) or window_tokens <= 0 \
            or window_tokens % CHUNK64:
        raise ValueError(f"window_tokens must be a positive multiple of {CHUNK64}, got {window_tokens!r}")
    return window_tokens


def _check_cadence(L) -> None:
    if isinstance(L, bool) or not isinstance(L, int) or L <= 0 or L % CHUNK_SIZE != 0:
        raise ValueError(
            f"checkpoint_every_n_tokens must be a positive multiple of the chunk size {CHUNK_SIZE}, got {L!r}"
        )


def default_checkpoint_tokens(max_len: int) -> int:
    """2048 tokens, clipped to the longest sequence rounded up to the chunk (at least one chunk)."""
    longest = max(CHUNK_SIZE, -(-int(max_len) // CHUNK_SIZE) * CHUNK_SIZE)
    if longest > DEFAULT_RECOMPUTE_TOKENS:
        # Keep whole recompute sub-segments per segment (see L2 in plan_kda).
        longest = -(-longest // DEFAULT_RECOMPUTE_TOKENS) * DEFAULT_RECOMPUTE_TOKENS
    return min(DEFAULT_CHECKPOINT_TOKENS, longest)


def training_checkpoint_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the checkpoints saved for backward: bf16 for bf16 inputs (the backward's per-chunk state
    slots are bf16 there already, as FLA's per-chunk states are; a checkpoint only starts a <= 256-token
    recompute), fp32 otherwise (fp16's range is too narrow for states, fp32 inputs ask for fp32)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def choose_block_v(programs: int, V: int, num_sms: int = H200_SMS) -> int:
    """Forward V block for ``programs`` (sequence, value head) pairs.

    A forward program walks its whole sequence serially, so the launch should fit in one
    wave: at 4 warps the kernel needs about 255 registers a thread, so two programs fit on
    an SM. BV = 64 is the default (no duplicated pairwise work beyond a factor V/64, small
    register spills); BV = 32 when even V/32 programs per pair fit in one wave (small batches).
    BV = 128 spills heavily at 4 warps and runs at 8 warps (pass ``block_v=128`` to try it).
    """
    full = min(128, max(16, 1 << (max(int(V), 1) - 1).bit_length()))
    if full <= 32:
        return full
    if programs * (-(-V // 32)) <= 2 * num_sms:
        return 32
    return 64


def plan_kda(q=None, v=None, *, B: int | None = None, T: int | None = None, H: int | None = None,
             HV: int | None = None, K: int | None = None, V: int | None = None,
             dtype: torch.dtype | None = None, seqlens: Sequence[int] | None = None, cu_seqlens=None,
             checkpoint_every_n_tokens: int | None = None, initial_state: bool = False,
             initial_state_dtype: torch.dtype = torch.float32, output_final_state: bool = False,
             gate_params: bool | None = None, backend: str = "triton", block_v: int | None = None,
             num_sms: int = H200_SMS, checkpoint_dtype: torch.dtype | None = None, pipeline: str | None = None,
             gate: str = "safe", window_tokens: int | None = None, g_dtype: torch.dtype | None = None) -> KDAPlan:
    """Plan a ``chunk_kda`` training call (forward + backward) from shapes alone.

    Shapes come from tensors ``q`` ``[B, T, H, K]`` and ``v`` ``[B, T, HV, V]`` (metadata only)
    or from ``B, T, H, HV, K, V`` (HV defaults to H, V to K). ``dtype`` is the token dtype
    (default: q's, else bf16). Packed sequences: ``seqlens`` (list of lengths, B = 1) or
    ``cu_seqlens`` (list or tensor). ``initial_state`` / ``output_final_state`` say whether
    those state tensors exist; ``gate_params`` whether fp32 ``A_log [HV]`` and
    ``dt_bias [HV*K]`` are inputs (and get gradients). ``checkpoint_dtype``: None for training
    (``training_checkpoint_dtype`` of the token dtype); the token dtype when the checkpoints are
    ``return_intermediate_states``'s h. ``checkpoint_every_n_tokens`` None: the densest of
    ``DENSE_CHECKPOINT_TOKENS`` whose predicted peak is within ``PEAK_BUDGET`` x the floor, else
    ``default_checkpoint_tokens``. ``backend`` is 'triton' (exact model)
    or 'torch' (the PyTorch path: checkpoints and floor only, ``peak_model = 'lower bound'``).

    ``pipeline``: the Triton pipeline priced, ``"windowed16"``, ``"chunk64"`` (windows recomputed in the backward)
    or ``"chunk64_fast"`` (the forward's per-chunk intermediates kept); None: ``DEFAULT_PIPELINE[gate]``, the one
    ``chunk_kda`` runs for that gate. ``gate``: ``gate_kind`` of the call, ``"safe"`` (the memory protocol's,
    default), ``"softplus"`` or ``"raw"``; ``gate_params`` None means ``gate != "raw"`` (a raw gate has none).
    ``window_tokens``: the 64-token pipelines' window, a multiple of 64 (``chunk_kda`` takes it as
    ``checkpoint_every_n_tokens``, so either names it; default ``chunk64_window``'s for the call's sequences and
    value heads). ``g_dtype``: g's
    dtype (and dg's), default the token dtype; Kimi Linear passes a raw fp32 log-decay with bf16 tokens.
    """
    if gate not in GATE_KINDS:
        raise ValueError(f"gate must be one of {GATE_KINDS}, got {gate!r}")
    if gate_params is None:
        gate_params = gate != "raw"
    elif gate_params and gate == "raw":
        raise ValueError("gate_params=True needs an in-kernel gate (A_log and dt_bias are read only for it), got "
                         "gate='raw'")
    pipeline = resolve_pipeline(pipeline, gate)
    if pipeline == "windowed16":
        if window_tokens is not None:
            raise ValueError(f"window_tokens is for the 64-token pipelines, got {window_tokens!r} with "
                             "pipeline='windowed16' (its cadence is checkpoint_every_n_tokens)")
    else:
        if backend != "triton":
            raise ValueError(f"pipeline={pipeline!r} is a Triton pipeline: backend must be 'triton', got {backend!r}")
        if window_tokens is not None and checkpoint_every_n_tokens is not None \
                and window_tokens != checkpoint_every_n_tokens:
            raise ValueError(f"window_tokens and checkpoint_every_n_tokens both name the 64-token window: give one, "
                             f"got {window_tokens!r} and {checkpoint_every_n_tokens!r}")
        explicit = window_tokens if window_tokens is not None else checkpoint_every_n_tokens
        window_tokens = chunk64_window(pipeline, explicit) if explicit is not None else None
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    if q is not None:
        B, T, H, K = (int(s) for s in q.shape)
        dtype = dtype or q.dtype
    if v is not None:
        HV, V = int(v.shape[2]), int(v.shape[3])
    for name, val in (("B", B), ("T", T), ("H", H), ("K", K)):
        if val is None and not (name in ("B", "T") and (seqlens is not None or cu_seqlens is not None)):
            raise ValueError(f"plan_kda needs {name} (or a tensor carrying it), got None")
    for name, val in (("B", B), ("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V)):
        if val is not None and (isinstance(val, bool) or int(val) != val):
            raise TypeError(f"plan_kda's {name} must be an integer, got {val!r}")
    HV = H if HV is None else int(HV)
    V = K if V is None else int(V)
    H, K = int(H), int(K)
    dtype = dtype or torch.bfloat16
    if checkpoint_dtype is None:
        checkpoint_dtype = training_checkpoint_dtype(dtype)
    if min(H, HV, K, V) <= 0:
        raise ValueError(f"H, HV, K and V must be positive, got H={H}, HV={HV}, K={K}, V={V}")
    if HV % H != 0:
        raise ValueError(f"HV must be a multiple of H={H}, got HV={HV}")
    if seqlens is not None and cu_seqlens is not None:
        raise ValueError("give seqlens or cu_seqlens, not both")
    if seqlens is not None:
        lengths = [int(n) for n in seqlens]
        if any(n < 0 for n in lengths):
            raise ValueError(f"seqlens must be >= 0, got {lengths}")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_seqlens = cu
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(x) for x in cu_seqlens]
        if not cu or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[:4]}")
        lengths = sequence_lengths(1, 0, cu)
        if any(n < 0 for n in lengths):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
        total = sum(lengths)
        if T is not None and int(T) != total:
            raise ValueError(f"T={T} does not match the packed sequences' total {total}")
        if B is not None and int(B) != 1:
            raise ValueError(f"packed sequences need B=1, got B={B}")
        B, T = 1, total
    else:
        B, T = int(B), int(T)
        if B < 0 or T < 0:
            raise ValueError(f"B and T must be >= 0, got B={B}, T={T}")
        lengths = [T] * B
    g_dtype = dtype if g_dtype is None else g_dtype
    if pipeline != "windowed16":
        if K > 128 or V > 128:
            raise ValueError(f"the Triton kernels support K, V <= 128, got K={K}, V={V} (plan_kda(backend='torch') "
                             "prices the PyTorch path)")
        if window_tokens is None:
            window_tokens = chunk64_window(pipeline, pairs=len(lengths) * HV)
        return _plan_chunk64(pipeline, gate, B, T, H, HV, K, V, dtype, g_dtype, tuple(lengths),
                             cu_seqlens is not None, window_tokens, bool(initial_state), initial_state_dtype,
                             bool(output_final_state), bool(gate_params))
    return _plan_cached(backend, B, T, H, HV, K, V, dtype, tuple(lengths), cu_seqlens is not None,
                        checkpoint_every_n_tokens, bool(initial_state), initial_state_dtype, bool(output_final_state),
                        bool(gate_params), block_v, num_sms, checkpoint_dtype, gate, g_dtype)


@functools.lru_cache(maxsize=256)
def _plan_cached(backend, B, T, H, HV, K, V, dtype, lengths, varlen, checkpoint_every_n_tokens, initial_state,
                 initial_state_dtype, output_final_state, gate_params, block_v, num_sms,
                 checkpoint_dtype, gate="safe", g_dtype=None) -> KDAPlan:
    """plan_kda's body on normalized, hashable arguments, memoized: a training loop plans the same shapes every
    step, and building the plan was most of kdakit's host time per call. KDAPlan is frozen, so one object can
    serve every call."""
    N = len(lengths)
    if backend == "triton" and (K > 128 or V > 128):
        raise ValueError(f"the Triton kernels support K, V <= 128, got K={K}, V={V} (plan_kda(backend='torch') "
                         "prices the PyTorch path)")

    if checkpoint_every_n_tokens is None:
        L = default_checkpoint_tokens(max(lengths, default=0))
        if backend == "triton":
            for dense in (c for c in DENSE_CHECKPOINT_TOKENS if c < L):
                p = _plan_cached(backend, B, T, H, HV, K, V, dtype, lengths, varlen, dense, initial_state,
                                 initial_state_dtype, output_final_state, gate_params, block_v, num_sms,
                                 checkpoint_dtype, gate, g_dtype)
                if p.predicted_peak_bytes <= PEAK_BUDGET * p.floor_bytes:
                    return p
    else:
        L = checkpoint_every_n_tokens
    _check_cadence(L)
    # The backward recomputes in sub-segments of L2 tokens that must tile a segment of L tokens.
    L2 = math.gcd(DEFAULT_RECOMPUTE_TOKENS, L)
    n_ckpt = sum(checkpoint_counts(lengths, L))
    bv = choose_block_v(N * HV, V, num_sms) if block_v is None else int(block_v)
    if bv < 16 or bv & (bv - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")

    f32 = torch.float32
    g_dtype = dtype if g_dtype is None else g_dtype
    allocs, events, add, free = _recorder()
    _caller_tensors(add, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, dtype=dtype, g_dtype=g_dtype, varlen=varlen,
                    gate_params=gate_params, initial_state=initial_state, initial_state_dtype=initial_state_dtype)

    # Forward: O, the final state, the checkpoints and their row offsets (both saved for backward).
    add("o", (B, T, HV, V), dtype, "inputs/dO/O", "forward")
    if output_final_state:
        add("final_state", (N, HV, K, V), f32, "inputs/dO/O", "forward")
    n_chunks = sum(chunk_counts(lengths))
    fwd_temps = ()
    if backend == "triton":
        add("checkpoint_offsets", (N + 1,), torch.int64, "state checkpoints", "saved")
        add("checkpoints", (n_ckpt, HV, K, V), checkpoint_dtype, "state checkpoints", "saved")
        # Intra-chunk kernel outputs read by the state kernel (chunk_fwd); U is written into o.
        if varlen:
            add("fwd_chunk_table", (2 * n_chunks + N + 1,), torch.int32, "workspace", "forward")
        for name in ("fwd_w", "fwd_qg", "fwd_kd"):
            add(name, (B, T, HV, K), dtype, "recompute intermediates", "forward")
        add("fwd_aqk", (B, T, HV, CHUNK_SIZE), dtype, "recompute intermediates", "forward")
        add("fwd_decay_last", (n_chunks, HV, K), f32, "recompute intermediates", "forward")
        fwd_temps = tuple(a.name for a in allocs if a.phase == "forward" and a.name.startswith("fwd_"))
    events.append(("mark", "forward"))
    if backend == "triton":
        free(*fwd_temps)  # freed before the launcher returns
    if output_final_state:
        # autograd hands a zero cotangent for an unused final state
        add("d_final_state", (N, HV, K, V), f32, "inputs/dO/O", "backward")

    # Backward (chunk_bwd): the windowed pipeline's allocations in launcher order; the PyTorch
    # path is priced by its gradient outputs only (a lower bound).
    if backend == "triton":
        _plan_windowed_backward(add, free, events, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, L=L, L2=L2, dtype=dtype,
                                initial_state=initial_state, initial_state_dtype=initial_state_dtype,
                                gate_params=gate_params, g_dtype=g_dtype)
    else:
        _token_grads(add, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype)
        if gate_params:
            add("dA_log", (HV,), f32, "gradient outputs", "backward")
            add("ddt_bias", (HV * K,), f32, "gradient outputs", "backward")
        if initial_state:
            add("d_initial_state", (N, HV, K, V), initial_state_dtype, "gradient outputs", "backward")
    events.append(("mark", "backward end"))

    peak, peak_at, fwd_peak = _replay(allocs, events)

    def total(pred) -> int:
        return sum(a.allocated_bytes for a in allocs if pred(a))

    floor = total(lambda a: a.group in ("inputs/dO/O", "gradient outputs"))
    saved = total(lambda a: a.phase == "saved")
    bwd_ws = total(lambda a: a.group == "workspace" and a.phase == "backward")
    fwd_ws = total(lambda a: a.name in fwd_temps)
    transient = peak - (floor + saved + bwd_ws) if backend == "triton" else 0
    return KDAPlan(
        backend=backend, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, seqlens=tuple(lengths),
        chunk_size=CHUNK_SIZE, checkpoint_every_n_tokens=L, recompute_every_n_tokens=L2,
        recompute_in_backward=True, block_v=bv, num_sequences=N, num_checkpoints=n_ckpt,
        checkpoint_bytes=total(lambda a: a.name == "checkpoints"), saved_bytes=saved,
        forward_workspace_bytes=fwd_ws, backward_workspace_bytes=bwd_ws, transient_bytes=transient,
        floor_bytes=floor, forward_peak_bytes=fwd_peak,
        predicted_peak_bytes=peak if backend == "triton" else floor + saved, peak_at=peak_at,
        events=tuple(events), checkpoint_dtype=checkpoint_dtype,
        allocations=tuple(allocs), peak_model="exact" if backend == "triton" else "lower bound",
        num_chunks=n_chunks, gate=gate, g_dtype=g_dtype,
    )


def _recorder():
    """``(allocations, events, add, free)``: ``add`` lists an allocation (and its "alloc" event unless
    ``live=False``), ``free`` appends "free" events."""
    allocs: list[Allocation] = []
    events: list[tuple[str, str]] = []

    def add(name, shape, dt, group, phase, live=True):
        allocs.append(Allocation(name, tuple(int(s) for s in shape), dt, group, phase))
        if live:
            events.append(("alloc", name))

    def free(*names):
        events.extend(("free", n) for n in names)

    return allocs, events, add, free


def _caller_tensors(add, *, B, T, H, HV, K, V, N, dtype, g_dtype, varlen, gate_params, initial_state,
                    initial_state_dtype) -> None:
    """What the caller holds before the call (docs/spec.md §3 protocol: dO exists up front)."""
    f32 = torch.float32
    for name, shape, dt in (("q", (B, T, H, K), dtype), ("k", (B, T, H, K), dtype), ("v", (B, T, HV, V), dtype),
                            ("g", (B, T, HV, K), g_dtype), ("beta", (B, T, HV), dtype)):
        add(name, shape, dt, "inputs/dO/O", "forward")
    if gate_params:
        add("A_log", (HV,), f32, "inputs/dO/O", "forward")
        add("dt_bias", (HV * K,), f32, "inputs/dO/O", "forward")
    if varlen:
        add("cu_seqlens", (N + 1,), torch.int64, "inputs/dO/O", "forward")
    if initial_state:
        add("initial_state", (N, HV, K, V), initial_state_dtype, "inputs/dO/O", "forward")
    add("do", (B, T, HV, V), dtype, "inputs/dO/O", "backward")


def _token_grads(add, *, B, T, H, HV, K, V, dtype, g_dtype, order=("dq", "dk", "dv", "dg", "dbeta")) -> None:
    """The token gradients in their inputs' dtypes (``torch.empty_like`` of each input), in ``order``."""
    spec = {"dq": ((B, T, H, K), dtype), "dk": ((B, T, H, K), dtype), "dv": ((B, T, HV, V), dtype),
            "dg": ((B, T, HV, K), g_dtype), "dbeta": ((B, T, HV), dtype)}
    for name in order:
        add(name, spec[name][0], spec[name][1], "gradient outputs", "backward")


def _replay(allocs, events) -> tuple[int, str, int]:
    """``(peak, where, running total at the "forward" mark)`` of a timeline."""
    size = {a.name: a.allocated_bytes for a in allocs}
    cur = peak = fwd_peak = 0
    peak_at = "start"
    for kind, name in events:
        if kind == "alloc":
            cur += size[name]
        elif kind == "free":
            cur -= size[name]
        elif name == "forward":
            fwd_peak = cur
        if cur > peak:
            peak, peak_at = cur, name if kind == "mark" else f"after allocating {name}"
    return peak, peak_at, fwd_peak


def _plan_windowed_backward(add, free, events, *, B, T, H, HV, K, V, N, L, L2, dtype, initial_state,
                            initial_state_dtype, gate_params, g_dtype) -> None:
    """The windowed backward's allocations in launcher order (``chunk_bwd_windowed.run_windowed``):
    the five token gradients, the parameter partials, dh0 (which doubles as the state-gradient carry)
    or a carry, the window-start / chunk-state / chunk-state-gradient slots; the slots and the carry
    are freed before the parameter sums."""
    f32 = torch.float32
    _token_grads(add, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, g_dtype=g_dtype)
    ws = backward_workspace_allocations(N, HV, K, V, T, L, None, dtype, initial_state=initial_state,
                                        gate_params=gate_params, recompute_every_n_tokens=L2, H=H)
    partials = [w for w in ws if w[0].endswith("_partials")]
    slots = [w for w in ws if not w[0].endswith("_partials")]
    for name, shape, dt in partials:
        add(name, shape, dt, "workspace", "backward")
    h0_cast = initial_state and initial_state_dtype != f32
    if initial_state:
        add("d_initial_state_fp32" if h0_cast else "d_initial_state", (N, HV, K, V), f32,
            "stage buffers" if h0_cast else "gradient outputs", "backward")
    for name, shape, dt in slots:
        add(name, shape, dt, "workspace", "backward")
    events.append(("mark", "backward kernel"))
    free(*(name for name, _, _ in slots))
    if gate_params:
        add("dA_log", (HV,), f32, "gradient outputs", "backward")
        add("ddt_bias", (HV * K,), f32, "gradient outputs", "backward")
    free("checkpoint_offsets")
    free(*(name for name, _, _ in partials))
    if h0_cast:
        add("d_initial_state", (N, HV, K, V), initial_state_dtype, "gradient outputs", "backward")
        events.append(("mark", "initial-state gradient cast"))
        free("d_initial_state_fp32")


@functools.lru_cache(maxsize=256)
def _plan_chunk64(pipeline, gate, B, T, H, HV, K, V, dtype, g_dtype, lengths, varlen, window, initial_state,
                  initial_state_dtype, output_final_state, gate_params) -> KDAPlan:
    """``plan_kda`` of a 64-token pipeline (``plan_chunk64.chunk64_step``: the allocations in program order)."""
    N = len(lengths)
    keep = pipeline == "chunk64_fast"
    n_rows, n_windows, max_slots, _ = chunk64_windows(lengths, window)
    _, forward_slots = chunk64_forward_groups(chunk64_window_rows(lengths, window), B=B, T=T, H=H, HV=HV, K=K,
                                              V=V, dtype=dtype, g_dtype=g_dtype)
    allocs, events, add, free = _recorder()
    _caller_tensors(add, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, dtype=dtype, g_dtype=g_dtype, varlen=varlen,
                    gate_params=gate_params, initial_state=initial_state, initial_state_dtype=initial_state_dtype)
    scratch = chunk64_step(add, free, events, pipeline=pipeline, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, dtype=dtype,
                           g_dtype=g_dtype, n_rows=n_rows, n_windows=n_windows, max_slots=max_slots,
                           forward_slots=forward_slots, initial_state=initial_state, initial_state_dtype=initial_state_dtype,
                           output_final_state=output_final_state, gate_params=gate_params)
    f32 = torch.float32

    peak, peak_at, fwd_peak = _replay(allocs, events)

    def total(pred) -> int:
        return sum(a.allocated_bytes for a in allocs if pred(a))

    floor = total(lambda a: a.group in ("inputs/dO/O", "gradient outputs"))
    saved = total(lambda a: a.phase == "saved")
    bwd_ws = total(lambda a: a.name in scratch)
    fwd_ws = total(lambda a: a.phase == "forward" and a.group in ("workspace", "recompute intermediates")
                   and not a.name.startswith("chunk_"))
    return KDAPlan(
        backend="triton", B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, seqlens=tuple(lengths),
        chunk_size=CHUNK64, checkpoint_every_n_tokens=window, recompute_every_n_tokens=window,
        recompute_in_backward=not keep, block_v=0, num_sequences=N, num_checkpoints=0 if keep else n_windows * N,
        checkpoint_bytes=total(lambda a: a.name == "checkpoints"), saved_bytes=saved,
        forward_workspace_bytes=fwd_ws, backward_workspace_bytes=bwd_ws,
        transient_bytes=peak - (floor + saved + bwd_ws), floor_bytes=floor, forward_peak_bytes=fwd_peak,
        predicted_peak_bytes=peak, peak_at=peak_at, events=tuple(events), checkpoint_dtype=f32,
        allocations=tuple(allocs), num_chunks=n_rows, pipeline=pipeline, gate=gate, g_dtype=g_dtype,
        window_tokens=window, num_windows=n_windows, max_slots=max_slots,
        forward_slots=n_rows if keep else forward_slots,
    )


# ---- the windowed backward's workspace (chunk_bwd_windowed allocates exactly this) ----

def default_stage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage of the per-chunk S_c and dS slots: bf16 for 16-bit inputs (RMS ratio cost < 7e-4 on
    every gradient, float64 emulation at 4K tokens), fp32 for fp32 inputs."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def uses_lean_states(H: int, HV: int) -> bool:
    """Stage 2 from the window's intermediates (``chunk_bwd_states``) needs dq/dk rows per value head."""
    return H == HV


def lean_workspace_allocations(N: int, HV: int, K: int, sub: int, n_sub: int, dtype: torch.dtype) -> list:
    """``(name, shape, dtype)`` of the windows' Aqk and exp(g_C) slots (allocated after ws_ds): one set per
    window of a checkpoint segment (``n_sub`` of them), ``sub`` chunks of every sequence each."""
    return [("bwd_window_aqk", (n_sub, N * sub, HV, CHUNK_SIZE, CHUNK_SIZE), dtype),
            ("bwd_window_decay", (n_sub, N * sub, HV, K), torch.float32)]


def backward_workspace_allocations(N: int, HV: int, K: int, V: int, T_max: int, L: int, seqlens=None,
                                   dtype: torch.dtype = torch.bfloat16, *, initial_state: bool = False,
                                   gate_params: bool = True, recompute_every_n_tokens: int | None = None,
                                   stage_dtype: torch.dtype | None = None,
                                   H: int | None = None) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, shape, dtype)`` of every workspace tensor the windowed backward allocates, in order.

    N sequences, HV value heads, checkpoint cadence L; windows of ``L2 = recompute_every_n_tokens``
    (default ``gcd(256, L)``, the plan's rule) tokens. Nothing depends on T_max or seqlens (kept
    for the plan's call; the workspace is sized by windows, not by T). The state-gradient carry is
    dh0 itself when there is an initial state (a gradient output, not listed). Allocated after the
    gradient outputs and freed before the parameter sums; dq and dk need no GVA partials. H (default
    HV) decides whether stage 2 runs from the window's intermediates (``uses_lean_states``), which adds
    the per-window Aqk and exp(g_C) slots.
    """
    C = CHUNK_SIZE
    L2 = math.gcd(DEFAULT_RECOMPUTE_TOKENS, L) if recompute_every_n_tokens is None else int(recompute_every_n_tokens)
    if L % L2 or L2 % C:
        raise ValueError(f"need C | L2 | L, got C={C}, L2={L2}, L={L}")
    st = default_stage_dtype(dtype) if stage_dtype is None else stage_dtype
    f32 = torch.float32
    items, sub = N * HV, L2 // C
    out = []
    if gate_params:
        out.append(("bwd_dA_log_partials", (items, sub), f32))
        out.append(("bwd_ddt_bias_partials", (items, sub, K), f32))
    if not initial_state:
        out.append(("bwd_state_grad_carry", (N, HV, K, V), f32))
    if L // L2 > 1:
        out.append(("bwd_window_start_states", (items, L // L2 - 1, K, V), f32))
    out.append(("bwd_chunk_states", (items, sub, K, V), st))
    out.append(("bwd_chunk_state_grads", (items, sub, K, V), st))
    if uses_lean_states(HV if H is None else H, HV):
        out.extend(lean_workspace_allocations(N, HV, K, sub, L // L2, dtype))
    return out
