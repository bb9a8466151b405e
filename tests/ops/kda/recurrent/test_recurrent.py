"""Recurrent KDA (fused_recurrent_kda, recurrent_kda_backward) against the naive definition.

The Triton kernels run under the interpreter (KDAKIT_BACKEND=triton, TRITON_INTERPRET=1 from
conftest) on tiny shapes with fp32 inputs; references are the naive recurrence in float64.
"""

import math

import pytest
import torch

from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.ops.kda.recurrent.backward import GRAD_NAMES, KDAGrads, recurrent_kda_backward, scratch_shapes
from kdakit.ops.kda.recurrent.segmented import SEG, backward_scratch_bytes, segmented_scratch_shapes
from kdakit.ops.kda.recurrent.workspace import Workspace
from kdakit.testing import assert_close, make_kda_inputs, run_kda

SEED = 7
# fp32 kernels vs the float64 definition: observed rms ratios are ~1e-7..5e-6 (the gate
# gradient is a reverse cumulative sum, the loosest); 5e-5 leaves room without hiding bugs.
FP32_RATIO = 5e-5


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")


def _inputs(seed, **kw):
    kw.setdefault("dtype", torch.float32)
    return make_kda_inputs(generator=torch.Generator().manual_seed(seed), **kw)


def _as_float64(inp):
    return {"tensors": {n: x.detach().double().requires_grad_() for n, x in inp["tensors"].items()},
            "kwargs": inp["kwargs"]}


def _check_against_naive(inp, ratio=FP32_RATIO, **extra):
    got = run_kda(fused_recurrent_kda, inp, seed=SEED, **extra)  # extra: options of the kernels only
    ref = run_kda(naive_recurrent_kda, _as_float64(inp), seed=SEED)
    assert set(got) == set(ref)
    for name, r in ref.items():
        if r is None:
            assert got[name] is None, name
            continue
        if name.startswith("d"):
            want = inp["tensors"][name[1:]].dtype
        elif name == "o":
            want = inp["tensors"]["v"].dtype
        else:  # the final state: fp32, float64 for float64 inputs
            want = torch.float64 if inp["tensors"]["q"].dtype == torch.float64 else torch.float32
        assert got[name].dtype == want, f"{name}: {got[name].dtype}, expected {want}"
        assert_close(name, r, got[name], ratio)
    return got


# --- forward and every gradient, option by option -------------------------------------------

CASES = {
    # name: make_kda_inputs arguments
    "log-decay gate, fixed length, GVA": dict(B=2, T=6, H=2, HV=4, K=8, V=8, gate="none"),
    "softplus gate, varlen with empty sequences, [K,V] state": dict(
        T=11, H=1, HV=2, K=8, V=12, gate="softplus", seqlens=[0, 4, 0, 7], initial_state="kv"),
    "safe gate, value-first state": dict(B=2, T=5, H=2, HV=2, K=16, V=8, gate="safe", initial_state="vk"),
    "safe gate without A_log, varlen, GVA x3": dict(
        T=9, H=1, HV=3, K=8, V=8, gate="safe_no_alog", seqlens=[5, 4], initial_state="kv"),
    "T = 1": dict(B=3, T=1, H=2, HV=2, K=8, V=8, gate="softplus", initial_state="vk"),
    "K and V not powers of two": dict(B=1, T=5, H=1, HV=2, K=6, V=40, gate="softplus", initial_state="kv"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_naive(triton_backend, case):
    _check_against_naive(_inputs(1, **CASES[case]))


@pytest.mark.parametrize("opts", [
    dict(allow_neg_eigval=True),
    dict(use_beta_sigmoid_in_kernel=False),
    dict(use_qk_l2norm_in_kernel=False),
    dict(scale=0.3),
], ids=["neg-eigval", "raw-beta", "no-l2norm", "scale"])
def test_options_match_naive(triton_backend, opts):
    inp = _inputs(2, B=1, T=7, H=2, HV=4, K=8, V=8, gate="softplus", initial_state="kv")
    if opts.get("use_beta_sigmoid_in_kernel") is False:
        # raw beta must be a usable beta: (0, 1)
        inp["tensors"]["beta"] = torch.sigmoid(inp["tensors"]["beta"].detach()).requires_grad_()
    if opts.get("use_qk_l2norm_in_kernel") is False:
        for n in ("q", "k"):
            inp["tensors"][n] = (0.3 * inp["tensors"][n].detach()).requires_grad_()
    inp["kwargs"].update(opts)
    _check_against_naive(inp)


def test_lower_bound_without_safe_gate(triton_backend):
    inp = _inputs(3, B=1, T=6, H=1, HV=2, K=8, V=8, gate="safe")
    inp["kwargs"].update(safe_gate=False, lower_bound=-8.0)
    _check_against_naive(inp)


def test_bf16_initial_state(triton_backend):
    inp = _inputs(4, B=2, T=4, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv_bf16")
    got = _check_against_naive(inp, ratio=1e-2)
    assert got["dinitial_state"].dtype == torch.bfloat16 and got["final_state"].dtype == torch.float32


def test_empty_sequences_pass_state_and_gradient_through(triton_backend):
    inp = _inputs(5, T=3, H=1, HV=2, K=8, V=8, gate="softplus", seqlens=[0, 3, 0], initial_state="kv")
    got = run_kda(fused_recurrent_kda, inp, seed=SEED)
    h0 = inp["tensors"]["initial_state"]
    assert torch.equal(got["final_state"][0], h0[0].detach())
    assert torch.equal(got["final_state"][2], h0[2].detach())
    # dh0 of an empty sequence is its dht: the same generator draw run_kda used
    gen = torch.Generator().manual_seed(SEED)
    torch.randn(got["o"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(got["final_state"].shape, generator=gen, dtype=torch.float64).float()
    assert torch.equal(got["dinitial_state"][0], dht[0])
    assert torch.equal(got["dinitial_state"][2], dht[2])


def test_torch_backend_is_the_naive_recurrence(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    inp = _inputs(6, B=1, T=5, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv", dtype=torch.float64)
    got = run_kda(fused_recurrent_kda, inp, seed=SEED)
    ref = run_kda(naive_recurrent_kda, inp, seed=SEED)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


# --- float64: computed by the PyTorch backend, refused by the Triton kernels (they compute in fp32) --

def _fp64_refused(name):
    return (rf"^{name} must be float16, bfloat16 or float32 for the Triton kernels, got torch.float64; "
            r"use KDAKIT_BACKEND=torch for float64$")


def test_float64_is_refused_on_the_triton_backend(triton_backend):
    # the kernels used to compute float64 inputs in fp32 and return float64 tensors without a word
    inp = _inputs(32, B=1, T=4, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv", dtype=torch.float64)
    with pytest.raises(TypeError, match=_fp64_refused("q")):
        run_kda(fused_recurrent_kda, inp, seed=SEED)
    inp = _inputs(32, B=1, T=4, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv")
    inp["tensors"]["initial_state"] = inp["tensors"]["initial_state"].detach().double().requires_grad_()
    with pytest.raises(TypeError, match=_fp64_refused("initial_state")):
        run_kda(fused_recurrent_kda, inp, seed=SEED)


@pytest.mark.parametrize("which", ["q", "do", "dht"])
def test_float64_is_refused_by_the_triton_backward(triton_backend, which):
    pos, named = _direct_args(_inputs(33, B=1, T=4, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv"))
    pos = list(pos)
    if which == "q":
        pos[:5] = [x.double() for x in pos[:5]]
        named = {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in named.items()}
    else:
        i = 5 if which == "do" else 6
        pos[i] = pos[i].double()
    with pytest.raises(TypeError, match=_fp64_refused(which)):
        recurrent_kda_backward(*pos, **named)


# --- recurrent_kda_backward: direct calls, out=, workspace, determinism -----------------------

def _direct_args(inp, seed=SEED):
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw.pop("output_final_state", None)
    o, ht = fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t.get("A_log"),
                                dt_bias=t.get("dt_bias"), initial_state=t.get("initial_state"),
                                output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen)
    pos = (t["q"], t["k"], t["v"], t["g"], t["beta"], do, dht)
    named = dict(A_log=t.get("A_log"), dt_bias=t.get("dt_bias"), initial_state=t.get("initial_state"), **kw)
    return pos, named


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_recurrent_kda_backward_matches_autograd(monkeypatch, backend):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    inp = _inputs(8, T=7, H=1, HV=2, K=8, V=8, gate="safe", seqlens=[3, 4], initial_state="vk")
    pos, named = _direct_args(inp)
    grads = recurrent_kda_backward(*pos, **named)
    assert isinstance(grads, KDAGrads) and len(grads) == 8
    t64 = {n: x.detach().double().requires_grad_() for n, x in inp["tensors"].items()}
    opts = {n: x for n, x in named.items() if n not in ("A_log", "dt_bias", "initial_state")}
    o, ht = naive_recurrent_kda(t64["q"], t64["k"], t64["v"], t64["g"], t64["beta"], A_log=t64["A_log"],
                                dt_bias=t64["dt_bias"], initial_state=t64["initial_state"],
                                output_final_state=True, **opts)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]
    want = torch.autograd.grad([o, ht], [t64[n] for n in names], [pos[5].double(), pos[6].double()])
    for gname, w, gr in zip(GRAD_NAMES, want, grads):
        assert gr.dtype == inp["tensors"][names[GRAD_NAMES.index(gname)]].dtype
        assert_close(gname, w, gr, FP32_RATIO)


def test_backward_out_workspace_and_determinism(triton_backend):
    inp = _inputs(9, B=2, T=5, H=2, HV=4, K=8, V=16, gate="softplus", initial_state="kv")
    pos, named = _direct_args(inp)
    like = [pos[0], pos[1], pos[2], pos[3], pos[4], named["A_log"], named["dt_bias"], named["initial_state"]]
    out = [torch.full_like(x, float("nan")) for x in like]
    ws = Workspace("cpu")
    first = recurrent_kda_backward(*pos, **named, workspace=ws, out=out)
    for o_, g_ in zip(out, first):
        assert g_ is o_ and torch.isfinite(g_).all()
    snapshot = [g_.clone() for g_ in first]
    held = {n: b.data_ptr() for n, b in ws._buffers.items()}
    nbytes = ws.nbytes
    assert nbytes > 0
    again = recurrent_kda_backward(*pos, **named, workspace=ws, out=out)
    assert ws.nbytes == nbytes and {n: b.data_ptr() for n, b in ws._buffers.items()} == held
    for a, b in zip(snapshot, again):
        assert torch.equal(a, b)
    fresh = recurrent_kda_backward(*pos, **named)  # stream-local scratch
    for a, b in zip(snapshot, fresh):
        assert torch.equal(a, b)


def test_backward_unused_gate_parameters_get_zero_gradients(triton_backend):
    inp = _inputs(10, B=1, T=4, H=1, HV=2, K=8, V=8, gate="none")
    pos, named = _direct_args(inp)
    A_log, dt_bias = torch.randn(2), torch.randn(16)
    grads = recurrent_kda_backward(*pos, **dict(named, A_log=A_log, dt_bias=dt_bias))
    assert torch.equal(grads.dA_log, torch.zeros(2)) and torch.equal(grads.ddt_bias, torch.zeros(16))
    assert grads.dh0 is None


def test_forward_out_and_final_state_out(triton_backend):
    inp = _inputs(11, B=2, T=3, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv")
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    o_buf = torch.full_like(t["v"], float("nan"))
    ht_buf = torch.full((2, 2, 8, 8), float("nan"))
    o, ht = fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                                initial_state=t["initial_state"], out=o_buf, final_state_out=ht_buf, **kw)
    assert o is o_buf and ht is ht_buf
    ref_o, ref_ht = naive_recurrent_kda(*(t[n].double() for n in ("q", "k", "v", "g", "beta")),
                                        A_log=t["A_log"].double(), dt_bias=t["dt_bias"].double(),
                                        initial_state=t["initial_state"].double(), **kw)
    assert_close("o", ref_o, o, FP32_RATIO)
    assert_close("ht", ref_ht, ht, FP32_RATIO)


# --- validation -------------------------------------------------------------------------------

def _small(seed=12):
    inp = _inputs(seed, B=1, T=4, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv")
    return {n: x.detach() for n, x in inp["tensors"].items()}, dict(inp["kwargs"])


def _fwd(t, kw, **extra):
    return fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                               initial_state=t["initial_state"], **dict(kw, **extra))


@pytest.mark.parametrize("extra, exc, pattern", [
    # the serving arguments (tests/ops/kda/serving/test_serving_args.py covers them): 4 tokens cannot fill FLA's 1-row final state
    (dict(ssm_state_indices=torch.zeros(1, dtype=torch.int32)), ValueError, "exactly N=1 tokens"),
    (dict(num_accepted_tokens=torch.ones(1, dtype=torch.int32)), ValueError, "needs ssm_state_indices"),
    (dict(chunk_size=64), TypeError, "unexpected keyword"),
    (dict(out=torch.empty(1, 4, 2, 4)), ValueError, r"^out must have shape \[1, 4, 2, 8\]"),
    (dict(out=torch.empty(1, 4, 2, 8, dtype=torch.float64)), TypeError, "^out must have dtype"),
    (dict(final_state_out=torch.empty(1, 2, 8, 8), output_final_state=False), ValueError, "output_final_state"),
    (dict(final_state_out=torch.empty(1, 2, 8, 4)), ValueError, "^final_state_out must have shape"),
    (dict(workspace="cpu"), TypeError, "^workspace must be a kdakit Workspace"),
    (dict(lower_bound=-7.0, safe_gate=True), ValueError, "lower_bound must be in the safe range"),
], ids=["ssm_state_indices", "num_accepted_tokens", "unknown", "out-shape", "out-dtype", "final-without-flag",
        "final-shape", "workspace-type", "safe-range"])
def test_forward_rejects_bad_arguments(triton_backend, extra, exc, pattern):
    t, kw = _small()
    with pytest.raises(exc, match=pattern):
        _fwd(t, kw, **extra)


def test_forward_rejects_non_unit_last_stride_and_wide_heads(triton_backend):
    t, kw = _small()
    t["q"] = torch.cat([t["q"], t["q"]], dim=-1)[..., ::2]  # right shape, last stride 2
    with pytest.raises(ValueError, match="^q must have a unit stride in its last dimension"):
        _fwd(t, kw)
    # a view with a unit last stride is read in place (tests/ops/kda/test_strided_views.py)
    t, kw = _small()
    ref = _fwd(t, kw)
    t["q"] = torch.cat([t["q"], t["q"]], dim=-1)[..., :8]
    assert not t["q"].is_contiguous() and all(torch.equal(a, b) for a, b in zip(_fwd(t, kw), ref) if a is not None)
    t, kw = _small()
    for n in ("q", "k"):
        t[n] = torch.randn(1, 4, 1, 300)
    t["g"] = torch.randn(1, 4, 2, 300)
    t["dt_bias"] = torch.randn(600)
    t["initial_state"] = torch.randn(1, 2, 300, 8)
    with pytest.raises(ValueError, match="K <= 256, got K=300"):
        _fwd(t, kw)


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda p, n: (p[:5] + (p[5][:, :2],) + p[6:], n), ValueError, r"^do must have o's shape"),
    (lambda p, n: (p[:6] + (p[6][..., :4],), n), ValueError, r"^dht must have the final state's shape"),
    (lambda p, n: (p, dict(n, out=[None] * 7)), ValueError, "^out must be a sequence of 8"),
    (lambda p, n: (p, dict(n, out=[None] * 5 + [torch.empty(3)] + [None] * 2)), ValueError, r"dA_log\) must have shape"),
], ids=["do-shape", "dht-shape", "out-length", "out-entry"])
def test_backward_rejects_bad_arguments(triton_backend, mutate, exc, pattern):
    inp = _inputs(13, B=1, T=3, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv")
    pos, named = _direct_args(inp)
    pos, named = mutate(pos, named)
    with pytest.raises(exc, match=pattern):
        recurrent_kda_backward(*pos, **named)


# --- segmented backward (sequences longer than segment_tokens) --------------------------------
# Segmented vs one pass: dq, dk, dv, dbeta and dh0 come from the same per-token math on the same
# states (bitwise equal on the interpreter); the gate gradients differ by how the reverse
# cumulative sum of da is split (observed rms ratios: segmented 2e-7..4e-6 against float64,
# one pass 4e-7..2e-5), so those two are compared within FP32_RATIO.
GATE_GRADS = ("dg", "dA_log", "ddt_bias")

SEGMENT_CASES = {
    # name: (make_kda_inputs arguments, segment_tokens, with dht)
    "varlen 0/1/7/13/20, softplus, GVA, [K,V] state, L=5": (
        dict(T=41, H=1, HV=2, K=8, V=8, gate="softplus", seqlens=[0, 1, 7, 13, 20], initial_state="kv"), 5, True),
    "varlen 20/0/13/1/7, safe gate, GVA, value-first state, L=8": (
        dict(T=41, H=2, HV=4, K=8, V=8, gate="safe", seqlens=[20, 0, 13, 1, 7], initial_state="vk"), 8, True),
    "fixed length B=2 T=17, safe gate, value-first state, L=8": (
        dict(B=2, T=17, H=1, HV=2, K=8, V=8, gate="safe", initial_state="vk"), 8, True),
    "fixed length, log-decay gate, no initial state, no dht, L=5": (
        dict(B=2, T=12, H=1, HV=2, K=8, V=8, gate="none"), 5, False),
}


def _naive_direct_grads(inp, pos, named):
    """Every gradient of the float64 naive recurrence for the cotangents of ``pos``."""
    t64 = {n: x.detach().double().requires_grad_() for n, x in inp["tensors"].items()}
    opts = {n: x for n, x in named.items() if n not in ("A_log", "dt_bias", "initial_state", "segment_tokens")}
    o, ht = naive_recurrent_kda(t64["q"], t64["k"], t64["v"], t64["g"], t64["beta"], A_log=t64.get("A_log"),
                                dt_bias=t64.get("dt_bias"), initial_state=t64.get("initial_state"),
                                output_final_state=True, **opts)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]
    present = [n for n in names if n in t64]
    outs, cots = [o], [pos[5].double()]
    if pos[6] is not None:
        outs.append(ht)
        cots.append(pos[6].double())
    got = dict(zip(present, torch.autograd.grad(outs, [t64[n] for n in present], cots)))
    return [got.get(n) for n in names]


@pytest.mark.parametrize("case", list(SEGMENT_CASES))
@pytest.mark.slow
def test_segmented_backward_matches_naive_and_one_pass(triton_backend, case):
    kw, L, with_dht = SEGMENT_CASES[case]
    inp = _inputs(20, **kw)
    pos, named = _direct_args(inp)
    if not with_dht:
        pos = pos[:6] + (None,)
    ws = Workspace("cpu")
    seg = recurrent_kda_backward(*pos, **named, segment_tokens=L, workspace=ws)
    assert any(n.startswith(SEG) for n in ws._buffers), "the segmented path did not run"
    one = recurrent_kda_backward(*pos, **named)
    for gname, want, s, o in zip(GRAD_NAMES, _naive_direct_grads(inp, pos, named), seg, one):
        if want is None:
            assert s is None and o is None, gname
            continue
        assert s.dtype == o.dtype
        assert_close(gname, want, s, FP32_RATIO)
        if gname in GATE_GRADS:
            assert_close(gname + " (vs one pass)", o.double(), s, FP32_RATIO)
        else:
            assert torch.equal(s, o), gname


def test_segmented_autograd_matches_naive(triton_backend):
    inp = _inputs(21, T=21, H=1, HV=2, K=8, V=8, gate="softplus", seqlens=[13, 0, 8], initial_state="kv")
    _check_against_naive(inp, segment_tokens=4)


def _workspace_sizes(ws):
    return {n: b.numel() * b.element_size() for n, b in ws._buffers.items()}


def test_segmented_scratch_is_bounded_in_T_and_predicted(triton_backend):
    L, sizes = 8, {}
    for T in (40, 80):
        inp = _inputs(22, B=1, T=T, H=1, HV=1, K=4, V=4, gate="safe", initial_state="kv")
        pos, named = _direct_args(inp)
        ws = Workspace("cpu")
        recurrent_kda_backward(*pos, **named, segment_tokens=L, workspace=ws)
        sizes[T] = _workspace_sizes(ws)
        assert ws.nbytes == backward_scratch_bytes([T], 1, 1, 4, 4, segment_tokens=L, dtypes=dict(
            q=torch.float32, k=torch.float32, v=torch.float32, g=torch.float32, beta=torch.float32,
            do=torch.float32, A_log=torch.float32, dt_bias=torch.float32))
    ckpt = SEG + "checkpoints"
    # the checkpoints hold one [K, V] fp32 state per segment boundary: 4 and 9 of them
    assert sizes[40][ckpt] == 4 * 4 * 16 and sizes[80][ckpt] == 9 * 4 * 16
    del sizes[40][ckpt], sizes[80][ckpt]
    assert sizes[40] == sizes[80]
    want = segmented_scratch_shapes(L, 10, 1, 1, 1, 4, 4, dict.fromkeys(
        ("q", "k", "v", "g", "beta", "do", "A_log", "dt_bias"), torch.float32))
    assert set(sizes[80]) == set(want) - {ckpt}


def test_segmented_out_workspace_reuse_and_determinism(triton_backend):
    inp = _inputs(23, T=20, H=1, HV=2, K=8, V=8, gate="softplus", seqlens=[11, 9], initial_state="kv")
    pos, named = _direct_args(inp)
    like = [pos[0], pos[1], pos[2], pos[3], pos[4], named["A_log"], named["dt_bias"], named["initial_state"]]
    out = [torch.full_like(x, float("nan")) for x in like]
    ws = Workspace("cpu")
    first = recurrent_kda_backward(*pos, **named, workspace=ws, out=out, segment_tokens=4)
    for o_, g_ in zip(out, first):
        assert g_ is o_ and torch.isfinite(g_).all()
    snapshot = [g_.clone() for g_ in first]
    held = {n: b.data_ptr() for n, b in ws._buffers.items()}
    plans = dict(ws._plans)
    again = recurrent_kda_backward(*pos, **named, workspace=ws, out=out, segment_tokens=4)
    assert {n: b.data_ptr() for n, b in ws._buffers.items()} == held
    assert len(plans) == 1 and all(ws._plans[k] is p for k, p in plans.items()), "the segment plan was rebuilt"
    for a, b in zip(snapshot, again):
        assert torch.equal(a, b)


def test_sequences_within_segment_tokens_take_the_one_pass_path(triton_backend):
    # T = 17 fixed and varlen [9, 8] (B*T > segment_tokens, but no sequence is longer)
    for kw, L in ((dict(B=2, T=17, H=1, HV=2, K=8, V=8, gate="safe", initial_state="vk"), 17),
                  (dict(T=17, H=1, HV=2, K=8, V=8, gate="safe", seqlens=[9, 8], initial_state="vk"), 9)):
        inp = _inputs(24, **kw)
        pos, named = _direct_args(inp)
        ws_default, ws_l = Workspace("cpu"), Workspace("cpu")
        a = recurrent_kda_backward(*pos, **named, workspace=ws_default)
        b = recurrent_kda_backward(*pos, **named, workspace=ws_l, segment_tokens=L)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        B, T = pos[0].shape[:2]
        N = B if "cu_seqlens" not in named else len(named["cu_seqlens"]) - 1
        want = {"recurrent_bwd." + n: math.prod(s) * 4 for n, (s, _) in scratch_shapes(B, T, 2, 8, 8, N).items()}
        assert _workspace_sizes(ws_l) == _workspace_sizes(ws_default) == want


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_segment_tokens_is_checked(triton_backend, bad, exc):
    inp = _inputs(25, B=1, T=3, H=1, HV=2, K=8, V=8, gate="softplus", initial_state="kv")
    pos, named = _direct_args(inp)
    with pytest.raises(exc, match="^segment_tokens must be"):
        recurrent_kda_backward(*pos, **named, segment_tokens=bad)
    t, kw = _small()
    with pytest.raises(exc, match="^segment_tokens must be"):
        _fwd(t, kw, segment_tokens=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_path_returns_o_in_the_input_dtype(dtype):
    # the PyTorch path used to return fp32 o for 16-bit inputs (the Triton path returns v's dtype)
    inp = make_kda_inputs(T=9, H=2, K=16, V=16, dtype=dtype, gate="safe", initial_state="kv")
    o, ht = fused_recurrent_kda(**inp["tensors"], **inp["kwargs"])
    assert o.dtype == dtype and ht.dtype == torch.float32
    ref, _ = naive_recurrent_kda(**{n: x.detach().double() for n, x in inp["tensors"].items()}, **inp["kwargs"])
    assert_close("o", ref, o, 0.005)


def test_naive_rejects_unknown_arguments():
    inp = make_kda_inputs(T=4, H=1, K=16, V=16, dtype=torch.float64, gate="safe")
    with pytest.raises(TypeError):
        naive_recurrent_kda(**inp["tensors"], **inp["kwargs"], use_qk_l2norm=True)


def test_several_value_blocks_with_final_state_gradient(triton_backend):
    # V = 64 spans two 32-column blocks of the backward kernels, with a final-state cotangent (dht): the
    # per-block partial sums are indexed by the grid (N * HV programs on axis 0, value blocks on axis 1)
    inp = _inputs(31, B=2, T=5, H=2, HV=4, K=16, V=64, gate="safe", initial_state="kv")
    _check_against_naive(inp)
