"""``plan_kda`` prices the 64-token pipelines exactly: the real ``chunk64_kda`` forward + backward (interpreter
kernels on tiny CPU tensors) runs inside an allocation tracker, and its running live total, its peak and its
sequence of allocations are compared with the plan's timeline for the same call.

The tracker (``AllocationTracker``) is a ``TorchDispatchMode``: every tensor an op returns whose storage it has
not seen is a new allocation of ``storage.nbytes()`` rounded up to 512 bytes (the CUDA caching allocator's
granule, which the plan models); a ``weakref.finalize`` on the storage records its release. The protocol's
caller tensors (inputs, dO) are allocated inside it too, in the plan's order, so the live totals compare from
the first byte. Zero-byte storages (the interpreter's argument wrappers) cost nothing and are not recorded.
Under the interpreter some launch frames end up in reference cycles that keep slot views alive until the cyclic
collector runs; the tracker runs it before recording each allocation, so what it counts as live is what
reference counting alone keeps (the device path's lifetimes). The objects that exist before the step are frozen
(``gc.freeze``) for its duration, so each collection walks only what the step created, not the whole test
process's heap; a cycle the collector then missed would keep a storage alive and fail the comparison, never
pass it.

The shapes are the smallest that reach each case's code paths (the interpreter's cost grows with the (chunk,
value head) rows); a step's tracked log is computed once per process (``_tracked``), so the perturbed-plan test
reuses the run of its case.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kdakit.ops.kda.chunk import plan as chunk_plan
from kdakit.ops.kda.chunk.autograd import chunk64_kda
from kdakit.ops.kda.chunk.backward import backward_slots
from kdakit.ops.kda.chunk.forward import forward_slots
from kdakit.ops.kda.options import kda_options
from kdakit.ops.kda.plan import (CHUNK64_WINDOW, DEFAULT_PIPELINE, chunk64_backward_slots, chunk64_forward_slots,
                                 gate_kind, plan_kda, resolve_pipeline)

GRANULE = 512
GATES = {
    "safe": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),
    "softplus": dict(use_gate_in_kernel=True, safe_gate=False, lower_bound=None),
    "raw": dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None),
}


class AllocationTracker(TorchDispatchMode):
    """Live bytes of every storage created under it (512-byte rounded), their peak, and the allocation log."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.allocs: list[tuple[int, int]] = []  # (rounded bytes, live total after it)

    def _see(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        s = t.untyped_storage()
        key = s._cdata
        if key in self.live:
            return
        n = s.nbytes()
        if n == 0:
            return
        gc.collect()
        size = -(-n // GRANULE) * GRANULE
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        self.allocs.append((size, self.current))
        weakref.finalize(s, self._free, key)

    def _free(self, key) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._see(t)
        return out


def _data(gate, *, B, T, H, HV, K, V, dtype, lengths, h0, h0_dtype, g_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    x = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, V), g=randn(B, T, HV, K, dt=g_dtype),
             beta=randn(B, T, HV))
    if gate == "raw":
        x["g"] = -torch.nn.functional.softplus(x["g"].double()).to(g_dtype)
    else:
        x["A_log"] = 0.3 * randn(HV, dt=torch.float32)
        x["dt_bias"] = 0.3 * randn(HV * K, dt=torch.float32)
    if lengths is not None:
        x["cu_seqlens"] = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    N = B if lengths is None else len(lengths)
    if h0:
        x["initial_state"] = 0.1 * randn(N, HV, K, V, dt=h0_dtype)
    return x, randn(B, T, HV, V)


def _tracked_step(gate, x, do, *, pipeline, window, output_final_state):
    """The protocol's step under the tracker: caller tensors (plan order), chunk64_kda, o.backward(dO)."""
    chunk_plan._plan.cache_clear()  # the chunk table and seq_rows are allocated (and then kept) by this call
    gc.collect()
    gc.freeze()  # the collections under the tracker walk only the objects the step creates
    try:
        return _tracked_step_frozen(gate, x, do, pipeline=pipeline, window=window,
                                    output_final_state=output_final_state)
    finally:
        gc.unfreeze()


def _tracked_step_frozen(gate, x, do, *, pipeline, window, output_final_state):
    order = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state")
    with AllocationTracker() as tr:
        t = {n: x[n].clone() for n in order if n in x}
        for n in t:
            if n != "cu_seqlens":
                t[n].requires_grad_(True)
        dO = do.clone()
        opts = kda_options(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t.get("initial_state"),
                           output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"),
                           cu_seqlens=t.get("cu_seqlens"), **GATES[gate])
        A_log, dt_bias = opts.kernel_gate_params(t.get("A_log"), t.get("dt_bias"))
        o, _ = chunk64_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=A_log, dt_bias=dt_bias,
                           initial_state=t.get("initial_state"), cu_seqlens=t.get("cu_seqlens"), opts=opts,
                           window_tokens=window, keep_intermediates=pipeline == "chunk64_fast")
        o.backward(dO)
        grads = {n: v.grad for n, v in t.items() if v.requires_grad}
        del o
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    return tr


def _planned(plan) -> tuple[list[tuple[int, int]], int]:
    """The plan's (bytes, live total after) per allocation event, and its peak."""
    size = {a.name: a.allocated_bytes for a in plan.allocations}
    cur, out = 0, []
    for kind, name in plan.events:
        if kind == "alloc":
            cur += size[name]
            out.append((size[name], cur))
        elif kind == "free":
            cur -= size[name]
    return out, plan.predicted_peak_bytes


CASES = {
    # name: gate, pipeline, window, shape / options
    # packed sequences, a zero-length one among them, over two 1-chunk windows (2 rows, then 1); GVA (HV = 2 H)
    "packed_zero_len_softplus": ("softplus", "chunk64", 64, dict(B=1, T=75, H=1, HV=2, K=32, V=16,
                                 dtype=torch.bfloat16, lengths=[70, 0, 5], h0=False)),
    # the keep-everything pipeline, three value heads a query head, a bf16 initial state
    "gva_softplus_fast": ("softplus", "chunk64_fast", 64, dict(B=1, T=75, H=1, HV=3, K=16, V=32,
                          dtype=torch.bfloat16, lengths=[70, 0, 5], h0=True, h0_dtype=torch.bfloat16)),
    # a batch of two fixed-length sequences over two 2-chunk windows (4 rows, then 2), float32 raw gate
    "raw_fp32_gate": ("raw", "chunk64", 128, dict(B=2, T=136, H=1, HV=1, K=16, V=16, dtype=torch.bfloat16,
                      lengths=None, h0=False, g_dtype=torch.float32)),
    "raw_fp32_gate_fast_final": ("raw", "chunk64_fast", 64, dict(B=1, T=150, H=1, HV=1, K=16, V=16,
                                 dtype=torch.bfloat16, lengths=[150], h0=True, g_dtype=torch.float32,
                                 final=True)),
    # one sequence of nine 1-chunk windows: the forward runs them in two groups
    "forward_groups_softplus": ("softplus", "chunk64", 64, dict(B=1, T=576, H=1, HV=1, K=16, V=16,
                                dtype=torch.bfloat16, lengths=None, h0=True)),
    # float32 tokens, two query heads
    "fp32_tokens_h0": ("softplus", "chunk64", 64, dict(B=1, T=75, H=2, HV=2, K=32, V=24, dtype=torch.float32,
                     lengths=[70, 5], h0=True)),
}


def _case(name):
    gate, pipeline, window, shape = CASES[name]
    shape = dict(shape)
    final = shape.pop("final", False)
    shape.setdefault("h0_dtype", torch.float32)
    shape.setdefault("g_dtype", shape["dtype"])
    x, do = _data(gate, **shape)
    return gate, pipeline, window, final, x, do, shape


def _plan(name):
    gate, pipeline, window, final, _, _, shape = _case(name)
    return plan_kda(B=shape["B"], T=shape["T"], H=shape["H"], HV=shape["HV"], K=shape["K"], V=shape["V"],
                    dtype=shape["dtype"], seqlens=shape["lengths"], initial_state=shape["h0"],
                    initial_state_dtype=shape["h0_dtype"], output_final_state=final, gate=gate,
                    pipeline=pipeline, window_tokens=window, g_dtype=shape["g_dtype"])


@functools.lru_cache(maxsize=None)
def _tracked(name) -> tuple[tuple[tuple[int, int], ...], int]:
    """The case's tracked step, once per process: ((rounded bytes, live total after) per allocation, peak)."""
    gate, pipeline, window, final, x, do, _ = _case(name)
    tr = _tracked_step(gate, x, do, pipeline=pipeline, window=window, output_final_state=final)
    return tuple(tr.allocs), tr.peak


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_plan_prices_every_allocation_of_the_step(name):
    gate, pipeline, window, final, x, _, _ = _case(name)
    plan = _plan(name)
    assert plan.pipeline == pipeline and plan.window_tokens == window and plan.peak_model == "exact"
    allocs, tracked_peak = _tracked(name)
    want, peak = _planned(plan)
    assert list(allocs) == want, f"tracked (bytes, live) per allocation:\n{list(allocs)}\nplanned:\n{want}"
    assert tracked_peak == peak
    # the windows' geometry is the chunk plan's own
    lengths = list(plan.seqlens) if x.get("cu_seqlens") is not None else None
    geometry = (plan.H, plan.HV, plan.K, plan.V, plan.dtype, plan.g_dtype or plan.dtype)
    cp = chunk_plan.make_chunk_plan(plan.B, plan.T, lengths, "cpu", window, slot_geometry=geometry)
    assert (plan.num_windows, plan.max_slots, plan.num_chunks) == (cp.n_windows, cp.max_slots, cp.table.shape[0])
    assert plan.forward_slots == (cp.table.shape[0] if pipeline == "chunk64_fast" else cp.forward_slots)
    assert cp.n_windows > 1, "every case spans several windows"
    if name == "forward_groups_softplus":
        assert len(cp.forward_groups) > 1 and cp.forward_slots < cp.table.shape[0], cp.forward_groups


def test_a_perturbed_slot_fails_the_comparison(monkeypatch):
    """The comparison can fail: one slot a row larger in the plan and the tracked step no longer matches (the
    step itself does not read the plan's slot lists, so its tracked log is the case's own)."""
    import kdakit.ops.kda.plan as P
    import kdakit.ops.kda.plan_chunk64 as P64

    name = "packed_zero_len_softplus"
    allocs, tracked_peak = _tracked(name)
    assert list(allocs) == _planned(_plan(name))[0]  # unperturbed, they agree
    real = P64.chunk64_backward_slots

    def grown(n, HV, K, V, dtype):
        s = real(n, HV, K, V, dtype)
        slot, shape, dt = s[1]
        s[1] = (slot, (shape[0] + 1,) + shape[1:], dt)
        return s

    monkeypatch.setattr(P64, "chunk64_backward_slots", grown)
    P._plan_chunk64.cache_clear()
    try:
        want, peak = _planned(_plan(name))
        assert list(allocs) != want and tracked_peak != peak
    finally:
        P._plan_chunk64.cache_clear()


@pytest.mark.parametrize("n", [0, 1, 7])
def test_slot_lists_are_the_launchers_slots(n):
    H, HV, K, V = 2, 6, 48, 32
    for dtype in (torch.bfloat16, torch.float32):
        fwd = forward_slots(n, H, HV, K, V, dtype, "meta")
        assert [(k, tuple(t.shape), t.dtype) for k, t in fwd.items()] == chunk64_forward_slots(n, H, HV, K, V, dtype)
        bwd = backward_slots(n, HV, K, V, dtype, "meta")
        assert [(k, tuple(t.shape), t.dtype) for k, t in bwd.items()] == chunk64_backward_slots(n, HV, K, V, dtype)


def test_gate_kind_is_the_options_safe_path():
    """gate_kind from the flags agrees with KDAOptions' own SAFE decision; the defaults per gate."""
    q = torch.zeros(1, 4, 1, 8)
    v, g, beta = torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1)
    for use in (False, True):
        for safe in (False, True):
            for lb in (None, -10.0, -5.0, -1.0):
                if use and safe and lb is None or safe and lb is not None and lb < -5 or (use and lb is None and
                                                                                         not safe and False):
                    continue
                opts = kda_options(q, q, v, g, beta, use_gate_in_kernel=use, safe_gate=safe, lower_bound=lb,
                                   A_log=torch.zeros(1) if use else None, validate=True)
                want = "raw" if not use else ("safe" if opts.safe else "softplus")
                assert gate_kind(use, safe, lb) == want == gate_kind(opts=opts), (use, safe, lb)
    assert DEFAULT_PIPELINE == {"safe": "windowed16", "softplus": "chunk64", "raw": "chunk64"}
    assert [resolve_pipeline(None, k) for k in ("safe", "softplus", "raw")] == ["windowed16", "chunk64", "chunk64"]
    assert resolve_pipeline("chunk64_fast", "safe") == "chunk64_fast"
    assert CHUNK64_WINDOW == {"chunk64": 1024, "chunk64_fast": 2048}
    with pytest.raises(ValueError, match="pipeline"):
        resolve_pipeline("chunk32", "safe")
    with pytest.raises(ValueError, match="gate"):
        resolve_pipeline(None, "sigmoid")


def test_default_window_grows_with_few_sequence_head_pairs():
    """The default window holds at least WINDOW_ROWS (chunk, value head) rows; an explicit one is kept; plan_kda
    prices the window chunk_kda picks."""
    from kdakit.ops.kda.plan import WINDOW_ROWS, chunk64_window

    assert WINDOW_ROWS == 1536
    # the protocol shapes keep the base windows; one sequence of 16 heads (a layer) gets 8192-token windows
    assert [chunk64_window("chunk64", pairs=p) for p in (96, 128, 16, 1)] == [1024, 1024, 8192, 131072]
    assert [chunk64_window("chunk64_fast", pairs=p) for p in (96, 16, 48)] == [2048, 8192, 2048]
    assert chunk64_window("chunk64", pairs=None) == 1024
    assert chunk64_window("chunk64", 256, pairs=16) == 256
    plan = plan_kda(B=1, T=32768, H=16, K=128, gate="softplus", pipeline="chunk64")
    assert (plan.window_tokens, plan.num_windows) == (8192, 4)
    packed = plan_kda(seqlens=[4096] * 6, H=16, K=128, gate="softplus", pipeline="chunk64")
    assert packed.window_tokens == 1024  # 6 x 16 = 96 pairs
    explicit = plan_kda(B=1, T=32768, H=16, K=128, gate="softplus", pipeline="chunk64", checkpoint_every_n_tokens=2048)
    assert explicit.window_tokens == 2048
