"""kdakit.nn.kimi_linear: a synthetic Moonshot / HF Kimi Linear KDA state dict (their names and shapes)
converts into kdakit's layer, which then reproduces a float64 forward written directly over the
Kimi weights with Kimi's semantics (modeling_kimi.py: FLA ShortConvolution + SiLU, fused_kda_gate's
-exp(A_log) * softplus(g + dt_bias), sigmoid beta, l2-normalized q/k, sigmoid-gated RMSNorm, no
g_b_proj bias); and the module swap on a stand-in model."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kdakit.nn import KimiDeltaAttention
from kdakit.nn.kimi_linear import (
    KimiLinearKDA,
    kimi_linear_kda_state_dict,
    load_kimi_linear_kda,
    swap_kimi_linear_kda,
)
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import assert_close

CONFIG = {"hidden_size": 12, "rms_norm_eps": 1e-6,
          "linear_attn_config": {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4}}
PREFIX = "model.layers.0.self_attn."


def kimi_state_dict(seed, conv_2d=False, dtype=torch.float64):
    """Kimi Linear's KDA keys and shapes, random values (A_log [1, 1, H, 1], no g_b_proj bias)."""
    D, K, H, W = 12, 8, 2, 4
    P = H * K
    shapes = {"q_proj.weight": (P, D), "k_proj.weight": (P, D), "v_proj.weight": (P, D),
              "q_conv1d.weight": (P, 1, W), "k_conv1d.weight": (P, 1, W), "v_conv1d.weight": (P, 1, W),
              "A_log": (1, 1, H, 1), "f_a_proj.weight": (K, D), "f_b_proj.weight": (P, K), "dt_bias": (P,),
              "b_proj.weight": (H, D), "g_a_proj.weight": (K, D), "g_b_proj.weight": (P, K),
              "o_norm.weight": (K,), "o_proj.weight": (D, P)}
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if conv_2d and "conv1d" in name:
            shape = (shape[0], shape[2])
        t = 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
        sd[PREFIX + name] = t.to(torch.float32 if name in ("A_log", "dt_bias") else dtype)
    sd["model.layers.0.mlp.gate.weight"] = torch.randn(3, D, dtype=dtype)     # another module's key
    return sd


def kimi_forward(sd, x, eps=1e-6):
    """Kimi's KDA layer forward, float64, straight from its weights."""
    w = {k[len(PREFIX):]: v.double() for k, v in sd.items() if k.startswith(PREFIX)}
    B, T, _ = x.shape
    H, K = 2, 8
    mixed = []
    for p in "qkv":
        y = F.linear(x, w[f"{p}_proj.weight"]).transpose(1, 2)                       # [B, C, T]
        cw = w[f"{p}_conv1d.weight"]
        cw = cw if cw.dim() == 3 else cw[:, None]
        y = F.conv1d(F.pad(y, (cw.shape[-1] - 1, 0)), cw, groups=cw.shape[0])
        mixed.append(F.silu(y.transpose(1, 2)).reshape(B, T, H, K))
    q, k = (m / torch.sqrt((m * m).sum(-1, keepdim=True) + 1e-6) for m in mixed[:2])
    graw = F.linear(F.linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]) + w["dt_bias"]
    g = -w["A_log"].exp() * F.softplus(graw.view(B, T, H, K))                       # A_log [1, 1, H, 1]
    beta = torch.sigmoid(F.linear(x, w["b_proj.weight"]))
    o, _ = naive_recurrent_kda(q, k, mixed[2], g, beta)
    gate = F.linear(F.linear(x, w["g_a_proj.weight"]), w["g_b_proj.weight"]).view(B, T, H, K)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * w["o_norm.weight"] * torch.sigmoid(gate)
    return F.linear(o.reshape(B, T, H * K), w["o_proj.weight"])


@pytest.mark.parametrize("conv_2d", [False, True])
def test_converted_kimi_weights_reproduce_kimi_forward(conv_2d):
    sd = kimi_state_dict(1, conv_2d=conv_2d)
    converted = kimi_linear_kda_state_dict(sd, PREFIX)
    assert converted["A_log"].shape == (2,) and converted["A_log"].dtype == torch.float32
    assert converted["q_conv1d.weight"].shape == (16, 1, 4)
    assert torch.equal(converted["g_proj.1.bias"], torch.zeros(16, dtype=torch.float64))
    layer = load_kimi_linear_kda(sd, CONFIG, PREFIX, layer_idx=0).double()
    assert (layer.num_heads, layer.head_dim, layer.conv_size, layer.o_norm.eps, layer.layer_idx) == (2, 8, 4, 1e-6, 0)
    x = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out, _, _ = layer(x)
    assert_close("kdakit layer vs Kimi forward", kimi_forward(sd, x), out, 1e-10)


def test_conversion_errors_name_the_key():
    sd = kimi_state_dict(3)
    with pytest.raises(ValueError, match="missing.*f_b_proj.weight"):
        kimi_linear_kda_state_dict({k: v for k, v in sd.items() if not k.endswith("f_b_proj.weight")}, PREFIX)
    with pytest.raises(ValueError, match="not Kimi Linear KDA weights.*kv_a_proj"):
        kimi_linear_kda_state_dict({**sd, PREFIX + "kv_a_proj.weight": torch.zeros(1)}, PREFIX)
    with pytest.raises(ValueError, match="A_log"):
        kimi_linear_kda_state_dict({**sd, PREFIX + "A_log": torch.zeros(1, 2, 1, 1)}, PREFIX)
    with pytest.raises(ValueError, match="q_conv1d.weight"):
        kimi_linear_kda_state_dict({**sd, PREFIX + "q_conv1d.weight": torch.zeros(16, 2, 4)}, PREFIX)
    with pytest.raises(TypeError, match="state_dict"):
        kimi_linear_kda_state_dict([], PREFIX)
    with pytest.raises(ValueError, match="short_conv_kernel_size"):
        load_kimi_linear_kda(sd, {**CONFIG, "linear_attn_config": {"head_dim": 8, "num_heads": 2}}, PREFIX)


class KimiDeltaAttentionStandIn(nn.Module):
    """Holds Kimi's parameter names (what swap_kimi_linear_kda reads); its own forward is never run."""

    def __init__(self, sd):
        super().__init__()
        for key, value in sd.items():
            if key.startswith(PREFIX):
                mod, name = self, key[len(PREFIX):]
                while "." in name:
                    head, name = name.split(".", 1)
                    if not hasattr(mod, head):
                        mod.add_module(head, nn.Module())
                    mod = getattr(mod, head)
                mod.register_parameter(name, nn.Parameter(value.clone()))
        self.layer_idx = 0


KimiDeltaAttentionStandIn.__name__ = "KimiDeltaAttention"


def test_swap_replaces_kimi_layers_in_a_model():
    sd = kimi_state_dict(4, dtype=torch.bfloat16)
    model = nn.Module()
    model.config = CONFIG
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].self_attn = KimiDeltaAttentionStandIn(sd)
    assert swap_kimi_linear_kda(model) == 1
    swapped = model.model.layers[0].self_attn
    assert isinstance(swapped, KimiLinearKDA) and isinstance(swapped.layer, KimiDeltaAttention)
    assert swapped.layer.q_proj.weight.dtype == torch.bfloat16 and swapped.layer.A_log.dtype == torch.float32
    x = torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    out = swapped(x.bfloat16(), attention_mask=mask)
    want = kimi_forward(sd, x[:, 1:])
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert_close("swapped bf16 layer vs Kimi forward", want, out[:, 1:].double(), 5e-2)
    with pytest.raises(ValueError, match="cache_params"):
        swapped(x.bfloat16(), cache_params=object())
