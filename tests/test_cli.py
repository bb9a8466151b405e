"""The command line: `kdakit demo`, `python -m kdakit`, and clear errors."""

import io
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


def test_demo_shows_reference_progress_on_stderr(capsys):
    rc = main(["demo", "--seq", "40", "--heads", "1", "--dim", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "PASS" in out
    assert "kdakit demo" not in out.split("\n", 1)[1]  # progress stays off stdout (the table's first line aside)
    lines = err.splitlines()
    assert lines[0] == "kdakit demo: float64 reference forward: 0/40 tokens"
    assert lines[1].startswith("kdakit demo: float64 reference forward: 40/40 tokens in ")
    assert lines[2] == "kdakit demo: float64 reference backward: 0/40 tokens"
    assert lines[3].startswith("kdakit demo: float64 reference backward: 40/40 tokens in ")
    assert "warning" not in err  # a small shape is not slow


def test_demo_progress_callback_counts_tokens_forward_then_backward():
    from kdakit.demo import run_demo

    events = []
    res = run_demo(seq=50, heads=1, value_heads=2, dim=8, progress=lambda *e: events.append(e))
    assert res.ok
    fwd = [d for p, d, t in events if p == "float64 reference forward"]
    bwd = [d for p, d, t in events if p == "float64 reference backward"]
    assert all(t == 50 for _, _, t in events)
    assert fwd[0] == 0 and fwd[-1] == 50 and fwd == sorted(fwd) and len(fwd) > 3
    assert bwd[0] == 0 and bwd[-1] == 50 and bwd == sorted(bwd) and len(bwd) > 3
    assert events.index(("float64 reference forward", 50, 50)) < events.index(("float64 reference backward", 0, 50))


def test_demo_reference_in_segments_equals_one_call():
    import torch

    from kdakit.demo import _inputs, _reference
    from kdakit.ops.kda.reference.naive import naive_recurrent_kda

    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    tok, par, do, dht = _inputs(1, 70, 1, 2, 8, torch.bfloat16, torch.device("cpu"), 3)
    a = [x.detach().double().requires_grad_() for x in tok + par]
    b = [x.detach().double().requires_grad_() for x in tok + par]
    got = _reference(a, do.double(), dht.double(), opts, None)
    q, k, v, g, beta, A_log, dt_bias, h0 = b
    o, ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                                dt_bias=dt_bias, **opts)
    torch.autograd.backward((o, ht), (do.double(), dht.double()))
    for x, y in zip(got, [o, ht] + [t.grad for t in b]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_demo_progress_lines_in_a_log_are_throttled():
    from kdakit.cli import DemoProgress

    log = _Stream(False)
    p = DemoProgress(log, every_s=3600)
    for done in range(0, 101, 10):
        p("float64 reference forward", done, 100)
    lines = log.getvalue().splitlines()
    assert lines[0] == "kdakit demo: float64 reference forward: 0/100 tokens"
    assert len(lines) == 2  # start and end only: nothing in between is every_s apart
    assert lines[1].startswith("kdakit demo: float64 reference forward: 100/100 tokens in ")
    every = _Stream(False)
    p = DemoProgress(every, every_s=0)
    for done in range(0, 101, 10):
        p("float64 reference forward", done, 100)
    lines = every.getvalue().splitlines()
    assert len(lines) == 11
    assert lines[1].startswith("kdakit demo: float64 reference forward: 10/100 tokens, ") and lines[1].endswith(" left")


def test_demo_progress_on_a_terminal_rewrites_one_line():
    from kdakit.cli import DemoProgress

    tty = _Stream(True)
    p = DemoProgress(tty)
    for done in (0, 5, 10):
        p("float64 reference backward", done, 10)
    text = tty.getvalue()
    assert text.count("\r\x1b[K") == 3 and text.count("\n") == 1 and text.endswith(" s\n")
    assert "5/10 tokens" in text and text.rsplit("\r", 1)[1].startswith("\x1b[Kkdakit demo: float64 reference "
                                                                         "backward: 10/10 tokens in ")


def test_demo_warns_before_a_slow_shape_and_says_roughly_how_long(capsys, monkeypatch):
    import kdakit.demo
    from kdakit.demo import DemoResult, estimate_reference_s

    seen = []

    def fake_run_demo(**kw):
        seen.append((kw, capsys.readouterr().err))  # what was on stderr before the run started
        return DemoResult(rows=[], ok=True, text="PASS")

    monkeypatch.setattr(kdakit.demo, "run_demo", fake_run_demo)
    assert estimate_reference_s(16384, 16, 128) > 60
    assert main(["demo", "--seq", "16384", "--heads", "16", "--dim", "128"]) == 0
    (kw, before), = seen
    assert kw["seq"] == 16384 and callable(kw["progress"])
    assert before.startswith("kdakit demo: warning: the float64 reference runs token by token on the CPU")
    assert "T=16384, HV=16, K=V=128 it takes roughly 2 min" in before
    assert "--seq 4096 takes about" in before


def test_demo_estimate_grows_with_the_shape_and_the_default_is_quick():
    from kdakit.cli import SLOW_DEMO_S, demo_warning
    from kdakit.demo import estimate_reference_s

    assert estimate_reference_s(256, 2, 64) < 1
    assert estimate_reference_s(2048, 2, 64) == pytest.approx(8 * estimate_reference_s(256, 2, 64))
    assert estimate_reference_s(256, 32, 128) > 8 * estimate_reference_s(256, 2, 64)
    assert demo_warning(256, 2, None, 64) is None and demo_warning(1024, 2, None, 64) is None
    assert demo_warning(65536, 2, 8, 128) is not None
    assert estimate_reference_s(65536, 8, 128) >= SLOW_DEMO_S


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


@pytest.mark.parametrize("given", ["0.001", "0.00001", "80", "7.5", "0.3", "2.675", "1e-9"])
def test_serve_mem_prints_the_budget_as_given(capsys, given):
    # the budget's whole bytes over 2^30 used to print as "0.000999999" for --budget-gib 0.001
    import re
    from decimal import Decimal

    assert main(["serve-mem", "--budget-gib", given]) == 0
    out = capsys.readouterr().out
    want = format(Decimal(given), "f")  # 1e-9 written out: 0.000000001
    assert f"budget {want} GiB per device" in out, out
    # the "nothing fits" sentence, where there is one, names the same figure
    assert set(re.findall(r"(\S+) GiB budget per device", out)) <= {want}, out


def test_serve_mem_budget_text_gives_back_the_same_bytes():
    from kdakit.memory.serving_cli import budget_bytes_of, budget_text

    for nbytes in (1, 1325, 1073741, 2 ** 30, 2 ** 30 + 1, 85899345920, 151719719731):
        text = budget_text(nbytes)
        assert budget_bytes_of(float(text)) == nbytes, (nbytes, text)
        assert "e" not in text and len(text.split(".")[-1]) <= 12, text


def test_serve_mem_plot_without_matplotlib_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = _serve_mem_error(capsys, "--plot", str(tmp_path / "s.png"))
    assert "--plot needs matplotlib" in line and "pip install -e '.[plot]'" in line


# ---------------------------------------------------------------------------------------
# No numpy warning: torch warns on import when numpy is missing, and neither torch nor triton installs it


def test_numpy_is_a_declared_dependency():
    import pathlib
    import re
    import tomllib

    meta = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower() for d in meta["project"]["dependencies"]}
    assert {"torch", "triton", "numpy"} <= names


def _user_env():
    import os

    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it for the tests


def test_without_numpy_torch_warns_on_every_command():
    # Where the warning came from: import kdakit (any command) imports torch, which warns without numpy;
    # and under the Triton interpreter, importing kdakit fails outright.
    code = ("import sys; sys.modules['numpy'] = None\n"
            "from kdakit.cli import main\n"
            "sys.exit(main(['serve-mem', '--json']))")
    env = _user_env()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "UserWarning: Failed to initialize NumPy" in res.stderr
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "TRITON_INTERPRET": "1"})
    assert res.returncode == 1 and "ModuleNotFoundError: import of numpy halted" in res.stderr


@pytest.mark.parametrize("argv", [["--help"], ["serve-mem", "--json"], ["mem", "model", "--shapes", "1x1024:2"]])
def test_commands_print_no_warnings(argv):
    res = subprocess.run([sys.executable, "-W", "default", "-m", "kdakit", *argv], capture_output=True, text=True,
                         timeout=300, env=_user_env())
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert res.stdout
