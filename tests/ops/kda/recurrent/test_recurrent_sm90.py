"""The training paths of the recurrence kernel built for the H200 (sm_90a) on the CPU: they compile and keep
their state tile in registers.

``fused_recurrent_kda``'s forward, the backward's u replay and its segment checkpoints run
``recurrent_forward._recurrent_kernel`` (the serving paths' kernel, with ``OUT_O`` / ``OUT_U``), and the
backward's state replay steps the same ``[BV, BK]`` tile. The interpreter runs their math in the CPU tier, but
not the GPU compile: a layout the compiler rejects, or a tile spilled to local memory, shows only in an sm_90a
build. Built without a GPU (Triton's own LLVM and ptxas) in a process without TRITON_INTERPRET, at the launch
configs the launchers use (K = V = 128, bf16 tokens, fp32 states).
"""

from .._sm90_build import read_reports, run_sm90_build

BUILD = """
from tests.ops.kda._sm90_build import print_reports, sm90_report
import kdakit.ops.kda.recurrent.backward_kernels as B
import kdakit.ops.kda.recurrent.kernels as R

PTR = {n: "*bf16" for n in ("q", "k", "v", "g", "beta", "do", "dv")}
PTR.update({n: "*fp32" for n in ("A_log", "dt_bias", "h0", "ht", "dht", "dh0", "ud", "dq_part", "dk_part", "x_part",
                                 "z_part", "dbeta_part", "term_part")})
PTR.update(state_indices="*i32", num_accepted="*i32", cu_seqlens="*i64")


def report(fn, const, warps, out_type):
    types = dict(PTR, out=out_type, scale="fp32", lower_bound="fp32")
    scalars = [n for n in fn.arg_names if not types.get(n, "i32").startswith("*")]  # hints on the pointers only
    return sm90_report(fn, types, const, warps, 1, unaligned=scalars)


out = {}
GATE = dict(L2NORM=True, GATE=2, HAS_A=True, HAS_BIAS=True, BETA=1)
for name, o, write, v_first, out_type, bv, warps in (
        ("forward o + final state", R.OUT_O, R.WRITE_FINAL_TO_READ_ROW, False, "*bf16", R.FWD_BLOCK_V, R.FWD_NUM_WARPS),
        ("forward o, value-first", R.OUT_O, R.WRITE_FINAL_TO_READ_ROW, True, "*bf16", R.FWD_BLOCK_V, R.FWD_NUM_WARPS),
        ("u replay", R.OUT_U, R.WRITE_NONE, False, "*fp32", B.BWD_BLOCK_V, R.FWD_NUM_WARPS),
        ("segment checkpoint", R.OUT_NONE, R.WRITE_FINAL_TO_READ_ROW, False, "*fp32", B.BWD_BLOCK_V, R.FWD_NUM_WARPS)):
    const = dict(H=16, HV=16, K=128, V=128, IDX_COLS=1, BK=128, BV=bv, HAS_INDICES=False, USE_H0=True, WRITE=write,
                 OUT=o, HAS_ACCEPTED=False, ROUND_STATE=False, ROUND_STORE=False, STATE_V_FIRST=v_first,
                 IS_VARLEN=True, NATIVE_ROUND=True, **GATE)
    out[name] = report(R._recurrent_kernel, const, warps, out_type)
const = dict(H=16, HV=16, K=128, V=128, BK=128, BV=B.BWD_BLOCK_V, USE_H0=True, HAS_DHT=True, IS_VARLEN=True,
             STATE_V_FIRST=False, **GATE)
out["state replay"] = report(B._recurrent_bwd_replay_kernel, const, B.BWD_NUM_WARPS, "*fp32")
print_reports(out)
"""

NAMES = {"forward o + final state", "forward o, value-first", "u replay", "segment checkpoint", "state replay"}


def test_recurrence_training_paths_build_for_sm90_without_spills():
    reports = read_reports(run_sm90_build(BUILD))
    assert set(reports) == NAMES, reports
    for name, r in reports.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name}: the state tile spills: {r}"
