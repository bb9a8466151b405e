"""CPU checks of the benchmark helpers that need no GPU: result joining and the time floors."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_chunk import parse_shapes, time_floors_ms  # noqa: E402
from compare_chunk import compare, markdown  # noqa: E402


def _record(backend, mbs, seq, heads, peak, fwd, fwd_bwd, status="ok"):
    return {"backend": backend, "mbs": mbs, "seq": seq, "heads": heads, "status": status, "floor_gib": 1.5,
            "peak_alloc_gib": peak, "peak_reserved_gib": peak + 0.1, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
            **time_floors_ms(mbs, seq, heads)}


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
    assert "fla_fwd_ms" not in rows["8x8192:16"]  # a kdakit record in the FLA file is not FLA's
    table = markdown(res)
    assert "3.08x" in table and "| 8x8192:16 |" in table and "- | - |" in table


def test_committed_h200_comparison_is_what_compare_prints(tmp_path):
    res_dir = os.path.join(ROOT, "benchmarks", "results")
    out = tmp_path / "c.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_chunk.py"),
                    "--kdakit", os.path.join(res_dir, "chunk_h200.json"),
                    "--fla", os.path.join(res_dir, "chunk_fla_h200.json"), "--out", str(out)],
                   check=True, capture_output=True)
    committed = json.load(open(os.path.join(res_dir, "chunk_vs_fla_h200.json")))
    assert json.load(open(out))["rows"] == committed["rows"]


def test_time_floors_and_shape_parsing():
    assert parse_shapes("1x8192:96,8x8192:16") == [(1, 8192, 96), (8, 8192, 16)]
    f = time_floors_ms(1, 8192, 96)
    th = 8192 * 96
    assert f["fwd_bwd_bytes_floor_ms"] == pytest.approx(1e3 * (28 * th * 128 + 6 * th) / 4.3e12)
    assert f["fwd_bwd_flops_floor_ms"] == pytest.approx(3 * f["fwd_flops_floor_ms"])
