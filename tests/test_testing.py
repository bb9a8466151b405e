"""kdakit.testing: random inputs say the seed they came from, and a failed comparison names it."""

from __future__ import annotations

import pytest
import torch

from kdakit import chunk_kda
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import SPEC_RMS_LIMITS, compare_with_naive, make_kda_inputs


def test_unseeded_inputs_record_the_seed_that_reproduces_them():
    inp = make_kda_inputs(T=8, H=1, K=4, V=4)
    assert isinstance(inp["seed"], int)
    again = make_kda_inputs(T=8, H=1, K=4, V=4, generator=torch.Generator().manual_seed(inp["seed"]))
    assert again["seed"] is None  # the caller's generator: the caller knows its seed
    for name, x in inp["tensors"].items():
        assert torch.equal(x, again["tensors"][name]), name


def test_a_failed_comparison_names_the_inputs_seed():
    inp = make_kda_inputs(T=8, H=1, K=4, V=4, gate="safe")

    def off_by_ten_percent(*args, **kwargs):
        o, ht = naive_recurrent_kda(*args, **kwargs)
        return 1.1 * o, ht

    with pytest.raises(AssertionError, match=rf"^o: .* \(inputs drawn with make_kda_inputs seed {inp['seed']}\)$"):
        compare_with_naive(off_by_ten_percent, inp, 1e-3)
    seeded = make_kda_inputs(T=8, H=1, K=4, V=4, gate="safe", generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError) as failure:
        compare_with_naive(off_by_ten_percent, seeded, 1e-3)
    assert "seed" not in str(failure.value)


def _bf16_valued_one_head(seed):
    """bf16 inputs with one value head, where dA_log is one cancelling sum: drawn so that a float64 dO read
    dA_log's RMS ratio near 0.09 (limit 0.008) although the path and the reference agree given one dO."""
    return make_kda_inputs(T=64, H=1, HV=1, K=64, V=64, dtype=torch.bfloat16, gate="safe", initial_state="kv",
                           generator=torch.Generator().manual_seed(seed))


def test_the_reference_differentiates_the_cotangent_the_path_got():
    # A path that is the float64 definition with its output rounded to bf16: given the same (bf16) dO, its
    # float32 gate-parameter gradients equal the reference's up to their float32 rounding. The reference used to get
    # the unrounded float64 dO, so the comparison measured dO's rounding (dA_log ratio 0.09).
    def definition_with_bf16_output(*args, **kwargs):
        o, ht = naive_recurrent_kda(*(x.double() for x in args),
                                    **{n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point()
                                           else x) for n, x in kwargs.items()})
        return o.to(torch.bfloat16), ht.float()

    limits = dict(SPEC_RMS_LIMITS, dA_log=1e-6, ddt_bias=1e-6)
    compare_with_naive(definition_with_bf16_output, _bf16_valued_one_head(10), limits)


def test_bf16_chunk_path_meets_spec_accuracy_with_one_value_head(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    got = compare_with_naive(chunk_kda, _bf16_valued_one_head(10), SPEC_RMS_LIMITS)
    assert got["dA_log"].dtype == torch.float32
