// ops.h: the power units' ops' entry points (NPU / RealNPU, iNALU), written once for every device,
// as csrc/ops/nac_nalu/ops.h does for NAC/NALU: one C++ signature per op (matching its schema in
// csrc/ops/power/schema.cpp), the shared argument checks (csrc/ops/power/checks.h), and the
// registration of the four kernels under a device's dispatch key.
//
// A device (csrc/ops/power/cpu/power_cpu.cpp, csrc/ops/power/cuda/power_cuda.cpp) supplies a
// struct `Dev` with
//   static void check_input(const char* op, const char* name, const at::Tensor& t);
//       what only that device requires of the argument the op runs on (its device, its dtypes)
//   static void check_inalu_backward(const char* op, const LayerShape& s, const at::Tensor& x);
//       what only that device requires of an inalu_backward's shape (a kernel's size limit)
//   npu_forward, npu_backward, inalu_forward, inalu_backward: the op's signature with the checked
//       LayerShape first, W_i an undefined tensor for the RealNPU (not an optional), and iNALU's
//       five parameters in a LayerParams (csrc/ops/nac_nalu/checks.h)
// all called with checked arguments, and registers the ops with
// `PowerOps<Dev>::register_kernels(m)` in its TORCH_LIBRARY_IMPL.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <tuple>

#include "ops/power/checks.h"

namespace nalu_cuda {

template <class Dev>
struct PowerOps {
  using Tensor = at::Tensor;

  // W_i is None for the RealNPU: the devices get an undefined tensor.
  static std::tuple<Tensor, Tensor, Tensor> npu_forward(const Tensor& x, const Tensor& W_r,
                                                        const c10::optional<Tensor>& W_i_opt, const Tensor& g,
                                                        double eps) {
    const char* op = "nalu_cuda::npu_forward";
    const Tensor W_i = W_i_opt.value_or(Tensor());
    const LayerShape s = check_npu(op, x, W_r, W_i, g, eps);
    Dev::check_input(op, "x", x);
    return Dev::npu_forward(s, x, W_r, W_i, g, eps);
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor> npu_backward(const Tensor& grad_y, const Tensor& x,
                                                                 const Tensor& W_r,
                                                                 const c10::optional<Tensor>& W_i_opt,
                                                                 const Tensor& g, const Tensor& y, const Tensor& sy,
                                                                 const Tensor& lr, double eps, bool compute_grad_x) {
    const char* op = "nalu_cuda::npu_backward";
    const Tensor W_i = W_i_opt.value_or(Tensor());
    const LayerShape s = check_npu(op, x, W_r, W_i, g, eps);
    Dev::check_input(op, "x", x);
    check_npu_saved(op, s, x, grad_y, y, sy, lr);
    return Dev::npu_backward(s, grad_y, x, W_r, W_i, g, y, sy, lr, eps, compute_grad_x);
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> inalu_forward(const Tensor& x, const Tensor& W_hat,
                                                                          const Tensor& M_hat, const Tensor& W_hat_m,
                                                                          const Tensor& M_hat_m, const Tensor& G,
                                                                          double eps, double omega) {
    const char* op = "nalu_cuda::inalu_forward";
    const LayerParams p = inalu_params(W_hat, M_hat, W_hat_m, M_hat_m, G);
    const LayerShape s = check_inalu(op, x, p, eps, omega);
    Dev::check_input(op, "x", x);
    return Dev::inalu_forward(s, x, p, eps, omega);
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> inalu_backward(
      const Tensor& grad_y, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const Tensor& W_hat_m,
      const Tensor& M_hat_m, const Tensor& G, const Tensor& a, const Tensor& u, const Tensor& msv, const Tensor& lx,
      double eps, double omega, bool compute_grad_x) {
    const char* op = "nalu_cuda::inalu_backward";
    const LayerParams p = inalu_params(W_hat, M_hat, W_hat_m, M_hat_m, G);
    const LayerShape s = check_inalu(op, x, p, eps, omega);
    Dev::check_input(op, "x", x);
    check_inalu_saved(op, s, x, grad_y, a, u, msv, lx);
    Dev::check_inalu_backward(op, s, x);
    return Dev::inalu_backward(s, grad_y, x, p, a, u, msv, lx, eps, omega, compute_grad_x);
  }

  static void register_kernels(torch::Library& m) {
    m.impl("npu_forward", &npu_forward);
    m.impl("npu_backward", &npu_backward);
    m.impl("inalu_forward", &inalu_forward);
    m.impl("inalu_backward", &inalu_backward);
  }
};

}  // namespace nalu_cuda
