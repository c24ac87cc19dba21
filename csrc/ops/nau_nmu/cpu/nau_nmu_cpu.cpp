// nau_nmu_cpu.cpp: the CPU ops of the NAU and NMU (schemas in the families' schema.cpp (csrc/ops/*/schema.cpp), math in
// csrc/ops/nau_nmu/math.h and csrc/ops/nau_nmu/checks.h).
//
// NAU: up to kRowwiseMaxOut outputs, the NAC+'s rowwise kernels on the clamped weights
// (ops/nac_nalu/cpu/drivers.h); wider layers, clamp and BLAS (ops/nau_nmu/checks.h, the same ATen code as on the GPU).
// NMU: the fused kernels of ops/nau_nmu/cpu/nmu_kernels.h, compiled once per instruction set like the
// NAC/NALU kernels (common/cpu/isa.h) and run for the best one the processor has.
#include <torch/library.h>

#include "ops/nau_nmu/checks.h"
#include "ops/nau_nmu/cpu/kernels.h"

namespace nalu_cuda {
namespace cpu {
namespace {

using at::Tensor;

Tensor nau_forward_cpu(const Tensor& x, const Tensor& W) {
  const char* op = "nalu_cuda::nau_forward";
  const LayerShape s = check_unit(op, x, W);
  check_dtype_supported(op, x, "CPU", cpu_dtypes());
  return rowwise_shape(s) ? NALU_CPU_CALL(nau_forward, s, x, W) : nau_forward_math(s, x, W);
}

std::tuple<Tensor, Tensor> nau_backward_cpu(const Tensor& grad_y, const Tensor& x, const Tensor& W,
                                            bool compute_grad_x) {
  const char* op = "nalu_cuda::nau_backward";
  const LayerShape s = check_unit_backward(op, grad_y, x, W);
  check_dtype_supported(op, x, "CPU", cpu_dtypes());
  return rowwise_shape(s) ? NALU_CPU_CALL(nau_backward, s, grad_y, x, W, compute_grad_x)
                          : nau_backward_math(s, grad_y, x, W, compute_grad_x);
}

Tensor nmu_forward_cpu(const Tensor& x, const Tensor& W) {
  const char* op = "nalu_cuda::nmu_forward";
  const LayerShape s = check_unit(op, x, W);
  check_dtype_supported(op, x, "CPU", cpu_dtypes());
  return NALU_CPU_CALL(nmu_forward, s, x, W);
}

std::tuple<Tensor, Tensor> nmu_backward_cpu(const Tensor& grad_y, const Tensor& x, const Tensor& W,
                                            bool compute_grad_x) {
  const char* op = "nalu_cuda::nmu_backward";
  const LayerShape s = check_unit_backward(op, grad_y, x, W);
  check_dtype_supported(op, x, "CPU", cpu_dtypes());
  return NALU_CPU_CALL(nmu_backward, s, grad_y, x, W, compute_grad_x);
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("nau_forward", &nau_forward_cpu);
  m.impl("nau_backward", &nau_backward_cpu);
  m.impl("nmu_forward", &nmu_forward_cpu);
  m.impl("nmu_backward", &nmu_backward_cpu);
}

}  // namespace cpu
}  // namespace nalu_cuda
