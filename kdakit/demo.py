"""``kdakit demo``: run KDA forward+backward once and check it against the naive definition.

The check uses SPEC-level tolerances on the RMS error ratio against a float64 run of
``naive_recurrent_kda`` on the same inputs: o and final state <= 0.005; dq, dk, dv,
dA_log, ddt_bias, dh0 <= 0.008; dg, dbeta <= 0.02.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.chunk import chunk_kda
from kdakit.ops.kda.naive import naive_recurrent_kda
from kdakit.testing import SPEC_RMS_LIMITS, error_report

# SPEC limits under the demo's names (dh0 is run_kda's dinitial_state).
TOLERANCES = {("dh0" if n == "dinitial_state" else n): lim for n, lim in SPEC_RMS_LIMITS.items()}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class DemoResult:
    rows: list
    ok: bool
    text: str


def _inputs(B, T, H, HV, D, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s)

    q, k = r(B, T, H, D), r(B, T, H, D)
    v = r(B, T, HV, D)
    g = r(B, T, HV, D)
    beta = r(B, T, HV)
    A_log = r(HV, s=0.5)
    dt_bias = r(HV * D, s=0.5)
    h0 = r(B, HV, D, D, s=0.1)
    do = r(B, T, HV, D)
    dht = r(B, HV, D, D, s=0.1)
    tok = [x.to(device, dtype) for x in (q, k, v, g, beta)]
    par = [x.to(device, torch.float32) for x in (A_log, dt_bias, h0)]
    return tok, par, do.to(device, dtype), dht.to(device, torch.float32)


def run_demo(*, device: str = "auto", seq: int = 256, heads: int = 2, value_heads: int | None = None,
             dim: int = 64, dtype: str = "bf16", seed: int = 0) -> DemoResult:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device must be 'cpu' or 'auto' on a machine without CUDA, got 'cuda'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    HV = value_heads or heads
    B = 1
    tok, par, do, dht = _inputs(B, seq, heads, HV, dim, DTYPES[dtype], dev, seed)
    leaves = [x.clone().requires_grad_() for x in tok + par]
    q, k, v, g, beta, A_log, dt_bias, h0 = leaves
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias, **opts)
    torch.autograd.backward((o, ht), (do, dht))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    got = [o, ht] + [x.grad for x in leaves]

    ref_leaves = [x.detach().to("cpu", torch.float64).requires_grad_() for x in tok + par]
    rq, rk, rv, rg, rb, rA, rbias, rh0 = ref_leaves
    ro, rht = naive_recurrent_kda(rq, rk, rv, rg, rb, initial_state=rh0, output_final_state=True,
                                  A_log=rA, dt_bias=rbias, **opts)
    torch.autograd.backward((ro, rht), (do.to("cpu", torch.float64), dht.to("cpu", torch.float64)))
    ref = [ro, rht] + [x.grad for x in ref_leaves]

    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]
    rows = []
    ok = True
    for name, r, x in zip(names, ref, got):
        rep = error_report(name, r, x)
        passed = rep.rms_ratio <= TOLERANCES[name]
        ok &= passed
        rows.append((name, rep.max_abs, rep.rms_ratio, TOLERANCES[name], passed))

    backend = select_backend(dev)
    lines = [
        "kdakit demo: KDA forward+backward vs the float64 naive recurrence",
        f"shape     B={B} T={seq} H={heads} HV={HV} K=V={dim} {dtype}, l2norm + softplus gate in kernel + beta sigmoid, h0 and final state",
        f"device    {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}",
        f"backend   {backend}",
        f"wall time {wall * 1e3:.1f} ms (forward+backward, first call)",
    ]
    if peak is not None:
        lines.append(f"peak mem  {peak / 2**30:.3f} GiB allocated")
    lines.append("")
    lines.append(f"{'tensor':<12}{'max abs err':>14}{'rms ratio':>12}{'limit':>9}  result")
    for name, ma, rr, tol, passed in rows:
        lines.append(f"{name:<12}{ma:>14.3e}{rr:>12.3e}{tol:>9.3f}  {'ok' if passed else 'FAIL'}")
    lines.append("")
    lines.append("PASS" if ok else "FAIL: at least one error is above its limit")
    return DemoResult(rows=rows, ok=ok, text="\n".join(lines))
