#!/usr/bin/env bash
# CI sanitizer stage: the CPU extension built with AddressSanitizer and UndefinedBehaviorSanitizer,
# and the op tests (python_tests/test_ops.py, test_layouts.py) run under it, bounded in time.
#
#     bash .ci/sanitize.sh [SRC_DIR]     # from a venv with torch and the dev requirements
#
# SRC_DIR (default .ci-asan-src) receives a copy of the tracked files, built in place, so that the
# checkout's own build stays as it is. Python itself is not instrumented, so the ASan runtime is
# preloaded (LD_PRELOAD, the usual way for an extension module) with leak detection off (the
# interpreter and torch keep allocations until exit). A heap use-after-free, a buffer overflow or
# undefined behaviour in the extension's code aborts the test process and fails the stage.
# Environment: SANITIZE_TIMEOUT (seconds for the tests, default 1500), MAX_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SRC=${1:-.ci-asan-src}
TIMEOUT=${SANITIZE_TIMEOUT:-1500}

rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -z | xargs -0 -I{} cp --parents {} "$SRC"/
cd "$SRC"

# setuptools adds CFLAGS/LDFLAGS to every compile and link. NALU_CUDA_DEBUG=1 builds with -O0 -g:
# the instrumented -O3 build takes several times longer to compile, and line numbers and frame
# pointers make the reports readable.
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CFLAGS="$SAN" LDFLAGS="$SAN" NALU_CUDA_DEBUG=1 NALU_CUDA_NO_CUDA=1 \
  python setup.py -q build_ext --inplace >build-asan.log 2>&1 ||
  { tail -n 40 build-asan.log; exit 1; }

LIBASAN=$(g++ -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "sanitize: no libasan.so next to g++ ($LIBASAN)"; exit 1; }
# (grep reads all of ldd's output: with -q it would stop at the first match, and under pipefail the
# SIGPIPE that ldd may then get would fail the check at random)
ldd nalu_cuda/_C*.so | grep libasan >/dev/null || { echo "sanitize: the extension is not instrumented"; exit 1; }

# abort_on_error: a report ends the process at once (pytest cannot swallow it); the exit status
# of the test run is then non-zero. halt_on_error is the default for ASan and forced for UBSan.
# The reports go to files (log_path), printed below: pytest's capture of the test's stderr would
# drop them when the process aborts.
REPORTS="$(pwd)/sanitizer-report"
rm -f "$REPORTS".*
export LD_PRELOAD="$LIBASAN"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:print_summary=1:log_path=$REPORTS"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$REPORTS"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python -c "import nalu_cuda, os; assert os.path.dirname(nalu_cuda.__file__) == os.path.join(os.getcwd(), 'nalu_cuda'), nalu_cuda.__file__"
status=0
timeout --signal=INT --kill-after=30 "$TIMEOUT" \
  python -m pytest python_tests/test_ops.py python_tests/test_layouts.py -q -p no:cacheprovider || status=$?
for f in "$REPORTS".*; do
  if [ -f "$f" ]; then
    echo "== sanitizer report $f"
    cat "$f"
    [ "$status" = 0 ] && status=1
  fi
done
cd "$ROOT"
exit "$status"
