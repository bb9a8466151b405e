"""``GatedRMSNorm``: ``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension, the KDA
layer's output norm (FLA's ``FusedRMSNormGated(activation="sigmoid")``; its state dict holds
``weight`` only).

Memory: written as plain PyTorch ops under autograd, the fp32 computation would keep four
fp32 copies of the input's size (x, the normalized x, its product with the weight, the sigmoid)
until backward: 16 bytes per element against the 4 of a bf16 x and gate. The autograd function
here saves only x, gate (the inputs, in their dtype) and the per-row ``rstd`` (fp32), and works
in blocks of ``BLOCK_ROWS`` rows in both directions, so its fp32 temporaries stay a few MiB
whatever the sequence length, as FLA's fused kernel. The math (fp32, float64 for float64)::

    y = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps),  s = sigmoid(gate),  out = y * w * s
    d_gate = d_out * y * w * s * (1 - s)
    d_w    = sum_rows d_out * y * s
    d_x    = rstd * (d_y - y * mean(d_y * y)),  d_y = d_out * w * s

Backends: CUDA tensors run the Triton kernels of ``kdakit/nn/gated_norm_triton.py`` (fp16 / bf16 /
fp32; a float64 CUDA tensor raises ``TypeError``), unless ``KDAKIT_BACKEND=torch``; CPU tensors run
the PyTorch code here, the kernels' reference twin (float64 included). Both save x, gate and rstd.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kdakit.nn.gated_norm_triton import gated_rmsnorm_triton
from kdakit.ops.kda.backend import requested_backend

# Rows (vectors of the normalized dimension) per block: 64K rows of 128 fp32 values are 32 MiB
# per temporary.
BLOCK_ROWS = 1 << 16


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _GatedRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        dt = _compute_dtype(x)
        D = x.shape[-1]
        x2, g2 = x.reshape(-1, D), gate.reshape(-1, D)      # views for the dense outputs of the layer
        out = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=dt, device=x.device)
        w = weight.to(dt)
        for i in range(0, x2.shape[0], BLOCK_ROWS):
            xb = x2[i:i + BLOCK_ROWS].to(dt)
            r = torch.rsqrt(xb.pow(2).mean(-1) + eps)
            rstd[i:i + BLOCK_ROWS] = r
            out[i:i + BLOCK_ROWS] = (xb * r[:, None] * w * torch.sigmoid(g2[i:i + BLOCK_ROWS].to(dt))).to(x.dtype)
        ctx.save_for_backward(x, gate, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        x, gate, weight, rstd = ctx.saved_tensors
        dt = _compute_dtype(x)
        D = x.shape[-1]
        x2, g2, do2 = x.reshape(-1, D), gate.reshape(-1, D), d_out.reshape(-1, D)
        need_x, need_g, need_w = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x2) if need_x else None
        dg = torch.empty_like(g2) if need_g else None
        dw = torch.zeros(D, dtype=dt, device=x.device)
        w = weight.to(dt)
        for i in range(0, x2.shape[0], BLOCK_ROWS):
            sl = slice(i, i + BLOCK_ROWS)
            r = rstd[sl][:, None]
            y = x2[sl].to(dt) * r
            s = torch.sigmoid(g2[sl].to(dt))
            do = do2[sl].to(dt)
            if need_w:
                dw += (do * y * s).sum(0)
            if need_g:
                dg[sl] = (do * y * w * s * (1 - s)).to(dg.dtype)
            if need_x:
                dy = do * w * s
                dx[sl] = (r * (dy - y * (dy * y).mean(-1, keepdim=True))).to(dx.dtype)
        return (None if dx is None else dx.view(x.shape), None if dg is None else dg.view(gate.shape),
                dw.to(weight.dtype) if need_w else None, None)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension in fp32 (float64 for
    float64 inputs on the PyTorch path); the output has x's dtype. The Triton kernels run for
    CUDA tensors (unless ``KDAKIT_BACKEND=torch``). See the module docstring for its memory."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.shape != gate.shape or x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"x and gate must have one shape [..., {self.weight.shape[0]}], got "
                             f"{list(x.shape)} and {list(gate.shape)}")
        if gate.dtype != x.dtype:
            gate = gate.to(x.dtype)   # under autocast the two projections may differ; the output has x's dtype
        if x.device.type == "cuda" and requested_backend() != "torch":
            return gated_rmsnorm_triton(x, gate, self.weight, self.eps)
        return _GatedRMSNormFn.apply(x, gate, self.weight, self.eps)


__all__ = ["GatedRMSNorm"]
