"""kdakit.nn.KimiDeltaAttention as FLA 0.6.0's ``fla.layers.KimiDeltaAttention`` drop-in.

FLA's layer cannot run here (its ShortConvolution, gated norm and KDA ops are Triton kernels, and
importing ``fla.layers`` needs einops and transformers, which CI does not install). So
``FlaKDAReference`` below is a small float64 re-implementation of FLA 0.6.0's layer written from
its source semantics (fla/layers/kda.py): the same submodule names, shapes and construction order
(so the same random draws), and a forward that applies every activation explicitly (causal
zero-padded nn.Conv1d + SiLU, -exp(A_log) * softplus(g + dt_bias) or the lower-bound sigmoid gate,
sigmoid beta (x2 with allow_neg_eigval), l2-normalized q/k, sigmoid-gated RMSNorm) and runs only
the recurrence through kdakit's token-by-token reference op. One test at the end builds FLA's own
layer when fla imports, and is skipped otherwise.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kdakit.nn import KimiDeltaAttention
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import assert_close

HIDDEN = 12


class FlaKDAReference(nn.Module):
    """FLA 0.6.0's KDA layer: parameters created in FLA's order; float64 forward (see module docstring)."""

    def __init__(self, hidden_size, expand_v=1, head_dim=8, num_heads=2, num_v_heads=None, use_short_conv=True,
                 allow_neg_eigval=False, safe_gate=False, lower_bound=None, conv_size=4, conv_bias=False,
                 norm_eps=1e-5):
        super().__init__()
        HV = num_v_heads or num_heads
        self.H, self.HV, self.K, self.V = num_heads, HV, head_dim, int(head_dim * expand_v)
        self.W, self.use_short_conv, self.eps = conv_size, use_short_conv, norm_eps
        self.allow_neg_eigval, self.lower_bound = allow_neg_eigval, lower_bound
        key_dim, value_dim = num_heads * head_dim, HV * self.V
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        if use_short_conv:
            for name, ch in (("q_conv1d", key_dim), ("k_conv1d", key_dim), ("v_conv1d", value_dim)):
                setattr(self, name, nn.Conv1d(ch, ch, conv_size, padding=conv_size - 1, groups=ch, bias=conv_bias))
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.V, bias=False),
                                    nn.Linear(self.V, HV * head_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        if safe_gate:
            self.A_log = nn.Parameter(torch.zeros(HV))
        else:
            self.A_log = nn.Parameter(torch.empty(HV).uniform_(1, 16).log())
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = (torch.rand(HV * head_dim) * (hi - lo) + lo).exp().clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))      # inverse softplus, FLA's form
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.V, bias=False),
                                    nn.Linear(self.V, value_dim, bias=True))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.V))
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(self, x):
        """x [B, T, hidden]: B independent sequences (no padding)."""
        B, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        qkv = []
        for proj, conv in ((self.q_proj, "q_conv1d"), (self.k_proj, "k_conv1d"), (self.v_proj, "v_conv1d")):
            y = proj(x)
            if self.use_short_conv:
                y = getattr(self, conv)(y.transpose(1, 2))[..., :T].transpose(1, 2)   # causal: drop the tail
            qkv.append(F.silu(y))
        q = qkv[0].view(B, T, H, K) / torch.sqrt((qkv[0].view(B, T, H, K) ** 2).sum(-1, keepdim=True) + 1e-6)
        k = qkv[1].view(B, T, H, K) / torch.sqrt((qkv[1].view(B, T, H, K) ** 2).sum(-1, keepdim=True) + 1e-6)
        v = qkv[2].view(B, T, HV, V)
        graw = (self.f_proj(x) + self.dt_bias).view(B, T, HV, K)
        A = self.A_log.exp()[:, None]
        if self.lower_bound is None:
            g = -A * F.softplus(graw)
        else:
            g = self.lower_bound * torch.sigmoid(A * graw)
        beta = torch.sigmoid(self.b_proj(x)) * (2.0 if self.allow_neg_eigval else 1.0)
        o, _ = naive_recurrent_kda(q, k, v, g, beta)
        gate = self.g_proj(x).view(B, T, HV, V)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight * torch.sigmoid(gate)
        return self.o_proj(o.reshape(B, T, HV * V))


CONFIGS = {
    "mha": dict(num_heads=2),
    "gva_safe_gate": dict(num_heads=1, num_v_heads=2, safe_gate=True, lower_bound=-5.0),
    "expand_v2_gva_neg_eig": dict(num_heads=2, num_v_heads=4, expand_v=2, allow_neg_eigval=True),
    "lower_bound_bias_conv3": dict(num_heads=2, lower_bound=-3.0, conv_bias=True, conv_size=3),
    "no_conv_expand_half": dict(num_heads=2, use_short_conv=False, expand_v=0.5),
}


def randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_seed_gives_fla_parameters(name):
    """Same names, shapes and values: modules and gate parameters are drawn in FLA's order."""
    cfg = CONFIGS[name]
    torch.manual_seed(7)
    ref = FlaKDAReference(HIDDEN, head_dim=8, **cfg)
    torch.manual_seed(7)
    layer = KimiDeltaAttention(HIDDEN, head_dim=8, **cfg)
    want, got = ref.state_dict(), layer.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == torch.float32, key
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fla_state_dict_loads_strictly_and_gives_fla_outputs(name):
    cfg = CONFIGS[name]
    ref = randomize(FlaKDAReference(HIDDEN, head_dim=8, **cfg).double(), seed=3)
    layer = KimiDeltaAttention(HIDDEN, head_dim=8, **cfg).double()
    layer.load_state_dict(ref.state_dict(), strict=True)
    x = rand(2, 9, HIDDEN, seed=4).requires_grad_()
    out, final, _ = layer(x)
    want = ref(x)
    assert final is None
    assert_close(f"{name} out", want, out, 1e-10)
    dy = rand(2, 9, HIDDEN, seed=5)
    got_g = torch.autograd.grad((out * dy).sum(), [x, *layer.parameters()])
    want_g = torch.autograd.grad((want * dy).sum(), [x, *ref.parameters()])
    for pname, gw, gg in zip(["x", *dict(layer.named_parameters())], want_g, got_g):
        assert float(gg.abs().max()) > 0, pname
        assert_close(f"{name} d{pname}", gw, gg, 1e-9)


def test_fused_recurrent_mode_matches_chunk_mode():
    cfg = CONFIGS["expand_v2_gva_neg_eig"]
    chunk = randomize(KimiDeltaAttention(HIDDEN, head_dim=8, **cfg).double(), seed=8)
    rec = KimiDeltaAttention(HIDDEN, head_dim=8, mode="fused_recurrent", **cfg).double()
    rec.load_state_dict(chunk.state_dict())
    x = rand(1, 10, HIDDEN, seed=9)
    cu = torch.tensor([0, 4, 10])
    h0 = 0.3 * rand(2, 4, 8, 16, seed=10)           # [N, HV, K, V], V = 2K
    a, fa, _ = chunk(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    b, fb, _ = rec(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert_close("fused_recurrent vs chunk out", a, b, 1e-10)
    assert_close("fused_recurrent vs chunk state", fa, fb, 1e-10)


@pytest.mark.parametrize("side", ["left", "right"])
def test_attention_mask_equals_unpadded_runs(side):
    layer = randomize(KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2, num_v_heads=4).double(), seed=11)
    lengths, T = [6, 2, 0, 4], 6
    B = len(lengths)
    x = rand(B, T, HIDDEN, seed=12).requires_grad_()
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, T - n:] = 1
        else:
            mask[b, :n] = 1
    h0 = 0.3 * rand(B, 4, 8, 8, seed=13)
    out, final, _ = layer(x, attention_mask=mask, initial_state=h0, output_final_state=True)
    assert out.shape == (B, T, HIDDEN)
    dy = rand(B, T, HIDDEN, seed=14)
    (dx,) = torch.autograd.grad((out * dy).sum(), [x])
    pad = mask == 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padded positions give zero output"
    assert torch.equal(dx[pad], torch.zeros_like(dx[pad])), "padded inputs get no gradient"
    for b, n in enumerate(lengths):
        sel = mask[b].bool()
        xb = x[b:b + 1, sel].detach().requires_grad_()
        ob, fb, _ = layer(xb, initial_state=h0[b:b + 1], output_final_state=True)
        assert_close(f"{side} row {b} final state", fb, final[b:b + 1], 1e-12)
        if n:
            assert_close(f"{side} row {b} out", ob, out[b:b + 1, sel], 1e-12)
            (dxb,) = torch.autograd.grad((ob * dy[b:b + 1, sel]).sum(), [xb])
            assert_close(f"{side} row {b} dx", dxb, dx[b:b + 1, sel], 1e-12)
    # a longer mask (as HF passes during decode) is cut to its last T columns; bool works too
    longer = torch.cat([torch.ones(B, 3, dtype=torch.long), mask], 1).bool()
    out2, _, _ = layer(x, attention_mask=longer, initial_state=h0)
    assert torch.equal(out2, out)


def test_module_casts_keep_gate_parameters_fp32():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2)
    A_log, dt_bias = layer.A_log.detach().clone(), layer.dt_bias.detach().clone()
    for cast in (lambda m: m.bfloat16(), lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        m = cast(KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2))
        m.load_state_dict(layer.state_dict())    # load_state_dict copies into the fp32 tensors
        assert m.q_proj.weight.dtype in (torch.bfloat16, torch.float16)
        assert m.A_log.dtype == torch.float32 and m.dt_bias.dtype == torch.float32
        assert isinstance(m.A_log, nn.Parameter) and m.A_log._no_weight_decay
    m = KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2)
    m.load_state_dict(layer.state_dict())
    m.A_log.grad = torch.ones_like(m.A_log)
    m.bfloat16()
    assert torch.equal(m.A_log, A_log) and torch.equal(m.dt_bias, dt_bias), "values not rounded through bf16"
    assert m.A_log.grad.dtype == torch.float32
    assert m.double().A_log.dtype == torch.float64, "a float64 cast is honoured"
    # a bf16 layer runs and stays close to its float64 self
    ref = randomize(KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2).double(), seed=15)
    low = KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2)
    low.load_state_dict(ref.state_dict())
    low.bfloat16()
    x = rand(1, 8, HIDDEN, seed=16)
    out, _, _ = low(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_close("bf16 layer vs float64", ref(x)[0], out.double(), 5e-2)


def test_fla_positional_signature_and_unknown_kwargs():
    layer = KimiDeltaAttention(64, 2, 8, 4)            # hidden_size, expand_v, head_dim, num_heads
    assert (layer.hidden_size, layer.head_v_dim, layer.head_dim, layer.num_heads) == (64, 16, 8, 4)
    assert layer.v_proj.weight.shape == (4 * 16, 64) and layer.o_norm.weight.shape == (16,)
    layer = KimiDeltaAttention(64, 1, 8, 2, 4, "fused_recurrent", False, True, True, -4.0, 3, True, 5, 1e-6)
    assert (layer.num_v_heads, layer.mode, layer.use_short_conv, layer.allow_neg_eigval, layer.safe_gate,
            layer.lower_bound, layer.conv_size, layer.conv_bias, layer.layer_idx, layer.o_norm.eps) == \
        (4, "fused_recurrent", False, True, True, -4.0, 3, True, 5, 1e-6)
    d = KimiDeltaAttention()
    assert (d.hidden_size, d.head_dim, d.num_heads, d.num_v_heads, d.conv_size) == (2048, 128, 16, 16, 4)
    with pytest.raises(TypeError, match="num_kv_heads"):
        KimiDeltaAttention(64, head_dim=8, num_heads=2, num_kv_heads=2)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(mode="parallel"), ValueError, "mode"),
    (dict(expand_v=0.3), ValueError, "expand_v"),
    (dict(expand_v=0), ValueError, "expand_v"),
    (dict(layer_idx="0"), TypeError, "layer_idx"),
    (dict(use_short_conv=1), TypeError, "use_short_conv"),
])
def test_bad_fla_arguments_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2, **kwargs)


def test_bad_mask_and_cache_arguments_raise():
    layer = randomize(KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2).double(), seed=17)
    x = rand(2, 5, HIDDEN, seed=18)
    ones = torch.ones(2, 5, dtype=torch.long)
    cases = [
        (lambda: layer(x, attention_mask=ones.double()), TypeError, "attention_mask"),
        (lambda: layer(x, attention_mask=ones[:, :4]), ValueError, "attention_mask"),
        (lambda: layer(x, attention_mask=ones[None]), ValueError, "attention_mask"),
        (lambda: layer(x, attention_mask=ones * 2), ValueError, "only 0"),
        (lambda: layer(x, attention_mask=[[1] * 5] * 2), TypeError, "attention_mask"),
        # a cache needs layer_idx, as in FLA (the cache path is tested in test_nn_cache.py)
        (lambda: layer(x, past_key_values=object()), ValueError, "layer_idx"),
        (lambda: layer(x, use_cache=True), ValueError, "layer_idx"),
        (lambda: layer(x, output_attentions=True), ValueError, "output_attentions"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    rec = KimiDeltaAttention(HIDDEN, head_dim=8, num_heads=2, mode="fused_recurrent").double()
    with pytest.raises(ValueError, match="state_indices"):
        rec(x, initial_state=torch.zeros(3, 2, 8, 8), state_indices=torch.tensor([0, 1], dtype=torch.int32))


def test_against_fla_layer_when_importable():
    """FLA's own constructor: same seed -> same state dict (needs fla, einops, transformers)."""
    fla_kda = pytest.importorskip("fla.layers.kda", reason="fla (with einops, transformers) is not installed")
    for cfg in CONFIGS.values():
        torch.manual_seed(5)
        fla_layer = fla_kda.KimiDeltaAttention(HIDDEN, head_dim=8, **cfg)
        torch.manual_seed(5)
        layer = KimiDeltaAttention(HIDDEN, head_dim=8, **cfg)
        layer.load_state_dict(fla_layer.state_dict(), strict=True)
        for key, value in fla_layer.state_dict().items():
            assert torch.equal(layer.state_dict()[key], value), key
