"""Triton building blocks shared by the chunked KDA forward and backward kernels.

Every helper is a ``@triton.jit`` function that works on register tiles of one chunk of
``C`` tokens (C = 16) for one sequence and one value head. Tiles are float32; loads
upcast whatever the storage dtype is (bf16 arithmetic is wrong under the interpreter and
the kernels compute in fp32 anyway). Notation used in the shape comments:

* ``C``  chunk rows (tokens), padded tail rows are zero on load;
* ``BK`` key channels (a power of two >= 16 covering K; columns >= K are zero);
* ``BKS`` a slice of the key channels (EXACT pairwise path);
* ``BV`` a block of value channels (any power of two >= 16; nothing here assumes BV == V).

Chunk math (docs/spec.md §2.9): ``G = cumsum(a)`` over the chunk rows,
``E[i, j, c] = exp(G[i, c] - G[j, c])`` for ``j <= i``. Two ways to form the pairwise sums
``A[i, j] = sum_c x_i[c] y_j[c] E[i, j, c]``:

* SAFE (bounded gate, ``a >= -5`` so ``|G| <= 80``): factor through a mid-chunk reference
  ``r = G[C//2 - 1]``: ``x * exp(G - r)`` times ``(y * exp(r - G))^T``; every exponent stays
  within about +-40, so one ``tl.dot`` gives the matrix;
* EXACT (any gate, log-decays down to -1000 and below): form ``E`` explicitly on a
  ``[C, C, BKS]`` slice with the causal mask applied before it is used, never
  ``exp(-G)`` of an unbounded sum.

Padded tail rows are identity steps: ``a = 0``, ``beta = 0``, ``k = q = 0``; the loaders
here guarantee it, so ``G[C-1]`` is always the last real token's cumulative decay.

Pointer convention: callers pass a base pointer already advanced (with int64 arithmetic)
to the first token of the sequence and to the head; rows are token indices relative to
it and are widened to int64 before they are multiplied by a stride.
"""

from __future__ import annotations

import triton
import triton.language as tl

# LOG_DECAY_FLOOR: log-decays are clamped to >= it on load, the same floor as the PyTorch path's (constants.py
# says why).
from kdakit.ops.kda.constants import L2NORM_EPS, LOG_DECAY_FLOOR, SOFTPLUS_THRESHOLD

# Gate modes (constexpr GATE in the kernels).
GATE_NONE = 0  # g is the log-decay itself
GATE_SOFTPLUS = 1  # a = -exp(A_log) * softplus(g + dt_bias)
GATE_LOWER_BOUND = 2  # a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))

# Below this, log(1 + exp(x)) is exp(x) to float32 precision and the sum 1 + exp(x) would round away.
SOFTPLUS_SMALL = -15.0
# The same constants as tl.constexpr: the form in which a @triton.jit function may read a module global.
L2NORM_EPS_TL = tl.constexpr(L2NORM_EPS)
SOFTPLUS_THRESHOLD_TL = tl.constexpr(SOFTPLUS_THRESHOLD)
SOFTPLUS_SMALL_TL = tl.constexpr(SOFTPLUS_SMALL)
LOG_DECAY_FLOOR_TL = tl.constexpr(LOG_DECAY_FLOOR)


def gate_mode(use_gate_in_kernel: bool, lower_bound: float | None) -> int:
    """The constexpr GATE value for a call's flags."""
    if not use_gate_in_kernel:
        return GATE_NONE
    return GATE_SOFTPLUS if lower_bound is None else GATE_LOWER_BOUND


def block_size(n: int) -> int:
    """Smallest power of two >= max(n, 16) (tl.dot needs every dimension >= 16)."""
    return max(16, triton.next_power_of_2(int(n)))


# ---------------------------------------------------------------------------------------
# loads and stores
# ---------------------------------------------------------------------------------------


@triton.jit
def seq_bounds(cu_seqlens, n, T, IS_VARLEN: tl.constexpr):
    """[bos, eos) token span of sequence n as int64 scalars: packed (cu_seqlens) or n * T.
    Shared by the chunk and the recurrent kernels."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def locate_chunk(i_t, cu_seqlens, chunk_table, T, NTS, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Global chunk i_t -> (its sequence's first token, the sequence's length int32, the chunk's first row t0).

    Packed sequences read (sequence, chunk within it) from ``chunk_table`` (int32 pairs); fixed-length ones
    hold NTS chunks each."""
    if IS_VARLEN:
        i_n = tl.load(chunk_table + 2 * i_t).to(tl.int64)
        i_c = tl.load(chunk_table + 2 * i_t + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_n = i_t // NTS
        i_c = (i_t % NTS).to(tl.int32)
        bos = i_n * T
        eos = bos + T
    return bos, (eos - bos).to(tl.int32), i_c * C


@triton.jit
def load_rows(base, t0, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Tile ``x[t0 + r, col0 + c]`` of a row-major slab (unit column stride) as fp32.

    base: pointer to row 0, column 0 (already offset to sequence start and head).
    Rows ``>= n_rows`` and columns ``>= n_cols`` read as 0. Returns ``[BR, BC]`` fp32.
    """
    # int64 scalar to the tile's first row, int32 offsets inside it (a [BR, BC] int64 pointer tile costs two
    # registers per element; sm_90a register counts dropped with this)
    rl = tl.arange(0, BR)  # [BR]
    c = col0 + tl.arange(0, BC)  # [BC]
    mask = (t0 + rl < n_rows)[:, None] & (c < n_cols)[None, :]
    ptrs = (base + t0.to(tl.int64) * stride_row) + (rl[:, None] * stride_row + c[None, :])
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # [BR, BC]


@triton.jit
def store_rows(base, x, t0, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Store ``x`` ``[BR, BC]`` into rows ``t0 + r < n_rows``, columns ``col0 + c < n_cols``.

    The value is cast to the pointer's element type (one rounding, from fp32).
    """
    rl = tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (t0 + rl < n_rows)[:, None] & (c < n_cols)[None, :]
    ptrs = (base + t0.to(tl.int64) * stride_row) + (rl[:, None] * stride_row + c[None, :])
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def load_row_scalars(base, t0, n_rows, stride_row, BR: tl.constexpr):
    """One value per row (e.g. beta): ``x[t0 + r]`` as fp32 ``[BR]``, 0 for rows ``>= n_rows``."""
    r = t0 + tl.arange(0, BR)
    return tl.load(base + r.to(tl.int64) * stride_row, mask=r < n_rows, other=0.0).to(tl.float32)


@triton.jit
def store_row_scalars(base, x, t0, n_rows, stride_row, BR: tl.constexpr):
    """Store ``x`` ``[BR]`` at ``base[(t0 + r) * stride_row]`` for rows ``< n_rows``."""
    r = t0 + tl.arange(0, BR)
    tl.store(base + r.to(tl.int64) * stride_row, x.to(base.dtype.element_ty), mask=r < n_rows)


@triton.jit
def load_matrix(base, stride0, stride1, n0, n1, off1, B0: tl.constexpr, B1: tl.constexpr):
    """Strided 2-D tile ``x[i, off1 + j]`` (e.g. a state in either layout) as fp32 ``[B0, B1]``.

    Entries with ``i >= n0`` or ``off1 + j >= n1`` read as 0. Strides are in elements.
    """
    i = tl.arange(0, B0)
    j = off1 + tl.arange(0, B1)
    mask = (i < n0)[:, None] & (j < n1)[None, :]
    ptrs = base + i.to(tl.int64)[:, None] * stride0 + j.to(tl.int64)[None, :] * stride1
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_matrix(base, x, stride0, stride1, n0, n1, off1, B0: tl.constexpr, B1: tl.constexpr):
    """Store ``x`` ``[B0, B1]`` at ``base[i * stride0 + (off1 + j) * stride1]`` (masked like load_matrix)."""
    i = tl.arange(0, B0)
    j = off1 + tl.arange(0, B1)
    mask = (i < n0)[:, None] & (j < n1)[None, :]
    ptrs = base + i.to(tl.int64)[:, None] * stride0 + j.to(tl.int64)[None, :] * stride1
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------
# token transforms and their derivatives
# ---------------------------------------------------------------------------------------


@triton.jit
def l2norm_rstd(sum_sq):
    """The l2norm's scale ``1 / sqrt(sum x^2 + 1e-6)`` from a row's sum of squares (any shape): the one form
    of every kernel, chunk and recurrent, forward and backward (preprocess.l2norm_rstd is its PyTorch twin)."""
    return 1.0 / tl.sqrt(sum_sq + L2NORM_EPS_TL)


@triton.jit
def l2norm_rows(x):
    """Row-wise ``x / sqrt(sum x^2 + 1e-6)``. x ``[BR, BC]`` -> (y ``[BR, BC]``, rstd ``[BR]``)."""
    rstd = l2norm_rstd(tl.sum(x * x, axis=1))  # [BR]
    return x * rstd[:, None], rstd


@triton.jit
def l2norm_rows_bwd(dy, y, rstd):
    """Gradient through ``y = l2norm(x)``: ``dx = rstd * (dy - y * sum(dy * y))``.

    dy, y ``[BR, BC]``; rstd ``[BR]`` (from l2norm_rows). Returns dx ``[BR, BC]``.
    """
    dot = tl.sum(dy * y, axis=1)  # [BR]
    return rstd[:, None] * (dy - y * dot[:, None])


@triton.jit
def softplus_fp32(x):
    """``softplus(x)`` in fp32, as torch's (threshold 20: x above it); ``e^x`` below -15, where ``1 + e^x``
    rounds to 1 and would lose the value. NaN in, NaN out. The chunk and the recurrent kernels' one copy."""
    big = x > SOFTPLUS_THRESHOLD_TL
    small = x < SOFTPLUS_SMALL_TL
    xs = tl.where(big | small, 0.0, x)  # keep exp() of the unused branch finite
    mid = tl.log(1.0 + tl.exp(xs))
    return tl.where(big, x, tl.where(small, tl.exp(tl.minimum(x, 0.0)), mid))


@triton.jit
def gate_log_decay(x, expA, lower_bound, GATE: tl.constexpr):
    """Log-decay ``a`` from the gate pre-activation ``x = g + dt_bias`` (any tile shape).

    expA: scalar fp32 ``exp(A_log[hv])`` (1.0 when A_log is None). lower_bound: scalar.
    GATE_NONE -> x; GATE_SOFTPLUS -> ``-expA * softplus(x)`` (softplus(x) = x for x > 20);
    GATE_LOWER_BOUND -> ``lower_bound * sigmoid(expA * x)``.
    """
    if GATE == 1:
        a = -expA * softplus_fp32(x)
    elif GATE == 2:
        a = lower_bound * tl.sigmoid(expA * x)
    else:
        a = x
    return a


@triton.jit
def gate_log_decay_bwd(da, x, expA, lower_bound, GATE: tl.constexpr):
    """Backward of gate_log_decay. da, x: same shape (x = g + dt_bias, fp32).

    Returns (dx, dA_log_elem): ``dx = da * da/dx`` (this is also dg and the per-element
    ddt_bias term) and ``dA_log_elem`` whose sum over tokens and channels is dA_log
    (``d a / d A_log = a`` for softplus, ``lower_bound * s * (1 - s) * expA * x`` for the
    lower-bound gate, 0 without an in-kernel gate).
    """
    if GATE == 1:
        sig = tl.sigmoid(x)
        a = -expA * softplus_fp32(x)
        dx = da * (-expA) * sig
        dlog = da * a
    elif GATE == 2:
        s = tl.sigmoid(expA * x)
        ds = da * lower_bound * s * (1.0 - s)
        dx = ds * expA
        dlog = ds * expA * x
    else:
        dx = da
        dlog = da * 0.0
    return dx, dlog


@triton.jit
def gate_log_decay_bwd_floored(da, x, a, expA, lower_bound, GATE: tl.constexpr):
    """gate_log_decay_bwd of a log-decay clamped to ``>= LOG_DECAY_FLOOR`` on load (the backward of both chunk
    pipelines): ``a`` is the clamped value (0 on padded entries), and where the clamp holds the gradient is 0.
    A NaN log-decay is not clamped (gate_from_preact propagates it), so its gradient stays NaN, as on the
    PyTorch path and in the recurrent kernels: the test is ``a <= floor`` (false for NaN), not ``a > floor``.
    The lower-bound gate (``a >= lower_bound >= -5``) never reaches the floor."""
    dx, dlog = gate_log_decay_bwd(da, x, expA, lower_bound, GATE)
    if GATE == 1:
        floored = a <= LOG_DECAY_FLOOR_TL
        dx = tl.where(floored, 0.0, dx)
        # d a / d A_log = a: the given a, which is the unclamped one wherever not floored, and 0 on padded entries
        # (gate_log_decay_bwd's recomputed a is not: padded entries see the gate of dt_bias alone)
        dlog = tl.where(floored, 0.0, da * a)
    elif GATE == 0:
        dx = tl.where(a <= LOG_DECAY_FLOOR_TL, 0.0, dx)
    return dx, dlog


@triton.jit
def beta_activation(b, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``sigmoid(b)`` (times 2 with NEG_EIGVAL) or b itself. Any shape, fp32."""
    if BETA_SIGMOID:
        s = tl.sigmoid(b)
        if NEG_EIGVAL:
            s = 2.0 * s
    else:
        s = b
    return s


@triton.jit
def beta_activation_bwd(dbeta, b_raw, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """Gradient of the raw beta: ``dbeta * (2 if NEG_EIGVAL) * s * (1 - s)`` or dbeta."""
    if BETA_SIGMOID:
        s = tl.sigmoid(b_raw)
        d = dbeta * s * (1.0 - s)
        if NEG_EIGVAL:
            d = 2.0 * d
    else:
        d = dbeta
    return d


@triton.jit
def gate_from_preact(x, t0, n_rows, col0, K, expA, lower_bound,
                     BR: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr):
    """Log-decay from the pre-activation ``x = g + dt_bias`` of rows ``t0 + [0, BR)``, columns ``col0 + [0, BC)``:
    clamped to ``>= -110`` (LOG_DECAY_FLOOR: exact in float32 for log-decays <= 0) and exactly 0 on padded rows
    and columns. The one home of the chunk kernels' clamp."""
    a = gate_log_decay(x, expA, lower_bound, GATE)
    r = t0 + tl.arange(0, BR)
    c = col0 + tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < K)[None, :]
    # NaN-propagating max (PTX max.NaN.f32): the plain max.f32 returns the non-NaN operand, so a NaN gate would
    # load as the floor, a finite reset, on the GPU only (tests/gpu/ops/kda/test_nonfinite_gpu.py checks it)
    return tl.where(mask, tl.maximum(a, LOG_DECAY_FLOOR_TL, propagate_nan=tl.PropagateNan.ALL), 0.0)


@triton.jit
def load_chunk_gate(g_base, bias_ptr, t0, n_rows, stride_g, col0, K, expA, lower_bound,
                    C: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Log-decay tile of a chunk (gate_from_preact of the loaded gate rows): a ``[C, BC]`` fp32.

    g_base: gate rows of this (sequence, value head) (row stride stride_g); bias_ptr: this
    value head's ``dt_bias[hv*K:(hv+1)*K]`` (unused without HAS_BIAS). Columns are
    ``col0 + [0, BC)``.
    """
    x = load_rows(g_base, t0, n_rows, stride_g, col0, K, C, BC)  # [C, BC]
    if HAS_BIAS:
        c = col0 + tl.arange(0, BC)
        bias = tl.load(bias_ptr + c, mask=c < K, other=0.0).to(tl.float32)  # [BC]
        x = x + bias[None, :]
    return gate_from_preact(x, t0, n_rows, col0, K, expA, lower_bound, C, BC, GATE)  # [C, BC]


@triton.jit
def load_chunk_beta(b_base, t0, n_rows, stride_b, C: tl.constexpr,
                    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """Activated beta of a chunk ``[C]`` fp32, exactly 0 on padded rows."""
    r = t0 + tl.arange(0, C)
    b = load_row_scalars(b_base, t0, n_rows, stride_b, C)  # [C]
    return tl.where(r < n_rows, beta_activation(b, BETA_SIGMOID, NEG_EIGVAL), 0.0)


# ---------------------------------------------------------------------------------------
# small matrix helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def row_of(x, i, BR: tl.constexpr):
    """Row ``i`` of ``x`` ``[BR, BC]`` as ``[BC]`` (i may be a runtime value)."""
    r = tl.arange(0, BR)
    return tl.sum(tl.where((r == i)[:, None], x, 0.0), axis=0)


@triton.jit
def causal_mask(C: tl.constexpr, INCLUDE_DIAG: tl.constexpr):
    """``[C, C]`` bool: ``j <= i`` (INCLUDE_DIAG) or ``j < i``."""
    i = tl.arange(0, C)
    if INCLUDE_DIAG:
        m = i[:, None] >= i[None, :]
    else:
        m = i[:, None] > i[None, :]
    return m


@triton.jit
def safe_gate_factors(G, C: tl.constexpr):
    """SAFE-path factors of a chunk's cumulative decay G ``[C, BK]`` (bounded gate only).

    Returns (eg, egi), both ``[C, BK]``: ``eg = exp(G - r)``, ``egi = exp(r - G)`` with the
    mid-chunk reference ``r = G[C//2 - 1]``, so ``eg[i] * egi[j] = exp(G[i] - G[j])`` and
    every exponent is within ``(C//2) * 5`` of 0 when ``a >= -5``.
    """
    r = row_of(G, C // 2 - 1, C)  # [BK]
    return tl.exp(G - r[None, :]), tl.exp(r[None, :] - G)


@triton.jit
def pairwise_dot(xe, ye, C: tl.constexpr, INCLUDE_DIAG: tl.constexpr, DOT_PREC: tl.constexpr):
    """SAFE pairwise matrix ``A[i, j] = sum_c xe[i, c] * ye[j, c]``, causally masked.

    xe = x * eg, ye = y * egi (safe_gate_factors), both ``[C, BK]``. Returns ``[C, C]``
    with zeros above (or on, without INCLUDE_DIAG) the diagonal; masked entries are
    replaced, not multiplied, so an overflow there cannot leak.
    """
    a = tl.dot(xe, tl.trans(ye), input_precision=DOT_PREC)  # [C, C]
    return tl.where(causal_mask(C, INCLUDE_DIAG), a, 0.0)


@triton.jit
def pairwise_decay(G, C: tl.constexpr, INCLUDE_DIAG: tl.constexpr):
    """EXACT pairwise decay ``E[i, j, c] = exp(G[i, c] - G[j, c])`` on the causal pairs, else 0.

    G ``[C, BKS]`` -> ``[C, C, BKS]``. Only differences G_i - G_j (i >= j) are
    exponentiated in the kept entries, so any gate (log-decay -1000 included) is finite.
    """
    d = G[:, None, :] - G[None, :, :]  # [C, C, BKS]
    keep = causal_mask(C, INCLUDE_DIAG)[:, :, None]
    return tl.where(keep, tl.exp(tl.where(keep, d, 0.0)), 0.0)


@triton.jit
def pairwise_exact(x, y, G, C: tl.constexpr, INCLUDE_DIAG: tl.constexpr):
    """EXACT pairwise matrix on one key slice: ``A[i, j] = sum_c x[i,c] y[j,c] E[i,j,c]``.

    x, y, G ``[C, BKS]`` (same columns). Returns ``[C, C]`` causally masked. Sum the
    results of all slices to get the full matrix.
    """
    e = pairwise_decay(G, C, INCLUDE_DIAG)  # [C, C, BKS]
    return tl.sum(x[:, None, :] * y[None, :, :] * e, axis=2)  # [C, C]


@triton.jit
def unit_lower_inverse(A, C: tl.constexpr):
    """``(I + A)^-1`` for a strictly lower triangular ``A`` ``[C, C]`` (fp32, forward substitution).

    Row i of ``X = (I + A)^-1 - I`` is ``-A_i - sum_{j<i} A_ij X_j``; rows are filled in order,
    so C - 1 dependent steps of a ``[C, C]`` multiply-reduce. Returns ``[C, C]``.
    """
    r = tl.arange(0, C)
    X = -A  # row i is replaced by X_i at step i; rows > i still hold -A
    for i in tl.static_range(1, C):
        row = row_of(X, i, C)  # [C] = -A_i (zero at columns >= i)
        row = row + tl.sum(row[:, None] * X, axis=0)  # rows j < i of X are final
        X = tl.where((r == i)[:, None], row[None, :], X)
    return X + tl.where(r[:, None] == r[None, :], 1.0, 0.0)


@triton.jit
def unit_lower_inverse_doubling(A, C: tl.constexpr):
    """Same result as unit_lower_inverse via ``(I+N)(I+N^2)(I+N^4)(I+N^8)``, ``N = -A`` (C <= 16).

    Nilpotency (``N^16 = 0``) makes the product exact; six ``[C, C] x [C, C]`` ieee-fp32
    dots replace C - 1 dependent reductions (shorter critical path on the GPU).
    """
    r = tl.arange(0, C)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    N = -A
    P = eye + N
    N2 = tl.dot(N, N, input_precision="ieee")
    P = P + tl.dot(P, N2, input_precision="ieee")
    N4 = tl.dot(N2, N2, input_precision="ieee")
    P = P + tl.dot(P, N4, input_precision="ieee")
    N8 = tl.dot(N4, N4, input_precision="ieee")
    P = P + tl.dot(P, N8, input_precision="ieee")
    return P


@triton.jit
def beta_lower_inverse(b, A, C: tl.constexpr, INV_DOUBLING: tl.constexpr):
    """The chunk's ``T^-1 = (I + diag(b) A)^-1`` (b ``[C]``, A strictly lower ``[C, C]``) by doubling products
    (INV_DOUBLING) or forward substitution: the backward kernels' one form. Returns ``[C, C]``."""
    if INV_DOUBLING:
        Tinv = unit_lower_inverse_doubling(b[:, None] * A, C)
    else:
        Tinv = unit_lower_inverse(b[:, None] * A, C)
    return Tinv


# ---------------------------------------------------------------------------------------
# storage-dtype helpers of the two-kernel forward (intra kernel -> state kernel)
# ---------------------------------------------------------------------------------------


@triton.jit
def load_rows_native(base, t0, n_rows, stride_row, col0, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Like load_rows but keeps the storage dtype (a bf16 tile can feed ``tl.dot`` as it is).

    Rows ``>= n_rows`` and columns ``>= n_cols`` read as 0. Returns ``[BR, BC]``.
    """
    r = t0 + tl.arange(0, BR)  # [BR]
    c = col0 + tl.arange(0, BC)  # [BC]
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    ptrs = base + r.to(tl.int64)[:, None] * stride_row + c[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)  # [BR, BC]


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bfloat16 (ties to even), returned as fp32.

    The interpreter's fp32 -> bf16 cast truncates and its bf16 ``tl.dot`` is wrong, so the
    interpreted kernels round with this integer recipe instead: the result equals what the
    GPU's cast produces (finite inputs), and a later cast of it to bf16 is exact.
    """
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16_if(x, ROUND: tl.constexpr):
    """``round_to_bf16(x)`` when ROUND (interpreted kernels storing bf16), else ``x``: a value about
    to be stored to a bf16 buffer then matches the GPU's round-to-nearest cast."""
    if ROUND:
        x = round_to_bf16(x)
    return x


@triton.jit
def dot_operand(x, OP_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """A ``tl.dot`` operand: bf16 rounded to nearest when OP_BF16 (the interpreter keeps fp32 but
    rounds like the GPU), else fp32."""
    if OP_BF16:
        if EMULATE_BF16:
            y = round_to_bf16(x.to(tl.float32))
        else:
            y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y
