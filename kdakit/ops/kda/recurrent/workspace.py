"""Scratch memory for the recurrent KDA kernels, and the CUDA-graph contract.

``Workspace(device)`` is caller-owned scratch: named flat buffers that grow to the
largest request seen and are then reused, so a second call at a shape allocates
nothing. Calls that pass no workspace use a stream-local one (one per device and
stream, kept for the life of the process), so the same holds for them.

CUDA graphs (``torch.cuda.CUDAGraph``):

Forward-only calls (``kda_decode``, ``fused_recurrent_kda`` without gradients, ``chunk_kda``)
need no scratch and capture like any PyTorch op: inside a plain ``torch.cuda.graph(g)`` after
warm-up iterations on any stream, with outputs allocated from the graph's pool, provided no
validation step needs a device value: fixed-length inputs, or ``cu_seqlens`` with its host copy
``cu_seqlens_cpu``; index checks (``check_indices``) are skipped while capturing. Replays assume
the capture's ``cu_seqlens_cpu`` values. The steps below are the zero-allocation contract, and
what the recurrent backward (which needs scratch) requires:

1. Allocate the inputs and, through ``out=``, every output the call returns.
2. Make one eager call on the capture stream with exactly those tensors and options,
   then synchronize that stream. This validates the arguments (which may read
   ``cu_seqlens`` or ``state_indices`` on the host), sizes every scratch buffer and
   records the call's signature (pointers, shapes, strides, dtypes, options) in the
   workspace.
3. Capture the same call. While a capture is running, a call whose signature was not
   recorded raises ``RuntimeError``, and a scratch request that does not fit the
   existing buffers raises instead of allocating. Validation is skipped for a recorded
   signature (it would need a host sync), so the capture performs no allocation and no
   synchronization.
4. Replays run the same kernels on the same buffers, so they give the eager call's bits.

Some calls derive a launch plan from host data (the segmented recurrent backward reads
``cu_seqlens`` on the host). The eager warm call stores that plan in the workspace
(``remember_plan``) and the capture reuses it (``recall_plan``), so the capture does not
read the device; replays therefore assume the values of ``cu_seqlens`` are those of the
warm call. A plan used by a capture is kept for the workspace's life (its device tensors
are read by every replay).

A workspace used by a graph must outlive the graph, and must not be shared by work
that runs concurrently on two streams (its buffers would race).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from kdakit.ops.kda.validate import check_token_strides

# How many call signatures a workspace remembers for graph capture (least recently used go first).
MAX_PREPARED_SIGNATURES = 256
# How many host-derived launch plans a workspace keeps for eager reuse (plans a capture used are kept apart).
MAX_PLANS = 64


def is_capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream of ``device``."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Workspace:
    """Caller-owned scratch for ``fused_recurrent_kda``'s backward, ``recurrent_kda_backward`` and ``kda_decode``.

    Args:
        device: where the buffers live (``"cuda"``, ``torch.device("cuda", 1)``, ``"cpu"``).

    Buffers are named; ``buffer(name, shape, dtype)`` returns a view of the named buffer,
    reallocating only when the request is larger than what it holds (or of another dtype).
    ``nbytes`` reports what the workspace holds.
    """

    def __init__(self, device) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._prepared: OrderedDict[tuple, None] = OrderedDict()
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self._graph_plans: list = []

    def __repr__(self) -> str:
        return f"Workspace(device={self.device}, buffers={len(self._buffers)}, nbytes={self.nbytes})"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` backed by the named buffer (contents undefined)."""
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            if is_capturing(self.device):
                raise RuntimeError(
                    f"workspace buffer {name!r} needs {numel} elements of {dtype} during CUDA-graph capture, "
                    f"but holds {0 if buf is None else buf.numel()} of {None if buf is None else buf.dtype}: "
                    "make one eager call with the exact tensors on the capture stream before capturing"
                )
            # Drop the old buffer first so its memory can be reused by the new one.
            self._buffers.pop(name, None)
            del buf
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def mark_prepared(self, signature: tuple) -> None:
        """Record a validated call so that it may later be captured without re-validation."""
        self._prepared[signature] = None
        self._prepared.move_to_end(signature)
        while len(self._prepared) > MAX_PREPARED_SIGNATURES:
            self._prepared.popitem(last=False)

    def is_prepared(self, signature: tuple) -> bool:
        return signature in self._prepared

    def remember_plan(self, key: tuple, plan) -> None:
        """Keep a launch plan derived from host data under ``key`` (eager calls only)."""
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)

    def recall_plan(self, key: tuple):
        """The plan remembered under ``key``, or None. During capture the plan is kept for good."""
        plan = self._plans.get(key)
        if plan is not None and is_capturing(self.device) and not any(p is plan for p in self._graph_plans):
            self._graph_plans.append(plan)
        return plan


_STREAM_LOCAL: dict[tuple, Workspace] = {}
_STREAM_LOCAL_LOCK = threading.Lock()


def stream_local_workspace(device: torch.device) -> Workspace:
    """The reusable workspace of ``device``'s current stream (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = ("cuda", index, torch.cuda.current_stream(index).cuda_stream)
        device = torch.device("cuda", index)
    else:
        key = (device.type, device.index, 0)
    with _STREAM_LOCAL_LOCK:
        ws = _STREAM_LOCAL.get(key)
        if ws is None:
            if is_capturing(device):
                raise RuntimeError(
                    "no stream-local workspace exists for the capture stream: make one eager call with the exact "
                    "tensors on the capture stream before capturing (or pass workspace=Workspace(device))"
                )
            ws = Workspace(device)
            _STREAM_LOCAL[key] = ws
    return ws


def resolve_workspace(workspace: Workspace | None, device: torch.device) -> Workspace:
    """The caller's workspace (checked to be on ``device``) or the stream-local one."""
    if workspace is None:
        return stream_local_workspace(device)
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a kdakit Workspace or None, got {type(workspace).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if workspace.device != dev:
        raise ValueError(f"workspace must be on the inputs' device {dev}, got a workspace on {workspace.device}")
    return workspace


def forward_workspace(workspace: Workspace | None, device: torch.device) -> Workspace | None:
    """The workspace a forward-only call records its signature in: the caller's, else the stream-local one.

    Forward kernels need no scratch, so a capture on a stream that never ran an eager call (the
    side stream ``torch.cuda.graph`` opens) is legal: there this returns None instead of raising,
    and the call captures like any PyTorch op (outputs from the graph's pool)."""
    if workspace is not None or not is_capturing(device):
        return resolve_workspace(workspace, device)
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAM_LOCAL_LOCK:
        return _STREAM_LOCAL.get(("cuda", index, torch.cuda.current_stream(index).cuda_stream))


def check_capturable_offsets(what: str, cu_seqlens, cu_seqlens_cpu) -> None:
    """During capture the offsets' values cannot be read from the device (a synchronization is illegal
    there): a packed call must bring them in ``cu_seqlens_cpu``, or be one an eager call prepared."""
    if cu_seqlens is not None and cu_seqlens_cpu is None:
        raise RuntimeError(f"capturing {what} in a CUDA graph with cu_seqlens needs cu_seqlens_cpu= (its host copy), "
                           "since the capture cannot read cu_seqlens from the device; got cu_seqlens_cpu=None (or make "
                           "one eager call with the exact tensors on the capture stream first)")


def call_signature(*items) -> tuple:
    """A hashable key of a call: pointer, shape, stride and dtype of each tensor, other values as they are."""
    key = []
    for x in items:
        if isinstance(x, torch.Tensor):
            key.append(("T", x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device))
        elif isinstance(x, (list, tuple)):
            key.append(call_signature(*x))
        else:
            key.append(x)
    return tuple(key)


def check_prepared_for_capture(ws: Workspace, signature: tuple, what: str) -> bool:
    """During capture: True if this exact call was prepared by an eager warm call, else raise.

    Outside capture: False (the caller validates and then calls ``ws.mark_prepared``).
    """
    if not is_capturing(ws.device):
        return False
    if not ws.is_prepared(signature):
        raise RuntimeError(
            f"{what} is being captured in a CUDA graph with arguments no eager call prepared: make one eager call "
            "with the exact tensors and options on the capture stream (with the same workspace) before capturing"
        )
    return True


def check_out(name: str, out, shape, dtype: torch.dtype, device: torch.device, *,
              token_view: bool = False) -> torch.Tensor:
    """Check a preallocated output: a contiguous tensor of the expected shape, dtype and device. ``token_view``:
    a per-token output the kernels write through its (batch, token, head) strides (``o``), so a view of a wider
    tensor is taken as it is: it needs a unit stride in its last dimension and no two elements in one place."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {out.device}")
    if token_view:
        check_token_strides(name, out)
        if not _non_overlapping(out):
            raise ValueError(f"{name} must not overlap itself (every element its own memory, as a view of a wider "
                             f"tensor), got shape {list(out.shape)} with strides {tuple(out.stride())}")
    elif not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(out.stride())}")
    return out


def _non_overlapping(x: torch.Tensor) -> bool:
    """Whether no two elements of x share memory, by a sufficient rule: each dimension's stride, in increasing
    order, at least the extent the smaller ones span (what a view of a dense tensor keeps)."""
    if x.numel() == 0:
        return True
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True
