"""KimiDeltaAttention (kdakit.nn): the layer against an explicit composition of its stages, packed
sequences against separate ones, prefill + decode steps against one forward, input errors, and
the pool path without host synchronization (a taint probe: check_indices=False, cu_seqlens_cpu)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import resolve_name

from kdakit.nn import KimiDeltaAttention, gated_norm, kda_layer
from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import assert_close

HIDDEN, HEAD_DIM = 12, 8

CONFIGS = {
    "mha": dict(num_heads=2),
    "gva_safe_gate": dict(num_heads=1, num_v_heads=2, safe_gate=True, lower_bound=-5.0),
    "no_conv": dict(num_heads=2, use_short_conv=False),
    "gva_neg_eig_bias_conv3": dict(num_heads=2, num_v_heads=4, allow_neg_eigval=True, conv_bias=True, conv_size=3),
}


def make_layer(seed, dtype=torch.float64, layer_idx=None, **cfg):
    """A layer whose every parameter is random (no zero or one initial values left to hide a bug)."""
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(HIDDEN, head_dim=HEAD_DIM, layer_idx=layer_idx, **cfg).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return layer


def rand(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def spans(T, B, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def explicit_layer(layer, x, cu_seqlens=None, initial_state=None, conv_context=None):
    """The layer written out stage by stage: F.conv1d per sequence on a zero- or context-padded
    window, SiLU, the token-by-token KDA definition, gated RMSNorm, output projection."""
    B, T, _ = x.shape
    H, HV, K = layer.num_heads, layer.num_v_heads, layer.head_dim
    W = layer.conv_size
    parts = []
    for c, (proj, conv) in enumerate(((layer.q_proj, "q_conv1d"), (layer.k_proj, "k_conv1d"),
                                      (layer.v_proj, "v_conv1d"))):
        y = proj(x)                                                         # [B, T, C]
        if layer.use_short_conv:
            mod = getattr(layer, conv)
            C = y.shape[-1]
            out = torch.zeros_like(y)
            for i, (b, bos, eos) in enumerate(spans(T, B, cu_seqlens)):
                if eos == bos:
                    continue
                seq = y[b, bos:eos].T                                       # [C, L]
                if conv_context is None:
                    left = seq.new_zeros(C, W - 1)
                else:
                    lo = [0, layer.key_dim, 2 * layer.key_dim][c]
                    left = conv_context[i, lo:lo + C].to(seq.dtype)
                z = F.conv1d(torch.cat([left, seq], 1)[None], mod.weight, mod.bias, groups=C)[0]
                out[b, bos:eos] = z.T
            y = out
        parts.append(F.silu(y))
    q = parts[0].view(B, T, H, K)
    k = parts[1].view(B, T, H, K)
    v = parts[2].view(B, T, HV, K)
    g = layer.f_proj(x).view(B, T, HV, K)
    beta = layer.b_proj(x)
    o, final = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=layer.allow_neg_eigval, lower_bound=layer.lower_bound,
        A_log=layer.A_log, dt_bias=layer.dt_bias, cu_seqlens=cu_seqlens,
    )
    gate = layer.g_proj(x).view(B, T, HV, K)
    eps = layer.o_norm.eps
    normed = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * layer.o_norm.weight * torch.sigmoid(gate)
    return layer.o_proj(normed.reshape(B, T, HV * K)), final


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_grads_match_explicit_composition(name):
    cfg = CONFIGS[name]
    layer = make_layer(11, **cfg)
    HV = layer.num_v_heads
    cu = torch.tensor([0, 3, 3, 9, 10], dtype=torch.long)     # includes an empty and a 1-token sequence
    x = rand(1, 10, HIDDEN, seed=3).requires_grad_()
    h0 = rand(4, HV, HEAD_DIM, HEAD_DIM, seed=4, scale=0.5).requires_grad_()
    dout = rand(1, 10, HIDDEN, seed=5)

    out, final, _ = layer(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ref, ref_final = explicit_layer(layer, x, cu, h0)
    assert out.shape == (1, 10, HIDDEN) and out.dtype == torch.float64
    assert_close(f"{name} out", ref, out, 1e-9)
    assert_close(f"{name} final state", ref_final, final, 1e-9)

    params = dict(layer.named_parameters())
    leaves = [x, h0, *params.values()]
    got = torch.autograd.grad((out * dout).sum() + final.sum(), leaves)
    want = torch.autograd.grad((ref * dout).sum() + ref_final.sum(), leaves)
    for pname, gw, gg in zip(["hidden_states", "initial_state", *params], want, got):
        assert torch.isfinite(gg).all(), pname
        assert float(gg.abs().max()) > 0, f"{pname}: zero gradient"
        assert_close(f"{name} d{pname}", gw, gg, 1e-8)


def test_gradients_reach_every_parameter_float32_batched():
    layer = make_layer(21, dtype=torch.float32, num_heads=2, num_v_heads=4)
    x = rand(2, 7, HIDDEN, seed=22).float()
    out, _, _ = layer(x)
    (out * rand(2, 7, HIDDEN, seed=23).float()).sum().backward()
    names = {n for n, _ in layer.named_parameters()}
    assert {"A_log", "dt_bias", "q_conv1d.weight", "f_proj.1.weight", "g_proj.1.bias", "o_norm.weight"} <= names
    for n, p in layer.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
        assert float(p.grad.abs().max()) > 0, f"{n}: zero gradient"
    ref, _ = explicit_layer(layer, x)
    assert_close("float32 batched out", ref, out, 1e-5)


@pytest.mark.parametrize("name", ["mha", "gva_neg_eig_bias_conv3"])
def test_packed_sequences_equal_separate_runs(name):
    """Neither the convolution, its conv-state update nor the recurrent state crosses a boundary."""
    layer = make_layer(31, **CONFIGS[name])
    lengths = [5, 0, 2, 7, 1]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.long)
    T, N, HV = sum(lengths), len(lengths), layer.num_v_heads
    x = rand(1, T, HIDDEN, seed=32)
    h0 = rand(N, HV, HEAD_DIM, HEAD_DIM, seed=33, scale=0.5)
    ctx = rand(N, layer.conv_channels, layer.conv_size - 1, seed=34)
    conv_packed = ctx.clone()
    out, final, _ = layer(x, cu_seqlens=cu, initial_state=h0, output_final_state=True, conv_state=conv_packed)
    for n in range(N):
        bos, eos = int(cu[n]), int(cu[n + 1])
        conv_n = ctx[n:n + 1].clone()
        o_n, f_n, _ = layer(x[:, bos:eos], initial_state=h0[n:n + 1], output_final_state=True, conv_state=conv_n)
        if eos > bos:
            assert_close(f"seq {n} out", o_n, out[:, bos:eos], 1e-12)
        assert_close(f"seq {n} final state", f_n, final[n:n + 1], 1e-12)
        # same values; the projections of a slice may differ from the packed ones in the last bit
        assert_close(f"seq {n} conv state", conv_n, conv_packed[n:n + 1], 1e-14)
    # the conv state holds the last W-1 projected inputs: the old context shifted by the length
    W1 = layer.conv_size - 1
    proj = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)[0].detach()
    for n in range(N):
        bos, eos = int(cu[n]), int(cu[n + 1])
        window = torch.cat([ctx[n], proj[bos:eos].T], 1)[:, -W1:]
        assert torch.equal(window, conv_packed[n]), f"seq {n} conv window"
    ref, _ = explicit_layer(layer, x, cu, h0, conv_context=ctx)
    assert_close("packed with conv context vs explicit", ref, out, 1e-9)


@pytest.mark.parametrize("name", ["mha", "gva_safe_gate", "no_conv"])
def test_prefill_then_decode_steps_equal_one_forward(name):
    layer = make_layer(41, **CONFIGS[name])
    HV = layer.num_v_heads
    prefill, steps = [5, 2], 3
    total = [n + steps for n in prefill]
    x_seqs = [rand(1, n, HIDDEN, seed=42 + i) for i, n in enumerate(total)]

    pool = rand(4, HV, HEAD_DIM, HEAD_DIM, seed=50).float()          # value-first [P, HV, V, K], stale rows
    idx = torch.tensor([2, 0], dtype=torch.int32)
    untouched = pool[[1, 3]].clone()
    # the conv-state pool has the recurrent pool's rows and stale values in the rows not used
    conv = (rand(4, layer.conv_channels, layer.conv_size - 1, seed=51) if layer.use_short_conv else None)
    conv_untouched = None if conv is None else conv[[1, 3]].clone()
    cu = torch.tensor([0, prefill[0], sum(prefill)], dtype=torch.long)
    x_pre = torch.cat([xs[:, :n] for xs, n in zip(x_seqs, prefill)], 1)
    h0 = torch.zeros(2, HV, HEAD_DIM, HEAD_DIM, dtype=torch.float32)
    pool[idx.long()] = h0                                              # fresh sequences start from zero
    if conv is not None:
        conv[idx.long()] = 0.0
    with torch.no_grad():
        out_pre, _, _ = layer(x_pre, cu_seqlens=cu, initial_state=pool, state_indices=idx, state_v_first=True,
                           conv_state=conv)
    step_outs = []
    for t in range(steps):
        x_t = torch.cat([xs[:, n + t:n + t + 1] for xs, n in zip(x_seqs, prefill)], 0)   # [N, 1, hidden]
        step_outs.append(layer.step(x_t, conv, pool, idx))
    assert torch.equal(pool[[1, 3]], untouched)
    if conv is not None:
        assert torch.equal(conv[[1, 3]], conv_untouched), "conv pool rows not in state_indices untouched"
        # each used row holds its sequence's last W-1 projected inputs
        for i, xs in enumerate(x_seqs):
            proj = torch.cat([layer.q_proj(xs), layer.k_proj(xs), layer.v_proj(xs)], -1)[0].detach()
            assert_close(f"seq {i} conv pool row", proj[-(layer.conv_size - 1):].T, conv[int(idx[i])], 1e-14)

    with torch.no_grad():
        for i, xs in enumerate(x_seqs):
            full, final, _ = layer(xs, output_final_state=True, state_v_first=True)
            got = torch.cat([out_pre[:, cu[i]:cu[i + 1]], *[o[i:i + 1] for o in step_outs]], 1)
            # the pool is fp32, so the decode path rounds the state once per call
            assert_close(f"{name} seq {i} prefill+steps", full, got, 1e-5)
            assert_close(f"{name} seq {i} pool row", final[0], pool[int(idx[i])], 1e-5)


def test_step_multi_token_padding_and_conv_state():
    layer = make_layer(61, num_heads=2, num_v_heads=4)
    N, HV, W1 = 3, layer.num_v_heads, layer.conv_size - 1
    pool = rand(5, HV, HEAD_DIM, HEAD_DIM, seed=62, scale=0.3).float()
    conv = rand(5, layer.conv_channels, W1, seed=63)                   # a pool: rows as state_indices
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    x = rand(N, 2, HIDDEN, seed=64)

    pool_a, conv_a = pool.clone(), conv.clone()
    out_a = layer.step(x, conv_a, pool_a, idx)
    pool_b, conv_b = pool.clone(), conv.clone()
    out_b = torch.cat([layer.step(x[:, t:t + 1], conv_b, pool_b, idx) for t in range(2)], 1)
    # the fp32 pool is rounded once per call, so the two differ by fp32 round-off only
    assert_close("2-token step vs two 1-token steps", out_b, out_a, 1e-6)
    assert_close("2-token step vs two 1-token steps: pool", pool_b, pool_a, 1e-6)
    assert_close("2-token step vs two 1-token steps: conv state", conv_b, conv_a, 1e-14)
    # a padded sequence: zero output; every conv and recurrent pool row not in use untouched
    assert torch.equal(out_a[1], torch.zeros_like(out_a[1]))
    assert torch.equal(conv_a[[0, 2, 3]], conv[[0, 2, 3]])
    assert torch.equal(pool_a[[0, 2, 3]], pool[[0, 2, 3]])
    # live sequences: the conv row shifted in the step's projected inputs, the output matches a forward
    proj = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1).detach()
    for n in (0, 2):
        r = int(idx[n])
        assert torch.equal(conv_a[r], torch.cat([conv[r], proj[n].T], 1)[:, -W1:])
        ref, _ = explicit_layer(layer, x[n:n + 1], initial_state=pool[r][None].double().transpose(-1, -2),
                                conv_context=conv[r:r + 1])
        assert_close(f"step seq {n} vs explicit", ref, out_a[n:n + 1], 1e-5)


def test_chunked_prefill_continues_from_conv_and_recurrent_state():
    layer = make_layer(71, num_heads=2)
    x = rand(2, 9, HIDDEN, seed=72)
    with torch.no_grad():
        full, full_final, _ = layer(x, output_final_state=True)
        conv = torch.zeros(2, layer.conv_channels, layer.conv_size - 1, dtype=torch.float64)
        a, s, _ = layer(x[:, :4], output_final_state=True, conv_state=conv)
        b, s, _ = layer(x[:, 4:], initial_state=s, output_final_state=True, conv_state=conv)
    assert_close("chunked prefill out", full, torch.cat([a, b], 1), 1e-12)
    assert_close("chunked prefill state", full_final, s, 1e-12)


def test_initialization():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(64, num_heads=4, head_dim=16, num_v_heads=8)
    assert layer.A_log.dtype == torch.float32 and layer.dt_bias.dtype == torch.float32
    assert layer.A_log.shape == (8,) and layer.dt_bias.shape == (8 * 16,)
    A_log = layer.A_log.detach()
    assert float(A_log.min()) >= 0.0 and float(A_log.max()) <= math.log(16.0)
    assert float(A_log.std()) > 0
    # FLA's recipe: dt_bias is the inverse softplus of a log-uniform dt in [1e-3, 0.1]
    dt = F.softplus(layer.dt_bias.detach().double())
    assert float(dt.min()) >= 1e-3 * (1 - 1e-5) and float(dt.max()) <= 0.1 * (1 + 1e-5)
    assert float(dt.log().std()) > 0.5, "dt must spread over the log range, not sit at one value"
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    assert layer.conv_channels == 2 * 4 * 16 + 8 * 16
    out, final, _ = layer(torch.randn(1, 5, 64))
    assert out.shape == (1, 5, 64) and final is None and torch.isfinite(out).all()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_heads=3, num_v_heads=4), ValueError, "num_v_heads"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(num_heads=2, conv_size=2.0), TypeError, "conv_size"),
    (dict(num_heads=2, safe_gate=True), ValueError, "lower_bound"),
    (dict(num_heads=2, safe_gate=True, lower_bound=-6.0), ValueError, "lower_bound"),
    (dict(num_heads=2, lower_bound=0.5), ValueError, "lower_bound"),
    (dict(num_heads=2, norm_eps=0.0), ValueError, "norm_eps"),
])
def test_bad_constructor_arguments_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KimiDeltaAttention(HIDDEN, head_dim=HEAD_DIM, **kwargs)


def test_bad_call_arguments_raise():
    layer = make_layer(81, num_heads=2)
    x = rand(1, 6, HIDDEN, seed=82)
    conv_ok = torch.zeros(1, layer.conv_channels, layer.conv_size - 1, dtype=torch.float64)
    cases = [
        (lambda: layer(x.numpy()), TypeError, "hidden_states"),
        (lambda: layer(x[0]), ValueError, "hidden_states"),
        (lambda: layer(rand(1, 6, HIDDEN + 1, seed=1)), ValueError, "hidden_size"),
        (lambda: layer(x.float()), TypeError, "hidden_states"),
        (lambda: layer(x.long()), TypeError, "hidden_states"),
        (lambda: layer(x, cu_seqlens=[0, 6]), TypeError, "cu_seqlens"),
        (lambda: layer(x, cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens"),
        (lambda: layer(x, cu_seqlens=torch.tensor([0, 5])), ValueError, "cu_seqlens"),
        (lambda: layer(x, cu_seqlens=torch.tensor([0, 4, 2, 6])), ValueError, "cu_seqlens"),
        (lambda: layer(rand(2, 3, HIDDEN, seed=1), cu_seqlens=torch.tensor([0, 3])), ValueError, "batch size 1"),
        (lambda: layer(x, conv_state=conv_ok[:, :, :2]), ValueError, "conv_state"),
        (lambda: layer(x, conv_state=conv_ok.long()), TypeError, "conv_state"),
        (lambda: layer(x, initial_state=torch.zeros(1, 2, 3, 3), conv_state=conv_ok), ValueError, "initial_state"),
        (lambda: layer(x, output_final_state=1), TypeError, "output_final_state"),
        (lambda: layer(x, initial_state=torch.zeros(2, 2, 8, 8), state_indices=torch.tensor([0.0])), TypeError,
         "state_indices"),
    ]
    pool = torch.zeros(2, 2, HEAD_DIM, HEAD_DIM)
    conv_pool = torch.zeros(2, layer.conv_channels, layer.conv_size - 1, dtype=torch.float64)
    idx = torch.tensor([0], dtype=torch.int32)
    step_x = x[:, :1]
    cases += [
        (lambda: layer.step(step_x, None, pool, idx), ValueError, "conv_state"),
        (lambda: layer.step(step_x[:, :0], conv_pool, pool, idx), ValueError, "T=0"),
        (lambda: layer.step(step_x, conv_pool, pool, torch.tensor([0, 1], dtype=torch.int32)), ValueError,
         "state_indices"),
        (lambda: layer.step(step_x, conv_pool, pool, [0]), TypeError, "state_indices"),
        (lambda: layer.step(step_x, conv_pool, torch.zeros(2, 2, HEAD_DIM, HEAD_DIM + 1), idx), ValueError,
         "state_pool"),
        (lambda: layer.step(step_x, conv_pool, pool.numpy(), idx), TypeError, "state_pool"),
        # the conv pool has the recurrent pool's rows, not one per sequence
        (lambda: layer.step(step_x, conv_ok, pool, idx), ValueError, r"conv_state must have shape \[P"),
        (lambda: layer(x, initial_state=pool, state_indices=idx, state_v_first=True, conv_state=conv_ok),
         ValueError, r"conv_state must have shape \[P"),
        (lambda: layer(x, state_indices=idx, conv_state=conv_pool), ValueError, "initial_state"),
        (lambda: layer.step(step_x, conv_pool, pool, torch.tensor([2], dtype=torch.int32)), ValueError,
         "state_indices"),
    ]
    conv_before = rand(1, layer.conv_channels, layer.conv_size - 1, seed=84)
    conv_ok.copy_(conv_before)
    pool_before = rand(2, layer.conv_channels, layer.conv_size - 1, seed=85)
    conv_pool.copy_(pool_before)
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert torch.equal(conv_ok, conv_before), "a rejected call must leave conv_state untouched"
    assert torch.equal(conv_pool, pool_before), "a rejected call must leave the conv pool untouched"
    no_conv = make_layer(83, num_heads=2, use_short_conv=False)
    with pytest.raises(ValueError, match="conv_state"):
        no_conv(x, conv_state=conv_ok)


def test_gated_rmsnorm_blocks_and_gradients(monkeypatch):
    """The blockwise autograd function equals the plain fp64 formula, values and every gradient,
    across block boundaries (BLOCK_ROWS made small), and saves only its inputs and rstd."""
    monkeypatch.setattr(gated_norm, "BLOCK_ROWS", 5)
    norm = gated_norm.GatedRMSNorm(8, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(rand(8, seed=91))
    x = rand(2, 7, 3, 8, seed=92).requires_grad_()
    gate = rand(2, 7, 3, 8, seed=93).requires_grad_()
    out = norm(x, gate)
    saved = out.grad_fn.saved_tensors      # x, gate, weight and the per-row rstd, nothing T-sized in fp32
    assert sum(t.numel() for t in saved) == 2 * x.numel() + 8 + 2 * 7 * 3
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight * torch.sigmoid(gate)
    assert_close("gated rmsnorm", want, out, 1e-13)
    dout = rand(2, 7, 3, 8, seed=94)
    got = torch.autograd.grad((out * dout).sum(), [x, gate, norm.weight])
    ref = torch.autograd.grad((want * dout).sum(), [x, gate, norm.weight])
    for name, a, b in zip(["x", "gate", "weight"], ref, got):
        assert float(a.abs().max()) > 0
        assert_close(f"d{name}", a, b, 1e-12)


# --- the pool path without host synchronization (check_indices=False, cu_seqlens_cpu) -----------
# The taint probe of tests/ops/kda/test_host_sync.py (copied: test modules do not import each other):
# pools, indices, offsets and hidden states stand for device tensors; every tensor computed from one
# is one too, and bringing any of their values to the host raises.

_SCALAR_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu",
                 "__array__"}


class HostReadError(AssertionError):
    pass


# Ops whose output size is a device value: on CUDA torch reads it back (a synchronization) and a
# graph capture refuses them. The probe below refuses them too, so a boolean-mask selection or write
# (x[mask], x[mask] = y) is caught, not only an explicit read.
_DATA_DEPENDENT_SIZE = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


def _device_mask(index) -> bool:
    """An index holding a boolean mask that is a device value (a host-made mask has a known size)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, DeviceValues) and i.dtype in (torch.bool, torch.uint8) for i in items)


class DeviceValues(torch.Tensor):
    """Values that live on the device: a scalar read, ``numpy`` or a ``.cpu()`` / ``.to("cpu")`` of
    one (or of anything computed from one) raises, as does an op whose output size it decides
    (indexing with a device mask, ``nonzero`` of one, ``repeat_interleave`` of device repeats
    without ``output_size``); device-side work of fixed shape on them is allowed."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = resolve_name(func) or repr(func)
        attr = name.removeprefix("torch.Tensor.").removeprefix("torch.")
        to_host = attr == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        if attr in _SCALAR_READS or to_host:
            raise HostReadError(f"a device value was brought to the host: {name}")
        sized = attr in _DATA_DEPENDENT_SIZE and isinstance(args[0], DeviceValues)
        sized |= attr in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1 \
            and _device_mask(args[1])
        sized |= attr == "repeat_interleave" and kwargs.get("output_size") is None \
            and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats", args[0]), DeviceValues)
        if sized:
            raise HostReadError(f"an op whose output size is a device value: {name}")
        return super().__torch_function__(func, types, args, kwargs)


def _dev(x):
    return x.clone().as_subclass(DeviceValues)


def _host(x):
    return x.as_subclass(torch.Tensor)


def test_probe_catches_host_reads_and_device_mask_writes():
    """The probe refuses what the pool path must not do: read an index (the old range check's
    tolist) and write the conv pool through a boolean mask of the indices (the old write); the
    fixed-shape gather / index_copy_ of kda_layer pass."""
    rows = _dev(torch.tensor([2, -1, 0]))
    pool = _dev(torch.arange(24.0).view(4, 3, 2))
    new = _dev(torch.ones(3, 3, 2))
    for old_way in (lambda: rows.tolist(), lambda: pool.__setitem__(rows[rows >= 0], new[rows >= 0])):
        with pytest.raises(HostReadError):
            old_way()
    want = pool.as_subclass(torch.Tensor).clone()
    want[[2, 0]] = 1.0
    kda_layer._scatter_conv_rows(pool, new, rows.long())
    assert torch.equal(_host(pool), want)
    assert torch.equal(_host(kda_layer._gather_conv_rows(pool, rows.long())), want[[2, 0, 0]])
    # none valid (padded, or outside the pool): row 0 gets its own bytes back, nothing changes
    kda_layer._scatter_conv_rows(pool, new, torch.tensor([-1, 4, -1]))
    assert torch.equal(_host(pool), want)


POOL_ROWS = 7
PREFILL_SEQLENS = (5, 3, 0, 4)
PREFILL_ROWS = (4, -1, 0, 2)          # a padded 3-token sequence; an empty one owns row 0
UNUSED_ROWS = [1, 3, 5, 6]


def _pool_case(layer, seed):
    HV, W1 = layer.num_v_heads, layer.conv_size - 1
    pool = rand(POOL_ROWS, HV, HEAD_DIM, HEAD_DIM, seed=seed, scale=0.3).float()   # value-first, stale rows
    conv = rand(POOL_ROWS, layer.conv_channels, W1, seed=seed + 1).to(layer.q_proj.weight.dtype)
    return pool, conv


def _pool_prefill(layer, x, pool0, conv0, *, check_indices, guard, host_offsets=True):
    """One prefill through the pools; returns plain (out, pool, conv)."""
    cu = torch.tensor([0, *torch.tensor(PREFILL_SEQLENS).cumsum(0).tolist()], dtype=torch.int32)
    extra = dict(cu_seqlens_cpu=cu.clone()) if host_offsets else {}
    pool, conv, idx = pool0.clone(), conv0.clone(), torch.tensor(PREFILL_ROWS, dtype=torch.int32)
    if guard:
        x, pool, conv, idx, cu = _dev(x), _dev(pool), _dev(conv), _dev(idx), _dev(cu)
    with torch.no_grad():
        out, _, _ = layer(x, cu_seqlens=cu, initial_state=pool, state_indices=idx, state_v_first=True,
                          conv_state=conv, check_indices=check_indices, **extra)
    assert isinstance(out, DeviceValues) == guard  # the probe followed the values through the whole layer
    return _host(out), _host(pool), _host(conv)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.slow
def test_pool_prefill_without_index_check_reads_nothing(monkeypatch, backend):
    """forward(state_indices=, conv_state=, cu_seqlens_cpu=, check_indices=False): hidden states,
    both pools, the indices and cu_seqlens are device values and none is read on the host; the
    output and both pools are the bits of the checked call (with and without cu_seqlens_cpu). A
    padded and an empty sequence; rows not in state_indices untouched in both pools."""
    if backend == "triton" and not triton_interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    dtype = torch.float64 if backend == "torch" else torch.float32
    layer = make_layer(101, dtype=dtype, **CONFIGS["gva_neg_eig_bias_conv3"])
    x = rand(1, sum(PREFILL_SEQLENS), HIDDEN, seed=102).to(dtype)
    pool0, conv0 = _pool_case(layer, 103)
    with pytest.raises(HostReadError, match="tolist"):  # the probe sees the index check's read
        _pool_prefill(layer, x, pool0, conv0, check_indices=True, guard=True)
    ref = _pool_prefill(layer, x, pool0, conv0, check_indices=True, guard=False, host_offsets=False)
    for name, a, b in zip(("out", "pool", "conv pool"), ref,
                          _pool_prefill(layer, x, pool0, conv0, check_indices=True, guard=False)):
        assert torch.equal(a, b), f"{name}: cu_seqlens_cpu changed the bits"
    got = _pool_prefill(layer, x, pool0, conv0, check_indices=False, guard=True)
    for name, a, b in zip(("out", "pool", "conv pool"), ref, got):
        assert torch.equal(a, b), f"{name}: the unchecked call differs from the checked one"

    out, pool, conv = got
    assert torch.equal(pool[UNUSED_ROWS], pool0[UNUSED_ROWS]) and torch.equal(conv[UNUSED_ROWS], conv0[UNUSED_ROWS])
    assert torch.equal(pool[0], pool0[0]) and torch.equal(conv[0], conv0[0]), "an empty sequence keeps its rows"
    assert torch.equal(out[:, 5:8], torch.zeros_like(out[:, 5:8])), "a padded sequence gives zeros"
    proj = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)[0].detach()
    W1 = layer.conv_size - 1
    for (bos, eos), r in (((0, 5), 4), ((8, 12), 2)):
        assert not torch.equal(pool[r], pool0[r])
        assert torch.equal(conv[r], proj[bos:eos].T[:, -W1:].to(conv.dtype)), f"conv pool row {r}"


def _step(layer, x, pool0, conv0, rows, *, check_indices, guard):
    pool, conv, idx = pool0.clone(), conv0.clone(), torch.tensor(rows, dtype=torch.int32)
    if guard:
        x, pool, conv, idx = _dev(x), _dev(pool), _dev(conv), _dev(idx)
    out = layer.step(x, conv, pool, idx, check_indices=check_indices)
    assert isinstance(out, DeviceValues) == guard
    return _host(out), _host(pool), _host(conv)


def test_step_without_index_check_reads_nothing(monkeypatch):
    """step(check_indices=False) on kda_decode's kernel (the interpreter here) reads no value of the
    hidden states, pools or indices on the host; same bits as the checked step; padded rows
    untouched. The PyTorch backend's kda_decode is a host loop (it reads the indices), so not it."""
    if not triton_interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    layer = make_layer(111, dtype=torch.float32, **CONFIGS["gva_neg_eig_bias_conv3"])
    x = rand(3, 2, HIDDEN, seed=112).float()
    pool0, conv0 = _pool_case(layer, 113)
    rows = (4, -1, 1)
    with pytest.raises(HostReadError, match="tolist"):
        _step(layer, x, pool0, conv0, rows, check_indices=True, guard=True)
    ref = _step(layer, x, pool0, conv0, rows, check_indices=True, guard=False)
    got = _step(layer, x, pool0, conv0, rows, check_indices=False, guard=True)
    for name, a, b in zip(("out", "pool", "conv pool"), ref, got):
        assert torch.equal(a, b), f"{name}: the unchecked step differs from the checked one"
    out, pool, conv = got
    untouched = [0, 2, 3, 5, 6]
    assert torch.equal(pool[untouched], pool0[untouched]) and torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    proj = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1).detach()
    for n, r in ((0, 4), (2, 1)):
        assert torch.equal(conv[r], torch.cat([conv0[r], proj[n].T], 1)[:, -(layer.conv_size - 1):])
        assert not torch.equal(pool[r], pool0[r])

    # unchecked, a row outside the pool is padded (as kda_decode): zero output, nothing written
    out_bad, pool_bad, conv_bad = _step(layer, x, pool0, conv0, (4, POOL_ROWS + 2, 1), check_indices=False,
                                        guard=True)
    assert torch.equal(out_bad[1], torch.zeros_like(out_bad[1]))
    assert torch.equal(pool_bad, pool) and torch.equal(conv_bad, conv)


def test_index_check_skipped_while_capturing(monkeypatch):
    """During a CUDA-graph capture (stood for here by the layer's capture test answering True)
    the default check_indices=True reads nothing, as check_indices=False."""
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    monkeypatch.setattr(kda_layer, "is_capturing", lambda device: True)
    layer = make_layer(121, **CONFIGS["mha"])
    x = rand(1, sum(PREFILL_SEQLENS), HIDDEN, seed=122)
    pool0, conv0 = _pool_case(layer, 123)
    got = _pool_prefill(layer, x, pool0, conv0, check_indices=True, guard=True)
    monkeypatch.setattr(kda_layer, "is_capturing", lambda device: False)
    ref = _pool_prefill(layer, x, pool0, conv0, check_indices=True, guard=False)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_checked_pool_indices_raise_before_any_row_is_touched():
    """check_indices=True (the default): out-of-range and duplicate rows raise ValueError naming
    state_indices, in forward and step, leaving both pools as they were."""
    layer = make_layer(131, **CONFIGS["mha"])
    pool0, conv0 = _pool_case(layer, 132)
    pool, conv = pool0.clone(), conv0.clone()
    x_pre = rand(1, 6, HIDDEN, seed=133)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    x_step = rand(2, 1, HIDDEN, seed=134)
    cases = [
        ((3, POOL_ROWS), r"state_indices must hold pool rows in \[-1, P=7\) \(-1 = padded\), got \[7\]"),
        ((-2, 0), r"state_indices must hold pool rows in \[-1, P=7\)"),
        ((5, 5), "state_indices rows must be distinct across sequences: row 5 is used by sequences 0 and 1"),
    ]
    for rows, match in cases:
        idx = torch.tensor(rows, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            layer(x_pre, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), initial_state=pool, state_indices=idx,
                  state_v_first=True, conv_state=conv)
        with pytest.raises(ValueError, match=match):
            layer.step(x_step, conv, pool, idx)
    assert torch.equal(pool, pool0) and torch.equal(conv, conv0)
    with pytest.raises(TypeError, match="check_indices"):
        layer.step(x_step, conv, pool, torch.tensor([0, 1], dtype=torch.int32), check_indices=1)
    with pytest.raises(TypeError, match="check_indices"):
        layer(x_pre, check_indices=None)


def test_bad_cu_seqlens_cpu_raises():
    layer = make_layer(141, **CONFIGS["mha"])
    x = rand(1, 6, HIDDEN, seed=142)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    cases = [
        (dict(cu_seqlens_cpu=cu), ValueError, "cu_seqlens_cpu needs cu_seqlens"),
        (dict(cu_seqlens=cu, cu_seqlens_cpu=[0, 2, 6]), TypeError, "cu_seqlens_cpu"),
        (dict(cu_seqlens=cu, cu_seqlens_cpu=cu.float()), TypeError, "cu_seqlens_cpu"),
        (dict(cu_seqlens=cu, cu_seqlens_cpu=cu[:2]), ValueError, "cu_seqlens_cpu must have cu_seqlens' shape"),
        (dict(cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 4, 2], dtype=torch.int32)), ValueError,
         "cu_seqlens_cpu must be non-decreasing"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            layer(x, **kwargs)
    # the host copy gives the offsets' bits: the same output as without it
    with torch.no_grad():
        assert torch.equal(layer(x, cu_seqlens=cu)[0], layer(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())[0])


class _CountedReads(torch.Tensor):
    """Counts host reads (``_SCALAR_READS``, ``.to("cpu")``) of itself and of anything computed from it."""
    reads = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        attr = (resolve_name(func) or repr(func)).removeprefix("torch.Tensor.").removeprefix("torch.")
        if attr in _SCALAR_READS or (attr == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))):
            cls.reads.append(attr)
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("cached", [False, True], ids=["packed", "cache"])
def test_packed_call_reads_offsets_once(monkeypatch, cached):
    """A packed forward without ``cu_seqlens_cpu`` reads ``cu_seqlens`` to the host once (the layer's check)
    and hands the KDA op that host copy: the op does not read the offsets again (a second device->host
    synchronization per layer call); the output is the bits of a call given the host copy."""
    layer = make_layer(151, layer_idx=0, **CONFIGS["gva_neg_eig_bias_conv3"])
    x = rand(1, 11, HIDDEN, seed=152)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    handed = []
    real = kda_layer.chunk_kda
    monkeypatch.setattr(kda_layer, "chunk_kda", lambda *a, **kw: handed.append(kw["cu_seqlens_cpu"]) or real(*a, **kw))
    extra = dict(use_cache=True) if cached else {}
    _CountedReads.reads = []
    with torch.no_grad():
        out = layer(x, cu_seqlens=cu.clone().as_subclass(_CountedReads), **extra)[0]
        ref = layer(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), **extra)[0]
    assert _CountedReads.reads == ["tolist"], _CountedReads.reads
    assert handed[0].device.type == "cpu" and handed[0].dtype == cu.dtype and torch.equal(handed[0], cu)
    assert torch.equal(out.as_subclass(torch.Tensor), ref)


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_projection_backward_gets_token_major_gradients(packed):
    """Every Linear of the layer receives a dense token-major output gradient in backward (the short
    convolution's dx included): a channel-major view, as the convolution's padded buffer gives, makes cuBLAS
    run its unaligned kernels for the projections' dgrad and wgrad GEMMs on CUDA."""
    layer = make_layer(161, dtype=torch.float32, **CONFIGS["gva_neg_eig_bias_conv3"])
    seen = {}
    for name, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_full_backward_hook(lambda m, gi, go, name=name: seen.__setitem__(name, go[0]))
    B = 1 if packed else 2
    x = rand(B, 13, HIDDEN, seed=162).float().requires_grad_()
    cu = torch.tensor([0, 5, 13], dtype=torch.int32) if packed else None
    out = layer(x, cu_seqlens=cu)[0]
    out.backward(rand(*out.shape, seed=163).float())
    linears = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(seen) == sorted(linears)
    for name, g in seen.items():
        assert g.is_contiguous(), f"{name}: output gradient strides {g.stride()} for shape {tuple(g.shape)}"
