"""Chunked KDA forward in Triton: one program per (sequence, value head, V block) walks its chunks.

Per chunk of C = 16 tokens, with the state ``S`` ``[K, BV]`` (fp32, in registers) at the
chunk start, ``G`` the inclusive cumsum of the log-decay ``a`` over the chunk rows,
``Γ = exp(G)``, ``g_C = G[C-1]`` and the pairwise decays ``E[i, j, c] = exp(G[i,c] - G[j,c])``::

    Akk[i, j] = beta_i sum_c k_i k_j E_ij     (j < i)      Aqk[i, j] = sum_c q_i k_j E_ij  (j <= i)
    Tinv      = (I + Akk)^-1                                (16x16 unit lower, forward substitution)
    V'        = Tinv (beta * (v - (k Γ) S))                 (= U - W S of the design note)
    O         = scale ((q Γ) S + Aqk V')
    S        <- exp(g_C) S + (k exp(g_C - G))^T V'

Pairwise sums: SAFE path (``safe_gate``, or the in-kernel lower-bound gate with
``lower_bound >= -5``) factors E through a mid-chunk reference and uses one ``tl.dot``;
the EXACT path (any gate, log-decays down to -1000) forms E on ``[C, C, 16]`` key slices.
See ``chunk_common``.

Layouts: q, k ``[B, T, H, K]``; v, o ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta
``[B, T, HV]`` (all contiguous, token-major); packed sequences via ``cu_seqlens`` (B = 1);
value head ``hv`` reads q/k head ``hv // (HV // H)``. Initial state fp32 or bf16 in either
layout (read through its strides); final state fp32 in the requested layout. Checkpoints:
fp32 ``[num_checkpoints, HV, K, V]`` (K-major), row ``offsets[n] + j`` is sequence n's state
before its token ``j * L`` (``plan.checkpoint_offsets``). All addressing is int64.

Precision: every load is upcast to fp32 and all math is fp32. ``tl.dot`` runs in TF32 for
bf16/fp16 inputs (operands stay fp32 in registers; TF32 keeps 10 mantissa bits against
bf16's 7, so its rounding sits below the bf16 output rounding) and TF32x3 (about fp32
accuracy) for fp32 inputs; the 16x16 inverse is exact fp32.

Limits: K, V <= 128 (other sizes are padded to a power of two >= 16 by masking).

Floors at 1 x 8K, H = HV = 96, K = V = 128, bf16 (H200: 4.3 TB/s, 790 TFLOP/s):
bytes moved = q, k, v, g, o (5 x 8192 x 96 x 128 x 2 B = 1.01 GB) + beta (1.6 MB) + checkpoints
(4 x 96 x 64 KiB = 25 MB) = 1.03 GB -> 0.24 ms. FLOPs per chunk and head (2 x m n k):
k Γ S, q Γ S, (k exp)^T V' = 3 x 2 x 16 x 128 x 128; Akk, Aqk = 2 x 2 x 16 x 16 x 128;
Tinv V', Aqk V' = 2 x 2 x 16 x 16 x 128 -> 2.1 MFLOP x 512 chunks x 96 heads = 0.10 TFLOP
-> 0.13 ms at the bf16 peak. Both floors are far below the 3.04 ms FLA forward; this kernel
is bound by the serial chunk walk (512 dependent steps per program), which is why the
V split (``plan.block_v``) trades duplicated pairwise work for more programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk_common import (
    block_size,
    gate_mode,
    l2norm_rows,
    load_chunk_beta,
    load_chunk_gate,
    load_matrix,
    load_rows,
    pairwise_dot,
    pairwise_exact,
    row_of,
    safe_gate_factors,
    store_matrix,
    store_rows,
    unit_lower_inverse,
    unit_lower_inverse_doubling,
)
from kdakit.ops.kda.plan import CHUNK_SIZE, KDAPlan, checkpoint_offsets, plan_kda

MAX_HEAD_DIM = 128
EXACT_KEY_SLICE = 16  # BKS: [C, C, BKS] fp32 per pairwise slice stays at 16 registers a thread
FWD_NUM_STAGES = 1


def fwd_num_warps(BK: int, BV: int) -> int:
    """4 warps up to BV = 64 (ptxas, sm_90a, K = 128: 255 registers, spills <= 0.5 KB at BV = 64, none at 32);
    8 warps at BV = 128 (4 warps would spill 1.5 KB)."""
    return 8 if BK * BV > 128 * 64 else 4
# The doubling inverse (six 16x16 dots) replaces 15 dependent row reductions on the GPU.
USE_DOUBLING_INVERSE = True


@triton.jit
def _fwd_chunk(
    S, t0, seq_len, q_base, k_base, g_base, b_base, v_base, o_base, bias_ptr, ckpt, ck_row0, i_hv,
    expA, scale, lower_bound, H, HV, v0, L_CKPT,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKS: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, SAFE: tl.constexpr, STORE_CKPT: tl.constexpr,
    DOT_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr,
):
    """One chunk (rows t0 .. t0 + C - 1 of the sequence): writes O, maybe a checkpoint; returns the new S."""
    if STORE_CKPT:
        if t0 % L_CKPT == 0:
            row = ck_row0 + t0 // L_CKPT
            store_matrix(ckpt + (row * HV + i_hv) * (K * V), S, V, 1, K, V, v0, BK, BV)

    qt = load_rows(q_base, t0, seq_len, H * K, 0, K, C, BK)  # [C, BK]
    kt = load_rows(k_base, t0, seq_len, H * K, 0, K, C, BK)  # [C, BK]
    if USE_L2NORM:
        qt, rq = l2norm_rows(qt)
        kt, rk = l2norm_rows(kt)
    a = load_chunk_gate(g_base, bias_ptr, t0, seq_len, HV * K, 0, K, expA, lower_bound,
                        C, BK, GATE, HAS_BIAS)  # [C, BK]
    Gc = tl.cumsum(a, axis=0)  # [C, BK]
    bt = load_chunk_beta(b_base, t0, seq_len, HV, C, BETA_SIGMOID, NEG_EIGVAL)  # [C]
    vt = load_rows(v_base, t0, seq_len, HV * V, v0, V, C, BV)  # [C, BV]

    if SAFE:
        eg, egi = safe_gate_factors(Gc, C)  # [C, BK] each
        ki = kt * egi
        Akk = pairwise_dot(kt * eg, ki, C, False, DOT_PREC)  # [C, C]
        Aqk = pairwise_dot(qt * eg, ki, C, True, DOT_PREC)  # [C, C]
    else:
        Akk = tl.zeros([C, C], dtype=tl.float32)
        Aqk = tl.zeros([C, C], dtype=tl.float32)
        for ks in tl.static_range(0, BK, BKS):
            qs = load_rows(q_base, t0, seq_len, H * K, ks, K, C, BKS)  # [C, BKS]
            kss = load_rows(k_base, t0, seq_len, H * K, ks, K, C, BKS)  # [C, BKS]
            if USE_L2NORM:
                qs = qs * rq[:, None]
                kss = kss * rk[:, None]
            a_s = load_chunk_gate(g_base, bias_ptr, t0, seq_len, HV * K, ks, K, expA, lower_bound,
                                  C, BKS, GATE, HAS_BIAS)
            G_s = tl.cumsum(a_s, axis=0)  # [C, BKS]
            Akk += pairwise_exact(kss, kss, G_s, C, False)
            Aqk += pairwise_exact(qs, kss, G_s, C, True)
    Akk = Akk * bt[:, None]
    if INV_DOUBLING:
        Tinv = unit_lower_inverse_doubling(Akk, C)  # [C, C]
    else:
        Tinv = unit_lower_inverse(Akk, C)

    # S-independent tiles first, so q, k and G die before the state products.
    gam = tl.exp(Gc)  # [C, BK]
    g_last = row_of(Gc, C - 1, C)  # [BK]
    kd = kt * tl.exp(g_last[None, :] - Gc)  # [C, BK]
    kg = kt * gam
    qg = qt * gam
    resid = bt[:, None] * (vt - tl.dot(kg, S, input_precision=DOT_PREC))  # [C, BV]
    vn = tl.dot(Tinv, resid, input_precision="ieee")  # [C, BV] = V'
    ot = scale * (tl.dot(qg, S, input_precision=DOT_PREC)
                  + tl.dot(Aqk, vn, input_precision=DOT_PREC))  # [C, BV]
    store_rows(o_base, ot, t0, seq_len, HV * V, v0, V, C, BV)
    S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(kd), vn, input_precision=DOT_PREC)  # [BK, BV]
    return S


@triton.jit
def chunk_kda_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, o, ht, ckpt, cu_seqlens, ckpt_offsets,
    scale, lower_bound, T, H, HV,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v,
    s_ht_n, s_ht_h, s_ht_k, s_ht_v,
    L_CKPT,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BKS: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
    SAFE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    STORE_CKPT: tl.constexpr, DOT_PREC: tl.constexpr, INV_DOUBLING: tl.constexpr,
    LOOP_WHILE: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    seq_len = (eos - bos).to(tl.int32)
    v0 = i_v * BV

    # Row slabs of this (sequence, head): token t of the sequence is row t.
    q_base = q + (bos * H + i_h) * K
    k_base = k + (bos * H + i_h) * K
    g_base = g + (bos * HV + i_hv) * K
    b_base = beta + bos * HV + i_hv
    v_base = v + (bos * HV + i_hv) * V
    o_base = o + (bos * HV + i_hv) * V
    if HAS_BIAS:
        bias_ptr = dt_bias + i_hv * K
    else:
        bias_ptr = dt_bias
    if HAS_A_LOG:
        expA = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        expA = 1.0

    S = tl.zeros([BK, BV], dtype=tl.float32)  # state columns [v0, v0 + BV), K-major
    if HAS_H0:
        S = load_matrix(h0 + i_n.to(tl.int64) * s_h0_n + i_hv * s_h0_h, s_h0_k, s_h0_v, K, V, v0, BK, BV)
    if STORE_CKPT:
        ck_row0 = tl.load(ckpt_offsets + i_n)  # int64
    else:
        ck_row0 = 0

    n_chunks = tl.cdiv(seq_len, C)
    if LOOP_WHILE:
        # The interpreter cannot take range() of a program-dependent bound; a while loop it can.
        i_c = 0
        while i_c < n_chunks:
            S = _fwd_chunk(S, i_c * C, seq_len, q_base, k_base, g_base, b_base, v_base, o_base, bias_ptr,
                           ckpt, ck_row0, i_hv, expA, scale, lower_bound, H, HV, v0, L_CKPT,
                           K, V, C, BK, BV, BKS, GATE, HAS_BIAS, USE_L2NORM, BETA_SIGMOID, NEG_EIGVAL,
                           SAFE, STORE_CKPT, DOT_PREC, INV_DOUBLING)
            i_c += 1
    else:
        for i_c in range(0, n_chunks):
            S = _fwd_chunk(S, i_c * C, seq_len, q_base, k_base, g_base, b_base, v_base, o_base, bias_ptr,
                           ckpt, ck_row0, i_hv, expA, scale, lower_bound, H, HV, v0, L_CKPT,
                           K, V, C, BK, BV, BKS, GATE, HAS_BIAS, USE_L2NORM, BETA_SIGMOID, NEG_EIGVAL,
                           SAFE, STORE_CKPT, DOT_PREC, INV_DOUBLING)

    if STORE_HT:
        store_matrix(ht + i_n.to(tl.int64) * s_ht_n + i_hv * s_ht_h, S, s_ht_k, s_ht_v, K, V, v0, BK, BV)


def _dot_precision(dtype: torch.dtype) -> str:
    if triton_interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _state_strides(t: torch.Tensor, state_v_first: bool) -> tuple[int, int, int, int]:
    """(n, hv, k, v) element strides of a state tensor in either layout."""
    sn, sh, s2, s3 = t.stride()
    return (sn, sh, s3, s2) if state_v_first else (sn, sh, s2, s3)


def uses_safe_path(safe_gate: bool, use_gate_in_kernel: bool, lower_bound: float | None) -> bool:
    """SAFE pairwise path when the log-decay is known to be >= -5 per token."""
    return bool(safe_gate) or (use_gate_in_kernel and lower_bound is not None and lower_bound >= -5.0)


def chunk_kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    plan: KDAPlan | None = None,
    save_checkpoints: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the chunked KDA forward kernel on validated inputs.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta
    ``[B, T, HV]`` (contiguous; fp16/bf16/fp32); A_log ``[HV]``, dt_bias ``[HV*K]`` (fp32);
    initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first; fp32 or bf16, any
    strides); cu_seqlens int32/int64 ``[N + 1]`` with B = 1.

    Returns ``o`` ``[B, T, HV, V]`` in v's dtype, the final state (fp32, requested layout)
    or None, and the checkpoints fp32 ``[plan.num_checkpoints, HV, K, V]`` or None (see
    ``plan.checkpoint_offsets`` for their rows). ``plan`` defaults to ``plan_kda`` of the
    shapes (it fixes the checkpoint cadence and the V block).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton forward, got strides {tuple(t.stride())}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32 for the Triton forward, got {q.dtype}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton forward supports K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}")
    if plan is None:
        plan = plan_kda(q, v, cu_seqlens=cu_seqlens, initial_state=initial_state is not None,
                        output_final_state=output_final_state, gate_params=A_log is not None)
    if (plan.B, plan.T, plan.H, plan.HV, plan.K, plan.V) != (B, T, H, HV, K, V):
        raise ValueError(
            f"plan was made for B,T,H,HV,K,V = {(plan.B, plan.T, plan.H, plan.HV, plan.K, plan.V)}, "
            f"got {(B, T, H, HV, K, V)}"
        )
    N = plan.num_sequences
    L = plan.checkpoint_every_n_tokens
    BK, BV = block_size(K), min(plan.block_v, block_size(V))
    dev = q.device

    o = torch.empty_like(v)
    final = None
    if output_final_state:
        final = torch.empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32, device=dev)
    ckpts = offsets = None
    if save_checkpoints:
        offsets = checkpoint_offsets(cu_seqlens, B=B, T=T, every_n_tokens=L, device=dev)
        ckpts = torch.empty((plan.num_checkpoints, HV, K, V), dtype=torch.float32, device=dev)
    if N * HV == 0 or T == 0:
        if final is not None:
            final.copy_(_initial_or_zeros(initial_state, final))
        return o, final, ckpts

    h0_strides = _state_strides(initial_state, state_v_first) if initial_state is not None else (0, 0, 0, 0)
    ht_strides = _state_strides(final, state_v_first) if final is not None else (0, 0, 0, 0)
    grid = (N * HV, triton.cdiv(V, BV))
    chunk_kda_fwd_kernel[grid](
        q, k, v, g, beta, A_log, dt_bias, initial_state, o, final, ckpts, cu_seqlens, offsets,
        float(scale), float(lower_bound) if lower_bound is not None else 0.0, T, H, HV,
        *h0_strides, *ht_strides, L,
        K=K, V=V, C=CHUNK_SIZE, BK=BK, BV=BV, BKS=min(EXACT_KEY_SLICE, BK),
        GATE=gate_mode(use_gate_in_kernel, lower_bound),
        HAS_A_LOG=A_log is not None and use_gate_in_kernel,
        HAS_BIAS=dt_bias is not None and use_gate_in_kernel,
        USE_L2NORM=bool(use_qk_l2norm_in_kernel), BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
        NEG_EIGVAL=bool(allow_neg_eigval and use_beta_sigmoid_in_kernel),
        SAFE=uses_safe_path(safe_gate, use_gate_in_kernel, lower_bound),
        IS_VARLEN=cu_seqlens is not None, HAS_H0=initial_state is not None, STORE_HT=final is not None,
        STORE_CKPT=ckpts is not None, DOT_PREC=_dot_precision(q.dtype), INV_DOUBLING=USE_DOUBLING_INVERSE,
        LOOP_WHILE=triton_interpreting(),
        num_warps=fwd_num_warps(BK, BV), num_stages=FWD_NUM_STAGES,
    )
    return o, final, ckpts


def _initial_or_zeros(initial_state, like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros_like(like)
    return initial_state.to(torch.float32)
