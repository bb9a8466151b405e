"""GPU tier of context-parallel chunk_kda (run on the H200 with KDAKIT_TEST_TIER=gpu).

Two ranks share the one GPU over gloo (which carries CUDA tensors; NCCL refuses two ranks on one
device): float32 CUDA tensors through the Triton kernels, T = 512 packed tokens, H = 2, HV = 4,
K = V = 64, both layouts, sequences inside one interval and across two and four (zigzag), against
the one-process chunk_kda on the same GPU: outputs, final states and every gradient. The ranks
run tests/distributed/cp_worker.py as separate processes; a hang fails after a timeout.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Relative max error: both sides run the same kernels, and they differ only where CP splits a
# sequence (state composed as M S_in + B in fp32 instead of carried through the kernels); a wrong
# composition is off by O(1).
TOL = 1e-2


def _worker():
    spec = importlib.util.spec_from_file_location("cp_worker", Path(__file__).parents[2] / "distributed" / "cp_worker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cp_two_ranks_one_gpu_matches_one_process(tmp_path):
    cp_worker = _worker()
    results = cp_worker.launch(2, tmp_path, suite="gpu", timeout=300)
    bad = {}
    for r, res in enumerate(results):
        assert len(res) == len(cp_worker.GPU_CASES[2])
        for case, errs in res.items():
            assert "dq" in errs and "o" in errs, (case, errs)
            worst = {k: v for k, v in errs.items() if not v <= TOL}
            if worst:
                bad[(r, case)] = worst
    assert not bad, bad
