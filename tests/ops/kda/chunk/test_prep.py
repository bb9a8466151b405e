"""CPU tier of the 64-token pipeline's prep and wu kernels (``kdakit/ops/kda/chunk/prep.py``) on the Triton
interpreter: each output slot against a float64 PyTorch reference of the kernel's contract (docs/chunk_pipeline.md),
over fixed-length and packed calls (short chunks, a zero-length sequence), K / V not powers of two, grouped value
heads, strided token views, bf16 / fp32 inputs and every gate mode; the launchers' argument errors; and the sm_90a
builds of every kernel variant (registers, no spills)."""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.chunk.plan import chunk_table, chunk_table_rows
from kdakit.ops.kda.chunk.prep import run_prep, run_wu
from kdakit.ops.kda.options import kda_options

from .._sm90_build import read_reports, run_sm90_build
from ._pairs import pair_views, same_bits, to_tokens

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
C = 64
FLOOR = -110.0


# ---------------------------------------------------------------------------------------
# inputs and the float64 forward transforms (shared with test_finish.py)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    seqlens: tuple | None  # packed lengths (B = 1), or None: B sequences of T tokens
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype
    gate: str  # "none" (raw log-decay), "softplus", "lower" (lower_bound = -5)
    has_A: bool
    has_bias: bool
    l2norm: bool
    beta: str  # "raw", "sigmoid", "neg" (sigmoid times 2)


def case_id(c: Case) -> str:
    lay = "varlen" if c.seqlens else f"B{c.B}"
    dt = str(c.dtype).replace("torch.", "")
    ab = ("A" if c.has_A else "") + ("b" if c.has_bias else "")
    return f"{lay}-H{c.H}HV{c.HV}-K{c.K}V{c.V}-{dt}-{c.gate}{ab}-{'l2' if c.l2norm else 'raw'}-{c.beta}"


VARLEN = (70, 0, 64, 5)
CASES = [
    Case(None, 2, 70, 2, 4, 24, 20, torch.float32, "none", False, False, True, "sigmoid"),
    Case(VARLEN, 1, 139, 1, 4, 32, 32, torch.bfloat16, "softplus", True, True, False, "raw"),
    Case(VARLEN, 1, 139, 2, 4, 24, 20, torch.float32, "lower", True, True, True, "neg"),
    Case(None, 2, 70, 1, 4, 32, 32, torch.float32, "softplus", False, True, False, "sigmoid"),
    Case(VARLEN, 1, 139, 2, 4, 24, 20, torch.bfloat16, "none", False, False, True, "raw"),
]


def make_inputs(c: Case, seed: int = 0) -> dict:
    """Token tensors in c.dtype as strided views (q, k, v split from one fused tensor; g with a padded head
    stride; beta with a token stride of 2 * HV), fp32 flat gate parameters, the chunk table and the options."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K, V = c.B, c.T, c.H, c.HV, c.K, c.V

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    fused = rnd(B, T, 2 * H * K + HV * V)
    fused[..., : 2 * H * K] *= 1.0 if c.l2norm else K ** -0.5
    q, k, v = fused.to(c.dtype).split([H * K, H * K, HV * V], dim=-1)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
    u = torch.rand(B, T, HV, K, generator=gen)
    if c.gate == "none":
        graw = -(0.02 + 0.6 * u)  # raw log-decays
        flat = graw.view(-1)
        pick = torch.randperm(flat.numel(), generator=gen)[:24]
        flat[pick[:8]] = -float("inf")
        flat[pick[8:16]] = -30.0
        flat[pick[16:]] = -1000.0
    elif c.gate == "softplus":
        graw = 2.0 * rnd(B, T, HV, K)
        flat = graw.view(-1)
        pick = torch.randperm(flat.numel(), generator=gen)[:16]
        flat[pick[:8]] = 60.0  # softplus beyond its threshold; with exp(A_log) >= 4 the clamp at -110 holds
        flat[pick[8:]] = -25.0  # softplus's small branch
    else:
        graw = 2.0 * rnd(B, T, HV, K)
    gfull = torch.empty(B, T, HV, K + 3)
    gfull[..., :K] = graw
    gfull[..., K:] = float("nan")  # never read
    g = gfull.to(c.dtype)[..., :K]
    braw = torch.rand(B, T, HV, generator=gen) if c.beta == "raw" else 2.0 * rnd(B, T, HV)
    bfull = torch.empty(B, T, HV, 2)
    bfull[..., 0] = braw
    bfull[..., 1] = float("nan")
    beta = bfull.to(c.dtype).view(B, T, 2 * HV)[..., ::2]
    A_log = dt_bias = None
    if c.has_A:
        lo = 4.0 if c.gate == "softplus" else 1.0
        A_log = torch.log(lo + (16.0 - lo) * torch.rand(HV, generator=gen))  # exp(A_log) ~ U(lo, 16)
    if c.has_bias:
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(HV * K, generator=gen))
        dt_bias = torch.log(torch.expm1(dt))
    cu = None
    if c.seqlens is not None:
        cu = torch.tensor([0, *torch.tensor(c.seqlens).cumsum(0).tolist()], dtype=torch.int32)
        assert cu[-1] == T
    opts = kda_options(q, k, v, g, beta, use_qk_l2norm_in_kernel=c.l2norm, use_gate_in_kernel=c.gate != "none",
                       use_beta_sigmoid_in_kernel=c.beta != "raw", allow_neg_eigval=c.beta == "neg",
                       lower_bound=-5.0 if c.gate == "lower" else None, A_log=A_log, dt_bias=dt_bias,
                       cu_seqlens=cu, validate=False)
    seqlens = list(c.seqlens) if c.seqlens is not None else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, opts=opts,
                table=chunk_table(B, T, seqlens, "cpu"), rows=chunk_table_rows(B, T, seqlens))


def gate_ref(c: Case, g, A_log, dt_bias):
    """float64 log-decay of raw g [B, T, HV, K] (float64 tensors; autograd-friendly), clamped as the kernels: 0
    gradient where the clamp holds, NaN kept."""
    x = g + dt_bias.view(c.HV, c.K) if c.has_bias else g
    expA = torch.exp(A_log).view(c.HV, 1) if c.has_A else 1.0
    if c.gate == "softplus":
        a = -expA * F.softplus(x, threshold=20.0)
    elif c.gate == "lower":
        a = -5.0 * torch.sigmoid(expA * x)
    else:
        a = x
    return torch.where(a <= FLOOR, torch.full_like(a, FLOOR), a)


def beta_ref(c: Case, beta):
    if c.beta == "raw":
        return beta
    s = torch.sigmoid(beta)
    return 2.0 * s if c.beta == "neg" else s


def rstd_ref(c: Case, x):
    """[B, T, H] l2norm scale (1 without the l2norm)."""
    if not c.l2norm:
        return torch.ones_like(x[..., 0])
    return 1.0 / torch.sqrt((x * x).sum(-1) + 1e-6)


def chunk_of(x, b, t0, L):
    """Rows t0 .. t0 + L of batch row b, zero-padded to C rows: [C, *x.shape[2:]] (heads first after permute)."""
    out = x.new_zeros(C, *x.shape[2:])
    out[:L] = x[b, t0:t0 + L]
    return out


def f64(x):
    return None if x is None else x.detach().to(torch.float64)


def prep_ref(c: Case, inp: dict) -> dict:
    """float64 gc [n, HV, C, K], bt [n, HV, C], rq, rk [n, H, C]."""
    a = gate_ref(c, f64(inp["g"]), f64(inp["A_log"]), f64(inp["dt_bias"]))
    bt = beta_ref(c, f64(inp["beta"]))
    rq, rk = rstd_ref(c, f64(inp["q"])), rstd_ref(c, f64(inp["k"]))
    out = {name: [] for name in ("gc", "bt", "rq", "rk")}
    for _, b, t0, L in inp["rows"]:
        out["gc"].append(chunk_of(a, b, t0, L).cumsum(0).permute(1, 0, 2))
        out["bt"].append(chunk_of(bt, b, t0, L).T)
        out["rq"].append(chunk_of(rq, b, t0, L).T)
        out["rk"].append(chunk_of(rk, b, t0, L).T)
    return {name: torch.stack(v) for name, v in out.items()}


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| over finite reference entries, which must match got's non-finite ones."""
    got, ref = got.to(torch.float64), ref.to(torch.float64)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)), "non-finite entries differ"
    if not fin.any():
        return 0.0
    return ((got - ref)[fin].abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------
# prep
# ---------------------------------------------------------------------------------------


def prep_slots(inp: dict, fill: float = float("nan")) -> dict:
    n = len(inp["rows"])
    H, HV, K = inp["q"].shape[2], inp["g"].shape[2], inp["q"].shape[3]
    f32 = torch.float32
    return dict(gc=torch.full((n, HV, C, K), fill, dtype=f32), bt=torch.full((n, HV, C), fill, dtype=f32),
                rq=torch.full((n, H, C), fill, dtype=f32), rk=torch.full((n, H, C), fill, dtype=f32))


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_prep_matches_float64(c):
    inp = make_inputs(c)
    s = prep_slots(inp)
    A_log, dt_bias = inp["opts"].kernel_gate_params(inp["A_log"], inp["dt_bias"])
    run_prep(inp["opts"], inp["table"], inp["q"], inp["k"], inp["g"], inp["beta"], A_log, dt_bias,
             s["gc"], s["bt"], s["rq"], s["rk"])
    ref = prep_ref(c, inp)
    for name in ("gc", "bt", "rq", "rk"):
        assert torch.isfinite(s[name]).all(), name  # every slot entry written, padded rows included
        assert rel_err(s[name], ref[name]) < 2e-6, name  # fp32 math on exact inputs: measured <= 2.4e-7
    # row-wise: padded rows hold G[L-1], beta and the scales 0 there
    for i, (_, _, _, L) in enumerate(inp["rows"]):
        assert torch.equal(s["gc"][i, :, L:], s["gc"][i, :, L - 1:L].expand_as(s["gc"][i, :, L:]))
        assert (s["bt"][i, :, L:] == 0).all() and (s["rq"][i, :, L:] == 0).all() and (s["rk"][i, :, L:] == 0).all()
    torch.testing.assert_close(s["gc"].double(), ref["gc"], rtol=1e-5, atol=1e-5)
    if c.gate == "none":
        assert (inp["g"] == -float("inf")).any() and s["gc"].min() <= FLOOR  # -inf and -1000 load as the floor


# ---------------------------------------------------------------------------------------
# wu
# ---------------------------------------------------------------------------------------


def tinv_ref(kh, G, bt):
    """(I + diag(bt) Akk)^-1 in float64 for one chunk and value head: kh, G [C, K], bt [C]."""
    d = G[:, None, :] - G[None, :, :]  # [C, C, K]
    low = torch.tril(torch.ones(C, C, dtype=torch.bool), -1)
    e = torch.where(low[:, :, None], torch.exp(torch.where(low[:, :, None], d, 0.0)), 0.0)
    Akk = (kh[:, None, :] * kh[None, :, :] * e).sum(-1)
    return torch.linalg.inv(torch.eye(C, dtype=torch.float64) + bt[:, None] * Akk)


def wu_case(c: Case):
    """Inputs, the prep slots as the kernel takes them (float64 reference cast to fp32), tinv in the token dtype
    and token layout (rows < L of each chunk at its tokens; the tinv view of a NaN-filled pair buffer, returned
    too: its aqk half, guard tokens and columns stay NaN, which the kernel must not read), and the float64
    reference of w, u, qg, kd from exactly those rows (Tinv's padded rows, unit rows in float64, load as 0: both
    give 0 there, bt and k^ being 0 on padded rows)."""
    inp = make_inputs(c, seed=1)
    p = {name: x.to(torch.float32) for name, x in prep_ref(c, inp).items()}
    G_of = c.HV // c.H
    q, k, v = f64(inp["q"]), f64(inp["k"]), f64(inp["v"])
    n = len(inp["rows"])
    tinv_s = torch.empty(n, c.HV, C, C, dtype=c.dtype)
    ref = {name: torch.zeros(n, c.HV, C, c.V if name == "u" else c.K, dtype=torch.float64)
           for name in ("w", "u", "qg", "kd")}
    for i, (_, b, t0, L) in enumerate(inp["rows"]):
        for hv in range(c.HV):
            h = hv // G_of
            G, bt = p["gc"][i, hv].double(), p["bt"][i, hv].double()
            kh = chunk_of(k, b, t0, L)[:, h] * p["rk"][i, h].double()[:, None]
            qh = chunk_of(q, b, t0, L)[:, h] * p["rq"][i, h].double()[:, None]
            vc = chunk_of(v, b, t0, L)[:, hv]
            tinv_s[i, hv] = tinv_ref(kh, G, bt).to(c.dtype)
            Ti = tinv_s[i, hv].double()
            Ti[L:] = 0.0  # padded rows: no storage
            ref["w"][i, hv] = Ti @ (bt[:, None] * kh * torch.exp(G))
            ref["u"][i, hv] = Ti @ (bt[:, None] * vc)
            ref["qg"][i, hv] = qh * torch.exp(G)
            ref["kd"][i, hv] = kh * torch.exp(G[-1][None, :] - G)
    buf, _, tinv = pair_views(c.B, c.T, c.HV, c.dtype)
    to_tokens(tinv_s, inp["rows"], tinv)
    return inp, p, tinv, buf, ref


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_wu_matches_float64(c):
    inp, p, tinv, buf, ref = wu_case(c)
    before = buf.clone()
    n = len(inp["rows"])
    out = {name: torch.full((n, c.HV, C, c.V if name == "u" else c.K), float("nan"), dtype=c.dtype)
           for name in ("w", "u", "qg", "kd")}
    run_wu(inp["opts"], inp["table"], inp["q"], inp["k"], inp["v"], p["gc"], p["bt"], p["rq"], p["rk"], tinv,
           out["w"], out["u"], out["qg"], out["kd"])
    # fp32: exact fp32 dots under the interpreter (measured <= 2.2e-7); bf16: bf16 operands and bf16 stores
    # (measured <= 4.1e-3)
    limit = 2e-6 if c.dtype == torch.float32 else 1e-2
    for name in ("w", "u", "qg", "kd"):
        assert torch.isfinite(out[name]).all(), name
        assert rel_err(out[name], ref[name]) < limit, name
    for i, (_, _, _, L) in enumerate(inp["rows"]):  # identity steps: nothing on padded rows
        for name in ("w", "u", "qg", "kd"):
            assert (out[name][i, :, L:] == 0).all(), name
    assert same_bits(buf, before)  # tinv is read only


# ---------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------


def test_launcher_errors_name_the_argument():
    c = CASES[0]
    inp = make_inputs(c)
    s = prep_slots(inp)
    args = [inp["opts"], inp["table"], inp["q"], inp["k"], inp["g"], inp["beta"], None, None,
            s["gc"], s["bt"], s["rq"], s["rk"]]
    bad = list(args)
    bad[10] = s["rq"][:, :1]
    with pytest.raises(ValueError, match="rq"):
        run_prep(*bad)
    bad = list(args)
    bad[4] = inp["g"].transpose(2, 3)  # K not unit-stride
    with pytest.raises(ValueError, match="g"):
        run_prep(*bad)
    bad = list(args)
    bad[1] = inp["table"].long()
    with pytest.raises(ValueError, match="table"):
        run_prep(*bad)
    bad = list(args)
    bad[8] = s["gc"].double()
    with pytest.raises(TypeError, match="gc"):
        run_prep(*bad)
    with pytest.raises(TypeError, match="opts"):
        run_prep(None, *args[1:])
    n = len(inp["rows"])
    w = torch.zeros(n, c.HV, C, c.K)

    def wu(tinv):
        run_wu(inp["opts"], inp["table"], inp["q"], inp["k"], inp["v"], s["gc"], s["bt"], s["rq"], s["rk"], tinv,
               w, torch.zeros(n, c.HV, C, c.V), w.clone(), w.clone())

    _, _, tinv = pair_views(c.B, c.T, c.HV, torch.bfloat16)  # fp32 inputs take an fp32 tinv
    with pytest.raises(TypeError, match="tinv"):
        wu(tinv)
    # token layout [B, T, HV, C], unit last stride
    with pytest.raises(ValueError, match="tinv"):
        wu(torch.zeros(n, c.HV, C, C))  # the former slot layout
    with pytest.raises(ValueError, match="tinv"):
        wu(torch.zeros(c.B, c.T, c.HV, 2 * C)[..., ::2])
    with pytest.raises(ValueError, match="tinv"):
        wu(torch.zeros(c.B, c.T + 1, c.HV, C))


# ---------------------------------------------------------------------------------------
# sm_90a builds
# ---------------------------------------------------------------------------------------

# A build script's prelude (run in a child process without TRITON_INTERPRET; test_finish.py's script shares it):
# build() is tests/ops/kda/_sm90_build.py's sm90_report, with the JIT's divisibility-16 hints on pointers and on
# the strides that are multiples of 16 at the docs/spec.md §3 shapes (H = HV = 96 or 24 with HV = 96, K = V = 128),
# one stage, each report printed as it is built.
BUILD_HELPER = r"""
from tests.ops.kda._sm90_build import print_reports, sm90_report

def build(fn, types, const, warps, unaligned=()):
    flags = ",".join(f"{k}={v}" for k, v in const.items() if k != "C")
    name = f"{build.n} {fn.__name__} k={types.get('k')} {flags}"
    build.n += 1
    print_reports({name: dict(sm90_report(fn, types, const, warps, 1, unaligned), warps=warps)})
build.n = 0
"""

PREP_BUILD = BUILD_HELPER + r"""
import kdakit.ops.kda.chunk.prep as P
tok = {n: "*bf16" for n in ("q", "k", "v", "g", "beta", "tinv", "w", "u", "qg", "kd")}
f32 = {n: "*fp32" for n in ("A_log", "dt_bias", "gc", "bt", "rq", "rk")}
types = dict(tok, **f32, table="*i32", lower_bound="fp32")
unaligned = ("s_bh", "lower_bound")  # beta's head stride is 1
# the variants whose code differs: each gate, with / without A_log, dt_bias, l2norm, the beta modes, GROUP 1 / 4
for gate, has_a, has_b, l2, sig, neg, group in ((0, False, False, False, False, False, 1),
                                                (0, False, False, True, True, False, 4),
                                                (1, True, True, True, True, False, 4),
                                                (1, False, True, False, False, False, 1),
                                                (2, True, True, True, True, True, 4)):
    build(P.chunk_prep_kernel, types, dict(HV=96, K=128, C=64, BK=P.PREP_BLOCK_K, GROUP=group, GATE=gate,
          HAS_A_LOG=has_a, HAS_BIAS=has_b, USE_L2NORM=l2, BETA_SIGMOID=sig, NEG_EIGVAL=neg),
          P.PREP_NUM_WARPS, unaligned)
for dt, prec in (("*bf16", "tf32"), ("*fp16", "tf32"), ("*fp32", "tf32x3")):
    t = dict(types, **{n: dt for n in tok})
    blk, warps = P.WU_CONFIG["fp32" if dt == "*fp32" else "bf16"]
    build(P.chunk_wu_kernel, t, dict(HV=96, K=128, V=128, C=64, BK=blk, BV=blk, GROUP=1,
          OP_BF16=dt != "*fp32", EMULATE_BF16=False, INTERPRETED=False, DOT_PREC=prec), warps)
"""


def check_builds(stdout: str, n_expected: int, warps_limit: dict) -> None:
    """Every build: no spills, no stack, registers within the budget of its warp count."""
    reports = read_reports(stdout)
    assert len(reports) == n_expected, stdout
    for name, r in reports.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (name, r)
        assert r["regs"] <= warps_limit.get(r["warps"], 255), (name, r)


def test_prep_and_wu_build_for_sm90_without_spills():
    out = run_sm90_build(PREP_BUILD)
    check_builds(out, 8, {8: 128})
