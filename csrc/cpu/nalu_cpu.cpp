// nalu_cpu.cpp: the CPU kernels of the NAC/NALU ops, registered through their entry points
// (csrc/layer_ops.h, which checks the arguments): each runs the kernels of the best instruction
// set the processor has (nalu_cpu_kernels.h, compiled as `base` and, on x86-64, `avx2`). The
// environment variable NALU_CUDA_CPU_ISA=base forces the baseline kernels (the tests use it to
// check both builds).
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "../layer_ops.h"
#include "nalu_cpu.h"

namespace nalu_cuda {
namespace cpu {
namespace {

// The CPU device of the ops' entry points (csrc/layer_ops.h).
struct Cpu {
  static void check_input(const char* op, const char* name, const at::Tensor& t) {
    (void)name;  // the dtype message names the op and x's dtype
    check_dtype_supported(op, t, "CPU", cpu_dtypes());
  }
  static Forward forward(const LayerKind& kind, const LayerShape& s, const at::Tensor& x, const LayerParams& p,
                         double eps) {
    return NALU_CPU_CALL(layer_forward, kind, s, x, p, eps);
  }
  static Backward backward(const LayerKind& kind, const LayerShape& s, const at::Tensor& grad_y, const at::Tensor& x,
                           const LayerParams& p, const Forward& saved, double eps, bool compute_grad_x) {
    return NALU_CPU_CALL(layer_backward, kind, s, grad_y, x, p, saved, eps, compute_grad_x);
  }
  static at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat) {
    return NALU_CPU_CALL(weight, W_hat, M_hat);
  }
  static std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W, const at::Tensor& W_hat,
                                                            const at::Tensor& M_hat) {
    return NALU_CPU_CALL(weight_backward, grad_W, W_hat, M_hat);
  }
};

}  // namespace

const std::vector<at::ScalarType>& cpu_dtypes() {
  static const std::vector<at::ScalarType> kTypes{at::kFloat, at::kDouble};
  return kTypes;
}

bool use_avx2() {
#ifdef NALU_CPU_HAVE_AVX2
  static const bool kUse = [] {
    const char* forced = std::getenv("NALU_CUDA_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "base") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return kUse;
#else
  return false;
#endif
}

}  // namespace cpu

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) { LayerOps<cpu::Cpu>::register_kernels(m); }

}  // namespace nalu_cuda
