"""GPU tier of the end-to-end serving loop (tests/ops/kda/serving/test_serving_e2e.py) at real shapes: K = V = 128,
HV = 32 value heads (GVA 2x in the fp32 case), up to 64 requests active at once over one pool of
4 speculative rows each, 96 requests arriving in bursts so that freed rows are reused. The
recurrent/decode ops run the Triton kernels compiled for the device; chunk_kda prefill runs on the
PyTorch path, as in the CPU tier. Every call is checked against the float64 definition and the
whole pool's storage bitwise (see the CPU module's docstring)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _e2e():
    spec = importlib.util.spec_from_file_location("serving_e2e", Path(__file__).parents[3] / "ops" / "kda" / "serving" / "test_serving_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


E2E = _e2e()
S = 4
N = 64  # requests active at once
REAL = dict(K=128, V=128, S=S, P=N * S + 1, n_requests=96, prompt=(8, 160), gen=(4, 16), chunk=(16, 96),
            first_arrivals=N, arrival_p=0.7, burst=6, max_steps=400, pad_slots=8, device="cuda")
CONFIGS = {
    "fp32-gva2": E2E.Cfg(H=16, HV=32, seed=11, **REAL),
    "bf16-strided": E2E.Cfg(H=32, HV=32, pool_dtype=torch.bfloat16, tok_dtype=torch.bfloat16, strided_pool=True,
                            seed=12, **REAL),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_serving_loop_real_shapes(monkeypatch, name):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    eng = E2E.Engine(CONFIGS[name]).run()
    E2E.check_coverage(eng)
    assert eng.max_active >= N // 2, f"only {eng.max_active} requests were active at once"
