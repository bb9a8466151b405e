"""Property-based tests of ``plan_kda``: its counts, bytes and timeline against themselves and the
shapes it was given, its shapes against what ``chunk_kda`` returns, and random invalid arguments.
The shared cases, helpers and settings are in _properties_common.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kdakit import chunk_kda, plan_kda
from kdakit.ops.kda.plan import DENSE_CHECKPOINT_TOKENS, PEAK_BUDGET

pytest.register_assert_rewrite(__package__ + "._properties_common")  # its asserts report as a test module's do

from . import _properties_common as _common
from ._properties_common import (_case_id, _settings, cases, check_against_definition, expect_refusal,
                                 itertools_accumulate, make_inputs)


_default_backend = _common.default_backend  # autouse: bound in this module, it applies to its tests


# ---------------------------------------------------------------------------------------------
# plan_kda
# ---------------------------------------------------------------------------------------------

@st.composite
def plan_args(draw):
    backend = draw(st.sampled_from(("triton", "torch")))
    dims = (1, 16, 48, 64, 128) if backend == "triton" else (1, 16, 100, 256)
    H = draw(st.integers(1, 4))
    kw = dict(H=H, HV=H * draw(st.integers(1, 3)), K=draw(st.sampled_from(dims)), V=draw(st.sampled_from(dims)),
              dtype=draw(st.sampled_from((torch.bfloat16, torch.float16, torch.float32))),
              initial_state=draw(st.booleans()), output_final_state=draw(st.booleans()),
              gate_params=draw(st.booleans()), backend=backend,
              initial_state_dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))))
    if draw(st.booleans()):
        kw["seqlens"] = draw(st.lists(st.integers(0, 5000), min_size=1, max_size=5))
    else:
        kw["B"], kw["T"] = draw(st.integers(0, 4)), draw(st.integers(0, 5000))
    if draw(st.booleans()):
        kw["checkpoint_every_n_tokens"] = 16 * draw(st.integers(1, 200))
    if draw(st.booleans()):
        kw["block_v"] = draw(st.sampled_from((16, 32, 64, 128)))
    return kw


@_settings(60)
@given(kw=plan_args())
def test_plan_kda_invariants(kw):
    """plan_kda's counts and bytes agree with its own timeline and with the shapes it was given; the
    same call planned from tensors, from lengths or from offsets gives the same plan."""
    p = plan_kda(**kw)
    lengths = list(kw["seqlens"]) if "seqlens" in kw else [kw["T"]] * kw["B"]
    B, T = (1, sum(lengths)) if "seqlens" in kw else (kw["B"], kw["T"])
    assert (p.B, p.T, p.H, p.HV, p.K, p.V, p.dtype) == (B, T, kw["H"], kw["HV"], kw["K"], kw["V"], kw["dtype"])
    assert p.seqlens == tuple(lengths) and p.num_sequences == len(lengths)
    L = p.checkpoint_every_n_tokens
    assert L > 0 and L % 16 == 0 and L == kw.get("checkpoint_every_n_tokens", L)
    if "checkpoint_every_n_tokens" not in kw:
        # The default: one checkpoint per sequence up to 2048 tokens, or a denser cadence that the plan
        # took because its predicted peak stays within the budget (triton only).
        dense = p.predicted_peak_bytes <= PEAK_BUDGET * p.floor_bytes and kw["backend"] == "triton"
        if max(lengths, default=0) <= 2048 and not (dense and L in DENSE_CHECKPOINT_TOKENS):
            assert all(n <= L for n in lengths), "the default cadence keeps one checkpoint per sequence up to 2048"
        if L < min(2048, max(lengths, default=0)):
            assert dense and L in DENSE_CHECKPOINT_TOKENS, "a cadence below the default only within the budget"
    assert L % p.recompute_every_n_tokens == 0 and 256 % p.recompute_every_n_tokens == 0
    assert p.num_checkpoints == sum(math.ceil(n / L) for n in lengths)
    assert p.num_chunks == sum(math.ceil(n / 16) for n in lengths)
    offs = p.checkpoint_offsets()
    assert offs.dtype == torch.int64 and offs.tolist() == [0, *itertools_accumulate(math.ceil(n / L) for n in lengths)]
    bv = p.block_v
    assert bv >= 16 and bv & (bv - 1) == 0 and bv == kw.get("block_v", bv)

    by_name = {a.name: a for a in p.allocations}
    for a in p.allocations:
        assert a.allocated_bytes % 512 == 0 and a.allocated_bytes >= a.nbytes
        assert (a.allocated_bytes == 0) == (a.nbytes == 0)
    assert by_name["q"].shape == (B, T, kw["H"], kw["K"]) and by_name["v"].shape == (B, T, kw["HV"], kw["V"])
    grads = {"dq", "dk", "dv", "dg", "dbeta"}
    grads |= {"dA_log", "ddt_bias"} if kw["gate_params"] else set()
    grads |= {"d_initial_state"} if kw["initial_state"] else set()
    assert grads <= set(by_name), sorted(grads - set(by_name))
    assert ("dA_log" in by_name) == kw["gate_params"] and ("d_initial_state" in by_name) == kw["initial_state"]
    if kw["initial_state"]:
        assert by_name["d_initial_state"].dtype == kw["initial_state_dtype"]
    assert ("final_state" in by_name) == kw["output_final_state"]
    assert sum(p.bytes_by_group().values()) == sum(a.allocated_bytes for a in p.allocations)
    assert p.floor_bytes == sum(a.allocated_bytes for a in p.allocations if a.group in ("inputs/dO/O", "gradient outputs"))

    # Replay the timeline: every freed tensor was live; the running maximum is the predicted peak.
    live, cur, peak = set(), 0, 0
    size = {a.name: a.allocated_bytes for a in p.allocations}
    for kind, name in p.events:
        if kind == "alloc":
            assert name in size and name not in live, name
            live.add(name)
            cur += size[name]
        elif kind == "free":
            assert name in live, f"{name} freed while not live"
            live.remove(name)
            cur -= size[name]
        else:
            assert kind == "mark"
        assert cur >= 0
        peak = max(peak, cur)
    assert p.forward_peak_bytes <= peak
    if p.backend == "triton":
        assert p.predicted_peak_bytes == peak and p.peak_model == "exact"
        assert p.num_checkpoints == 0 or p.checkpoint_bytes > 0
    else:
        assert p.predicted_peak_bytes == p.floor_bytes + p.saved_bytes and p.peak_model == "lower bound"
    assert p.predicted_peak_bytes >= p.floor_bytes

    # The same call in another form gives an equal plan; the same arguments give the memoized object.
    assert plan_kda(**kw) is p
    alt = dict(kw)
    if "seqlens" in kw:
        cu = [0, *itertools_accumulate(lengths)]
        del alt["seqlens"]
        assert plan_kda(**alt, cu_seqlens=cu) == p
        assert plan_kda(**alt, cu_seqlens=torch.tensor(cu)) == p
    else:
        for n in ("B", "T", "H", "HV", "K", "V"):
            alt.pop(n)
        q = torch.empty(B, T, kw["H"], kw["K"], device="meta", dtype=kw["dtype"])
        v = torch.empty(B, T, kw["HV"], kw["V"], device="meta", dtype=kw["dtype"])
        alt.pop("dtype")
        assert plan_kda(q, v, **alt) == p


@_settings(10)
@given(c=cases(dtypes=("float32",), max_T=40, states=(None, "kv")), cadence=st.integers(1, 3))
def test_plan_kda_shapes_are_what_chunk_kda_returns(c, cadence):
    """For a planned call, chunk_kda with the plan's cadence matches the definition, and each output
    and gradient it returns has the shape and dtype of the plan's allocation for it."""
    t, kw = make_inputs(c)
    p = plan_kda(t["q"], t["v"], seqlens=c.seqlens, checkpoint_every_n_tokens=16 * cadence,
                 initial_state=c.state is not None, output_final_state=c.final, backend="torch",
                 gate_params="A_log" in t and "dt_bias" in t)
    assert p.checkpoint_every_n_tokens == 16 * cadence and p.seqlens == tuple(c.seqlens or (c.T,) * c.B)
    # the 16-token pipeline's cadence (any multiple of 16): named, since an unbounded gate defaults to chunk64
    got = check_against_definition(c, chunk_kda, checkpoint_every_n_tokens=p.checkpoint_every_n_tokens,
                                   pipeline="windowed16")
    plan = {a.name: a for a in p.allocations}
    pairs = {"o": "o", "final_state": "final_state", "dq": "dq", "dk": "dk", "dv": "dv", "dg": "dg",
             "dbeta": "dbeta", "dinitial_state": "d_initial_state"}
    if not c.engine_shapes:
        pairs.update(dA_log="dA_log", ddt_bias="ddt_bias")
    for mine, theirs in pairs.items():
        x = got.get(mine)
        if x is None or theirs not in plan:
            continue
        a = plan[theirs]
        assert tuple(x.shape) == a.shape, (mine, tuple(x.shape), a.shape)
        if theirs != "d_initial_state":
            assert x.dtype == a.dtype, (mine, x.dtype, a.dtype)


# ---------------------------------------------------------------------------------------------
# Invalid arguments
# ---------------------------------------------------------------------------------------------

@st.composite
def valid_plan_kwargs(draw):
    H = draw(st.integers(1, 3))
    return dict(B=draw(st.integers(1, 3)), T=draw(st.integers(1, 4096)), H=H, HV=H * draw(st.integers(1, 3)),
                K=draw(st.sampled_from((16, 64, 128))), V=draw(st.sampled_from((16, 64, 128)))), \
        draw(st.randoms(use_true_random=False))


def _seqlens(kw, rnd, lengths):
    for n in ("B", "T"):
        kw.pop(n)
    kw["seqlens"] = lengths


PLAN_CORRUPTIONS = [
    ("H-missing", ValueError, "H", lambda kw, rnd: kw.pop("H")),
    ("K-missing", ValueError, "K", lambda kw, rnd: kw.pop("K")),
    ("B-missing", ValueError, "B", lambda kw, rnd: kw.pop("B")),
    ("H-zero", ValueError, "H", lambda kw, rnd: kw.update(H=0, HV=0)),
    ("HV-zero", ValueError, "HV", lambda kw, rnd: kw.update(HV=0)),
    ("HV-not-multiple", ValueError, "HV", lambda kw, rnd: kw.update(H=2, HV=2 * rnd.randint(1, 3) + 1)),
    ("K-negative", ValueError, "K", lambda kw, rnd: kw.update(K=-rnd.randint(1, 64))),
    ("K-over-128-triton", ValueError, "K", lambda kw, rnd: kw.update(K=rnd.choice((129, 192, 256)))),
    ("V-over-128-triton", ValueError, "V", lambda kw, rnd: kw.update(V=rnd.choice((129, 256)))),
    ("B-negative", ValueError, "B", lambda kw, rnd: kw.update(B=-rnd.randint(1, 4))),
    ("T-negative", ValueError, "T", lambda kw, rnd: kw.update(T=-rnd.randint(1, 4))),
    ("T-not-an-integer", (ValueError, TypeError), "T", lambda kw, rnd: kw.update(T=kw["T"] + 0.5)),
    ("seqlens-negative", ValueError, "seqlens",
                  lambda kw, rnd: _seqlens(kw, rnd, [rnd.randint(0, 64), -rnd.randint(1, 64)])),
    ("cu_seqlens-decreasing", ValueError, "cu_seqlens",
                  lambda kw, rnd: (_seqlens(kw, rnd, None), kw.pop("seqlens"),
                                   kw.update(cu_seqlens=[0, 40, 40 - rnd.randint(1, 40)]))),
    ("cu_seqlens-start", ValueError, "cu_seqlens",
                  lambda kw, rnd: (_seqlens(kw, rnd, None), kw.pop("seqlens"),
                                   kw.update(cu_seqlens=[rnd.randint(1, 16), 40]))),
    ("seqlens-and-cu_seqlens", ValueError, "cu_seqlens",
     lambda kw, rnd: (_seqlens(kw, rnd, [3, 4]), kw.update(cu_seqlens=[0, 3, 7]))),
    ("T-mismatch-with-seqlens", ValueError, "T",
     lambda kw, rnd: (_seqlens(kw, rnd, [3, 4]), kw.update(T=7 + rnd.randint(1, 5)))),
    ("B-not-1-with-seqlens", ValueError, "B",
     lambda kw, rnd: (_seqlens(kw, rnd, [3, 4]), kw.update(B=rnd.randint(2, 4)))),
    ("backend", ValueError, "backend", lambda kw, rnd: kw.update(backend=rnd.choice(("cuda", "auto", "TRITON")))),
    ("block_v", ValueError, "block_v", lambda kw, rnd: kw.update(block_v=rnd.choice((0, 8, 24, 48, 100)))),
    ("checkpoint_every_n_tokens", ValueError, "checkpoint_every_n_tokens",
     lambda kw, rnd: kw.update(checkpoint_every_n_tokens=rnd.choice((0, -16, 8, 24, 100, True, 32.0)))),
]


@pytest.mark.parametrize("corruption", PLAN_CORRUPTIONS, ids=[_case_id(x) for x in PLAN_CORRUPTIONS])
@_settings(4)
@given(base=valid_plan_kwargs())
def test_plan_kda_refuses_invalid_arguments(corruption, base):
    """plan_kda: each invalid argument raises ValueError/TypeError naming it."""
    _, exc, name, mutate = corruption
    kw, rnd = base
    plan_kda(**kw)  # the base is valid
    kw = dict(kw)
    mutate(kw, rnd)
    cu = kw.get("cu_seqlens")
    expect_refusal(lambda: plan_kda(**kw), exc, name, {"cu_seqlens": cu} if isinstance(cu, torch.Tensor) else {})
