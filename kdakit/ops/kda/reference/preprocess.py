"""Token-wise activations applied before the KDA recurrence, in PyTorch.

These are the "in-kernel" transforms of docs/spec.md §2.3, written once and shared by the
naive recurrence, the chunked reference and the tests:

* ``l2norm(x) = x / sqrt(sum(x^2) + 1e-6)`` over the last dimension;
* the gate: ``-exp(A_log[h]) * softplus(g + dt_bias[h])`` or, with a lower bound,
  ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (``exp(A_log) = 1``
  when ``A_log`` is None);
* beta: ``sigmoid(beta)`` (times 2 with ``allow_neg_eigval``).

All functions are differentiable and compute in the dtype they are given; callers
upcast first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdakit.ops.kda.constants import L2NORM_EPS, LOG_DECAY_FLOOR, SOFTPLUS_THRESHOLD


def floor_log_decay(a: torch.Tensor) -> torch.Tensor:
    """``max(a, LOG_DECAY_FLOOR)`` as the Triton kernels take it: a NaN stays NaN (a NaN-propagating max), and the
    gradient is 0 where the floor holds (``a <= LOG_DECAY_FLOOR``), 1 elsewhere. A where, not clamp: clamp's
    gradient at a NaN is 0, and a NaN's gradient must stay NaN."""
    return torch.where(a <= LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, a)


def l2norm_rstd(x: torch.Tensor) -> torch.Tensor:
    """The l2norm's scale ``1 / sqrt(sum(x^2) + 1e-6)`` over the last dimension (kept, size 1), in the form of
    the kernels' ``chunk_common.l2norm_rstd``; l2norm and its backward (chunk_bwd_reference) both use it."""
    return 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Normalize the last dimension: ``x / sqrt(sum(x^2) + 1e-6)``."""
    return x * l2norm_rstd(x)


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """Per-channel log-decay from the raw gate ``g`` of shape ``[..., HV, K]``.

    ``A_log`` is ``[HV]``; ``dt_bias`` is ``[HV * K]``. Returns a tensor of ``g``'s
    shape and dtype (the caller chooses the compute dtype).
    """
    HV, K = g.shape[-2], g.shape[-1]
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(g.dtype).view(HV, K)
    if lower_bound is None:
        return -torch.exp(A_log.to(g.dtype)).view(HV, 1) * F.softplus(x, threshold=SOFTPLUS_THRESHOLD)
    if A_log is not None:
        x = torch.exp(A_log.to(g.dtype)).view(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


def kda_beta(beta: torch.Tensor, use_sigmoid: bool, allow_neg_eigval: bool) -> torch.Tensor:
    """``sigmoid(beta)`` (``2 * sigmoid(beta)`` with ``allow_neg_eigval``) or ``beta`` itself."""
    if not use_sigmoid:
        return beta
    b = torch.sigmoid(beta)
    return 2.0 * b if allow_neg_eigval else b


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any floating input is float64, else float32 (docs/spec.md §2.7: fp32 math)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32
