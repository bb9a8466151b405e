"""The two forms of the forward's diagonal 16 x 16 blocks (kdakit/ops/kda/chunk/intra.py): by dots in the dots
kernel for the sub-chunks that pass the span check, token-parallel in the diag kernel for the others. Each test
sets the log-decays per (chunk, value head, sub-chunk) so that a chosen pattern of sub-chunks takes each path,
checks akk_d (NaN-filled before the call: every row written, each path at its own tolerance) and the outputs
(token-layout aqk, tinv in a NaN-poisoned buffer, tests/ops/kda/chunk/_pairs.py) against the float64 reference
of test_intra at its tolerances."""

import math
from types import SimpleNamespace

import pytest
import torch

from kdakit.ops.kda.chunk.intra import run_intra
from kdakit.ops.kda.chunk.tiles import CHUNK, SUB
from kdakit.ops.kda.chunk_common import GATE_LOWER_BOUND
from tests.ops.kda.chunk._pairs import assert_outside_untouched, covered, from_tokens, pair_views
from tests.ops.kda.chunk.test_intra import check_outputs, make_inputs, reference, token_parallel

C = CHUNK
NSUB = C // SUB
SEQLENS = [70, 37]  # chunks of 64, 6 and 37 tokens: a full one, short ones with padded rows


def set_log_decay(x, big, seed):
    """Rebuild gc from log-decays: mild ones (in [-4.9, 0), one channel at exactly -5: 8 tokens span exactly the
    bound, 40) on the sub-chunks where ``big[i, hv, s]`` is False, -30 on one channel of every token elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    K = x.gc.shape[-1]
    for i, (_, _, _, L) in enumerate(x.rows):
        a = -4.9 * torch.rand(x.HV, C, K, generator=gen)
        a[:, :, 0] = -5.0
        for s in range(NSUB):
            a[:, SUB * s:SUB * (s + 1), 3] = torch.where(big[i, :, s, None], -30.0, a[:, SUB * s:SUB * (s + 1), 3])
        G = torch.cumsum(a[:, :L], dim=1)
        x.gc[i, :, :L] = G
        x.gc[i, :, L:] = G[:, L - 1:L]


def run(x, dtype, safe, rows=slice(None)):
    """run_intra on the table rows ``rows`` (a slice: the slots' rows with them) -> (scale, aqk, akk_d, tinv,
    buf): aqk, tinv token-layout views of the NaN-filled pair buffer buf."""
    HV = x.HV
    scale = x.q.shape[-1] ** -0.5
    table = x.table[rows].contiguous()
    n = table.shape[0]
    buf, aqk, tinv = pair_views(x.B, x.T, HV, dtype)
    akk_d = torch.full((n, HV, C, SUB), math.nan)
    slots = [s[rows].contiguous() for s in (x.gc, x.bt, x.rq, x.rk)]
    run_intra(SimpleNamespace(scale=scale, safe=safe), table, x.q, x.k, *slots, aqk, akk_d, tinv)
    return scale, aqk, akk_d, tinv, buf


def inputs(dtype, seed=0):
    # GVA with one q/k head: the two value heads share one diag program (DIAG_BLOCK_H = 2); two head blocks and
    # H = 2, both paths among them, are test_intra's fp32-none-fixed-gva (H = 2, HV = 4: 40 of its 64 sub-chunks
    # token-parallel, in every head)
    return make_inputs(B=1, T=sum(SEQLENS), H=1, HV=2, K=24, seqlens=SEQLENS, dtype=dtype, gate=GATE_LOWER_BOUND,
                       l2norm=True, strided=True, seed=seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["dots", "token", "mix"])
def test_diag_paths(mode, dtype):
    """All sub-chunks by dots (mild decays), all token-parallel (-30 per token), or a mix within every chunk and
    across the value heads of one diag program (sub-chunk s of head hv token-parallel iff hv + s is odd);
    GVA (HV = 2, H = 1), K = 24 (masked key columns), short chunks."""
    x = inputs(dtype)
    n = len(x.rows)
    if mode == "dots":
        big = torch.zeros(n, x.HV, NSUB, dtype=torch.bool)
    elif mode == "token":
        big = torch.ones(n, x.HV, NSUB, dtype=torch.bool)
    else:
        hv, s = torch.arange(x.HV)[:, None], torch.arange(NSUB)[None, :]
        big = ((hv + s) % 2 == 1).expand(n, x.HV, NSUB).clone()
    set_log_decay(x, big, seed=1)
    expect = big.clone()
    for i, (_, _, _, L) in enumerate(x.rows):  # a sub-chunk wholly past L spans 0 (every row reads as L - 1)
        expect[i, :, (L + SUB - 1) // SUB:] = False
    assert torch.equal(token_parallel(x), expect)  # the test's own premise
    scale, aqk, akk_d, tinv, buf = run(x, dtype, safe=False)
    check_outputs(x, scale, dtype, aqk, akk_d, tinv, buf)  # akk_d: each sub-chunk at its path's tolerance
    # the 6-token chunk alone (table row 1: its sub-chunk 0 on both paths in "mix", sub-chunks 1-3 padded):
    # nothing stored on its padded rows, which would be the next sequence's tokens 70.. and the guard past T;
    # its own rows the full run's bits
    assert x.rows[1][2:] == (64, 6)
    _, aqk1, akk_d1, tinv1, buf1 = run(x, dtype, safe=False, rows=slice(1, 2))
    assert_outside_untouched(buf1, x.T, x.rows, "aqk/tinv", 1, 2)
    mine = covered(x.B, x.T, x.rows, 1, 2)
    assert torch.equal(aqk1[mine], aqk[mine]) and torch.equal(tinv1[mine], tinv[mine])
    assert torch.equal(akk_d1, akk_d[1:2])


def test_safe_skips_the_check_with_the_same_bits():
    """With opts.safe the token-parallel kernel is not launched and every block is formed by dots: on decays that
    pass the check anyway the outputs, akk_d included, are bit-identical to the checked run."""
    x = inputs(torch.bfloat16, seed=2)
    set_log_decay(x, torch.zeros(len(x.rows), x.HV, NSUB, dtype=torch.bool), seed=3)
    _, aqk, akk_d, tinv, _ = run(x, torch.bfloat16, safe=False)
    _, aqk_s, akk_d_s, tinv_s, buf_s = run(x, torch.bfloat16, safe=True)
    assert torch.isfinite(akk_d).all() and torch.equal(akk_d, akk_d_s)
    assert covered(x.B, x.T, x.rows).all()  # every token is a chunk's row: the views hold no NaN fill
    assert torch.equal(aqk, aqk_s) and torch.equal(tinv, tinv_s)
    assert_outside_untouched(buf_s, x.T, x.rows, "aqk/tinv")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nan_gate_takes_the_token_parallel_path(dtype):
    """A NaN log-decay at row 20 of chunk 0, value head 1 (channel 5): G is NaN from row 20 on, so sub-chunks
    1-3 of that (chunk, head) fail the check; Aqk is NaN exactly where the float64 reference is (rows >= 20,
    lower part), finite and within tolerance elsewhere; the other heads and chunks keep the dot path."""
    x = inputs(dtype, seed=4)
    set_log_decay(x, torch.zeros(len(x.rows), x.HV, NSUB, dtype=torch.bool), seed=5)
    x.gc[0, 1, 20:, 5] = math.nan
    tp = token_parallel(x)
    assert tp[0, 1].tolist() == [False, True, True, True] and tp.sum() == 3
    scale, aqk, akk_d, tinv, buf = run(x, dtype, safe=False)
    assert_outside_untouched(buf, x.T, x.rows, "aqk/tinv")
    aqk, tinv = from_tokens(aqk, x.rows), from_tokens(tinv, x.rows)  # [n, HV, C, C], padded rows 0
    r_aqk, _, _ = reference(x, scale)
    nan_ref = torch.isnan(r_aqk)
    r = torch.arange(C)
    assert nan_ref[0, 1].equal((r[:, None] >= 20) & (r[:, None] >= r[None, :]))
    assert torch.isnan(aqk.double()).equal(nan_ref)
    err = ((aqk.double() - r_aqk).abs()[~nan_ref] / r_aqk[~nan_ref].abs().max()).max().item()
    assert err <= (1e-5 if dtype == torch.float32 else 8e-3), err
    # akk_d: sub-chunk 0 by dots, rows 16-19 token-parallel before the NaN, NaN from row 20 on; finite elsewhere
    assert torch.isfinite(akk_d[0, 1, :20]).all() and torch.isnan(akk_d[0, 1, 20:]).any()
    assert torch.isfinite(akk_d[1:]).all() and torch.isfinite(akk_d[:, 0]).all()
    # Tinv: sub-chunk 0's rows and the untouched heads and chunks stay finite (the block substitution's dots
    # carry a NaN row of sub-chunk 1 into the whole block row)
    assert torch.isfinite(tinv[0, 1, :16].float()).all() and torch.isfinite(tinv[:, 0].float()).all()
    assert torch.isfinite(tinv[1:].float()).all() and torch.isfinite(tinv[0, 2:].float()).all()
