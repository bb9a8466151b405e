"""Argument checking shared by every public KDA op.

Each failure raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong
value or shape) naming the argument, what was expected and what was got. Nothing
here modifies an input.

Host synchronization: the checks read only tensor metadata (shape, dtype, device),
never the values of a device tensor, with one exception: ``cu_seqlens`` without
``cu_seqlens_cpu`` is read to the host once (one device->host copy for CUDA tensors)
to check its values and to give ``KDAShape.seqlens``. With ``cu_seqlens_cpu`` (a CPU
copy of the same offsets) the values are checked and read from that copy and
``cu_seqlens`` is not read at all; fixed-length inputs (``cu_seqlens=None``) are
never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
# What the Triton kernels read: they compute in fp32, so float64 is the PyTorch backend's alone.
TRITON_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KDAShape:
    """Sizes read off validated inputs."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # number of sequences (B, or len(cu_seqlens) - 1)
    # Tokens per packed sequence, read once on the host (from cu_seqlens_cpu when given, else from
    # cu_seqlens: a device read for CUDA tensors) so that later host-side work (the plan) needs no
    # second read; None without cu_seqlens.
    seqlens: tuple[int, ...] | None = None


def metadata_shape(q: torch.Tensor, v: torch.Tensor, cu_seqlens) -> KDAShape:
    """``KDAShape`` from metadata alone: no check, no read (``seqlens`` is None). For a CUDA-graph capture
    of a call that an eager warm call validated, where reading ``cu_seqlens`` is illegal."""
    B, T, H, K = q.shape
    return KDAShape(B=B, T=T, H=H, HV=v.shape[2], K=K, V=v.shape[3],
                    N=B if cu_seqlens is None else cu_seqlens.numel() - 1)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {t.dim()}-D tensor of shape {_shape(t)}")


def check_triton_dtypes(tensors: dict) -> None:
    """Refuse a floating tensor the Triton kernels cannot honour (float64), naming it: the kernels compute in
    fp32, so a float64 input would come back computed in fp32 without a word. ``tensors``: name -> tensor or
    None (non-floating tensors such as offsets are skipped). Every Triton op calls this; the PyTorch backend
    computes float64 and never does. Reads the dtype alone (metadata: no value, no device sync)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.dtype not in TRITON_FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32 for the Triton kernels, got {t.dtype}; "
                            "use KDAKIT_BACKEND=torch for float64")


def check_token_strides(name: str, x) -> None:
    """A token tensor the Triton kernels read through its (batch, token, head) strides: a view of a wider tensor
    (one of a fused projection's ``split``, a ``transpose``d batch/time, a slice of heads) is read in place, with
    no copy; only the last dimension must have unit stride (a size-1 one may have any). Metadata only."""
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dimension (a view of a wider tensor is fine), "
                         f"got strides {tuple(x.stride())}")


def _check_offsets_meta(name: str, cu) -> None:
    """Kind, dtype and shape of a ``cu_seqlens``-like tensor (metadata only: nothing is read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have an integer dtype (int32 or int64), got {str(cu.dtype).replace('torch.', '')}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got shape {_shape(cu)}")


def _check_offset_values(name: str, cu: list[int], T: int) -> None:
    """Values of offsets already on the host: start at 0, non-decreasing, end at T."""
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {cu}")
    if cu[-1] != T:
        raise ValueError(f"{name} must end at T={T} (q.shape[1]), got {cu[-1]}")


# Gate parameter shapes accepted besides the flat ones: engines keep A_log as [HV, 1] or
# [1, 1, HV, 1] (broadcast against [B, T, HV, K]) and dt_bias as [HV, K]. Every shape holds the
# same elements in the same order, so a dense tensor of any of them is one flat view away from
# the [HV] / [HV * K] vector the kernels read.
def _gate_param_shapes(name: str, HV: int, K: int) -> tuple[tuple[int, ...], ...]:
    if name == "A_log":
        return (HV,), (HV, 1), (1, 1, HV, 1)
    return (HV * K,), (HV, K)


def _either(names) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _check_gate_param(name: str, t, HV: int, K: int, dtypes, engine_shapes: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    flat, *engine = _gate_param_shapes(name, HV, K)
    allowed = (flat, *engine) if engine_shapes else (flat,)
    if tuple(t.shape) not in allowed:
        spelled = {"A_log": ("[HV]", "[HV, 1]", "[1, 1, HV, 1]"), "dt_bias": ("[HV * K]", "[HV, K]")}[name]
        spelled = spelled if engine_shapes else spelled[:1]
        sizes = f"HV={HV}" if name == "A_log" else f"HV={HV}, K={K}"
        sized = ["[" + ", ".join(map(str, s)) + "]" for s in allowed]
        raise ValueError(f"{name} must have shape {_either(spelled)} with {sizes} ({_either(sized)}), "
                         f"got {_shape(t)}")
    # The kernels read gate parameters as dense vectors (the chunk kernels' stride_alog /
    # stride_bias is stride(0) of a 1-D tensor; the others assume stride 1): a strided view
    # (e.g. ``big[::2]``, or ``w[:, :K]`` of a wider [HV, K'] tensor) is refused on every backend
    # rather than read wrongly (a kernel would give a silently wrong output). is_contiguous()
    # ignores the strides of size-1 dims, which no read ever steps along, so a contiguous tensor
    # of an engine shape always has a flat view (``flat_gate_params``) with element stride 1.
    if not t.is_contiguous():
        raise ValueError(f"{name} must be a dense vector (contiguous, element stride 1), got shape {_shape(t)} "
                         f"with strides {tuple(t.stride())}; pass {name}.contiguous()")


def flat_gate_params(A_log, dt_bias):
    """The ``[HV]`` / ``[HV * K]`` views of gate parameters that ``validate_kda_inputs`` accepted with
    ``engine_gate_shapes=True`` (an engine's ``[HV, 1]``, ``[1, 1, HV, 1]``, ``[HV, K]``).

    ``view``, never ``reshape``: validation admitted only contiguous tensors, so this is always a
    view (no copy, gradients flow back to the caller's tensor in its own shape); a tensor that
    did not pass validation raises here rather than being copied silently. Metadata only, so it is
    also safe while a CUDA graph is being captured (where validation is skipped: the captured
    call's tensors are the warm call's, which were validated)."""
    return (None if A_log is None else A_log.view(-1), None if dt_bias is None else dt_bias.view(-1))


def validate_kda_inputs(
    q, k, v, g, beta, *,
    scale,
    initial_state,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    safe_gate: bool,
    lower_bound,
    A_log,
    dt_bias,
    state_v_first: bool,
    cu_seqlens,
    cu_seqlens_cpu=None,
    engine_gate_shapes: bool = False,
) -> KDAShape:
    """Check the full ``chunk_kda`` / ``fused_recurrent_kda`` contract (docs/spec.md §2).

    ``chunk_kda``, ``fused_recurrent_kda`` and ``recurrent_kda_backward`` call it through
    ``options.kda_options``, which adds the call's options and their kernel encodings to the returned
    shape (one frozen ``KDAOptions``); ``kda_decode`` and the serving path still call it directly.

    ``cu_seqlens_cpu`` (FLA 0.6.0's argument): a CPU int32/int64 tensor holding the same offsets
    as ``cu_seqlens``. When given, its values are checked (start 0, non-decreasing, end at T) and
    the sequence lengths come from it; ``cu_seqlens`` gets only its metadata checked (dtype,
    shape, length equal to ``cu_seqlens_cpu``'s, device) and its values are not read, so the
    call does no device->host synchronization. Comparing the two would need that read: the
    caller promises they are equal, as in FLA.

    ``engine_gate_shapes``: also accept ``A_log`` as ``[HV, 1]`` or ``[1, 1, HV, 1]`` and
    ``dt_bias`` as ``[HV, K]`` (dense, like the flat ones). A caller that sets it must hand the
    kernels ``flat_gate_params(A_log, dt_bias)``, not the tensors as given: the launchers and the
    backward's gradient shapes assume ``[HV]`` / ``[HV * K]`` (the chunk kernels' stride_alog is
    ``A_log.stride(0)``, which for a ``[1, 1, HV, 1]`` tensor is not the element stride). An op
    that passes them on as they are leaves it False, so that it refuses those shapes instead.
    """
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    _check_tensor("g", g, 4)
    _check_tensor("beta", beta, 3)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {_shape(q)} [B, T, H, K], got {_shape(k)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T} (from q), got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v's head count HV must be a multiple of q's head count H={H}, got HV={HV}")
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"head count and head dims must be positive, got H={H}, K={K}, V={V}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must have shape [B, T, HV, K] = [{B}, {T}, {HV}, {K}], got {_shape(g)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must have shape [B, T, HV] = [{B}, {T}, {HV}], got {_shape(beta)}")

    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("A_log", A_log), ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens)):
        if t is not None and isinstance(t, torch.Tensor) and t.device != dev:
            raise ValueError(f"{name} must be on q's device {dev}, got {t.device}")

    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    # Both backends would otherwise return NaN (inf, nan) or a meaningless output (<= 0) without a word.
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float or None (K ** -0.5), got {scale}")

    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True, got False")

    if lower_bound is not None:
        if not isinstance(lower_bound, (int, float)):
            raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if safe_gate and not (-5.0 <= lower_bound < 0.0):
            raise ValueError(f"lower_bound must be in the safe range [-5, 0) with safe_gate=True, got {lower_bound}")
        # The gate is lower_bound * sigmoid(.), a log-decay, so <= 0. With lower_bound >= 0 the state grows
        # without bound and the two backends' round-off diverges (1x20 tokens at lower_bound = 1: outputs
        # 54 apart), so it is refused rather than computed.
        if not (math.isfinite(lower_bound) and lower_bound < 0.0):
            raise ValueError(f"lower_bound must be a negative finite float or None, got {lower_bound}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (or lower_bound), got A_log=None and lower_bound=None")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), got None")
    # Gate parameters are fp32 (float64 only alongside float64 tokens, for reference checks).
    param_dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if A_log is not None:
        _check_gate_param("A_log", A_log, HV, K, param_dtypes, engine_gate_shapes)
    if dt_bias is not None:
        _check_gate_param("dt_bias", dt_bias, HV, K, param_dtypes, engine_gate_shapes)

    N, seqlens = B, None
    if cu_seqlens_cpu is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens and needs cu_seqlens, got cu_seqlens=None")
    if cu_seqlens is not None:
        _check_offsets_meta("cu_seqlens", cu_seqlens)
        if B != 1:
            raise ValueError(f"the batch size B must be 1 with cu_seqlens (packed sequences), got B={B}")
        if cu_seqlens_cpu is None:
            cu = cu_seqlens.tolist()  # the one device read of a call without cu_seqlens_cpu
            name = "cu_seqlens"
        else:
            _check_offsets_meta("cu_seqlens_cpu", cu_seqlens_cpu)
            if cu_seqlens_cpu.device.type != "cpu":
                raise ValueError(f"cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens), "
                                 f"got device {cu_seqlens_cpu.device}")
            if cu_seqlens_cpu.numel() != cu_seqlens.numel():
                raise ValueError(f"cu_seqlens_cpu must have cu_seqlens's length {cu_seqlens.numel()}, "
                                 f"got {cu_seqlens_cpu.numel()}")
            cu = cu_seqlens_cpu.tolist()  # host memory: no synchronization
            name = "cu_seqlens_cpu"
        _check_offset_values(name, cu, T)
        N = len(cu) - 1
        seqlens = tuple(b - a for a, b in zip(cu, cu[1:]))

    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, STATE_DTYPES)
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
        if tuple(initial_state.shape) != want:
            raise ValueError(
                f"initial_state must have shape {layout} = {list(want)} for {N} sequence(s), got {_shape(initial_state)}"
            )
    return KDAShape(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, seqlens=seqlens)


INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(name: str, t, device, where: str = "q's device") -> None:
    """An index tensor's type, dtype and device (``state_indices``, ``ssm_state_indices``,
    ``num_accepted_tokens``); its shape is the caller's to check."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor (or int64), got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 tensor (or int64), got {str(t.dtype).replace('torch.', '')}")
    if t.device != device:
        raise ValueError(f"{name} must be on {where} {device}, got {t.device}")


def check_state_pool(pool, state_indices, shape: KDAShape, *, state_v_first: bool, device,
                     check_values: bool = True) -> list[int] | None:
    """``chunk_kda``'s state-pool arguments, after ``validate_kda_inputs`` gave ``shape``.

    ``pool`` is ``initial_state`` read as a pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with
    ``state_v_first``); ``state_indices`` is int ``[N]``, row ``state_indices[n]`` holding
    sequence n's initial state and receiving its final state, ``-1`` a padded sequence.

    Metadata is checked first, then the indices are read to the host once (a device->host copy
    for CUDA indices: the one read of this path), then their values: each in ``[-1, P)`` (a row
    outside the pool would be gathered from and scattered to memory that is not the pool), and
    the rows of different sequences distinct (two sequences writing one row would leave
    whichever final state the scatter happened to write last; ``kda_decode`` refuses the same).
    Returns the host values, so that the caller needs no second read (padded positions).
    ``check_values=False`` (the caller's ``check_indices=False``, or a CUDA-graph capture, where a
    device read is illegal) checks the metadata only, reads nothing and returns None.
    """
    if pool is None:
        raise ValueError("state_indices needs initial_state to be the state pool [P, HV, ...], got None")
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"initial_state (the state pool) must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype not in STATE_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in STATE_DTYPES)
        raise TypeError(f"initial_state (the state pool) must have dtype in ({names}), "
                        f"got {str(pool.dtype).replace('torch.', '')}")
    if pool.device != device:
        raise ValueError(f"initial_state (the state pool) must be on q's device {device}, got {pool.device}")
    inner = (shape.HV, shape.V, shape.K) if state_v_first else (shape.HV, shape.K, shape.V)
    layout = "[P, HV, V, K] (state_v_first=True)" if state_v_first else "[P, HV, K, V]"
    if pool.dim() != 4 or tuple(pool.shape[1:]) != inner:
        raise ValueError(f"initial_state (the state pool) must have shape {layout} = "
                         f"[P, {', '.join(map(str, inner))}], got {_shape(pool)}")
    check_index_tensor("state_indices", state_indices, pool.device, "the pool's device")
    if tuple(state_indices.shape) != (shape.N,):
        raise ValueError(f"state_indices must have shape [N] = [{shape.N}] (one pool row per sequence), "
                         f"got {_shape(state_indices)}")
    if not check_values:
        return None
    return check_pool_rows("state_indices", state_indices, pool.shape[0])  # the one host read of the pool path


POOL_ROWS_RANGE_MESSAGE = "{name} must lie in [-1, {last}] for a pool of {P} rows, got {host}"


def check_pool_rows(name: str, state_indices: torch.Tensor, P: int, *,
                    range_message: str = POOL_ROWS_RANGE_MESSAGE) -> list[int]:
    """The values of pool rows ``state_indices`` for a pool of ``P`` rows, read to the host once:
    ``[N]`` (one row per sequence) or ``[N, S]`` (``kda_decode``'s per-token rows of sequence n).

    Each must lie in ``[-1, P)`` (``-1`` a padded entry), and the rows of different sequences
    must be distinct (a sequence may name its own row more than once). ``state_indices.tolist()``
    is the one read: a device->host copy for CUDA indices, so a caller skips this during a
    CUDA-graph capture (or with ``check_indices=False``) and makes it before any pool row is read
    or written. Returns the host values (nested lists for ``[N, S]``).

    ``range_message`` is the out-of-range error, a ``str.format`` template over ``name``, ``P``,
    ``last`` (``P - 1``), ``host`` (all the values) and ``bad`` (the sorted distinct values out of
    range): ``chunk_kda``'s by default; ``KimiDeltaAttention`` names its own.
    """
    host = state_indices.tolist()
    rows = host if state_indices.dim() == 2 else [[r] for r in host]  # sequence n's rows
    bad = sorted({r for row in rows for r in row if not -1 <= r < P})
    if bad:
        raise ValueError(range_message.format(name=name, P=P, last=P - 1, host=host, bad=bad))
    owner = {}
    for n, row in enumerate(rows):
        for r in row:
            if r >= 0 and owner.setdefault(r, n) != n:
                raise ValueError(f"{name} rows must be distinct across sequences: row {r} is used by "
                                 f"sequences {owner[r]} and {n}")
    return host
