"""CPU tier of the experimental 64-token chunk pipeline (``KDAKIT_CHUNK_PIPELINE=chunk64``: ``chunk_prep64.py``,
``chunk_fwd64.py``, ``chunk_bwd64.py``) on the Triton interpreter: the public chunk_kda's outputs and gradients
against the float64 naive definition over the option matrix (fp32: round-off only), sequences
that span several 64-token chunks, several V blocks, GVA, both state layouts; bf16 within the
docs/spec.md §8 limits; the selector's error; reset-level log-decays on both pipelines."""

import pytest
import torch

import kdakit.ops.kda.chunk_bwd64 as B64
import kdakit.ops.kda.chunk_fwd64 as F64
from kdakit import chunk_kda
from kdakit.ops.kda.backend import triton_interpreting
from kdakit.testing import (SPEC_RMS_LIMITS, assert_close, compare_with_naive, make_kda_inputs, run_kda,
                            set_token_options)

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
# fp32 kernels vs float64, measured 5e-7 to 9e-6 (exact fp32 dots under the interpreter); 5x headroom.
FP32_LIMIT = 5e-5


@pytest.fixture(autouse=True)
def _chunk64(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    monkeypatch.setenv("KDAKIT_CHUNK_PIPELINE", "chunk64")


def _compare(inp, limit=FP32_LIMIT, **extra):
    return compare_with_naive(chunk_kda, inp, {n: limit for n in SPEC_RMS_LIMITS}, **extra)


@pytest.mark.parametrize("gate,l2norm,beta_mode", [
    ("safe", True, "sigmoid"), ("softplus", True, "sigmoid"), ("none", False, "raw"),
    ("safe_no_alog", True, "neg_eigval"), ("softplus", False, "neg_eigval"),
])
def test_options_match_naive(gate, l2norm, beta_mode):
    gen = torch.Generator().manual_seed(7)
    # 0 and 1-token sequences, a partial chunk, a sequence over two chunks
    inp = make_kda_inputs(T=150, H=1, HV=1, K=16, V=16, dtype=torch.float32, gate=gate, seqlens=[70, 0, 1, 79],
                          initial_state="kv", generator=gen)
    set_token_options(inp, l2norm=l2norm, beta_mode=beta_mode)
    _compare(inp)


@pytest.mark.parametrize("pipeline", ["chunk64", "windowed"])
def test_reset_level_log_decays(monkeypatch, pipeline):
    # Both pipelines clamp log-decays of -1000 to LOG_DECAY_FLOOR on load, and their backwards' gate gradient is 0
    # where the clamp holds (chunk_common.gate_log_decay_bwd_floored): the float64 gradient, exp(-1000) times
    # anything. The 16-token (windowed) gradient stage once took the unclamped decay: dg 7.2e-5 against float64
    # (max 2.0e-7 at the reset tokens), dk 4.5e-5, dv 4.9e-5; clamped: 6.1e-6, 5.2e-6, 7.7e-6 (chunk64: 1.1e-5,
    # 9.4e-6, 7.1e-6; the two agree within 1.2e-5).
    monkeypatch.setenv("KDAKIT_CHUNK_PIPELINE", pipeline)
    gen = torch.Generator().manual_seed(13)
    inp = make_kda_inputs(T=100, H=1, HV=1, K=16, V=16, dtype=torch.float32, gate="none", seqlens=[70, 30],
                          initial_state="kv", reset_tokens=0.2, generator=gen)
    got = _compare(inp)
    reset = inp["tensors"]["g"].detach() == -1000.0
    assert reset.any()
    assert torch.equal(got["dg"][reset], torch.zeros_like(got["dg"][reset]))
    # A log-decay of -inf (docs/spec.md §2.7: it forgets the state) loads as the same floor: the same bits. (The
    # unclamped 16-token gradient stage gave NaN gradients there: exp(G_i - G_j) of two infinite cumsums.)
    g = inp["tensors"]["g"].detach()
    forget = dict(inp, tensors=dict(inp["tensors"], g=torch.where(reset, float("-inf"), g).requires_grad_()))
    for name, x in run_kda(chunk_kda, forget).items():
        if x is not None:
            assert torch.equal(x, got[name]), name
    if pipeline == "windowed":  # and the two pipelines agree
        monkeypatch.setenv("KDAKIT_CHUNK_PIPELINE", "chunk64")
        other = run_kda(chunk_kda, inp)
        for name, x in got.items():
            if x is not None:
                assert_close(f"{name}: windowed vs chunk64", other[name], x, FP32_LIMIT)


def test_gva_value_first_state_several_v_blocks(monkeypatch):
    # V = 48 in 16-column steps of the gradient kernel, the serial passes and the forward; 2 value heads per q/k head
    monkeypatch.setattr(B64, "GRADS_BLOCK_V", 16)
    monkeypatch.setattr(B64, "STATES_BLOCK_V", 16)
    monkeypatch.setattr(F64, "STATE_BLOCK_V", 16)
    gen = torch.Generator().manual_seed(3)
    inp = make_kda_inputs(T=140, H=1, HV=2, K=32, V=48, dtype=torch.float32, gate="safe", seqlens=[70, 70],
                          initial_state="vk", generator=gen)
    _compare(inp)


def test_fixed_length_batch_without_initial_state():
    gen = torch.Generator().manual_seed(5)
    inp = make_kda_inputs(B=2, T=65, H=2, HV=2, K=16, V=16, dtype=torch.float32, gate="softplus", generator=gen)
    _compare(inp)


def test_bf16_within_spec_limits():
    seed = 11
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    inp = make_kda_inputs(T=300, H=4, HV=4, K=32, V=32, dtype=torch.bfloat16, gate="safe", seqlens=[100, 200],
                          initial_state="kv", generator=gen)
    compare_with_naive(chunk_kda, inp, SPEC_RMS_LIMITS)


def test_unknown_chunk_pipeline_raises(monkeypatch):
    monkeypatch.setenv("KDAKIT_CHUNK_PIPELINE", "fast")
    inp = make_kda_inputs(T=20, H=1, K=16, V=16, dtype=torch.float32, gate="safe")
    with pytest.raises(ValueError, match="KDAKIT_CHUNK_PIPELINE must be one of"):
        chunk_kda(**inp["tensors"], **inp["kwargs"])
