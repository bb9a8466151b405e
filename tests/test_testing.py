"""kdakit.testing: random inputs say the seed they came from, and a failed comparison names it."""

from __future__ import annotations

import pytest
import torch

from kdakit.ops.kda.naive import naive_recurrent_kda
from kdakit.testing import compare_with_naive, make_kda_inputs


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
