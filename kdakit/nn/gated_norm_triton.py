"""Triton kernels of the gated RMSNorm (``kdakit.nn.GatedRMSNorm`` on CUDA tensors).

Per row of D values (fp32 math; ``w`` the weight, ``s = sigmoid(gate)``)::

    rstd = 1 / sqrt(mean(x^2) + eps),  y = x * rstd,  out = y * w * s
    d_gate = d_out * y * w * s * (1 - s)
    d_w    = sum_rows d_out * y * s
    d_x    = rstd * (d_y - y * mean(d_y * y)),  d_y = d_out * w * s

For backward the forward saves its inputs x and gate and the per-row ``rstd`` (fp32): no fp32 copy of a
row-sized intermediate. d_w is reduced deterministically: each backward program sums its rows' terms into fp32
registers and writes one row of an ``[S, D]`` partial buffer, summed by ``torch.sum`` afterwards.

Layouts: x and gate ``[..., D]``, each viewable as ``[R, D]`` rows (a ``view``, no copy; ``ValueError``
otherwise) and read through that view's row and column strides; d_out the same, except that a gradient whose
layout has no row view (autograd picks it, not the caller) is copied once by ``reshape``. out and d_x come back
contiguous in x's shape and dtype, d_gate in gate's, rstd fp32 ``[R]``, d_w in the weight's dtype (unit stride
required). fp16 / bf16 / fp32 (float64 is the PyTorch path's: ``TypeError``), on one CUDA device (CPU tensors
only under ``TRITON_INTERPRET=1``). Limits: 1 <= D <= MAX_DIM (a row block is one register tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.validate import check_triton_dtypes

# Launch configs: [BLOCK_ROWS rows, next_power_of_2(D)] tiles.
FWD_BLOCK_ROWS = 16
FWD_NUM_WARPS = 4
BWD_BLOCK_ROWS = 16
BWD_NUM_WARPS = 4
# The backward grid holds S programs, each over a contiguous run of row blocks, with S about BWD_TARGET_PROGRAMS.
BWD_TARGET_PROGRAMS = 2048
MAX_DIM = 1024


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def gated_rmsnorm_fwd_kernel(
    x, gate, weight, out, rstd, R, D, eps,
    s_xr, s_xd, s_gr, s_gd,
    BR: tl.constexpr, BD: tl.constexpr,
):
    """Rows pid * BR ..: out (contiguous [R, D]) and rstd [R]."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)                                 # [BR]
    d = tl.arange(0, BD)                                                         # [BD]
    m_r = r < R
    m_d = d < D
    m = m_r[:, None] & m_d[None, :]                                              # [BR, BD]
    r64 = r.to(tl.int64)[:, None]
    xv = tl.load(x + r64 * s_xr + d[None, :] * s_xd, mask=m, other=0.0).to(tl.float32)     # [BR, BD]
    gv = tl.load(gate + r64 * s_gr + d[None, :] * s_gd, mask=m, other=0.0).to(tl.float32)  # [BR, BD]
    wv = tl.load(weight + d, mask=m_d, other=0.0).to(tl.float32)                            # [BD]
    rs = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)                        # [BR]
    o = xv * rs[:, None] * wv[None, :] * tl.sigmoid(gv)                          # [BR, BD]
    tl.store(out + r64 * D + d[None, :], o.to(out.dtype.element_ty), mask=m)
    tl.store(rstd + r, rs, mask=m_r)


@triton.jit
def gated_rmsnorm_bwd_kernel(
    x, gate, weight, rstd, d_out, dx, dg, dw_part, R, D, blocks_per_prog,
    s_xr, s_xd, s_gr, s_gd, s_or, s_od,
    BR: tl.constexpr, BD: tl.constexpr, NEED_DX: tl.constexpr, NEED_DG: tl.constexpr, NEED_DW: tl.constexpr,
):
    """Row blocks pid * blocks_per_prog .. (+ blocks_per_prog): dx, dg (contiguous [R, D]) of those rows and this
    program's row of the fp32 partial sums dw_part [S, D]."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)                                                         # [BD]
    m_d = d < D
    wv = tl.load(weight + d, mask=m_d, other=0.0).to(tl.float32)                 # [BD]
    dw_acc = tl.zeros([BD], dtype=tl.float32)                                    # [BD]
    i = 0
    while i < blocks_per_prog:  # a while loop: the interpreter cannot range() over a runtime scalar
        r = (pid * blocks_per_prog + i) * BR + tl.arange(0, BR)                  # [BR]
        i += 1
        m_r = r < R
        m = m_r[:, None] & m_d[None, :]                                          # [BR, BD]
        r64 = r.to(tl.int64)[:, None]
        xv = tl.load(x + r64 * s_xr + d[None, :] * s_xd, mask=m, other=0.0).to(tl.float32)      # [BR, BD]
        gv = tl.load(gate + r64 * s_gr + d[None, :] * s_gd, mask=m, other=0.0).to(tl.float32)   # [BR, BD]
        do = tl.load(d_out + r64 * s_or + d[None, :] * s_od, mask=m, other=0.0).to(tl.float32)  # [BR, BD]
        rs = tl.load(rstd + r, mask=m_r, other=0.0)                              # [BR]
        y = xv * rs[:, None]                                                     # [BR, BD]
        s = tl.sigmoid(gv)                                                       # [BR, BD]
        if NEED_DW:
            dw_acc += tl.sum(do * y * s, axis=0)
        if NEED_DG:
            g_grad = do * y * wv[None, :] * s * (1.0 - s)                        # [BR, BD]
            tl.store(dg + r64 * D + d[None, :], g_grad.to(dg.dtype.element_ty), mask=m)
        if NEED_DX:
            dy = do * wv[None, :] * s                                            # [BR, BD]
            c = tl.sum(dy * y, axis=1) / D                                       # [BR]
            x_grad = rs[:, None] * (dy - y * c[:, None])                         # [BR, BD]
            tl.store(dx + r64 * D + d[None, :], x_grad.to(dx.dtype.element_ty), mask=m)
    if NEED_DW:
        tl.store(dw_part + pid.to(tl.int64) * D + d, dw_acc, mask=m_d)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _rows(name: str, t: torch.Tensor, D: int) -> torch.Tensor:
    """t as an [R, D] view (no copy); ValueError naming it when its strides do not allow one."""
    try:
        return t.view(-1, D)
    except RuntimeError as e:
        raise ValueError(f"{name} must be viewable as [rows, {D}] (its leading dimensions mergeable without a "
                         f"copy), got shape {list(t.shape)} with strides {list(t.stride())}") from e


def gated_rmsnorm_fwd(x2: torch.Tensor, g2: torch.Tensor, weight: torch.Tensor, eps: float):
    """Launch the forward on [R, D] row views: (out contiguous [R, D] in x's dtype, rstd fp32 [R])."""
    R, D = x2.shape
    out = torch.empty(R, D, dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x2.device)
    if R == 0:
        return out, rstd
    gated_rmsnorm_fwd_kernel[(triton.cdiv(R, FWD_BLOCK_ROWS),)](
        x2, g2, weight, out, rstd, R, D, eps, *x2.stride(), *g2.stride(),
        BR=FWD_BLOCK_ROWS, BD=triton.next_power_of_2(D), num_warps=FWD_NUM_WARPS,
    )
    return out, rstd


def backward_splits(R: int) -> tuple[int, int]:
    """(S programs, row blocks per program) of the backward grid."""
    n_blocks = triton.cdiv(R, BWD_BLOCK_ROWS)
    per = triton.cdiv(n_blocks, min(n_blocks, BWD_TARGET_PROGRAMS))
    return triton.cdiv(n_blocks, per), per


def gated_rmsnorm_bwd(do2, x2, g2, weight, rstd, need=(True, True, True)):
    """Launch the backward on [R, D] row views: (dx [R, D] in x's dtype, dgate [R, D] in gate's dtype, dweight in
    weight's dtype), each None where ``need`` (x, gate, weight) says so."""
    R, D = x2.shape
    need_dx, need_dg, need_dw = need
    dx = torch.empty(R, D, dtype=x2.dtype, device=x2.device) if need_dx else None
    dg = torch.empty(R, D, dtype=g2.dtype, device=x2.device) if need_dg else None
    if R == 0:
        return dx, dg, torch.zeros_like(weight) if need_dw else None
    S, per = backward_splits(R)
    dw_part = torch.empty(S, D, dtype=torch.float32, device=x2.device) if need_dw else None
    gated_rmsnorm_bwd_kernel[(S,)](
        x2, g2, weight, rstd, do2, dx if need_dx else x2, dg if need_dg else x2, dw_part if need_dw else rstd,
        R, D, per, *x2.stride(), *g2.stride(), *do2.stride(),
        BR=BWD_BLOCK_ROWS, BD=triton.next_power_of_2(D), NEED_DX=need_dx, NEED_DG=need_dg, NEED_DW=need_dw,
        num_warps=BWD_NUM_WARPS,
    )
    return dx, dg, dw_part.sum(0).to(weight.dtype) if need_dw else None


# ---------------------------------------------------------------------------------------
# public function
# ---------------------------------------------------------------------------------------


class _TritonGatedRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        D = x.shape[-1]
        out, rstd = gated_rmsnorm_fwd(_rows("x", x, D), _rows("gate", gate, D), weight, eps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        x, gate, weight, rstd = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        if not any(need):
            return None, None, None, None
        D = x.shape[-1]
        check_triton_dtypes({"d_out": d_out})
        try:
            do2 = d_out.view(-1, D)
        except RuntimeError:
            do2 = d_out.reshape(-1, D)   # autograd chose a layout with no row view: the one copy (docstring)
        dx, dg, dw = gated_rmsnorm_bwd(do2, x.view(-1, D), gate.view(-1, D), weight, rstd, need)
        return (None if dx is None else dx.view(x.shape), None if dg is None else dg.view(gate.shape), dw, None)


def gated_rmsnorm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension on the Triton kernels (see the module
    docstring), differentiable in x, gate and weight. The output has x's dtype."""
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if x.dim() < 1 or x.shape != gate.shape:
        raise ValueError(f"x and gate must have one shape [..., D], got {list(x.shape)} and {list(gate.shape)}")
    D = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != D:
        raise ValueError(f"weight must have shape [D] = [{D}], got {list(weight.shape)}")
    if not 1 <= D <= MAX_DIM:
        raise ValueError(f"x: the Triton kernels take 1 <= D <= {MAX_DIM} (x.shape[-1]), got D={D}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    check_triton_dtypes({"x": x, "gate": gate, "weight": weight})
    if x.device.type != "cuda" and not (x.device.type == "cpu" and triton_interpreting()):
        raise ValueError(f"x must be a CUDA tensor for the Triton kernels (CPU tensors need TRITON_INTERPRET=1), "
                         f"got {x.device}")
    for name, t in (("gate", gate), ("weight", weight)):
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if weight.stride(0) != 1:
        raise ValueError(f"weight must have unit stride, got stride {weight.stride(0)}")
    _rows("x", x, D), _rows("gate", gate, D)   # raise here, before autograd, on a layout that has no row view
    return _TritonGatedRMSNormFn.apply(x, gate, weight, float(eps))


__all__ = ["gated_rmsnorm_triton", "gated_rmsnorm_fwd", "gated_rmsnorm_bwd", "MAX_DIM"]
