"""Public chunked KDA: ``kdakit.chunk_kda``, a drop-in for ``fla.ops.kda.chunk_kda`` (FLA 0.6.0).

Validates the arguments (docs/spec.md §2), then runs the Triton kernels (CUDA tensors, or CPU
tensors under ``TRITON_INTERPRET=1`` with ``KDAKIT_BACKEND=triton``) or the chunked
PyTorch reference (CPU tensors, or ``KDAKIT_BACKEND=torch``). See
``kdakit/ops/kda/backend.py`` for the selection rule; there is no silent fallback.

Host synchronization: a fixed-length call (``cu_seqlens=None``) reads no device tensor's
values on the host, and neither does a packed call given ``cu_seqlens_cpu``; a packed call
without it reads ``cu_seqlens`` once (in validation). ``state_indices`` is read once to check
its range against the pool (one device->host copy per call on that path) unless
``check_indices=False`` or a CUDA graph is being captured; the pool's gather and scatter run on
the device (``state_pool.py``), so such a call captures in a plain ``torch.cuda.graph``.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kdakit.ops.kda.chunk.cp import chunk_kda_cp
from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.reference.chunk import chunked_kda_reference, chunked_kda_reference_states
from kdakit.ops.kda.chunk.autograd import chunk64_kda
from kdakit.ops.kda.chunk_triton import chunk_kda_triton, chunk_kda_triton_states
from kdakit.ops.kda.compiled import chunk_kda_via_op
from kdakit.ops.kda.serving.state_pool import gather_pool_rows, scatter_pool_rows, zero_padded_outputs
from kdakit.ops.kda.options import kda_options
from kdakit.ops.kda.plan import PIPELINES as PLAN_PIPELINES, chunk64_window, gate_kind, resolve_pipeline
from kdakit.ops.kda.validate import check_state_pool
from kdakit.ops.kda.recurrent.workspace import check_capturable_offsets, is_capturing

# The values ``pipeline`` takes (None: the plan's default for the call's gate, ``plan.DEFAULT_PIPELINE``).
PIPELINES = (None,) + PLAN_PIPELINES

# FLA 0.6.0 options kdakit does not implement; each raises if set to a non-default value.
_UNSUPPORTED_FLA_OPTIONS = {
    "disable_recompute": False,
    "use_graph": False,
    "max_num_seqs": None,
}


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    checkpoint_every_n_tokens: int | None = None,
    pipeline: str | None = None,
    state_indices: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
    check_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention, chunked, with FLA 0.6.0's arguments and semantics.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (fp16/bf16/fp32/fp64).
        v: ``[B, T, HV, V]`` values; HV a multiple of H (value head i uses q/k head ``i // (HV // H)``).
        g: ``[B, T, HV, K]`` log-decay, or the raw gate when ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` beta, or its logits when ``use_beta_sigmoid_in_kernel``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), fp32 or bf16.
        output_final_state: also return the final state (fp32, same layout).
        use_qk_l2norm_in_kernel: l2-normalize q and k (``x / sqrt(sum x^2 + 1e-6)``).
        use_gate_in_kernel: ``g`` is raw: ``-exp(A_log) * softplus(g + dt_bias)``, or
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``lower_bound`` is set.
        use_beta_sigmoid_in_kernel: beta is ``sigmoid(beta)``; ``allow_neg_eigval`` doubles it.
        safe_gate: the gate is bounded below by ``lower_bound`` in [-5, 0) (enables the
            factorized fast path in the Triton kernels).
        state_v_first: states use the value-first ``[V, K]`` layout.
        cu_seqlens: int ``[N + 1]`` offsets of packed sequences (B must be 1); zero-length
            sequences are legal.
        cu_seqlens_cpu: the same offsets as ``cu_seqlens`` in a CPU int tensor (FLA 0.6.0's
            argument). With it kdakit validates the offsets and takes the sequence lengths from
            this host copy and never reads ``cu_seqlens`` back from the device, so the call does
            no device->host synchronization; the caller promises the two are equal (checking it
            would need the read). Without it ``cu_seqlens`` is read to the host once per call.
            Needs ``cu_seqlens``.
        cp_context: a ``kdakit.build_cp_context`` context: context parallelism over its process
            group (q..beta hold this rank's local tokens; see ``kdakit/ops/kda/chunk/cp.py``).
            ``cu_seqlens`` comes from the context. kdakit extension: ``initial_state`` is then the
            global ``[N, HV, ...]`` (same on every rank) and ``output_final_state`` returns the
            global states of the sequences that end on this rank (zeros elsewhere).
        return_intermediate_states: under ``torch.inference_mode()`` only (as in FLA; otherwise
            ``ValueError``): also return h, the state entering every 64-token chunk of every sequence
            (prefix caching), ``[B, NT, HV, K, V]`` (``[.., V, K]`` with ``state_v_first``) in k's dtype;
            B = 1 and NT over all sequences when packed. Not with ``cp_context``.
        disable_recompute, use_graph, max_num_seqs:
            FLA options kdakit does not implement; setting one raises ``ValueError``.

    kdakit-only keyword arguments:
        A_log: ``[HV]`` fp32 gate parameter (FLA passes it through ``**kwargs``).
        dt_bias: ``[HV * K]`` fp32 gate bias.
        chunk_size: chunk length of the PyTorch path (16, 32 or 64). With ``pipeline=None`` it also picks the
            Triton pipeline: 16 the 16-token one, 64 the 64-token one (32 is the PyTorch path's only); the
            result does not depend on it beyond round-off.
        pipeline: which Triton chunk pipeline runs (CUDA tensors; the PyTorch path computes the same function):
            ``None`` (default): the plan's choice for the gate (``kdakit.ops.kda.plan.DEFAULT_PIPELINE``): the
            64-token pipeline for the unbounded gates (softplus in kernel, a precomputed log-decay), the 16-token
            one for the safe gate, and the 16-token one for ``return_intermediate_states``, ``chunk_size=16`` or a
            ``checkpoint_every_n_tokens`` that is not a multiple of 64.
            ``"windowed16"``: 16-token forward and windowed backward, peak within 1.10x of the memory floor
            (slow with an unbounded gate); ``"chunk64"``: the 64-token pipeline, whose backward recomputes each
            window of ``checkpoint_every_n_tokens`` tokens (default 1024, doubled until a window holds 1536
            (chunk, value head) rows: 8192 tokens for one sequence of 16 heads); ``"chunk64_fast"``: the same with
            the forward's per-chunk intermediates kept for the backward (about 2.4 KB per token and value head
            at K = V = 128 in bf16; backward windows of ``checkpoint_every_n_tokens``, default 2048, doubled
            the same way). The two
            64-token pipelines take any gate and strided token views (unit last stride), not
            ``return_intermediate_states``. ``kdakit.plan_kda(pipeline=..., gate=...)`` prices each one;
            docs/perf_notes.md has their measured speed and memory.
        checkpoint_every_n_tokens: cadence of the state checkpoints saved for backward, a
            positive multiple of 16 (and of ``chunk_size``; of 64 on the 64-token pipelines, where it is the
            backward's window); None lets the plan choose (see ``kdakit.plan_kda``).
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (warns).
        state_indices: int32 ``[N]`` rows of a state pool. With it, ``initial_state`` is the
            pool ``[P, HV, ...]``; row ``state_indices[n]`` is sequence n's initial state and
            receives its final state in place; ``-1`` marks a padded sequence (zero output,
            pool untouched), as in ``kdakit.kda_decode``. Prefill and decode share one pool
            when ``state_v_first=True`` (decode's ``[P, HV, V, K]`` layout). The pool itself
            is not differentiated.
        check_indices: with ``state_indices``, read them to the host once to check their range and
            that rows are distinct (a device->host copy). Skipped while a CUDA graph is being
            captured; pass False in a serving loop that guarantees them, for a call without any
            synchronization. Unchecked, an index outside ``[-1, P)`` is an indexing error on the
            device.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 (float64
        for float64 inputs) or None. With return_intermediate_states, ``(o, final_state, h)``.
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if torch.compiler.is_compiling():
        # torch.compile traces the registered op torch.ops.kdakit.chunk_kda, not this Python (compiled.py)
        return chunk_kda_via_op(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs,
            A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, checkpoint_every_n_tokens=checkpoint_every_n_tokens,
            state_indices=state_indices, transpose_state_layout=transpose_state_layout, check_indices=check_indices,
            pipeline=pipeline)
    fla_opts = {"disable_recompute": disable_recompute, "use_graph": use_graph, "max_num_seqs": max_num_seqs}
    for name, default in _UNSUPPORTED_FLA_OPTIONS.items():
        if fla_opts[name] != default:
            raise ValueError(f"{name} is an FLA option kdakit does not implement: expected {default!r}, got {fla_opts[name]!r}")
    if transpose_state_layout is not None:
        warnings.warn("transpose_state_layout is deprecated; use state_v_first", DeprecationWarning, stacklevel=2)
        if state_v_first:
            raise ValueError("pass state_v_first or its old name transpose_state_layout, not both")
        state_v_first = bool(transpose_state_layout)
    if chunk_size is not None and chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    requested = pipeline
    if pipeline is None:
        # an explicit chunk length, the prefix-cache states or a 16-token cadence name the pipeline that serves
        # them; otherwise the plan's default for the gate
        cadence16 = checkpoint_every_n_tokens is not None and not (
            isinstance(checkpoint_every_n_tokens, int) and checkpoint_every_n_tokens > 0
            and checkpoint_every_n_tokens % 64 == 0)  # (an invalid one is reported with the 16-token rule)
        if chunk_size in (16, 32) or return_intermediate_states or cadence16:
            pipeline = "windowed16"
        elif chunk_size == 64:
            pipeline = "chunk64"
        else:
            pipeline = resolve_pipeline(None, gate_kind(use_gate_in_kernel, safe_gate, lower_bound))
    chunk64 = pipeline in ("chunk64", "chunk64_fast")
    if chunk64 and chunk_size not in (None, 64):
        raise ValueError(f"pipeline={pipeline!r} runs 64-token chunks: chunk_size must be None or 64, got {chunk_size}")
    if chunk64 and return_intermediate_states:
        raise ValueError(f"return_intermediate_states is served by pipeline=None or 'windowed16', got "
                         f"pipeline={requested!r}")
    if checkpoint_every_n_tokens is not None:
        unit = 64 if chunk64 else max(16, chunk_size or 16)
        if isinstance(checkpoint_every_n_tokens, bool) or not isinstance(checkpoint_every_n_tokens, int) \
                or checkpoint_every_n_tokens <= 0 or checkpoint_every_n_tokens % unit:
            raise ValueError(f"checkpoint_every_n_tokens must be a positive multiple of {unit} or None, "
                             f"got {checkpoint_every_n_tokens!r}")

    if return_intermediate_states and not torch.is_inference_mode_enabled():
        raise ValueError("return_intermediate_states is for inference: call chunk_kda under torch.inference_mode(), "
                         "got it outside inference mode")
    if return_intermediate_states and cp_context is not None:
        raise ValueError("return_intermediate_states does not combine with cp_context, got both")
    if cp_context is not None:
        return chunk_kda_cp(
            q, k, v, g, beta, local_op=functools.partial(chunk_kda, pipeline=requested), cp_context=cp_context, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, state_indices=state_indices, use_gate_in_kernel=use_gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, chunk_size=chunk_size,
            checkpoint_every_n_tokens=checkpoint_every_n_tokens)

    if not isinstance(check_indices, bool):
        raise TypeError(f"check_indices must be a bool, got {type(check_indices).__name__}")
    capturing = is_capturing(q.device) if isinstance(q, torch.Tensor) else False
    if capturing:
        check_capturable_offsets("chunk_kda", cu_seqlens, cu_seqlens_cpu)
    pool = host = valid = None
    if state_indices is not None:
        pool, initial_state = initial_state, None

    # A pool call always produces final states: they are scattered back into the pool.
    opts = kda_options(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state or pool is not None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        A_log=A_log, dt_bias=dt_bias, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, engine_gate_shapes=True,
    )
    shape = opts.shape
    A_log, dt_bias = opts.kernel_gate_params(A_log, dt_bias)
    if state_indices is not None:  # check_state_pool refuses a missing pool too
        host = check_state_pool(pool, state_indices, shape, state_v_first=state_v_first, device=q.device,
                                check_values=check_indices and not capturing)
        initial_state, valid = gather_pool_rows(pool, state_indices, host)
    tensors = dict(A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, cu_seqlens=cu_seqlens)
    backend = select_backend(q.device)
    if backend == "triton" and not chunk64 and chunk_size not in (None, 16):
        raise ValueError(f"chunk_size={chunk_size} is for the PyTorch path; pipeline={pipeline!r} uses 16-token "
                         "chunks (pass None or 16)")
    h = None
    if backend == "triton":
        if chunk64:
            window = chunk64_window(pipeline, checkpoint_every_n_tokens, pairs=opts.shape.N * opts.shape.HV)
            o, final = chunk64_kda(q, k, v, g, beta, **tensors, opts=opts, window_tokens=window,
                                   keep_intermediates=pipeline == "chunk64_fast")
        elif return_intermediate_states:
            o, final, h = chunk_kda_triton_states(q, k, v, g, beta, **tensors, opts=opts)
        else:
            o, final = chunk_kda_triton(q, k, v, g, beta, **tensors,
                                        checkpoint_every_n_tokens=checkpoint_every_n_tokens, opts=opts)
    else:
        if cu_seqlens_cpu is not None:
            # The reference reads the offsets on the host: give it the host copy (validated
            # above, equal to cu_seqlens by the caller's promise) so that it does not read
            # cu_seqlens back from the device either.
            tensors["cu_seqlens"] = cu_seqlens_cpu
        reference = chunked_kda_reference_states if return_intermediate_states else chunked_kda_reference
        res = reference(q, k, v, g, beta, **tensors, output_final_state=opts.output_final_state, chunk_size=chunk_size,
                        checkpoint_every_n_tokens=None if chunk64 else checkpoint_every_n_tokens,
                        **opts.reference_kwargs())
        o, final, h = res if return_intermediate_states else (*res, None)
    if pool is not None:
        scatter_pool_rows(pool, final, state_indices, valid, host)
        # padded sequences give zero output, as in kda_decode; the offsets on o's device (the host
        # copy on the CPU), so that building the token mask reads nothing back either
        on_device = cu_seqlens_cpu if cu_seqlens_cpu is not None and cu_seqlens_cpu.device == o.device else cu_seqlens
        o = zero_padded_outputs(o, valid, host, on_device)
    if return_intermediate_states:
        return o, (final if output_final_state else None), h
    return o, (final if output_final_state else None)

