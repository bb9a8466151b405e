"""Engine-shaped gate parameters (issue #13 item 3) and chunk_kda's state-pool index checks (item 8).

Engines keep ``A_log`` as ``[HV, 1]`` or ``[1, 1, HV, 1]`` and ``dt_bias`` as ``[HV, K]``. The
recurrent ops (fused_recurrent_kda, its serving path, kda_decode) read them through flat views:
each shape must give bitwise the answer of the flat ``[HV]`` / ``[HV * K]`` call (same kernel, same
values), on both backends, and gradients come back in the caller's shape. Wrong shapes and
non-dense layouts raise ValueError naming the argument, on both backends alike.

chunk_kda takes them too: it hands its kernels ``flat_gate_params(A_log, dt_bias)``, the flat views
whose element stride the launchers read as ``stride_alog`` / ``stride_bias``.
"""

import pytest
import torch

from kdakit import chunk_kda
from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.validate import KDAShape, check_state_pool, flat_gate_params
from kdakit.testing import make_kda_inputs

H, HV, K, V = 2, 4, 8, 8

# name -> (A_log's shape, dt_bias's shape); "flat" is the reference call.
SHAPES = {
    "flat": ((HV,), (HV * K,)),
    "A_log [HV, 1]": ((HV, 1), (HV * K,)),
    "A_log [1, 1, HV, 1]": ((1, 1, HV, 1), (HV * K,)),
    "dt_bias [HV, K]": ((HV,), (HV, K)),
    "engine": ((1, 1, HV, 1), (HV, K)),
}
ENGINE = [n for n in SHAPES if n != "flat"]

# Shapes no op accepts; each must raise a ValueError naming the argument.
WRONG = {
    "A_log [1, HV]": ("A_log", (1, HV)),
    "A_log [HV, 1, 1]": ("A_log", (HV, 1, 1)),
    "A_log [1, HV, 1]": ("A_log", (1, HV, 1)),
    "A_log [HV * K]": ("A_log", (HV * K,)),
    "dt_bias [K, HV]": ("dt_bias", (K, HV)),  # the right count, rows of the wrong length
    "dt_bias [1, HV * K]": ("dt_bias", (1, HV * K)),
    "dt_bias [HV, K, 1]": ("dt_bias", (HV, K, 1)),
    "dt_bias [1, 1, HV, K]": ("dt_bias", (1, 1, HV, K)),
}


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")


def _tokens(seed, N=2, T=3, seqlens=None):
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        inp = make_kda_inputs(B=1, T=sum(seqlens), H=H, HV=HV, K=K, V=V, dtype=torch.float32, gate="softplus",
                              seqlens=seqlens, generator=gen)
    else:
        inp = make_kda_inputs(B=N, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.float32, gate="softplus", generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw.pop("safe_gate", None)
    return t, kw


def _shaped(t, name):
    """Fresh dense tensors of the named shapes holding the flat parameters' values (an engine's own
    parameter, not a view of the test's flat one)."""
    a_shape, b_shape = SHAPES[name]
    return t["A_log"].clone().view(a_shape), t["dt_bias"].clone().view(b_shape)


def _pool(seed, P, v_first=True):
    shape = (P, HV, V, K) if v_first else (P, HV, K, V)
    return 0.5 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- flat_gate_params ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ENGINE)
def test_flat_gate_params_are_views(name):
    t, _ = _tokens(0)
    A_log, dt_bias = _shaped(t, name)
    fa, fb = flat_gate_params(A_log, dt_bias)
    assert fa.shape == (HV,) and fb.shape == (HV * K,)
    # a view: same memory, no copy
    assert fa.data_ptr() == A_log.data_ptr() and fb.data_ptr() == dt_bias.data_ptr()
    assert fa._base is not None and fb._base is not None
    assert torch.equal(fa, t["A_log"]) and torch.equal(fb, t["dt_bias"])
    assert flat_gate_params(None, None) == (None, None)


def test_flat_gate_params_never_copies():
    # a tensor without a flat view (validation refuses it first) raises rather than being copied
    wide = torch.randn(HV, 2 * K)
    with pytest.raises(RuntimeError):
        flat_gate_params(None, wide[:, :K])


# --- fused_recurrent_kda -----------------------------------------------------------------------

def _recurrent(t, kw, A_log, dt_bias, h0, **extra):
    return fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=A_log, dt_bias=dt_bias,
                               initial_state=h0, output_final_state=True, **dict(kw, **extra))


@pytest.mark.parametrize("name", ENGINE)
def test_recurrent_engine_shapes_equal_the_flat_call(backend, name):
    t, kw = _tokens(1, seqlens=[3, 0, 2])
    h0 = _pool(2, P=3, v_first=False)
    o_ref, ht_ref = _recurrent(t, kw, t["A_log"], t["dt_bias"], h0)
    A_log, dt_bias = _shaped(t, name)
    o, ht = _recurrent(t, kw, A_log, dt_bias, h0)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


@pytest.mark.parametrize("name", ENGINE)
def test_recurrent_gradients_come_back_in_the_callers_shape(backend, name):
    t, kw = _tokens(3, N=2, T=4)
    h0 = _pool(4, P=2, v_first=False)
    do = torch.randn(t["v"].shape, generator=torch.Generator().manual_seed(5))
    grads = {}
    for case in ("flat", name):
        A_log, dt_bias = (x.requires_grad_() for x in _shaped(t, case))
        o, _ = _recurrent(t, kw, A_log, dt_bias, h0)
        o.backward(do)
        assert A_log.grad.shape == A_log.shape and dt_bias.grad.shape == dt_bias.shape
        grads[case] = (A_log.grad.reshape(-1), dt_bias.grad.reshape(-1))
    assert grads["flat"][0].abs().sum() > 0 and grads["flat"][1].abs().sum() > 0
    assert torch.equal(grads[name][0], grads["flat"][0]) and torch.equal(grads[name][1], grads["flat"][1])


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("name", ENGINE)
def test_serving_path_engine_shapes_equal_the_flat_call(backend, name, v_first):
    t, kw = _tokens(6, N=3, T=2)
    pool0 = _pool(7, P=5, v_first=v_first)
    idx = torch.tensor([[4, 1], [0, 2], [3, 3]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 1], dtype=torch.int32)
    outs = {}
    for case in ("flat", name):
        A_log, dt_bias = _shaped(t, case)
        pool = pool0.clone()
        with torch.no_grad():
            o, final = fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=A_log, dt_bias=dt_bias,
                                           initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
                                           inplace_final_state=True, state_v_first=v_first, **kw)
        assert final is pool
        outs[case] = (o, pool)
    assert not torch.equal(outs["flat"][1], pool0)  # the call did write the pool
    assert torch.equal(outs[name][0], outs["flat"][0]) and torch.equal(outs[name][1], outs["flat"][1])


# --- kda_decode --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ENGINE)
def test_decode_engine_shapes_equal_the_flat_call(backend, name):
    t, kw = _tokens(8, seqlens=[2, 1, 3])
    pool0 = _pool(9, P=5)
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    outs = {}
    for case in ("flat", name):
        A_log, dt_bias = _shaped(t, case)
        pool = pool0.clone()
        o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=A_log, dt_bias=dt_bias, **kw)
        outs[case] = (o, pool)
    assert not torch.equal(outs["flat"][1], pool0)
    assert torch.equal(outs[name][0], outs["flat"][0]) and torch.equal(outs[name][1], outs["flat"][1])


# --- errors, every op ----------------------------------------------------------------------------

def _call_op(op, t, kw, A_log, dt_bias):
    if op == "fused_recurrent_kda":
        return _recurrent(t, kw, A_log, dt_bias, _pool(1, P=2, v_first=False))
    if op == "serving":
        with torch.no_grad():
            return fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=A_log, dt_bias=dt_bias,
                                       initial_state=_pool(1, P=3, v_first=False),
                                       ssm_state_indices=torch.tensor([2, 0], dtype=torch.int32), **kw)
    if op == "kda_decode":
        return kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], _pool(1, P=3),
                          torch.tensor([2, 0], dtype=torch.int32), A_log=A_log, dt_bias=dt_bias, **kw)
    assert op == "chunk_kda"
    return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=A_log, dt_bias=dt_bias, **kw)


RECURRENT_OPS = ["fused_recurrent_kda", "serving", "kda_decode"]


def _wrong(t, case):
    which, shape = WRONG[case]
    n = 1
    for s in shape:
        n *= s
    # values that are not zeros, of the wrong shape (counts may differ from the right one)
    bad = torch.randn(n, generator=torch.Generator().manual_seed(11)).view(shape)
    A_log, dt_bias = t["A_log"], t["dt_bias"]
    return (bad, dt_bias) if which == "A_log" else (A_log, bad)


@pytest.mark.parametrize("case", list(WRONG))
@pytest.mark.parametrize("op", RECURRENT_OPS)
def test_wrong_shape_names_the_argument(backend, op, case):
    t, kw = _tokens(10)
    which = WRONG[case][0]
    spelled = r"\[HV\], \[HV, 1\] or \[1, 1, HV, 1\]" if which == "A_log" else r"\[HV \* K\] or \[HV, K\]"
    with pytest.raises(ValueError, match=rf"^{which} must have shape {spelled} .*got \["):
        _call_op(op, t, kw, *_wrong(t, case))


def _non_dense(t, which):
    """Right shape and values, no flat view: a column of a wider tensor (A_log [HV, 1] with row
    stride 2) or the first K columns of an [HV, 2K] tensor (dt_bias)."""
    if which == "A_log":
        wide = torch.stack([t["A_log"], torch.full_like(t["A_log"], 7.0)], 1)
        bad = wide[:, :1]
        assert bad.shape == (HV, 1) and bad.stride() == (2, 1)
        return bad, t["dt_bias"]
    wide = torch.cat([t["dt_bias"].view(HV, K), torch.full((HV, K), 7.0)], 1)
    bad = wide[:, :K]
    assert bad.shape == (HV, K) and bad.stride() == (2 * K, 1)
    return t["A_log"], bad


@pytest.mark.parametrize("which", ["A_log", "dt_bias"])
@pytest.mark.parametrize("op", RECURRENT_OPS)
def test_non_dense_engine_shape_is_refused(backend, op, which):
    # the kernels read a flat vector: reading this one as if dense would be silently wrong
    t, kw = _tokens(12)
    with pytest.raises(ValueError, match=rf"^{which} must be a dense vector .*got shape \[{HV}, .*strides"):
        _call_op(op, t, kw, *_non_dense(t, which))


@pytest.mark.parametrize("op", RECURRENT_OPS)
def test_strides_of_size_one_dims_are_never_read(backend, op):
    # [HV, 1] with an odd stride along its size-1 dim is still the dense vector: same answer
    t, kw = _tokens(13)
    A_log = torch.as_strided(t["A_log"].clone(), (HV, 1), (1, 5))
    assert A_log.is_contiguous() and A_log.stride() == (1, 5)
    want = _call_op(op, t, kw, t["A_log"], t["dt_bias"])
    got = _call_op(op, t, kw, A_log, t["dt_bias"])
    want, got = (want, got) if isinstance(want, torch.Tensor) else (want[0], got[0])
    assert torch.equal(got, want)


# --- chunk_kda (PyTorch path only) ---------------------------------------------------------------

@pytest.mark.slow
def test_chunk_engine_shapes_equal_the_flat_call(backend):
    # the Triton kernels read A_log / dt_bias through the flat views (element stride 1); every engine shape
    # against the one flat call (a chunk_kda step is the expensive part under the interpreter, its cost the
    # chunks': one sequence and an empty one)
    t, kw = _tokens(15, seqlens=[8, 0])
    h0 = _pool(16, P=2, v_first=False)
    leaves = {n: x.clone().requires_grad_() for n, x in t.items() if n not in ("A_log", "dt_bias")}
    do = torch.randn(t["v"].shape, generator=torch.Generator().manual_seed(17))
    res = {}
    for case in ("flat", *ENGINE):
        for x in leaves.values():
            x.grad = None
        A_log, dt_bias = (x.requires_grad_() for x in _shaped(t, case))
        o, ht = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=A_log,
                          dt_bias=dt_bias, initial_state=h0, output_final_state=True, **kw)
        o.backward(do)
        assert A_log.grad.shape == A_log.shape and dt_bias.grad.shape == dt_bias.shape, case
        res[case] = (o.detach(), ht.detach(), A_log.grad.reshape(-1), dt_bias.grad.reshape(-1), leaves["g"].grad)
    for name in ENGINE:
        for what, a, b in zip(("o", "ht", "dA_log", "ddt_bias", "dg"), res[name], res["flat"]):
            assert torch.equal(a, b), (name, what)


@pytest.mark.parametrize("case", list(WRONG))
def test_chunk_wrong_shape_names_the_argument(torch_backend, case):
    t, kw = _tokens(18)
    which = WRONG[case][0]
    with pytest.raises(ValueError, match=rf"^{which} must have shape .*got \["):
        _call_op("chunk_kda", t, kw, *_wrong(t, case))


# --- chunk_kda's state pool indices (issue #13 item 8) ---------------------------------------------

def _chunk_pool_call(idx, P=4, seqlens=(3, 2, 4)):
    t, kw = _tokens(19, seqlens=list(seqlens))
    pool = _pool(20, P=P)
    before = pool.clone()
    with pytest.raises(ValueError) as info:
        chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                  initial_state=pool, state_indices=idx, state_v_first=True, **kw)
    assert torch.equal(pool, before), "a refused call wrote the pool"
    return str(info.value)


def test_chunk_index_outside_the_pool(torch_backend):
    for bad in (4, -2):
        msg = _chunk_pool_call(torch.tensor([0, bad, 1], dtype=torch.int32))
        assert msg.startswith("state_indices must lie in [-1, 3] for a pool of 4 rows")


def test_chunk_duplicate_rows_are_refused(torch_backend):
    msg = _chunk_pool_call(torch.tensor([2, 0, 2], dtype=torch.int32))
    assert msg.startswith("state_indices rows must be distinct across sequences: row 2 is used by sequences 0 and 2")


@pytest.mark.parametrize("length", [2, 4])
def test_chunk_wrong_length_names_state_indices(torch_backend, length):
    msg = _chunk_pool_call(torch.tensor([0, 1, 2, 3][:length], dtype=torch.int32))
    assert msg.startswith("state_indices must have shape [N] = [3]")


# --- check_state_pool, the helper chunk.py is to call --------------------------------------------

def _shape3():
    return KDAShape(B=1, T=9, H=H, HV=HV, K=K, V=V, N=3, seqlens=(3, 2, 4))


def _check(pool, idx, v_first=True):
    return check_state_pool(pool, idx, _shape3(), state_v_first=v_first, device=torch.device("cpu"))


def test_check_state_pool_accepts_and_reads_once():
    pool = _pool(21, P=4)
    assert _check(pool, torch.tensor([3, -1, 0], dtype=torch.int32)) == [3, -1, 0]
    # several padded sequences share -1: not a row, so not a duplicate
    assert _check(pool, torch.tensor([-1, 2, -1], dtype=torch.int64)) == [-1, 2, -1]
    assert _check(_pool(21, P=4, v_first=False), torch.tensor([1, 2, 3], dtype=torch.int32), v_first=False) == [1, 2, 3]


CHECK_CASES = {
    "duplicate": (ValueError, r"^state_indices rows must be distinct across sequences: row 1 is used by sequences 0 and 2",
                  lambda p: (p, torch.tensor([1, 3, 1], dtype=torch.int32))),
    "too short": (ValueError, r"^state_indices must have shape \[N\] = \[3\] \(one pool row per sequence\), got \[2\]",
                  lambda p: (p, torch.tensor([1, 3], dtype=torch.int32))),
    "too long": (ValueError, r"^state_indices must have shape \[N\] = \[3\].*got \[4\]",
                 lambda p: (p, torch.tensor([1, 3, 0, 2], dtype=torch.int32))),
    "2-D": (ValueError, r"^state_indices must have shape \[N\] = \[3\].*got \[3, 1\]",
            lambda p: (p, torch.tensor([[1], [3], [0]], dtype=torch.int32))),
    "past the pool": (ValueError, r"^state_indices must lie in \[-1, 3\] for a pool of 4 rows, got \[1, 4, 0\]",
                      lambda p: (p, torch.tensor([1, 4, 0], dtype=torch.int32))),
    "below -1": (ValueError, r"^state_indices must lie in \[-1, 3\]", lambda p: (p, torch.tensor([1, -2, 0]))),
    "float indices": (TypeError, r"^state_indices must be an int32 tensor \(or int64\), got float32",
                      lambda p: (p, torch.tensor([1.0, 2.0, 0.0]))),
    "list indices": (TypeError, r"^state_indices must be an int32 tensor \(or int64\), got list",
                     lambda p: (p, [1, 2, 0])),
    "indices off the pool's device": (ValueError, r"^state_indices must be on the pool's device cpu, got meta",
                                      lambda p: (p, torch.empty(3, dtype=torch.int32, device="meta"))),
    "no pool": (ValueError, r"^state_indices needs initial_state to be the state pool",
                lambda p: (None, torch.tensor([1, 2, 0], dtype=torch.int32))),
    "pool layout": (ValueError, r"^initial_state \(the state pool\) must have shape \[P, HV, V, K\] \(state_v_first=True\) "
                                r"= \[P, 4, 8, 8\], got \[4, 4, 8, 4\]",
                    lambda p: (p[..., :4], torch.tensor([1, 2, 0], dtype=torch.int32))),
    "pool dtype": (TypeError, r"^initial_state \(the state pool\) must have dtype in",
                   lambda p: (p.half(), torch.tensor([1, 2, 0], dtype=torch.int32))),
}


@pytest.mark.parametrize("case", list(CHECK_CASES))
def test_check_state_pool_errors(case):
    exc, pattern, make = CHECK_CASES[case]
    pool, idx = make(_pool(22, P=4))
    with pytest.raises(exc, match=pattern):
        _check(pool, idx)
