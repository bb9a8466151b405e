"""``KDAOptions``: a call's options and their kernel encodings, decided once and taken whole by every launcher."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kdakit.ops.kda.chunk.autograd as chunk64_autograd
import kdakit.ops.kda.chunk_bwd as chunk_bwd
import kdakit.ops.kda.chunk_bwd_windowed as chunk_bwd_windowed
import kdakit.ops.kda.chunk_fwd as chunk_fwd
import kdakit.ops.kda.chunk_triton as chunk_triton
import kdakit.ops.kda.serving.decode as decode
import kdakit.ops.kda.recurrent.api as fused_recurrent
import kdakit.ops.kda.options as options
import kdakit.ops.kda.recurrent.backward as recurrent_backward
import kdakit.ops.kda.recurrent.backward_kernels as recurrent_backward_kernels
import kdakit.ops.kda.recurrent.segmented as recurrent_backward_segmented
from kdakit import chunk_kda, fused_recurrent_kda, kda_decode
from kdakit.ops.kda.chunk_common import GATE_LOWER_BOUND, GATE_NONE, GATE_SOFTPLUS
from kdakit.ops.kda.options import KDAOptions, kda_options
from kdakit.ops.kda.recurrent.kernels import BETA_RAW, BETA_SIGMOID, BETA_SIGMOID_X2


def _inputs(B=1, T=20, H=1, HV=2, K=16, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = torch.randn(B, T, HV, K, generator=gen)
    beta = torch.randn(B, T, HV, generator=gen)
    A_log, dt_bias = 0.5 * torch.randn(HV, generator=gen), torch.randn(HV * K, generator=gen)
    return (q, k, v, g, beta), A_log, dt_bias


def test_frozen_and_resolved():
    (q, k, v, g, beta), A_log, dt_bias = _inputs()
    opts = kda_options(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.scale = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.gate = GATE_NONE
    assert opts.scale == 16 ** -0.5 and isinstance(opts.scale, float)
    assert (opts.shape.B, opts.shape.T, opts.shape.H, opts.shape.HV, opts.shape.K, opts.shape.N) == (1, 20, 1, 2, 16, 1)
    assert opts.has_A_log and opts.has_dt_bias
    # hashable: a cache key, and safe to keep on an autograd ctx
    assert hash(opts) == hash(kda_options(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias))


@pytest.mark.parametrize("gate_in_kernel,lower_bound,safe_gate,gate,safe,kernel_lb", [
    (False, None, False, GATE_NONE, False, 0.0),
    (False, -3.0, False, GATE_NONE, False, 0.0),  # FLA reads lower_bound only for the in-kernel gate
    (True, None, False, GATE_SOFTPLUS, False, 0.0),
    (True, -3.0, False, GATE_LOWER_BOUND, True, -3.0),  # a bound >= -5 gives the SAFE path by itself
    (True, -7.0, False, GATE_LOWER_BOUND, False, -7.0),
    (True, -5, True, GATE_LOWER_BOUND, True, -5.0),
])
def test_gate_encodings(gate_in_kernel, lower_bound, safe_gate, gate, safe, kernel_lb):
    (q, k, v, g, beta), A_log, dt_bias = _inputs()
    opts = kda_options(q, k, v, g, beta, use_gate_in_kernel=gate_in_kernel, lower_bound=lower_bound,
                       safe_gate=safe_gate, A_log=A_log, dt_bias=dt_bias)
    assert opts.gate == gate and opts.safe == safe
    assert opts.kernel_lower_bound == kernel_lb and isinstance(opts.kernel_lower_bound, float)
    assert opts.lower_bound == (lower_bound if gate_in_kernel else None)
    assert opts.has_A_log == opts.has_dt_bias == gate_in_kernel
    cx = opts.chunk_constexprs()
    assert (cx["GATE"], cx["SAFE"], cx["HAS_A"], cx["HAS_BIAS"]) == (gate, safe, gate_in_kernel, gate_in_kernel)
    assert opts.intra_constexprs()["GATE"] == opts.recurrent_constexprs()["GATE"] == gate


@pytest.mark.parametrize("sigmoid,neg,beta,neg_eigval", [
    (False, False, BETA_RAW, False), (True, False, BETA_SIGMOID, False), (True, True, BETA_SIGMOID_X2, True),
])
def test_beta_encodings(sigmoid, neg, beta, neg_eigval):
    (q, k, v, g, b), _, _ = _inputs()
    opts = kda_options(q, k, v, g, b, use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=neg, state_v_first=True,
                       use_qk_l2norm_in_kernel=True)
    assert opts.beta == beta and opts.neg_eigval == neg_eigval
    assert opts.recurrent_constexprs() == dict(L2NORM=True, GATE=GATE_NONE, HAS_A=False, HAS_BIAS=False, BETA=beta,
                                               STATE_V_FIRST=True)
    assert opts.intra_constexprs()["NEG_EIGVAL"] == opts.chunk_constexprs()["NEG_EIGVAL"] == neg_eigval


def test_validation_errors_are_validate_kda_inputs():
    (q, k, v, g, beta), _, _ = _inputs()
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"):
        kda_options(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(TypeError, match="scale must be a float or None"):
        kda_options(q, k, v, g, beta, scale="1")
    # without validation (a prepared CUDA-graph capture): sizes from metadata only, no offsets read
    cu = torch.tensor([0, 5, 20])
    opts = kda_options(q, k, v, g, beta, cu_seqlens=cu, validate=False)
    assert opts.shape.N == 2 and opts.shape.seqlens is None


def _count_builds(monkeypatch):
    """Count KDAOptions constructions (each computes the encodings once, in __post_init__)."""
    built = []
    post_init = KDAOptions.__post_init__

    def counting(self):
        built.append(self)
        post_init(self)

    monkeypatch.setattr(KDAOptions, "__post_init__", counting)
    return built


def _record(monkeypatch, module, name, seen):
    """Wrap module.name so that each call records the ``opts`` it was given."""
    fn = getattr(module, name)

    def wrapped(*args, **kwargs):
        seen.append((name, kwargs["opts"]))
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("gate,H", [(False, 1), (True, 2)])
def test_chunk_launchers_take_the_one_object(monkeypatch, gate, H):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    (q, k, v, g, beta), A_log, dt_bias = _inputs(T=40, H=H)  # H == HV: the backward's lean window stages
    if not gate:
        g = -torch.rand_like(g)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    built, seen = _count_builds(monkeypatch), []
    for module, name in ((chunk_triton, "chunk_kda_fwd"), (chunk_fwd, "chunk_kda_fwd_intra"),
                         (chunk_triton, "chunk_kda_bwd"), (chunk_bwd, "run_windowed"),
                         (chunk_bwd_windowed, "run_lean_window_states")):
        _record(monkeypatch, module, name, seen)
    o, final = chunk_kda(*leaves, use_gate_in_kernel=gate, A_log=A_log if gate else None,
                         dt_bias=dt_bias if gate else None, lower_bound=-4.0 if gate else None,
                         use_qk_l2norm_in_kernel=True, output_final_state=True, pipeline="windowed16")
    (o.sum() + final.sum()).backward()
    assert len(built) == 1, "the options are decided once per call"
    names = {n for n, _ in seen}
    assert names == {"chunk_kda_fwd", "chunk_kda_fwd_intra", "chunk_kda_bwd", "run_windowed"} | (
        {"run_lean_window_states"} if H == 2 else set())
    assert all(opts is built[0] for _, opts in seen)


@pytest.mark.parametrize("gate", [False, True])
def test_chunk64_stages_take_the_one_object(monkeypatch, gate):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    (q, k, v, g, beta), A_log, dt_bias = _inputs(T=70, H=2)
    if not gate:
        g = -torch.rand_like(g)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    built, seen = _count_builds(monkeypatch), []
    for name in ("chunk_fwd", "chunk_bwd"):
        _record(monkeypatch, chunk64_autograd, name, seen)
    o, final = chunk_kda(*leaves, use_gate_in_kernel=gate, A_log=A_log if gate else None,
                         dt_bias=dt_bias if gate else None, use_qk_l2norm_in_kernel=True,
                         output_final_state=True, pipeline="chunk64")
    (o.sum() + final.sum()).backward()
    assert len(built) == 1, "the options are decided once per call"
    assert [n for n, _ in seen] == ["chunk_fwd", "chunk_bwd"]
    assert all(opts is built[0] for _, opts in seen)


def test_recurrent_launchers_take_the_one_object(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    (q, k, v, g, beta), A_log, dt_bias = _inputs(T=12)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    built, seen = _count_builds(monkeypatch), []
    for module, name in ((fused_recurrent, "launch_recurrent_forward"), (fused_recurrent, "run_recurrent_backward"),
                         (recurrent_backward, "launch_recurrent_backward"),
                         (recurrent_backward, "launch_segmented_backward"),
                         (recurrent_backward_kernels, "launch_recurrent_forward")):
        _record(monkeypatch, module, name, seen)
    o, final = fused_recurrent_kda(*leaves, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, output_final_state=True)
    (o.sum() + final.sum()).backward()
    assert len(built) == 1, "the options are decided once per call"
    assert [n for n, _ in seen] == ["launch_recurrent_forward", "run_recurrent_backward",
                                    "launch_recurrent_backward", "launch_recurrent_forward"]
    assert all(opts is built[0] for _, opts in seen)
    # the segmented backward (sequences longer than segment_tokens) hands the same object to every segment
    built.clear()
    seen.clear()
    for name in ("launch_recurrent_forward", "launch_recurrent_backward"):
        _record(monkeypatch, recurrent_backward_segmented, name, seen)
    recurrent_backward.recurrent_kda_backward(q, k, v, g, beta, torch.randn_like(v), A_log=A_log, dt_bias=dt_bias,
                                              use_gate_in_kernel=True, segment_tokens=5)
    names = [n for n, _ in seen]
    assert len(built) == 1
    assert names[0] == "launch_segmented_backward" and names.count("launch_recurrent_backward") == 3  # 12 / 5
    assert all(opts is built[0] for _, opts in seen)


def test_lower_bound_has_one_kernel_form():
    assert options.kernel_lower_bound(None) == 0.0
    assert options.kernel_lower_bound(-5) == -5.0 and isinstance(options.kernel_lower_bound(-5), float)


def test_decode_and_serving_launch_the_one_object(monkeypatch):
    """kda_decode and fused_recurrent_kda's serving arguments: one object per call, handed to the pool kernel's
    launcher whole (its encodings are the object's, not re-derived from loose options)."""
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    (q, k, v, g, beta), A_log, dt_bias = _inputs(B=3, T=1)
    built, seen = _count_builds(monkeypatch), []
    launch = decode.launch_pool_recurrent

    def wrapped(q, k, v, g, beta, o, opts, **kw):
        seen.append(opts)
        return launch(q, k, v, g, beta, o, opts, **kw)

    monkeypatch.setattr(decode, "launch_pool_recurrent", wrapped)
    pool = torch.randn(4, 2, 16, 16)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32)
    kda_decode(q, k, v, g, beta, pool, idx, A_log=A_log.view(2, 1), dt_bias=dt_bias.view(2, 16),
               use_gate_in_kernel=True, lower_bound=-4.0, use_beta_sigmoid_in_kernel=True)
    assert len(built) == 1 and seen == built
    assert (seen[0].state_v_first, seen[0].gate, seen[0].kernel_lower_bound) == (True, GATE_LOWER_BOUND, -4.0)
    built.clear()
    seen.clear()
    with torch.no_grad():
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool.clone(), ssm_state_indices=idx,
                            inplace_final_state=True, state_v_first=True, use_gate_in_kernel=True, A_log=A_log,
                            dt_bias=dt_bias)
    assert len(built) == 1 and seen == built
    assert (seen[0].gate, seen[0].has_A_log, seen[0].has_dt_bias) == (GATE_SOFTPLUS, True, True)


def test_kernel_gate_params_flattens_views_or_drops_them_without_the_gate():
    (q, k, v, g, beta), A_log, dt_bias = _inputs()
    A2, b2 = A_log.view(2, 1), dt_bias.view(2, 16)
    opts = kda_options(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A2, dt_bias=b2, engine_gate_shapes=True)
    a, b = opts.kernel_gate_params(A2, b2)
    assert a.shape == (2,) and b.shape == (32,) and a.data_ptr() == A2.data_ptr() and b.data_ptr() == b2.data_ptr()
    plain = kda_options(q, k, v, g, beta, A_log=A2, dt_bias=b2, engine_gate_shapes=True)
    assert plain.kernel_gate_params(A2, b2) == (None, None)
