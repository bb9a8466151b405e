"""Property-based tests of ``chunk_kda`` (the PyTorch path): random shapes and options against the
float64 definition, the state pool, and random invalid inputs. The shared cases, helpers and
settings are in _properties_common.py (its docstring says how the examples are drawn).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kdakit import chunk_kda
from kdakit.testing import assert_close

pytest.register_assert_rewrite(__package__ + "._properties_common")  # its asserts report as a test module's do

from . import _properties_common as _common
from ._properties_common import (DTYPES, GRAD_ROUNDING_LIMIT, LIMITS, _call, _case_id, _naive, _settings,
                                 _state_corruptions, _token_corruptions, cases, check_against_definition,
                                 expect_refusal, invalid_bases, itertools_accumulate, make_inputs)


_default_backend = _common.default_backend  # autouse: bound in this module, it applies to its tests


# ---------------------------------------------------------------------------------------------
# chunk_kda
# ---------------------------------------------------------------------------------------------

@_settings(25)
@given(c=cases(dtypes=("float64", "float64", "float32", "bfloat16")), chunk_size=st.sampled_from((None, 16, 32, 64)),
       cadence=st.sampled_from((None, 1, 2)), host_offsets=st.booleans())
def test_chunk_kda_matches_the_definition(c, chunk_size, cadence, host_offsets):
    """chunk_kda (the PyTorch path) forward and backward against the float64 definition, for any
    shape (T = 0, empty packed sequences, K, V not powers of two, GVA), gate, state layout,
    chunk size and checkpoint cadence."""
    extra = {"chunk_size": chunk_size}
    if cadence is not None:
        extra["checkpoint_every_n_tokens"] = cadence * max(16, chunk_size or 16)
    if host_offsets and c.seqlens is not None:
        extra["cu_seqlens_cpu"] = torch.tensor([0, *itertools_accumulate(c.seqlens)], dtype=torch.int32)
    check_against_definition(c, chunk_kda, **extra)


@st.composite
def pool_cases(draw, *, max_tokens=4, max_seqs=4, dtypes=("float64", "float32")):
    c = draw(cases(dtypes=dtypes, max_T=max_tokens, max_B=max_seqs, max_seqs=max_seqs, dims=(1, 4, 8, 12),
                   states=(None,)))
    P = c.N + draw(st.integers(0, 3))
    rows = draw(st.permutations(range(P)))[:c.N]
    padded = draw(st.lists(st.booleans(), min_size=c.N, max_size=c.N))
    idx = tuple(-1 if p else r for r, p in zip(rows, padded))
    return c, P, idx


@_settings(12)
@given(pc=pool_cases(), v_first=st.booleans(), pool_dtype=st.sampled_from(("float32", "float64")))
def test_chunk_kda_state_pool_matches_the_definition(pc, v_first, pool_dtype):
    """chunk_kda(..., state_indices=...): sequence n starts from pool row idx[n] (zeros for -1, whose
    output is zero), the final states land in those rows, every other row keeps its bits."""
    c, P, idx = pc
    t, kw = make_inputs(c)
    kw["state_v_first"] = v_first
    gen = torch.Generator().manual_seed(c.seed + 1)
    inner = (c.HV, c.V, c.K) if v_first else (c.HV, c.K, c.V)
    pool = (0.5 * torch.randn(P, *inner, generator=gen, dtype=torch.float64)).to(DTYPES[pool_dtype])
    before = pool.clone()
    indices = torch.tensor(idx, dtype=torch.int32)
    o, _ = _call(chunk_kda, t, kw, state_indices=indices, initial_state=pool)
    h0 = torch.stack([before[i].double() if i >= 0 else torch.zeros(inner, dtype=torch.float64) for i in idx])
    d = {n: x.double() for n, x in t.items()}
    d["initial_state"] = h0
    ref_o, ref_final = _naive(d, dict(kw, output_final_state=True))
    cu = [0, *itertools_accumulate(c.seqlens)] if c.seqlens is not None else None
    for n, i in enumerate(idx):
        o_n = o[0, cu[n]:cu[n + 1]] if cu else o[n]
        r_n = ref_o[0, cu[n]:cu[n + 1]] if cu else ref_o[n]
        if i < 0:
            assert not o_n.abs().max().item() if o_n.numel() else True, f"padded sequence {n} has nonzero output"
        elif o_n.numel():
            assert_close(f"o[{n}]", r_n, o_n, LIMITS[c.dtype]["o"])
    written = {i for i in idx if i >= 0}
    for p in range(P):
        if p in written:
            n = idx.index(p)
            lim = max(LIMITS[c.dtype]["final_state"], GRAD_ROUNDING_LIMIT.get(pool.dtype, 0.0))  # stored rounded
            assert_close(f"pool[{p}]", ref_final[n], pool[p], lim)
        else:
            assert torch.equal(pool[p], before[p]), f"pool row {p} (no sequence's) was modified"


# ---------------------------------------------------------------------------------------------
# Invalid inputs
# ---------------------------------------------------------------------------------------------

CHUNK_CORRUPTIONS = _token_corruptions() + _state_corruptions() + [
    ("chunk_size", ValueError, "chunk_size", lambda t, kw, c, rnd: kw.update(chunk_size=rnd.choice((0, 8, 48, 128)))),
    ("checkpoint_every_n_tokens", ValueError, "checkpoint_every_n_tokens",
     lambda t, kw, c, rnd: kw.update(checkpoint_every_n_tokens=rnd.choice((0, -16, 8, 24, True, 16.0, "16")))),
    ("disable_recompute", ValueError, "disable_recompute", lambda t, kw, c, rnd: kw.update(disable_recompute=True)),
    ("use_graph", ValueError, "use_graph", lambda t, kw, c, rnd: kw.update(use_graph=True)),
    ("cu_seqlens_cpu-alone", ValueError, "cu_seqlens_cpu",
     lambda t, kw, c, rnd: (kw.pop("cu_seqlens", None), kw.update(cu_seqlens_cpu=torch.tensor([0, c.T])))),
    ("cu_seqlens_cpu-length", ValueError, "cu_seqlens_cpu",
     lambda t, kw, c, rnd: kw.update(cu_seqlens=torch.tensor([0, c.T]), cu_seqlens_cpu=torch.tensor([0, 0, c.T]))
     if c.B == 1 else kw.update(cu_seqlens_cpu=torch.tensor([0, c.T]))),
    ("state_indices-float", TypeError, "state_indices",
     lambda t, kw, c, rnd: kw.update(state_indices=torch.arange(c.N, dtype=torch.float32))),
    ("state_indices-range", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw.update(state_indices=torch.tensor([c.N + rnd.randint(0, 3)] + list(range(c.N - 1)),
                                                                dtype=torch.int32))),
    ("state_indices-below-minus-one", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw.update(state_indices=torch.tensor([-2] + list(range(c.N - 1)), dtype=torch.int32))),
    ("state_indices-shape", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw.update(state_indices=torch.arange(c.N + 1, dtype=torch.int32))),
    ("state_indices-without-pool", ValueError, "state_indices",
                  lambda t, kw, c, rnd: (t.pop("initial_state"),
                                         kw.update(state_indices=torch.tensor([c.N + 3] * c.N, dtype=torch.int32)))),
]


@pytest.mark.parametrize("corruption", CHUNK_CORRUPTIONS, ids=[_case_id(x) for x in CHUNK_CORRUPTIONS])
@_settings(3)
@given(base=invalid_bases())
def test_chunk_kda_refuses_invalid_inputs(corruption, base):
    """chunk_kda: each random invalid input raises ValueError/TypeError naming the argument; no input
    (the state pool included) is modified."""
    _, exc, name, mutate = corruption
    c, rnd = base
    t, kw = make_inputs(c)
    mutate(t, kw, c, rnd)
    expect_refusal(lambda: _call(chunk_kda, t, kw), exc, name, t, kw)


@st.composite
def duplicate_pool_rows(draw):
    c, rnd = draw(invalid_bases())
    return dataclasses.replace(c, B=max(c.B, 2)) if c.seqlens is None else c, rnd


@_settings(5)
@given(base=duplicate_pool_rows())
def test_chunk_kda_refuses_a_pool_row_shared_by_two_sequences(base):
    c, rnd = base
    if c.N < 2:
        c = dataclasses.replace(c, seqlens=(*c.seqlens, 0))
    t, kw = make_inputs(c)
    idx = list(range(c.N))
    i, j = rnd.sample(range(c.N), 2)
    idx[j] = idx[i]
    kw["state_indices"] = torch.tensor(idx, dtype=torch.int32)
    expect_refusal(lambda: _call(chunk_kda, t, kw), ValueError, "state_indices", t, kw)
