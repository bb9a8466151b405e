#!/usr/bin/env bash
# The GPU tier and the benchmarks in one go, on the H200 (device tool), results under $OUT.
#
# One call, kdakit and FLA 0.6.0 compared in the same invocation, inside a 9-minute command limit
# (carry .whl and .tcache: FLA's wheel and FLA's H200 autotune cache; the device copy has no .git,
# so put the commit of the tree you carry in KDAKIT_GIT_SHA):
#
#   KDAKIT_GIT_SHA=<short sha> bash benchmarks/run_gpu.sh env warm chunk fla sweep profile tests
#
# Time budget of that call (expected; [default STAGE_LIMIT_<stage>]). TOTAL_LIMIT (525 s, from the
# script's start) caps the whole call: a stage's limit shrinks to what is left of it minus
# END_RESERVE (10 s, for the joins and the packing at the end), and a stage with less than 5 s left
# is skipped, so the later stages are the ones that get cut.
#   setup    ~5 s    FLA wheel into /tmp/site, carried autotune cache into TRITON_CACHE_DIR
#   env      ~5 s    [10]   env.json: GPU, versions, git sha, date
#   warm   ~140 s    [160]  kdakit correctness gate (kdakit's first compile, ~30-60 s) while, in the
#                           background, FLA tunes and compiles the sweep's GVA and softplus variants
#                           (one process, cells in turn: ~45 s + ~95 s, the autotune keys of GVA are
#                           not in the carried cache) and kdakit compiles its protocol and sweep variants;
#                           all of it joined before anything is timed. (FLA's GVA / softplus autotune
#                           benchmarks thus share the GPU with kdakit's compile processes, whose GPU
#                           work is a few 1K-token steps.)
#   chunk   ~60 s    [100]  kdakit at the four protocol shapes (docs/spec.md §3), fresh process per cell
#   fla    ~120 s    [150]  FLA at the four protocol shapes (~20 s first call per head count with the
#                           carried autotune cache), fresh process per cell
#   sweep   ~50 s    [80]   kdakit and FLA at SWEEP_SHAPES, one process per backend (1 memory rep,
#                           5 timing runs), sweep.json
#   profile ~15 s    [20]   kdakit's per-kernel CUDA time at 1x8192:96
#   tests  the rest  [rest] GPU test tier (-x), whatever time is left (~150 s when the stages above take
#                           their expected times, nothing when they all run to their limits)
#   end      ~3 s           chunk_vs_fla.json (protocol join + sweep join), autotune_new.json, triton_autotune.tgz
#
#   bash benchmarks/run_gpu.sh [STAGE ...]   stages run in the order given:
#       env warm chunk fla sweep profile tests recurrent flalayer layer traintiny tune tunecompile flawarm wait
#       vsfla layervsfla
#       (default: env warm chunk fla sweep profile tests)
#   env       env.json (GPU, torch, triton, CUDA, FLA, python, git sha, date)
#   warm      the correctness gate (gate.json) in the foreground; in the background FLA's
#             autotuning/compilation of the GVA / softplus cells of SWEEP_SHAPES (FLAWARM_SHAPES;
#             one process, cells in turn; FLAWARM_PARALLEL=1: one process per cell) and kdakit's
#             compilation of KDAWARM_SHAPES (protocol variants) and the sweep variants; joins all of it
#   chunk     kdakit at SHAPES (runs the correctness gate itself when `warm` has not)
#   fla       FLA 0.6.0 at FLA_SHAPES
#   sweep     kdakit and FLA at SWEEP_SHAPES (SWEEP_PROCESS=shared|fresh, SWEEP_REPS, SWEEP_TIMING_RUNS)
#   profile   per-kernel CUDA time of kdakit's forward and backward (profile_chunk.py, PROFILE_SHAPES;
#             PROFILE_GATE=softplus: the unbounded gate, FLA's layer default, instead of the safe gate)
#   tests     the GPU test tier (tests marked gpu; GPU_TESTS; GPU_TEST_FLAGS, default "--timeout=300": per
#             test, with pytest-timeout, which the device has; a test's first Triton compile of new variants
#             counts, and at 60 s the 2026-12-01 run lost six tests to it or to failures it could not tell
#             apart), one line per test so a cut run shows how far it got
#   recurrent decode and recurrent fwd+bwd benchmark (bench_recurrent.py; RECURRENT_ARGS)
#   flalayer  FLA's layer alone in bench_layer.py at LAYER_TOKENS, the whole stage for its first call (its
#             autotuning took over 175 s on 2026-12-01; the tuned configs are packed for the next machine)
#   layer     kdakit's KimiDeltaAttention against FLA's (needs .whl/layer): examples/train_tiny.py --device cuda
#             (TRAIN_TINY_ARGS; LAYER_TRAIN_S, default half the stage), the GPU comparison test (LAYER_TEST_S,
#             default 120) and bench_layer.py at LAYER_TOKENS (131072) with the rest
#   traintiny examples/train_tiny.py --device cuda alone (TRAIN_TINY_ARGS)
#   tune      launch-config sweep of the windowed backward (tune_windowed.py); tunecompile only
#             compiles its variants (parallel processes)
#   flawarm   FLA's autotuning only, in the background, one process per head count of FLA_SHAPES;
#             `wait` joins it
#   vsfla     kdakit beside FLA 0.6.0, three gates x four protocol shapes (bench_vs_fla.py chunk;
#             VSFLA_ARGS, e.g. "--gates safe,softplus"): $OUT/chunk_vs_fla.json, its budget the stage's limit
#   layervsfla kdakit's KimiDeltaAttention beside FLA's at 8K and 32K (bench_vs_fla.py layer; LAYERVSFLA_ARGS;
#             fla.layers imports with the transformers stub, TRANSFORMERS_STUB, default .stub/transformers_stub)
# A failed correctness gate drops kdakit's timings from chunk and sweep (IGNORE_GATE=1 times it anyway).
# Every stage's file is written as it goes, so a stage cut by its limit keeps what it measured.
# Cells are MBSxSEQ:H (docs/spec.md §3), MBSxSEQ:H/HV (grouped value heads) and MBSxSEQ:H:softplus (the
# unbounded gate). Triton autotuning is cached on disk (TRITON_CACHE_DIR); all tuned configs are
# packed into $OUT/triton_autotune.tgz (put it at .tcache/triton_autotune.tgz for the next machine),
# and $OUT/autotune_new.json lists what this run tuned (an entry whose kernel and key were already
# in the carried cache means the carried file was not found: a different Triton / environment).
# At the end every file under $OUT but stages.log is packed into $OUT/results.tgz (PACK_OUT=0: left loose),
# since the device tool returns only a few files; a command that reads results after run_gpu.sh reads them
# from the archive (or sets PACK_OUT=0).
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env warm chunk fla sweep profile tests)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

TOTAL_LIMIT=${TOTAL_LIMIT:-525}
END_RESERVE=${END_RESERVE:-10}
left() { echo $(( T0 + TOTAL_LIMIT - END_RESERVE - $(date +%s) )); }
# stage_limit NAME DEFAULT: STAGE_LIMIT_<NAME> (or DEFAULT; "rest" = all that is left), capped by what is left.
stage_limit() {
    local var="STAGE_LIMIT_$1" want l
    want=${!var:-$2}
    l=$(left)
    [ "$want" = rest ] && want=$l
    [ "$l" -lt "$want" ] && want=$l
    echo "$want"
}

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# FLA's layer (fla.layers, in flash-linear-attention, which needs einops and transformers) for the `layer`
# stage: wheels in .whl/layer (pip download -d .whl/layer flash-linear-attention==0.6.0 with its
# dependencies, for the device's Python), installed into the device's environment, so that what it already
# has (torch, numpy, ...) stays as it is and only the missing packages come from the carried wheels.
if ls .whl/layer/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-cache-dir --find-links .whl/layer --find-links .whl \
        flash-linear-attention==0.6.0 >"$OUT/pip_layer.log" 2>&1 \
        || echo "run_gpu.sh: installing FLA's layer failed (see pip_layer.log)" | tee -a "$OUT/stages.log"
fi
# Autotune results are cached on disk so each fresh measurement process reuses them. Triton keeps
# them at $TRITON_CACHE_DIR/<base32 of the tuning hash>/<kernel>.autotune.json; the carried archive
# holds exactly those relative paths (./<hash>/<kernel>.autotune.json), so it unpacks in place.
export TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kdakit_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton_autotune.tgz ] && tar xzf .tcache/triton_autotune.tgz -C "$TRITON_CACHE_DIR"
export FLA_DISABLE_BACKEND_DISPATCH=1
# The docs/spec.md §3 shapes; the 128K cell second, so that a stage cut by its limit loses an 8K cell, not it.
SHAPES=${SHAPES:-1x8192:96,1x131072:96,8x8192:16,1x8192:128}
FLA_SHAPES=${FLA_SHAPES:-$SHAPES}
# 2K..128K tokens, H 16..128, one GVA cell (H16, HV32) and one softplus-gate cell. Head counts are
# those of the protocol shapes, which the `fla` stage has compiled and whose autotuning is carried
# (.tcache holds H 16/32/48/96/128, not 64); the GVA cell's (H, HV) keys are tuned by `warm`.
SWEEP_SHAPES=${SWEEP_SHAPES:-1x2048:96,8x2048:16,1x32768:128,2x65536:16,1x8192:96:softplus,1x8192:16/32}
autotune_count() { find "$TRITON_CACHE_DIR" -name "*.autotune.json" 2>/dev/null | wc -l; }
rc=0

# The file holding a finished correctness gate: gate.json (warm) or chunk_kdakit.json (chunk).
gate_file() {
    local f
    for f in "$OUT/gate.json" "$OUT/chunk_kdakit.json"; do
        [ -f "$f" ] && python3 -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('correctness_gate') else 1)" \
            "$f" 2>/dev/null && { echo "$f"; return 0; }
    done
    return 1
}
gate_args() {  # gate_args MODE: how a timed stage treats the gate (MODE run: run it when none exists)
    local f
    if [ "${IGNORE_GATE:-0}" = 1 ]; then echo "--skip-gate"; return; fi
    if f=$(gate_file); then echo "--gate-from $f"; return; fi
    [ "$1" = run ] || echo "--skip-gate"
}

stage_env() {
    KDAKIT_GIT_SHA=${KDAKIT_GIT_SHA:-} timeout -k 5 "$1" python3 - <<'PY' | tee "$OUT/env.json"
import datetime, importlib.metadata as md, json, os, platform, torch, triton
# The device copy of the tree has no .git: the caller passes the commit in KDAKIT_GIT_SHA.
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
try:  # set variables that change Triton's cache keys (then the carried autotune files are not found)
    from triton._C.libtriton import get_cache_invalidating_env_vars
    invalidating = get_cache_invalidating_env_vars()
except Exception as exc:
    invalidating = f"unknown ({exc})"
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "cuda": torch.version.cuda, "fla": version("fla-core"), "python": platform.python_version(),
                  "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2 ** 30,
                  "triton_cache_invalidating_env": invalidating,
                  "git_sha": os.environ.get("KDAKIT_GIT_SHA") or "unknown",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}))
PY
    return "${PIPESTATUS[0]}"
}

stage_warm() {
    local lim=$1 pids=() sweep_warm fw kw c i=0 grc
    sweep_warm=$(python3 benchmarks/bench_chunk.py --warm-cells "$SWEEP_SHAPES") || sweep_warm=""
    fw=${FLAWARM_SHAPES-$sweep_warm}
    if [ -n "$fw" ]; then
        if [ "${FLAWARM_PARALLEL:-0}" = 1 ]; then
            for c in ${fw//,/ }; do
                i=$((i + 1))
                timeout -k 5 "$lim" python3 -m kdakit.memory.measure_worker --backend fla --cells "$c" --warmup-only \
                    >"$OUT/warm_fla_$i.log" 2>&1 &
                pids+=($!)
            done
        else
            timeout -k 5 "$lim" python3 -m kdakit.memory.measure_worker --backend fla --cells "$fw" --warmup-only \
                >"$OUT/warm_fla.log" 2>&1 &
            pids+=($!)
        fi
    fi
    i=0
    for kw in "${KDAWARM_SHAPES-1x1024:96,2x1024:16}" "${KDAWARM_VARIANTS-$sweep_warm}"; do
        [ -n "$kw" ] || continue
        i=$((i + 1))
        timeout -k 5 "$lim" python3 -m kdakit.memory.measure_worker --backend kdakit --cells "$kw" --warmup-only \
            >"$OUT/warm_kdakit_$i.log" 2>&1 &
        pids+=($!)
    done
    echo "warm: background FLA [$fw], kdakit [${KDAWARM_SHAPES-1x1024:96,2x1024:16}] [${KDAWARM_VARIANTS-$sweep_warm}]" \
        | tee -a "$OUT/run.log"
    timeout -k 5 "$lim" python3 benchmarks/bench_chunk.py --backends kdakit --gate-only --out "$OUT/gate.json" 2>&1 \
        | tee -a "$OUT/run.log"
    grc=${PIPESTATUS[0]}
    for c in "${pids[@]}"; do wait "$c"; done
    # One line per warmed cell: status and the small warm-up's seconds (compile + autotune).
    python3 - "$OUT" <<'PY' | tee -a "$OUT/run.log"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "warm_*.log"))):
    for line in open(path, errors="replace"):
        if line.startswith("KDAKIT_MEM_RESULT "):
            r = json.loads(line.split(" ", 1)[1])
            print(f"warm {r.get('backend')} {r.get('cell')}: {r.get('status')}, small warm-up "
                  f"{r.get('warmup_s') or 0:.1f} s, cell {r.get('wall_s') or 0:.1f} s {r.get('message') or ''}")
PY
    return "$grc"
}

stage_chunk() {
    # shellcheck disable=SC2046
    timeout -k 5 "$1" python3 benchmarks/bench_chunk.py --backends kdakit --shapes "$SHAPES" $(gate_args run) \
        --cell-timeout 150 --budget-s $(( $1 - 5 )) --out "$OUT/chunk_kdakit.json" 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_fla() {
    timeout -k 5 "$1" python3 benchmarks/bench_chunk.py --backends fla --skip-gate --shapes "$FLA_SHAPES" \
        --cell-timeout "$1" --budget-s $(( $1 - 5 )) --out "$OUT/chunk_fla.json" 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_sweep() {
    local mode=()
    [ "${SWEEP_PROCESS:-shared}" = shared ] && mode=(--shared-process)
    # shellcheck disable=SC2046
    timeout -k 5 "$1" python3 benchmarks/bench_chunk.py --backends "${SWEEP_BACKENDS:-kdakit,fla}" \
        --shapes "$SWEEP_SHAPES" $(gate_args skip) "${mode[@]}" --reps "${SWEEP_REPS:-1}" \
        --timing-runs "${SWEEP_TIMING_RUNS:-5}" --warmup-iters "${SWEEP_WARMUP_ITERS:-1}" \
        --cell-timeout "$1" --budget-s $(( $1 - 5 )) --out "$OUT/sweep.json" 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_profile() {
    timeout -k 5 "$1" python3 benchmarks/profile_chunk.py --shapes "${PROFILE_SHAPES:-1x8192:96}" \
        --gate "${PROFILE_GATE:-safe}" --out "$OUT/profile.json" 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_tests() {
    # shellcheck disable=SC2086
    KDAKIT_TEST_TIER=gpu timeout -k 5 "$1" python3 -m pytest -v -m gpu -rs ${GPU_TEST_FLAGS:---timeout=300} ${GPU_TESTS:-tests/gpu} 2>&1 \
        | tee "$OUT/gpu_tests.log"
    return "${PIPESTATUS[0]}"
}

stage_recurrent() {
    # shellcheck disable=SC2086
    timeout -k 5 "$1" python3 benchmarks/bench_recurrent.py --out "$OUT/recurrent_bench.json" ${RECURRENT_ARGS:-} 2>&1 \
        | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_flalayer() {
    timeout -k 5 "$1" python3 benchmarks/bench_layer.py --tokens "${LAYER_TOKENS:-131072}" --backends fla \
        --timeout $(( $1 - 10 )) --out "$OUT/layer_fla.json" 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_layer() {
    # kdakit's layer against FLA's. train_tiny --device cuda first (both layers, same weights and data): FLA's
    # model tunes FLA's kernels for its config in its first steps, alone on the GPU (the step time it reports is
    # the median after 3 warm-up steps); then the GPU test comparing the layers (train_tiny's layer config, so
    # cached by then); then bench_layer at LAYER_TOKENS (a fresh process per backend, FLA's with what is left).
    local lim=$1 t0 r=0 rest
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout -k 5 "${LAYER_TRAIN_S:-$(( lim / 2 ))}" python3 examples/train_tiny.py --device cuda --quiet \
        --out "$OUT/train_tiny" ${TRAIN_TINY_ARGS:-} 2>&1 | tee "$OUT/train_tiny.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || r=1
    rest=$(( lim - ($(date +%s) - t0) - 5 ))
    KDAKIT_TEST_TIER=gpu timeout -k 5 "$(( rest < ${LAYER_TEST_S:-120} ? rest : ${LAYER_TEST_S:-120} ))" \
        python3 -m pytest -q -m gpu -rs --timeout=300 tests/gpu/nn/test_nn_layer_gpu.py -k against_fla 2>&1 \
        | tee "$OUT/layer_vs_fla_test.log" | tail -n 5
    [ "${PIPESTATUS[0]}" -eq 0 ] || r=1
    rest=$(( lim - ($(date +%s) - t0) - 5 ))
    if [ "$rest" -gt 30 ]; then
        timeout -k 5 "$rest" python3 benchmarks/bench_layer.py --tokens "${LAYER_TOKENS:-131072}" \
            --backends kdakit,fla --timeout $(( rest - 10 )) --out "$OUT/layer.json" 2>&1 | tee -a "$OUT/run.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || r=1
    else
        echo "layer: bench_layer skipped, ${rest} s left" | tee -a "$OUT/run.log"
        r=1
    fi
    return "$r"
}

stage_traintiny() {
    # train_tiny --device cuda alone (TRAIN_TINY_ARGS): its two models, kdakit's and FLA's, side by side
    # shellcheck disable=SC2086
    timeout -k 5 "$1" python3 examples/train_tiny.py --device cuda --quiet --out "$OUT/train_tiny" \
        ${TRAIN_TINY_ARGS:-} 2>&1 | tee "$OUT/train_tiny.log"
    return "${PIPESTATUS[0]}"
}

stage_tune() {
    timeout -k 5 "$1" python3 benchmarks/tune_windowed.py --out "$OUT/tune_windowed.json" 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_tunecompile() {
    timeout -k 5 "$1" python3 benchmarks/tune_windowed.py --compile-all --out /dev/null 2>&1 | tail -n 20
    return 0
}

stage_flawarm() {
    # In the background, one process per head count (autotune keys hold head counts, not T, so a
    # 2K-token warm-up tunes every shape of that head count); `wait` or the script's end joins it.
    local h heads
    heads=$(echo "$FLA_SHAPES" | tr ',' '\n' | cut -d: -f2 | sort -u)
    for h in $heads; do
        timeout -k 5 "$1" python3 -m kdakit.memory.measure_worker --backend fla --mbs 1 --seq 2048 --heads "$h" \
            --warmup-only >"$OUT/flawarm_$h.log" 2>&1 &
    done
    return 0
}

stage_vsfla() {
    # shellcheck disable=SC2086
    timeout -k 10 "$1" python3 benchmarks/bench_vs_fla.py chunk --out "$OUT" --budget-s $(( $1 - 10 )) \
        ${VSFLA_ARGS:-} 2>&1 | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_layervsfla() {
    # shellcheck disable=SC2086
    timeout -k 10 "$1" python3 benchmarks/bench_vs_fla.py layer --out "$OUT" --budget-s $(( $1 - 10 )) \
        --transformers-stub "${TRANSFORMERS_STUB:-.stub/transformers_stub}" ${LAYERVSFLA_ARGS:-} 2>&1 \
        | tee -a "$OUT/run.log"
    return "${PIPESTATUS[0]}"
}

stage_wait() {
    wait
    tail -q -n 2 "$OUT"/flawarm_*.log 2>/dev/null
    return 0
}

declare -A DEFAULT_LIMIT=([env]=10 [warm]=160 [chunk]=100 [fla]=150 [sweep]=80 [profile]=20 [tests]=rest
                          [recurrent]=150 [flalayer]=300 [layer]=300 [traintiny]=200 [tune]=300 [tunecompile]=200 [flawarm]=300 [wait]=rest
                          [vsfla]=rest [layervsfla]=rest)
for s in "${stages[@]}"; do
    if [ -z "${DEFAULT_LIMIT[$s]+x}" ]; then
        echo "run_gpu.sh: unknown stage '$s' (skipped)" | tee -a "$OUT/stages.log"
        rc=1
        continue
    fi
    lim=$(stage_limit "$s" "${DEFAULT_LIMIT[$s]}")
    start=$(( $(date +%s) - T0 ))
    if [ "$lim" -lt 5 ]; then
        echo "stage $s: skipped at +${start} s, limit ${lim} s (what is left of TOTAL_LIMIT=${TOTAL_LIMIT} s, or its STAGE_LIMIT) < 5 s" | tee -a "$OUT/stages.log"
        rc=1
        continue
    fi
    n0=$(autotune_count)
    echo "stage $s: start at +${start} s, limit ${lim} s" | tee -a "$OUT/stages.log"
    "stage_$s" "$lim"
    src=$?
    [ "$src" -eq 0 ] || rc=1
    end=$(( $(date +%s) - T0 ))
    echo "stage $s: rc $src, took $(( end - start )) s (limit ${lim} s), at +${end} s;" \
         "autotune files $n0 -> $(autotune_count)" | tee -a "$OUT/stages.log"
done
wait

compare_args=()
[ -f "$OUT/chunk_kdakit.json" ] && [ -f "$OUT/chunk_fla.json" ] \
    && compare_args+=(--kdakit "$OUT/chunk_kdakit.json" --fla "$OUT/chunk_fla.json")
[ -f "$OUT/sweep.json" ] && compare_args+=(--sweep "$OUT/sweep.json")
[ -f "$OUT/env.json" ] && compare_args+=(--env "$OUT/env.json")
if [ ${#compare_args[@]} -gt 0 ] && { [ -f "$OUT/chunk_fla.json" ] || [ -f "$OUT/sweep.json" ]; }; then
    python3 benchmarks/compare_chunk.py "${compare_args[@]}" --out "$OUT/chunk_vs_fla.json" || rc=1
fi
# What this run tuned, beside what it carried in.
python3 - "$TRITON_CACHE_DIR" .tcache/triton_autotune.tgz "$OUT/autotune_new.json" <<'PY' || true
import json, os, sys, tarfile
cache, carried_tgz, out = sys.argv[1:4]
carried, carried_keys = set(), set()
if os.path.exists(carried_tgz):
    with tarfile.open(carried_tgz) as t:
        for m in t.getmembers():
            if m.isfile() and m.name.endswith(".autotune.json"):
                carried.add(os.path.normpath(m.name))
                try:
                    key = json.load(t.extractfile(m)).get("key")
                except Exception:
                    key = None
                carried_keys.add((os.path.basename(m.name), json.dumps(key)))
now = sorted(os.path.normpath(os.path.relpath(os.path.join(d, f), cache))
             for d, _, fs in os.walk(cache) for f in fs if f.endswith(".autotune.json"))
new = []
for rel in now:
    if rel in carried:
        continue
    try:
        key = json.load(open(os.path.join(cache, rel))).get("key")
    except Exception:
        key = None
    new.append({"file": rel, "kernel": os.path.basename(rel)[:-len(".autotune.json")], "key": key,
                "retuned_although_carried": (os.path.basename(rel), json.dumps(key)) in carried_keys})
missed = sum(r["retuned_although_carried"] for r in new)
json.dump({"carried": len(carried), "now": len(now), "tuned_in_this_run": len(new), "carried_but_missed": missed,
           "new": new}, open(out, "w"), indent=1)
print(f"autotune cache: {len(carried)} files carried, {len(now)} now, {len(new)} tuned in this run"
      + (f"; {missed} of them had the same kernel and key as a carried file (the carried file was not found)"
         if missed else ""))
PY
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/triton_autotune.tgz" -T -)
echo "run_gpu.sh: done at +$(( $(date +%s) - T0 )) s, rc $rc" | tee -a "$OUT/stages.log"
# The device tool returns only a handful of files from $OUT (on 2026-12-01 eight came back and the rest were
# left out, a train_tiny log among them), so by default everything goes into one archive, results.tgz, beside
# stages.log; PACK_OUT=0 leaves the files loose. Unpack with: tar xzf results.tgz
if [ "${PACK_OUT:-1}" = 1 ]; then
    (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name stages.log -printf '%P\n' \
        | tar czf results.tgz -T - --remove-files) || echo "run_gpu.sh: packing $OUT failed" >&2
fi
exit $rc
