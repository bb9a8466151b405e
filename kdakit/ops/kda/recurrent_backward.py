"""Backward of recurrent KDA in Triton: ``recurrent_kda_backward`` returns all eight gradients.

Notation per sequence and value head (``S_t`` the state after token t, ``S'_t = D_t S_{t-1}``,
``D_t = Diag(exp(a_t))``, ``u_t = beta_t (v_t - S'_t^T k_t)``, ``dS_t`` the total adjoint of
``S_t``, starting from ``dS_T = dht``)::

    dS_t    += scale q_t dO_t^T                   du_t = dS_t^T k_t            dv_t = beta_t du_t
    X_t      = dS_t u_t                            Y_t  = beta_t S'_t du_t
    dk_t     = X_t - Y_t                           dq_t = scale S_t dO_t
    dbeta_t  = du_t . (v_t - S'_t^T k_t)
    dS_{t-1} = D_t (dS_t - beta_t k_t du_t^T)      dh0  = dS_0

and the gate gradient ``da_t = rowsum(dS'_t * S'_t)`` through the identity (it follows
from ``rowsum(dS_{t-1} * S_{t-1}) = da_t + q_{t-1} * dq_{t-1}``)::

    da_t = rowsum(dht * S_T) + sum_{s >= t} (q_s * dq_s - k_s * (X_s + Y_s))

so no pass needs the state and its adjoint at the same token. Three passes over the
tokens, each a program per ``(V-block, sequence, value head)`` holding one ``[BK, BV]``
fp32 tile (grid ``(N * HV, cdiv(V, BV))``):

1. replay (forward kernel of ``fused_recurrent.py`` with ``STORE_U``): ``u_t``;
2. reverse: ``dS`` from ``dht`` back to ``dh0``; writes ``dv``, ``du_t`` (over ``u_t``), ``X_t``;
3. replay with the adjoint terms: ``dq_t``, ``dk_t``, ``Z_t = q*dq - k*(X+Y)``, ``dbeta_t``
   and ``rowsum(dht * S_T)``, each a partial sum over its V-block.

Then a token-parallel kernel sums the V-block partials and the value heads of a q/k
head and applies the l2norm backward (dq, dk); a kernel per ``(sequence, value head)``
reverse-cumsums ``Z`` into ``da`` in blocks of tokens and applies the gate and beta
backward (dg, dbeta, per-sequence partials of dA_log and dt_bias); a last kernel sums
those partials over sequences. Every sum has a fixed order: results are bitwise
reproducible and graph replays equal eager calls.

Memory: nothing is saved by the forward besides its inputs, and no state series is
stored (the replays start from the initial state). All scratch comes from the workspace.

One pass (every sequence has at most ``segment_tokens`` = L tokens): with ``TT = B*T`` and
``NV = cdiv(V, 32)``, ``4 * TT * HV * (V + NV * (3 K + 1)) + 4 * N * HV * (NV + 1) * (K + 1)``
bytes (about 6.6 KiB per token and value head at K = V = 128; 417 MiB at TT = 4096, HV = 16).

Segmented (a sequence longer than L): segment s holds tokens ``[s L, (s + 1) L)`` of every
sequence. The states at segment starts are recomputed by the forward kernel, segment by
segment, into ``S - 1`` checkpoints (``S = cdiv(max length, L)``); then the segments are
walked last to first, each gathered into a packed launch of the one-pass backward that
starts from its checkpoint and ends on the carried state gradient (its dh0 is the previous
segment's dht); the gradients are scattered back and dA_log / dt_bias summed over segments.
With ``M = max_s sum_n min(max(len_n - s L, 0), L) <= N L`` (B L for fixed length) and
``e`` the token dtype's size, the bytes are::

    4 M HV (V + NV (3 K + 1)) + 4 N HV (NV + 1) (K + 1)    one-pass scratch of a segment
  + e M (4 H K + HV (3 V + 2 K + 2))                       gathered inputs, do and gradients
  + 4 (S + 1) N HV K V                                     S - 1 checkpoints, 2 carried dS
  + 8 HV (K + 1)                                           gate-parameter partials

Only the checkpoints grow with T: 4 HV K V / L bytes per token of the longest sequence
(2 KiB at HV = 32, K = V = 128, L = 1024, a quarter of the bf16 q). Example, N = 1,
T = 32K, H = HV = 32, K = V = 128, bf16, L = 1024: 347 MiB instead of 6.5 GiB in one
pass. ``recurrent_backward_segmented.backward_scratch_bytes`` computes these figures. Each token is gathered twice
and its recurrence replayed three times (checkpoints, then passes 1 and 3).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.chunk_common import gate_mode, seq_bounds
from kdakit.ops.kda.fused_recurrent import (
    DEFAULT_SEGMENT_TOKENS,
    beta_mode,
    beta_value,
    check_kernel_layout,
    check_segment_tokens,
    launch_recurrent_forward,
    load_qk_token,
    log_decay,
)
from kdakit.ops.kda.naive import naive_recurrent_kda
from kdakit.ops.kda.validate import validate_kda_inputs
from kdakit.ops.kda.workspace import (
    Workspace,
    call_signature,
    check_out,
    check_prepared_for_capture,
    resolve_workspace,
)

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

# V columns per recurrence program (the dq/dk/Z partials scale with cdiv(V, BWD_BLOCK_V)). On the
# H200 (B=4, T=1024, H=16, K=V=128): 32 columns, 2 warps: 6.1 ms and 417 MiB of scratch; 16
# columns: 6.8 ms, 802 MiB; 64 columns, 4 warps: 6.8 ms, 225 MiB.
BWD_BLOCK_V = 32
BWD_NUM_WARPS = 2
REDUCE_BLOCK_T = 16     # tokens per block in the token-parallel reductions
REDUCE_NUM_WARPS = 4

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")


class KDAGrads(NamedTuple):
    """Gradients of recurrent KDA w.r.t. its raw inputs (None where the input is absent)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None
    dh0: torch.Tensor | None


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T", "TT"])
def _recurrent_bwd_reverse_kernel(
    q, k, g, beta, A_log, dt_bias, do, dht, ud, dv, dh0, x_part, cu_seqlens,
    scale, lower_bound, T, TT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    """Pass 2: dS backwards through the tokens. Reads u_t from ``ud`` and overwrites it with du_t."""
    i_nh = tl.program_id(0)  # N * HV on axis 0: axes 1 and 2 hold at most 65535 programs
    i_v = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    state_base = (i_n * HV + i_hv).to(tl.int64) * K * V
    if STATE_V_FIRST:
        offs_s = offs_v[None, :] * K + offs_k[:, None]                                    # [BK, BV]
    else:
        offs_s = offs_k[:, None] * V + offs_v[None, :]

    dS = tl.zeros([BK, BV], dtype=tl.float32)                                             # [BK, BV]
    if HAS_DHT:
        dS += tl.load(dht + state_base + offs_s, mask=mask_s, other=0.0).to(tl.float32)

    # while loops: the interpreter cannot take range() of a program-dependent bound.
    t = eos - 1
    while t >= bos:
        qk_row = (t * H + i_h) * K
        hv_row = t * HV + i_hv
        b_q = load_qk_token(q + qk_row, offs_k, mask_k, L2NORM)                           # [BK]
        b_k = load_qk_token(k + qk_row, offs_k, mask_k, L2NORM)                           # [BK]
        b_g = tl.load(g + hv_row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_a = log_decay(b_g, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound, K, GATE, HAS_A, HAS_BIAS)
        b_beta = beta_value(tl.load(beta + hv_row).to(tl.float32), BETA)
        b_do = tl.load(do + hv_row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)   # [BV]
        b_u = tl.load(ud + hv_row * V + offs_v, mask=mask_v, other=0.0)                   # [BV] fp32

        dS += (scale * b_q)[:, None] * b_do[None, :]
        b_du = tl.sum(dS * b_k[:, None], axis=0)                                          # [BV]
        b_x = tl.sum(dS * b_u[None, :], axis=1)                                           # [BK]
        tl.store(x_part + ((i_v * TT + t) * HV + i_hv) * K + offs_k, b_x, mask=mask_k)
        tl.store(dv + hv_row * V + offs_v, (b_beta * b_du).to(dv.dtype.element_ty), mask=mask_v)
        tl.store(ud + hv_row * V + offs_v, b_du, mask=mask_v)
        dS = (dS - (b_beta * b_k)[:, None] * b_du[None, :]) * tl.exp(b_a)[:, None]
        t -= 1

    if STORE_DH0:
        tl.store(dh0 + state_base + offs_s, dS.to(dh0.dtype.element_ty), mask=mask_s)


@triton.jit(do_not_specialize=["T", "TT"])
def _recurrent_bwd_replay_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, do, dht, ud, dq_part, dk_part, z_part, dbeta_part, term_part,
    cu_seqlens, scale, lower_bound, T, TT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    """Pass 3: the forward again, with du_t and X_t from pass 2; V-block partials of dq, dk, Z, dbeta."""
    i_nh = tl.program_id(0)  # N * HV on axis 0: axes 1 and 2 hold at most 65535 programs
    i_v = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    state_base = (i_n * HV + i_hv).to(tl.int64) * K * V
    if STATE_V_FIRST:
        offs_s = offs_v[None, :] * K + offs_k[:, None]                                    # [BK, BV]
    else:
        offs_s = offs_k[:, None] * V + offs_v[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)                                              # [BK, BV]
    if USE_H0:
        S += tl.load(h0 + state_base + offs_s, mask=mask_s, other=0.0).to(tl.float32)

    t = bos
    while t < eos:
        qk_row = (t * H + i_h) * K
        hv_row = t * HV + i_hv
        part_row = ((i_v * TT + t) * HV + i_hv) * K
        b_q = load_qk_token(q + qk_row, offs_k, mask_k, L2NORM)                           # [BK]
        b_k = load_qk_token(k + qk_row, offs_k, mask_k, L2NORM)                           # [BK]
        b_g = tl.load(g + hv_row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        b_a = log_decay(b_g, A_log, dt_bias, i_hv, offs_k, mask_k, lower_bound, K, GATE, HAS_A, HAS_BIAS)
        b_beta = beta_value(tl.load(beta + hv_row).to(tl.float32), BETA)
        b_v = tl.load(v + hv_row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)     # [BV]
        b_do = tl.load(do + hv_row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)   # [BV]
        b_du = tl.load(ud + hv_row * V + offs_v, mask=mask_v, other=0.0)                  # [BV]
        b_x = tl.load(dk_part + part_row + offs_k, mask=mask_k, other=0.0)                # [BK] X_t

        S = S * tl.exp(b_a)[:, None]                                                      # S'
        b_r = b_v - tl.sum(S * b_k[:, None], axis=0)                                      # [BV] v - S'^T k
        b_y = b_beta * tl.sum(S * b_du[None, :], axis=1)                                  # [BK]
        b_dbeta = tl.sum(b_du * b_r, axis=0)
        S = S + b_k[:, None] * (b_beta * b_r)[None, :]
        b_dq = scale * tl.sum(S * b_do[None, :], axis=1)                                  # [BK]

        tl.store(dq_part + part_row + offs_k, b_dq, mask=mask_k)
        tl.store(dk_part + part_row + offs_k, b_x - b_y, mask=mask_k)
        tl.store(z_part + part_row + offs_k, b_q * b_dq - b_k * (b_x + b_y), mask=mask_k)
        tl.store(dbeta_part + i_v * TT * HV + hv_row, b_dbeta)
        t += 1

    if HAS_DHT:
        b_dht = tl.load(dht + state_base + offs_s, mask=mask_s, other=0.0).to(tl.float32)
        tl.store(term_part + ((i_v * (tl.num_programs(0) // HV) + i_n) * HV + i_hv) * K + offs_k,
                 tl.sum(b_dht * S, axis=1), mask=mask_k)


@triton.jit(do_not_specialize=["T", "TT"])
def _recurrent_bwd_gate_kernel(
    g, beta, A_log, dt_bias, z_part, dbeta_part, term_part, dg, dbeta, dA_part, dbias_part, cu_seqlens,
    lower_bound, T, TT,
    NV: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
):
    """da = reverse cumsum of Z (plus rowsum(dht * S_T)), then the gate and beta backward."""
    i_nh = tl.program_id(0)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K

    carry = tl.zeros([BK], dtype=tl.float32)                                              # da_{t+1}
    if HAS_DHT:
        for i_v in tl.static_range(NV):
            carry += tl.load(term_part + ((i_v * (tl.num_programs(0) // HV) + i_n) * HV + i_hv) * K + offs_k,
                             mask=mask_k, other=0.0)
    if HAS_A:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        b_A = 1.0
    dA_acc = tl.zeros([BK], dtype=tl.float32)
    dbias_acc = tl.zeros([BK], dtype=tl.float32)

    end = eos
    while end > bos:
        rows = end - BT + tl.arange(0, BT)                                                # [BT]
        mask_t = rows >= bos
        mask_tk = mask_t[:, None] & mask_k[None, :]
        z = tl.zeros([BT, BK], dtype=tl.float32)
        db = tl.zeros([BT], dtype=tl.float32)
        for i_v in tl.static_range(NV):
            z += tl.load(z_part + ((i_v * TT + rows[:, None]) * HV + i_hv) * K + offs_k[None, :],
                         mask=mask_tk, other=0.0)
            db += tl.load(dbeta_part + (i_v * TT + rows) * HV + i_hv, mask=mask_t, other=0.0)
        da = tl.cumsum(z, axis=0, reverse=True) + carry[None, :]                          # [BT, BK]
        carry += tl.sum(z, axis=0)

        p_g = g + (rows[:, None] * HV + i_hv) * K + offs_k[None, :]
        if GATE == 0:
            b_dg = da
        else:
            b_graw = tl.load(p_g, mask=mask_tk, other=0.0).to(tl.float32)
            x = b_graw
            if HAS_BIAS:
                x = x + tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            if GATE == 1:
                # a = -e^A softplus(x): da/dx = -e^A sigmoid(x) (1 above the softplus threshold), da/dA = a
                dsp = tl.where(x > 20.0, 1.0, tl.sigmoid(x))
                b_dg = da * (-b_A * dsp)
                sp = tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))
                sp = tl.where(x < -15.0, tl.exp(x), sp)
                sp = tl.where(x > 20.0, x, sp)
                dA_acc += tl.sum(tl.where(mask_tk, da * (-b_A * sp), 0.0), axis=0)
            else:
                # a = lb * sigmoid(e^A x): da/dx = lb s (1 - s) e^A, da/dA = that times x
                s = tl.sigmoid(b_A * x)
                b_dg = da * (lower_bound * s * (1.0 - s) * b_A)
                dA_acc += tl.sum(tl.where(mask_tk, b_dg * x, 0.0), axis=0)
            dbias_acc += tl.sum(tl.where(mask_tk, b_dg, 0.0), axis=0)
        tl.store(dg + (rows[:, None] * HV + i_hv) * K + offs_k[None, :], b_dg.to(dg.dtype.element_ty), mask=mask_tk)

        p_beta = beta + rows * HV + i_hv
        if BETA == 0:
            b_db = db
        else:
            s_b = tl.sigmoid(tl.load(p_beta, mask=mask_t, other=0.0).to(tl.float32))
            b_db = db * s_b * (1.0 - s_b)
            if BETA == 2:
                b_db = 2.0 * b_db
        tl.store(dbeta + rows * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=mask_t)
        end -= BT

    if GATE != 0:
        tl.store(dA_part + i_nh, tl.sum(dA_acc, axis=0))
        tl.store(dbias_part + i_nh.to(tl.int64) * K + offs_k, dbias_acc, mask=mask_k)


@triton.jit(do_not_specialize=["TT"])
def _recurrent_bwd_qk_kernel(
    q, k, dq_part, dk_part, dq, dk, TT,
    NV: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """dq, dk of a block of tokens and one q/k head: sum V-blocks and value heads, l2norm backward."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    G: tl.constexpr = HV // H
    rows = (i_t * BT + tl.arange(0, BT)).to(tl.int64)                                    # [BT]
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    mask = (rows < TT)[:, None] & mask_k[None, :]                                         # [BT, BK]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in tl.static_range(NV):
        for j in tl.static_range(G):
            p = ((i_v * TT + rows[:, None]) * HV + i_h * G + j) * K + offs_k[None, :]
            b_dq += tl.load(dq_part + p, mask=mask, other=0.0)
            b_dk += tl.load(dk_part + p, mask=mask, other=0.0)
    p_x = (rows[:, None] * H + i_h) * K + offs_k[None, :]
    if L2NORM:
        # y = x r, r = (sum x^2 + eps)^-1/2: dx = r (dy - y (dy . y))
        b_q = tl.load(q + p_x, mask=mask, other=0.0).to(tl.float32)
        r_q = tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)                                  # [BT]
        y_q = b_q * r_q[:, None]
        b_dq = r_q[:, None] * (b_dq - y_q * tl.sum(b_dq * y_q, axis=1)[:, None])
        b_k = tl.load(k + p_x, mask=mask, other=0.0).to(tl.float32)
        r_k = tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)
        y_k = b_k * r_k[:, None]
        b_dk = r_k[:, None] * (b_dk - y_k * tl.sum(b_dk * y_k, axis=1)[:, None])
    tl.store(dq + p_x, b_dq.to(dq.dtype.element_ty), mask=mask)
    tl.store(dk + p_x, b_dk.to(dk.dtype.element_ty), mask=mask)


@triton.jit
def _recurrent_bwd_param_kernel(
    dA_part, dbias_part, dA_log, ddt_bias, N,
    HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """dA_log[hv] and dt_bias[hv, :]: sums over sequences of the per-sequence partials, in order."""
    i_hv = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    acc_a = tl.zeros([1], dtype=tl.float32)
    acc_b = tl.zeros([BK], dtype=tl.float32)
    n = 0
    while n < N:
        acc_a += tl.load(dA_part + n * HV + i_hv + tl.arange(0, 1))
        acc_b += tl.load(dbias_part + (n * HV + i_hv) * K + offs_k, mask=mask_k, other=0.0)
        n += 1
    if HAS_A:
        tl.store(dA_log + i_hv + tl.arange(0, 1), acc_a.to(dA_log.dtype.element_ty))
    if HAS_BIAS:
        tl.store(ddt_bias + i_hv * K + offs_k, acc_b.to(ddt_bias.dtype.element_ty), mask=mask_k)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def scratch_shapes(B: int, T: int, HV: int, K: int, V: int, N: int) -> dict:
    """Name -> (shape, dtype) of the backward's scratch buffers (all fp32)."""
    NV = triton.cdiv(V, min(triton.next_power_of_2(V), BWD_BLOCK_V))
    TT = B * T
    f = torch.float32
    return {
        "ud": ((TT, HV, V), f),
        "dq_part": ((NV, TT, HV, K), f),
        "dk_part": ((NV, TT, HV, K), f),
        "z_part": ((NV, TT, HV, K), f),
        "dbeta_part": ((NV, TT, HV), f),
        "term_part": ((NV, N, HV, K), f),
        "dA_part": ((N, HV), f),
        "dbias_part": ((N, HV, K), f),
    }


def launch_recurrent_backward(
    q, k, v, g, beta, do, dht, *, A_log, dt_bias, scale, initial_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
    cu_seqlens, workspace: Workspace, out=None,
) -> KDAGrads:
    """Run the five backward kernels. ``A_log``/``dt_bias`` are None unless the gate is in the kernel."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    TT = B * T
    # autograd may hand over expanded or strided cotangents; the kernels read dense ones.
    do = do if do.is_contiguous() else do.contiguous()
    if dht is not None and not dht.is_contiguous():
        dht = dht.contiguous()

    grads = grad_outputs(q, k, v, g, beta, A_log, dt_bias, initial_state, out)
    shapes = scratch_shapes(B, T, HV, K, V, N)
    buf = {name: workspace.buffer("recurrent_bwd." + name, shp, dt) for name, (shp, dt) in shapes.items()}

    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), BWD_BLOCK_V)
    NV = triton.cdiv(V, BV)
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    bmode = beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    dummy = buf["ud"]
    A = A_log if A_log is not None else dummy
    bias = dt_bias if dt_bias is not None else dummy
    cu = cu_seqlens if cu_seqlens is not None else dummy
    flags = dict(IS_VARLEN=cu_seqlens is not None, STATE_V_FIRST=state_v_first, L2NORM=use_qk_l2norm_in_kernel,
                 GATE=gate, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, BETA=bmode)
    grid = (N * HV, NV)

    # 1. replay: u_t
    launch_recurrent_forward(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, N=N, u=buf["ud"],
        block_v=BV,
    )
    # 2. reverse: dv, du_t, X_t, dh0
    _recurrent_bwd_reverse_kernel[grid](
        q, k, g, beta, A, bias, do, dht if dht is not None else dummy, buf["ud"], grads.dv,
        grads.dh0 if grads.dh0 is not None else dummy, buf["dk_part"], cu,
        float(scale), lb, T, TT, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        HAS_DHT=dht is not None, STORE_DH0=grads.dh0 is not None, **flags, num_warps=BWD_NUM_WARPS,
    )
    # 3. replay with adjoint terms: partial dq, dk, Z, dbeta, rowsum(dht * S_T)
    _recurrent_bwd_replay_kernel[grid](
        q, k, v, g, beta, A, bias, initial_state if initial_state is not None else dummy, do,
        dht if dht is not None else dummy, buf["ud"], buf["dq_part"], buf["dk_part"], buf["z_part"],
        buf["dbeta_part"], buf["term_part"], cu, float(scale), lb, T, TT,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_H0=initial_state is not None, HAS_DHT=dht is not None,
        **flags, num_warps=BWD_NUM_WARPS,
    )
    # 4. dq, dk (token-parallel)
    _recurrent_bwd_qk_kernel[(triton.cdiv(TT, REDUCE_BLOCK_T), H)](
        q, k, buf["dq_part"], buf["dk_part"], grads.dq, grads.dk, TT,
        NV=NV, H=H, HV=HV, K=K, BK=BK, BT=REDUCE_BLOCK_T, L2NORM=use_qk_l2norm_in_kernel, num_warps=REDUCE_NUM_WARPS,
    )
    # 5. dg, dbeta and per-sequence parameter partials
    _recurrent_bwd_gate_kernel[(N * HV,)](
        g, beta, A, bias, buf["z_part"], buf["dbeta_part"], buf["term_part"], grads.dg, grads.dbeta,
        buf["dA_part"], buf["dbias_part"], cu, lb, T, TT,
        NV=NV, HV=HV, K=K, BK=BK, BT=REDUCE_BLOCK_T, HAS_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
        GATE=gate, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, BETA=bmode, num_warps=REDUCE_NUM_WARPS,
    )
    # 6. dA_log, ddt_bias
    if gate != 0 and (grads.dA_log is not None or grads.ddt_bias is not None):
        _recurrent_bwd_param_kernel[(HV,)](
            buf["dA_part"], buf["dbias_part"], grads.dA_log if A_log is not None else dummy,
            grads.ddt_bias if dt_bias is not None else dummy, N,
            HV=HV, K=K, BK=BK, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, num_warps=1,
        )
    return grads


def run_recurrent_backward(
    q, k, v, g, beta, do, dht, *, segment_tokens: int, cu_seqlens, workspace: Workspace, out=None, **kw,
) -> KDAGrads:
    """One launch when every sequence fits in ``segment_tokens`` tokens, else the segmented driver."""
    # Imported here: the segmented driver builds on this module's launcher.
    from kdakit.ops.kda.recurrent_backward_segmented import launch_segmented_backward, segment_plan

    plan = segment_plan(q.shape[0], q.shape[1], cu_seqlens, segment_tokens, workspace)
    if plan is None:
        return launch_recurrent_backward(q, k, v, g, beta, do, dht, cu_seqlens=cu_seqlens, workspace=workspace,
                                         out=out, **kw)
    return launch_segmented_backward(q, k, v, g, beta, do, dht, plan=plan, cu_seqlens=cu_seqlens,
                                     workspace=workspace, out=out, **kw)


def grad_outputs(q, k, v, g, beta, A_log, dt_bias, initial_state, out) -> KDAGrads:
    """The eight gradient tensors: the caller's (``out``, checked) or new ones."""
    like = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    if out is None:
        return KDAGrads(*(None if x is None else torch.empty_like(x) for x in like))
    if not isinstance(out, (tuple, list)) or len(out) != 8:
        raise ValueError(f"out must be a sequence of 8 gradient tensors {GRAD_NAMES}, got {type(out).__name__}"
                         + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    res = []
    for name, x, o in zip(GRAD_NAMES, like, out):
        if x is None:
            if o is not None:
                raise ValueError(f"out[{GRAD_NAMES.index(name)}] ({name}) must be None: its input is absent")
            res.append(None)
        elif o is None:
            res.append(torch.empty_like(x))
        else:
            res.append(check_out(f"out[{GRAD_NAMES.index(name)}] ({name})", o, x.shape, x.dtype, x.device))
    return KDAGrads(*res)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

def recurrent_kda_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    out=None,
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
) -> KDAGrads:
    r"""All eight gradients of recurrent KDA (the forward of ``kdakit.fused_recurrent_kda``).

    Args:
        q, k, v, g, beta, A_log, dt_bias, initial_state, options: exactly as given to the
            forward (raw inputs; shapes and dtypes as ``fused_recurrent_kda``).
        do: ``[B, T, HV, V]`` gradient of ``o`` (contiguous).
        dht: gradient of the final state (``[N, HV, K, V]``, or ``[N, HV, V, K]`` with
            ``state_v_first``), or None.
        workspace: ``kdakit.Workspace``; default: the stream-local one.
        out: optional sequence of 8 preallocated gradients in ``KDAGrads`` order, each
            contiguous with its input's shape and dtype, None for an absent input (or to
            allocate that one).
        segment_tokens: when every sequence has at most this many tokens, one pass over
            the whole input (scratch grows with B*T); otherwise the sequences are split into
            segments of this many tokens, recomputed from state checkpoints, and the scratch
            scales with N * segment_tokens (see this module's docstring for the bytes).

    Returns ``KDAGrads(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)`` in the inputs'
    dtypes; ``dA_log``, ``ddt_bias`` and ``dh0`` are None when their input is None, and
    zeros when given but unused (gate not in the kernel). Gradients are w.r.t. the raw
    inputs (through l2norm, gate and sigmoid).

    Any T >= 1 (and zero-length varlen sequences), N, H, HV. Bitwise deterministic.
    CUDA graphs: see ``kdakit/ops/kda/workspace.py`` (pass ``out`` with all gradients
    and one workspace; make one eager warm call first). The segmented path is capturable
    too: its gather buffers and checkpoints are workspace buffers sized by the warm call,
    and with ``cu_seqlens`` its segment plan is read on the host by the warm call and
    reused by the capture, so replays assume the warm call's ``cu_seqlens`` values.
    """
    check_segment_tokens(segment_tokens)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    backend = select_backend(device)
    opts = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound, state_v_first=state_v_first)
    ws, prepared, signature = None, False, None
    if backend == "triton":
        ws = resolve_workspace(workspace, device)
        signature = call_signature("recurrent_kda_backward", q, k, v, g, beta, do, dht, A_log, dt_bias,
                                   initial_state, cu_seqlens, scale, safe_gate, tuple(sorted(opts.items())),
                                   tuple(out) if isinstance(out, (list, tuple)) else out, segment_tokens)
        prepared = check_prepared_for_capture(ws, signature, "recurrent_kda_backward")
        if prepared and (out is None or any(
                o is None for o, x in zip(out, (q, k, v, g, beta, A_log, dt_bias, initial_state)) if x is not None)):
            raise RuntimeError("capturing recurrent_kda_backward in a CUDA graph needs out= with every gradient "
                               "so that the capture allocates nothing")
    if prepared:
        K = q.shape[3]
    else:
        shape = validate_kda_inputs(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        )
        K = shape.K
        _check_cotangents(do, dht, v, shape, state_v_first)
    opts["scale"] = float(K ** -0.5 if scale is None else scale)
    if not use_gate_in_kernel:
        opts["lower_bound"] = None

    if backend == "torch":
        return _reference_backward(q, k, v, g, beta, do, dht, A_log, dt_bias, initial_state, cu_seqlens, opts, out)

    if not prepared:
        check_kernel_layout(K, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "do": do, "dht": dht,
                                "initial_state": initial_state, "A_log": A_log, "dt_bias": dt_bias,
                                "cu_seqlens": cu_seqlens})
    gate_args = (A_log, dt_bias) if use_gate_in_kernel else (None, None)
    grads = run_recurrent_backward(
        q, k, v, g, beta, do, dht, A_log=gate_args[0], dt_bias=gate_args[1], initial_state=initial_state,
        cu_seqlens=cu_seqlens, workspace=ws, out=_kernel_out(out, use_gate_in_kernel),
        segment_tokens=segment_tokens, **opts,
    )
    grads = _fill_unused_params(grads, A_log, dt_bias, out, use_gate_in_kernel)
    if not prepared:
        ws.mark_prepared(signature)
    return grads


def _check_cotangents(do, dht, v, shape, state_v_first) -> None:
    if not isinstance(do, torch.Tensor):
        raise TypeError(f"do must be a torch.Tensor, got {type(do).__name__}")
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do must have o's shape [B, T, HV, V] = {list(v.shape)}, got {list(do.shape)}")
    if not do.is_floating_point():
        raise TypeError(f"do must be a floating tensor, got {do.dtype}")
    if dht is not None:
        if not isinstance(dht, torch.Tensor):
            raise TypeError(f"dht must be a torch.Tensor or None, got {type(dht).__name__}")
        want = (shape.N, shape.HV, shape.V, shape.K) if state_v_first else (shape.N, shape.HV, shape.K, shape.V)
        if tuple(dht.shape) != want:
            raise ValueError(f"dht must have the final state's shape {list(want)}, got {list(dht.shape)}")


def _kernel_out(out, use_gate_in_kernel):
    """Without the in-kernel gate, the kernels do not produce dA_log / ddt_bias (they are zero)."""
    if out is None or use_gate_in_kernel:
        return out
    out = list(out)
    return (*out[:5], None, None, out[7]) if len(out) == 8 else out


def _fill_unused_params(grads: KDAGrads, A_log, dt_bias, out, use_gate_in_kernel) -> KDAGrads:
    if use_gate_in_kernel:
        return grads
    filled = {}
    for i, (name, x) in enumerate((("dA_log", A_log), ("ddt_bias", dt_bias)), start=5):
        if x is None:
            continue
        dst = out[i] if out is not None and out[i] is not None else None
        if dst is None:
            dst = torch.zeros_like(x)
        else:
            dst = check_out(f"out[{i}] ({name})", dst, x.shape, x.dtype, x.device)
            dst.zero_()
        filled[name] = dst
    return grads._replace(**filled)


def _reference_backward(q, k, v, g, beta, do, dht, A_log, dt_bias, initial_state, cu_seqlens, opts, out) -> KDAGrads:
    """Gradients through autograd of the naive recurrence (the PyTorch backend)."""
    leaves = [None if x is None else x.detach().requires_grad_() for x in
              (q, k, v, g, beta, A_log, dt_bias, initial_state)]
    gate = opts["use_gate_in_kernel"]
    with torch.enable_grad():
        o, ht = naive_recurrent_kda(
            *leaves[:5], initial_state=leaves[7], output_final_state=dht is not None,
            A_log=leaves[5] if gate else None, dt_bias=leaves[6] if gate else None, cu_seqlens=cu_seqlens, **opts,
        )
        outs, cots = [o], [do]
        if dht is not None:
            outs.append(ht)
            cots.append(dht.to(ht.dtype))
        present = [x for x in leaves if x is not None]
        got = iter(torch.autograd.grad(outs, present, cots, allow_unused=True))
    res = []
    for i, x in enumerate(leaves):
        if x is None:
            res.append(None)
            continue
        gr = next(got)
        gr = torch.zeros_like(x) if gr is None else gr.to(x.dtype)
        if out is not None and out[i] is not None:
            check_out(f"out[{i}] ({GRAD_NAMES[i]})", out[i], x.shape, x.dtype, x.device).copy_(gr)
            gr = out[i]
        res.append(gr.detach())
    return KDAGrads(*res)
