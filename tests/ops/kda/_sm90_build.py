"""Building a kernel for sm_90a (Triton's own LLVM and ptxas, no GPU) from a CPU-tier test.

The tier sets TRITON_INTERPRET=1 for its own process (tests/conftest.py), under which Triton builds nothing, so
a build script runs in a child process without it (``run_sm90_build``), from the repository root with it on
PYTHONPATH. The script builds its variants with ``sm90_report`` and prints them with ``print_reports``; the test
reads them back with ``read_reports``:

    out = {}
    for ...:
        out[name] = dict(sm90_report(fn, types, const, warps, stages), warps=warps)
    print_reports(out)
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_PREFIX = "SM90 "


def run_sm90_build(script: str, timeout: int = 600) -> str:
    """The script's stdout; fails the test with its stderr when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def sm90_report(fn, types: dict, const: dict, num_warps: int, num_stages: int = 1, unaligned=()) -> dict:
    """Build ``fn`` (a ``@triton.jit`` function) for sm_90a and read ptxas -v's report.

    ``types`` maps argument names to Triton type strings ("*bf16", "*fp32", "fp32", ...); an argument in neither
    ``types`` nor ``const`` is an "i32", one in ``const`` a constexpr of that value. Every other argument whose
    type is not "fp32" and whose name is not in ``unaligned`` carries the JIT's divisibility-16 hint (pointers
    16-byte aligned, integers multiples of 16), as the JIT specializes them at the production shapes.
    Returns regs, spill_stores, spill_loads, stack (bytes of stack frame) and shared (bytes of shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n not in unaligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(kern.asm["ptx"])
        rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
    assert regs and spill, f"{fn.__name__}: no ptxas report: {rep[-1500:]}"
    stack = re.search(r"(\d+) bytes stack frame", rep)
    return dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                stack=int(stack.group(1)) if stack else 0, shared=kern.metadata.shared)


def print_reports(reports: dict) -> None:
    """In the child: the reports (name -> dict), for ``read_reports``."""
    print(_PREFIX + json.dumps(reports), flush=True)


def read_reports(stdout: str) -> dict:
    """In the test: the reports ``print_reports`` wrote (several calls merge), each also printed for the log."""
    reports = {}
    for line in stdout.splitlines():
        if line.startswith(_PREFIX):
            reports.update(json.loads(line[len(_PREFIX):]))
    for name, rep in reports.items():
        print(f"sm90 {name}: {rep}")
    return reports
