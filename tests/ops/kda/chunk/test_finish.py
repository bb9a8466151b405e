"""CPU tier of the 64-token pipeline's finish kernel (``kdakit/ops/kda/chunk/finish.py``) on the Triton interpreter:
the vector-Jacobian product of the forward's token transforms (l2norm, gate and chunk cumsum, beta activation)
against torch autograd on a float64 re-implementation of them, with random upstream gradients for q^, k^, G, g_C
and beta per chunk and value head; fixed-length and packed calls, grouped value heads, strided views, bf16 /
fp32, every gate mode; the clamp's zero gradient at -inf / -1000 / floored softplus log-decays, a NaN gate entry
giving NaN at that entry only; the sm_90a builds of every variant."""

import math

import pytest
import torch

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk.finish import FINISH_NUM_WARPS, SUM_NUM_WARPS, partial_sums, run_finish

from .._sm90_build import run_sm90_build
from .test_prep import (
    BUILD_HELPER,
    C,
    CASES,
    Case,
    beta_ref,
    case_id,
    check_builds,
    chunk_of,
    f64,
    gate_ref,
    make_inputs,
    rel_err,
    rstd_ref,
)

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
NAN = float("nan")


def upstream(c: Case, inp: dict, seed: int = 3) -> dict:
    """Random fp32 upstream slots (dqh, dkh, dgs [n, HV, C, K], dgc [n, HV, K], dbs [n, HV, C]) with NaN on
    padded rows (the kernel must never read them), and rq, rk as prep stores them (float64 reference in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(inp["rows"])
    s = dict(dqh=torch.randn(n, c.HV, C, c.K, generator=gen), dkh=torch.randn(n, c.HV, C, c.K, generator=gen),
             dgs=torch.randn(n, c.HV, C, c.K, generator=gen), dgc=torch.randn(n, c.HV, c.K, generator=gen),
             dbs=torch.randn(n, c.HV, C, generator=gen))
    rq, rk = rstd_ref(c, f64(inp["q"])), rstd_ref(c, f64(inp["k"]))
    s["rq"] = torch.stack([chunk_of(rq, b, t0, L).T for _, b, t0, L in inp["rows"]]).float()
    s["rk"] = torch.stack([chunk_of(rk, b, t0, L).T for _, b, t0, L in inp["rows"]]).float()
    for i, (_, _, _, L) in enumerate(inp["rows"]):
        for name in ("dqh", "dkh", "dgs", "dbs"):
            s[name][i, :, L:] = NAN
    return s


def vjp_ref(c: Case, inp: dict, s: dict) -> dict:
    """float64 autograd through l2norm, gate, chunk cumsum and beta activation of the forward: the gradients of
    sum_i <upstream_i, transform_i> w.r.t. q, k, g, beta (token tensors), and per chunk w.r.t. A_log and dt_bias
    ([n, HV], [n, HV, K])."""
    leaves = {name: f64(inp[name]).requires_grad_() for name in ("q", "k", "g", "beta")}
    for name in ("A_log", "dt_bias"):
        leaves[name] = f64(inp[name]).requires_grad_() if inp[name] is not None else None
    q, k = leaves["q"], leaves["k"]
    qh = q * rstd_ref(c, q)[..., None] if c.l2norm else q
    kh = k * rstd_ref(c, k)[..., None] if c.l2norm else k
    a = gate_ref(c, leaves["g"], leaves["A_log"], leaves["dt_bias"])
    bt = beta_ref(c, leaves["beta"])
    group = c.HV // c.H
    heads = torch.arange(c.HV) // group
    terms = []
    for i, (_, b, t0, L) in enumerate(inp["rows"]):
        G = a[b, t0:t0 + L].cumsum(0)  # [L, HV, K]
        t = (s["dgs"][i, :, :L].double().transpose(0, 1) * G).sum() + (s["dgc"][i].double() * G[L - 1]).sum()
        t = t + (s["dbs"][i, :, :L].double().T * bt[b, t0:t0 + L]).sum()
        t = t + (s["dqh"][i, :, :L].double().transpose(0, 1) * qh[b, t0:t0 + L][:, heads]).sum()
        t = t + (s["dkh"][i, :, :L].double().transpose(0, 1) * kh[b, t0:t0 + L][:, heads]).sum()
        terms.append(t)
    names = [n for n in ("q", "k", "g", "beta") if leaves[n] is not None]
    grads = torch.autograd.grad(sum(terms), [leaves[n] for n in names], retain_graph=True)
    ref = dict(zip(["d" + n for n in names], grads))
    for name, key in (("A_log", "dalog"), ("dt_bias", "dbias")):
        if leaves[name] is not None:
            ref[key] = torch.stack([torch.autograd.grad(t, leaves[name], retain_graph=True)[0] for t in terms])
    if "dbias" in ref:
        ref["dbias"] = ref["dbias"].view(len(terms), c.HV, c.K)
    return ref


def run_case(c: Case, inp: dict, s: dict) -> dict:
    """run_finish into NaN-filled outputs (dq, dk, dg, dbeta in the inputs' shapes and dtype, contiguous)."""
    n = len(inp["rows"])
    out = {name: torch.full(inp[name[1:]].shape, NAN, dtype=c.dtype) for name in ("dq", "dk", "dg", "dbeta")}
    gate_in_kernel = c.gate != "none"
    out["dalog"] = torch.full((n, c.HV), NAN) if gate_in_kernel else None
    out["dbias"] = torch.full((n, c.HV, c.K), NAN) if gate_in_kernel else None
    A_log, dt_bias = inp["opts"].kernel_gate_params(inp["A_log"], inp["dt_bias"])
    run_finish(inp["opts"], inp["table"], inp["q"], inp["k"], inp["g"], inp["beta"], A_log, dt_bias, s["rq"],
               s["rk"], s["dqh"], s["dkh"], s["dgs"], s["dgc"], s["dbs"], out["dq"], out["dk"], out["dg"],
               out["dbeta"], out["dalog"], out["dbias"])
    return out


# fp32: fp32 math on the slots (measured <= 3.4e-7); bf16: the outputs' rounding to nearest bf16, at most 2^-8
# relative (measured <= 2.8e-3)
LIMIT = {torch.float32: 2e-6, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_finish_is_the_vjp_of_the_token_transforms(c):
    inp = make_inputs(c, seed=2)
    s = upstream(c, inp)
    out = run_case(c, inp, s)
    ref = vjp_ref(c, inp, s)
    for name in ("dq", "dk", "dg", "dbeta"):
        assert not out[name].isnan().any(), name  # every token row written (the packed call covers all of T)
        assert rel_err(out[name], ref[name]) < LIMIT[c.dtype], name
    if c.gate == "none":
        # -inf and -1000 raw log-decays: the clamp holds there, so the gradient is exactly 0
        floored = inp["g"] <= -110
        assert floored.any() and (out["dg"][floored] == 0).all()
    else:
        for name, has in (("dalog", c.has_A), ("dbias", c.has_bias)):
            if has:
                assert rel_err(out[name], ref[name]) < 2e-6, name  # fp32 partials: measured <= 3.4e-7
        if c.gate == "softplus" and c.has_A:
            # g = 60 with exp(A_log) >= 4: a <= -4 * (60 + dt_bias) < -110 is floored, so dg is 0 there
            floored = inp["g"] == 60.0
            assert floored.any() and (out["dg"][floored] == 0).all()


@pytest.mark.parametrize("gate", ["softplus", "none"])
def test_nan_gate_entry(gate):
    """A NaN gate entry: with the softplus gate dg is NaN at that entry only (and the dA_log partial of its chunk,
    the ddt_bias partial of its column); the raw log-decay's derivative is 1, so there dg = da stays finite."""
    c = next(x for x in CASES if x.gate == gate and x.dtype == torch.float32) if gate == "none" else CASES[1]
    inp = make_inputs(c, seed=4)
    g = inp["g"]
    b, t, hv, col = (1, 66, 3, 5) if c.seqlens is None else (0, 40, 2, 7)
    g[b, t, hv, col] = NAN  # g is a view of its fused tensor: written in place
    s = upstream(c, inp)
    out = run_case(c, inp, s)
    ref = vjp_ref(c, inp, s)
    nan = out["dg"].isnan()
    if gate == "softplus":
        assert nan[b, t, hv, col] and nan.sum() == 1
        assert torch.equal(nan, ref["dg"].isnan())
        i = next(j for j, (_, rb, t0, L) in enumerate(inp["rows"]) if rb == b and t0 <= t < t0 + L)
        assert out["dalog"].isnan().sum() == 1 and out["dalog"][i, hv].isnan()
        assert out["dbias"].isnan().sum() == 1 and out["dbias"][i, hv, col].isnan()
    else:
        assert not nan.any()
    for name in ("dq", "dk", "dg", "dbeta"):
        assert rel_err(out[name], ref[name]) < LIMIT[c.dtype], name


def test_partials_without_gate_in_kernel():
    """Without the in-kernel gate the partials, when given anyway, are zeros, and dg is da (0 where floored)."""
    c = CASES[0]
    inp = make_inputs(c, seed=5)
    s = upstream(c, inp)
    n = len(inp["rows"])
    out = {name: torch.full(inp[name[1:]].shape, NAN, dtype=c.dtype) for name in ("dq", "dk", "dg", "dbeta")}
    dalog, dbias = torch.full((n, c.HV), NAN), torch.full((n, c.HV, c.K), NAN)
    run_finish(inp["opts"], inp["table"], inp["q"], inp["k"], inp["g"], inp["beta"], None, None, s["rq"], s["rk"],
               s["dqh"], s["dkh"], s["dgs"], s["dgc"], s["dbs"], out["dq"], out["dk"], out["dg"], out["dbeta"],
               dalog, dbias)
    assert (dalog == 0).all() and (dbias == 0).all()
    assert rel_err(out["dg"], vjp_ref(c, inp, s)["dg"]) < LIMIT[c.dtype]


def test_launcher_errors_name_the_argument():
    c = CASES[1]
    inp = make_inputs(c)
    s = upstream(c, inp)
    out = {name: torch.empty(inp[name[1:]].shape, dtype=c.dtype) for name in ("dq", "dk", "dg", "dbeta")}
    n = len(inp["rows"])
    A_log, dt_bias = inp["opts"].kernel_gate_params(inp["A_log"], inp["dt_bias"])
    args = dict(opts=inp["opts"], table=inp["table"], q=inp["q"], k=inp["k"], g=inp["g"], beta=inp["beta"],
                A_log=A_log, dt_bias=dt_bias, rq=s["rq"], rk=s["rk"], dqh=s["dqh"], dkh=s["dkh"], dgs=s["dgs"],
                dgc=s["dgc"], dbs=s["dbs"], dq=out["dq"], dk=out["dk"], dg=out["dg"], dbeta=out["dbeta"],
                dalog=torch.empty(n, c.HV), dbias=torch.empty(n, c.HV, c.K))
    for key, value, err in (("dgc", s["dgc"][:, :, :-1], ValueError), ("dg", out["dg"][:, :-1], ValueError),
                            ("dbs", s["dbs"].double(), TypeError), ("A_log", None, TypeError),
                            ("dt_bias", dt_bias[:-1], ValueError), ("dbias", torch.empty(n, c.HV), ValueError)):
        with pytest.raises(err, match=key):
            run_finish(**dict(args, **{key: value}))


@pytest.mark.parametrize("shape", [(1, 3), (45, 7, 19), (70, 130), (0, 5, 2)])
def test_partial_sums_are_the_column_sums(shape):
    """The per-chunk partials' sum over rows, against a float64 sum; row and column counts off the tile sizes."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    got = partial_sums(x)
    assert got.shape == (math.prod(shape[1:]),) and got.dtype == torch.float32
    want = x.double().sum(0).flatten()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * max(1, shape[0]) ** 0.5)
    assert torch.equal(partial_sums(x), got)


def test_partial_sums_errors_name_the_argument():
    for bad, err in ((torch.randn(4, 3).double(), ValueError), (torch.randn(4, 6)[:, ::2], ValueError),
                     (torch.randn(5), ValueError), ([1.0, 2.0], TypeError)):
        with pytest.raises(err, match="rows"):
            partial_sums(bad)


FINISH_BUILD = BUILD_HELPER + r'''
import kdakit.ops.kda.chunk.finish as M
ptr = {n: "*fp32" for n in ("A_log", "dt_bias", "rq", "rk", "dqh", "dkh", "dgs", "dgc", "dbs", "dalog", "dbias")}
unaligned = ("s_bh", "s_dbh", "lower_bound")  # beta's and dbeta's head strides are 1
# the variants whose code differs: each gate, with / without A_log, dt_bias and the partials, l2norm, the beta
# modes, GROUP 1 / 4, bf16 / fp32 token tensors
for dt, gate, has_a, has_b, l2, sig, neg, group in (("*bf16", 0, False, False, False, False, False, 1),
                                                    ("*bf16", 0, False, False, True, True, False, 4),
                                                    ("*bf16", 1, True, True, True, True, False, 4),
                                                    ("*bf16", 1, False, True, False, False, False, 1),
                                                    ("*bf16", 2, True, True, True, True, True, 4),
                                                    ("*fp32", 0, False, False, True, True, False, 4),
                                                    ("*fp32", 1, True, True, True, True, False, 4)):
    types = dict(ptr, **{n: dt for n in ("q", "k", "g", "beta", "dq", "dk", "dg", "dbeta")}, table="*i32",
                 lower_bound="fp32")
    build(M.chunk_finish_kernel, types, dict(HV=96, K=128, C=64, BR=M.FINISH_ROWS, BKF=128, BK=M.FINISH_BLOCK_K,
          GROUP=group, GATE=gate, HAS_A_LOG=has_a, HAS_BIAS=has_b, USE_L2NORM=l2, BETA_SIGMOID=sig, NEG_EIGVAL=neg,
          STORE_DALOG=gate != 0, STORE_DBIAS=gate != 0, INTERPRETED=False), M.FINISH_NUM_WARPS, unaligned)
build(M.partial_sums_kernel, dict(x="*fp32", out="*fp32", n="i32", W="i32"), dict(BR=M.SUM_ROWS, BW=M.SUM_BLOCK),
      M.SUM_NUM_WARPS, ("n", "W"))
'''


def test_finish_builds_for_sm90_without_spills():
    out = run_sm90_build(FINISH_BUILD)
    check_builds(out, 8, {8: 128})
    assert FINISH_NUM_WARPS <= 4 and SUM_NUM_WARPS <= 4
