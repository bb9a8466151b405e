"""The state walks and dAv of the 64-token pipeline (kdakit/ops/kda/chunk/walk.py) against float64 loops over
chunks implementing docs/chunk_pipeline.md's formulas, on random slot tensors (padded rows and aqk's upper
triangle hold garbage the kernels must not read), fixed-length and packed (with a short chunk and an empty
sequence) tables, one window and two windows with the carry passed between, strided do / o views; plus the
launchers' argument checks and an sm_90a build of every kernel variant (registers, no spills). aqk is in token
layout (tests/ops/kda/chunk/_pairs.py): each chunk's rows < L at its tokens in a NaN-filled pair buffer, so a
padded row a kernel read would be the next chunk's rows or NaN past the batch row's last chunk."""

import pytest
import torch

from kdakit.ops.kda.chunk.plan import chunk_table_rows
from kdakit.ops.kda.chunk.tiles import CHUNK
from kdakit.ops.kda.chunk.walk import run_dav, run_walk_bwd, run_walk_fwd
from kdakit.ops.kda.options import kda_options
from tests.ops.kda._sm90_build import read_reports, run_sm90_build
from tests.ops.kda.chunk._pairs import pair_views, same_bits, to_tokens

C = CHUNK
DIMS = [(24, 20), (32, 32)]  # (K, V): not powers of two, and a full block
CASES = [  # (B, T, H, HV, seqlens)
    (2, 140, 1, 1, None),
    (1, 139, 2, 4, [70, 0, 64, 5]),
]


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dot operand as the kernels form it: bf16 for 16-bit slots, the value itself for fp32."""
    return x if dtype == torch.float32 else x.to(torch.bfloat16).double()


def _seq_rows(rows, r0: int, r1: int, N: int, base: int | None = None) -> torch.Tensor:
    """(first row counted from ``base`` (default r0: the first slot within the window), chunk count) of each
    sequence among table rows [r0, r1)."""
    out = [[0, 0] for _ in range(N)]
    for i in range(r0, r1):
        n = rows[i][0]
        if out[n][1] == 0:
            out[n][0] = i - (r0 if base is None else base)
        out[n][1] += 1
    return torch.tensor(out, dtype=torch.int32).reshape(N, 2)


def _view(wide: torch.Tensor, HV: int, V: int) -> torch.Tensor:
    """The [B, T, HV, V] view of a wide token tensor [B, T, 3 + HV * V] (token stride HV * V + 3)."""
    return wide[..., 3:].view(wide.shape[0], wide.shape[1], HV, V)


def _setup(B, T, H, HV, seqlens, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = chunk_table_rows(B, T, seqlens)
    n = len(rows)
    N = B if seqlens is None else len(seqlens)
    q = torch.randn(B, T, H, K, generator=gen)
    cu = None if seqlens is None else torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist())
    opts = kda_options(q, q, torch.randn(B, T, HV, V, generator=gen), torch.randn(B, T, HV, K, generator=gen),
                       torch.rand(B, T, HV, generator=gen), scale=0.37, cu_seqlens=cu)

    def rn(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    # G per chunk: cumsum of negative log-decays, two channels reset-like (-30 a token, then huge negatives);
    # padded rows hold +3 (exp would blow up if a kernel read one as g_C)
    a = -torch.rand(n, HV, C, K, generator=gen) * 0.3
    a[..., 1] = -30.0
    gc = a.cumsum(2)
    for i, (_, _, _, L) in enumerate(rows):
        gc[i, :, L:] = 3.0
    x = dict(
        w=rn(n, HV, C, K, s=0.5 / K ** 0.5), u=rn(n, HV, C, V), qg=rn(n, HV, C, K),
        kd=rn(n, HV, C, K, s=0.5 / C ** 0.5), aqk_slot=rn(n, HV, C, C, s=0.2), gc=gc.float(),
        carry=torch.randn(N, HV, K, V, generator=gen),
        do_wide=rn(B, T, 3 + HV * V), o_wide=rn(B, T, 3 + HV * V),
        dvs=torch.randn(n, HV, C, V, generator=gen), dcarry=torch.randn(N, HV, K, V, generator=gen),
    )
    x["do"], x["o"] = _view(x["do_wide"], HV, V), _view(x["o_wide"], HV, V)
    # aqk in token layout: the slot matrices' rows < L (upper triangle garbage included) at their tokens
    x["aqk_buf"], x["aqk"], _ = pair_views(B, T, HV, dtype)
    to_tokens(x["aqk_slot"], rows, x["aqk"])
    return opts, rows, n, N, x


def _chunk_operands(x, i, L):
    """float64 copies of slot i's tiles with the padded rows (r >= L) zeroed and aqk lower-triangular."""
    z = {name: x[name][i].double().clone() for name in ("w", "u", "qg", "kd", "aqk_slot", "dvs")}
    z["aqk"] = z.pop("aqk_slot")
    for name in z:
        z[name][:, L:] = 0.0
    z["aqk"] = torch.tril(z["aqk"])
    z["decay"] = torch.exp(x["gc"][i, :, L - 1].double())  # [HV, K]
    return z


def _ref_fwd(rows, seq_rows, x, scale, dtype, store_o):
    """float64 forward walk: (h, u with V', o, carry)."""
    h = torch.full(x["w"].shape[:2] + (x["w"].shape[3], x["u"].shape[3]), float("nan"), dtype=torch.float64)
    u = torch.full(x["u"].shape, float("nan"), dtype=torch.float64)
    o = x["o"].double().clone()
    carry = x["carry"].double().clone()
    for n_seq, (first, count) in enumerate(seq_rows.tolist()):
        S = carry[n_seq]  # [HV, K, V]
        for i in range(first, first + count):
            _, b, t0, L = rows[i]
            z = _chunk_operands(x, i, L)
            h[i] = S
            Sb = _rnd(S, dtype)
            Vn = z["u"] - z["w"] @ Sb
            u[i] = Vn
            Vb = _rnd(Vn, dtype)
            if store_o:
                O = scale * (z["qg"] @ Sb) + z["aqk"] @ Vb  # [HV, C, V]
                o[b, t0:t0 + L] = O[:, :L].transpose(0, 1)
            S = S * z["decay"][..., None] + z["kd"].transpose(1, 2) @ Vb
        carry[n_seq] = S
    return h, u, o, carry


def _ref_bwd(rows, seq_rows, x, scale, dtype):
    """float64 reverse walk: (dh, dvs with dV', carry)."""
    dh = torch.full(x["w"].shape[:2] + (x["w"].shape[3], x["u"].shape[3]), float("nan"), dtype=torch.float64)
    dvs = torch.full(x["dvs"].shape, float("nan"), dtype=torch.float64)
    carry = x["dcarry"].double().clone()
    for n_seq, (first, count) in enumerate(seq_rows.tolist()):
        dS = carry[n_seq]
        for i in reversed(range(first, first + count)):
            _, b, t0, L = rows[i]
            z = _chunk_operands(x, i, L)
            dO = torch.zeros_like(z["u"])
            dO[:, :L] = x["do"][b, t0:t0 + L].double().transpose(0, 1)
            dh[i] = dS
            dVn = z["dvs"] + z["kd"] @ _rnd(dS, dtype)
            dvs[i] = dVn
            dS = dS * z["decay"][..., None] + scale * z["qg"].transpose(1, 2) @ dO \
                - z["w"].transpose(1, 2) @ _rnd(dVn, dtype)
        carry[n_seq] = dS
    return dh, dvs, carry


def _ref_dav(rows, x):
    """float64 dAv: (daqk, dvs)."""
    n, HV, _, V = x["u"].shape
    daqk = torch.empty(n, HV, C, C, dtype=torch.float64)
    dvs = torch.empty(n, HV, C, V, dtype=torch.float64)
    for i, (_, b, t0, L) in enumerate(rows):
        z = _chunk_operands(x, i, L)
        dO = torch.zeros(HV, C, V, dtype=torch.float64)
        dO[:, :L] = x["do"][b, t0:t0 + L].double().transpose(0, 1)
        daqk[i] = torch.tril(dO @ z["u"].transpose(1, 2))
        dvs[i] = z["aqk"].transpose(1, 2) @ dO
    return daqk, dvs


def _tol(dtype, stored=True):
    """fp32 slots: 1e-4 of the largest value. 16-bit slots: their rounding (2^-9) for what is stored in the token
    dtype; fp32 results (carry, dvs) see only rare rounding flips of the operands, which the reference rounds too."""
    if dtype == torch.float32:
        return 1e-4
    return 6e-3 if stored else 1e-3


def _run_fwd(opts, x, table, rows, N, windows, store_o):
    """The forward walk over table rows split into windows [(r0, r1), ...], the carry passed between."""
    n, HV, _, K = x["w"].shape
    V = x["u"].shape[3]
    u = x["u"].clone()
    h = torch.full((n, HV, K, V), float("nan"), dtype=x["w"].dtype)
    o_wide = x["o_wide"].clone()
    o = _view(o_wide, HV, V) if store_o else None
    carry = x["carry"].clone()
    for r0, r1 in windows:
        # the table's own row numbers, with the slots and table starting at row0 = r0
        s = slice(r0, r1)
        run_walk_fwd(opts, table[s], _seq_rows(rows, r0, r1, N, base=0)[None], x["w"][s], u[s], x["qg"][s],
                     x["kd"][s], x["aqk"], x["gc"][s], carry, h[s], o, row0=r0)
    return h, u, o_wide, carry


def _run_fwd_grouped(opts, x, table, rows, N, windows, states: bool):
    """One launch over every window, checkpoints written (the recomputing forward without states)."""
    n, HV, _, K = x["w"].shape
    V = x["u"].shape[3]
    u = x["u"].clone()
    h = torch.full((n, HV, K, V), float("nan"), dtype=x["w"].dtype) if states else None
    o_wide = x["o_wide"].clone()
    carry = x["carry"].clone()
    seq = torch.stack([_seq_rows(rows, r0, r1, N, base=0) for r0, r1 in windows])
    ckpt = torch.full((len(windows), *carry.shape), float("nan"))
    run_walk_fwd(opts, table, seq, x["w"], u, x["qg"], x["kd"], x["aqk"], x["gc"], carry, h, _view(o_wide, HV, V),
                 checkpoints=ckpt)
    return h, u, o_wide, carry, ckpt


def _run_bwd(opts, x, table, rows, N, windows):
    n, HV, _, K = x["w"].shape
    V = x["u"].shape[3]
    dvs = x["dvs"].clone()
    dh = torch.full((n, HV, K, V), float("nan"), dtype=x["w"].dtype)
    carry = x["dcarry"].clone()
    for r0, r1 in reversed(windows):
        s = slice(r0, r1)
        run_walk_bwd(opts, table[s], _seq_rows(rows, r0, r1, N), x["w"][s], x["qg"][s], x["kd"][s], x["gc"][s],
                     x["do"], carry, dh[s], dvs[s])
    return dh, dvs, carry


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,V", DIMS)
@pytest.mark.parametrize("B,T,H,HV,seqlens", CASES)
def test_walk_fwd(B, T, H, HV, seqlens, K, V, dtype):
    opts, rows, n, N, x = _setup(B, T, H, HV, seqlens, K, V, dtype)
    aqk_before = x["aqk_buf"].clone()
    table = torch.tensor(rows, dtype=torch.int32)
    one = [(0, n)]
    two = [(0, n // 2), (n // 2, n)]
    tol = _tol(dtype)
    runs = {}
    for store_o in (True, False):
        h, u, o_wide, carry = runs[store_o] = _run_fwd(opts, x, table, rows, N, one, store_o)
        rh, ru, ro, rc = _ref_fwd(rows, _seq_rows(rows, 0, n, N), x, opts.scale, dtype, store_o)
        assert not torch.isnan(h).any() and not torch.isnan(u).any()
        assert _rel_err(h, rh) < tol and _rel_err(u, ru) < tol and _rel_err(carry, rc) < _tol(dtype, False)
        if store_o:
            assert _rel_err(_view(o_wide, HV, V), ro) < tol
            assert torch.equal(o_wide[..., :3], x["o_wide"][..., :3])  # the view's neighbours are untouched
        else:
            assert torch.equal(o_wide, x["o_wide"])
        if seqlens is not None:  # the empty sequence's carry passes through
            assert torch.equal(carry[1], x["carry"][1])
    # two windows with the carry passed between them: the same bits as one window
    for got, want in zip(_run_fwd(opts, x, table, rows, N, two, True), runs[True]):
        assert torch.equal(got, want)
    # both windows in one launch: the same bits, and the checkpoints are the states entering each window
    h1, _, _, carry1 = _run_fwd(opts, x, table, rows, N, two[:1], True)
    for states in (True, False):
        h, u, o_wide, carry, ckpt = _run_fwd_grouped(opts, x, table, rows, N, two, states)
        assert torch.equal(o_wide, runs[True][2]) and torch.equal(carry, runs[True][3])
        assert torch.equal(ckpt[0], x["carry"]) and torch.equal(ckpt[1], carry1)
        if states:
            assert torch.equal(h, runs[True][0]) and torch.equal(u, runs[True][1])
        else:  # the recomputing forward stores neither states nor V'
            assert torch.equal(u, x["u"])
    # the backward's recompute: from a checkpoint that it leaves as it is
    start = x["carry"].clone()
    u = x["u"].clone()
    h = torch.full_like(runs[True][0], float("nan"))
    run_walk_fwd(opts, table, _seq_rows(rows, 0, n, N)[None], x["w"], u, x["qg"], x["kd"], x["aqk"], x["gc"], start,
                 h, None, store_carry=False)
    assert torch.equal(start, x["carry"]) and torch.equal(h, runs[False][0]) and torch.equal(u, runs[False][1])
    assert same_bits(x["aqk_buf"], aqk_before)  # aqk is read only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,V", DIMS)
@pytest.mark.parametrize("B,T,H,HV,seqlens", CASES)
def test_walk_bwd(B, T, H, HV, seqlens, K, V, dtype):
    opts, rows, n, N, x = _setup(B, T, H, HV, seqlens, K, V, dtype, seed=1)
    table = torch.tensor(rows, dtype=torch.int32)
    tol = _tol(dtype)
    dh, dvs, carry = _run_bwd(opts, x, table, rows, N, [(0, n)])
    rdh, rdvs, rc = _ref_bwd(rows, _seq_rows(rows, 0, n, N), x, opts.scale, dtype)
    assert not torch.isnan(dh).any()
    assert _rel_err(dh, rdh) < tol
    assert _rel_err(dvs, rdvs) < _tol(dtype, False) and _rel_err(carry, rc) < _tol(dtype, False)
    if seqlens is not None:
        assert torch.equal(carry[1], x["dcarry"][1])
    dh2, dvs2, carry2 = _run_bwd(opts, x, table, rows, N, [(0, n - n // 2), (n - n // 2, n)])
    assert torch.equal(dh2, dh) and torch.equal(dvs2, dvs) and torch.equal(carry2, carry)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,V", DIMS)
@pytest.mark.parametrize("B,T,H,HV,seqlens", CASES)
def test_dav(B, T, H, HV, seqlens, K, V, dtype):
    opts, rows, n, N, x = _setup(B, T, H, HV, seqlens, K, V, dtype, seed=2)
    table = torch.tensor(rows, dtype=torch.int32)
    daqk = torch.full((n, HV, C, C), float("nan"))
    dvs = torch.full((n, HV, C, V), float("nan"))
    aqk_before = x["aqk_buf"].clone()
    run_dav(opts, table, x["do"], x["u"], x["aqk"], daqk, dvs)
    assert same_bits(x["aqk_buf"], aqk_before)  # aqk is read only
    rdaqk, rdvs = _ref_dav(rows, x)
    tol = _tol(dtype, False)
    assert not torch.isnan(daqk).any() and not torch.isnan(dvs).any()
    assert _rel_err(daqk, rdaqk) < tol and _rel_err(dvs, rdvs) < tol
    assert torch.equal(torch.triu(daqk, 1), torch.zeros_like(daqk))  # exact zeros above the diagonal


def test_launcher_checks():
    opts, rows, n, N, x = _setup(1, 139, 2, 4, [70, 0, 64, 5], 24, 20, torch.bfloat16)
    table = torch.tensor(rows, dtype=torch.int32)
    seq = _seq_rows(rows, 0, n, N)
    h = torch.empty(n, 4, 24, 20, dtype=torch.bfloat16)
    args = dict(w=x["w"], u=x["u"], qg=x["qg"], kd=x["kd"], aqk=x["aqk"], gc=x["gc"], carry=x["carry"], h=h,
                o=x["o"])
    bad = {
        "gc": x["gc"].to(torch.bfloat16),  # wrong dtype
        "u": x["u"].transpose(2, 3).contiguous().transpose(2, 3),  # not contiguous
        "carry": x["carry"][:, :, :, :8],  # wrong shape
        "o": x["o"].transpose(2, 3).contiguous().transpose(2, 3),  # last dimension not unit-stride
    }
    for name, value in bad.items():
        with pytest.raises((ValueError, TypeError), match=name):
            run_walk_fwd(opts, table, seq[None], **dict(args, **{name: value}))
    # aqk: token layout [B, T, HV, C] in the slots' dtype with a unit last stride
    bad_aqk = [
        (TypeError, x["aqk"].float()),  # wrong dtype
        (ValueError, x["aqk_slot"]),  # the former slot layout [n, HV, C, C]
        (ValueError, x["aqk"][:, :, :2]),  # HV of 2, not 4
        (ValueError, torch.zeros(1, 139, 4, 2 * C, dtype=torch.bfloat16)[..., ::2]),  # not unit-stride
    ]
    for err, value in bad_aqk:
        with pytest.raises(err, match="aqk"):
            run_walk_fwd(opts, table, seq[None], **dict(args, aqk=value))
        with pytest.raises(err, match="aqk"):
            run_dav(opts, table, x["do"], x["u"], value, torch.empty(n, 4, C, C), x["dvs"])
    with pytest.raises((ValueError, TypeError), match="seq_rows"):
        run_walk_fwd(opts, table, seq[None].long(), **args)
    with pytest.raises((ValueError, TypeError), match="seq_rows"):
        run_walk_fwd(opts, table, seq, **args)  # one window's [N, 2] without the window dimension
    with pytest.raises((ValueError, TypeError), match="checkpoints"):
        run_walk_fwd(opts, table, seq[None], **args, checkpoints=torch.empty(2, *x["carry"].shape))
    with pytest.raises((ValueError, TypeError), match="dvs"):
        run_walk_bwd(opts, table, seq, x["w"], x["qg"], x["kd"], x["gc"], x["do"], x["dcarry"], h,
                     x["dvs"].double())
    with pytest.raises((ValueError, TypeError), match="daqk"):
        run_dav(opts, table, x["do"], x["u"], x["aqk"], torch.empty(n, 4, C, C - 1), x["dvs"])


def test_walk_block_v():
    from kdakit.ops.kda.chunk.walk import walk_block_v

    fwd, bwd = (64, 32, 16), (32, 16)
    assert walk_block_v(fwd, 96, 128, 132) == 64  # 1 x H96: 192 programs
    assert walk_block_v(bwd, 96, 128, 132) == 32  # 384 programs
    assert walk_block_v(fwd, 16, 128, 132) == 16  # one sequence of 16 heads: the narrowest (128 programs)
    assert walk_block_v(fwd, 48, 128, 132) == 32  # 96 programs at 64, 192 at 32
    assert walk_block_v(fwd, 128, 128, 132) == 64  # 8 x H16 and 1 x H128
    assert walk_block_v(fwd, 16, 128, None) == 64  # no SM count (the interpreter): the widest
    assert walk_block_v(fwd, 1, 32, 132) == 16  # too few programs at any block: the narrowest
    assert walk_block_v(fwd, 200, 32, 132) == 32  # each candidate capped at V's block
    assert walk_block_v((16,), 1, 128, 132) == 16


# sm_90a builds at the launchers' configs, K = V = 128 (what the H200 runs)
_BUILD = r"""
from tests.ops.kda._sm90_build import print_reports, sm90_report
import kdakit.ops.kda.chunk.walk as W

def build(fn, types, const, warps, stages):
    return dict(sm90_report(fn, types, const, warps, stages), warps=warps)

out = {}
for tok in ("bf16", "fp16", "fp32"):
    T = "*" + tok
    fl = dict(OP_BF16=tok != "fp32", EMULATE=False, DOT_PREC="tf32x3" if tok == "fp32" else "tf32")
    kind = "fp32" if tok == "fp32" else "bf16"
    for bv in W.WALK_FWD_BLOCK_V[kind]:
        # the forward keeping its intermediates, the recomputing forward, the backward's recompute
        for store_o, states in ((True, True), (True, False), (False, True)):
            # checkpoints: the recomputing forward's; the carry: every walk but the backward's recompute
            out[f"fwd/{tok}/bv={bv}/store_o={store_o}/states={states}"] = build(
                W.chunk_walk_fwd_kernel, dict(table="*i32", seq_rows="*i32", w=T, u=T, qg=T, kd=T, aqk=T,
                                              gc="*fp32", carry="*fp32", ckpt="*fp32", h=T, o=T, scale="fp32"),
                dict(K=128, V=128, C=64, BK=128, BV=bv, STORE_O=store_o, STORE_STATES=states,
                     STORE_CKPT=store_o and not states, STORE_CARRY=store_o, LOOP_WHILE=False, **fl),
                W.WALK_FWD_WARPS, W.WALK_FWD_STAGES[kind])
    for bv in W.WALK_BWD_BLOCK_V[kind]:
        out[f"bwd/{tok}/bv={bv}"] = build(
            W.chunk_walk_bwd_kernel, dict(table="*i32", seq_rows="*i32", w=T, qg=T, kd=T, gc="*fp32", do=T,
                                          carry="*fp32", dh=T, dvs="*fp32", scale="fp32"),
            dict(K=128, V=128, C=64, BK=128, BV=bv, LOOP_WHILE=False, **fl),
            W.WALK_BWD_WARPS, W.WALK_BWD_STAGES)
    out[f"dav/{tok}"] = build(
        W.chunk_dav_kernel, dict(table="*i32", do=T, u=T, aqk=T, daqk="*fp32", dvs="*fp32"),
        dict(V=128, C=64, BV=W.DAV_BLOCK_V[kind], **fl), W.DAV_WARPS, W.DAV_STAGES)
print_reports(out)
"""


def test_sm90_build():
    res = read_reports(run_sm90_build(_BUILD))
    from kdakit.ops.kda.chunk import walk as W

    per_tok = {k: 3 * len(W.WALK_FWD_BLOCK_V[k]) + len(W.WALK_BWD_BLOCK_V[k]) + 1 for k in ("bf16", "fp32")}
    assert len(res) == 2 * per_tok["bf16"] + per_tok["fp32"]
    from kdakit.ops.kda.chunk.walk import WALK_SPILL_BUDGET

    for name, r in res.items():
        budget = WALK_SPILL_BUDGET["fp32" if "fp32" in name else "bf16"]
        assert r["spill_stores"] + r["spill_loads"] <= budget, (name, r, budget)
        assert r["regs"] <= (255 if r["warps"] <= 4 else 128), (name, r)
        assert r["shared"] <= 113 * 1024, (name, r)  # two programs per SM in the H200's 228 KB
