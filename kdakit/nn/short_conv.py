"""Short causal depthwise convolution over packed sequences: ``kdakit.nn.ShortConvolution``.

``y[t] = act(bias + sum_{j < W} weight[:, 0, W-1-j] * x[t-j])`` per channel, where ``x[t-j]``
from before the token's sequence start is read from a caller-given left context (``[N, C,
W-1]``, oldest first) or is zero. ``act`` is SiLU (as FLA's ``ShortConvolution(...,
activation="silu")``) or the identity.

Backends: CUDA tensors run the Triton kernels of ``kdakit/nn/short_conv_triton.py`` (fp16 / bf16 /
fp32; a float64 CUDA tensor raises ``TypeError``), unless ``KDAKIT_BACKEND=torch``; CPU tensors run
the PyTorch code here, the kernels' reference twin (float64 included). Both save only ``x`` (plus the
weight, bias and the small context) for backward and recompute the pre-activation there.

The PyTorch code: one ``F.conv1d(groups=C)`` over a buffer in which every sequence is preceded by
its ``W-1`` context columns, so no output reads across a ``cu_seqlens`` boundary. The padded buffer
and the pre-activation are transient and are rebuilt in backward under autograd. A version that
sums ``W`` shifted, masked copies of ``x`` under autograd would keep ``W-1`` T-sized copies alive
until backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kdakit.nn.short_conv_triton import short_conv_triton
from kdakit.ops.kda.backend import requested_backend

ACTIVATIONS = (None, "silu", "swish")


def _padded_conv(x, weight, bias, activation, cu_seqlens, context):
    """Forward computation (differentiable; the autograd function below runs it without a graph
    in forward and with one in backward)."""
    B, T, C = x.shape
    if T == 0:
        return x.new_zeros(B, 0, C)   # F.conv1d rejects inputs shorter than the kernel
    W = weight.shape[-1]
    w = weight.reshape(C, 1, W).to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    if context is not None:
        context = context.to(x.dtype)
    if cu_seqlens is None:
        # one sequence per batch row: its left context sits in front of it
        left = context if context is not None else x.new_zeros(B, C, W - 1)
        z = torch.cat([left, x.transpose(1, 2)], dim=2)                   # [B, C, W-1+T]
        y = F.conv1d(z, w, b, groups=C).transpose(1, 2)                   # [B, T, C]
    else:
        # packed (B = 1): sequence n occupies padded slots from cu[n] + n*(W-1): its W-1 context
        # columns, then its tokens. Output o of the valid conv reads slots o .. o+W-1, so token t
        # of sequence n (slot t + (n+1)(W-1)) is output t + n(W-1).
        N = cu_seqlens.numel() - 1
        cu = cu_seqlens.long()  # on x's device (checked): the indices below are built there, nothing is read
        seq_id = torch.repeat_interleave(torch.arange(N, device=x.device), cu[1:] - cu[:-1], output_size=T)
        out_idx = torch.arange(T, device=x.device) + seq_id * (W - 1)
        z = x.new_zeros(T + N * (W - 1), C)
        z[out_idx + (W - 1)] = x[0]
        if context is not None and W > 1:
            ctx_slot = (cu[:-1] + torch.arange(N, device=x.device) * (W - 1))[:, None] \
                + torch.arange(W - 1, device=x.device)
            z[ctx_slot.reshape(-1)] = context.transpose(1, 2).reshape(N * (W - 1), C)
        y = F.conv1d(z.T[None], w, b, groups=C)[0].T[out_idx][None]       # [1, T, C]
    if activation is not None:
        y = F.silu(y)
    return y.contiguous()


class _ShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, cu_seqlens, context):
        ctx.activation = activation
        ctx.save_for_backward(x, weight, bias, cu_seqlens, context)
        with torch.no_grad():
            return _padded_conv(x, weight, bias, activation, cu_seqlens, context)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens, context = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in zip((x, weight, bias), need)]
        wanted = [t for t, n in zip(leaves, need) if n]
        if not wanted or x.shape[1] == 0:
            # nothing asked, or no tokens: the output depends on no input
            out = [torch.zeros_like(t) if n else None for t, n in zip(leaves, need)]
            return out[0], out[1], out[2], None, None, None
        # recompute the (cheap) convolution with a graph instead of keeping its intermediates
        with torch.enable_grad():
            y = _padded_conv(leaves[0], leaves[1], leaves[2], ctx.activation, cu_seqlens, context)
            grads = iter(torch.autograd.grad(y, wanted, dy))
        out = [next(grads) if n else None for n in need]
        if out[0] is not None:
            # the padded buffer is channel-major, so autograd's dx is a [B, T, C] view with token stride 1
            # and channel stride W-1+T; the projection's backward GEMMs need the token-major layout
            # (cuBLAS takes slow unaligned kernels for a leading dimension of odd W-1+T)
            out[0] = out[0].contiguous()
        return out[0], out[1], out[2], None, None, None


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise convolution (see the module docstring), differentiable in x, weight, bias: the
    Triton kernels for CUDA tensors (unless ``KDAKIT_BACKEND=torch``), the PyTorch code for CPU tensors.

    Args:
        x: ``[B, T, C]``; with ``cu_seqlens`` B must be 1.
        weight: ``[C, 1, W]`` (``nn.Conv1d``'s depthwise layout) or ``[C, W]``.
        bias: ``[C]`` or None.
        activation: ``"silu"`` (or its alias ``"swish"``) or None.
        cu_seqlens: int ``[N + 1]`` offsets of packed sequences on x's device (values validated by the caller).
        context: ``[N, C, W-1]`` left context per sequence (N = B without ``cu_seqlens``),
            oldest first; not differentiated. None means zeros.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, T, C], got {list(x.shape)}")
    C = x.shape[-1]
    if weight.dim() not in (2, 3) or weight.shape[0] != C or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"weight must have shape [C, 1, W] or [C, W] with C={C}, got {list(weight.shape)}")
    W = weight.shape[-1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must have shape [C] = [{C}], got {list(bias.shape)}")
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"x must have batch size 1 with cu_seqlens, got B={x.shape[0]}")
    if cu_seqlens is not None and cu_seqlens.device != x.device:
        # the per-token indices are built from the offsets on x's device: no host copy, no read
        raise ValueError(f"cu_seqlens must be on x's device {x.device}, got {cu_seqlens.device}")
    if context is not None and tuple(context.shape) != (N, C, W - 1):
        raise ValueError(f"context must have shape [N, C, W-1] = [{N}, {C}, {W - 1}], got {list(context.shape)}")
    if x.device.type == "cuda" and requested_backend() != "torch":
        return short_conv_triton(x, weight, bias, activation, cu_seqlens, context)
    act = None if activation is None else "silu"
    return _ShortConvFn.apply(x, weight, bias, act, cu_seqlens, None if context is None else context.detach())


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution with an optional SiLU, parameter-compatible with FLA's
    ``ShortConvolution`` (an ``nn.Conv1d`` with ``weight [C, 1, W]`` and ``bias [C]``), so
    FLA state dicts load into it. Runs ``short_conv``; the recurrent conv cache lives in the
    KDA layer (``conv_state``), not here."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu",
                 device=None, dtype=None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        return short_conv(x, self.weight, self.bias, self.activation, cu_seqlens, context)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"


__all__ = ["ShortConvolution", "short_conv"]
