"""The chunked PyTorch path against the naive definition (float64), bf16 accuracy, gradcheck, memory."""

import random

import pytest
import torch

from kdakit import chunk_kda, naive_recurrent_kda
from kdakit.ops.kda.reference.chunk import chunked_kda_reference
from kdakit.testing import SPEC_RMS_LIMITS, assert_close, compare_with_naive, make_kda_inputs, set_token_options

EXACT = 1e-10  # relative RMS in float64 (issue 2: all gradients to <= 1e-10)


def _compare(inputs, ratio=EXACT, **extra):
    return compare_with_naive(chunk_kda, inputs, ratio, **extra)


# Every gate x l2norm x beta transform, with GVA, initial/final state and uneven varlen.
@pytest.mark.parametrize("gate", ["none", "softplus", "safe", "safe_no_alog"])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("beta_mode", ["raw", "sigmoid", "neg_eigval"])
def test_options_match_naive(gate, l2norm, beta_mode):
    inp = make_kda_inputs(T=41, H=1, HV=2, K=8, V=6, gate=gate, seqlens=[17, 0, 1, 23], B=1, initial_state="kv")
    set_token_options(inp, l2norm=l2norm, beta_mode=beta_mode)
    _compare(inp)


@pytest.mark.parametrize("layout", ["kv", "vk", "kv_bf16", None])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_states_layouts_and_chunk_sizes(layout, chunk_size):
    inp = make_kda_inputs(B=2, T=37, H=2, HV=2, K=8, V=8, gate="softplus", initial_state=layout)
    if layout is None:
        inp["kwargs"]["output_final_state"] = True
    _compare(inp, chunk_size=chunk_size)


@pytest.mark.parametrize("checkpoint", [16, 48, 1024])
def test_checkpoint_cadence_does_not_change_results(checkpoint):
    inp = make_kda_inputs(T=70, H=1, HV=1, K=8, V=8, gate="safe", initial_state="vk")
    _compare(inp, checkpoint_every_n_tokens=checkpoint)


@pytest.mark.parametrize("reset", [0.1, 0.5])
def test_reset_level_decays_stay_exact(reset):
    inp = make_kda_inputs(T=64, H=1, HV=2, K=8, V=8, gate="none", reset_tokens=reset, initial_state="kv")
    got = _compare(inp)
    assert all(torch.isfinite(x).all() for x in got.values() if x is not None)


def test_strong_softplus_gate_stays_exact():
    # No initial state: its gradient underflows to exactly zero whenever every first-token decay does.
    inp = make_kda_inputs(T=48, H=1, HV=1, K=8, V=8, gate="softplus")
    with torch.no_grad():
        inp["tensors"]["A_log"].fill_(6.0)  # exp(6) * softplus(x): log-decays in the hundreds
        inp["tensors"]["g"].mul_(10.0)
    # dA_log is one cancelling sum for the single head: one run in six measured 1.08e-10.
    limits = {name: EXACT for name in ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "ddt_bias")}
    got = _compare(inp, ratio=dict(limits, dA_log=1e-9))
    assert all(torch.isfinite(x).all() for x in got.values() if x is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_meet_spec_accuracy(dtype):
    inp = make_kda_inputs(T=96, H=2, HV=4, K=32, V=32, gate="safe", dtype=dtype, initial_state="kv")
    got = compare_with_naive(chunk_kda, inp, SPEC_RMS_LIMITS)
    assert got["o"].dtype == dtype and got["final_state"].dtype == torch.float32


def test_gradcheck_tiny():
    inp = make_kda_inputs(T=19, H=1, HV=2, K=3, V=2, gate="softplus", seqlens=[3, 16], initial_state="vk")
    t = inp["tensors"]
    names = list(t)
    kw = dict(inp["kwargs"], scale=0.7)

    def f(*xs):
        d = dict(zip(names, xs))
        pos = [d.pop(n) for n in ("q", "k", "v", "g", "beta")]
        return chunked_kda_reference(*pos, chunk_size=16, checkpoint_every_n_tokens=16, **d, **kw)

    # fast_mode: the Jacobian against random projections on both sides (one numerical directional derivative
    # per input instead of one per element), which any wrong gradient entry fails
    assert torch.autograd.gradcheck(f, tuple(t[n] for n in names), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True)


def test_saved_for_backward_is_inputs_plus_sparse_checkpoints():
    inp = make_kda_inputs(T=256, H=2, HV=2, K=16, V=16, gate="safe", dtype=torch.float32)
    t = {n: x.detach().requires_grad_() for n, x in inp["tensors"].items()}
    input_ptrs = {x.data_ptr() for x in t.values()}
    extra = []

    def pack(x):
        if x.data_ptr() not in input_ptrs:
            extra.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                  checkpoint_every_n_tokens=64, **inp["kwargs"])
    # 256 tokens / 64 = 4 segment-start states of [N=1, HV=2, K=16, V=16] fp32, nothing else.
    assert len(extra) == 1
    assert extra[0].shape == (4, 1, 2, 16, 16) and extra[0].dtype == torch.float32


def test_randomized_sweep():
    rng = random.Random(20261129)
    for case in range(10):
        H = rng.choice([1, 2])
        HV = H * rng.choice([1, 2])
        K, V = rng.choice([4, 8, 12]), rng.choice([4, 8, 10])
        gate = rng.choice(["none", "softplus", "safe", "safe_no_alog"])
        layout = rng.choice([None, "kv", "vk"])
        if rng.random() < 0.5:
            lens = [rng.choice([0, 1, 5, 16, 17, 33]) for _ in range(rng.randint(1, 4))]
            T, B, seqlens = sum(lens), 1, lens
        else:
            B, T, seqlens = rng.randint(1, 2), rng.randint(1, 50), None
        inp = make_kda_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, gate=gate, seqlens=seqlens, initial_state=layout,
                              generator=torch.Generator().manual_seed(case))
        cs = rng.choice([16, 32])
        _compare(inp, chunk_size=cs, checkpoint_every_n_tokens=cs * rng.choice([1, 2, 8]))


def test_state_pool_prefill_updates_rows_in_place():
    gen = torch.Generator().manual_seed(21)
    inp = make_kda_inputs(T=30, H=1, HV=2, K=8, V=8, gate="safe", seqlens=[10, 20], generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    pool = torch.randn(5, 2, 8, 8, dtype=torch.float64, generator=gen)  # value-first rows [HV, V, K]
    before = pool.clone()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    kw = dict(inp["kwargs"], state_v_first=True)
    o, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                     initial_state=pool, state_indices=idx, **kw)
    o_ref, ht_ref = naive_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                                        dt_bias=t["dt_bias"], initial_state=before[[3, 1]],
                                        output_final_state=True, **kw)
    assert_close("o", o_ref, o, EXACT)
    assert_close("pool[3]", ht_ref[0], pool[3], EXACT)
    assert_close("pool[1]", ht_ref[1], pool[1], EXACT)
    for r in (0, 2, 4):
        assert torch.equal(pool[r], before[r])


def test_state_pool_prefill_then_decode_share_one_cache():
    from kdakit import kda_decode

    gen = torch.Generator().manual_seed(22)
    inp = make_kda_inputs(T=24, H=1, HV=2, K=8, V=8, gate="safe", seqlens=[10, 14], dtype=torch.float32,
                          generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"], state_v_first=True)
    kw.pop("output_final_state", None)
    pool = torch.randn(4, 2, 8, 8, generator=gen)  # decode pools are fp32 or bf16
    idx = torch.tensor([2, -1], dtype=torch.int32)
    before = pool.clone()
    o, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                     initial_state=pool, state_indices=idx, **kw)
    assert torch.equal(o[0, 10:], torch.zeros_like(o[0, 10:]))  # padded sequence: zero output
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])        # and its rows untouched
    # One decode token continues sequence 0 from the pool row prefill wrote.
    step = make_kda_inputs(B=1, T=1, H=1, HV=2, K=8, V=8, gate="safe", dtype=torch.float32, generator=gen)
    s = {n: x.detach() for n, x in step["tensors"].items()}
    s["A_log"], s["dt_bias"] = t["A_log"], t["dt_bias"]
    o_dec = kda_decode(s["q"], s["k"], s["v"], s["g"], s["beta"], pool, idx[:1], A_log=s["A_log"],
                       dt_bias=s["dt_bias"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    cat = {n: torch.cat([t[n][:, :10], s[n]], dim=1).double() for n in ("q", "k", "v", "g", "beta")}
    kw.pop("cu_seqlens")
    o_ref, _ = naive_recurrent_kda(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], A_log=t["A_log"].double(),
                                   dt_bias=t["dt_bias"].double(), initial_state=before[[2]].double(), **kw)
    assert_close("decode after prefill", o_ref[:, 10:], o_dec, 1e-5)


@pytest.mark.parametrize("gate,value", [("none", float("-inf")), ("softplus", float("inf"))])
def test_infinite_decay_is_finite_like_the_recurrent_path(gate, value):
    # -inf log-decay (or +inf raw softplus gate) forgets everything at once; it gave NaN here and finite
    # results on the recurrent path
    from kdakit import chunk_kda, fused_recurrent_kda

    inp = make_kda_inputs(T=20, H=1, K=16, V=16, dtype=torch.float64, gate=gate, initial_state="kv",
                          generator=torch.Generator().manual_seed(23))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    t["g"] = t["g"].clone()
    t["g"][0, 5] = value
    o, ht = chunk_kda(**t, **inp["kwargs"])
    ro, rht = fused_recurrent_kda(**t, **inp["kwargs"])
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_close("o", ro, o, 1e-10)
    assert_close("final_state", rht, ht, 1e-10)


def test_resets_in_float32_keep_float32_accuracy(monkeypatch):
    # -inf log-decays (resets) at a few positions in fp32: the final state and every gradient within the fp32
    # tolerance of the float64 definition. Flooring -inf at -1e4 and differencing the chunk cumsum in float32
    # there (a rounding step of ~1e-3) put them 2e-4..5e-4 off; the same entries at -30 were ~1e-6.
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    inp = make_kda_inputs(T=64, H=1, HV=2, K=16, V=16, dtype=torch.float32, gate="none", initial_state="kv",
                          generator=torch.Generator().manual_seed(0))
    g = inp["tensors"]["g"].detach().clone()
    g[:, [9, 23, 40, 57]] = float("-inf")  # all channels of both value heads: each chunk of 16 holds one
    inp["tensors"]["g"] = g.requires_grad_()
    got = compare_with_naive(chunk_kda, inp, 1e-5)
    assert torch.equal(got["dg"][:, [9, 23, 40, 57]], torch.zeros_like(got["dg"][:, [9, 23, 40, 57]]))


def test_log_decay_floor_is_the_triton_kernels_rule():
    from kdakit.ops.kda import chunk_common
    from kdakit.ops.kda.constants import LOG_DECAY_FLOOR
    from kdakit.ops.kda.reference.preprocess import floor_log_decay

    assert chunk_common.LOG_DECAY_FLOOR is LOG_DECAY_FLOOR == -110.0  # one constant for both backends
    a = torch.tensor([float("-inf"), -1000.0, -110.0, -109.5, float("nan"), -0.5], requires_grad=True)
    out = floor_log_decay(a)
    want = torch.tensor([-110.0, -110.0, -110.0, -109.5, float("nan"), -0.5])
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~want.isnan()], want[~want.isnan()])
    out.backward(torch.ones_like(out))
    # 0 where the floor holds (a <= floor, as the kernels' gate_log_decay_bwd_floored), 1 elsewhere, NaN included
    assert torch.equal(a.grad, torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]))
