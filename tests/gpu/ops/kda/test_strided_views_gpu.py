"""GPU tier of strided token views on the recurrent and decode kernels: q, k, v, g and beta split from one fused
projection, ``transpose``d ``[T, B, ...]`` buffers and every other head of a wider tensor, at real shapes (bf16,
K = V = 128), read in place through their strides, give the contiguous call's bits: output, final state, every
gradient (one-pass and segmented backward, a strided dO), the one-token decode step and the pool kernel's
multi-token and packed steps (pool rows, a strided ``out``), and the FLA serving path."""

import pytest
import torch

from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.ops.kda.recurrent.api import fused_recurrent_kda
from kdakit.testing import make_kda_inputs

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOKENS = ("q", "k", "v", "g", "beta")
PARAMS = ("A_log", "dt_bias", "initial_state")


def strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values as a view of a wider tensor: a ``[T, B, ...]`` buffer transposed, or every other head."""
    if layout == "transpose":
        view = x.detach().transpose(0, 1).contiguous().transpose(0, 1)
    else:
        wide = torch.zeros(*x.shape[:2], 2 * x.shape[2], *x.shape[3:], dtype=x.dtype, device=x.device)
        wide[:, :, ::2] = x.detach()
        view = wide[:, :, ::2]
    assert torch.equal(view, x) and not view.is_contiguous()
    return view


def fused_split(t: dict) -> dict:
    """q, k, v, g, beta split from one fused projection ``[B, T, sum of widths]``."""
    flat = [t[n].detach().reshape(*t[n].shape[:2], -1) for n in TOKENS]
    parts = torch.cat(flat, -1).split([f.shape[-1] for f in flat], -1)
    views = {n: p.view(t[n].shape) for n, p in zip(TOKENS, parts)}
    for n, x in views.items():
        assert torch.equal(x, t[n]) and not x.is_contiguous(), n
    return views


def as_views(t: dict, layout: str) -> dict:
    return dict(t, **(fused_split(t) if layout == "split" else {n: strided(t[n], layout) for n in TOKENS}))


CASES = {
    # layout: make_kda_inputs arguments
    "split": dict(B=1, T=1000, H=4, HV=8, seqlens=[700, 0, 300], gate="softplus", initial_state="kv"),
    "transpose": dict(B=3, T=300, H=4, HV=8, gate="safe", initial_state="vk"),
    "heads": dict(B=2, T=257, H=4, HV=4, gate="softplus", initial_state="kv"),
}


def _inputs(seed, **kw):
    inp = make_kda_inputs(K=128, V=128, dtype=torch.bfloat16, device=DEV, generator=torch.Generator().manual_seed(seed),
                          **kw)
    return {n: x.detach() for n, x in inp["tensors"].items()}, dict(inp["kwargs"])


def _recurrent(t, kw, do, dht, **extra):
    t = {n: x.detach().requires_grad_() for n, x in t.items()}  # detach keeps a view's strides
    o, ht = fused_recurrent_kda(*(t[n] for n in TOKENS), **{n: t[n] for n in PARAMS}, **dict(kw, **extra))
    grads = torch.autograd.grad([o, ht], list(t.values()), [do, dht])
    return dict({"o": o.detach(), "ht": ht.detach()}, **{"d" + n: gr for n, gr in zip(t, grads)})


@pytest.mark.parametrize("segment_tokens", [1024, 128], ids=["one-pass", "segmented"])
@pytest.mark.parametrize("layout", list(CASES))
def test_recurrent_views_give_the_contiguous_bits(layout, segment_tokens):
    t, kw = _inputs(1, **CASES[layout])
    gen = torch.Generator(device=DEV).manual_seed(2)
    do = torch.randn(t["v"].shape, generator=gen, device=DEV).to(torch.bfloat16)
    dht = torch.randn(t["initial_state"].shape, generator=gen, device=DEV)
    ref = _recurrent(t, kw, do, dht, segment_tokens=segment_tokens)
    got = _recurrent(as_views(t, layout), kw, strided(do, "heads" if layout == "split" else layout), dht,
                     segment_tokens=segment_tokens)
    for name, r in ref.items():
        assert torch.isfinite(r.float()).all(), name
        assert torch.equal(got[name], r), f"{layout}: {name} differs from the contiguous call's"


def _decode_inputs(seed, N, T, seqlens=None, pool_dtype=torch.bfloat16):
    B, TT = (1, sum(seqlens)) if seqlens else (N, T)
    inp = make_kda_inputs(B=B, T=TT, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, device=DEV, gate="softplus",
                          seqlens=seqlens, generator=torch.Generator().manual_seed(seed))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = {n: x for n, x in inp["kwargs"].items() if n != "safe_gate"}
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    pool = (0.3 * torch.randn(3 * N + 3, 32, 128, 128, generator=gen, device=DEV)).to(pool_dtype)
    return t, kw, pool


def _decode(t, kw, pool, idx, **extra):
    pool = pool.clone()
    o = kda_decode(*(t[n] for n in TOKENS), pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"], **dict(kw, **extra))
    return o, pool


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["one-token step N=64", "three tokens, per-token rows", "packed"])
def test_decode_views_give_the_contiguous_bits(case, pool_dtype):
    if case == "one-token step N=64":
        N = 64
        t, kw, pool = _decode_inputs(3, N=N, T=1, pool_dtype=pool_dtype)
        idx = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(4))[:N].int().to(DEV)
        idx[5] = -1
        layouts = ("split", "heads")  # one token: a transposed [1, N] buffer is contiguous
    elif case == "three tokens, per-token rows":
        N = 8
        t, kw, pool = _decode_inputs(5, N=N, T=3, pool_dtype=pool_dtype)
        idx = torch.arange(3 * N, dtype=torch.int32, device=DEV).view(N, 3)
        kw["num_accepted_tokens"] = torch.tensor([1, 2, 3] * 2 + [1, 3], dtype=torch.int32, device=DEV)
        layouts = ("split", "transpose", "heads")
    else:
        N = 5
        t, kw, pool = _decode_inputs(7, N=N, T=None, seqlens=[3, 0, 1, 4, 2], pool_dtype=pool_dtype)
        idx = torch.tensor([4, 0, 7, 2, 9], dtype=torch.int32, device=DEV)
        layouts = ("split", "heads")
    ref_o, ref_pool = _decode(t, kw, pool, idx)
    assert torch.isfinite(ref_o.float()).all()
    V = t["v"].shape[3]
    for layout in layouts:
        wide = torch.full((*t["v"].shape[:3], 2 * V), 5.0, dtype=t["v"].dtype, device=DEV)
        out = wide[..., V:]  # the second half of every row of a wider buffer
        o, got_pool = _decode(as_views(t, layout), kw, pool, idx, out=out)
        assert o is out and torch.equal(o, ref_o), f"{layout}: o"
        assert torch.equal(got_pool, ref_pool), f"{layout}: pool"
        assert torch.equal(wide[..., :V], torch.full_like(ref_o, 5.0)), f"{layout}: out's other columns"


def test_serving_path_views_give_the_contiguous_bits():
    """fused_recurrent_kda's FLA serving arguments (the pool kernel, in-place per-token rows) from a fused split."""
    N = 16
    t, kw, pool = _decode_inputs(9, N=N, T=2, pool_dtype=torch.float32)
    pool = pool.transpose(-1, -2).contiguous()  # [P, HV, K, V]
    idx = torch.arange(2 * N, dtype=torch.int32, device=DEV).view(N, 2)
    kw = dict(kw, ssm_state_indices=idx, inplace_final_state=True)

    def run(x):
        p = pool.clone()
        with torch.no_grad():
            o, _ = fused_recurrent_kda(*(x[n] for n in TOKENS), A_log=x["A_log"], dt_bias=x["dt_bias"],
                                       initial_state=p, **kw)
        return o, p

    ref_o, ref_pool = run(t)
    o, p = run(dict(t, **fused_split(t)))
    assert torch.equal(o, ref_o) and torch.equal(p, ref_pool)
