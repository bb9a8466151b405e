"""CPU checks of benchmarks/bench_vs_fla.py: the memory floor, the rows and tables built from records, merging,
the job plan, and whole dry runs (subprocess per cell, kdakit's PyTorch path standing in for FLA) with a crashing,
a hanging and a budget-skipped process."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_vs_fla as bvf  # noqa: E402
import vs_fla_common as common  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_vs_fla.py")


def test_floor_matches_the_protocol_figures():
    assert common.floor_gib("1x8192:96", "safe") == pytest.approx(1.878, abs=5e-4)
    assert common.floor_gib("1x131072:96", "softplus") == pytest.approx(30.047, abs=5e-4)
    T, H, D = 8192, 96, 128
    assert common.floor_bytes(1, 8192, 96, "safe") == 20 * T * H * D + 4 * T * H
    # raw: g and dg in fp32, 4 more bytes per element each
    assert common.floor_bytes(1, 8192, 96, "raw") == 24 * T * H * D + 4 * T * H
    assert common.floor_gib("8x8192:16", "safe") == pytest.approx(common.floor_gib("1x8192:128", "safe"))


def test_shapes_and_lists_reject_bad_input():
    assert common.parse_shape("8x8192:16") == (8, 8192, 16)
    for bad in ("8192:16", "1x8192", "0x8192:16", "ax1:2"):
        with pytest.raises(ValueError, match="shape"):
            common.parse_shape(bad)
    with pytest.raises(ValueError, match="--gates"):
        common.parse_list("safe,bogus", common.GATES, "--gates")


def _rec(impl, gate, shape, status="ok", pipeline=None, **kw):
    r = {"kind": "chunk", "impl": impl, "gate": gate, "shape": shape, "status": status, **kw}
    if impl == "kdakit":
        r["pipeline"] = pipeline or "default"
    return r


def test_rows_join_pipelines_and_fla_with_ratios():
    recs = [
        _rec("kdakit", "safe", "1x8192:96", fwd_ms=4.0, fwd_bwd_ms=20.0, peak_alloc_gib=2.0, peak_reserved_gib=2.5,
             pipeline_ran="windowed16", accuracy_vs_fla={"o": 1e-3}),
        _rec("kdakit", "safe", "1x8192:96", pipeline="chunk64_fast", fwd_ms=3.0, fwd_bwd_ms=13.0,
             peak_alloc_gib=4.0, peak_reserved_gib=4.5, pipeline_ran="chunk64_fast (window 2048)"),
        _rec("fla", "safe", "1x8192:96", fwd_ms=2.0, fwd_bwd_ms=10.0, peak_alloc_gib=8.0, peak_reserved_gib=9.0),
        _rec("kdakit", "raw", "1x131072:96", status="skipped", message="budget"),
        _rec("fla", "raw", "1x131072:96", status="timeout", message="cut"),
    ]
    rows = common.build_rows(recs, ["default", "chunk64_fast"])
    assert [(r["gate"], r["shape"]) for r in rows] == [("safe", "1x8192:96"), ("raw", "1x131072:96")]
    a, b = rows
    assert a["floor_gib"] == pytest.approx(1.8779296875)
    assert (a["fwd_ratio"], a["fwd_bwd_ratio"], a["peak_ratio"]) == (2.0, 2.0, 0.25)
    assert a["fwd_bwd_ratio_chunk64_fast"] == 1.3 and a["kdakit_chunk64_fast_pipeline_arg"] == "chunk64_fast"
    assert a["kdakit_pipeline_arg"] is None and a["kdakit_pipeline_ran"] == "windowed16"
    assert a["kdakit_accuracy_vs_fla"] == {"o": 1e-3}
    assert b["kdakit_status"] == "skipped" and b["fla_status"] == "timeout" and "fwd_ratio" not in b
    assert b["kdakit_chunk64_fast_status"] == "not run" and b["floor_gib"] == pytest.approx(2.2529296875 * 16)
    table = common.markdown_chunk({"rows": rows, "pipelines": ["default", "chunk64_fast"]})
    lines = table.splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| safe | 1x8192:96 | 1.878 | 4.00 / 20.00 | 2.00 / 10.00 | 2.00x | 2.00x | 2.000 (2.500) |" in table
    assert "| raw | 1x131072:96 | 36.047 | skipped | timeout |" in table


def test_an_ok_record_is_not_replaced_by_a_later_failure_and_merge_rebuilds_rows():
    ok = _rec("fla", "safe", "1x8192:96", fwd_ms=2.0, fwd_bwd_ms=10.0, peak_alloc_gib=8.0, peak_reserved_gib=9.0)
    bad = _rec("fla", "safe", "1x8192:96", status="error", message="boom")
    assert common.build_rows([ok, bad], ["default"])[0]["fla_status"] == "ok"
    assert common.build_rows([bad, ok], ["default"])[0]["fla_status"] == "ok"
    kd = _rec("kdakit", "raw", "1x8192:96", fwd_ms=1.0, fwd_bwd_ms=5.0, peak_alloc_gib=1.0, peak_reserved_gib=1.0)
    a = {"kind": "chunk", "pipelines": ["default"], "records": [ok], "kdakit": {"git_sha": "abc"}}
    b = {"kind": "chunk", "pipelines": ["default", "chunk64_fast"], "records": [kd], "kdakit": {"git_sha": "abc"}}
    m = common.merge([a, b])
    assert m["pipelines"] == ["default", "chunk64_fast"] and len(m["rows"]) == 2 and "git_sha_mismatch" not in m
    assert common.merge([a, dict(b, kdakit={"git_sha": "def"})])["git_sha_mismatch"] == ["abc", "def"]
    with pytest.raises(ValueError, match="one kind"):
        common.merge([a, dict(b, kind="layer")])


def test_job_plan_and_warm_cells():
    cells = [("safe", "1x8192:96"), ("safe", "8x8192:16"), ("safe", "1x131072:96")]
    keys = common.impl_keys(["kdakit", "fla"], ["default", "chunk64_fast"])
    assert keys == ["kdakit:default", "kdakit:chunk64_fast", "fla"]
    assert len(common.plan_jobs(cells, keys, "fresh")) == 9
    assert common.plan_jobs(cells[:1], keys, "split") == [(cells[0], keys[:2]), (cells[0], ["fla"])]
    assert common.plan_jobs(cells[:1], keys, "shared") == [(cells[0], keys)]
    assert common.plan_jobs(cells[:1], ["fla"], "split") == [(cells[0], ["fla"])]
    # one small cell per (gate, sequence count, head count): the 128K cell shares the 8K H96 variants
    assert common.warm_cells("chunk", cells) == [("safe", "1x1024:96"), ("safe", "8x128:16")]


def _run(tmp_path, *extra, timeout=400):
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT, "chunk", "--out", str(out), "--dry-run", "--gates", "raw", "--shapes",
           "2x8192:4", "--pipelines", "default", "--runs", "2", "--warmup", "1", "--warm-jobs", "0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc, json.load(open(out / "chunk_vs_fla.json"))


@pytest.mark.slow
def test_dry_run_end_to_end_with_accuracy_and_table(tmp_path):
    proc, res = _run(tmp_path, "--process", "shared", "--warm-jobs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = res["rows"]
    assert row["kdakit_status"] == row["fla_status"] == "ok"
    assert row["floor_gib"] == pytest.approx(common.floor_gib("2x8192:4", "raw"))
    # the stand-in is kdakit's own PyTorch path on the same inputs: the sampled outputs agree exactly
    acc = row["kdakit_accuracy_vs_fla"]
    assert set(acc) >= {"o", "dq", "dg"} and max(acc[k] for k in ("o", "dq", "dg")) == 0.0
    assert row["kdakit_pipeline_ran"] == "torch reference" and row["fwd_bwd_ratio"] > 0
    assert {w["status"] for w in res["warm"]} == {"warm"} and len(res["warm"]) == 2
    assert res["kdakit"]["git_sha"] == res["fla"]["git_sha"] and res["process"] == "shared"
    assert not any(n.endswith(".pt") for n in os.listdir(tmp_path / "out"))  # samples kept off OUT
    table = subprocess.run([sys.executable, SCRIPT, "table", str(tmp_path / "out" / "chunk_vs_fla.json")],
                           check=True, capture_output=True, text=True).stdout
    assert table.strip() == res["markdown"].strip() and "| raw | 2x8192:4 |" in table


@pytest.mark.slow
def test_dry_run_records_a_crash_a_hang_and_a_spent_budget(tmp_path):
    proc, res = _run(tmp_path, "--process", "fresh", "--fault", "fla:crash")
    assert proc.returncode == 1
    (row,) = res["rows"]
    assert row["kdakit_status"] == "ok" and row["fla_status"] == "error" and "exit status 3" in row["fla_message"]
    assert row["kdakit_accuracy_vs_fla"] == {"missing": "FLA did not run ok in this run"}

    proc, res = _run(tmp_path, "--impls", "kdakit", "--fault", "kdakit:default:hang", "--cell-timeout", "5")
    (row,) = res["rows"]
    assert row["kdakit_status"] == "timeout" and row["fla_status"] == "not run", row
    assert "cut at 5 s" in row["kdakit_message"]

    proc, res = _run(tmp_path, "--budget-s", "10", "--min-job-s", "25")
    (row,) = res["rows"]
    assert row["kdakit_status"] == row["fla_status"] == "skipped" and "budget" in row["fla_message"]


def test_layer_dry_run_builds_both_layers_with_fp32_gate_parameters(tmp_path):
    out = tmp_path / "out"
    subprocess.run([sys.executable, SCRIPT, "layer", "--out", str(out), "--dry-run", "--tokens", "8192",
                    "--pipelines", "default", "--runs", "2", "--warmup", "1", "--warm-jobs", "0",
                    "--process", "shared"], check=True, capture_output=True, text=True, timeout=400, cwd=ROOT)
    res = json.load(open(out / "layer_vs_fla.json"))
    (row,) = res["rows"]
    assert row["shape"] == "1x8192" and row["kdakit_status"] == row["fla_status"] == "ok"
    assert row["kdakit_accuracy_vs_fla"]["dx"] == 0.0
    assert all(r["fp32_gate_params"] for r in res["records"])
    assert "| 1x8192 |" in common.markdown(res)
