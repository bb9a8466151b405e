"""chunk_kda reads no device tensor back to the host when the caller gives cu_seqlens_cpu, and a
fixed-length call (cu_seqlens=None) never does (docs/spec.md §2.5; FLA 0.6.0's cu_seqlens_cpu contract).

Two probes stand in for a device on this CPU tier:

- ``NoReadTensor``: a tensor subclass that lets through only metadata (shape, dtype, device,
  strides) and what a kernel launch takes (its pointer and storage, an allocation like it);
  any other use (``tolist``, ``item``, ``bool``, ``int``, indexing, arithmetic, ``.to``) raises.
  It stands for ``cu_seqlens`` in full calls on both backends.
- the ``meta`` device: tensors without data, so any read of a value raises. Validation, shared
  by both backends, runs on all-meta inputs.

Each probe is first shown to catch the read that a call without ``cu_seqlens_cpu`` does, so a
read that creeps back into the ``cu_seqlens_cpu`` path fails these tests.
"""

import pytest
import torch
from torch.overrides import resolve_name

from kdakit import chunk_kda, fused_recurrent_kda, kda_decode
from kdakit.ops.kda.backend import triton_interpreting
from kdakit.ops.kda.validate import validate_kda_inputs
from kdakit.testing import make_kda_inputs, run_kda

# torch.Tensor attributes and methods that read no values: metadata, and what a Triton launch (or
# the interpreter standing in for the device) takes from an argument.
_NO_READ = {
    "dtype", "device", "shape", "ndim", "layout", "is_cuda", "is_meta", "requires_grad", "grad_fn",
    "dim", "numel", "size", "stride", "storage_offset", "is_contiguous", "element_size", "__len__",
    "data_ptr", "untyped_storage", "new_empty",
}


class HostReadError(AssertionError):
    pass


class NoReadTensor(torch.Tensor):
    """A tensor whose values must not be read on the host (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = resolve_name(func) or repr(func)
        attr = name.removeprefix("torch.Tensor.").removesuffix(".__get__").removesuffix(".__set__")
        if attr not in _NO_READ:
            raise HostReadError(f"cu_seqlens was used beyond its metadata: {name}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _guarded(cu: torch.Tensor) -> NoReadTensor:
    return cu.clone().as_subclass(NoReadTensor)


def _plain(res: dict) -> dict:
    return {n: (None if x is None else x.as_subclass(torch.Tensor)) for n, x in res.items()}


def _assert_same(ref: dict, got: dict) -> None:
    assert set(ref) == set(got)
    for n in ref:
        if ref[n] is None:
            assert got[n] is None, n
        else:
            assert torch.equal(ref[n], got[n]), f"{n} differs with cu_seqlens_cpu"


def _inputs(dtype=torch.float64, seqlens=(17, 0, 1, 22), initial_state="kv", **kw):
    return make_kda_inputs(T=sum(seqlens), H=1, HV=2, K=16, V=16, dtype=dtype, gate="safe",
                           seqlens=list(seqlens), initial_state=initial_state,
                           generator=torch.Generator().manual_seed(7), **kw)


def test_probe_catches_the_read_of_a_call_without_cu_seqlens_cpu(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    inp = _inputs()
    inp["kwargs"]["cu_seqlens"] = _guarded(inp["kwargs"]["cu_seqlens"])
    with pytest.raises(HostReadError, match="tolist"):
        run_kda(chunk_kda, inp)


@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
def test_torch_path_with_cu_seqlens_cpu_reads_nothing_and_matches(monkeypatch, offsets_dtype):
    """Forward and backward (state checkpoints every 16 tokens, an empty sequence) are bit-identical
    to the call without cu_seqlens_cpu, and cu_seqlens is never read."""
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    inp = _inputs()
    cu = inp["kwargs"]["cu_seqlens"].to(offsets_dtype)
    inp["kwargs"]["cu_seqlens"] = cu
    ref = run_kda(chunk_kda, inp, seed=3, checkpoint_every_n_tokens=16)
    host = cu.clone()
    inp["kwargs"]["cu_seqlens"] = _guarded(cu)
    got = run_kda(chunk_kda, inp, seed=3, checkpoint_every_n_tokens=16, cu_seqlens_cpu=host)
    _assert_same(ref, _plain(got))


@pytest.mark.skipif(not triton_interpreting() and not torch.cuda.is_available(),
                    reason="needs TRITON_INTERPRET=1 (CPU tier) or a CUDA device")
def test_triton_path_with_cu_seqlens_cpu_reads_nothing_and_matches(monkeypatch):
    """The Triton kernels take cu_seqlens's pointer and nothing else on the host; the result is
    the one without cu_seqlens_cpu."""
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    inp = _inputs(dtype=torch.float32, seqlens=(17, 0, 23))
    cu = inp["kwargs"]["cu_seqlens"]
    ref = run_kda(chunk_kda, inp, seed=5)
    inp["kwargs"]["cu_seqlens"] = _guarded(cu)
    got = run_kda(chunk_kda, inp, seed=5, cu_seqlens_cpu=cu.clone())
    _assert_same(ref, _plain(got))


def _validate(t, kw, **extra):
    return validate_kda_inputs(
        t["q"], t["k"], t["v"], t["g"], t["beta"], scale=None, initial_state=t.get("initial_state"),
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True,
        lower_bound=kw["lower_bound"], A_log=t["A_log"], dt_bias=t["dt_bias"], state_v_first=False,
        cu_seqlens=kw.get("cu_seqlens"), **extra)


def test_validation_reads_no_device_value_with_cu_seqlens_cpu():
    """All inputs on the meta device (no data: any value read raises); the lengths come from the host copy."""
    inp = _inputs(device="meta")
    t, kw = {n: x.detach() for n, x in inp["tensors"].items()}, inp["kwargs"]
    assert kw["cu_seqlens"].device.type == "meta"
    with pytest.raises(Exception, match="meta"):  # the probe works: without the host copy it reads
        _validate(t, kw)
    shape = _validate(t, kw, cu_seqlens_cpu=torch.tensor([0, 17, 17, 18, 40]))
    assert shape.N == 4 and shape.seqlens == (17, 0, 1, 22) and shape.T == 40


def test_fixed_length_validation_reads_nothing():
    inp = make_kda_inputs(B=3, T=12, H=2, HV=4, K=8, V=8, gate="safe", initial_state="kv", device="meta")
    t, kw = {n: x.detach() for n, x in inp["tensors"].items()}, inp["kwargs"]
    shape = _validate(t, kw)
    assert shape.N == 3 and shape.seqlens is None


def test_fixed_length_call_reads_nothing(monkeypatch):
    """A fixed-length chunk_kda makes no host read of any input: every tensor method that would
    bring a value to the host raises while it runs (the torch path, CPU tensors)."""
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    inp = make_kda_inputs(B=2, T=20, H=1, HV=2, K=8, V=8, gate="safe", initial_state="vk",
                          generator=torch.Generator().manual_seed(2))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    ref = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                    initial_state=t["initial_state"], **inp["kwargs"])
    inputs = {id(x) for x in t.values()}

    def forbid(name):
        real = getattr(torch.Tensor, name)

        def guard(self, *a, **k):
            if id(self) in inputs:
                raise HostReadError(f"an input was read on the host: Tensor.{name}")
            return real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, guard)

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        forbid(name)
    with pytest.raises(HostReadError):  # the guard works
        t["q"].tolist()
    got = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                    initial_state=t["initial_state"], **inp["kwargs"])
    monkeypatch.undo()
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


@pytest.mark.parametrize("packed", [True, False])
def test_state_pool_with_cu_seqlens_cpu_and_padding(monkeypatch, packed):
    """The state-pool path (padded rows, in-place update) reads state_indices once to check it and
    never reads cu_seqlens when cu_seqlens_cpu is given; results equal the call without it and
    the explicit gather/scatter."""
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    if packed:
        inp = _inputs(seqlens=(9, 5, 14), initial_state="vk")
    else:
        inp = make_kda_inputs(B=3, T=8, H=1, HV=2, K=16, V=16, gate="safe", initial_state="vk",
                              generator=torch.Generator().manual_seed(4))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw.pop("output_final_state")
    pool0 = torch.randn(5, 2, 16, 16, dtype=torch.float64)
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)

    def call(**extra):
        pool = pool0.clone()
        o, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                         initial_state=pool, state_indices=idx, **dict(kw, **extra))
        return o.as_subclass(torch.Tensor), pool

    o_ref, pool_ref = call()
    if packed:
        cu = kw["cu_seqlens"]
        o_got, pool_got = call(cu_seqlens=_guarded(cu), cu_seqlens_cpu=cu.clone())
        assert torch.equal(o_ref, o_got) and torch.equal(pool_ref, pool_got)
    # Against the explicit definition: sequences 0 and 2 from pool rows 3 and 0, sequence 1 padded.
    h0 = pool0[[3, 0, 0]].clone()
    h0[1] = 0
    o_dir, ht = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                          initial_state=h0, output_final_state=True, **kw)
    o_dir = o_dir.clone()
    if packed:
        o_dir[:, 9:14] = 0
    else:
        o_dir[1] = 0
    assert torch.equal(o_ref, o_dir)
    want = pool0.clone()
    want[3], want[0] = ht[0], ht[2]
    assert torch.equal(pool_ref, want)


def test_state_pool_all_padded(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "torch")
    inp = make_kda_inputs(B=2, T=6, H=1, HV=2, K=8, V=8, gate="safe", initial_state="vk",
                          generator=torch.Generator().manual_seed(5))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = dict(inp["kwargs"])
    kw.pop("output_final_state")
    pool = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    before = pool.clone()
    o, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                     initial_state=pool, state_indices=torch.tensor([-1, -1], dtype=torch.int32), **kw)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(pool, before)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [True, False])
def test_gpu_call_does_not_synchronize(packed):
    """On CUDA, with cu_seqlens_cpu (or fixed-length inputs) a warm forward+backward runs with
    torch.cuda.set_sync_debug_mode('error'), which raises on every host synchronization PyTorch
    does (device->host reads, blocking host->device copies)."""
    if packed:
        inp = make_kda_inputs(T=256, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16, gate="safe",
                              seqlens=[100, 0, 156], initial_state="kv", device="cuda")
    else:
        inp = make_kda_inputs(B=2, T=128, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16, gate="safe",
                              initial_state="kv", device="cuda")
    t, kw = inp["tensors"], dict(inp["kwargs"])
    if packed:
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    named = {n: t[n] for n in ("initial_state", "A_log", "dt_bias")}

    def step(do, dht):
        o, ht = chunk_kda(*args, **named, **kw)
        torch.autograd.backward((o, ht), (do, dht))

    do = torch.randn_like(t["v"])
    dht = torch.randn_like(t["initial_state"], dtype=torch.float32)
    step(do, dht)  # warm-up: compilation and autotuning synchronize
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(do, dht)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# --- state pools, kda_decode and fused_recurrent_kda (issue #13 item 5) -------------------------

_SCALAR_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu",
                 "__array__"}


class DeviceValues(torch.Tensor):
    """Values that live on the device: every tensor computed from one is one too (torch's subclass
    propagation), and bringing any of their values to the host raises: a scalar read (``item``,
    ``tolist``, ``bool``, ``int``...), ``numpy`` or a ``.cpu()`` / ``.to("cpu")`` transfer, which is
    every way the ops read a value back. Device-side work on them (indexing, where, a kernel
    launch) is allowed. Stands for state pools and index tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = resolve_name(func) or repr(func)
        attr = name.removeprefix("torch.Tensor.")
        to_host = attr == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        if attr in _SCALAR_READS or to_host:
            raise HostReadError(f"a device value was brought to the host: {name}")
        return super().__torch_function__(func, types, args, kwargs)


def _dev(x: torch.Tensor) -> DeviceValues:
    return x.clone().as_subclass(DeviceValues)


def _host(x):
    return None if x is None else x.as_subclass(torch.Tensor)


def test_device_values_probe_catches_reads_and_lets_device_work_through():
    idx = _dev(torch.tensor([2, -1, 0], dtype=torch.int32))
    rows = torch.arange(12.0).view(3, 4)[idx.long().clamp(min=0)]  # device work: allowed, and tainted
    assert isinstance(rows, DeviceValues)
    for read in (lambda: idx.tolist(), lambda: int(idx[0]), lambda: bool((idx >= 0).all()), lambda: rows.sum().item(),
                 lambda: idx.cpu(), lambda: idx.to("cpu")):
        with pytest.raises(HostReadError):
            read()


def _pool_prefill(seqlens, check_indices, guard, dtype=torch.float64):
    inp = _inputs(dtype=dtype, seqlens=seqlens, initial_state="vk")
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = {n: x for n, x in inp["kwargs"].items() if n not in ("output_final_state", "state_v_first")}
    cu = kw["cu_seqlens"]
    pool = torch.randn(6, 2, 16, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(8))
    idx = torch.tensor([4, -1, 0, 2][:len(seqlens)], dtype=torch.int32)
    if guard:
        pool, idx, kw["cu_seqlens"] = _dev(pool), _dev(idx), _guarded(cu)
    kw["cu_seqlens_cpu"] = cu.clone()
    o, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                     initial_state=pool, state_indices=idx, check_indices=check_indices, state_v_first=True, **kw)
    return _host(o), _host(pool)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunk_kda_pool_without_index_check_reads_nothing(monkeypatch, backend):
    """check_indices=False with cu_seqlens_cpu: pool, indices and cu_seqlens are device values and
    none is read on the host; o and the pool equal the checked call's bits (a padded sequence,
    an empty one)."""
    if backend == "triton" and not triton_interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    dtype = torch.float64 if backend == "torch" else torch.float32
    seqlens = (9, 5, 0, 14)
    with pytest.raises(HostReadError, match="tolist"):  # the probe sees the index check's read
        _pool_prefill(seqlens, check_indices=True, guard=True, dtype=dtype)
    o_ref, pool_ref = _pool_prefill(seqlens, check_indices=True, guard=False, dtype=dtype)
    o_got, pool_got = _pool_prefill(seqlens, check_indices=False, guard=True, dtype=dtype)
    assert torch.equal(o_ref, o_got) and torch.equal(pool_ref, pool_got)
    assert torch.equal(o_got[:, 9:14], torch.zeros_like(o_got[:, 9:14])) and o_got[:, :9].abs().sum() > 0


def _decode_case(seed=6):
    inp = make_kda_inputs(T=5, H=1, HV=2, K=16, V=16, dtype=torch.float32, gate="safe", seqlens=[2, 0, 3],
                          generator=torch.Generator().manual_seed(seed))
    t = {n: x.detach() for n, x in inp["tensors"].items()}
    kw = {n: x for n, x in inp["kwargs"].items() if n not in ("output_final_state", "state_v_first")}
    pool = torch.randn(7, 2, 16, 16, generator=torch.Generator().manual_seed(seed + 1))
    return t, kw, pool


def _decode(t, kw, pool, idx, **extra):
    o = kda_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx, A_log=t["A_log"], dt_bias=t["dt_bias"],
                   **dict(kw, **extra))
    return _host(o)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kda_decode_with_cu_seqlens_cpu_reads_nothing(monkeypatch, backend):
    """kda_decode with cu_seqlens_cpu reads no offset (both backends); on the kernels with
    check_indices=False it reads no index or pool value either. Per-token rows [N, S] with
    num_accepted_tokens, a padded sequence; same bits as the checked call."""
    if backend == "triton" and not triton_interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    t, kw, pool0 = _decode_case()
    cu = kw["cu_seqlens"]
    rows = torch.tensor([[1, 2, -1], [-1, -1, -1], [3, 4, 5]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 1], dtype=torch.int32)
    ref_pool = pool0.clone()
    ref = _decode(t, kw, ref_pool, rows, num_accepted_tokens=acc)
    with pytest.raises(HostReadError):  # without the host copy the offsets are read
        _decode(dict(t), dict(kw, cu_seqlens=_guarded(cu)), pool0.clone(), rows, num_accepted_tokens=acc)
    got_pool = pool0.clone()
    got = _decode(t, dict(kw, cu_seqlens=_guarded(cu)), got_pool, rows, num_accepted_tokens=acc, cu_seqlens_cpu=cu)
    assert torch.equal(ref, got) and torch.equal(ref_pool, got_pool)
    if backend == "triton":
        pool = _dev(pool0)
        got = _decode(t, dict(kw, cu_seqlens=_guarded(cu)), pool, _dev(rows), num_accepted_tokens=_dev(acc),
                      cu_seqlens_cpu=cu, check_indices=False)
        assert torch.equal(ref, got) and torch.equal(ref_pool, _host(pool))
    assert not torch.equal(ref_pool, pool0) and torch.equal(ref_pool[[0, 6]], pool0[[0, 6]])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_recurrent_with_cu_seqlens_cpu_reads_nothing(monkeypatch, backend):
    """fused_recurrent_kda (plain, and with FLA's serving arguments in place) with cu_seqlens_cpu:
    no offset is read; on the kernels with check_indices=False, no index or pool value either."""
    if backend == "triton" and not triton_interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tier)")
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    t, kw, pool0 = _decode_case(seed=11)
    cu = kw["cu_seqlens"]
    h0 = pool0[:3].clone()

    def plain(**extra):
        o, ht = fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                                    initial_state=h0, output_final_state=True, state_v_first=True,
                                    **dict(kw, **extra))
        return _host(o), _host(ht)

    ref = plain()
    with pytest.raises(HostReadError):
        plain(cu_seqlens=_guarded(cu))
    got = plain(cu_seqlens=_guarded(cu), cu_seqlens_cpu=cu.clone())
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])

    rows = torch.tensor([[1, 2, -1], [0, -1, -1], [3, 4, 5]], dtype=torch.int32)

    def serving(pool, idx, **extra):
        o, _ = fused_recurrent_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                                   initial_state=pool, ssm_state_indices=idx, inplace_final_state=True,
                                   state_v_first=True, **dict(kw, **extra))
        return _host(o)

    ref_pool = pool0.clone()
    ref_o = serving(ref_pool, rows)
    got_pool = pool0.clone()
    got_o = serving(got_pool, rows, cu_seqlens=_guarded(cu), cu_seqlens_cpu=cu.clone())
    assert torch.equal(ref_o, got_o) and torch.equal(ref_pool, got_pool)
    if backend == "triton":
        pool = _dev(pool0)
        got_o = serving(pool, _dev(rows), cu_seqlens=_guarded(cu), cu_seqlens_cpu=cu.clone(), check_indices=False)
        assert torch.equal(ref_o, got_o) and torch.equal(ref_pool, _host(pool))
    assert not torch.equal(ref_pool, pool0) and torch.equal(ref_pool[6], pool0[6])
