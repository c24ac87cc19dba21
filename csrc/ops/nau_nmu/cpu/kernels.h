// kernels.h: the NAU and NMU CPU kernels' interface, declared once per instruction set (defined in
// nau_kernels.h and nmu_kernels.h, compiled per instruction set by csrc/common/cpu/kernels_*.cpp
// after the NAC/NALU kernels, whose rowwise path the NAU runs). Arguments are checked by the
// caller (nau_nmu_cpu.cpp).
#pragma once

#include "common/cpu/isa.h"
#include "ops/nac_nalu/cpu/kernels.h"  // the NAU runs the NAC+'s rowwise kernels
#include "ops/nau_nmu/checks.h"
#include "ops/nau_nmu/math.h"

namespace nalu_cuda {
namespace cpu {

#define NAU_NMU_CPU_DECLARE_KERNELS(ISA)                                                           \
  namespace ISA {                                                                                 \
  at::Tensor nau_forward(const LayerShape& s, const at::Tensor& x, const at::Tensor& W);          \
  std::tuple<at::Tensor, at::Tensor> nau_backward(const LayerShape& s, const at::Tensor& grad_y,  \
                                                  const at::Tensor& x, const at::Tensor& W,       \
                                                  bool compute_grad_x);                           \
  at::Tensor nmu_forward(const LayerShape& s, const at::Tensor& x, const at::Tensor& W);          \
  std::tuple<at::Tensor, at::Tensor> nmu_backward(const LayerShape& s, const at::Tensor& grad_y,  \
                                                  const at::Tensor& x, const at::Tensor& W,       \
                                                  bool compute_grad_x);                           \
  }
NALU_CPU_FOR_EACH_ISA(NAU_NMU_CPU_DECLARE_KERNELS)
#undef NAU_NMU_CPU_DECLARE_KERNELS

}  // namespace cpu
}  // namespace nalu_cuda
