"""``KDACache``: FLA 0.6.0's layer cache (``fla.models.utils.Cache``) for KDA layers, without FLA
or transformers, and the cache protocol ``KimiDeltaAttention.forward(past_key_values=...)`` uses.

The protocol is the one FLA's layers use (``fla.layers.utils.get_layer_cache`` /
``update_layer_cache``), so kdakit's layer works with either cache:

- read: ``past_key_values[layer_idx]`` when ``len(past_key_values) > layer_idx``, a dict (or
  None for a layer not yet written) with keys ``recurrent_state``, ``attn_state``,
  ``conv_state``, ``ffn_state``;
- write: ``past_key_values.update(recurrent_state=..., conv_state=..., layer_idx=...,
  offset=...)``; an argument left None keeps the stored value.

What a KDA layer stores there (FLA's layout, so a cache written by FLA's layer is continued by
kdakit's and the other way round): ``recurrent_state`` ``[N, HV, V, K]`` value-first in fp32
(float64 for a float64 layer), ``conv_state`` a tuple ``(q, k, v)`` of ``[N, D, W]`` windows
(D = that projection's width, W = ``conv_size``: the last W projected inputs, oldest first; the
next token's convolution reads the newest W-1), or None without the short convolution.

``KDACache`` keeps one dict and one token counter per layer, as FLA's ``FLACache`` (each layer's
counter advances by the ``offset`` of its own updates). It has no attention (KV) state: a hybrid
model with attention layers needs FLA's or transformers' cache.
"""

from __future__ import annotations

from typing import Any

import torch

STATE_KEYS = ("recurrent_state", "attn_state", "conv_state", "ffn_state")


class KDACache:
    """Per-layer recurrent and convolution states of KDA layers, keyed by ``layer_idx``; the
    subset of FLA's ``Cache`` API that KDA layers and a generation loop use."""

    is_compileable = False

    def __init__(self) -> None:
        self.states: list[dict[str, Any] | None] = []
        self._seen_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        yield from self.states

    def __getitem__(self, layer_idx: int) -> dict[str, Any] | None:
        _check_layer_idx("layer_idx", layer_idx)
        if layer_idx >= len(self.states):
            raise KeyError(f"Cache only has {len(self.states)} layers, attempted to access layer with index {layer_idx}")
        return self.states[layer_idx]

    def update(
        self,
        recurrent_state: torch.Tensor | None = None,
        attn_state: tuple[torch.Tensor, ...] | None = None,
        conv_state: Any | None = None,
        ffn_state: Any | None = None,
        layer_idx: int = 0,
        offset: int | None = 1,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Store layer ``layer_idx``'s states (a None argument keeps the stored one) and advance
        its token counter by ``offset`` (None counts as 1, as in FLA). Returns the layer's dict."""
        _check_layer_idx("layer_idx", layer_idx)
        if attn_state is not None:
            raise ValueError("attn_state: KDACache holds KDA layers' recurrent and conv states only; "
                             "use FLA's or transformers' cache for attention layers")
        offset = 1 if offset is None else offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        while len(self.states) <= layer_idx:
            self.states.append(None)
            self._seen_tokens.append(0)
        if self.states[layer_idx] is None:
            self.states[layer_idx] = dict.fromkeys(STATE_KEYS)
        state = self.states[layer_idx]
        for key, value in (("recurrent_state", recurrent_state), ("conv_state", conv_state),
                           ("ffn_state", ffn_state)):
            if value is not None:
                state[key] = value
        self._seen_tokens[layer_idx] += offset
        return state

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens layer ``layer_idx`` has seen (the sum of its updates' offsets); 0 if never written."""
        layer_idx = layer_idx or 0
        _check_layer_idx("layer_idx", layer_idx)
        return self._seen_tokens[layer_idx] if layer_idx < len(self.states) else 0

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Select / reorder the batch rows of every stored tensor (beam search), as FLA's Cache."""
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"beam_idx must be an integer tensor, got {getattr(beam_idx, 'dtype', type(beam_idx))}")
        self.states = [_map_tensors(s, lambda t: t.index_select(0, beam_idx.to(t.device))) for s in self.states]

    batch_select_indices = reorder_cache

    def reset(self) -> None:
        self.states.clear()
        self._seen_tokens.clear()

    def to_legacy_cache(self) -> tuple[dict[str, Any] | None, ...]:
        return tuple(self.states)


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _check_layer_idx(name, layer_idx) -> None:
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise TypeError(f"{name} must be an int, got {type(layer_idx).__name__}")
    if layer_idx < 0:
        raise ValueError(f"{name} must be non-negative, got {layer_idx}")


def read_layer_state(past_key_values, layer_idx: int) -> dict[str, Any] | None:
    """``past_key_values[layer_idx]`` if that layer has been written, else None (FLA's
    ``get_layer_cache``); checks that the object speaks the cache protocol."""
    for attr in ("update", "__getitem__", "__len__"):
        if not hasattr(past_key_values, attr):
            raise TypeError(f"past_key_values must be an FLA Cache or kdakit.nn.KDACache (with update, "
                            f"__getitem__ and __len__), got {type(past_key_values).__name__}")
    if len(past_key_values) <= layer_idx:
        return None
    state = past_key_values[layer_idx]
    if state is not None and not isinstance(state, dict):
        raise TypeError(f"past_key_values[{layer_idx}] must be a dict of layer states or None, "
                        f"got {type(state).__name__}")
    return state


__all__ = ["KDACache", "read_layer_state"]
