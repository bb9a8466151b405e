"""Property-based tests (hypothesis, issue #11 item 5): random shapes and options of ``chunk_kda``,
``fused_recurrent_kda``, ``kda_decode`` and ``plan_kda`` against the float64 definition
(``naive_recurrent_kda``), and random invalid inputs, which must raise ``ValueError`` / ``TypeError``
naming the argument and leave every input as it was.

Deterministic and bounded: every test runs a fixed number of examples with ``derandomize=True``
and no example database, so CI sees the same examples on every run. Every tensor comes from a
``torch.Generator`` seeded with a hypothesis-drawn integer (``Case.seed``), so the falsifying
example hypothesis prints on a failure (the whole ``Case``, seed included) reproduces it.

Backends: the default (the PyTorch path on CPU tensors) for most examples; a few examples run
``fused_recurrent_kda`` and ``kda_decode`` on their Triton kernels under the interpreter
(``KDAKIT_BACKEND=triton``; the CPU tier sets ``TRITON_INTERPRET=1`` in conftest.py). The chunk
Triton kernels are not run here (tests/ops/kda/test_chunk_triton*.py cover them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kdakit import chunk_kda, fused_recurrent_kda, kda_decode, naive_recurrent_kda, plan_kda
from kdakit.ops.kda.plan import DENSE_CHECKPOINT_TOKENS, PEAK_BUDGET
from kdakit.testing import SPEC_RMS_LIMITS, assert_close

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# RMS error ratio against the float64 definition, per token dtype: float64 paths agree with it to
# round-off; float32 ones to fp32 round-off (observed ~1e-6); 16-bit inputs to docs/spec.md §8's limits.
LIMITS = {
    "float64": {n: 1e-9 for n in SPEC_RMS_LIMITS},
    "float32": {n: (2e-4 if n in ("dg", "dbeta", "dA_log", "ddt_bias") else 5e-5) for n in SPEC_RMS_LIMITS},
    "bfloat16": SPEC_RMS_LIMITS,
}

GRAD_ROUNDING_LIMIT = {torch.bfloat16: 2.0 ** -8, torch.float32: 1e-6}  # a few unit roundoffs (bf16: one)


# A local stress run: KDAKIT_PROPERTY_EXAMPLES=8 runs 8x the examples, drawn at random (not the CI set;
# a failure prints its example and an @reproduce_failure blob).
_STRESS = float(os.environ.get("KDAKIT_PROPERTY_EXAMPLES", "0") or 0)


def _settings(n: int):
    """``n`` examples, the same ones on every run (derandomize, no database), no per-example deadline."""
    return settings(max_examples=max(1, round(n * _STRESS)) if _STRESS else n, deadline=None,
                    derandomize=not _STRESS, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    """The default backend (the PyTorch path on CPU tensors) unless a test asks for Triton: a
    KDAKIT_BACKEND in the environment must not send chunk_kda here to the chunk Triton kernels."""
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)


# ---------------------------------------------------------------------------------------------
# Random cases
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One random KDA call; ``make_inputs`` turns it into tensors with ``torch.Generator(seed)``."""

    seed: int
    B: int
    T: int
    H: int
    G: int  # value heads per q/k head (HV = H * G)
    K: int
    V: int
    seqlens: tuple[int, ...] | None  # packed sequences (B = 1, T = their sum)
    dtype: str
    gate: str  # none | softplus | safe | lower_bound (no A_log)
    decay: float  # scale of the log-decay (gate 'none')
    resets: bool  # some tokens with log-decay -1000 (gate 'none')
    lower_bound: float
    engine_shapes: bool  # A_log [HV, 1] / [1, 1, HV, 1] and dt_bias [HV, K]
    param_dtype: str
    l2norm: bool
    beta_sigmoid: bool
    neg_eigval: bool
    scale: float | None
    state: str | None  # None | kv | vk
    state_dtype: str
    final: bool

    @property
    def HV(self) -> int:
        return self.H * self.G

    @property
    def N(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B


@st.composite
def cases(draw, *, dtypes=("float64",), min_T=0, max_T=40, max_B=3, max_seqs=4, dims=(1, 3, 8, 16, 20), max_H=2,
          max_G=3, varlen=True, states=(None, "kv", "vk")):
    """A random ``Case``; ``min_T``: tokens of a fixed-length sequence, and of the longest packed one."""
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(dtypes))
    if varlen and draw(st.booleans()):
        seqlens = draw(st.lists(st.integers(0, max(max_T // 2, min_T)), min_size=1, max_size=max_seqs))
        if max(seqlens) < min_T:
            seqlens[draw(st.integers(0, len(seqlens) - 1))] = min_T
        seqlens = tuple(seqlens)
        B, T = 1, sum(seqlens)
    else:
        seqlens = None
        B, T = draw(st.integers(1, max_B)), draw(st.integers(min_T, max_T))
    gate = draw(st.sampled_from(("none", "softplus", "safe", "lower_bound")))
    beta_sigmoid = draw(st.booleans())
    state = draw(st.sampled_from(states))
    l2norm = draw(st.booleans())
    # K = 1 with the in-kernel l2norm: q / |q| is +-1 and dq is a cancellation (1e-6 / |q|^3, the
    # eps term), so a 16/32-bit result has no accurate digits to compare; float64 still does.
    k_dims = dims if dtype == "float64" or not l2norm else tuple(d for d in dims if d > 1)
    state_dtypes = {"float64": ("float64", "float32", "bfloat16"), "float32": ("float32", "bfloat16"),
                    "bfloat16": ("float32", "bfloat16")}[dtype]
    return Case(
        seed=seed, B=B, T=T, H=draw(st.integers(1, max_H)), G=draw(st.integers(1, max_G)),
        K=draw(st.sampled_from(k_dims)), V=draw(st.sampled_from(dims)), seqlens=seqlens, dtype=dtype, gate=gate,
        decay=draw(st.sampled_from((0.05, 0.5, 3.0))), resets=gate == "none" and draw(st.booleans()),
        lower_bound=draw(st.sampled_from((-5.0, -1.0, -0.1))), engine_shapes=draw(st.booleans()),
        param_dtype=draw(st.sampled_from(("float32", "float64") if dtype == "float64" else ("float32",))),
        l2norm=l2norm, beta_sigmoid=beta_sigmoid, neg_eigval=beta_sigmoid and draw(st.booleans()),
        scale=draw(st.sampled_from((None, 0.3, 1.7))), state=state,
        state_dtype=draw(st.sampled_from(state_dtypes)), final=draw(st.booleans()),
    )


def make_inputs(c: Case) -> tuple[dict, dict]:
    """(tensors, kwargs) for ``chunk_kda`` / ``fused_recurrent_kda`` / ``naive_recurrent_kda``.

    The values keep the recurrence stable whatever the options: without the in-kernel l2norm, k
    is drawn with norm <= 1, and beta (without the sigmoid) lies in [0, 1], so every transition
    ``Diag(decay) (I - beta k k^T)`` has eigenvalues in [-1, 1]."""
    gen = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    pdt = DTYPES[c.param_dtype]
    B, T, H, HV, K, V = c.B, c.T, c.H, c.HV, c.K, c.V

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    def u(*s):
        return torch.rand(*s, generator=gen, dtype=torch.float64)

    k = r(B, T, H, K)
    if c.l2norm:
        k = k * (0.1 + 2 * u(B, T, H, 1))
    else:
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-3) * (0.2 + 0.8 * u(B, T, H, 1))
    t = {"q": r(B, T, H, K), "k": k, "v": r(B, T, HV, V),
         "beta": r(B, T, HV) if c.beta_sigmoid else u(B, T, HV)}
    kw = dict(use_qk_l2norm_in_kernel=c.l2norm, use_beta_sigmoid_in_kernel=c.beta_sigmoid,
              allow_neg_eigval=c.neg_eigval, scale=c.scale)
    if c.gate == "none":
        g = -torch.nn.functional.softplus(r(B, T, HV, K)) * c.decay
        if c.resets:
            g = torch.where(u(B, T, HV, 1) < 0.2, torch.full_like(g, -1000.0), g)
        t["g"] = g
    else:
        t["g"] = r(B, T, HV, K)
        kw["use_gate_in_kernel"] = True
        dt_bias = 0.5 * r(HV * K)
        t["dt_bias"] = (dt_bias.view(HV, K) if c.engine_shapes else dt_bias).to(pdt)
        if c.gate in ("softplus", "safe"):
            a = 0.5 * r(HV)
            if c.engine_shapes:
                a = a.view(HV, 1) if c.seed % 2 else a.view(1, 1, HV, 1)
            t["A_log"] = a.to(pdt)
        if c.gate in ("safe", "lower_bound"):
            kw["lower_bound"] = c.lower_bound
            kw["safe_gate"] = c.gate == "safe"
    t = {n: (x.to(dt) if n in ("q", "k", "v", "g", "beta") else x) for n, x in t.items()}
    if c.state is not None:
        shape = (c.N, HV, V, K) if c.state == "vk" else (c.N, HV, K, V)
        t["initial_state"] = (0.5 * r(*shape)).to(DTYPES[c.state_dtype])
        kw["state_v_first"] = c.state == "vk"
    kw["output_final_state"] = c.final
    if c.seqlens is not None:
        kw["cu_seqlens"] = torch.tensor([0, *itertools_accumulate(c.seqlens)], dtype=torch.long)
    return t, kw


def itertools_accumulate(xs):
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out


POSITIONAL = ("q", "k", "v", "g", "beta")


def _call(fn, t: dict, kw: dict, **extra):
    named = {n: t[n] for n in ("initial_state", "A_log", "dt_bias") if n in t}
    return fn(*(t[n] for n in POSITIONAL), **named, **kw, **extra)


def _naive_flat(q, k, v, g, beta, *, A_log=None, dt_bias=None, **kw):
    """The definition, reading gate parameters through their flat views as the ops do."""
    return naive_recurrent_kda(q, k, v, g, beta, A_log=None if A_log is None else A_log.reshape(-1),
                               dt_bias=None if dt_bias is None else dt_bias.reshape(-1), **kw)


def _naive(t: dict, kw: dict):
    return _call(_naive_flat, t, kw)


def forward_backward(fn, t: dict, kw: dict, seed: int, *, backward: bool = True, cot_dtypes=(None, None),
                     **extra) -> dict:
    """``fn`` on fresh leaves of ``t``: ``o``, ``final_state`` and each input's gradient under random
    cotangents (drawn in float64 from ``seed`` and rounded to ``cot_dtypes``, the dtypes of the op's
    ``o`` and final state, so that both sides of a comparison see the very same values)."""
    leaves = {n: x.detach().clone().requires_grad_(backward) for n, x in t.items()}
    o, ht = _call(fn, leaves, kw, **extra)
    res = {"o": o, "final_state": ht}
    if not backward:
        return res
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    outs, cots = [], []
    for x, rounded in zip((o, ht), cot_dtypes):
        if x is not None:
            outs.append(x)
            cots.append(torch.randn(x.shape, generator=gen, dtype=torch.float64).to(rounded or x.dtype).to(x.dtype))
    pairs = [(x, ct) for x, ct in zip(outs, cots) if x.requires_grad]
    grads = (torch.autograd.grad([p[0] for p in pairs], list(leaves.values()), [p[1] for p in pairs],
                                 allow_unused=True) if pairs else [None] * len(leaves))
    for n, gr in zip(leaves, grads):
        res["d" + n] = gr
    return res


def check_against_definition(c: Case, fn, *, backward: bool = True, limits=None, **extra) -> dict:
    """Run ``fn`` and the float64 definition on the same values; check shapes, dtypes and values."""
    t, kw = make_inputs(c)
    note(f"torch seed {c.seed}")
    ref_in = {n: x.double() for n, x in t.items()}
    cot = (DTYPES[c.dtype], torch.float64 if c.dtype == "float64" else torch.float32)
    ref = forward_backward(_naive_flat, ref_in, kw, c.seed, backward=backward, cot_dtypes=cot)
    got = forward_backward(fn, t, kw, c.seed, backward=backward, cot_dtypes=cot, **extra)
    limits = limits or LIMITS[c.dtype]
    dt = DTYPES[c.dtype]
    HV, V, K = c.HV, c.V, c.K

    o = got["o"]
    assert o.shape == (c.B, c.T, HV, V) and o.dtype == dt, (o.shape, o.dtype)
    if c.final:
        ht = got["final_state"]
        want = (c.N, HV, V, K) if c.state == "vk" else (c.N, HV, K, V)
        assert ht is not None and tuple(ht.shape) == want, None if ht is None else ht.shape
        assert ht.dtype in (torch.float32, torch.float64), ht.dtype
    else:
        assert got["final_state"] is None
    for name in ref:
        r, x = ref[name], got[name]
        if name.startswith("d"):
            leaf = t[name[1:]]
            if x is not None:
                assert x.shape == leaf.shape and x.dtype == leaf.dtype, \
                    f"{name}: {tuple(x.shape)} {x.dtype}, its input {tuple(leaf.shape)} {leaf.dtype}"
        lim = limits[name]
        if name.startswith("d"):
            # the gradient of a bf16 / fp32 input (a state or gate parameter beside float64 tokens) is
            # itself rounded to that dtype
            lim = max(lim, GRAD_ROUNDING_LIMIT.get(t[name[1:]].dtype, 0.0))
        if r is None or (r.numel() and not r.abs().max().item()):
            # e.g. an input that reaches no output: no gradient, or an all-zero one (to round-off:
            # the RMS ratio is undefined here, so the limit applies to the absolute error)
            err = 0.0 if x is None or not x.numel() else x.double().abs().max().item()
            assert err <= lim, f"{name}: max abs {err:.3e} where the definition is zero"
            continue
        assert x is not None, f"{name}: missing, the definition has one"
        assert_close(name, r, x, lim)
    return got


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
    got = check_against_definition(c, chunk_kda, checkpoint_every_n_tokens=p.checkpoint_every_n_tokens)
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
# Invalid inputs: a typed error naming the argument, every input left as it was
# ---------------------------------------------------------------------------------------------

def _case_id(x):
    """The id of a corruption (a tuple, or a pytest.param around one)."""
    return (x.values[0] if hasattr(x, "values") else x)[0]


def _names(msg: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", msg) is not None


def _snapshot(*dicts):
    snap = []
    for d in dicts:
        for n, x in d.items():
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                snap.append((n, x, x.clone()))
    return snap


def expect_refusal(call, exc, name, *dicts):
    """``call()`` raises ``exc`` naming ``name``, and no tensor in ``dicts`` changed (values, shape, dtype)."""
    snap = _snapshot(*dicts)
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    assert type(err) in (exc if isinstance(exc, tuple) else (exc,)), f"{type(err).__name__}: {err}"
    assert _names(str(err), name), f"the error does not name {name!r}: {err}"
    for n, x, before in snap:
        assert x.dtype == before.dtype and torch.equal(x, before), f"{n} was modified by a refused call"


def _grow(x, dim):
    """``x`` one larger along ``dim`` (a zero slice appended)."""
    pad = list(x.shape)
    pad[dim] = 1
    return torch.cat([x, torch.zeros(pad, dtype=x.dtype)], dim)


def _strided(x):
    """The same values as a non-contiguous view (every other element of a twice-as-long tensor)."""
    big = torch.stack([x, torch.zeros_like(x)], -1)
    return big[..., 0]


def _token_corruptions():
    """(id, exception, argument named, mutate(t, kw, c, rnd)); rnd: a random.Random from hypothesis."""
    out = []
    for n in POSITIONAL:
        out.append((f"{n}-not-a-tensor", TypeError, n, lambda t, kw, c, rnd, n=n: t.update({n: t[n].tolist()})))
        out.append((f"{n}-integer", TypeError, n, lambda t, kw, c, rnd, n=n: t.update({n: t[n].to(torch.int32)})))
        out.append((f"{n}-ndim", ValueError, n, lambda t, kw, c, rnd, n=n: t.update({n: t[n][0]})))
    # a size that another argument fixes (a free size, e.g. v's V, has nothing to disagree with)
    sized = {"q": (1, 2, 3), "k": (0, 1, 2, 3), "v": (0, 1), "g": (0, 1, 2, 3), "beta": (0, 1, 2)}
    for n, dims in sized.items():
        out.append((f"{n}-size", ValueError, n,
                    lambda t, kw, c, rnd, n=n, dims=dims: t.update({n: _grow(t[n], rnd.choice(dims))})))
    for n in ("k", "v", "g", "beta"):
        out.append((f"{n}-device", ValueError, n,
                    lambda t, kw, c, rnd, n=n: t.update({n: torch.empty(t[n].shape, dtype=t[n].dtype, device="meta")})))
    out += [
        ("A_log-bf16", TypeError, "A_log", lambda t, kw, c, rnd: t.update(A_log=t["A_log"].bfloat16())),
        ("A_log-list", TypeError, "A_log", lambda t, kw, c, rnd: t.update(A_log=t["A_log"].tolist())),
        ("A_log-size", ValueError, "A_log", lambda t, kw, c, rnd: t.update(A_log=_grow(t["A_log"], 0))),
        ("A_log-strided", ValueError, "A_log", lambda t, kw, c, rnd: t.update(A_log=_strided(t["A_log"]))),
        ("A_log-missing", ValueError, "A_log", lambda t, kw, c, rnd: t.pop("A_log")),
        ("dt_bias-fp16", TypeError, "dt_bias", lambda t, kw, c, rnd: t.update(dt_bias=t["dt_bias"].half())),
        ("dt_bias-size", ValueError, "dt_bias", lambda t, kw, c, rnd: t.update(dt_bias=t["dt_bias"][1:])),
        ("dt_bias-strided", ValueError, "dt_bias", lambda t, kw, c, rnd: t.update(dt_bias=_strided(t["dt_bias"]))),
        ("scale-str", TypeError, "scale", lambda t, kw, c, rnd: kw.update(scale="0.5")),
        ("lower_bound-str", TypeError, "lower_bound", lambda t, kw, c, rnd: kw.update(lower_bound="-1")),
        ("lower_bound-unsafe", ValueError, "lower_bound",
         lambda t, kw, c, rnd: kw.update(safe_gate=True, lower_bound=rnd.choice((-6.0, -5.5, 0.0, 0.5)))),
        ("safe_gate-without-lower_bound", ValueError, "lower_bound",
         lambda t, kw, c, rnd: kw.update(safe_gate=True, lower_bound=None)),
        ("allow_neg_eigval-without-sigmoid", ValueError, "allow_neg_eigval",
         lambda t, kw, c, rnd: kw.update(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False)),
        ("cu_seqlens-float", TypeError, "cu_seqlens",
         lambda t, kw, c, rnd: kw.update(cu_seqlens=torch.tensor([0.0, float(c.T)]))),
        ("cu_seqlens-2d", ValueError, "cu_seqlens", lambda t, kw, c, rnd: kw.update(cu_seqlens=torch.tensor([[0, c.T]]))),
        ("cu_seqlens-start", ValueError, "cu_seqlens",
         lambda t, kw, c, rnd: kw.update(cu_seqlens=torch.tensor([rnd.randint(1, 3), c.T]))),
        ("cu_seqlens-end", ValueError, "cu_seqlens",
         lambda t, kw, c, rnd: kw.update(cu_seqlens=torch.tensor([0, c.T + rnd.choice((-1, 1, 5))]))),
        ("cu_seqlens-decreasing", ValueError, "cu_seqlens",
         lambda t, kw, c, rnd: kw.update(cu_seqlens=torch.tensor([0, c.T, c.T - 1, c.T]))),
    ]
    return out


def _state_corruptions():
    return [
        ("initial_state-fp16", TypeError, "initial_state",
         lambda t, kw, c, rnd: t.update(initial_state=t["initial_state"].half())),
        ("initial_state-rows", ValueError, "initial_state",
         lambda t, kw, c, rnd: t.update(initial_state=_grow(t["initial_state"], 0))),
        ("initial_state-3d", ValueError, "initial_state",
         lambda t, kw, c, rnd: t.update(initial_state=t["initial_state"][0])),
        ("initial_state-layout", ValueError, "initial_state",  # K != V in the base case
         lambda t, kw, c, rnd: kw.update(state_v_first=not kw.get("state_v_first", False))),
    ]


@st.composite
def invalid_bases(draw, fixed_length=False):
    """A valid float32 call with every optional tensor present (gate parameters, an initial state),
    K != V (so that a transposed state is wrong), at least 2 tokens."""
    c = draw(cases(dtypes=("float32",), max_T=12, dims=(4, 8), varlen=not fixed_length, states=("kv", "vk")))
    V = draw(st.sampled_from((12, 16)))
    c = dataclasses.replace(c, gate="softplus", engine_shapes=False, V=V, G=max(c.G, 2), T=max(c.T, 2) if c.seqlens is None else c.T,
                            seqlens=None if c.seqlens is None or sum(c.seqlens) < 2 else c.seqlens, final=True)
    return c, draw(st.randoms(use_true_random=False))


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
