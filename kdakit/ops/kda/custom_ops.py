"""kdakit's ops registered with ``torch.library``: ``torch.ops.kdakit.*``.

=============================  ===================================================  ==============
op                             what                                                 autograd
=============================  ===================================================  ==============
``chunk_kda``                  ``kdakit.chunk_kda`` -> (o, final_state)             yes
``chunk_kda_backward``         its backward: the 8 gradients                        (is one)
``chunk_kda_pool``             ``chunk_kda(..., state_indices=)``; mutates the pool  forward only
``fused_recurrent_kda``        ``kdakit.fused_recurrent_kda`` -> (o, final_state)   yes
``fused_recurrent_kda_backward``  its backward (``kdakit.recurrent_kda_backward``)  (is one)
``fused_recurrent_kda_serving``   FLA's serving arguments; mutates initial_state    forward only
``kda_decode``                 ``kdakit.kda_decode`` -> o; mutates state_pool       forward only
=============================  ===================================================  ==============

Each implementation calls the public eager function, so results, dtypes and errors are the eager
ones. ``torch.compile`` reaches these ops through the public functions (``compiled.py``); engines
may also call them directly. Arguments are the public ones, in a fixed order, restricted to what a
schema holds: tensors, ``Tensor?``, bool, int, float. Host data travels as ``cu_seqlens_cpu`` (a
CPU tensor argument): the ops never need a host value at trace time.

Outputs a call does not produce (final_state without ``output_final_state``, a gradient of an
absent input) are empty tensors, since a schema cannot return None; the public wrappers and the
autograd formulas turn them back into None from the call's own flags, never from a size.

Fake implementations give the eager outputs' shapes, dtypes and strides from metadata alone (o
dense in v's shape and dtype; final_state fp32, float64 on the PyTorch path for float64 inputs).

Backward of ``chunk_kda``: the eager forward saves sparse state checkpoints whose count depends on
the sequence lengths (a data-dependent shape), so the registered op saves only its inputs and
``chunk_kda_backward`` recomputes the forward before its backward: the same bits as the eager
backward, for the cost of one more forward in compiled training. ``fused_recurrent_kda``'s backward
recomputes from the inputs in eager mode too, so it costs nothing more.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.chunk.api import chunk_kda
from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.reference.preprocess import compute_dtype
from kdakit.ops.kda.recurrent.backward import recurrent_kda_backward
from kdakit.ops.kda.validate import flat_gate_params

_GRAD_INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _autograd_inside_op():
    """Re-admit autograd inside an op's implementation, for the backward ops only.

    An op's implementation runs below the autograd dispatch key (excluded in the thread's dispatch
    state), so ``torch.enable_grad()`` alone records nothing. The backward ops need it: the PyTorch
    paths differentiate a recomputed segment with ``torch.autograd.grad``, and ``chunk_kda_backward``
    recomputes the whole forward under autograd. torch's own higher-order ops re-admit the keys
    the same way."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set().remove(C.DispatchKey.AutogradFunctionality)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _state_dtype(*tokens) -> torch.dtype:
    """The dtype of a returned final state: fp32 on the Triton kernels; the compute dtype (fp32, or
    float64 for float64 inputs) on the PyTorch path."""
    if select_backend(tokens[0].device) == "triton":
        return torch.float32
    return compute_dtype(*tokens)


def _state_shape(q, v, N, state_v_first):
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def _num_seqs(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _absent(q) -> Tensor:
    """What an op returns in place of None (see the module docstring)."""
    return q.new_empty((0,))


def _fake_outputs(o, q, k, v, g, beta, cu_seqlens, returns_state: bool, state_v_first: bool):
    """A fake's ``(o, final_state)``: the final state's shape and dtype as the eager op returns it, or the
    absent-state placeholder."""
    if not returns_state:
        return o, _absent(q)
    shape = _state_shape(q, v, _num_seqs(q, cu_seqlens), state_v_first)
    return o, q.new_empty(shape, dtype=_state_dtype(q, k, v, g, beta))


def _grads_needed(A_log, dt_bias, initial_state, use_gate_in_kernel):
    """Which of the 8 inputs get a gradient: the token tensors always; A_log and dt_bias when given and
    the gate runs in the kernel (otherwise the eager ops do not read them); initial_state when given."""
    return (True,) * 5 + (A_log is not None and use_gate_in_kernel, dt_bias is not None and use_gate_in_kernel,
                          initial_state is not None)


def _fake_grads(inputs, needed):
    return tuple(torch.empty_like(x) if n else _absent(inputs[0]) for x, n in zip(inputs, needed))


# ---------------------------------------------------------------------------------------------
# chunk_kda
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("kdakit::chunk_kda", mutates_args=())
def _chunk_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                  dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                  cu_seqlens_cpu: Tensor | None, scale: float | None, output_final_state: bool,
                  use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                  allow_neg_eigval: bool, safe_gate: bool, lower_bound: float | None, state_v_first: bool,
                  chunk_size: int | None, checkpoint_every_n_tokens: int | None,
                  pipeline: str | None = None) -> tuple[Tensor, Tensor]:
    o, final = chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, checkpoint_every_n_tokens=checkpoint_every_n_tokens,
        pipeline=pipeline)
    return o, (final if final is not None else _absent(q))


@_chunk_kda_op.register_fake
def _chunk_kda_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                    output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, safe_gate, lower_bound, state_v_first, chunk_size, checkpoint_every_n_tokens,
                    pipeline=None):
    o = v.new_empty(v.shape)
    return _fake_outputs(o, q, k, v, g, beta, cu_seqlens, output_final_state, state_v_first)


@torch.library.custom_op("kdakit::chunk_kda_backward", mutates_args=())
def _chunk_kda_backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                           dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                           cu_seqlens_cpu: Tensor | None, do: Tensor, dht: Tensor | None, scale: float | None,
                           use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                           allow_neg_eigval: bool, safe_gate: bool, lower_bound: float | None, state_v_first: bool,
                           chunk_size: int | None, checkpoint_every_n_tokens: int | None,
                           pipeline: str | None = None
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    needed = _grads_needed(A_log, dt_bias, initial_state, use_gate_in_kernel)
    with _autograd_inside_op():
        # the eager forward again (see the module docstring), then its own backward
        leaves = [x.detach().requires_grad_(n) if x is not None else None for x, n in zip(inputs, needed)]
        o, final = chunk_kda(
            *leaves[:5], scale=scale, initial_state=leaves[7], output_final_state=dht is not None,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, A_log=leaves[5], dt_bias=leaves[6], chunk_size=chunk_size,
            checkpoint_every_n_tokens=checkpoint_every_n_tokens, pipeline=pipeline)
        outs, cots = [o], [do]
        if dht is not None:
            outs.append(final)
            cots.append(dht)
        wrt = [x for x, n in zip(leaves, needed) if n]
        got = iter(torch.autograd.grad(outs, wrt, cots, allow_unused=True))
    res = []
    for x, n in zip(inputs, needed):
        if not n:
            res.append(_absent(q))
            continue
        gr = next(got)
        res.append(torch.zeros_like(x) if gr is None else gr.detach())
    return tuple(res)


@_chunk_kda_backward_op.register_fake
def _chunk_kda_backward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht,
                             scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, *rest):
    needed = _grads_needed(A_log, dt_bias, initial_state, use_gate_in_kernel)
    return _fake_grads((q, k, v, g, beta, A_log, dt_bias, initial_state), needed)


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state = inputs[:12]
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.output_final_state, ctx.options = scale, output_final_state, tuple(inputs[12:])


def _chunk_backward(ctx, do, dfinal):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    dht = dfinal if ctx.output_final_state else None
    grads = torch.ops.kdakit.chunk_kda_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                cu_seqlens_cpu, do, dht, ctx.scale, *ctx.options)
    use_gate_in_kernel = ctx.options[1]
    needed = _grads_needed(A_log, dt_bias, initial_state, use_gate_in_kernel)
    return (*(gr if n else None for gr, n in zip(grads, needed)), None, None, None, None, *(None,) * len(ctx.options))


torch.library.register_autograd("kdakit::chunk_kda", _chunk_backward, setup_context=_chunk_setup_context)


@torch.library.custom_op("kdakit::chunk_kda_pool", mutates_args=("state_pool",))
def _chunk_kda_pool_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                       dt_bias: Tensor | None, state_pool: Tensor, state_indices: Tensor, cu_seqlens: Tensor | None,
                       cu_seqlens_cpu: Tensor | None, scale: float | None, output_final_state: bool,
                       use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                       allow_neg_eigval: bool, safe_gate: bool, lower_bound: float | None, state_v_first: bool,
                       chunk_size: int | None, checkpoint_every_n_tokens: int | None,
                       check_indices: bool, pipeline: str | None = None) -> tuple[Tensor, Tensor]:
    o, final = chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=state_pool, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, checkpoint_every_n_tokens=checkpoint_every_n_tokens,
        pipeline=pipeline, state_indices=state_indices, check_indices=check_indices)
    return o, (final if final is not None else _absent(q))


@_chunk_kda_pool_op.register_fake
def _chunk_kda_pool_fake(q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, cu_seqlens, cu_seqlens_cpu,
                         scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                         use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, *rest):
    o = v.new_empty(v.shape)
    return _fake_outputs(o, q, k, v, g, beta, cu_seqlens, output_final_state, state_v_first)


# ---------------------------------------------------------------------------------------------
# fused_recurrent_kda
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("kdakit::fused_recurrent_kda", mutates_args=())
def _fused_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                        dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                        cu_seqlens_cpu: Tensor | None, scale: float | None, output_final_state: bool,
                        use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                        allow_neg_eigval: bool, lower_bound: float | None, state_v_first: bool, safe_gate: bool,
                        segment_tokens: int) -> tuple[Tensor, Tensor]:
    o, final = fused_recurrent_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        safe_gate=safe_gate, segment_tokens=segment_tokens, cu_seqlens_cpu=cu_seqlens_cpu)
    return o, (final if final is not None else _absent(q))


@_fused_recurrent_op.register_fake
def _fused_recurrent_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                          output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                          allow_neg_eigval, lower_bound, state_v_first, safe_gate, segment_tokens):
    o = v.new_empty(v.shape)  # the eager op allocates a dense o whatever v's strides (the PyTorch path: the same)
    return _fake_outputs(o, q, k, v, g, beta, cu_seqlens, output_final_state, state_v_first)


@torch.library.custom_op("kdakit::fused_recurrent_kda_backward", mutates_args=())
def _fused_recurrent_backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                                 dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                                 do: Tensor, dht: Tensor | None, scale: float | None, use_qk_l2norm_in_kernel: bool,
                                 use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
                                 lower_bound: float | None, state_v_first: bool, safe_gate: bool, segment_tokens: int
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    needed = _grads_needed(A_log, dt_bias, initial_state, use_gate_in_kernel)
    A_flat, bias_flat = flat_gate_params(A_log, dt_bias)  # the backward takes the flat shapes only
    # autograd hands expanded (stride-0) cotangents for reductions like o.sum(); the kernels need a unit last
    # stride, so only such a cotangent is materialized (a unit-last-stride view is read in place)
    if do.dim() and do.shape[-1] > 1 and do.stride(-1) != 1:
        do = do.contiguous()
    with _autograd_inside_op():  # the PyTorch path differentiates the recurrence with autograd
        grads = recurrent_kda_backward(
            q, k, v, g, beta, do, dht, A_log=A_flat, dt_bias=bias_flat, scale=scale,
            initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, safe_gate=safe_gate,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, segment_tokens=segment_tokens)
    return tuple(gr.detach().view(x.shape) if n else _absent(q) for gr, x, n in zip(grads, inputs, needed))


@_fused_recurrent_backward_op.register_fake
def _fused_recurrent_backward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, do, dht, scale,
                                   use_qk_l2norm_in_kernel, use_gate_in_kernel, *rest):
    needed = _grads_needed(A_log, dt_bias, initial_state, use_gate_in_kernel)
    # the eager backward returns new dense gradients, whatever the inputs' strides
    return tuple(x.new_empty(x.shape) if n else _absent(q)
                 for x, n in zip((q, k, v, g, beta, A_log, dt_bias, initial_state), needed))


def _fused_setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state = inputs[:12]
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    ctx.scale, ctx.output_final_state, ctx.options = scale, output_final_state, tuple(inputs[12:])


def _fused_backward(ctx, do, dfinal):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = ctx.saved_tensors
    dht = dfinal if ctx.output_final_state else None
    grads = torch.ops.kdakit.fused_recurrent_kda_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                          do, dht, ctx.scale, *ctx.options)
    needed = _grads_needed(A_log, dt_bias, initial_state, ctx.options[1])
    return (*(gr if n else None for gr, n in zip(grads, needed)), None, None, None, None, *(None,) * len(ctx.options))


torch.library.register_autograd("kdakit::fused_recurrent_kda", _fused_backward, setup_context=_fused_setup_context)


@torch.library.custom_op("kdakit::fused_recurrent_kda_serving", mutates_args=("initial_state",))
def _fused_recurrent_serving_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                                dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                                cu_seqlens_cpu: Tensor | None, ssm_state_indices: Tensor | None,
                                num_accepted_tokens: Tensor | None, scale: float | None, output_final_state: bool,
                                use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                                use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: float | None,
                                state_v_first: bool, safe_gate: bool, inplace_final_state: bool,
                                check_indices: bool) -> tuple[Tensor, Tensor]:
    o, final = fused_recurrent_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        safe_gate=safe_gate, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
        inplace_final_state=inplace_final_state, check_indices=check_indices, cu_seqlens_cpu=cu_seqlens_cpu)
    # in place, the eager op returns initial_state itself, which an op may not return (its wrapper does)
    return o, (final if final is not None and not inplace_final_state else _absent(q))


@_fused_recurrent_serving_op.register_fake
def _fused_recurrent_serving_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                                  ssm_state_indices, num_accepted_tokens, scale, output_final_state,
                                  use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                  allow_neg_eigval, lower_bound, state_v_first, safe_gate, inplace_final_state,
                                  check_indices):
    o = v.new_empty(v.shape)
    return _fake_outputs(o, q, k, v, g, beta, cu_seqlens, output_final_state and not inplace_final_state,
                         state_v_first)


# ---------------------------------------------------------------------------------------------
# kda_decode
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("kdakit::kda_decode", mutates_args=("state_pool",))
def _kda_decode_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                   state_indices: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, cu_seqlens: Tensor | None,
                   cu_seqlens_cpu: Tensor | None, num_accepted_tokens: Tensor | None, scale: float | None,
                   use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                   allow_neg_eigval: bool, lower_bound: float | None, safe_gate: bool, check_indices: bool) -> Tensor:
    return kda_decode(
        q, k, v, g, beta, state_pool, state_indices, A_log=A_log, dt_bias=dt_bias, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, safe_gate=safe_gate, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
        check_indices=check_indices, cu_seqlens_cpu=cu_seqlens_cpu)


@_kda_decode_op.register_fake
def _kda_decode_fake(q, k, v, g, beta, state_pool, state_indices, *rest):
    return v.new_empty(v.shape)
