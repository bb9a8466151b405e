"""What ``kdakit.chunk_kda``, ``kdakit.fused_recurrent_kda`` and ``kdakit.kda_decode`` do while
``torch.compile`` traces them: call the registered custom ops ``torch.ops.kdakit.*``
(``custom_ops.py``), so that the compiler sees one opaque op per call, with a fake implementation
for shapes and an autograd formula, instead of the Python around the kernels (validation reads
host values, plans, launches), which would break the graph.

Eager calls never come here (the public functions check ``torch.compiler.is_compiling()``), so
their behaviour, errors and cost are unchanged. Under compile the op's implementation calls that
same eager function at run time, so validation and its errors are the eager ones, raised when the
compiled code runs.

Arguments an op cannot carry (Python objects, or results whose shape depends on host values) are
refused here with a ``ValueError`` naming them. ``out=`` / ``final_state_out=`` are honoured by a
copy after the op (the compiler owns allocation).

This module imports no other kdakit module: it reaches the ops through the dispatcher's
``torch.ops.kdakit`` namespace, which ``kdakit.ops.kda`` fills by importing ``custom_ops`` (the
top of the import graph), so the public modules can call it without an import cycle.
"""

from __future__ import annotations

import torch


def _refuse(op: str, name: str, value, default) -> None:
    if value is not default and value != default:
        raise ValueError(f"{op} under torch.compile does not take {name} (the registered op cannot carry it), "
                         f"got {name}={value!r}; call it eagerly (outside the compiled region) for {name}")


def _copy_into(dst, src):
    """``out=`` under compile: the values go into the caller's tensor (no autograd edge, as the eager
    path's out= on the PyTorch backend)."""
    with torch.no_grad():
        dst.copy_(src)
    return dst


def chunk_kda_via_op(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                     disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                     cp_context, use_graph, max_num_seqs, A_log, dt_bias, chunk_size, checkpoint_every_n_tokens,
                     state_indices, transpose_state_layout, check_indices, pipeline=None):
    for name, value, default in (("disable_recompute", disable_recompute, False), ("use_graph", use_graph, False),
                                 ("max_num_seqs", max_num_seqs, None), ("cp_context", cp_context, None),
                                 ("return_intermediate_states", return_intermediate_states, False),
                                 ("transpose_state_layout", transpose_state_layout, None)):
        _refuse("chunk_kda", name, value, default)
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
             lower_bound, state_v_first, chunk_size, checkpoint_every_n_tokens)
    if state_indices is None:
        o, final = torch.ops.kdakit.chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                              cu_seqlens_cpu, scale, output_final_state, *flags, pipeline)
    else:
        # the pool is updated in place: a mutating op, forward only (no autograd formula)
        o, final = torch.ops.kdakit.chunk_kda_pool(q, k, v, g, beta, A_log, dt_bias, initial_state, state_indices,
                                                   cu_seqlens, cu_seqlens_cpu, scale, output_final_state, *flags,
                                                   check_indices, pipeline)
    return o, (final if output_final_state else None)


def fused_recurrent_kda_via_op(q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                               allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, safe_gate, out,
                               final_state_out, workspace, segment_tokens, ssm_state_indices, num_accepted_tokens,
                               inplace_final_state, check_indices, cu_seqlens_cpu, kwargs):
    _refuse("fused_recurrent_kda", "workspace", workspace, None)
    if kwargs:
        _refuse("fused_recurrent_kda", sorted(kwargs)[0], kwargs[sorted(kwargs)[0]], None)
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
             state_v_first, safe_gate)
    if ssm_state_indices is not None or num_accepted_tokens is not None or inplace_final_state is not False:
        o, final = torch.ops.kdakit.fused_recurrent_kda_serving(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, ssm_state_indices,
            num_accepted_tokens, scale, output_final_state, *flags, inplace_final_state, check_indices)
        if inplace_final_state:
            final = initial_state  # the states went into the pool (the op cannot return its input)
        elif not output_final_state:
            final = None
    else:
        o, final = torch.ops.kdakit.fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                        cu_seqlens_cpu, scale, output_final_state, *flags,
                                                        segment_tokens)
        final = final if output_final_state else None
    # as the eager PyTorch path: out receives the values; a differentiable result stays the one returned
    if out is not None:
        _copy_into(out, o)
        o = o if o.requires_grad else out
    if final_state_out is not None and final is not None:
        _copy_into(final_state_out, final)
        final = final if final.requires_grad else final_state_out
    return o, final


def kda_decode_via_op(q, k, v, g, beta, state_pool, state_indices, *, A_log, dt_bias, scale, use_qk_l2norm_in_kernel,
                      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, safe_gate,
                      cu_seqlens, num_accepted_tokens, out, check_indices, workspace, cu_seqlens_cpu):
    _refuse("kda_decode", "workspace", workspace, None)
    o = torch.ops.kdakit.kda_decode(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias, cu_seqlens,
                                    cu_seqlens_cpu, num_accepted_tokens, scale, use_qk_l2norm_in_kernel,
                                    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                                    safe_gate, check_indices)
    return _copy_into(out, o) if out is not None else o
