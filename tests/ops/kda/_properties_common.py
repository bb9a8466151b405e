"""Shared machinery of the property-based tests (hypothesis, issue #11 item 5):
tests/ops/kda/test_properties_chunk.py (``chunk_kda``), test_properties_recurrent.py
(``fused_recurrent_kda``, ``kda_decode``) and test_properties_plan.py (``plan_kda``) check random
shapes and options against the float64 definition (``naive_recurrent_kda``), and random invalid
inputs, which must raise ``ValueError`` / ``TypeError`` naming the argument and leave every input as
it was.

Deterministic and bounded: every test runs a fixed number of examples with ``derandomize=True``
and no example database, so CI sees the same examples on every run. Every tensor comes from a
``torch.Generator`` seeded with a hypothesis-drawn integer (``Case.seed``), so the falsifying
example hypothesis prints on a failure (the whole ``Case``, seed included) reproduces it.

Backends: the default (the PyTorch path on CPU tensors) for most examples (the autouse fixture
``default_backend``, which each test module binds as ``_default_backend``); a few examples run
``fused_recurrent_kda`` and ``kda_decode`` on their Triton kernels under the interpreter
(``KDAKIT_BACKEND=triton``; the CPU tier sets ``TRITON_INTERPRET=1`` in conftest.py). The chunk
Triton kernels are not run here (tests/ops/kda/test_chunk_triton*.py cover them).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st

from kdakit import naive_recurrent_kda
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
def default_backend(monkeypatch):
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
