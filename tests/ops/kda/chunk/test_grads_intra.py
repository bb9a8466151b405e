"""grads_intra (kdakit/ops/kda/chunk/grads_intra.py): the pairwise gradients of Aqk and A = diag(β) Akk.

The kernel's increments to dqh, dkh, dgs, dbs (slots filled with random values first, subtracted after) are
compared with float64 autograd of the two matrices as functions of q̂, k̂, G and β, per chunk and value head,
for every gate's kind of G: safe (log-decays in [-5, 0], on the SAFE path and without SAFE), softplus-like
(down to -40 per token), raw with -110 (the clamp value) entries, large (below -41 at every sub-chunk's middle row)
and mixed (large log-decays on some sub-chunks and key channels of each chunk, bounded ones elsewhere). Shapes cover K = 24 / 32 /
100 (several K blocks), H = 1 and 2 with HV = 4, fixed-length B = 2 and packed sequences with short chunks and
a zero-length sequence, q and k as strided views of one fused tensor, bf16 and fp32. Entries the kernel must
not read (gc's padded rows, daqk / dakk above the diagonal and outside the chunk) hold NaN.

Without SAFE the diagonal blocks' path is chosen per (sub-chunk, K block) at run time (the span check): each
case's tiles are classified by the same check here, and the kernel's tiles are compared with a run of the SAFE
build (dots everywhere): bit-equal where the check passes, different where it fails, and every case has the mix
of paths it was built for. An sm_90a build of every variant checks registers and spills.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kdakit.ops.kda.chunk.grads_intra import DOT_SPAN_LIMIT, GRADS_INTRA_BLOCK_K, run_grads_intra
from kdakit.ops.kda.chunk_common import block_size
from kdakit.ops.kda.chunk.plan import chunk_table, chunk_table_rows
from kdakit.ops.kda.chunk.tiles import CHUNK, SUB
from kdakit.ops.kda.options import KDAOptions
from kdakit.ops.kda.validate import KDAShape

from .._sm90_build import read_reports, run_sm90_build

C = CHUNK


def make_opts(H, HV, K, gate):
    """KDAOptions for a gate kind: 'safe' (lower_bound = -5: the SAFE path), 'softplus', 'raw', 'raw_safe'
    (safe_gate=True with a raw log-decay: the SAFE path too), 'safe_exact' (a lower bound of -6: no SAFE, on
    log-decays in [-5, 0]), 'large' and 'mixed' (raw log-decays, no SAFE)."""
    in_kernel = gate in ("safe", "softplus", "safe_exact")
    return KDAOptions(
        shape=KDAShape(B=1, T=C, H=H, HV=HV, K=K, V=K, N=1), scale=K ** -0.5, output_final_state=False,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=in_kernel, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=False, safe_gate=gate == "raw_safe", lower_bound={"safe": -5.0, "safe_exact": -6.0}.get(gate),
        state_v_first=False, has_A_log=in_kernel, has_dt_bias=in_kernel)


def log_decay(kind, B, T, HV, K, gen):
    """Per-token log-decays [B, T, HV, K] (fp32) of a gate kind, as prep would produce them."""
    x = torch.randn(B, T, HV, K, generator=gen)
    if kind in ("safe", "raw_safe", "safe_exact"):
        return -5.0 * torch.sigmoid(2.0 * x)  # the lower-bound gate, in [-5, 0]
    if kind == "large":
        # [-5, 0] but below -41 at each sub-chunk's middle row: every full sub-chunk fails the span check
        mid = (torch.arange(T) % SUB == SUB // 2)[:, None, None]
        return torch.where(mid, -41.0 - 10.0 * torch.rand(B, T, HV, K, generator=gen), -5.0 * torch.sigmoid(2.0 * x))
    if kind == "mixed":
        # per chunk: sub-chunks 1 and 3 and key channels of the K blocks 1, 3 in [-36, -6], the rest in [-5, 0]
        sub = (torch.arange(T) % C) // SUB
        blk = torch.arange(K) // GRADS_INTRA_BLOCK_K
        big = ((sub % 2 == 1)[:, None, None] & (blk % 2 == 1)[None, None, :]).expand(T, HV, K)
        return torch.where(big, -6.0 - 30.0 * torch.rand(B, T, HV, K, generator=gen),
                           -5.0 * torch.sigmoid(2.0 * x))
    if kind == "softplus":
        exp_a = 1.0 + 15.0 * torch.rand(HV, 1, generator=gen)  # exp(A_log) ~ U(1, 16)
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(HV, K, generator=gen))
        dt_bias = torch.log(torch.expm1(dt))
        return (-exp_a * F.softplus(3.0 * x + dt_bias)).clamp(min=-40.0)
    a = -2.0 * torch.rand(B, T, HV, K, generator=gen)  # raw: small decays with resets at the clamp value
    return torch.where(torch.rand(B, T, HV, K, generator=gen) < 0.08, torch.full_like(a, -110.0), a)


def make_case(B, T, seqlens, H, HV, K, dtype, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = chunk_table_rows(B, T, seqlens)
    table = chunk_table(B, T, seqlens, "cpu")
    n = len(rows)
    # q, k as views of one fused projection (token stride 2 H K + 7)
    fused = torch.randn(B, T, 2 * H * K + 7, generator=gen).to(dtype)
    q, k, _ = fused.split([H * K, H * K, 7], dim=-1)
    q, k = q.view(B, T, H, K), k.view(B, T, H, K)
    a = log_decay(kind, B, T, HV, K, gen)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    nan = float("nan")
    gc = torch.full((n, HV, C, K), nan)
    bt = torch.zeros(n, HV, C)
    rq = torch.zeros(n, H, C)
    rk = torch.zeros(n, H, C)
    daqk = torch.full((n, HV, C, C), nan)
    dakk = torch.full((n, HV, C, C), nan)
    tril = torch.ones(C, C).tril().bool()
    for i, (_, b, t0, L) in enumerate(rows):
        gc[i, :, :L] = a[b, t0:t0 + L].cumsum(0).transpose(0, 1)
        bt[i, :, :L] = beta[b, t0:t0 + L].transpose(0, 1)
        rq[i, :, :L] = q[b, t0:t0 + L].float().pow(2).sum(-1).add(1e-6).rsqrt().transpose(0, 1)
        rk[i, :, :L] = k[b, t0:t0 + L].float().pow(2).sum(-1).add(1e-6).rsqrt().transpose(0, 1)
        lower = tril[:L, :L]
        g = torch.randn(2, HV, L, L, generator=gen)
        daqk[i, :, :L, :L] = torch.where(lower, g[0], nan)
        dakk[i, :, :L, :L] = torch.where(lower.tril(-1), g[1], nan)
    slots = [torch.randn(n, HV, C, K, generator=gen) for _ in range(3)] + [torch.randn(n, HV, C, generator=gen)]
    return rows, table, q, k, gc, bt, rq, rk, daqk, dakk, slots


def reference(rows, q, k, gc, bt, rq, rk, daqk, dakk, scale, H, HV):
    """float64 autograd of Aqk and A = diag(β) Akk per chunk and value head: increments on the L real rows."""
    out = []
    for i, (_, b, t0, L) in enumerate(rows):
        per_head = []
        for hv in range(HV):
            h = hv // (HV // H)
            qh = (q[b, t0:t0 + L, h].double() * rq[i, h, :L, None].double()).requires_grad_()
            kh = (k[b, t0:t0 + L, h].double() * rk[i, h, :L, None].double()).requires_grad_()
            G = gc[i, hv, :L].double().requires_grad_()
            bv = bt[i, hv, :L].double().requires_grad_()
            d = G[:, None, :] - G[None, :, :]  # [L, L, K]
            incl = torch.ones(L, L, dtype=torch.bool).tril()[:, :, None]
            strict = torch.ones(L, L, dtype=torch.bool).tril(-1)[:, :, None]
            e_incl = torch.exp(torch.where(incl, d, -math.inf))
            e_strict = torch.exp(torch.where(strict, d, -math.inf))
            aqk = scale * torch.einsum("ic,jc,ijc->ij", qh, kh, e_incl)
            akk = torch.einsum("ic,jc,ijc->ij", kh, kh, e_strict)
            dA = daqk[i, hv, :L, :L].double().nan_to_num(0.0).tril()
            dK = dakk[i, hv, :L, :L].double().nan_to_num(0.0).tril(-1)
            loss = (dA * aqk).sum() + (dK * (bv[:, None] * akk)).sum()
            per_head.append(torch.autograd.grad(loss, (qh, kh, G, bv)))
        out.append(per_head)
    return out


def rel_err(x, ref, slot):
    """Max error relative to the reference's max, less the resolution of the increment: it is read as the
    difference of fp32 slot values, each rounded to half an ulp of the slot's value (``slot``, after the '+=')."""
    err = ((x.double() - ref).abs() - 2.0 ** -23 * slot.double().abs()).clamp_min(0.0)
    return (err.max() / ref.abs().max().clamp_min(1e-30)).item()


CASES = [
    # B, T, seqlens, H, HV, K, dtype, gate kind (G's kind and the path: 'safe' / 'raw_safe' take SAFE)
    (2, 70, None, 2, 4, 24, torch.float32, "raw"),
    (1, 139, [70, 0, 64, 5], 1, 4, 32, torch.bfloat16, "softplus"),
    (1, 139, [70, 0, 64, 5], 2, 4, 24, torch.bfloat16, "safe"),
    (2, 70, None, 1, 2, 32, torch.float32, "raw_safe"),
    (1, 75, [5, 70], 1, 2, 100, torch.float32, "safe_exact"),
    (1, 139, [70, 0, 64, 5], 1, 2, 32, torch.bfloat16, "safe_exact"),
    (2, 70, None, 1, 2, 24, torch.float32, "large"),
    (2, 70, None, 1, 2, 100, torch.float32, "mixed"),
    (1, 75, [5, 70], 1, 2, 100, torch.bfloat16, "mixed"),
]


def dot_tiles(rows, gc, HV, K):
    """The kernel's span check per (chunk, value head, sub-chunk, K block) of the real sub-chunks: True where the
    diagonal block takes the dots (|G - G_mid| <= DOT_SPAN_LIMIT over the tile, padded rows as the row L - 1,
    mid = min(r0 + 8, L - 1); a NaN fails), in the kernel's fp32 arithmetic."""
    BK = min(GRADS_INTRA_BLOCK_K, block_size(K))
    out = {}
    for i, (_, _, _, L) in enumerate(rows):
        for s in range(C // SUB):
            r0 = s * SUB
            if r0 >= L:
                continue
            idx = torch.arange(r0, r0 + SUB).clamp(max=L - 1)
            mid = min(r0 + SUB // 2, L - 1)
            for hv in range(HV):
                for c0 in range(0, K, BK):
                    d = (gc[i, hv, idx, c0:c0 + BK] - gc[i, hv, mid, c0:c0 + BK]).abs()
                    out[(i, hv, s, c0)] = bool((d <= DOT_SPAN_LIMIT).all())
    return out, BK


# each non-SAFE case and the paths its tiles must take: 'dots' (all), 'exact' (every full sub-chunk: the
# token-parallel loop), 'both' (both paths within one chunk); the SAFE cases ('safe', 'raw_safe') have one path
PATHS = {"safe_exact": "dots", "large": "exact", "raw": "exact", "softplus": "both", "mixed": "both"}


@pytest.mark.parametrize("B,T,seqlens,H,HV,K,dtype,kind", CASES)
@pytest.mark.slow
def test_grads_intra_matches_float64_autograd(B, T, seqlens, H, HV, K, dtype, kind):
    """The increments against float64 autograd; for the non-SAFE cases, the same run's tiles against the SAFE
    build's (``check_paths``: one interpreter run of the kernel serves both checks)."""
    rows, table, q, k, gc, bt, rq, rk, daqk, dakk, slots = make_case(B, T, seqlens, H, HV, K, dtype, kind, 7)
    opts = make_opts(H, HV, K, kind)
    assert opts.safe == (kind in ("safe", "raw_safe"))
    assert opts.safe == (kind not in PATHS)
    before = [x.clone() for x in slots]
    run_grads_intra(opts, table, q, k, gc, bt, rq, rk, daqk, dakk, *slots)
    ref = reference(rows, q, k, gc, bt, rq, rk, daqk, dakk, opts.scale, H, HV)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    names = ("dqh", "dkh", "dgs", "dbs")
    for i, (_, _, _, L) in enumerate(rows):
        for hv in range(HV):
            for j, name in enumerate(names):
                inc = slots[j][i, hv, :L] - before[j][i, hv, :L]
                err = rel_err(inc, ref[i][hv][j], slots[j][i, hv, :L])
                assert err < tol, f"{name} chunk {i} head {hv}: relative error {err:.2e}"
            # the pairwise terms of dG cancel over the chunk's rows (their sum over rows is exactly 0): to fp32
            # rounding, bf16 operands included (plus the rounding of the '+=' onto the slot's values)
            dg = slots[2][i, hv, :L].double() - before[2][i, hv, :L].double()
            allowed = 1e-5 * dg.abs().sum(0) + 2.0 ** -23 * slots[2][i, hv, :L].double().abs().sum(0)
            resid = (dg.sum(0).abs() / allowed).max().item()
            assert resid < 1, f"dgs rows of chunk {i} head {hv} do not cancel: {resid:.2f} of the allowance"
    for j, name in enumerate(names):  # padded rows are not written
        for i, (_, _, _, L) in enumerate(rows):
            assert torch.equal(slots[j][i, :, L:], before[j][i, :, L:]), f"{name}: padded rows of chunk {i} written"
    if not opts.safe:
        check_paths(rows, table, q, k, gc, bt, rq, rk, daqk, dakk, before, slots, H, HV, K, kind, PATHS[kind])


def check_paths(rows, table, q, k, gc, bt, rq, rk, daqk, dakk, before, slots, H, HV, K, kind, expect):
    """Without SAFE, a tile that passes the span check is bit-equal to the SAFE build's (dots everywhere), one that
    fails differs from it (the token-parallel loop; float64 agreement is checked above). ``slots``: the non-SAFE
    run's output from the initial values ``before``."""
    opts, opts_safe = make_opts(H, HV, K, kind), make_opts(H, HV, K, "raw_safe")
    assert not opts.safe and opts_safe.safe and opts.scale == opts_safe.scale
    twin = [x.clone() for x in before]
    run_grads_intra(opts_safe, table, q, k, gc, bt, rq, rk, daqk, dakk, *twin)
    dots, BK = dot_tiles(rows, gc, HV, K)
    for (i, hv, s, c0), ok in dots.items():
        r = slice(s * SUB, min(s * SUB + SUB, rows[i][3]))
        for j, name in enumerate(("dqh", "dkh", "dgs")):
            same = torch.equal(slots[j][i, hv, r, c0:c0 + BK], twin[j][i, hv, r, c0:c0 + BK])
            assert same == ok, f"{name} chunk {i} head {hv} sub-chunk {s} K block {c0}: dots expected {ok}"
    per_chunk = {}
    for (i, _, _, _), ok in dots.items():
        per_chunk.setdefault(i, set()).add(ok)
    if expect == "dots":
        assert all(v == {True} for v in per_chunk.values()), per_chunk
    elif expect == "exact":
        full = [ok for (i, _, s, _), ok in dots.items() if s * SUB + SUB <= rows[i][3]]
        assert full and not any(full), per_chunk
    else:
        assert any(v == {True, False} for v in per_chunk.values()), per_chunk


def test_grads_intra_rejects_bad_arguments():
    rows, table, q, k, gc, bt, rq, rk, daqk, dakk, slots = make_case(1, 70, None, 1, 2, 24, torch.float32, "raw", 1)
    opts = make_opts(1, 2, 24, "raw")
    args = [table, q, k, gc, bt, rq, rk, daqk, dakk, *slots]
    with pytest.raises(TypeError, match="opts"):
        run_grads_intra(None, *args)
    bad = list(args)
    bad[10] = slots[1][:, :, :, :20]
    with pytest.raises(ValueError, match="dkh"):
        run_grads_intra(opts, *bad)
    bad = list(args)
    bad[7] = daqk.double()
    with pytest.raises(ValueError, match="daqk"):
        run_grads_intra(opts, *bad)
    bad = list(args)
    bad[1] = q.transpose(1, 2)
    with pytest.raises(ValueError, match="q"):
        run_grads_intra(opts, *bad)
    bad = list(args)
    bad[0] = table.long()
    with pytest.raises(ValueError, match="table"):
        run_grads_intra(opts, *bad)


BUILD = """
from tests.ops.kda._sm90_build import print_reports, sm90_report
import kdakit.ops.kda.chunk.grads_intra as M
from kdakit.ops.kda.backend import dot_precision
from kdakit.ops.kda.chunk.tiles import CHUNK, SUB
import torch

fn = M.chunk_grads_intra_kernel
out = {}
for safe in (False, True):
    for dtype in (torch.bfloat16, torch.float32):
        const = dict(K=128, BK=M.GRADS_INTRA_BLOCK_K, C=CHUNK, SUBC=SUB, SAFE=safe, OP_BF16=dtype != torch.float32,
                     EMULATE_BF16=False, DOT_PREC=dot_precision(dtype))
        tok = "*bf16" if dtype == torch.bfloat16 else "*fp32"
        types = dict(q=tok, k=tok, table="*i32", scale="fp32",
                     **{n: "*fp32" for n in ("gc", "bt", "rq", "rk", "daqk", "dakk", "dqh", "dkh", "dgs", "dbs")})
        # what the JIT specializes at real shapes: pointers and strides multiples of 16
        out[f"SAFE={safe} {dtype}"] = sm90_report(
            fn, types, const, M.GRADS_INTRA_NUM_WARPS["fp32" if dtype == torch.float32 else "bf16"],
            M.GRADS_INTRA_NUM_STAGES)
print_reports(out)
"""


def test_grads_intra_builds_for_sm90_without_spills():
    from kdakit.ops.kda.chunk.grads_intra import GRADS_INTRA_NUM_WARPS

    reports = read_reports(run_sm90_build(BUILD))
    assert len(reports) == 4, reports
    budget = 255 if max(GRADS_INTRA_NUM_WARPS.values()) <= 4 else 128
    for name, r in reports.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name}: spills: {r}"
        assert r["regs"] <= budget, f"{name}: {r['regs']} registers"
