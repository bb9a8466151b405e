"""The 64-token pipeline end to end (``chunk64_kda``) under the Triton interpreter against the float64 chunked
reference: output, final state and every gradient, for each gate, with grouped value heads, packed uneven
sequences (a zero-length one included), an initial state in both layouts, windows, and strided token views."""

import math

import pytest
import torch

from kdakit.ops.kda.chunk.autograd import chunk64_kda
from kdakit.ops.kda.chunk.plan import make_chunk_plan
from kdakit.ops.kda.reference.chunk import chunked_kda_reference
from kdakit.ops.kda.options import kda_options

GATES = {
    "safe": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),
    "softplus": dict(use_gate_in_kernel=True, safe_gate=False, lower_bound=None),
    "raw": dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None),
}


def _inputs(gate, *, B, T, H, HV, K, V, dtype, lengths, seed, strided, h0, v_first):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    if strided:  # q, k, v split from one fused projection: token stride wider than the head block
        fused = randn(B, T, 2 * H * K + HV * V)
        q, k, v = fused.split([H * K, H * K, HV * V], dim=-1)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
    else:
        q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    g = randn(B, T, HV, K)
    beta = randn(B, T, HV)
    A_log = dt_bias = None
    if gate == "safe":
        A_log, dt_bias = 0.3 * randn(HV, dt=torch.float32), 0.3 * randn(HV * K, dt=torch.float32)
    else:
        A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen))
        dt = torch.exp(torch.rand(HV * K, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt_bias = (dt + torch.log(-torch.expm1(-dt))).float()
    if gate == "raw":
        a = -A_log.exp().view(HV, 1) * torch.nn.functional.softplus(g.double() + 2.0 * dt_bias.double().view(HV, K))
        a[..., 0, :, 1] = -float("inf")  # a reset
        a[..., 3, :, 2] = -30.0
        g = a.float()
        A_log = dt_bias = None
    cu = None
    if lengths is not None:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)
    N = B if cu is None else len(lengths)
    initial = None
    if h0:
        initial = randn(N, HV, V, K) if v_first else randn(N, HV, K, V)
        initial = initial.float()
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, initial_state=initial)


def _run(fn, x, flags, v_first, do, dht):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()
              if n != "cu_seqlens" and t is not None}
    o, ht = fn(leaves, flags, v_first)
    (o * do).sum().backward(retain_graph=True) if dht is None else (
        (o * do).sum() + (ht * dht).sum()).backward()
    return o.detach(), ht.detach() if ht is not None else None, {n: t.grad for n, t in leaves.items()}


def _ours(x, window, keep=False, launch=None):
    def fn(leaves, flags, v_first):
        q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
        opts = kda_options(q, k, v, g, beta, initial_state=leaves.get("initial_state"), output_final_state=True,
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=leaves.get("A_log"),
                           dt_bias=leaves.get("dt_bias"), state_v_first=v_first, cu_seqlens=x["cu_seqlens"], **flags)
        A_log, dt_bias = opts.kernel_gate_params(leaves.get("A_log"), leaves.get("dt_bias"))
        return chunk64_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=leaves.get("initial_state"),
                           cu_seqlens=x["cu_seqlens"], opts=opts, window_tokens=window,
                           keep_intermediates=keep, launch=launch)
    return fn


def _reference(x):
    def fn(leaves, flags, v_first):
        f64 = {n: t.double() for n, t in leaves.items()}
        return chunked_kda_reference(
            f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], scale=x["q"].shape[-1] ** -0.5,
            A_log=f64.get("A_log"), dt_bias=f64.get("dt_bias"), initial_state=f64.get("initial_state"),
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=flags["use_gate_in_kernel"],
            use_beta_sigmoid_in_kernel=True, lower_bound=flags["lower_bound"], state_v_first=v_first,
            cu_seqlens=x["cu_seqlens"])
    return fn


def _rel(ref, got):
    ref, got = ref.double(), got.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CASES = [
    # gate, B, T, H, HV, K, V, dtype, lengths, strided, h0, v_first, window, keep
    ("softplus", 1, 139, 1, 2, 24, 20, torch.float32, [70, 0, 64, 5], False, True, False, 64, False),
    ("raw", 2, 80, 2, 4, 32, 32, torch.float32, None, True, False, False, None, False),
    ("safe", 1, 139, 2, 2, 32, 24, torch.float32, [70, 0, 64, 5], True, True, True, None, False),
    ("softplus", 2, 80, 1, 2, 32, 32, torch.bfloat16, None, False, False, False, 64, False),
    ("raw", 1, 139, 1, 2, 32, 16, torch.float32, [70, 0, 64, 5], True, True, False, 64, True),
    # nine 1-chunk windows, which the forward runs in two groups (chunk64_forward_groups)
    ("softplus", 1, 576, 1, 1, 16, 16, torch.float32, None, False, True, False, 64, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[7])[6:]}-w{c[12]}{'-keep' if c[13] else ''}")
def test_pipeline_matches_float64(case):
    gate, B, T, H, HV, K, V, dtype, lengths, strided, h0, v_first, window, keep = case
    x = _inputs(gate, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, lengths=lengths, seed=7, strided=strided,
                h0=h0, v_first=v_first)
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    N = B if lengths is None else len(lengths)
    dht = torch.randn(N, HV, *((V, K) if v_first else (K, V)), generator=gen)
    flags = GATES[gate]
    o_ref, ht_ref, g_ref = _run(_reference(x), x, flags, v_first, do.double(), dht.double())
    o, ht, g = _run(_ours(x, window, keep), x, flags, v_first, do, dht)
    if T == 576:  # the case that exercises the forward's groups of windows
        cp = make_chunk_plan(B, T, lengths, "cpu", window, slot_geometry=(H, HV, K, V, dtype, dtype))
        assert len(cp.forward_groups) == 2, cp.forward_groups
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    assert _rel(o_ref, o) < tol, ("o", _rel(o_ref, o))
    assert _rel(ht_ref, ht) < tol, ("ht", _rel(ht_ref, ht))
    for name, ref in g_ref.items():
        assert g[name] is not None, name
        assert torch.isfinite(g[name]).all(), name
        assert _rel(ref, g[name]) < 5 * tol, (name, _rel(ref, g[name]))
