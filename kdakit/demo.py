"""``kdakit demo``: run KDA forward+backward once and check it against the naive definition.

The check uses the accuracy limits of docs/spec.md §8 on the RMS error ratio against a float64 run of
``naive_recurrent_kda`` on the same inputs: o and final state <= 0.005; dq, dk, dv,
dA_log, ddt_bias, dh0 <= 0.008; dg, dbeta <= 0.02.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from kdakit.ops.kda.backend import select_backend
from kdakit.ops.kda.chunk.api import chunk_kda
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import SPEC_RMS_LIMITS, error_report

# docs/spec.md §8's limits under the demo's names (dh0 is run_kda's dinitial_state).
TOLERANCES = {("dh0" if n == "dinitial_state" else n): lim for n, lim in SPEC_RMS_LIMITS.items()}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Cost of the float64 reference (naive_recurrent_kda forward + autograd backward, a Python loop over
# tokens on the CPU), measured on a 2-core x86 CPU from T=64 to 256, HV*K*V from 256 to 1M: about
# 0.5 ms per token plus 25 ns per state element (HV * K * V) per token. A rough guide, not a promise.
REF_S_PER_TOKEN = 5e-4
REF_S_PER_STATE_ELEMENT = 2.5e-8
# The reference runs in this many segments at most (progress is reported after each).
REF_SEGMENTS = 20

Progress = Callable[[str, int, int], None]  # (phase, tokens done, tokens in all)


def estimate_reference_s(seq: int, value_heads: int, dim: int, batch: int = 1) -> float:
    """Rough seconds the float64 reference takes (forward + backward) for this shape, from the cost above."""
    return batch * seq * (REF_S_PER_TOKEN + REF_S_PER_STATE_ELEMENT * value_heads * dim * dim)


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


def _reference(leaves, do, dht, opts, progress: Progress | None):
    """float64 naive recurrence, forward and backward, in segments that carry the state.

    The recurrence is exact across a split (every preprocessing step is per token and the state is the
    only thing a token passes on), so the segments give the same result as one call; they exist so that
    ``progress(phase, done, total)`` can report tokens done in the forward and (through hooks on the
    carried states) in the backward.
    """
    q, k, v, g, beta, A_log, dt_bias, h0 = leaves
    T = q.shape[1]
    step = max(8, -(-T // REF_SEGMENTS))
    bounds = [(s, min(s + step, T)) for s in range(0, T, step)]
    report = progress or (lambda phase, done, total: None)
    outs, state = [], h0
    report("float64 reference forward", 0, T)
    for s, e in bounds:
        if state is not h0:
            # The gradient of the state carried into [s, e) is complete once the backward has gone
            # through every token from s on.
            state.register_hook(lambda grad, s=s: report("float64 reference backward", T - s, T))
        o, state = naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                       initial_state=state, output_final_state=True,
                                       A_log=A_log, dt_bias=dt_bias, **opts)
        outs.append(o)
        report("float64 reference forward", e, T)
    o = torch.cat(outs, dim=1)
    report("float64 reference backward", 0, T)
    torch.autograd.backward((o, state), (do, dht))
    report("float64 reference backward", T, T)
    return [o, state] + [x.grad for x in leaves]


def run_demo(*, device: str = "auto", seq: int = 256, heads: int = 2, value_heads: int | None = None,
             dim: int = 64, dtype: str = "bf16", seed: int = 0, progress: Progress | None = None) -> DemoResult:
    """Run the demo; ``progress(phase, done, total)`` (optional) hears how far the float64 reference is."""
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
    ref = _reference(ref_leaves, do.to("cpu", torch.float64), dht.to("cpu", torch.float64), opts, progress)

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
