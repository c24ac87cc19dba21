// ensemble_step_kernels.h: the interface between the CUDA op static_ensemble_grad
// (csrc/experiments/cuda/ensemble_step_cuda.cpp: checks, allocation, registration) and its kernel
// (ensemble_step_kernels.cu). Plain data only: no ATen here, the kernel is compiled by nvcc without
// it (and, for the CUDA emulator, as plain C++).
//
// The work is the CPU op's (csrc/experiments/cpu/ensemble_step.cpp, static_ensemble_grad): for each
// member of the static task's two-layer ensemble model, the forward through both layers, the MSE,
// diverged |= the objective (MSE + the NMU model's sparsity penalty) is not finite, and the gradient
// of the objective written over the member's part of the flat gradient buffer (zero upstream, times
// the error, for a member that had diverged before the call). One block per member, one launch on
// `stream`, no allocation and nothing read back: a CUDA graph can capture it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "experiments/counter_draw.h"

namespace nalu_cuda {
namespace training {

// The layer kinds, as csrc/experiments/cpu/step_common.h's Kind (the same values).
enum class StepKind : int { kNac = 0, kNalu = 1, kNau = 2, kNmu = 3 };

constexpr int kStepMaxParams = 6;  // two layers of at most three parameters (NALU: W_hat, M_hat, G)

// The batch drawn in the kernel (static_ensemble_grad_counter): CounterDraw (experiments/counter_draw.h),
// CounterStream's values regenerated wherever the kernel reads an input (never stored), and the
// targets from them in the same pass.

struct StaticGradArgs {
  const void* x;       // (E, B, I), float (is_double false) or double; null: drawn (`draw`, float only)
  const void* target;  // (E, B); null when drawn
  const void* param;   // FlatAdam's flat buffer
  void* grad;          // its gradient buffer (the members' parts written whole)
  bool* diverged;      // (E,)
  void* loss;          // (E,) out: each member's MSE
  void* work;          // E * static_grad_work_elems(...) values of the dtype (any content on entry)
  int64_t E, B, I, H;
  StepKind kinds[2];
  // offset[q], per_member[q]: parameter q (layer 0's, then layer 1's, in the layers' order) is
  // param[offset[q] + e * per_member[q] + k], k < per_member[q] for member e (FlatAdam's segments)
  int64_t offset[kStepMaxParams];
  int64_t per_member[kStepMaxParams];
  double eps, reg_weight;
  CounterDraw draw;  // read when x is null
};

// The workspace one member needs, in values of the dtype.
int64_t static_grad_work_elems(int64_t B, int64_t I, int64_t H);

void static_ensemble_grad_cuda(const StaticGradArgs& a, bool is_double, cudaStream_t stream);

}  // namespace training
}  // namespace nalu_cuda
