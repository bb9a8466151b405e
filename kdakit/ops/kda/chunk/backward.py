"""Backward of the 64-token chunk pipeline (docs/chunk_pipeline.md), window by window, last first: recompute
the window's intermediates and states from its checkpoint, then dAv, the reverse state-gradient walk (dS
carried from window to window), the per-chunk gradient kernels, and the finishing transforms that write
every gradient once in its input's dtype.
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.chunk.finish import partial_sums, run_finish
from kdakit.ops.kda.chunk.forward import forward_slots, window_intermediates
from kdakit.ops.kda.chunk.grads import run_grads_wy
from kdakit.ops.kda.chunk.grads_intra import run_grads_intra
from kdakit.ops.kda.chunk.plan import ChunkPlan
from kdakit.ops.kda.chunk.tiles import CHUNK
from kdakit.ops.kda.chunk.walk import run_dav, run_walk_bwd, run_walk_fwd
from kdakit.ops.kda.options import KDAOptions


def backward_slots(n: int, HV: int, K: int, V: int, dtype: torch.dtype, device) -> dict:
    """The backward's own slot tensors for a window of n chunks (docs/chunk_pipeline.md)."""
    f32 = torch.float32
    return dict(
        dh=torch.empty(n, HV, K, V, dtype=dtype, device=device),
        daqk=torch.empty(n, HV, CHUNK, CHUNK, dtype=f32, device=device),
        dvs=torch.empty(n, HV, CHUNK, V, dtype=f32, device=device),
        dakk=torch.empty(n, HV, CHUNK, CHUNK, dtype=f32, device=device),
        dqh=torch.empty(n, HV, CHUNK, K, dtype=f32, device=device),
        dkh=torch.empty(n, HV, CHUNK, K, dtype=f32, device=device),
        dgs=torch.empty(n, HV, CHUNK, K, dtype=f32, device=device),
        dgc=torch.empty(n, HV, K, dtype=f32, device=device),
        dbs=torch.empty(n, HV, CHUNK, dtype=f32, device=device),
    )


def chunk_bwd(q, k, v, g, beta, do, dht, *, opts: KDAOptions, plan: ChunkPlan, checkpoints, A_log, dt_bias,
              initial_state, saved: dict, keep: bool):
    """-> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0): input dtypes; dA_log / ddt_bias fp32 (None without the
    in-kernel gate's parameters); dh0 fp32 in the call's layout (None without an initial state). ``saved``: the
    forward's ``chunk_fwd`` returned: aqk, tinv (token layout) and the dg buffer they live in (or None); with
    ``keep`` every slot of the whole call too, read instead of recomputing each window's; else a window recomputes
    prep, wu and its states."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    # the forward's pairs may live in dg's rows (forward.pair_rows): each window's are read before its rows are
    dg = saved["dg"] if saved["dg"] is not None else torch.empty_like(g)
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    pairs = saved["aqk"], saved["tinv"]
    s = None if keep else forward_slots(plan.max_slots, H, HV, K, V, q.dtype, dev, intra_scratch=False)
    b = backward_slots(plan.max_slots, HV, K, V, q.dtype, dev)
    # the gate parameters' per-chunk partials for the whole call, summed once after the last window
    n_rows = plan.table.shape[0]
    dalog_rows = torch.empty(n_rows, HV, dtype=torch.float32, device=dev) if A_log is not None else None
    dbias_rows = torch.empty(n_rows, HV, K, dtype=torch.float32, device=dev) if dt_bias is not None else None
    launch = plan.launch
    dcarry = torch.zeros(plan.n_seqs, HV, K, V, dtype=torch.float32, device=dev)
    if dht is not None:
        dcarry.copy_(dht.transpose(-1, -2) if opts.state_v_first else dht)
    for w in reversed(range(plan.n_windows)):
        r0, r1 = plan.window_rows[w]
        if r1 == r0:
            continue
        rows, n = plan.table[r0:r1], r1 - r0
        if keep:
            x = {name: t[r0:r1] for name, t in saved.items() if name not in ("aqk", "tinv", "dg")}
            x["aqk"], x["tinv"] = pairs
        else:
            x = window_intermediates(opts, rows, s, pairs, q, k, v, g, beta, A_log, dt_bias, intra=False,
                                     launch=launch)
            # the window's states from its checkpoint, which stays as it is (store_carry=False)
            run_walk_fwd(opts, rows, plan.seq_rows[w:w + 1], x["w"], x["u"], x["qg"], x["kd"], x["aqk"], x["gc"],
                         checkpoints[w], x["h"], None, row0=r0, store_carry=False, launch=launch)
        y = {name: t[:n] for name, t in b.items()}
        run_dav(opts, rows, do, x["u"], x["aqk"], y["daqk"], y["dvs"], launch=launch)
        run_walk_bwd(opts, rows, plan.seq_rows[w], x["w"], x["qg"], x["kd"], x["gc"], do, dcarry, y["dh"], y["dvs"],
                     row0=r0, launch=launch)
        run_grads_wy(opts, rows, q, k, v, do, x["gc"], x["bt"], x["rq"], x["rk"], x["tinv"], x["w"], x["qg"],
                     x["kd"], x["u"], y["dvs"], x["h"], y["dh"], dv, y["dqh"], y["dkh"], y["dgs"], y["dgc"], y["dbs"],
                     y["dakk"], launch=launch)
        run_grads_intra(opts, rows, q, k, x["gc"], x["bt"], x["rq"], x["rk"], y["daqk"], y["dakk"], y["dqh"],
                        y["dkh"], y["dgs"], y["dbs"], launch=launch)
        run_finish(opts, rows, q, k, g, beta, A_log, dt_bias, x["rq"], x["rk"], y["dqh"], y["dkh"], y["dgs"],
                   y["dgc"], y["dbs"], dq, dk, dg, dbeta, dalog_rows[r0:r1] if dalog_rows is not None else None,
                   dbias_rows[r0:r1] if dbias_rows is not None else None, launch=launch)
    dA_log = partial_sums(dalog_rows, launch=launch) if dalog_rows is not None else None
    ddt_bias = partial_sums(dbias_rows, launch=launch) if dbias_rows is not None else None
    dh0 = None
    if initial_state is not None:
        dh0 = dcarry.transpose(-1, -2) if opts.state_v_first else dcarry
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
