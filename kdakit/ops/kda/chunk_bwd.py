"""Triton backward of chunked KDA from the forward's sparse checkpoints.

The per-chunk math (forward recompute and every gradient of one chunk) is in ``chunk_bwd_common.py``;
its float64 twin, checked against autograd, is ``chunk_bwd_reference.py``.

Two algorithms (``chunk_kda_bwd(..., algorithm=...)``):

* ``streaming`` (default; measured on the H200: ~68 ms of the 71.4 ms fwd+bwd at 1x8K H96,
  ``docs/perf_notes.md``): grid over the N * HV items, a program owns all of V; for each checkpoint
  segment, last first, recompute the states every L2 tokens into per-program slots, then per
  sub-segment the chunk start states, and walk the chunks in reverse carrying dS ``[BK, BV]`` in
  registers. Workspace ``programs * (L/L2 + L2/C) * K * V`` state slots; GVA needs fp32 dq/dk
  partials ``[B, T, HV, K]``.
* ``windowed`` (``chunk_bwd_windowed.py``): parallel stages over windows of the recompute cadence;
  predicted 4-13x faster, not yet run on a GPU.

Layouts and limits: as ``chunk_bwd_common.py`` states (token-major contiguous inputs, fp32
checkpoints ``[rows, HV, K, V]``, K, V <= 128, int64 offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_bwd_common import (
    CHUNK,
    LAST_LAUNCH,
    MAX_HEAD_DIM,
    USE_DOUBLING_INVERSE,
    chunk_grads,
    dot_precision,
    grad_precision,
    state_step,
    state_strides,
    streaming_num_warps,
)
from kdakit.ops.kda.chunk_bwd_windowed import default_stage_dtype, run_windowed
from kdakit.ops.kda.chunk_common import block_size, gate_mode, load_matrix, store_matrix
from kdakit.ops.kda.chunk_fwd import uses_safe_path
from kdakit.ops.kda.plan import checkpoint_offsets

# ---------------------------------------------------------------- the kernel --------------------

@triton.jit
def chunk_kda_bwd_kernel(
    q, k, v, g, beta, do, dht, ckpt, ckpt_off, cu_seqlens, A_log, dt_bias,
    dq, dk, dv, dg, dbeta, dh0, dA_part, ddt_part, ws_seg, ws_chunk,
    scale, lower_bound, T, H, HV, K, V, n_items, n_prog,
    s_dht_n, s_dht_h, s_dht_k, s_dht_v, s_dh0_n, s_dh0_h, s_dh0_k, s_dh0_v,
    GROUP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SEG_CHUNKS: tl.constexpr, SUB_CHUNKS: tl.constexpr, N_SUB: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, GVA_PARTIAL: tl.constexpr, DOT_PREC: tl.constexpr,
    GRAD_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BK)
    KV = K.to(tl.int64) * V
    seg_slots = ws_seg + pid.to(tl.int64) * N_SUB * KV  # this program's level-1 states
    chunk_slots = ws_chunk + pid.to(tl.int64) * SUB_CHUNKS * KV  # this program's level-2 states
    s_qk = H * K
    s_v = HV * V
    s_g = HV * K
    if GVA_PARTIAL:
        s_dqk = HV * K
    else:
        s_dqk = H * K
    # Items are (sequence, value head) pairs; a program takes pid, pid + n_prog, ... so the
    # workspace is bounded by the grid, not by the number of sequences. Loops are while loops
    # because the interpreter cannot take range() of a program-dependent bound.
    item = pid
    while item < n_items:
        n = item // HV
        hv = item % HV
        h = hv // GROUP
        if IS_VARLEN:
            bos = tl.load(cu_seqlens + n).to(tl.int64)
            eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        else:
            bos = n.to(tl.int64) * T
            eos = bos + T
        n_rows = (eos - bos).to(tl.int32)
        q_b = q + bos * s_qk + h * K
        k_b = k + bos * s_qk + h * K
        v_b = v + bos * s_v + hv * V
        do_b = do + bos * s_v + hv * V
        dv_b = dv + bos * s_v + hv * V
        g_b = g + bos * s_g + hv * K
        dg_b = dg + bos * s_g + hv * K
        b_b = beta + bos * HV + hv
        db_b = dbeta + bos * HV + hv
        if GVA_PARTIAL:
            dq_b = dq + bos * s_dqk + hv * K
            dk_b = dk + bos * s_dqk + hv * K
        else:
            dq_b = dq + bos * s_dqk + h * K
            dk_b = dk + bos * s_dqk + h * K
        bias_p = dt_bias + hv * K
        if HAS_A:
            expA = tl.exp(tl.load(A_log + hv).to(tl.float32))
        else:
            expA = 1.0

        if HAS_DHT:
            dS = load_matrix(dht + n.to(tl.int64) * s_dht_n + hv * s_dht_h, s_dht_k, s_dht_v, K, V, 0, BK, BV)
        else:
            dS = tl.zeros([BK, BV], dtype=tl.float32)
        dA_acc = tl.sum(tl.zeros([BK], dtype=tl.float32), axis=0)
        ddt_acc = tl.zeros([BK], dtype=tl.float32)

        n_chunks = (n_rows + C - 1) // C
        first_ckpt = tl.load(ckpt_off + n)
        s = (n_chunks + SEG_CHUNKS - 1) // SEG_CHUNKS - 1
        while s >= 0:  # checkpoint segments, last first
            c0 = s * SEG_CHUNKS
            c1 = tl.minimum(n_chunks, c0 + SEG_CHUNKS)
            n_sub = (c1 - c0 + SUB_CHUNKS - 1) // SUB_CHUNKS
            # Level 1: states at every SUB_CHUNKS chunks of the segment, from its checkpoint.
            S = load_matrix(ckpt + ((first_ckpt + s) * HV + hv) * KV, V, 1, K, V, 0, BK, BV)  # [BK, BV]
            store_matrix(seg_slots, S, V, 1, K, V, 0, BK, BV)
            c = c0
            while c < c0 + (n_sub - 1) * SUB_CHUNKS:
                S = state_step(S, k_b, v_b, g_b, b_b, bias_p, c * C, n_rows, s_qk, s_v, s_g, HV, K, V,
                                expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID,
                                NEG_EIGVAL, SAFE, DOT_PREC, INV_DOUBLING)
                c += 1
                if (c - c0) % SUB_CHUNKS == 0:
                    store_matrix(seg_slots + ((c - c0) // SUB_CHUNKS) * KV, S, V, 1, K, V, 0, BK, BV)
            tl.debug_barrier()
            u = n_sub - 1
            while u >= 0:  # sub-segments, last first
                d0 = c0 + u * SUB_CHUNKS
                d1 = tl.minimum(c1, d0 + SUB_CHUNKS)
                # Level 2: the start state of every chunk of the sub-segment.
                S = load_matrix(seg_slots + u * KV, V, 1, K, V, 0, BK, BV)
                c = d0
                while c < d1 - 1:
                    store_matrix(chunk_slots + (c - d0) * KV, S, V, 1, K, V, 0, BK, BV)
                    S = state_step(S, k_b, v_b, g_b, b_b, bias_p, c * C, n_rows, s_qk, s_v, s_g, HV, K, V,
                                    expA, lower_bound, C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID,
                                    NEG_EIGVAL, SAFE, DOT_PREC, INV_DOUBLING)
                    c += 1
                store_matrix(chunk_slots + (d1 - 1 - d0) * KV, S, V, 1, K, V, 0, BK, BV)
                tl.debug_barrier()
                c = d1 - 1
                while c >= d0:  # chunks, last first
                    S = load_matrix(chunk_slots + (c - d0) * KV, V, 1, K, V, 0, BK, BV)
                    dS, dA_t, ddt_t, _, _ = chunk_grads(
                        S, dS, q_b, k_b, v_b, g_b, b_b, bias_p, do_b, dq_b, dk_b, dv_b, dg_b, db_b,
                        c * C, n_rows, s_qk, s_v, s_g, HV, s_dqk, K, V, scale, expA, lower_bound,
                        C, BK, BV, GATE, HAS_BIAS, L2NORM, BETA_SIGMOID, NEG_EIGVAL, SAFE, DOT_PREC, GRAD_PREC,
                        INV_DOUBLING, True)
                    dA_acc += dA_t
                    ddt_acc += ddt_t
                    c -= 1
                # The next sub-segment (or segment) overwrites the slots just read.
                tl.debug_barrier()
                u -= 1
            s -= 1

        if HAS_DH0:
            store_matrix(dh0 + n.to(tl.int64) * s_dh0_n + hv * s_dh0_h, dS, s_dh0_k, s_dh0_v, K, V, 0, BK, BV)
        if HAS_A:
            tl.store(dA_part + item, dA_acc)
        if HAS_BIAS:
            tl.store(ddt_part + item.to(tl.int64) * K + cols, ddt_acc, mask=cols < K)
        item += n_prog



# ---------------------------------------------------------------- launcher ----------------------

ALGORITHMS = ("windowed", "streaming")
# streaming is the algorithm measured on the H200; windowed awaits its first GPU run.
DEFAULT_ALGORITHM = "streaming"


def chunk_kda_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    do: torch.Tensor, dht: torch.Tensor | None, *,
    checkpoints: torch.Tensor,
    scale: float,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    safe_gate: bool,
    lower_bound: float | None,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    plan,
    ckpt_offsets: torch.Tensor | None = None,
    stage_dtype: torch.dtype | None = None,
    max_programs: int | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
):
    """Gradients of chunked KDA from the inputs, dO, dht and the forward's sparse state checkpoints.

    Shapes: q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``
    (all contiguous, same dtype); dht ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``)
    or None; checkpoints fp32 ``[plan.num_checkpoints, HV, K, V]`` (layout of ``plan.py``).
    ``plan`` supplies ``checkpoint_every_n_tokens`` (L), ``recompute_every_n_tokens`` (L2: the
    window of the windowed algorithm, the sub-segment of the streaming one) and ``seqlens``;
    ``ckpt_offsets`` (int64 ``[N + 1]``, on the device) is computed when not given.
    ``stage_dtype`` stores the per-chunk state (and, windowed, state-gradient) slots; None picks
    ``default_stage_dtype``. ``algorithm``: 'windowed' (parallel stages, see the module docstring)
    or 'streaming' (one sequential program per (sequence, value head), the previous kernel);
    ``max_programs`` caps the streaming grid.

    Returns ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)``: the first five in the token dtype;
    dA_log ``[HV]`` and ddt_bias ``[HV * K]`` fp32 (None when A_log / dt_bias is None); dh0 fp32 in
    initial_state's layout (None without an initial state).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("do", do)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton backward, got strides {tuple(t.stride())}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton backward supports K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}")
    if do.shape != v.shape or do.dtype != v.dtype:
        raise ValueError(f"do must match v ({list(v.shape)}, {v.dtype}), got {list(do.shape)}, {do.dtype}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    C = CHUNK
    L, L2 = int(plan.checkpoint_every_n_tokens), int(plan.recompute_every_n_tokens)
    if plan.chunk_size != C or L % L2 or L2 % C:
        raise ValueError(f"plan must have chunk_size {C} and L2 | L with C | L2, got chunk {plan.chunk_size}, "
                         f"L={L}, L2={L2}")
    if checkpoints.dtype != torch.float32 or tuple(checkpoints.shape[1:]) != (HV, K, V) \
            or not checkpoints.is_contiguous():
        raise ValueError(f"checkpoints must be contiguous fp32 [rows, {HV}, {K}, {V}], got "
                         f"{checkpoints.dtype} {list(checkpoints.shape)}")
    if checkpoints.shape[0] != plan.num_checkpoints:
        raise ValueError(f"checkpoints must have plan.num_checkpoints={plan.num_checkpoints} rows, "
                         f"got {checkpoints.shape[0]}")
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    if gate == 1 and A_log is None:
        raise ValueError("use_gate_in_kernel without lower_bound needs A_log, got None")
    if dht is not None and dht.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"dht must be a floating tensor, got {dht.dtype}")
    if ckpt_offsets is None:
        ckpt_offsets = checkpoint_offsets(cu_seqlens, B=B, T=T, every_n_tokens=L, device=q.device)
    if stage_dtype is None:
        # fp32 slots are what the streaming kernel was measured with; windowed slots follow the inputs.
        stage_dtype = torch.float32 if algorithm == "streaming" else default_stage_dtype(q.dtype)
    has_a = use_gate_in_kernel and A_log is not None
    has_bias = use_gate_in_kernel and dt_bias is not None
    consts = dict(GATE=gate, HAS_A=has_a, HAS_BIAS=has_bias, L2NORM=use_qk_l2norm_in_kernel,
                  BETA_SIGMOID=use_beta_sigmoid_in_kernel, NEG_EIGVAL=allow_neg_eigval,
                  SAFE=uses_safe_path(safe_gate, use_gate_in_kernel, lower_bound), IS_VARLEN=cu_seqlens is not None,
                  DOT_PREC=dot_precision(q.dtype), INV_DOUBLING=USE_DOUBLING_INVERSE)
    args = (q, k, v, g, beta, do, dht, checkpoints, ckpt_offsets, cu_seqlens, A_log, dt_bias, initial_state,
            float(scale), float(lower_bound if lower_bound is not None else 0.0), state_v_first, L, L2, N,
            stage_dtype, consts)
    if algorithm == "streaming":
        dq, dk, dv, dg, dbeta, dA_part, ddt_part, dh0 = _run_streaming(*args, max_programs)
    else:
        dq, dk, dv, dg, dbeta, dA_part, ddt_part, dh0 = run_windowed(*args, plan)
    dev, f32 = q.device, torch.float32
    dA_log = ddt_bias = None
    if A_log is not None:
        dA_log = dA_part.view(N, HV, -1).sum((0, 2)) if has_a else torch.zeros(HV, dtype=f32, device=dev)
    if dt_bias is not None:
        ddt_bias = ddt_part.view(N, HV, -1, K).sum((0, 2)).view(HV * K) if has_bias \
            else torch.zeros(HV * K, dtype=f32, device=dev)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _run_streaming(q, k, v, g, beta, do, dht, checkpoints, ckpt_offsets, cu_seqlens, A_log, dt_bias, initial_state,
                   scale, lower_bound, state_v_first, L, L2, N, stage_dtype, consts, max_programs):
    """The previous one-pass kernel: one program per (sequence, value head) item."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C, dev, f32 = CHUNK, q.device, torch.float32
    gva = HV > H
    if gva:
        dq = torch.empty(B, T, HV, K, dtype=f32, device=dev)
        dk = torch.empty(B, T, HV, K, dtype=f32, device=dev)
    else:
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    has_a, has_bias = consts["HAS_A"], consts["HAS_BIAS"]
    dA_part = torch.empty(N * HV, dtype=f32, device=dev) if has_a else None
    ddt_part = torch.empty(N * HV, K, dtype=f32, device=dev) if has_bias else None
    dh0 = torch.empty(initial_state.shape, dtype=f32, device=dev) if initial_state is not None else None
    n_items = N * HV
    n_prog = max(1, n_items if max_programs is None else min(n_items, int(max_programs)))
    ws_seg = torch.empty(n_prog, L // L2, K, V, dtype=f32, device=dev)
    ws_chunk = torch.empty(n_prog, L2 // C, K, V, dtype=stage_dtype, device=dev)

    dht_strides = state_strides(dht, state_v_first) if dht is not None else (0, 0, 0, 0)
    dh0_strides = state_strides(dh0, state_v_first) if dh0 is not None else (0, 0, 0, 0)
    BK, BV = block_size(K), block_size(V)
    if n_items > 0:
        LAST_LAUNCH["kernel"] = chunk_kda_bwd_kernel[(n_prog,)](
            q, k, v, g, beta, do, dht if dht is not None else q, checkpoints, ckpt_offsets,
            cu_seqlens if cu_seqlens is not None else ckpt_offsets,
            A_log if has_a else q, dt_bias if has_bias else q,
            dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else dv,
            dA_part if has_a else dv, ddt_part if has_bias else dv, ws_seg, ws_chunk,
            scale, lower_bound, T, H, HV, K, V, n_items, n_prog,
            *dht_strides, *dh0_strides,
            GROUP=HV // H, C=C, BK=BK, BV=BV, SEG_CHUNKS=L // C, SUB_CHUNKS=L2 // C, N_SUB=L // L2,
            HAS_DHT=dht is not None, HAS_DH0=dh0 is not None, GVA_PARTIAL=gva, GRAD_PREC=grad_precision(),
            **consts, num_warps=streaming_num_warps(BK, BV), num_stages=1,
        )
    elif dh0 is not None:
        dh0.zero_()
    del ws_seg, ws_chunk
    if gva:
        dq = dq.view(B, T, H, HV // H, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, HV // H, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg, dbeta, dA_part, ddt_part, dh0
