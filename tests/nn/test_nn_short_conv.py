"""kdakit.nn.short_conv: the causal depthwise convolution against a naive per-token loop (values and
gradients, fixed-length and packed, with and without a left context), and what its autograd saves."""

import pytest
import torch
import torch.nn.functional as F

from kdakit.nn import ShortConvolution, short_conv
from kdakit.testing import assert_close


def rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def naive_conv(x, weight, bias, activation, cu_seqlens=None, context=None):
    """y[t] = act(bias + sum_j w[W-1-j] x[t-j]), one token and one tap at a time; x[t-j] before the
    sequence start comes from the context (column W-1-(j-pos) of its [C, W-1] row) or is zero."""
    B, T, C = x.shape
    W = weight.shape[-1]
    w = weight.reshape(C, W)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    rows = [[None] * T for _ in range(B)]
    for n, (b, bos, eos) in enumerate(spans):
        for t in range(bos, eos):
            acc = bias.clone() if bias is not None else x.new_zeros(C)
            for j in range(W):
                pos = t - bos - j
                if pos >= 0:
                    src = x[b, bos + pos]
                elif context is not None:
                    src = context[n, :, W - 1 + pos]
                else:
                    continue
                acc = acc + w[:, W - 1 - j] * src
            rows[b][t] = F.silu(acc) if activation else acc
    return torch.stack([torch.stack(r) for r in rows]) if T else x.new_zeros(B, 0, C)


CASES = {
    "batched_W4_bias": dict(B=3, T=7, W=4, bias=True, cu=None, ctx=False, act="silu"),
    "batched_W4_context": dict(B=2, T=5, W=4, bias=False, cu=None, ctx=True, act="silu"),
    "batched_W2_no_act": dict(B=2, T=6, W=2, bias=True, cu=None, ctx=True, act=None),
    "packed_W4_context": dict(B=1, T=11, W=4, bias=True, cu=[0, 3, 3, 4, 9, 11], ctx=True, act="silu"),
    "packed_W3_zeros": dict(B=1, T=9, W=3, bias=False, cu=[0, 1, 6, 9], ctx=False, act="silu"),
    "packed_W1": dict(B=1, T=5, W=1, bias=True, cu=[0, 2, 5], ctx=True, act="silu"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_short_conv_matches_naive_values_and_grads(name):
    c = CASES[name]
    C = 5
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32)
    N = c["B"] if cu is None else len(c["cu"]) - 1
    x = rand(c["B"], c["T"], C, seed=1).requires_grad_()
    w = rand(C, 1, c["W"], seed=2).requires_grad_()
    b = rand(C, seed=3).requires_grad_() if c["bias"] else None
    ctx = rand(N, C, c["W"] - 1, seed=4) if c["ctx"] else None
    dy = rand(c["B"], c["T"], C, seed=5)

    y = short_conv(x, w, b, c["act"], cu, ctx)
    ref = naive_conv(x, w, b, c["act"], cu, ctx)
    assert y.shape == x.shape and y.is_contiguous()
    assert_close(f"{name} y", ref, y, 1e-13)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad((y * dy).sum(), leaves)
    want = torch.autograd.grad((ref * dy).sum(), leaves)
    for pname, gw, gg in zip(["x", "weight", "bias"], want, got):
        assert float(gg.abs().max()) > 0, f"{name} d{pname} is zero"
        assert_close(f"{name} d{pname}", gw, gg, 1e-12)


def test_short_conv_gradcheck_and_weight_layouts():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.long)
    x = rand(1, 5, 3, seed=11).requires_grad_()
    w = rand(3, 1, 3, seed=12).requires_grad_()
    b = rand(3, seed=13).requires_grad_()
    ctx = rand(3, 3, 2, seed=14)
    assert torch.autograd.gradcheck(lambda x, w, b: short_conv(x, w, b, "silu", cu, ctx), (x, w, b))
    # [C, W] weights (as some checkpoints store them) give the same result as [C, 1, W]
    assert torch.equal(short_conv(x, w, b, "silu", cu, ctx), short_conv(x, w[:, 0], b, "silu", cu, ctx))


def test_short_conv_empty_sequence_batch_has_zero_grads():
    x = rand(2, 0, 4, seed=15).requires_grad_()
    w = rand(4, 1, 4, seed=16).requires_grad_()
    y = short_conv(x, w, None, "silu")
    assert y.shape == (2, 0, 4)
    (gw,) = torch.autograd.grad(y.sum(), [w])
    assert torch.equal(gw, torch.zeros_like(w))


def test_backward_saves_only_the_input():
    """The graph keeps x (and the weight, bias, context and offsets, none T-sized), not W-1
    shifted copies or the pre-activation."""
    B, T, C, W = 2, 64, 16, 4
    x = rand(B, T, C, seed=21).requires_grad_()
    conv = ShortConvolution(C, W, bias=True).double()
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = conv(x)
    t_sized = [s for s in saved if len(s[0]) == 3 and s[0][1] == T]
    assert t_sized == [((B, T, C), x.data_ptr())], saved
    assert sum(torch.Size(s[0]).numel() for s in saved) <= x.numel() + 2 * C * W
    # and it still differentiates correctly after the recompute
    gx, = torch.autograd.grad(y.sum(), [x])
    ref = naive_conv(x, conv.weight, conv.bias, "silu")
    want, = torch.autograd.grad(ref.sum(), [x])
    assert_close("dx", want, gx, 1e-12)


def test_module_matches_fla_parameter_layout():
    conv = ShortConvolution(6, 4, bias=True)
    assert isinstance(conv, torch.nn.Conv1d)
    assert {k: tuple(v.shape) for k, v in conv.state_dict().items()} == {"weight": (6, 1, 4), "bias": (6,)}
    assert ShortConvolution(6, 4).bias is None


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, w: short_conv(x, w, activation="relu"), ValueError, "activation"),
    (lambda x, w: short_conv(x[0], w), ValueError, "x must have shape"),
    (lambda x, w: short_conv(x, w[:3]), ValueError, "weight"),
    (lambda x, w: short_conv(x, w, bias=torch.zeros(5, dtype=torch.float64)), ValueError, "bias"),
    (lambda x, w: short_conv(x, w, context=torch.zeros(2, 4, 2, dtype=torch.float64)), ValueError, "context"),
    (lambda x, w: short_conv(x, w, cu_seqlens=torch.tensor([0, 3])), ValueError, "batch size 1"),
    (lambda x, w: ShortConvolution(4, 3, activation="gelu"), ValueError, "activation"),
])
def test_bad_arguments_raise(call, exc, match):
    x = rand(2, 3, 4, seed=31)
    w = rand(4, 1, 4, seed=32)
    with pytest.raises(exc, match=match):
        call(x, w)
