"""Triton kernels of the short causal depthwise convolution (``kdakit.nn.short_conv`` on CUDA tensors).

Forward, per token t of a sequence starting at token ``bos`` and channel c (fp32 math)::

    pre[t, c] = bias[c] + sum_{j < W} w[c, W-1-j] * src(t - j, c)
    y[t, c]   = silu(pre[t, c])   (or pre[t, c] without an activation)
    src(p, c) = x[p, c]                         p >= bos
              = context[n, c, W-1 + p - bos]    p < bos, with a context (oldest first)
              = 0                               p < bos, without one

Backward, with ``dpre = dy * silu'(pre)`` (``dy`` without an activation) and ``pre`` recomputed from x::

    dx[t, c]        = sum_{j < W, t + j < eos} w[c, W-1-j] * dpre[t + j, c]
    dw[c, W-1-j]    = sum_t dpre[t, c] * src(t - j, c)
    dbias[c]        = sum_t dpre[t, c]

The context is not differentiated. The forward reads W source tiles per [BT, BC] output tile; the backward reads
the 2W-1 source tiles src(t-W+1) .. src(t+W-1) and the W gradient tiles dy(t) .. dy(t+W-1) of each tile once,
recomputes pre at the W shifts from them, and accumulates the dw / dbias terms elementwise in fp32 registers
over its run of tiles. dw and dbias are reduced deterministically: each backward program writes one row of a
``[S, C, W]`` (and ``[S, C]``) partial buffer, whose S rows are summed by ``torch.sum`` afterwards (the
``[C, W]`` sum is the weight's own layout: no transposed copy).

Layouts: x, dy ``[B, T, C]`` read through their three strides (none required to be unit; a unit channel stride,
as the layer's Linear outputs have, gives vector loads); with ``cu_seqlens`` (int32 / int64 ``[N + 1]`` on x's
device) B = 1 and sequence n holds packed tokens ``cu[n] .. cu[n+1]``, located per token by a binary search
over ``cu_seqlens`` inside the kernels (no host read of the offsets). weight ``[C, 1, W]`` or ``[C, W]`` and
bias ``[C]``: any strides. The context ``[N, C, W-1]`` is read as ``[N, W-1, C]`` rows of channels, like x's
rows, so that a window reaching before a sequence start is one load per tap: ``context_rows`` gives that
layout as a view when the context's channel stride is 1 and as a transposed copy otherwise (N (W-1) C
elements; FLA's conv-state layout ``[N, C, W-1]`` has channel stride W-1), once per forward, kept for the
backward. y and dx come back contiguous ``[B, T, C]`` in x's dtype, dweight / dbias in their parameters'
dtypes. Tensors fp16 / bf16 / fp32 (float64 is the PyTorch path's: ``TypeError``), on one CUDA device (CPU
tensors only under ``TRITON_INTERPRET=1``).

Limits: 1 <= W <= MAX_WIDTH (the taps are unrolled and the backward holds 2W-1 source tiles in registers; the
sm_90a build test checks W = 4). The backward saves x, the weight, the bias and the context rows only; the
pre-activation is recomputed (nothing T-sized is kept).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.validate import check_triton_dtypes

# Launch configs: [BLOCK_T tokens, BLOCK_C channels] tiles.
FWD_BLOCK_T = 32
FWD_BLOCK_C = 128
FWD_NUM_WARPS = 4
BWD_BLOCK_T = 16
BWD_BLOCK_C = 64
BWD_NUM_WARPS = 4
# The backward grid is [channel blocks, S]: S programs per channel block, each summing a contiguous run of
# token tiles into its dw / dbias partial row; S is chosen so the grid holds about BWD_TARGET_PROGRAMS programs.
BWD_TARGET_PROGRAMS = 2048
MAX_WIDTH = 8
MAX_BATCH = 65535   # the forward grid's third dimension
ACTIVATIONS = (None, "silu", "swish")


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _sequence_of(cu_seqlens, t, n_seqs, STEPS: tl.constexpr):
    """Per token index t ([BT] int32): the sequence n holding it (the last n < n_seqs with cu[n] <= t, so
    zero-length sequences are skipped), its start cu[n] and end cu[n+1]. A binary search of STEPS >=
    bit_length(n_seqs) unrolled steps (steps after convergence change nothing)."""
    lo = tl.zeros_like(t)                                     # [BT]
    hi = tl.zeros_like(t) + (n_seqs - 1)                      # [BT]
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_seqlens + mid).to(tl.int32) <= t     # mid in [0, n_seqs): always a valid entry
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    bos = tl.load(cu_seqlens + lo).to(tl.int32)              # [BT]
    eos = tl.load(cu_seqlens + lo + 1).to(tl.int32)          # [BT]
    return lo, bos, eos


@triton.jit
def _src(x_row, context, p, bos, seq, c, m_t, m_c, T, s_xt, s_xc, s_ctx_n, s_ctx_w, s_ctx_c,
         W: tl.constexpr, CTX: tl.constexpr):
    """src(p, c) of the module docstring as fp32 ``[BT, BC]`` for tokens valid where m_t (0 elsewhere). ``x_row``:
    x at the batch row (int64 offset applied); p, bos, seq: [BT]; c: [BC]. One load: each row's pointer is x's
    row p or (with CTX) the context's row (seq, W-1 + p - bos) of its [N, W-1, C] layout, both read along the
    channels."""
    c64 = c.to(tl.int64)[None, :]                                                # [1, BC]
    ptr = x_row + p.to(tl.int64)[:, None] * s_xt + c64 * s_xc                    # [BT, BC]
    m = (m_t & (p < T))[:, None] & m_c[None, :]                                  # [BT, BC]
    if CTX:
        row = seq.to(tl.int64) * s_ctx_n + ((W - 1) + p - bos).to(tl.int64) * s_ctx_w   # [BT]
        ptr = tl.where((p >= bos)[:, None], ptr, context + row[:, None] + c64 * s_ctx_c)
    else:
        m = m & (p >= bos)[:, None]
    return tl.load(ptr, mask=m, other=0.0).to(tl.float32)                        # [BT, BC]


@triton.jit
def _tap(weight, c, m_c, k, s_wc, s_ww):
    """w[c, k] as fp32 ``[BC]``."""
    return tl.load(weight + c.to(tl.int64) * s_wc + k * s_ww, mask=m_c, other=0.0).to(tl.float32)


@triton.jit
def short_conv_fwd_kernel(
    x, weight, bias, context, cu_seqlens, y,
    T, C, n_seqs,
    s_xb, s_xt, s_xc, s_wc, s_ww, s_ctx_n, s_ctx_w, s_ctx_c,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONTEXT: tl.constexpr,
    SILU: tl.constexpr, IS_VARLEN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """One [BT, BC] tile of y: tokens pid0 * BT.., channels pid1 * BC.., batch row pid2. y contiguous [B, T, C]."""
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)                                 # [BT]
    c = tl.program_id(1) * BC + tl.arange(0, BC)                                 # [BC]
    m_t = t < T
    m_c = c < C
    if IS_VARLEN:
        seq, bos, _ = _sequence_of(cu_seqlens, tl.minimum(t, T - 1), n_seqs, SEARCH_STEPS)
    else:
        seq = tl.zeros_like(t) + tl.program_id(2)
        bos = tl.zeros_like(t)
    x_row = x + b * s_xb
    acc = tl.zeros([BT, BC], dtype=tl.float32)                                   # [BT, BC]
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        acc += _tap(weight, c, m_c, W - 1 - j, s_wc, s_ww)[None, :] * _src(
            x_row, context, t - j, bos, seq, c, m_t, m_c, T, s_xt, s_xc, s_ctx_n, s_ctx_w, s_ctx_c, W, HAS_CONTEXT)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    y_ptr = y + b * T * C + t.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(y_ptr, acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def short_conv_bwd_kernel(
    x, weight, bias, context, cu_seqlens, dy, dx, dw_part, db_part,
    T, C, n_seqs, tiles_per_row, n_tiles, tiles_per_prog,
    s_xb, s_xt, s_xc, s_wc, s_ww, s_ctx_n, s_ctx_w, s_ctx_c, s_dyb, s_dyt, s_dyc,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, SILU: tl.constexpr, IS_VARLEN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
):
    """Channels pid0 * BC.., token tiles pid1 * tiles_per_prog .. (+ tiles_per_prog) of the flattened
    [B, tiles_per_row] tile list: dx of those tiles (contiguous [B, T, C]) and this program's row of the
    fp32 partial sums dw_part [S, C, W] (tap index k = W-1-j) and db_part [S, C].

    Per tile, the 2W-1 source tiles src(t + d), d = -(W-1) .. W-1, are read once (a tuple ``xs``, entry d + W-1)
    and serve pre at every shift and the dw terms; dw / dbias terms are summed elementwise over the tiles
    (tuple ``dws``, entry j) and reduced over tokens once, at the end."""
    pid_s = tl.program_id(1)
    c = tl.program_id(0) * BC + tl.arange(0, BC)                                 # [BC]
    m_c = c < C
    if HAS_BIAS:
        bv = tl.load(bias + c, mask=m_c, other=0.0).to(tl.float32)               # [BC]
    dws = (tl.zeros([BT, BC], dtype=tl.float32),) * W                            # W x [BT, BC]
    db_acc = tl.zeros([BT, BC], dtype=tl.float32)                                # [BT, BC]
    i = 0
    while i < tiles_per_prog:  # a while loop: the interpreter cannot range() over a runtime scalar
        tile = pid_s * tiles_per_prog + i
        i += 1
        b = tile // tiles_per_row
        t = (tile % tiles_per_row) * BT + tl.arange(0, BT)                       # [BT]
        m_t = (t < T) & (tile < n_tiles)
        if IS_VARLEN:
            seq, bos, eos = _sequence_of(cu_seqlens, tl.minimum(t, T - 1), n_seqs, SEARCH_STEPS)
        else:
            seq = tl.zeros_like(t) + b
            bos = tl.zeros_like(t)
            eos = tl.zeros_like(t) + T
        x_row = x + b.to(tl.int64) * s_xb
        dy_row = dy + b.to(tl.int64) * s_dyb
        xs = ()
        for e in tl.static_range(2 * W - 1 if SILU else W):
            xs = xs + (_src(x_row, context, t + (e - (W - 1)), bos, seq, c, m_t, m_c, T, s_xt, s_xc,
                            s_ctx_n, s_ctx_w, s_ctx_c, W, HAS_CONTEXT and e < W - 1),)  # src(t + d) [BT, BC]
        dx_acc = tl.zeros([BT, BC], dtype=tl.float32)                            # [BT, BC]
        for s in tl.static_range(W):
            # dpre at tokens u = t + s of the same sequence, from pre recomputed there
            u = t + s                                                            # [BT]
            m_u = m_t & (u < eos)                                                # [BT]
            g = tl.load(dy_row + u.to(tl.int64)[:, None] * s_dyt + c.to(tl.int64)[None, :] * s_dyc,
                        mask=m_u[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BT, BC]
            if SILU:
                pre = tl.zeros([BT, BC], dtype=tl.float32)                       # [BT, BC]
                if HAS_BIAS:
                    pre += bv[None, :]
                for j in tl.static_range(W):
                    pre += _tap(weight, c, m_c, W - 1 - j, s_wc, s_ww)[None, :] * xs[s - j + W - 1]
                sg = tl.sigmoid(pre)
                g = g * sg * (1.0 + pre * (1.0 - sg))                            # dpre [BT, BC]
            if NEED_DX:
                dx_acc += _tap(weight, c, m_c, W - 1 - s, s_wc, s_ww)[None, :] * g
            if s == 0:
                if NEED_DB:
                    db_acc += g
                if NEED_DW:
                    for j in tl.static_range(W):
                        dws = dws[:j] + (dws[j] + g * xs[W - 1 - j],) + dws[j + 1:]
        if NEED_DX:
            dx_ptr = dx + b.to(tl.int64) * T * C + t.to(tl.int64)[:, None] * C + c[None, :]
            tl.store(dx_ptr, dx_acc.to(dx.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if NEED_DW:
        for j in tl.static_range(W):
            p = dw_part + pid_s.to(tl.int64) * C * W + c.to(tl.int64) * W + (W - 1 - j)
            tl.store(p, tl.sum(dws[j], axis=0), mask=m_c)
    if NEED_DB:
        tl.store(db_part + pid_s.to(tl.int64) * C + c, tl.sum(db_acc, axis=0), mask=m_c)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------


def _weight_strides(weight: torch.Tensor) -> tuple[int, int]:
    return weight.stride(0), weight.stride(-1)


def _context_strides(ctx_rows) -> tuple[int, int, int]:
    return (0, 0, 0) if ctx_rows is None else tuple(ctx_rows.stride())


def context_rows(context):
    """The context ``[N, C, W-1]`` as ``[N, W-1, C]`` with unit channel stride, the layout the kernels read (one
    row of channels per context token, like x's rows): the transposed view when its channel stride is 1, else
    a transposed copy (N (W-1) C elements; FLA's conv-state layout has channel stride W-1). None stays None."""
    if context is None:
        return None
    rows = context.transpose(1, 2)
    return rows if rows.stride(2) == 1 or rows.shape[2] <= 1 else rows.contiguous()


def _search_steps(cu_seqlens) -> tuple[int, int]:
    """(N, unrolled binary-search steps covering N sequences), from the shape alone; (1, 0) without offsets.
    The steps are rounded up to a power of two (0, 1, 2, 4, 8, 16, 32), so at most seven kernel variants are
    compiled whatever the sequence counts."""
    if cu_seqlens is None:
        return 1, 0
    n = cu_seqlens.numel() - 1
    bits = (max(n, 1) - 1).bit_length()   # steps to narrow [0, n - 1] to one index
    return n, 0 if bits == 0 else triton.next_power_of_2(bits)


def short_conv_fwd(x, weight, bias, ctx_rows, cu_seqlens, activation) -> torch.Tensor:
    """Launch the forward: y contiguous ``[B, T, C]`` in x's dtype. Arguments as ``short_conv_triton``, checked,
    with the context given as ``context_rows(context)``."""
    B, T, C = x.shape
    W = weight.shape[-1]
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    if T == 0 or C == 0 or B == 0:
        return y
    n_seqs, steps = _search_steps(cu_seqlens)
    has_ctx = ctx_rows is not None and W > 1
    grid = (triton.cdiv(T, FWD_BLOCK_T), triton.cdiv(C, FWD_BLOCK_C), B)
    short_conv_fwd_kernel[grid](
        x, weight, bias if bias is not None else weight, ctx_rows if has_ctx else x,
        cu_seqlens if cu_seqlens is not None else x, y,
        T, C, n_seqs,
        *x.stride(), *_weight_strides(weight), *_context_strides(ctx_rows if has_ctx else None),
        W=W, BT=FWD_BLOCK_T, BC=FWD_BLOCK_C, HAS_BIAS=bias is not None, HAS_CONTEXT=has_ctx,
        SILU=activation is not None, IS_VARLEN=cu_seqlens is not None, SEARCH_STEPS=steps,
        num_warps=FWD_NUM_WARPS,
    )
    return y


def backward_splits(B: int, T: int, C: int) -> tuple[int, int]:
    """(S programs per channel block, token tiles per program) of the backward grid."""
    n_tiles = B * triton.cdiv(T, BWD_BLOCK_T)
    want = max(1, triton.cdiv(BWD_TARGET_PROGRAMS, triton.cdiv(C, BWD_BLOCK_C)))
    per = triton.cdiv(n_tiles, min(n_tiles, want))
    return triton.cdiv(n_tiles, per), per


def short_conv_bwd(dy, x, weight, bias, ctx_rows, cu_seqlens, activation, need=(True, True, True)):
    """Launch the backward: (dx, dweight, dbias), each None where ``need`` (x, weight, bias) says so (dbias also
    without a bias). dx contiguous in x's dtype; dweight in weight's shape and dtype; dbias in bias's dtype.
    The context is given as ``context_rows(context)``."""
    B, T, C = x.shape
    W = weight.shape[-1]
    need_dx, need_dw, need_db = need[0], need[1], need[2] and bias is not None
    if T == 0 or B == 0 or C == 0:
        return (torch.zeros_like(x) if need_dx else None, torch.zeros_like(weight) if need_dw else None,
                torch.zeros_like(bias) if need_db else None)
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {list(x.shape)}, got {list(dy.shape)}")
    check_triton_dtypes({"dy": dy})
    n_seqs, steps = _search_steps(cu_seqlens)
    has_ctx = ctx_rows is not None and W > 1
    S, per = backward_splits(B, T, C)
    tiles_per_row = triton.cdiv(T, BWD_BLOCK_T)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device) if need_dx else None
    dw_part = torch.empty(S, C, W, dtype=torch.float32, device=x.device) if need_dw else None
    db_part = torch.empty(S, C, dtype=torch.float32, device=x.device) if need_db else None
    short_conv_bwd_kernel[(triton.cdiv(C, BWD_BLOCK_C), S)](
        x, weight, bias if bias is not None else weight, ctx_rows if has_ctx else x,
        cu_seqlens if cu_seqlens is not None else x, dy,
        dx if need_dx else x, dw_part if need_dw else x, db_part if need_db else x,
        T, C, n_seqs, tiles_per_row, B * tiles_per_row, per,
        *x.stride(), *_weight_strides(weight), *_context_strides(ctx_rows if has_ctx else None), *dy.stride(),
        W=W, BT=BWD_BLOCK_T, BC=BWD_BLOCK_C, HAS_BIAS=bias is not None,
        HAS_CONTEXT=has_ctx, SILU=activation is not None, IS_VARLEN=cu_seqlens is not None, SEARCH_STEPS=steps,
        NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db, num_warps=BWD_NUM_WARPS,
    )
    dw = dw_part.sum(0).view(weight.shape).to(weight.dtype) if need_dw else None   # [C, W] -> weight's
    db = db_part.sum(0).to(bias.dtype) if need_db else None
    return dx, dw, db


# ---------------------------------------------------------------------------------------
# public function
# ---------------------------------------------------------------------------------------


class _TritonShortConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, cu_seqlens, context):
        ctx.activation = activation
        rows = context_rows(context)
        ctx.save_for_backward(x, weight, bias, cu_seqlens, rows)
        return short_conv_fwd(x, weight, bias, rows, cu_seqlens, activation)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens, rows = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if not any(need):
            return None, None, None, None, None, None
        dx, dw, db = short_conv_bwd(dy, x, weight, bias, rows, cu_seqlens, ctx.activation, need)
        return dx, dw, db, None, None, None


def _check_device(name: str, t, device: torch.device) -> None:
    if t is not None and t.device != device:
        raise ValueError(f"{name} must be on x's device {device}, got {t.device}")


def short_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """The short convolution on the Triton kernels (see the module docstring), differentiable in x, weight
    and bias. Arguments as ``kdakit.nn.short_conv``; the offsets' values are not read (the caller checks them)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("context", context), ("cu_seqlens", cu_seqlens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name != 'x' and name != 'weight' else ''}, "
                            f"got {type(t).__name__}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("context", context)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, T, C], got {list(x.shape)}")
    B, T, C = x.shape
    if weight.dim() not in (2, 3) or weight.shape[0] != C or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"weight must have shape [C, 1, W] or [C, W] with C={C}, got {list(weight.shape)}")
    W = weight.shape[-1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"weight: the Triton kernels take widths 1 <= W <= {MAX_WIDTH}, got W={W}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must have shape [C] = [{C}], got {list(bias.shape)}")
    if cu_seqlens is not None:
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise TypeError(f"cu_seqlens must be a 1-D int32 or int64 tensor of at least 2 entries, got "
                            f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"x must have batch size 1 with cu_seqlens, got B={B}")
    if B > MAX_BATCH:
        raise ValueError(f"x: the Triton forward's grid takes batch sizes up to {MAX_BATCH}, got B={B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if context is not None and tuple(context.shape) != (N, C, W - 1):
        raise ValueError(f"context must have shape [N, C, W-1] = [{N}, {C}, {W - 1}], got {list(context.shape)}")
    check_triton_dtypes({"x": x, "weight": weight, "bias": bias, "context": context})
    if x.device.type != "cuda" and not (x.device.type == "cpu" and triton_interpreting()):
        raise ValueError(f"x must be a CUDA tensor for the Triton kernels (CPU tensors need TRITON_INTERPRET=1), "
                         f"got {x.device}")
    for name, t in (("weight", weight), ("bias", bias), ("context", context), ("cu_seqlens", cu_seqlens)):
        _check_device(name, t, x.device)
    act = None if activation is None else "silu"
    return _TritonShortConvFn.apply(x, weight, bias, act, cu_seqlens, None if context is None else context.detach())


__all__ = ["short_conv_triton", "short_conv_fwd", "short_conv_bwd", "MAX_WIDTH"]
