#!/usr/bin/env bash
# gpu_check.sh: on a machine with a GPU and a CUDA build of torch (no network needed), from the
# repository root:
#
#     bash benchmarks/gpu_check.sh
#
#   1. builds nalu_cuda in place for the local GPU (TORCH_CUDA_ARCH_LIST from its capability,
#      e.g. 9.0 on H100/H200; setup.py falls back to setuptools' compiler loop without ninja);
#   2. checks the build (.ci/check_cuda_build.py: every op has a CUDA kernel);
#   3. runs the CUDA tests, then the rest of the suite (skipped, with a note, if pytest is missing);
#   4. runs the GPU benchmarks (benchmarks/bench_gpu.py), which check correctness before timing.
# Logs and results (bench_gpu.json / .csv / .md, build.log, pytest and bench logs) go to $OUT if
# set, else benchmarks/results/. A summary and the benchmark table are printed last. Each stage has
# a time limit so that the whole script stays under 8 minutes on one H200.
#
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default: the GPU's capability),
# MAX_JOBS (default: the number of CPUs), CUDA_HOME (default: setup.py's choice),
# BUILD_TIMEOUT / TEST_TIMEOUT / REST_TIMEOUT / BENCH_TIMEOUT (seconds; 150 + 150 + 45 + 135 = 8 min),
# GPU_CHECK_REST=0 (skip the non-CUDA tests), BENCH_ARGS (extra bench_gpu.py arguments).
# Exit status: 0 when every stage passed, 1 otherwise.
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
BUILD_TIMEOUT="${BUILD_TIMEOUT:-150}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
REST_TIMEOUT="${REST_TIMEOUT:-45}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-135}"
T0=$(date +%s)
declare -A STATUS
ORDER=()

stage() {  # stage NAME STATUS
  STATUS[$1]="$2"
  ORDER+=("$1")
  echo "== [$1] $2 ($(( $(date +%s) - T0 )) s elapsed)"
}

finish() {
  echo
  echo "================ gpu_check summary ================"
  "$PY" - <<'EOF' 2>/dev/null || true
import torch
print(f"torch {torch.__version__} CUDA {torch.version.cuda}; GPU: "
      + (f"{torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))})"
         if torch.cuda.is_available() else "none"))
EOF
  local failed=0
  for s in "${ORDER[@]}"; do
    echo "  $s: ${STATUS[$s]}"
    case "${STATUS[$s]}" in ok*|skipped*) ;; *) failed=1 ;; esac
  done
  echo "  results and logs: $OUT_DIR ($(( $(date +%s) - T0 )) s in all)"
  if [ -f "$OUT_DIR/bench_gpu.md" ] && [ "${STATUS[bench]:-}" != "" ]; then
    echo
    # The short table (the first lines of bench_gpu.md, up to the full per-row section).
    sed -n '/^nalu_cuda GPU benchmark/,/^$/p' "$OUT_DIR/bench_gpu.md"
  fi
  exit $failed
}

# ---- 0. the machine ----------------------------------------------------------------------------
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  stage environment "FAILED: no CUDA device visible to $PY (torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1))"
  finish
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
echo "python: $("$PY" --version 2>&1) at $(command -v "$PY"); nvcc: ${NVCC:-not found}; arch: $TORCH_CUDA_ARCH_LIST; jobs: $MAX_JOBS"
"$PY" -c "import ninja" 2>/dev/null || command -v ninja >/dev/null || echo "ninja not found: building without it"
stage environment "ok ($TORCH_CUDA_ARCH_LIST)"

# ---- 1. build ----------------------------------------------------------------------------------
rm -f nalu_cuda/_C*.so
if NALU_CUDA_FORCE_CUDA=1 timeout "$BUILD_TIMEOUT" "$PY" setup.py build_ext --inplace >"$OUT_DIR/build.log" 2>&1; then
  stage build "ok"
else
  rc=$?
  tail -40 "$OUT_DIR/build.log"
  stage build "FAILED (exit $rc; see build.log)"
  finish
fi

# ---- 2. the build has every CUDA kernel --------------------------------------------------------
if "$PY" .ci/check_cuda_build.py >"$OUT_DIR/check_cuda_build.log" 2>&1; then
  stage check_cuda_build "ok"
else
  cat "$OUT_DIR/check_cuda_build.log"
  stage check_cuda_build "FAILED (see check_cuda_build.log)"
fi

# ---- 3. tests ----------------------------------------------------------------------------------
if "$PY" -c "import pytest" 2>/dev/null; then
  export NALU_CUDA_REQUIRE_EXT=1
  run_pytest() {  # run_pytest NAME LOG TIMEOUT ARGS...
    local name=$1 log=$2 limit=$3
    shift 3
    timeout "$limit" "$PY" -m pytest -q -x -p no:cacheprovider "$@" >"$OUT_DIR/$log" 2>&1
    local rc=$?
    local last
    last="$(tail -1 "$OUT_DIR/$log")"
    case $rc in
      0) stage "$name" "ok: $last" ;;
      5) stage "$name" "skipped: no tests collected" ;;
      124) tail -15 "$OUT_DIR/$log"; stage "$name" "FAILED: over ${limit} s" ;;
      *) tail -40 "$OUT_DIR/$log"; stage "$name" "FAILED (exit $rc): $last" ;;
    esac
  }
  run_pytest tests_cuda pytest_cuda.log "$TEST_TIMEOUT" python_tests/test_cuda.py
  if [ "${GPU_CHECK_REST:-1}" != "0" ]; then
    run_pytest tests_rest pytest_rest.log "$REST_TIMEOUT" python_tests --ignore=python_tests/test_cuda.py
  fi
else
  stage tests "skipped: pytest is not installed for $PY (the benchmark still checks correctness)"
fi

# ---- 4. benchmarks -----------------------------------------------------------------------------
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT" "$PY" benchmarks/bench_gpu.py --out "$OUT_DIR" ${BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench.log" | grep '^\[bench\]\|CORRECTNESS\|^  - \|Error\|error'
rc=${PIPESTATUS[0]}
case $rc in
  0) stage bench "ok" ;;
  124) stage bench "FAILED: over ${BENCH_TIMEOUT} s (partial log in bench.log)" ;;
  *) tail -30 "$OUT_DIR/bench.log"; stage bench "FAILED (exit $rc; see bench.log)" ;;
esac
finish
