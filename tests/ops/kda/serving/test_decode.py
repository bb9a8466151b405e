"""kda_decode: state-pool decode steps (in-place rows, padded rows, several tokens, per-token
rows for speculative decoding, bf16 state) on the Triton interpreter and the PyTorch path."""

import pytest
import torch

from kdakit.ops.kda.serving.decode import decode_options, kda_decode, kda_decode_reference
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import assert_close, make_kda_inputs

FP32_RATIO = 5e-5  # fp32 decode vs the float64 definition (observed ~1e-7)
BF16_U = 2.0 ** -8  # unit roundoff of bf16 (8 significant bits)


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def _tokens(seed, N=3, T=2, H=2, HV=4, K=8, V=8, gate="softplus", seqlens=None):
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        inp = make_kda_inputs(B=1, T=sum(seqlens), H=H, HV=HV, K=K, V=V, dtype=torch.float32, gate=gate,
                              seqlens=seqlens, generator=gen)
    else:
        inp = make_kda_inputs(B=N, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.float32, gate=gate, generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw.pop("safe_gate", None)
    return t, kw


def _decode(t, kw, pool, idx, **extra):
    return kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t.get("A_log"),
                      dt_bias=t.get("dt_bias"), **dict(kw, **extra))


def _naive(t, kw, h0_vk):
    """The definition in float64 from value-first initial states; returns (o, final states [N, HV, V, K])."""
    d = {n: x.double() for n, x in t.items()}
    return naive_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d.get("A_log"),
                               dt_bias=d.get("dt_bias"), initial_state=h0_vk.double(), output_final_state=True,
                               state_v_first=True, **kw)


def _pool(seed, P, HV=4, V=8, K=8, dtype=torch.float32):
    return (0.5 * torch.randn(P, HV, V, K, generator=torch.Generator().manual_seed(seed))).to(dtype)


# --- against the definition, and pool semantics -------------------------------------------------

@pytest.mark.parametrize("T", [1, 3])
def test_decode_matches_naive_and_leaves_other_rows(backend, T):
    t, kw = _tokens(1, N=3, T=T)
    pool = _pool(2, P=6)
    before = pool.clone()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    o = _decode(t, kw, pool, idx)
    ref_o, ref_final = _naive(t, kw, before[idx.long()])
    assert_close("o", ref_o, o, FP32_RATIO)
    assert_close("rows", ref_final, pool[idx.long()], FP32_RATIO)
    for r in (1, 3, 5):
        assert torch.equal(pool[r], before[r])


def test_decode_varlen_token_counts(backend):
    t, kw = _tokens(3, H=1, HV=2, seqlens=[2, 0, 3, 1])
    pool = _pool(4, P=5, HV=2)
    before = pool.clone()
    idx = torch.tensor([3, 1, 0, 4], dtype=torch.int32)
    o = _decode(t, kw, pool, idx)
    ref_o, ref_final = _naive(t, kw, before[idx.long()])
    assert_close("o", ref_o, o, FP32_RATIO)
    assert_close("rows", ref_final, pool[idx.long()], FP32_RATIO)
    assert torch.equal(pool[1], before[1])  # the empty sequence's row is rewritten with the same values
    assert torch.equal(pool[2], before[2])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_get_zero_output_and_pool_is_untouched(backend, pool_dtype):
    t, kw = _tokens(5, N=4, T=2)
    pool = _pool(6, P=5, dtype=pool_dtype)
    before = pool.clone()
    idx = torch.tensor([-1, 2, -1, 0], dtype=torch.int32)
    o = _decode(t, kw, pool, idx)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[2], torch.zeros_like(o[2]))
    assert o[1].abs().max() > 0 and o[3].abs().max() > 0
    for r in (1, 3, 4):
        assert torch.equal(pool[r], before[r])
    assert not torch.equal(pool[2], before[2])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_multi_token_step_equals_single_token_steps(backend, pool_dtype):
    t, kw = _tokens(7, N=2, T=3)
    pool_a = _pool(8, P=3, dtype=pool_dtype)
    pool_b = pool_a.clone()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    o_all = _decode(t, kw, pool_a, idx)
    for j in range(3):
        step = {n: (x[:, j:j + 1].contiguous() if x.dim() >= 3 else x) for n, x in t.items()}
        o_j = _decode(step, kw, pool_b, idx)
        assert torch.equal(o_j[:, 0], o_all[:, j]), j
    assert torch.equal(pool_a, pool_b)


# --- speculative decoding: one row per token ------------------------------------------------

def test_per_token_rows_hold_every_intermediate_state(backend):
    t, kw = _tokens(9, N=2, T=3, H=1, HV=2)
    pool = _pool(10, P=8, HV=2)
    before = pool.clone()
    idx = torch.tensor([[5, 1, -1], [0, 7, 3]], dtype=torch.int32)
    o = _decode(t, kw, pool, idx)
    h0 = before[idx[:, 0].long()]
    ref_o, _ = _naive(t, kw, h0)
    assert_close("o", ref_o, o, FP32_RATIO)
    for j in range(3):
        prefix = {n: (x[:, :j + 1] if x.dim() >= 3 else x) for n, x in t.items()}
        _, states = _naive(prefix, kw, h0)
        for n in range(2):
            r = int(idx[n, j])
            if r >= 0:
                assert_close(f"row {r}", states[n], pool[r], FP32_RATIO)
    for r in (2, 4, 6):
        assert torch.equal(pool[r], before[r])


def test_num_accepted_tokens_selects_the_initial_row(backend):
    t, kw = _tokens(11, N=3, T=2, H=1, HV=2)
    pool = _pool(12, P=9, HV=2)
    before = pool.clone()
    idx = torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int32)
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32)
    o = _decode(t, kw, pool, idx, num_accepted_tokens=accepted)
    h0 = torch.stack([before[1], before[2], torch.zeros_like(before[0])])
    ref_o, ref_states = _naive(t, kw, h0)
    assert_close("o", ref_o[:2], o[:2], FP32_RATIO)
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    assert_close("row 1", ref_states[0], pool[1], FP32_RATIO)
    assert_close("row 3", ref_states[1], pool[3], FP32_RATIO)


# --- bf16 state -----------------------------------------------------------------------------

def test_bf16_pool_kernel_matches_reference_rounding(monkeypatch):
    """Interpreter kernel vs PyTorch reference, both rounding each token's state to bf16 (ties to even)."""
    t, kw = _tokens(13, N=2, T=4)
    pool = _pool(14, P=3, dtype=torch.bfloat16)
    results = {}
    for be in ("triton", "torch"):
        monkeypatch.setenv("KDAKIT_BACKEND", be)
        p = pool.clone()
        results[be] = (_decode(t, kw, p, torch.tensor([1, 2], dtype=torch.int32)), p)
    o_k, p_k = results["triton"]
    o_r, p_r = results["torch"]
    assert_close("o", o_r, o_k, 1e-3)
    # fp32 sums in another order can flip a rounding: at most one bf16 ulp, and rarely
    diff = (p_k.float() - p_r.float()).abs()
    assert (diff <= 2 * BF16_U * p_r.float().abs()).all()
    assert (diff > 0).float().mean() < 0.05


def test_bf16_state_error_bound_over_4096_steps():
    """bf16 pool vs fp32 pool over 4096 tokens (PyTorch reference path, K = V = 16).

    Each token rounds the state once: error r_t with |r_t| <= u |S_t| elementwise (u = 2^-8).
    With l2-normalized k and beta in (0, 1), (I - beta k k^T) has norm <= 1, and the decay
    is at most rho = max exp(a) < 1, so e_t = M_t e_{t-1} + r_t gives the rigorous bound
    ||e_t|| <= u max_s ||S_s|| / (1 - rho). The rounding errors are independent and damped,
    so in practice the relative error stays near u (measured ~0.6u-0.9u here): we also assert
    it stays below 2u at every step and does not drift (last quarter <= 1.25 x first quarter),
    and that it is not zero (the state really is rounded).
    """
    gen = torch.Generator().manual_seed(15)
    N, T, H, HV, K, V = 2, 4096, 1, 2, 16, 16
    q, k, v = (torch.randn(N, T, H, K, generator=gen), torch.randn(N, T, H, K, generator=gen),
               torch.randn(N, T, HV, V, generator=gen))
    g = -(0.05 + 0.5 * torch.nn.functional.softplus(torch.randn(N, T, HV, K, generator=gen)))
    beta = torch.randn(N, T, HV, generator=gen)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    idx = torch.arange(N * T, dtype=torch.int32).view(N, T)  # one row per token: the whole trajectory
    pool32 = torch.zeros(N * T, HV, V, K)
    pool16 = torch.zeros(N * T, HV, V, K, dtype=torch.bfloat16)
    o32 = kda_decode(q, k, v, g, beta, pool32, idx, check_indices=False, **kw)
    o16 = kda_decode(q, k, v, g, beta, pool16, idx, check_indices=False, **kw)

    s = pool32.view(N, T, -1)
    e = (pool16.float() - pool32).view(N, T, -1).norm(dim=-1)
    rho = torch.exp(g.max()).item()
    assert rho < 1
    assert (e <= BF16_U * s.norm(dim=-1).max() / (1 - rho)).all()
    rel = e / s.norm(dim=-1)
    assert rel.max() < 2 * BF16_U, f"max relative state error {rel.max():.3e}"
    assert rel[:, -1024:].mean() <= 1.25 * rel[:, :1024].mean()
    assert rel[:, -1].min() > 0.1 * BF16_U
    assert_close("o", o32, o16, 2 * BF16_U)


def test_reference_is_used_on_cpu_by_default(monkeypatch):
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    t, kw = _tokens(16, N=2, T=2)
    pool_a = _pool(17, P=2)
    pool_b = pool_a.clone()
    idx = torch.tensor([1, 0], dtype=torch.int32)
    o = _decode(t, kw, pool_a, idx)
    o_ref = torch.empty_like(t["v"])
    opts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                          scale=8 ** -0.5, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                          use_beta_sigmoid_in_kernel=True)
    kda_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], pool_b, idx, None, o_ref, opts,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], cu_seqlens=None, N=2)
    assert torch.equal(o, o_ref) and torch.equal(pool_a, pool_b)


def test_out_is_filled_and_returned(backend):
    t, kw = _tokens(18, N=2, T=1)
    pool = _pool(19, P=2)
    out = torch.full_like(t["v"], float("nan"))
    o = _decode(t, kw, pool, torch.tensor([0, 1], dtype=torch.int32), out=out)
    assert o is out and torch.isfinite(out).all()


@pytest.mark.parametrize("per_token", [False, True])
def test_padded_pool_rows_are_read_through_the_stride(backend, per_token):
    """A pool with padded rows (every other row of a wider cache: row stride 2 * row) gives the
    contiguous pool's bits, with no copy: the rows in between are never touched."""
    t, kw = _tokens(22, N=2, T=2)
    wide = _pool(23, P=8)
    padded = wide[::2]
    assert not padded.is_contiguous()
    dense = padded.clone()
    between = wide[1::2].clone()
    idx = torch.tensor([[3, 1], [0, 2]] if per_token else [3, 0], dtype=torch.int32)
    o_p = _decode(t, kw, padded, idx)
    o_d = _decode(t, kw, dense, idx)
    assert torch.equal(o_p, o_d) and torch.equal(padded, dense)
    assert torch.equal(wide[1::2], between)


def test_no_sequences_gives_an_empty_result(backend):
    t, kw = _tokens(24, N=1, T=1)
    t = {n: (x[:0] if x.dim() >= 3 else x) for n, x in t.items()}
    pool = _pool(25, P=2)
    before = pool.clone()
    for idx in (torch.zeros(0, dtype=torch.int32), torch.zeros(0, 3, dtype=torch.int32)):
        o = _decode(t, kw, pool, idx)
        assert o.shape == (0, 1, 4, 8)
    assert torch.equal(pool, before)


# --- validation ---------------------------------------------------------------------------

def _bad(mutation):
    t, kw = _tokens(20, N=2, T=2)
    args = dict(pool=_pool(21, P=4), idx=torch.tensor([0, 1], dtype=torch.int32), extra={})
    mutation(args)
    return t, kw, args


@pytest.mark.parametrize("mutation, exc, pattern", [
    (lambda a: a.update(pool=a["pool"].half()), TypeError, "^state_pool must be float32 or bfloat16"),
    (lambda a: a.update(pool=torch.zeros(4, 4, 8, 6)), ValueError, "^state_pool must have shape"),
    (lambda a: a.update(pool=torch.randn(4, 4, 8, 8).transpose(2, 3)), ValueError, "^state_pool rows must be dense"),
    (lambda a: a.update(pool=torch.randn(4 * 256 + 8).as_strided((4, 4, 8, 8), (255, 64, 8, 1))), ValueError,
     "^state_pool rows must not overlap"),
    (lambda a: a.update(pool=torch.randn(4 * 260).as_strided((4, 4, 8, 8), (258, 64, 8, 1))), ValueError,
     "^state_pool padded rows need a 16-byte aligned row stride"),
    (lambda a: a.update(idx=a["idx"].float()), TypeError, r"^state_indices must be an int32 tensor \(or int64\), got float32"),
    (lambda a: a.update(idx=[0, 1]), TypeError, r"^state_indices must be an int32 tensor \(or int64\), got list"),
    (lambda a: a.update(idx=a["idx"][:1]), ValueError, r"^state_indices must be \[N\] or \[N, S\]"),
    (lambda a: a.update(idx=torch.tensor([0, 4], dtype=torch.int32)), ValueError, r"must lie in \[-1, 3\]"),
    (lambda a: a.update(idx=torch.tensor([-2, 1], dtype=torch.int32)), ValueError, r"must lie in \[-1, 3\]"),
    (lambda a: a.update(idx=torch.tensor([2, 2], dtype=torch.int32)), ValueError, "distinct across sequences"),
    (lambda a: a.update(idx=torch.tensor([[0], [1]], dtype=torch.int32)), ValueError, "S >= tokens per sequence"),
    (lambda a: a["extra"].update(num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32)), ValueError,
     "needs per-token state_indices"),
    (lambda a: a.update(idx=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                        extra=dict(num_accepted_tokens=torch.tensor([0, 1], dtype=torch.int32))), ValueError,
     r"num_accepted_tokens must lie in \[1, 2\]"),
    (lambda a: a["extra"].update(out=torch.empty(2, 2, 4, 4)), ValueError, r"^out must have shape"),
], ids=["pool-dtype", "pool-layout", "pool-rows-not-dense", "pool-rows-overlap", "pool-row-misaligned",
        "idx-dtype", "idx-type", "idx-shape", "idx-high", "idx-low",
        "idx-duplicate", "idx-too-few-columns", "accepted-1d", "accepted-range", "out-shape"])
def test_decode_rejects_bad_arguments(backend, mutation, exc, pattern):
    t, kw, a = _bad(mutation)
    snapshot = a["pool"].clone() if isinstance(a["pool"], torch.Tensor) else None
    with pytest.raises(exc, match=pattern):
        _decode(t, kw, a["pool"], a["idx"], **a["extra"])
    assert torch.equal(a["pool"], snapshot), "a failing call modified the pool"


def test_decode_refuses_float64_on_the_triton_backend(monkeypatch):
    # the kernel used to compute float64 tokens in fp32; the PyTorch path computes them in float64
    t, kw, a = _bad(lambda a: None)
    t = {n: x.double() for n, x in t.items()}
    snapshot = a["pool"].clone()
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    with pytest.raises(TypeError, match=r"^q must be float16, bfloat16 or float32 for the Triton kernels, "
                                        r"got torch.float64; use KDAKIT_BACKEND=torch for float64$"):
        _decode(t, kw, a["pool"], a["idx"])
    assert torch.equal(a["pool"], snapshot), "a failing call modified the pool"
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    o = _decode(t, kw, a["pool"], a["idx"])
    ref_o, ref_final = _naive(t, kw, snapshot[a["idx"].long()])
    assert o.dtype == torch.float64
    assert_close("o", ref_o, o, 1e-12)
    assert_close("rows", ref_final, a["pool"][a["idx"].long()], 1e-6)  # the pool keeps its fp32


def test_decode_rejects_a_pool_on_another_device(backend):
    t, kw, a = _bad(lambda a: None)
    with pytest.raises(ValueError, match="^state_pool must be on q's device cpu, got meta"):
        _decode(t, kw, a["pool"].to("meta"), a["idx"])


def test_decode_launch_config_rule():
    """The wide tile from the swept grid size on, one-token steps only (the sweep measured only those)."""
    from kdakit.ops.kda.serving.decode import (DECODE_BLOCK_V, DECODE_NUM_WARPS, WIDE_DECODE_BLOCK_V,
                                       WIDE_DECODE_NUM_WARPS, decode_launch_config)

    small, wide = (DECODE_BLOCK_V, DECODE_NUM_WARPS), (WIDE_DECODE_BLOCK_V, WIDE_DECODE_NUM_WARPS)
    assert decode_launch_config(64, 1, 32, 128) == small   # 4096 programs of the wide tile
    assert decode_launch_config(256, 1, 32, 128) == wide   # 16384
    assert decode_launch_config(4096, 1, 32, 128) == wide
    assert decode_launch_config(4096, 2, 32, 128) == small  # speculative / multi-token steps: not swept
    assert decode_launch_config(4096, 1.5, 32, 128) == small


def test_wide_and_small_decode_tiles_agree_under_the_interpreter():
    """Both launch configs of the pool kernel on the same step: the same outputs and pool rows (to fp32
    round-off: the warp count only reorders the key sums)."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tier")
    from kdakit.ops.kda.serving.decode import decode_options, launch_kda_decode

    gen = torch.Generator().manual_seed(5)
    N, H, K, V = 3, 2, 16, 128  # V = 128: the wide tile (64 rows) and the small one (16) both split it
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, g = r(N, 1, H, K), r(N, 1, H, K), r(N, 1, H, V), r(N, 1, H, K)
    beta = r(N, 1, H)
    pool = 0.3 * r(N + 1, H, V, K)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32)
    A_log = 0.5 * r(H)
    outs = []
    for block_v, num_warps in ((16, 1), (64, 2)):
        p, o = pool.clone(), torch.empty_like(v)
        opts = decode_options(q, k, v, g, beta, A_log=A_log, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True)
        launch_kda_decode(q, k, v, g, beta, p, idx, None, o, opts, A_log=A_log, dt_bias=None, cu_seqlens=None, N=N,
                          block_v=block_v, num_warps=num_warps)
        outs.append((o, p))
    assert_close("o", outs[0][0], outs[1][0], 1e-6)
    assert_close("pool", outs[0][1], outs[1][1], 1e-6)
    assert not torch.equal(outs[0][1], pool)  # the step wrote the pool rows
