"""Token tensors as views of wider tensors on the recurrent, decode and layer paths: the Triton kernels (under
the interpreter here) read q, k, v, g, beta, o and dO through their (batch, token, head) strides, with no copy,
and need a unit stride in the last dimension only; the PyTorch path takes any layout. Either way a view gives the
contiguous call's bits: outputs, final states, pool rows and every gradient.

The views are the ones engines pass: q, k, v, g and beta split from one fused projection, ``transpose``d
``[T, B, ...]`` buffers, and every other head of a tensor with twice the heads (beta's last stride is then 2). Any
other layout (a last stride other than 1) is refused with a ValueError naming the tensor.
"""

import pytest
import torch

from kdakit.nn import KimiDeltaAttention
from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.recurrent.backward import recurrent_kda_backward
from kdakit.testing import make_kda_inputs

TOKENS = ("q", "k", "v", "g", "beta")
PARAMS = ("A_log", "dt_bias", "initial_state")
LAYOUTS = ("split", "transpose", "heads")


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    if request.param == "triton" and not triton_interpreting():
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1 (the CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values as a view of a wider tensor ([B, T, heads, ...] or, for beta, [B, T, heads])."""
    if layout == "transpose":  # a [T, B, ...] buffer seen as [B, T, ...]
        view = x.detach().transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "heads":  # every other head of a tensor with twice the heads
        wide = torch.zeros(*x.shape[:2], 2 * x.shape[2], *x.shape[3:], dtype=x.dtype)
        wide[:, :, ::2] = x.detach()
        view = wide[:, :, ::2]
    else:
        raise ValueError(layout)
    assert torch.equal(view, x) and not view.is_contiguous()
    return view


def fused_split(tensors: dict, names=TOKENS) -> dict:
    """``names`` as views split from one fused projection ``[B, T, sum of widths]`` (vLLM's ``mixed_qkv``)."""
    flat = [tensors[n].detach().reshape(*tensors[n].shape[:2], -1) for n in names]
    fused = torch.cat(flat, -1)
    parts = fused.split([f.shape[-1] for f in flat], -1)
    views = {n: p.view(tensors[n].shape) for n, p in zip(names, parts)}
    for n, x in views.items():
        assert torch.equal(x, tensors[n]) and not x.is_contiguous(), n
    return views


def as_views(tensors: dict, layout: str) -> dict:
    """The token tensors of ``tensors`` as views (``layout``), the rest as they are."""
    out = dict(tensors)
    out.update(fused_split(tensors) if layout == "split" else {n: strided(tensors[n], layout) for n in TOKENS})
    return out


def _inputs(layout, seed=3, **kw):
    """Tiny fp32 inputs with every option the kernels read: GVA, the in-kernel gate with A_log and dt_bias,
    l2norm, sigmoid beta, an initial state. The split case packs two sequences (B = 1, cu_seqlens)."""
    if layout == "split":
        kw = dict(B=1, T=9, seqlens=[4, 5], **kw)
    else:
        kw = dict(B=2, T=5, **kw)
    inp = make_kda_inputs(H=1, HV=2, K=8, V=8, dtype=torch.float32, gate="softplus", initial_state="kv",
                          generator=torch.Generator().manual_seed(seed), **kw)
    return {n: x.detach() for n, x in inp["tensors"].items()}, dict(inp["kwargs"])


def _recurrent(t, kw, do, dht, **extra):
    """fused_recurrent_kda forward and autograd backward: o, the final state and the gradient of every input
    (detach keeps a view's strides: the gradients are the views' own)."""
    t = {n: x.detach().requires_grad_() for n, x in t.items()}
    o, ht = fused_recurrent_kda(*(t[n] for n in TOKENS), **{n: t[n] for n in PARAMS if n in t}, **dict(kw, **extra))
    grads = torch.autograd.grad([o, ht], list(t.values()), [do, dht])
    res = {"o": o.detach(), "ht": ht.detach()}
    res.update({"d" + n: gr for n, gr in zip(t, grads)})
    return res


def _cotangents(t, kw, seed=11):
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(t["v"].shape, generator=gen)
    return do, torch.randn(t["initial_state"].shape, generator=gen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recurrent_views_give_the_contiguous_bits(backend, layout):
    """Forward, final state and all eight gradients from views equal the contiguous call's, bit for bit; the
    cotangent dO is a strided view too (the backward reads it in place). Gradients are new dense tensors."""
    t, kw = _inputs(layout)
    do, dht = _cotangents(t, kw)
    ref = _recurrent(t, kw, do, dht)
    views = as_views(t, layout)
    got = _recurrent(views, kw, strided(do, "heads" if layout == "split" else layout), dht)
    for name, r in ref.items():
        assert torch.equal(got[name], r), f"{layout}: {name} differs from the contiguous call's"
        if name[1:] in TOKENS:
            assert got[name].shape == t[name[1:]].shape


def test_recurrent_segmented_backward_and_public_backward_read_views(backend):
    """The segmented backward (segments of 2 tokens: gathered copies of the views) and ``recurrent_kda_backward``
    called directly with views and a strided dO give the contiguous call's gradients."""
    t, kw = _inputs("transpose")
    do, dht = _cotangents(t, kw)
    ref = _recurrent(t, kw, do, dht, segment_tokens=2)
    got = _recurrent(as_views(t, "heads"), kw, strided(do, "heads"), dht, segment_tokens=2)
    for name, r in ref.items():
        assert torch.equal(got[name], r), f"segmented: {name}"

    opts = {n: x for n, x in kw.items() if n != "output_final_state"}
    named = {n: t[n] for n in PARAMS}
    ref_g = recurrent_kda_backward(*(t[n] for n in TOKENS), do, dht, **named, **opts)
    v = fused_split(t)
    got_g = recurrent_kda_backward(*(v[n] for n in TOKENS), strided(do, "transpose"), dht, **named, **opts)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"), ref_g, got_g):
        assert torch.equal(a, b), f"recurrent_kda_backward: {name}"
        assert b.is_contiguous(), name


def test_recurrent_writes_a_strided_out(backend):
    """``out=`` may be a view of a wider tensor (unit last stride): written in place, the contiguous call's
    bits, the columns in between untouched."""
    t, kw = _inputs("transpose")
    kw["output_final_state"] = False
    args = [t[n] for n in TOKENS]
    named = {n: t[n] for n in PARAMS}
    ref, _ = fused_recurrent_kda(*args, **named, **kw)
    wide = torch.full((*t["v"].shape[:2], 2 * t["v"].shape[2], t["v"].shape[3]), 7.0)
    out = wide[:, :, 1::2]
    o, _ = fused_recurrent_kda(*(t[n] for n in TOKENS), **named, **kw, out=out)
    assert torch.equal(out, ref) and torch.equal(o, ref)
    assert torch.equal(wide[:, :, ::2], torch.full_like(ref, 7.0))


# --- decode ------------------------------------------------------------------------------------------------

def _decode_case(N, T, seqlens=None, seed=5):
    gen = torch.Generator().manual_seed(seed)
    B, TT = (1, sum(seqlens)) if seqlens else (N, T)
    inp = make_kda_inputs(B=B, T=TT, H=1, HV=2, K=8, V=8, dtype=torch.float32, gate="softplus", seqlens=seqlens,
                          generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = {n: x for n, x in inp["kwargs"].items() if n != "safe_gate"}
    pool = 0.5 * torch.randn(6, 2, 8, 8, generator=gen)
    return t, kw, pool


def _decode(t, kw, pool, idx, **extra):
    pool = pool.clone()
    o = kda_decode(*(t[n] for n in TOKENS), pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"], **dict(kw, **extra))
    return o, pool


@pytest.mark.parametrize("case", ["one-token step", "multi-token per-token rows", "packed"])
def test_decode_views_give_the_contiguous_bits(backend, case):
    """kda_decode from views: the one-token in-place step (its own kernel), several tokens with per-token rows
    and packed sequences (the pool kernel); o written into a strided ``out``. The same o and pool rows."""
    if case == "one-token step":
        t, kw, pool = _decode_case(N=3, T=1)
        idx, layouts = torch.tensor([4, -1, 1], dtype=torch.int32), ("split", "heads")  # T = 1: no transpose
    elif case == "multi-token per-token rows":
        t, kw, pool = _decode_case(N=2, T=3)
        idx, layouts = torch.tensor([[0, 1, 2], [5, 4, 3]], dtype=torch.int32), ("split", "transpose", "heads")
    else:
        t, kw, pool = _decode_case(N=3, T=None, seqlens=[2, 0, 3])
        idx, layouts = torch.tensor([2, 0, 5], dtype=torch.int32), ("split", "heads")
    ref_o, ref_pool = _decode(t, kw, pool, idx)
    for layout in layouts:
        wide = torch.full((*t["v"].shape[:3], 2 * t["v"].shape[3]), 3.0)
        out = wide[..., :t["v"].shape[3]]  # a strided out: the first half of every row
        o, got_pool = _decode(as_views(t, layout), kw, pool, idx, out=out)
        assert o is out and torch.equal(o, ref_o), f"{layout}: o"
        assert torch.equal(got_pool, ref_pool), f"{layout}: pool"
        assert torch.equal(wide[..., t["v"].shape[3]:], torch.full_like(ref_o, 3.0))


def test_fused_recurrent_serving_reads_views(backend):
    """fused_recurrent_kda's serving arguments (the pool kernel, FLA's in-place per-token rows) from a fused
    projection's split: the contiguous call's o and pool."""
    t, kw, pool = _decode_case(N=2, T=2)
    pool = pool.transpose(-1, -2).contiguous()  # [P, HV, K, V]
    idx = torch.tensor([[3, 0], [1, 5]], dtype=torch.int32)
    kw = dict(kw, ssm_state_indices=idx, inplace_final_state=True)

    def run(x):
        p = pool.clone()
        o, _ = fused_recurrent_kda(*(x[n] for n in TOKENS), A_log=x["A_log"], dt_bias=x["dt_bias"],
                                   initial_state=p, **kw)
        return o, p

    ref_o, ref_pool = run(t)
    o, p = run(fused_split(t) | {n: t[n] for n in ("A_log", "dt_bias")})
    assert torch.equal(o, ref_o) and torch.equal(p, ref_pool)


# --- refused layouts ---------------------------------------------------------------------------------------

def _non_unit_last(x):
    """x's values with last stride 2."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


@pytest.mark.parametrize("name", ["q", "k", "v", "g"])
def test_triton_refuses_a_non_unit_last_stride_naming_the_tensor(name, monkeypatch):
    """The Triton kernels need a unit last stride: fused_recurrent_kda and kda_decode name the tensor (the
    PyTorch path computes the call)."""
    if not triton_interpreting():
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1 (the CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    t, kw = _inputs("transpose")
    bad = dict(t, **{name: _non_unit_last(t[name])})
    pattern = rf"^{name} must have a unit stride in its last dimension .*got strides"
    with pytest.raises(ValueError, match=pattern):
        fused_recurrent_kda(*(bad[n] for n in TOKENS), **{n: bad[n] for n in PARAMS}, **kw)
    dt, dkw, pool = _decode_case(N=3, T=1)
    dbad = dict(dt, **{name: _non_unit_last(dt[name])})
    with pytest.raises(ValueError, match=pattern):
        _decode(dbad, dkw, pool, torch.tensor([0, 1, 2], dtype=torch.int32))
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    o, _ = fused_recurrent_kda(*(bad[n] for n in TOKENS), **{n: bad[n] for n in PARAMS}, **kw)
    ref, _ = fused_recurrent_kda(*(t[n] for n in TOKENS), **{n: t[n] for n in PARAMS}, **kw)
    assert torch.equal(o, ref)


def test_refused_cotangent_and_out_layouts(backend):
    """recurrent_kda_backward names a dO without unit last stride (Triton); an ``out`` without one, or one whose
    elements overlap, is refused on both backends."""
    t, kw = _inputs("transpose")
    do, dht = _cotangents(t, kw)
    if backend == "triton":
        opts = {n: x for n, x in kw.items() if n != "output_final_state"}
        with pytest.raises(ValueError, match=r"^do must have a unit stride in its last dimension"):
            recurrent_kda_backward(*(t[n] for n in TOKENS), _non_unit_last(do), dht,
                                   **{n: t[n] for n in PARAMS}, **opts)
    kw["output_final_state"] = False
    args, named = [t[n] for n in TOKENS], {n: t[n] for n in PARAMS}
    with pytest.raises(ValueError, match=r"^out must have a unit stride in its last dimension"):
        fused_recurrent_kda(*args, **named, **kw, out=_non_unit_last(torch.empty_like(t["v"])))
    overlapping = torch.empty(1, 1, *t["v"].shape[2:]).expand(t["v"].shape)
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        fused_recurrent_kda(*args, **named, **kw, out=overlapping)
    dt, dkw, pool = _decode_case(N=3, T=1)
    with pytest.raises(ValueError, match=r"^out must not overlap itself"):
        _decode(dt, dkw, pool, torch.tensor([0, 1, 2], dtype=torch.int32),
                out=torch.empty(1, 1, 2, 8).expand(dt["v"].shape))


# --- the layer ---------------------------------------------------------------------------------------------

def test_layer_fused_recurrent_and_step_take_strided_hidden_states(backend):
    """KimiDeltaAttention (mode='fused_recurrent', and ``step`` on kda_decode) on ``transpose``d hidden states:
    the contiguous call's output, input gradient and pool rows."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(12, head_dim=8, num_heads=1, num_v_heads=2, mode="fused_recurrent")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    x = torch.randn(2, 4, 12, generator=gen)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert not xt.is_contiguous()
    outs = []
    for h in (x, xt):
        h = h.detach().requires_grad_()
        out = layer(h)[0]
        dx, = torch.autograd.grad(out, h, torch.linspace(-1, 1, out.numel()).view(out.shape))
        outs.append((out.detach(), dx))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])

    pool0 = 0.5 * torch.randn(4, 2, 8, 8, generator=gen)
    conv0 = 0.5 * torch.randn(4, layer.conv_channels, layer.conv_size - 1, generator=gen)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    steps = []
    for h in (x[:, :1], xt[:, :1]):
        pool, conv = pool0.clone(), conv0.clone()
        steps.append((layer.step(h, conv, pool, idx), pool, conv))
    for a, b in zip(*steps):
        assert torch.equal(a, b)
