"""``KimiDeltaAttention``: the KDA token mixer of Kimi Linear, built on ``kdakit.chunk_kda``; a
drop-in for FLA 0.6.0's ``fla.layers.KimiDeltaAttention`` (same constructor arguments, order
and defaults, same parameter names and shapes, same initialization recipe).

Per token (``x`` the hidden state ``[hidden]``, H q/k heads of size K = ``head_dim``, HV value
heads of size V = ``head_dim * expand_v``)::

    q, k, v   = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))   # causal depthwise conv, per sequence
    g_raw     = W_f2 W_f1 x                    # low rank: hidden -> V -> HV * K
    beta_raw  = W_b x                          # [HV]
    o         = KDA(q, k, v, g_raw, beta_raw)  # in-kernel l2norm(q, k), gate(A_log, dt_bias), sigmoid(beta)
    gate      = W_g2 W_g1 x + b_g2             # low rank: hidden -> V -> HV * V
    y         = W_o [ rmsnorm(o) * w_norm * sigmoid(gate) ]   # per value head

Parameter names and shapes are FLA's (``q_proj``, ``k_proj``, ``v_proj``, ``q_conv1d``,
``k_conv1d``, ``v_conv1d``, ``f_proj``, ``b_proj``, ``A_log [HV]``, ``dt_bias [HV * K]``,
``g_proj``, ``o_norm``, ``o_proj``), so an FLA layer's state dict loads with
``load_state_dict(strict=True)``. Moonshot / Hugging Face Kimi Linear checkpoints use other
names; ``kdakit.nn.kimi_linear`` converts them.

Initialization (FLA 0.6.0's recipe, drawn in FLA's order, so one seed gives the same
parameters as FLA's constructor): projections and convolutions use ``nn.Linear`` /
``nn.Conv1d``'s defaults; ``A_log = log(U(1, 16))`` per value head (decay rates ``exp(A_log)``
spread over [1, 16]), or ``A_log = 0`` with ``safe_gate`` (the sigmoid gate's slope starts
at 1); ``dt_bias = softplus^-1(dt)`` with ``dt = exp(U(log 1e-3, log 0.1))`` clamped to
>= 1e-4 per gate channel (the Mamba recipe: at initialization ``softplus(dt_bias)`` spans
[1e-3, 0.1]); ``o_norm.weight = 1``. ``A_log`` and ``dt_bias`` carry ``_no_weight_decay``.

Precision: ``A_log`` and ``dt_bias`` stay float32 when the module is cast to fp16 / bf16
(``module.bfloat16()``, ``.half()``, ``.to(torch.bfloat16)``; ``_apply`` is overridden),
because ``chunk_kda`` requires float32 gate parameters; a float64 cast casts them to float64
(accepted with float64 inputs).

Padding: ``forward(x, attention_mask)`` with a ``[B, S]`` 0/1 mask (S >= T; its last T
columns are used, as in FLA) packs each row's valid tokens into one sequence (``cu_seqlens``),
runs them and scatters the outputs back; padded positions give zeros. Left and right padding
both work, and a valid token's output equals an unpadded run of its row.

The short convolution is ``kdakit.nn.ShortConvolution`` (one ``F.conv1d`` per projection over
the packed tokens, restarted at every sequence start; see ``kdakit/nn/short_conv.py``).

Decode through FLA's cache (what FLA's models and a ``generate`` loop do):
``o, _, cache = layer(x, past_key_values=cache, use_cache=True)`` with ``layer_idx`` set, as
FLA's layer: the call returns FLA's ``(o, None, past_key_values)``, reads layer ``layer_idx``'s
states from the cache and writes the new ones with ``cache.update(...)``. The cache is an FLA
``Cache`` (``fla.models.utils.Cache``) or kdakit's ``kdakit.nn.KDACache`` (no FLA or
transformers needed; a new one is made when ``use_cache=True`` comes without a cache); the
stored states have FLA's layout (``kdakit/nn/cache.py``), so either layer continues the other's
cache. kdakit runs the layer's ``mode`` for every call, decode included; FLA's layer switches
to ``fused_recurrent`` for inference calls of <= 64 tokens (the two agree to round-off).

Serving with state pools: prefill with ``forward(..., initial_state=state_pool,
state_indices=..., state_v_first=True, conv_state=conv_pool)`` and decode with ``step``.
``kda_decode`` keeps the recurrent state value-first (``[P, HV, V, K]``), so a pool shared with
decode must be written by prefill with ``state_v_first=True``. The conv state is a pool too,
``[P, conv_channels, conv_size - 1]`` with the recurrent pool's P rows, indexed by the same
``state_indices`` (``-1`` rows untouched): ``conv_channels = 2 * H * K + HV * V`` in the order
q, k, v; a row holds its sequence's last ``conv_size - 1`` projected (pre-conv) inputs, oldest
first (the W-1 columns serving engines keep). Fresh sequences start from zeroed rows. Without
``state_indices``, ``conv_state`` is ``[N, conv_channels, conv_size - 1]``, one row per sequence.

Host synchronization on the pool path: ``state_indices`` is read to the host once per call to
check it (range ``[-1, P)``, distinct rows) before any pool row is touched, unless
``check_indices=False`` or a CUDA graph is being captured. Everything else runs on the device
with shapes fixed by the call's metadata: the conv pool is gathered with clamped indices and
written back with one ``index_copy_`` of N rows (a padded sequence rewrites the bytes of another
write, see ``_scatter_conv_rows``), never a boolean-mask selection. So with ``cu_seqlens_cpu`` (or
fixed-length inputs) and ``check_indices=False`` the prefill and ``step`` read nothing back from
the device and capture in a plain ``torch.cuda.graph`` (``step`` through ``kda_decode``'s kernel;
its PyTorch backend is a host loop).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kdakit.nn.cache import KDACache, read_layer_state
from kdakit.nn.gated_norm import GatedRMSNorm
from kdakit.nn.short_conv import ShortConvolution
from kdakit.ops.kda.chunk.api import PIPELINES, chunk_kda
from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.serving.state_pool import padded_row_writes
from kdakit.ops.kda.validate import INDEX_DTYPES, check_pool_rows
from kdakit.ops.kda.recurrent.workspace import check_capturable_offsets, is_capturing

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# the layer's out-of-range message for pool rows (``check_pool_rows``, the op's check, names the rest)
POOL_ROWS_RANGE_MESSAGE = "{name} must hold pool rows in [-1, P={P}) (-1 = padded), got {bad}"
MODES = ("chunk", "fused_recurrent")
# Range of the gate's lower bound accepted by chunk_kda's safe-gate path (docs/spec.md §2.3).
SAFE_LOWER_BOUND_MIN = -5.0
# FLA's initialization: A_log = log(U(A_INIT_MIN, A_INIT_MAX)); dt log-uniform in [DT_MIN, DT_MAX].
A_INIT_MIN, A_INIT_MAX = 1.0, 16.0
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
# Parameters that chunk_kda / kda_decode need in float32 whatever the module's dtype.
FP32_PARAMS = ("A_log", "dt_bias")


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer (token mixer); see the module docstring for the formula.

    Args (FLA 0.6.0's names, order and defaults; an unknown keyword raises ``TypeError``):
        hidden_size: model width.
        expand_v: value head size V = ``head_dim * expand_v`` (must be an integer).
        head_dim: q/k head size K.
        num_heads: q/k heads H.
        num_v_heads: value heads HV (grouped value attention), a multiple of ``num_heads``;
            default ``num_heads``.
        mode: ``"chunk"`` (``chunk_kda``) or ``"fused_recurrent"`` (``fused_recurrent_kda``,
            differentiable in kdakit). kdakit runs the mode asked for; it does not switch to the
            recurrent kernel for short inputs as FLA's layer does (the two agree to round-off).
        use_short_conv: convolve q, k, v before their SiLU (otherwise SiLU only).
        allow_neg_eigval: beta = 2 * sigmoid(beta_raw) (eigenvalues of the transition in (-1, 1]).
        safe_gate: use chunk_kda's safe-gate path; needs ``lower_bound`` in [-5, 0).
        lower_bound: the gate's lower bound (< 0); setting it selects the sigmoid gate form
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``. None keeps the softplus gate
            ``-exp(A_log) * softplus(g + dt_bias)``.
        conv_size: width W of the short causal depthwise convolution (>= 1).
        conv_bias: give the convolutions a bias.
        layer_idx: the layer's index in a model (kept for FLA compatibility; unused here).
        norm_eps: epsilon of the gated output RMSNorm.
        pipeline: kdakit extension: the Triton chunk pipeline of ``mode="chunk"`` (``kdakit.chunk_kda``'s
            ``pipeline``: None, "windowed16", "chunk64" or "chunk64_fast").
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        pipeline: str | None = None,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("head_dim", head_dim), ("num_heads", num_heads),
                            ("conv_size", conv_size)):
            _check_positive_int(name, value)
        if num_v_heads is None:
            num_v_heads = num_heads
        _check_positive_int("num_v_heads", num_v_heads)
        if num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads must be a multiple of num_heads={num_heads}, got {num_v_heads}")
        if isinstance(expand_v, bool) or not isinstance(expand_v, (int, float)) or not expand_v > 0:
            raise ValueError(f"expand_v must be a positive number, got {expand_v!r}")
        head_v_dim = head_dim * expand_v
        if not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-5) or round(head_v_dim) < 1:
            raise ValueError(f"expand_v must make head_dim * expand_v a positive integer: head_dim={head_dim}, "
                             f"got expand_v={expand_v} (head_dim * expand_v = {head_v_dim})")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for name, flag in (("use_short_conv", use_short_conv), ("allow_neg_eigval", allow_neg_eigval),
                           ("safe_gate", safe_gate), ("conv_bias", conv_bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if lower_bound is not None:
            if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
                raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
            if not lower_bound < 0.0:
                raise ValueError(f"lower_bound must be negative, got {lower_bound}")
        if safe_gate and (lower_bound is None or not SAFE_LOWER_BOUND_MIN <= lower_bound < 0.0):
            raise ValueError(f"safe_gate=True needs lower_bound in [{SAFE_LOWER_BOUND_MIN}, 0), got {lower_bound}")
        if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int)):
            raise TypeError(f"layer_idx must be an int or None, got {type(layer_idx).__name__}")
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not norm_eps > 0:
            raise ValueError(f"norm_eps must be a positive float, got {norm_eps!r}")
        if pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
        if pipeline is not None and mode != "chunk":
            raise ValueError(f"pipeline selects the chunk op's kernels: it needs mode='chunk', got mode={mode!r}")

        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.head_dim = self.head_k_dim = head_dim
        self.head_v_dim = int(round(head_v_dim))
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.mode = mode
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.safe_gate = safe_gate
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.layer_idx = layer_idx
        self.pipeline = pipeline
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.gate_dim = num_v_heads * head_dim
        self.conv_channels = 2 * self.key_dim + self.value_dim

        # Modules are created, and so random numbers drawn, in FLA's order: one seed gives FLA's
        # parameters.
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, activation="silu")
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.gate_dim, dtype=torch.float32))
        self.reset_gate_parameters()
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """FLA's gate initialization (see the module docstring): ``A_log`` then ``dt_bias``."""
        if self.safe_gate:
            self.A_log.zero_()  # no random draw, as in FLA
        else:
            self.A_log.copy_(torch.empty(self.A_log.shape, dtype=torch.float32).uniform_(A_INIT_MIN, A_INIT_MAX).log())
        u = torch.rand(self.dt_bias.shape, dtype=torch.float32)
        dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
        # inverse softplus: softplus(dt + log(1 - exp(-dt))) = dt
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _apply(self, fn, recurse=True):
        """Module casts (``.bfloat16()``, ``.half()``, ``.to(dtype)``) leave ``A_log`` and ``dt_bias``
        in float32 when they would make them fp16 / bf16: the KDA ops need float32 gate parameters,
        and the values are restored from the uncast ones (no bf16 rounding)."""
        before = {name: (getattr(self, name).data, getattr(self, name).grad) for name in FP32_PARAMS}
        super()._apply(fn, recurse)
        for name, (data, grad) in before.items():
            p = getattr(self, name)
            if p.dtype in (torch.float16, torch.bfloat16):
                p.data = data.to(device=p.device, dtype=torch.float32)
                if p.grad is not None:
                    p.grad = (grad if grad is not None else p.grad).to(device=p.device, dtype=torch.float32)
        return self

    # -----------------------------------------------------------------------------------------
    # Public API
    # -----------------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        state_v_first: bool = False,
        state_indices: torch.Tensor | None = None,
        conv_state: torch.Tensor | None = None,
        check_indices: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """Run the layer over whole sequences (training, prefill, or decode through a cache).

        Args:
            hidden_states: ``[B, T, hidden_size]``; packed sequences need B = 1 and ``cu_seqlens``.
            attention_mask: optional bool / int ``[B, S]`` 0/1 padding mask (1 = valid), S >= T;
                its last T columns are used. Each row's valid tokens run as one sequence (left
                or right padding); outputs at padded positions are zero. Ignored (after its
                checks) when ``cu_seqlens`` is given, as in FLA.
            past_key_values: FLA's cache protocol (see ``kdakit.nn.cache``): an FLA ``Cache`` or
                a ``kdakit.nn.KDACache``. Layer ``layer_idx``'s stored recurrent and conv states
                (FLA's layout) continue each sequence (one per batch row, or per ``cu_seqlens``
                sequence); with ``use_cache`` the new states are written back. Needs ``layer_idx``.
            use_cache: write the final states into ``past_key_values`` (a new ``KDACache`` when
                None). With a cache and ``use_cache=False`` the cache is read, not changed.
            output_attentions: KDA has no attention weights: anything but None / False raises.
            cu_seqlens: int ``[N + 1]`` offsets of the packed sequences (zero-length ones legal).
                Neither the convolution nor the recurrent state crosses a boundary. Without
                ``cu_seqlens_cpu`` the layer reads them to the host once and hands the op that copy.
            cu_seqlens_cpu: the same offsets in a CPU int tensor (as ``chunk_kda``): the layer and
                the op validate this host copy and never read ``cu_seqlens`` back from the device
                (the caller promises the two are equal). Needed to capture a packed call in a
                CUDA graph. Needs ``cu_seqlens``.
            initial_state: recurrent state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
                ``state_v_first``), or, with ``state_indices``, the state pool ``[P, HV, ...]``
                whose rows ``state_indices`` are read and overwritten in place (not differentiated).
            output_final_state: return the final recurrent state (fp32; float64 for float64) as
                the second element.
            state_v_first: value-first state layout; required to share a pool with ``step``.
            state_indices: int ``[N]`` pool rows, ``-1`` for a padded sequence (zero output, its
                pool rows untouched); see ``chunk_kda``. Needs ``mode="chunk"``.
            conv_state: optional ``[N, conv_channels, conv_size - 1]`` per sequence, or with
                ``state_indices`` a pool ``[P, conv_channels, conv_size - 1]`` (P rows as the
                recurrent pool; rows ``state_indices`` used). Only with ``use_short_conv``. Read
                as each sequence's left context of projected inputs (zeros for a fresh sequence)
                and overwritten in place with its last ``conv_size - 1`` projected inputs; not
                differentiated.
            check_indices: with ``state_indices``, read them to the host once to check that they
                lie in ``[-1, P)`` and that rows of different sequences are distinct (a
                device->host copy), before any pool row is touched. Skipped while a CUDA graph is
                being captured; pass False in a serving loop that guarantees them, for a call
                without any synchronization. Unchecked, an index outside ``[-1, P)`` is
                ``chunk_kda``'s indexing error on the device; the conv pool treats it as padded.

            The kdakit state arguments (``initial_state`` ... ``conv_state``) and a cache
            (``past_key_values`` / ``use_cache``) are two ways to carry state: one call takes one.

        Returns:
            ``(out [B, T, hidden_size], final_state or None, past_key_values)``: FLA's
            ``(o, attentions, past_key_values)``, where the attentions slot, always None in FLA,
            holds the final state when ``output_final_state=True``.
        """
        B, T = self._check_hidden("hidden_states", hidden_states)
        if output_attentions not in (None, False):
            raise ValueError(f"output_attentions: KDA computes no attention weights; expected None or False, "
                             f"got {output_attentions!r}")
        if use_cache is not None and not isinstance(use_cache, bool):
            raise TypeError(f"use_cache must be a bool or None, got {type(use_cache).__name__}")
        cached = bool(use_cache) or past_key_values is not None
        last = None
        if cached:
            for name, value in (("initial_state", initial_state), ("state_indices", state_indices),
                                ("conv_state", conv_state)):
                if value is not None:
                    raise ValueError(f"{name} cannot be combined with past_key_values / use_cache: the cache "
                                     "holds the layer's states (pass one or the other)")
            for name, value in (("output_final_state", output_final_state), ("state_v_first", state_v_first)):
                if value is not False:
                    raise ValueError(f"{name} cannot be combined with past_key_values / use_cache: the final "
                                     "state is in the cache (value-first, FLA's layout)")
            if self.layer_idx is None:
                raise ValueError("layer_idx: KimiDeltaAttention requires `layer_idx` when past_key_values or "
                                 "use_cache is given (the cache is keyed by it)")
            if past_key_values is None:
                past_key_values = KDACache()
            last = read_layer_state(past_key_values, self.layer_idx)
        if not isinstance(check_indices, bool):
            raise TypeError(f"check_indices must be a bool, got {type(check_indices).__name__}")
        if cu_seqlens_cpu is not None and cu_seqlens is None:
            # the offsets an attention_mask gives are made on the device; a host copy of them is the caller's
            raise ValueError("cu_seqlens_cpu needs cu_seqlens (its device copy), got cu_seqlens=None")
        indices = None
        if attention_mask is not None:
            valid = self._check_attention_mask("attention_mask", attention_mask, B, T, hidden_states.device)
            if cu_seqlens is None:
                hidden_states, indices, cu_seqlens = _unpad(hidden_states, valid)
        if cached:
            out, final = self._forward_cached(hidden_states, cu_seqlens, cu_seqlens_cpu, last, past_key_values,
                                              bool(use_cache), T)
        else:
            out, final = self._forward_packed(hidden_states, cu_seqlens, cu_seqlens_cpu, initial_state,
                                              output_final_state, state_v_first, state_indices, conv_state,
                                              check_indices)
        if indices is not None:
            out = _repad(out, indices, B, T)
        return out, final, past_key_values

    def _forward_packed(self, hidden_states, cu_seqlens, cu_seqlens_cpu, initial_state, output_final_state,
                        state_v_first, state_indices, conv_state, check_indices):
        B, T = hidden_states.shape[:2]
        N, cu_seqlens_cpu = _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, hidden_states.device)
        for name, flag in (("output_final_state", output_final_state), ("state_v_first", state_v_first)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        rows = None
        if state_indices is not None:
            _check_state_indices("state_indices", state_indices, N)
            if self.mode != "chunk":
                raise ValueError(f"state_indices needs mode='chunk' (decode with step), got mode={self.mode!r}")
            rows = state_indices.long()
        if conv_state is not None and rows is not None:
            if not isinstance(initial_state, torch.Tensor):
                raise ValueError("initial_state: a conv_state pool with state_indices needs the recurrent state "
                                 "pool as initial_state, got None")
            self._check_conv_state("conv_state", conv_state, initial_state.shape[0], hidden_states,
                                   "[P, conv_channels, conv_size - 1] (P rows as the initial_state pool)")
        else:
            self._check_conv_state("conv_state", conv_state, N, hidden_states, "[N, conv_channels, conv_size - 1]")

        if rows is not None and check_indices and not is_capturing(hidden_states.device) \
                and isinstance(initial_state, torch.Tensor):
            # the one host read of the pool path, before the conv pool is gathered or any row written;
            # the op then skips its own read (a missing pool is the op's error, named there)
            check_pool_rows("state_indices", state_indices, initial_state.shape[0],
                            range_message=POOL_ROWS_RANGE_MESSAGE)
        contexts = None if conv_state is None else self._split_channels(
            conv_state if rows is None else _gather_conv_rows(conv_state, rows))
        q, k, v, proj = self._mix_qkv(hidden_states, contexts, cu_seqlens)
        g, beta = self._gate_inputs(hidden_states)
        o, final = self._kda(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, output_final_state,
                             state_v_first, state_indices)
        if conv_state is not None:
            # after the op, which has accepted its arguments: a rejected call leaves the conv state as it was
            _store_conv_state(conv_state, proj, _seq_lengths(B, T, cu_seqlens, hidden_states.device),
                              _seq_starts(B, T, cu_seqlens, hidden_states.device), rows)
        return self._output(o, hidden_states), final

    def _forward_cached(self, hidden_states, cu_seqlens, cu_seqlens_cpu, last, cache, use_cache, offset):
        """FLA's cache path: continue from ``last`` (layer ``layer_idx``'s stored states, or None)
        and, with ``use_cache``, write the new ones with ``cache.update``."""
        B, T = hidden_states.shape[:2]
        N, cu_seqlens_cpu = _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, hidden_states.device)
        recurrent, windows = self._cached_states(last, N, hidden_states)
        contexts = None
        if windows is not None:
            # the next token's convolution reads the newest W-1 of FLA's W-column window
            contexts = [None if w is None else w[:, :, 1:] for w in windows]
        q, k, v, proj = self._mix_qkv(hidden_states, contexts, cu_seqlens)
        g, beta = self._gate_inputs(hidden_states)
        o, final = self._kda(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, recurrent, use_cache, True, None)
        if use_cache:
            conv = None
            if self.use_short_conv:
                lengths = _seq_lengths(B, T, cu_seqlens, hidden_states.device)
                starts = _seq_starts(B, T, cu_seqlens, hidden_states.device)
                old = windows if windows is not None else [None] * 3
                conv = tuple(_conv_windows(w if w is not None else p.new_zeros(N, p.shape[-1], self.conv_size),
                                           p, lengths, starts) for w, p in zip(old, proj))
            cache.update(recurrent_state=final, conv_state=conv, layer_idx=self.layer_idx, offset=offset)
        return self._output(o, hidden_states), None

    @torch.no_grad()
    def step(
        self,
        hidden_states: torch.Tensor,
        conv_state: torch.Tensor | None,
        state_pool: torch.Tensor,
        state_indices: torch.Tensor,
        *,
        check_indices: bool = True,
    ) -> torch.Tensor:
        """Decode: advance N sequences by their next tokens, updating both pools in place.

        Args:
            hidden_states: ``[N, T, hidden_size]``, usually T = 1 (T > 1 gives the same result
                as T one-token steps).
            conv_state: ``[P, conv_channels, conv_size - 1]`` conv-state pool, the same P rows as
                ``state_pool`` (row ``state_indices[n]`` is sequence n's), updated in place; None
                when ``use_short_conv=False``.
            state_pool: ``[P, HV, V, K]`` value-first recurrent state pool (fp32 or bf16),
                updated in place through ``kdakit.kda_decode``.
            state_indices: int32 ``[N]`` pool rows; ``-1`` marks a padded sequence (zero output,
                no pool row touched).
            check_indices: read ``state_indices`` to the host once to check their range
                ``[-1, P)`` and that rows are distinct, before any pool row is touched (a
                device->host copy). Skipped while a CUDA graph is being captured; pass False in a
                serving loop that guarantees them: the step then reads nothing back from the
                device (on ``kda_decode``'s kernel). Unchecked, an out-of-range row is treated as
                padded (as ``kda_decode``), in the conv pool too.

        Returns:
            ``out [N, T, hidden_size]``. Not differentiable (inference only).
        """
        N, T = self._check_hidden("hidden_states", hidden_states)
        if T == 0:
            raise ValueError("hidden_states must carry at least one token per sequence, got T=0")
        if not isinstance(check_indices, bool):
            raise TypeError(f"check_indices must be a bool, got {type(check_indices).__name__}")
        _check_state_indices("state_indices", state_indices, N)
        if not isinstance(state_pool, torch.Tensor):
            raise TypeError(f"state_pool must be a torch.Tensor, got {type(state_pool).__name__}")
        if self.use_short_conv and conv_state is None:
            raise ValueError(f"conv_state is required with use_short_conv=True: expected "
                             f"[P, {self.conv_channels}, {self.conv_size - 1}], got None")
        self._check_conv_state("conv_state", conv_state, state_pool.shape[0], hidden_states,
                               "[P, conv_channels, conv_size - 1] (P rows as state_pool)")

        rows = state_indices.long()
        if check_indices and not is_capturing(hidden_states.device):
            # the one host read of the step, before the conv pool is gathered or any row written;
            # kda_decode then skips its own read
            check_pool_rows("state_indices", state_indices, state_pool.shape[0],
                            range_message=POOL_ROWS_RANGE_MESSAGE)
        contexts = None if conv_state is None else self._split_channels(_gather_conv_rows(conv_state, rows))
        q, k, v, proj = self._mix_qkv(hidden_states, contexts, None)
        g, beta = self._gate_inputs(hidden_states)
        o = kda_decode(
            q, k, v, g, beta, state_pool, state_indices,
            A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
            lower_bound=self.lower_bound, safe_gate=self.safe_gate, check_indices=False,
        )
        if conv_state is not None:
            _store_conv_state(conv_state, proj, _seq_lengths(N, T, None, hidden_states.device),
                              _seq_starts(N, T, None, hidden_states.device), rows)
        return self._output(o, hidden_states)

    # -----------------------------------------------------------------------------------------
    # Stages
    # -----------------------------------------------------------------------------------------

    def _split_channels(self, conv_state):
        """``[N, conv_channels, M]`` -> its q, k, v parts (views)."""
        return torch.split(conv_state, [self.key_dim, self.key_dim, self.value_dim], dim=1)

    def _mix_qkv(self, x, contexts, cu_seqlens):
        """Projections, causal conv (per sequence, left contexts ``contexts`` = q, k, v
        ``[N, D, W-1]`` tensors or None for zeros) and SiLU.

        Returns q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` and the projections (q, k, v
        ``[B, T, D]``) that the caller shifts into the conv state once the KDA op has accepted
        its arguments.
        """
        B, T = x.shape[:2]
        proj = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        if self.use_short_conv:
            contexts = contexts if contexts is not None else [None] * 3
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            mixed = [conv(p, cu_seqlens=cu_seqlens, context=c) for p, conv, c in zip(proj, convs, contexts)]
        else:
            mixed = [F.silu(p) for p in proj]
        H, HV, K = self.num_heads, self.num_v_heads, self.head_dim
        return (mixed[0].view(B, T, H, K), mixed[1].view(B, T, H, K),
                mixed[2].view(B, T, HV, self.head_v_dim), proj)

    def _kda(self, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, output_final_state, state_v_first,
             state_indices):
        """The layer's KDA op (``mode``) with the gate and beta activations inside it."""
        common = dict(
            initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, A_log=self.A_log, dt_bias=self.dt_bias,
        )
        if self.mode == "chunk":
            # the layer has checked state_indices (or was told not to): the op does not read them again
            return chunk_kda(q, k, v, g, beta, safe_gate=self.safe_gate, state_indices=state_indices,
                             check_indices=False, pipeline=self.pipeline, **common)
        return fused_recurrent_kda(q, k, v, g, beta, **common)

    def _gate_inputs(self, x):
        """Raw gate ``[B, T, HV, K]`` and beta logits ``[B, T, HV]`` (activated inside the KDA op)."""
        B, T = x.shape[:2]
        return self.f_proj(x).view(B, T, self.num_v_heads, self.head_dim), self.b_proj(x)

    def _output(self, o, x):
        B, T = x.shape[:2]
        gate = self.g_proj(x).view(B, T, self.num_v_heads, self.head_v_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, self.value_dim))

    # -----------------------------------------------------------------------------------------
    # Checks
    # -----------------------------------------------------------------------------------------

    def _check_hidden(self, name, x) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"{name} must have shape [B, T, hidden_size={self.hidden_size}], got {list(x.shape)}")
        w = self.q_proj.weight
        if x.device != w.device:
            raise ValueError(f"{name} must be on the layer's device {w.device}, got {x.device}")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"{name} must have the layer's dtype {w.dtype} (or run under autocast), got {x.dtype}")
        return x.shape[0], x.shape[1]

    def _check_attention_mask(self, name, mask, B, T, device) -> torch.Tensor:
        """The mask's last T columns as a bool ``[B, T]`` (reads the mask once on the host to check
        that it is 0/1)."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.dtype.is_complex):
            raise TypeError(f"{name} must be a bool or integer 0/1 padding mask, got {mask.dtype}")
        if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < T:
            raise ValueError(f"{name} must be a [batch_size, seq_len] padding mask with batch_size={B} and "
                             f"seq_len >= T={T} (arbitrary [B, T, T] masks are not supported), "
                             f"got {list(mask.shape)}")
        if mask.device != device:
            raise ValueError(f"{name} must be on hidden_states' device {device}, got {mask.device}")
        mask = mask[:, mask.shape[1] - T:]
        if mask.dtype != torch.bool:
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"{name} must hold only 0 (padding) and 1 (valid), got values "
                                 f"{sorted(set(mask.unique().tolist()))}")
            mask = mask != 0
        return mask

    def _check_conv_state(self, name, conv_state, rows, x, layout) -> None:
        if conv_state is None:
            return
        if not self.use_short_conv:
            raise ValueError(f"{name} must be None with use_short_conv=False, got a tensor")
        if not isinstance(conv_state, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(conv_state).__name__}")
        if conv_state.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got {conv_state.dtype}")
        want = (rows, self.conv_channels, self.conv_size - 1)
        if tuple(conv_state.shape) != want:
            raise ValueError(f"{name} must have shape {layout} = {list(want)}, got {list(conv_state.shape)}")
        if conv_state.device != x.device:
            raise ValueError(f"{name} must be on hidden_states' device {x.device}, got {conv_state.device}")

    def _cached_states(self, last, N, x):
        """Layer ``layer_idx``'s cached ``(recurrent_state, conv windows (q, k, v) or None)``,
        checked against this call's N sequences."""
        if last is None:
            return None, None
        where = f"past_key_values[{self.layer_idx}]"
        recurrent = last.get("recurrent_state")
        if recurrent is not None:
            want = (N, self.num_v_heads, self.head_v_dim, self.head_dim)
            if not isinstance(recurrent, torch.Tensor) or recurrent.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{where}['recurrent_state'] must be a floating tensor, got "
                                f"{getattr(recurrent, 'dtype', type(recurrent).__name__)}")
            if tuple(recurrent.shape) != want or recurrent.device != x.device:
                raise ValueError(f"{where}['recurrent_state'] must be [N, HV, V, K] = {list(want)} (value-first, "
                                 f"one row per sequence of this call) on {x.device}, got {list(recurrent.shape)} "
                                 f"on {recurrent.device}")
        windows = last.get("conv_state")
        if windows is None:
            return recurrent, None
        if not self.use_short_conv:
            raise ValueError(f"{where}['conv_state'] must be None for a layer with use_short_conv=False, "
                             f"got {type(windows).__name__}")
        if not isinstance(windows, (tuple, list)) or len(windows) != 3:
            raise TypeError(f"{where}['conv_state'] must be FLA's (q, k, v) tuple of [N, D, conv_size] tensors, "
                            f"got {type(windows).__name__}")
        for part, w, D in zip("qkv", windows, (self.key_dim, self.key_dim, self.value_dim)):
            if w is None:
                continue   # FLA 0.6.0 stores Nones after a call without use_cache: zeros
            if not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{where}['conv_state'] ({part}) must be a floating tensor, got "
                                f"{getattr(w, 'dtype', type(w).__name__)}")
            if tuple(w.shape) != (N, D, self.conv_size) or w.device != x.device:
                raise ValueError(f"{where}['conv_state'] ({part}) must be [N, D, conv_size] = "
                                 f"{[N, D, self.conv_size]} on {x.device}, got {list(w.shape)} on {w.device}")
            if w.requires_grad and torch.is_grad_enabled():
                # kdakit's short convolution does not differentiate its left context
                raise ValueError(f"{where}['conv_state'] ({part}) requires grad: kdakit's short convolution "
                                 "does not differentiate the cached context; detach it")
        return recurrent, list(windows)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, expand_v={self.expand_v}, head_dim={self.head_dim}, "
                f"num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, mode={self.mode!r}, "
                f"conv_size={self.conv_size if self.use_short_conv else None}, "
                f"safe_gate={self.safe_gate}, lower_bound={self.lower_bound}, layer_idx={self.layer_idx}")


# ---------------------------------------------------------------------------------------------
# Padding masks and the conv state
# ---------------------------------------------------------------------------------------------

def _unpad(x, valid):
    """Pack each row's valid tokens: ``(x [1, total, D], token indices into B*T, cu_seqlens [B + 1])``."""
    B, T = valid.shape
    indices = valid.reshape(-1).nonzero().squeeze(1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=x.device)
    cu[1:] = valid.sum(1).cumsum(0)
    return x.reshape(B * T, *x.shape[2:])[indices][None], indices, cu


def _repad(y, indices, B, T):
    """Inverse of ``_unpad``: zeros at padded positions (differentiable)."""
    out = y.new_zeros(B * T, *y.shape[2:])
    out = out.index_copy(0, indices, y[0])
    return out.view(B, T, *y.shape[2:])


def _conv_windows(old, x, lengths, starts):
    """Each sequence's last M inputs, oldest first, the old window filling in where the sequence
    is shorter than M: ``[N, D, M]`` (a new tensor in ``old``'s dtype). ``old`` ``[N, D, M]``,
    ``x`` ``[B, T, D]`` (sequence n at flat tokens ``starts[n] : starts[n] + lengths[n]``)."""
    N, D, M = old.shape
    total = x.shape[0] * x.shape[1]
    if M == 0 or total == 0:
        return old.detach().clone()
    flat = x.detach().reshape(total, D)    # a view: x is a projection's contiguous output
    rel = lengths[:, None] - M + torch.arange(M, device=x.device)          # [N, M] position in sequence
    tok = flat[(starts[:, None] + rel.clamp(min=0)).clamp(max=total - 1)]  # [N, M, D], used where rel >= 0
    col = (M + rel).clamp(0, M - 1)                                         # old column, used where rel < 0
    prev = torch.gather(old.detach(), 2, col[:, None, :].expand(N, D, M))
    return torch.where((rel >= 0)[:, None, :], tok.transpose(1, 2).to(old.dtype), prev)


@torch.no_grad()
def _store_conv_state(conv_state, proj, lengths, starts, rows):
    """Shift each sequence's projected inputs (q, k, v ``[B, T, D]``) into its conv-state row:
    row n (``rows[n]`` of a pool, skipped where padded) holds the last ``W-1`` inputs afterwards.
    Per part, so no T-sized concatenation of the projections is made."""
    old = conv_state if rows is None else _gather_conv_rows(conv_state, rows)
    splits = [p.shape[-1] for p in proj]
    new = torch.cat([_conv_windows(o, p, lengths, starts) for o, p in zip(torch.split(old, splits, 1), proj)], 1)
    if rows is None:
        conv_state.copy_(new)
    else:
        _scatter_conv_rows(conv_state, new, rows)


def _gather_conv_rows(pool, rows):
    """Rows ``rows`` ``[N]`` (long) of a conv pool ``[P, C, M]`` as a new ``[N, C, M]`` tensor; a
    padded or out-of-range entry reads a clamped row (its sequence's output is zero, and its row
    is never written), so no index value has to be known on the host."""
    if pool.shape[0] == 0:
        return pool.new_zeros(rows.shape[0], *pool.shape[1:])  # no row to read: every entry is padded
    return pool.index_select(0, rows.clamp(0, pool.shape[0] - 1))


def _scatter_conv_rows(pool, new, rows) -> None:
    """``new[n]`` into pool row ``rows[n]`` in place for the entries in ``[0, P)``; others write nothing.

    One ``index_copy_`` of all N rows, so the write's size is the call's N, not the number of valid
    entries (a device value): ``padded_row_writes``, as the recurrent pool's scatter."""
    if pool.shape[0] == 0 or rows.numel() == 0:
        return  # nothing can be written
    valid = (rows >= 0) & (rows < pool.shape[0])
    dest, values = padded_row_writes(pool, new, rows, valid)
    pool.index_copy_(0, dest, values)


def _seq_starts(B, T, cu_seqlens, device):
    """Each sequence's first flat token ``[N]`` (long); ``cu_seqlens`` is on ``device`` (checked)."""
    if cu_seqlens is None:
        return torch.arange(B, device=device, dtype=torch.long) * T
    return cu_seqlens[:-1].long()


def _check_state_indices(name, state_indices, N) -> None:
    if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 tensor [N], got "
                        f"{getattr(state_indices, 'dtype', type(state_indices).__name__)}")
    if state_indices.dim() != 1 or state_indices.shape[0] != N:
        raise ValueError(f"{name} must have shape [N] = [{N}], got {list(state_indices.shape)}")


def _seq_lengths(B, T, cu_seqlens, device):
    """Per sequence length ``[N]`` (long), on the device: ``cu_seqlens`` is on ``device`` (checked)."""
    if cu_seqlens is None:
        return torch.full((B,), T, device=device, dtype=torch.long)
    cu = cu_seqlens.long()
    return cu[1:] - cu[:-1]


def _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, device) -> tuple[int, torch.Tensor | None]:
    """``(N, host offsets)`` from the offsets' values: read from ``cu_seqlens_cpu`` when given
    (``cu_seqlens`` is then used on the device only), otherwise one host read of ``cu_seqlens``,
    whose values come back as a CPU tensor for the KDA op (which would otherwise read them again:
    a second device->host synchronization). ``(B, None)`` without offsets."""
    if cu_seqlens is None:
        return B, None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on hidden_states' device {device}, got {cu_seqlens.device}")
    if B != 1:
        raise ValueError(f"hidden_states must have batch size 1 with cu_seqlens (packed sequences), got B={B}")
    name = "cu_seqlens"
    if cu_seqlens_cpu is not None:
        name = "cu_seqlens_cpu"
        if not isinstance(cu_seqlens_cpu, torch.Tensor):
            raise TypeError(f"cu_seqlens_cpu must be a torch.Tensor or None, got {type(cu_seqlens_cpu).__name__}")
        if cu_seqlens_cpu.dtype not in INDEX_DTYPES:
            raise TypeError(f"cu_seqlens_cpu must be int32 or int64, got {cu_seqlens_cpu.dtype}")
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens), "
                             f"got {cu_seqlens_cpu.device}")
        if tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
            raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {list(cu_seqlens.shape)}, "
                             f"got {list(cu_seqlens_cpu.shape)}")
        cu = cu_seqlens_cpu.tolist()  # a host tensor: no synchronization
    else:
        if is_capturing(device):
            check_capturable_offsets("KimiDeltaAttention", cu_seqlens, cu_seqlens_cpu)  # raises: no device read here
        cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing from 0 to T={T}, got {cu}")
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = torch.tensor(cu, dtype=cu_seqlens.dtype)
    return len(cu) - 1, cu_seqlens_cpu


def _check_positive_int(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")


__all__ = ["KimiDeltaAttention", "GatedRMSNorm"]
