"""grads_wy (kdakit/ops/kda/chunk/grads.py) against a float64 autograd of one chunk's forward.

The float64 function takes q̂, k̂, v, G, g_C, β, S and, as independent leaves, Aqk and A = diag(β) Akk, and
returns O and S_next (Tinv = (I + A)^-1 inside); its gradients for the upstream dO and dS_next are what
grads_wy writes: dqh (q̂), dkh (k̂), dv, dbs (β), dgs (G), dgc (g_C), dakk (A, strictly lower). The kernels read
the forward's slots (Tinv, qg, kd, V', dV', the states) as the forward would store them (the token dtype), with
NaN in every padded slot row, which they must never read. Tinv is in token layout (tests/ops/kda/chunk/_pairs.py):
each chunk's rows < L at its tokens of a NaN-filled pair buffer, so a padded row read past a batch row's last
chunk is NaN.
"""

import math

import pytest
import torch

from kdakit.ops.kda.chunk.grads import GRADS_WY_NUM_WARPS, run_grads_wy
from kdakit.ops.kda.chunk.plan import chunk_table_rows
from kdakit.ops.kda.chunk.tiles import CHUNK
from kdakit.ops.kda.chunk_common import GATE_LOWER_BOUND, GATE_NONE, GATE_SOFTPLUS
from kdakit.ops.kda.constants import LOG_DECAY_FLOOR
from kdakit.ops.kda.options import kda_options
from tests.ops.kda._sm90_build import read_reports, run_sm90_build
from tests.ops.kda.chunk._pairs import pair_views, same_bits

C = CHUNK
F64 = torch.float64


def chunk_forward(qh, kh, v, G, gC, beta, S, Aqk, A, scale):
    """One chunk (L real rows) for HV heads at once: qh, kh [HV, L, K]; v [HV, L, V]; G [HV, L, K]; gC [HV, K];
    beta [HV, L]; S [HV, K, V]; Aqk, A [HV, L, L]. -> (O [HV, L, V], S_next [HV, K, V])."""
    L = qh.shape[1]
    Tinv = torch.linalg.inv(torch.eye(L, dtype=F64) + A)
    Y = beta[..., None] * kh * torch.exp(G)
    Z = beta[..., None] * v
    W, U = Tinv @ Y, Tinv @ Z
    Vp = U - W @ S
    qg = qh * torch.exp(G)
    kd = kh * torch.exp(gC[:, None, :] - G)
    O = scale * qg @ S + Aqk @ Vp
    S_next = torch.exp(gC)[..., None] * S + kd.transpose(1, 2) @ Vp
    return O, S_next


def log_decay(gate, B, T, HV, K, gen):
    """[B, T, HV, K] float64 log-decay of a gate mode, clamped as the pipeline's loads clamp it."""
    x = torch.randn(B, T, HV, K, generator=gen, dtype=F64)
    if gate == GATE_NONE:
        a = -torch.rand(B, T, HV, K, generator=gen, dtype=F64) * 0.5
        a.view(-1)[::37] = -30.0
        a.view(-1)[5::53] = -math.inf
    else:
        A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen, dtype=F64))
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(HV, K, generator=gen, dtype=F64))
        pre = x + torch.log(torch.expm1(dt))
        if gate == GATE_SOFTPLUS:
            a = -torch.exp(A_log)[:, None] * torch.nn.functional.softplus(pre)
        else:
            a = -5.0 * torch.sigmoid(torch.exp(A_log)[:, None] * pre)
    return a.clamp(min=LOG_DECAY_FLOOR)


def make_case(B, T, seqlens, H, HV, K, V, dtype, gate, l2norm, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = chunk_table_rows(B, T, seqlens)
    n = len(rows)
    scale = K ** -0.5
    nan = float("nan")
    # token tensors: q, k, v split from one fused tensor; do and dv views of wider ones
    qkv = torch.randn(B, T, 2 * H * K + HV * V, generator=gen, dtype=F64)
    if not l2norm:  # keys of unit size on average, so that (I + A)^-1 stays moderate
        qkv[..., :2 * H * K] *= K ** -0.5
    qkv = qkv.to(dtype)
    q, k, v = (x.view(B, T, -1, d) for x, d in zip(qkv.split([H * K, H * K, HV * V], dim=-1), (K, K, V)))
    do_buf = torch.randn(B, T, HV * V + 8, generator=gen, dtype=F64).to(dtype)
    do = do_buf[..., 8:].view(B, T, HV, V)
    dv_buf = torch.full((B, T, HV * V + 4), nan, dtype=dtype)
    dv = dv_buf[..., :HV * V].view(B, T, HV, V)
    a = log_decay(gate, B, T, HV, K, gen)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, dtype=F64)).float()
    pairs, _, tinv = pair_views(B, T, HV, dtype)  # NaN-filled, the chunks' rows written below
    slot = dict(
        gc=torch.full((n, HV, C, K), nan), bt=torch.full((n, HV, C), nan), rq=torch.full((n, H, C), nan),
        rk=torch.full((n, H, C), nan), tinv=tinv,
        w=torch.full((n, HV, C, K), nan, dtype=dtype), qg=torch.full((n, HV, C, K), nan, dtype=dtype),
        kd=torch.full((n, HV, C, K), nan, dtype=dtype), u=torch.full((n, HV, C, V), nan, dtype=dtype),
        dvs=torch.full((n, HV, C, V), nan), h=(0.5 * torch.randn(n, HV, K, V, generator=gen, dtype=F64)).to(dtype),
        dh=(0.5 * torch.randn(n, HV, K, V, generator=gen, dtype=F64)).to(dtype),
    )
    out = dict(dqh=torch.full((n, HV, C, K), nan), dkh=torch.full((n, HV, C, K), nan),
               dgs=torch.full((n, HV, C, K), nan), dgc=torch.full((n, HV, K), nan),
               dbs=torch.full((n, HV, C), nan), dakk=torch.full((n, HV, C, C), nan))
    grp = HV // H
    refs = []
    for i, (_, b, t0, L) in enumerate(rows):
        tok = slice(t0, t0 + L)
        qc = q[b, tok].double().repeat_interleave(grp, dim=1).transpose(0, 1)  # [HV, L, K]
        kc = k[b, tok].double().repeat_interleave(grp, dim=1).transpose(0, 1)
        if l2norm:
            rq = 1.0 / torch.sqrt((q[b, tok].double() ** 2).sum(-1) + 1e-6)  # [L, H]
            rk = 1.0 / torch.sqrt((k[b, tok].double() ** 2).sum(-1) + 1e-6)
        else:
            rq = rk = torch.ones(L, H, dtype=F64)
        slot["rq"][i, :, :L], slot["rk"][i, :, :L] = rq.T.float(), rk.T.float()
        qh = qc * slot["rq"][i, :, :L].double().repeat_interleave(grp, dim=0)[..., None]
        kh = kc * slot["rk"][i, :, :L].double().repeat_interleave(grp, dim=0)[..., None]
        vc = v[b, tok].double().transpose(0, 1)  # [HV, L, V]
        doc = do[b, tok].double().transpose(0, 1)
        slot["gc"][i, :, :L] = torch.cumsum(a[b, tok], dim=0).transpose(0, 1).float()
        G = slot["gc"][i, :, :L].double()  # [HV, L, K]: the stored (fp32) cumsum is the leaf
        gC = G[:, L - 1].clone()
        slot["bt"][i, :, :L] = beta[b, tok].T
        bt = slot["bt"][i, :, :L].double()  # [HV, L]
        E = torch.exp(G[:, :, None, :] - G[:, None, :, :])  # [HV, L, L, K], used only where j <= i
        tri = torch.ones(L, L, dtype=torch.bool).tril()
        Akk = torch.where(tri & ~torch.eye(L, dtype=torch.bool), (kh[:, :, None] * kh[:, None] * E).sum(-1), 0.0)
        Aqk = torch.where(tri, scale * (qh[:, :, None] * kh[:, None] * E).sum(-1), 0.0)
        A = bt[..., None] * Akk
        S = slot["h"][i].double()
        dS = slot["dh"][i].double()
        Tinv = torch.linalg.inv(torch.eye(L, dtype=F64) + A)
        W = Tinv @ (bt[..., None] * kh * torch.exp(G))
        Vp = Tinv @ (bt[..., None] * vc) - W @ S
        kd = kh * torch.exp(gC[:, None] - G)
        slot["tinv"][b, tok, :, :L] = Tinv.transpose(0, 1).to(dtype)  # row r at token t0 + r
        slot["tinv"][b, tok, :, L:] = 0  # exact zeros above the diagonal
        slot["w"][i, :, :L] = W.to(dtype)
        slot["qg"][i, :, :L] = (qh * torch.exp(G)).to(dtype)
        slot["kd"][i, :, :L] = kd.to(dtype)
        slot["u"][i, :, :L] = Vp.to(dtype)
        slot["dvs"][i, :, :L] = (Aqk.transpose(1, 2) @ doc + kd @ dS).float()
        leaves = [x.clone().requires_grad_() for x in (qh, kh, vc, G, gC, bt, S, Aqk, A)]
        O, S_next = chunk_forward(*leaves, scale)
        torch.autograd.backward((O, S_next), (doc, dS))
        refs.append((b, t0, L, [x.grad for x in leaves]))
    opts = kda_options(q, k, v, a.float(), beta, scale=scale, validate=False,
                       cu_seqlens=None if seqlens is None else torch.tensor([0] + seqlens).cumsum(0))
    table = torch.tensor(rows, dtype=torch.int32).reshape(n, 4)
    return opts, table, dict(q=q, k=k, v=v, do=do), slot, dv, dv_buf, out, refs, pairs


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


CASES = [
    # (B, T, seqlens, H, HV, K, V, gate, l2norm)
    (2, 70, None, 1, 1, 24, 20, GATE_NONE, False),
    (2, 70, None, 2, 4, 32, 32, GATE_SOFTPLUS, True),
    (1, 139, [70, 0, 64, 5], 1, 2, 24, 20, GATE_LOWER_BOUND, True),
    (1, 139, [70, 0, 64, 5], 2, 4, 32, 32, GATE_NONE, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["fixed-K24-none", "fixed-group-softplus", "varlen-K24-lowerbound",
                                              "varlen-K32-none"])
def test_grads_wy_matches_float64_autograd(case, dtype):
    B, T, seqlens, H, HV, K, V, gate, l2norm = case
    opts, table, tok, slot, dv, dv_buf, out, refs, pairs = make_case(B, T, seqlens, H, HV, K, V, dtype, gate,
                                                                     l2norm)
    pairs_before = pairs.clone()  # the pair buffer whose tinv view the kernels read
    run_grads_wy(opts, table, tok["q"], tok["k"], tok["v"], tok["do"], slot["gc"], slot["bt"], slot["rq"],
                 slot["rk"], slot["tinv"], slot["w"], slot["qg"], slot["kd"], slot["u"], slot["dvs"], slot["h"],
                 slot["dh"], dv, out["dqh"], out["dkh"], out["dgs"], out["dgc"], out["dbs"], out["dakk"])
    tol = 1e-4 if dtype == torch.float32 else 1.5e-2
    got = {name: [] for name in ("dqh", "dkh", "dv", "dbs", "dgs", "dgc", "dakk")}
    want = {name: [] for name in got}
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    for i, (b, t0, L, g) in enumerate(refs):
        dqh_r, dkh_r, dv_r, dgs_r, dgc_r, dbs_r, _, _, dA_r = g
        for name, ref in (("dqh", dqh_r), ("dkh", dkh_r), ("dgs", dgs_r), ("dbs", dbs_r)):
            got[name].append(out[name][i, :, :L].reshape(-1))
            want[name].append(ref.reshape(-1))
            assert (out[name][i, :, L:] == 0).all(), f"{name}: padded rows of chunk {i} not zero"
        got["dgc"].append(out["dgc"][i].reshape(-1))
        want["dgc"].append(dgc_r.reshape(-1))
        got["dv"].append(dv[b, t0:t0 + L].transpose(0, 1).reshape(-1))
        want["dv"].append(dv_r.reshape(-1))
        dA_full = torch.zeros(HV, C, C, dtype=F64)
        dA_full[:, :L, :L] = dA_r
        dA_full = torch.where(strict, dA_full, 0.0)
        got["dakk"].append(out["dakk"][i].reshape(-1))
        want["dakk"].append(dA_full.reshape(-1))
    for name in got:
        x, ref = torch.cat(got[name]), torch.cat(want[name])
        assert torch.isfinite(x).all(), f"{name} has non-finite entries"
        err = rel_err(x, ref)
        assert err < tol, f"{name}: max error {err:.2e} of its largest entry (tolerance {tol:.0e})"
    # dv is written through its view only: the wider buffer's other columns keep their NaN fill
    assert torch.isnan(dv_buf[..., HV * V:]).all()
    assert same_bits(pairs, pairs_before)  # tinv is read only
    if seqlens is None:
        assert torch.isfinite(dv).all()


def test_grads_wy_rejects_bad_arguments():
    opts, table, tok, slot, dv, _, out, _, _ = make_case(1, 70, None, 1, 1, 32, 32, torch.float32, GATE_NONE, False)

    def call(**change):
        args = dict(opts=opts, table=table, **tok, **slot, dv=dv, **out)
        args.update(change)
        run_grads_wy(**args)

    with pytest.raises(TypeError, match="opts"):
        call(opts=None)
    with pytest.raises(ValueError, match="table"):
        call(table=table.long())
    with pytest.raises(ValueError, match="dvs"):
        call(dvs=slot["dvs"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="h must be contiguous"):
        call(h=slot["h"].transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="dakk"):
        call(dakk=out["dakk"][:, :, :32])
    with pytest.raises(ValueError, match="dv"):
        call(dv=dv.to(torch.bfloat16))
    with pytest.raises(ValueError, match="k must have a unit stride"):
        call(k=tok["k"].repeat_interleave(2, dim=-1)[..., ::2])
    # tinv: token layout [B, T, HV, C] in the token dtype, unit last stride
    with pytest.raises(TypeError, match="tinv"):
        call(tinv=slot["tinv"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="tinv"):
        call(tinv=torch.zeros(table.shape[0], 1, C, C))  # the former slot layout [n, HV, C, C]
    with pytest.raises(ValueError, match="tinv"):
        call(tinv=torch.zeros(1, 70, 1, 2 * C)[..., ::2])  # not unit-stride
    with pytest.raises(ValueError, match="tinv"):
        call(tinv=torch.zeros(1, 71, 1, C))  # T of 71


SM90_SCRIPT = """
from concurrent.futures import ProcessPoolExecutor
from tests.ops.kda._sm90_build import print_reports, sm90_report
import kdakit.ops.kda.chunk.grads as M

TOK = {"k", "v", "do", "dv", "tinv", "qg", "kd", "u", "h", "dh"}
F32 = {"gc", "bt", "rk", "dvs", "dqh", "dkh", "dgs", "dgc", "dbs", "dakk"}
VARIANTS = [(name, dtype, gop, prec) for name in ("chunk_grads_wy_kernel", "chunk_grads_wy_dv_kernel")
            for dtype, gop, prec in (("bf16", 1, "tf32"), ("fp32", 0, "tf32x3"))]  # fp16: fp32's code, 16-bit loads


def build(variant):
    name, dtype, gop, prec = variant
    fn = getattr(M, name)
    kind = "bf16" if gop == 1 else "fp32"
    blocks = M.GRADS_WY_BLOCKS if name == "chunk_grads_wy_kernel" else M.GRADS_WY_DV_BLOCKS
    BK, BV = blocks[kind]
    const = dict(K=128, V=128, C=64, BK=BK, BV=BV, GRAD_OP=gop, GRAD_PREC=prec)
    types = dict({n: "*" + dtype for n in TOK}, **{n: "*fp32" for n in F32}, table="*i32", scale="fp32")
    stages = M.GRADS_WY_NUM_STAGES if name == "chunk_grads_wy_kernel" else M.GRADS_WY_DV_STAGES[kind]
    # what the JIT specializes at the production shapes: pointers and strides divisible by 16 (not H, HV)
    return f"{name} {dtype}", sm90_report(fn, types, const, M.GRADS_WY_NUM_WARPS, stages, unaligned=("H", "HV"))


if __name__ == "__main__":
    with ProcessPoolExecutor(2) as pool:
        print_reports(dict(pool.map(build, VARIANTS)))
"""


def test_grads_wy_kernels_build_for_sm90_without_spills():
    reports = read_reports(run_sm90_build(SM90_SCRIPT))
    assert len(reports) == 4 and all(key.startswith("chunk_grads_wy") for key in reports), reports
    for key, r in reports.items():
        stores, loads, regs = r["spill_stores"], r["spill_loads"], r["regs"]
        assert stores == 0 and loads == 0, f"{key} spills: {stores} B stores, {loads} B loads"
        assert regs <= (255 if GRADS_WY_NUM_WARPS <= 4 else 128), f"{key}: {regs} registers"
