"""CPU tier of the layer's Triton stages on the interpreter: the short convolution
(``kdakit/nn/short_conv_triton.py``) and the gated RMSNorm (``kdakit/nn/gated_norm_triton.py``) against their
float64 PyTorch twins (``kdakit.nn.short_conv`` / ``GatedRMSNorm`` on CPU tensors), values and every gradient:
fixed-length and packed batches (uneven and zero-length sequences, more sequences than one search step covers),
left contexts in FLA's conv-state layout and channel-contiguous, bias / no bias, SiLU / none, strided inputs and
gradients, backward programs over several tiles; what the autograd functions save; the argument errors; and the
sm_90a builds at the launch configs (registers, no spills)."""

import pytest
import torch

import kdakit.nn.gated_norm_triton as GN
import kdakit.nn.short_conv_triton as SC
from kdakit.nn import short_conv
from kdakit.nn.gated_norm import _GatedRMSNormFn
from kdakit.ops.kda.backend import triton_interpreting
from kdakit.testing import assert_close

from ..ops.kda._sm90_build import read_reports, run_sm90_build

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tier)")

# rms(error) / rms(reference) against float64: fp32 kernels; fp16 inputs and outputs
RATIO = {torch.float32: 2e-6, torch.float16: 2e-3}


def rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# short convolution
# ---------------------------------------------------------------------------------------

# seqlens: packed lengths (B = 1) or None (B rows of T tokens). T spans several forward and backward tiles.
CONV_CASES = {
    "batched_W4_bias_ctx": dict(B=2, T=70, C=5, W=4, seqlens=None, bias=True, ctx="fla", act="silu"),
    "batched_W2_no_act": dict(B=3, T=19, C=20, W=2, seqlens=None, bias=True, ctx=None, act=None),
    "packed_uneven_zero_len": dict(B=1, T=None, C=70, W=4, seqlens=(0, 3, 1, 40, 0, 35, 20, 0), bias=True,
                                   ctx="fla", act="silu"),
    "packed_W3_no_ctx": dict(B=1, T=None, C=9, W=3, seqlens=(5, 0, 60, 2), bias=False, ctx=None, act="silu"),
    "packed_many_seqs": dict(B=1, T=None, C=6, W=4, seqlens=tuple((7 * n) % 5 for n in range(37)), bias=False,
                             ctx="rows", act="silu"),
    "packed_W1": dict(B=1, T=None, C=4, W=1, seqlens=(2, 9), bias=True, ctx="fla", act="silu"),
}


def conv_inputs(c, seed=0):
    """float64 x [B, T, C] (a strided slice of a wider tensor), weight [C, 1, W], bias, context [N, C, W-1]
    (FLA's layout, a channel slice of a conv-state pool; or a transposed view of a channel-contiguous buffer),
    cu_seqlens and dy (a strided view)."""
    B, C, W = c["B"], c["C"], c["W"]
    if c["seqlens"] is None:
        T, cu, N = c["T"], None, B
    else:
        T, N = sum(c["seqlens"]), len(c["seqlens"])
        cu = torch.tensor([0, *torch.tensor(c["seqlens"]).cumsum(0).tolist()], dtype=torch.int32)
    x = rand(B, T, 3 * C, seed=seed + 1)[..., C:2 * C]
    w = rand(C, 1, W, seed=seed + 2, scale=0.6)
    b = rand(C, seed=seed + 3) if c["bias"] else None
    ctx = None
    if c["ctx"] == "fla":
        ctx = rand(N, 2 * C, W - 1, seed=seed + 4)[:, C:]                       # channel stride W-1
    elif c["ctx"] == "rows":
        ctx = rand(N, W - 1, C, seed=seed + 4).transpose(1, 2)                  # channel stride 1
    dy = rand(B, 2 * T, C, seed=seed + 5)[:, ::2]
    return x, w, b, ctx, cu, dy


def run_conv(fn, x, w, b, ctx, cu, dy, act, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    xx, ww, bb = leaves[0], leaves[1], leaves[2] if b is not None else None
    y = fn(xx, ww, bb, act, cu, None if ctx is None else ctx.to(dtype))
    grads = torch.autograd.grad(y, leaves, dy.to(dtype))
    return y, grads


@pytest.mark.parametrize("name, dtype", [pytest.param(n, torch.float32, id=f"{n}-fp32") for n in CONV_CASES]
                         + [pytest.param(n, torch.float16, id=f"{n}-fp16")
                            for n in ("packed_uneven_zero_len", "batched_W2_no_act")])
def test_short_conv_triton_matches_float64_twin(name, dtype):
    c = CONV_CASES[name]
    x, w, b, ctx, cu, dy = conv_inputs(c)
    y_ref, g_ref = run_conv(short_conv, x, w, b, ctx, cu, dy, c["act"], torch.float64)
    y, g = run_conv(SC.short_conv_triton, x, w, b, ctx, cu, dy, c["act"], dtype)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(f"{name} y", y_ref, y.double(), RATIO[dtype])
    for pname, a, got in zip(("x", "weight", "bias"), g_ref, g):
        assert got.dtype == dtype and got.shape == a.shape, pname
        # dense, in the (contiguous) parameter's layout: no copy for autograd to make
        assert got.is_contiguous(), f"d{pname} strides {got.stride()}"
        assert_close(f"{name} d{pname}", a, got.double(), RATIO[dtype])


def test_short_conv_triton_backward_programs_over_several_tiles(monkeypatch):
    """A backward grid of 2 programs per channel block (2 blocks), each summing several token tiles (the last
    one past the end): the same gradients; only the requested ones are computed."""
    monkeypatch.setattr(SC, "BWD_TARGET_PROGRAMS", 4)
    c = CONV_CASES["packed_uneven_zero_len"]
    x, w, b, ctx, cu, dy = conv_inputs(c, seed=10)
    S, per = SC.backward_splits(1, x.shape[1], x.shape[2])
    assert S == 2 and per > 1 and S * per > SC.triton.cdiv(x.shape[1], SC.BWD_BLOCK_T)
    _, g_ref = run_conv(short_conv, x, w, b, ctx, cu, dy, "silu", torch.float64)
    _, g = run_conv(SC.short_conv_triton, x, w, b, ctx, cu, dy, "silu", torch.float32)
    for pname, a, got in zip(("x", "weight", "bias"), g_ref, g):
        assert_close(f"split d{pname}", a, got.double(), RATIO[torch.float32])
    # weight alone, then x alone
    xf, wf = x.float(), w.float().requires_grad_()
    (gw,) = torch.autograd.grad(SC.short_conv_triton(xf, wf, None, "silu", cu, ctx.float()), [wf], dy.float())
    w_ref = w.clone().requires_grad_()
    (gw_ref,) = torch.autograd.grad(short_conv(x, w_ref, None, "silu", cu, ctx), [w_ref], dy)
    assert_close("weight-only dweight", gw_ref, gw.double(), RATIO[torch.float32])
    xg = x.float().requires_grad_()
    (gx,) = torch.autograd.grad(SC.short_conv_triton(xg, w.float(), b.float(), "silu", cu, ctx.float()), [xg],
                                dy.float())
    assert_close("x-only dx", g_ref[0], gx.double(), RATIO[torch.float32])


def test_short_conv_triton_saves_only_inputs_and_empty_calls():
    """Saved for backward: x itself and nothing else T-sized. T = 0: empty output, zero gradients."""
    x = rand(2, 40, 8, seed=21).float().requires_grad_()
    w = rand(8, 1, 4, seed=22).float().requires_grad_()
    ctx = rand(2, 8, 3, seed=23).float()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = SC.short_conv_triton(x, w, None, "silu", None, ctx)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr(), [tuple(t.shape) for t in saved]
    assert sum(t.numel() for t in saved) <= x.numel() + w.numel() + ctx.numel()
    y.sum().backward()
    x0 = torch.zeros(1, 0, 8, requires_grad=True)
    y0 = SC.short_conv_triton(x0, w, None, "silu", torch.tensor([0, 0], dtype=torch.int32))
    assert y0.shape == (1, 0, 8)
    (gw,) = torch.autograd.grad(y0.sum(), [w])
    assert torch.equal(gw, torch.zeros_like(w))


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, w: SC.short_conv_triton(x.double(), w), TypeError, "x must be float16, bfloat16 or float32"),
    (lambda x, w: SC.short_conv_triton(x, w.double()), TypeError, "weight must be float16"),
    (lambda x, w: SC.short_conv_triton(x, w, context=torch.zeros(2, 4, 3, dtype=torch.float64)), TypeError,
     "context must be float16"),
    (lambda x, w: SC.short_conv_triton(x.long(), w), TypeError, "x must be a floating tensor"),
    (lambda x, w: SC.short_conv_triton(x, torch.zeros(4, 1, 9)), ValueError, "weight: the Triton kernels take"),
    (lambda x, w: SC.short_conv_triton(x, w[:3]), ValueError, "weight must have shape"),
    (lambda x, w: SC.short_conv_triton(x, w, bias=torch.zeros(3)), ValueError, "bias"),
    (lambda x, w: SC.short_conv_triton(x, w, activation="gelu"), ValueError, "activation"),
    (lambda x, w: SC.short_conv_triton(x, w, cu_seqlens=torch.tensor([0, 3])), ValueError, "batch size 1"),
    (lambda x, w: SC.short_conv_triton(x[:1], w, cu_seqlens=torch.tensor([0.0, 3.0])), TypeError, "cu_seqlens"),
    (lambda x, w: SC.short_conv_triton(x, w, context=torch.zeros(2, 4, 2)), ValueError, "context must have shape"),
])
def test_short_conv_triton_bad_arguments_raise(call, exc, match):
    x = rand(2, 3, 4, seed=31).float()
    w = rand(4, 1, 4, seed=32).float()
    with pytest.raises(exc, match=match):
        call(x, w)


def test_triton_stages_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(SC, "triton_interpreting", lambda: False)
    monkeypatch.setattr(GN, "triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        SC.short_conv_triton(torch.zeros(1, 2, 4), torch.zeros(4, 1, 4))
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        GN.gated_rmsnorm_triton(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8))


# ---------------------------------------------------------------------------------------
# gated RMSNorm
# ---------------------------------------------------------------------------------------

NORM_CASES = {
    "layer_rows_D128": dict(shape=(2, 37, 3), D=128),
    "D100_not_pow2": dict(shape=(5,), D=100),
    "flat_rows_D64": dict(shape=(1000,), D=64),
}


def norm_inputs(shape, D, seed):
    x = rand(*shape, 2 * D, seed=seed)[..., :D]                                 # a strided row view
    g = rand(*shape, D, seed=seed + 1, scale=2.0)
    w = 1.0 + 0.3 * rand(D, seed=seed + 2)
    do = rand(*shape, D, seed=seed + 3)
    return x, g, w, do


def run_norm(fn, x, g, w, do, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, g, w)]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, do.to(dtype))


def ref_norm(x, g, w, eps=1e-5):
    """The PyTorch twin (GatedRMSNorm's autograd function on CPU tensors) with w as a differentiable input."""
    return _GatedRMSNormFn.apply(x, g, w, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_gated_norm_triton_matches_float64_twin(name, dtype):
    c = NORM_CASES[name]
    x, g, w, do = norm_inputs(c["shape"], c["D"], seed=40)
    o_ref, g_ref = run_norm(lambda x, g, w: ref_norm(x, g, w), x, g, w, do, torch.float64)
    o, grads = run_norm(lambda x, g, w: GN.gated_rmsnorm_triton(x, g, w, 1e-5), x, g, w, do, dtype)
    assert o.dtype == dtype and o.shape == x.shape
    assert_close(f"{name} out", o_ref, o.double(), RATIO[dtype])
    for pname, a, got in zip(("x", "gate", "weight"), g_ref, grads):
        assert got.dtype == dtype and got.shape == a.shape, pname
        assert_close(f"{name} d{pname}", a, got.double(), RATIO[dtype])


def test_gated_norm_triton_backward_programs_over_several_blocks(monkeypatch):
    """Backward programs over several row blocks (and one past the end); an expanded d_out (stride 0);
    saved tensors: x, gate, weight and the fp32 rstd, nothing else."""
    monkeypatch.setattr(GN, "BWD_TARGET_PROGRAMS", 3)
    x, g, w, do = norm_inputs((300,), 64, seed=50)
    S, per = GN.backward_splits(300)
    assert S == 3 and per > 1
    _, g_ref = run_norm(lambda x, g, w: ref_norm(x, g, w), x, g, w, do, torch.float64)
    _, grads = run_norm(lambda x, g, w: GN.gated_rmsnorm_triton(x, g, w), x, g, w, do, torch.float32)
    for pname, a, got in zip(("x", "gate", "weight"), g_ref, grads):
        assert_close(f"split d{pname}", a, got.double(), RATIO[torch.float32])
    xf, gf, wf = (t.float().requires_grad_() for t in (x, g, w))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = GN.gated_rmsnorm_triton(xf, gf, wf)
    assert [tuple(t.shape) for t in saved] == [(300, 64), (300, 64), (64,), (300,)]
    assert saved[3].dtype == torch.float32
    got = torch.autograd.grad(out.sum(), [xf, gf, wf])
    xd, gd, wd = (t.detach().requires_grad_() for t in (x, g, w))
    want = torch.autograd.grad(ref_norm(xd, gd, wd).sum(), [xd, gd, wd])
    for pname, a, b in zip(("x", "gate", "weight"), want, got):
        assert_close(f"expanded d{pname}", a, b.double(), RATIO[torch.float32])


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, g, w: GN.gated_rmsnorm_triton(x.double(), g.double(), w), TypeError, "x must be float16"),
    (lambda x, g, w: GN.gated_rmsnorm_triton(x, g, w.double()), TypeError, "weight must be float16"),
    (lambda x, g, w: GN.gated_rmsnorm_triton(x, g[:, :4], w), ValueError, "x and gate must have one shape"),
    (lambda x, g, w: GN.gated_rmsnorm_triton(x, g, w[:4]), ValueError, "weight must have shape"),
    (lambda x, g, w: GN.gated_rmsnorm_triton(x.unsqueeze(0).expand(2, 6, 8).transpose(0, 1),
                                             g.unsqueeze(1).expand(6, 2, 8), w), ValueError, "x must be viewable as"),
    (lambda x, g, w: GN.gated_rmsnorm_triton(x, g, w, eps=-1.0), ValueError, "eps"),
    (lambda x, g, w: GN.gated_rmsnorm_triton(torch.zeros(2, 2048), torch.zeros(2, 2048), torch.ones(2048)),
     ValueError, "D <= 1024"),
])
def test_gated_norm_triton_bad_arguments_raise(call, exc, match):
    x, g, w = rand(6, 8, seed=61).float(), rand(6, 8, seed=62).float(), torch.ones(8)
    with pytest.raises(exc, match=match):
        call(x, g, w)


# ---------------------------------------------------------------------------------------
# sm_90a builds
# ---------------------------------------------------------------------------------------

# At the layer's shapes (C = 2048 channels per projection, W = 4, D = 128) the JIT specializes unit strides to
# the constant 1 (x's and dy's channel stride, the weight's tap stride, the context rows' channel stride) and
# gives the multiples of 16 (token strides, T, C) the divisibility hint; the weight's channel stride (W) and the
# counts that vary per call are left without one.
BUILD = r"""
from tests.ops.kda._sm90_build import print_reports, sm90_report
import kdakit.nn.short_conv_triton as SC
import kdakit.nn.gated_norm_triton as GN

UNIT = dict(s_xc=1, s_ww=1, s_ctx_c=1, s_dyc=1)
UNALIGNED = ("s_wc", "n_seqs", "tiles_per_prog", "n_tiles", "tiles_per_row", "R", "blocks_per_prog")
out = {}
for dt in ("*bf16", "*fp32"):
    types = {n: dt for n in ("x", "weight", "bias", "context", "y", "dy", "dx", "gate", "out", "d_out", "dg")}
    types.update(cu_seqlens="*i32", dw_part="*fp32", db_part="*fp32", rstd="*fp32", eps="fp32")
    for varlen, ctx, bias in ((True, True, True), (False, False, False)):
        common = dict(W=4, HAS_BIAS=bias, HAS_CONTEXT=ctx, SILU=True, IS_VARLEN=varlen,
                      SEARCH_STEPS=8 if varlen else 0, **UNIT)
        fwd = {k: v for k, v in common.items() if k in SC.short_conv_fwd_kernel.arg_names}
        out[f"conv_fwd {dt} varlen={varlen} ctx={ctx}"] = dict(sm90_report(
            SC.short_conv_fwd_kernel, types, dict(fwd, BT=SC.FWD_BLOCK_T, BC=SC.FWD_BLOCK_C),
            SC.FWD_NUM_WARPS, 1, UNALIGNED), warps=SC.FWD_NUM_WARPS)
        out[f"conv_bwd {dt} varlen={varlen} ctx={ctx}"] = dict(sm90_report(
            SC.short_conv_bwd_kernel, types, dict(common, BT=SC.BWD_BLOCK_T, BC=SC.BWD_BLOCK_C, NEED_DX=True,
            NEED_DW=True, NEED_DB=bias), SC.BWD_NUM_WARPS, 1, UNALIGNED), warps=SC.BWD_NUM_WARPS)
    out[f"norm_fwd {dt}"] = dict(sm90_report(GN.gated_rmsnorm_fwd_kernel, types,
        dict(BR=GN.FWD_BLOCK_ROWS, BD=128, s_xd=1, s_gd=1), GN.FWD_NUM_WARPS, 1, UNALIGNED), warps=GN.FWD_NUM_WARPS)
    out[f"norm_bwd {dt}"] = dict(sm90_report(GN.gated_rmsnorm_bwd_kernel, types,
        dict(BR=GN.BWD_BLOCK_ROWS, BD=128, NEED_DX=True, NEED_DG=True, NEED_DW=True, s_xd=1, s_gd=1, s_od=1),
        GN.BWD_NUM_WARPS, 1, UNALIGNED), warps=GN.BWD_NUM_WARPS)
print_reports(out)
"""

# Register budgets at the launch configs (4 warps each, so 160 registers still fit three programs on an SM):
# the convolution's forward with a context selects a row pointer per vector (fp32 has twice the vectors of
# bf16); its backward holds 2W-1 source tiles and W dw accumulators.
REG_BUDGET = {"conv_fwd": 160, "conv_bwd": 176, "norm_fwd": 96, "norm_bwd": 160}


def test_stage_kernels_build_for_sm90_without_spills():
    reports = read_reports(run_sm90_build(BUILD))
    assert len(reports) == 12, reports
    for name, r in reports.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)
        assert r["regs"] <= REG_BUDGET[name.split()[0]], (name, r)
