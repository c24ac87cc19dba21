// kernels.h: the NAC/NALU CPU kernels' interface, declared once per instruction set (they are
// defined in kernels_impl.h and its parts, compiled per instruction set by
// csrc/common/cpu/kernels_*.cpp). Arguments are checked by the caller (ops.h); the scalar
// arguments come as one LayerArgs (csrc/common/layer_types.h), read by the kernel that uses each.
#pragma once

#include "common/cpu/isa.h"
#include "ops/nac_nalu/blas_path.h"
#include "ops/nac_nalu/checks.h"
#include "ops/nac_nalu/math.h"

namespace nalu_cuda {
namespace cpu {

#define NAC_NALU_CPU_DECLARE_KERNELS(ISA)                                                          \
  namespace ISA {                                                                                 \
  Forward layer_forward(const LayerArgs& args, const LayerShape& s, const at::Tensor& x,          \
                        const LayerParams& p);                                                    \
  Backward layer_backward(const LayerArgs& args, const LayerShape& s, const at::Tensor& grad_y,   \
                          const at::Tensor& x, const LayerParams& p, const Forward& saved,        \
                          const PartGrads& parts);                                                \
  at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat);                            \
  std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W, const at::Tensor& W_hat, \
                                                     const at::Tensor& M_hat);                     \
  }
NALU_CPU_FOR_EACH_ISA(NAC_NALU_CPU_DECLARE_KERNELS)
#undef NAC_NALU_CPU_DECLARE_KERNELS

}  // namespace cpu
}  // namespace nalu_cuda
