"""Which allocations are live at the peak of one GPU-tier plan case (``tests/gpu/ops/kda/test_plan_chunk64_gpu.py``):
the case's measured and planned peaks, then a replay of the CUDA allocator's recorded history of the same step
(live blocks at the traced peak, grouped by size and the kdakit / test frames that allocated them), so that a
measured peak above the plan can be traced to its block.

Usage: python benchmarks/trace_plan_chunk64.py [CASE] [--free free_requested|free_completed]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.gpu.ops.kda import test_plan_chunk64_gpu as cases  # noqa: E402


def _where(event) -> str:
    frames = [f for f in event.get("frames", []) if "kdakit" in f["filename"] or "tests/" in f["filename"]]
    return "; ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", nargs="?", default="softplus_chunk64", choices=list(cases.CASES))
    ap.add_argument("--free", default="free_completed", choices=("free_requested", "free_completed"))
    args = ap.parse_args()
    print(cases._measure(args.case))  # compiles, and the untraced figures
    torch.cuda.memory._record_memory_history(max_entries=200000)
    print(cases._measure(args.case))
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    print(dict(collections.Counter(e["action"] for e in trace)))
    live, cur, best, at_best = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, at_best = cur, dict(live)
        elif e["action"] == args.free and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    print("peak over the traced window (caller tensors included)", best)
    groups = collections.Counter((e["size"], _where(e)) for e in at_best.values())
    for (size, where), count in sorted(groups.items(), key=lambda x: -x[0][0]):
        print(size, count, where)


if __name__ == "__main__":
    main()
