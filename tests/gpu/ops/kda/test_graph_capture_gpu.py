"""GPU tier, issue #13 items 5 and 7: CUDA graphs the way engines capture them, and compiled calls.

- One plain ``torch.cuda.graph(g)`` (its own capture stream, default capture mode) holds a whole
  serving step: a packed prefill into pool rows (``chunk_kda`` with ``state_indices`` and
  ``cu_seqlens_cpu``, one padded and one empty sequence), a decode step that continues two of the
  prefilled rows (``kda_decode``) and an FLA-style decode on other rows (``fused_recurrent_kda``
  with ``ssm_state_indices``, in place). Warm-up iterations run on a side stream, as engines do; no
  call is made on the capture stream before capturing, no ``out=`` is passed (outputs come from
  the graph's pool), no workspace is passed. Replays with new token data copied into the static
  inputs give the bits of eager calls on the same data: every output and the whole pool.
- ``torch.compile(fullgraph=True)`` (inductor) of a training step through ``chunk_kda`` and of a
  decode step equals the eager call bitwise (outputs, gradients, pool).
"""

import pytest
import torch

from kdakit import chunk_kda, fused_recurrent_kda, kda_decode

from ...capture import capture_like_an_engine

pytestmark = pytest.mark.gpu

DEV = "cuda"
H, HV, K, V = 4, 8, 128, 128
SEQLENS = [100, 0, 37, 64]  # the prefill batch: one empty sequence
P = 16                      # pool rows
GATE = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
            lower_bound=-5.0)


def _tokens(B, T, gen, dtype=torch.bfloat16):
    """q, k, v, raw g, beta logits ``[B, T, ...]`` on the device."""
    def r(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV))


def _refill(static: dict, gen) -> None:
    """New token values into the same (static) tensors."""
    for name, t in static.items():
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV).to(t.dtype))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_in_one_plain_cuda_graph(monkeypatch, pool_dtype):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    gen = torch.Generator(device=DEV).manual_seed(0)
    A_log = torch.rand(HV, generator=gen, device=DEV) * 2.0
    dt_bias = 0.1 * torch.randn(HV * K, generator=gen, device=DEV)
    # [P, HV, V, K]: the value-first pool that prefill (state_v_first=True) and decode share
    pool0 = (0.1 * torch.randn(P, HV, V, K, generator=gen, device=DEV)).to(pool_dtype)
    pool = pool0.clone()

    prefill = _tokens(1, sum(SEQLENS), gen)
    cu_cpu = torch.tensor([0] + torch.tensor(SEQLENS).cumsum(0).tolist(), dtype=torch.int32)
    cu = cu_cpu.to(DEV)
    # sequence 1 (empty) keeps row 11 as it is, sequence 2 (37 tokens) is padded
    prefill_rows = torch.tensor([3, 11, -1, 0], dtype=torch.int32, device=DEV)
    decode = _tokens(3, 1, gen)
    decode_rows = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEV)      # continues rows 3 and 0
    fla = _tokens(2, 1, gen)
    fla_rows = torch.tensor([9, 12], dtype=torch.int32, device=DEV)            # other requests' rows
    static = {**{f"p_{n}": t for n, t in prefill.items()}, **{f"d_{n}": t for n, t in decode.items()},
              **{f"f_{n}": t for n, t in fla.items()}}

    def step():
        with torch.no_grad():
            o_prefill, _ = chunk_kda(*prefill.values(), A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                     state_indices=prefill_rows, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                     state_v_first=True, **GATE)
            o_decode = kda_decode(*decode.values(), pool, decode_rows, A_log=A_log, dt_bias=dt_bias, **GATE)
            o_fla, same = fused_recurrent_kda(*fla.values(), A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                              ssm_state_indices=fla_rows, inplace_final_state=True,
                                              state_v_first=True, **GATE)
        assert same is pool
        return o_prefill, o_decode, o_fla

    graph, static_out = capture_like_an_engine(step, reset=lambda: pool.copy_(pool0))

    for round_ in range(2):
        _refill(static, gen)
        pool.copy_(pool0)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [o.clone() for o in static_out]
        replayed_pool = pool.clone()

        pool.copy_(pool0)
        eager = step()
        torch.cuda.synchronize()
        names = ("chunk_kda prefill", "kda_decode", "fused_recurrent_kda")
        for name, a, b in zip(names, eager, replayed):
            assert torch.equal(a, b), f"replay {round_}: {name} differs from the eager call"
        assert torch.equal(pool, replayed_pool), f"replay {round_}: the pool differs from the eager call"

        # the step did real work: written rows changed, the padded sequence's output is zero and
        # rows nobody uses are untouched
        written = (0, 3, 9, 12)
        for r in written:
            assert not torch.equal(pool[r], pool0[r]), r
        untouched = [r for r in range(P) if r not in written]  # row 11: an empty sequence's own state
        assert torch.equal(pool[untouched], pool0[untouched])
        assert torch.count_nonzero(eager[0][:, 100:137]) == 0 and eager[0][:, :100].abs().sum() > 0
        assert eager[0][:, 137:].abs().sum() > 0
        assert torch.count_nonzero(eager[1][1]) == 0 and eager[1][0].abs().sum() > 0


def test_compiled_training_and_decode_match_eager(monkeypatch):
    """A compiled call in the GPU tier (item 7): inductor around the registered ops, no graph break."""
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    torch._dynamo.reset()
    gen = torch.Generator(device=DEV).manual_seed(1)
    A_log = torch.rand(HV, generator=gen, device=DEV) * 2.0
    dt_bias = 0.1 * torch.randn(HV * K, generator=gen, device=DEV)
    tok = _tokens(1, sum(SEQLENS), gen)
    cu_cpu = torch.tensor([0] + torch.tensor(SEQLENS).cumsum(0).tolist(), dtype=torch.int32)
    cu = cu_cpu.to(DEV)
    h0 = 0.1 * torch.randn(len(SEQLENS), HV, K, V, generator=gen, device=DEV)
    do = torch.randn(tok["v"].shape, generator=gen, device=DEV).to(torch.bfloat16)

    def train(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                          cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **GATE)
        return (o.float() * do.float()).sum() + ht.square().sum()

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (*tok.values(), A_log, dt_bias, h0)]
        loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [x.grad for x in leaves]

    ref = run(train)
    got = run(torch.compile(train, fullgraph=True))
    # the loss's sums may be ordered differently by inductor; the op's outputs and gradients may not
    torch.testing.assert_close(ref[0], got[0], rtol=1e-5, atol=0)
    for i, (a, b) in enumerate(zip(ref[1], got[1])):
        assert torch.equal(a, b), f"gradient {i} differs under torch.compile"

    pool0 = (0.1 * torch.randn(P, HV, V, K, generator=gen, device=DEV))
    dec = _tokens(3, 1, gen)
    rows = torch.tensor([5, -1, 2], dtype=torch.int32, device=DEV)

    def decode_step(pool):
        return 2.0 * kda_decode(*dec.values(), pool, rows, A_log=A_log, dt_bias=dt_bias, **GATE)

    p_ref, p_got = pool0.clone(), pool0.clone()
    o_ref = decode_step(p_ref)
    o_got = torch.compile(decode_step, fullgraph=True)(p_got)
    assert torch.equal(o_ref, o_got) and torch.equal(p_ref, p_got) and not torch.equal(p_ref, pool0)
