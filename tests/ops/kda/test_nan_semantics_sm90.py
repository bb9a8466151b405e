"""The GPU's NaN semantics of the chunk kernels' gate clamp, checked on the CPU from their sm_90a PTX.

PTX ``max.f32`` returns the non-NaN operand, so a log-decay clamped to >= -110 with it turns a NaN gate into the
floor, a finite reset, on the GPU only; the interpreter's numpy maximum propagates NaN, so the interpreted tests
cannot see it (the GPU tier's test_nan_softplus_gate_propagates[chunk] failed so on b6dd5fc). The clamp is
``max.NaN.f32``. Built without a GPU by benchmarks/compile_sm90.py (Triton's own LLVM and ptxas), in a process
without TRITON_INTERPRET; before the fix the same build held 32 / 16 plain ``max.f32`` and no ``max.NaN.f32``.
"""

import re

from ._sm90_build import run_sm90_build

BUILD = """
import re, sys
sys.path.insert(0, "benchmarks")
from compile_sm90 import build
import kdakit.ops.kda.chunk_fwd as F16
for gate, safe in ((1, False), (2, True)):  # the softplus gate (EXACT path) and the safe gate
    kern = build(F16.chunk_kda_fwd_intra_kernel,
                 dict(K=128, V=128, C=16, BK=128, BV=128, BKS=16, GATE=gate, HAS_A_LOG=True, HAS_BIAS=True,
                      USE_L2NORM=True, BETA_SIGMOID=True, NEG_EIGVAL=False, SAFE=safe, IS_VARLEN=True,
                      DOT_PREC="tf32", EMULATE_BF16=False), F16.INTRA_NUM_WARPS)
    ptx = kern.asm["ptx"]
    print("COUNTS", gate, len(re.findall(r"\\tmax\\.f32", ptx)), len(re.findall(r"\\tmax\\.NaN\\.f32", ptx)))
"""


def test_chunk_gate_clamp_propagates_nan_in_sm90_ptx():
    stdout = run_sm90_build(BUILD)
    counts = {int(g): (int(plain), int(nan)) for g, plain, nan in
              re.findall(r"^COUNTS (\d) (\d+) (\d+)$", stdout, flags=re.M)}
    assert set(counts) == {1, 2}, stdout
    for gate, (plain, nan) in counts.items():
        assert plain == 0 and nan > 0, f"gate mode {gate}: {plain} max.f32, {nan} max.NaN.f32 in the intra kernel"
