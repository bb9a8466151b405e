"""PyTorch twin of the Triton chunk backward: one chunk's forward and backward, written out by hand.

This file is the executable form of the backward math written out below and of the algorithm
the windowed Triton backward (``chunk_bwd.py``, ``chunk_bwd_windowed.py``) runs, in float64 (or
whatever dtype it is given), so the derivation can be checked against ``torch.autograd`` of the
token-by-token definition before any kernel is trusted.

One chunk of ``C`` rows of one value head (rows past the sequence end are padding: ``q = k = 0``,
``a = 0``, ``beta = 0``, which makes them identity steps)::

    G = cumsum(a) (inclusive, per key channel)     Gamma = exp(G)     gC = exp(G[C-1])
    E[i, j, c] = exp(G[i, c] - G[j, c])  (j <= i)
    Araw[i, j] = sum_c k_i k_j E_ij (j < i)        Aqk[i, j] = sum_c q_i k_j E_ij (j <= i)
    Tinv = (I + diag(beta) Araw)^-1
    W = Tinv (beta k Gamma)      U = Tinv (beta v)      V' = U - W S
    O = scale ((q Gamma) S + Aqk V')
    S_next = gC S + (k exp(G[C-1] - G))^T V'

The pairwise matrices come in two forms, as in the kernel:

* SAFE (``exact=False``): factor ``E`` with a mid-chunk reference ``r = G[C//2 - 1]``:
  ``qr = q exp(G - r)``, ``kr = k exp(G - r)``, ``ki = k exp(r - G)``, then ``Aqk = qr ki^T``.
  Only valid when the gate is bounded (``a >= -5``), so that ``exp(+-(G - r))`` stays finite.
* EXACT (``exact=True``): ``exp(G_i - G_j)`` for each pair, never ``exp(-G)``; valid for any gate.

The backward of a chunk takes ``dO`` and ``dS_next`` and returns the gradients of the
*transformed* per-token quantities (l2-normalized q and k, log-decay a, effective beta) and
``dS`` before the chunk. ``token_input_grads`` maps them back to the raw inputs (l2norm, gate,
beta sigmoid). ``chunk_kda_bwd_reference`` runs a whole batch with the kernel's two-level
recompute from sparse checkpoints, and ``reference_checkpoints`` produces those checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdakit.ops.kda.constants import SOFTPLUS_THRESHOLD
from kdakit.ops.kda.reference.preprocess import kda_beta, kda_gate, l2norm, l2norm_rstd

CHUNK = 16


# ---------------------------------------------------------------- one chunk ---------------------

def _pairwise(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, exact: bool) -> torch.Tensor:
    """``sum_c x_i[c] k_j[c] exp(G_i[c] - G_j[c])`` for all (i, j), unmasked."""
    C = G.shape[0]
    if exact:
        low = torch.tril(torch.ones(C, C, dtype=torch.bool, device=G.device))
        diff = G[:, None, :] - G[None, :, :]                                 # [C, C, K]
        # Above the diagonal the exponent can be huge; it is masked anyway, so never exponentiate it.
        E = torch.where(low[:, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
        return (x[:, None, :] * k[None, :, :] * E).sum(-1)
    r = G[C // 2 - 1]
    return (x * torch.exp(G - r)) @ (k * torch.exp(r - G)).T


def _pairwise_bwd(dA, x, k, G, exact: bool):
    """Gradients of ``_pairwise`` (``dA`` already masked) w.r.t. x, k and G."""
    C = G.shape[0]
    if exact:
        low = torch.tril(torch.ones(C, C, dtype=torch.bool, device=G.device))
        diff = G[:, None, :] - G[None, :, :]
        E = torch.where(low[:, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
        P = dA[:, :, None] * E                                                # [C, C, K]
        dx = (P * k[None, :, :]).sum(1)
        dk = (P * x[:, None, :]).sum(0)
        T = P * x[:, None, :] * k[None, :, :]
        dG = T.sum(1) - T.sum(0)
        return dx, dk, dG
    r = G[C // 2 - 1]
    ep, em = torch.exp(G - r), torch.exp(r - G)
    xr, ki = x * ep, k * em
    dxr = dA @ ki
    dki = dA.T @ xr
    # r is treated as a constant: the unmasked entries of the product do not depend on it.
    return dxr * ep, dki * em, dxr * xr - dki * ki


def chunk_forward(q, k, v, a, b, S, scale: float, exact: bool):
    """Forward of one chunk. q, k, a ``[C, K]``; v ``[C, V]``; b ``[C]``; S ``[K, V]``.

    Returns ``(O, S_next, saved)`` where ``saved`` holds the recomputed intermediates.
    """
    C = q.shape[0]
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    low = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    G = torch.cumsum(a, 0)
    Gam = torch.exp(G)
    GC = G[C - 1]
    Araw = torch.where(strict, _pairwise(k, k, G, exact), 0.0)
    Aqk = torch.where(low, _pairwise(q, k, G, exact), 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + b[:, None] * Araw, eye, upper=False, unitriangular=True)
    X = b[:, None] * k * Gam
    Y = b[:, None] * v
    W = Tinv @ X
    U = Tinv @ Y
    Vp = U - W @ S
    kd = k * torch.exp(GC - G)
    O = scale * ((q * Gam) @ S + Aqk @ Vp)
    S_next = torch.exp(GC)[:, None] * S + kd.T @ Vp
    saved = dict(G=G, Gam=Gam, GC=GC, Araw=Araw, Aqk=Aqk, Tinv=Tinv, X=X, Y=Y, W=W, Vp=Vp, kd=kd)
    return O, S_next, saved


def chunk_backward(q, k, v, a, b, S, dO, dSn, scale: float, exact: bool):
    """Backward of one chunk (the formulas of the module docstring).

    Returns ``(dq, dk, dv, da, db, dS)``: gradients of the transformed q, k, the values, the
    log-decay a, the effective beta, and of the state before the chunk.
    """
    C = q.shape[0]
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    low = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    _, _, s = chunk_forward(q, k, v, a, b, S, scale, exact)
    G, Gam, GC, Tinv, X, Y, W, Vp, kd = (s[n] for n in ("G", "Gam", "GC", "Tinv", "X", "Y", "W", "Vp", "kd"))
    gC = torch.exp(GC)

    dAqk = torch.where(low, scale * dO @ Vp.T, 0.0)
    dVp = scale * s["Aqk"].T @ dO + kd @ dSn
    dS = gC[:, None] * dSn + scale * (q * Gam).T @ dO - W.T @ dVp
    dqG = scale * dO @ S.T
    dW = -dVp @ S.T
    dkd = Vp @ dSn.T
    dgC = (S * dSn).sum(1)
    dT = dW @ X.T + dVp @ Y.T
    dX = Tinv.T @ dW
    dY = Tinv.T @ dVp
    dM = torch.where(strict, -(Tinv.T @ dT @ Tinv.T), 0.0)
    dAraw = b[:, None] * dM
    db = (dM * s["Araw"]).sum(1)

    dq, dk1, dG = _pairwise_bwd(dAqk, q, k, G, exact)
    dkx, dkk, dG2 = _pairwise_bwd(dAraw, k, k, G, exact)
    dk = dk1 + dkx + dkk
    dG = dG + dG2

    dv = b[:, None] * dY
    db = db + (v * dY).sum(1) + (k * Gam * dX).sum(1)
    dk = dk + b[:, None] * Gam * dX
    dG = dG + dX * X
    dq = dq + dqG * Gam
    dG = dG + dqG * q * Gam
    dk = dk + dkd * torch.exp(GC - G)
    dG = dG - dkd * kd
    dG[C - 1] += (dkd * kd).sum(0) + dgC * gC
    da = torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0])
    return dq, dk, dv, da, db, dS


def chunk_state_grad(q, k, a, b, dO, dSn, scale: float, exact: bool):
    """dL/dS before a chunk from dL/dS after it, without the state (the windowed backward's recurrence)::

        dV' = scale Aqk^T dO + kd dSn,   dS = gC dSn + scale (q Gamma)^T dO - W^T dV'

    W, Aqk, kd and gC depend only on the chunk's q, k, a, b; each value column of dS depends only on
    the same column of dO and dSn. Equals the ``dS`` of ``chunk_backward`` for any state.
    """
    C, K = q.shape
    zero = torch.zeros(K, dO.shape[1], dtype=q.dtype, device=q.device)
    _, _, s = chunk_forward(q, k, torch.zeros_like(dO), a, b, zero, scale, exact)
    gC = torch.exp(s["GC"])
    dVp = scale * s["Aqk"].T @ dO + s["kd"] @ dSn
    return gC[:, None] * dSn + scale * (q * s["Gam"]).T @ dO - s["W"].T @ dVp


# ---------------------------------------------------------------- token transforms --------------

def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Backward of ``y = l2norm(x) = x r``, ``r = l2norm_rstd(x)``: ``r (dy - y sum(dy y))``."""
    r = l2norm_rstd(x)
    y = x * r
    return r * (dy - y * (dy * y).sum(-1, keepdim=True))


def gate_bwd(g, da, A_log, dt_bias, lower_bound):
    """Backward of ``kda_gate`` for ``g`` ``[..., HV, K]``; returns (dg, dA_log [HV], ddt_bias [HV*K])."""
    HV, K = g.shape[-2], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).view(HV, K)
    lead = tuple(range(g.dim() - 2))
    if lower_bound is None:
        eA = torch.exp(A_log.to(g.dtype)).view(HV, 1)
        a = -eA * F.softplus(x, threshold=SOFTPLUS_THRESHOLD)
        sig = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
        dx = -da * eA * sig
        dA = (da * a).sum(lead).sum(-1)
    else:
        eA = torch.ones(HV, 1, dtype=g.dtype) if A_log is None else torch.exp(A_log.to(g.dtype)).view(HV, 1)
        sg = torch.sigmoid(eA * x)
        t = da * lower_bound * sg * (1 - sg)
        dx = t * eA
        dA = None if A_log is None else (t * eA * x).sum(lead).sum(-1)
    ddt = None if dt_bias is None else dx.sum(lead).reshape(HV * K)
    if A_log is None:
        dA = None
    return dx, dA, ddt


def beta_bwd(beta, db, use_sigmoid: bool, allow_neg_eigval: bool):
    """Backward of ``kda_beta``."""
    if not use_sigmoid:
        return db
    s = torch.sigmoid(beta)
    return db * (2.0 if allow_neg_eigval else 1.0) * s * (1 - s)


# ---------------------------------------------------------------- whole-sequence driver ---------

def checkpoint_offsets_ref(lengths: list[int], every: int) -> list[int]:
    """Row of each sequence's first checkpoint: sequence n has ceil(len_n / every) checkpoints."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + -(-n // every))
    return offs


def _spans(B: int, T: int, cu_seqlens):
    if cu_seqlens is None:
        return [(n, 0, T) for n in range(B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _transformed(q, k, g, beta, *, dtype, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias):
    q, k, g, beta = (x.to(dtype) for x in (q, k, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    a = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g
    b = kda_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return q, k, a, b


def _chunk_rows(x, bidx, t0, t1, C):
    """Rows t0..t1 of x[bidx] zero-padded to C rows (x is [B, T, ...])."""
    rows = x[bidx, t0:t1]
    if t1 - t0 == C:
        return rows
    pad = rows.new_zeros((C - (t1 - t0),) + tuple(rows.shape[1:]))
    return torch.cat([rows, pad], 0)


def reference_checkpoints(q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, initial_state=None,
                          use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                          use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
                          lower_bound=None, state_v_first=False, cu_seqlens=None,
                          checkpoint_every_n_tokens=32, dtype=torch.float64, chunk_size=CHUNK):
    """Chunked forward producing the sparse checkpoints the backward consumes.

    Returns ``(o, final_state [N, HV, K, V] K-major, checkpoints [total, HV, K, V], offsets [N+1])``
    all in ``dtype`` (offsets int64).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    grp = HV // H
    C, L = chunk_size, checkpoint_every_n_tokens
    scale = K ** -0.5 if scale is None else scale
    qt, kt, a, b = _transformed(q, k, g, beta, dtype=dtype, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                use_gate_in_kernel=use_gate_in_kernel,
                                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, A_log=A_log,
                                dt_bias=dt_bias)
    vv = v.to(dtype)
    spans = _spans(B, T, cu_seqlens)
    offs = checkpoint_offsets_ref([e - s for _, s, e in spans], L)
    ckpts = torch.zeros(offs[-1], HV, K, V, dtype=dtype)
    o = torch.zeros(B, T, HV, V, dtype=dtype)
    final = torch.zeros(len(spans), HV, K, V, dtype=dtype)
    for n, (bi, bos, eos) in enumerate(spans):
        for hv in range(HV):
            h = hv // grp
            S = torch.zeros(K, V, dtype=dtype)
            if initial_state is not None:
                S0 = initial_state[n, hv].to(dtype)
                S = S0.T if state_v_first else S0
            for t0 in range(bos, eos, C):
                if (t0 - bos) % L == 0:
                    ckpts[offs[n] + (t0 - bos) // L, hv] = S
                t1 = min(eos, t0 + C)
                O, S, _ = chunk_forward(_chunk_rows(qt[:, :, h], bi, t0, t1, C),
                                        _chunk_rows(kt[:, :, h], bi, t0, t1, C),
                                        _chunk_rows(vv[:, :, hv], bi, t0, t1, C),
                                        _chunk_rows(a[:, :, hv], bi, t0, t1, C),
                                        _chunk_rows(b[:, :, hv], bi, t0, t1, C), S, scale, not safe_gate)
                o[bi, t0:t1, hv] = O[: t1 - t0]
            final[n, hv] = S
    return o, final, ckpts, torch.tensor(offs, dtype=torch.int64)


def chunk_kda_bwd_reference(q, k, v, g, beta, do, dht, *, checkpoints, checkpoint_offsets, scale=None,
                            A_log=None, dt_bias=None, initial_state=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                            allow_neg_eigval=False, safe_gate=False, lower_bound=None, state_v_first=False,
                            cu_seqlens=None, checkpoint_every_n_tokens=32, recompute_every_n_tokens=16,
                            dtype=torch.float64, chunk_size=CHUNK):
    """The kernel's algorithm in PyTorch: reverse walk over checkpoint segments with two-level recompute.

    Per (sequence, value head): for each checkpoint segment (reverse), load its checkpoint, recompute
    the states at every ``recompute_every_n_tokens`` boundary (level 1), then for each of those
    sub-segments (reverse) recompute the chunk start states (level 2) and run the chunk backward
    in reverse, carrying ``dS``. Returns ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)`` in ``dtype``
    (dh0 in initial_state's layout, None without an initial state).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    grp = HV // H
    C, L, L2 = chunk_size, checkpoint_every_n_tokens, recompute_every_n_tokens
    if L % L2 or L2 % C:
        raise ValueError(f"checkpoint cadence {L} must be a multiple of recompute cadence {L2}, "
                         f"itself a multiple of the chunk {C}")
    scale = K ** -0.5 if scale is None else scale
    exact = not safe_gate
    kw = dict(dtype=dtype, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
              use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
              lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)
    qt, kt, a, b = _transformed(q, k, g, beta, **kw)
    vv, dov = v.to(dtype), do.to(dtype)
    spans = _spans(B, T, cu_seqlens)
    offs = checkpoint_offsets.tolist()
    # Gradients of the transformed quantities, per value head (q/k summed over the group below).
    dqt = torch.zeros(B, T, HV, K, dtype=dtype)
    dkt = torch.zeros(B, T, HV, K, dtype=dtype)
    dv = torch.zeros(B, T, HV, V, dtype=dtype)
    da = torch.zeros(B, T, HV, K, dtype=dtype)
    dbt = torch.zeros(B, T, HV, dtype=dtype)
    dh0 = None if initial_state is None else torch.zeros(initial_state.shape, dtype=dtype)

    def rows(x, bi, t0, hsel):
        return _chunk_rows(x[:, :, hsel], bi, t0, min(t0 + C, eos), C)

    for n, (bi, bos, eos) in enumerate(spans):
        for hv in range(HV):
            h = hv // grp
            dS = torch.zeros(K, V, dtype=dtype)
            if dht is not None:
                d = dht[n, hv].to(dtype)
                dS = d.T.clone() if state_v_first else d.clone()

            def fwd(S, t0):
                return chunk_forward(rows(qt, bi, t0, h), rows(kt, bi, t0, h), rows(vv, bi, t0, hv),
                                     rows(a, bi, t0, hv), rows(b, bi, t0, hv), S, scale, exact)[1]

            seg_starts = list(range(bos, eos, L))
            for si in reversed(range(len(seg_starts))):
                s0 = seg_starts[si]
                s1 = min(eos, s0 + L)
                S = checkpoints[offs[n] + si, hv].to(dtype)
                subs = list(range(s0, s1, L2))
                level1 = [S]
                for u0 in subs[:-1]:
                    for t0 in range(u0, u0 + L2, C):
                        S = fwd(S, t0)
                    level1.append(S)
                for ui in reversed(range(len(subs))):
                    u0 = subs[ui]
                    u1 = min(s1, u0 + L2)
                    S = level1[ui]
                    level2 = []
                    for t0 in range(u0, u1, C):
                        level2.append(S)
                        S = fwd(S, t0)
                    for ci in reversed(range(len(level2))):
                        t0 = u0 + ci * C
                        t1 = min(eos, t0 + C)
                        m = t1 - t0
                        gq, gk, gv, ga, gb, dS = chunk_backward(
                            rows(qt, bi, t0, h), rows(kt, bi, t0, h), rows(vv, bi, t0, hv),
                            rows(a, bi, t0, hv), rows(b, bi, t0, hv), level2[ci], rows(dov, bi, t0, hv),
                            dS, scale, exact)
                        dqt[bi, t0:t1, hv] = gq[:m]
                        dkt[bi, t0:t1, hv] = gk[:m]
                        dv[bi, t0:t1, hv] = gv[:m]
                        da[bi, t0:t1, hv] = ga[:m]
                        dbt[bi, t0:t1, hv] = gb[:m]
            if dh0 is not None:
                dh0[n, hv] = dS.T if state_v_first else dS

    # Raw-input gradients: l2norm and the gate act per head, so the group sum commutes with them.
    qr, kr = q.to(dtype).repeat_interleave(grp, 2), k.to(dtype).repeat_interleave(grp, 2)
    if use_qk_l2norm_in_kernel:
        dqt, dkt = l2norm_bwd(qr, dqt), l2norm_bwd(kr, dkt)
    dq = dqt.view(B, T, H, grp, K).sum(3)
    dk = dkt.view(B, T, H, grp, K).sum(3)
    dA_log = ddt = None
    if use_gate_in_kernel:
        dg, dA_log, ddt = gate_bwd(g.to(dtype), da, A_log, dt_bias, lower_bound)
    else:
        dg = da
    dbeta = beta_bwd(beta.to(dtype), dbt, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0
