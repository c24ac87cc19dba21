// flat_adam_kernels.h: the interface between the CUDA op flat_adam_step_resident (csrc/experiments/cuda/flat_adam_cuda.cpp:
// checks, allocation, registration) and its kernels (flat_adam_cuda.cu). Plain data only: no ATen here,
// the kernels are compiled by nvcc without it (and, for the CUDA emulator, as plain C++).
//
// The step is FlatAdam.step_resident's (nalu_cuda/experiments/parts/optim.py) without clipping and with
// one learning rate: for every member e, nonfinite[e] = whether its gradient has a NaN or Inf in any
// segment; members in frozen | nonfinite take a zero gradient (written into grad, as the tensor ops'
// masked_fill_ does); then Adam with the bias corrections of the device step count, which the step
// increments first. Two launches on `stream`, no synchronisation, no allocation: graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nalu_cuda {
namespace training {

// param, grad, exp_avg, exp_avg_sq: n contiguous elements, float (is_double false) or double.
// segments: P rows (offset, per_member) of int64 in device memory: elements [offset, offset + E * per_member)
//   are one parameter of shape (E, ...), member e's part the e-th run of per_member elements. A row
//   that would reach outside [0, n) is skipped (the host cannot read the rows without a synchronisation;
//   FlatAdam builds them from its own views).
// frozen: E bools; step: one double, incremented by the step; nonfinite: E bools (out).
// partial: E * splits ints of workspace (any content on entry), splits = flat_adam_nonfinite_splits(n, E).
struct FlatAdamResidentArgs {
  void* param;
  void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  int64_t n;
  const int64_t* segments;
  int64_t P;
  int64_t E;
  const bool* frozen;
  double* step;
  bool* nonfinite;
  int* partial;
  int64_t splits;
  double lr, beta1, beta2, eps;
};

// How many blocks scan one member's gradient for NaN/Inf (from n and E alone): one up to 16 elements
// per thread of a block, more for large members, at most 64.
int64_t flat_adam_nonfinite_splits(int64_t n, int64_t E);

void flat_adam_step_resident(const FlatAdamResidentArgs& a, bool is_double, cudaStream_t stream);

}  // namespace training
}  // namespace nalu_cuda
