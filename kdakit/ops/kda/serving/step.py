"""The one-token decode step over a state pool: ``kda_decode``'s most frequent call, on its own kernel.

The math is the recurrence kernel's (``recurrent_forward._recurrent_kernel``, "the pool kernel" below, which
``decode.py`` launches; both call ``state_tile_step``) for one token per sequence, read and written in place to row ``state_indices[n]`` of a value-first pool ``[P, HV, V, K]`` (docs/spec.md §2.1)::

    S'  = S Diag(exp(a))        (S^T tile [BV, K], fp32)
    u   = beta (v - S' k)
    S   = S' + u k^T            (rounded to bf16 for a bf16 pool)
    o   = scale * S q

Why a second kernel: a step is bound by the pool's bytes (it reads and writes ``2 N HV V K`` state
elements once), and what separates the pool kernel from a copy at N = 64 is latency per program, not
bytes (docs/perf_notes.md, "Decode"). This kernel gives each program one ``[BV, K]`` tile on a 1-D grid,
with no token loop and no element masks (K a power of two, BV dividing V), requests the token's inputs
before the row index and the state that depends on it, and reads the state ``evict_first`` and writes it
with streaming stores, since each byte is touched once (its times against the pool kernel's and a copy's:
docs/perf_notes.md, "Decode").

PyTorch twin: ``decode.pool_recurrent_reference``, the pool kernel's, whose semantics this kernel keeps
(tests/ops/kda/serving/test_step.py checks the two kernels' bits against each other).

Limits (``step_kernel_applies``): one token per sequence, ``[N]`` indices, the pool updated in place,
value-first, K a power of two <= 256, V a multiple of the tile. Everything else runs on the pool kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk_common import round_to_bf16_if
from kdakit.ops.kda.recurrent.kernels import MAX_HEAD_DIM, state_tile_step, token_activations

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

# [8, K] tiles on one warp: at 64 registers, 32 one-warp programs an SM (the block limit) fill the register file;
# more warps a tile make the K reductions cross warps (the sweep and counters: docs/perf_notes.md, "Decode").
STEP_BLOCK_V = 8
STEP_NUM_WARPS = 1


def step_kernel_applies(*, T: int, cu_seqlens, state_indices, h0, ht, write_final_to_read_row: bool,
                        state_v_first: bool, K: int, V: int, block_v: int | None) -> bool:
    """Whether a pool launch is a one-token in-place step that this kernel runs."""
    bv = STEP_BLOCK_V if block_v is None else block_v
    return (T == 1 and cu_seqlens is None and state_indices is not None and state_indices.dim() == 1
            and h0 is not None and h0 is ht and write_final_to_read_row and state_v_first
            and K == triton.next_power_of_2(K) and K <= MAX_HEAD_DIM and V % bv == 0)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["P"])
def _pool_step_kernel(
    q, k, v, g, beta, A_log, dt_bias, pool, state_indices, o,
    scale, lower_bound, P, row_stride, idx_stride,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_gh, s_bb, s_bh, s_ob, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    ROUND_STATE: tl.constexpr, ROUND_STORE: tl.constexpr, NATIVE_ROUND: tl.constexpr,
    L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, BETA: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
):
    tl.static_assert(STATE_V_FIRST, "the step kernel reads value-first pools (step_kernel_applies)")
    NVT: tl.constexpr = V // BV
    pid = tl.program_id(0).to(tl.int64)          # (n, hv, v-block), v-block fastest: neighbours share a row
    i_n = pid // (HV * NVT)
    i_hv = (pid // NVT) % HV
    i_v = pid % NVT
    i_h = i_hv // (HV // H)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)

    # the token's inputs first: they do not wait on the row index, the state does. Token tensors through their
    # (batch, head) strides (one token: the token stride is never used), int64 offsets.
    b_q = tl.load(q + i_n * s_qb + i_h * s_qh + offs_k).to(tl.float32)                    # [K]
    b_k = tl.load(k + i_n * s_kb + i_h * s_kh + offs_k).to(tl.float32)                    # [K]
    b_g = tl.load(g + i_n * s_gb + i_hv * s_gh + offs_k).to(tl.float32)                   # [K]
    b_v = tl.load(v + i_n * s_vb + i_hv * s_vh + offs_v).to(tl.float32)                   # [BV]
    b_beta = tl.load(beta + i_n * s_bb + i_hv * s_bh).to(tl.float32)
    slot = tl.load(state_indices + i_n * idx_stride).to(tl.int64)
    # -1 marks a padded sequence; out-of-range rows are treated the same (no access outside the pool)
    valid = (slot >= 0) & (slot < P)
    offs_s = (i_hv * V + offs_v[:, None]) * K + offs_k[None, :]                           # [BV, K]
    row = pool + slot * row_stride
    S = tl.load(row + offs_s, mask=valid, other=0.0, eviction_policy="evict_first").to(tl.float32)

    b_q, b_k, b_a, b_beta = token_activations(b_q, b_k, b_g, b_beta, A_log, dt_bias, i_hv, offs_k, offs_k < K,
                                              lower_bound, K, L2NORM, GATE, HAS_A, HAS_BIAS, BETA)
    S, _, b_o = state_tile_step(S, b_q, b_k, b_v, b_a, b_beta, scale, ROUND_STATE, NATIVE_ROUND)
    tl.store(o + i_n * s_ob + i_hv * s_oh + offs_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty))
    tl.store(row + offs_s, round_to_bf16_if(S, ROUND_STORE).to(pool.dtype.element_ty), mask=valid,
             cache_modifier=".cs")


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def _batch_head_strides(x: torch.Tensor) -> tuple[int, int]:
    """(batch, head) element strides of a one-token ``[N, 1, heads, ...]`` tensor."""
    return x.stride(0), x.stride(2)


def launch_pool_step(q, k, v, g, beta, o, opts, *, pool: torch.Tensor, state_indices: torch.Tensor,
                     round_state: bool, A_log, dt_bias, N: int, block_v: int | None = None,
                     num_warps: int | None = None, maxnreg: int | None = None) -> None:
    """One token per sequence, row ``state_indices[n]`` of ``pool`` read and written in place.

    ``opts``: the call's ``KDAOptions`` (its kernel encodings); ``A_log`` / ``dt_bias``: the flat views of the
    in-kernel gate's parameters (None without it); ``block_v`` / ``num_warps`` / ``maxnreg`` (ptxas's register
    cap): benchmarks' sweeps."""
    if N == 0:
        return
    _, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BV = STEP_BLOCK_V if block_v is None else block_v
    dummy = q  # pointer for absent optional tensors; never dereferenced (constexpr flags)
    _pool_step_kernel[(N * HV * (V // BV),)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        pool, state_indices, o, opts.scale, opts.kernel_lower_bound, pool.shape[0], pool.stride(0),
        state_indices.stride(0), *_batch_head_strides(q), *_batch_head_strides(k), *_batch_head_strides(v),
        *_batch_head_strides(g), *_batch_head_strides(beta), *_batch_head_strides(o),
        H=H, HV=HV, K=K, V=V, BV=BV, ROUND_STATE=round_state,
        ROUND_STORE=pool.dtype == torch.bfloat16 and not round_state, NATIVE_ROUND=not triton_interpreting(),
        **opts.recurrent_constexprs(), num_warps=STEP_NUM_WARPS if num_warps is None else num_warps,
        maxnreg=maxnreg,
    )
