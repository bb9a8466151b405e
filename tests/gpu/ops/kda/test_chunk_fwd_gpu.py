"""GPU tier of the Triton chunked forward (run on the H200 with KDAKIT_TEST_TIER=gpu).

Real shapes against the float64 chunked PyTorch reference, NaN-poisoned output
allocations, bitwise-determinism reruns, checkpoint contents, 64-bit addressing and the
plan's forward byte count. Nothing here imports triton at module level, so collecting this
file on a CPU machine cannot switch the interpreter off for the CPU tier.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROTOCOL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                safe_gate=True, lower_bound=-5.0)
SOFTPLUS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _inputs(B, T, H, HV, K, V, *, dtype=torch.bfloat16, raw_gate=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    g = -torch.nn.functional.softplus(rnd(B, T, HV, K)) * 0.5 if raw_gate else rnd(B, T, HV, K)
    beta = rnd(B, T, HV)
    if raw_gate:
        beta = torch.sigmoid(beta)
    params = dict(A_log=rnd(HV) * 0.5, dt_bias=rnd(HV * K) * 0.5)
    return [x.to(dtype) for x in (q, k, v, g, beta)], params


def _forward(q, k, v, g, beta, *, plan=None, **kw):
    from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd
    from kdakit.ops.kda.options import kda_options

    # the launcher's contract: inputs as chunk_kda hands them over (this tier never validated them)
    opts = kda_options(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, output_final_state=True, validate=False, **kw)
    tensors = {n: kw.get(n) for n in ("A_log", "dt_bias", "initial_state", "cu_seqlens")}
    return chunk_kda_fwd(q, k, v, g, beta, opts=opts, plan=plan, **tensors)


def _reference(q, k, v, g, beta, *, initial_state=None, **kw):
    from kdakit.ops.kda.reference.chunk import chunked_kda_reference

    kw = {key: val for key, val in kw.items() if key not in ("safe_gate", "plan")}
    for name in ("A_log", "dt_bias"):
        if kw.get(name) is not None:
            kw[name] = kw[name].double()
    with torch.no_grad():
        return chunked_kda_reference(
            q.double(), k.double(), v.double(), g.double(), beta.double(), scale=q.shape[-1] ** -0.5,
            initial_state=None if initial_state is None else initial_state.double(), output_final_state=True, **kw,
        )


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64, device="cuda")


def _check(name, ref, got, tol):
    from kdakit.testing import assert_close

    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    return assert_close(name, ref, got, tol)


@pytest.mark.parametrize("B,T,H", [(1, 32768, 16), (8, 4096, 16), (1, 8192, 96)])
def test_protocol_shapes_bf16(B, T, H):
    (q, k, v, g, beta), params = _inputs(1, B * T, H, H, 128, 128, seed=B + T + H)
    cu = _cu([T] * B)
    kw = dict(PROTOCOL, cu_seqlens=cu, **params)
    o, ht, _ = _forward(q, k, v, g, beta, **kw)
    ro, rht = _reference(q, k, v, g, beta, **kw)
    _check("o", ro, o, 0.005)
    _check("final state", rht, ht, 0.005)


def test_softplus_gva_initial_state_v_first():
    (q, k, v, g, beta), params = _inputs(2, 8192, 4, 16, 128, 128, seed=1)
    h0 = torch.randn(2, 16, 128, 128, device="cuda").to(torch.bfloat16)
    kw = dict(SOFTPLUS, state_v_first=True, initial_state=h0, **params)
    o, ht, _ = _forward(q, k, v, g, beta, **kw)
    ro, rht = _reference(q, k, v, g, beta, **kw)
    assert ht.shape == h0.shape
    _check("o", ro, o, 0.005)
    _check("final state", rht, ht, 0.005)


def test_varlen_uneven_k64():
    lengths = [0, 1, 1000, 4097, 15, 8191]
    (q, k, v, g, beta), params = _inputs(1, sum(lengths), 8, 8, 64, 64, seed=2)
    h0 = torch.randn(len(lengths), 8, 64, 64, device="cuda")
    kw = dict(PROTOCOL, cu_seqlens=_cu(lengths), initial_state=h0, **params)
    o, ht, _ = _forward(q, k, v, g, beta, **kw)
    ro, rht = _reference(q, k, v, g, beta, **kw)
    _check("o", ro, o, 0.005)
    _check("final state", rht, ht, 0.005)
    assert torch.equal(ht[0], h0[0])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 0.003)])
def test_other_dtypes(dtype, tol):
    (q, k, v, g, beta), params = _inputs(2, 4096, 4, 4, 128, 128, dtype=dtype, seed=3)
    kw = dict(SOFTPLUS, **params)
    o, ht, _ = _forward(q, k, v, g, beta, **kw)
    ro, rht = _reference(q, k, v, g, beta, **kw)
    assert o.dtype == dtype
    _check("o", ro, o, tol)
    _check("final state", rht, ht, tol)


def test_reset_level_decays():
    (q, k, v, g, beta), _ = _inputs(1, 8192, 4, 4, 128, 128, raw_gate=True, seed=4)
    resets = torch.randperm(8192, generator=torch.Generator().manual_seed(5))[:200].cuda()
    g[:, resets] = -1000.0
    o, ht, _ = _forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    ro, rht = _reference(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    _check("o", ro, o, 0.005)
    _check("final state", rht, ht, 0.005)


def test_checkpoints_match_reference_states():
    from kdakit.ops.kda.plan import checkpoint_offsets, plan_kda

    lengths = [3000, 0, 5000]
    (q, k, v, g, beta), params = _inputs(1, sum(lengths), 4, 4, 128, 128, seed=6)
    cu = _cu(lengths)
    plan = plan_kda(q, v, cu_seqlens=cu, checkpoint_every_n_tokens=1024, output_final_state=True)
    kw = dict(PROTOCOL, cu_seqlens=cu, **params)
    _, _, ck = _forward(q, k, v, g, beta, plan=plan, **kw)
    offs = checkpoint_offsets(cu, every_n_tokens=1024).tolist()
    assert offs == [0, 3, 3, 8] and ck.shape[0] == 8
    for n, j in ((0, 2), (2, 1), (2, 4)):
        bos = int(cu[n])
        end = bos + j * 1024
        sl = slice(bos, end)
        _, ref = _reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], **dict(PROTOCOL, **params))
        _check(f"checkpoint {n},{j}", ref[0], ck[offs[n] + j], 0.005)


def test_nan_poisoned_outputs_and_determinism():
    lengths = [4096, 1, 3001, 0, 8192]
    (q, k, v, g, beta), params = _inputs(1, sum(lengths), 8, 16, 128, 128, seed=7)
    kw = dict(PROTOCOL, cu_seqlens=_cu(lengths), **params)
    first = _forward(q, k, v, g, beta, **kw)
    shapes = [(t.shape, t.dtype) for t in first]
    # Free NaN-filled blocks of exactly the outputs' sizes; the caching allocator hands them back.
    poison = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes]
    del poison
    second = _forward(q, k, v, g, beta, **kw)
    for name, a, b in zip(("o", "final state", "checkpoints"), first, second):
        assert torch.isfinite(b).all(), f"{name}: reads or leaves unwritten (NaN-poisoned) memory"
        assert torch.equal(a, b), f"{name}: rerun is not bitwise identical"


def _forward_peak_against_plan():
    """The forward's measured peak and the plan's bytes, in this process (run fresh: see the test)."""
    from kdakit.ops.kda.plan import plan_kda

    lengths = [8192, 100, 3000]
    (q, k, v, g, beta), params = _inputs(1, sum(lengths), 16, 16, 128, 128, seed=8)
    cu = _cu(lengths)
    plan = plan_kda(q, v, cu_seqlens=cu, output_final_state=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = _forward(q, k, v, g, beta, cu_seqlens=cu, plan=plan, **dict(PROTOCOL, **params))
    torch.cuda.synchronize()
    size = {a.name: a.allocated_bytes for a in plan.allocations}
    kept = size["o"] + size["final_state"] + size["checkpoints"]
    temps = size["checkpoint_offsets"] + sum(b for n, b in size.items() if n.startswith("fwd_"))
    result = dict(peak=torch.cuda.max_memory_allocated() - base, kept=kept, temps=temps,
                  workspace=temps - size["checkpoint_offsets"], plan_workspace=plan.forward_workspace_bytes,
                  after=torch.cuda.memory_allocated() - base)
    del out
    return result


def test_forward_allocates_what_the_plan_says():
    # In a fresh process: blocks that earlier tests leave in live segments are handed out whole when
    # what would be left over is under 1 MiB, and counted whole as allocated (the GPU tier read
    # 475136 B over the plan after empty_cache; a fresh process matched the plan to the byte).
    code = ("import json; from tests.gpu.ops.kda.test_chunk_fwd_gpu import _forward_peak_against_plan; "
            "print(json.dumps(_forward_peak_against_plan()))")
    root = str(Path(__file__).resolve().parents[4])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["workspace"] == r["plan_workspace"]
    assert r["peak"] == r["kept"] + r["temps"], f"forward peak {r['peak']} B, plan says {r['kept'] + r['temps']} B"
    assert r["after"] == r["kept"], "forward temporaries outlived the call"


def test_slow_decay_long_sequence_bf16():
    # Slow decays keep many chunks in the state: the bf16 operands of the state kernel must stay accurate.
    (q, k, v, g, beta), params = _inputs(1, 16384, 4, 4, 128, 128, seed=10)
    params["dt_bias"] = params["dt_bias"] * 0 - 6.0  # lower-bound gate: about -0.02 per token
    kw = dict(PROTOCOL, **params)
    o, ht, _ = _forward(q, k, v, g, beta, **kw)
    ro, rht = _reference(q, k, v, g, beta, **kw)
    _check("o", ro, o, 0.005)
    _check("final state", rht, ht, 0.005)


def test_64bit_addressing():
    # T * H * K > 2^31 elements: the last sequence starts beyond int32 element offsets.
    H, K = 128, 128
    T = 2**31 // (H * K) + 4096
    tail = 2048
    (q, k, v, g, beta), params = _inputs(1, T, H, H, K, K, seed=9)
    kw = dict(PROTOCOL, **params)
    o, ht, _ = _forward(q, k, v, g, beta, cu_seqlens=_cu([T - tail, tail]), **kw)
    sl = slice(T - tail, T)
    parts = [x[:, sl].contiguous() for x in (q, k, v, g, beta)]
    o_tail, ht_tail, _ = _forward(*parts, **kw)
    assert torch.equal(o[:, sl], o_tail)
    assert torch.equal(ht[1:], ht_tail)
    ro, _ = _reference(*parts, **kw)
    _check("o tail", ro, o_tail, 0.005)


def test_intermediate_states_match_fla():
    """return_intermediate_states: h equals FLA 0.6.0's h on the same inputs (within bf16 storage rounding)
    and the state kdakit's own forward reaches at each 64-token boundary."""
    from kdakit import chunk_kda

    lengths = [4096, 100, 3000]
    (q, k, v, g, beta), params = _inputs(1, sum(lengths), 8, 8, 128, 128, seed=12)
    cu = _cu(lengths)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, cu_seqlens=cu, **params)
    with torch.inference_mode():
        o, _, h = chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **kw)
    NT = sum(-(-n // 64) for n in lengths)
    assert h.shape == (1, NT, 8, 128, 128) and h.dtype == k.dtype
    assert torch.isfinite(h).all()
    # the state entering chunk 1 of sequence 0 equals the final state of its first 64 tokens
    with torch.inference_mode():
        _, s64 = chunk_kda(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], output_final_state=True,
                           **dict(kw, cu_seqlens=None))
    _check("h[1] vs a 64-token run", s64[0].float(), h[0, 1].float(), 0.005)
    fla = pytest.importorskip("fla.ops.kda")
    with torch.inference_mode():
        _, _, h_fla = fla.chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **kw)
    _check("h vs FLA", h_fla.float(), h.float(), 0.01)
