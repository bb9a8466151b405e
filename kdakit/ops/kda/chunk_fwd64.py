"""Experimental forward of chunked KDA at 64-token chunks (``KDAKIT_CHUNK_PIPELINE=chunk64``; the default is
the 16-token forward of ``chunk_fwd.py``): the prep stage of ``chunk_prep64.py``, then one serial kernel.

Per chunk of C = 64 tokens, with S ``[K, V]`` the state entering it (fp32)::

    U = Tinv (beta v)    V' = U - W S    O = scale (qΓ S + Aqk V')    S <- exp(g_C) S + kd^T V'

``chunk_kda_fwd64_state_kernel``, grid ``(N * HV, cdiv(V, BV))``: one program walks its sequence for a block
of value columns; a step loads Tinv, W, kd, qΓ, Aqk, exp(g_C) (stored by the prep stage) and its v
columns, and writes its o columns. Saves nothing for backward (the 64-token backward recomputes).

Status: exact to fp32 round-off under the interpreter (``tests/test_chunk_bwd64.py``); not yet run on a GPU.
Temporaries: Tinv, Aqk ``[B, T, HV, C]`` and W, kd, qΓ ``[B, T, HV, K]`` in the token dtype, exp(g_C)
fp32 ``[chunks, HV, K]``, freed on return. Layouts as ``chunk_fwd.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdakit.ops.kda.chunk_common import store_matrix
from kdakit.ops.kda.chunk_prep64 import (
    Chunk64Options,
    chunk64_tables,
    locate_sequence,
    run_prep,
    state_recurrence,
    state_row,
    state_strides,
)
from kdakit.ops.kda.chunk_tiles import CHUNK

STATE_NUM_WARPS = 8
STATE_BLOCK_V = 64


@triton.jit
def chunk_kda_fwd64_state_kernel(
    v, beta, o, w, kd, qg, aqk, tinv, egc, h0, ht, cu_seqlens, chunk_offsets, scale, T, HV, NTS,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v, s_ht_n, s_ht_h, s_ht_k, s_ht_v,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
    LOOP_WHILE: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos, seq_len, c0 = locate_sequence(i_n, cu_seqlens, chunk_offsets, T, NTS, IS_VARLEN)
    v0 = i_v * BV
    tok_k = (bos * HV + i_hv) * K
    tok_v = (bos * HV + i_hv) * V
    tok_c = (bos * HV + i_hv) * C
    S = state_recurrence(state_row(h0, i_n, i_hv, s_h0_n, s_h0_h, HAS_H0), s_h0_k, s_h0_v, c0, i_hv, seq_len, HV, v0,
                         scale, v + tok_v, beta + bos * HV + i_hv, w + tok_k, kd + tok_k, tinv + tok_c, egc,
                         qg + tok_k, aqk + tok_c, o + tok_v, None, K, V, C, BK, BV, BETA_SIGMOID, NEG_EIGVAL, OP_BF16,
                         EMULATE_BF16, DOT_PREC, True, False, HAS_H0, LOOP_WHILE)
    if STORE_HT:
        store_matrix(ht + i_n.to(tl.int64) * s_ht_n + i_hv * s_ht_h, S, s_ht_k, s_ht_v, K, V, v0, BK, BV)


def chunk_kda_fwd64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    seqlens,
    opts: Chunk64Options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o [B, T, HV, V] in v's dtype, final state fp32 in the requested layout or None)``.

    Shapes and layouts as ``chunk_fwd.chunk_kda_fwd``; ``opts`` from ``chunk64_options``."""
    ob = opts
    dev = q.device
    out = torch.empty_like(v)
    final = None
    if output_final_state:
        final = torch.empty((ob.N, ob.HV, ob.V, ob.K) if ob.state_v_first else (ob.N, ob.HV, ob.K, ob.V),
                            dtype=torch.float32, device=dev)
    pairs, firsts = chunk64_tables(ob, seqlens, dev)
    p = run_prep(q, k, g, beta, A_log, dt_bias, cu_seqlens, pairs, ob)
    cx = ob.constexprs
    if ob.N * ob.HV > 0:
        bv = min(STATE_BLOCK_V, ob.BV)
        chunk_kda_fwd64_state_kernel[(ob.N * ob.HV, triton.cdiv(ob.V, bv))](
            v, beta, out, p["w"], p["kd"], p["qg"], p["aqk"], p["tinv"], p["egc"], initial_state, final, cu_seqlens,
            firsts, ob.scale, ob.T, ob.HV, ob.NTS, *state_strides(initial_state, ob.state_v_first),
            *state_strides(final, ob.state_v_first),
            K=ob.K, V=ob.V, C=CHUNK, BK=ob.BK, BV=bv, BETA_SIGMOID=cx["BETA_SIGMOID"], NEG_EIGVAL=cx["NEG_EIGVAL"],
            IS_VARLEN=ob.varlen, HAS_H0=initial_state is not None, STORE_HT=final is not None,
            OP_BF16=cx["OP_BF16"], EMULATE_BF16=cx["EMULATE_BF16"], DOT_PREC=cx["DOT_PREC"],
            LOOP_WHILE=ob.interpreting, num_warps=STATE_NUM_WARPS, num_stages=1,
        )
    del p, pairs, firsts
    return out, final
