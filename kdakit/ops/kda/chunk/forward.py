"""Forward of the 64-token chunk pipeline (docs/chunk_pipeline.md): per window of chunks, the state-independent
stages (prep, intra, wu) in parallel over the window's chunks and value heads, then the state walk, which
carries each sequence's state from window to window and writes o.

Saved for the backward: the state entering every window (``checkpoints``, fp32 ``[n_windows, N, HV, K, V]``)
and the intra stage's outputs for every chunk (aqk and tinv in token layout, ``[B, T, HV, C]`` each in the token
dtype: 256 bytes a token and value head at 16 bits, held in g's gradient rows where they fit, ``pair_rows``);
the backward recomputes the rest of a window's intermediates (prep, wu, the states) from them. The forward runs its state-independent stages once per group of consecutive windows
(``ChunkPlan.forward_groups``: as many as fit in the memory the backward's scratch and gradients will need
anyway), then walks the group's windows in one launch, which also writes their checkpoints; its other scratch
(the slot tensors) is sized by the largest group and reused by every group. With ``keep=True`` (the plan's fast
workspace) every slot is sized by the whole call instead, each window writes its own rows, and the backward
reads them instead of recomputing (about 2.4 KB per token and value head at K = V = 128 in bf16).
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.chunk.intra import run_intra
from kdakit.ops.kda.chunk.plan import ChunkPlan
from kdakit.ops.kda.chunk.prep import run_prep, run_wu
from kdakit.ops.kda.chunk.tiles import CHUNK, SUB
from kdakit.ops.kda.chunk.walk import run_walk_fwd
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.plan_chunk64 import PAIR_WIDTH, pairs_in_gradient


def pair_rows(g: torch.Tensor, dtype: torch.dtype, in_gradient: bool) -> tuple:
    """aqk and tinv of every chunk of the call in token layout -> ``(aqk, tinv, dg)``: two views of one
    ``[B, T, HV, 2C]`` tensor in the token dtype, row t holding token t's row of its chunk's Aqk (columns
    ``[0, C)``) and Tinv (``[C, 2C)``); rows of a chunk beyond its length are not stored.

    ``in_gradient`` (a backward will come): when g's gradient rows are wide enough (``K * g.itemsize >= 2C *
    itemsize``: bf16 g or an fp32 log-decay at K = 128), the pair tensor is a view of the buffer that the
    backward returns as dg (``dg``, else None). The backward runs last window first and writes a window's dg rows
    only in its finishing kernel, after the window's last read of its pairs, so every pair is read before its
    memory is overwritten, and the pairs cost no memory beyond the gradients at the backward's peak."""
    B, T, HV, K = g.shape
    width = PAIR_WIDTH
    if in_gradient and pairs_in_gradient(K, dtype, g.dtype):
        dg = torch.empty(B, T, HV, K, dtype=g.dtype, device=g.device)
        pairs = dg.view(dtype)[..., :width]
    else:
        dg, pairs = None, torch.empty(B, T, HV, width, dtype=dtype, device=g.device)
    return pairs[..., :CHUNK], pairs[..., CHUNK:], dg


def forward_slots(n: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, device, states: bool = True,
                  intra_scratch: bool = True) -> dict:
    """The forward's slot tensors for n chunks (docs/chunk_pipeline.md, "Slot tensors"); ``states``: with the
    per-chunk states ``h``, which only a backward reads (the recomputing forward's walk stores no states);
    ``intra_scratch``: with akk_d, which only the intra stage uses (a backward that reads kept pairs has none).
    The pairs (aqk, tinv) are not slots: ``pair_rows`` holds them for the whole call."""
    f32 = torch.float32
    slots = dict(
        gc=torch.empty(n, HV, CHUNK, K, dtype=f32, device=device),
        bt=torch.empty(n, HV, CHUNK, dtype=f32, device=device),
        rq=torch.empty(n, H, CHUNK, dtype=f32, device=device),
        rk=torch.empty(n, H, CHUNK, dtype=f32, device=device),
    )
    if intra_scratch:
        slots["akk_d"] = torch.empty(n, HV, CHUNK, SUB, dtype=f32, device=device)
    slots.update(
        w=torch.empty(n, HV, CHUNK, K, dtype=dtype, device=device),
        qg=torch.empty(n, HV, CHUNK, K, dtype=dtype, device=device),
        kd=torch.empty(n, HV, CHUNK, K, dtype=dtype, device=device),
        u=torch.empty(n, HV, CHUNK, V, dtype=dtype, device=device),
    )
    if states:
        slots["h"] = torch.empty(n, HV, K, V, dtype=dtype, device=device)
    return slots


def window_intermediates(opts: KDAOptions, rows: torch.Tensor, s: dict, pairs: tuple, q, k, v, g, beta, A_log,
                         dt_bias, intra: bool = True, launch=None) -> dict:
    """prep, intra and wu of the chunk table's ``rows`` into the first ``len(rows)`` slots of ``s`` and the
    rows' tokens of ``pairs`` (aqk, tinv: ``pair_rows``); returns those slot views and the pairs. ``intra`` False:
    aqk and tinv already hold the rows' pairs (kept by the forward), only prep and wu run. ``launch``: the
    plan's launch overrides."""
    n = rows.shape[0]
    x = {name: t[:n] for name, t in s.items()}
    x["aqk"], x["tinv"] = pairs
    run_prep(opts, rows, q, k, g, beta, A_log, dt_bias, x["gc"], x["bt"], x["rq"], x["rk"], launch=launch)
    if intra:
        run_intra(opts, rows, q, k, x["gc"], x["bt"], x["rq"], x["rk"], x["aqk"], x["akk_d"], x["tinv"], launch=launch)
    run_wu(opts, rows, q, k, v, x["gc"], x["bt"], x["rq"], x["rk"], x["tinv"], x["w"], x["u"], x["qg"], x["kd"],
           launch=launch)
    return x


def state_carry(initial_state, N: int, HV: int, K: int, V: int, v_first: bool, device) -> torch.Tensor:
    """fp32 ``[N, HV, K, V]`` carry from the initial state (either layout) or zeros."""
    if initial_state is None:
        return torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    h0 = initial_state.transpose(-1, -2) if v_first else initial_state
    return h0.to(torch.float32).contiguous().clone()


def chunk_fwd(q, k, v, g, beta, *, opts: KDAOptions, plan: ChunkPlan, A_log, dt_bias, initial_state,
              keep: bool = False, save: bool = True):
    """-> (o ``[B, T, HV, V]`` in v's dtype, final state fp32 in the call's layout or None, the checkpoints (None
    when ``keep``), what the backward reads: a dict with the whole call's ``aqk`` and ``tinv`` (``pair_rows``),
    ``dg`` (the buffer they live in when it is g's gradient, else None) and, with ``keep``, every slot of the
    whole call; None when ``save`` is False, i.e. no backward will come)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    carry = state_carry(initial_state, plan.n_seqs, HV, K, V, opts.state_v_first, q.device)
    # kept slots: the backward reads them, so it needs no checkpoints, and every stage runs once over every chunk
    checkpoints = None if keep else torch.empty(plan.n_windows, *carry.shape, dtype=torch.float32, device=q.device)
    n_rows = plan.table.shape[0]
    aqk, tinv, dg = pair_rows(g, q.dtype, in_gradient=save)
    s = forward_slots(n_rows if keep else plan.forward_slots, H, HV, K, V, q.dtype, q.device, states=keep)
    if keep and n_rows:
        window_intermediates(opts, plan.table, s, (aqk, tinv), q, k, v, g, beta, A_log, dt_bias, launch=plan.launch)
    groups = ((0, plan.n_windows),) if keep else plan.forward_groups
    for w0, w1 in groups:
        g0, g1 = plan.window_rows[w0][0], plan.window_rows[w1 - 1][1]
        base = 0 if keep else g0
        x = {name: t[:g1 - base] for name, t in s.items()}
        if not keep and g1 > g0:
            # the group's state-independent stages in one launch each, into slots 0 .. g1 - g0
            window_intermediates(opts, plan.table[g0:g1], x, (aqk, tinv), q, k, v, g, beta, A_log, dt_bias,
                                 launch=plan.launch)
        # one walk over the group's windows, writing the state entering each window into its checkpoint
        run_walk_fwd(opts, plan.table[base:g1], plan.seq_rows[w0:w1], x["w"], x["u"], x["qg"], x["kd"], aqk,
                     x["gc"], carry, x.get("h"), o, row0=base,
                     checkpoints=checkpoints[w0:w1] if checkpoints is not None else None, launch=plan.launch)
    final = None
    if opts.output_final_state:
        final = carry.transpose(-1, -2).contiguous() if opts.state_v_first else carry
    saved = None
    if save:
        saved = dict(s) if keep else {}
        saved.update(aqk=aqk, tinv=tinv, dg=dg)
    return o, final, checkpoints, saved
