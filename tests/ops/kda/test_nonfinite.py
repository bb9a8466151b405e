"""Non-finite inputs (issue #11 item 4): not checked, propagated, the same way on both backends.

A check would read device tensors (a host sync on every call), so the ops leave NaN in the token inputs to
propagate (docs/spec.md §2.7): the outputs of the sequence that holds it are NaN from that token on (the
chunked paths may also reach the earlier tokens of its chunk; a NaN in q only its own token's output) and
the other sequences are untouched. The
unbounded softplus gate's NaN took a different path in the recurrent kernels (their softplus clamped NaN
to 20 and returned a finite decay) until both kernel families shared one softplus.
"""

from __future__ import annotations

import pytest
import torch

from kdakit import chunk_kda, fused_recurrent_kda, kda_decode
from kdakit.testing import make_kda_inputs

# a 64-token chunk and a 16-token one before the bad token's, so earlier chunks of either pipeline stay finite
N, T, BAD_SEQ, BAD_TOKEN = 3, 100, 1, 85
# the recurrent ops have no chunks: a shorter sequence (the interpreter's cost grows with T), still with tokens
# before the bad one and after it
T_RECURRENT, BAD_TOKEN_RECURRENT = 24, 13
# the gradient checks hold within one sequence's chunks, whatever their count: one 64-token chunk a sequence
# (two of the 16-token pipeline), the bad token past the first 16
T_GRAD, BAD_TOKEN_GRAD = 40, 25


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def _inputs(gate, name, seed=3, T=T, bad_token=BAD_TOKEN):
    # one head: the NaN fills the bad token's every head, so more heads would only repeat it
    inp = make_kda_inputs(B=N, T=T, H=1, K=16, V=16, dtype=torch.float32, gate=gate,
                          generator=torch.Generator().manual_seed(seed))
    t = {n: x.detach().clone() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    t[name][BAD_SEQ, bad_token].fill_(float("nan"))
    return t, kw


def _assert_propagated(o, first_nan_token_at_most, into_state=True, bad_token=BAD_TOKEN):
    """NaN in every output of the bad sequence from the bad token on (only at it when the NaN input does not
    enter the state: q), nowhere in the other sequences, and none before ``first_nan_token_at_most``."""
    bad = o[BAD_SEQ].isnan().flatten(1).any(1)  # [T]: a NaN in token t's output
    if into_state:
        assert bad[bad_token:].all(), f"finite outputs after the NaN token: {(~bad[bad_token:]).nonzero().flatten()}"
    else:
        assert bad[bad_token] and not bad[bad_token + 1:].any(), f"NaN outputs: {bad.nonzero().flatten()}"
    assert not bad[:first_nan_token_at_most].any(), f"NaN before token {first_nan_token_at_most}"
    others = [n for n in range(N) if n != BAD_SEQ]
    assert torch.isfinite(o[others]).all(), "a NaN in one sequence reached another"


@pytest.mark.parametrize("gate,name", [("softplus", "g"), ("safe", "g"), ("softplus", "q"), ("none", "v"),
                                       ("softplus", "beta")])
def test_chunk_kda_propagates_nan(backend, gate, name):
    t, kw = _inputs(gate, name)
    o, final = chunk_kda(**t, **kw, output_final_state=True)
    # the chunked paths may reach the earlier tokens of the bad token's chunk: 64 tokens on the Triton
    # pipeline of the unbounded gates (their default), 16 on the 16-token one and the PyTorch path's default
    chunk = 64 if backend == "triton" and gate != "safe" else 16
    _assert_propagated(o, BAD_TOKEN // chunk * chunk, into_state=name != "q")
    if name == "q":  # q reaches its own token's output only
        assert torch.isfinite(final).all()
    else:
        assert final[BAD_SEQ].isnan().any() and torch.isfinite(final[[0, 2]]).all()


@pytest.mark.parametrize("gate,name", [("softplus", "g"), ("safe", "g"), ("softplus", "k"), ("none", "beta")])
def test_fused_recurrent_kda_propagates_nan(backend, gate, name):
    t, kw = _inputs(gate, name, T=T_RECURRENT, bad_token=BAD_TOKEN_RECURRENT)
    o, final = fused_recurrent_kda(**t, **kw, output_final_state=True)
    _assert_propagated(o, BAD_TOKEN_RECURRENT, bad_token=BAD_TOKEN_RECURRENT)
    assert final[BAD_SEQ].isnan().any() and torch.isfinite(final[[0, 2]]).all()


@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_kda_decode_propagates_nan_gate_to_its_row_only(backend, gate):
    inp = make_kda_inputs(B=N, T=1, H=2, K=16, V=16, dtype=torch.float32, gate=gate,
                          generator=torch.Generator().manual_seed(4))
    t = {n: x.detach().clone() for n, x in inp["tensors"].items()}
    kw = {n: x for n, x in inp["kwargs"].items() if n != "safe_gate"}
    t["g"][BAD_SEQ, 0].fill_(float("nan"))
    pool = torch.randn(N + 1, 2, 16, 16, generator=torch.Generator().manual_seed(5))
    before = pool.clone()
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t.get("A_log"),
                   dt_bias=t.get("dt_bias"), safe_gate=inp["kwargs"].get("safe_gate", False), **kw)
    assert o[BAD_SEQ].isnan().all() and torch.isfinite(o[[0, 2]]).all()
    assert pool[0].isnan().any(), "the bad sequence's row (0) holds its NaN state"
    assert torch.isfinite(pool[[1, 3]]).all() and torch.equal(pool[2], before[2])


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("gate", ["softplus", "safe", "none"])
def test_nan_gate_gradient_is_nan_and_stays_in_its_sequence(backend, op, gate):
    """Backward of a NaN gate entry: its own dg is NaN (the chunk kernels' log-decay floor once zeroed it, while
    the PyTorch path and the recurrent kernels gave NaN), and the other sequences' token gradients are finite."""
    bad_token = BAD_TOKEN_GRAD if op == "chunk" else BAD_TOKEN_RECURRENT
    t, kw = _inputs(gate, "g", T=T_GRAD if op == "chunk" else T_RECURRENT, bad_token=bad_token)
    for x in t.values():
        x.requires_grad_(True)
    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    o, _ = fn(**t, **kw, output_final_state=True)
    o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(1)))
    assert t["g"].grad[BAD_SEQ, bad_token].isnan().all(), t["g"].grad[BAD_SEQ, bad_token]
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.isfinite(t[name].grad[[0, 2]]).all(), f"a NaN reached another sequence's d{name}"
