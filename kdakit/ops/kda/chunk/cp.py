"""Context-parallel ``chunk_kda``: each rank runs the local op on its slice of the packed tokens
and the ranks exchange only boundary states.

Why it is exact: per sequence and value head, one KDA step is
``S <- (I - beta k k^T) Diag(exp(a)) S + beta k v^T`` on the ``[K, V]`` state, and every value
column evolves on its own. So the state leaving an interval of a sequence is affine in the
state entering it, ``S_out = M S_in + B``, with ``M`` ``[K, K]`` (the product of the per-step
matrices) and ``B`` ``[K, V]`` (the final state from a zero initial state). ``M`` is the final
state of the same recurrence run on K virtual value columns with ``v = 0`` from ``S_in = I``.

Forward: every rank computes ``(B, M)`` for the last sequence of each of its intervals that
continues into the next interval (``M`` only where the sequence also entered from the previous
one), all-gathers them (one collective of ``[parts, HV, K, V + K]`` per rank), composes the
prefixes of the chain to get the true state entering its first sequence, then runs the local op
once with those initial states (the only run whose graph is kept).

Backward, the same chain reversed: the local backward with the incoming ``dht`` set to zero at
the outgoing boundary gives ``dS_in`` of each interval's first sequence from its own outputs
(``g``); one all-gather of ``g`` and ``dS_out = g_next + M_next^T dS_out_next`` (walking back
from the interval where the sequence ends) give each rank the gradient of the state it sent;
a second backward through the local graph with ``dht = dS_out`` at that row adds its
contribution (the backward is linear in ``(do, dht)``). Token gradients then equal the
one-process ones; gradients of replicated inputs (A_log, dt_bias, initial_state) are this
rank's contribution, and their sum over ranks (what DDP/FSDP do) is the one-process gradient.

Cost beyond the local op: forward runs the op on the outgoing sequence's piece once or twice more
(B, and M with K value columns) without a graph; backward walks the local graph twice on ranks
that send a state. Memory: boundary states only (``[C, HV, K, K]`` of M kept for backward).
No tokens cross ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from kdakit.ops.kda.reference.preprocess import compute_dtype
from kdakit.ops.kda.validate import STATE_DTYPES, validate_kda_inputs

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class ChainSlot:
    """One chain interval ``[start, end)`` of the global token order (kdakit metadata).

    ``seq_ids``: global ids of the positive-length sequences overlapping it, in order.
    ``pre`` / ``post``: earlier / later intervals the first / last of them spans (FLA's
    pre_num_ranks / post_num_ranks). ``empty_ids``: zero-length sequences whose offset falls
    here (they have an initial and a final state but no token; this interval's rank owns them).
    ``rank`` / ``part``: where the interval lives (part 0 = front, 1 = zigzag back).
    """
    index: int
    start: int
    end: int
    seq_ids: tuple[int, ...]
    pre: int
    post: int
    empty_ids: tuple[int, ...]
    rank: int
    part: int

    @property
    def passthrough(self) -> bool:
        """One sequence enters from the previous interval and leaves into the next: its outgoing
        state depends on the incoming one (through M)."""
        return self.pre > 0 and self.post > 0 and len(self.seq_ids) == 1


@dataclass
class CPContext:
    """Sequence partition and communication metadata for context parallelism (FLA 0.6.0's
    ``FLACPContext`` fields, plus kdakit's chain metadata). Build it with ``build_cp_context``."""
    group: object = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    is_last_rank: bool | None = None
    pre_num_ranks: int | None = None
    is_first_rank: bool | None = None
    post_num_ranks: int | None = None
    conv1d_kernel_size: int | None = None
    pre_num_conv_tokens: int | None = None
    # FLA's CUDA-graph device scalars; kdakit has no graph mode and keeps them None.
    pre_num_ranks_dev: torch.Tensor | None = None
    post_num_ranks_dev: torch.Tensor | None = None
    layout: str = "contiguous"
    part_len: int | None = None
    front_num_seqs: int | None = None
    pre_num_ranks_by_part: tuple[int, int] | None = None
    post_num_ranks_by_part: tuple[int, int] | None = None
    is_first_by_part: tuple[bool, bool] | None = None
    is_last_by_part: tuple[bool, bool] | None = None
    pre_num_conv_tokens_by_part: tuple[int, int] | None = None
    # kdakit: world size and rank in ``group``, the global offsets, every interval of the chain
    # and the indices (into ``chain``) of this rank's parts in local-buffer order.
    world_size: int | None = None
    rank: int | None = None
    global_cu_seqlens_cpu: torch.Tensor | None = None
    chain: tuple[ChainSlot, ...] = field(default_factory=tuple)
    local_slots: tuple[int, ...] = field(default_factory=tuple)

    def copy_for_backward(self) -> "CPContext":
        """A copy with cloned offsets (FLA's hook for pipeline parallelism)."""
        return replace(
            self,
            cu_seqlens=self.cu_seqlens.clone() if self.cu_seqlens is not None else None,
            cu_seqlens_cpu=self.cu_seqlens_cpu.clone() if self.cu_seqlens_cpu is not None else None,
        )

    @property
    def num_seqs(self) -> int:
        """Number of local sequences (pieces) on this rank."""
        return 0 if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def is_cp_enabled(self) -> bool:
        return self.group is not None

    @property
    def num_global_seqs(self) -> int:
        return len(self.global_cu_seqlens_cpu) - 1

    @property
    def has_boundaries(self) -> bool:
        """Whether any sequence crosses an interval boundary (else no rank exchanges anything)."""
        return any(s.post > 0 for s in self.chain)



@dataclass(frozen=True)
class _Piece:
    local: int        # index among this rank's local sequences
    seq: int          # global sequence id
    part: int         # 0 front, 1 zigzag back
    start: int        # first local token
    end: int          # one past the last local token
    starts_here: bool  # the sequence's first token is on this rank (it reads the user's initial state)
    ends_here: bool    # its last token is here (this rank returns its final state)


@dataclass(frozen=True)
class _Options:
    cp: CPContext
    op: dict               # keyword arguments of every local chunk_kda call
    state_v_first: bool
    output_final_state: bool
    track: bool            # build the local graph (some input needs a gradient)
    local_op: object       # the one-process chunk_kda (handed in by it: this module never imports it)


def _pieces(cp: CPContext) -> list[_Piece]:
    cu = cp.global_cu_seqlens_cpu.tolist()
    out = []
    for p, c in enumerate(cp.local_slots):
        s = cp.chain[c]
        for j in s.seq_ids:
            a, b = max(cu[j], s.start), min(cu[j + 1], s.end)
            base = p * cp.part_len - s.start
            out.append(_Piece(local=len(out), seq=j, part=p, start=a + base, end=b + base,
                              starts_here=cu[j] >= s.start, ends_here=cu[j + 1] <= s.end))
    return out


def _first_last(pieces: list[_Piece], part: int) -> tuple[_Piece, _Piece]:
    mine = [pc for pc in pieces if pc.part == part]
    return mine[0], mine[-1]


def _gather(t: torch.Tensor, cp: CPContext) -> list[torch.Tensor]:
    bufs = [torch.empty_like(t) for _ in range(cp.world_size)]
    dist.all_gather(bufs, t, group=cp.group)
    return bufs


class _ChunkKDACP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, opt: _Options, q, k, v, g, beta, A_log, dt_bias, h0):
        chunk_kda = opt.local_op
        cp = opt.cp
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        dt = compute_dtype(q, k, v, g, beta)
        needs = fctx.needs_input_grad[1:9]
        # detach() aliases the caller's storage (no copy); the local graph hangs off these leaves
        leaves = [None if t is None else t.detach().requires_grad_(opt.track and bool(n))
                  for t, n in zip((q, k, v, g, beta, A_log, dt_bias), needs)]
        lq, lk, lv, lg, lb, lA, ldb = leaves
        h0k = None if h0 is None else (h0.transpose(-1, -2) if opt.state_v_first else h0)
        pieces = _pieces(cp)
        slots = [cp.chain[c] for c in cp.local_slots]

        def user_row(j):
            return h0k[j].to(dt) if h0k is not None else torch.zeros(HV, K, V, dtype=dt, device=q.device)

        def run(sl, vv, init):
            _, fin = chunk_kda(lq[:, sl], lk[:, sl], vv, lg[:, sl], lb[:, sl], initial_state=init,
                               output_final_state=True, A_log=lA, dt_bias=ldb, **opt.op)
            return fin[0]

        # (B, M) of every outgoing sequence, packed for one all-gather
        send = torch.zeros(len(slots), HV, K, V + K, dtype=dt, device=q.device)
        with torch.no_grad():
            for p, s in enumerate(slots):
                if s.post == 0:
                    continue
                last = _first_last(pieces, p)[1]
                sl = slice(last.start, last.end)
                init = user_row(last.seq)[None] if last.starts_here and h0k is not None else None
                send[p, ..., :V] = run(sl, lv[:, sl], init)
                if s.passthrough:
                    eye = torch.eye(K, dtype=dt, device=q.device).repeat(1, HV, 1, 1)
                    zeros_v = torch.zeros(1, sl.stop - sl.start, HV, K, dtype=v.dtype, device=v.device)
                    send[p, ..., V:] = run(sl, zeros_v, eye)
        Ms = None
        if cp.has_boundaries:
            bufs = _gather(send, cp)
            per_slot = [bufs[s.rank][s.part] for s in cp.chain]
            Bs = [b[..., :V] for b in per_slot]
            Ms = torch.stack([b[..., V:] for b in per_slot])  # kept for backward: [C, HV, K, K]
            del bufs

        # true initial state of every local sequence
        rows, need_h0 = [], h0k is not None
        for pc in pieces:
            if pc.starts_here:
                rows.append(user_row(pc.seq))
                continue
            need_h0 = True
            s = slots[pc.part]
            b = s.index - s.pre  # the interval where this sequence starts
            S = Bs[b]
            for t in range(b + 1, s.index):
                S = torch.matmul(Ms[t], S) + Bs[t]
            rows.append(S)
        h0_local = torch.stack(rows).requires_grad_(opt.track) if need_h0 else None

        sends = any(s.post > 0 for s in slots)
        with torch.set_grad_enabled(opt.track):
            o, fin = chunk_kda(lq, lk, lv, lg, lb, initial_state=h0_local,
                               output_final_state=opt.output_final_state or sends,
                               cu_seqlens=cp.cu_seqlens, cu_seqlens_cpu=cp.cu_seqlens_cpu,
                               A_log=lA, dt_bias=ldb, **opt.op)

        final = None
        if opt.output_final_state:
            N = cp.num_global_seqs
            shape = (N, HV, V, K) if opt.state_v_first else (N, HV, K, V)
            final = torch.zeros(shape, dtype=dt, device=q.device)
            fk = final.transpose(-1, -2) if opt.state_v_first else final  # K-first view for writing
            with torch.no_grad():
                for pc in pieces:
                    if pc.ends_here:
                        fk[pc.seq] = fin[pc.local]
                for s in slots:
                    for j in s.empty_ids:  # no token: the final state is the initial one
                        fk[j] = user_row(j)
        fctx.opt, fctx.pieces, fctx.slots = opt, pieces, slots
        fctx.graph = (o, fin if (sends or opt.output_final_state) else None, leaves, h0_local, Ms)
        fctx.h0_meta = None if h0 is None else (h0.shape, h0.dtype)
        return o.detach(), final

    @staticmethod
    def backward(fctx, do, dfinal):
        opt, pieces, slots = fctx.opt, fctx.pieces, fctx.slots
        cp = opt.cp
        if fctx.graph is None:
            # the first backward consumed the local graph (and the peers' collectives ran once)
            raise RuntimeError("chunk_kda with cp_context supports one backward per forward, got a second "
                               "(retain_graph=True is not supported)")
        o, fin, leaves, h0_local, Ms = fctx.graph
        fctx.graph = None  # frees the local graph once this backward returns
        wrt = [t for t in leaves if t is not None and t.requires_grad]
        if h0_local is not None and h0_local.requires_grad:
            wrt.append(h0_local)
        dfk = None
        if dfinal is not None:
            dfk = dfinal.transpose(-1, -2) if opt.state_v_first else dfinal
        sends = any(s.post > 0 for s in slots)

        outs, couts = [o], [do]
        if fin is not None:
            # the user's final-state gradient where a sequence ends here; zero at outgoing rows,
            # whose gradient arrives from later ranks in the second pass
            dht = torch.zeros_like(fin)
            if dfk is not None:
                for pc in pieces:
                    if pc.ends_here:
                        dht[pc.local] = dfk[pc.seq].to(dht.dtype)
            outs.append(fin)
            couts.append(dht)
        grads = list(torch.autograd.grad(outs, wrt, couts, retain_graph=sends, allow_unused=True))
        dh0_local = grads[-1] if h0_local is not None and h0_local.requires_grad else None

        if cp.has_boundaries:
            HV, K, V = o.shape[2], leaves[0].shape[3], o.shape[3]
            send = torch.zeros(len(slots), HV, K, V, dtype=Ms.dtype, device=o.device)
            for p, s in enumerate(slots):
                if s.pre > 0:
                    send[p] = dh0_local[_first_last(pieces, p)[0].local]
            bufs = _gather(send, cp)
            gs = [bufs[s.rank][s.part] for s in cp.chain]
            if sends:
                dht2 = torch.zeros_like(fin)
                for p, s in enumerate(slots):
                    if s.post == 0:
                        continue
                    e = s.index + s.post  # the interval where the sequence ends
                    dS = gs[e]
                    for t in range(e - 1, s.index, -1):
                        dS = gs[t] + torch.matmul(Ms[t].transpose(-1, -2), dS)
                    dht2[_first_last(pieces, p)[1].local] = dS
                more = torch.autograd.grad([fin], wrt, [dht2], allow_unused=True)
                grads = [a if b is None else (b if a is None else a + b) for a, b in zip(grads, more)]
                dh0_local = grads[-1] if dh0_local is not None else None

        it = iter(grads)
        out = [next(it) if (t is not None and t.requires_grad) else None for t in leaves]
        dh0 = None
        if fctx.h0_meta is not None and fctx.needs_input_grad[8]:
            shape, dtype = fctx.h0_meta
            dh0 = torch.zeros(shape, dtype=dtype, device=o.device)
            dk = dh0.transpose(-1, -2) if opt.state_v_first else dh0
            for pc in pieces:
                if pc.starts_here:
                    dk[pc.seq] = dh0_local[pc.local]
            if dfk is not None:
                for s in slots:
                    for j in s.empty_ids:
                        dk[j] = dfk[j]
        return (None, *out, dh0)


def chunk_kda_cp(q, k, v, g, beta, *, local_op, cp_context, scale, initial_state, output_final_state, state_v_first,
                 cu_seqlens, cu_seqlens_cpu, state_indices, use_gate_in_kernel, A_log, dt_bias, **op):
    """``chunk_kda(..., cp_context=ctx)`` (dispatched from ``kdakit.chunk_kda``; see its docstring).

    ``local_op``: the one-process ``chunk_kda``, which each rank runs on its pieces; the public op passes
    itself, so this module sits below it and imports nothing of the chunk stack.

    q, k, v, g, beta hold this rank's local tokens ``[1, T_local, ...]`` in ctx's buffer order.
    kdakit extension over FLA 0.6.0 (which refuses both): ``initial_state`` is the global
    ``[N, HV, K, V]`` (N global sequences, the same tensor on every rank); the rank holding a
    sequence's first token reads its row. ``output_final_state`` returns a global ``[N, HV, K, V]``
    holding the final states of the sequences that end on this rank and zeros elsewhere (their
    sum over ranks is every final state).
    """
    cp = cp_context
    if not isinstance(cp, CPContext):
        raise TypeError(f"cp_context must be a kdakit CPContext (kdakit.build_cp_context), got {type(cp).__name__}")
    if state_indices is not None:
        raise ValueError("state_indices (a state pool) does not combine with cp_context: expected None, "
                         f"got a {type(state_indices).__name__}")
    # FLA overrides cu_seqlens with the context's; kdakit accepts only the context's own tensors
    for name, given, own in (("cu_seqlens", cu_seqlens, cp.cu_seqlens),
                             ("cu_seqlens_cpu", cu_seqlens_cpu, cp.cu_seqlens_cpu)):
        if given is not None and given is not own:
            raise ValueError(f"{name} comes from cp_context with context parallelism: expected None or "
                             f"cp_context.{name}, got another tensor")
    if cp.world_size is None or not cp.chain:
        raise ValueError("cp_context must come from kdakit.build_cp_context, got one without chain metadata")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("chunk_kda with cp_context needs an initialized torch.distributed process group, got none")
    if dist.get_world_size(group=cp.group) != cp.world_size or dist.get_rank(group=cp.group) != cp.rank:
        raise ValueError(f"cp_context was built for rank {cp.rank} of {cp.world_size}, got rank "
                         f"{dist.get_rank(group=cp.group)} of {dist.get_world_size(group=cp.group)} in its group")
    T_local = cp.part_len * len(cp.local_slots)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != T_local:
        raise ValueError(f"q must be this rank's [1, {T_local}, H, K] tokens (layout={cp.layout!r}, part_len="
                         f"{cp.part_len}), got shape {list(getattr(q, 'shape', []))}")
    # every local argument checked before any rank communicates (a refusal then raises on all ranks alike)
    shape = validate_kda_inputs(
        q, k, v, g, beta, scale=scale, initial_state=None, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=op["use_beta_sigmoid_in_kernel"], allow_neg_eigval=op["allow_neg_eigval"],
        safe_gate=op["safe_gate"], lower_bound=op["lower_bound"], A_log=A_log, dt_bias=dt_bias,
        state_v_first=state_v_first, cu_seqlens=cp.cu_seqlens, cu_seqlens_cpu=cp.cu_seqlens_cpu)
    if initial_state is not None:
        N, HV, K, V = cp.num_global_seqs, shape.HV, shape.K, shape.V
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype not in STATE_DTYPES:
            raise TypeError(f"initial_state must be a tensor with dtype in {STATE_DTYPES}, got "
                            f"{getattr(initial_state, 'dtype', type(initial_state).__name__)}")
        if tuple(initial_state.shape) != want or initial_state.device != q.device:
            raise ValueError(f"initial_state must be the global {list(want)} states of all {N} sequences on "
                             f"{q.device} with cp_context, got {list(initial_state.shape)} on {initial_state.device}")
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    track = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    op = dict(op, scale=scale, use_gate_in_kernel=use_gate_in_kernel, state_v_first=False)
    opt = _Options(cp=cp, op=op, state_v_first=state_v_first, output_final_state=output_final_state, track=track,
                   local_op=local_op)
    o, final = _ChunkKDACP.apply(opt, *inputs)
    return o, (final if output_final_state else None)
