"""Autograd Function joining the Triton chunk kernels: the 16-token forward (chunk_fwd) and the windowed
backward (chunk_bwd).

Saved for backward: the inputs autograd already holds plus the fp32 state checkpoints at the plan's cadence
(``plan.checkpoint_every_n_tokens``) — nothing that grows with T·H beyond those. The plan
(``kdakit.ops.kda.plan.plan_kda``) is made once per call from the shapes and is the object the memory model
prices. The call's options travel as its one ``KDAOptions`` (``options.py``), which every launcher below takes
whole.
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.chunk_bwd import chunk_kda_bwd
from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd
from kdakit.ops.kda.reference.chunk import INTERMEDIATE_STATE_TOKENS
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan import plan_kda, sequence_lengths
from kdakit.ops.kda.validate import check_triton_dtypes


class ChunkKDATritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, seqlens, checkpoint_every_n_tokens,
                opts: KDAOptions):
        # seqlens: cu_seqlens's lengths as validation read them (no second device read here).
        plan = _plan(q, v, A_log, initial_state, seqlens, opts.output_final_state, checkpoint_every_n_tokens, None)
        # One offsets tensor, from the planned lengths (no device read), serves forward and backward.
        offsets = plan.checkpoint_offsets(q.device)
        o, final, ckpts = chunk_kda_fwd(
            q, k, v, g, beta, opts=opts, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
            cu_seqlens=cu_seqlens, plan=plan, ckpt_offsets=offsets)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ckpts, offsets)
        ctx.plan, ctx.opts = plan, opts
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ckpts, offsets = ctx.saved_tensors
        # Autograd hands expanded (stride-0) cotangents for reductions like o.sum(); the kernels
        # read dense rows, so only such a cotangent is materialized.
        if not do.is_contiguous():
            do = do.contiguous()
        dq, dk, dv, dg, dbeta, dA, dbias, dh0 = chunk_kda_bwd(
            q, k, v, g, beta, do, dht, checkpoints=ckpts, A_log=A_log, dt_bias=dt_bias,
            initial_state=initial_state, cu_seqlens=cu_seqlens, plan=ctx.plan, opts=ctx.opts,
            ckpt_offsets=offsets)
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg, dbeta, dA, dbias, dh0, None, None, None, None


def chunk_kda_triton(q, k, v, g, beta, *, A_log, dt_bias, initial_state, cu_seqlens, checkpoint_every_n_tokens,
                     opts: KDAOptions):
    """Validated inputs (see ``kdakit.chunk_kda``) and their ``KDAOptions`` -> ``(o, final_state or None)``
    via the Triton kernels (final state when ``opts.output_final_state``).

    The lengths of packed sequences come from ``opts.shape.seqlens`` (validation read them); an object built
    without validation has none, and they are then read from ``cu_seqlens``.
    """
    seqlens = _checked(q, k, v, g, beta, cu_seqlens, opts.shape.seqlens, initial_state)
    return ChunkKDATritonFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, seqlens,
                                        checkpoint_every_n_tokens, opts)


def _plan(q, v, A_log, initial_state, seqlens, output_final_state, checkpoint_every_n_tokens, checkpoint_dtype):
    """plan_kda of one call (memoized there), from the lengths validation read (no device read here)."""
    return plan_kda(q, v, seqlens=seqlens, checkpoint_every_n_tokens=checkpoint_every_n_tokens,
                    initial_state=initial_state is not None,
                    initial_state_dtype=initial_state.dtype if initial_state is not None else torch.float32,
                    output_final_state=output_final_state, gate_params=A_log is not None,
                    checkpoint_dtype=checkpoint_dtype)


def _checked(q, k, v, g, beta, cu_seqlens, seqlens, initial_state) -> tuple | None:
    """What the Triton kernels need beyond validation; returns the host lengths of packed sequences."""
    check_triton_dtypes({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state})
    if cu_seqlens is None:
        seqlens = None
    elif seqlens is None:
        seqlens = tuple(sequence_lengths(1, 0, cu_seqlens))
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernels, got strides {tuple(t.stride())}")
    return seqlens


def chunk_kda_triton_states(q, k, v, g, beta, *, A_log, dt_bias, initial_state, cu_seqlens, opts: KDAOptions):
    """``chunk_kda(..., return_intermediate_states=True)`` on the Triton kernels (inference, no autograd):
    ``(o, final_state or None, h)``. h is the forward's own checkpoint store at a 64-token cadence, written
    in k's dtype and the requested state layout straight from the state kernel: ``[B, NT, HV, K, V]``
    (``[.., V, K]`` with state_v_first), B = 1 and NT over all sequences when packed (FLA's h)."""
    seqlens = _checked(q, k, v, g, beta, cu_seqlens, opts.shape.seqlens, initial_state)
    plan = _plan(q, v, A_log, initial_state, seqlens, opts.output_final_state, INTERMEDIATE_STATE_TOKENS, k.dtype)
    o, final, h = chunk_kda_fwd(q, k, v, g, beta, opts=opts, A_log=A_log, dt_bias=dt_bias,
                                initial_state=initial_state, cu_seqlens=cu_seqlens, plan=plan, checkpoint_dtype=k.dtype,
                                checkpoint_v_first=opts.state_v_first)
    return o, final, h.view(1 if cu_seqlens is not None else q.shape[0], -1, *h.shape[1:])
