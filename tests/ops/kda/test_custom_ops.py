"""The registered ops torch.ops.kdakit.* (issue #13 item 7), CPU tier, PyTorch path.

- ``torch.library.opcheck`` on every forward op (schema and declared mutations, autograd
  registration, fake implementation against the real one, AOT dispatch with dynamic shapes and,
  for the differentiable ops, their backward ops through the registered formula).
- ``torch.compile(fullgraph=True)`` of the public functions: no graph break (fullgraph raises on
  one), the op is in the traced graph, and outputs, gradients and pool updates equal the eager
  call bitwise; once through inductor (C++ codegen on this machine).
- Under compile: eager validation errors come back unchanged, and arguments an op cannot carry
  are refused naming them.
"""

import pytest
import torch

import kdakit
from kdakit import chunk_kda, fused_recurrent_kda, kda_decode
from kdakit.testing import make_kda_inputs

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    torch._dynamo.reset()


def _case(dtype=torch.float64, seqlens=(2, 0, 4), state="kv", seed=1):
    inp = make_kda_inputs(T=sum(seqlens), H=1, HV=2, K=8, V=8, dtype=dtype, gate="safe", seqlens=list(seqlens),
                          initial_state=state, generator=torch.Generator().manual_seed(seed))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw["cu_seqlens_cpu"] = kw["cu_seqlens"].clone()
    return t, kw


def _flags(kw):
    return (kw["use_qk_l2norm_in_kernel"], kw["use_gate_in_kernel"], kw["use_beta_sigmoid_in_kernel"], False)


def _grad_leaves(args):
    return [x.clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in args]


def _all_success(res):
    assert res and all(v == "SUCCESS" for v in res.values()), res


# --- opcheck ------------------------------------------------------------------------------------

@pytest.mark.parametrize("varlen", [True, False])
def test_opcheck_chunk_kda(varlen):
    if varlen:
        t, kw = _case()
        cu, cu_cpu = kw["cu_seqlens"], kw["cu_seqlens_cpu"]
    else:
        inp = make_kda_inputs(B=2, T=5, H=1, HV=2, K=8, V=8, dtype=torch.float64, gate="safe", initial_state="vk",
                              generator=torch.Generator().manual_seed(2))
        t, kw = {n: x.detach() for n, x in inp["tensors"].items()}, dict(inp["kwargs"])
        cu = cu_cpu = None
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], t["initial_state"], cu, cu_cpu,
            None, True, *_flags(kw), True, kw["lower_bound"], not varlen, 16, 16)
    _all_success(torch.library.opcheck(torch.ops.kdakit.chunk_kda.default, _grad_leaves(args)))


def test_opcheck_fused_recurrent_kda():
    t, kw = _case(state="vk")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], t["initial_state"], kw["cu_seqlens"],
            kw["cu_seqlens_cpu"], 0.5, True, *_flags(kw), kw["lower_bound"], True, True, 64)
    _all_success(torch.library.opcheck(torch.ops.kdakit.fused_recurrent_kda.default, _grad_leaves(args)))


def _pool_case():
    t, kw = _case(dtype=torch.float32, state=None)
    pool = torch.randn(7, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    return t, kw, pool


def test_opcheck_chunk_kda_pool():
    t, kw, pool = _pool_case()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, idx, kw["cu_seqlens"],
            kw["cu_seqlens_cpu"], None, True, *_flags(kw), True, kw["lower_bound"], True, None, None, True)
    _all_success(torch.library.opcheck(torch.ops.kdakit.chunk_kda_pool.default, args))


def test_opcheck_kda_decode():
    t, kw, pool = _pool_case()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, t["A_log"], t["dt_bias"], kw["cu_seqlens"],
            kw["cu_seqlens_cpu"], None, None, *_flags(kw), kw["lower_bound"], True, True)
    _all_success(torch.library.opcheck(torch.ops.kdakit.kda_decode.default, args))


def test_opcheck_fused_recurrent_kda_serving():
    t, kw, pool = _pool_case()
    rows = torch.tensor([[0, 1, -1, -1], [2, -1, -1, -1], [3, 4, 5, 6]], dtype=torch.int32)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["A_log"], t["dt_bias"], pool, kw["cu_seqlens"],
            kw["cu_seqlens_cpu"], rows, None, None, False, *_flags(kw), kw["lower_bound"], True, True, True, True)
    _all_success(torch.library.opcheck(torch.ops.kdakit.fused_recurrent_kda_serving.default, args))


# --- torch.compile(fullgraph=True) of the public functions ---------------------------------------

class GraphRecorder:
    """An aot_eager-like backend that keeps the Dynamo graphs' op targets (to show what was traced)."""

    def __init__(self):
        self.targets = set()

    def __call__(self, gm, example_inputs):
        # Dynamo records an op as its packet (``kdakit.chunk_kda``); keep the names
        self.targets |= {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        return gm.forward


def _run(fn, t, names=NAMES):
    leaves = {n: t[n].clone().requires_grad_() for n in names if t.get(n) is not None}
    loss = fn(**leaves)
    loss.backward()
    return loss.detach(), {n: x.grad for n, x in leaves.items()}


def _assert_bitwise(ref, got):
    assert torch.equal(ref[0], got[0])
    assert set(ref[1]) == set(got[1])
    for n in ref[1]:
        assert ref[1][n] is not None and torch.equal(ref[1][n], got[1][n]), n


def test_compile_chunk_kda_fullgraph_matches_eager_bitwise():
    t, kw = _case(dtype=torch.float32, seqlens=(7, 0, 13))

    def f(q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, ht = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, **kw)
        return (o * o).sum() + (ht * ht.flip(-1)).sum()

    ref = _run(f, t)
    rec = GraphRecorder()
    got = _run(torch.compile(f, fullgraph=True, backend=rec), t)
    assert "kdakit.chunk_kda" in rec.targets
    _assert_bitwise(ref, got)
    assert got[1]["A_log"].abs().sum() > 0 and got[1]["initial_state"].abs().sum() > 0
    got_aot = _run(torch.compile(f, fullgraph=True, backend="aot_eager"), t)
    _assert_bitwise(ref, got_aot)


@pytest.mark.slow
def test_compile_chunk_kda_carries_the_pipeline(monkeypatch):
    """``pipeline`` travels through the op's schema: the compiled call runs the same 64-token pipeline as eager
    (Triton kernels under the interpreter), bit for bit."""
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    t, kw = _case(dtype=torch.float32, seqlens=(70, 0, 13))

    def f(q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, ht = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                          pipeline="chunk64_fast", checkpoint_every_n_tokens=64, **kw)
        return (o * o).sum() + (ht * ht.flip(-1)).sum()

    ref = _run(f, t)
    rec = GraphRecorder()
    got = _run(torch.compile(f, fullgraph=True, backend=rec), t)
    assert "kdakit.chunk_kda" in rec.targets
    _assert_bitwise(ref, got)


def test_compile_fused_recurrent_kda_fullgraph_matches_eager_bitwise():
    t, kw = _case(dtype=torch.float32, seqlens=(3, 0, 5), state="vk")
    kw["state_v_first"] = True

    def f(q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, ht = fused_recurrent_kda(q, k, v, g, beta, A_log=A_log.view(-1, 1), dt_bias=dt_bias.view(2, 8),
                                    initial_state=initial_state, **kw)
        return (o * o).sum() + ht.sum()

    ref = _run(f, t)
    got = _run(torch.compile(f, fullgraph=True, backend="aot_eager"), t)
    _assert_bitwise(ref, got)
    assert got[1]["dt_bias"].shape == t["dt_bias"].shape and got[1]["dt_bias"].abs().sum() > 0


def test_compile_serving_step_fullgraph_matches_eager_bitwise():
    """A prefill into pool rows (chunk_kda with state_indices) then a decode step (kda_decode) and a
    speculative step (fused_recurrent_kda with FLA's serving arguments), in one compiled function:
    outputs and the whole pool equal the eager run's bits."""
    t, kw, pool0 = _pool_case()
    kw = {n: x for n, x in kw.items() if n != "output_final_state"}
    kw["state_v_first"] = True
    pool0 = pool0.transpose(-1, -2).contiguous()  # [P, HV, V, K]: decode's layout
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    dec = make_kda_inputs(B=3, T=1, H=1, HV=2, K=8, V=8, gate="safe", generator=torch.Generator().manual_seed(9))
    d = {n: x.detach() for n, x in dec["tensors"].items()}
    rows = torch.tensor([[5, 6], [1, 2], [3, 4]], dtype=torch.int32)
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=kw["lower_bound"], safe_gate=True)

    def step(pool):
        o1, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                          initial_state=pool, state_indices=idx, check_indices=False, **kw)
        o2 = kda_decode(d["q"], d["k"], d["v"], d["g"], d["beta"], pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
                        check_indices=False, **gate)
        o3, same = fused_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=t["A_log"],
                                       dt_bias=t["dt_bias"], initial_state=pool, ssm_state_indices=rows,
                                       inplace_final_state=True, state_v_first=True, check_indices=False, **gate)
        return o1, o2, o3, same is pool

    p_ref, p_got = pool0.clone(), pool0.clone()
    ref = step(p_ref)
    rec = GraphRecorder()
    got = torch.compile(step, fullgraph=True, backend=rec)(p_got)
    assert {"kdakit.chunk_kda_pool", "kdakit.kda_decode", "kdakit.fused_recurrent_kda_serving"} <= rec.targets
    for a, b in zip(ref[:3], got[:3]):
        assert torch.equal(a, b)
    assert ref[3] and got[3]
    assert torch.equal(p_ref, p_got)
    # written: rows 3 and 0 (prefill, decode; sequence 1 padded), 5, 1, 3 (the state after each
    # sequence's one speculative token); rows 2, 4 and 6 are nobody's
    for r in (0, 1, 3, 5):
        assert not torch.equal(p_ref[r], pool0[r]), r
    assert torch.equal(p_ref[[2, 4, 6]], pool0[[2, 4, 6]])


def test_compile_with_inductor():
    """The C++ inductor backend compiles around the opaque op (decode step plus surrounding math)."""
    t, kw, pool0 = _pool_case()
    dec = make_kda_inputs(B=3, T=1, H=1, HV=2, K=8, V=8, gate="safe", generator=torch.Generator().manual_seed(4))
    d = {n: x.detach() for n, x in dec["tensors"].items()}
    pool0 = pool0.transpose(-1, -2).contiguous()
    idx = torch.tensor([6, 2, 0], dtype=torch.int32)

    def f(pool, scale_q):
        o = kda_decode(d["q"] * scale_q, d["k"], d["v"], d["g"], d["beta"], pool, idx, A_log=t["A_log"],
                       dt_bias=t["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                       lower_bound=kw["lower_bound"], safe_gate=True, use_beta_sigmoid_in_kernel=True)
        return o * 2.0

    p_ref, p_got = pool0.clone(), pool0.clone()
    ref = f(p_ref, 0.5)
    got = torch.compile(f, fullgraph=True, backend="inductor")(p_got, 0.5)
    assert torch.equal(ref, got) and torch.equal(p_ref, p_got) and not torch.equal(p_ref, pool0)


# --- errors under compile -------------------------------------------------------------------------

def test_compiled_call_raises_the_eager_validation_error():
    t, kw = _case(dtype=torch.float32)
    bad = t["beta"][..., :1].contiguous()  # [B, T, 1] for HV = 2
    with pytest.raises(ValueError) as eager:
        chunk_kda(t["q"], t["k"], t["v"], t["g"], bad, A_log=t["A_log"], dt_bias=t["dt_bias"],
                  initial_state=t["initial_state"], **kw)

    def f(beta):
        return chunk_kda(t["q"], t["k"], t["v"], t["g"], beta, A_log=t["A_log"], dt_bias=t["dt_bias"],
                         initial_state=t["initial_state"], **kw)[0]

    with pytest.raises(ValueError) as compiled:
        torch.compile(f, fullgraph=True, backend="aot_eager")(bad)
    assert str(eager.value) == str(compiled.value)
    assert str(eager.value).startswith("beta must have shape")


def test_compiled_call_refuses_what_an_op_cannot_carry():
    t, kw, pool = _pool_case()
    dec = make_kda_inputs(B=3, T=1, H=1, HV=2, K=8, V=8, gate="safe", generator=torch.Generator().manual_seed(4))
    d = {n: x.detach() for n, x in dec["tensors"].items()}
    pool = pool.transpose(-1, -2).contiguous()

    def f(pool):
        return kda_decode(d["q"], d["k"], d["v"], d["g"], d["beta"], pool, torch.tensor([0, 1, 2], dtype=torch.int32),
                          workspace=kdakit.Workspace("cpu"))

    # fullgraph: Dynamo reports the ValueError it traced as the reason it cannot compile the call
    with pytest.raises(torch._dynamo.exc.Unsupported, match="kda_decode under torch.compile does not take workspace"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(pool)
