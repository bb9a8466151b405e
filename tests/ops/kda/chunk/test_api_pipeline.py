"""``chunk_kda(pipeline=...)``: the 64-token pipelines through the public op (Triton interpreter), the same answer
as the default pipeline and the PyTorch path, and the errors of options the pipelines do not take."""

import pytest
import torch

from kdakit import chunk_kda
from kdakit.nn.kda_layer import KimiDeltaAttention


def _inputs(seed=3, B=1, T=150, H=1, HV=2, K=32, V=16):
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
             v=torch.randn(B, T, HV, V, generator=gen), g=torch.randn(B, T, HV, K, generator=gen),
             beta=torch.randn(B, T, HV, generator=gen))
    A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen))
    dt_bias = torch.full((HV * K,), -3.0) + 0.5 * torch.randn(HV * K, generator=gen)
    return x, A_log, dt_bias


def _call(x, A_log, dt_bias, **kw):
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, ht = chunk_kda(**leaves, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, output_final_state=True,
                      cu_seqlens=torch.tensor([0, 70, 70, 150]), **kw)
    (o.square().sum() + ht.sum()).backward()
    return o.detach(), ht.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.slow
def test_pipeline_matches_the_default_pipeline(monkeypatch):
    """Both 64-token pipelines against the default pipeline's answer (Triton backend), computed once in this
    test (a fixture shared by two tests is computed once per xdist worker that runs one)."""
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    x, A_log, dt_bias = _inputs()
    ref = _call(x, A_log, dt_bias)
    for pipeline in ("chunk64", "chunk64_fast"):
        got = _call(x, A_log, dt_bias, pipeline=pipeline, checkpoint_every_n_tokens=64)
        for what, a, b in zip(("o", "ht"), ref[:2], got[:2]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (pipeline, what, (a - b).abs().max())
        for name, grad in ref[2].items():
            scale = grad.abs().max()
            assert (grad - got[2][name]).abs().max() <= 1e-4 * scale, (pipeline, name)


def test_pytorch_path_gives_the_same_answer_whatever_the_pipeline(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    x, A_log, dt_bias = _inputs()
    a = _call(x, A_log, dt_bias)
    b = _call(x, A_log, dt_bias, pipeline="chunk64_fast")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kw, match", [
    (dict(pipeline="chunk32"), "pipeline must be one of"),
    (dict(pipeline="chunk64", chunk_size=16), "chunk_size must be None or 64"),
    (dict(pipeline="chunk64_fast", checkpoint_every_n_tokens=32), "multiple of 64"),
])
def test_pipeline_errors_name_the_argument(kw, match):
    x, A_log, dt_bias = _inputs()
    with pytest.raises(ValueError, match=match):
        chunk_kda(**x, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, **kw)


def test_intermediate_states_need_the_default_pipeline():
    x, A_log, dt_bias = _inputs()
    with torch.inference_mode(), pytest.raises(ValueError, match="return_intermediate_states"):
        chunk_kda(**x, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, pipeline="chunk64",
                  return_intermediate_states=True)


def test_layer_checks_its_pipeline():
    with pytest.raises(ValueError, match="pipeline must be one of"):
        KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=2, pipeline="fast")
    assert KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=2, pipeline="chunk64").pipeline == "chunk64"
    with pytest.raises(ValueError, match="mode='chunk'"):
        KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=2, mode="fused_recurrent", pipeline="chunk64")
