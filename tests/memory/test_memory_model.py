"""The analytic memory model (kdakit/memory/model.py) against measured and saved-tensor figures.

* FLA 0.6.0: the source-based replay must reproduce FLA's peaks measured on the H200 by
  the protocol of docs/spec.md §3 (its table) within 2%.
* Group bytes at the peak sum to the peak for every backend and option mix.
* Saved-for-backward bytes: counted by ``torch.autograd.graph.saved_tensors_hooks`` on the
  real code paths (PyTorch reference on CPU; Triton kernels under the interpreter), they
  must equal what the model / plan says is saved.
"""

import os
import sys

import pytest
import torch

import kdakit.memory.model as M
from kdakit.memory.measure_worker import Cell, parse_cell, parse_cells
from kdakit.memory.model import (
    GIB,
    GROUP_STATES,
    GROUPS,
    ModelUnsupported,
    Timeline,
    fla_model,
    floor_bytes,
    kdakit_model,
    kdakit_plan,
    model,
    parse_backends,
    protocol_spec,
    reference_saved_bytes,
)

# FLA 0.6.0 on H200, docs/spec.md §3 protocol, max_memory_allocated (GiB): the docs/spec.md §3 table.
FLA_MEASURED = [((1, 8192, 96), 6.590), ((8, 8192, 16), 8.787), ((1, 8192, 128), 8.787), ((1, 131072, 96), 105.445)]
SPEC_FLOORS = [((1, 131072, 96), 30.047), ((1, 8192, 96), 1.878), ((8, 8192, 16), 2.504), ((1, 8192, 128), 2.504)]

VARIANTS = [
    {},
    {"qk_heads": 4},                                   # GVA: HV = 16 > H = 4
    {"use_qk_l2norm": False, "use_beta_sigmoid": False},
    {"gate": "softplus"},
    {"gate": "precomputed", "gate_params": False},
    {"initial_state": True, "output_final_state": True},
    {"varlen": False},
    {"dtype": "fp32", "head_dim": 64, "value_dim": 96},
    {"checkpoint_every_n_tokens": 512},
]


@pytest.mark.parametrize("shape,measured", FLA_MEASURED)
def test_fla_model_reproduces_measured_peaks(shape, measured):
    m = fla_model(protocol_spec(*shape))
    assert abs(m.peak_gib - measured) / measured <= 0.02, f"{shape}: model {m.peak_gib:.4f} vs measured {measured}"


@pytest.mark.parametrize("shape,floor", SPEC_FLOORS)
def test_floor_is_the_spec_floor(shape, floor):
    mbs, seq, heads = shape
    T, D = mbs * seq, 128
    assert floor_bytes(protocol_spec(*shape)) == 20 * T * heads * D + 4 * T * heads
    assert round(floor_bytes(protocol_spec(*shape)) / GIB, 3) == floor


@pytest.mark.parametrize("backend", ["fla", "kdakit"])
@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "spec")
def test_groups_at_the_peak_sum_to_the_peak(backend, options):
    spec = protocol_spec(2, 3000, 16, **options)
    m = model(backend, spec)
    groups = m.groups()
    assert list(groups)[:len(GROUPS)] == list(GROUPS)
    assert sum(groups.values()) == m.peak_bytes
    assert len({b.name for b in m.blocks}) == len(m.blocks)
    assert all(b.nbytes % 512 == 0 for b in m.blocks)
    # Everything the protocol's caller holds is live at any backward peak.
    names = {b.name for b in m.blocks}
    assert {"q", "k", "v", "g", "beta", "dO"} <= names


def test_fla_state_series_and_recompute_match_closed_forms():
    # 1 x 128K, H96, D128: h and dh are [T/64, H, K, V] bf16 each; w, u, qg, kg, v_new bf16 and
    # the gate cumsum fp32 are full-sequence [T, H, D] tensors (docs/spec.md §4).
    T, H, D = 131072, 96, 128
    m = fla_model(protocol_spec(1, T, H))
    groups = m.groups()
    assert groups[GROUP_STATES] == 2 * (T // 64) * H * D * D * 2
    assert groups["recompute intermediates"] == 5 * T * H * D * 2 + T * H * D * 4
    assert "db_sum" in m.peak_stage and "chunk_kda_bwd_intra" in m.peak_stage


def test_fla_l2norm_costs_the_saved_normalized_qk():
    # Dropping in-kernel l2norm removes the saved normalized q/k (two bf16 [T, H, K]) and
    # their rstd vectors from the backward live set.
    with_norm = fla_model(protocol_spec(1, 8192, 96))
    without = fla_model(protocol_spec(1, 8192, 96, use_qk_l2norm=False))
    T, H, K = 8192, 96, 128
    assert with_norm.peak_bytes - without.peak_bytes == 2 * T * H * K * 2 + 2 * T * H * 4


@pytest.mark.parametrize("shape,options", [(s, {}) for s, _ in FLA_MEASURED] + [((2, 3000, 16), o) for o in VARIANTS[1:]])
def test_kdakit_model_agrees_with_the_plans_own_peak(shape, options):
    spec = protocol_spec(*shape, **options)
    plan = kdakit_plan(spec)
    m = kdakit_model(spec, plan)
    assert m.peak_bytes == plan.predicted_peak_bytes
    assert m.saved_bytes == plan.saved_bytes
    # The protocol's caller tensors are the ones the plan assumes the caller holds.
    tl = Timeline()
    M._harness(tl, spec)
    plan_caller = {a.name: a.allocated_bytes for a in plan.allocations if a.name in M._HARNESS_NAMES}
    assert sum(plan_caller.values()) == tl.current


def test_reference_peak_is_declared_unsupported():
    with pytest.raises(ModelUnsupported, match="no analytic peak model"):
        model("reference", protocol_spec(1, 8192, 96))


def test_timeline_rejects_double_allocation_and_unknown_free():
    tl = Timeline()
    tl.alloc("x", (4,), "fp32", "workspace")
    with pytest.raises(RuntimeError, match="allocated twice"):
        tl.alloc("x", (4,), "fp32", "workspace")
    with pytest.raises(RuntimeError, match="not live"):
        tl.free("y")
    tl.free("x")
    assert tl.current == 0 and tl.peak == 512


def test_shape_and_backend_parsing():
    # the shapes of every mem command are cells, read by measure_worker's one parser
    assert parse_cell("8x8192:16") == Cell(8, 8192, 16)
    assert parse_cell(" 1x128k:96 ") == Cell(1, 131072, 96)
    assert parse_cells("1x8192:96,8x8192:16") == [Cell(1, 8192, 96), Cell(8, 8192, 16)]
    for bad in ("8x8192", "x8192:16", "8x8192:0", "8*8192:16", ""):
        with pytest.raises(ValueError, match="MBSxSEQ:H|integer|positive|no cells"):
            parse_cells(bad)
    assert parse_backends("kdakit,fla") == ["kdakit", "fla"]
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        parse_backends("kdakit,flash")
    with pytest.raises(ValueError, match="repeat"):
        parse_backends("fla,fla")


# ---------------------------------------------------------------------------------------
# Saved-for-backward bytes, counted on the real code paths


def _inputs(spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, H, HV, K, V = spec.T, spec.H, spec.HV, spec.K, spec.V

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).requires_grad_()

    x = dict(q=leaf(1, T, H, K), k=leaf(1, T, H, K), v=leaf(1, T, HV, V), g=leaf(1, T, HV, K), beta=leaf(1, T, HV),
             A_log=torch.zeros(HV, requires_grad=True), dt_bias=torch.zeros(HV * K, requires_grad=True),
             cu_seqlens=torch.arange(0, T + 1, spec.seq, dtype=torch.int64))
    return x


def _saved_beyond_inputs(x, checkpoint_every):
    """Run the protocol's forward+backward; return (bytes of saved storages that are not inputs, saw_inputs)."""
    from kdakit import chunk_kda

    input_ptrs = {t.untyped_storage().data_ptr() for t in x.values()}
    extra, seen_inputs = {}, set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in input_ptrs:
            seen_inputs.add(ptr)
        else:
            extra[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                         cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                         checkpoint_every_n_tokens=checkpoint_every)
    o.backward(torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.dtype))
    assert torch.isfinite(x["q"].grad.float()).all()
    return sum(extra.values()), len(seen_inputs)


@pytest.mark.parametrize("mbs,seq,every", [(2, 24, 16), (3, 40, None), (1, 70, 32)])
def test_reference_saved_bytes_match_saved_tensor_hooks(monkeypatch, mbs, seq, every):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    spec = protocol_spec(mbs, seq, 2, head_dim=16, checkpoint_every_n_tokens=every)
    got, seen_inputs = _saved_beyond_inputs(_inputs(spec), every)
    assert seen_inputs >= 5, "the hook did not see the saved inputs: it is not measuring the reference path"
    assert got == reference_saved_bytes(spec) > 0


_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.skipif(_TRITON_PREIMPORTED or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton is imported)")
@pytest.mark.parametrize("mbs,seq,every", [(2, 24, 16), (1, 48, 32)])
def test_kdakit_plan_checkpoints_match_saved_tensor_hooks(monkeypatch, mbs, seq, every):
    # The plan's saved checkpoints are what the Triton autograd Function really saves.
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    spec = protocol_spec(mbs, seq, 2, head_dim=16, checkpoint_every_n_tokens=every)
    got, seen_inputs = _saved_beyond_inputs(_inputs(spec), every)
    assert seen_inputs >= 5
    plan = kdakit_plan(spec)
    saved = [a for a in plan.allocations if a.phase == "saved"]
    assert sorted(a.name for a in saved) == ["checkpoint_offsets", "checkpoints"]
    assert got == sum(a.nbytes for a in saved) > 0
    m = kdakit_model(spec, plan)
    assert m.saved_bytes >= got


# ---------------------------------------------------------------------------------------
# FLA's own host code, kernels stubbed: its allocation timeline against the replay

_FLA_HOST_SCRIPT = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
import torch
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter
# Only the host-side allocations matter here: every kernel launch becomes a no-op and
# autotuning picks the first config without running anything.
autotuner.Autotuner._bench = lambda self, *a, config, **k: [1.0, 1.0, 1.0]
interpreter.GridExecutor.__call__ = lambda self, *a, **k: None
from torch.profiler import ProfilerActivity, profile
from kdakit.memory import measure_worker as mw

mbs, seq, heads, dim = (int(a) for a in sys.argv[1:5])
x = mw.make_inputs(mbs, seq, heads, dim, "cpu", 0)
call, _ = mw.load_backend("fla", None)
o = mw.step(call, x)  # warm-up: fills FLA's chunk-index cache, as in the protocol
del o
mw.release_grads(x)
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    o = mw.step(call, x)
events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
cur = peak = 0
for e in events:
    cur += e.nbytes()
    peak = max(peak, cur)
print(json.dumps({"peak_above_start": peak, "end_above_start": cur, "events": len(events)}))
'''


def _fla_pythonpath():
    import importlib.util

    extra = os.environ.get("KDAKIT_TEST_FLA_PATH", "")
    if extra or (importlib.util.find_spec("fla") and importlib.util.find_spec("einops")):
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
        return os.pathsep.join(p for p in (root, extra, os.environ.get("PYTHONPATH", "")) if p)
    return None


@pytest.mark.skipif(_fla_pythonpath() is None,
                    reason="needs FLA 0.6.0 and einops importable (or KDAKIT_TEST_FLA_PATH=<fla src>:<einops dir>)")
@pytest.mark.parametrize("mbs,seq,heads,dim", [(2, 64, 2, 32), (3, 100, 3, 64)])
def test_fla_replay_matches_fla_host_allocations(mbs, seq, heads, dim, monkeypatch):
    """Run FLA's real chunk_kda host code on CPU with its kernels stubbed out and record every
    torch allocation and free (profiler memory events); the replay's peak above the step's
    start must equal it to the byte (allocator rounding off: CPU allocations are exact)."""
    import json
    import subprocess

    env = dict(os.environ, PYTHONPATH=_fla_pythonpath())
    res = subprocess.run([sys.executable, "-c", _FLA_HOST_SCRIPT, str(mbs), str(seq), str(heads), str(dim)],
                         capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["events"] > 20

    monkeypatch.setattr(M, "ALLOC_GRANULE", 1)
    spec = protocol_spec(mbs, seq, heads, head_dim=dim)
    m = fla_model(spec)
    before = Timeline()
    M._harness(before, spec)
    nt = M._fla_num_chunks(spec, M.FLA_CHUNK)
    resident = before.current + 8 * (mbs + 2 * nt + mbs + 1)  # + FLA's cached index tensors (int64)
    assert m.peak_bytes - resident == got["peak_above_start"]
    # After the step: O and the seven gradients remain.
    T, D = mbs * seq, dim
    assert got["end_above_start"] == 5 * T * heads * D * 2 + T * heads * 2 + heads * 4 + heads * D * 4


@pytest.mark.parametrize("B,T,H,dtype,cadence,ckpt_dtype", [
    (1, 8192, 96, torch.bfloat16, 512, torch.bfloat16),
    (8, 8192, 16, torch.bfloat16, 512, torch.bfloat16),
    (1, 131072, 96, torch.bfloat16, 256, torch.bfloat16),
    (1, 8192, 96, torch.float16, 1024, torch.float32),
    (1, 8192, 96, torch.float32, 512, torch.float32),
    (1, 1024, 96, torch.bfloat16, 1024, torch.bfloat16),  # no denser cadence fits: the default
])
def test_default_cadence_is_the_densest_within_the_peak_budget(B, T, H, dtype, cadence, ckpt_dtype):
    from kdakit.ops.kda.plan import DENSE_CHECKPOINT_TOKENS, PEAK_BUDGET, plan_kda

    cu = [i * T for i in range(B + 1)]
    p = plan_kda(T=B * T, H=H, K=128, dtype=dtype, cu_seqlens=cu)
    assert (p.checkpoint_every_n_tokens, p.checkpoint_dtype) == (cadence, ckpt_dtype)
    assert p.num_checkpoints == B * -(-T // cadence)
    default = min(2048, T)
    within = p.predicted_peak_bytes <= PEAK_BUDGET * p.floor_bytes
    assert within == (cadence < default), (p.predicted_peak_bytes / p.floor_bytes)
    for denser in (c for c in DENSE_CHECKPOINT_TOKENS if c < cadence):
        q = plan_kda(T=B * T, H=H, K=128, dtype=dtype, cu_seqlens=cu, checkpoint_every_n_tokens=denser)
        assert q.predicted_peak_bytes > PEAK_BUDGET * q.floor_bytes, denser
    # An explicit cadence is kept; the torch backend keeps the plain default.
    assert plan_kda(T=B * T, H=H, K=128, dtype=dtype, cu_seqlens=cu,
                    checkpoint_every_n_tokens=2048).checkpoint_every_n_tokens == 2048
    assert plan_kda(T=B * T, H=H, K=128, dtype=dtype, cu_seqlens=cu,
                    backend="torch").checkpoint_every_n_tokens == default


# ---------------------------------------------------------------------------------------
# The pipeline per gate (kdakit.ops.kda.plan.DEFAULT_PIPELINE) and a named pipeline


@pytest.mark.parametrize("gate,pipeline", [("safe", "windowed16"), ("softplus", "chunk64"), ("precomputed", "chunk64")])
def test_kdakit_model_prices_the_gates_default_pipeline(gate, pipeline):
    from kdakit.ops.kda.plan import plan_kda

    extra = {"gate_params": False} if gate == "precomputed" else {}
    spec = protocol_spec(1, 8192, 16, gate=gate, **extra)
    plan = kdakit_plan(spec)
    assert plan.pipeline == pipeline
    m = kdakit_model(spec, plan)
    assert m.peak_bytes == plan.predicted_peak_bytes and m.notes[0].startswith(f"kdakit plan: {pipeline},")
    named = protocol_spec(1, 8192, 16, gate=gate, pipeline=pipeline, **extra)
    assert kdakit_model(named).peak_bytes == m.peak_bytes
    if pipeline == "chunk64":
        # the default window is chunk_kda's (one sequence of 16 heads: 8192 tokens, chunk64_window), and the
        # checkpoint cadence names the window
        assert plan.window_tokens == 8192
        assert kdakit_plan(protocol_spec(1, 8192, 96, gate=gate, **extra)).window_tokens == 1024
        w512 = kdakit_plan(protocol_spec(1, 8192, 16, gate=gate, checkpoint_every_n_tokens=512, **extra))
        assert w512.window_tokens == 512 and w512.predicted_peak_bytes != plan.predicted_peak_bytes
        # at one window the recomputing pipeline holds what the fast one does but the intra stage's akk_d
        # scratch (its backward runs no intra stage), and its checkpoint on top; at 96 heads (1024- against
        # 2048-token windows) the fast workspace costs more
        fast = kdakit_model(protocol_spec(1, 8192, 16, gate=gate, pipeline="chunk64_fast", **extra))
        akk_d, checkpoint = 128 * 16 * 64 * 16 * 4, 16 * 128 * 128 * 4
        assert fast.peak_bytes - m.peak_bytes == akk_d - checkpoint
        lean96 = kdakit_model(protocol_spec(1, 8192, 96, gate=gate, **extra))
        fast96 = kdakit_model(protocol_spec(1, 8192, 96, gate=gate, pipeline="chunk64_fast", **extra))
        assert fast96.peak_bytes > lean96.peak_bytes and fast.to_json()["pipeline"] == "chunk64_fast"
        assert plan_kda(seqlens=[8192], H=16, K=128, gate=plan.gate, g_dtype=plan.g_dtype) == plan


def test_precomputed_gate_is_fp32_and_the_floor_counts_it_so():
    T, H, D = 8192, 16, 128
    bf16_g = protocol_spec(1, T, H, gate="precomputed", gate_params=False, gate_dtype="bf16")
    fp32_g = protocol_spec(1, T, H, gate="precomputed", gate_params=False)
    assert fp32_g.g_dtype == "fp32" and bf16_g.g_dtype == "bf16"
    assert floor_bytes(fp32_g) - floor_bytes(bf16_g) == 2 * T * H * D * 2  # g and dg, 2 more bytes each
    for backend in ("kdakit", "fla"):
        a, b = model(backend, fp32_g), model(backend, bf16_g)
        assert a.floor_bytes == floor_bytes(fp32_g) and a.peak_bytes > b.peak_bytes, backend
    plan = kdakit_plan(fp32_g)
    assert {x.name: x.dtype for x in plan.allocations if x.name in ("g", "dg")} == {"g": torch.float32,
                                                                                  "dg": torch.float32}


def test_a_named_pipeline_is_validated():
    with pytest.raises(ValueError, match="pipeline"):
        protocol_spec(1, 8192, 16, pipeline="chunk32")
    with pytest.raises(ValueError, match="window_tokens"):
        kdakit_plan(protocol_spec(1, 8192, 16, gate="softplus", checkpoint_every_n_tokens=48))
