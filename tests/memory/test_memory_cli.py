"""`kdakit mem measure | model | plot`: output, errors, and the measure protocol's bookkeeping on CPU.

The GPU run itself happens on the H200; here the parent/worker plumbing is exercised with
``--device cpu --dry-run`` on the reference backend and with stand-in workers that report
an OOM, crash or hang, so that the first GPU run has nothing left to discover.
"""

import io
import json
import sys

import pytest
import torch

from kdakit.memory import measure, measure_worker
from kdakit.memory.mem_cli import main
from kdakit.memory.model import GROUPS

NO_CUDA = not torch.cuda.is_available()


def _run(capsys, *argv):
    rc = main(["mem", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(err: str, *words):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kdakit mem ")
    for w in words:
        assert w in lines[0], lines[0]


def test_model_table_has_fla_peak_and_every_group(capsys):
    rc, out, err = _run(capsys, "model", "--backends", "fla,kdakit", "--shapes", "1x8192:96")
    assert rc == 0, err
    fla_row = next(ln for ln in out.splitlines() if ln.startswith("| fla "))
    assert "| 6.590 |" in fla_row and "| 1.878 |" in fla_row
    assert any(ln.startswith("| kdakit ") for ln in out.splitlines())
    for g in GROUPS:
        assert g in out
    assert "peak during backward chunk_kda_bwd_intra" in out


def test_model_json_lines(capsys):
    rc, out, err = _run(capsys, "model", "--backends", "kdakit,fla", "--shapes", "1x8192:96,8x8192:16", "--json")
    assert rc == 0, err
    recs = [json.loads(ln) for ln in out.splitlines()]
    assert [(r["backend"], r["mbs"], r["seq"], r["heads"]) for r in recs] == [
        ("kdakit", 1, 8192, 96), ("fla", 1, 8192, 96), ("kdakit", 8, 8192, 16), ("fla", 8, 8192, 16)]
    for r in recs:
        assert set(GROUPS) <= set(r["groups"])
        assert abs(sum(r["groups"].values()) - r["peak_alloc_gib"]) < 1e-4
    assert recs[1]["peak_alloc_gib"] == pytest.approx(6.590, abs=0.002)


def test_model_compares_with_measured_records(capsys, tmp_path):
    path = tmp_path / "measured.jsonl"
    path.write_text(json.dumps({"backend": "fla", "mbs": 1, "seq": 131072, "heads": 96, "status": "ok",
                                "peak_alloc_gib": 105.445}) + "\n")
    rc, out, err = _run(capsys, "model", "--backends", "fla", "--shapes", "1x131072:96", "--json",
                        "--measured", str(path), "--tensors")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["measured_peak_alloc_gib"] == 105.445 and abs(rec["model_error_pct"]) < 2.0
    assert {"dq_intra", "dk_intra", "dg_intra", "bwd_h", "dh"} <= {t["name"] for t in rec["tensors"]}


def test_every_command_takes_the_cell_notation(capsys, monkeypatch):
    # model and plot used a second parser that refused the cells measure's workers and docs/spec.md §3 take
    def model_json(*argv):
        rc, out, err = _run(capsys, "model", "--backends", "kdakit,fla", "--json", *argv)
        assert rc == 0, err
        return [json.loads(ln) for ln in out.splitlines()]

    gva = model_json("--shapes", "1x8192:16/32")
    assert gva == model_json("--shapes", "1x8192:32", "--qk-heads", "16")  # HEADS is HV with --qk-heads
    assert (gva[0]["heads"], gva[0]["qk_heads"]) == (32, 16)
    softplus = model_json("--shapes", "1x8k:16:softplus")
    assert softplus == model_json("--shapes", "1x8192:16", "--gate", "softplus")
    assert softplus[0]["gate"] == "softplus"
    rc, out, err = _run(capsys, "model", "--backends", "kdakit", "--shapes", "1x8192:16/32,1x8192:16:softplus")
    assert rc == 0, err
    assert "| kdakit | 1 x 8192 : 16/32 |" in out and "| kdakit | 1 x 8192 : 16 : softplus |" in out
    assert "kdakit 1x8192:16/32: peak during" in out
    seen = []
    monkeypatch.setattr(measure, "run_measure", lambda backends, cells, options, **kw: seen.extend(cells) or [])
    rc, out, err = _run(capsys, "measure", "--device", "cpu", "--dry-run", "--backends", "reference",
                        "--shapes", "1x16:1/2,1x16:2:softplus")
    assert rc == 0, err
    assert [c.label for c in seen] == ["1x16:1/2", "1x16:2:softplus"]


def test_model_matches_measured_records_by_cell(capsys, tmp_path):
    path = tmp_path / "measured.jsonl"
    rec = {"backend": "fla", "mbs": 1, "seq": 8192, "heads": 16, "value_heads": 32, "gate": "safe",
           "cell": "1x8192:16/32", "status": "ok", "peak_alloc_gib": 3.0}
    path.write_text(json.dumps(rec) + "\n")
    for shape, found in (("1x8192:16/32", True), ("1x8192:32", False), ("1x8192:16", False)):
        rc, out, err = _run(capsys, "model", "--backends", "fla", "--shapes", shape, "--json", "--measured", str(path))
        assert rc == 0, err
        assert ("measured_peak_alloc_gib" in json.loads(out)) is found, shape


@pytest.mark.parametrize("argv,words", [
    (["model", "--shapes", "1x8192"], ["MBSxSEQ:H[/HV][:gate]", "'1x8192'"]),
    (["model", "--shapes", "1x8192:96,banana"], ["'banana'"]),
    (["model", "--backends", "kdakit,flash"], ["unknown backend 'flash'"]),
    (["model", "--backends", "reference"], ["no analytic peak model", "mem measure --backends reference"]),
    (["model", "--shapes", "1x8192:96", "--gate", "sigmoid"], ["gate must be one of"]),
    (["model", "--shapes", "1x8192:96", "--qk-heads", "5"], ["multiple of qk_heads"]),
    (["model", "--shapes", "1x8192:16/32", "--qk-heads", "8"], ["--qk-heads must match", "H=16", "got 8"]),
    (["model", "--shapes", "1x8192:16:softplus", "--gate", "precomputed"],
     ["--gate must match the gate softplus", "'precomputed'"]),
    (["plot", "--shape", "1x8192:16:sigmoid"], ["gate must be one of"]),
    (["measure", "--shapes", "0x8192:96"], ["positive"]),
    (["measure", "--backends", "triton"], ["unknown backend 'triton'"]),
    (["measure", "--device", "cpu", "--backends", "reference", "--shapes", "1x16:1"], ["--dry-run"]),
    (["plot", "--shape", "1x8192:96", "--format", "jpg"], ["unknown format 'jpg'"]),
])
def test_errors_are_one_line_and_non_zero(capsys, argv, words):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert out == ""
    _one_line_error(err, *words)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_measure_without_cuda_is_a_clear_error(capsys):
    rc, out, err = _run(capsys, "measure", "--backends", "kdakit", "--shapes", "1x8192:96")
    assert rc == 2 and out == ""
    _one_line_error(err, "no CUDA device", "--device cpu --dry-run")


def test_mem_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["mem"])
    assert exc.value.code == 2


def test_measure_dry_run_on_cpu_reference(capsys, tmp_path):
    # A real worker subprocess: the protocol's warm-up, three measured steps, finite checks and timings.
    out_path, table_path = tmp_path / "m.jsonl", tmp_path / "m.md"
    rc, out, err = _run(capsys, "measure", "--device", "cpu", "--dry-run", "--backends", "reference",
                        "--shapes", "2x24:2", "--head-dim", "16", "--timing-runs", "2", "--warmup-seq", "16",
                        "--warmup-iters", "1", "--json", "--output", str(out_path), "--table", str(table_path))
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["status"] == "ok" and rec["finite"] is True and rec["dry_run"] is True
    assert (rec["backend"], rec["mbs"], rec["seq"], rec["heads"], rec["head_dim"]) == ("reference", 2, 24, 2, 16)
    assert rec["peak_alloc_gib"] is None and rec["fwd_ms"] > 0 and rec["fwd_bwd_ms"] > 0
    assert rec["floor_gib"] == pytest.approx((20 * 48 * 2 * 16 + 4 * 48 * 2) / 2 ** 30)
    assert "[1/1] reference 2x24:2" in err and "measured run 3/3" in err and "warm-up" in err
    assert json.loads(out_path.read_text()) == rec
    assert "| reference | 2 x 24 : 2 |" in table_path.read_text()


# ---------------------------------------------------------------------------------------
# Parent bookkeeping with stand-in workers (no torch work in the children)


def _fake_worker(script):
    return [sys.executable, "-c", script]


def test_oom_crash_and_timeout_cells_are_recorded_and_the_run_goes_on(monkeypatch):
    marker = measure_worker.RESULT_MARKER
    scripts = {
        "reference": (
            "import json,sys; print('progress', file=sys.stderr); "
            f"print({marker!r} + json.dumps(dict(status='oom', message='CUDA out of memory', peak_alloc_gib_at_oom=140.0)))"
        ),
        "fla": "import sys; print('boom: Segmentation fault', file=sys.stderr); sys.exit(139)",
        "kdakit": "import time; time.sleep(30)",
    }
    monkeypatch.setattr(measure, "worker_command", lambda backend, shape, options: _fake_worker(scripts[backend]))
    monkeypatch.setattr(measure, "preflight", lambda backends, options: None)
    monkeypatch.setattr(measure, "HEARTBEAT_S", 1.0)
    seen, progress = [], io.StringIO()
    opts = measure.MeasureOptions(device="cpu", dry_run=True, timeout_s=3.0)
    results = measure.run_measure(["reference", "fla", "kdakit"], [(1, 4096, 8)], opts, progress=progress,
                                  on_result=seen.append)
    assert [r["status"] for r in results] == ["oom", "crashed", "timeout"]
    assert seen == results
    assert results[0]["message"] == "CUDA out of memory" and results[0]["peak_alloc_gib"] is None
    assert results[1]["returncode"] == 139 and "Segmentation fault" in results[1]["message"]
    assert results[2]["wall_s"] < 20
    shown = progress.getvalue()
    assert "[1/3] reference 1x4096:8" in shown and "[3/3] kdakit 1x4096:8: TIMEOUT" in shown
    assert "    boom: Segmentation fault" in shown  # the worker's stderr is forwarded
    assert "kdakit 1x4096:8 running for" in shown   # heartbeat during a silent stretch
    table = measure.markdown_table(results)
    assert "| oom |" in table and "| crashed |" in table and "| timeout |" in table
    # The model column is filled where a model exists (fla) even for a failed cell.
    assert results[1]["model_peak_alloc_gib"] > 0 and results[0]["model_peak_alloc_gib"] is None


def test_exit_status_is_one_when_a_cell_fails(monkeypatch, capsys):
    monkeypatch.setattr(measure, "worker_command",
                        lambda backend, shape, options: _fake_worker("import sys; sys.exit(3)"))
    rc, out, err = _run(capsys, "measure", "--device", "cpu", "--dry-run", "--backends", "reference",
                        "--shapes", "1x16:1", "--quiet")
    assert rc == 1
    assert "| crashed |" in out


def test_worker_records_an_oom_in_the_measured_steps(monkeypatch):
    calls = {"n": 0}

    def fake_load(name, checkpoint_every):
        def call(x):
            calls["n"] += 1
            if x["q"].shape[1] > 16:  # the target shape runs out of memory, the small warm-up does not
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
            o = (x["q"] * 2).sum(-1, keepdim=True) * x["v"] + x["g"] * x["beta"][..., None] + x["k"] \
                + x["A_log"].sum() + x["dt_bias"].sum()
            return o, None
        return call, {"torch": torch.__version__}

    monkeypatch.setattr(measure_worker, "load_backend", fake_load)
    args = measure_worker.build_parser().parse_args(
        ["--backend", "reference", "--mbs", "2", "--seq", "32", "--heads", "2", "--head-dim", "8",
         "--device", "cpu", "--dry-run", "--warmup-seq", "16"])
    res = measure_worker.run_cell(args, lambda msg: None)
    assert res["status"] == "oom" and "Tried to allocate" in res["message"]
    assert calls["n"] == 2  # the warm-up step ran, then the target shape's first step failed


def test_worker_protocol_environment():
    env = measure_worker.protocol_env("fla", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert env["FLA_DISABLE_BACKEND_DISPATCH"] == "1"
    assert measure_worker.protocol_env("reference", {})["KDAKIT_BACKEND"] == "torch"
    assert measure_worker.protocol_env("kdakit", {})["KDAKIT_BACKEND"] == "triton"


def test_worker_inputs_are_identically_seeded():
    a = measure_worker.make_inputs(2, 8, 2, 4, "cpu", seed=7)
    b = measure_worker.make_inputs(2, 8, 2, 4, "cpu", seed=7)
    c = measure_worker.make_inputs(2, 8, 2, 4, "cpu", seed=8)
    for name in ("q", "k", "v", "g", "beta", "do"):
        assert torch.equal(a[name], b[name]) and a[name].dtype == torch.bfloat16
    assert not torch.equal(a["q"], c["q"])
    assert a["cu_seqlens"].tolist() == [0, 8, 16]
    assert all(a[n].requires_grad for n in measure_worker.LEAVES)
    assert not a["A_log"].any() and not a["dt_bias"].any()


def test_plot_writes_png_and_svg_with_measured_markers(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    measured = tmp_path / "m.jsonl"
    measured.write_text(json.dumps({"backend": "fla", "mbs": 1, "seq": 8192, "heads": 96, "status": "ok",
                                    "peak_alloc_gib": 6.590}) + "\n")
    stem = tmp_path / "out" / "mem_8k"
    rc, out, err = _run(capsys, "plot", "--backends", "kdakit,fla", "--shape", "1x8192:96", "--out", str(stem),
                        "--measured", str(measured))
    assert rc == 0, err
    paths = out.split()
    assert paths == [f"{stem}.png", f"{stem}.svg"]
    png = open(paths[0], "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    svg = open(paths[1]).read()
    assert "<svg" in svg and "6.590" in svg and "measured" in svg


def test_plot_takes_a_cell_with_value_heads_and_gate(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "plot", "--backends", "kdakit", "--shape", "1x1024:2/4:softplus", "--format", "svg")
    assert rc == 0, err
    assert out.split() == ["kdakit_mem_1x1024_h2_hv4_softplus.svg"]
    assert "<svg" in (tmp_path / "kdakit_mem_1x1024_h2_hv4_softplus.svg").read_text()


def test_load_records_rejects_a_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"backend": "fla"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        measure.load_records(str(path))


def test_measure_with_a_missing_backend_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(measure, "_fla_present", lambda: False)
    rc, out, err = _run(capsys, "measure", "--device", "cpu", "--dry-run", "--backends", "reference,fla",
                        "--shapes", "1x16:1")
    assert rc == 2 and out == ""
    _one_line_error(err, "backend 'fla' is not importable", "PYTHONPATH")


def test_fla_presence_check_needs_its_kda_ops(monkeypatch, tmp_path):
    # A package named fla without ops/kda (e.g. an unrelated directory) is not FLA.
    import importlib

    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    assert measure._fla_present() is False
    (tmp_path / "fla" / "ops" / "kda").mkdir(parents=True)
    assert measure._fla_present() is True


def test_worker_env_sets_the_triton_interpreter_for_kdakit_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert measure.worker_env("kdakit", "cpu")["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET" not in measure.worker_env("reference", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" not in measure.worker_env("kdakit", "cuda")  # compiled kernels on the GPU
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"  # the parent's environment is not changed


def test_measure_dry_run_on_cpu_kdakit_without_triton_interpret(capsys, monkeypatch):
    # The user has not exported TRITON_INTERPRET: the worker gets it, and the Triton kernels run interpreted.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, out, err = _run(capsys, "measure", "--device", "cpu", "--dry-run", "--backends", "kdakit",
                        "--shapes", "1x16:1", "--head-dim", "16", "--reps", "1", "--timing-runs", "1",
                        "--warmup-seq", "0", "--warmup-iters", "0", "--json", "--timeout", "300")
    assert rc == 0, err
    rec = json.loads(out)
    assert rec["status"] == "ok" and rec["finite"] is True and rec["backend"] == "kdakit", rec
    assert "TRITON_INTERPRET" not in err


@pytest.mark.parametrize("dtype", ["int8", "fp64", "float64", "fp8", "torch.bfloat16"])
@pytest.mark.parametrize("command", ["model", "plot"])
def test_model_dtype_accepts_only_the_documented_dtypes(capsys, command, dtype):
    rc, out, err = _run(capsys, command, "--backends", "kdakit", "--shapes" if command == "model" else "--shape",
                        "1x1024:2", "--dtype", dtype)
    assert rc == 2 and out == ""
    _one_line_error(err, "--dtype must be one of bf16, fp16, fp32", repr(dtype))


def test_model_dtype_documented_values_work(capsys):
    floors = {}
    for dtype in ("bf16", "fp16", "fp32", "FP32"):
        rc, out, err = _run(capsys, "model", "--backends", "kdakit", "--shapes", "1x1024:2", "--dtype", dtype,
                            "--json")
        assert rc == 0, err
        rec = json.loads(out)
        assert rec["dtype"] == dtype.lower()
        floors[dtype] = rec["floor_gib"]
    assert floors["bf16"] == floors["fp16"] < floors["fp32"] == floors["FP32"]


def test_plot_without_matplotlib_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, out, err = _run(capsys, "plot", "--backends", "kdakit", "--shape", "1x1024:2", "--out", str(tmp_path / "m"))
    assert rc == 2 and out == ""
    _one_line_error(err, "needs matplotlib", "pip install -e '.[plot]'")
    assert "kdakit[plot]" not in err  # kdakit is not on PyPI
    assert not list(tmp_path.iterdir())


def test_model_reserved_replays_the_protocol(capsys):
    rc, out, err = _run(capsys, "model", "--backends", "kdakit,fla", "--shapes", "1x8192:96", "--reserved")
    assert rc == 0, err
    table = out.split("Replayed reserved memory")[1]
    row = next(ln for ln in table.splitlines() if ln.startswith("| kdakit | 1 x 8192 : 96 | 1.878 | 2.034 |"))
    # the H200's measured reserved peaks (benchmarks/results/chunk_h200.json), replayed
    assert "| 2.289 (1.219x) | 2.082 (1.109x) |" in row
    rc, out, err = _run(capsys, "model", "--backends", "kdakit", "--shapes", "1x8192:96", "--reserved", "--json")
    rec = json.loads(out.splitlines()[0])
    assert rec["reserved_after_short_step_gib"] == pytest.approx(2.2890625)
    rc, out, err = _run(capsys, "model", "--backends", "kdakit", "--shapes", "1x8192:96", "--reserved",
                        "--gate", "softplus")
    assert rc != 0
    _one_line_error(err, "--reserved")


def test_model_prices_the_gates_pipeline_and_a_named_one(capsys):
    """``mem model``: a softplus cell is priced on chunk64 (chunk_kda's default for the gate), the safe cell on
    windowed16; --pipeline names another, --checkpoint-every is its window, --gate-dtype g's dtype."""
    def one(*argv):
        rc, out, err = _run(capsys, "model", "--backends", "kdakit", "--json", *argv)
        assert rc == 0, err
        return json.loads(out.strip().splitlines()[0])

    safe, soft = one("--shapes", "1x8192:16"), one("--shapes", "1x8192:16:softplus")
    assert (safe["pipeline"], soft["pipeline"]) == ("windowed16", "chunk64")
    # at 96 heads the default windows are 1024 (recomputing) and 2048 (fast) tokens
    soft96 = one("--shapes", "1x8192:96:softplus")
    fast = one("--shapes", "1x8192:96:softplus", "--pipeline", "chunk64_fast")
    assert fast["pipeline"] == "chunk64_fast" and fast["peak_alloc_bytes"] > soft96["peak_alloc_bytes"]
    w512 = one("--shapes", "1x8192:16:softplus", "--checkpoint-every", "512")
    assert w512["peak_alloc_bytes"] != soft["peak_alloc_bytes"]
    raw = one("--shapes", "1x8192:16", "--gate", "precomputed", "--no-gate-params")
    raw16 = one("--shapes", "1x8192:16", "--gate", "precomputed", "--no-gate-params", "--gate-dtype", "bf16")
    assert raw["gate_dtype"] == "fp32" and raw["floor_gib"] > raw16["floor_gib"] and raw["pipeline"] == "chunk64"
    rc, out, err = _run(capsys, "model", "--backends", "kdakit", "--shapes", "1x8192:16:softplus")
    assert rc == 0 and "kdakit 1x8192:16:softplus: peak during" in out and "(chunk64, chunk 64" in out
    rc, _, err = _run(capsys, "model", "--backends", "kdakit", "--shapes", "1x8192:16", "--gate-dtype", "int8")
    assert rc == 2
    _one_line_error(err, "--gate-dtype")
