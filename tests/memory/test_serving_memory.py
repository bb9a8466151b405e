"""Serving-memory estimator (docs/spec.md §6) and ``kdakit serve-mem``.

Expected values are computed here by hand from the layer geometry, independently of the library's
helpers, and the library is checked against them.
"""

import argparse
import dataclasses
import json
import re
from fractions import Fraction

import pytest

from kdakit.memory import serving as sv
from kdakit.memory.serving_cli import register

# Kimi-Linear-48B-A3B by hand: 32 KDA heads x 128 x 128 fp32 state; q, k, v conv channels 3 * 32 * 128
# with width-1 = 3 past columns in bf16; MLA latent 512 + rope 64 in bf16.
KIMI_RECURRENT = 32 * 128 * 128 * 4  # 2,097,152
KIMI_CONV = 3 * 32 * 128 * (4 - 1) * 2  # 73,728
KIMI_SIGMA = KIMI_RECURRENT + KIMI_CONV  # 2,170,880
KIMI_KAPPA = (512 + 64) * 2  # 1,152


def _config_4l(ell, **kw):
    """A 4l-layer 3:1 hybrid with small, distinct per-layer sizes."""
    kda, mla = sv.pattern_from_ratio(4 * ell, 3, 1)
    base = dict(kda_heads=4, head_k_dim=16, head_v_dim=8, conv_width=3, kv_lora_rank=24, rope_dim=8)
    base.update(kw)
    return sv.HybridModelConfig(num_layers=4 * ell, kda_layers=kda, mla_layers=mla, **base)


def _sigma_by_hand(h, hv, k, v, width_cols, state_b, conv_b):
    return hv * k * v * state_b + (2 * h * k + hv * v) * width_cols * conv_b


# ---------------------------------------------------------------------------------------------------
# Seed-004 formula and crossover
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ell,b,T", [(1, 1, 1), (2, 3, 100), (8, 5, 4096), (5, 7, 131072)])
def test_seed004_formula(ell, b, T):
    cfg = _config_4l(ell)
    sigma = _sigma_by_hand(4, 4, 16, 8, 2, 4, 2)  # 4*16*8*4 + (2*4*16 + 4*8) * 2 * 2 = 2048 + 640
    kappa = (24 + 8) * 2
    assert sv.kda_state_bytes_per_seq(cfg) == sigma == 2688
    assert sv.mla_bytes_per_token(cfg) == kappa == 64
    assert (cfg.num_kda, cfg.num_mla) == (3 * ell, ell)
    assert sv.m_mla_bytes(cfg, b, T) == 4 * b * ell * kappa * T
    assert sv.m_hybrid_bytes(cfg, b, T) == b * ell * (kappa * T + 3 * sigma)
    expect = Fraction(1, 4) + Fraction(3 * sigma, 4 * kappa * T)
    assert sv.memory_ratio(cfg, T) == pytest.approx(float(expect), rel=1e-15)
    est = sv.estimate(cfg, b, T)
    assert (est.m_mla_bytes, est.m_hybrid_bytes) == (4 * b * ell * kappa * T, b * ell * (kappa * T + 3 * sigma))
    assert est.ratio_limit == 0.25


def test_seed004_crossover_non_integer():
    cfg = _config_4l(3, kv_lora_rank=40, rope_dim=10)  # sigma 2688, kappa 100 -> T* = 26.88
    assert sv.crossover_tokens(cfg) == pytest.approx(26.88, rel=1e-15)
    b = 2
    # the hybrid holds more at T = 26 and less from T = 27 on; the ratio crosses 1 between them
    assert sv.m_hybrid_bytes(cfg, b, 26) > sv.m_mla_bytes(cfg, b, 26)
    assert sv.m_hybrid_bytes(cfg, b, 27) < sv.m_mla_bytes(cfg, b, 27)
    assert sv.memory_ratio(cfg, 26) > 1.0 > sv.memory_ratio(cfg, 27)


def test_seed004_crossover_integer_is_break_even():
    cfg = _config_4l(2)  # sigma 2688, kappa 64 -> T* = 42
    assert sv.crossover_tokens(cfg) == 42.0
    assert sv.m_hybrid_bytes(cfg, 3, 42) == sv.m_mla_bytes(cfg, 3, 42)
    assert sv.memory_ratio(cfg, 42) == 1.0
    assert sv.memory_ratio(cfg, 41) > 1.0 > sv.memory_ratio(cfg, 43)


def test_crossover_is_independent_of_pattern_and_ratio_tends_to_mla_fraction():
    for kda, mla in [(1, 1), (3, 1), (7, 1), (5, 2)]:
        k_ids, m_ids = sv.pattern_from_ratio(14, kda, mla)
        cfg = sv.HybridModelConfig(num_layers=14, kda_layers=k_ids, mla_layers=m_ids)
        assert sv.crossover_tokens(cfg) == KIMI_SIGMA / KIMI_KAPPA
        assert sv.memory_ratio(cfg, 10**9) == pytest.approx(len(m_ids) / 14, abs=1e-5)


# ---------------------------------------------------------------------------------------------------
# Presets and per-layer bytes
# ---------------------------------------------------------------------------------------------------


def test_preset_kimi_linear_bytes_by_hand():
    cfg = sv.get_preset("kimi-linear-48b-a3b")
    assert (cfg.num_layers, cfg.num_kda, cfg.num_mla) == (27, 20, 7)
    # checkpoint full_attn_layers 4, 8, ..., 24, 27 (1-based)
    assert cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    parts = sv.kda_state_breakdown(cfg)
    assert (parts.recurrent, parts.conv) == (KIMI_RECURRENT, KIMI_CONV) == (2_097_152, 73_728)
    assert sv.kda_state_bytes_per_seq(cfg) == KIMI_SIGMA == 2_170_880
    assert sv.mla_bytes_per_token(cfg) == KIMI_KAPPA == 1152
    assert sv.crossover_tokens(cfg) == pytest.approx(1884.444444, rel=1e-9)
    b, T = 4, 131072
    assert sv.m_mla_bytes(cfg, b, T) == b * 27 * 1152 * T
    assert sv.m_hybrid_bytes(cfg, b, T) == b * (7 * 1152 * T + 20 * KIMI_SIGMA)


def test_preset_generic_is_seed004_shape():
    cfg = sv.get_preset("generic-4l-3to1")
    assert (cfg.num_layers, cfg.num_kda, cfg.num_mla) == (32, 24, 8)
    assert cfg.mla_layers == tuple(range(3, 32, 4))
    assert sv.kda_state_bytes_per_seq(cfg) == KIMI_SIGMA
    assert sv.mla_bytes_per_token(cfg) == KIMI_KAPPA
    ell, b, T = 8, 2, 10_000
    assert sv.m_hybrid_bytes(cfg, b, T) == b * ell * (KIMI_KAPPA * T + 3 * KIMI_SIGMA)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset.*kimi-linear-48b-a3b.*got 'llama'"):
        sv.get_preset("llama")


def test_conv_columns_dtypes_and_grouped_value_heads():
    cfg = sv.get_preset("kimi-linear-48b-a3b")
    full = dataclasses.replace(cfg, conv_state_columns="width")
    assert sv.kda_state_breakdown(full).conv == 3 * 32 * 128 * 4 * 2
    bf16_state = dataclasses.replace(cfg, state_dtype="bf16")
    assert sv.kda_state_breakdown(bf16_state).recurrent == 32 * 128 * 128 * 2
    fp8 = dataclasses.replace(cfg, mla_cache_dtype="fp8")
    assert sv.mla_bytes_per_token(fp8) == 576
    gva = dataclasses.replace(cfg, kda_heads=8, kda_value_heads=16, head_k_dim=64, head_v_dim=96, conv_width=5)
    assert sv.kda_state_bytes_per_seq(gva) == _sigma_by_hand(8, 16, 64, 96, 4, 4, 2)


def test_tensor_parallel_splits_kda_and_replicates_mla():
    cfg = sv.get_preset("kimi-linear-48b-a3b")
    for tp in (1, 2, 4, 8, 32):
        parts = sv.kda_state_breakdown(cfg, tp)
        assert parts.recurrent == (32 // tp) * 128 * 128 * 4
        assert parts.conv == 3 * (32 // tp) * 128 * 3 * 2
        assert sv.mla_bytes_per_token(cfg, tp) == KIMI_KAPPA
        assert sv.crossover_tokens(cfg, tp) == pytest.approx(KIMI_SIGMA / tp / KIMI_KAPPA, rel=1e-15)
        assert sv.m_hybrid_bytes(cfg, 3, 5000, tp) == 3 * (7 * KIMI_KAPPA * 5000 + 20 * KIMI_SIGMA // tp)
    with pytest.raises(ValueError, match="tp: expected a divisor of kda_heads=32"):
        sv.kda_state_bytes_per_seq(cfg, 3)


# ---------------------------------------------------------------------------------------------------
# Budget solvers
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget_gib,context,tp", [(80, 131072, 1), (7.5, 4096, 2), (0.01, 1000, 1)])
def test_max_batch_is_tight(budget_gib, context, tp):
    cfg = sv.get_preset("kimi-linear-48b-a3b")
    budget = int(budget_gib * 2**30)
    per_seq_h = 7 * KIMI_KAPPA * context + 20 * KIMI_SIGMA // tp
    per_seq_m = 27 * KIMI_KAPPA * context
    bh = sv.max_batch_at_context(cfg, budget, context, tp)
    bm = sv.max_batch_at_context(cfg, budget, context, tp, design="mla")
    assert (bh, bm) == (budget // per_seq_h, budget // per_seq_m)
    assert bh * per_seq_h <= budget < (bh + 1) * per_seq_h
    if bh:
        assert sv.m_hybrid_bytes(cfg, bh, context, tp) <= budget < sv.m_hybrid_bytes(cfg, bh + 1, context, tp)


@pytest.mark.parametrize("budget_gib,batch", [(80, 1), (60, 16), (1, 3)])
def test_max_context_is_tight(budget_gib, batch):
    cfg = sv.get_preset("kimi-linear-48b-a3b")
    budget = int(budget_gib * 2**30)
    th = sv.max_context_at_batch(cfg, budget, batch)
    tm = sv.max_context_at_batch(cfg, budget, batch, design="mla")
    assert th == (budget - batch * 20 * KIMI_SIGMA) // (batch * 7 * KIMI_KAPPA)
    assert tm == budget // (batch * 27 * KIMI_KAPPA)
    assert sv.m_hybrid_bytes(cfg, batch, th) <= budget < sv.m_hybrid_bytes(cfg, batch, th + 1)
    assert sv.m_mla_bytes(cfg, batch, tm) <= budget < sv.m_mla_bytes(cfg, batch, tm + 1)
    assert th > tm  # at these budgets the context is far above T*


def test_budget_edge_cases():
    cfg = sv.get_preset("kimi-linear-48b-a3b")
    fixed = 20 * KIMI_SIGMA
    assert sv.max_context_at_batch(cfg, fixed - 1, 1) == 0  # not even the fixed KDA state fits
    assert sv.max_batch_at_context(cfg, fixed, 1) == 0
    kda_only = sv.HybridModelConfig(num_layers=4, kda_layers=(0, 1, 2, 3), mla_layers=())
    assert sv.max_context_at_batch(kda_only, 4 * KIMI_SIGMA, 1) is None  # unbounded
    assert sv.max_context_at_batch(kda_only, 4 * KIMI_SIGMA - 1, 1) == 0
    with pytest.raises(ValueError, match="design"):
        sv.max_batch_at_context(cfg, 1 << 30, 10, design="gqa")
    with pytest.raises(ValueError, match="budget_bytes"):
        sv.max_batch_at_context(cfg, 0, 10)


# ---------------------------------------------------------------------------------------------------
# Patterns and validation
# ---------------------------------------------------------------------------------------------------


def test_patterns():
    kda, mla = sv.pattern_from_ratio(27, 3, 1)
    assert (len(kda), len(mla)) == (21, 6) and mla == (3, 7, 11, 15, 19, 23)
    kda, mla = sv.pattern_from_counts(20, 7)
    assert mla == sv.get_preset("kimi-linear-48b-a3b").mla_layers and len(kda) == 20
    kda, mla = sv.pattern_from_counts(5, 0)
    assert (kda, mla) == ((0, 1, 2, 3, 4), ())


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(num_layers=4, kda_layers=(0, 1, 2), mla_layers=(2, 3)), ValueError, "both KDA and MLA"),
        (dict(num_layers=4, kda_layers=(0, 1), mla_layers=(3,)), ValueError, r"layers \[2\] are neither"),
        (dict(num_layers=2, kda_layers=(), mla_layers=(0, 1)), ValueError, "at least one KDA layer"),
        (dict(num_layers=2, kda_layers=(0, 5), mla_layers=(1,)), ValueError, r"kda_layers: expected layer indices in \[0, 2\)"),
        (dict(num_layers=2, kda_layers=(0,), mla_layers=(1,), state_dtype="int4"), ValueError, "state_dtype"),
        (dict(num_layers=2, kda_layers=(0,), mla_layers=(1,), kda_heads=0), ValueError, "kda_heads"),
        (dict(num_layers=2, kda_layers=(0,), mla_layers=(1,), head_k_dim=True), TypeError, "head_k_dim"),
        (dict(num_layers=2, kda_layers=(0,), mla_layers=(1,), conv_state_columns="full"), ValueError, "conv_state_columns"),
    ],
)
def test_config_validation(kw, exc, match):
    with pytest.raises(exc, match=match):
        sv.HybridModelConfig(**kw)


def test_call_validation():
    cfg = sv.get_preset("generic-4l-3to1")
    with pytest.raises(ValueError, match="context: expected an int >= 1, got 0"):
        sv.m_mla_bytes(cfg, 1, 0)
    with pytest.raises(TypeError, match="batch"):
        sv.m_hybrid_bytes(cfg, 1.5, 10)


# ---------------------------------------------------------------------------------------------------
# CLI through register() on a fresh parser
# ---------------------------------------------------------------------------------------------------


def _run(argv):
    parser = argparse.ArgumentParser(prog="kdakit")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve-mem", *argv])
    return args.func(args)


def test_cli_json(capsys):
    assert _run(["--json", "--batch", "4", "--context", "131072", "--budget-gib", "80"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kda_state_bytes_per_seq"] == KIMI_SIGMA
    assert out["mla_bytes_per_token"] == KIMI_KAPPA
    assert out["m_mla_bytes"] == 4 * 27 * KIMI_KAPPA * 131072
    assert out["m_hybrid_bytes"] == 4 * (7 * KIMI_KAPPA * 131072 + 20 * KIMI_SIGMA)
    assert out["ratio"] == pytest.approx(out["m_hybrid_bytes"] / out["m_mla_bytes"], rel=1e-15)
    assert out["crossover_tokens"] == pytest.approx(KIMI_SIGMA / KIMI_KAPPA, rel=1e-15)
    budget = 80 * 2**30
    assert out["max_batch_hybrid"] == budget // (7 * KIMI_KAPPA * 131072 + 20 * KIMI_SIGMA)
    assert out["max_context_mla"] == budget // (4 * 27 * KIMI_KAPPA)
    assert out["preset"] == "kimi-linear-48b-a3b" and out["per_rank"] is True
    assert "active attention state only" in out["scope"]
    assert "replicated" in out["tp_assumption"]


def test_cli_overrides(capsys):
    argv = ["--json", "--layers", "8", "--ratio", "3:1", "--kda-heads", "4", "--head-dim", "16",
            "--conv-width", "3", "--kv-lora-rank", "24", "--rope-dim", "8", "--tp", "2",
            "--state-dtype", "bf16", "--conv-dtype", "fp32", "--context", "100"]
    assert _run(argv) == 0
    out = json.loads(capsys.readouterr().out)
    sigma = (2 * 16 * 16 * 2) + (3 * 2 * 16) * 2 * 4  # per rank: 2 heads
    assert out["kda_state_bytes_per_seq"] == sigma
    assert out["mla_bytes_per_token"] == 64
    assert (out["num_kda_layers"], out["num_mla_layers"]) == (6, 2)
    assert out["m_hybrid_bytes"] == 2 * 64 * 100 + 6 * sigma
    assert out["model"]["name"].startswith("custom")


def test_cli_explicit_layers_and_counts(capsys):
    assert _run(["--json", "--kda-layers", "0-2,4", "--mla-layers", "3,5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["mla_layers"] == [3, 5] and out["num_layers"] == 6
    assert _run(["--json", "--mla-count", "2", "--layers", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_kda_layers"], out["num_mla_layers"]) == (8, 2)


def test_cli_table(capsys):
    assert _run(["--preset", "generic-4l-3to1", "--batch", "2", "--context", "8192", "--budget-gib", "40"]) == 0
    text = capsys.readouterr().out
    m_hybrid = 2 * 8 * (KIMI_KAPPA * 8192 + 3 * KIMI_SIGMA)
    for piece in ("generic-4l-3to1", "32 layers = 24 KDA + 8 MLA", f"{KIMI_SIGMA:,} B", f"{m_hybrid:,} B",
                  "1,884.4 tokens", "largest batch", "longest context", "active attention state only",
                  "replicated"):
        assert piece in text, piece


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--preset", "llama-70b"], "unknown preset 'llama-70b'"),
        (["--batch", "0"], "--batch: expected a positive integer, got '0'"),
        (["--context", "1e5"], "--context: expected a positive integer"),
        (["--budget-gib", "-3"], "--budget-gib: expected a positive finite number"),
        (["--budget-gib", "nan"], "--budget-gib: expected a positive finite number"),
        (["--ratio", "3-1"], "--ratio: expected KDA:MLA"),
        (["--state-dtype", "int4"], "--state-dtype: expected one of"),
        (["--tp", "3"], "tp: expected a divisor of kda_heads=32"),
        (["--layers", "40"], "--layers 40 changes the preset's 27 layers"),
        (["--ratio", "3:1", "--kda-count", "3"], "give only one of"),
        (["--kda-count", "3"], "give both"),
        (["--plot", "out.pdf"], r"--plot: expected a path ending in \.png or \.svg"),
    ],
)
def test_cli_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        _run(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdakit serve-mem: error:")
    assert re.search(match, lines[0]), lines[0]


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_cli_plot(tmp_path, capsys, suffix, magic):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"serve{suffix}"
    assert _run(["--json", "--plot", str(path), "--budget-gib", "20", "--batch", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(path)
    data = path.read_bytes()
    assert magic in data[:2000]


def test_through_kdakit_cli_main(capsys):
    from kdakit import cli

    try:
        code = cli.main(["serve-mem", "--json", "--context", "2048"])
    except SystemExit as done:
        code = done.code
    assert code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["m_hybrid_bytes"] == 7 * KIMI_KAPPA * 2048 + 20 * KIMI_SIGMA
    with pytest.raises(SystemExit) as info:
        cli.main(["serve-mem", "--preset", "nope"])
    assert info.value.code == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
