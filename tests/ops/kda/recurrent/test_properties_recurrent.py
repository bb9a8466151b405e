"""Property-based tests of ``fused_recurrent_kda`` and ``kda_decode`` (the PyTorch path, and a few
examples on their Triton kernels under the interpreter): random shapes and options against the
float64 definition, and random invalid inputs. The shared cases, helpers and settings are in
_properties_common.py (its docstring says how the examples are drawn).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from kdakit import fused_recurrent_kda, kda_decode
from kdakit.testing import assert_close

pytest.register_assert_rewrite(__package__ + "._properties_common")  # its asserts report as a test module's do

from .. import _properties_common as _common
from .._properties_common import (DTYPES, POSITIONAL, _call, _grow, _naive, _settings, _state_corruptions,
                                 _token_corruptions, cases, check_against_definition, expect_refusal,
                                 invalid_bases, itertools_accumulate, make_inputs)


_default_backend = _common.default_backend  # autouse: bound in this module, it applies to its tests


# ---------------------------------------------------------------------------------------------
# fused_recurrent_kda
# ---------------------------------------------------------------------------------------------

@_settings(20)
@given(c=cases(dtypes=("float64", "float32", "bfloat16")), use_out=st.booleans())
def test_fused_recurrent_kda_matches_the_definition(c, use_out):
    """fused_recurrent_kda (the PyTorch path) forward and backward against the float64 definition;
    with out= the output is also written there."""
    if not use_out:
        check_against_definition(c, fused_recurrent_kda)
        return
    out = torch.full((c.B, c.T, c.HV, c.V), float("nan"), dtype=DTYPES[c.dtype])
    got = check_against_definition(c, fused_recurrent_kda, out=out)
    assert torch.equal(out, got["o"].detach())


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    from kdakit.ops.kda.backend import select_backend

    assert select_backend(torch.device("cpu")) == "triton"  # the CPU tier sets TRITON_INTERPRET=1


@_settings(5)
@given(c=cases(dtypes=("float32",), min_T=2, max_T=4, max_B=2, max_seqs=3, dims=(4, 12, 16), max_H=2, max_G=2),
       segment_tokens=st.integers(1, 3))
def test_fused_recurrent_kda_triton_matches_the_definition(triton_backend, c, segment_tokens):
    """The recurrent Triton kernels (interpreter), forward and segmented backward, against the definition."""
    got = check_against_definition(c, fused_recurrent_kda, segment_tokens=segment_tokens)
    if c.final:
        assert got["final_state"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# kda_decode
# ---------------------------------------------------------------------------------------------

@st.composite
def decode_cases(draw, *, dtypes=("float32", "float64"), min_tokens=1, max_tokens=3, max_seqs=4, dims=(1, 4, 8, 12)):
    c = draw(cases(dtypes=dtypes, min_T=min_tokens, max_T=2 * max_tokens, max_B=max_seqs, max_seqs=max_seqs,
                   dims=dims, states=(None,)))
    if c.seqlens is None and c.T == 0:
        c = dataclasses.replace(c, T=1)  # a fixed-length decode step carries T >= 1 tokens
    lengths = list(c.seqlens) if c.seqlens is not None else [c.T] * c.N
    per_token = draw(st.booleans())
    S = max(lengths, default=0) + draw(st.integers(0 if max(lengths, default=0) else 1, 1)) if per_token else 1
    cols = S if per_token else 1
    P = c.N * cols + draw(st.integers(0, 2))
    rows = list(draw(st.permutations(range(P))))
    idx = []
    for n in range(c.N):
        mine = rows[n * cols:(n + 1) * cols]
        holes = draw(st.lists(st.booleans(), min_size=cols, max_size=cols))
        idx.append([-1 if h else r for r, h in zip(mine, holes)])
    acc = [draw(st.integers(1, S)) for _ in range(c.N)] if per_token and draw(st.booleans()) else None
    return c, lengths, P, idx, per_token, acc, draw(st.sampled_from(("float32", "bfloat16")))


def check_decode(dc):
    c, lengths, P, idx, per_token, acc, pool_dtype = dc
    t, kw = make_inputs(c)
    note(f"torch seed {c.seed}")
    for n in ("output_final_state", "state_v_first"):
        kw.pop(n, None)
    gen = torch.Generator().manual_seed(c.seed + 1)
    pool = (0.5 * torch.randn(P, c.HV, c.V, c.K, generator=gen, dtype=torch.float64)).to(DTYPES[pool_dtype])
    before = pool.clone()
    indices = torch.tensor(idx, dtype=torch.int32) if per_token else torch.tensor([r[0] for r in idx], dtype=torch.int32)
    accepted = torch.tensor(acc, dtype=torch.int32) if acc is not None else None
    o = kda_decode(*(t[n] for n in POSITIONAL), pool, indices, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"),
                   num_accepted_tokens=accepted, **kw)
    assert o.shape == t["v"].shape and o.dtype == t["v"].dtype

    bf16 = pool_dtype == "bfloat16"
    lim = 0.03 if bf16 else 5e-5  # an fp32 pool: fp32 math (float64 tokens too: the stored states are fp32)
    cu = [0, *itertools_accumulate(lengths)]
    expected = before.clone()
    written = set()
    d = {n: x.double() for n, x in t.items()}
    for n in range(c.N):
        col = min(max(acc[n] - 1, 0), len(idx[n]) - 1) if acc is not None else 0
        slot = idx[n][col]
        span = (slice(0, 1), slice(cu[n], cu[n + 1])) if c.seqlens is not None else (slice(n, n + 1), slice(None))
        o_n = o[span]
        if slot < 0:
            assert not o_n.abs().max().item() if o_n.numel() else True, f"padded sequence {n} has nonzero output"
            continue
        tok = {name: x[span] for name, x in d.items() if name in POSITIONAL}
        tok.update({name: x for name, x in d.items() if name not in POSITIONAL})
        tok["initial_state"] = before[slot:slot + 1].double()
        nk = dict(kw, state_v_first=True, output_final_state=True)
        nk.pop("cu_seqlens", None)
        ref_o, ref_final = _naive(tok, nk)
        if o_n.numel():
            assert_close(f"o[{n}]", ref_o, o_n, lim)
        if per_token:
            for j in range(lengths[n]):
                w = idx[n][j]
                if w >= 0:
                    pre = {name: (x[:, :j + 1] if name in POSITIONAL else x) for name, x in tok.items()}
                    _, state_j = _naive(pre, nk)
                    expected[w] = state_j[0].to(pool.dtype)
                    written.add(w)
        else:
            expected[slot] = ref_final[0].to(pool.dtype)
            written.add(slot)
    for p in range(P):
        if p in written:
            assert_close(f"pool[{p}]", expected[p], pool[p], lim)
        else:
            assert torch.equal(pool[p], before[p]), f"pool row {p} (written by no token) was modified"


@_settings(20)
@given(dc=decode_cases())
def test_kda_decode_matches_the_definition(dc):
    """kda_decode (the PyTorch path): outputs against the definition from each sequence's pool row,
    the final (or per-token) states in their rows, padded sequences zero, other rows untouched."""
    check_decode(dc)


@_settings(5)
@given(dc=decode_cases(dtypes=("float32",), min_tokens=2, max_tokens=2, max_seqs=3, dims=(4, 12, 16)))
def test_kda_decode_triton_matches_the_definition(triton_backend, dc):
    """The decode Triton kernel (interpreter), same properties."""
    check_decode(dc)


# ---------------------------------------------------------------------------------------------
# Invalid inputs
# ---------------------------------------------------------------------------------------------

FUSED_CORRUPTIONS = _token_corruptions() + _state_corruptions() + [
    ("segment_tokens-zero", ValueError, "segment_tokens", lambda t, kw, c, rnd: kw.update(segment_tokens=rnd.choice((0, -3)))),
    ("segment_tokens-float", TypeError, "segment_tokens", lambda t, kw, c, rnd: kw.update(segment_tokens=1.5)),
    ("unknown-keyword", TypeError, "chunk_size", lambda t, kw, c, rnd: kw.update(chunk_size=16)),
    ("out-shape", ValueError, "out", lambda t, kw, c, rnd: kw.update(out=_grow(torch.zeros_like(t["v"]), 1))),
    ("out-dtype", (ValueError, TypeError), "out", lambda t, kw, c, rnd: kw.update(out=torch.zeros_like(t["v"]).double())),
    ("final_state_out-without-output_final_state", ValueError, "final_state_out",
     lambda t, kw, c, rnd: kw.update(output_final_state=False, final_state_out=torch.zeros_like(t["initial_state"]))),
    ("num_accepted_tokens-without-indices", ValueError, "num_accepted_tokens",
     lambda t, kw, c, rnd: kw.update(num_accepted_tokens=torch.ones(c.N, dtype=torch.int32))),
]


@pytest.mark.parametrize("corruption", FUSED_CORRUPTIONS, ids=[x[0] for x in FUSED_CORRUPTIONS])
@_settings(3)
@given(base=invalid_bases())
def test_fused_recurrent_kda_refuses_invalid_inputs(corruption, base):
    """fused_recurrent_kda: the same contract."""
    _, exc, name, mutate = corruption
    c, rnd = base
    t, kw = make_inputs(c)
    mutate(t, kw, c, rnd)
    expect_refusal(lambda: _call(fused_recurrent_kda, t, kw), exc, name, t, kw)


def _decode_call(t, kw):
    extra = {n: kw[n] for n in ("state_pool", "state_indices") if n in kw}
    rest = {n: x for n, x in kw.items() if n not in ("state_pool", "state_indices", "output_final_state",
                                                       "state_v_first")}
    return kda_decode(*(t[n] for n in POSITIONAL), extra.get("state_pool"), extra.get("state_indices"),
                      A_log=t.get("A_log"), dt_bias=t.get("dt_bias"), **rest)


def _per_token(kw, c, S):
    """Turn the base's [N] indices into [N, S] ones (rows N.. of the pool, which has room)."""
    kw["state_indices"] = torch.arange(c.N * S, dtype=torch.int32).view(c.N, S)


DECODE_CORRUPTIONS = [x for x in _token_corruptions() if not x[0].startswith("cu_seqlens")] + [
    ("state_pool-fp64", TypeError, "state_pool", lambda t, kw, c, rnd: kw.update(state_pool=kw["state_pool"].double())),
    ("state_pool-list", TypeError, "state_pool", lambda t, kw, c, rnd: kw.update(state_pool=kw["state_pool"].tolist())),
    ("state_pool-layout", ValueError, "state_pool",  # K-major [P, HV, K, V], K != V
     lambda t, kw, c, rnd: kw.update(state_pool=kw["state_pool"].transpose(-1, -2).contiguous())),
    ("state_pool-3d", ValueError, "state_pool", lambda t, kw, c, rnd: kw.update(state_pool=kw["state_pool"][0])),
    ("state_indices-float", TypeError, "state_indices",
     lambda t, kw, c, rnd: kw.update(state_indices=kw["state_indices"].float())),
    ("state_indices-range", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw["state_indices"].__setitem__(rnd.randrange(c.N), kw["state_pool"].shape[0] + rnd.randint(0, 2))),
    ("state_indices-below-minus-one", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw["state_indices"].__setitem__(rnd.randrange(c.N), rnd.choice((-2, -7)))),
    ("state_indices-duplicate", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw["state_indices"].__setitem__(1, kw["state_indices"][0].item())),
    ("state_indices-length", ValueError, "state_indices",
     lambda t, kw, c, rnd: kw.update(state_indices=torch.arange(c.N + 1, dtype=torch.int32))),
    ("state_indices-too-few-columns", ValueError, "state_indices", lambda t, kw, c, rnd: _per_token(kw, c, c.T - 1)),
    ("num_accepted_tokens-with-1d-indices", ValueError, "num_accepted_tokens",
     lambda t, kw, c, rnd: kw.update(num_accepted_tokens=torch.ones(c.N, dtype=torch.int32))),
    ("num_accepted_tokens-range", ValueError, "num_accepted_tokens",
     lambda t, kw, c, rnd: (_per_token(kw, c, c.T),
                            kw.update(num_accepted_tokens=torch.full((c.N,), rnd.choice((0, c.T + 1)), dtype=torch.int32)))),
    ("num_accepted_tokens-float", TypeError, "num_accepted_tokens",
     lambda t, kw, c, rnd: (_per_token(kw, c, c.T), kw.update(num_accepted_tokens=torch.ones(c.N)))),
    ("out-shape", ValueError, "out", lambda t, kw, c, rnd: kw.update(out=_grow(torch.zeros_like(t["v"]), 2))),
]


@st.composite
def decode_bases(draw):
    """A valid decode step: N >= 2 sequences of T in [2, 3] tokens, [N] indices into a pool with room for [N, T]."""
    c, rnd = draw(invalid_bases(fixed_length=True))
    return dataclasses.replace(c, B=max(c.B, 2), T=min(c.T, 3), state=None, final=False), rnd


@pytest.mark.parametrize("corruption", DECODE_CORRUPTIONS, ids=[x[0] for x in DECODE_CORRUPTIONS])
@_settings(3)
@given(base=decode_bases())
def test_kda_decode_refuses_invalid_inputs(corruption, base):
    """kda_decode: the same contract; in particular a refused step leaves the pool's bits as they were."""
    _, exc, name, mutate = corruption
    c, rnd = base
    t, kw = make_inputs(c)
    P = c.N * c.T + rnd.randint(0, 2)
    kw["state_pool"] = torch.randn(P, c.HV, c.V, c.K, generator=torch.Generator().manual_seed(c.seed))
    kw["state_indices"] = torch.tensor(rnd.sample(range(P), c.N), dtype=torch.int32)
    mutate(t, kw, c, rnd)
    expect_refusal(lambda: _decode_call(t, kw), exc, name, t, kw)
