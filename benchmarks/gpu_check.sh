#!/usr/bin/env bash
# gpu_check.sh: the one-shot check of the CUDA kernels on a lent GPU machine (CUDA build of torch,
# nvcc, no network), from the repository root of a copy of the working tree (no .git needed):
#
#     NALU_CUDA_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_check.sh [COMMIT]
#     GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh     # on a CPU machine: every stage's logic
#
# Stages, each time-boxed inside one overall budget (GPU_CHECK_BUDGET seconds, default 420: the
# whole run ends within 8 minutes of wall time with a minute of margin); a stage gets at most its
# own limit and never more than what is left, and the run goes on after a failed stage:
#   environment  GPU, driver, nvcc, CPU model, Python.h and g++ (a torch extension can build), commit;
#                a dry run also checks that a g++ linking libstdc++ statically is refused
#   build        setup.py build_ext --inplace for the local GPU's architecture        (limit 170 s)
#   kernels      .ci/check_cuda_build.py: every op has a CUDA kernel                   (limit 20 s)
#   tests        python_tests/test_cuda.py without the torch.compile cases, incl. CUDA-graph capture
#                and replay and the > 2^31-element cases, and test_native_step_cuda.py (the static
#                task's gradient kernel, the trainer's native resident step in a graph);
#                --maxfail=50 -rfE                                                (limit 110 s)
#   sanitizer    compute-sanitizer memcheck and racecheck on one rowwise-path forward and backward and
#                one call of the static task's gradient kernel, when the tool is there   (limit 2 x 40 s)
#   bench        benchmarks/bench_gpu.py: copy bandwidth, ops (per call and graph replay), the
#                memory-bound shape, the large shape vs cuBLAS, 100-seed training       (limit 110 s)
#   profile      ncu (Nsight Compute), when the tool is there: speed-of-light, occupancy and launch
#                sections of one launch each of the memory-bound forward (rowwise_forward_kernel) and
#                the static step's gradient kernel (static_grad_kernel); informational: a failing
#                profiler (no counters on some runtimes) is recorded as skipped      (limit 2 x 30 s)
#   compile      last and separate (cold torch.compile / Triton): the compile tests of
#                test_cuda.py, then bench_gpu.py --stages compile                     (what is left)
# Results: at most 8 files in $OUT (else benchmarks/results/gpu_check/): gpu_check.log (this
# script's output, the benchmark's log and the summary, appended after every stage), build.log, tests.log,
# sanitizer.log, bench_gpu.json/.csv/.md (rewritten after each benchmark stage), ncu.log. Exit status: 0
# when every stage passed or was skipped for want of a tool, 1 otherwise.
# Environment: PYTHON (python3), TORCH_CUDA_ARCH_LIST (the GPU's capability), MAX_JOBS (nproc),
# NALU_CUDA_COMMIT (or the first argument; the copy has no .git), GPU_CHECK_BUDGET,
# GPU_CHECK_DRY_RUN=1 (no build, no GPU: tests collected only, the benchmark's --device cpu
# --dry-run without the compile stage, the sanitizer's target run without the tool, every limit
# 3x; to test this script, its result files and its time-boxing on a CPU; .ci/run does).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
BUDGET="${GPU_CHECK_BUDGET:-420}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
export NALU_CUDA_COMMIT="${1:-${NALU_CUDA_COMMIT:-unknown}}"
export PYTHONUNBUFFERED=1 NALU_CUDA_REQUIRE_EXT=1
T0=$(date +%s)
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
SUMMARY=()
FAILED=0

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
limit() {  # limit STAGE_LIMIT: the stage's limit (3x in a dry run: a CPU is slower), capped by what is left
  local l want=$1; l=$(left)
  [ "$DRY" = 1 ] && want=$(( want * 3 ))
  (( l < want )) && echo "$l" || echo "$want"
}
record() {  # record NAME STATUS: one summary line, the summary rewritten at the end of the log
  SUMMARY+=("$1: $2 (at $(elapsed) s)")
  case "$2" in ok*|skipped*) ;; *) FAILED=1 ;; esac
  echo "== [$1] $2 ($(elapsed) s of $BUDGET)"
}
run_boxed() {  # run_boxed NAME LIMIT LOGFILE CMD...: runs CMD under the time box, appends to LOGFILE
  local name=$1 lim=$2 log=$3
  shift 3
  if (( lim < 5 )); then record "$name" "skipped: out of time"; return 0; fi
  echo "-- $name (limit $lim s): $*" >>"$log"
  timeout --kill-after=10 "$lim" "$@" >>"$log" 2>&1
  local rc=$?
  case $rc in
    0) record "$name" "ok: $(tail -n 1 "$log")" ;;
    124|137) tail -n 15 "$log"; record "$name" "FAILED: over its $lim s (partial output in $(basename "$log"))" ;;
    *) tail -n 30 "$log"; record "$name" "FAILED (exit $rc): $(tail -n 1 "$log")" ;;
  esac
  return $rc
}
finish() {
  echo
  echo "================ gpu_check summary (commit $NALU_CUDA_COMMIT, $(elapsed) s) ================"
  printf '  %s\n' "${SUMMARY[@]}"
  [ -f "$OUT_DIR/bench_gpu.md" ] && sed -n '/^| stage/,/^$/p' "$OUT_DIR/bench_gpu.md" | head -n 150
  echo "  results: $OUT_DIR ($(ls "$OUT_DIR" | wc -l) files)"
  exit $FAILED
}
trap finish EXIT

# ---- environment -------------------------------------------------------------------------------
echo "commit $NALU_CUDA_COMMIT; $(date -u '+%Y-%m-%d %H:%M UTC'); budget $BUDGET s; dry run: $DRY"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(OMP_NUM_THREADS= nproc) cores"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total \
  --format=csv,noheader
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
echo "nvcc: ${NVCC:-not found} $([ -n "$NVCC" ] && "$NVCC" --version | tail -n 1)"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'TF32 matmul', torch.backends.cuda.matmul.allow_tf32)"
# The bench's training stage and the native step's trainer tests import nalu_cuda.experiments, whose
# grid-world task needs gymnasium (requirements.txt): say so now rather than fail there.
"$PY" -c "import gymnasium" 2>/dev/null ||
  echo "WARNING: gymnasium is not installed: the training stage and the trainer tests will fail to import" \
       "nalu_cuda.experiments (offline: pip install --no-index --find-links DIR gymnasium farama-notifications)"
# A torch extension needs the Python headers and a C++ compiler: check before spending the build.
ENV_OK=1
PYINC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[ -f "$PYINC/Python.h" ] || { echo "no Python.h in $PYINC"; ENV_OK=0; }
command -v "${CXX:-g++}" >/dev/null || { echo "no C++ compiler (${CXX:-g++})"; ENV_OK=0; }
rm -f /tmp/gpu_check_cxx
echo 'int main() { return 0; }' >/tmp/gpu_check_cxx.cpp
"${CXX:-g++}" -I"$PYINC" -include Python.h -o /tmp/gpu_check_cxx /tmp/gpu_check_cxx.cpp 2>&1 | tail -n 3 || ENV_OK=0
[ -x /tmp/gpu_check_cxx ] || ENV_OK=0
# A compiler that links libstdc++ statically into shared libraries (the default g++ of one GPU image)
# builds an extension that crashes in its first error message; setup.py's compiler check says so
# (setup.py _check_compiler). Take the system compiler then.
static_libstdcxx() {  # static_libstdcxx CXX: true when setup.py refuses CXX for that reason
  # (setup.py's output kept whole first: under pipefail, a pipe into grep -q would take setup.py's
  # failing exit status for the pipeline's and never report the refusal)
  local said
  said="$(CXX="$1" "$PY" setup.py --name 2>&1)"
  grep -q "own copy of libstdc++" <<<"$said"
}
if static_libstdcxx "${CXX:-g++}"; then
  if [ -x /usr/bin/g++ ] && ! static_libstdcxx /usr/bin/g++; then
    echo "${CXX:-g++} links libstdc++ statically into shared libraries: building with /usr/bin/g++ and /usr/bin/gcc"
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc
  else
    echo "${CXX:-g++} links libstdc++ statically into shared libraries and no system compiler avoids it"; ENV_OK=0
  fi
fi
if [ "$DRY" = 1 ]; then
  # The check above, tried on a compiler known to be refused: a wrapper that links libstdc++ statically.
  printf '#!/bin/sh\nexec %s -static-libstdc++ "$@"\n' "${CXX:-g++}" >/tmp/gpu_check_static_cxx
  chmod +x /tmp/gpu_check_static_cxx
  if ! static_libstdcxx /tmp/gpu_check_static_cxx; then
    record environment "FAILED: the compiler check did not refuse a g++ that links libstdc++ statically"
  else
    record environment "ok: dry run (Python.h and g++: $([ $ENV_OK = 1 ] && echo found || echo MISSING))"
  fi
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  record environment "FAILED: no CUDA device visible to $PY"
  exit
elif [ $ENV_OK = 0 ] || [ -z "$NVCC" ]; then
  record environment "FAILED: cannot build a torch CUDA extension here (Python.h, g++ or nvcc missing)"
  exit
else
  record environment "ok"
fi

# ---- build -------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  record build "skipped: dry run (uses the extension already built)"
else
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
    export TORCH_CUDA_ARCH_LIST
  fi
  export MAX_JOBS="${MAX_JOBS:-$(OMP_NUM_THREADS= nproc)}"
  rm -f nalu_cuda/_C*.so
  NALU_CUDA_FORCE_CUDA=1 run_boxed build "$(limit 170)" "$OUT_DIR/build.log" "$PY" setup.py build_ext --inplace ||
    exit  # nothing below can run without the build
fi

# ---- kernels -----------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  record kernels "skipped: dry run (no CUDA build)"
else
  run_boxed kernels "$(limit 20)" "$OUT_DIR/build.log" "$PY" .ci/check_cuda_build.py
fi

# ---- tests (the torch.compile cases come last, in the compile stage) ---------------------------
PYTEST=("$PY" -m pytest python_tests/test_cuda.py python_tests/test_native_step_cuda.py -q -p no:cacheprovider
        --maxfail=50 -rfE)
if [ "$DRY" = 1 ]; then
  run_boxed tests "$(limit 100)" "$OUT_DIR/tests.log" "${PYTEST[@]}" -k "not compile" --collect-only
else
  run_boxed tests "$(limit 110)" "$OUT_DIR/tests.log" "${PYTEST[@]}" -k "not compile"
fi

# ---- sanitizer ---------------------------------------------------------------------------------
SAN="$(command -v compute-sanitizer || true)"
[ -z "$SAN" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] && SAN="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
CASE=("$PY" benchmarks/bench_gpu.py --stages sanitize_case)
if [ "$DRY" = 1 ]; then
  echo "would run: ${SAN:-compute-sanitizer} --tool {memcheck,racecheck} --error-exitcode 1 ${CASE[*]}" >>"$OUT_DIR/sanitizer.log"
  run_boxed sanitizer "$(limit 60)" "$OUT_DIR/sanitizer.log" "${CASE[@]}" --device cpu
elif [ -z "$SAN" ]; then
  record sanitizer "skipped: compute-sanitizer not found"
else
  run_boxed memcheck "$(limit 40)" "$OUT_DIR/sanitizer.log" "$SAN" --tool memcheck --error-exitcode 1 "${CASE[@]}"
  run_boxed racecheck "$(limit 40)" "$OUT_DIR/sanitizer.log" "$SAN" --tool racecheck --error-exitcode 1 "${CASE[@]}"
fi

# ---- benchmarks --------------------------------------------------------------------------------
BENCH=("$PY" benchmarks/bench_gpu.py --out "$OUT_DIR")
[ "$DRY" = 1 ] && BENCH+=(--device cpu --dry-run)
lim=$(limit 110)
# bench_gpu.py stops starting work 10 s before its box closes, and saves after every stage.
run_boxed bench "$lim" "$LOG" "${BENCH[@]}" --deadline $(( lim - 10 ))

# ---- profile: ncu on the two kernels the GPU sections of benchmarks/RESULTS.md follow ----------
NCU="$(command -v ncu || true)"
[ -z "$NCU" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/ncu" ] && NCU="${CUDA_HOME:-/usr/local/cuda}/bin/ncu"
profile() {  # profile NAME KERNEL_REGEX SKIP BENCH_ARGS...: launch SKIP+1 of KERNEL under ncu, into ncu.log
  local name=$1 kernel=$2 skip=$3 lim rc tmp=/tmp/gpu_check_ncu_$1.log
  shift 3
  lim=$(limit 30)
  if (( lim < 10 )); then record "$name" "skipped: out of time"; return; fi
  timeout --kill-after=5 "$lim" "$NCU" --clock-control none --kernel-name "regex:$kernel" --launch-skip "$skip" \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
    "$PY" benchmarks/bench_gpu.py --out /tmp/gpu_check_profile "$@" >"$tmp" 2>&1
  rc=$?
  { echo "-- $name (limit $lim s, exit $rc)"; cat "$tmp"; } >>"$OUT_DIR/ncu.log"
  if [ $rc = 0 ] && grep -q "Duration" "$tmp"; then
    record "$name" "ok: $(grep -E '^ +Duration' "$tmp" | tail -n 1 | xargs)"
  else
    record "$name" "skipped: ncu exit $rc, no profile (see ncu.log; some runtimes give it no counters)"
  fi
}
if [ "$DRY" = 1 ]; then
  record profile "skipped: dry run (no GPU to profile)"
elif [ -z "$NCU" ]; then
  record profile "skipped: ncu not found"
else
  profile profile_forward rowwise_forward_kernel 0 --stages memory_bound --reps 1
  profile profile_step static_grad_kernel 5 --stages training --train-steps 20
fi

# ---- compile: cold torch.compile / Triton, last and separate ------------------------------------
if [ "$DRY" = 1 ]; then
  run_boxed compile_tests "$(limit 60)" "$OUT_DIR/tests.log" "${PYTEST[@]}" -k compile --collect-only
else
  run_boxed compile_tests "$(limit 90)" "$OUT_DIR/tests.log" "${PYTEST[@]}" -k compile
fi
if [ "$DRY" = 1 ]; then
  record compile_bench "skipped: dry run (a cold compile on a CPU takes minutes)"
else
  lim=$(left)
  run_boxed compile_bench "$lim" "$LOG" "${BENCH[@]}" --stages compile --append --deadline $(( lim - 10 ))
fi
