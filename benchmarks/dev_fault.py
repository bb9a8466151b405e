"""Locate a faulting kernel of the experimental 64-token backward: one small forward+backward per launch configuration, each in its own process
with CUDA_LAUNCH_BLOCKING=1 (usage: python benchmarks/dev_fault.py 'prep=8,states=8' 'prep=4' ...)."""
import os
import subprocess
import sys

CHILD = r"""
import os, sys, torch
os.environ["KDAKIT_CHUNK_PIPELINE"] = "chunk64"
import kdakit.ops.kda.chunk_bwd64 as M
import kdakit.ops.kda.chunk_fwd64 as F
import kdakit.ops.kda.chunk_prep64 as P
for item in filter(None, sys.argv[1].split(",")):
    n, v = item.split("=")
    mod, attr = {"prep": (P, "PREP_NUM_WARPS"), "fwd": (F, "STATE_NUM_WARPS"), "fbv": (F, "STATE_BLOCK_V"),
                 "states": (M, "STATES_NUM_WARPS"), "sbv": (M, "STATES_BLOCK_V"), "grads": (M, "GRADS_NUM_WARPS"),
                 "gbv": (M, "GRADS_BLOCK_V"), "pair": (M, "PAIR_NUM_WARPS")}[n]
    setattr(mod, attr, int(v))
from kdakit import chunk_kda
T, H = int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)
x = dict(q=r(1, T, H, 128), k=r(1, T, H, 128), v=r(1, T, H, 128), g=r(1, T, H, 128), beta=r(1, T, H))
for t in x.values(): t.requires_grad_(True)
A_log = torch.zeros(H, device="cuda", requires_grad=True); dt = torch.zeros(H * 128, device="cuda", requires_grad=True)
cu = torch.tensor([0, T // 3, T], device="cuda", dtype=torch.int64)
o, _ = chunk_kda(**x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt, cu_seqlens=cu)
gr = torch.autograd.grad(o, list(x.values()) + [A_log, dt], r(1, T, H, 128))
torch.cuda.synchronize()
print("OK", sys.argv[1], [float(t.float().abs().sum()) for t in gr])
"""
for cfg in sys.argv[1:]:
    for T, H in ((1000, 2), (8192, 96)):
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        res = subprocess.run([sys.executable, "-c", CHILD, cfg, str(T), str(H)], env=env, capture_output=True,
                             text=True, timeout=240)
        tail = (res.stdout + res.stderr).strip().splitlines()
        print(cfg, T, H, "rc", res.returncode, "|", " / ".join(l for l in tail if "OK" in l or "line" in l
                                                                 or "Error" in l)[-1500:], flush=True)
