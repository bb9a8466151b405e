"""CPU tier of the Triton chunked forward: kernels under TRITON_INTERPRET=1 on tiny shapes,
checked against the float64 token-by-token definition, plus the plan's byte arithmetic.

The interpreter must be chosen before triton is imported; in the GPU tier, or when another
module of the session already imported triton in compiled mode, the kernel tests are
skipped (the plan tests still run).
"""

import os
import sys

import pytest

_GPU_TIER = os.environ.get("KDAKIT_TEST_TIER", "cpu") == "gpu"
_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
_CAN_INTERPRET = not _GPU_TIER and not _TRITON_PREIMPORTED
if _CAN_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kdakit.ops.kda.chunk_common import (  # noqa: E402
    load_matrix,
    store_matrix,
    unit_lower_inverse,
    unit_lower_inverse_doubling,
)

from kdakit.ops.kda.naive import naive_recurrent_kda  # noqa: E402
from kdakit.ops.kda.plan import (  # noqa: E402
    Allocation,
    checkpoint_offsets,
    default_checkpoint_tokens,
    plan_kda,
)
from kdakit.testing import assert_close  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not _CAN_INTERPRET,
    reason="interpreted kernels need TRITON_INTERPRET=1 before triton is imported: skipped in the GPU tier "
    "(KDAKIT_TEST_TIER=gpu) or when triton was already imported in compiled mode; run this file on its own",
)

GIB = 2**30


def _inputs(B, T, H, HV, K, V, *, dtype=torch.float32, gate_in_kernel=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    if gate_in_kernel:
        g = rnd(B, T, HV, K)
    else:  # already a log-decay
        g = -torch.nn.functional.softplus(rnd(B, T, HV, K)) * 0.5
    beta = rnd(B, T, HV)
    params = dict(A_log=rnd(HV) * 0.5, dt_bias=rnd(HV * K) * 0.5)
    return [x.to(dtype) for x in (q, k, v, g, beta)], params


def _run_both(q, k, v, g, beta, *, cu_seqlens=None, initial_state=None, plan=None, **opts):
    from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd

    K = q.shape[-1]
    scale = K**-0.5
    o, ht, ck = chunk_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                              output_final_state=True, cu_seqlens=cu_seqlens, plan=plan, **opts)
    ref_opts = {kk: vv for kk, vv in opts.items() if kk != "safe_gate"}
    for name in ("A_log", "dt_bias"):
        if ref_opts.get(name) is not None:
            ref_opts[name] = ref_opts[name].double()
    ro, rht = naive_recurrent_kda(
        q.double(), k.double(), v.double(), g.double(), beta.double(), scale=scale,
        initial_state=None if initial_state is None else initial_state.double(),
        output_final_state=True, cu_seqlens=cu_seqlens, **ref_opts,
    )
    return (o, ht, ck), (ro, rht)


CONFIGS = {
    # name: (H, HV, K, V, options)
    "raw_gate": (1, 1, 16, 16, dict()),
    "softplus_l2_sigmoid": (1, 1, 32, 16, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                               use_beta_sigmoid_in_kernel=True)),
    "safe_gate_neg_eig": (1, 1, 16, 32, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                             safe_gate=True, lower_bound=-5.0)),
    "lower_bound_no_alog": (1, 1, 16, 16, dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                                    lower_bound=-3.0, no_A_log=True)),
    "gva": (1, 2, 16, 16, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True)),
    "gva_safe": (1, 2, 16, 16, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0)),
    "masked_dims": (1, 1, 24, 20, dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)),
}


def _options(opts, params, H, HV):
    opts = dict(opts)
    no_alog = opts.pop("no_A_log", False)
    if opts.get("use_gate_in_kernel"):
        opts["A_log"] = None if no_alog else params["A_log"]
        opts["dt_bias"] = params["dt_bias"]
    return opts


def _beta_for(beta, opts):
    # Without the in-kernel sigmoid beta is used as given: keep it in (0, 1) like a real model.
    return beta if opts.get("use_beta_sigmoid_in_kernel") else torch.sigmoid(beta)


@needs_interpreter
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_recurrence(name):
    H, HV, K, V, opts = CONFIGS[name]
    (q, k, v, g, beta), params = _inputs(2, 37, H, HV, K, V, gate_in_kernel=opts.get("use_gate_in_kernel", False),
                                         seed=list(CONFIGS).index(name))
    opts = _options(opts, params, H, HV)
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, _beta_for(beta, opts), **opts)
    assert o.dtype == v.dtype and ht.dtype == torch.float32
    assert_close(f"{name} o", ro, o, 1e-5)
    assert_close(f"{name} final state", rht, ht, 1e-5)


@needs_interpreter
def test_v_split_matches_single_block():
    (q, k, v, g, beta), params = _inputs(1, 33, 1, 1, 16, 32, seed=3)
    opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **params)
    plan = plan_kda(q, v, block_v=16, output_final_state=True)
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, beta, plan=plan, **opts)
    assert_close("split-V o", ro, o, 1e-5)
    assert_close("split-V final state", rht, ht, 1e-5)


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.005), (torch.float16, 0.002)])
def test_forward_half_inputs(dtype, tol):
    (q, k, v, g, beta), params = _inputs(1, 40, 1, 1, 32, 32, dtype=dtype, seed=11)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                safe_gate=True, lower_bound=-5.0, **params)
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, beta, **opts)
    assert o.dtype == dtype
    assert_close(f"{dtype} o", ro, o, tol)
    assert_close(f"{dtype} final state", rht, ht, tol)


@needs_interpreter
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_varlen_with_initial_state(state_v_first, state_dtype):
    lengths = [0, 1, 16, 3, 20]  # zero, one, a full chunk, non-multiples of 16
    cu = torch.tensor([0, 0, 1, 17, 20, 40], dtype=torch.int64)
    (q, k, v, g, beta), params = _inputs(1, 40, 1, 2, 16, 16, seed=5)
    N, HV, K, V = len(lengths), 2, 16, 16
    h0 = torch.randn(N, HV, V, K) if state_v_first else torch.randn(N, HV, K, V)
    h0 = h0.to(state_dtype)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                state_v_first=state_v_first, **params)
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, **opts)
    assert ht.shape == h0.shape
    assert_close("varlen o", ro, o, 1e-5)
    assert_close("varlen final state", rht, ht, 1e-5)
    # the empty sequence's final state is its initial state, exactly
    assert torch.equal(ht[0], h0[0].float())


@needs_interpreter
def test_initial_state_read_through_strides():
    (q, k, v, g, beta), params = _inputs(2, 20, 1, 1, 16, 16, seed=8)
    base = torch.randn(1, 2, 16, 16)
    h0 = base.transpose(0, 1).transpose(-1, -2)  # [2, 1, 16, 16], a strided view
    assert not h0.is_contiguous()
    opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **params)
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, beta, initial_state=h0, **opts)
    assert_close("strided h0 o", ro, o, 1e-5)
    assert_close("strided h0 final state", rht, ht, 1e-5)


@needs_interpreter
def test_reset_level_decays_exact_path():
    (q, k, v, g, beta), _ = _inputs(1, 40, 1, 1, 16, 16, gate_in_kernel=False, seed=13)
    g[:, [3, 17, 18, 30]] = -1000.0  # whole tokens reset
    g[:, 9, :, :8] = -1000.0  # half the channels of one token reset
    beta = torch.sigmoid(beta)
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_close("reset o", ro, o, 1e-5)
    assert_close("reset final state", rht, ht, 1e-5)


@needs_interpreter
def test_unbounded_softplus_gate():
    (q, k, v, g, beta), params = _inputs(1, 33, 1, 1, 16, 16, seed=17)
    g = g * 20 + 10  # softplus arguments above the linear threshold: decays of -20 .. -200 per token
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=params["A_log"], dt_bias=params["dt_bias"])
    (o, ht, _), (ro, rht) = _run_both(q, k, v, g, beta, **opts)
    assert torch.isfinite(o).all()
    assert_close("softplus o", ro, o, 1e-5)


@needs_interpreter
@pytest.mark.parametrize("varlen", [False, True])
def test_checkpoints_hold_reference_states(varlen):
    L = 16
    (q, k, v, g, beta), params = _inputs(1 if varlen else 2, 40, 1, 2, 16, 16, seed=21)
    cu = torch.tensor([0, 5, 5, 40]) if varlen else None
    N = 3 if varlen else 2
    h0 = torch.randn(N, 2, 16, 16)
    opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True, **params)
    plan = plan_kda(q, v, cu_seqlens=cu, checkpoint_every_n_tokens=L, initial_state=True, output_final_state=True)
    (o, ht, ck), _ = _run_both(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, plan=plan, **opts)
    offs = checkpoint_offsets(cu, B=q.shape[0], T=40, every_n_tokens=L).tolist()
    assert ck.shape == (offs[-1], 2, 16, 16) == (plan.num_checkpoints, 2, 16, 16)
    spans = [(0, 5), (5, 5), (5, 40)] if varlen else [(0, 40), (0, 40)]
    for n, (bos, eos) in enumerate(spans):
        b = 0 if varlen else n
        assert offs[n + 1] - offs[n] == -(-(eos - bos) // L)
        for j in range(offs[n + 1] - offs[n]):
            t = bos + j * L
            sl = slice(bos, t)
            _, ref = naive_recurrent_kda(
                q[b:b + 1, sl].double(), k[b:b + 1, sl].double(), v[b:b + 1, sl].double(), g[b:b + 1, sl].double(),
                beta[b:b + 1, sl].double(), scale=16**-0.5, initial_state=h0[n:n + 1].double(),
                output_final_state=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                use_qk_l2norm_in_kernel=True, A_log=params["A_log"].double(), dt_bias=params["dt_bias"].double(),
            )
            assert_close(f"checkpoint seq {n} row {j}", ref[0], ck[offs[n] + j], 1e-5)


@triton.jit
def _inverse_kernel(a_ptr, out_ptr, C: tl.constexpr, DOUBLING: tl.constexpr):
    A = load_matrix(a_ptr, C, 1, C, C, 0, C, C)
    if DOUBLING:
        X = unit_lower_inverse_doubling(A, C)
    else:
        X = unit_lower_inverse(A, C)
    store_matrix(out_ptr, X, C, 1, C, C, 0, C, C)


@needs_interpreter
@pytest.mark.parametrize("doubling", [False, True])
def test_unit_lower_inverse(doubling):
    A = (torch.randn(16, 16) * 0.4).tril(-1)
    out = torch.empty(16, 16)
    _inverse_kernel[(1,)](A, out, C=16, DOUBLING=doubling)
    ref = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + A.double())
    assert_close("inverse", ref, out, 1e-6)


@needs_interpreter
def test_launcher_rejects_bad_layouts():
    from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd

    (q, k, v, g, beta), _ = _inputs(1, 16, 1, 1, 16, 16, gate_in_kernel=False)
    with pytest.raises(ValueError, match="q must be contiguous"):
        chunk_kda_fwd(torch.randn(1, 16, 1, 32)[..., :16], k, v, g, beta, scale=0.25)
    (q, k, v, g, beta), _ = _inputs(1, 16, 1, 1, 160, 16, gate_in_kernel=False)
    with pytest.raises(ValueError, match="K, V <= 128"):
        chunk_kda_fwd(q, k, v, g, beta, scale=0.25)


# ----------------------------------------------------------------------------------------
# plan arithmetic (no kernels)
# ----------------------------------------------------------------------------------------


def _round512(n):
    return -(-n // 512) * 512


def test_plan_floor_matches_spec_formula():
    for B, T, H in ((1, 8192, 96), (8, 8192, 16), (1, 8192, 128), (1, 131072, 96)):
        p = plan_kda(seqlens=[T] * B, H=H, K=128, dtype=torch.bfloat16)
        D = 128
        spec = 20 * B * T * H * D + 4 * B * T * H
        params = 2 * (_round512(4 * H) + _round512(4 * H * D))  # A_log, dt_bias and their gradients
        cu = 512  # cu_seqlens, rounded to one allocator block
        assert p.floor_bytes == spec + params + cu
    assert round(plan_kda(seqlens=[8192], H=96, K=128).floor_bytes / GIB, 3) == 1.878
    assert round(plan_kda(seqlens=[131072], H=96, K=128).floor_bytes / GIB, 2) == 30.05


def test_plan_checkpoints_and_workspace_bytes():
    p = plan_kda(seqlens=[8192], H=96, K=128)
    assert p.checkpoint_every_n_tokens == 2048 and p.recompute_every_n_tokens == 256
    assert p.num_checkpoints == 4
    assert p.checkpoint_bytes == 4 * 96 * 128 * 128 * 4
    assert p.saved_bytes == p.checkpoint_bytes + 512  # + the int64 row offsets
    per_prog = (2048 // 256) * 128 * 128 * 4 + (256 // 16) * 128 * 128 * 4
    assert p.backward_workspace_bytes == p.workspace_bytes == 96 * per_prog + 512 + 96 * 128 * 4
    # The peak is the backward kernel: everything but dA_log and ddt_bias (summed after the
    # workspace is freed) is live then.
    params_grads = 512 + 96 * 128 * 4
    assert p.predicted_peak_bytes == p.floor_bytes + p.saved_bytes + p.workspace_bytes - params_grads
    assert p.transient_bytes == -params_grads
    assert p.forward_peak_bytes == p.floor_bytes - 4 * (8192 * 96 * 128 * 2) - 8192 * 96 * 2 - params_grads \
        + p.saved_bytes  # no gradients yet; the offsets (512 B) are live during the forward kernel
    by_group = p.bytes_by_group()
    assert sum(by_group.values()) == sum(a.allocated_bytes for a in p.allocations)
    assert by_group["state checkpoints"] == p.saved_bytes


def test_plan_varlen_counts_and_default_cadence():
    p = plan_kda(seqlens=[0, 1, 16, 17, 5000], H=2, HV=4, K=64, V=32)
    assert p.checkpoint_every_n_tokens == 2048
    assert p.num_checkpoints == 0 + 1 + 1 + 1 + 3
    # fp32 per-value-head dq/dk partials replace bf16 dq/dk during the kernel; dA_log, ddt_bias come later
    assert p.transient_bytes == 2 * 5034 * 4 * 64 * 4 - 2 * 5034 * 2 * 64 * 2 - 512 - 1024
    assert p.peak_at == "after allocating bwd_chunk_states"
    short = plan_kda(seqlens=[40, 3], H=1, K=16)
    assert short.checkpoint_every_n_tokens == 48 == default_checkpoint_tokens(40)
    assert plan_kda(B=2, T=40, H=1, K=16, checkpoint_every_n_tokens=16).num_checkpoints == 6
    offs = checkpoint_offsets([0, 0, 1, 17, 20, 40], every_n_tokens=16)
    assert offs.dtype == torch.int64 and offs.tolist() == [0, 0, 1, 2, 3, 5]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple of the chunk size 16"):
        plan_kda(B=1, T=64, H=1, K=16, checkpoint_every_n_tokens=24)
    with pytest.raises(ValueError, match="HV must be a multiple"):
        plan_kda(B=1, T=64, H=2, HV=3, K=16)
    with pytest.raises(ValueError, match="needs K"):
        plan_kda(B=1, T=64, H=2)
    with pytest.raises(ValueError, match="block_v"):
        plan_kda(B=1, T=64, H=1, K=16, block_v=24)


def test_allocation_rounding():
    assert Allocation("x", (3,), torch.float32, "workspace", "backward").allocated_bytes == 512
    assert Allocation("x", (0, 5), torch.float32, "workspace", "backward").allocated_bytes == 0
    assert Allocation("x", (129,), torch.float32, "workspace", "backward").allocated_bytes == 1024
    assert Allocation("x", (128,), torch.bfloat16, "workspace", "backward").nbytes == 256


# ----------------------------------------------------------------------------------------
# the compiled (non-interpreted) kernel: it must build for sm_90a without a GPU
# ----------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd_kernel as fn, fwd_num_warps

def build(safe, gate, dtype, prec, BV, K=128):
    ptr = "*" + dtype
    const = dict(K=K, V=K, C=16, BK=K, BV=BV, BKS=16, GATE=gate, HAS_A_LOG=True, HAS_BIAS=True, USE_L2NORM=True,
                 BETA_SIGMOID=True, NEG_EIGVAL=True, SAFE=safe, IS_VARLEN=True, HAS_H0=True, STORE_HT=True,
                 STORE_CKPT=True, DOT_PREC=prec, INV_DOUBLING=True, LOOP_WHILE=False)
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ("q", "k", "v", "g", "beta", "o"):
            sig[n] = ptr
        elif n in ("A_log", "dt_bias", "h0", "ht", "ckpt"):
            sig[n] = "*fp32"
        elif n in ("cu_seqlens", "ckpt_offsets"):
            sig[n] = "*i64"
        elif n in ("scale", "lower_bound"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=fwd_num_warps(K, BV), num_stages=1))
    assert "mma" in kern.asm["ptx"]
    print("built", safe, gate, dtype, BV)

build(True, 2, "bf16", "tf32", 64)
build(False, 1, "fp32", "tf32x3", 32, K=64)
"""


def test_kernel_compiles_for_sm90():
    import subprocess

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("triton's bundled ptxas is missing, cannot build for sm_90a")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("built") == 2


def test_plan_events_replay_to_the_peak():
    p = plan_kda(seqlens=[3000, 5000], H=4, HV=8, K=64, initial_state=True, initial_state_dtype=torch.bfloat16,
                 output_final_state=True)
    size = {a.name: a.allocated_bytes for a in p.allocations}
    live, cur, peak = set(), 0, 0
    for kind, name in p.events:
        if kind == "alloc":
            assert name not in live, f"{name} allocated twice without a free"
            live.add(name)
            cur += size[name]
        elif kind == "free":
            live.remove(name)
            cur -= size[name]
        peak = max(peak, cur)
    assert peak == p.predicted_peak_bytes
    assert "checkpoints" in live and "bwd_segment_states" not in live and "bwd_dq_partials" not in live
