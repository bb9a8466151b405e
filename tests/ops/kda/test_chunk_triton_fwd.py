"""CPU tier of the Triton chunked forward: kernels under TRITON_INTERPRET=1 on tiny shapes,
checked against the float64 token-by-token definition (whole forward) and a float64 PyTorch
computation of the intra-chunk kernel's outputs, plus the chunk table and the plan's byte
arithmetic, and an sm_90a build of both kernels.

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

from kdakit.ops.kda.reference.naive import naive_recurrent_kda  # noqa: E402
from kdakit.ops.kda.options import kda_options  # noqa: E402
from kdakit.ops.kda.plan import (  # noqa: E402
    Allocation,
    checkpoint_offsets,
    default_checkpoint_tokens,
    forward_chunk_table,
    plan_kda,
)
from kdakit.ops.kda.reference.preprocess import kda_beta, kda_gate, l2norm  # noqa: E402
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
    call = kda_options(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                       cu_seqlens=cu_seqlens, **opts)
    o, ht, ck = chunk_kda_fwd(q, k, v, g, beta, opts=call, A_log=opts.get("A_log"), dt_bias=opts.get("dt_bias"),
                              initial_state=initial_state, cu_seqlens=cu_seqlens, plan=plan)
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


# ----------------------------------------------------------------------------------------
# the intra-chunk kernel's outputs against a float64 PyTorch computation of the same quantities
# ----------------------------------------------------------------------------------------


def _intra_reference(q, k, v, g, beta, lengths, *, A_log=None, dt_bias=None, use_qk_l2norm_in_kernel=False,
                     use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                     lower_bound=None, **_):
    """Per chunk, float64: W, qΓ, kd, Aqk (rows of the chunk), exp(g_C) and U, from the chunk formulas."""
    C = 16
    q, k, v, g, beta = (x.double().reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta))
    HV, H = v.shape[1], q.shape[1]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(HV // H, dim=1)
    k = k.repeat_interleave(HV // H, dim=1)
    if use_gate_in_kernel:
        a = kda_gate(g, None if A_log is None else A_log.double(), dt_bias.double(), lower_bound)
    else:
        a = g
    b = kda_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    out = {n: torch.zeros(q.shape[0], HV, d, dtype=torch.float64)
           for n, d in (("w", q.shape[-1]), ("qg", q.shape[-1]), ("kd", q.shape[-1]), ("aqk", C), ("u", v.shape[-1]))}
    gcs = []
    bos = 0
    for n_len in lengths:
        for t0 in range(bos, bos + n_len, C):
            sl = slice(t0, min(t0 + C, bos + n_len))
            G = a[sl].cumsum(0)  # [c, HV, K]
            gam = G.exp()
            d = G[:, None] - G[None, :]  # [c, c, HV, K]: G_i - G_j
            causal = torch.ones(d.shape[0], d.shape[0], dtype=torch.bool).tril()
            E = torch.where(causal[..., None, None], d.clamp(max=0).exp(), torch.zeros((), dtype=d.dtype))
            Araw = torch.einsum("ihc,jhc,ijhc->hij", k[sl], k[sl], E)
            Aqk = torch.einsum("ihc,jhc,ijhc->hij", q[sl], k[sl], E)
            Akk = (b[sl].T[:, :, None] * Araw).tril(-1)
            Tinv = torch.linalg.inv(torch.eye(d.shape[0], dtype=d.dtype) + Akk)  # [HV, c, c]
            out["w"][sl] = torch.einsum("hij,jhc->ihc", Tinv, b[sl][..., None] * k[sl] * gam)
            out["u"][sl] = torch.einsum("hij,jhc->ihc", Tinv, b[sl][..., None] * v[sl])
            out["qg"][sl] = q[sl] * gam
            out["kd"][sl] = k[sl] * (G[-1:] - G).exp()
            out["aqk"][sl, :, :d.shape[0]] = Aqk.permute(1, 0, 2)
            gcs.append(G[-1].exp())
        bos += n_len
    out["gc"] = torch.stack(gcs) if gcs else torch.zeros(0, HV, q.shape[-1], dtype=torch.float64)
    return out


INTRA_CASES = {
    # name: (lengths (None: B=2 equal sequences of 37), H, HV, K, V, options)
    "safe_gate_varlen": ([0, 5, 16, 0, 21], 1, 2, 32, 16,
                         dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                              safe_gate=True, lower_bound=-5.0, allow_neg_eigval=True)),
    "softplus_exact_batched": (None, 1, 1, 32, 16,
                               dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True)),
    "raw_gate_masked_dims": ([17, 3], 2, 2, 20, 24, dict()),
}


@needs_interpreter
@pytest.mark.parametrize("name", list(INTRA_CASES))
def test_intra_kernel_outputs(name):
    from kdakit.ops.kda.chunk_fwd import chunk_kda_fwd_intra

    lengths, H, HV, K, V, opts = INTRA_CASES[name]
    B, T = (2, 37) if lengths is None else (1, sum(lengths))
    (q, k, v, g, beta), params = _inputs(B, T, H, HV, K, V, gate_in_kernel=opts.get("use_gate_in_kernel", False),
                                         seed=31 + list(INTRA_CASES).index(name))
    opts = _options(opts, params, H, HV)
    beta = _beta_for(beta, opts)
    cu = None if lengths is None else torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    plan = plan_kda(q, v, cu_seqlens=cu)
    call = kda_options(q, k, v, g, beta, cu_seqlens=cu, **opts)
    o = torch.full_like(v, float("nan"))
    w, qg, kd, aqk, gc, table = chunk_kda_fwd_intra(q, k, v, g, beta, o, A_log=opts.get("A_log"),
                                                    dt_bias=opts.get("dt_bias"), cu_seqlens=cu, plan=plan, opts=call)
    ref = _intra_reference(q, k, v, g, beta, [T] * B if lengths is None else lengths, **opts)
    assert gc.shape == (plan.num_chunks, HV, K) == ref["gc"].shape
    assert (table is None) == (cu is None)
    got = dict(w=w, qg=qg, kd=kd, aqk=aqk, u=o, gc=gc)
    for n in ("w", "qg", "kd", "aqk", "u"):
        assert_close(f"{name} {n}", ref[n], got[n].reshape(B * T, HV, -1), 1e-5)
    assert_close(f"{name} exp(g_C)", ref["gc"], gc, 1e-5)


def test_forward_chunk_table_with_empty_sequences():
    t = forward_chunk_table([0, 1, 16, 17, 0, 40])
    assert t.dtype == torch.int32
    pairs = [(0 + 1, 0), (2, 0), (3, 0), (3, 1), (5, 0), (5, 1), (5, 2)]
    assert t[:14].view(7, 2).tolist() == [list(p) for p in pairs]
    assert t[14:].tolist() == [0, 0, 1, 2, 4, 4, 7]  # each sequence's first chunk, then the total
    assert forward_chunk_table([0, 0]).tolist() == [0, 0, 0]
    p = plan_kda(seqlens=[0, 1, 16, 17, 0, 40], H=1, K=16)
    assert p.num_chunks == 7
    table = [a for a in p.allocations if a.name == "fwd_chunk_table"]
    assert table[0].shape == tuple(t.shape) and table[0].dtype == torch.int32


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
    strided = torch.randn(1, 16, 1, 32)[..., :16]
    with pytest.raises(ValueError, match="q must be contiguous"):
        chunk_kda_fwd(strided, k, v, g, beta, opts=kda_options(strided, k, v, g, beta, scale=0.25))
    (q, k, v, g, beta), _ = _inputs(1, 16, 1, 1, 160, 16, gate_in_kernel=False)
    with pytest.raises(ValueError, match="K, V <= 128"):
        chunk_kda_fwd(q, k, v, g, beta, opts=kda_options(q, k, v, g, beta, scale=0.25))


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
    # bf16 checkpoints every 512 tokens: the densest cadence within 1.10x the floor (256 would be 1.103x)
    assert p.checkpoint_every_n_tokens == 512 and p.recompute_every_n_tokens == 256
    assert p.num_checkpoints == 16 and p.checkpoint_dtype == torch.bfloat16
    assert p.checkpoint_bytes == 16 * 96 * 128 * 128 * 2
    assert p.saved_bytes == p.checkpoint_bytes + 512  # + the int64 row offsets
    # windowed backward: parameter partials per (item, chunk of a window), the fp32 state-gradient
    # carry, the fp32 start of window 1 of a segment, bf16 per-chunk states and state gradients, the
    # windows' Aqk (bf16) and exp(g_C) (fp32) slots (stages 1-2 from the windows' intermediates, H == HV)
    KV = 128 * 128
    partials = 96 * 16 * 4 + 96 * 16 * 128 * 4
    lean = 2 * (16 * 96 * 16 * 16 * 2 + 16 * 96 * 128 * 4)  # one slot set per window of a 512-token segment
    ws = partials + 96 * KV * 4 + 96 * 1 * KV * 4 + 2 * 96 * 16 * KV * 2 + lean
    assert p.backward_workspace_bytes == p.workspace_bytes == ws == 117184512
    # The peak is the backward kernel: everything but dA_log and ddt_bias (summed after the
    # workspace is freed) is live then.
    params_grads = 512 + 96 * 128 * 4
    assert p.predicted_peak_bytes == p.floor_bytes + p.saved_bytes + p.workspace_bytes - params_grads
    assert p.transient_bytes == -params_grads
    # forward-only temporaries: W, qΓ, kd (bf16 [T, HV, K]), Aqk (bf16 [T, HV, 16]), exp(g_C) (fp32 per chunk),
    # and the chunk table of the packed sequences (int32 [2 * 512 + 2])
    T, HV, K = 8192, 96, 128
    table = _round512(4 * (2 * 512 + 2))
    temps = 3 * T * HV * K * 2 + T * HV * 16 * 2 + (T // 16) * HV * K * 4 + table
    assert p.forward_workspace_bytes == temps and p.num_chunks == 512
    assert p.forward_peak_bytes == p.floor_bytes - 4 * (8192 * 96 * 128 * 2) - 8192 * 96 * 2 - params_grads \
        + p.saved_bytes + temps  # no gradients yet; the offsets (512 B) are live during the forward kernels
    assert p.forward_peak_bytes < p.predicted_peak_bytes
    by_group = p.bytes_by_group()
    assert sum(by_group.values()) == sum(a.allocated_bytes for a in p.allocations)
    assert by_group["state checkpoints"] == p.saved_bytes
    assert by_group["recompute intermediates"] == temps - table


def test_plan_varlen_counts_and_default_cadence():
    p = plan_kda(seqlens=[0, 1, 16, 17, 5000], H=2, HV=4, K=64, V=32)
    assert p.checkpoint_every_n_tokens == 2048
    assert p.num_checkpoints == 0 + 1 + 1 + 1 + 3
    # dq, dk are summed over the GVA group in registers (no partial buffers); dA_log, ddt_bias
    # (512 + 1024 allocated bytes) come after the peak
    assert p.transient_bytes == -512 - 1024
    assert p.peak_at == "after allocating bwd_chunk_state_grads"
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
import os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kdakit.ops.kda.chunk_fwd as F

PTRS = {"q", "k", "v", "g", "beta", "w", "qg", "kd", "uo", "aqk"}
F32 = {"A_log", "dt_bias", "h0", "ht", "ckpt", "gc"}
I32 = {"chunk_table", "chunk_offsets"}
I64 = {"cu_seqlens", "ckpt_offsets"}


def build(fn, const, dtype, num_warps, num_stages):
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        else:
            sig[n] = ("*" + dtype if n in PTRS else "*fp32" if n in F32 else "*i32" if n in I32
                      else "*i64" if n in I64 else "fp32" if n in ("scale", "lower_bound") else "i32")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))
    assert "mma" in kern.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kern.asm["ptx"])
    res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    info = " | ".join(l.split(":")[-1].strip() for l in res.stderr.splitlines() if "registers" in l or "spill" in l)
    print("built", fn.__name__, dtype, info)


def intra(safe, gate, K=128, prec="tf32"):
    return dict(K=K, V=K, C=16, BK=K, BV=K, BKS=16, GATE=gate, HAS_A_LOG=True, HAS_BIAS=True, USE_L2NORM=True,
                BETA_SIGMOID=True, NEG_EIGVAL=True, SAFE=safe, IS_VARLEN=True, DOT_PREC=prec, EMULATE_BF16=False)


def state(BV, K=128, bf16=True, prec="tf32"):
    return dict(K=K, V=K, C=16, BK=K, BV=BV, IS_VARLEN=True, HAS_H0=True, STORE_HT=True, STORE_CKPT=True,
                OP_BF16=bf16, EMULATE_BF16=False, DOT_PREC=prec, LOOP_WHILE=False)


build(F.chunk_kda_fwd_intra_kernel, intra(True, 2), "bf16", F.INTRA_NUM_WARPS, 1)
build(F.chunk_kda_fwd_intra_kernel, intra(False, 1, K=64, prec="tf32x3"), "fp32", F.INTRA_NUM_WARPS, 1)
build(F.chunk_kda_fwd_state_kernel, state(64), "bf16", F.state_num_warps(128, 64), F.STATE_NUM_STAGES)
build(F.chunk_kda_fwd_state_kernel, state(32, K=64, bf16=False, prec="tf32x3"), "fp32", F.state_num_warps(64, 32),
      F.STATE_NUM_STAGES)
"""


def test_kernel_compiles_for_sm90():
    import subprocess

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("triton's bundled ptxas is missing, cannot build for sm_90a")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("built") == 4, res.stdout


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
    assert "checkpoints" in live and "bwd_chunk_states" not in live and "bwd_chunk_state_grads" not in live
