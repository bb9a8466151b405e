"""bench_recurrent.py's launch-config sweep (``--sweep``) and speculative-decoding cells (``--spec-n``),
with their helpers; bench_recurrent.py's docstring describes both. Not a script: bench_recurrent.py
imports this module, re-exports its names (``bench_recurrent.sweep_decode``, ``.bench_speculative``,
``.SWEEP_WARMUP``, ...) and binds itself to it.

The timing, device and decode helpers these cells share with bench_recurrent.py's other cells
(``median_ms``, ``graphed``, ``DEV``, ``_decode_inputs``, ``_decode_reference``, ``_decode_gate``,
``_fla_decode_fn``, ``device_error_report``, ``decode_targets``, ``FLA_GATE_RATIO``) stay there and are
read from it at call time (``br = _bench()``, then ``br.median_ms(...)``), so that a test's
``monkeypatch.setattr(bench_recurrent, "median_ms", ...)`` reaches these cells as well.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from kdakit.ops.kda.serving.decode import decode_launch_config, decode_options, kda_decode, launch_kda_decode
from kdakit.ops.kda.serving.step import STEP_BLOCK_V, STEP_NUM_WARPS, step_kernel_applies

# Speculative decoding (issue #13 item 9): S tokens per sequence, state_indices [N, S], num_accepted_tokens [N]
SPEC_S = 4
SPEC_N = (64, 256)
SPEC_BYTES = ("the N pool rows read once (row state_indices[n, num_accepted_tokens[n] - 1]) plus the N * S rows "
              "written (row state_indices[n, t] after token t), HV * V * K state elements each; token inputs and "
              "outputs not counted")
# The launch-config grid of --sweep: around the defaults (serving/step.py's 8 x 1 for one-token steps, serving/decode.py's
# decode_launch_config 16 x 1 / 64 x 2 warps for the rest).
SWEEP_BLOCK_V = (4, 8, 16, 32, 64)
SWEEP_NUM_WARPS = (1, 2, 4, 8)
SWEEP_WARMUP = 5

_BENCH = None


def bind(bench) -> None:
    """Make ``bench`` (bench_recurrent's module object) the one that the cells read their helpers from."""
    global _BENCH
    _BENCH = bench


def _bench():
    """bench_recurrent's module, as bound (``__main__`` when bench_recurrent.py runs as a script, which is why
    this module does not import it)."""
    if _BENCH is None:
        raise RuntimeError("bench_recurrent_cells is driven by bench_recurrent.py: import bench_recurrent first")
    return _BENCH


# ---------------------------------------------------------------------------------------------
# Launch-config sweep (--sweep)
# ---------------------------------------------------------------------------------------------

def sweep_configs(V: int, block_v=SWEEP_BLOCK_V, num_warps=SWEEP_NUM_WARPS) -> list[tuple[int, int]]:
    """The (block_v, num_warps) grid for value dimension ``V``: block_v above V is left out, as the
    launcher clamps the tile to V and it would time a duplicate config."""
    if V < 1:
        raise ValueError(f"V must be >= 1, got {V}")
    return [(bv, nw) for bv in block_v if bv <= V for nw in num_warps]


def best_config(rows: list[dict]) -> dict | None:
    """The fastest timed row of one cell's sweep (rows that failed or were skipped have no graph_ms),
    with its speedup over serving/decode.py's default config when that was timed; None when none was timed."""
    timed = [r for r in rows if "graph_ms" in r]
    if not timed:
        return None
    best = min(timed, key=lambda r: r["graph_ms"])
    out = {n: best[n] for n in ("block_v", "num_warps", "graph_ms", "fraction_of_copy")}
    default = [r for r in timed if r.get("default")]
    if default:
        out["speedup_vs_default"] = default[0]["graph_ms"] / best["graph_ms"]
    return out


def overall_best(cells: list[dict]) -> dict:
    """Per state dtype, the config to make the default: the lowest geometric mean over that dtype's
    swept cells of (config time / the cell's fastest time), among configs timed in every such cell.
    ``cells``: decode rows carrying a ``sweep`` list."""
    by_dtype = {}
    for cell in cells:
        if cell.get("sweep") and "graph_ms" in (cell.get("sweep_best") or {}):
            by_dtype.setdefault(cell["state_dtype"], []).append(cell)
    out = {}
    for dtype, group in by_dtype.items():
        slowdowns = {}
        for cell in group:
            fastest = cell["sweep_best"]["graph_ms"]
            for r in cell["sweep"]:
                if "graph_ms" in r:
                    slowdowns.setdefault((r["block_v"], r["num_warps"]), []).append(r["graph_ms"] / fastest)
        complete = {c: s for c, s in slowdowns.items() if len(s) == len(group)}
        if not complete:
            out[dtype] = None
            continue
        geomean = {c: math.exp(sum(map(math.log, s)) / len(s)) for c, s in complete.items()}
        (bv, nw) = min(geomean, key=geomean.get)
        out[dtype] = {"block_v": bv, "num_warps": nw, "geomean_slowdown_vs_cell_best": geomean[(bv, nw)],
                      "worst_slowdown_vs_cell_best": max(complete[(bv, nw)]), "cells_N": [c["N"] for c in group]}
    return out


@dataclasses.dataclass
class SweepPlan:
    """What --sweep times, and the time it has left over all cells (spent as it runs)."""
    iters: int
    left_s: float
    warmup: int = SWEEP_WARMUP


def _launch_fn(t, opts, pool, idx, out, block_v, num_warps):
    """kda_decode's kernel at one launch config: kda_decode's own launcher (``kda_decode`` itself launches the
    default config: serving/step.py's for one-token steps, serving/decode.py's ``decode_launch_config`` otherwise),
    without kda_decode's validation."""
    N = t["q"].shape[0]
    kopts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"], **opts)
    A_log, dt_bias = kopts.kernel_gate_params(t["A_log"], t["dt_bias"])

    def run():
        launch_kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, None, out, kopts, A_log=A_log,
                          dt_bias=dt_bias, cu_seqlens=None, N=N, block_v=block_v, num_warps=num_warps)
    return run


def _sweep_one(t, opts, pool, idx, ref_o, ref_pool, block_v, num_warps, state_bytes, copy_GBps, plan) -> dict:
    """One config on its own copy of ``pool`` (freed on return, so the next config's 8 GiB copy at N=4096
    fp32 reuses its memory): a gated step, then the timed replays."""
    br = _bench()
    cfg_pool, cfg_o = pool.clone(), torch.empty_like(t["v"])
    run = _launch_fn(t, opts, cfg_pool, idx, cfg_o, block_v, num_warps)
    run()
    row = {}
    row["gate"], ok = br._decode_gate(ref_o, ref_pool, cfg_o, cfg_pool)
    if not ok:
        row["error"] = "correctness gate failed"
        return row
    replay, _graph = br.graphed(run)
    ms = br.median_ms(replay, warmup=plan.warmup, iters=plan.iters)
    row["graph_ms"] = ms
    row["fraction_of_copy"] = state_bytes / ms / 1e6 / copy_GBps
    return row


def sweep_decode(t, opts, pool, idx, ref_o, ref_pool, copy_GBps: float, plan: SweepPlan) -> list[dict]:
    """Each config of the grid on a copy of ``pool`` (left as it is): one step gated against the reference
    step (``ref_o``, ``ref_pool``) as the row's kda_decode step is, then CUDA-graph replays timed on that
    copy. Configs reached after the plan's time is spent are recorded as skipped."""
    state_bytes = 2 * pool.numel() * pool.element_size()
    start = time.monotonic()
    rows = []
    N, HV, V = t["v"].shape[0], t["v"].shape[2], t["v"].shape[3]
    # the config kda_decode itself would launch: serving/step.py's kernel when it takes the step, else the pool kernel's
    step = step_kernel_applies(T=t["v"].shape[1], cu_seqlens=None, state_indices=idx, h0=pool, ht=pool,
                               write_final_to_read_row=idx.dim() == 1, state_v_first=True, K=t["q"].shape[3], V=V,
                               block_v=None)
    default = (STEP_BLOCK_V, STEP_NUM_WARPS) if step else decode_launch_config(N, t["v"].shape[1], HV, V)
    try:
        for block_v, num_warps in sweep_configs(V):
            row = {"block_v": block_v, "num_warps": num_warps,
                   "default": (block_v, num_warps) == default}
            rows.append(row)
            if time.monotonic() - start >= plan.left_s:
                row["skipped"] = "the sweep's time budget (--sweep-budget-s) is spent"
                continue
            try:
                row.update(_sweep_one(t, opts, pool, idx, ref_o, ref_pool, block_v, num_warps, state_bytes,
                                      copy_GBps, plan))
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is recorded
                row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        # charged even when the cell dies (an error in bench_decode after a config), so later cells see it
        plan.left_s -= time.monotonic() - start
    return rows


# ---------------------------------------------------------------------------------------------
# Speculative decoding steps (--spec-n)
# ---------------------------------------------------------------------------------------------

def spec_indices(N: int, S: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step's rows over a pool of ``N * S`` rows, int32 on the CPU.

    ``state_indices`` ``[N, S]``: a random permutation of the pool's rows, so every row belongs to one
    sequence's column (contiguous: FLA's kernel reads entry ``[n, t]`` at ``n * stride(0) + t``, ignoring
    the token stride). ``num_accepted_tokens`` ``[N]``: the counts 1..S in turn, shuffled, so each count
    occurs ``N // S`` or ``N // S + 1`` times.
    """
    if N < 1 or S < 1:
        raise ValueError(f"N and S must be >= 1, got N={N}, S={S}")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(N * S, generator=gen).to(torch.int32).view(N, S)
    acc = (torch.arange(N) % S + 1)[torch.randperm(N, generator=gen)].to(torch.int32)
    return idx, acc


def spec_state_bytes(N: int, S: int, row_bytes: int) -> int:
    """State bytes one speculative step moves: each sequence's initial row read once, its S rows written."""
    return N * (1 + S) * row_bytes


def bench_speculative(N: int, pool_dtype: torch.dtype, copy_GBps: float, iters: int, S: int = SPEC_S,
                      H: int = 32, K: int = 128, V: int = 128) -> dict:
    """One speculative cell: ``kda_decode`` with ``[N, S]`` state_indices and num_accepted_tokens, gated
    against kda_decode_reference, timed as CUDA-graph replays (and eager calls), then FLA's call on the
    same rows, gated and timed the same way."""
    br = _bench()
    t, opts = br._decode_inputs(N, H, K, V, T=S)
    idx_cpu, acc_cpu = spec_indices(N, S)
    idx, acc = idx_cpu.to(br.DEV), acc_cpu.to(br.DEV)
    P = N * S
    gen = torch.Generator(device=br.DEV).manual_seed(1)
    pool = (0.3 * torch.randn(P, H, V, K, device=br.DEV, generator=gen)).to(pool_dtype)
    out = torch.empty_like(t["v"])
    state_bytes = spec_state_bytes(N, S, H * V * K * pool.element_size())
    counts = acc_cpu.tolist()
    block_v, num_warps = decode_launch_config(N, S, H, V)
    res = {"N": N, "S": S, "H": H, "HV": H, "K": K, "V": V, "state_dtype": str(pool_dtype).replace("torch.", ""),
           "pool_rows": P, "num_accepted_tokens_counts": {str(c): counts.count(c) for c in range(1, S + 1)},
           "state_bytes_read_plus_written": state_bytes, "state_bytes_counted": SPEC_BYTES,
           "kdakit_launch_config": {"block_v": block_v, "num_warps": num_warps}}

    # correctness gate: one step against the PyTorch reference on a copy of the pool (outputs and all rows)
    ref_o, ref_pool = br._decode_reference(t, opts, pool, idx, acc)
    gate_pool = pool.clone()
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], gate_pool, idx, A_log=t["A_log"],
                   dt_bias=t["dt_bias"], num_accepted_tokens=acc, **opts)
    res["gate"], ok = br._decode_gate(ref_o, ref_pool, o, gate_pool)
    del gate_pool, ref_o, ref_pool
    if not ok:
        res["error"] = "correctness gate failed"
        return res

    def ours():
        kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
                   num_accepted_tokens=acc, out=out, check_indices=False, **opts)

    replay, _graph = br.graphed(ours)
    ms = br.median_ms(replay, warmup=20, iters=iters)
    res["kdakit_graph_ms"] = ms
    res["kdakit_state_GBps"] = state_bytes / ms / 1e6
    res["kdakit_fraction_of_copy"] = res["kdakit_state_GBps"] / copy_GBps
    res["meets_target"] = br.decode_targets(res["kdakit_fraction_of_copy"], None)
    res["kdakit_eager_ms"] = br.median_ms(ours, warmup=10, iters=max(20, iters // 4))

    res["fla_semantics"] = (
        "fused_recurrent_kda_fwd(ssm_state_indices=[N, S], num_accepted_tokens, inplace_final_state=True, "
        "state_v_first=True): the same rows read and written as kda_decode's; a bf16 pool's running state is "
        f"rounded per token by kdakit and not by FLA (only its stored copies), so FLA is gated at {br.FLA_GATE_RATIO}")
    try:
        fla_pool = pool.clone()
        fla_out = torch.empty_like(out)
        ref2_o, ref2_pool = br._decode_reference(t, opts, fla_pool, idx, acc)
        run_fla = br._fla_decode_fn(t, opts, fla_pool, idx, fla_out, acc)
        run_fla()
        reps = [br.device_error_report("fla o", ref2_o, fla_out),
                br.device_error_report("fla state", ref2_pool, fla_pool)]
        del ref2_o, ref2_pool
        res["fla_gate"] = [str(r) for r in reps]
        if any(r.rms_ratio > br.FLA_GATE_RATIO for r in reps):
            res["fla_error"] = "FLA's speculative step disagrees with the reference (outputs or stored states)"
        else:
            replay_fla, _g2 = br.graphed(run_fla)
            fms = br.median_ms(replay_fla, warmup=20, iters=iters)
            res["fla_graph_ms"] = fms
            res["fla_state_GBps"] = state_bytes / fms / 1e6
            res["fla_fraction_of_copy"] = res["fla_state_GBps"] / copy_GBps
            res["kdakit_speedup_vs_fla"] = fms / ms
            res["meets_target"] = br.decode_targets(res["kdakit_fraction_of_copy"], res["kdakit_speedup_vs_fla"])
    except Exception as exc:  # noqa: BLE001 - record any FLA failure (not installed, API mismatch)
        res["fla_error"] = f"{type(exc).__name__}: {exc}"
    return res

