"""Test tiers. The CPU tier (default) runs Triton kernels under the interpreter, so
TRITON_INTERPRET=1 is set here, before any test module imports triton. The GPU tier
(``KDAKIT_TEST_TIER=gpu``, run on the H200 by benchmarks/run_gpu.sh) compiles for the device
and runs the tests marked ``gpu``. Under pytest-xdist (``-n auto``: one worker a core) the workers and the
processes their tests start compute on one thread each (``OMP_NUM_THREADS=1`` unless set)."""

import os

TIER = os.environ.get("KDAKIT_TEST_TIER", "cpu")
if TIER not in ("cpu", "gpu"):
    raise ValueError(f"KDAKIT_TEST_TIER must be 'cpu' or 'gpu', got {TIER!r}")
if TIER == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one xdist worker a core: each worker and every process a test starts computes on one thread, so that
    # OpenMP's spinning threads do not compete with the other workers for the cores (an explicit setting wins)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # the tests marked slow first (stable: collection order otherwise), so that xdist deals the longest ones out
    # early and the run does not end on one worker still busy with a long test
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if TIER == "gpu" and torch.cuda.is_available():
        return
    reason = ("GPU tier: needs a CUDA device and KDAKIT_TEST_TIER=gpu (benchmarks/run_gpu.sh runs it on the H200)")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
