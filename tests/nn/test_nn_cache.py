"""KimiDeltaAttention's FLA cache interface (``past_key_values`` / ``use_cache``, the
``(o, None, past_key_values)`` return) with kdakit's ``KDACache`` and, when FLA imports, FLA's own
``Cache``: prefill then token-by-token decode equals one full-sequence call, the stored states have
FLA's layout and values, and bad caches raise naming the argument."""

import pytest
import torch

from kdakit.nn import KDACache
from kdakit.testing import assert_close

from .test_nn_layer import HIDDEN, rand
from .test_nn_layer import make_layer as random_layer


CONFIGS = {
    "mha": dict(num_heads=2),
    "gva_safe_gate": dict(num_heads=1, num_v_heads=2, safe_gate=True, lower_bound=-5.0),
    "no_conv": dict(num_heads=2, use_short_conv=False),
    "gva_neg_eig_bias_conv3_expand2": dict(num_heads=2, num_v_heads=4, allow_neg_eigval=True, conv_bias=True,
                                           conv_size=3, expand_v=2),
}


def make_layer(seed, layer_idx=0, dtype=torch.float64, **cfg):
    """test_nn_layer's random layer, with a layer_idx (a cache needs one)."""
    return random_layer(seed, dtype=dtype, layer_idx=layer_idx, **cfg)


def full_run(layer, x):
    """One call over a whole [1, L, hidden] sequence: output, final state (value-first), and the
    conv windows FLA's cache would hold (the last W projected inputs, zeros in front)."""
    with torch.no_grad():
        out, final, cache = layer(x, output_final_state=True, state_v_first=True)
        assert cache is None
        windows = None
        if layer.use_short_conv:
            W = layer.conv_size
            windows = []
            for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
                p = proj(x)[0].T                                        # [D, L]
                windows.append(torch.cat([p.new_zeros(p.shape[0], W), p], 1)[:, -W:])
    return out, final, windows


def check_layer_state(cache, layer, row, final, windows, tol):
    state = cache[layer.layer_idx]
    assert_close("cached recurrent state", final[0], state["recurrent_state"][row], tol)
    if windows is None:
        assert state["conv_state"] is None
        return
    assert isinstance(state["conv_state"], tuple) and len(state["conv_state"]) == 3
    for part, want, got in zip("qkv", windows, state["conv_state"]):
        assert got.shape[1:] == want.shape, part
        assert_close(f"cached {part} conv window", want, got[row], tol)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_prefill_then_decode_equals_full_calls(name, mode):
    """HF's generate pattern: a left-padded batch prefilled with use_cache, then one token per
    row with the growing mask; every valid output and the cached states match one call per row."""
    layer = make_layer(11, mode=mode, **CONFIGS[name])
    lengths, T_pre, steps = [5, 2, 1], 5, 4
    B = len(lengths)
    x_rows = [rand(1, n + steps, HIDDEN, seed=20 + b) for b, n in enumerate(lengths)]
    x_pre = torch.zeros(B, T_pre, HIDDEN, dtype=torch.float64)
    mask = torch.zeros(B, T_pre, dtype=torch.long)
    for b, n in enumerate(lengths):
        x_pre[b, T_pre - n:] = x_rows[b][0, :n]
        mask[b, T_pre - n:] = 1
    x_pre[mask == 0] = 7.0                       # padding is garbage, never zeros that hide a leak
    cache = KDACache()
    with torch.no_grad():
        out_pre, attn, ret = layer(x_pre, attention_mask=mask, past_key_values=cache, use_cache=True)
        assert attn is None and ret is cache
        assert cache.get_seq_length(0) == T_pre
        outs = []
        for t in range(steps):
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            x_t = torch.cat([x_rows[b][:, n + t:n + t + 1] for b, n in enumerate(lengths)], 0)
            o, attn, ret = layer(x_t, attention_mask=mask, past_key_values=cache, use_cache=True)
            assert attn is None and ret is cache and o.shape == (B, 1, HIDDEN)
            outs.append(o)
    assert cache.get_seq_length(0) == T_pre + steps and len(cache) == 1
    assert torch.equal(out_pre[mask[:, :T_pre] == 0], torch.zeros_like(out_pre[mask[:, :T_pre] == 0]))
    for b, n in enumerate(lengths):
        full, final, windows = full_run(layer, x_rows[b])
        got = torch.cat([out_pre[b:b + 1, T_pre - n:], *[o[b:b + 1] for o in outs]], 1)
        assert float(full.abs().max()) > 0.1
        assert_close(f"{name} {mode} row {b} prefill+decode", full, got, 1e-11)
        check_layer_state(cache, layer, b, final, windows, 1e-11)


def test_chunked_prefill_packed_sequences_and_multi_token_decode():
    """cu_seqlens prefill (one cache row per packed sequence, a zero-length one included) in two
    chunks, then a 3-token step per sequence: equals one call per sequence."""
    layer = make_layer(31, num_heads=2, num_v_heads=4, conv_size=3)
    chunks = [[4, 0, 2], [3, 2, 1], [3, 3, 3]]     # tokens per sequence in each call
    N = 3
    totals = [sum(c[n] for c in chunks) for n in range(N)]
    x_seq = [rand(1, L, HIDDEN, seed=40 + n) for n, L in enumerate(totals)]
    cache, done, outs = KDACache(), [0] * N, [[] for _ in range(N)]
    with torch.no_grad():
        for c, lens in enumerate(chunks):
            pieces = [x_seq[n][:, done[n]:done[n] + lens[n]] for n in range(N)]
            if c < len(chunks) - 1:                 # packed: one row, cu_seqlens
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                o, _, _ = layer(torch.cat(pieces, 1), past_key_values=cache, use_cache=True, cu_seqlens=cu)
                for n in range(N):
                    outs[n].append(o[:, int(cu[n]):int(cu[n + 1])])
            else:                                   # batched: one row per sequence
                o, _, _ = layer(torch.cat(pieces, 0), past_key_values=cache, use_cache=True)
                for n in range(N):
                    outs[n].append(o[n:n + 1])
            done = [d + n for d, n in zip(done, lens)]
    for n in range(N):
        full, final, windows = full_run(layer, x_seq[n])
        assert_close(f"seq {n} chunked", full, torch.cat(outs[n], 1), 1e-11)
        check_layer_state(cache, layer, n, final, windows, 1e-11)


def test_cache_semantics_read_only_new_cache_and_layers():
    layer0, layer1 = make_layer(51, layer_idx=0, num_heads=2), make_layer(52, layer_idx=1, num_heads=2)
    x = rand(2, 6, HIDDEN, seed=53)
    with torch.no_grad():
        _, _, cache = layer1(x[:, :4], use_cache=True)          # use_cache without a cache: a new KDACache
        assert isinstance(cache, KDACache) and len(cache) == 2 and cache[0] is None
        assert cache.get_seq_length(1) == 4 and cache.get_seq_length(0) == 0
        layer0(x[:, :4], past_key_values=cache, use_cache=True)
        snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in cache[1].items()}
        conv_snapshot = [w.clone() for w in cache[1]["conv_state"]]
        # use_cache=False reads the cache (continues the sequences) and leaves it as it was
        o_ro, _, ret = layer1(x[:, 4:], past_key_values=cache, use_cache=False)
        assert ret is cache and cache.get_seq_length(1) == 4
        assert torch.equal(cache[1]["recurrent_state"], snapshot["recurrent_state"])
        for a, b in zip(cache[1]["conv_state"], conv_snapshot):
            assert torch.equal(a, b)
        o_rw, _, _ = layer1(x[:, 4:], past_key_values=cache, use_cache=True)
        full = layer1(x)[0]
    assert torch.equal(o_ro, o_rw)
    assert_close("read-only continuation", full[:, 4:], o_ro, 1e-11)
    # reorder_cache selects batch rows of every stored tensor (beam search)
    rec = cache[1]["recurrent_state"].clone()
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache[1]["recurrent_state"], rec[[1, 1]])
    assert cache[1]["conv_state"][2].shape[0] == 2
    cache.reset()
    assert len(cache) == 0 and cache.get_seq_length() == 0


def test_kdacache_update_keeps_omitted_states():
    cache = KDACache()
    a, b = torch.ones(2, 3), torch.full((2, 3), 2.0)
    cache.update(recurrent_state=a, conv_state=(a, a, a), layer_idx=2, offset=5)
    assert len(cache) == 3 and cache[0] is None and cache.get_seq_length(2) == 5
    cache.update(recurrent_state=b, layer_idx=2)           # offset None/default counts 1, conv kept
    assert cache[2]["recurrent_state"] is b and cache[2]["conv_state"][0] is a
    assert cache.get_seq_length(2) == 6 and cache.to_legacy_cache()[2] is cache[2]
    with pytest.raises(KeyError):
        cache[3]
    with pytest.raises(ValueError, match="attn_state"):
        cache.update(attn_state=(a, a), layer_idx=0)
    with pytest.raises(TypeError, match="layer_idx"):
        cache.update(recurrent_state=a, layer_idx="0")
    with pytest.raises(ValueError, match="offset"):
        cache.update(recurrent_state=a, layer_idx=0, offset=-1)
    with pytest.raises(TypeError, match="beam_idx"):
        cache.reorder_cache([0, 1])


def test_bad_cache_arguments_raise():
    layer = make_layer(61, num_heads=2)
    x = rand(2, 5, HIDDEN, seed=62)
    with torch.no_grad():
        _, _, good = layer(x, use_cache=True)
    bad_rec = KDACache()
    bad_rec.update(recurrent_state=torch.zeros(3, 2, 8, 8, dtype=torch.float64), layer_idx=0)
    bad_conv = KDACache()
    bad_conv.update(conv_state=torch.zeros(2, layer.conv_channels, 4), layer_idx=0)
    short_conv = KDACache()
    short_conv.update(conv_state=tuple(w[:, :, 1:] for w in good[0]["conv_state"]), layer_idx=0)
    grad_conv = KDACache()
    grad_conv.update(conv_state=tuple(w.clone().requires_grad_() for w in good[0]["conv_state"]), layer_idx=0)
    no_idx = make_layer(61, layer_idx=None, num_heads=2)
    cases = [
        (lambda: layer(x, past_key_values=object()), TypeError, "past_key_values"),
        (lambda: no_idx(x, past_key_values=KDACache()), ValueError, "layer_idx"),
        (lambda: no_idx(x, use_cache=True), ValueError, "layer_idx"),
        (lambda: layer(x, use_cache=1), TypeError, "use_cache"),
        (lambda: layer(x, output_attentions=True), ValueError, "output_attentions"),
        (lambda: layer(x, past_key_values=good, initial_state=torch.zeros(2, 2, 8, 8)), ValueError,
         "initial_state"),
        (lambda: layer(x, use_cache=True, output_final_state=True), ValueError, "output_final_state"),
        (lambda: layer(x, past_key_values=good, conv_state=torch.zeros(2, layer.conv_channels, 3)), ValueError,
         "conv_state"),
        (lambda: layer(x[:1], past_key_values=good), ValueError, r"recurrent_state'\] must be \[N, HV, V, K\]"),
        (lambda: layer(x, past_key_values=bad_rec), ValueError, "recurrent_state"),
        (lambda: layer(x, past_key_values=bad_conv), TypeError, "conv_state"),
        (lambda: layer(x, past_key_values=short_conv), ValueError, r"\[N, D, conv_size\]"),
        (lambda: layer(x, past_key_values=grad_conv), ValueError, "requires grad"),
    ]
    before = [t.clone() for t in (good[0]["recurrent_state"], *good[0]["conv_state"])]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    after = (good[0]["recurrent_state"], *good[0]["conv_state"])
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a rejected call leaves the cache as it was"
    assert good.get_seq_length(0) == 5


def test_training_step_through_cache_keeps_the_recurrent_graph():
    """Under autograd the cached recurrent state carries its graph into the next call (as in FLA);
    the conv windows are stored detached."""
    layer = make_layer(71, num_heads=2)
    x = rand(1, 8, HIDDEN, seed=72).requires_grad_()
    a, _, cache = layer(x[:, :5], use_cache=True)
    assert cache[0]["recurrent_state"].requires_grad
    assert not any(w.requires_grad for w in cache[0]["conv_state"])
    b, _, _ = layer(x[:, 5:], past_key_values=cache, use_cache=True)
    full = layer(x)[0]
    assert_close("two cached calls vs one", full, torch.cat([a, b], 1), 1e-11)
    (dx,) = torch.autograd.grad(b.sum(), [x])
    # the second call's loss reaches the first call's tokens through the recurrent state
    assert float(dx[:, :2].abs().max()) > 0


# ---------------------------------------------------------------------------------------------
# FLA's own Cache (fla.models.utils.Cache needs flash-linear-attention and transformers)
# ---------------------------------------------------------------------------------------------

def _fla_cache_class():
    utils = pytest.importorskip("fla.models.utils", reason="flash-linear-attention / transformers not installed")
    return utils.Cache


@pytest.mark.parametrize("name", ["mha", "gva_neg_eig_bias_conv3_expand2", "no_conv"])
def test_fla_cache_object_gives_the_kdacache_results(name):
    """The same prefill + decode through FLA's Cache: bitwise the KDACache outputs and states,
    FLA's per-layer token counters, and FLA's own reorder / legacy conversion work on them."""
    Cache = _fla_cache_class()
    layers = [make_layer(81 + i, layer_idx=i, **CONFIGS[name]) for i in range(2)]
    x = rand(2, 9, HIDDEN, seed=83)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    results = []
    for cache in (KDACache(), Cache()):
        outs = []
        with torch.no_grad():
            h = x[:, :6]
            for layer in layers:
                h, attn, ret = layer(h, attention_mask=mask, past_key_values=cache, use_cache=True)
                assert attn is None and ret is cache
            outs.append(h)
            m = mask
            for t in range(6, 9):
                m = torch.cat([m, torch.ones(2, 1, dtype=torch.long)], 1)
                h = x[:, t:t + 1]
                for layer in layers:
                    h, _, _ = layer(h, attention_mask=m, past_key_values=cache, use_cache=True)
                outs.append(h)
        results.append((torch.cat(outs, 1), cache))
    (out_k, kc), (out_f, fc) = results
    assert torch.equal(out_k, out_f)
    assert float(out_k.abs().max()) > 0.1
    assert len(fc) == 2 and fc.get_seq_length(0) == 9 and fc.get_seq_length(1) == 9
    for i in range(2):
        assert torch.equal(kc[i]["recurrent_state"], fc[i]["recurrent_state"])
        if layers[i].use_short_conv:
            for a, b in zip(kc[i]["conv_state"], fc[i]["conv_state"]):
                assert torch.equal(a, b)
        else:
            assert fc[i]["conv_state"] is None
    rec = fc[0]["recurrent_state"].clone()
    fc.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(fc[0]["recurrent_state"], rec[[1, 0]])
    legacy = type(fc).from_legacy_cache(fc.to_legacy_cache(), seen_tokens=9)
    with torch.no_grad():
        a = layers[0](x[:, :1], past_key_values=legacy, use_cache=True)[0]
        b = layers[0](x[:, :1], past_key_values=fc, use_cache=True)[0]
    assert torch.equal(a, b)
