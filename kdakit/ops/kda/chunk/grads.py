"""The backward's per-chunk products with the state (docs/chunk_pipeline.md, "Backward", item 4): ``grads_wy``.

Per chunk (table row i) and value head hv, with S = ``h`` (state entering the chunk, ``[K, V]``), dS_next =
``dh`` (state gradient leaving it), V' = ``u``, dV' = ``dvs``, G = ``gc`` (g_C = G[L-1]), β = ``bt``,
k̂ = rk k, Yh = k̂ ⊙ exp(G), Y = diag(β) Yh, Z = diag(β) v::

    dqg = scale dO S^T           dqh = dqg ⊙ exp(G)                                        [C, K]
    dkd = V' dS_next^T           dW = -dV' S^T     dY = Tinv^T dW     dZ = Tinv^T dV'
    dkh = dkd ⊙ exp(g_C - G) + β exp(G) ⊙ dY                                               [C, K]
    dgs = dqg ⊙ qg + β dY ⊙ Yh - dkd ⊙ kd                                                  [C, K]
    dgc = Σ_r dkd ⊙ kd + exp(g_C) ⊙ Σ_v S ⊙ dS_next                                        [K]
    dv  = β ⊙ dZ   (token rows, the input dtype: the final value gradient)
    dbs = Σ_v dZ ⊙ v + Σ_c dY ⊙ Yh                                                         [C]
    dT  = dW Y^T + dV' Z^T       dakk = -(Tinv^T dT Tinv^T), strictly lower                 [C, C]

(dakk is the gradient w.r.t. A = diag(β) Akk; grads_intra adds the pairwise terms to dqh, dkh, dgs, dbs.) Every
slot output is written with '=' on all C rows (zeros on padded rows: every slot row r >= L is masked to 0 on
load, so the slots' padded rows may hold anything). dv is stored on the chunk's L rows only.

Two kernels, so that neither holds dT and three ``[C, BK]`` accumulators at once:

* ``chunk_grads_wy_kernel``, grid ``(n * HV * cdiv(K, BK),)``: one key block; dqg, dkd, dW accumulated over V
  blocks, then dY = Tinv^T dW and the stores of dqh, dkh, dgs, dgc.
* ``chunk_grads_wy_dv_kernel``, grid ``(n, HV)``: the sums over all of K, through R = v - Yh S ``[C, V]``
  (dW Y^T = -dV' (Yh S)^T diag(β), dV' Z^T = dV' v^T diag(β))::

      N = dV' R^T     dT = N diag(β)     dbs_r = Σ_i Tinv_ir N_ir     dv = β Tinv^T dV'

  (dbs: Σ_v dZ ⊙ v + Σ_c dY ⊙ Yh = diag(Tinv^T dV' (v - Yh S)^T)), then the sandwich for dakk.

Products (chunk_bwd_common.grad_operands): bf16 inputs take bf16 operands rounded to nearest with fp32
accumulation (emulated by rounding fp32 tiles under the interpreter), fp16 and fp32 inputs fp32 operands at 3xTF32
("ieee" under the interpreter).

Layouts: k ``[B, T, H, K]``; v, do, dv ``[B, T, HV, V]`` and tinv ``[B, T, HV, C]`` (token layout: row r of a
chunk's Tinv at its token t0 + r, rows < L) through their strides (unit last stride); slots
contiguous, indexed by the program's table row (``[n, HV, C, K]`` etc.; ``rk`` ``[n, H, C]``). K, V <= 128
(any size: blocks are masked). Offsets that scale with T or the window are int64. q, rq and w belong to the
stage's signature but are not read: dq̂'s state term needs exp(G) only, and Y is formed from k (validated only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk.tiles import (
    CHUNK,
    check_pairs,
    check_token_strides,
    chunk_row,
    launch_values,
    load_tile,
    store_tile,
    token_base,
)
from kdakit.ops.kda.chunk_bwd_common import GRAD_OP_FP32, grad_operand, grad_operands
from kdakit.ops.kda.chunk_common import block_size
from kdakit.ops.kda.constants import CHUNK_MAX_HEAD_DIM
from kdakit.ops.kda.options import KDAOptions

# ---------------------------------------------------------------------------------------
# launch config
# ---------------------------------------------------------------------------------------

# (BK, BV) of each kernel by operand kind: bf16 operands (bf16 inputs) or fp32 operands at 3xTF32 (fp16, fp32
# inputs), whose split halves need more registers; 4 warps each (sm_90a, K = V = 128: no spills, <= 255 registers)
GRADS_WY_NUM_WARPS = 4
GRADS_WY_NUM_STAGES = 3
GRADS_WY_DV_STAGES = {"bf16": 2, "fp32": 1}  # chunk_grads_wy_dv_kernel (fp32 operands spill at 2 stages)
GRADS_WY_BLOCKS = {"bf16": (32, 32), "fp32": (32, 32)}  # chunk_grads_wy_kernel: a program's key block, V step
# (bf16 at (32, 64) and 4 warps built without spills but faulted on sm_90a: out-of-range shared address)
GRADS_WY_DV_BLOCKS = {"bf16": (64, 128), "fp32": (64, 32)}  # chunk_grads_wy_dv_kernel: inner K step, V step
# the constants above that a tuning run may override by name (``chunk.launch.Launch``, ``tiles.launch_values``)
LAUNCH_CONSTANTS = ("GRADS_WY_NUM_WARPS", "GRADS_WY_NUM_STAGES", "GRADS_WY_DV_STAGES", "GRADS_WY_BLOCKS",
                    "GRADS_WY_DV_BLOCKS")


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _mm(a, b, GRAD_OP: tl.constexpr, GRAD_PREC: tl.constexpr):
    """``a @ b`` with grad_operand operands, fp32 accumulation."""
    return tl.dot(grad_operand(a, GRAD_OP), grad_operand(b, GRAD_OP), input_precision=GRAD_PREC)


@triton.jit
def chunk_grads_wy_kernel(
    table, k, do, gc, bt, rk, tinv, qg, kd, u, dvs, h, dh, dqh, dkh, dgs, dgc,
    s_kb, s_kt, s_kh, s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, scale, H, HV,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GRAD_OP: tl.constexpr, GRAD_PREC: tl.constexpr,
):
    """Grid ``(n * HV * cdiv(K, BK),)``, key blocks fastest (the programs of one (row, head) run together and share
    their dO, V', dV' tiles in L2): key block k0 of table row i, value head hv: dqh, dkh, dgs, dgc."""
    NK: tl.constexpr = (K + BK - 1) // BK
    pid = tl.program_id(0)
    k0 = (pid % NK) * BK
    i = pid // NK // HV
    hv = pid // NK % HV
    _, b, t0, L = chunk_row(table, i)
    hk = hv // (HV // H)
    slot = i.to(tl.int64) * HV + hv  # (i, hv) in the [n, HV, ...] slots
    do_base = token_base(do, b, t0, hv, s_ob, s_ot, s_oh)
    u_base = u + slot * (C * V)
    dvs_base = dvs + slot * (C * V)
    h_base = h + slot * (K * V) + k0 * V
    dh_base = dh + slot * (K * V) + k0 * V

    # ---- dqg = dO S^T, dkd = V' dS_next^T, -dW = dV' S^T over the V blocks
    dqg = tl.zeros([C, BK], dtype=tl.float32)
    dkd = tl.zeros([C, BK], dtype=tl.float32)
    mdW = tl.zeros([C, BK], dtype=tl.float32)  # -dW
    sds = tl.zeros([BK], dtype=tl.float32)  # Σ_v S ⊙ dS_next
    for v0 in range(0, V, BV):
        s = load_tile(h_base, K - k0, V, v0, V, BK, BV)  # [BK, BV]
        ds = load_tile(dh_base, K - k0, V, v0, V, BK, BV)  # [BK, BV]
        sds += tl.sum(s.to(tl.float32) * ds.to(tl.float32), axis=1)
        st = tl.trans(s)  # [BV, BK]
        dqg += _mm(load_tile(do_base, L, s_ot, v0, V, C, BV), st, GRAD_OP, GRAD_PREC)
        dkd += _mm(load_tile(u_base, L, V, v0, V, C, BV), tl.trans(ds), GRAD_OP, GRAD_PREC)
        mdW += _mm(load_tile(dvs_base, L, V, v0, V, C, BV), st, GRAD_OP, GRAD_PREC)

    # ---- epilogue, ordered so that each accumulator dies early; slot tiles: all C rows (0 on padded rows)
    rows = tl.arange(0, C)
    beta = tl.load(bt + slot * C + rows, mask=rows < L, other=0.0)  # [C]
    cols = k0 + tl.arange(0, BK)
    cmask = cols < K
    gc_base = gc + slot * (C * K)
    G = load_tile(gc_base, L, K, k0, K, C, BK)  # [C, BK] fp32
    gC = tl.load(gc_base + (L - 1) * K + cols, mask=cmask, other=0.0)  # [BK] g_C
    eG = tl.exp(G)
    dqg = dqg * scale
    store_tile(dqh + slot * (C * K), dqg * eG, C, K, k0, K, C, BK)
    dg = dqg * load_tile(qg + slot * (C * K), L, K, k0, K, C, BK).to(tl.float32)  # [C, BK]
    dkdkd = dkd * load_tile(kd + slot * (C * K), L, K, k0, K, C, BK).to(tl.float32)  # [C, BK]
    tl.store(dgc + slot * K + cols, tl.sum(dkdkd, axis=0) + tl.exp(gC) * sds, mask=cmask)
    dg -= dkdkd
    dk = dkd * tl.exp(gC[None, :] - G)  # [C, BK]
    # [C, C] Tinv from its token rows (padded rows 0; 0 above the diagonal)
    ti = load_tile(token_base(tinv, b, t0, hv, s_pb, s_pt, s_ph), L, s_pt, 0, C, C, C)
    dY = -_mm(tl.trans(ti), mdW, GRAD_OP, GRAD_PREC)  # [C, BK] Tinv^T dW
    rkr = tl.load(rk + (i.to(tl.int64) * H + hk) * C + rows, mask=rows < L, other=0.0)  # [C]
    k_base = token_base(k, b, t0, hk, s_kb, s_kt, s_kh)
    yh = rkr[:, None] * load_tile(k_base, L, s_kt, k0, K, C, BK).to(tl.float32) * eG  # [C, BK] k̂ exp(G)
    dYb = dY * beta[:, None]
    store_tile(dgs + slot * (C * K), dg + dYb * yh, C, K, k0, K, C, BK)
    store_tile(dkh + slot * (C * K), dk + dYb * eG, C, K, k0, K, C, BK)


@triton.jit
def chunk_grads_wy_dv_kernel(
    table, k, v, gc, bt, rk, tinv, dvs, h, dv, dbs, dakk,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_db, s_dt, s_dh, s_pb, s_pt, s_ph, H, HV,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GRAD_OP: tl.constexpr, GRAD_PREC: tl.constexpr,
):
    """Grid ``(n, HV)``: dv, dbs and dakk of table row i, value head hv, through N = dV' R^T (module docstring)."""
    i = tl.program_id(0)
    hv = tl.program_id(1)
    _, b, t0, L = chunk_row(table, i)
    hk = hv // (HV // H)
    slot = i.to(tl.int64) * HV + hv
    k_base = token_base(k, b, t0, hk, s_kb, s_kt, s_kh)
    v_base = token_base(v, b, t0, hv, s_vb, s_vt, s_vh)
    dv_base = token_base(dv, b, t0, hv, s_db, s_dt, s_dh)
    gc_base = gc + slot * (C * K)
    h_base = h + slot * (K * V)
    dvs_base = dvs + slot * (C * V)
    tinv_base = token_base(tinv, b, t0, hv, s_pb, s_pt, s_ph)
    rows = tl.arange(0, C)
    beta = tl.load(bt + slot * C + rows, mask=rows < L, other=0.0)  # [C]
    rkr = tl.load(rk + (i.to(tl.int64) * H + hk) * C + rows, mask=rows < L, other=0.0)  # [C]

    N = tl.zeros([C, C], dtype=tl.float32)  # dV' (v - k̂ exp(G) S)^T
    for v0 in range(0, V, BV):
        r = load_tile(v_base, L, s_vt, v0, V, C, BV).to(tl.float32)  # [C, BV] v, then R = v - k̂ exp(G) S
        for k0 in range(0, K, BK):
            yh = load_tile(k_base, L, s_kt, k0, K, C, BK).to(tl.float32) * tl.exp(load_tile(gc_base, L, K, k0, K, C, BK))
            s = load_tile(h_base + k0 * V, K - k0, V, v0, V, BK, BV)  # [BK, BV]
            r -= _mm(yh * rkr[:, None], s, GRAD_OP, GRAD_PREC)  # [C, BV]
        N += _mm(load_tile(dvs_base, L, V, v0, V, C, BV), tl.trans(r), GRAD_OP, GRAD_PREC)  # [C, C]
    # ---- dv = β Tinv^T dV'
    for v0 in range(0, V, BV):
        ti = load_tile(tinv_base, L, s_pt, 0, C, C, C)  # [C, C]
        dZ = _mm(tl.trans(ti), load_tile(dvs_base, L, V, v0, V, C, BV), GRAD_OP, GRAD_PREC)  # [C, BV]
        store_tile(dv_base, dZ * beta[:, None], L, s_dt, v0, V, C, BV)

    # ---- dbs_r = Σ_i Tinv_ir N_ir;  dT = N diag(β);  dA = -(Tinv^T dT Tinv^T), strictly lower
    ti = load_tile(tinv_base, L, s_pt, 0, C, C, C)  # [C, C]
    tl.store(dbs + slot * C + rows, tl.sum(ti.to(tl.float32) * N, axis=0))
    strict = rows[:, None] > rows[None, :]
    dT = tl.where(strict, N * beta[None, :], 0.0)  # only dT's strictly lower part reaches dA
    dA = -_mm(tl.trans(ti), _mm(dT, tl.trans(ti), GRAD_OP, GRAD_PREC), GRAD_OP, GRAD_PREC)  # [C, C]
    store_tile(dakk + slot * (C * C), tl.where(strict, dA, 0.0), C, C, 0, C, C, C)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------


def _check_slot(name: str, x, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(x.stride())}")


def _check_token(name: str, x, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4 or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} (q's dtype), got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    check_token_strides(name, x)


def run_grads_wy(opts: KDAOptions, table, q, k, v, do, gc, bt, rq, rk, tinv, w, qg, kd, u, dvs, h, dh,
                 dv, dqh, dkh, dgs, dgc, dbs, dakk, *, launch=None) -> None:
    """Launch ``chunk_grads_wy_kernel`` over the chunk table's rows (a window); writes dv's rows and the slots
    dqh, dkh, dgs, dgc, dbs, dakk. Slot tensors are the window's (first dimension = the table's rows)."""
    if not isinstance(opts, KDAOptions):
        raise TypeError(f"opts must be a KDAOptions, got {type(opts).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, T, H, K] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"v must be a [B, T, HV, V] tensor, got {getattr(v, 'shape', type(v).__name__)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype, device = q.dtype, q.device
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {dtype}")
    if H < 1 or HV % H != 0:
        raise ValueError(f"v's heads must be a multiple of q's, got HV={HV}, H={H}")
    if K > CHUNK_MAX_HEAD_DIM or V > CHUNK_MAX_HEAD_DIM:
        raise ValueError(f"q and v need K, V <= {CHUNK_MAX_HEAD_DIM}, got K={K}, V={V}")
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"table must be a torch.Tensor, got {type(table).__name__}")
    if table.dim() != 2 or table.shape[1] != 4 or table.dtype != torch.int32 or table.device != device:
        raise ValueError(f"table must be an int32 [n, 4] tensor on {device}, got {table.dtype} "
                         f"{tuple(table.shape)} on {table.device}")
    if not table.is_contiguous():
        raise ValueError(f"table must be contiguous, got strides {tuple(table.stride())}")
    n, C = table.shape[0], CHUNK
    _check_token("q", q, (B, T, H, K), dtype, device)
    _check_token("k", k, (B, T, H, K), dtype, device)
    for name, x in (("v", v), ("do", do), ("dv", dv)):
        _check_token(name, x, (B, T, HV, V), dtype, device)
    f32 = torch.float32
    for name, x, shape, dt in (
        ("gc", gc, (n, HV, C, K), f32), ("bt", bt, (n, HV, C), f32), ("rq", rq, (n, H, C), f32),
        ("rk", rk, (n, H, C), f32), ("w", w, (n, HV, C, K), dtype),
        ("qg", qg, (n, HV, C, K), dtype), ("kd", kd, (n, HV, C, K), dtype), ("u", u, (n, HV, C, V), dtype),
        ("dvs", dvs, (n, HV, C, V), f32), ("h", h, (n, HV, K, V), dtype), ("dh", dh, (n, HV, K, V), dtype),
        ("dqh", dqh, (n, HV, C, K), f32), ("dkh", dkh, (n, HV, C, K), f32), ("dgs", dgs, (n, HV, C, K), f32),
        ("dgc", dgc, (n, HV, K), f32), ("dbs", dbs, (n, HV, C), f32), ("dakk", dakk, (n, HV, C, C), f32),
    ):
        _check_slot(name, x, shape, dt, device)
    try:
        sp = check_pairs(tinv, tinv, B, T, HV, dtype)
    except (TypeError, ValueError) as e:  # check_pairs names its first tensor aqk: here it is tinv
        raise type(e)(str(e).replace("aqk", "tinv")) from None
    if n == 0:
        return
    grad_op, grad_prec = grad_operands(dtype)
    kind = "fp32" if grad_op == GRAD_OP_FP32 else "bf16"
    warps, stages, dv_stages, blocks, dv_blocks = launch_values(
        launch, GRADS_WY_NUM_WARPS=GRADS_WY_NUM_WARPS, GRADS_WY_NUM_STAGES=GRADS_WY_NUM_STAGES,
        GRADS_WY_DV_STAGES=GRADS_WY_DV_STAGES, GRADS_WY_BLOCKS=GRADS_WY_BLOCKS, GRADS_WY_DV_BLOCKS=GRADS_WY_DV_BLOCKS)
    BK, BV = (min(x, block_size(d)) for x, d in zip(blocks[kind], (K, V)))
    chunk_grads_wy_kernel[(n * HV * triton.cdiv(K, BK),)](
        table, k, do, gc, bt, rk, tinv, qg, kd, u, dvs, h, dh, dqh, dkh, dgs, dgc,
        *k.stride()[:3], *do.stride()[:3], *sp, float(opts.scale), H, HV,
        K=K, V=V, C=C, BK=BK, BV=BV, GRAD_OP=grad_op, GRAD_PREC=grad_prec,
        num_warps=warps, num_stages=stages,
    )
    BK, BV = (min(x, block_size(d)) for x, d in zip(dv_blocks[kind], (K, V)))
    chunk_grads_wy_dv_kernel[(n, HV)](
        table, k, v, gc, bt, rk, tinv, dvs, h, dv, dbs, dakk,
        *k.stride()[:3], *v.stride()[:3], *dv.stride()[:3], *sp, H, HV,
        K=K, V=V, C=C, BK=BK, BV=BV, GRAD_OP=grad_op, GRAD_PREC=grad_prec,
        num_warps=warps, num_stages=dv_stages[kind],
    )
