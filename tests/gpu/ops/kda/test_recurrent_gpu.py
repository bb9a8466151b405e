"""GPU tier for recurrent KDA and decode: real shapes, every gradient, NaN-poisoned buffers,
bitwise reruns, CUDA-graph capture (no allocation) and replay == eager."""

import pytest
import torch

from kdakit.ops.kda.serving.decode import decode_options, kda_decode, kda_decode_reference
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.ops.kda.recurrent.backward import GRAD_NAMES, recurrent_kda_backward
from kdakit.ops.kda.recurrent.segmented import backward_scratch_bytes
from kdakit.ops.kda.recurrent.workspace import Workspace
from kdakit.testing import assert_close, make_kda_inputs

from ...capture import capture_after_warm_call

pytestmark = pytest.mark.gpu

DEV = "cuda"
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
# bf16 inputs and bf16 gradients against the float64 definition: bf16 rounding of inputs
# and outputs is ~2^-9 relative, sums over long sequences grow it a little.
BF16_RATIO = 2e-2
FP32_RATIO = 1e-4


def _inputs(seed, dtype=torch.bfloat16, **kw):
    inp = make_kda_inputs(generator=torch.Generator().manual_seed(seed), dtype=dtype, device=DEV, **kw)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    return t, dict(inp["kwargs"])


def _cotangents(seed, t, kw, N):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    do = torch.randn(t["v"].shape, generator=gen, device=DEV).to(t["v"].dtype)
    HV, V, K = t["v"].shape[2], t["v"].shape[3], t["q"].shape[3]
    shape = (N, HV, V, K) if kw.get("state_v_first") else (N, HV, K, V)
    return do, torch.randn(shape, generator=gen, device=DEV)


def _call_fwd(t, kw, **extra):
    return fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t.get("A_log"),
                               dt_bias=t.get("dt_bias"), initial_state=t.get("initial_state"), **dict(kw, **extra))


def _bwd_args(t, kw, do, dht):
    named = {n: t.get(n) for n in ("A_log", "dt_bias", "initial_state")}
    opts = {n: x for n, x in kw.items() if n != "output_final_state"}
    return (t["q"], t["k"], t["v"], t["g"], t["beta"], do, dht), dict(named, **opts)


def _naive_grads(t, kw, do, dht):
    d = {n: x.double().requires_grad_() for n, x in t.items()}
    o, ht = naive_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=d.get("A_log"),
                                dt_bias=d.get("dt_bias"), initial_state=d.get("initial_state"),
                                **dict(kw, output_final_state=True))
    present = [n for n in NAMES if n in d]
    grads = torch.autograd.grad([o, ht], [d[n] for n in present], [do.double(), dht.double()])
    return o.detach(), ht.detach(), dict(zip(present, grads))


SHAPES = {
    "B1 T17 H16 K=V=128": dict(B=1, T=17, H=16, K=128, V=128, gate="safe", initial_state="vk"),
    "varlen [17, 33, 65] H4": dict(T=115, H=4, K=128, V=128, gate="safe", seqlens=[17, 33, 65], initial_state="vk"),
    "varlen with empty, GVA 2x, softplus": dict(T=70, H=4, HV=8, K=128, V=128, gate="softplus",
                                                seqlens=[30, 0, 40], initial_state="kv"),
    "T1 decode-like B64 H8": dict(B=64, T=1, H=8, K=128, V=128, gate="safe", initial_state="vk"),
    "K64 V96 log-decay": dict(B=2, T=40, H=2, HV=4, K=64, V=96, gate="none", initial_state="kv"),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_forward_and_every_gradient_at_real_shapes(case):
    t, kw = _inputs(1, **SHAPES[case])
    N = len(kw["cu_seqlens"]) - 1 if "cu_seqlens" in kw else t["q"].shape[0]
    do, dht = _cotangents(2, t, kw, N)
    o, ht = _call_fwd(t, kw)
    pos, named = _bwd_args(t, kw, do, dht)
    grads = recurrent_kda_backward(*pos, **named)
    ref_o, ref_ht, ref = _naive_grads(t, kw, do, dht)
    assert_close("o", ref_o, o, BF16_RATIO)
    assert_close("final_state", ref_ht, ht, FP32_RATIO * 10)
    for gname, name in zip(GRAD_NAMES, NAMES):
        if name in ref:
            assert_close(gname, ref[name], getattr(grads, gname), BF16_RATIO)


def test_autograd_equals_direct_backward_bitwise():
    t, kw = _inputs(3, **SHAPES["varlen [17, 33, 65] H4"])
    do, dht = _cotangents(4, t, kw, 3)
    leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
    o, ht = _call_fwd(leaves, kw)
    auto = torch.autograd.grad([o, ht], [leaves[n] for n in NAMES if n in leaves], [do, dht])
    pos, named = _bwd_args(t, kw, do, dht)
    direct = recurrent_kda_backward(*pos, **named)
    for a, d in zip(auto, [x for x in direct if x is not None]):
        assert torch.equal(a, d)


def _poisoned_out(t):
    return [None if t.get(n) is None else torch.full_like(t[n], float("nan")) for n in NAMES]


def test_poisoned_buffers_and_bitwise_reruns():
    t, kw = _inputs(5, **SHAPES["varlen with empty, GVA 2x, softplus"])
    do, dht = _cotangents(6, t, kw, 3)
    pos, named = _bwd_args(t, kw, do, dht)
    ws = Workspace(DEV)
    first = recurrent_kda_backward(*pos, **named, workspace=ws, out=_poisoned_out(t))
    for gname, x in zip(GRAD_NAMES, first):
        assert x is None or torch.isfinite(x).all(), gname
    for buf in ws._buffers.values():
        buf.fill_(float("nan"))
    again = recurrent_kda_backward(*pos, **named, workspace=ws, out=_poisoned_out(t))
    for a, b in zip(first, again):
        assert (a is None and b is None) or torch.equal(a, b)
    o1, h1 = _call_fwd(t, kw, out=torch.full_like(t["v"], float("nan")))
    o2, h2 = _call_fwd(t, kw)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def _keep_and_restore(out, pool, start):
    """After an eager warm call that updated ``pool`` in place: (its output, the pool) kept, the pool restored."""
    kept = out.clone(), pool.clone()
    pool.copy_(start)
    return kept


def test_cuda_graph_forward_and_backward_capture_and_replay():
    t, kw = _inputs(7, B=1, T=1024, H=4, K=128, V=128, gate="safe", initial_state="vk")
    do, dht = _cotangents(8, t, kw, 1)
    o_buf = torch.empty_like(t["v"])
    ht_buf = torch.empty(1, 4, 128, 128, device=DEV)
    grads_out = [torch.empty_like(t[n]) for n in NAMES]
    ws = Workspace(DEV)
    pos, named = _bwd_args(t, kw, do, dht)

    def step():
        with torch.no_grad():
            _call_fwd(t, kw, out=o_buf, final_state_out=ht_buf, workspace=ws)
        recurrent_kda_backward(*pos, **named, workspace=ws, out=grads_out)

    bufs = [o_buf, ht_buf, *grads_out]
    graph, stream, eager = capture_after_warm_call(step, after_warm=lambda: [x.clone() for x in bufs])

    for x in bufs:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, bufs):
        assert torch.equal(a, b)

    # new input values, same tensors: replay == a fresh eager call
    for n in ("q", "k", "v", "g"):
        t[n].copy_(torch.randn_like(t[n], dtype=torch.float32).to(t[n].dtype))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [x.clone() for x in bufs]
    with torch.cuda.stream(stream):
        step()
    stream.synchronize()
    for a, b in zip(replayed, bufs):
        assert torch.equal(a, b)


def test_backward_capture_without_warm_call_raises():
    """The backward needs scratch: capturing it with a workspace no eager call sized raises. (The
    forward needs none and captures without a warm call: tests/gpu/ops/kda/test_graph_capture_gpu.py.)"""
    t, kw = _inputs(9, B=1, T=4, H=2, K=64, V=64, gate="safe", initial_state="vk")
    do, dht = _cotangents(10, t, kw, 1)
    pos, named = _bwd_args(t, kw, do, dht)
    grads_out = [torch.empty_like(t[n]) for n in NAMES]
    _call_fwd(t, kw)  # compiles the forward kernel outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="eager call"):
        with torch.cuda.graph(graph, stream=stream):
            recurrent_kda_backward(*pos, **named, workspace=Workspace(DEV), out=grads_out)


# --- segmented backward (sequences longer than segment_tokens) ------------------------------

# the same fp32 values rounded to bf16 (dq, dk, dv, dbeta, dh0), or gate gradients whose fp32
# sums are split differently: agreement far inside the bf16 rounding
SEGMENT_VS_ONE_PASS = 2e-3


def test_segmented_backward_matches_naive_and_one_pass():
    t, kw = _inputs(14, T=5200, H=4, HV=8, K=128, V=128, gate="safe", seqlens=[3000, 0, 1500, 700],
                    initial_state="vk")
    do, dht = _cotangents(15, t, kw, 4)
    pos, named = _bwd_args(t, kw, do, dht)
    seg = recurrent_kda_backward(*pos, **named, segment_tokens=1024)
    one = recurrent_kda_backward(*pos, **named, segment_tokens=10 ** 9)
    _, _, ref = _naive_grads(t, kw, do, dht)
    for gname, name in zip(GRAD_NAMES, NAMES):
        assert_close(gname, ref[name], getattr(seg, gname), BF16_RATIO)
        assert_close(gname + " (vs one pass)", getattr(one, gname).double(), getattr(seg, gname),
                     SEGMENT_VS_ONE_PASS)


def test_segmented_scratch_at_32k_tokens():
    """T = 32K, H = HV = 32: the workspace holds what backward_scratch_bytes predicts (~347 MiB)."""
    t, kw = _inputs(16, B=1, T=32768, H=32, K=128, V=128, gate="safe", initial_state="vk")
    do, dht = _cotangents(17, t, kw, 1)
    pos, named = _bwd_args(t, kw, do, dht)
    out = [torch.empty_like(t[n]) for n in NAMES]
    ws = Workspace(DEV)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    recurrent_kda_backward(*pos, **named, workspace=ws, out=out, segment_tokens=1024)
    torch.cuda.synchronize()
    dtypes = dict(q=torch.bfloat16, k=torch.bfloat16, v=torch.bfloat16, g=torch.bfloat16, beta=torch.bfloat16,
                  do=torch.bfloat16, A_log=torch.float32, dt_bias=torch.float32)
    predicted = backward_scratch_bytes([32768], 32, 32, 128, 128, segment_tokens=1024, dtypes=dtypes)
    assert ws.nbytes == predicted and predicted < 400 * 2 ** 20
    # the only other allocation is the segment plan (none for fixed length)
    assert torch.cuda.max_memory_allocated() - base <= predicted + 2 ** 20
    for gname, x in zip(GRAD_NAMES, out):
        assert torch.isfinite(x).all(), gname


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_segmented_cuda_graph_capture_and_replay(varlen):
    shape = dict(T=3000, seqlens=[1800, 0, 1200]) if varlen else dict(B=2, T=1500)
    t, kw = _inputs(18, H=4, K=128, V=128, gate="safe", initial_state="vk", **shape)
    N = 3 if varlen else 2
    do, dht = _cotangents(19, t, kw, N)
    grads_out = [torch.empty_like(t[n]) for n in NAMES]
    ws = Workspace(DEV)
    pos, named = _bwd_args(t, kw, do, dht)

    def step():
        recurrent_kda_backward(*pos, **named, workspace=ws, out=grads_out, segment_tokens=512)

    graph, stream, eager = capture_after_warm_call(step, after_warm=lambda: [x.clone() for x in grads_out])
    for x in grads_out:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, grads_out):
        assert torch.equal(a, b)
    # new values, same tensors: replay == a fresh eager call
    for n in ("q", "k", "v", "g"):
        t[n].copy_(torch.randn_like(t[n], dtype=torch.float32).to(t[n].dtype))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [x.clone() for x in grads_out]
    with torch.cuda.stream(stream):
        step()
    stream.synchronize()
    for a, b in zip(replayed, grads_out):
        assert torch.equal(a, b)


# --- decode -----------------------------------------------------------------------------------

def _decode_inputs(seed, N, T, H=32, K=128, V=128):
    t, kw = _inputs(seed, B=N, T=T, H=H, K=K, V=V, gate="safe")
    kw.pop("safe_gate")
    return t, kw


def _decode(t, kw, pool, idx, **extra):
    return kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"],
                      dt_bias=t["dt_bias"], **dict(kw, **extra))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_decode_real_shapes(pool_dtype, T):
    N, P = 64, 80
    t, kw = _decode_inputs(10, N, T)
    pool = (0.3 * torch.randn(P, 32, 128, 128, device=DEV)).to(pool_dtype)
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    idx[::7] = -1
    before = pool.clone()
    o = _decode(t, kw, pool, idx)
    ref_pool = before.clone()
    ref_o = torch.empty_like(o)
    opts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                          scale=128 ** -0.5, lower_bound=kw["lower_bound"], use_gate_in_kernel=True,
                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    kda_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, idx, None, ref_o, opts,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], cu_seqlens=None, N=N)
    assert_close("o", ref_o, o, 1e-2 if pool_dtype == torch.bfloat16 else BF16_RATIO)
    assert_close("pool", ref_pool.float(), pool.float(), 1e-2 if pool_dtype == torch.bfloat16 else 1e-5)
    used = set(idx.tolist())
    for r in range(P):
        if r not in used:
            assert torch.equal(pool[r], before[r]), r
    padded = (idx < 0).nonzero().flatten()
    assert torch.equal(o[padded], torch.zeros_like(o[padded]))


def test_decode_large_batch():
    # N * HV = 131072 programs: more than grid axis 1 holds (65535); they sit on axis 0
    N, P = 4096, 4096
    t, kw = _decode_inputs(12, N, 1)
    pool = (0.3 * torch.randn(P, 32, 128, 128, device=DEV)).to(torch.bfloat16)
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    ref_pool = pool.clone()
    o = _decode(t, kw, pool, idx)
    ref_o = torch.empty_like(o)
    opts = decode_options(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                          scale=128 ** -0.5, lower_bound=kw["lower_bound"], use_gate_in_kernel=True,
                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    kda_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], ref_pool, idx, None, ref_o, opts,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], cu_seqlens=None, N=N)
    assert_close("o", ref_o, o, 1e-2)
    assert_close("pool", ref_pool.float(), pool.float(), 1e-2)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_step_kernel_gives_the_pool_kernels_bits(monkeypatch, pool_dtype):
    """The one-token step kernel (serving/step.py, [8, K] tiles) against the pool kernel it stands in for
    ([16, K] tiles) at a real shape: the same bits, padded rows included."""
    import kdakit.ops.kda.serving.decode as decode

    N, P = 64, 80
    t, kw = _decode_inputs(14, N, 1)
    pool_a = (0.3 * torch.randn(P, 32, 128, 128, device=DEV)).to(pool_dtype)
    pool_b = pool_a.clone()
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    idx[::9] = -1
    o_step = _decode(t, kw, pool_a, idx)
    monkeypatch.setattr(decode, "step_kernel_applies", lambda **_: False)
    o_pool = _decode(t, kw, pool_b, idx)
    assert torch.equal(o_step, o_pool), (o_step.float() - o_pool.float()).abs().max()
    assert torch.equal(pool_a, pool_b), (pool_a.float() - pool_b.float()).abs().max()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_multi_token_equals_single_steps_bitwise(pool_dtype):
    t, kw = _decode_inputs(11, 16, 3)
    pool_a = (0.3 * torch.randn(20, 32, 128, 128, device=DEV)).to(pool_dtype)
    pool_b = pool_a.clone()
    idx = torch.arange(16, device=DEV, dtype=torch.int32)
    o_all = _decode(t, kw, pool_a, idx)
    for j in range(3):
        step = {n: (x[:, j:j + 1].contiguous() if x.dim() >= 3 else x) for n, x in t.items()}
        assert torch.equal(_decode(step, kw, pool_b, idx)[:, 0], o_all[:, j])
    assert torch.equal(pool_a, pool_b)


def test_decode_bf16_state_error_over_4096_steps():
    """Triton bf16 pool vs fp32 pool over 4096 tokens at K = V = 128 (bound as in the CPU test)."""
    gen = torch.Generator(device=DEV).manual_seed(12)
    N, T, H, K, V = 2, 4096, 2, 128, 128
    q, k = (torch.randn(N, T, H, K, device=DEV, generator=gen) for _ in range(2))
    v = torch.randn(N, T, H, V, device=DEV, generator=gen)
    g = -(0.05 + 0.5 * torch.nn.functional.softplus(torch.randn(N, T, H, K, device=DEV, generator=gen)))
    beta = torch.randn(N, T, H, device=DEV, generator=gen)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, check_indices=False)
    idx = torch.arange(N, device=DEV, dtype=torch.int32)
    pool32 = torch.zeros(N, H, V, K, device=DEV)
    pool16 = torch.zeros(N, H, V, K, device=DEV, dtype=torch.bfloat16)
    o32 = kda_decode(q, k, v, g, beta, pool32, idx, **kw)
    o16 = kda_decode(q, k, v, g, beta, pool16, idx, **kw)
    u = 2.0 ** -8
    rel = (pool16.float() - pool32).flatten(1).norm(dim=1) / pool32.flatten(1).norm(dim=1)
    assert rel.max() < 2 * u and rel.min() > 0.1 * u, rel
    assert_close("o", o32, o16, 2 * u)


def test_decode_cuda_graph_capture_and_replay():
    N, P = 64, 64
    t, kw = _decode_inputs(13, N, 1)
    pool = (0.3 * torch.randn(P, 32, 128, 128, device=DEV)).to(torch.bfloat16)
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    out = torch.empty_like(t["v"])
    ws = Workspace(DEV)
    start = pool.clone()
    graph, _, (eager_o, eager_pool) = capture_after_warm_call(lambda: _decode(t, kw, pool, idx, out=out, workspace=ws),
                                                              after_warm=lambda: _keep_and_restore(out, pool, start))
    pool.copy_(start)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_o) and torch.equal(pool, eager_pool)


# --- fused_recurrent_kda's serving arguments (FLA 0.6.0's fused_recurrent_kda_fwd) -------------

def _serving_case(seed, pool_dtype, v_first, padded):
    """N = 64 sequences of 0-3 tokens (packed), a pool of 256 rows (optionally padded rows),
    [N, 3] per-token rows with -1 in the columns no token reaches, random accepted counts."""
    N, S, P, H, K, V = 64, 3, 256, 32, 128, 128
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, S + 1, (N,), generator=gen)
    lens[0] = S
    t, kw = _inputs(seed, B=1, T=int(lens.sum()), H=H, K=K, V=V, gate="safe", seqlens=lens.tolist())
    kw.pop("safe_gate")
    rows = torch.randperm(P, generator=gen)[:N * S].view(N, S).to(torch.int32)
    rows[torch.arange(S)[None, :] >= lens[:, None].clamp(min=1)] = -1  # never written or read
    rows[lens == 0] = -1  # sequences without tokens read nothing
    # in [1, lens]: the accepted column is one this step's tokens also write, so it holds a row
    accepted = (torch.randint(0, S, (N,), generator=gen) % lens.clamp(min=1) + 1).to(torch.int32)
    shape = (P, H, V, K) if v_first else (P, H, K, V)
    init = (0.3 * torch.randn(*shape, generator=gen)).to(pool_dtype)

    def make_pool():
        """A fresh pool holding ``init``, and the padding after each row (None for a dense pool)."""
        if not padded:
            return init.clone().to(DEV), None
        row = H * K * V
        buf = torch.full((P, row + 64), 7.0, dtype=pool_dtype, device=DEV)
        pool = buf[:, :row].view(shape)
        pool.copy_(init)
        return pool, buf[:, row:]

    return t, kw, rows.to(DEV), accepted.to(DEV), make_pool


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_serving_args_match_fla(monkeypatch, pool_dtype, v_first, padded):
    """Speculative decoding into a pool, in place: the Triton kernel against kdakit's PyTorch
    path (always) and against FLA's fused_recurrent_kda_fwd on the same inputs (when fla imports)."""
    t, kw, rows, accepted, make_pool = _serving_case(20, pool_dtype, v_first, padded)
    kw = dict(kw, state_v_first=v_first)
    cu = kw["cu_seqlens"]
    args = dict(ssm_state_indices=rows, num_accepted_tokens=accepted, inplace_final_state=True)
    pool, pad = make_pool()
    o, final = _call_fwd(dict(t, initial_state=pool), kw, **args)
    assert final is pool
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    ref_pool, _ = make_pool()
    ref_o, _ = _call_fwd(dict(t, initial_state=ref_pool), kw, **args)
    pool_ratio = 1e-2 if pool_dtype == torch.bfloat16 else 1e-5
    assert_close("o vs PyTorch path", ref_o, o, 1e-4 if pool_dtype == torch.float32 else 1e-2)
    assert_close("pool vs PyTorch path", ref_pool.float(), pool.float(), pool_ratio)
    if pad is not None:
        assert torch.equal(pad, torch.full_like(pad, 7.0)), "the kernel wrote into the row padding"

    fla = pytest.importorskip("fla.ops.kda.fused_recurrent")
    fla_pool, _ = make_pool()  # FLA reads rows through stride(0) too
    fla_o, fla_final = fla.fused_recurrent_kda_fwd(
        t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=fla_pool,
        inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=rows, num_accepted_tokens=accepted,
        state_v_first=v_first, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"])
    assert fla_final is fla_pool
    assert_close("o vs FLA", fla_o, o, 1e-4 if pool_dtype == torch.float32 else 1e-2)
    assert_close("pool vs FLA", fla_pool.float(), pool.float(), pool_ratio)


@pytest.mark.parametrize("v_first", [False, True])
def test_serving_decode_not_in_place_matches_fla(v_first):
    """One token per sequence, [N] indices, inplace_final_state=False: a new fp32 [N, ...] final state."""
    N, P = 64, 96
    t, kw = _decode_inputs(21, N, 1)
    kw = dict(kw, state_v_first=v_first, output_final_state=True)
    shape = (P, 32, 128, 128)
    pool = 0.3 * torch.randn(*shape, device=DEV)
    before = pool.clone()
    idx = torch.randperm(P, device=DEV)[:N].to(torch.int32)
    o, final = _call_fwd(dict(t, initial_state=pool), kw, ssm_state_indices=idx)
    assert torch.equal(pool, before) and final.shape == (N, 32, 128, 128) and final.dtype == torch.float32
    h0 = before[idx.long()]
    ref = naive_recurrent_kda(*(t[n].double() for n in ("q", "k", "v", "g", "beta")), A_log=t["A_log"].double(),
                              dt_bias=t["dt_bias"].double(), initial_state=h0.double(), **kw)
    assert_close("o", ref[0], o, BF16_RATIO)
    assert_close("final", ref[1], final, 1e-4)
    fla = pytest.importorskip("fla.ops.kda.fused_recurrent")
    fla_o, fla_final = fla.fused_recurrent_kda_fwd(
        t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"], initial_state=pool,
        inplace_final_state=False, output_final_state=True, ssm_state_indices=idx, state_v_first=v_first,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=kw["lower_bound"])
    assert_close("o vs FLA", fla_o, o, 1e-2)
    assert_close("final vs FLA", fla_final, final, 1e-5)


def test_serving_cuda_graph_capture_and_replay():
    t, kw, rows, accepted, make_pool = _serving_case(22, torch.bfloat16, False, True)
    pool, _ = make_pool()
    start = pool.clone()
    out = torch.empty_like(t["v"])
    ws = Workspace(DEV)
    args = dict(ssm_state_indices=rows, num_accepted_tokens=accepted, inplace_final_state=True, out=out,
                workspace=ws)
    graph, _, (eager_o, eager_pool) = capture_after_warm_call(
        lambda: _call_fwd(dict(t, initial_state=pool), kw, **args),
        after_warm=lambda: _keep_and_restore(out, pool, start))
    pool.copy_(start)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_o) and torch.equal(pool, eager_pool)
