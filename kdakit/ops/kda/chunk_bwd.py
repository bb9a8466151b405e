"""Triton backward of chunked KDA from the forward's sparse checkpoints: the entry point.

``chunk_kda_bwd`` validates, runs the windowed pipeline of ``chunk_bwd_windowed.py`` (window-start
states per checkpoint segment, then per window of ``plan.recompute_every_n_tokens`` tokens, last
first: per-chunk states and state gradients, then every gradient of every chunk in parallel) and
sums the parameter partials. The per-chunk math is in ``chunk_bwd_common.py`` and
``chunk_bwd_windowed.py``; its float64 twin, checked against autograd, is ``reference/chunk_bwd.py``.

Layouts and limits: token-major contiguous inputs, checkpoints ``[rows, HV, K, V]`` in
``plan.checkpoint_dtype`` (bf16 for bf16 inputs),
K, V <= 128, int64 offsets.
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.chunk_bwd_common import CHUNK
from kdakit.ops.kda.chunk_bwd_windowed import run_windowed
from kdakit.ops.kda.chunk_common import GATE_SOFTPLUS
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan import checkpoint_offsets, default_stage_dtype


def chunk_kda_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    do: torch.Tensor, dht: torch.Tensor | None, *,
    checkpoints: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    plan,
    opts: KDAOptions,
    ckpt_offsets: torch.Tensor | None = None,
    stage_dtype: torch.dtype | None = None,
):
    """Gradients of chunked KDA from the inputs, dO, dht and the forward's sparse state checkpoints.

    Shapes: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``
    (all contiguous, same dtype); dht ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``opts.state_v_first``)
    or None; checkpoints ``[plan.num_checkpoints, HV, K, V]`` in ``plan.checkpoint_dtype`` (layout of
    ``plan.py``); ``opts`` the call's ``KDAOptions`` (the forward's: scale, options, their kernel encodings).
    ``plan`` supplies ``checkpoint_every_n_tokens`` (L), ``recompute_every_n_tokens`` (L2: the
    window) and ``seqlens``; ``ckpt_offsets`` (int64 ``[N + 1]``, on the device) is computed when
    not given. ``stage_dtype`` stores the per-chunk state and state-gradient slots; None picks
    ``default_stage_dtype`` (bf16 for 16-bit inputs).

    Returns ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)``: the first five in the token dtype;
    dA_log ``[HV]`` and ddt_bias ``[HV * K]`` fp32 (None when A_log / dt_bias is None); dh0 fp32 in
    initial_state's layout (None without an initial state).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("do", do)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton backward, got strides {tuple(t.stride())}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > CHUNK_MAX_HEAD_DIM or V > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"the Triton backward supports K, V <= {CHUNK_MAX_HEAD_DIM}, got K={K}, V={V}")
    if do.shape != v.shape or do.dtype != v.dtype:
        raise ValueError(f"do must match v ({list(v.shape)}, {v.dtype}), got {list(do.shape)}, {do.dtype}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    C = CHUNK
    L, L2 = int(plan.checkpoint_every_n_tokens), int(plan.recompute_every_n_tokens)
    if plan.chunk_size != C or L % L2 or L2 % C:
        raise ValueError(f"plan must have chunk_size {C} and L2 | L with C | L2, got chunk {plan.chunk_size}, "
                         f"L={L}, L2={L2}")
    if checkpoints.dtype != plan.checkpoint_dtype or tuple(checkpoints.shape[1:]) != (HV, K, V) \
            or not checkpoints.is_contiguous():
        raise ValueError(f"checkpoints must be contiguous {plan.checkpoint_dtype} [rows, {HV}, {K}, {V}] (the plan's "
                         f"checkpoint dtype), got {checkpoints.dtype} {list(checkpoints.shape)}")
    if checkpoints.shape[0] != plan.num_checkpoints:
        raise ValueError(f"checkpoints must have plan.num_checkpoints={plan.num_checkpoints} rows, "
                         f"got {checkpoints.shape[0]}")
    if opts.gate == GATE_SOFTPLUS and A_log is None:
        raise ValueError("use_gate_in_kernel without lower_bound needs A_log, got None")
    if dht is not None and dht.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"dht must be a floating tensor, got {dht.dtype}")
    if ckpt_offsets is None:
        ckpt_offsets = checkpoint_offsets(cu_seqlens, B=B, T=T, every_n_tokens=L, device=q.device)
    if stage_dtype is None:
        stage_dtype = default_stage_dtype(q.dtype)
    dq, dk, dv, dg, dbeta, dA_part, ddt_part, dh0 = run_windowed(
        q, k, v, g, beta, do, dht, checkpoints=checkpoints, ckpt_offsets=ckpt_offsets, cu_seqlens=cu_seqlens,
        A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, N=N, plan=plan, stage_dtype=stage_dtype,
        opts=opts)
    dev, f32 = q.device, torch.float32
    dA_log = ddt_bias = None
    if A_log is not None:
        dA_log = dA_part.view(N, HV, -1).sum((0, 2)) if opts.has_A_log else torch.zeros(HV, dtype=f32, device=dev)
    if dt_bias is not None:
        ddt_bias = ddt_part.view(N, HV, -1, K).sum((0, 2)).view(HV * K) if opts.has_dt_bias \
            else torch.zeros(HV * K, dtype=f32, device=dev)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
