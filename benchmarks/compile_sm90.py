"""Build Triton kernels for sm_90a without a GPU and print registers and spills: (``--only lean``) the default
backward's stage 2 from the window's intermediates and the 16-token forward's intra kernel, and (``--only window``)
its stage 3, the window gradients, on the safe and the EXACT gate paths at the launcher's warp counts.
A build that ptxas -O3 gives 32 registers with KBs of spill code is its fallback allocation (the EXACT
path at 4 warps: 32 registers, 17 KB; the H200 ran it at 2.25 ms a 16-token program).

Usage: python benchmarks/compile_sm90.py [--only lean,window] (no TRITON_INTERPRET). The docs/spec.md §3 flags
at K = V = 128, bf16: what the H200 will run. ``build`` is also imported by tests (test_chunk_triton_bwd.py,
test_nan_semantics_sm90.py).
"""
import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kdakit.ops.kda.chunk_bwd_windowed as WG
import kdakit.ops.kda.chunk_bwd_states as LS
import kdakit.ops.kda.chunk_fwd as F16

TOK = {"q", "k", "v", "g", "beta", "do", "o", "u", "dq", "dk", "dv", "dg", "dbeta", "tinv", "hs", "dhs", "w", "kd", "aqk",
       "akk", "qg", "ckpt", "ws_s", "ws_ds", "uo", "ws_aqk"}
UNALIGNED = {"stride_alog", "stride_bias", "seq_len", "s_c_v", "win", "lower_bound"}  # element strides of 1
F32_EXTRA = {"inter", "dA2", "db_buf", "dgc_buf"}
F32 = {"scratch", "A_log", "dt_bias", "dA_part", "dbias_part", "h0", "ht", "dht", "dh0", "egc", "gc", "ws_win",
       "carry", "ddt_part"}


def build(fn, const, warps, stages=1):
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in TOK:
            sig[n] = "*bf16"
        elif n in F32 or n in F32_EXTRA:
            sig[n] = "*fp32"
        elif n in ("cu_seqlens", "ckpt_off"):
            sig[n] = "*i64"
        elif n in ("chunk_table", "chunk_offsets"):
            sig[n] = "*i32"
        elif n in ("scale", "lower_bound"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    # What the JIT specializes at the docs/spec.md §3 shapes (H, HV, T and token strides multiples of 16, tensors 16-byte
    # aligned): without these hints nothing vectorizes and the register counts are not the GPU's.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and n not in UNALIGNED and sig[n] != "fp32"}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kern.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
    n_mma = len(re.findall(r"\bmma\.sync", ptx))  # PTX indents instructions with a tab: no leading space
    print(f"{fn.__name__}: warps {warps}, stages {stages}, registers {regs.group(1) if regs else '?'}, "
          f"spill stores/loads {spill.group(1) + '/' + spill.group(2) if spill else '?'} B, "
          f"wgmma {len(re.findall('wgmma.mma_async', ptx))}, mma.sync {n_mma}")
    return kern


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="lean,window")
    a = ap.parse_args()
    only = a.only.split(",")
    if "lean" in only:
        build(LS.chunk_kda_bwd_lean_starts_kernel, dict(C=16, BK=128, BV=LS.LEAN_BLOCK_V, SUB_CHUNKS=16, N_SUB=2,
                                                        IS_VARLEN=True, DOT_PREC="tf32", OP_BF16=True,
                                                        EMULATE_BF16=False), LS.LEAN_NUM_WARPS)
        build(LS.chunk_kda_bwd_lean_states_kernel, dict(C=16, BK=128, BV=LS.LEAN_BLOCK_V, SUB_CHUNKS=16, N_SUB=2,
                                                        IS_VARLEN=True, DOT_PREC="tf32", OP_BF16=True,
                                                        EMULATE_BF16=False, ROUND_STAGE=False), LS.LEAN_NUM_WARPS)
        build(F16.chunk_kda_fwd_intra_kernel, dict(K=128, V=128, C=16, BK=128, BV=128, BKS=16, GATE=2, HAS_A_LOG=True,
                                                   HAS_BIAS=True, USE_L2NORM=True, BETA_SIGMOID=True, NEG_EIGVAL=False,
                                                   SAFE=True, IS_VARLEN=True, DOT_PREC="tf32", EMULATE_BF16=False,
                                                   WINDOW=True, SUB=16), F16.INTRA_NUM_WARPS)
    if "window" in only:
        for safe in (True, False):
            warps = WG.GRADS_NUM_WARPS if safe else getattr(WG, "GRADS_EXACT_NUM_WARPS", WG.GRADS_NUM_WARPS)
            build(WG.chunk_kda_bwd_window_grads_kernel,
                  dict(GROUP=1, C=16, BK=128, BV=WG.GRADS_BLOCK_V, SUB_CHUNKS=16, GATE=2 if safe else 1, HAS_A=True,
                       HAS_BIAS=True, L2NORM=True, BETA_SIGMOID=True, NEG_EIGVAL=False, SAFE=safe, IS_VARLEN=True,
                       DOT_PREC="tf32", GRAD_PREC="tf32", GRAD_OP=1, INV_DOUBLING=True), warps, WG.GRADS_NUM_STAGES)


if __name__ == "__main__":
    main()
