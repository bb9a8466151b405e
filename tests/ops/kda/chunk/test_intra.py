"""The forward's intra-chunk stage (kdakit/ops/kda/chunk/intra.py) against a float64 reference of its contract
(docs/chunk_pipeline.md): Aqk (scaled, lower incl. diagonal), the diagonal 16 x 16 blocks of Akk, and
Tinv = (I + diag(bt) Akk)^-1, from q, k and the slots gc, bt, rq, rk that the prep stage writes (built here in
PyTorch as prep defines them: the gate's log-decay clamped at -110, its inclusive cumsum within each chunk,
padded rows holding G[L-1], bt and the l2norm scales 0 on padded rows). aqk and tinv are token-layout views of one
pair tensor (tests/ops/kda/chunk/_pairs.py) inside a NaN-poisoned buffer, gathered back into ``[n, HV, C, C]``
for the comparisons."""

import math
from types import SimpleNamespace

import pytest
import torch

from kdakit.ops.kda.chunk.intra import (
    DIAG_DOT_SPAN, DIAG_NUM_WARPS, DOTS_CONFIG, SOLVE_CONFIG, SOLVE_SPILL_BUDGET, chunk_intra_diag_kernel,
    chunk_intra_dots_kernel, chunk_intra_solve_kernel, run_intra, solve_block_k,
)
from kdakit.ops.kda.chunk.plan import chunk_table, chunk_table_rows
from kdakit.ops.kda.chunk.tiles import CHUNK, SUB
from kdakit.ops.kda.chunk_common import GATE_LOWER_BOUND, GATE_NONE, GATE_SOFTPLUS
from kdakit.ops.kda.constants import LOG_DECAY_FLOOR
from kdakit.ops.kda.reference.preprocess import kda_gate, l2norm_rstd
from tests.ops.kda._sm90_build import read_reports, run_sm90_build
from tests.ops.kda.chunk._pairs import assert_outside_untouched, from_tokens, pair_views

C = CHUNK


def make_inputs(*, B, T, H, HV, K, seqlens, dtype, gate, l2norm, strided, seed):
    """Token tensors q, k (strided views of one fused tensor when ``strided``) and the prep slots."""
    gen = torch.Generator().manual_seed(seed)
    V = 20
    if strided:
        fused = torch.randn(B, T, 2 * H * K + HV * V, generator=gen).to(dtype)
        q, k, _ = fused.split([H * K, H * K, HV * V], dim=-1)
        q, k = q.view(B, T, H, K), k.view(B, T, H, K)
        assert q.stride(1) != H * K
    else:
        q = torch.randn(B, T, H, K, generator=gen).to(dtype)
        k = torch.randn(B, T, H, K, generator=gen).to(dtype)
    if not l2norm:  # keep k̂ of unit size so that Tinv stays well conditioned
        q = (q.float() / math.sqrt(K)).to(dtype)
        k = (k.float() / math.sqrt(K)).to(dtype)
    g = torch.randn(B, T, HV, K, generator=gen)
    if gate == GATE_NONE:  # a raw log-decay: mostly mild, some reset-level entries
        a = torch.nn.functional.logsigmoid(g + 2.0)
        pick = torch.rand(B, T, HV, K, generator=gen)
        a = torch.where(pick < 0.02, torch.full_like(a, -math.inf), a)
        a = torch.where((pick >= 0.02) & (pick < 0.05), torch.full_like(a, -30.0), a)
        a = torch.where((pick >= 0.05) & (pick < 0.07), torch.full_like(a, -1000.0), a)
    else:
        A_log = torch.log(torch.empty(HV).uniform_(1.0, 16.0, generator=gen))
        dt = torch.exp(torch.empty(HV * K).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
        dt_bias = torch.log(torch.expm1(dt))
        a = kda_gate(2.0 * g, A_log, dt_bias, None if gate == GATE_SOFTPLUS else -5.0)
    a = a.to(dtype).float().clamp(min=LOG_DECAY_FLOOR)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))

    rows = chunk_table_rows(B, T, seqlens)
    table = chunk_table(B, T, seqlens, "cpu")
    n, group = len(rows), HV // H
    gc = torch.empty(n, HV, C, K)
    bt = torch.zeros(n, HV, C)
    rq = torch.zeros(n, H, C)
    rk = torch.zeros(n, H, C)
    for i, (_, b, t0, L) in enumerate(rows):
        G = torch.cumsum(a[b, t0:t0 + L].transpose(0, 1), dim=1)  # [HV, L, K] fp32
        gc[i, :, :L] = G
        gc[i, :, L:] = G[:, L - 1:L]
        bt[i, :, :L] = beta[b, t0:t0 + L].transpose(0, 1)
        if l2norm:
            rq[i, :, :L] = l2norm_rstd(q[b, t0:t0 + L].float())[..., 0].transpose(0, 1)
            rk[i, :, :L] = l2norm_rstd(k[b, t0:t0 + L].float())[..., 0].transpose(0, 1)
        else:
            rq[i, :, :L] = 1.0
            rk[i, :, :L] = 1.0
    assert group >= 1
    return SimpleNamespace(q=q, k=k, table=table, rows=rows, gc=gc, bt=bt, rq=rq, rk=rk, HV=HV, B=B, T=T)


def reference(x, scale):
    """float64 Aqk, Akk and Tinv ``[n, HV, C, C]`` of the contract."""
    n, HV, H = len(x.rows), x.HV, x.q.shape[2]
    K = x.q.shape[3]
    qh = torch.zeros(n, HV, C, K, dtype=torch.float64)
    kh = torch.zeros(n, HV, C, K, dtype=torch.float64)
    heads = torch.arange(HV) // (HV // H)
    for i, (_, b, t0, L) in enumerate(x.rows):
        qh[i, :, :L] = (x.q[b, t0:t0 + L, heads].double() * x.rq[i, heads, :L].double().T[..., None]).transpose(0, 1)
        kh[i, :, :L] = (x.k[b, t0:t0 + L, heads].double() * x.rk[i, heads, :L].double().T[..., None]).transpose(0, 1)
    G = x.gc.double()
    r = torch.arange(C)
    lower = (r[:, None] >= r[None, :])[None, None, :, :, None]
    D = torch.where(lower, G[:, :, :, None, :] - G[:, :, None, :, :], -math.inf)  # [n, HV, C, C, K]
    E = torch.exp(D)
    aqk = scale * torch.einsum("nhic,nhjc,nhijc->nhij", qh, kh, E)
    akk = torch.einsum("nhic,nhjc,nhijc->nhij", kh, kh, E) * (r[:, None] > r[None, :])
    eye = torch.eye(C, dtype=torch.float64)
    tinv = torch.linalg.inv(eye + x.bt.double()[..., None] * akk)
    return aqk, akk, tinv


def diag_blocks(m):
    """``[..., C, C]`` -> ``[..., C, SUB]``: row r holds ``m[r, 16 (r // 16) + jj]``."""
    return torch.cat([m[..., s * SUB:(s + 1) * SUB, s * SUB:(s + 1) * SUB] for s in range(C // SUB)], dim=-2)


def token_parallel(x):
    """bool ``[n, HV, C // SUB]``: the sub-chunks that fail the span check (fp32, as the kernels form it): some
    channel with |G - G_mid| > DIAG_DOT_SPAN at the sub-chunk's first or last row (padded rows as row L - 1)."""
    out = torch.zeros(len(x.rows), x.HV, C // SUB, dtype=torch.bool)
    for i, (_, _, _, L) in enumerate(x.rows):
        for s in range(C // SUB):
            g = [x.gc[i, :, min(r, L - 1)] for r in (SUB * s, SUB * s + SUB // 2, SUB * s + SUB - 1)]
            ok = ((g[0] - g[1]).abs() <= DIAG_DOT_SPAN) & ((g[2] - g[1]).abs() <= DIAG_DOT_SPAN)  # NaN: False
            out[i, :, s] = ~ok.all(dim=-1)
    return out


def check_akk_d(akk_d, r_akk, tp, rows, fp32):
    """akk_d (NaN-filled before the call) against float64 on every row: the token-parallel sub-chunks' rows to
    fp32 rounding, the dot-formed ones within the dot tolerance (bf16 operands for 16-bit inputs); zeros in the
    unused columns and on padded rows."""
    r = torch.arange(C)
    tp_rows = tp.repeat_interleave(SUB, dim=-1)  # [n, HV, C]
    ref = diag_blocks(r_akk)
    assert torch.isfinite(akk_d).all(), "akk_d: a row not written"
    scale = ref.abs().amax(dim=(-2, -1), keepdim=True).expand_as(ref).clamp(min=1e-30)
    err = (akk_d.double() - ref).abs() / scale
    if tp_rows.any():
        assert err[tp_rows].max().item() <= 1e-5, "akk_d: token-parallel rows"  # fp32 math and storage
    if (~tp_rows).any():
        tol = 1e-5 if fp32 else 8e-3
        assert err[~tp_rows].max().item() <= tol, f"akk_d: dot-formed rows, max error {err[~tp_rows].max():.3g}"
    upper = (r[None, :SUB] >= (r % SUB)[:, None]).expand_as(akk_d)
    assert (akk_d[upper] == 0).all()
    for i, (_, _, _, L) in enumerate(rows):
        assert (akk_d[i, :, L:] == 0).all()


def check_close(name, got, ref, tol):
    """Max error relative to the matrix's largest entry, per (slot, value head)."""
    got = got.double()
    assert torch.isfinite(got).all(), name
    scale = ref.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-30)
    err = ((got - ref).abs() / scale).max().item()
    assert err <= tol, f"{name}: max error {err:.3g} of the largest entry > {tol}"


CASES = [
    # name, B, T, H, HV, K, seqlens, dtype, gate, l2norm, strided
    ("fp32-none-fixed-gva", 2, 70, 2, 4, 24, None, torch.float32, GATE_NONE, True, True),
    ("bf16-softplus-varlen", 1, 75, 1, 4, 32, [70, 0, 5], torch.bfloat16, GATE_SOFTPLUS, True, True),
    ("fp32-lowerbound-varlen", 1, 95, 2, 4, 32, [70, 0, 5, 20], torch.float32, GATE_LOWER_BOUND, False, False),
    ("bf16-none-fixed-short", 2, 40, 1, 2, 24, None, torch.bfloat16, GATE_NONE, False, True),
    ("fp32-softplus-k20", 1, 80, 1, 1, 20, None, torch.float32, GATE_SOFTPLUS, True, False),
    ("fp16-lowerbound-short", 1, 20, 2, 2, 32, None, torch.float16, GATE_LOWER_BOUND, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_intra_matches_reference(case):
    """aqk, akk_d, tinv against float64: fp32 within 1e-4 of each matrix's largest entry (16-bit: bf16/fp16
    storage and bf16 dot operands); exact zeros above the diagonal and in akk_d's unused columns and rows;
    Tinv's diagonal exactly 1; every entry of the chunks' rows written (outputs start as NaN) and finite, nothing
    stored outside them (padded rows past a batch row's last chunk, columns past the pair tensor)."""
    _, B, T, H, HV, K, seqlens, dtype, gate, l2norm, strided = case
    x = make_inputs(B=B, T=T, H=H, HV=HV, K=K, seqlens=seqlens, dtype=dtype, gate=gate, l2norm=l2norm,
                    strided=strided, seed=len(case[0]))
    n = len(x.rows)
    scale = K ** -0.5
    buf, aqk, tinv = pair_views(B, T, HV, dtype)
    akk_d = torch.full((n, HV, C, SUB), math.nan)
    run_intra(SimpleNamespace(scale=scale, safe=False), x.table, x.q, x.k, x.gc, x.bt, x.rq, x.rk, aqk, akk_d, tinv)

    check_outputs(x, scale, dtype, aqk, akk_d, tinv, buf)


def real_rows(rows):
    """bool ``[n, 1, C, 1]``: the chunks' real rows r < L."""
    return torch.stack([torch.arange(C) < L for _, _, _, L in rows])[:, None, :, None]


def check_outputs(x, scale, dtype, aqk, akk_d, tinv, buf=None):
    """The common checks on token-layout aqk, tinv (``buf``: their NaN-filled backing buffer from
    ``_pairs.pair_views``, checked for stores outside the chunks' rows when given); returns the token-parallel
    sub-chunk mask."""
    if buf is not None:
        assert_outside_untouched(buf, x.T, x.rows, "aqk/tinv")
    aqk, tinv = from_tokens(aqk, x.rows), from_tokens(tinv, x.rows)  # [n, HV, C, C], rows >= L 0
    real = real_rows(x.rows)
    r_aqk, r_akk, r_tinv = reference(x, scale)
    assert (r_aqk[~real.expand_as(r_aqk)] == 0).all()  # the contract's padded rows of Aqk are 0 (q^ = 0 there)
    fp32 = dtype == torch.float32
    check_close("aqk", aqk, r_aqk, 1e-5 if fp32 else 8e-3)
    tp = token_parallel(x)
    check_akk_d(akk_d, r_akk, tp, x.rows, fp32)
    # Tinv's padded rows (unit rows in the reference: identity steps) have no storage
    check_close("tinv", tinv, torch.where(real, r_tinv, 0.0), 1e-4 if fp32 else 5e-3)

    r = torch.arange(C)
    upper = r[None, :] > r[:, None]
    assert (aqk[..., upper] == 0).all() and (tinv[..., upper] == 0).all()
    diag = tinv.diagonal(dim1=-2, dim2=-1)  # [n, HV, C]
    assert (diag[real[..., 0].expand_as(diag)] == 1).all()
    return tp


def test_diag_blocks_exact_under_resets():
    """A chunk whose log-decay holds -inf (clamped to -110) and -30 everywhere but a few tokens: the pairs
    across a reset are exactly 0 and the rest match float64 to fp32 rounding."""
    x = make_inputs(B=1, T=64, H=1, HV=1, K=24, seqlens=None, dtype=torch.float32, gate=GATE_NONE, l2norm=True,
                    strided=False, seed=3)
    a = torch.full((64, 24), -30.0)
    a[::5] = -0.01
    a[7] = LOG_DECAY_FLOOR
    x.gc[0, 0] = torch.cumsum(a, dim=0)
    buf, aqk, tinv = pair_views(1, 64, 1, torch.float32)
    akk_d = torch.empty(1, 1, C, SUB)
    run_intra(SimpleNamespace(scale=0.5, safe=False), x.table, x.q, x.k, x.gc, x.bt, x.rq, x.rk, aqk, akk_d, tinv)
    assert_outside_untouched(buf, 64, x.rows, "aqk/tinv")
    aqk, tinv = from_tokens(aqk, x.rows), from_tokens(tinv, x.rows)
    r_aqk, r_akk, r_tinv = reference(x, 0.5)
    assert (aqk[0, 0, 7:, :7] == 0).all() and (akk_d[0, 0, 7:16, :7] == 0).all()
    # the diagonal blocks pair by pair: each entry, down to 1e-30, to fp32 rounding (sums of 24 terms)
    assert torch.allclose(diag_blocks(aqk).double(), diag_blocks(r_aqk), rtol=1e-4, atol=1e-30)
    assert torch.allclose(akk_d.double(), diag_blocks(r_akk), rtol=1e-4, atol=1e-30)
    check_close("aqk", aqk, r_aqk, 1e-5)
    check_close("tinv", tinv, r_tinv, 1e-5)


def test_run_intra_rejects_bad_arguments():
    x = make_inputs(B=1, T=16, H=1, HV=2, K=16, seqlens=None, dtype=torch.float32, gate=GATE_LOWER_BOUND,
                    l2norm=True, strided=False, seed=0)
    n, opts = len(x.rows), SimpleNamespace(scale=1.0, safe=False)
    _, aqk, tinv = pair_views(1, 16, 2, torch.float32)
    good = dict(aqk=aqk, akk_d=torch.empty(n, 2, C, SUB), tinv=tinv)

    def call(**over):
        t = dict(table=x.table, q=x.q, k=x.k, gc=x.gc, bt=x.bt, rq=x.rq, rk=x.rk, **good)
        t.update(over)
        run_intra(opts, t["table"], t["q"], t["k"], t["gc"], t["bt"], t["rq"], t["rk"], t["aqk"], t["akk_d"],
                  t["tinv"])

    # aqk, tinv: token layout [B, T, HV, C] in q's dtype, unit last stride, views of one pair tensor
    with pytest.raises(TypeError, match="aqk"):
        call(aqk=aqk.to(torch.bfloat16))
    with pytest.raises(TypeError, match="tinv"):
        call(tinv=torch.empty(1, 16, 2, C, dtype=torch.float16))
    with pytest.raises(ValueError, match="aqk"):
        call(aqk=torch.empty(n, 2, C, C))  # the former slot layout
    with pytest.raises(ValueError, match="tinv"):
        call(tinv=torch.empty(1, 17, 2, 2 * C)[:, :16, :, :C].transpose(1, 2))  # [B, HV, T, C]
    with pytest.raises(ValueError, match="tinv"):
        call(tinv=torch.empty(1, 16, 2, 2 * C)[..., ::2])  # not unit-stride
    with pytest.raises(ValueError, match="aqk and tinv"):
        call(tinv=torch.empty(1, 16, 2, C))  # the right shape, but not a view of aqk's pair tensor
    with pytest.raises(ValueError, match="tinv"):
        call(tinv=torch.empty(1, 15, 2, 2 * C)[..., C:])  # T of 15
    with pytest.raises(ValueError, match="akk_d"):
        call(akk_d=torch.empty(n, 2, C, 8))
    with pytest.raises(ValueError, match="gc"):
        call(gc=x.gc.double())
    with pytest.raises(ValueError, match="q"):
        call(q=x.q.transpose(2, 3))
    with pytest.raises(ValueError, match="table"):
        call(table=x.table.long())
    with pytest.raises(TypeError, match="rq"):
        call(rq=None)
    with pytest.raises(ValueError, match="HV"):
        call(q=torch.randn(1, 16, 3, 16), k=torch.randn(1, 16, 3, 16))


BUILD_SCRIPT = r"""
from tests.ops.kda._sm90_build import print_reports, sm90_report
import kdakit.ops.kda.chunk.intra as M

PTR = {"table": "*i32", "gc": "*fp32", "bt": "*fp32", "rq": "*fp32", "rk": "*fp32", "akk_d": "*fp32"}
out = {}
# every pointer, stride and head count divisibility-16, as the JIT specializes them at K = 128, H = HV = 96
for tok in ("bf16", "fp32"):  # fp16 builds the bf16 code (bf16 operands) on fp16 pointers
    types = dict(PTR, **{n: "*" + tok for n in ("q", "k", "aqk", "tinv")}, scale="fp32")
    prec = "tf32x3" if tok == "fp32" else "tf32"
    fn, warps = M.chunk_intra_diag_kernel, M.DIAG_NUM_WARPS
    out[f"{fn.__name__} {tok}"] = dict(sm90_report(fn, types, dict(K=128, BK=128, BH=M.DIAG_BLOCK_H, C=64, SB=16,
                                                                   ROUND=False), warps), warps=warps)
    fn, (bk, warps) = M.chunk_intra_dots_kernel, M.DOTS_CONFIG[tok]
    for safe in (False, True):
        out[f"{fn.__name__} {tok} safe={safe}"] = dict(sm90_report(fn, types, dict(
            K=128, BK=bk, C=64, SB=16, OP_BF16=tok != "fp32", EMULATE_BF16=False, DOT_PREC=prec,
            ROUND=False, SAFE=safe), warps), warps=warps)
    fn, (bk, warps, stages) = M.chunk_intra_solve_kernel, M.SOLVE_CONFIG[tok]
    out[f"{fn.__name__} {tok}"] = dict(sm90_report(fn, types, dict(
        K=128, BK=bk, C=64, SB=16, OP_BF16=tok != "fp32", EMULATE_BF16=False, DOT_PREC=prec, INV_PREC="tf32x3",
        ROUND=False), warps, stages), warps=warps)
print_reports(out)
"""

WARPS = {chunk_intra_diag_kernel.__name__: lambda tok: DIAG_NUM_WARPS,
         chunk_intra_dots_kernel.__name__: lambda tok: DOTS_CONFIG[tok][1],
         chunk_intra_solve_kernel.__name__: lambda tok: SOLVE_CONFIG[tok][1]}


def test_kernels_build_for_sm90_without_spills():
    """The three kernels, 16-bit and fp32 inputs, the dots kernel with and without SAFE, at the launcher's
    configs (K = 128): registers <= 255, at most 4 warps, no spills but the solve kernel's declared budget."""
    reports = read_reports(run_sm90_build(BUILD_SCRIPT))
    assert len(reports) == 8, reports
    for key, r in reports.items():
        name, tok = key.split()[:2]
        assert r["warps"] == WARPS[name](tok) and r["warps"] <= 4
        spill = r["spill_stores"] + r["spill_loads"]
        budget = SOLVE_SPILL_BUDGET[tok] if name == chunk_intra_solve_kernel.__name__ else 0
        assert spill <= budget, f"{key}: {spill} bytes of spill (budget {budget})"
        assert r["regs"] <= 255, f"{key}: {r['regs']} registers"
    assert {key.split()[0] for key in reports} == set(WARPS)
    assert solve_block_k(True, 128) >= 16
