"""GPU tier: ``plan_kda``'s prediction for the 64-token pipelines against ``torch.cuda.max_memory_allocated`` of
the protocol's step (``chunk64_kda`` forward, ``o.backward(dO)``), each case in a fresh process.

The step is measured after a warm-up step of the same shape (compilation, the memoized chunk plan); the
caller's tensors (inputs, dO) and the chunk plan's device tensors are resident in the baseline, so the measured
peak above it is compared with the plan's peak less those allocations.
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

GATES = {
    "softplus": dict(use_gate_in_kernel=True, safe_gate=False, lower_bound=None),
    "raw": dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None),
}
RESIDENT = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens", "initial_state", "do", "chunk_table",
            "chunk_seq_rows")
CASES = {
    "softplus_chunk64": ("softplus", "chunk64", 1024, [5000, 0, 3192], 16, 16, torch.bfloat16),
    "softplus_chunk64_fast_gva": ("softplus", "chunk64_fast", 2048, [5000, 0, 3192], 8, 16, torch.bfloat16),
    "raw_fp32_gate_chunk64": ("raw", "chunk64", 512, [8192], 16, 16, torch.float32),
}


def _measure(name):
    """Measured peak above the baseline and the plan's, in this process."""
    from kdakit.ops.kda.chunk.autograd import chunk64_kda
    from kdakit.ops.kda.options import kda_options
    from kdakit.ops.kda.plan import plan_kda

    gate, pipeline, window, lens, H, HV, g_dtype = CASES[name]
    D, dev, T = 128, "cuda", sum(lens)
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dt=torch.bfloat16):
        return torch.randn(shape, generator=gen, device=dev).to(dt)

    t = dict(q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, HV, D), g=randn(1, T, HV, D, dt=g_dtype),
             beta=randn(1, T, HV))
    if gate == "raw":
        t["g"] = -torch.nn.functional.softplus(t["g"])
    else:
        t["A_log"], t["dt_bias"] = 0.3 * randn(HV, dt=torch.float32), 0.3 * randn(HV * D, dt=torch.float32)
    for x in t.values():
        x.requires_grad_(True)
    cu_cpu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    cu = cu_cpu.to(dev)
    do = randn(1, T, HV, D)
    opts = kda_options(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"),
                       cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **GATES[gate])
    A_log, dt_bias = opts.kernel_gate_params(t.get("A_log"), t.get("dt_bias"))

    def step():
        for x in t.values():
            x.grad = None
        o, _ = chunk64_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=A_log, dt_bias=dt_bias,
                           initial_state=None, cu_seqlens=cu, opts=opts, window_tokens=window,
                           keep_intermediates=pipeline == "chunk64_fast")
        o.backward(do)

    step()
    for x in t.values():
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    plan = plan_kda(seqlens=lens, H=H, HV=HV, K=D, dtype=torch.bfloat16, gate=gate, pipeline=pipeline,
                    window_tokens=window, g_dtype=g_dtype)
    resident = sum(a.allocated_bytes for a in plan.allocations if a.name in RESIDENT)
    return dict(peak=peak, predicted=plan.predicted_peak_bytes - resident, peak_at=plan.peak_at)


@pytest.mark.parametrize("name", list(CASES))
def test_chunk64_step_allocates_what_the_plan_says(name):
    code = ("import json; from tests.gpu.ops.kda.test_plan_chunk64_gpu import _measure; "
            f"print(json.dumps(_measure({name!r})))")
    root = str(Path(__file__).resolve().parents[4])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["peak"] == r["predicted"], (f"{name}: measured {r['peak']} B above the resident tensors, the plan "
                                         f"says {r['predicted']} B (its peak {r['peak_at']})")
