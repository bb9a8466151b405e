"""The one-token step kernel (kdakit/ops/kda/serving/step.py): which launches it takes, and that it gives
the pool kernel's bits (interpreter) on every option set, pool dtype, padded and out-of-range rows and
padded pool rows. Accuracy against the float64 definition is test_decode.py's (it runs through this kernel)."""

import pytest
import torch

import kdakit.ops.kda.serving.decode as decode
import kdakit.ops.kda.serving.step as decode_step
from kdakit.ops.kda.serving.decode import kda_decode
from kdakit.testing import make_kda_inputs


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")


def _inputs(seed, N, H, HV, K, V, gate):
    gen = torch.Generator().manual_seed(seed)
    inp = make_kda_inputs(B=N, T=1, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, gate=gate, generator=gen)
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    return t, kw, gen


def _run(t, kw, pool, idx, **extra):
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t.get("A_log"),
                   dt_bias=t.get("dt_bias"), check_indices=False, **dict(kw, **extra))
    return o, pool


class _Counter:
    """Counts launches of a jitted kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("gate", ["safe", "softplus", "none"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded_rows", [False, True])
def test_step_kernel_gives_the_pool_kernels_bits(monkeypatch, gate, pool_dtype, padded_rows):
    N, H, HV, K, V, P = 4, 2, 4, 16, 32, 7
    t, kw, gen = _inputs(3, N, H, HV, K, V, gate)
    row = HV * V * K
    wide = (0.4 * torch.randn(P, row + (8 if padded_rows else 0), generator=gen)).to(pool_dtype)
    # -1: a padded sequence; 9: an unchecked row outside the pool, treated as padded (never touched)
    idx = torch.tensor([5, -1, 0, 9], dtype=torch.int32)
    results = {}
    for kernel in ("step", "pool"):
        if kernel == "pool":
            monkeypatch.setattr(decode, "step_kernel_applies", lambda **_: False)
        step = _Counter(decode_step._pool_step_kernel)
        monkeypatch.setattr(decode_step, "_pool_step_kernel", step)
        buf = wide.clone()
        pool = buf[:, :row].unflatten(1, (HV, V, K))
        o, _ = _run(t, kw, pool, idx)
        assert len(step.grids) == (1 if kernel == "step" else 0), kernel
        results[kernel] = (o, buf)
        monkeypatch.undo()
        monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    (o_s, buf_s), (o_p, buf_p) = results["step"], results["pool"]
    assert torch.equal(o_s, o_p)
    assert torch.equal(buf_s, buf_p)
    assert torch.equal(o_s[1], torch.zeros_like(o_s[1])) and torch.equal(o_s[3], torch.zeros_like(o_s[3]))
    untouched = [1, 2, 3, 4, 6]
    assert torch.equal(buf_s[untouched], wide[untouched])  # rows no sequence names, and the row padding
    assert not torch.equal(buf_s[5, :row], wide[5, :row])


def test_step_kernel_takes_only_one_token_in_place_steps(monkeypatch):
    """Several tokens, per-token rows ([N, S]) and packed sequences run on the pool kernel."""
    N, H, HV, K, V, P = 2, 2, 2, 16, 16, 6
    step = _Counter(decode_step._pool_step_kernel)
    monkeypatch.setattr(decode_step, "_pool_step_kernel", step)
    gen = torch.Generator().manual_seed(0)
    pool = 0.3 * torch.randn(P, HV, V, K, generator=gen)

    t, kw, _ = _inputs(1, N, H, HV, K, V, "safe")
    _run(t, kw, pool, torch.tensor([0, 3], dtype=torch.int32))
    assert len(step.grids) == 1 and step.grids[0] == (N * HV * (V // decode_step.STEP_BLOCK_V),)

    inp = make_kda_inputs(B=N, T=3, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, gate="safe", generator=gen)
    t3 = {n: x.detach() for n, x in inp["tensors"].items()}
    _run(t3, inp["kwargs"], pool, torch.tensor([0, 3], dtype=torch.int32))
    _run(t, kw, pool, torch.tensor([[0, 1], [3, 4]], dtype=torch.int32),
         num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32))
    assert len(step.grids) == 1


@pytest.mark.parametrize("K,V,expected", [(16, 32, True), (24, 32, False), (16, 20, False)])
def test_step_kernel_applies_to_powers_of_two_keys_and_whole_value_tiles(K, V, expected):
    idx = torch.zeros(2, dtype=torch.int32)
    pool = torch.zeros(2, 1, V, K)
    assert decode_step.step_kernel_applies(T=1, cu_seqlens=None, state_indices=idx, h0=pool, ht=pool,
                                           write_final_to_read_row=True, state_v_first=True, K=K, V=V,
                                           block_v=None) is expected
