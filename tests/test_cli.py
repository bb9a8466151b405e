"""The command line: `kdakit demo`, `python -m kdakit`, and clear errors."""

import subprocess
import sys

import pytest

from kdakit.cli import main


def test_demo_passes_and_prints_table(capsys):
    rc = main(["demo", "--seq", "40", "--heads", "1", "--value-heads", "2", "--dim", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in ("shape", "device", "backend   torch", "wall time", "dq", "dbeta", "dh0", "PASS"):
        assert word in out


def test_python_dash_m_runs_the_same_cli():
    res = subprocess.run([sys.executable, "-m", "kdakit", "demo", "--seq", "20", "--heads", "1", "--dim", "8"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "PASS" in res.stdout


def test_bad_numbers_are_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--seq", "-3"])
    assert exc.value.code == 2
    assert "expected a positive integer, got '-3'" in capsys.readouterr().err


def test_cuda_request_without_cuda_is_an_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["demo", "--device", "cuda", "--seq", "8"]) == 2
    assert "device must be 'cpu' or 'auto'" in capsys.readouterr().err
