"""Non-finite inputs on the GPU (docs/spec.md §2.7): a NaN gate propagates through every compiled op as it
does on the CPU paths. The interpreter cannot show the difference this guards: its tl.minimum is numpy's,
which propagates NaN, while sm_90's min.f32 returns the other operand, so the recurrent kernels' former
softplus, log(1 + exp(min(x, 20))), turned a NaN gate into a finite decay on the GPU only."""

from __future__ import annotations

import pytest
import torch

from kdakit import chunk_kda, fused_recurrent_kda, kda_decode
from kdakit.testing import make_kda_inputs

pytestmark = pytest.mark.gpu

N, T, BAD_SEQ, BAD_TOKEN = 3, 40, 1, 21


def _inputs(T_=T):
    inp = make_kda_inputs(B=N, T=T_, H=2, K=64, V=64, dtype=torch.bfloat16, gate="softplus", device="cuda",
                          generator=torch.Generator().manual_seed(6))
    t = {n: x.detach().clone() for n, x in inp["tensors"].items()}
    t["g"][BAD_SEQ, min(BAD_TOKEN, T_ - 1)] = float("nan")
    return t, dict(inp["kwargs"])


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_nan_softplus_gate_propagates(op):
    t, kw = _inputs()
    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    o, final = fn(**t, **kw, output_final_state=True)
    bad = o[BAD_SEQ].isnan().flatten(1).any(1)
    assert bad[BAD_TOKEN:].all() and not bad[:16].any()
    assert final[BAD_SEQ].isnan().any()
    assert torch.isfinite(o[[0, 2]]).all() and torch.isfinite(final[[0, 2]]).all()


def test_nan_softplus_gate_in_a_decode_step():
    t, kw = _inputs(T_=1)
    kw.pop("safe_gate", None)
    pool = torch.randn(N, 2, 64, 64, device="cuda")
    idx = torch.arange(N, device="cuda", dtype=torch.int32)
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"], **kw)
    assert o[BAD_SEQ].isnan().all() and pool[BAD_SEQ].isnan().any()
    assert torch.isfinite(o[[0, 2]]).all() and torch.isfinite(pool[[0, 2]]).all()


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_nan_softplus_gate_gradient_is_nan_in_its_sequence_only(op):
    """The backward on the GPU: the NaN entry's own dg is NaN (the chunk backward's floor test is false for NaN
    on sm_90 as in the interpreter) and the other sequences' token gradients are finite."""
    t, kw = _inputs()
    for x in t.values():
        x.requires_grad_(True)
    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    o, _ = fn(**t, **kw, output_final_state=True)
    o.backward(torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(o.dtype))
    assert t["g"].grad[BAD_SEQ, BAD_TOKEN].isnan().all()
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.isfinite(t[name].grad[[0, 2]]).all(), f"a NaN reached another sequence's d{name}"
