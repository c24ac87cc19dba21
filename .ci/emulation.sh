#!/usr/bin/env bash
# CI emulation stage: the CUDA ops and kernels of csrc/ (every *.cpp of a cuda/ folder and every
# *.cu, the experiments' kernels among them) built for the CPU on the CUDA emulator
# (csrc/emulation/build.py) and the CUDA test files (python_tests/test_cuda.py,
# test_units_cuda.py, test_power_cuda.py, test_flat_adam_cuda.py, test_native_step_cuda.py) and the layout fuzz
# (test_layouts.py: every argument of every NAC/NALU op in every memory layout) run on them, so that
# every change to the CUDA sources is checked without a GPU.
#
#     bash .ci/emulation.sh [BUILD_DIR]     # from a venv with torch and the dev requirements
#
# Fails when the build fails, when pytest exits non-zero (a failure, an error, or exit 5: nothing
# collected), and when no test of the file ran on the emulated kernels (all skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath -m "${1:-build-emu}")
LIB=$(python csrc/emulation/build.py "$BUILD" | tail -n 1)
[ -f "$LIB" ] || { echo "emulation: build.py printed no library ($LIB)"; exit 1; }
REPORT="$BUILD/test_cuda.xml"
NALU_CUDA_LIBRARY="$LIB" NALU_CUDA_TEST_EMULATION=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
  python -m pytest python_tests/test_cuda.py python_tests/test_units_cuda.py python_tests/test_power_cuda.py \
  python_tests/test_flat_adam_cuda.py python_tests/test_native_step_cuda.py python_tests/test_layouts.py -q -p no:cacheprovider --junitxml="$REPORT"
python .ci/tests_ran.py "$REPORT"
