// nac_nalu_cpu.cpp: the CPU device of the NAC/NALU ops, registered through their entry points
// (csrc/ops/nac_nalu/ops.h, which checks the arguments): each runs the kernels of the best
// instruction set the processor has (kernels.h; compiled as `base` and, on x86-64, `avx2`: see
// csrc/common/cpu/isa.h).
#include <torch/library.h>

#include "ops/nac_nalu/ops.h"
#include "ops/nac_nalu/cpu/kernels.h"

namespace nalu_cuda {
namespace cpu {
namespace {

// The CPU device of the ops' entry points (csrc/ops/nac_nalu/ops.h).
struct Cpu {
  static void check_input(const char* op, const char* name, const at::Tensor& t) {
    (void)name;  // the dtype message names the op and x's dtype
    check_dtype_supported(op, t, "CPU", cpu_dtypes());
  }
  static Forward forward(const LayerArgs& args, const LayerShape& s, const at::Tensor& x, const LayerParams& p) {
    return NALU_CPU_CALL(layer_forward, args, s, x, p);
  }
  static Backward backward(const LayerArgs& args, const LayerShape& s, const at::Tensor& grad_y, const at::Tensor& x,
                           const LayerParams& p, const Forward& saved, const PartGrads& parts) {
    return NALU_CPU_CALL(layer_backward, args, s, grad_y, x, p, saved, parts);
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

}  // namespace cpu

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) { LayerOps<cpu::Cpu>::register_kernels(m); }

}  // namespace nalu_cuda
