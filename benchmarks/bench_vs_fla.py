"""kdakit beside FLA 0.6.0 in one GPU run: ``chunk_kda`` for three gates at the four protocol shapes, and the
KimiDeltaAttention layer; correctness first (kdakit against FLA on the same inputs), then times and peaks.

chunk: ``kdakit.chunk_kda`` and ``fla.ops.kda.chunk_kda`` with the same arguments (bf16, K = V = 128, packed
equal sequences with cu_seqlens and cu_seqlens_cpu, in-kernel l2norm and beta sigmoid) for the gates
``safe`` (in-kernel lower_bound -5 sigmoid gate, A_log = dt_bias = 0, seven inputs differentiated),
``softplus`` (in-kernel unbounded gate, A_log / dt_bias as FLA's layer initialises them) and ``raw`` (that
softplus log-decay computed outside in fp32, passed as g with use_gate_in_kernel=False, five inputs
differentiated). kdakit runs each of ``--pipelines`` (``default`` is ``pipeline=None``).
layer: ``kdakit.nn.KimiDeltaAttention`` against ``fla.layers.KimiDeltaAttention`` at FLA's defaults (hidden
2048, 16 heads of 128), the same weights (kdakit's seeded init, which draws in FLA's order, loaded into both),
bf16 weights with fp32 A_log / dt_bias, x ``[1, T, 2048]``.

Per cell and implementation: one forward+backward whose o and gradients are sampled (the same 2^20 positions
in every process) for the accuracy check (relative RMS of kdakit against FLA; recorded, not a gate), warm-up
steps, the median of ``--runs`` CUDA-event times (``--runs-long`` from 128K tokens) of the forward (autograd
recording, and under no_grad) and of forward+backward with a fixed dO, then ``max_memory_allocated`` /
``max_memory_reserved`` over one steady-state forward+backward with earlier outputs and gradients released
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False). Each measuring process is a subprocess with a timeout;
``--process fresh``: one per (cell, implementation); ``split``: kdakit's pipelines share one, FLA its own;
``shared``: one per cell (kdakit first; everything released, empty_cache and reset_peak_memory_stats before
the next). Results are written after every process; a failing one is recorded as error rows; past
``--budget-s`` the remaining cells are recorded as skipped. ``--warm-jobs N`` first compiles (and autotunes
what the carried cache lacks) every variant at 1K tokens in N parallel processes.

Usage:
  python benchmarks/bench_vs_fla.py chunk --out DIR [--gates safe,softplus,raw] [--shapes ...] [--impls kdakit,fla]
         [--pipelines default,chunk64_fast] [--process split] [--budget-s 480] [--warm-jobs 9] [--dry-run]
  python benchmarks/bench_vs_fla.py layer --out DIR [--tokens 8192,32768] [...the same options]
  python benchmarks/bench_vs_fla.py table FILE.json           # the README's markdown table
  python benchmarks/bench_vs_fla.py merge A.json B.json --out C.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import vs_fla_common as common  # noqa: E402

MARK = "VSFLA_RESULT "
SAMPLES = 1 << 20
LONG_TOKENS = 131072
LAYER_CONFIG = dict(hidden_size=2048, expand_v=1, head_dim=128, num_heads=16, layer_idx=0)
DRY_LAYER_CONFIG = dict(hidden_size=256, expand_v=1, head_dim=32, num_heads=2, layer_idx=0)
OUT_NAMES = {"chunk": "chunk_vs_fla.json", "layer": "layer_vs_fla.json"}


# ---------------------------------------------------------------------------------------------------------
# Worker: one process measures one cell for a list of implementations and prints one MARK line per impl.

def _median_ms(fn, iters: int, cuda: bool) -> float:
    if cuda:
        from timing import median_ms
        return median_ms(fn, warmup=0, iters=iters, sync_each=True)
    import statistics
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _sample(t, n: int = SAMPLES):
    """The same positions of a tensor of this size in every process (a CPU generator seeded by numel)."""
    import torch
    flat = t.detach().reshape(-1)
    if flat.numel() <= n:
        return flat.float().cpu()
    idx = torch.randint(0, flat.numel(), (n,), generator=torch.Generator().manual_seed(flat.numel()))
    return flat[idx.to(flat.device)].float().cpu()


def chunk_inputs(mbs, seq, H, gate, seed, device, D=common.D):
    """profile_chunk64.make_inputs' recipe on any device: randn q, k, v, g, beta, dO; FLA's layer init of A_log /
    dt_bias for softplus and raw; raw's g the fp32 log-decay -exp(A_log) * softplus(g + dt_bias)."""
    import math

    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    T = mbs * seq

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    x = dict(q=randn(1, T, H, D), k=randn(1, T, H, D), v=randn(1, T, H, D), g=randn(1, T, H, D),
             beta=randn(1, T, H))
    if gate == "safe":
        A_log, dt_bias = torch.zeros(H, device=device), torch.zeros(H * D, device=device)
    else:  # FLA's KimiDeltaAttention init: A ~ U(1, 16), dt log-uniform in [1e-3, 0.1]
        A_log = torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=gen))
        dt = torch.exp(torch.rand(H * D, device=device, generator=gen) * (math.log(0.1) - math.log(1e-3))
                       + math.log(1e-3))
        dt_bias = dt + torch.log(-torch.expm1(-dt))
    if gate == "raw":
        g = x["g"].float() + dt_bias.view(H, D)
        x["g"] = (-A_log.exp().view(H, 1) * torch.nn.functional.softplus(g)).float()
        del g
        A_log = dt_bias = None
    x["A_log"], x["dt_bias"] = A_log, dt_bias
    x["leaves"] = [n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") if x[n] is not None]
    for n in x["leaves"]:
        x[n].requires_grad_(True)
    starts = list(range(0, T + 1, seq))
    x["cu_seqlens"] = torch.tensor(starts, dtype=torch.int64, device=device)
    x["cu_seqlens_cpu"] = torch.tensor(starts, dtype=torch.int64)
    x["do"] = randn(1, T, H, D)
    return x


def gate_flags(gate: str) -> dict:
    if gate == "safe":
        return dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    if gate == "softplus":
        return dict(use_gate_in_kernel=True, safe_gate=False, lower_bound=None)
    return dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None)


class PipelineProbe:
    """Which Triton pipeline a kdakit call ran: wraps the launchers that kdakit's chunk_kda dispatches to."""

    def __init__(self):
        self.ran = None

    def __enter__(self):
        from kdakit.ops.kda.chunk import api
        self.api, self.saved = api, (api.chunk64_kda, api.chunk_kda_triton)
        c64, c16 = self.saved

        def chunk64(*a, **kw):
            self.ran = ("chunk64_fast" if kw.get("keep_intermediates") else "chunk64") + \
                (f" (window {kw['window_tokens']})" if kw.get("window_tokens") else "")
            return c64(*a, **kw)

        def windowed(*a, **kw):
            self.ran = "windowed16"
            return c16(*a, **kw)
        api.chunk64_kda, api.chunk_kda_triton = chunk64, windowed
        return self

    def __exit__(self, *exc):
        self.api.chunk64_kda, self.api.chunk_kda_triton = self.saved
        if self.ran is None:
            self.ran = "torch reference" if self.api.select_backend(_probe_device()) == "torch" else "unknown"
        return False


_DEVICE = ["cuda"]


def _probe_device():
    import torch
    return torch.device(_DEVICE[0])


def _fla_chunk(dry_run: bool):
    if dry_run:  # no FLA on the CPU tier: kdakit's PyTorch path stands in, so the plumbing is what is tested
        from kdakit import chunk_kda
        return chunk_kda
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    from fla.ops.kda import chunk_kda
    return chunk_kda


def chunk_call(impl: str, pipeline: str, gate: str, dry_run: bool):
    if impl == "fla":
        fn, extra = _fla_chunk(dry_run), {}
    else:
        from kdakit import chunk_kda as fn
        extra = {"pipeline": None if pipeline == "default" else pipeline}
    flags = gate_flags(gate)

    def call(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=x["cu_seqlens_cpu"], use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, **flags, **extra)[0]
    return call


def measure(run_fwd, step, release, samples_of, cuda: bool, runs: int, warmup: int, sample_path, base_fn=None,
            probe=None):
    """Correctness step (sampled; under ``probe``, which names the pipeline it ran), warm-up, times, one
    steady-state step's peaks. ``step()`` runs one forward+backward and returns nothing (``step(keep=True)``:
    its output); ``samples_of(output)`` samples the output and the gradients."""
    import contextlib
    import gc

    import torch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    t0 = time.perf_counter()
    release()
    with probe if probe is not None else contextlib.nullcontext():
        first = step(keep=True)
    sync()
    out["first_step_s"] = time.perf_counter() - t0
    samples = samples_of(first)
    del first
    out["finite"] = all(bool(torch.isfinite(s).all()) for s in samples.values())
    if sample_path:
        torch.save(samples, sample_path)
        out["samples"] = os.path.basename(sample_path)
    del samples
    release()
    for _ in range(warmup):
        step()
        release()
    out["fwd_ms"] = _median_ms(lambda: run_fwd(False), runs, cuda)
    out["fwd_nograd_ms"] = _median_ms(lambda: run_fwd(True), runs, cuda)

    def timed_step():
        release()
        step()
    out["fwd_bwd_ms"] = _median_ms(timed_step, runs, cuda)
    release()
    gc.collect()
    sync()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        if base_fn is None:
            out["peak_alloc_gib"] = peak / common.GIB
        else:  # the layer: the peak above what was live before the step (weights, x, dy)
            out["base_alloc_gib"] = base / common.GIB
            out["peak_alloc_gib"] = (peak - base) / common.GIB
            out["peak_reserved_above_base_gib"] = (reserved - base) / common.GIB
        out["peak_reserved_gib"] = reserved / common.GIB
        release()
    out["runs"] = runs
    out["warmup"] = warmup
    return out


def _free(cuda: bool):
    import gc

    import torch
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _meta(cuda: bool) -> dict:
    import importlib.metadata as md

    import torch

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None
    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "torch": torch.__version__,
            "triton": version("triton"), "fla": version("fla-core"),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def _fault(args, impl_key):
    """Test hook (``--fault IMPL:crash|hang``): the CPU tests' way to check that a failing process is recorded."""
    for item in (args.fault or "").split(","):
        if item and item.rsplit(":", 1)[0] == impl_key:
            if item.endswith(":hang"):
                time.sleep(3600)
            os._exit(3)


def worker(args) -> int:
    import torch
    cuda = not args.dry_run
    _DEVICE[0] = "cuda" if cuda else "cpu"
    device = _DEVICE[0]
    meta = _meta(cuda)
    shapes = common.parse_list(args.shape, None, "--shape")
    if len(shapes) > 1 and not args.warm_only:
        raise ValueError(f"--shape: one shape per measuring process (several with --warm-only), got {args.shape!r}")
    for shape, impl_key in [(s, k) for s in shapes for k in common.parse_list(args.impls, None, "--impls")]:
        args.shape = shape
        impl, _, pipeline = impl_key.partition(":")
        rec = {"kind": args.kind, "gate": args.gate, "shape": args.shape, "impl": impl, "process": args.process,
               "dry_run": args.dry_run, **meta}
        if impl == "kdakit":
            rec["pipeline"] = pipeline or "default"
        t0 = time.perf_counter()
        try:
            _fault(args, impl_key)
            if args.kind == "chunk":
                rec.update(_chunk_cell(args, impl, rec.get("pipeline"), device, cuda))
            else:
                rec.update(_layer_cell(args, impl, rec.get("pipeline"), device, cuda))
            rec["status"] = "warm" if args.warm_only else "ok"
        except torch.cuda.OutOfMemoryError as e:
            rec.update(status="oom", message=str(e)[:400])
        except Exception as e:  # noqa: BLE001 - recorded as this implementation's error row; the next one runs
            rec.update(status="error", message=f"{type(e).__name__}: {e}"[:800])
        rec["wall_s"] = time.perf_counter() - t0
        print(MARK + json.dumps(rec), flush=True)
        _free(cuda)
    return 0


def _sample_path(args, impl, pipeline):
    if args.warm_only or not args.work:
        return None
    tag = "fla" if impl == "fla" else f"kdakit-{pipeline}"
    return os.path.join(args.work, f"{args.kind}_{args.gate}_{args.shape}_{tag}.pt".replace(":", "-"))


def _chunk_cell(args, impl, pipeline, device, cuda) -> dict:
    import torch
    mbs, seq, H = common.parse_shape(args.shape)
    if args.dry_run:
        seq, H = min(seq, 64), min(H, 2)
    x = chunk_inputs(mbs, seq, H, args.gate, args.seed, device)
    call = chunk_call(impl, pipeline, args.gate, args.dry_run)
    out = {}

    def release():
        for n in x["leaves"]:
            x[n].grad = None

    def step(keep=False):
        o = call(x)
        o.backward(x["do"])
        return o if keep else None

    def run_fwd(no_grad):
        with torch.no_grad() if no_grad else torch.enable_grad():
            call(x)

    def samples_of(o):
        return {"o": _sample(o), "dq": _sample(x["q"].grad), "dg": _sample(x["g"].grad)}

    if args.warm_only:
        step()
        return {"tokens": mbs * seq}
    probe = PipelineProbe() if impl == "kdakit" else None
    runs = args.runs_long if mbs * seq >= LONG_TOKENS else args.runs
    out.update(measure(run_fwd, step, release, samples_of, cuda, runs, args.warmup,
                       _sample_path(args, impl, pipeline), probe=probe))
    if probe is not None:
        out["pipeline_ran"] = probe.ran
    out["floor_gib"] = common.floor_gib(args.shape, args.gate)
    del x
    return out


def layer_state_dict(dry_run: bool):
    """kdakit's layer init (seed 0; it draws in FLA's order) on the CPU in fp32: the weights of both layers."""
    import torch

    from kdakit.nn import KimiDeltaAttention
    torch.manual_seed(0)
    return KimiDeltaAttention(**(DRY_LAYER_CONFIG if dry_run else LAYER_CONFIG)).state_dict()


def build_layer(impl, pipeline, device, dry_run):
    import torch
    cfg = DRY_LAYER_CONFIG if dry_run else LAYER_CONFIG
    sd = layer_state_dict(dry_run)
    if impl == "fla" and not dry_run:
        from fla.layers import KimiDeltaAttention
        layer = KimiDeltaAttention(**cfg)
    else:
        from kdakit.nn import KimiDeltaAttention
        kw = {} if impl == "fla" or pipeline == "default" else {"pipeline": pipeline}
        layer = KimiDeltaAttention(**cfg, **kw)
    layer.load_state_dict(sd, strict=True)
    layer = layer.to(device).bfloat16()
    with torch.no_grad():
        for name in ("A_log", "dt_bias"):  # bf16 weights, fp32 gate parameters (FLA's .bfloat16() rounds them)
            getattr(layer, name).data = sd[name].to(device, torch.float32)
    return layer


def _layer_cell(args, impl, pipeline, device, cuda) -> dict:
    import torch
    T = int(args.shape.split("x")[1])
    if args.dry_run:
        T = min(T, 64)
    layer = build_layer(impl, pipeline, device, args.dry_run)
    hidden = layer.hidden_size
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    xin = torch.randn(1, T, hidden, device=device, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(xin.shape, device=device, generator=gen).bfloat16()
    params = list(layer.parameters())

    def release():
        xin.grad = None
        for p in params:
            p.grad = None

    def step(keep=False):
        y = layer(xin)[0]
        y.backward(dy)
        return y if keep else None

    def run_fwd(no_grad):
        with torch.no_grad() if no_grad else torch.enable_grad():
            layer(xin)

    def samples_of(y):
        return {"y": _sample(y), "dx": _sample(xin.grad), "dq_proj": _sample(layer.q_proj.weight.grad)}

    if args.warm_only:
        step()
        return {"tokens": T}
    out = {"tokens": T, "fp32_gate_params": layer.A_log.dtype == torch.float32 == layer.dt_bias.dtype}
    probe = PipelineProbe() if impl == "kdakit" else None
    runs = args.runs_long if T >= LONG_TOKENS else args.runs
    out.update(measure(run_fwd, step, release, samples_of, cuda, runs, args.warmup,
                       _sample_path(args, impl, pipeline), base_fn=True, probe=probe))
    if probe is not None:
        out["pipeline_ran"] = probe.ran
    return out


# ---------------------------------------------------------------------------------------------------------
# Parent: jobs, subprocesses, budget, join.

def child_env(args) -> dict:
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    env["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    paths = [ROOT]
    stub = args.transformers_stub
    if stub and os.path.isdir(stub):
        paths.append(os.path.abspath(stub))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def worker_cmd(args, cell, keys, warm_only=False) -> list[str]:
    gate, shape = cell
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--kind", args.kind, "--shape", shape,
           "--impls", ",".join(keys), "--runs", str(args.runs), "--runs-long", str(args.runs_long),
           "--warmup", str(args.warmup), "--seed", str(args.seed), "--process", args.process,
           "--work", args.work_dir]
    if gate:
        cmd += ["--gate", gate]
    if warm_only:
        cmd.append("--warm-only")
    if args.dry_run:
        cmd.append("--dry-run")
    if args.fault:
        cmd += ["--fault", args.fault]
    return cmd


ACTIVE: dict = {}


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def launch(cmd, env, log_path):
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT, start_new_session=True)
    ACTIVE[proc.pid] = proc
    return proc, log


def finish(proc, log, timeout):
    """stdout's MARK records, and why the process ended short ('timeout', or an error text), or None."""
    why = None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        why = "timeout"
    ACTIVE.pop(proc.pid, None)
    log.close()
    recs = [json.loads(line[len(MARK):]) for line in out.decode(errors="replace").splitlines()
            if line.startswith(MARK)]
    if why is None and proc.returncode != 0:
        why = f"exit status {proc.returncode}"
    return recs, why


def _tail(path, n=1500):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_warm(args, cells, keys, env, deadline) -> list[dict]:
    """The warm-up processes, one per (gate, implementation) running its small cells in turn, ``--warm-jobs`` at a
    time, FLA's first; each cut at the warm phase's deadline."""
    small = common.warm_cells(args.kind, cells)
    gates = list(dict.fromkeys(g for g, _ in small))
    todo = [((g, ",".join(s for gg, s in small if gg == g)), [k])
            for k in sorted(keys, key=lambda k: k != "fla") for g in gates]
    running, done = [], []
    log = os.path.join(args.out, f"{args.kind}_warm.log")
    while todo or running:
        while todo and len(running) < args.warm_jobs and time.monotonic() < deadline:
            cell, ks = todo.pop(0)
            proc, fh = launch(worker_cmd(args, cell, ks, warm_only=True), env, log)
            running.append((proc, fh, cell, ks, time.monotonic()))
        if not running:
            break
        time.sleep(0.2)
        for item in list(running):
            proc, fh, cell, ks, t0 = item
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            running.remove(item)
            recs, why = finish(proc, fh, timeout=max(0.0, deadline - time.monotonic()))
            done.append({"cell": list(cell), "impl": ks[0], "wall_s": time.monotonic() - t0,
                         "status": why or ",".join(r["status"] for r in recs),
                         "messages": [r["message"] for r in recs if r.get("message")]})
    for cell, ks in todo:
        done.append({"cell": list(cell), "impl": ks[0], "status": "skipped (warm budget)"})
    return done


def add_accuracy(records: list[dict], work: str, final: bool = False) -> None:
    """kdakit's samples against FLA's of the same cell (relative RMS), into each kdakit record; a cell whose FLA
    record is not in yet waits, unless ``final``."""
    import torch

    def rel_rms(ref, got):
        ref, got = ref.double(), got.double()
        return float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))

    def samples(r):
        name = r.get("samples")
        if r.get("status") != "ok" or not name or not os.path.exists(os.path.join(work, name)):
            return None
        return torch.load(os.path.join(work, name))
    fla = {(r.get("gate"), r["shape"]): r for r in records if r["impl"] == "fla" and r.get("status") == "ok"}
    for r in records:
        if r["impl"] != "kdakit" or r.get("status") != "ok" or "missing" not in r.get("accuracy_vs_fla", {"missing": 1}):
            continue
        ref = fla.get((r.get("gate"), r["shape"]))
        if ref is None and not final:
            continue
        a, b = samples(r), samples(ref) if ref else None
        if a is None or b is None:
            r["accuracy_vs_fla"] = {"missing": "FLA did not run ok in this run" if ref is None else "no samples"}
            continue
        r["accuracy_vs_fla"] = common.accuracy(a, b, rel_rms) | {"samples": int(next(iter(b.values())).numel()),
                                                               "metric": "rel RMS vs FLA"}


def run_parent(args) -> int:
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    # the samples stay off OUT (which run_gpu.sh packs whole): a temporary folder unless --work names one
    args.work_dir = args.work or tempfile.mkdtemp(prefix=f"vsfla_{args.kind}_")
    os.makedirs(args.work_dir, exist_ok=True)
    pipelines = common.parse_list(args.pipelines, None, "--pipelines")
    impls = common.parse_list(args.impls, ("kdakit", "fla"), "--impls")
    keys = common.impl_keys(impls, pipelines)
    if args.kind == "chunk":
        gates = common.parse_list(args.gates, common.GATES, "--gates")
        shapes = common.parse_list(args.shapes, None, "--shapes")
        for s in shapes:
            common.parse_shape(s)
        # shape-major: every gate at a shape before the next shape, so a cut budget loses the last (longest) shape
        cells = [(g, s) for s in shapes for g in gates]
    else:
        cells = [(None, f"1x{int(t)}") for t in common.parse_list(args.tokens, None, "--tokens")]
    jobs = common.plan_jobs(cells, keys, args.process)
    env = child_env(args)
    path = os.path.join(args.out, args.name or OUT_NAMES[args.kind])
    sha = os.environ.get("KDAKIT_GIT_SHA") or "unknown"
    result = {"kind": args.kind, "kdakit": {"git_sha": sha}, "fla": {"git_sha": sha, "package": "fla-core"},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "process": args.process, "pipelines": pipelines, "dry_run": args.dry_run,
              "selection": {"gates": args.gates if args.kind == "chunk" else None,
                            "shapes": [c[1] for c in cells], "impls": keys},
              "method": {"runs": args.runs, "runs_long": args.runs_long, "long_tokens": LONG_TOKENS,
                         "warmup_steps": args.warmup, "samples": SAMPLES, "budget_s": args.budget_s,
                         "cell_timeout_s": args.cell_timeout, "warm_jobs": args.warm_jobs,
                         "alloc_conf": env["PYTORCH_CUDA_ALLOC_CONF"],
                         "fwd_ms": "forward with autograd recording (output dropped); fwd_nograd_ms under no_grad",
                         "peaks": "one steady-state fwd+bwd, earlier outputs/grads released, no empty_cache"
                                  + (" (layer: above weights + x + dy)" if args.kind == "layer" else "")},
              "records": [], "rows": []}
    records = result["records"]

    def save():
        result["rows"] = common.build_rows(records, pipelines, args.kind)
        result["markdown"] = common.markdown(result)
        for r in records:
            if r.get("status") == "ok" and r.get("gpu"):
                for k in ("gpu", "torch", "triton"):
                    result.setdefault(k, r.get(k))
                result["fla"]["version"] = result["fla"].get("version") or r.get("fla")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)

    def on_term(signum, frame):
        for proc in list(ACTIVE.values()):
            _kill(proc)
        result["interrupted"] = f"signal {signum} after {time.monotonic() - t_start:.0f} s"
        save()
        _drop_samples(args)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_term)
    save()
    if args.warm_jobs > 0:
        warm_deadline = min(deadline, t_start + args.warm_budget_s)
        result["warm"] = run_warm(args, cells, keys, env, warm_deadline)
        result["warm_s"] = time.monotonic() - t_start
        save()
        print(f"warm: {result['warm_s']:.0f} s, " + ", ".join(f"{w['impl']} {w['cell'][1]} {w['status']}"
                                                            for w in result["warm"]), flush=True)
    log = os.path.join(args.out, f"{args.kind}_workers.log")
    for cell, ks in jobs:
        left = deadline - time.monotonic()
        if left < args.min_job_s:
            for k in ks:
                records.append(_stub_record(args, cell, k, "skipped", f"budget: {left:.0f} s left of {args.budget_s} s"))
            save()
            continue
        t0 = time.monotonic()
        proc, fh = launch(worker_cmd(args, cell, ks), env, log)
        recs, why = finish(proc, fh, timeout=min(args.cell_timeout, left))
        seen = {common.impl_key(r) for r in recs}
        for r in recs:
            print(f"{r.get('gate') or ''} {r['shape']} {common.impl_key(r)}: {r['status']} "
                  + json.dumps({k: r.get(k) for k in ("pipeline_ran", "fwd_ms", "fwd_bwd_ms", "peak_alloc_gib",
                                                      "peak_reserved_gib", "wall_s", "message") if k in r}), flush=True)
        records += recs
        for k in ks:
            if k not in seen:
                status = "timeout" if why == "timeout" else "error"
                msg = (f"process cut at {min(args.cell_timeout, left):.0f} s" if why == "timeout"
                       else f"process ended ({why}) before reporting; stderr tail: {_tail(log)}")
                records.append(_stub_record(args, cell, k, status, msg, wall_s=time.monotonic() - t0))
                print(f"{cell[0] or ''} {cell[1]} {k}: {status}", flush=True)
        try:
            add_accuracy(records, args.work_dir)
        except Exception as e:  # noqa: BLE001 - the accuracy join must not lose the timings
            result["accuracy_error"] = f"{type(e).__name__}: {e}"[:400]
        save()
    try:
        add_accuracy(records, args.work_dir, final=True)
    except Exception as e:  # noqa: BLE001
        result["accuracy_error"] = f"{type(e).__name__}: {e}"[:400]
    result["total_s"] = time.monotonic() - t_start
    save()
    print(result["markdown"])
    _drop_samples(args)
    return 0 if all(r.get("status") == "ok" for r in records) else 1


def _drop_samples(args):
    if args.keep_samples:
        return
    for name in os.listdir(args.work_dir):
        if name.endswith(".pt"):
            os.remove(os.path.join(args.work_dir, name))
    try:
        os.rmdir(args.work_dir)
    except OSError:
        pass


def _stub_record(args, cell, key, status, message, **extra):
    impl, _, pipeline = key.partition(":")
    rec = {"kind": args.kind, "gate": cell[0], "shape": cell[1], "impl": impl, "status": status,
           "message": message, "process": args.process, **extra}
    if impl == "kdakit":
        rec["pipeline"] = pipeline
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for kind in ("chunk", "layer", "worker"):
        p = sub.add_parser(kind)
        p.add_argument("--impls", default="kdakit,fla", help="kdakit and/or fla (worker: impl keys)")
        p.add_argument("--pipelines", default=",".join(common.PIPELINES),
                       help="kdakit's chunk_kda pipeline per column: default (pipeline=None), windowed16, chunk64, "
                            "chunk64_fast; the first fills the kdakit_* columns")
        p.add_argument("--runs", type=int, default=10, help="timed runs per figure below 128K tokens (median)")
        p.add_argument("--runs-long", type=int, default=5, help="timed runs per figure from 128K tokens")
        p.add_argument("--warmup", type=int, default=2, help="forward+backward steps after the correctness step")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dry-run", action="store_true",
                       help="CPU, tiny shapes, kdakit's PyTorch path standing in for FLA: tests the plumbing")
        p.add_argument("--fault", default=None, help=argparse.SUPPRESS)
        p.add_argument("--process", default="split", choices=("fresh", "split", "shared"))
        p.add_argument("--work", default=None, help="folder for the accuracy samples (default a temporary folder, removed at the end)")
        if kind == "worker":
            p.add_argument("--kind", choices=("chunk", "layer"), required=True)
            p.add_argument("--gate", default=None)
            p.add_argument("--shape", required=True)
            p.add_argument("--warm-only", action="store_true")
            continue
        p.add_argument("--out", required=True, help="output folder")
        p.add_argument("--name", default=None, help=f"results file name (default {OUT_NAMES[kind]})")
        if kind == "chunk":
            p.add_argument("--gates", default=",".join(common.GATES))
            p.add_argument("--shapes", default=",".join(common.SHAPES))
        else:
            p.add_argument("--tokens", default=",".join(map(str, common.LAYER_TOKENS)))
        p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
        p.add_argument("--cell-timeout", type=float, default=240.0, help="seconds per measuring process")
        p.add_argument("--min-job-s", type=float, default=25.0, help="a process is not started with less left")
        p.add_argument("--warm-jobs", type=int, default=9, help="parallel warm-up processes (0: no warm phase)")
        p.add_argument("--warm-budget-s", type=float, default=120.0, help="seconds for the warm phase at most")
        p.add_argument("--keep-samples", action="store_true", help="keep the sampled tensors (.pt)")
        p.add_argument("--transformers-stub", default=os.environ.get("KDAKIT_TRANSFORMERS_STUB",
                                                                     os.path.join(ROOT, ".stub", "transformers_stub")),
                       help="a folder put on the workers' PYTHONPATH so fla.layers imports without transformers")
    p = sub.add_parser("table")
    p.add_argument("file")
    p = sub.add_parser("merge")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "table":
        print(common.markdown(common.load(args.file)))
        return 0
    if args.cmd == "merge":
        res = common.merge([common.load(f) for f in args.files])
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(res["markdown"])
        return 0
    if args.cmd == "worker":
        return worker(args)
    args.kind = args.cmd
    try:
        return run_parent(args)
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
