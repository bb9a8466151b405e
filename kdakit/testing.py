"""Helpers for checking KDA paths against each other (used by tests, the demo and benchmarks).

The accuracy measure is FlashAttention's style of tolerance: the RMS of the error
divided by the RMS of the reference (``rms_ratio``), reported together with the
max absolute error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdakit.ops.kda.reference.naive import naive_recurrent_kda


@dataclass(frozen=True)
class ErrorReport:
    name: str
    max_abs: float
    rms_ratio: float

    def __str__(self) -> str:
        return f"{self.name}: max abs err {self.max_abs:.3e}, rms ratio {self.rms_ratio:.3e}"


def error_report(name: str, ref: torch.Tensor, got: torch.Tensor) -> ErrorReport:
    """Max abs error and RMS error ratio of ``got`` against ``ref`` (both upcast to float64)."""
    if ref.shape != got.shape:
        raise ValueError(f"{name}: shape mismatch, reference {list(ref.shape)} vs got {list(got.shape)}")
    r = ref.detach().to(torch.float64).cpu()
    x = got.detach().to(torch.float64).cpu()
    if not torch.isfinite(x).all():
        return ErrorReport(name, float("inf"), float("inf"))
    err = x - r
    max_abs = err.abs().max().item() if err.numel() else 0.0
    ref_rms = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    err_rms = err.pow(2).mean().sqrt().item() if err.numel() else 0.0
    if ref_rms == 0.0:
        ratio = 0.0 if err_rms == 0.0 else float("inf")
    else:
        ratio = err_rms / ref_rms
    return ErrorReport(name, max_abs, ratio)


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> ErrorReport:
    """Fail unless ``rms(got - ref) / rms(ref) <= ratio`` and ``got`` is finite.

    A reference that is identically zero is rejected: a check against zeros proves nothing.
    """
    rep = error_report(name, ref, got)
    if ref.numel() and float(ref.detach().abs().max()) == 0.0:
        raise AssertionError(f"{name}: the reference is all zeros, so the comparison cannot fail")
    if not rep.rms_ratio <= ratio:
        raise AssertionError(f"{rep} exceeds the allowed rms ratio {ratio:.1e}")
    return rep


GATES = ("none", "softplus", "safe", "safe_no_alog")


def make_kda_inputs(
    *, B: int = 1, T: int = 32, H: int = 2, HV: int | None = None, K: int = 16, V: int = 16,
    dtype: torch.dtype = torch.float64, device="cpu", gate: str = "softplus",
    seqlens: list[int] | None = None, initial_state: str | None = None, reset_tokens: float = 0.0,
    generator: torch.Generator | None = None,
) -> dict:
    """Random KDA inputs and matching ``chunk_kda`` keyword arguments.

    gate: ``none`` (g is a log-decay, ``-softplus(randn)``), ``softplus`` (raw g with A_log
    and dt_bias), ``safe`` (lower bound -5 with A_log and dt_bias), ``safe_no_alog``.
    seqlens: packed sequences (B must be 1, T their sum). initial_state: None, ``kv``, ``vk``
    (value-first) or ``kv_bf16``. reset_tokens: fraction of tokens whose log-decay is -1000
    (only with gate ``none``; never the first token, so the initial state always matters). Returns a dict with ``tensors`` (name -> tensor, all leaves to
    differentiate), ``kwargs`` (options for chunk_kda / naive_recurrent_kda) and ``seed``: without
    ``generator``, the fresh seed the inputs were drawn from (``compare_with_naive`` names it in a failure,
    so that a random case can be rerun with ``generator=torch.Generator().manual_seed(seed)``), else None.
    """
    HV = HV or H
    seed = None if generator is not None else torch.seed() % 2**31
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if seqlens is not None:
        if B != 1 or sum(seqlens) != T:
            raise ValueError(f"seqlens must sum to T={T} with B=1, got B={B}, seqlens={seqlens}")
    N = len(seqlens) if seqlens is not None else B
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    t = {
        "q": r(B, T, H, K).to(dtype),
        "k": r(B, T, H, K).to(dtype),
        "v": r(B, T, HV, V).to(dtype),
        "beta": r(B, T, HV).to(dtype),
    }
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if gate == "none":
        a = -torch.nn.functional.softplus(r(B, T, HV, K)) * 0.5
        if reset_tokens:
            mask = torch.rand(B, T, HV, 1, generator=gen, dtype=torch.float64) < reset_tokens
            # The first token never resets, so the initial state always reaches some output.
            mask[:, 0] = False
            a = torch.where(mask, torch.full_like(a, -1000.0), a)
        t["g"] = a.to(dtype)
    else:
        t["g"] = r(B, T, HV, K).to(dtype)
        kw["use_gate_in_kernel"] = True
        t["dt_bias"] = (0.5 * r(HV * K)).to(pdt)
        if gate in ("softplus", "safe"):
            t["A_log"] = (0.5 * r(HV)).to(pdt)
        if gate in ("safe", "safe_no_alog"):
            kw["safe_gate"] = True
            kw["lower_bound"] = -5.0
        elif gate != "softplus":
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if initial_state is not None:
        sdt = torch.bfloat16 if initial_state == "kv_bf16" else pdt
        shape = (N, HV, V, K) if initial_state == "vk" else (N, HV, K, V)
        t["initial_state"] = (0.5 * r(*shape)).to(sdt)
        kw["state_v_first"] = initial_state == "vk"
        kw["output_final_state"] = True
    if seqlens is not None:
        cu = [0]
        for n in seqlens:
            cu.append(cu[-1] + n)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.long, device=device)
    t = {name: x.to(device).requires_grad_() for name, x in t.items()}
    return {"tensors": t, "kwargs": kw, "seed": seed}


BETA_MODES = ("raw", "sigmoid", "neg_eigval")


def set_token_options(inputs: dict, *, l2norm: bool, beta_mode: str) -> dict:
    """Switch ``make_kda_inputs``' inputs to another l2norm / beta mode, in place, keeping them sensible:
    ``raw`` beta is given as sigmoid(beta) in (0, 1) (as FLA expects), and without l2norm q and k are
    scaled by 0.3 so the state stays bounded. Returns ``inputs``."""
    if beta_mode not in BETA_MODES:
        raise ValueError(f"beta_mode must be one of {BETA_MODES}, got {beta_mode!r}")
    kw, t = inputs["kwargs"], inputs["tensors"]
    kw["use_qk_l2norm_in_kernel"] = l2norm
    kw["use_beta_sigmoid_in_kernel"] = beta_mode != "raw"
    kw["allow_neg_eigval"] = beta_mode == "neg_eigval"
    if beta_mode == "raw":
        t["beta"] = torch.sigmoid(t["beta"]).detach().requires_grad_()
    if not l2norm:
        for n in ("q", "k"):
            t[n] = (0.3 * t[n]).detach().requires_grad_()
    return inputs


def run_kda(fn, inputs: dict, *, seed: int | None = None, cotangent_dtypes: tuple | None = None, **extra) -> dict:
    """Run ``fn`` (chunk_kda-like) forward+backward with random cotangents.

    Returns name -> tensor for ``o``, ``final_state`` (if any) and the gradient of each input
    (``d<name>``). Cotangents are drawn in float64 from a generator seeded with ``seed`` so two calls
    with the same seed see the same ``dO``/``dht``, then rounded to ``cotangent_dtypes`` (the dtypes
    of ``o`` and ``final_state``; default: fn's outputs' own) and cast to the outputs' dtypes. A float64
    reference given the dtypes of the path under test differentiates the very cotangents that path
    got (``compare_with_naive`` does so).
    """
    t = {n: x.detach().clone().requires_grad_() for n, x in inputs["tensors"].items()}
    kw = dict(inputs["kwargs"], **extra)
    pos = [t[n] for n in ("q", "k", "v", "g", "beta")]
    named = {n: t[n] for n in ("initial_state", "A_log", "dt_bias") if n in t}
    o, ht = fn(*pos, **named, **kw)
    do_dtype, dht_dtype = cotangent_dtypes or (None, None)
    gen = torch.Generator().manual_seed(1234 if seed is None else seed)
    outs, cots = [o], [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(do_dtype or o.dtype).to(o)]
    res = {"o": o}
    if ht is not None:
        outs.append(ht)
        cots.append(torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(dht_dtype or ht.dtype).to(ht))
        res["final_state"] = ht
    grads = torch.autograd.grad(outs, list(t.values()), cots, allow_unused=True)
    for n, gr in zip(t, grads):
        res["d" + n] = gr
    return res


# The accuracy of 16-bit inputs against the float64 definition (RMS error ratio; docs/spec.md §8), keyed
# by ``run_kda``'s names.
SPEC_RMS_LIMITS = {
    "o": 0.005, "final_state": 0.005,
    "dq": 0.008, "dk": 0.008, "dv": 0.008, "dA_log": 0.008, "ddt_bias": 0.008, "dinitial_state": 0.008,
    "dg": 0.02, "dbeta": 0.02,
}


def float64_copy(inputs: dict) -> dict:
    """The same inputs as fresh float64 leaves (the reference's precision), same options."""
    return {"tensors": {n: x.detach().double().requires_grad_() for n, x in inputs["tensors"].items()},
            "kwargs": inputs["kwargs"], "seed": inputs.get("seed")}


def compare_with_naive(fn, inputs: dict, limits, *, seed: int | None = None, **extra) -> dict:
    """Run ``fn`` and ``naive_recurrent_kda`` (on float64 copies of non-float64 inputs)
    forward+backward with the same cotangents; fail unless every output and gradient is within its RMS-ratio limit and every
    gradient has its input's dtype.

    ``limits``: one float for all, or a name -> limit map covering every output. Returns
    ``fn``'s results (``run_kda``'s dict).
    """
    # float64 tokens are already the reference precision: the reference then sees the very same
    # leaves (a bf16 initial state stays bf16, so both sides round its gradient alike).
    exact = inputs["tensors"]["q"].dtype == torch.float64
    got = run_kda(fn, inputs, seed=seed, **extra)
    # The reference differentiates the cotangents fn got, rounded to fn's output dtypes (bf16 dO for bf16
    # inputs): a float64 dO there would measure the cotangent's rounding, not fn's error (with one or two
    # value heads, dA_log's single cancelling sum per head read above its limit so).
    dtypes = (got["o"].dtype, got["final_state"].dtype if "final_state" in got else None)
    ref = run_kda(naive_recurrent_kda, inputs if exact else float64_copy(inputs), seed=seed,
                  cotangent_dtypes=dtypes)
    if set(ref) != set(got):
        raise AssertionError(f"outputs differ: reference {sorted(ref)}, got {sorted(got)}")
    for name in ref:
        if ref[name] is None:
            if got[name] is not None:
                raise AssertionError(f"{name}: the reference has no gradient, got one")
            continue
        leaf = inputs["tensors"].get(name[1:]) if name.startswith("d") else None
        if leaf is not None and got[name].dtype != leaf.dtype:
            raise AssertionError(f"{name} has dtype {got[name].dtype}, its input {leaf.dtype}")
        try:
            assert_close(name, ref[name], got[name], limits if isinstance(limits, float) else limits[name])
        except AssertionError as exc:
            if inputs.get("seed") is None:
                raise
            raise AssertionError(f"{exc} (inputs drawn with make_kda_inputs seed {inputs['seed']})") from None
    return got
