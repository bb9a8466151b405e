"""A call's options, decided once: ``kda_options`` validates and returns one frozen ``KDAOptions``.

The public ops (``chunk_kda``, ``fused_recurrent_kda`` and its serving arguments, ``recurrent_kda_backward``,
``kda_decode``) build it from their FLA arguments; every launcher below them (chunk forward and backward, the
64-token pipeline, the recurrent forward and backward, the pool kernel of decode and serving) takes it whole and reads the kernel encodings from it (``GATE``, the beta mode,
the SAFE pairwise path, the lower bound and the scale in kernel form), so nothing is re-derived on the
way down and no option travels loose. Two places flatten it, on purpose: the custom-op schemas
(``custom_ops.py``, ``compiled.py``), since a schema holds plain values (each op's implementation calls the
public op, which builds the object again with this one function), and the PyTorch references, which keep
FLA's keyword arguments (``KDAOptions.reference_kwargs``; the pool kernel's twin, ``pool_recurrent_reference``,
takes the object as its launcher does).

What depends on the tensors of a launch rather than on the options (``IS_VARLEN``, since the recurrent
backward's segments carry their own offsets; dot precisions from the dtype) stays with the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdakit.ops.kda.chunk_common import gate_mode
from kdakit.ops.kda.recurrent.kernels import beta_mode
from kdakit.ops.kda.validate import KDAShape, flat_gate_params, metadata_shape, validate_kda_inputs


def uses_safe_path(safe_gate: bool, use_gate_in_kernel: bool, lower_bound: float | None) -> bool:
    """SAFE pairwise path of the chunk kernels when the log-decay is known to be >= -5 per token."""
    return bool(safe_gate) or (use_gate_in_kernel and lower_bound is not None and lower_bound >= -5.0)


def kernel_lower_bound(lower_bound: float | None) -> float:
    """``lower_bound`` as the kernels take it: a float scalar, 0.0 when unset (then GATE never reads it)."""
    return float(lower_bound) if lower_bound is not None else 0.0


@dataclass(frozen=True)
class KDAOptions:
    """One call's shape, options and their kernel encodings.

    The options are the call's after resolution: ``scale`` is a float (``K ** -0.5`` by default);
    ``lower_bound``, ``has_A_log`` and ``has_dt_bias`` describe the in-kernel gate, so they are None /
    False without ``use_gate_in_kernel`` (FLA reads A_log, dt_bias and lower_bound only for it);
    ``output_final_state`` says whether the kernels produce final states. The encodings after them are
    computed from those fields on construction and never again.

    ``shape`` is the whole call's; a launch on part of it (a segment of the recurrent backward) reads its
    sizes off its own tensors. Tensors are not held: they travel beside the object (autograd saves them).
    """

    shape: KDAShape
    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: float | None
    state_v_first: bool
    has_A_log: bool
    has_dt_bias: bool
    gate: int = field(init=False)  # constexpr GATE: chunk_common's GATE_NONE / GATE_SOFTPLUS / GATE_LOWER_BOUND
    beta: int = field(init=False)  # constexpr BETA of the recurrent kernels: BETA_RAW / BETA_SIGMOID / _X2
    neg_eigval: bool = field(init=False)  # constexpr NEG_EIGVAL of the chunk kernels (beta doubled)
    safe: bool = field(init=False)  # constexpr SAFE of the chunk kernels
    kernel_lower_bound: float = field(init=False)  # the lower_bound scalar argument

    def __post_init__(self):
        encodings = dict(
            gate=gate_mode(self.use_gate_in_kernel, self.lower_bound),
            beta=beta_mode(self.use_beta_sigmoid_in_kernel, self.allow_neg_eigval),
            neg_eigval=bool(self.allow_neg_eigval and self.use_beta_sigmoid_in_kernel),
            safe=uses_safe_path(self.safe_gate, self.use_gate_in_kernel, self.lower_bound),
            kernel_lower_bound=kernel_lower_bound(self.lower_bound),
        )
        for name, value in encodings.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def chunk_constexprs(self) -> dict:
        """The option constexprs of the windowed chunk backward's kernels (``chunk_bwd_windowed``)."""
        return dict(GATE=self.gate, HAS_A=self.has_A_log, HAS_BIAS=self.has_dt_bias,
                    L2NORM=self.use_qk_l2norm_in_kernel, BETA_SIGMOID=self.use_beta_sigmoid_in_kernel,
                    NEG_EIGVAL=self.neg_eigval, SAFE=self.safe)

    def intra_constexprs(self) -> dict:
        """The option constexprs, SAFE aside, in the spelling of the chunk forward's intra kernel."""
        return dict(GATE=self.gate, HAS_A_LOG=self.has_A_log, HAS_BIAS=self.has_dt_bias,
                    USE_L2NORM=self.use_qk_l2norm_in_kernel, BETA_SIGMOID=self.use_beta_sigmoid_in_kernel,
                    NEG_EIGVAL=self.neg_eigval)

    def recurrent_constexprs(self) -> dict:
        """The option constexprs of the recurrent forward kernel and the backward's two token passes."""
        return dict(L2NORM=self.use_qk_l2norm_in_kernel, GATE=self.gate, HAS_A=self.has_A_log,
                    HAS_BIAS=self.has_dt_bias, BETA=self.beta, STATE_V_FIRST=self.state_v_first)

    def kernel_gate_params(self, A_log, dt_bias):
        """The gate parameters as every path reads them: the ``[HV]`` / ``[HV * K]`` views of accepted engine
        shapes, or None for both without the in-kernel gate (FLA reads them only for it)."""
        if not self.use_gate_in_kernel:
            return None, None
        return flat_gate_params(A_log, dt_bias)

    def reference_kwargs(self) -> dict:
        """The options as the PyTorch references take them (FLA's keyword arguments, resolved)."""
        return dict(scale=self.scale, use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel,
                    use_gate_in_kernel=self.use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel=self.use_beta_sigmoid_in_kernel,
                    allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound,
                    state_v_first=self.state_v_first)


def kda_options(
    q, k, v, g, beta, *,
    scale=None,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound=None,
    A_log=None,
    dt_bias=None,
    state_v_first: bool = False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    engine_gate_shapes: bool = False,
    validate: bool = True,
) -> KDAOptions:
    """``validate_kda_inputs`` (its checks and errors, docs/spec.md §2), then the call's ``KDAOptions``.

    ``validate=False`` skips the checks and reads the sizes off metadata alone (``metadata_shape``: no
    ``seqlens``), for a CUDA-graph capture of a call that an eager warm call already validated.
    """
    if validate:
        shape = validate_kda_inputs(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            engine_gate_shapes=engine_gate_shapes,
        )
    else:
        shape = metadata_shape(q, v, cu_seqlens)
    gate = bool(use_gate_in_kernel)
    return KDAOptions(
        shape=shape, scale=float(shape.K ** -0.5 if scale is None else scale),
        output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval), safe_gate=bool(safe_gate),
        lower_bound=lower_bound if gate else None, state_v_first=bool(state_v_first),
        has_A_log=gate and A_log is not None, has_dt_bias=gate and dt_bias is not None,
    )
