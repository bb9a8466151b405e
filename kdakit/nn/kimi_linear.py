"""Moonshot / Hugging Face Kimi Linear checkpoints -> ``kdakit.nn.KimiDeltaAttention``.

Kimi Linear's remote code (``modeling_kimi.py``, ``KimiDeltaAttention`` under
``model.layers.{i}.self_attn`` of its KDA layers) names and shapes the KDA weights differently
from FLA's layer:

=============================  ============================  ==========================================
Kimi Linear key                kdakit / FLA key              conversion
=============================  ============================  ==========================================
``q_proj/k_proj/v_proj.weight``  same                        none
``{q,k,v}_conv1d.weight``      same                          ``[C, 1, W]`` kept; ``[C, W]`` unsqueezed
``f_a_proj.weight``            ``f_proj.0.weight``           none
``f_b_proj.weight``            ``f_proj.1.weight``           none
``b_proj.weight``              same                          none
``A_log [1, 1, H, 1]``         ``A_log [H]``                 flattened, float32
``dt_bias [H * K]``            same                          float32
``g_a_proj.weight``            ``g_proj.0.weight``           none
``g_b_proj.weight``            ``g_proj.1.weight``           the bias FLA's layer has is set to 0
                                                             (Kimi's ``g_b_proj`` has none: exact)
``o_norm.weight``, ``o_proj``  same                          none
=============================  ============================  ==========================================

Kimi's layer computes the same function as FLA's with ``num_v_heads = num_heads``,
``expand_v = 1``, the softplus gate, sigmoid beta and no conv bias, so the converted layer
reproduces it. The config fields read are ``hidden_size``, ``rms_norm_eps`` and
``linear_attn_config["head_dim" | "num_heads" | "short_conv_kernel_size"]``.

Running HF's Kimi Linear on kdakit (see also the README section "Swapping in kdakit's layer"):

* ops only, any use including ``generate`` with its cache: the remote module calls
  ``chunk_kda`` / ``fused_recurrent_kda`` with FLA 0.6.0's arguments, which kdakit's ops take::

      import sys, kdakit
      mod = sys.modules[type(model.model.layers[0].self_attn).__module__]  # any KDA layer's module
      mod.chunk_kda, mod.fused_recurrent_kda = kdakit.chunk_kda, kdakit.fused_recurrent_kda

* whole layers (training, or prefill without a cache): ``swap_kimi_linear_kda(model)`` replaces
  every module whose class is named ``KimiDeltaAttention`` by a ``KimiLinearKDA`` holding a
  converted ``kdakit.nn.KimiDeltaAttention``; a call with ``cache_params`` raises.
"""

from __future__ import annotations

import torch.nn as nn

from kdakit.nn.kda_layer import KimiDeltaAttention

# Kimi key -> kdakit key, for the keys that are renamed.
RENAMED = {"f_a_proj.weight": "f_proj.0.weight", "f_b_proj.weight": "f_proj.1.weight",
           "g_a_proj.weight": "g_proj.0.weight", "g_b_proj.weight": "g_proj.1.weight"}
SAME = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
        "v_conv1d.weight", "b_proj.weight", "A_log", "dt_bias", "o_norm.weight", "o_proj.weight")
OPTIONAL = ("g_b_proj.bias",)


def _cfg(config, name, default=None):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    if value is None:
        raise ValueError(f"config must have {name!r} (a Kimi Linear config), got none")
    return value


def kda_layer_from_kimi_config(config, layer_idx: int | None = None) -> KimiDeltaAttention:
    """An (initialized) ``KimiDeltaAttention`` with a Kimi Linear config's KDA shape.
    ``config``: the HF ``KimiLinearConfig`` or its dict."""
    lac = _cfg(config, "linear_attn_config")
    for key in ("head_dim", "num_heads", "short_conv_kernel_size"):
        if key not in lac:
            raise ValueError(f"config.linear_attn_config must have {key!r}, got keys {sorted(lac)}")
    return KimiDeltaAttention(
        hidden_size=_cfg(config, "hidden_size"), head_dim=lac["head_dim"], num_heads=lac["num_heads"],
        conv_size=lac["short_conv_kernel_size"], norm_eps=float(_cfg(config, "rms_norm_eps", 1e-5)),
        layer_idx=layer_idx,
    )


def kimi_linear_kda_state_dict(state_dict: dict, prefix: str = "") -> dict:
    """Convert one Kimi Linear KDA layer's weights (keys ``prefix + name``, e.g. prefix
    ``"model.layers.0.self_attn."``) into a state dict that ``KimiDeltaAttention`` loads with
    ``strict=True``. Keys under ``prefix`` that are not KDA weights raise ``ValueError``, as do
    missing ones; keys outside ``prefix`` are ignored."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
    src = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    known = set(SAME) | set(RENAMED) | set(OPTIONAL)
    unknown = sorted(set(src) - known)
    if unknown:
        raise ValueError(f"state_dict has keys under prefix {prefix!r} that are not Kimi Linear KDA weights: {unknown}")
    missing = sorted((set(SAME) | set(RENAMED)) - set(src))
    if missing:
        raise ValueError(f"state_dict is missing Kimi Linear KDA weights under prefix {prefix!r}: {missing}")
    out = {}
    for key in SAME:
        out[key] = src[key]
    for key, new in RENAMED.items():
        out[new] = src[key]
    A_log = src["A_log"]
    if A_log.dim() not in (1, 4) or (A_log.dim() == 4 and (A_log.shape[0], A_log.shape[1], A_log.shape[3]) != (1, 1, 1)):
        raise ValueError(f"A_log must have shape [1, 1, H, 1] (Kimi) or [H], got {list(A_log.shape)}")
    out["A_log"] = A_log.reshape(-1).float()
    out["dt_bias"] = src["dt_bias"].float()
    for name in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
        w = src[name]
        if w.dim() == 2:
            w = w[:, None, :]
        if w.dim() != 3 or w.shape[1] != 1:
            raise ValueError(f"{name} must have shape [C, 1, W] or [C, W], got {list(src[name].shape)}")
        out[name] = w
    g_b = out["g_proj.1.weight"]
    out["g_proj.1.bias"] = src.get("g_b_proj.bias", g_b.new_zeros(g_b.shape[0]))
    return out


def load_kimi_linear_kda(state_dict: dict, config, prefix: str = "", layer_idx: int | None = None
                         ) -> KimiDeltaAttention:
    """A ``KimiDeltaAttention`` shaped by ``config`` holding the converted weights (strict load),
    in the checkpoint's dtype (that of ``q_proj.weight``; ``A_log`` / ``dt_bias`` stay float32
    unless it is float64), so that loading rounds nothing."""
    converted = kimi_linear_kda_state_dict(state_dict, prefix)
    layer = kda_layer_from_kimi_config(config, layer_idx)
    layer.to(dtype=converted["q_proj.weight"].dtype)
    layer.load_state_dict(converted, strict=True)
    return layer


class KimiLinearKDA(nn.Module):
    """Stands in for the remote code's ``KimiDeltaAttention``: same call
    (``hidden_states, attention_mask=None, cache_params=None, **kwargs``) and return value (the
    output tensor), computed by ``self.layer`` (a ``kdakit.nn.KimiDeltaAttention``). Without
    cache support: ``cache_params`` other than None raises ``ValueError``."""

    def __init__(self, layer: KimiDeltaAttention):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, attention_mask=None, cache_params=None, **kwargs):
        if cache_params is not None:
            raise ValueError("cache_params: KimiLinearKDA runs without a cache; expected None, got "
                             f"{type(cache_params).__name__} (generate with use_cache=False, or swap only "
                             "the ops: see kdakit.nn.kimi_linear)")
        if attention_mask is not None and attention_mask.dim() != 2:
            attention_mask = kwargs.get("padding_mask")     # as the remote code does with 4-D masks
        return self.layer(hidden_states, attention_mask=attention_mask, cu_seqlens=kwargs.get("cu_seqlens"))[0]


def swap_kimi_linear_kda(model: nn.Module) -> int:
    """Replace, in place, every submodule whose class is named ``KimiDeltaAttention`` (the remote
    code's KDA layer) by a ``KimiLinearKDA`` with its converted weights, on the same device and
    dtype (``A_log`` / ``dt_bias`` stay float32). Returns how many were replaced."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("model must have a Kimi Linear .config, got none")
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod).__name__ == "KimiDeltaAttention" and not isinstance(mod, KimiDeltaAttention)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = load_kimi_linear_kda(mod.state_dict(), config, layer_idx=getattr(mod, "layer_idx", None))
        layer.to(device=mod.q_proj.weight.device)
        setattr(parent, child, KimiLinearKDA(layer))
    return len(targets)


__all__ = ["kda_layer_from_kimi_config", "kimi_linear_kda_state_dict", "load_kimi_linear_kda", "KimiLinearKDA",
           "swap_kimi_linear_kda"]
