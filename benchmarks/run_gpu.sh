#!/usr/bin/env bash
# The GPU tier and the benchmarks in one go, on the H200 (device tool), results under $OUT.
#
#   bash benchmarks/run_gpu.sh [STAGE ...]   stages, in priority order:
#       env chunk recurrent tests fla        (default: all; also: profile tunecompile tune flawarm wait)
#   chunk     correctness gate + kdakit at the four SPEC §3 shapes (bench_chunk.py)
#   recurrent decode and recurrent fwd+bwd benchmark (bench_recurrent.py)
#   tests     the GPU test tier (tests marked gpu)
#   fla       FLA 0.6.0 at SPEC shapes in the same run (FLA_SHAPES; autotuning takes minutes)
#   profile   per-kernel CUDA time of kdakit's forward and backward (profile_chunk.py, PROFILE_SHAPES)
#   tune      launch-config sweep of the windowed backward (tune_windowed.py); tunecompile only
#             compiles its variants (parallel processes), e.g. while flawarm runs
#   flawarm   FLA's autotuning only, in the background, one process per head count of FLA_SHAPES;
#             its times are discarded, only the tuned configs are kept; `wait` joins it
# Each stage has a wall-clock limit (STAGE_LIMIT_<stage>, seconds) so the whole call fits the
# device's 10-minute command limit and every stage's file is written even if a later one is cut.
# FLA 0.6.0 travels as a wheel in .whl/ (pure Python; einops is on the machine).
# Triton autotuning (FLA's takes minutes per head count) is cached on disk, and the tuned
# configs are packed into $OUT/triton_autotune.tgz; put that file at .tcache/triton_autotune.tgz
# (and carry .tcache) so the next machine skips the tuning.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env chunk recurrent tests fla)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# Autotune results are cached on disk so each fresh measurement process reuses them.
export TRITON_CACHE_AUTOTUNING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kdakit_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton_autotune.tgz ] && tar xzf .tcache/triton_autotune.tgz -C "$TRITON_CACHE_DIR"
export FLA_DISABLE_BACKEND_DISPATCH=1
SHAPES=${SHAPES:-1x8192:96,8x8192:16,1x8192:128,1x131072:96}
FLA_SHAPES=${FLA_SHAPES:-$SHAPES}
rc=0

if has env; then
    KDAKIT_GIT_SHA=${KDAKIT_GIT_SHA:-} python3 - <<'PY' | tee "$OUT/env.json"
import datetime, json, os, torch, triton
# The device copy of the tree has no .git: the caller passes the commit in KDAKIT_GIT_SHA.
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "cuda": torch.version.cuda, "git_sha": os.environ.get("KDAKIT_GIT_SHA") or "unknown",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}))
PY
fi

if has flawarm; then
    # In the background, so kdakit's compiles (CPU) can share the machine's 16 cores; the stage
    # `wait` (or the script's end) joins it before anything is timed. Autotune keys hold head
    # counts, not T, so a 2K-token warm-up tunes every shape of that head count.
    heads=$(echo "$FLA_SHAPES" | tr ',' '\n' | cut -d: -f2 | sort -u)
    for h in $heads; do
        timeout "${STAGE_LIMIT_flawarm:-300}" python3 -m kdakit.memory.measure_worker --backend fla --mbs 1 \
            --seq 2048 --heads "$h" --reps 1 --timing-runs 1 --warmup-iters 0 >"$OUT/flawarm_$h.log" 2>&1 &
    done
fi

if has tunecompile; then
    timeout "${STAGE_LIMIT_tunecompile:-200}" python3 benchmarks/tune_windowed.py --compile-all --out /dev/null \
        2>&1 | tail -n 20
fi

if has wait; then
    wait
    has flawarm && tail -n 2 "$OUT"/flawarm_*.log
fi

if has profile; then
    timeout "${STAGE_LIMIT_profile:-150}" python3 benchmarks/profile_chunk.py --shapes "${PROFILE_SHAPES:-1x8192:96}" \
        --out "$OUT/profile.json" 2>&1 | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if has tune; then
    timeout "${STAGE_LIMIT_tune:-300}" python3 benchmarks/tune_windowed.py --out "$OUT/tune_windowed.json" 2>&1 \
        | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if has chunk; then
    timeout "${STAGE_LIMIT_chunk:-240}" python3 benchmarks/bench_chunk.py --backends kdakit --shapes "$SHAPES" \
        --cell-timeout 120 --out "$OUT/chunk_kdakit.json" 2>&1 | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if has recurrent; then
    timeout "${STAGE_LIMIT_recurrent:-100}" python3 benchmarks/bench_recurrent.py --out "$OUT/recurrent_bench.json" \
        2>&1 | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if has tests; then
    KDAKIT_TEST_TIER=gpu timeout "${STAGE_LIMIT_tests:-100}" python3 -m pytest -q -m gpu -rs -x \
        ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

if has fla; then
    timeout "${STAGE_LIMIT_fla:-240}" python3 benchmarks/bench_chunk.py --backends fla --skip-gate --shapes "$FLA_SHAPES" \
        --cell-timeout "${STAGE_LIMIT_fla:-240}" --out "$OUT/chunk_fla.json" 2>&1 | tee -a "$OUT/run.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
wait
if [ -f "$OUT/chunk_kdakit.json" ] && [ -f "$OUT/chunk_fla.json" ]; then
    python3 benchmarks/compare_chunk.py --kdakit "$OUT/chunk_kdakit.json" --fla "$OUT/chunk_fla.json" \
        --out "$OUT/chunk_vs_fla.json" || rc=1
fi
(cd "$TRITON_CACHE_DIR" && find . -name "*.autotune.json" | tar czf "$OUT/triton_autotune.tgz" -T -)
exit $rc
