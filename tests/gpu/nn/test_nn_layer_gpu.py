"""GPU tier of ``kdakit.nn.KimiDeltaAttention`` (run on the H200 with KDAKIT_TEST_TIER=gpu):
the bf16 layer on CUDA (Triton kernels) against the same weights in float64 on CPU (PyTorch
path) forward and backward, attention_mask padding, prefill + decode through the cache and the
pool path against one call, the pool path (prefill + step) in one plain CUDA graph against eager,
FLA's layer when fla imports, and the layer's peak memory at 1 x 128K against its predicted floor.

Memory floor (bf16, FLA's KimiDeltaAttention defaults: hidden 2048, 16 heads of 128, expand_v 1,
conv 4, softplus gate). The step: the caller holds x (requires grad) and dy, runs
``y = layer(x)[0]; y.backward(dy)``; measured = ``max_memory_allocated`` during the step minus
the bytes allocated before it (weights, their grads, x, dy: a warm-up step ran first). The
layer's peak is inside the KDA op's backward, where the bytes that must be live are

* the op's own modelled peak, ``kdakit.memory.model.kdakit_model`` (from the plan the kernels
  use): its inputs q, k, v, g, beta, its dO, its gradients and its state series, less its
  output O (the caller of the op holds O; in the layer the norm's backward has consumed it);
* the pre-conv projections of q, k, v (saved by the short convolution: its backward recomputes
  from them), ``3 T D`` bf16;
* f_proj's bottleneck activation ``[T, head_v_dim]`` (saved by its second linear);
* the layer's output y, held by the caller, and x's gradient being accumulated, ``2 T hidden``.

The assertion: measured <= 1.10 x that floor (the bound issue #10 sets for CP) + 64 MiB
(cuBLAS / allocator granules). What the bound leaves out, and so must fit in the 10 %: the
transients of the other stages (the conv's recompute in backward, the norm's 32 MiB blocks).
"""

import os

import pytest
import torch

from kdakit.memory.model import allocated_bytes, kdakit_model, protocol_spec
from kdakit.nn import KDACache, KimiDeltaAttention
from kdakit.testing import assert_close

from ..capture import capture_like_an_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
# bf16 weights/activations through ~10 matmuls and the chunked op against float64
BF16_RATIO = 3e-2
MEMORY_TOKENS = int(os.environ.get("KDAKIT_LAYER_MEMORY_TOKENS", 128 * 1024))
FLA_DEFAULTS = dict(hidden_size=2048, expand_v=1, head_dim=128, num_heads=16)
CONFIGS = {
    "fla_defaults_small": dict(hidden_size=512, head_dim=128, num_heads=4),
    "gva_safe_gate": dict(hidden_size=512, head_dim=64, num_heads=2, num_v_heads=8, safe_gate=True,
                          lower_bound=-5.0),
}


def make_pair(seed, **cfg):
    """A float64 CPU layer and a bf16 CUDA copy of it (A_log / dt_bias stay fp32)."""
    torch.manual_seed(seed)
    ref = KimiDeltaAttention(layer_idx=0, **cfg).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name not in ("A_log", "dt_bias", "o_norm.weight"):   # keep FLA's init where it is the point
                p.copy_(p + 0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    dev = KimiDeltaAttention(layer_idx=0, **cfg)
    dev.load_state_dict(ref.state_dict())
    dev = dev.to(DEV).bfloat16()
    assert dev.A_log.dtype == torch.float32 and dev.dt_bias.dtype == torch.float32
    return ref, dev


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_cuda_layer_matches_float64_cpu_forward_and_backward(name):
    ref, dev = make_pair(1, **CONFIGS[name])
    hidden = ref.hidden_size
    cu = torch.tensor([0, 700, 777, 1500], dtype=torch.int32)      # ragged, not chunk multiples
    x = rand(1, 1500, hidden, seed=2)
    dy = rand(1, 1500, hidden, seed=3)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref, cu_seqlens=cu)[0]
    g_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref, *ref.parameters()])
    x_dev = x.to(DEV, torch.bfloat16).requires_grad_()
    y_dev = dev(x_dev, cu_seqlens=cu.to(DEV))[0]
    g_dev = torch.autograd.grad((y_dev * dy.to(DEV, torch.bfloat16)).sum(), [x_dev, *dev.parameters()])
    assert_close(f"{name} y", y_ref, y_dev.double().cpu(), BF16_RATIO)
    for pname, a, b in zip(["x", *dict(ref.named_parameters())], g_ref, g_dev):
        assert torch.isfinite(b).all(), pname
        assert_close(f"{name} d{pname}", a, b.double().cpu(), BF16_RATIO)


def test_attention_mask_padding_on_cuda():
    _, dev = make_pair(4, **CONFIGS["fla_defaults_small"])
    lengths, T = [300, 129, 0, 64], 300
    x = rand(len(lengths), T, dev.hidden_size, seed=5).to(DEV, torch.bfloat16)
    mask = torch.zeros(len(lengths), T, dtype=torch.long, device=DEV)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1                                         # left padding, as tokenizers give
    with torch.no_grad():
        y = dev(x, attention_mask=mask)[0]
        assert torch.equal(y[mask == 0], torch.zeros_like(y[mask == 0]))
        for b, n in enumerate(lengths):
            if n:
                alone = dev(x[b:b + 1, T - n:])[0]
                assert_close(f"row {b}", alone.double(), y[b:b + 1, T - n:].double(), 1e-2)


def test_prefill_then_decode_equals_full_on_cuda():
    """Through a KDACache (FLA's protocol) and through the pools (forward with state_indices +
    step / kda_decode): prefill 200 tokens of each of 3 sequences, decode 8 more one by one."""
    _, dev = make_pair(6, **CONFIGS["gva_safe_gate"])
    N, pre, steps = 3, 200, 8
    x = rand(N, pre + steps, dev.hidden_size, seed=7).to(DEV, torch.bfloat16)
    with torch.no_grad():
        full = dev(x)[0].double()
        cache = KDACache()
        outs = [dev(x[:, :pre], past_key_values=cache, use_cache=True)[0]]
        for t in range(pre, pre + steps):
            outs.append(dev(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
        assert_close("cache prefill+decode", full, torch.cat(outs, 1).double(), 1e-2)
        P = 5
        pool = torch.zeros(P, dev.num_v_heads, dev.head_v_dim, dev.head_dim, device=DEV)
        conv = torch.zeros(P, dev.conv_channels, dev.conv_size - 1, device=DEV, dtype=torch.bfloat16)
        idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
        cu = torch.arange(N + 1, dtype=torch.int32, device=DEV) * pre
        o_pre = dev(x[:, :pre].reshape(1, N * pre, -1), cu_seqlens=cu, initial_state=pool, state_indices=idx,
                    state_v_first=True, conv_state=conv)[0].view(N, pre, -1)
        outs = [o_pre] + [dev.step(x[:, t:t + 1], conv, pool, idx) for t in range(pre, pre + steps)]
        assert_close("pool prefill+step", full, torch.cat(outs, 1).double(), 1e-2)
        assert float(pool[[1, 3]].abs().max()) == 0.0, "pool rows not in state_indices untouched"


def test_against_fla_layer_when_importable():
    fla_kda = pytest.importorskip("fla.layers.kda", reason="fla (with einops, transformers) is not installed")
    cfg = CONFIGS["fla_defaults_small"]
    torch.manual_seed(8)
    theirs = fla_kda.KimiDeltaAttention(layer_idx=0, **cfg).to(DEV).bfloat16()
    ours = KimiDeltaAttention(layer_idx=0, **cfg)
    ours.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()}, strict=True)
    ours = ours.to(DEV).bfloat16()
    for name in ("A_log", "dt_bias"):
        # FLA's .bfloat16() rounds its gate parameters; give ours the same (rounded) values
        getattr(ours, name).data.copy_(getattr(theirs, name).float())
    x = rand(2, 500, cfg["hidden_size"], seed=9).to(DEV, torch.bfloat16)
    dy = rand(2, 500, cfg["hidden_size"], seed=10).to(DEV, torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = theirs(xa)[0], ours(xb)[0]
    (dxa,) = torch.autograd.grad((ya * dy).sum(), [xa])
    (dxb,) = torch.autograd.grad((yb * dy).sum(), [xb])
    assert_close("vs FLA y", ya.double(), yb.double(), 2e-2)
    assert_close("vs FLA dx", dxa.double(), dxb.double(), 3e-2)
    Cache = pytest.importorskip("fla.models.utils").Cache

    def generate(prefill_layer, decode_layer, cache):
        outs = [prefill_layer(x[:, :300], past_key_values=cache, use_cache=True)[0]]
        for t in range(300, 304):
            outs.append(decode_layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
        return torch.cat(outs, 1).double()

    with torch.no_grad():
        want = generate(theirs, theirs, Cache())
        assert_close("vs FLA prefill+decode", want, generate(ours, ours, Cache()), 2e-2)
        # ours continues a cache FLA's layer wrote (and the other way round): one layout
        assert_close("FLA prefill, kdakit decode", want, generate(theirs, ours, Cache()), 2e-2)
        assert_close("kdakit prefill, FLA decode", want, generate(ours, theirs, Cache()), 2e-2)


def layer_floor_bytes(layer, T) -> dict:
    """The bytes that must be live at the layer's peak (see the module docstring)."""
    spec = protocol_spec(1, T, layer.num_v_heads, qk_heads=layer.num_heads, head_dim=layer.head_dim,
                         value_dim=layer.head_v_dim, varlen=False,
                         gate="softplus" if layer.lower_bound is None else "safe",
                         lower_bound=layer.lower_bound if layer.lower_bound is not None else -5.0)
    op = kdakit_model(spec)
    o = allocated_bytes((1, T, layer.num_v_heads, layer.head_v_dim), "bf16")
    parts = {
        "op peak less O": op.peak_bytes - o,
        "pre-conv q, k, v": 2 * allocated_bytes((1, T, layer.key_dim), "bf16")
        + allocated_bytes((1, T, layer.value_dim), "bf16"),
        "f_proj bottleneck": allocated_bytes((1, T, layer.head_v_dim), "bf16"),
        "y and dx": 2 * allocated_bytes((1, T, layer.hidden_size), "bf16"),
    }
    parts["floor"] = sum(parts.values())
    parts["op peak stage"] = op.peak_stage
    return parts


def test_layer_peak_memory_at_128k_within_floor():
    torch.manual_seed(11)
    layer = KimiDeltaAttention(layer_idx=0, **FLA_DEFAULTS).to(DEV).bfloat16()
    T = MEMORY_TOKENS
    x = torch.randn(1, T, layer.hidden_size, device=DEV, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        layer(x)[0].backward(dy)

    step()                                           # warm-up: plans, cuBLAS workspace, parameter grads
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    floor = layer_floor_bytes(layer, T)
    gib = 2.0 ** 30
    print(f"\nlayer 1 x {T}, hidden {layer.hidden_size}, {layer.num_heads} x {layer.head_dim}: peak above "
          f"baseline {peak / gib:.3f} GiB, floor {floor['floor'] / gib:.3f} GiB "
          f"(ratio {peak / floor['floor']:.3f}); reserved {torch.cuda.max_memory_reserved() / gib:.3f} GiB; "
          + ", ".join(f"{k} {v / gib:.3f}" for k, v in floor.items() if isinstance(v, int) and k != "floor")
          + f"; op peak at {floor['op peak stage']}")
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    assert peak <= 1.10 * floor["floor"] + 64 * 2 ** 20, (peak, floor)


@pytest.mark.parametrize("check_indices", [True, False])
def test_pool_prefill_and_step_in_one_plain_cuda_graph(check_indices):
    """The layer's pool path the way engines capture it: one plain ``torch.cuda.graph`` holds a
    packed prefill through both pools (forward with state_indices, conv_state and cu_seqlens_cpu;
    a padded and an empty sequence) and one decode step (``step``) continuing two of its rows.
    Warm-up on a side stream; the index check (default check_indices=True) runs there and is
    skipped during capture by itself. Replays with new hidden states give the eager call's bits:
    both outputs and both whole pools."""
    _, dev = make_pair(12, **CONFIGS["gva_safe_gate"])
    gen = torch.Generator(device=DEV).manual_seed(13)
    seqlens, P = [100, 0, 37, 64], 8
    cu_cpu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
    cu = cu_cpu.to(DEV)
    prefill_rows = torch.tensor([3, 5, -1, 0], dtype=torch.int32, device=DEV)   # row 5: an empty sequence's
    decode_rows = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEV)       # continues rows 3 and 0
    pool0 = 0.1 * torch.randn(P, dev.num_v_heads, dev.head_v_dim, dev.head_dim, generator=gen, device=DEV)
    conv0 = torch.randn(P, dev.conv_channels, dev.conv_size - 1, generator=gen, device=DEV).to(torch.bfloat16)
    pool, conv = pool0.clone(), conv0.clone()
    x_pre = torch.empty(1, sum(seqlens), dev.hidden_size, device=DEV, dtype=torch.bfloat16)
    x_dec = torch.empty(3, 1, dev.hidden_size, device=DEV, dtype=torch.bfloat16)

    def refill():
        for t in (x_pre, x_dec):
            t.copy_(torch.randn(t.shape, generator=gen, device=DEV).to(t.dtype))

    def reset():
        pool.copy_(pool0)
        conv.copy_(conv0)

    def serve():
        with torch.no_grad():
            o_pre = dev(x_pre, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, initial_state=pool, state_indices=prefill_rows,
                        state_v_first=True, conv_state=conv, check_indices=check_indices)[0]
            o_dec = dev.step(x_dec, conv, pool, decode_rows, check_indices=check_indices)
        return o_pre, o_dec

    refill()
    graph, static_out = capture_like_an_engine(serve, reset=reset)

    for round_ in range(2):
        refill()
        reset()
        graph.replay()
        torch.cuda.synchronize()
        replayed = [o.clone() for o in static_out]
        replayed_pools = pool.clone(), conv.clone()

        reset()
        eager = serve()
        torch.cuda.synchronize()
        for name, a, b in zip(("prefill", "step"), eager, replayed):
            assert torch.equal(a, b), f"replay {round_}: the {name} output differs from the eager call"
        assert torch.equal(pool, replayed_pools[0]), f"replay {round_}: the recurrent pool differs from eager"
        assert torch.equal(conv, replayed_pools[1]), f"replay {round_}: the conv pool differs from eager"

        # real work: rows 3 and 0 written; the padded sequences' outputs zero; every other row untouched
        for r in (0, 3):
            assert not torch.equal(pool[r], pool0[r]) and not torch.equal(conv[r], conv0[r]), r
        untouched = [r for r in range(P) if r not in (0, 3)]   # row 5: an empty sequence keeps its rows
        assert torch.equal(pool[untouched], pool0[untouched]) and torch.equal(conv[untouched], conv0[untouched])
        assert torch.count_nonzero(eager[0][:, 100:137]) == 0 and eager[0][:, :100].abs().sum() > 0
        assert eager[0][:, 137:].abs().sum() > 0
        assert torch.count_nonzero(eager[1][1]) == 0 and eager[1][0].abs().sum() > 0
