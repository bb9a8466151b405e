"""GPU tier of the layer's Triton stages (run on the H200 with KDAKIT_TEST_TIER=gpu): the short convolution
(``kdakit/nn/short_conv_triton.py``) and the gated RMSNorm (``kdakit/nn/gated_norm_triton.py``) on CUDA tensors
against their PyTorch twins (the same modules under ``KDAKIT_BACKEND=torch``) at the layer's shapes, values and
every gradient, bf16 and fp32: each Triton result is compared with the float64 twin, and its error must stay
within a small factor of the twin's own error at the same dtype. Also: CUDA tensors take the Triton path (a
float64 CUDA tensor raises ``TypeError`` unless ``KDAKIT_BACKEND=torch``), and the forward+backward times of
both paths at 1 x 32K tokens are printed."""

import pytest
import torch

from kdakit.nn import short_conv
from kdakit.nn.gated_norm import GatedRMSNorm
from kdakit.testing import assert_close, error_report

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
RATIO = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def rand(*shape, seed, scale=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return scale * torch.randn(*shape, generator=gen, device=DEV, dtype=torch.float64)


def cu_from(seqlens):
    return torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


# B, T, C; packed lengths (B = 1) or None; W; bias; context
CONV_SHAPES = {
    "1x8192x2048_ctx_bias": dict(B=1, T=8192, C=2048, seqlens=None, W=4, bias=True, ctx=True),
    "2x4096x2048": dict(B=2, T=4096, C=2048, seqlens=None, W=4, bias=False, ctx=False),
    "packed_8192x2048_ctx": dict(B=1, T=None, C=2048, seqlens=(3000, 0, 1, 77, 4000, 1114), W=4, bias=False,
                                 ctx=True),
    "packed_many_short_W3": dict(B=1, T=None, C=1024, seqlens=tuple(1 + (37 * n) % 61 for n in range(200)), W=3,
                                 bias=True, ctx=True),
}


def conv_case(c):
    B, C, W = c["B"], c["C"], c["W"]
    cu = None if c["seqlens"] is None else cu_from(c["seqlens"])
    T = c["T"] if cu is None else sum(c["seqlens"])
    N = B if cu is None else len(c["seqlens"])
    x = rand(B, T, C, seed=1)
    w = rand(C, 1, W, seed=2, scale=0.5)
    b = rand(C, seed=3) if c["bias"] else None
    # FLA's conv-state layout: a channel slice of a [N, 3C, W-1] pool
    ctx = rand(N, 3 * C, W - 1, seed=4)[:, C:2 * C] if c["ctx"] else None
    dy = rand(B, T, C, seed=5)
    return x, w, b, ctx, cu, dy


def conv_grads(x, w, b, ctx, cu, dy, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = short_conv(leaves[0], leaves[1], leaves[2] if b is not None else None, "silu", cu,
                   None if ctx is None else ctx.to(dtype))
    return [y, *torch.autograd.grad(y, leaves, dy.to(dtype))]


def check_against_twin(name, want, got, twin, dtype):
    """got (Triton) against the float64 twin's want, and within 2x (+ a floor) of the twin's error at dtype."""
    for part, a, g, t in zip(name[1], want, got, twin):
        label = f"{name[0]} {part} {str(dtype)[6:]}"
        assert g.dtype == t.dtype and g.shape == t.shape, label
        rep = assert_close(label, a, g.double(), RATIO[dtype])
        ref = error_report(label + " (twin)", a, t.double())
        assert rep.rms_ratio <= 2 * ref.rms_ratio + 1e-6, (rep, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CONV_SHAPES))
def test_short_conv_triton_matches_torch_twin(name, dtype, monkeypatch):
    x, w, b, ctx, cu, dy = conv_case(CONV_SHAPES[name])
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    want = conv_grads(x, w, b, ctx, cu, dy, torch.float64)
    twin = conv_grads(x, w, b, ctx, cu, dy, dtype)
    monkeypatch.delenv("KDAKIT_BACKEND")
    got = conv_grads(x, w, b, ctx, cu, dy, dtype)
    assert got[0].is_contiguous()
    check_against_twin((name, ("y", "dx", "dweight", "dbias")), want, got, twin, dtype)


NORM_SHAPES = {"1x8192x16x128": (1, 8192, 16, 128), "2x1500x8x64": (2, 1500, 8, 64)}


def norm_grads(x, g, w, do, dtype):
    m = GatedRMSNorm(w.shape[0]).to(DEV, dtype)    # a bf16 weight for bf16, as in layer.bfloat16()
    m.weight.data.copy_(w)
    xs, gs = x.to(dtype).requires_grad_(), g.to(dtype).requires_grad_()
    out = m(xs, gs)
    return [out, *torch.autograd.grad(out, [xs, gs, m.weight], do.to(dtype))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORM_SHAPES))
def test_gated_norm_triton_matches_torch_twin(name, dtype, monkeypatch):
    shape = NORM_SHAPES[name]
    x, g, do = rand(*shape, seed=11), rand(*shape, seed=12, scale=2.0), rand(*shape, seed=13)
    w = 1.0 + 0.3 * rand(shape[-1], seed=14)
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    want = norm_grads(x, g, w, do, torch.float64)
    twin = norm_grads(x, g, w, do, dtype)
    monkeypatch.delenv("KDAKIT_BACKEND")
    got = norm_grads(x, g, w, do, dtype)
    check_against_twin((name, ("out", "dx", "dgate", "dweight")), want, got, twin, dtype)


def test_cuda_float64_needs_the_torch_backend(monkeypatch):
    x, w = rand(1, 16, 8, seed=21), rand(8, 1, 4, seed=22)
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        short_conv(x, w)
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        GatedRMSNorm(8).to(DEV)(x, x)
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    assert short_conv(x, w).dtype == torch.float64
    assert GatedRMSNorm(8).to(DEV).double()(x, x).dtype == torch.float64


def _time_ms(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def test_stage_times_at_32k_tokens_printed(monkeypatch):
    """Forward+backward of the layer's three convolutions (q, k, v: 3 x 2048 channels) and its norm
    (16 heads of 128) at 1 x 32K bf16 tokens, Triton against the PyTorch path: printed, not asserted."""
    T, C, H, D = 32768, 2048, 16, 128
    x = torch.randn(1, T, C, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (0.5 * torch.randn(C, 1, 4, device=DEV)).bfloat16().requires_grad_()
    dy = torch.randn(1, T, C, device=DEV, dtype=torch.bfloat16)
    o = torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    norm = GatedRMSNorm(D).to(DEV).bfloat16()

    def conv_step():
        for _ in range(3):
            torch.autograd.grad(short_conv(x, w, None, "silu"), [x, w], dy)

    def norm_step():
        torch.autograd.grad(norm(o, g), [o, g, norm.weight], o)

    times = {}
    for backend in ("triton", "torch"):
        if backend == "torch":
            monkeypatch.setenv("KDAKIT_BACKEND", "torch")
        times[backend] = (_time_ms(conv_step), _time_ms(norm_step))
    print(f"\n1 x {T} bf16, fwd+bwd: 3 convs (C={C}) triton {times['triton'][0]:.2f} ms, torch "
          f"{times['torch'][0]:.2f} ms; norm ({H} x {D}) triton {times['triton'][1]:.2f} ms, torch "
          f"{times['torch'][1]:.2f} ms")
