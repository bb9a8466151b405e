"""Every bad input of chunk_kda raises ValueError/TypeError naming the argument; nothing is modified."""

import pytest
import torch

from kdakit import chunk_kda
from kdakit.testing import make_kda_inputs


def _base(**kw):
    inp = make_kda_inputs(T=20, H=2, HV=4, K=8, V=8, dtype=torch.bfloat16, gate="softplus", **kw)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    return t, inp["kwargs"]


def _call(t, kw):
    return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"],
                     **{n: t[n] for n in ("A_log", "dt_bias", "initial_state") if n in t}, **kw)


def _expect(exc, pattern, mutate, **base):
    t, kw = _base(**base)
    mutate(t, kw)
    snap = {n: x.clone() for n, x in t.items() if isinstance(x, torch.Tensor) and x.device.type != "meta"}
    with pytest.raises(exc, match=pattern):
        _call(t, kw)
    for n, x in snap.items():
        assert torch.equal(t[n], x), f"{n} was modified by a failing call"


def test_valid_call_runs():
    t, kw = _base(initial_state="kv")
    o, ht = _call(t, kw)
    assert o.shape == (1, 20, 4, 8) and ht.shape == (1, 4, 8, 8)


CASES = {
    "integer q": (TypeError, r"^q must have dtype", lambda t, kw: t.update(q=t["q"].to(torch.int32))),
    "A_log bf16": (TypeError, r"^A_log must have dtype", lambda t, kw: t.update(A_log=t["A_log"].bfloat16())),
    "dt_bias fp16": (TypeError, r"^dt_bias must have dtype", lambda t, kw: t.update(dt_bias=t["dt_bias"].half())),
    "q not a tensor": (TypeError, r"^q must be a torch.Tensor", lambda t, kw: t.update(q=[1.0])),
    "k shape": (ValueError, r"^k must have q's shape", lambda t, kw: t.update(k=t["k"][:, :, :1])),
    "v length": (ValueError, r"^v must be \[B, T, HV, V\]", lambda t, kw: t.update(v=t["v"][:, :10])),
    "HV not multiple": (ValueError, r"HV must be a multiple of .*H=2, got HV=3",
                        lambda t, kw: t.update(v=t["v"][:, :, :3], g=t["g"][:, :, :3], beta=t["beta"][:, :, :3])),
    "g shape": (ValueError, r"^g must have shape \[B, T, HV, K\]", lambda t, kw: t.update(g=t["g"][..., :4])),
    "beta shape": (ValueError, r"^beta must have shape \[B, T, HV\]", lambda t, kw: t.update(beta=t["beta"][:, :, :2])),
    "q 3-D": (ValueError, r"^q must be 4-D", lambda t, kw: t.update(q=t["q"][0])),
    "A_log shape": (ValueError, r"^A_log must have shape \[HV\]", lambda t, kw: t.update(A_log=t["A_log"][:2])),
    "dt_bias shape": (ValueError, r"^dt_bias must have shape \[HV \* K\]", lambda t, kw: t.update(dt_bias=t["dt_bias"][:5])),
    "cu_seqlens 2-D": (ValueError, r"^cu_seqlens must be 1-D",
                       lambda t, kw: kw.update(cu_seqlens=torch.tensor([[0, 20]]))),
    "cu_seqlens float": (TypeError, r"^cu_seqlens must have an integer dtype",
                         lambda t, kw: kw.update(cu_seqlens=torch.tensor([0.0, 20.0]))),
    "cu_seqlens start": (ValueError, r"^cu_seqlens must start at 0, got 2",
                         lambda t, kw: kw.update(cu_seqlens=torch.tensor([2, 20]))),
    "cu_seqlens decreasing": (ValueError, r"^cu_seqlens must be non-decreasing",
                              lambda t, kw: kw.update(cu_seqlens=torch.tensor([0, 12, 8, 20]))),
    "cu_seqlens end": (ValueError, r"^cu_seqlens must end at T=20.*got 18",
                       lambda t, kw: kw.update(cu_seqlens=torch.tensor([0, 18]))),
    "gate without A_log or lower_bound": (ValueError, r"use_gate_in_kernel=True needs A_log",
                                          lambda t, kw: t.pop("A_log")),
    "safe_gate lower_bound -6": (ValueError, r"^lower_bound must be in the safe range \[-5, 0\).*got -6",
                                 lambda t, kw: kw.update(safe_gate=True, lower_bound=-6.0)),
    "safe_gate lower_bound 0": (ValueError, r"^lower_bound must be in the safe range \[-5, 0\).*got 0",
                                lambda t, kw: kw.update(safe_gate=True, lower_bound=0.0)),
    "safe_gate without lower_bound": (ValueError, r"safe_gate=True .* needs lower_bound",
                                      lambda t, kw: kw.update(safe_gate=True)),
    "neg eigval without sigmoid": (ValueError, r"^allow_neg_eigval=True requires use_beta_sigmoid_in_kernel",
                                   lambda t, kw: kw.update(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False)),
    "different devices": (ValueError, r"^k must be on q's device cpu, got meta",
                          lambda t, kw: t.update(k=torch.empty(t["k"].shape, dtype=t["k"].dtype, device="meta"))),
    "fla-only option": (ValueError, r"^disable_recompute is an FLA option", lambda t, kw: kw.update(disable_recompute=True)),
    "bad chunk size": (ValueError, r"^chunk_size must be 16, 32 or 64, got 48", lambda t, kw: kw.update(chunk_size=48)),
    "bad checkpoint cadence": (ValueError, r"^checkpoint_every_n_tokens must be a positive multiple of 16",
                               lambda t, kw: kw.update(checkpoint_every_n_tokens=0)),
    "initial_state dtype": (TypeError, r"^initial_state must have dtype",
                            lambda t, kw: t.update(initial_state=torch.zeros(1, 4, 8, 8, dtype=torch.float16) + 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case):
    exc, pattern, mutate = CASES[case]
    _expect(exc, pattern, mutate)


def test_batch_must_be_one_with_cu_seqlens():
    inp = make_kda_inputs(B=2, T=10, H=1, K=4, V=4, gate="none")
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    with pytest.raises(ValueError, match=r"^the batch size B must be 1 with cu_seqlens.*got B=2"):
        _call(t, dict(inp["kwargs"], cu_seqlens=torch.tensor([0, 4, 10])))


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_initial_state_shape_for_layout(layout):
    t, kw = _base(initial_state=layout)
    wrong = t["initial_state"].transpose(-1, -2)[..., :4, :].contiguous()  # neither layout fits
    t["initial_state"] = wrong
    with pytest.raises(ValueError, match=r"^initial_state must have shape"):
        _call(t, kw)


def test_initial_state_sequence_count_with_cu_seqlens():
    inp = make_kda_inputs(T=20, H=1, K=4, V=4, gate="none", seqlens=[5, 15], initial_state="kv")
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    t["initial_state"] = t["initial_state"][:1]
    with pytest.raises(ValueError, match=r"^initial_state must have shape .* for 2 sequence\(s\)"):
        _call(t, inp["kwargs"])


def test_state_indices_errors():
    t, kw = _base(initial_state="vk")
    pool = torch.randn(3, 4, 8, 8)
    t["initial_state"] = pool
    with pytest.raises(TypeError, match=r"^state_indices must be an int32 tensor"):
        _call(t, dict(kw, state_indices=torch.tensor([0.0])))
    with pytest.raises(ValueError, match=r"^state_indices must lie in \[-1, 2\]"):
        _call(t, dict(kw, state_indices=torch.tensor([5], dtype=torch.int32)))


def test_backend_env_is_checked(monkeypatch):
    t, kw = _base()
    monkeypatch.setenv("KDAKIT_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match=r"^KDAKIT_BACKEND must be one of"):
        _call(t, kw)


def test_validation_reads_the_sequence_lengths_once_for_the_plan():
    """KDAShape.seqlens carries cu_seqlens's lengths (one host read); the plan made from them is the
    plan made from cu_seqlens itself."""
    from kdakit.ops.kda.plan import plan_kda
    from kdakit.ops.kda.validate import validate_kda_inputs

    inp = make_kda_inputs(T=70, H=1, HV=2, K=16, V=16, dtype=torch.float32, gate="safe", seqlens=[37, 0, 33])
    t, kw = inp["tensors"], inp["kwargs"]
    opts = dict(scale=None, initial_state=None, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=False, safe_gate=True, lower_bound=kw["lower_bound"], A_log=t["A_log"],
                dt_bias=t["dt_bias"], state_v_first=False)
    shape = validate_kda_inputs(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=kw["cu_seqlens"], **opts)
    assert shape.seqlens == (37, 0, 33) and shape.N == 3
    assert plan_kda(t["q"], t["v"], seqlens=shape.seqlens) == plan_kda(t["q"], t["v"], cu_seqlens=kw["cu_seqlens"])
    fixed = validate_kda_inputs(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=None, **opts)
    assert fixed.seqlens is None


# cu_seqlens_cpu (FLA 0.6.0's host copy of cu_seqlens): its values are checked in place of
# cu_seqlens's (which are then not read). Validation runs before the backend is chosen, so both
# backends give the same error.
_CU = [0, 8, 20]
CPU_OFFSET_CASES = {
    "not a tensor": (TypeError, r"^cu_seqlens_cpu must be a torch.Tensor, got list", dict(cu_seqlens_cpu=list(_CU))),
    "float": (TypeError, r"^cu_seqlens_cpu must have an integer dtype \(int32 or int64\), got float32",
              dict(cu_seqlens_cpu=torch.tensor(_CU, dtype=torch.float32))),
    "2-D": (ValueError, r"^cu_seqlens_cpu must be 1-D with at least 2 entries, got shape \[1, 3\]",
            dict(cu_seqlens_cpu=torch.tensor([_CU]))),
    "one entry": (ValueError, r"^cu_seqlens_cpu must be 1-D with at least 2 entries, got shape \[1\]",
                  dict(cu_seqlens_cpu=torch.tensor([0]))),
    "length": (ValueError, r"^cu_seqlens_cpu must have cu_seqlens's length 3, got 4",
               dict(cu_seqlens_cpu=torch.tensor([0, 8, 8, 20]))),
    "not on the host": (ValueError, r"^cu_seqlens_cpu must be a CPU tensor .*got device meta",
                        dict(cu_seqlens_cpu=torch.empty(3, dtype=torch.int64, device="meta"))),
    "start": (ValueError, r"^cu_seqlens_cpu must start at 0, got 1", dict(cu_seqlens_cpu=torch.tensor([1, 8, 20]))),
    "decreasing": (ValueError, r"^cu_seqlens_cpu must be non-decreasing, got \[0, 21, 20\]",
                   dict(cu_seqlens_cpu=torch.tensor([0, 21, 20]))),
    "end": (ValueError, r"^cu_seqlens_cpu must end at T=20 \(q.shape\[1\]\), got 18",
            dict(cu_seqlens_cpu=torch.tensor([0, 8, 18]))),
    "without cu_seqlens": (ValueError, r"^cu_seqlens_cpu is the host copy of cu_seqlens and needs cu_seqlens, got cu_seqlens=None",
                           dict(cu_seqlens=None, cu_seqlens_cpu=torch.tensor(_CU))),
    # cu_seqlens's own metadata is still checked next to a good host copy.
    "cu_seqlens float": (TypeError, r"^cu_seqlens must have an integer dtype",
                         dict(cu_seqlens=torch.tensor(_CU, dtype=torch.float32), cu_seqlens_cpu=torch.tensor(_CU))),
    "cu_seqlens 2-D": (ValueError, r"^cu_seqlens must be 1-D", dict(cu_seqlens=torch.tensor([_CU]), cu_seqlens_cpu=torch.tensor(_CU))),
    "cu_seqlens device": (ValueError, r"^cu_seqlens must be on q's device cpu, got meta",
                          dict(cu_seqlens=torch.empty(3, dtype=torch.int64, device="meta"), cu_seqlens_cpu=torch.tensor(_CU))),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CPU_OFFSET_CASES))
def test_bad_cu_seqlens_cpu(case, backend, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    exc, pattern, update = CPU_OFFSET_CASES[case]
    _expect(exc, pattern, lambda t, kw: kw.update(dict(cu_seqlens=torch.tensor(_CU)), **update))


def test_batch_must_be_one_with_cu_seqlens_cpu():
    inp = make_kda_inputs(B=2, T=10, H=1, K=4, V=4, gate="none")
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    with pytest.raises(ValueError, match=r"^the batch size B must be 1 with cu_seqlens.*got B=2"):
        _call(t, dict(inp["kwargs"], cu_seqlens=torch.tensor([0, 4, 10]), cu_seqlens_cpu=torch.tensor([0, 4, 10])))


def test_cu_seqlens_cpu_gives_the_lengths_and_the_plan():
    """The lengths (and so the plan) come from the host copy, int32 or int64, exactly as from cu_seqlens."""
    from kdakit.ops.kda.plan import plan_kda
    from kdakit.ops.kda.validate import validate_kda_inputs

    inp = make_kda_inputs(T=70, H=1, HV=2, K=16, V=16, dtype=torch.float32, gate="safe", seqlens=[37, 0, 33],
                          initial_state="kv")
    t, kw = inp["tensors"], inp["kwargs"]
    opts = dict(scale=None, initial_state=t["initial_state"], use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=False, safe_gate=True, lower_bound=kw["lower_bound"], A_log=t["A_log"],
                dt_bias=t["dt_bias"], state_v_first=False)
    want = validate_kda_inputs(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=kw["cu_seqlens"], **opts)
    for dt in (torch.int64, torch.int32):
        got = validate_kda_inputs(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=kw["cu_seqlens"],
                                  cu_seqlens_cpu=kw["cu_seqlens"].to(dt), **opts)
        assert got == want and got.seqlens == (37, 0, 33)
    assert plan_kda(t["q"], t["v"], seqlens=want.seqlens) == plan_kda(t["q"], t["v"], cu_seqlens=kw["cu_seqlens"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_strided_gate_parameter_is_refused(monkeypatch, backend, name):
    # a view with element stride 2 was read as if dense by the kernels (silently wrong on the H200)
    from kdakit import chunk_kda
    from kdakit.testing import make_kda_inputs

    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    inp = make_kda_inputs(T=20, H=2, K=16, V=16, dtype=torch.float32, gate="safe")
    t = dict(inp["tensors"])
    dense = t[name].detach()
    t[name] = torch.stack([dense, torch.full_like(dense, 7.0)], 1).reshape(-1)[::2]
    assert torch.equal(t[name], dense) and t[name].stride(0) == 2
    with pytest.raises(ValueError, match=f"{name} must be a dense vector"):
        chunk_kda(**t, **inp["kwargs"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_checkpoint_cadence_and_chunk_size_rules_are_the_same_on_both_backends(monkeypatch, backend):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    inp = make_kda_inputs(T=40, H=1, K=16, V=16, dtype=torch.float32, gate="safe")
    with pytest.raises(ValueError, match="checkpoint_every_n_tokens must be a positive multiple of 16"):
        chunk_kda(**inp["tensors"], **inp["kwargs"], checkpoint_every_n_tokens=20)
    with pytest.raises(ValueError, match="multiple of 32"):
        chunk_kda(**inp["tensors"], **inp["kwargs"], chunk_size=32, checkpoint_every_n_tokens=48)


def test_chunk_size_is_refused_on_the_triton_path(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    inp = make_kda_inputs(T=40, H=1, K=16, V=16, dtype=torch.float32, gate="safe")
    with pytest.raises(ValueError, match="pipeline='windowed16' uses 16-token chunks"):
        chunk_kda(**inp["tensors"], **inp["kwargs"], chunk_size=32)


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_transpose_state_layout_is_the_deprecated_state_v_first(op):
    from kdakit import fused_recurrent_kda

    fn = chunk_kda if op == "chunk" else fused_recurrent_kda
    inp = make_kda_inputs(T=20, H=1, K=16, V=16, dtype=torch.float64, gate="safe", initial_state="vk")
    kw = dict(inp["kwargs"])
    kw.pop("state_v_first")
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    ref_o, ref_s = fn(**t, **kw, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o, s = fn(**t, **kw, transpose_state_layout=True)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)


def test_plan_refuses_shapes_the_kernels_reject():
    from kdakit import plan_kda

    with pytest.raises(ValueError, match="B and T must be >= 0"):
        plan_kda(B=1, T=-5, H=1, K=16)
    with pytest.raises(ValueError, match="K, V <= 128"):
        plan_kda(B=1, T=10, H=1, K=256)
    assert plan_kda(B=1, T=10, H=1, K=256, backend="torch").K == 256


# scale and lower_bound out of their ranges: without the check both backends returned NaN (scale inf /
# nan) or outputs 54 apart (lower_bound = 1 without safe_gate); validation runs before the backend is
# chosen, so both give the same error.
RANGE_CASES = {
    "scale 0": (ValueError, r"^scale must be a positive finite float or None .*got 0", dict(scale=0.0)),
    "scale negative": (ValueError, r"^scale must be a positive finite float or None .*got -1", dict(scale=-1.0)),
    "scale inf": (ValueError, r"^scale must be a positive finite float or None .*got inf", dict(scale=float("inf"))),
    "scale nan": (ValueError, r"^scale must be a positive finite float or None .*got nan", dict(scale=float("nan"))),
    "scale bool": (TypeError, r"^scale must be a float or None, got bool", dict(scale=True)),
    "lower_bound positive": (ValueError, r"^lower_bound must be a negative finite float or None, got 1",
                             dict(lower_bound=1.0)),
    "lower_bound zero": (ValueError, r"^lower_bound must be a negative finite float or None, got 0",
                         dict(lower_bound=0.0)),
    "lower_bound -inf": (ValueError, r"^lower_bound must be a negative finite float or None, got -inf",
                         dict(lower_bound=float("-inf"))),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_scale_and_lower_bound_ranges(case, backend, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    exc, pattern, update = RANGE_CASES[case]
    _expect(exc, pattern, lambda t, kw: kw.update(**update))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scale_and_lower_bound_in_range_run(backend, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    t, kw = _base()
    kw.update(scale=0.3, lower_bound=-3.0)
    o, _ = _call(t, kw)
    assert torch.isfinite(o).all()
