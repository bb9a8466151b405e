"""Running an sm_90a build script (Triton's own LLVM and ptxas, no GPU) from a CPU-tier test.

The tier sets TRITON_INTERPRET=1 for its own process (tests/conftest.py), under which Triton builds nothing, so
the script runs in a child process without it, from the repository root."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_sm90_build(script: str, timeout: int = 600) -> str:
    """The script's stdout; fails the test with its stderr when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
