"""Which implementation runs a KDA call: the Triton kernels or the PyTorch reference.

``KDAKIT_BACKEND`` selects it: ``auto`` (default: Triton on CUDA tensors, PyTorch
on CPU tensors), ``triton`` (Triton kernels; on CPU tensors this needs
``TRITON_INTERPRET=1`` set before triton is imported) or ``torch`` (the PyTorch
reference everywhere). There is no silent switch: a request that cannot be served
raises.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def requested_backend() -> str:
    value = os.environ.get("KDAKIT_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"KDAKIT_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Matmuls of fp32 tiles in the chunk kernels: TF32 for 16-bit inputs (already rounded coarser than TF32),
# 3xTF32 for fp32 inputs, exact in the interpreter; forward and backward make the same choice.
def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision of fp32-operand products (bf16 operands ignore it)."""
    if triton_interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def select_backend(device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for tensors on ``device``."""
    want = requested_backend()
    if want == "torch":
        return "torch"
    if device.type == "cuda":
        return "triton"
    if want == "triton":
        if not triton_interpreting():
            raise ValueError(
                "KDAKIT_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported, "
                "got TRITON_INTERPRET unset"
            )
        return "triton"
    return "torch"
