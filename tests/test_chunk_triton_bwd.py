"""CPU tier of the Triton chunk backward: the float64 twin against autograd, then the kernel (interpreter).

1. ``chunk_bwd_reference`` (hand-written chunk backward + two-level recompute driver) must equal
   ``torch.autograd`` of ``naive_recurrent_kda`` in float64 to round-off, for every gradient and
   option: this validates the design note's derivation.
2. ``chunk_kda_bwd`` (Triton, under ``TRITON_INTERPRET=1``) must match that twin on fp32 inputs
   (and, through it, autograd). Checkpoints come from the twin's forward, so the backward is tested
   on its own. Cadences are tiny (checkpoint every 32 tokens, recompute every 16) so sequences span
   several segments and sub-segments.
"""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    _TRITON_PREIMPORTED = True
else:
    os.environ["TRITON_INTERPRET"] = "1"
    _TRITON_PREIMPORTED = False

import itertools
from dataclasses import replace

import pytest
import torch

from kdakit.ops.kda.chunk_bwd_reference import chunk_kda_bwd_reference, reference_checkpoints
from kdakit.ops.kda.naive import naive_recurrent_kda
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


def _kernel_call(c, ckpts, safe, L=L_CKPT, L2=L_RECOMPUTE, **extra):
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
    return chunk_kda_bwd(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"], f32["do"], f32["dht"],
                         checkpoints=ckpts.float().contiguous(), initial_state=f32["h0"], safe_gate=safe,
                         plan=plan, **kw, **extra)


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


def test_kernel_persistent_grid_and_cadences():
    """Fewer programs than (sequence, head) items, and a segment cadence with several sub-segments."""
    c = _case(gate=True, lower_bound=-5.0, l2=True, bsig=True, H=1, HV=2, lens=[23, 0, 40, 5], h0=True, seed=2)
    _, ckpts = _twin(c, True)
    ref = _autograd(c)
    got = dict(zip(NAMES, _kernel_call(c, ckpts, True, max_programs=3)))
    for n in ref:
        assert_close(n, ref[n], got[n], 1e-4)


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
