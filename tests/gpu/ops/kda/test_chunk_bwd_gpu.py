"""GPU tier of the Triton chunk backward (H200): real shapes, poisoned memory, determinism, memory.

Checkpoints come from the Triton forward (``chunk_kda_fwd``); gradients are compared with autograd of
the chunked PyTorch reference run in float64 on the GPU, by the issue's RMS-ratio targets for bf16
inputs (dq, dk, dv, dA_log, ddt_bias, dh0 <= 0.008; dg, dbeta <= 0.02).
"""

import pytest
import torch

from kdakit.testing import assert_close

pytestmark = pytest.mark.gpu

D = 128
TOL = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dA_log": 8e-3, "ddt_bias": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
SAFE_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=False, safe_gate=True, lower_bound=-5.0)
SOFTPLUS_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      allow_neg_eigval=True, safe_gate=False, lower_bound=None)


def _inputs(lens, H, HV, *, dtype=torch.bfloat16, h0=False, vfirst=False, dht=False, seed=0, K=D, V=D):
    torch.manual_seed(seed)
    dev = "cuda"
    T = sum(lens)
    q = torch.randn(1, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(1, T, H, K, device=dev, dtype=dtype)
    v = torch.randn(1, T, HV, V, device=dev, dtype=dtype)
    g = torch.randn(1, T, HV, K, device=dev, dtype=dtype)
    beta = torch.randn(1, T, HV, device=dev, dtype=dtype)
    A_log = 0.3 * torch.randn(HV, device=dev)
    dt_bias = 0.3 * torch.randn(HV * K, device=dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.int64)
    N = len(lens)
    shape = (N, HV, V, K) if vfirst else (N, HV, K, V)
    init = 0.1 * torch.randn(shape, device=dev) if h0 else None
    do = torch.randn_like(v)
    dht_t = 0.1 * torch.randn(shape, device=dev) if dht else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu=cu, h0=init, do=do, dht=dht_t,
                vfirst=vfirst)


def _plan(c, L=None):
    from kdakit.ops.kda.plan import plan_kda

    return plan_kda(c["q"], c["v"], cu_seqlens=c["cu"], checkpoint_every_n_tokens=L,
                    initial_state=c["h0"] is not None, output_final_state=c["dht"] is not None)


def _options(c, flags):
    from kdakit.ops.kda.options import kda_options

    # the launchers' contract: inputs as chunk_kda hands them over (this tier never validated them)
    return kda_options(c["q"], c["k"], c["v"], c["g"], c["beta"], scale=D ** -0.5, initial_state=c["h0"],
                       output_final_state=c["dht"] is not None, A_log=c["A_log"], dt_bias=c["dt_bias"],
                       state_v_first=c["vfirst"], cu_seqlens=c["cu"], validate=False, **flags)


def _forward(c, flags, plan):
    from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd

    return chunk_kda_fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], opts=_options(c, flags), A_log=c["A_log"],
                         dt_bias=c["dt_bias"], initial_state=c["h0"], cu_seqlens=c["cu"], plan=plan)


def _backward(c, flags, plan, ckpts, **extra):
    from kdakit.ops.kda.chunk_bwd import chunk_kda_bwd

    return chunk_kda_bwd(c["q"], c["k"], c["v"], c["g"], c["beta"], c["do"], c["dht"], checkpoints=ckpts,
                         A_log=c["A_log"], dt_bias=c["dt_bias"], initial_state=c["h0"], cu_seqlens=c["cu"],
                         plan=plan, opts=_options(c, flags), **extra)


def _reference_grads(c, flags):
    from kdakit.ops.kda.reference.chunk import chunked_kda_reference

    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias"] + (["h0"] if c["h0"] is not None else [])
    leaves = {n: c[n].detach().double().requires_grad_(True) for n in names}
    o, final = chunked_kda_reference(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=D ** -0.5,
        A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], initial_state=leaves.get("h0"),
        output_final_state=c["dht"] is not None, state_v_first=c["vfirst"], cu_seqlens=c["cu"],
        **{k: v for k, v in flags.items() if k != "safe_gate"})
    loss = (o * c["do"].double()).sum()
    if c["dht"] is not None:
        loss = loss + (final * c["dht"].double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    out = dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), grads[:7]))
    if c["h0"] is not None:
        out["dh0"] = grads[7]
    return out


def _poison_allocator():
    """Fill freed cached blocks with NaN so an unwritten gradient element cannot pass as a value."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    n = min(int(free * 0.5) // 4, 1 << 30)
    blob = torch.full((n,), float("nan"), device="cuda")
    del blob  # stays cached: the backward's allocations reuse the NaN-filled block


CASES = {
    "safe_varlen": (dict(lens=[3000, 0, 17, 1031], H=4, HV=4, h0=True, dht=True), SAFE_FLAGS, None),
    "softplus_gva_vfirst": (dict(lens=[2500, 700], H=2, HV=4, h0=True, vfirst=True, dht=True), SOFTPLUS_FLAGS, 512),
    "long_32k": (dict(lens=[32768], H=2, HV=2), SAFE_FLAGS, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_reference(name):
    shape, flags, L = CASES[name]
    c = _inputs(**shape)
    plan = _plan(c, L)
    _, _, ckpts = _forward(c, flags, plan)
    ref = _reference_grads(c, flags)
    _poison_allocator()
    got = dict(zip(NAMES, _backward(c, flags, plan, ckpts)))
    for n in NAMES:
        if n not in ref:
            assert got[n] is None
            continue
        want_dtype = torch.float32 if n in ("dA_log", "ddt_bias", "dh0") else c["q"].dtype
        assert got[n].dtype == want_dtype, n
        assert torch.isfinite(got[n]).all(), f"{n} has non-finite entries (unwritten poisoned memory?)"
        assert_close(n, ref[n], got[n], TOL[n])


def test_backward_is_bitwise_deterministic():
    c = _inputs(lens=[4096, 1000], H=2, HV=4, h0=True, dht=True)
    plan = _plan(c)
    _, _, ckpts = _forward(c, SAFE_FLAGS, plan)
    first = _backward(c, SAFE_FLAGS, plan, ckpts)
    _poison_allocator()
    second = _backward(c, SAFE_FLAGS, plan, ckpts)
    for n, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{n} differs between two identical backward calls"


def test_backward_reset_decays_finite():
    """Log-decays of -1000 (gate not in kernel) on the EXACT path stay finite and accurate."""
    c = _inputs(lens=[2048], H=2, HV=2, dht=True)
    u = torch.rand_like(c["g"], dtype=torch.float32)
    c["g"] = torch.where(u < 0.05, torch.full_like(u, -1000.0), -0.1 * u).to(torch.bfloat16)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=True,
                 allow_neg_eigval=False, safe_gate=False, lower_bound=None)
    c["A_log"] = c["dt_bias"] = None
    plan = _plan(c)
    _, _, ckpts = _forward(c, flags, plan)
    got = dict(zip(NAMES, _backward(c, flags, plan, ckpts)))
    from kdakit.ops.kda.reference.chunk import chunked_kda_reference
    leaves = [c[n].detach().double().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    o, final = chunked_kda_reference(*leaves, scale=D ** -0.5, output_final_state=True, cu_seqlens=c["cu"],
                                     **{k: v for k, v in flags.items() if k != "safe_gate"})
    grads = torch.autograd.grad((o * c["do"].double()).sum() + (final * c["dht"].double()).sum(), leaves)
    for n, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads):
        assert torch.isfinite(got[n]).all(), n
        assert_close(n, r, got[n], TOL[n])


def test_backward_peak_memory_within_plan():
    """Peak of the backward <= inputs + dO + gradients + checkpoints + workspace (+ 16 MiB slack)."""
    c = _inputs(lens=[8192], H=16, HV=16)
    plan = _plan(c)
    _, _, ckpts = _forward(c, SAFE_FLAGS, plan)
    _backward(c, SAFE_FLAGS, plan, ckpts)  # compile outside the measured interval
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = _backward(c, SAFE_FLAGS, plan, ckpts)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grad_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
    budget = grad_bytes + plan.backward_workspace_bytes + plan.transient_bytes + (16 << 20)
    assert extra <= budget, f"backward allocated {extra / 2**20:.1f} MiB above its inputs, budget {budget / 2**20:.1f} MiB"
