"""The 64-token pipeline's autograd Function and its entry point (``chunk64_kda``): validated inputs and their
``KDAOptions`` in, ``(o, final_state)`` out.

Saved for the backward: the inputs autograd already holds, the state entering every window and the intra
stage's pairwise matrices (``forward.chunk_fwd``; with the fast workspace every per-chunk intermediate instead). Token tensors may be strided views (the kernels read
their strides; only the last dimension must be unit-stride).
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.chunk.backward import chunk_bwd
from kdakit.ops.kda.chunk.forward import chunk_fwd
from kdakit.ops.kda.chunk.launch import launch_of
from kdakit.ops.kda.chunk.plan import ChunkPlan, make_chunk_plan
from kdakit.ops.kda.chunk.tiles import check_token_strides
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan import sequence_lengths

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Chunk64Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, plan: ChunkPlan, opts: KDAOptions,
                keep: bool, save: bool):
        o, final, checkpoints, saved = chunk_fwd(q, k, v, g, beta, opts=opts, plan=plan, A_log=A_log,
                                                 dt_bias=dt_bias, initial_state=initial_state, keep=keep and save,
                                                 save=save)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, checkpoints)
        ctx.plan, ctx.opts, ctx.keep, ctx.kept = plan, opts, keep and save, saved
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, checkpoints = ctx.saved_tensors
        if do.stride(-1) != 1:
            # autograd's expanded cotangent of a reduction (o.sum()) has stride 0 everywhere
            do = do.contiguous()
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = chunk_bwd(
            q, k, v, g, beta, do, dht, opts=ctx.opts, plan=ctx.plan, checkpoints=checkpoints, A_log=A_log,
            dt_bias=dt_bias, initial_state=initial_state, saved=ctx.kept, keep=ctx.keep)
        ctx.kept = None
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None, None, None, None


def chunk64_kda(q, k, v, g, beta, *, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions,
                window_tokens: int | None = None, keep_intermediates: bool = False, launch=None):
    """Validated inputs (see ``kdakit.chunk_kda``; gate parameters as ``opts.kernel_gate_params`` gives them)
    -> ``(o, final_state or None)`` on the 64-token pipeline. ``window_tokens``: the plan's window (None: one
    window over the whole call). ``keep_intermediates``: the forward keeps its per-chunk intermediates for the
    backward (whole-call scratch, no recomputation; the fast workspace). ``launch``: overrides of the kernels'
    launch constants by name (``chunk.launch.launch_of``; a tuning run's variant), None: the shipped configs."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in TRITON_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32 for the Triton kernels, got {t.dtype}")
        check_token_strides(name, t)
    if q.shape[-1] > CHUNK_MAX_HEAD_DIM or v.shape[-1] > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"K and V must be <= {CHUNK_MAX_HEAD_DIM} for the Triton kernels, got K={q.shape[-1]}, "
                         f"V={v.shape[-1]}")
    seqlens = None
    if cu_seqlens is not None:
        seqlens = list(opts.shape.seqlens) if opts.shape.seqlens is not None else sequence_lengths(1, 0, cu_seqlens)
    plan = make_chunk_plan(q.shape[0], q.shape[1], seqlens, q.device, window_tokens,
                           slot_geometry=(q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype, g.dtype),
                           launch=launch_of(launch))
    # without a backward to come (inference, torch.no_grad, no input needing a gradient) nothing is kept
    # beyond the checkpoints: the forward's slots are group-sized
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    o, final = Chunk64Function.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, plan, opts,
                                     bool(keep_intermediates), needs_grad)
    return o, (final if opts.output_final_state else None)
