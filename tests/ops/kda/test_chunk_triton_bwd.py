"""CPU tier of the Triton chunk backward: the float64 twin against autograd, then the kernel (interpreter).

1. ``chunk_bwd_reference`` (hand-written chunk backward + two-level recompute driver) must equal
   ``torch.autograd`` of ``naive_recurrent_kda`` in float64 to round-off, for every gradient and
   option: this validates the derivation of the chunked form (docs/spec.md §2.9).
2. ``chunk_kda_bwd`` (Triton, under ``TRITON_INTERPRET=1``) must match that twin on fp32 inputs
   (and, through it, autograd). Checkpoints come from the twin's forward, so the backward is tested
   on its own. Cadences are tiny (checkpoint every 32 to 96 tokens, windows of 16 or 32) so
   sequences span several checkpoint segments and several windows per segment.
3. ``backward_workspace_allocations`` must list exactly what the windowed launcher allocates.
"""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    _TRITON_PREIMPORTED = True
else:
    os.environ["TRITON_INTERPRET"] = "1"
    _TRITON_PREIMPORTED = False

import itertools
import math
from dataclasses import replace

import pytest
import torch

from kdakit.ops.kda.reference.chunk_bwd import chunk_kda_bwd_reference, reference_checkpoints
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.ops.kda.options import kda_options
from kdakit.ops.kda.plan import backward_workspace_allocations, plan_kda
from kdakit.testing import assert_close

pytestmark = pytest.mark.skipif(
    _TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1 could be set; run this module alone")

L_CKPT, L_RECOMPUTE = 32, 16
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")


def _case(*, gate=False, lower_bound=None, l2=False, bsig=False, neg=False, H=1, HV=1, K=16, V=16,
          lens=None, B=2, T=37, h0=False, vfirst=False, dht=False, reset=False, seed=0, dtype=torch.float64):
    """Fresh random inputs (never zeros) and the keyword arguments shared by every path."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    if lens is not None:
        B, T = 1, sum(lens)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int64)
        N = len(lens)
    else:
        cu, N = None, B
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    if not l2:
        q, k = 0.3 * q, 0.3 * k
    if gate:
        g = 2 * rnd(B, T, HV, K)
    elif reset:
        # Reset-level decays: some channels forget everything at once (log-decay -1000).
        u = torch.rand(B, T, HV, K, generator=gen, dtype=dtype)
        g = torch.where(u < 0.1, torch.full_like(u, -1000.0), -0.2 * u)
    else:
        g = -torch.rand(B, T, HV, K, generator=gen, dtype=dtype)
    beta = rnd(B, T, HV) if bsig else torch.rand(B, T, HV, generator=gen, dtype=dtype)
    A_log = 0.5 * rnd(HV) if gate else None
    dt_bias = rnd(HV * K) if gate else None
    state = rnd(N, HV, V, K) if vfirst else rnd(N, HV, K, V)
    init = state if h0 else None
    do = rnd(B, T, HV, V)
    dht_t = (rnd(N, HV, V, K) if vfirst else rnd(N, HV, K, V)) if dht else None
    kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate,
              use_beta_sigmoid_in_kernel=bsig, allow_neg_eigval=neg, lower_bound=lower_bound,
              A_log=A_log, dt_bias=dt_bias, state_v_first=vfirst, cu_seqlens=cu)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=init, do=do, dht=dht_t, kw=kw)


def _autograd(c):
    """float64 gradients of the token-by-token definition, keyed like chunk_kda_bwd's outputs."""
    kw = c["kw"]
    leaves = {n: c[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    extra = {}
    for name, key in (("A_log", "dA_log"), ("dt_bias", "ddt_bias")):
        if kw[name] is not None:
            extra[key] = kw[name].clone().requires_grad_(True)
    h0 = c["h0"].clone().requires_grad_(True) if c["h0"] is not None else None
    kw = dict(kw, A_log=extra.get("dA_log"), dt_bias=extra.get("ddt_bias"))
    o, final = naive_recurrent_kda(*leaves.values(), initial_state=h0, output_final_state=True, **kw)
    loss = (o * c["do"]).sum()
    if c["dht"] is not None:
        loss = loss + (final * c["dht"]).sum()
    wrt = list(leaves.values()) + list(extra.values()) + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad(loss, wrt)
    out = dict(zip(("dq", "dk", "dv", "dg", "dbeta"), grads[:5]))
    out.update(zip(extra.keys(), grads[5:5 + len(extra)]))
    if h0 is not None:
        out["dh0"] = grads[-1]
    return out


def _twin(c, safe):
    kw = dict(c["kw"])
    _, _, ckpts, offs = reference_checkpoints(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=c["h0"],
                                              safe_gate=safe, checkpoint_every_n_tokens=L_CKPT, **kw)
    grads = chunk_kda_bwd_reference(c["q"], c["k"], c["v"], c["g"], c["beta"], c["do"], c["dht"],
                                    checkpoints=ckpts, checkpoint_offsets=offs, initial_state=c["h0"],
                                    safe_gate=safe, checkpoint_every_n_tokens=L_CKPT,
                                    recompute_every_n_tokens=L_RECOMPUTE, **kw)
    return dict(zip(NAMES, grads)), ckpts


CASES = {
    "plain": dict(),
    "plain_v_first_h0_dht": dict(h0=True, vfirst=True, dht=True),
    "softplus_gate_l2_sigmoid_neg_varlen": dict(gate=True, l2=True, bsig=True, neg=True, H=1, HV=2,
                                                lens=[0, 1, 37, 16, 20], h0=True, dht=True),
    "safe_gate_gva_h0": dict(gate=True, lower_bound=-5.0, l2=True, bsig=True, H=2, HV=4, h0=True, dht=True,
                             K=32, V=16),
    "reset_decays": dict(reset=True, l2=True, lens=[40], dht=True),
}


@pytest.mark.parametrize("safe", [False, True], ids=["exact", "safe"])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_twin_matches_autograd(name, safe):
    opts = CASES[name]
    if safe and (opts.get("reset") or (opts.get("gate") and opts.get("lower_bound") is None)):
        pytest.skip("the SAFE factorization requires a bounded gate (a >= -5)")
    c = _case(**opts)
    ref = _autograd(c)
    got, _ = _twin(c, safe)
    for n in NAMES:
        if n in ref:
            assert_close(n, ref[n], got[n], 1e-10)
        else:
            assert got[n] is None, f"{n} should be None for this call"


@pytest.mark.parametrize("exact", [False, True])
def test_state_gradient_recurrence_is_state_free(exact):
    """The reverse dS recurrence of chunk_backward equals chunk_state_grad, which never sees S."""
    from kdakit.ops.kda.reference.chunk_bwd import chunk_backward, chunk_state_grad

    gen = torch.Generator().manual_seed(11)
    C, K, V = 16, 8, 6
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, dO, dSn = 0.5 * r(C, K), 0.5 * r(C, K), r(C, V), r(C, V), r(K, V)
    a, b = -torch.rand(C, K, generator=gen, dtype=torch.float64), torch.rand(C, generator=gen, dtype=torch.float64)
    want = chunk_state_grad(q, k, a, b, dO, dSn, 0.3, exact)
    for S in (r(K, V), 10 * r(K, V)):
        got = chunk_backward(q, k, v, a, b, S, dO, dSn, 0.3, exact)[-1]
        assert_close("dS", want, got, 1e-12)
    # Column independence: the V-split of the kernel's stage 2 is exact.
    assert_close("dS[:, :2]", want[:, :2], chunk_state_grad(q, k, a, b, dO[:, :2], dSn[:, :2], 0.3, exact), 1e-12)


def _kernel_call(c, ckpts, safe, L=L_CKPT, L2=L_RECOMPUTE, offsets=None, **extra):
    from kdakit.ops.kda.chunk_bwd import chunk_kda_bwd
    from kdakit.ops.kda.plan import plan_kda

    f32 = {n: (c[n].float() if c[n] is not None else None) for n in ("q", "k", "v", "g", "beta", "h0", "do", "dht")}
    kw = dict(c["kw"])
    for p in ("A_log", "dt_bias"):
        if kw[p] is not None:
            kw[p] = kw[p].float()
    plan = plan_kda(f32["q"], f32["v"], cu_seqlens=kw["cu_seqlens"], checkpoint_every_n_tokens=L,
                    initial_state=f32["h0"] is not None, gate_params=kw["A_log"] is not None)
    plan = replace(plan, recompute_every_n_tokens=L2)
    tensors = {n: kw.pop(n) for n in ("A_log", "dt_bias", "cu_seqlens")}
    opts = kda_options(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"], initial_state=f32["h0"], safe_gate=safe,
                       **tensors, **kw)
    return chunk_kda_bwd(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"], f32["do"], f32["dht"],
                         checkpoints=ckpts.float().contiguous(), initial_state=f32["h0"], plan=plan,
                         ckpt_offsets=offsets, opts=opts, **tensors, **extra)


KERNEL_CASES = {
    "plain_exact": (dict(), False),
    "safe_h0_v_first_dht": (dict(gate=True, lower_bound=-5.0, l2=True, bsig=True, h0=True, vfirst=True, dht=True),
                            True),
    "softplus_varlen_gva": (dict(gate=True, l2=True, bsig=True, neg=True, H=1, HV=2, lens=[0, 1, 37, 16, 20],
                                 h0=True, dht=True), False),
    "reset_decays_k32": (dict(reset=True, l2=True, lens=[40, 9], K=32, V=32, dht=True), False),
    "masked_dims": (dict(l2=True, bsig=True, K=20, V=12, T=33, h0=True), False),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_autograd(name):
    opts, safe = KERNEL_CASES[name]
    c = _case(**opts, seed=1)
    twin, ckpts = _twin(c, safe)
    ref = _autograd(c)
    got = dict(zip(NAMES, _kernel_call(c, ckpts, safe)))
    for n in NAMES:
        if n not in ref:
            assert got[n] is None, f"{n} should be None for this call"
            continue
        assert got[n].dtype == (torch.float32 if n in ("dA_log", "ddt_bias", "dh0") else c["q"].float().dtype)
        assert got[n].shape == ref[n].shape, n
        assert_close(n, ref[n], got[n], 1e-4)
        assert_close(n + " vs twin", twin[n], got[n], 1e-4)


def _checkpoints(c, safe, L):
    _, _, ckpts, offs = reference_checkpoints(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=c["h0"],
                                              safe_gate=safe, checkpoint_every_n_tokens=L, **c["kw"])
    return ckpts, offs


WINDOW_CASES = {
    # (options, safe, L, L2): windows of 2 chunks, 2 or 3 windows per checkpoint segment, sequences
    # ending mid-window, mid-segment and on a boundary, plus an empty one.
    "softplus_gva_varlen_w32_seg64": (dict(gate=True, l2=True, bsig=True, neg=True, H=1, HV=2,
                                           lens=[70, 0, 64, 5], h0=True, dht=True), False, 64, 32),
    "safe_v_first_w32_seg96": (dict(gate=True, lower_bound=-5.0, l2=True, bsig=True, H=2, HV=4, B=2, T=101,
                                    h0=True, vfirst=True, dht=True), True, 96, 32),
    "reset_decays_w16_seg48": (dict(reset=True, l2=True, lens=[53, 17], dht=True), False, 48, 16),
    # H == HV: stages 1-2 from the windows' intermediates (chunk_bwd_states), slot sets per window
    "softplus_varlen_w32_seg64_lean": (dict(gate=True, l2=True, bsig=True, neg=True, H=2, HV=2,
                                            lens=[70, 0, 64, 5], h0=True, dht=True), False, 64, 32),
    "safe_v_first_w32_seg96_lean": (dict(gate=True, lower_bound=-5.0, l2=True, bsig=True, H=2, HV=2, B=2, T=101,
                                         h0=True, vfirst=True, dht=True), True, 96, 32),
}


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_windowed_multi_window_multi_segment(name):
    opts, safe, L, L2 = WINDOW_CASES[name]
    c = _case(**opts, seed=3)
    ckpts, offs = _checkpoints(c, safe, L)
    ref = _autograd(c)
    got = dict(zip(NAMES, _kernel_call(c, ckpts, safe, L=L, L2=L2, offsets=offs)))
    for n in NAMES:
        if n not in ref:
            assert got[n] is None, f"{n} should be None for this call"
            continue
        assert got[n].shape == ref[n].shape, n
        assert_close(n, ref[n], got[n], 1e-4)


def test_windowed_value_blocks(monkeypatch):
    """V split into several blocks in every stage (V = 48: blocks of 32 and 16 with masking in the
    sequential stages, three blocks of 16 in the gradient stage's loop), K = 20 masked."""
    import kdakit.ops.kda.chunk_bwd_windowed as bwd

    monkeypatch.setattr(bwd, "GRADS_BLOCK_V", 16)
    c = _case(gate=True, lower_bound=-5.0, l2=True, bsig=True, H=1, HV=2, K=20, V=48, lens=[37, 20], h0=True,
              dht=True, seed=8)
    ckpts, offs = _checkpoints(c, True, 32)
    assert bwd.state_block_v(4, 48) == bwd.state_block_v(8, 48) == 32
    ref = _autograd(c)
    got = dict(zip(NAMES, _kernel_call(c, ckpts, True, offsets=offs)))
    for n in ref:
        assert_close(n, ref[n], got[n], 1e-4)


def test_windowed_bf16_stage_slots():
    """S_c and dS slots stored in bf16 (the default for 16-bit inputs) on fp32 inputs: small, bounded error.

    The interpreter truncates on the bf16 store (the GPU rounds), so this is a pessimistic check.
    """
    c = _case(gate=True, lower_bound=-5.0, l2=True, bsig=True, lens=[45, 30], h0=True, dht=True, seed=4)
    ckpts, offs = _checkpoints(c, True, 32)
    ref = _autograd(c)
    got = dict(zip(NAMES, _kernel_call(c, ckpts, True, offsets=offs, stage_dtype=torch.bfloat16)))
    for n in ref:
        assert_close(n, ref[n], got[n], 5e-3)


class _RecordingTorch:
    """Stands in for ``torch`` inside chunk_bwd: records (shape, dtype) of torch.empty / torch.zeros."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name not in ("empty", "zeros"):
            return fn

        def record(*shape, dtype=None, device=None):
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            self.calls.append((tuple(int(x) for x in shape), dtype))
            return fn(*shape, dtype=dtype, device=device)
        return record


@pytest.mark.parametrize("h0,gate,L,H", [(False, True, 64, 1), (True, False, 32, 2), (False, False, 64, 2)])
def test_workspace_allocations_are_what_the_launcher_allocates(monkeypatch, h0, gate, L, H):
    import kdakit.ops.kda.chunk_bwd_windowed as bwd

    c = _case(gate=gate, l2=True, H=H, HV=2, lens=[40, 9], h0=h0, dht=True, seed=6)
    ckpts, offs = _checkpoints(c, False, L)
    rec = _RecordingTorch()
    monkeypatch.setattr(bwd, "torch", rec)
    _kernel_call(c, ckpts, False, L=L, L2=32 if L == 64 else 16, offsets=offs)
    monkeypatch.undo()
    want = backward_workspace_allocations(2, 2, 16, 16, 40, L, [40, 9], torch.float32, initial_state=h0,
                                          gate_params=gate, recompute_every_n_tokens=32 if L == 64 else 16, H=H)
    dh0 = [((2, 2, 16, 16), torch.float32)] if h0 else []  # the state-gradient carry is dh0 itself
    assert sorted(rec.calls, key=str) == sorted([(s, d) for _, s, d in want] + dh0, key=str)
    names = [n for n, _, _ in want]
    assert ("bwd_state_grad_carry" in names) == (not h0) and ("bwd_ddt_bias_partials" in names) == gate
    # Stage 2 from the window's intermediates (H == HV) adds the per-window Aqk and exp(g_C) slots.
    assert ("bwd_window_aqk" in names) == ("bwd_window_decay" in names) == (H == 2)


def test_workspace_bytes_at_benchmark_shapes():
    """Workspace + checkpoints within a budget above the floor of docs/spec.md §3 (190 MB at 1x8K H96, 250 MB at 8x8K H16)."""

    for N, HV, budget in ((1, 96, 190e6), (8, 16, 250e6), (1, 128, 250e6)):
        p = plan_kda(seqlens=[8192] * N, H=HV, K=128)  # the default cadence and checkpoint dtype
        ws = backward_workspace_allocations(N, HV, 128, 128, 8192, p.checkpoint_every_n_tokens, [8192] * N,
                                            torch.bfloat16)
        ws_bytes = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, s, d in ws)
        assert ws_bytes == p.backward_workspace_bytes
        assert ws_bytes + p.checkpoint_bytes < budget, (N, HV, ws_bytes / 1e6, p.checkpoint_bytes / 1e6)


def test_kernel_rejects_bad_inputs():
    c = _case(H=2, HV=2, dtype=torch.float32)
    _, ckpts = _twin(c, False)
    with pytest.raises(ValueError, match="checkpoints"):
        _kernel_call(c, ckpts[:-1], False)
    c["q"] = c["q"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, head-major storage
    with pytest.raises(ValueError, match="q must be contiguous"):
        _kernel_call(c, ckpts, False)
    wide = _case(K=16, V=16, dtype=torch.float32)
    wide["v"] = torch.randn(2, 37, 1, 160)
    wide["do"] = torch.randn(2, 37, 1, 160)
    with pytest.raises(ValueError, match="V <= 128"):
        _kernel_call(wide, torch.zeros(4, 1, 16, 160), False)


# The compiled (non-interpreted) windowed stages must build for sm_90a without a GPU. Stage 1 runs the
# same state step as stage 2's role 0, so stages 2 and 3 cover every jit helper.
_COMPILE_SCRIPT = r"""
import sys
sys.path.insert(0, "benchmarks")
from compile_sm90 import build  # the sm_90a build with the JIT's alignment hints, and its ptxas report
import kdakit.ops.kda.chunk_bwd_windowed as M

c = dict(C=16, BK=128, GATE=2, HAS_A=True, HAS_BIAS=True, L2NORM=True, BETA_SIGMOID=True, NEG_EIGVAL=False,
         SAFE=True, IS_VARLEN=True, DOT_PREC="tf32", GRAD_PREC="tf32", GRAD_OP=1, INV_DOUBLING=True, GROUP=1,
         SUB_CHUNKS=16)
for fn, const, warps in ((M.chunk_kda_bwd_window_states_kernel, dict(c, BV=128, N_SUB=8, ROUND_STAGE=False),
                          M.STATE_NUM_WARPS),
                         (M.chunk_kda_bwd_window_grads_kernel, dict(c, BV=M.GRADS_BLOCK_V), M.GRADS_NUM_WARPS)):
    assert "mma" in build(fn, const, warps).asm["ptx"]
    print("built", fn.__name__)
"""


def test_windowed_kernels_compile_for_sm90():
    import subprocess

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("triton's bundled ptxas is missing, cannot build for sm_90a")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("built") == 2
