"""The 64-token pipelines' allocations (kdakit/ops/kda/chunk/: forward.py, backward.py, autograd.py allocate exactly
this), for ``plan.plan_kda(pipeline="chunk64" | "chunk64_fast")``: shapes alone, no tensors, no kernel import.
"""

from __future__ import annotations

from typing import Sequence

import torch

CHUNK64 = 64
PAIR_WIDTH = 2 * CHUNK64  # a token's row of its chunk's aqk and tinv, in the token dtype


def pairs_in_gradient(K: int, dtype: torch.dtype, g_dtype: torch.dtype) -> bool:
    """Whether the pairs of a call with a backward live in g's gradient rows (``chunk.forward.pair_rows``): a dg row
    (K elements of g's dtype) holds a token's aqk and tinv rows (``PAIR_WIDTH`` of the token dtype)."""
    return K * g_dtype.itemsize >= PAIR_WIDTH * dtype.itemsize


def chunk64_windows(lengths: Sequence[int], window_tokens: int) -> tuple[int, int, int, int]:
    """``(n_chunks, n_windows, max_slots, nonempty windows)`` of the chunk plan (``chunk.plan.make_chunk_plan``):
    window w holds chunks ``[w * wc, (w + 1) * wc)`` of every sequence; max_slots is the largest window's row count."""
    rows = chunk64_window_rows(lengths, window_tokens)
    return sum(rows), len(rows), max(rows), sum(1 for r in rows if r)


def chunk64_window_rows(lengths: Sequence[int], window_tokens: int) -> list[int]:
    """Each window's row count in the chunk plan (``chunk.plan.make_chunk_plan``)."""
    counts = [-(-int(n) // CHUNK64) for n in lengths]
    wc = window_tokens // CHUNK64
    n_windows = max(-(-max(counts, default=0) // wc), 1)
    return [sum(max(min((w + 1) * wc, c) - w * wc, 0) for c in counts) for w in range(n_windows)]


def _bytes(slots: list) -> int:
    total = 0
    for _, shape, dt in slots:
        n = dt.itemsize
        for d in shape:
            n *= d
        total += n
    return total


def chunk64_forward_groups(window_rows: Sequence[int], *, B: int, T: int, H: int, HV: int, K: int, V: int,
                           dtype: torch.dtype, g_dtype: torch.dtype) -> tuple[tuple[tuple[int, int], ...], int]:
    """The recomputing forward's groups of consecutive windows, ``(((w0, w1), ...), the largest group's rows)``.

    The forward runs its state-independent stages (prep, intra, wu) once per group, over every row of the
    group's windows, and then walks the group's windows in one launch (each window's checkpoint is the state
    entering it). Larger groups mean fewer, fuller launches. The forward's slots are free memory up to what the
    backward holds at its peak and the forward does not: the backward's own slots of the largest window and
    the five token gradients. A group's rows stay within ``max_slots + (backward slots + gradients) / forward
    bytes a row``, so the forward's slots never exceed the backward's scratch plus the gradients, and the
    forward does not set the step's peak; of the fewest groups that fit, the rows are spread as evenly as the
    windows allow."""
    max_slots = max(window_rows, default=0)
    per_row = _bytes(chunk64_forward_slots(1, H, HV, K, V, dtype, states=False))
    bwd = _bytes(chunk64_backward_slots(max_slots, HV, K, V, dtype))
    # the gradients the forward does not hold already: dg is the forward's pair tensor when the pairs fit in it
    dg = 0 if pairs_in_gradient(K, dtype, g_dtype) else HV * K * g_dtype.itemsize
    grads = B * T * (2 * H * K * dtype.itemsize + dg + HV * V * dtype.itemsize + HV * dtype.itemsize)
    cap = max_slots + (bwd + grads) // per_row
    # the fewest groups that fit, then as even as the windows allow (smaller slots for the same launches)
    fewest = len(_greedy_groups(window_rows, cap))
    target = max(-(-sum(window_rows) // fewest), max_slots)
    while len(groups := _greedy_groups(window_rows, target)) > fewest:
        target += 1
    largest = max(sum(window_rows[w0:w1]) for w0, w1 in groups)
    return groups, largest


def _greedy_groups(window_rows: Sequence[int], cap: int) -> tuple[tuple[int, int], ...]:
    """Consecutive windows, each group filled while its rows stay <= cap (a window alone may exceed it)."""
    groups, start, rows = [], 0, 0
    for w, n in enumerate(window_rows):
        if w > start and rows + n > cap:
            groups.append((start, w))
            start, rows = w, 0
        rows += n
    groups.append((start, len(window_rows)))
    return tuple(groups)


def chunk64_forward_slots(n: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, states: bool = True,
                          intra_scratch: bool = True) -> list:
    """``(name, shape, dtype)`` of ``chunk.forward.forward_slots`` for n rows, in its order."""
    f32, C = torch.float32, CHUNK64
    slots = [("gc", (n, HV, C, K), f32), ("bt", (n, HV, C), f32), ("rq", (n, H, C), f32), ("rk", (n, H, C), f32)]
    if intra_scratch:
        slots.append(("akk_d", (n, HV, C, 16), f32))
    slots += [("w", (n, HV, C, K), dtype), ("qg", (n, HV, C, K), dtype), ("kd", (n, HV, C, K), dtype),
              ("u", (n, HV, C, V), dtype)]
    return slots + [("h", (n, HV, K, V), dtype)] if states else slots


def chunk64_backward_slots(n: int, HV: int, K: int, V: int, dtype: torch.dtype) -> list:
    """``(name, shape, dtype)`` of ``chunk.backward.backward_slots`` for n rows, in its order."""
    f32, C = torch.float32, CHUNK64
    return [("dh", (n, HV, K, V), dtype), ("daqk", (n, HV, C, C), f32), ("dvs", (n, HV, C, V), f32),
            ("dakk", (n, HV, C, C), f32), ("dqh", (n, HV, C, K), f32), ("dkh", (n, HV, C, K), f32),
            ("dgs", (n, HV, C, K), f32), ("dgc", (n, HV, K), f32), ("dbs", (n, HV, C), f32)]


def chunk64_step(add, free, events, *, pipeline, B, T, H, HV, K, V, N, dtype, g_dtype, n_rows, n_windows,
                 max_slots, forward_slots, initial_state, initial_state_dtype, output_final_state,
                 gate_params) -> list[str]:
    """The step after the caller's tensors, allocation by allocation in program order (``chunk64_kda``), through
    ``add`` / ``free`` / ``events`` (``plan._recorder``); returns the names of the backward's scratch.

    * resident: the memoized chunk plan's device tensors (``make_chunk_plan``: the table int32 ``[chunks, 4]`` and
      ``seq_rows`` int32 ``[windows, N, 2]``), built by a call's first step and kept by the plan cache across
      calls, so they are live through every step (allocated first here, never freed);
    * forward (``chunk_fwd``): o; the fp32 state carry (zeros, or the initial state's fp32 copy: a bf16 state
      goes through an fp32 cast first); ``chunk64``: the fp32 checkpoints ``[windows, N, HV, K, V]``; both: aqk,
      tinv of every chunk in token layout (saved: ``ctx.kept``), in the buffer that the backward returns as dg
      when a dg row holds a token's pair rows (``pairs_in_gradient``), else ``[B, T, HV, 2C]`` of their own;
      then ``chunk64``: the other slots of the largest group of windows (``chunk64_forward_groups``; no per-chunk
      states; freed at return); ``chunk64_fast``: the slots of every chunk (saved: the backward reads them).
      The carry is the final state when one is returned, else freed;
    * backward (``chunk_bwd``): dq, dk, dg (unless the pairs' buffer is it), dv, dbeta; ``chunk64``: the forward
      slots again but akk_d (one window: the backward reads the saved aqk, tinv and runs no intra stage); the
      backward slots (one window); with the gate's parameters their per-chunk partials for every chunk of the
      call (fp32 ``[chunks, HV]`` and ``[chunks, HV, K]``); the fp32 dS carry (which is dh0; the recomputing walk
      starts from each window's checkpoint in place); after the last window dA_log ``[HV]`` and ddt_bias
      ``[HV, K]``, the partials' sums; at return the slots, partials and carries go, then the kept slots and
      pairs of their own (``ctx.kept = None``), then dh0's cast to a bf16 initial state's dtype; the saved
      tensors are released after the backward returns.

    dq and dk come out of the finishing kernel already summed over a GVA group (no per-value-head partials
    beyond the window's dqh / dkh slots)."""
    f32, i32 = torch.float32, torch.int32
    keep = pipeline == "chunk64_fast"
    state = (N, HV, K, V)
    add("chunk_table", (n_rows, 4), i32, "workspace", "forward")
    add("chunk_seq_rows", (n_windows, N, 2), i32, "workspace", "forward")

    # forward
    add("o", (B, T, HV, V), dtype, "inputs/dO/O", "forward")
    carry = "final_state" if output_final_state else "fwd_state_carry"
    carry_group = "inputs/dO/O" if output_final_state else "workspace"
    if initial_state and initial_state_dtype != f32:
        add("fwd_initial_state_fp32", state, f32, "workspace", "forward")
        add(carry, state, f32, carry_group, "forward")
        free("fwd_initial_state_fp32")
    else:
        add(carry, state, f32, carry_group, "forward")
    if not keep:
        add("checkpoints", (n_windows,) + state, f32, "state checkpoints", "saved")
    # the pairs (aqk, tinv) of every chunk in token layout: in the buffer that becomes dg when they fit
    in_dg = pairs_in_gradient(K, dtype, g_dtype)
    if in_dg:
        add("dg", (B, T, HV, K), g_dtype, "gradient outputs", "saved")
    else:
        add("saved_pairs", (B, T, HV, PAIR_WIDTH), dtype, "saved forward activations", "saved")
    fwd_slots = ["fwd_" + name for name, _, _ in chunk64_forward_slots(0, H, HV, K, V, dtype, states=keep)]
    for name, shape, dt in chunk64_forward_slots(n_rows if keep else forward_slots, H, HV, K, V, dtype, states=keep):
        if keep:
            add("fwd_" + name, shape, dt, "saved forward activations", "saved")
        else:
            add("fwd_" + name, shape, dt, "recompute intermediates", "forward")
    events.append(("mark", "forward"))
    if not keep:
        free(*fwd_slots)
    if not output_final_state:
        free(carry)
    else:
        # autograd hands a zero cotangent for an unused final state
        add("d_final_state", state, f32, "inputs/dO/O", "backward")

    # backward
    grads = [("dq", (B, T, H, K), dtype), ("dk", (B, T, H, K), dtype), ("dg", (B, T, HV, K), g_dtype),
             ("dv", (B, T, HV, V), dtype), ("dbeta", (B, T, HV), dtype)]
    for name, shape, dt in grads:
        if not (in_dg and name == "dg"):
            add(name, shape, dt, "gradient outputs", "backward")
    scratch = []
    if not keep:
        for name, shape, dt in chunk64_forward_slots(max_slots, H, HV, K, V, dtype, intra_scratch=False):
            add("bwd_" + name, shape, dt, "recompute intermediates", "backward")
            scratch.append("bwd_" + name)
    for name, shape, dt in chunk64_backward_slots(max_slots, HV, K, V, dtype):
        add("bwd_" + name, shape, dt, "stage buffers", "backward")
        scratch.append("bwd_" + name)
    if gate_params:
        add("dA_log_rows", (n_rows, HV), f32, "stage buffers", "backward")
        add("ddt_bias_rows", (n_rows, HV, K), f32, "stage buffers", "backward")
        scratch += ["dA_log_rows", "ddt_bias_rows"]
    h0_cast = initial_state and initial_state_dtype != f32
    if not initial_state:
        dcarry = "bwd_state_grad_carry"
        add(dcarry, state, f32, "workspace", "backward")
        scratch.append(dcarry)
    else:
        add("d_initial_state_fp32" if h0_cast else "d_initial_state", state, f32,
            "stage buffers" if h0_cast else "gradient outputs", "backward")
    if gate_params:
        add("dA_log", (HV,), f32, "gradient outputs", "backward")
        add("ddt_bias", (HV, K), f32, "gradient outputs", "backward")
    events.append(("mark", "backward kernels"))
    free(*scratch)
    if keep:
        free(*fwd_slots)
    if not in_dg:
        free("saved_pairs")
    if h0_cast:
        add("d_initial_state", state, initial_state_dtype, "gradient outputs", "backward")
        events.append(("mark", "initial-state gradient cast"))
        free("d_initial_state_fp32")
    if not keep:
        free("checkpoints")
    if output_final_state:
        free("d_final_state")
    events.append(("mark", "backward end"))
    return scratch
