// target_ops.h: the targets' operations of the native steps' in-call draws
// (nalu_cuda/experiments/parts/arithmetic_ops.py apply_op, SumTargets and CounterStream), on the
// float64 sums a and b, shared by the CPU kernels (cpu/step_common.h) and the CUDA kernel
// (cuda/ensemble_step_kernels.cu). Plain C++ and NALU_HD: no ATen here.
#pragma once

#include <cmath>

#include "common/math.h"  // NALU_HD

namespace nalu_cuda {
namespace training {

// The codes of the ops' argument 'ops': 0 .. 5.
enum class TargetOp { kAdd, kSub, kMul, kDiv, kSquared, kRoot };

NALU_HD double apply_target(TargetOp op, double a, double b) {
  switch (op) {
    case TargetOp::kAdd: return a + b;
    case TargetOp::kSub: return a - b;
    case TargetOp::kMul: return a * b;
    case TargetOp::kDiv: return a / b;
    case TargetOp::kSquared: return a * a;
    default: return sqrt(a);
  }
}

}  // namespace training
}  // namespace nalu_cuda
