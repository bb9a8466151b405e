"""Segmented driver of the recurrent KDA backward: bounded scratch for long sequences.

When a sequence is longer than ``segment_tokens`` (L), ``recurrent_backward.run_recurrent_backward``
hands the call here. Segment s of every sequence is gathered into a packed buffer; the forward
launcher, run segment by segment, writes the S - 1 boundary states as fp32 checkpoints; then the
segments are walked last to first, each through the one-pass backward
(``recurrent_backward_kernels.launch_recurrent_backward``) from its checkpoint with the carried state
gradient as ``dht``; gradients are copied back and the gate-parameter gradients summed in fp32.
No Triton kernel of its own. Memory (the formula is in ``recurrent_backward``'s docstring) grows
with T only through the checkpoints. All buffers come from the ``Workspace``, so the path can be
captured in a CUDA graph after an eager warm call with the same ``cu_seqlens`` values.

Imports ``recurrent_forward`` and ``recurrent_backward_kernels``; imported by ``recurrent_backward``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.recurrent.backward_kernels import (
    BWD_BLOCK_V,
    KDAGrads,
    grad_outputs,
    launch_recurrent_backward,
    scratch_shapes,
)
from kdakit.ops.kda.recurrent.kernels import DEFAULT_SEGMENT_TOKENS, launch_recurrent_forward
from kdakit.ops.kda.recurrent.workspace import Workspace, is_capturing


SEG = "recurrent_bwd.seg."


class Segment(NamedTuple):
    """Segment s of every sequence, gathered into one packed launch.

    Fixed length: tokens ``[start, stop)`` of each of the B sequences (``cu`` None). Varlen:
    ``runs`` of ``(source token, packed row, count)`` and the segment's own ``cu`` ``[N + 1]``.
    """

    start: int
    stop: int
    rows: int
    runs: tuple
    cu: torch.Tensor | None


class SegmentPlan(NamedTuple):
    segments: tuple           # Segment per segment index, first to last
    max_rows: int             # the largest gathered segment (tokens)


def segment_lengths(seqlens, segment_tokens: int) -> list[list[int]]:
    """Tokens of each sequence in each segment: ``[segment][sequence]``."""
    L = segment_tokens
    S = triton.cdiv(max(seqlens, default=0), L)
    return [[min(max(n - s * L, 0), L) for n in seqlens] for s in range(S)]


def _fixed_plan(B: int, T: int, L: int) -> SegmentPlan:
    segs = tuple(Segment(a, min(T, a + L), B * (min(T, a + L) - a), (), None) for a in range(0, T, L))
    return SegmentPlan(segs, segs[0].rows)


def _varlen_plan(cu_host, L: int, cu_dtype, device) -> SegmentPlan | None:
    seqlens = [b - a for a, b in zip(cu_host[:-1], cu_host[1:])]
    lengths = segment_lengths(seqlens, L)
    if len(lengths) <= 1:
        return None
    cus, runs_all = [], []
    for s, lens in enumerate(lengths):
        cu_s, runs = [0], []
        for bos, m in zip(cu_host[:-1], lens):
            src, dst = bos + s * L, cu_s[-1]
            if m and runs and runs[-1][0] + runs[-1][2] == src:   # adjacent in source and packed rows
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + m)
            elif m:
                runs.append((src, dst, m))
            cu_s.append(dst + m)
        cus.append(cu_s)
        runs_all.append(tuple(runs))
    cu_dev = torch.tensor(cus, dtype=cu_dtype, device=device)                      # [S, N + 1]
    segs = tuple(Segment(0, 0, c[-1], r, cu_dev[s]) for s, (c, r) in enumerate(zip(cus, runs_all)))
    return SegmentPlan(segs, max(seg.rows for seg in segs))


class _PlanEntry(NamedTuple):
    cu_host: tuple
    plan: SegmentPlan | None


def segment_plan(B: int, T: int, cu_seqlens, segment_tokens: int, workspace: Workspace) -> SegmentPlan | None:
    """The segments of a call, or None when no sequence is longer than ``segment_tokens``.

    Varlen plans read ``cu_seqlens`` on the host and are remembered in the workspace
    (keyed by the tensor's address), so that a CUDA-graph capture reuses the warm call's
    plan without reading the device, and repeated eager calls allocate nothing.
    """
    L = segment_tokens
    if cu_seqlens is None:
        return None if T <= L else _fixed_plan(B, T, L)
    if B * T <= L:
        return None
    key = ("recurrent_bwd.segments", L, B * T, cu_seqlens.data_ptr(), cu_seqlens.numel(), cu_seqlens.dtype)
    known = workspace.recall_plan(key)
    if is_capturing(workspace.device):
        if known is None:
            raise RuntimeError("capturing the recurrent backward of packed sequences longer than segment_tokens "
                               "needs the segment plan of an eager warm call with the same cu_seqlens tensor")
        return known.plan
    cu_host = tuple(cu_seqlens.tolist())
    if known is not None and known.cu_host == cu_host:
        return known.plan
    plan = _varlen_plan(cu_host, L, cu_seqlens.dtype, cu_seqlens.device)
    workspace.remember_plan(key, _PlanEntry(cu_host, plan))
    return plan


def segmented_scratch_shapes(rows: int, num_segments: int, N: int, H: int, HV: int, K: int, V: int,
                             dtypes: dict) -> dict:
    """Name -> (shape, dtype) of every buffer the segmented backward takes from the workspace.

    ``rows``: tokens of the largest segment (at most N * segment_tokens); ``dtypes``: the
    dtypes of q, k, v, g, beta, do, and of A_log / dt_bias when the gate is in the kernel.
    Only the checkpoints grow with T (through ``num_segments``).
    """
    f = torch.float32
    token = {"q": (H, K), "k": (H, K), "v": (HV, V), "g": (HV, K), "beta": (HV,)}
    shapes = {"recurrent_bwd." + n: s for n, s in scratch_shapes(1, rows, HV, K, V, N).items()}
    for n, tail in (*token.items(), ("do", (HV, V))):
        shapes[SEG + n] = ((rows, *tail), dtypes[n])                # gathered inputs
    for n, tail in token.items():
        shapes[SEG + "d" + n] = ((rows, *tail), dtypes[n])          # gathered gradients
    for n, size in (("A_log", HV), ("dt_bias", HV * K)):
        if dtypes.get(n) is not None:
            shapes[SEG + "d" + n] = ((size,), dtypes[n])            # this segment's share
            shapes[SEG + "d" + n + "_acc"] = ((size,), f)           # the sum over segments
    shapes[SEG + "checkpoints"] = ((num_segments - 1, N, HV, K, V), f)
    shapes[SEG + "carry"] = ((2, N, HV, K, V), f)
    return shapes


def backward_scratch_bytes(seqlens, H: int, HV: int, K: int, V: int, *,
                           segment_tokens: int = DEFAULT_SEGMENT_TOKENS, dtypes: dict | None = None) -> int:
    """Workspace bytes of one backward call over sequences of lengths ``seqlens``.

    ``dtypes`` as ``segmented_scratch_shapes`` (default bf16 token tensors, fp32 gate
    parameters). Fixed-length input: ``seqlens = [T] * B``.
    """
    dtypes = dtypes or dict(q=torch.bfloat16, k=torch.bfloat16, v=torch.bfloat16, g=torch.bfloat16,
                            beta=torch.bfloat16, do=torch.bfloat16, A_log=torch.float32, dt_bias=torch.float32)
    lengths = segment_lengths(seqlens, segment_tokens)
    N = len(seqlens)
    if len(lengths) <= 1:
        shapes = scratch_shapes(1, sum(seqlens), HV, K, V, N)
    else:
        shapes = segmented_scratch_shapes(max(sum(x) for x in lengths), len(lengths), N, H, HV, K, V, dtypes)
    return sum(math.prod(shp) * torch.empty((), dtype=dt).element_size() for shp, dt in shapes.values())


def _gather(x, seg: Segment, dst) -> torch.Tensor:
    if seg.cu is None:
        dst.copy_(x[:, seg.start:seg.stop])
    else:
        for src, row, n in seg.runs:
            dst[0, row:row + n].copy_(x[0, src:src + n])
    return dst


def _scatter(src, seg: Segment, x) -> None:
    if seg.cu is None:
        x[:, seg.start:seg.stop].copy_(src)
    else:
        for tok, row, n in seg.runs:
            x[0, tok:tok + n].copy_(src[0, row:row + n])


def launch_segmented_backward(
    q, k, v, g, beta, do, dht, *, plan: SegmentPlan, A_log, dt_bias, initial_state, cu_seqlens,
    opts: KDAOptions, workspace: Workspace, out=None,
) -> KDAGrads:
    """The backward segment by segment: checkpoints forward, then ``launch_recurrent_backward`` per
    gathered segment, last first, carrying the state gradient. Every buffer is a workspace view."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S = len(plan.segments)
    grads = grad_outputs(q, k, v, g, beta, A_log, dt_bias, initial_state, out)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, do=do)
    dtypes = {n: x.dtype for n, x in inputs.items()}
    dtypes.update(A_log=None if A_log is None else A_log.dtype, dt_bias=None if dt_bias is None else dt_bias.dtype)
    shapes = segmented_scratch_shapes(plan.max_rows, S, N, H, HV, K, V, dtypes)
    for name, (shp, dt) in shapes.items():  # size every buffer once; segments take views of them
        workspace.buffer(name, shp, dt)

    def view(name, seg):
        (_, *tail), dt = shapes[name]
        lead = (1, seg.rows) if seg.cu is not None else (B, seg.stop - seg.start)
        return workspace.buffer(name, (*lead, *tail), dt)

    def gathered(seg, names):
        return [_gather(inputs[n], seg, view(SEG + n, seg)) for n in names]

    state = (N, HV, V, K) if opts.state_v_first else (N, HV, K, V)
    ckpt = workspace.buffer(SEG + "checkpoints", (S - 1, *state), torch.float32)
    carry = workspace.buffer(SEG + "carry", (2, *state), torch.float32)
    BV = min(triton.next_power_of_2(V), BWD_BLOCK_V)

    # 1. the state at the start of every segment but the first (the sparse checkpoints)
    h = initial_state
    for s, seg in enumerate(plan.segments[:-1]):
        launch_recurrent_forward(*gathered(seg, ("q", "k", "v", "g", "beta")), A_log=A_log, dt_bias=dt_bias,
                                 initial_state=h, cu_seqlens=seg.cu, N=N, opts=opts, final_state=ckpt[s], block_v=BV)
        h = ckpt[s]

    # 2. segments last first: each starts from its checkpoint and ends on the carried dS
    params = [(i, SEG + "d" + n) for i, n in ((5, "A_log"), (6, "dt_bias")) if grads[i] is not None]
    dh = dht
    for s in reversed(range(S)):
        seg = plan.segments[s]
        seg_out = [view(SEG + "d" + n, seg) for n in ("q", "k", "v", "g", "beta")]
        seg_out += [workspace.buffer(name, shapes[name][0], shapes[name][1]) if grads[i] is not None else None
                    for i, name in ((5, SEG + "dA_log"), (6, SEG + "ddt_bias"))]
        seg_out.append(grads.dh0 if s == 0 else carry[s % 2])
        part = launch_recurrent_backward(
            *gathered(seg, ("q", "k", "v", "g", "beta", "do")), dh, A_log=A_log, dt_bias=dt_bias,
            initial_state=initial_state if s == 0 else ckpt[s - 1], cu_seqlens=seg.cu, opts=opts,
            workspace=workspace, out=seg_out,
        )
        for i in range(5):
            _scatter(part[i], seg, grads[i])
        for i, name in params:
            acc = workspace.buffer(name + "_acc", shapes[name + "_acc"][0], torch.float32)
            if s == S - 1:
                acc.copy_(part[i])
            else:
                acc.add_(part[i])
        dh = part.dh0
    for i, name in params:
        grads[i].copy_(workspace.buffer(name + "_acc", shapes[name + "_acc"][0], torch.float32))
    return grads


