"""Chunked KDA in PyTorch: kdakit's CPU path and the reference twin of the Triton kernels.

Per sequence and value head, with a chunk of C tokens, the state S ``[K, V]`` at the
chunk start, ``G`` the inclusive cumsum of the log-decay ``a`` within the chunk and
``E[i, j, c] = exp(G[i, c] - G[j, c])`` for ``j <= i`` (always <= 1)::

    Akk[i, j] = beta_i * sum_c k_i[c] k_j[c] E[i, j, c]      (j < i)
    Aqk[i, j] = sum_c q_i[c] k_j[c] E[i, j, c]               (j <= i)
    Tinv      = (I + Akk)^-1                                 (unit lower triangular)
    W  = Tinv (beta * k * exp(G)),   U = Tinv (beta * v),   V' = U - W S
    O  = scale * ((q * exp(G)) S + Aqk V')
    S <- exp(G_C) * S + (k * exp(G_C - G))^T V'

Numerics: every exponent above is a difference ``G_i - G_j`` with ``i >= j`` or a
cumsum that is <= 0, so nothing overflows for any gate, including unbounded softplus
gates and per-token log-decays of -1000 (the pairwise factors are formed explicitly,
never as ``exp(-G)``); the within-chunk cumsum and its differences run in float64.

Memory follows the recompute idea: forward keeps only its inputs and the state at
the start of every segment of ``checkpoint_every_n_tokens`` tokens; backward walks the
segments in reverse, recomputes one segment under autograd from its checkpoint and
back-propagates ``dO`` and the incoming state gradient through it. Live memory beyond
inputs and gradients is one segment's intermediates plus the sparse checkpoints.

Layouts: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta
``[B, T, HV]``; packed sequences via ``cu_seqlens`` (B = 1). Internally each segment is
gathered into a padded ``[N, HV, L, D]`` block; padding rows are identity steps
(a = 0, beta = 0, k = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdakit.ops.kda.reference.preprocess import compute_dtype, floor_log_decay, kda_beta, kda_gate, l2norm

# 16 measured fastest on 2 CPU cores at T=4096, H=4, D=128 (fwd+bwd 2.0 s vs 3.5 s at 32, 6.7 s at 64).
DEFAULT_CHUNK_SIZE = 16
DEFAULT_CHECKPOINT_TOKENS = 256


@dataclass(frozen=True)
class ReferenceOptions:
    scale: float
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    lower_bound: float | None
    state_v_first: bool
    output_final_state: bool
    chunk_size: int
    checkpoint_every_n_tokens: int


def sequence_index(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded token map: ``idx[n, t]`` is the flat token (``b * T + t``) of sequence n's t-th token.

    Returns ``(idx, valid)``, both ``[N, L]`` with L the longest sequence rounded up to
    the chunk size; padding entries point at token 0 and are marked invalid.
    """
    if cu_seqlens is None:
        lens = torch.full((B,), T, dtype=torch.long)
        starts = torch.arange(B, dtype=torch.long) * T
    else:
        cu = cu_seqlens.detach().to("cpu", torch.long)
        lens = cu[1:] - cu[:-1]
        starts = cu[:-1]
    N = lens.numel()
    longest = int(lens.max()) if N else 0
    L = -(-longest // chunk_size) * chunk_size
    t = torch.arange(L, dtype=torch.long)
    valid = t[None, :] < lens[:, None]
    idx = torch.where(valid, starts[:, None] + t[None, :], torch.zeros((), dtype=torch.long))
    return idx.to(device), valid.to(device)


def _chunk_step(qc, kc, vc, ac, bc, S, scale):
    """One chunk for all sequences and heads. Shapes: qc, kc, ac [N, HV, C, K]; vc [N, HV, C, V];
    bc [N, HV, C]; S [N, HV, K, V]. Returns (O [N, HV, C, V], S_next)."""
    dt = qc.dtype
    C = qc.shape[-2]
    # A log-decay of -inf (or a raw gate of +inf under softplus) would make G_i - G_j = -inf - -inf = NaN: it is
    # floored as the Triton kernels floor it (floor_log_decay: NaN kept, gradient 0 where the floor holds). The
    # cumsum and every exponent formed from it run in float64 and are rounded once, after exp: a float32 G near
    # a few hundred (a few floored resets) would put a rounding step of ~1e-5 into each G_i - G_j.
    G64 = floor_log_decay(ac.to(torch.float64)).cumsum(-2)                  # [N, HV, C, K]
    diff = G64[..., :, None, :] - G64[..., None, :, :]                     # [N, HV, C, C, K]
    incl = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    diff = diff.masked_fill(~incl[:, :, None], float("-inf"))
    E = diff.exp().to(dt)                                                  # exp(G_i - G_j), 0 above the diagonal
    gamma = G64.exp().to(dt)                                               # [N, HV, C, K]
    g_last = G64[..., -1:, :]                                              # [N, HV, 1, K]

    A_raw = torch.einsum("nhic,nhjc,nhijc->nhij", kc, kc, E)               # [N, HV, C, C]
    strict = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril(-1)
    Akk = (bc[..., :, None] * A_raw) * strict
    Aqk = torch.einsum("nhic,nhjc,nhijc->nhij", qc, kc, E)
    eye = torch.eye(C, dtype=dt, device=qc.device)
    Tinv = torch.linalg.solve_triangular(eye + Akk, eye.expand_as(Akk), upper=False, unitriangular=True)

    W = Tinv @ (bc[..., None] * kc * gamma)                                # [N, HV, C, K]
    U = Tinv @ (bc[..., None] * vc)                                        # [N, HV, C, V]
    Vn = U - W @ S                                                         # [N, HV, C, V]
    O = scale * ((qc * gamma) @ S + Aqk @ Vn)
    kd = kc * torch.exp(g_last - G64).to(dt)                               # [N, HV, C, K]
    S = g_last.exp().to(dt).transpose(-1, -2) * S + kd.transpose(-1, -2) @ Vn
    return O, S


def _segment_forward(tokens, valid, S, params, opts: ReferenceOptions, group: int):
    """Apply the token transforms to a segment's gathered tokens and run its chunks.

    tokens: (q, k, v, g, beta), each [N, Ls, heads(, dim)]; valid: [N, Ls]; S: [N, HV, K, V].
    Returns (O [N, HV, Ls, V], S_end).
    """
    q, k, v, g, beta = tokens
    A_log, dt_bias = params
    dt = S.dtype
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if opts.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    a = kda_gate(g, A_log, dt_bias, opts.lower_bound) if opts.use_gate_in_kernel else g
    b = kda_beta(beta, opts.use_beta_sigmoid_in_kernel, opts.allow_neg_eigval)
    m = valid[..., None, None]
    # Padding rows become identity steps: no decay, no write, no read.
    a = torch.where(m, a, torch.zeros((), dtype=dt, device=a.device))
    k = torch.where(m, k, torch.zeros((), dtype=dt, device=k.device))
    q = torch.where(m, q, torch.zeros((), dtype=dt, device=q.device))
    b = torch.where(valid[..., None], b, torch.zeros((), dtype=dt, device=b.device))
    if group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    q, k, v, a = (x.permute(0, 2, 1, 3) for x in (q, k, v, a))            # [N, HV, Ls, dim]
    b = b.permute(0, 2, 1)                                                 # [N, HV, Ls]
    C = opts.chunk_size
    outs = []
    for s in range(0, q.shape[2], C):
        sl = slice(s, s + C)
        O, S = _chunk_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], a[:, :, sl], b[:, :, sl], S, opts.scale)
        outs.append(O)
    O = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return O, S


def _forward_segments(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: ReferenceOptions):
    """The forward, one checkpoint segment at a time: (o ``[B, T, HV, V]``, the final state and the list of
    segment-start states, each ``[N, HV, K, V]`` K-major in the compute dtype)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v, g, beta)
    idx, valid = sequence_index(B, T, cu_seqlens, opts.chunk_size, q.device)
    N, L = idx.shape
    raw = tuple(x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    S = _initial_state(initial_state, N, HV, K, V, dt, q.device, opts.state_v_first)
    o_flat = v.new_zeros(B * T, HV, V)
    seg = opts.checkpoint_every_n_tokens
    ckpts = []
    with torch.no_grad():
        for s in range(0, L, seg):
            ckpts.append(S)
            tokens = [x[idx[:, s:s + seg]] for x in raw]
            O, S = _segment_forward(tokens, valid[:, s:s + seg], S, (A_log, dt_bias), opts, HV // H)
            _scatter_rows(o_flat, O.permute(0, 2, 1, 3), idx[:, s:s + seg], valid[:, s:s + seg])
    return o_flat.view(B, T, HV, V), S, ckpts


class ChunkedKDAFunction(torch.autograd.Function):
    """Chunked KDA with sparse state checkpoints and per-segment recompute in backward.

    Saved for backward: the raw inputs (already held by autograd) and the segment-start
    states ``[num_segments, N, HV, K, V]`` in the compute dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: ReferenceOptions):
        o, S, ckpts = _forward_segments(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              torch.stack(ckpts) if ckpts else S.new_zeros(0, *S.shape))
        ctx.opts = opts
        if not opts.output_final_state:
            return o, None
        final = S.transpose(-1, -2) if opts.state_v_first else S
        return o, final.contiguous()

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ckpts = ctx.saved_tensors
        opts = ctx.opts
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dt = ckpts.dtype
        idx, valid = sequence_index(B, T, cu_seqlens, opts.chunk_size, q.device)
        N, L = idx.shape
        raw = tuple(x.detach().reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        grads_flat = [torch.zeros_like(x) for x in raw]
        do_flat = do.reshape(B * T, HV, V)
        dS = torch.zeros(N, HV, K, V, dtype=dt, device=q.device)
        if dht is not None:
            dS = (dht.transpose(-1, -2) if opts.state_v_first else dht).to(dt)
        params = [p.detach().requires_grad_() if p is not None else None for p in (A_log, dt_bias)]
        dparams = [torch.zeros_like(p) if p is not None else None for p in params]
        seg = opts.checkpoint_every_n_tokens
        starts = list(range(0, L, seg))
        for i in reversed(range(len(starts))):
            s = starts[i]
            ix, vd = idx[:, s:s + seg], valid[:, s:s + seg]
            leaves = [x.requires_grad_() for x in (r[ix].detach() for r in raw)]
            S0 = ckpts[i].detach().requires_grad_()
            with torch.enable_grad():
                O, S1 = _segment_forward(leaves, vd, S0, params, opts, HV // H)
                dO = do_flat[ix].permute(0, 2, 1, 3).to(O.dtype) * vd[:, None, :, None]
                wrt = leaves + [S0] + [p for p in params if p is not None]
                gs = torch.autograd.grad((O, S1), wrt, (dO, dS), allow_unused=True)
            for gf, gl in zip(grads_flat, gs[:5]):
                if gl is not None:
                    _scatter_rows(gf, gl, ix, vd)
            dS = gs[5]
            rest = list(gs[6:])
            for j, p in enumerate(params):
                if p is not None:
                    gp = rest.pop(0)
                    if gp is not None:
                        dparams[j] += gp
        dq, dk, dv, dg, db = (gf.view_as(x) for gf, x in zip(grads_flat, (q, k, v, g, beta)))
        dh0 = None
        if initial_state is not None and ctx.needs_input_grad[7]:
            dh0 = (dS.transpose(-1, -2) if opts.state_v_first else dS).to(initial_state.dtype)
        dA = dparams[0] if A_log is not None else None
        dbias = dparams[1] if dt_bias is not None else None
        return dq, dk, dv, dg, db, dA, dbias, dh0, None, None


def _scatter_rows(dst_flat, rows, idx, valid):
    """Write rows ``[N, Ls, ...]`` back to their flat token positions (valid rows only)."""
    dst_flat[idx[valid]] = rows[valid].to(dst_flat.dtype)


def _initial_state(h0, N, HV, K, V, dt, device, state_v_first):
    if h0 is None:
        return torch.zeros(N, HV, K, V, dtype=dt, device=device)
    S = h0.transpose(-1, -2) if state_v_first else h0
    return S.to(dt)


def _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
             lower_bound, state_v_first, output_final_state, chunk_size, checkpoint_every_n_tokens) -> ReferenceOptions:
    """The reference's options; the checkpoint segment rounded up to whole chunks."""
    C = chunk_size or DEFAULT_CHUNK_SIZE
    seg = checkpoint_every_n_tokens or DEFAULT_CHECKPOINT_TOKENS
    return ReferenceOptions(
        scale=float(scale), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, output_final_state=output_final_state, chunk_size=C,
        checkpoint_every_n_tokens=max(C, -(-seg // C) * C))


def chunked_kda_reference(
    q, k, v, g, beta, *,
    scale: float,
    A_log=None,
    dt_bias=None,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens=None,
    chunk_size: int | None = None,
    checkpoint_every_n_tokens: int | None = None,
):
    """Chunked KDA (validated inputs assumed; see ``kdakit.chunk_kda`` for the contract).

    Returns ``(o [B, T, HV, V] in v's dtype, final_state or None)``. The final state is
    in the compute dtype (float32, or float64 for float64 inputs).
    """
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                    lower_bound, state_v_first, output_final_state, chunk_size, checkpoint_every_n_tokens)
    return ChunkedKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)


INTERMEDIATE_STATE_TOKENS = 64  # FLA's h: the state at the start of every 64-token chunk


@torch.no_grad()
def chunked_kda_reference_states(q, k, v, g, beta, *, scale: float, A_log=None, dt_bias=None, initial_state=None,
                                 output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                 use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                                 allow_neg_eigval: bool = False, lower_bound: float | None = None,
                                 state_v_first: bool = False, cu_seqlens=None, chunk_size: int | None = None,
                                 checkpoint_every_n_tokens: int | None = None):
    """``chunk_kda(..., return_intermediate_states=True)`` on the PyTorch path: ``(o, final_state or None, h)``,
    h the state entering every 64-token chunk of every sequence, ``[B, NT, HV, K, V]`` (``[.., V, K]`` with
    state_v_first) in k's dtype; NT chunks per sequence (B = 1 and NT over all sequences when packed).
    ``checkpoint_every_n_tokens`` is ignored: the segments are the 64-token chunks."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                    lower_bound, state_v_first, output_final_state, chunk_size, INTERMEDIATE_STATE_TOKENS)
    o, S, ckpts = _forward_segments(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    if cu_seqlens is None:
        lengths = [T] * B
    else:
        cu = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
    per_seq = [-(-n // INTERMEDIATE_STATE_TOKENS) for n in lengths]
    rows = [ckpts[c][n] for n, count in enumerate(per_seq) for c in range(count)]
    h = torch.stack(rows) if rows else q.new_zeros((0, HV, K, V), dtype=S.dtype)
    if state_v_first:
        h = h.transpose(-1, -2)
    h = h.to(k.dtype).contiguous().view(B if cu_seqlens is None else 1, -1, *h.shape[1:])
    final = None
    if output_final_state:
        final = (S.transpose(-1, -2) if state_v_first else S).contiguous()
    return o, final, h
