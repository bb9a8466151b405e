"""End-to-end serving over one state pool (issue #13 item 10): a scheduler loop that admits
requests into free rows, prefills them in chunks, decodes every active request at once, runs
speculative steps with partial acceptance, resumes requests from a cached prefix state and frees
finished requests' rows for reuse, all through one value-first pool ``[P, HV, V, K]``.

The ops share the pool: prefill through ``chunk_kda(..., state_indices=)`` (PyTorch path only:
its Triton kernels are tested elsewhere), ``kda_decode`` with packed tokens (one row per
sequence) or ``fused_recurrent_kda`` (``ssm_state_indices`` ``[N, L]`` naming the sequence's
row in every column, ``inplace_final_state=True``); decode through ``kda_decode`` ``[N]`` (the
batch padded with ``-1`` slots as a CUDA-graph batch is) or ``fused_recurrent_kda`` ``[N]``;
speculative steps through ``kda_decode`` or ``fused_recurrent_kda`` with ``[N, S]`` indices and
``num_accepted_tokens`` (FLA's scheme: the state after token j goes to row ``idx[n, j]``, the
next step reads column ``num_accepted_tokens[n] - 1``).

Checked after every call: each sequence's outputs and every row it wrote against the float64
definition (``naive_recurrent_kda``) run from the row's state before the call; every other bit
of the pool's storage (other requests' rows, rows a step did not write, the prefix-cache rows,
free rows poisoned with NaN, the padding between rows of a strided pool) unchanged; ``out=``
buffers poisoned with NaN fully written; padded slots' outputs zero. Checked when a request
finishes: all its accepted outputs and its final state against ``naive_recurrent_kda`` run once
over the whole accepted sequence (cached prefix included) from a zero state.

The CPU tier runs the recurrent/decode ops on the PyTorch path and on the Triton kernels under
the interpreter; tests/gpu/ops/kda/test_serving_e2e_gpu.py runs the same loop at real shapes.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from dataclasses import dataclass, field

import pytest
import torch

from kdakit import chunk_kda, fused_recurrent_kda, kda_decode, naive_recurrent_kda
from kdakit.testing import assert_close

KW = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True)

# rms(err) / rms(ref) against the float64 definition.
# fp32 pool: one call from the row's state and a whole request (both observed <= 2.5e-7 on CPU).
FP32_STEP, FP32_SEQ = 5e-5, 2e-4
# bf16 pool and bf16 tokens: bf16 outputs (2^-9 relative) and the state rounded to bf16 once per
# token or per call (observed <= 5e-3 per call and <= 4e-3 over a request on CPU). A wrong state
# (wrong row, wrong column, a lost prefix) is off by O(0.1) (see the negative controls below).
BF16_STEP, BF16_SEQ = 2e-2, 3e-2


@dataclass
class Cfg:
    H: int = 2
    HV: int = 2
    K: int = 16
    V: int = 16
    S: int = 3                      # speculative columns per request (rows per request)
    P: int = 14                     # pool rows
    pool_dtype: torch.dtype = torch.float32
    tok_dtype: torch.dtype = torch.float32
    strided_pool: bool = False      # the pool is a slice of a wider cache (padded row stride)
    n_requests: int = 7
    prompt: tuple = (3, 20)         # prompt length range
    gen: tuple = (3, 9)             # accepted tokens to generate
    chunk: tuple = (1, 9)           # prefill chunk length range
    first_arrivals: int = 2         # requests arriving at step 0
    arrival_p: float = 0.5          # probability that a burst arrives at a later step
    burst: int = 1                  # requests in a burst
    max_steps: int = 200
    device: str = "cpu"
    seed: int = 0
    chunk_on_torch: bool = True     # run chunk_kda on the PyTorch path whatever KDAKIT_BACKEND says
    prefill_ops: tuple = ("chunk", "decode", "fused")
    decode_ops: tuple = ("decode", "fused")
    pad_slots: int = 2              # -1 slots padding kda_decode's decode batch


@dataclass
class Req:
    rid: int
    prompt: dict                    # token tensors [L, ...] still to prefill
    gen_target: int
    rows: list = field(default_factory=list)
    col: int = 0                    # column of rows holding the current state
    stream: list = field(default_factory=list)   # accepted token dicts (one token each), prefix included
    n_prefix: int = 0               # tokens from a cached prefix (no outputs recorded)
    outs: list = field(default_factory=list)     # kernel outputs of accepted tokens [HV, V]
    generated: int = 0
    cache_hit: bool = False

    @property
    def row(self) -> int:
        return self.rows[self.col]

    @property
    def prefilling(self) -> bool:
        return self.prompt["q"].shape[0] > 0


NAMES = ("q", "k", "v", "g", "beta")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@contextlib.contextmanager
def _torch_backend(enabled: bool):
    """chunk_kda on the PyTorch path (its Triton kernels are not part of this test)."""
    if not enabled:
        yield
        return
    old = os.environ.get("KDAKIT_BACKEND")
    os.environ["KDAKIT_BACKEND"] = "torch"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KDAKIT_BACKEND"]
        else:
            os.environ["KDAKIT_BACKEND"] = old


class Engine:
    """The scheduler, the pool and the float64 bookkeeping the checks use."""

    def __init__(self, cfg: Cfg):
        self.c = c = cfg
        self.dev = torch.device(c.device)
        self.rng = random.Random(c.seed)
        self.gen = torch.Generator().manual_seed(c.seed)
        self.A_log = (0.5 * torch.randn(c.HV, generator=self.gen, dtype=torch.float64)).float().to(self.dev)
        self.dt_bias = (0.5 * torch.randn(c.HV * c.K, generator=self.gen, dtype=torch.float64)).float().to(self.dev)
        heads = c.HV + 1 if c.strided_pool else c.HV
        # the whole storage, poisoned: every bit the ops may not write stays NaN (or holds what was written)
        self.storage = torch.full((c.P, heads, c.V, c.K), float("nan"), dtype=c.pool_dtype, device=self.dev)
        self.pool = self.storage[:, :c.HV]
        self.poison = _bits(self.storage[0, 0, 0, :1].clone())
        self.free = list(range(c.P - 1, -1, -1))  # a stack: freed rows are reused first
        self.cache = None                          # (pool row, the prefix's accepted tokens)
        self.queue, self.active, self.done = [], [], []
        self.next_rid = 0
        self.step = 0
        self.max_active = 0
        self.calls = {}
        self.tol_step, self.tol_seq = ((FP32_STEP, FP32_SEQ) if c.pool_dtype == torch.float32 and
                                       c.tok_dtype == torch.float32 else (BF16_STEP, BF16_SEQ))

    # --- tokens and references -----------------------------------------------------------------

    def tokens(self, L: int) -> dict:
        c, r = self.c, lambda *s: torch.randn(*s, generator=self.gen, dtype=torch.float64)  # noqa: E731
        t = dict(q=r(L, c.H, c.K), k=r(L, c.H, c.K), v=r(L, c.HV, c.V), g=r(L, c.HV, c.K), beta=r(L, c.HV))
        return {n: x.to(c.tok_dtype).to(self.dev) for n, x in t.items()}

    @staticmethod
    def split(t: dict, a: int, b: int) -> dict:
        return {n: x[a:b] for n, x in t.items()}

    def naive(self, t: dict, h0):
        """float64 definition on one sequence t [L, ...] from h0 [HV, V, K] (None: zeros)."""
        d = {n: x.double()[None] for n, x in t.items()}
        o, s = naive_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], A_log=self.A_log.double(),
                                   dt_bias=self.dt_bias.double(), state_v_first=True, output_final_state=True,
                                   initial_state=None if h0 is None else h0.double()[None], **KW)
        return o[0], s[0]

    def naive_per_token(self, t: dict, h0):
        """Outputs [L, HV, V] and the state after each token [L, HV, V, K]."""
        outs, states, S = [], [], h0
        for j in range(t["q"].shape[0]):
            o, S = self.naive(self.split(t, j, j + 1), S)
            outs.append(o[0])
            states.append(S)
        return torch.stack(outs), torch.stack(states)

    # --- one checked call ------------------------------------------------------------------------

    def pack(self, toks: list):
        """Sequences [L_n, ...] packed to [1, total, ...] with cu_seqlens, or [N, L, ...] when equal."""
        lens = [t["q"].shape[0] for t in toks]
        if len(set(lens)) == 1 and self.rng.random() < 0.5:
            return {n: torch.stack([t[n] for t in toks]) for n in NAMES}, None, lens
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=self.dev)
        return {n: torch.cat([t[n] for t in toks])[None] for n in NAMES}, cu, lens

    def checked_call(self, kind, op, seqs, toks, fn, writes, *, per_token=True, out=True):
        """Run ``fn(packed, cu, out)`` and check outputs and the whole storage.

        seqs: the requests (None for a padded slot) in batch order, toks: their tokens;
        writes(n, L_n) -> the (token j, column c) pairs of sequence n's writes: the state after its
        token j goes to row rows[c] (a prefill writes only the final state, to the current row).
        per_token: compute the reference state after every token (else only after the last).
        Returns each sequence's outputs [L_n, HV, V] and its float64 (outputs, states)."""
        packed, cu, lens = self.pack(toks)
        o_buf = None
        if out:
            o_buf = torch.full_like(packed["v"], float("nan"))
        before = self.storage.clone()
        refs = []
        for req, t in zip(seqs, toks):
            if req is None:
                refs.append(None)
                continue
            h0 = self.pool[req.row]
            assert bool(torch.isfinite(h0).all()), f"request {req.rid}: row {req.row} is not a state"
            if per_token:
                refs.append(self.naive_per_token(t, h0))
            else:  # only the final state is written: one call over the chunk
                ro, rs = self.naive(t, h0)
                refs.append((ro, rs.expand(t["q"].shape[0], *rs.shape)))
        self.calls[(kind, op)] = self.calls.get((kind, op), 0) + 1
        o = fn(packed, cu, o_buf)
        if out:
            assert o is o_buf
        where = f"step {self.step} {kind} via {op}"
        o_seqs = list(torch.split(o.reshape(-1, self.c.HV, self.c.V), lens)) if cu is not None else list(o)
        expected = _bits(before).clone()
        for n, (req, ref) in enumerate(zip(seqs, refs)):
            if req is None:
                assert torch.equal(o_seqs[n], torch.zeros_like(o_seqs[n])), f"{where}: padded slot {n} output"
                continue
            ro, rs = ref
            assert_close(f"{where}: request {req.rid} outputs", ro, o_seqs[n], self.tol_step)
            for j, col in writes(n, lens[n]):
                r = req.rows[col]
                assert_close(f"{where}: request {req.rid} row {r} (state after token {j})", rs[j], self.pool[r],
                             self.tol_step)
                expected[r, :self.c.HV] = _bits(self.pool[r])
        bad = (_bits(self.storage) != expected).reshape(self.c.P, -1).any(1).nonzero().flatten().tolist()
        assert not bad, f"{where}: pool rows {bad} changed though the call may not write them"
        if self.free:
            lost = (_bits(self.storage[self.free]) != self.poison).reshape(len(self.free), -1).any(1)
            assert not lost.any(), f"{where}: free rows {[self.free[i] for i in lost.nonzero().flatten()]} lost " \
                                   f"their poison"
        if self.cache is not None:
            assert torch.isfinite(self.pool[self.cache[0]]).all()
        return o_seqs, refs

    def calls_of(self, kind):
        return sum(n for (k, _), n in self.calls.items() if k == kind)

    def pick(self, kind, ops):
        """The ops take turns, so that a short loop runs each of them."""
        return ops[self.calls_of(kind) % len(ops)]

    # --- the scheduler -------------------------------------------------------------------------

    def arrive(self):
        c = self.c
        rid = self.next_rid
        self.next_rid += 1
        hit = self.cache is not None and rid % 3 == 0
        lo, hi = (1, 6) if hit else c.prompt
        req = Req(rid, self.tokens(self.rng.randint(lo, hi)), self.rng.randint(*c.gen), cache_hit=hit)
        self.queue.append(req)

    def admit(self):
        c = self.c
        while self.queue and len(self.free) >= c.S:
            req = self.queue.pop(0)
            req.rows = [self.free.pop() for _ in range(c.S)]
            req.col = self.rng.randrange(c.S)  # any column may hold the state; the others stay poisoned
            with torch.no_grad():
                if req.cache_hit:
                    # resume from a cached prefix: copy the saved state into the fresh row
                    row, prefix = self.cache
                    self.pool[req.row] = self.pool[row]
                    req.stream = list(prefix)
                    req.n_prefix = len(prefix)
                else:
                    self.pool[req.row] = 0
            self.active.append(req)
        self.max_active = max(self.max_active, len(self.active))

    def finish(self, req):
        """The whole request against the definition, then its rows are freed (poisoned)."""
        stream = {n: torch.stack([t[n] for t in req.stream]) for n in NAMES}
        ro, rs = self.naive(stream, None)
        got = torch.stack(req.outs)
        assert got.shape[0] == len(req.stream) - req.n_prefix
        assert_close(f"request {req.rid}: all accepted outputs", ro[req.n_prefix:], got, self.tol_seq)
        assert_close(f"request {req.rid}: final state", rs, self.pool[req.row], self.tol_seq)
        with torch.no_grad():
            for r in req.rows:
                self.storage[r].fill_(float("nan"))
                self.free.append(r)
        self.active.remove(req)
        self.done.append(req)

    def accept(self, req, t, o):
        for j in range(t["q"].shape[0]):
            req.stream.append({n: x[j] for n, x in t.items()})
            req.outs.append(o[j])

    def prefill(self):
        reqs = [r for r in self.active if r.prefilling]
        if not reqs:
            return
        c = self.c
        op = self.pick("prefill", c.prefill_ops)
        toks = []
        for req in reqs:
            L = min(self.rng.randint(*c.chunk), req.prompt["q"].shape[0])
            toks.append(self.split(req.prompt, 0, L))
        seqs = list(reqs)
        if op in ("chunk", "decode") and self.rng.random() < 0.5:
            # a padded sequence (-1): zero output, nothing written
            pos = self.rng.randrange(len(seqs) + 1)
            seqs.insert(pos, None)
            toks.insert(pos, self.tokens(self.rng.randint(1, 4)))
        pool, dev = self.pool, self.dev
        rows = torch.tensor([-1 if r is None else r.row for r in seqs], dtype=torch.int32, device=dev)

        def run(p, cu, out):
            args = (p["q"], p["k"], p["v"], p["g"], p["beta"])
            if op == "chunk":
                with _torch_backend(c.chunk_on_torch):
                    o, _ = chunk_kda(*args, initial_state=pool, state_indices=rows, state_v_first=True,
                                     cu_seqlens=cu, A_log=self.A_log, dt_bias=self.dt_bias, **KW)
                if out is not None:
                    out.copy_(o)
                    o = out
                return o
            if op == "decode":
                return kda_decode(*args, pool, rows, A_log=self.A_log, dt_bias=self.dt_bias, cu_seqlens=cu,
                                  out=out, **KW)
            # fused_recurrent_kda: every column names the sequence's row, so the state after each token
            # is written there and the last write is the final state
            Lmax = max(t["q"].shape[0] for t in toks)
            idx = rows[:, None].expand(-1, Lmax).contiguous()
            o, final = fused_recurrent_kda(*args, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=pool,
                                           state_v_first=True, cu_seqlens=cu, ssm_state_indices=idx,
                                           inplace_final_state=True, out=out, **KW)
            assert final is pool
            return o

        def writes(n, L):
            return [(L - 1, seqs[n].col)]

        o_seqs, _ = self.checked_call("prefill", op, seqs, toks, run, writes, per_token=False,
                                      out=self.rng.random() < 0.5)
        for req, t, o in zip(seqs, toks, o_seqs):
            if req is None:
                continue
            L = t["q"].shape[0]
            req.prompt = self.split(req.prompt, L, req.prompt["q"].shape[0])
            self.accept(req, t, o)
            if not req.prefilling and self.cache is None and not req.cache_hit and self.free:
                # cache the prompt's state (prefix caching): a row of its own, read by later requests only
                r = self.free.pop()
                with torch.no_grad():
                    self.pool[r] = self.pool[req.row]
                self.cache = (r, list(req.stream))

    def decode(self):
        reqs = [r for r in self.active if not r.prefilling and r.generated < r.gen_target]
        if not reqs:
            return
        c = self.c
        spec = (self.calls_of("decode") + self.calls_of("spec")) % 5 in (1, 2, 4)  # 3 speculative steps in 5
        op = self.pick("spec" if spec else "decode", c.decode_ops)
        pool, dev = self.pool, self.dev
        seqs = list(reqs)
        if spec:
            toks = [self.tokens(self.rng.choice([c.S, c.S, self.rng.randint(1, c.S)])) for _ in seqs]
            idx = torch.tensor([r.rows for r in seqs], dtype=torch.int32, device=dev)
            acc = torch.tensor([r.col + 1 for r in seqs], dtype=torch.int32, device=dev)
        else:
            toks = [self.tokens(1) for _ in seqs]
            if op == "decode":
                for _ in range(self.rng.randint(0, c.pad_slots)):
                    pos = self.rng.randrange(len(seqs) + 1)
                    seqs.insert(pos, None)
                    toks.insert(pos, self.tokens(1))
            idx = torch.tensor([-1 if r is None else r.row for r in seqs], dtype=torch.int32, device=dev)
            acc = None

        def run(p, cu, out):
            args = (p["q"], p["k"], p["v"], p["g"], p["beta"])
            if op == "decode":
                return kda_decode(*args, pool, idx, A_log=self.A_log, dt_bias=self.dt_bias, cu_seqlens=cu,
                                  num_accepted_tokens=acc, out=out, **KW)
            o, final = fused_recurrent_kda(*args, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=pool,
                                           state_v_first=True, cu_seqlens=cu, ssm_state_indices=idx,
                                           num_accepted_tokens=acc, inplace_final_state=True, out=out, **KW)
            assert final is pool
            return o

        def writes(n, L):
            return [(j, j) for j in range(L)] if spec else [(0, seqs[n].col)]

        o_seqs, _ = self.checked_call("spec" if spec else "decode", op, seqs, toks, run, writes,
                                      out=self.rng.random() < 0.5)
        for req, t, o in zip(seqs, toks, o_seqs):
            if req is None:
                continue
            L = t["q"].shape[0]
            a = self.rng.randint(1, L) if spec else 1  # accepted tokens: the verifier keeps a prefix
            if spec:
                req.col = a - 1  # the next step reads column num_accepted_tokens - 1
            self.accept(req, self.split(t, 0, a), o[:a])
            req.generated += a

    def run(self):
        c = self.c
        while len(self.done) < c.n_requests:
            assert self.step < c.max_steps, "the scheduler did not drain its requests"
            if self.step == 0 or self.rng.random() < c.arrival_p:
                for _ in range(c.first_arrivals if self.step == 0 else c.burst):
                    if self.next_rid < c.n_requests:
                        self.arrive()
            self.admit()
            self.prefill()
            self.decode()
            for req in [r for r in self.active if not r.prefilling and r.generated >= r.gen_target]:
                self.finish(req)
            self.step += 1
        return self


def check_coverage(eng: Engine):
    c = eng.c
    assert any(r.cache_hit for r in eng.done), "no request resumed from the prefix cache"
    first = {r.rid: r.rows for r in eng.done}
    reused = [(a, b) for a in first for b in first if a < b and set(first[a]) & set(first[b])]
    assert reused, "no row was reused by a later request"
    kinds = {k for k, _ in eng.calls}
    assert kinds == {"prefill", "decode", "spec"}, eng.calls
    for kind, ops in (("prefill", c.prefill_ops), ("decode", c.decode_ops), ("spec", c.decode_ops)):
        for op in ops:
            assert (kind, op) in eng.calls, f"{kind} via {op} never ran: {eng.calls}"
    assert any(len(r.stream) - r.n_prefix > r.generated for r in eng.done)


# --- CPU tier ---------------------------------------------------------------------------------

@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


CONFIGS = {
    "fp32-K16": Cfg(H=2, HV=2, K=16, V=16, S=3, P=14, seed=1),
    "bf16-K32-gva2-strided": Cfg(H=1, HV=2, K=32, V=32, S=4, P=17, pool_dtype=torch.bfloat16,
                                 tok_dtype=torch.bfloat16, strided_pool=True, seed=2),
    "fp32-K32-gva2-strided": Cfg(H=2, HV=4, K=32, V=32, S=4, P=16, strided_pool=True, n_requests=6, prompt=(3, 12),
                                 seed=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_serving_loop(backend, name):
    eng = Engine(CONFIGS[name]).run()
    check_coverage(eng)


# --- the checks can fail (PyTorch path, one small loop each) ----------------------------------

class _ContinuesFromColumnZero(Engine):
    """Ignores num_accepted_tokens' semantics: after a speculative step it keeps column 0."""

    def decode(self):
        super().decode()
        for req in self.active:
            req.col = 0


class _ForgetsThePrefix(Engine):
    """Starts a cache hit from a zero state instead of the cached one."""

    def admit(self):
        waiting = list(self.queue)
        super().admit()
        for req in waiting:
            if req.cache_hit and req in self.active:
                with torch.no_grad():
                    self.pool[req.row] = 0


@pytest.mark.parametrize("engine", [_ContinuesFromColumnZero, _ForgetsThePrefix])
def test_a_wrong_scheduler_is_caught(monkeypatch, engine):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    with pytest.raises(AssertionError, match="all accepted outputs|is not a state"):
        engine(CONFIGS["fp32-K16"]).run()


def test_a_write_outside_the_call_rows_is_caught(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    mod = sys.modules[__name__]
    real = kda_decode

    def leaky(*args, **kw):
        o = real(*args, **kw)
        args[5][-1, 0, 0, 0] = 1.0  # one element of the last pool row
        return o

    monkeypatch.setattr(mod, "kda_decode", leaky)
    with pytest.raises(AssertionError, match="changed though the call may not write them"):
        Engine(CONFIGS["fp32-K16"]).run()
