"""GPU tier of the 64-token chunk pipelines (``chunk_kda(pipeline="chunk64" | "chunk64_fast")``) on the H200: every
gate (safe, softplus in kernel with FLA's layer init, a precomputed fp32 log-decay with resets), grouped value
heads, packed uneven sequences, initial state and final-state gradient, against autograd of the float64 chunked
reference on the same inputs and cotangents; FLA 0.6.0 on the same inputs where installed (kdakit no worse);
bitwise reruns; memory poisoned with NaN before the call; strided token views giving the contiguous call's bits.
"""

import math

import pytest
import torch

from kdakit.testing import error_report

pytestmark = pytest.mark.gpu

TOL = {"o": 8e-3, "ht": 8e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "A_log": 8e-3, "dt_bias": 8e-3, "h0": 8e-3,
       "g": 2e-2, "beta": 2e-2}
GATES = {
    "safe": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),
    "softplus": dict(use_gate_in_kernel=True, safe_gate=False, lower_bound=None),
    "raw": dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None),
}


def _inputs(gate, lens, H, HV, *, seed=0, D=128, mild=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(lens), len(lens)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=gen, device="cuda").to(dtype)

    x = dict(q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, HV, D), g=randn(1, T, HV, D), beta=randn(1, T, HV))
    if gate == "safe":
        A_log, dt_bias = 0.3 * randn(HV, dtype=torch.float32), 0.3 * randn(HV * D, dtype=torch.float32)
    else:  # FLA's layer init (A up to 16: large decays), or mild decays
        hi = 2.0 if mild else 16.0
        A_log = torch.log(torch.empty(HV, device="cuda").uniform_(1, hi, generator=gen))
        dt = torch.exp(torch.rand(HV * D, device="cuda", generator=gen) * (math.log(0.1) - math.log(1e-3))
                       + math.log(1e-3))
        dt_bias = dt + torch.log(-torch.expm1(-dt))
    if gate == "raw":
        a = -A_log.exp().view(HV, 1) * torch.nn.functional.softplus(x["g"].float() + dt_bias.view(HV, D))
        a[0, 100, :, :3] = -float("inf")  # resets
        x["g"] = a
        A_log = dt_bias = None
    x.update(A_log=A_log, dt_bias=dt_bias, h0=0.1 * randn(N, HV, D, D, dtype=torch.float32))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    return x, cu, randn(1, T, HV, D), 0.1 * randn(N, HV, D, D, dtype=torch.float32)


def _run(fn, x, cu, do, dht, gate, **kw):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves.get("A_log"),
               dt_bias=leaves.get("dt_bias"), initial_state=leaves["h0"], output_final_state=True,
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu.cuda(),
               cu_seqlens_cpu=cu, **GATES[gate], **kw)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    return {"o": o.detach(), "ht": ht.detach(), **{n: t.grad for n, t in leaves.items()}}


def _reference(x, cu, do, dht, gate):
    from kdakit.ops.kda.reference.chunk import chunked_kda_reference

    def fn(q, k, v, g, beta, *, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, safe_gate, **kw):
        f64 = [t.double() if t is not None else None for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)]
        return chunked_kda_reference(*f64[:5], scale=q.shape[-1] ** -0.5, A_log=f64[5], dt_bias=f64[6],
                                     initial_state=f64[7], cu_seqlens=cu_seqlens_cpu, **kw)
    return _run(fn, x, cu, do.double(), dht.double(), gate)


def _errors(ref, got):
    return {n: error_report(n, ref[n], got[n]).rms_ratio for n in ref}


@pytest.mark.parametrize("pipeline", ["chunk64", "chunk64_fast"])
@pytest.mark.parametrize("gate", list(GATES))
def test_chunk64_against_float64_and_fla(gate, pipeline):
    from kdakit import chunk_kda

    x, cu, do, dht = _inputs(gate, [1500, 64, 2532], H=16, HV=16)  # head counts in the carried FLA autotune cache
    ref = _reference(x, cu, do, dht, gate)
    got = _run(chunk_kda, x, cu, do, dht, gate, pipeline=pipeline, checkpoint_every_n_tokens=1024)
    errs = _errors(ref, got)
    for name, err in errs.items():
        assert err <= TOL[name], (name, err, errs)
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return
    theirs = _errors(ref, _run(fla_chunk_kda, x, cu, do, dht, gate))
    for name, err in errs.items():
        assert err <= max(1.25 * theirs[name], 1e-3), (name, err, theirs[name])


@pytest.mark.parametrize("mild", [False, True])
def test_chunk64_fast_at_32k_softplus(mild):
    from kdakit import chunk_kda

    x, cu, do, dht = _inputs("softplus", [32768], H=1, HV=2, seed=1, mild=mild)
    errs = _errors(_reference(x, cu, do, dht, "softplus"),
                   _run(chunk_kda, x, cu, do, dht, "softplus", pipeline="chunk64_fast"))
    for name, err in errs.items():
        assert err <= TOL[name], (name, err, errs)


@pytest.mark.parametrize("pipeline", ["chunk64", "chunk64_fast"])
def test_chunk64_bitwise_reruns_poisoned_memory_and_strided_views(pipeline):
    from kdakit import chunk_kda

    x, cu, do, dht = _inputs("softplus", [700, 0, 2400], H=2, HV=4, seed=2)
    first = _run(chunk_kda, x, cu, do, dht, "softplus", pipeline=pipeline, checkpoint_every_n_tokens=1024)
    poison = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB of NaN the allocator hands out again
    del poison
    second = _run(chunk_kda, x, cu, do, dht, "softplus", pipeline=pipeline, checkpoint_every_n_tokens=1024)
    for name in first:
        assert torch.isfinite(second[name]).all(), name
        assert torch.equal(first[name], second[name]), name
    # q, k, v as views of one fused projection (non-contiguous, read through their strides): the same bits
    T, H, HV, D = x["q"].shape[1], 2, 4, 128
    fused = torch.cat([x["q"].reshape(1, T, -1), x["k"].reshape(1, T, -1), x["v"].reshape(1, T, -1)], dim=-1)
    fused.requires_grad_(True)
    q, k, v = fused.split([H * D, H * D, HV * D], dim=-1)
    q, k, v = q.view(1, T, H, D), k.view(1, T, H, D), v.view(1, T, HV, D)
    assert not q.is_contiguous()
    rest = {n: x[n].detach().clone().requires_grad_(True) for n in ("g", "beta", "A_log", "dt_bias", "h0")}
    o, ht = chunk_kda(q, k, v, rest["g"], rest["beta"], A_log=rest["A_log"], dt_bias=rest["dt_bias"],
                      initial_state=rest["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu,
                      pipeline=pipeline, checkpoint_every_n_tokens=1024, **GATES["softplus"])
    torch.autograd.backward([o, ht], [do, dht])
    assert torch.equal(first["o"], o) and torch.equal(first["ht"], ht)
    for name, t in rest.items():
        assert torch.equal(first[name], t.grad), name
    dq, dk, dv = fused.grad.split([H * D, H * D, HV * D], dim=-1)
    for name, grad in (("q", dq), ("k", dk), ("v", dv)):
        assert torch.equal(first[name], grad.reshape(first[name].shape)), name
