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


# ---------------------------------------------------------------------------------------
# serve-mem: configurations the ops reject, and budgets that hold nothing


def _serve_mem_error(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        main(["serve-mem", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("kdakit serve-mem: error:"), err
    return lines[0]


@pytest.mark.parametrize("argv", [["--kda-value-heads", "48"], ["--kda-heads", "3", "--kda-value-heads", "8"]])
def test_serve_mem_rejects_value_heads_not_a_multiple_of_heads(capsys, argv):
    line = _serve_mem_error(capsys, *argv)
    assert "kda_value_heads: expected a multiple of kda_heads=" in line


def test_serve_mem_accepts_grouped_value_heads(capsys):
    import json

    assert main(["serve-mem", "--kda-heads", "8", "--kda-value-heads", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["kda_value_heads"] == 32 and out["model"]["kda_heads"] == 8


@pytest.mark.parametrize("dtype", ["fp16", "float16", "fp8", "fp8_e4m3", "int4"])
def test_serve_mem_rejects_state_dtypes_the_kernels_do_not_support(capsys, dtype):
    line = _serve_mem_error(capsys, "--state-dtype", dtype)
    assert "--state-dtype" in line and "fp32" in line and "bf16" in line and repr(dtype) in line


@pytest.mark.parametrize("dtype,nbytes", [("fp32", 4), ("bf16", 2), ("BFloat16", 2)])
def test_serve_mem_state_dtypes_the_kernels_support(capsys, dtype, nbytes):
    import json

    assert main(["serve-mem", "--state-dtype", dtype, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kda_recurrent_bytes_per_seq"] == 32 * 128 * 128 * nbytes


def test_serve_mem_says_plainly_when_nothing_fits(capsys):
    assert main(["serve-mem", "--budget-gib", "0.5"]) == 0  # an answer, not an error
    out, err = capsys.readouterr()
    assert err == ""
    rows = {ln.strip().split("  ")[0]: ln for ln in out.splitlines()}
    assert "hybrid 0 (nothing fits: one sequence needs 1.025 GiB)" in rows["largest batch at 131,072 tokens"]
    assert "all-MLA 0 (nothing fits: one sequence needs 3.797 GiB)" in rows["largest batch at 131,072 tokens"]
    assert "nothing fits" in rows and "does not hold one sequence of 131,072 tokens" in rows["nothing fits"]
    assert "raise --budget-gib or lower --context" in rows["nothing fits"]
    # Shorter contexts still fit, and say how long.
    assert "hybrid 61,192 tokens" in rows["longest context at batch 1"]


def test_serve_mem_nothing_fits_even_one_token(capsys):
    assert main(["serve-mem", "--budget-gib", "0.00001", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "hybrid 0 tokens (nothing fits: batch 4 needs 0.162 GiB at one token)" in out
    assert "all-MLA 0 tokens (nothing fits: batch 4 needs 124,416 B at one token)" in out


def test_serve_mem_json_nothing_fits_note_goes_to_stderr(capsys):
    import json

    assert main(["serve-mem", "--budget-gib", "0.5", "--json"]) == 0
    out, err = capsys.readouterr()
    rec = json.loads(out)  # stdout is still exactly one JSON object
    assert rec["max_batch_hybrid"] == 0 and rec["max_batch_mla"] == 0
    assert err.startswith("kdakit serve-mem: nothing fits: the 0.5 GiB budget per device does not hold one sequence")


def test_serve_mem_budget_that_fits_has_no_nothing_fits_line(capsys):
    assert main(["serve-mem", "--budget-gib", "80"]) == 0
    out, err = capsys.readouterr()
    assert "nothing fits" not in out and err == ""
    assert "hybrid 78, all-MLA 21" in out


def test_serve_mem_plot_without_matplotlib_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = _serve_mem_error(capsys, "--plot", str(tmp_path / "s.png"))
    assert "--plot needs matplotlib" in line and "pip install -e '.[plot]'" in line
