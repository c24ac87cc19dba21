// nau_nmu_cpu.cpp: the CPU device of the NAU and NMU ops, registered through their entry points
// (csrc/ops/nau_nmu/ops.h, which checks the arguments; math in csrc/ops/nau_nmu/math.h).
//
// NAU: up to kRowwiseMaxOut outputs, the NAC+'s rowwise kernels on the clamped weights
// (ops/nac_nalu/cpu/drivers.h); wider layers, clamp and BLAS (ops/nau_nmu/checks.h, the same ATen code as on the GPU).
// NMU: the fused kernels of ops/nau_nmu/cpu/nmu_kernels.h, compiled once per instruction set like the
// NAC/NALU kernels (common/cpu/isa.h) and run for the best one the processor has.
#include <torch/library.h>

#include "ops/nau_nmu/ops.h"
#include "ops/nau_nmu/cpu/kernels.h"

namespace nalu_cuda {
namespace cpu {
namespace {

using at::Tensor;

// The CPU device of the ops' entry points (csrc/ops/nau_nmu/ops.h).
struct Cpu {
  static void check_input(const char* op, const char* name, const Tensor& t) {
    (void)name;  // the dtype message names the op and x's dtype
    check_dtype_supported(op, t, "CPU", cpu_dtypes());
  }
  static void check_nmu(const char* /*op*/, const LayerShape& /*s*/) {}  // the CPU kernels take any size

  static Tensor nau_forward(const LayerShape& s, const Tensor& x, const Tensor& W) {
    return rowwise_shape(s) ? NALU_CPU_CALL(nau_forward, s, x, W) : nau_forward_math(s, x, W);
  }
  static std::tuple<Tensor, Tensor> nau_backward(const LayerShape& s, const Tensor& grad_y, const Tensor& x,
                                                 const Tensor& W, bool compute_grad_x) {
    return rowwise_shape(s) ? NALU_CPU_CALL(nau_backward, s, grad_y, x, W, compute_grad_x)
                            : nau_backward_math(s, grad_y, x, W, compute_grad_x);
  }
  static Tensor nmu_forward(const LayerShape& s, const Tensor& x, const Tensor& W) {
    return NALU_CPU_CALL(nmu_forward, s, x, W);
  }
  static std::tuple<Tensor, Tensor> nmu_backward(const LayerShape& s, const Tensor& grad_y, const Tensor& x,
                                                 const Tensor& W, bool compute_grad_x) {
    return NALU_CPU_CALL(nmu_backward, s, grad_y, x, W, compute_grad_x);
  }
};

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) { UnitOps<cpu::Cpu>::register_kernels(m); }

}  // namespace nalu_cuda
