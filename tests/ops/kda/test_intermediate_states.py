"""chunk_kda(..., return_intermediate_states=True) (issue #13 item 4, prefix caching): h is the state entering
every 64-token chunk of every sequence, FLA's shape [B, NT, HV, K, V] ([.., V, K] with state_v_first) in k's
dtype, on both backends, against the float64 naive recurrence run on each sequence's prefix."""

import pytest
import torch

from kdakit import chunk_kda
from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.reference.naive import naive_recurrent_kda
from kdakit.testing import make_kda_inputs

BACKENDS = ["torch"] + (["triton"] if triton_interpreting() else [])
C = 64


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def _expected_h(inp, lengths, v_first):
    """float64 states at each sequence's 64-token boundaries, in FLA's row order (sequence-major)."""
    t = {n: x.detach().double() for n, x in inp["tensors"].items()}
    kw = {n: val for n, val in inp["kwargs"].items() if n not in ("cu_seqlens", "output_final_state")}
    B = t["q"].shape[0]
    rows, bos = [], 0
    for n, length in enumerate(lengths):
        b, lo = (n, 0) if B > 1 else (0, bos)  # a fixed-length batch, or packed sequences
        h0 = t["initial_state"][n:n + 1] if "initial_state" in t else None
        for c in range(-(-length // C)):
            if c == 0:
                S = h0 if h0 is not None else torch.zeros(1, *rows_shape(t, v_first), dtype=torch.float64)
            else:
                sl = slice(lo, lo + C * c)
                _, S = naive_recurrent_kda(*(t[x][b:b + 1, sl] for x in ("q", "k", "v", "g", "beta")),
                                           initial_state=h0, output_final_state=True, A_log=t.get("A_log"),
                                           dt_bias=t.get("dt_bias"), **kw)
            rows.append(S[0])
        bos += length
    return torch.stack(rows)


def rows_shape(t, v_first):
    HV, K, V = t["v"].shape[2], t["q"].shape[3], t["v"].shape[3]
    return (HV, V, K) if v_first else (HV, K, V)


@pytest.mark.parametrize("case", ["packed_kv", "packed_vk_h0", "batch_bf16"])
@pytest.mark.slow
def test_h_matches_the_recurrence_at_64_token_boundaries(backend, case):
    gen = torch.Generator().manual_seed(11)
    if case == "batch_bf16":
        inp = make_kda_inputs(B=2, T=130, H=2, HV=2, K=16, V=32, dtype=torch.bfloat16, gate="safe", generator=gen)
        lengths = [130, 130]
    else:
        lengths = [150, 0, 64, 65]
        inp = make_kda_inputs(T=sum(lengths), H=1, HV=2, K=16, V=16, dtype=torch.float32, gate="softplus",
                              seqlens=lengths, initial_state="vk" if case == "packed_vk_h0" else None, generator=gen)
    v_first = bool(inp["kwargs"].get("state_v_first"))
    t = inp["tensors"]
    named = {n: t[n] for n in ("initial_state", "A_log", "dt_bias") if n in t}
    inp["kwargs"] = {n: x for n, x in inp["kwargs"].items() if n != "output_final_state"}
    with torch.inference_mode():
        o, ht, h = chunk_kda(*(t[n] for n in ("q", "k", "v", "g", "beta")), **named, **inp["kwargs"],
                             output_final_state=True, return_intermediate_states=True)
        o2, ht2 = chunk_kda(*(t[n] for n in ("q", "k", "v", "g", "beta")), **named, **inp["kwargs"],
                            output_final_state=True)
    B = t["q"].shape[0]
    NT = sum(-(-n // C) for n in lengths) // (B if B > 1 else 1)
    assert h.shape == (B if B > 1 else 1, NT, *rows_shape(t, v_first)) and h.dtype == t["k"].dtype
    want = _expected_h(inp, lengths, v_first)
    got = h.reshape(-1, *h.shape[2:]).double()
    # bf16 h is rounded once on store (2^-9 relative); fp32 differs from float64 by round-off only
    tol = 1e-2 if t["k"].dtype == torch.bfloat16 else 1e-4
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < tol, f"h max error {err:.2e} relative to its largest entry"
    assert torch.equal(o, o2) or (o - o2).abs().max() <= 1e-2 * o2.abs().max(), "o differs from the plain call"
    assert torch.allclose(ht.double(), ht2.double(), rtol=1e-4, atol=1e-5)


def test_outside_inference_mode_is_refused(backend):
    gen = torch.Generator().manual_seed(3)
    inp = make_kda_inputs(T=20, H=1, K=16, V=16, dtype=torch.float32, gate="safe", generator=gen)
    t = inp["tensors"]
    with pytest.raises(ValueError, match="return_intermediate_states is for inference"):
        chunk_kda(*(t[n] for n in ("q", "k", "v", "g", "beta")), A_log=t["A_log"], dt_bias=t["dt_bias"],
                  **inp["kwargs"], return_intermediate_states=True)
