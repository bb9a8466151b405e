"""CPU checks of the benchmark helpers that need no GPU: cells, result joining, time floors, the
measurement parent's shared-process and deadline bookkeeping, and run_gpu.sh's stage budget."""

import io
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_chunk import comparisons_of, parse_shapes, time_floors_ms, warm_cells  # noqa: E402
from compare_chunk import cell_label, compare, compare_sweep, markdown, sweep_markdown  # noqa: E402

from kdakit.memory import measure, measure_worker  # noqa: E402
from kdakit.memory.measure_worker import Cell, parse_cell, parse_cells  # noqa: E402

BENCH = os.path.join(ROOT, "benchmarks", "bench_chunk.py")
COMPARE = os.path.join(ROOT, "benchmarks", "compare_chunk.py")
RUN_GPU = os.path.join(ROOT, "benchmarks", "run_gpu.sh")


def _record(backend, mbs, seq, heads, peak, fwd, fwd_bwd, status="ok", **extra):
    return {"backend": backend, "mbs": mbs, "seq": seq, "heads": heads, "status": status, "floor_gib": 1.5,
            "peak_alloc_gib": peak, "peak_reserved_gib": peak + 0.1, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
            **time_floors_ms(mbs, seq, heads, value_heads=extra.get("value_heads")), **extra}


def test_compare_joins_by_shape_and_keeps_provenance(tmp_path):
    ours = {"gpu": "G", "git_sha": "aaa", "date": "d1", "records": [
        _record("kdakit", 1, 8192, 96, 2.0, 4.0, 40.0), _record("kdakit", 8, 8192, 16, 2.7, 4.4, 50.0),
        _record("kdakit", 1, 512, 4, 0.1, 1.0, 2.0, status="oom")]}
    theirs = {"gpu": "G", "git_sha": "bbb", "date": "d2", "records": [
        _record("fla", 1, 8192, 96, 6.5, 3.2, 13.0), _record("kdakit", 8, 8192, 16, 9.0, 1.0, 1.0)]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(theirs))
    res = compare(str(a), str(b))
    assert res["kdakit"]["git_sha"] == "aaa" and res["fla"]["git_sha"] == "bbb"
    rows = {r["shape"]: r for r in res["rows"]}
    assert set(rows) == {"1x8192:96", "8x8192:16"}  # the failed cell is left out
    assert rows["1x8192:96"]["fwd_bwd_ratio"] == pytest.approx(40.0 / 13.0)
    assert rows["1x8192:96"]["peak_ratio"] == pytest.approx(2.0 / 6.5)
    assert rows["1x8192:96"]["fla_peak_reserved_gib"] == pytest.approx(6.6)
    assert "fla_fwd_ms" not in rows["8x8192:16"]  # a kdakit record in the FLA file is not FLA's
    table = markdown(res)
    assert "3.08x" in table and "| 8x8192:16 |" in table and "- | - |" in table and "6.500 (6.600)" in table


def test_committed_h200_comparison_is_what_compare_prints(tmp_path):
    res_dir = os.path.join(ROOT, "benchmarks", "results")
    out = tmp_path / "c.json"
    # the d3f00ec triple (chunk_vs_fla_h200.json is bench_vs_fla.py's format, tests/test_bench_vs_fla.py)
    subprocess.run([sys.executable, COMPARE, "--kdakit", os.path.join(res_dir, "chunk_h200_d3f00ec.json"),
                    "--fla", os.path.join(res_dir, "chunk_fla_h200_d3f00ec.json"), "--out", str(out)],
                   check=True, capture_output=True)
    committed = json.load(open(os.path.join(res_dir, "chunk_vs_fla_h200_d3f00ec.json")))["rows"]
    rows = json.load(open(out))["rows"]
    assert [r["shape"] for r in rows] == [r["shape"] for r in committed]
    for new, old in zip(rows, committed):
        assert {k: new[k] for k in old} == old
    # the join carries each FLA record's reserved peak into the row of its shape
    fla = {f"{r['mbs']}x{r['seq']}:{r['heads']}": r for r in
           json.load(open(os.path.join(res_dir, "chunk_fla_h200_d3f00ec.json")))["records"] if r["status"] == "ok"}
    joined = [r for r in rows if r["shape"] in fla]
    assert joined
    for r in joined:
        assert r["fla_peak_reserved_gib"] == pytest.approx(fla[r["shape"]]["peak_reserved_gib"])


def test_time_floors_and_shape_parsing():
    assert parse_shapes("1x8192:96,8x8192:16") == [(1, 8192, 96), (8, 8192, 16)]
    f = time_floors_ms(1, 8192, 96)
    th = 8192 * 96
    assert f["fwd_bwd_bytes_floor_ms"] == pytest.approx(1e3 * (28 * th * 128 + 6 * th) / 4.3e12)
    assert f["fwd_bytes_floor_ms"] == pytest.approx(1e3 * (10 * th * 128 + 2 * th) / 4.3e12)
    assert f["fwd_bwd_flops_floor_ms"] == pytest.approx(3 * f["fwd_flops_floor_ms"])
    assert time_floors_ms(1, 8192, 96, value_heads=96) == f


def test_gva_time_floors_count_each_tensor_at_its_head_count():
    T, H, HV, D = 8192, 16, 32, 128
    g = time_floors_ms(1, T, H, value_heads=HV)
    inputs = 2 * (2 * T * H * D + 2 * T * HV * D + T * HV)   # q, k at H; v, g, beta at HV (bf16)
    o = 2 * T * HV * D
    assert g["fwd_bytes_floor_ms"] == pytest.approx(1e3 * (inputs + o) / 4.3e12)
    assert g["fwd_bwd_bytes_floor_ms"] == pytest.approx(1e3 * (3 * inputs + 2 * o) / 4.3e12)
    # FLOPs go with the value heads: the same as HV q/k heads would cost.
    assert g["fwd_flops_floor_ms"] == pytest.approx(time_floors_ms(1, T, HV)["fwd_flops_floor_ms"])
    assert g["fwd_bwd_bytes_floor_ms"] < time_floors_ms(1, T, HV)["fwd_bwd_bytes_floor_ms"]


# ---------------------------------------------------------------------------------------
# Cells


def test_cells_parse_label_and_reject_bad_input():
    assert parse_cell("1x8192:16/32") == Cell(1, 8192, 16, 32, "safe")
    assert parse_cell("1x8k:96:softplus") == Cell(1, 8192, 96, None, "softplus")
    assert parse_cell("2x65536:32").fields() == {"mbs": 2, "seq": 65536, "heads": 32, "value_heads": 32,
                                                 "gate": "safe", "cell": "2x65536:32"}
    for text in ("1x8192:16/32", "1x8192:96:softplus", "4x4096:32", "1x2048:8/32:softplus"):
        assert parse_cell(text).label == text
    assert parse_cell("1x8192:16/16").label == "1x8192:16"  # HV = H is the protocol's cell (docs/spec.md §3)
    assert parse_cell("1x8192:16/32").hv == 32 and parse_cell("1x8192:16").hv == 16
    assert [c.tokens for c in parse_cells("1x2048:32, 2x65536:32")] == [2048, 131072]
    for bad in ("1x8192:16/24", "1x8192:16:bogus", "8192:16", "1x8192", "0x8192:16", "1x8192:a", ""):
        with pytest.raises(ValueError):
            parse_cells(bad)
    # Records written before GVA / gate support are protocol cells (HV = H, safe gate).
    assert measure_worker.cell_of_record({"mbs": 8, "seq": 8192, "heads": 16}) == Cell(8, 8192, 16)
    assert cell_label({"mbs": 1, "seq": 8192, "heads": 16, "value_heads": 32, "gate": "softplus"}) == \
        "1x8192:16/32:softplus"
    assert cell_label({"mbs": 1, "seq": 8192, "heads": 16, "value_heads": 16}) == "1x8192:16"


def test_warm_cells_are_one_small_cell_per_new_kernel_variant():
    cells = parse_cells("1x2048:96,8x2048:16,1x8192:96:softplus,1x8192:16/32,2x65536:16/32,4x4096:96:softplus")
    assert [c.label for c in warm_cells(cells)] == ["1x1024:96:softplus", "1x1024:16/32"]
    assert warm_cells(parse_cells("1x8192:96,8x8192:16")) == []
    out = subprocess.run([sys.executable, BENCH, "--warm-cells", "1x8192:16/32,1x8192:128:softplus"],
                         check=True, capture_output=True, text=True).stdout.strip()
    assert out == "1x1024:16/32,1x1024:128:softplus"


def test_bench_chunk_help_and_arguments():
    out = subprocess.run([sys.executable, BENCH, "--help"], check=True, capture_output=True, text=True).stdout
    for flag in ("--shared-process", "--budget-s", "--gate-from", "--gate-only", "--warm-cells", "--reps",
                 "--timing-runs", "--no-cu-seqlens-cpu"):
        assert flag in out
    import bench_chunk

    args = bench_chunk.build_parser().parse_args(["--out", "x.json"])
    assert (args.reps, args.timing_runs, args.warmup_seq, args.warmup_iters) == (3, 10, 1024, 2)
    assert not args.shared_process and args.budget_s is None


def test_worker_arguments_cells_and_defaults():
    args, cells = measure_worker.parse_args(["--backend", "fla", "--mbs", "1", "--seq", "8192", "--heads", "16",
                                             "--value-heads", "32", "--gate", "softplus"])
    assert cells == [Cell(1, 8192, 16, 32, "softplus")]
    assert args.warmup_seq == 1024 and not args.no_cu_seqlens_cpu and not args.warmup_only
    args, cells = measure_worker.parse_args(["--backend", "kdakit", "--cells", "1x2048:96,1x8192:16/32",
                                             "--warmup-only"])
    assert [c.label for c in cells] == ["1x2048:96", "1x8192:16/32"] and args.warmup_only
    for bad in (["--backend", "kdakit", "--cells", "1x2048:96", "--mbs", "1"],
                ["--backend", "kdakit", "--mbs", "1", "--seq", "64"],
                ["--backend", "kdakit", "--mbs", "1", "--seq", "64", "--heads", "3", "--value-heads", "4"]):
        with pytest.raises(SystemExit):
            measure_worker.parse_args(bad)


def test_worker_commands_keep_the_spec_cell_and_add_only_what_a_cell_needs():
    opts = measure.MeasureOptions()
    spec = measure.worker_command("fla", (1, 8192, 96), opts)
    assert "--value-heads" not in spec and "--gate" not in spec and "--no-cu-seqlens-cpu" not in spec
    assert spec[spec.index("--warmup-seq") + 1] == "1024" and spec[spec.index("--reps") + 1] == "3"
    gva = measure.worker_command("fla", parse_cell("1x8192:16/32:softplus"), opts)
    assert gva[gva.index("--value-heads") + 1] == "32" and gva[gva.index("--gate") + 1] == "softplus"
    shared = measure.shared_worker_command("kdakit", parse_cells("1x2048:96,1x8192:16/32"),
                                           measure.MeasureOptions(reps=1, cu_seqlens_cpu=False), warmup_only=True)
    assert shared[shared.index("--cells") + 1] == "1x2048:96,1x8192:16/32"
    assert "--warmup-only" in shared and "--no-cu-seqlens-cpu" in shared and "--mbs" not in shared


def test_worker_inputs_for_gva_and_gate_modes():
    spec = measure_worker.make_inputs(2, 8, 2, 4, "cpu", seed=3)
    gva = measure_worker.make_inputs(2, 8, 2, 4, "cpu", seed=3, value_heads=4, gate="softplus")
    assert gva["q"].shape == gva["k"].shape == (1, 16, 2, 4)
    assert gva["v"].shape == gva["g"].shape == gva["do"].shape == (1, 16, 4, 4) and gva["beta"].shape == (1, 16, 4)
    assert gva["A_log"].shape == (4,) and gva["dt_bias"].shape == (16,)
    assert torch.equal(spec["q"], gva["q"]) and torch.equal(spec["k"], gva["k"])  # same seed, same q and k
    assert gva["gate"] == "softplus" and spec["gate"] == "safe"
    assert gva["cu_seqlens_cpu"].device.type == "cpu" and gva["cu_seqlens_cpu"].tolist() == [0, 8, 16]
    assert measure_worker.make_inputs(1, 8, 2, 4, "cpu", 0, cu_seqlens_cpu=False)["cu_seqlens_cpu"] is None


def test_both_backends_get_the_same_call(monkeypatch):
    # load_backend's call: the gate mode and cu_seqlens_cpu come from the inputs, for kdakit and FLA alike.
    seen = []

    def fake_fn(q, k, v, g, beta, **kw):
        seen.append(kw)
        return v * 1.0, None

    import kdakit

    monkeypatch.setattr(kdakit, "chunk_kda", fake_fn)
    call, _ = measure_worker.load_backend("reference", None)
    call(measure_worker.make_inputs(1, 8, 2, 4, "cpu", 0))
    call(measure_worker.make_inputs(1, 8, 2, 4, "cpu", 0, value_heads=4, gate="softplus", cu_seqlens_cpu=False))
    safe, soft = seen
    assert safe["safe_gate"] is True and safe["lower_bound"] == -5.0 and safe["cu_seqlens_cpu"].tolist() == [0, 8]
    assert soft["safe_gate"] is False and soft["lower_bound"] is None and soft["cu_seqlens_cpu"] is None
    for kw in seen:
        assert kw["use_gate_in_kernel"] and kw["use_qk_l2norm_in_kernel"] and kw["use_beta_sigmoid_in_kernel"]
        assert kw["A_log"] is not None and kw["dt_bias"] is not None


# ---------------------------------------------------------------------------------------
# The parent: shared processes, deadlines


def _fake(script):
    return [sys.executable, "-c", script]


def test_shared_process_records_stream_and_an_unfinished_cell_is_a_timeout(monkeypatch):
    marker = measure_worker.RESULT_MARKER
    script = (
        "import json, sys, time\n"
        "for c in ('1x64:2', '1x64:2/4'):\n"
        f"    print({marker!r} + json.dumps(dict(status='ok', cell=c, fwd_ms=1.0, fwd_bwd_ms=3.0, peak_alloc_gib=None,"
        f" process='shared')), flush=True)\n"
        "time.sleep(30)\n"
    )
    monkeypatch.setattr(measure, "shared_worker_command", lambda backend, cells, options, warmup_only=False:
                        _fake(script))
    monkeypatch.setattr(measure, "preflight", lambda backends, options: None)
    monkeypatch.setattr(measure, "HEARTBEAT_S", 1.0)
    seen, progress = [], io.StringIO()
    opts = measure.MeasureOptions(device="cpu", dry_run=True, timeout_s=4.0)
    cells = parse_cells("1x64:2,1x64:2/4,1x64:2:softplus")
    results = measure.run_measure(["reference"], cells, opts, progress=progress, on_result=seen.append,
                                  shared_process=True)
    assert [r["status"] for r in results] == ["ok", "ok", "timeout"]
    assert [r["cell"] for r in results] == ["1x64:2", "1x64:2/4", "1x64:2:softplus"]
    assert results[1]["value_heads"] == 4 and results[2]["gate"] == "softplus"
    assert seen == results and "shared" in results[2]["process"]
    # The floor of the GVA cell counts v, g, beta, o at HV = 4 and q, k at H = 2 (bf16, D = 128).
    T, D = 64, 128
    floor = 2 * (2 * (2 * T * 2 * D + 2 * T * 4 * D + T * 4)) + 2 * (2 * T * 4 * D)
    assert results[1]["floor_gib"] == pytest.approx(floor / 2 ** 30)
    assert "[reference] 3 cells in one process" in progress.getvalue()


def test_deadline_skips_cells_and_caps_limits(monkeypatch):
    import time

    limits = []

    def fake_run_cell(backend, shape, options, progress=None):
        limits.append(options.timeout_s)
        return {"backend": backend, **measure_worker.as_cell(shape).fields(), "head_dim": 128, "status": "ok",
                "fwd_ms": 1.0, "fwd_bwd_ms": 2.0, "wall_s": 0.0}

    monkeypatch.setattr(measure, "run_cell", fake_run_cell)
    monkeypatch.setattr(measure, "preflight", lambda backends, options: None)
    opts = measure.MeasureOptions(device="cpu", dry_run=True, timeout_s=600.0)
    res = measure.run_measure(["kdakit", "fla"], [(1, 64, 2)], opts, progress=None, deadline=time.monotonic() + 60)
    assert [r["status"] for r in res] == ["ok", "ok"] and all(50 < t <= 60 for t in limits)
    res = measure.run_measure(["kdakit", "fla"], [(1, 64, 2), (1, 128, 2)], opts, progress=None,
                              deadline=time.monotonic() + 1)
    assert [r["status"] for r in res] == ["skipped"] * 4 and len(limits) == 2


def test_real_shared_worker_on_cpu_runs_gva_and_softplus_cells():
    # A real worker process (the PyTorch path, dry run): three cells in one process, in order.
    opts = measure.MeasureOptions(device="cpu", dry_run=True, timeout_s=240.0, reps=1, timing_runs=1,
                                  warmup_seq=16, warmup_iters=1, head_dim=8)
    res = measure.run_measure(["reference"], parse_cells("2x16:2,1x32:2/4,1x32:2:softplus"), opts, progress=None,
                              shared_process=True)
    assert [r["status"] for r in res] == ["ok", "ok", "ok"], [r.get("message") for r in res]
    assert [r["cell"] for r in res] == ["2x16:2", "1x32:2/4", "1x32:2:softplus"]
    for r in res:
        assert r["fwd_ms"] > 0 and r["fwd_nograd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["cu_seqlens_cpu"] is True
        assert r["warmup_seq"] == 16 and r["process"].startswith("shared")
    warm = measure.run_shared("reference", parse_cells("1x32:2/4"),
                              measure.MeasureOptions(device="cpu", dry_run=True, warmup_seq=16, head_dim=8),
                              progress=None, warmup_only=True)
    assert warm[0]["status"] == "warm" and "fwd_ms" not in warm[0]


# ---------------------------------------------------------------------------------------
# The sweep join


def _sweep_file(tmp_path):
    recs = [
        _record("kdakit", 1, 2048, 96, 0.50, 1.1, 9.0, fwd_nograd_ms=1.0, peak_reserved_clean_gib=0.55,
                process="shared (1 of 3 cells in one process)", versions={"kdakit": "0.1.0", "torch": "2.11"}),
        _record("kdakit", 1, 8192, 16, 0.9, 2.0, 20.0, value_heads=32, gate="safe", fwd_nograd_ms=1.8),
        _record("kdakit", 1, 8192, 96, 2.1, 4.4, 44.0, value_heads=96, gate="softplus", fwd_nograd_ms=4.0),
        _record("fla", 1, 2048, 96, 1.7, 1.0, 3.0, fwd_nograd_ms=0.8, versions={"fla": "0.6.0"}),
        _record("fla", 1, 8192, 16, 9.0, 1.0, 1.0, value_heads=32, status="timeout"),
        _record("fla", 1, 8192, 96, 6.6, 3.3, 13.2, value_heads=96, gate="softplus", fwd_nograd_ms=3.2),
    ]
    recs[4]["message"] = "the shared fla process exceeded its 80 s limit"
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "git_sha": "abc1234",
                                "date": "2026-12-02", "process_mode": "shared", "records": recs}))
    return path


def test_sweep_join_per_cell_with_ratios_reserved_target_and_statuses(tmp_path):
    sweep = compare_sweep([str(_sweep_file(tmp_path))])
    rows = {r["shape"]: r for r in sweep["rows"]}
    assert list(rows) == ["1x2048:96", "1x8192:16/32", "1x8192:96:softplus"]
    a = rows["1x2048:96"]
    assert a["fwd_nograd_ratio"] == pytest.approx(1.0 / 0.8) and a["fwd_bwd_ratio"] == pytest.approx(3.0)
    assert a["fwd_ratio"] == pytest.approx(1.1) and a["peak_ratio"] == pytest.approx(0.5 / 1.7)
    assert a["reserved_target_gib"] == pytest.approx(1.15 * 1.5)
    assert a["kdakit_reserved_over_floor"] == pytest.approx(0.6 / 1.5) and a["kdakit_reserved_target_met"] is True
    assert a["fla_reserved_target_met"] is False and a["kdakit_peak_reserved_clean_gib"] == 0.55
    g = rows["1x8192:16/32"]
    assert (g["heads"], g["value_heads"], g["tokens"]) == (16, 32, 8192)
    assert g["fla_status"] == "timeout" and "80 s" in g["fla_message"] and "fwd_bwd_ratio" not in g
    assert g["fwd_bwd_bytes_floor_ms"] == pytest.approx(time_floors_ms(1, 8192, 16, value_heads=32)
                                                         ["fwd_bwd_bytes_floor_ms"])
    s = rows["1x8192:96:softplus"]
    assert s["gate"] == "softplus" and s["fwd_bwd_ratio"] == pytest.approx(44.0 / 13.2)
    assert sweep["versions"] == {"kdakit": "0.1.0", "torch": "2.11", "fla": "0.6.0"}
    table = sweep_markdown(sweep)
    assert "| 1x8192:16/32 | 8192 |" in table and "| timeout |" in table and "3.33x" in table
    assert "1.25x" in table and "0.400 ok" in table


def test_compare_cli_writes_sweep_env_and_git_sha(tmp_path):
    sweep = _sweep_file(tmp_path)
    env = tmp_path / "env.json"
    env.write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
                               "fla": "0.6.0", "git_sha": "abc1234", "date": "2026-12-02T10:00:00+00:00"}))
    out = tmp_path / "c.json"
    subprocess.run([sys.executable, COMPARE, "--sweep", str(sweep), "--env", str(env), "--out", str(out)],
                   check=True, capture_output=True)
    res = json.load(open(out))
    assert res["git_sha"] == "abc1234" and res["env"]["gpu"] == "NVIDIA H200" and res["env"]["fla"] == "0.6.0"
    assert res["env"]["date"].startswith("2026-12-02") and "rows" not in res  # no --kdakit / --fla files given
    assert [r["shape"] for r in res["sweep"]["rows"]][0] == "1x2048:96"
    assert res["sweep"]["files"][0]["process_mode"] == "shared"
    # Without env.json the results files' provenance fills the environment in.
    subprocess.run([sys.executable, COMPARE, "--sweep", str(sweep), "--out", str(out)], check=True,
                   capture_output=True)
    res = json.load(open(out))
    assert res["git_sha"] == "abc1234" and res["env"]["triton"] == "3.6.0" and res["env"]["kdakit"] == "0.1.0"
    bad = subprocess.run([sys.executable, COMPARE, "--kdakit", str(sweep), "--out", str(out)], capture_output=True)
    assert bad.returncode == 2  # --kdakit without --fla


def test_bench_comparisons_match_by_cell_label():
    recs = [_record("kdakit", 1, 8192, 16, 1.0, 2.0, 8.0, value_heads=32, fwd_nograd_ms=1.5),
            _record("fla", 1, 8192, 16, 4.0, 1.0, 4.0, value_heads=32, fwd_nograd_ms=1.0),
            _record("fla", 1, 8192, 16, 3.0, 1.0, 2.0)]  # the H16 protocol cell (HV = H) is another cell
    (c,) = comparisons_of(recs)
    assert c["shape"] == "1x8192:16/32" and c["fwd_bwd_ratio_kdakit_over_fla"] == pytest.approx(2.0)
    assert c["fwd_nograd_ratio_kdakit_over_fla"] == pytest.approx(1.5)


# ---------------------------------------------------------------------------------------
# run_gpu.sh


def test_run_gpu_script_parses_and_its_one_call_budget_fits():
    subprocess.run(["bash", "-n", RUN_GPU], check=True)
    text = open(RUN_GPU).read()
    m = re.search(r"declare -A DEFAULT_LIMIT=\((.*?)\)\n", text, re.S)
    limits = dict(re.findall(r"\[(\w+)\]=(\w+)", m.group(1)))
    command = re.search(r"bash benchmarks/run_gpu.sh ((?:\w+ ?)+)\n", text).group(1).split()
    assert command == ["env", "warm", "chunk", "fla", "sweep", "profile", "tests"]
    assert all(s in limits for s in command)
    fixed = sum(int(limits[s]) for s in command if limits[s] != "rest")
    total = int(re.search(r"TOTAL_LIMIT=\$\{TOTAL_LIMIT:-(\d+)\}", text).group(1))
    assert fixed <= 520 and total <= 530 and limits["tests"] == "rest"
    # Every stage the script documents has a function.
    for s in limits:
        assert f"stage_{s}() {{" in text


@pytest.mark.parametrize("pack", ["1", "0"])
def test_run_gpu_packs_its_outputs_into_one_archive(tmp_path, pack):
    """The device tool returns only a few files, so run_gpu.sh leaves results.tgz and stages.log (PACK_OUT=0:
    the files as written). Run from a copy of the script in an empty tree: no wheels to install, no stage."""
    import tarfile

    (tmp_path / "tree" / "benchmarks").mkdir(parents=True)
    script = tmp_path / "tree" / "benchmarks" / "run_gpu.sh"
    script.write_text(open(RUN_GPU).read())
    out = tmp_path / "out"
    (out / "train_tiny").mkdir(parents=True)
    (out / "train_tiny" / "loss_curve.csv").write_text("step,loss\n")
    (out / "train_tiny.log").write_text("trained\n")
    env = dict(os.environ, OUT=str(out), TRITON_CACHE_DIR=str(tmp_path / "cache"), PACK_OUT=pack)
    r = subprocess.run(["bash", str(script), "no_such_stage"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown stage 'no_such_stage'" in r.stdout, r.stdout + r.stderr
    if pack == "1":
        assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "stages.log"]
        with tarfile.open(out / "results.tgz") as t:
            names = set(t.getnames())
        assert {"train_tiny.log", "train_tiny/loss_curve.csv", "autotune_new.json", "triton_autotune.tgz"} <= names
    else:
        assert (out / "train_tiny.log").exists() and (out / "train_tiny" / "loss_curve.csv").exists()
        assert not (out / "results.tgz").exists()


def test_bench_chunk_main_records_gate_drops_kdakit_on_failure_and_writes_comparisons(monkeypatch, tmp_path):
    import bench_chunk

    calls = []

    def fake_run_measure(backends, cells, options, progress=None, on_result=None, shared_process=False,
                         deadline=None):
        calls.append({"backends": list(backends), "cells": [c.label for c in cells], "shared": shared_process,
                      "reps": options.reps, "timing_runs": options.timing_runs, "deadline": deadline,
                      "warmup_seq": options.warmup_seq})
        out = []
        for b in backends:
            for c in cells:
                r = {"backend": b, **c.fields(), "head_dim": 128, "status": "ok", "floor_gib": 1.0,
                     "peak_alloc_gib": 1.0 if b == "kdakit" else 3.0, "peak_reserved_gib": 1.1,
                     "fwd_ms": 2.0, "fwd_nograd_ms": 1.0 if b == "kdakit" else 0.5, "fwd_bwd_ms": 9.0 if b == "kdakit"
                     else 3.0}
                on_result(r)
                out.append(r)
        return out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(measure, "run_measure", fake_run_measure)
    monkeypatch.setenv("KDAKIT_GIT_SHA", "abc1234")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"correctness_gate": {"ok": True, "errors": {}}}))
    bad.write_text(json.dumps({"correctness_gate": {"ok": False, "errors": {}}}))
    out = tmp_path / "sweep.json"
    rc = bench_chunk.main(["--backends", "kdakit,fla", "--shapes", "1x2048:96,1x8192:16/32", "--gate-from", str(good),
                           "--shared-process", "--reps", "1", "--timing-runs", "5", "--budget-s", "80",
                           "--out", str(out)])
    assert rc == 0
    assert calls[0]["backends"] == ["kdakit", "fla"] and calls[0]["shared"] is True
    assert calls[0]["cells"] == ["1x2048:96", "1x8192:16/32"] and calls[0]["deadline"] is not None
    assert (calls[0]["reps"], calls[0]["timing_runs"], calls[0]["warmup_seq"]) == (1, 5, 1024)
    res = json.load(open(out))
    assert res["git_sha"] == "abc1234" and res["process_mode"] == "shared" and res["correctness_gate"]["ok"]
    assert "one process per backend" in res["protocol"] and "cu_seqlens_cpu" in res["protocol"]
    assert len(res["records"]) == 4 and res["records"][1]["fwd_bwd_bytes_floor_ms"] > 0
    cmp = {c["shape"]: c for c in res["comparisons"]}
    assert cmp["1x8192:16/32"]["fwd_bwd_ratio_kdakit_over_fla"] == pytest.approx(3.0)
    assert cmp["1x2048:96"]["fwd_nograd_ratio_kdakit_over_fla"] == pytest.approx(2.0)
    # A failed gate: FLA is still measured, kdakit is not.
    rc = bench_chunk.main(["--backends", "kdakit,fla", "--shapes", "1x2048:96", "--gate-from", str(bad),
                           "--out", str(out)])
    res = json.load(open(out))
    assert calls[1]["backends"] == ["fla"] and calls[1]["shared"] is False
    assert res["kdakit_dropped"] and {r["backend"] for r in res["records"]} == {"fla"} and rc == 0


# ---------------------------------------------------------------------------------------------
# bench_recurrent: decode targets, the launch-config sweep and its picks
# ---------------------------------------------------------------------------------------------

def test_bench_recurrent_help_targets_and_default_cells():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_recurrent.py"), "--help"],
                         check=True, capture_output=True, text=True).stdout
    for flag in ("--sweep", "--sweep-iters", "--sweep-budget-s", "--decode-n", "--train-t"):
        assert flag in out
    import bench_recurrent as br

    args = br.build_parser().parse_args(["--out", "x.json"])
    assert not args.sweep and {1024, 4096} <= set(args.decode_n)
    assert br.build_parser().parse_args(["--sweep", "--train-t", "--out", "x.json"]).train_t == []
    # issue #13: >= 85% of copy bandwidth and >= 1.3x FLA, judged separately
    assert br.decode_targets(0.86, 1.29) == {"fraction_of_copy": True, "speedup_vs_fla": False}
    assert br.decode_targets(0.849, 1.31) == {"fraction_of_copy": False, "speedup_vs_fla": True}
    assert br.decode_targets(0.9, None) == {"fraction_of_copy": True, "speedup_vs_fla": None}


def test_bench_recurrent_config_grid_and_best_config_pickers():
    import bench_recurrent as br

    assert br.sweep_configs(128) == [(bv, nw) for bv in (4, 8, 16, 32, 64) for nw in (1, 2, 4, 8)]
    assert br.sweep_configs(16) == [(bv, nw) for bv in (4, 8, 16) for nw in (1, 2, 4, 8)]
    with pytest.raises(ValueError, match="V must be"):
        br.sweep_configs(0)

    def row(bv, nw, ms):
        return {"block_v": bv, "num_warps": nw, "default": (bv, nw) == (16, 1), "graph_ms": ms,
                "fraction_of_copy": 0.1 / ms}

    a = [row(16, 1, 1.0), row(32, 2, 0.8), row(8, 1, 0.9), {"block_v": 64, "num_warps": 1, "error": "x"}]
    b = [row(16, 1, 2.0), row(32, 2, 2.2), row(8, 1, 1.9), {"block_v": 64, "num_warps": 1, "skipped": "budget"}]
    best = br.best_config(a)
    assert (best["block_v"], best["num_warps"], best["graph_ms"]) == (32, 2, 0.8)
    assert best["speedup_vs_default"] == pytest.approx(1.25)
    assert br.best_config([{"block_v": 8, "num_warps": 1, "error": "x"}]) is None
    cells = [{"N": 64, "state_dtype": "float32", "sweep": a, "sweep_best": br.best_config(a)},
             {"N": 4096, "state_dtype": "float32", "sweep": b, "sweep_best": br.best_config(b)},
             {"N": 64, "state_dtype": "bfloat16", "error": "correctness gate failed"}]
    pick = br.overall_best(cells)
    # (8, 1): 0.9/0.8 and 1.9/1.9 -> geomean 1.061; (32, 2): 1.0 and 2.2/1.9 -> 1.076; (16, 1): 1.118
    assert set(pick) == {"float32"}
    assert (pick["float32"]["block_v"], pick["float32"]["num_warps"]) == (8, 1)
    assert pick["float32"]["geomean_slowdown_vs_cell_best"] == pytest.approx(math.sqrt(0.9 / 0.8))
    assert pick["float32"]["worst_slowdown_vs_cell_best"] == pytest.approx(0.9 / 0.8)
    assert pick["float32"]["cells_N"] == [64, 4096]


def test_device_error_report_is_error_report_in_chunks():
    import bench_recurrent as br
    from kdakit.testing import error_report

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 3, 7, generator=gen)
    got = (ref + 1e-3 * torch.randn(5, 3, 7, generator=gen)).bfloat16()
    want = error_report("s", ref, got)
    for chunk in (1, 7, 1 << 26):
        rep = br.device_error_report("s", ref, got, chunk_elems=chunk)
        assert rep.max_abs == pytest.approx(want.max_abs) and rep.rms_ratio == pytest.approx(want.rms_ratio)
    bad = got.float().clone()
    bad[2, 1, 3] = float("nan")
    assert br.device_error_report("s", ref, bad, chunk_elems=4).rms_ratio == float("inf")
    assert br.device_error_report("s", torch.zeros(4), torch.zeros(4)).rms_ratio == 0.0
    with pytest.raises(ValueError, match="shape mismatch"):
        br.device_error_report("s", ref, got[0])


def test_bench_recurrent_sweep_gates_each_config_on_the_cpu_kernel(monkeypatch):
    import bench_recurrent as br

    monkeypatch.setattr(br, "DEV", "cpu")
    monkeypatch.setattr(br, "graphed", lambda fn: (fn, None))
    # a fake clock per config, in sweep_configs(16) order: (16, 2) is the fastest
    times = iter([2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3, 1.0, 0.5, 0.6, 0.7])
    replays = []

    def fake_median_ms(fn, warmup, iters):
        fn()
        replays.append((warmup, iters))
        return next(times)

    monkeypatch.setattr(br, "median_ms", fake_median_ms)
    N, H, K, V = 3, 2, 16, 16
    t, opts = br._decode_inputs(N, H, K, V)
    # a bf16 pool: its gate (1e-2) allows the bf16 output's last-bit differences that the interpreter's
    # truncating fp32 -> bf16 cast gives; the fp32 pool's gate (1e-4) holds only on the GPU
    pool = (0.3 * torch.randn(N, H, V, K, generator=torch.Generator().manual_seed(2))).bfloat16()
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    start = pool.clone()
    ref_o, ref_pool = br._decode_reference(t, opts, pool, idx)
    plan = br.SweepPlan(iters=4, left_s=1e9)
    rows = br.sweep_decode(t, opts, pool, idx, ref_o, ref_pool, copy_GBps=1.0, plan=plan)
    assert torch.equal(pool, start)  # each config runs on its own copy
    assert [(r["block_v"], r["num_warps"]) for r in rows] == br.sweep_configs(V)
    assert all("graph_ms" in r and len(r["gate"]) == 2 for r in rows), rows
    assert replays == [(br.SWEEP_WARMUP, 4)] * len(rows)
    from kdakit.ops.kda.serving.step import STEP_BLOCK_V, STEP_NUM_WARPS

    default = (STEP_BLOCK_V, STEP_NUM_WARPS)  # a one-token step: serving/step.py's kernel and config
    assert [r["default"] for r in rows] == [(r["block_v"], r["num_warps"]) == default for r in rows]
    best = br.best_config(rows)
    assert (best["block_v"], best["num_warps"]) == (16, 2) and plan.left_s < 1e9
    assert rows[9]["fraction_of_copy"] == pytest.approx(2 * pool.numel() * 2 / 0.5 / 1e6)

    # a wrong reference fails every config's gate, and none is timed
    rows = br.sweep_decode(t, opts, pool, idx, ref_o, ref_pool.float() + 1.0, copy_GBps=1.0,
                           plan=br.SweepPlan(iters=4, left_s=1e9))
    assert all(r.get("error") == "correctness gate failed" and "graph_ms" not in r for r in rows)
    # a spent budget skips every config without launching one
    rows = br.sweep_decode(t, opts, pool, idx, ref_o, ref_pool, copy_GBps=1.0, plan=br.SweepPlan(iters=4, left_s=0))
    assert all("skipped" in r for r in rows) and br.best_config(rows) is None


def test_bench_recurrent_summary_states_both_targets():
    import bench_recurrent as br

    row = {"N": 4096, "state_dtype": "bfloat16", "kdakit_fraction_of_copy": 0.86, "kdakit_speedup_vs_fla": 1.2,
           "meets_target": br.decode_targets(0.86, 1.2),
           "sweep": [], "sweep_best": {"block_v": 32, "num_warps": 2, "graph_ms": 1.0, "fraction_of_copy": 0.9,
                                       "speedup_vs_default": 1.1, "speedup_vs_fla": 1.35}}
    no_fla = {"N": 64, "state_dtype": "float32", "kdakit_fraction_of_copy": 0.8, "fla_error": "ImportError: fla",
              "meets_target": br.decode_targets(0.8, None)}
    lines = br.summary_lines({"decode": [row, no_fla, {"N": 1, "state_dtype": "float32", "error": "boom"}],
                              "sweep_overall_best": {"bfloat16": None}})
    assert "85%" in lines[0] and "1.3x" in lines[0]
    assert "0.860 of copy (meets 0.85), 1.20x FLA (misses 1.3x)" in lines[1]
    assert "block_v=32 num_warps=2" in lines[2] and "1.35x FLA" in lines[2]
    assert lines[3].endswith("0.800 of copy (misses 0.85), FLA not measured (ImportError: fla)")
    assert lines[4].endswith("boom") and "no config timed in every cell" in lines[5]


# ---------------------------------------------------------------------------------------------
# bench_recurrent: speculative steps (S tokens per sequence, [N, S] state_indices, num_accepted_tokens)
# ---------------------------------------------------------------------------------------------

def test_bench_recurrent_spec_indices_bytes_and_flag():
    import bench_recurrent as br

    idx, acc = br.spec_indices(64, 4)
    assert idx.shape == (64, 4) and acc.shape == (64,) and idx.dtype == acc.dtype == torch.int32
    assert idx.is_contiguous()  # FLA reads entry [n, t] at n * stride(0) + t
    assert sorted(idx.flatten().tolist()) == list(range(256))  # every pool row in exactly one sequence's column
    assert [acc.tolist().count(c) for c in (1, 2, 3, 4)] == [16, 16, 16, 16]
    assert acc.tolist() != sorted(acc.tolist())  # shuffled, not in runs
    again = br.spec_indices(64, 4)
    assert torch.equal(again[0], idx) and torch.equal(again[1], acc)
    _, acc6 = br.spec_indices(6, 4)
    assert sorted(acc6.tolist()) == [1, 1, 2, 2, 3, 4]
    with pytest.raises(ValueError, match="must be >= 1"):
        br.spec_indices(0, 4)
    # one row read and S rows written per sequence: N = 64, S = 4, HV = 32, K = V = 128 fp32 rows of 2 MiB
    assert br.spec_state_bytes(64, 4, 32 * 128 * 128 * 4) == 64 * 5 * 2 ** 21
    assert br.spec_state_bytes(256, 4, 32 * 128 * 128 * 2) == 256 * 5 * 2 ** 20

    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_recurrent.py"), "--help"],
                         check=True, capture_output=True, text=True).stdout
    assert "--spec-n" in out
    parse = br.build_parser().parse_args
    assert parse(["--out", "x.json"]).spec_n == [64, 256] and br.SPEC_S == 4
    assert parse(["--spec-n", "--out", "x.json"]).spec_n == []
    assert parse(["--spec-n", "8", "--out", "x.json"]).spec_n == [8]
    only_spec = parse(["--decode-n", "--train-t", "--out", "x.json"])  # the speculative rows alone
    assert (only_spec.decode_n, only_spec.train_t, only_spec.spec_n) == ([], [], [64, 256])
    with pytest.raises(SystemExit):
        br.main(["--spec-n", "0", "--out", "x.json"])


def test_bench_recurrent_summary_lists_speculative_rows():
    import bench_recurrent as br

    spec = {"N": 256, "S": 4, "state_dtype": "float32", "kdakit_fraction_of_copy": 0.7, "kdakit_speedup_vs_fla": 1.4,
            "meets_target": br.decode_targets(0.7, 1.4)}
    no_fla = {"N": 64, "S": 4, "state_dtype": "bfloat16", "kdakit_fraction_of_copy": 0.9,
              "fla_error": "FLA's speculative step disagrees", "meets_target": br.decode_targets(0.9, None)}
    failed = {"N": 64, "S": 4, "state_dtype": "float32", "error": "correctness gate failed"}
    lines = br.summary_lines({"decode": [], "speculative": [spec, no_fla, failed]})
    assert lines[1] == "speculative S=4 N=256 float32: 0.700 of copy (misses 0.85), 1.40x FLA (meets 1.3x)"
    assert lines[2] == ("speculative S=4 N=64 bfloat16: 0.900 of copy (meets 0.85), FLA not measured "
                        "(FLA's speculative step disagrees)")
    assert lines[3] == "speculative S=4 N=64 float32: correctness gate failed" and len(lines) == 4


def _cpu_bench(monkeypatch, br, times):
    """bench_recurrent on the CPU: the Triton kernels under the interpreter, no graphs, a fake clock."""
    monkeypatch.setattr(br, "DEV", "cpu")
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    monkeypatch.setattr(br, "graphed", lambda fn: (fn, None))
    clock, calls = iter(times), []

    def fake_median_ms(fn, warmup, iters):
        fn()
        calls.append(iters)
        return next(clock)

    monkeypatch.setattr(br, "median_ms", fake_median_ms)
    return calls


def _kdakit_as_fla(t, opts, pool, idx, out, acc=None):
    """FLA's fused_recurrent_kda_fwd call as kdakit implements its semantics (FLA is not installed on CPU)."""
    from kdakit.ops.kda.recurrent.api import fused_recurrent_kda

    def run():
        with torch.no_grad():
            fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                                initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                num_accepted_tokens=acc, state_v_first=True, out=out, **opts)
    return run


def test_bench_recurrent_speculative_cell_on_the_cpu_kernel(monkeypatch):
    import bench_recurrent as br

    calls = _cpu_bench(monkeypatch, br, [2.0, 5.0, 3.0])  # kdakit graph, kdakit eager, FLA graph
    monkeypatch.setattr(br, "_fla_decode_fn", _kdakit_as_fla)
    N, S, H, K, V = 4, 4, 2, 16, 16
    # a bf16 pool: its gate (1e-2) allows the interpreter's truncating fp32 -> bf16 cast of the bf16 outputs
    r = br.bench_speculative(N, torch.bfloat16, copy_GBps=1.0, iters=8, S=S, H=H, K=K, V=V)
    assert "error" not in r and "fla_error" not in r, r
    assert len(r["gate"]) == 2 and len(r["fla_gate"]) == 2 and calls == [8, 20, 8]
    assert r["pool_rows"] == N * S and r["num_accepted_tokens_counts"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert r["state_bytes_read_plus_written"] == N * (1 + S) * H * V * K * 2
    assert r["kdakit_fraction_of_copy"] == pytest.approx(r["state_bytes_read_plus_written"] / 2.0 / 1e6)
    assert r["kdakit_speedup_vs_fla"] == pytest.approx(1.5) and r["kdakit_eager_ms"] == 5.0
    assert r["meets_target"] == br.decode_targets(r["kdakit_fraction_of_copy"], 1.5)
    assert r["kdakit_launch_config"] == dict(zip(("block_v", "num_warps"), br.decode_launch_config(N, S, H, V)))
    json.dumps(r)


def test_bench_recurrent_speculative_gates_catch_the_wrong_initial_row(monkeypatch):
    import bench_recurrent as br

    # an FLA call that ignores num_accepted_tokens (reads column 0): its states are wrong, so it is not timed
    _cpu_bench(monkeypatch, br, [2.0, 5.0])
    monkeypatch.setattr(br, "_fla_decode_fn", lambda t, opts, pool, idx, out, acc=None:
                        _kdakit_as_fla(t, opts, pool, idx, out, None))
    r = br.bench_speculative(4, torch.bfloat16, copy_GBps=1.0, iters=8, S=4, H=2, K=16, V=16)
    assert "error" not in r and "disagrees with the reference" in r["fla_error"], r
    assert "kdakit_speedup_vs_fla" not in r and r["meets_target"]["speedup_vs_fla"] is None
    # a reference that ignores num_accepted_tokens fails kdakit's gate: nothing is timed
    calls = _cpu_bench(monkeypatch, br, [])
    ref = br.kda_decode_reference
    monkeypatch.setattr(br, "kda_decode_reference", lambda q, k, v, g, beta, pool, idx, acc, o, opts, **kw:
                        ref(q, k, v, g, beta, pool, idx, None, o, opts, **kw))
    r = br.bench_speculative(4, torch.bfloat16, copy_GBps=1.0, iters=8, S=4, H=2, K=16, V=16)
    assert r["error"] == "correctness gate failed" and "kdakit_graph_ms" not in r and calls == []
