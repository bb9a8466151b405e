"""``KimiDeltaAttention``: the KDA token mixer of Kimi Linear, built on ``kdakit.chunk_kda``.

Per token (``x`` the hidden state ``[hidden]``, H q/k heads, HV value heads, head size K = V)::

    q, k, v   = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))   # causal depthwise conv, per sequence
    g_raw     = W_f2 W_f1 x                    # low rank: hidden -> K -> HV * K
    beta_raw  = W_b x                          # [HV]
    o         = KDA(q, k, v, g_raw, beta_raw)  # in-kernel l2norm(q, k), gate(A_log, dt_bias), sigmoid(beta)
    gate      = W_g2 W_g1 x + b_g2             # low rank: hidden -> K -> HV * V
    y         = W_o [ rmsnorm(o) * w_norm * sigmoid(gate) ]   # per value head

Parameter names and shapes follow the Kimi Linear / FLA layer (``q_proj``, ``k_proj``,
``v_proj``, ``q_conv1d``, ``k_conv1d``, ``v_conv1d``, ``f_proj``, ``b_proj``, ``A_log``,
``dt_bias``, ``g_proj``, ``o_norm``, ``o_proj``), so a checkpoint with ``num_v_heads ==
num_heads`` loads with ``load_state_dict``. With grouped value heads (``num_v_heads >
num_heads``) the gate and beta projections produce one gate per value head (``HV * K`` and
``HV`` outputs) rather than repeating the q/k heads' ones.

Initialization: projections use ``nn.Linear``'s default; ``A_log = log(U(1, 16))`` per value
head, so the decay rates ``exp(A_log)`` spread over [1, 16]; ``dt_bias = 0``, as in FLA's
layer: at initialization the gate is ``-exp(A_log) * softplus(g_raw)`` and the spread of time
scales comes from ``A_log`` alone (the Mamba-style inverse-softplus bias is not used);
``o_norm.weight = 1``. ``A_log`` and ``dt_bias`` carry ``_no_weight_decay = True``.

Precision: ``A_log`` and ``dt_bias`` must stay float32 (``chunk_kda`` requires it; float64 is
accepted with float64 inputs). For bf16 training use autocast, or cast the module and then
restore those two parameters to float32.

The short convolution runs in PyTorch (``conv_size`` shifted multiply-adds over the packed
tokens, masked at sequence starts), so no value crosses a ``cu_seqlens`` boundary.

Serving: prefill with ``forward(..., initial_state=state_pool, state_indices=...,
state_v_first=True, conv_state=...)`` and decode with ``step``. ``kda_decode`` keeps the
recurrent state value-first (``[P, HV, V, K]``), so a pool shared with decode must be written
by prefill with ``state_v_first=True``. The conv state is caller-owned, one row per sequence of
the batch: ``[N, conv_channels, conv_size - 1]`` with ``conv_channels = 2 * H * K + HV * K``
in the order q, k, v; it holds each sequence's last ``conv_size - 1`` projected (pre-conv)
inputs, oldest first. Fresh sequences start from a zeroed row.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kdakit.ops.kda.chunk import chunk_kda
from kdakit.ops.kda.decode import kda_decode

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Range of the gate's lower bound accepted by chunk_kda's safe-gate path (SPEC §2).
SAFE_LOWER_BOUND_MIN = -5.0
# A_log is initialized to log(U(A_INIT_MIN, A_INIT_MAX)).
A_INIT_MIN, A_INIT_MAX = 1.0, 16.0


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dt) * torch.sigmoid(gate.to(dt))).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer (token mixer); see the module docstring for the formula.

    Args:
        hidden_size: model width.
        num_heads: q/k heads H.
        head_dim: K = V, the size of every head.
        num_v_heads: value heads HV (grouped value attention), a multiple of ``num_heads``;
            default ``num_heads``.
        conv_size: width of the short causal depthwise convolution (>= 1).
        use_short_conv: convolve q, k, v before their SiLU (otherwise SiLU only).
        conv_bias: give the convolutions a bias.
        allow_neg_eigval: beta = 2 * sigmoid(beta_raw) (eigenvalues of the transition in (-1, 1]).
        safe_gate: use the bounded gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
            and chunk_kda's safe-gate path; needs ``lower_bound`` in [-5, 0).
        lower_bound: the gate's lower bound (< 0); setting it selects the sigmoid gate form.
            None keeps the softplus gate ``-exp(A_log) * softplus(g + dt_bias)``.
        norm_eps: epsilon of the gated output RMSNorm.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        num_v_heads: int | None = None,
        conv_size: int = 4,
        use_short_conv: bool = True,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                            ("conv_size", conv_size)):
            _check_positive_int(name, value)
        if num_v_heads is None:
            num_v_heads = num_heads
        _check_positive_int("num_v_heads", num_v_heads)
        if num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads must be a multiple of num_heads={num_heads}, got {num_v_heads}")
        if lower_bound is not None:
            if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
                raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
            if not lower_bound < 0.0:
                raise ValueError(f"lower_bound must be negative, got {lower_bound}")
        if safe_gate and (lower_bound is None or not SAFE_LOWER_BOUND_MIN <= lower_bound < 0.0):
            raise ValueError(f"safe_gate=True needs lower_bound in [{SAFE_LOWER_BOUND_MIN}, 0), got {lower_bound}")
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not norm_eps > 0:
            raise ValueError(f"norm_eps must be a positive float, got {norm_eps!r}")

        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_dim = head_dim
        self.conv_size = conv_size
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.safe_gate = safe_gate
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * head_dim
        self.conv_channels = 2 * self.key_dim + self.value_dim

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            # depthwise: weight [channels, 1, conv_size], applied causally by causal_conv below
            self.q_conv1d = nn.Conv1d(self.key_dim, self.key_dim, conv_size, groups=self.key_dim, bias=conv_bias)
            self.k_conv1d = nn.Conv1d(self.key_dim, self.key_dim, conv_size, groups=self.key_dim, bias=conv_bias)
            self.v_conv1d = nn.Conv1d(self.value_dim, self.value_dim, conv_size, groups=self.value_dim,
                                      bias=conv_bias)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False),
                                    nn.Linear(head_dim, num_v_heads * head_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads * head_dim, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False),
                                    nn.Linear(head_dim, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """``A_log = log(U(1, 16))``, ``dt_bias = 0`` (see the module docstring)."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(A_INIT_MIN, A_INIT_MAX).log())
        self.dt_bias.zero_()

    # -----------------------------------------------------------------------------------------
    # Public API
    # -----------------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        state_v_first: bool = False,
        state_indices: torch.Tensor | None = None,
        conv_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the layer over whole sequences (training or prefill) with ``chunk_kda``.

        Args:
            hidden_states: ``[B, T, hidden_size]``; packed sequences need B = 1 and ``cu_seqlens``.
            cu_seqlens: int ``[N + 1]`` offsets of the packed sequences (zero-length ones legal).
                Neither the convolution nor the recurrent state crosses a boundary.
            initial_state: recurrent state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
                ``state_v_first``), or, with ``state_indices``, the state pool ``[P, HV, ...]``
                whose rows ``state_indices`` are read and overwritten in place (not differentiated).
            output_final_state: also return the final recurrent state (fp32; float64 for float64).
            state_v_first: value-first state layout; required to share a pool with ``step``.
            state_indices: int ``[N]`` pool rows, ``-1`` for a padded sequence (zero output, its
                pool row and conv-state row untouched); see ``chunk_kda``.
            conv_state: optional caller-owned ``[N, conv_channels, conv_size - 1]`` (only with
                ``use_short_conv``): read as each sequence's left context of projected inputs
                (zeros for a fresh sequence) and overwritten in place with its last
                ``conv_size - 1`` projected inputs. It is not differentiated.

        Returns:
            ``(out [B, T, hidden_size], final_state or None)``.
        """
        B, T = self._check_hidden("hidden_states", hidden_states)
        N = _check_cu_seqlens(cu_seqlens, B, T, hidden_states.device)
        for name, flag in (("output_final_state", output_final_state), ("state_v_first", state_v_first)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        keep = None
        if state_indices is not None:
            if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in INDEX_DTYPES:
                raise TypeError(f"state_indices must be an int32 tensor [N], got "
                                f"{getattr(state_indices, 'dtype', type(state_indices).__name__)}")
            if state_indices.dim() != 1 or state_indices.shape[0] != N:
                raise ValueError(f"state_indices must have shape [N] = [{N}], got {list(state_indices.shape)}")
            keep = state_indices >= 0
        self._check_conv_state("conv_state", conv_state, N, hidden_states)

        seq_id, pos, lengths = _token_positions(B, T, N, cu_seqlens, hidden_states.device)
        q, k, v, proj = self._mix_qkv(hidden_states, conv_state, seq_id, pos)
        g, beta = self._gate_inputs(hidden_states)
        o, final = chunk_kda(
            q, k, v, g, beta,
            initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval, safe_gate=self.safe_gate, lower_bound=self.lower_bound,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=self.A_log, dt_bias=self.dt_bias,
            state_indices=state_indices,
        )
        if conv_state is not None:
            _update_conv_state(conv_state, torch.cat(proj, dim=-1).detach(), lengths, cu_seqlens, keep)
        return self._output(o, hidden_states), final

    @torch.no_grad()
    def step(
        self,
        hidden_states: torch.Tensor,
        conv_state: torch.Tensor | None,
        state_pool: torch.Tensor,
        state_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Decode: advance N sequences by their next tokens, updating both caches in place.

        Args:
            hidden_states: ``[N, T, hidden_size]``, usually T = 1 (T > 1 gives the same result
                as T one-token steps).
            conv_state: ``[N, conv_channels, conv_size - 1]`` caller-owned conv cache (row n is
                sequence n's), updated in place; None when ``use_short_conv=False``.
            state_pool: ``[P, HV, V, K]`` value-first recurrent state pool (fp32 or bf16),
                updated in place through ``kdakit.kda_decode``.
            state_indices: int32 ``[N]`` pool rows; ``-1`` marks a padded sequence (zero output,
                its pool row and conv-state row untouched).

        Returns:
            ``out [N, T, hidden_size]``. Not differentiable (inference only).
        """
        N, T = self._check_hidden("hidden_states", hidden_states)
        if T == 0:
            raise ValueError("hidden_states must carry at least one token per sequence, got T=0")
        if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in INDEX_DTYPES:
            raise TypeError(f"state_indices must be an int32 tensor [N], got "
                            f"{getattr(state_indices, 'dtype', type(state_indices).__name__)}")
        if state_indices.dim() != 1 or state_indices.shape[0] != N:
            raise ValueError(f"state_indices must have shape [N] = [{N}], got {list(state_indices.shape)}")
        if self.use_short_conv and conv_state is None:
            raise ValueError(f"conv_state is required with use_short_conv=True: expected "
                             f"[{N}, {self.conv_channels}, {self.conv_size - 1}], got None")
        self._check_conv_state("conv_state", conv_state, N, hidden_states)

        seq_id, pos, lengths = _token_positions(N, T, N, None, hidden_states.device)
        q, k, v, proj = self._mix_qkv(hidden_states, conv_state, seq_id, pos)
        g, beta = self._gate_inputs(hidden_states)
        o = kda_decode(
            q, k, v, g, beta, state_pool, state_indices,
            A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
            lower_bound=self.lower_bound, safe_gate=self.safe_gate,
        )
        if conv_state is not None:
            _update_conv_state(conv_state, torch.cat(proj, dim=-1), lengths, None, state_indices >= 0)
        return self._output(o, hidden_states)

    # -----------------------------------------------------------------------------------------
    # Stages
    # -----------------------------------------------------------------------------------------

    def _mix_qkv(self, x, conv_state, seq_id, pos):
        """Projections, causal conv (per sequence) and SiLU.

        Returns q, k ``[B, T, H, K]``, v ``[B, T, HV, K]`` and the projections ``[B, T, conv_channels]``
        that the caller shifts into ``conv_state`` once the KDA op has accepted its arguments.
        """
        B, T = x.shape[:2]
        proj = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        if self.use_short_conv:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            contexts = [None] * 3
            if conv_state is not None:
                contexts = torch.split(conv_state.detach().to(proj[0].dtype),
                                       [self.key_dim, self.key_dim, self.value_dim], dim=1)
            mixed = [causal_conv(p, c.weight, c.bias, seq_id, pos, context)
                     for p, c, context in zip(proj, convs, contexts)]
        else:
            mixed = proj
        q, k, v = (F.silu(m) for m in mixed)
        H, HV, K = self.num_heads, self.num_v_heads, self.head_dim
        return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, K), proj

    def _gate_inputs(self, x):
        """Raw gate ``[B, T, HV, K]`` and beta logits ``[B, T, HV]`` (activated inside the KDA op)."""
        B, T = x.shape[:2]
        return self.f_proj(x).view(B, T, self.num_v_heads, self.head_dim), self.b_proj(x)

    def _output(self, o, x):
        B, T = x.shape[:2]
        gate = self.g_proj(x).view(B, T, self.num_v_heads, self.head_dim)
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

    def _check_conv_state(self, name, conv_state, N, x) -> None:
        if conv_state is None:
            return
        if not self.use_short_conv:
            raise ValueError(f"{name} must be None with use_short_conv=False, got a tensor")
        if not isinstance(conv_state, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(conv_state).__name__}")
        if conv_state.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got {conv_state.dtype}")
        want = (N, self.conv_channels, self.conv_size - 1)
        if tuple(conv_state.shape) != want:
            raise ValueError(f"{name} must have shape [N, conv_channels, conv_size - 1] = {list(want)}, "
                             f"got {list(conv_state.shape)}")
        if conv_state.device != x.device:
            raise ValueError(f"{name} must be on hidden_states' device {x.device}, got {conv_state.device}")

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_dim={self.head_dim}, conv_size={self.conv_size if self.use_short_conv else None}, "
                f"safe_gate={self.safe_gate}, lower_bound={self.lower_bound}")


# ---------------------------------------------------------------------------------------------
# Short convolution over packed sequences
# ---------------------------------------------------------------------------------------------

def causal_conv(x, weight, bias, seq_id, pos, context):
    """Depthwise causal convolution that restarts at every sequence start.

    ``y[t] = bias + sum_j weight[:, 0, W-1-j] * x[t-j]`` for ``j < W``, where ``x[t-j]`` from
    before the sequence start is taken from ``context`` (``[N, C, W-1]``, oldest first) or is
    zero. ``x`` ``[B, T, C]``; ``seq_id``/``pos`` ``[B, T]``: each token's sequence and position.
    """
    W = weight.shape[-1]
    w = weight.view(weight.shape[0], W)                                   # [C, W]
    y = x * w[:, W - 1]
    if bias is not None:
        y = y + bias
    for j in range(1, W):
        shifted = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]                 # x[t - j], [B, T, C]
        inside = (pos >= j)[..., None]                                    # same sequence
        if context is None:
            src = shifted * inside.to(x.dtype)
        else:
            slot = (W - 1 + pos - j).clamp(0, W - 2)                       # context column of x[t - j]
            src = torch.where(inside, shifted, context.transpose(1, 2)[seq_id, slot])
        y = y + src * w[:, W - 1 - j]
    return y


@torch.no_grad()
def _update_conv_state(conv_state, x, lengths, cu_seqlens, keep):
    """Shift each sequence's inputs into its conv state: afterwards row n holds the last ``W-1``
    inputs of the old context followed by sequence n's tokens. ``x`` ``[B, T, C]``."""
    N, C, Wm1 = conv_state.shape
    B, T = x.shape[:2]
    if Wm1 == 0 or B * T == 0:
        return
    flat = x.reshape(B * T, C)
    starts = cu_seqlens[:-1].long() if cu_seqlens is not None else torch.arange(N, device=x.device) * T
    rel = lengths[:, None] - Wm1 + torch.arange(Wm1, device=x.device)    # [N, W-1] position in sequence
    tok = flat[(starts[:, None] + rel.clamp(min=0)).clamp(max=B * T - 1)]  # [N, W-1, C], used where rel >= 0
    ctx_col = (Wm1 + rel).clamp(0, Wm1 - 1)                               # used where rel < 0
    old = torch.gather(conv_state, 2, ctx_col[:, None, :].expand(N, C, Wm1)).transpose(1, 2)
    new = torch.where((rel >= 0)[..., None], tok.to(conv_state.dtype), old)
    if keep is not None:
        new = torch.where(keep[:, None, None], new, conv_state.transpose(1, 2))
    conv_state.copy_(new.transpose(1, 2))


def _token_positions(B, T, N, cu_seqlens, device):
    """Per token: sequence index and position in it (``[B, T]`` each); per sequence: length ``[N]``."""
    if cu_seqlens is None:
        seq_id = torch.arange(B, device=device)[:, None].expand(B, T)
        pos = torch.arange(T, device=device)[None, :].expand(B, T)
        return seq_id, pos, torch.full((B,), T, device=device, dtype=torch.long)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(N, device=device), lengths, output_size=T)
    pos = torch.arange(T, device=device) - cu[seq_id]
    return seq_id[None], pos[None], lengths


def _check_cu_seqlens(cu_seqlens, B, T, device) -> int:
    if cu_seqlens is None:
        return B
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
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cu}")
    return len(cu) - 1


def _check_positive_int(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")


__all__ = ["KimiDeltaAttention", "GatedRMSNorm", "causal_conv"]
