"""The executable definition of KDA: docs/spec.md §2.1's token-by-token recurrence, literally.

For each sequence, value head and token (state ``S`` is ``[K, V]``)::

    S'  = Diag(exp(a_t)) S
    S   = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = scale * S^T q_t

It is slow (a Python loop over tokens) and exists to define the operator and to
check every faster path against it. It is differentiable by autograd. Math runs in
float32, or float64 when an input is float64.
"""

from __future__ import annotations

import torch

from kdakit.ops.kda.reference.preprocess import compute_dtype, kda_beta, kda_gate, l2norm


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA with ``chunk_kda``'s arguments (docs/spec.md §2.2). No validation; an unknown argument is
    a TypeError. ``safe_gate`` is accepted for signature parity and changes nothing: the definition is
    exact for any gate.

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``;
    beta ``[B, T, HV]``; initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``). Returns ``o`` ``[B, T, HV, V]`` in v's dtype and the final
    state (compute dtype) or None.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if scale is None:
        scale = K ** -0.5
    out_dtype = v.dtype
    dt = compute_dtype(q, k, v, g, beta)
    # dense copies of strided views: PyTorch's vectorized elementwise kernels (exp, softplus...) round differently
    # from its strided fallbacks, so a view is computed as its contiguous copy is (the same bits)
    q, k, v, g, beta = (x.contiguous().to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    a = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g
    b = kda_beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    q = q.repeat_interleave(G, dim=2)
    k = k.repeat_interleave(G, dim=2)

    if cu_seqlens is None:
        spans = [(n, 0, T) for n in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]

    outs = []
    finals = []
    for i, (bidx, bos, eos) in enumerate(spans):
        if initial_state is not None:
            S = initial_state[i].to(dt)
            if state_v_first:
                S = S.transpose(-1, -2)
        else:
            S = q.new_zeros(HV, K, V)
        for t in range(bos, eos):
            S = S * torch.exp(a[bidx, t])[..., None]                       # [HV, K, V]
            kt, bt = k[bidx, t], b[bidx, t]                                 # [HV, K], [HV]
            pred = torch.einsum("hk,hkv->hv", kt, S)                        # S'^T k
            S = S + torch.einsum("hk,hv->hkv", bt[:, None] * kt, v[bidx, t] - pred)
            outs.append(scale * torch.einsum("hk,hkv->hv", q[bidx, t], S))
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    if outs:
        o = torch.stack(outs, 0)
    else:
        o = v.new_zeros(0, HV, V)
    o = o.reshape(B, T, HV, V).to(out_dtype)
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final
