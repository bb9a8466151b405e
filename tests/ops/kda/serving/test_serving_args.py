"""fused_recurrent_kda with FLA 0.6.0's serving arguments (ssm_state_indices, num_accepted_tokens,
inplace_final_state, out=), on the Triton interpreter and the PyTorch path, against the float64
definition (naive_recurrent_kda). FLA's own kernel cannot run under the interpreter (it loops
over a runtime token count), so the comparison with FLA itself is the GPU test
(tests/gpu/ops/kda/test_recurrent_gpu.py::test_serving_args_match_fla)."""

import pytest
import torch

from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import assert_close, make_kda_inputs

FP32_RATIO = 5e-5  # fp32 kernels vs the float64 definition (observed ~1e-7)
HV, K, V = 2, 8, 8


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def _tokens(seed, N=3, T=1, seqlens=None):
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        inp = make_kda_inputs(B=1, T=sum(seqlens), H=1, HV=HV, K=K, V=V, dtype=torch.float32, gate="softplus",
                              seqlens=seqlens, generator=gen)
    else:
        inp = make_kda_inputs(B=N, T=T, H=1, HV=HV, K=K, V=V, dtype=torch.float32, gate="softplus", generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw.pop("safe_gate", None)
    return t, kw


def _pool(seed, P, v_first, dtype=torch.float32):
    shape = (P, HV, V, K) if v_first else (P, HV, K, V)
    return (0.5 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _run(t, kw, pool, **extra):
    return fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                               initial_state=pool, **dict(kw, **extra))


def _naive(t, kw, h0, v_first, upto=None):
    """The definition in float64 from initial states h0 [N, ...]; ``upto`` keeps the first tokens of
    each (fixed-length) sequence. Returns (o, final states)."""
    d = {n: x.double() for n, x in t.items()}
    if upto is not None:
        d = {n: (x[:, :upto] if x.dim() >= 3 else x) for n, x in d.items()}
    return naive_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d["A_log"], dt_bias=d["dt_bias"],
                               initial_state=None if h0 is None else h0.double(), output_final_state=True,
                               state_v_first=v_first, **{n: x for n, x in kw.items() if n != "output_final_state"})


# --- the semantics -------------------------------------------------------------------------

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_decode_into_pool_in_place(backend, v_first, idx_dtype):
    t, kw = _tokens(1, N=3, T=1)
    pool = _pool(2, 6, v_first)
    before = pool.clone()
    idx = torch.tensor([4, 0, 2], dtype=idx_dtype)
    o, final = _run(t, kw, pool, ssm_state_indices=idx, inplace_final_state=True, state_v_first=v_first)
    assert final is pool
    ref_o, ref_s = _naive(t, kw, before[idx.long()], v_first)
    assert_close("o", ref_o, o, FP32_RATIO)
    assert_close("rows", ref_s, pool[idx.long()], FP32_RATIO)
    for r in (1, 3, 5):
        assert torch.equal(pool[r], before[r])


@pytest.mark.parametrize("v_first", [False, True])
def test_speculative_rows_and_accepted_tokens(backend, v_first):
    """[N, S] indices: the state after token j goes to row idx[n, j]; the initial state comes from
    column num_accepted_tokens[n] - 1. -1 in columns that are never read is ignored, as in FLA."""
    N, T = 3, 2
    t, kw = _tokens(3, N=N, T=T)
    pool = _pool(4, 12, v_first)
    before = pool.clone()
    idx = torch.tensor([[0, 1, -1], [2, 3, 4], [5, 6, -1]], dtype=torch.int32)
    accepted = torch.tensor([1, 3, 2], dtype=torch.int32)
    o, final = _run(t, kw, pool, ssm_state_indices=idx, num_accepted_tokens=accepted, inplace_final_state=True,
                    state_v_first=v_first)
    assert final is pool
    h0 = before[torch.tensor([0, 4, 6])]  # idx[n, accepted[n] - 1]
    ref_o, _ = _naive(t, kw, h0, v_first)
    assert_close("o", ref_o, o, FP32_RATIO)
    for j in range(T):
        _, states = _naive(t, kw, h0, v_first, upto=j + 1)
        for n in range(N):
            assert_close(f"row {int(idx[n, j])}", states[n], pool[int(idx[n, j])], FP32_RATIO)
    for r in (4, 7, 8, 9, 10, 11):  # rows not written: row 4 is read only (accepted), the rest unused
        assert torch.equal(pool[r], before[r])


def test_varlen_with_empty_padded_sequence(backend):
    """A sequence with no tokens reads and writes nothing, so its -1 entries are never used."""
    t, kw = _tokens(5, seqlens=[2, 0, 1])
    pool = _pool(6, 8, False)
    before = pool.clone()
    idx = torch.tensor([[3, 5], [-1, -1], [1, -1]], dtype=torch.int32)
    o, _ = _run(t, kw, pool, ssm_state_indices=idx, inplace_final_state=True)
    h0 = torch.stack([before[3], torch.zeros_like(before[0]), before[1]])
    ref_o, ref_s = _naive(t, kw, h0, False)
    assert_close("o", ref_o, o, FP32_RATIO)
    first = {n: (x[:, :1] if x.dim() >= 3 else x) for n, x in t.items()}  # sequence 0's first token
    _, after_first = _naive(first, dict(kw, cu_seqlens=torch.tensor([0, 1])), h0[:1], False)
    assert_close("row 3", after_first[0], pool[3], FP32_RATIO)  # read first, then overwritten by token 0
    assert_close("row 5", ref_s[0], pool[5], FP32_RATIO)
    assert_close("row 1", ref_s[2], pool[1], FP32_RATIO)
    for r in (0, 2, 4, 6, 7):
        assert torch.equal(pool[r], before[r])


@pytest.mark.parametrize("with_h0", [True, False])
def test_not_in_place_returns_new_states_and_leaves_the_pool(backend, with_h0):
    """inplace_final_state=False with indices: FLA's row t of a new [N, ...] fp32 tensor holds the
    state after packed token t (one token per sequence here, so row n is sequence n's state)."""
    t, kw = _tokens(7, N=3, T=1)
    pool = _pool(8, 5, False)
    before = pool.clone()
    idx = torch.tensor([2, 2, 0], dtype=torch.int32)  # two sequences may read one row: nobody writes it
    o, final = _run(t, kw, pool if with_h0 else None, ssm_state_indices=idx, output_final_state=True)
    assert torch.equal(pool, before)
    assert final is not pool and final.shape == (3, HV, K, V) and final.dtype == torch.float32
    ref_o, ref_s = _naive(t, kw, before[idx.long()] if with_h0 else None, False)
    assert_close("o", ref_o, o, FP32_RATIO)
    assert_close("final", ref_s, final, FP32_RATIO)


def test_not_in_place_without_final_state_writes_nothing(backend):
    t, kw = _tokens(9, N=2, T=3)
    pool = _pool(10, 3, False)
    before = pool.clone()
    kw.pop("output_final_state", None)
    o, final = _run(t, kw, pool, ssm_state_indices=torch.tensor([2, 0], dtype=torch.int32))
    assert final is None and torch.equal(pool, before)
    ref_o, _ = _naive(t, kw, before[torch.tensor([2, 0])], False)
    assert_close("o", ref_o, o, FP32_RATIO)


def test_in_place_without_indices_overwrites_row_n(backend):
    t, kw = _tokens(11, N=2, T=3)
    h0 = _pool(12, 2, True)
    before = h0.clone()
    o, final = _run(t, kw, h0, inplace_final_state=True, state_v_first=True)
    assert final is h0
    ref_o, ref_s = _naive(t, kw, before, True)
    assert_close("o", ref_o, o, FP32_RATIO)
    assert_close("states", ref_s, h0, FP32_RATIO)


@pytest.mark.parametrize("v_first", [False, True])
def test_padded_pool_rows_are_read_through_the_stride(backend, v_first):
    """A pool whose rows are padded (a slice of a wider buffer) gives the contiguous pool's bits and
    never touches the padding."""
    t, kw = _tokens(13, N=2, T=2)
    dense = _pool(14, 4, v_first)
    row = HV * K * V
    buf = torch.full((4, row + 8), 7.0)
    padded = buf[:, :row].view(dense.shape)
    padded.copy_(dense)
    assert not padded.is_contiguous() and padded.stride(0) == row + 8
    idx = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    args = dict(ssm_state_indices=idx, inplace_final_state=True, state_v_first=v_first)
    o_d, _ = _run(t, kw, dense, **args)
    o_p, _ = _run(t, kw, padded, **args)
    assert torch.equal(o_d, o_p) and torch.equal(dense, padded)
    assert torch.equal(buf[:, row:], torch.full((4, 8), 7.0))


def test_strided_index_tensors_are_read_by_element(backend):
    """Index tensors are read through their strides (FLA ignores the column stride; for a
    contiguous tensor the two agree)."""
    t, kw = _tokens(15, N=2, T=2)
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    strided_idx = idx.t().contiguous().t()
    strided_acc = torch.stack([acc, acc], 1)[:, 0]
    assert not strided_idx.is_contiguous() and strided_acc.stride(0) == 2
    pool_a, pool_b = _pool(16, 4, False), _pool(16, 4, False)
    o_a, _ = _run(t, kw, pool_a, ssm_state_indices=idx, num_accepted_tokens=acc, inplace_final_state=True)
    o_b, _ = _run(t, kw, pool_b, ssm_state_indices=strided_idx, num_accepted_tokens=strided_acc,
                  inplace_final_state=True)
    assert torch.equal(o_a, o_b) and torch.equal(pool_a, pool_b)


def test_bf16_pool_rounds_only_the_stored_states(backend):
    """As FLA: the running state stays fp32 across a call's tokens; each stored copy is rounded to
    bf16 (nearest even). So o equals the fp32 pool's and each row is the fp32 row rounded."""
    t, kw = _tokens(17, N=2, T=3)
    pool16 = _pool(18, 8, False, torch.bfloat16)
    pool32 = pool16.float()
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    o16, _ = _run(t, kw, pool16, ssm_state_indices=idx, inplace_final_state=True)
    o32, _ = _run(t, kw, pool32, ssm_state_indices=idx, inplace_final_state=True)
    assert torch.equal(o16, o32)
    assert torch.equal(pool16, pool32.to(torch.bfloat16))
    assert not torch.equal(pool16.float(), pool32)  # the stored states really were rounded


def test_out_is_filled_and_returned(backend):
    t, kw = _tokens(19, N=2, T=1)
    out = torch.full_like(t["v"], float("nan"))
    o, _ = _run(t, kw, _pool(20, 2, False), ssm_state_indices=torch.tensor([1, 0], dtype=torch.int32),
                inplace_final_state=True, out=out)
    assert o is out and torch.isfinite(out).all()


def test_backends_agree():
    t, kw = _tokens(21, seqlens=[3, 1, 2])
    idx = torch.tensor([[0, 1, 2], [3, -1, -1], [4, 5, -1]], dtype=torch.int32)
    acc = torch.tensor([1, 1, 2], dtype=torch.int32)
    res = {}
    for be in ("triton", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KDAKIT_BACKEND", be)
            pool = _pool(22, 7, False)
            o, _ = _run(t, kw, pool, ssm_state_indices=idx, num_accepted_tokens=acc, inplace_final_state=True)
            res[be] = (o, pool)
    assert_close("o", res["torch"][0], res["triton"][0], 1e-6)
    assert_close("pool", res["torch"][1], res["triton"][1], 1e-6)


# --- errors --------------------------------------------------------------------------------

def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _as_strided_pool(stride0):
    base = torch.randn(4 * HV * K * V + 64)
    return base.as_strided((4, HV, K, V), (stride0, K * V, V, 1))


BAD = {
    "idx-length": (dict(ssm_state_indices=_i32([0])), ValueError, r"^ssm_state_indices must be \[N\] or \[N, S\]"),
    "idx-3d": (dict(ssm_state_indices=_i32([[[0]], [[1]]])), ValueError, r"^ssm_state_indices must be \[N\]"),
    "idx-dtype": (dict(ssm_state_indices=torch.tensor([0.0, 1.0])), TypeError, r"^ssm_state_indices must be an int32 tensor \(or int64\), got float32"),
    "idx-type": (dict(ssm_state_indices=[0, 1]), TypeError, r"^ssm_state_indices must be an int32 tensor \(or int64\), got list"),
    "accepted-length": (dict(ssm_state_indices=_i32([[0, 1], [2, 3]]), num_accepted_tokens=_i32([1])), ValueError,
                        r"^num_accepted_tokens must have shape \[N\] = \[2\]"),
    "accepted-without-idx": (dict(num_accepted_tokens=_i32([1, 1])), ValueError, "needs ssm_state_indices"),
    "accepted-range": (dict(ssm_state_indices=_i32([[0, 1], [2, 3]]), num_accepted_tokens=_i32([1, 3])), ValueError,
                       r"num_accepted_tokens\[1\] must lie in \[1, 2\]"),
    "idx-outside-pool": (dict(ssm_state_indices=_i32([0, 4])), ValueError, r"ssm_state_indices\[1, 0\].*\[0, 3\]"),
    "idx-negative-read": (dict(ssm_state_indices=_i32([-1, 1])), ValueError,
                          r"ssm_state_indices\[0, 0\] \(sequence 0's initial-state row\) must lie in \[0, 3\]"),
    "idx-duplicate-write": (dict(ssm_state_indices=_i32([2, 2])), ValueError, "row 2 is written by sequences 0 and 1"),
    "idx-read-written": (dict(ssm_state_indices=_i32([[0, 1], [2, 0]]), num_accepted_tokens=_i32([1, 2])),
                         ValueError, "row 0 is read by sequence 1 and written by sequence 0"),
    "too-many-tokens": (dict(T=2, ssm_state_indices=_i32([0, 1])), ValueError, "at most S=1 tokens"),
    "not-inplace-token-count": (dict(T=2, inplace_final_state=False, output_final_state=True,
                                     ssm_state_indices=_i32([[0, 1], [2, 3]])), ValueError, "exactly N=2 tokens"),
    "inplace-without-state": (dict(pool=None), ValueError, "got initial_state=None"),
    "inplace-flag-type": (dict(inplace_final_state=1), TypeError, "^inplace_final_state must be a bool"),
    "pool-shape": (dict(pool=torch.randn(4, HV, V + 1, K)), ValueError, "^initial_state .*must have shape"),
    "pool-dtype": (dict(pool=torch.randn(4, HV, K, V).half()), TypeError, "^initial_state must be float32"),
    "pool-rows-not-dense": (dict(pool=torch.randn(4, HV, V, K).transpose(2, 3)), ValueError, "rows must be dense"),
    "pool-rows-overlap": (dict(pool=_as_strided_pool(HV * K * V - 8)), ValueError, "rows must not overlap"),
    "pool-row-misaligned": (dict(pool=_as_strided_pool(HV * K * V + 1)), ValueError, "16-byte aligned row stride"),
    "final-out-inplace": (dict(final_state_out=torch.empty(2, HV, K, V)), ValueError, "^final_state_out is not used"),
    "out-shape": (dict(out=torch.empty(2, 1, HV, V + 1)), ValueError, r"^out must have shape"),
    "requires-grad": (dict(grad=True), ValueError, "forward-only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_rejects_bad_arguments(backend, case):
    args, exc, pattern = BAD[case]
    args = dict(args)
    t, kw = _tokens(23, N=2, T=args.pop("T", 1))
    kw.pop("output_final_state", None)
    pool = args.pop("pool", _pool(24, 4, False))
    if args.pop("grad", False):
        t["v"] = t["v"].clone().requires_grad_()
    args.setdefault("inplace_final_state", True)
    if "ssm_state_indices" not in args and case not in ("inplace-without-state", "accepted-without-idx"):
        args.setdefault("ssm_state_indices", _i32([0, 1]))
    snapshot = pool.clone() if isinstance(pool, torch.Tensor) else None
    with pytest.raises(exc, match=pattern):
        _run(t, kw, pool, **args)
    if snapshot is not None:
        assert torch.equal(pool, snapshot), "a failing call modified the pool"


def test_float64_pool_is_refused_on_the_triton_backend(backend):
    # the kernel used to read and write a float64 pool through fp32 math; the PyTorch path computes float64
    t, kw = _tokens(27, N=2, T=1)
    pool = _pool(28, 4, False, torch.float64)
    snapshot = pool.clone()
    if backend == "triton":
        with pytest.raises(TypeError, match=r"^initial_state must be float16, bfloat16 or float32 for the Triton "
                                            r"kernels, got torch.float64; use KDAKIT_BACKEND=torch for float64$"):
            _run(t, kw, pool, ssm_state_indices=_i32([2, 0]), inplace_final_state=True)
        assert torch.equal(pool, snapshot), "a failing call modified the pool"
        return
    _run(t, kw, pool, ssm_state_indices=_i32([2, 0]), inplace_final_state=True)
    _, ref_final = _naive(t, kw, snapshot[[2, 0]], False)
    assert_close("rows", ref_final, pool[[2, 0]], 1e-6)


def test_unchecked_indices_are_not_read_on_the_host(backend):
    """check_indices=False skips the host read; entries inside the pool still give the checked result."""
    t, kw = _tokens(25, N=2, T=1)
    pool_a, pool_b = _pool(26, 3, False), _pool(26, 3, False)
    idx = _i32([2, 0])
    o_a, _ = _run(t, kw, pool_a, ssm_state_indices=idx, inplace_final_state=True)
    o_b, _ = _run(t, kw, pool_b, ssm_state_indices=idx, inplace_final_state=True, check_indices=False)
    assert torch.equal(o_a, o_b) and torch.equal(pool_a, pool_b)


def test_unchecked_rows_outside_the_pool_are_skipped_alike(backend):
    """Without the host check, a read row outside the pool is never dereferenced: that sequence
    gets zeros and writes nothing (the same on both backends), the others are unaffected."""
    t, kw = _tokens(27, N=2, T=1)
    pool = _pool(28, 3, False)
    before = pool.clone()
    o, _ = _run(t, kw, pool, ssm_state_indices=_i32([-1, 2]), inplace_final_state=True, check_indices=False)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(pool[:2], before[:2])
    ref_o, ref_s = _naive({n: (x[1:] if x.dim() >= 3 else x) for n, x in t.items()}, kw, before[2:], False)
    assert_close("o", ref_o, o[1:], FP32_RATIO)
    assert_close("row 2", ref_s, pool[2:], FP32_RATIO)
