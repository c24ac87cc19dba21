// ops.h: the NAU and NMU ops' entry points, written once for every device, as
// csrc/ops/nac_nalu/ops.h does for NAC/NALU: one C++ signature per op (matching its schema in
// csrc/ops/nau_nmu/schema.cpp), the shared argument checks (csrc/ops/nau_nmu/checks.h), and the
// registration of the four kernels under a device's dispatch key.
//
// A device (csrc/ops/nau_nmu/cpu/nau_nmu_cpu.cpp, csrc/ops/nau_nmu/cuda/nau_nmu_cuda.cpp) supplies
// a struct `Dev` with
//   static void check_input(const char* op, const char* name, const at::Tensor& t);
//       what only that device requires of the argument the op runs on (its device, its dtypes)
//   static void check_nmu(const char* op, const LayerShape& s);
//       what only that device requires of an NMU's shape (a kernel's size limit)
//   static at::Tensor nau_forward(const LayerShape&, const at::Tensor& x, const at::Tensor& W);
//   static std::tuple<at::Tensor, at::Tensor> nau_backward(const LayerShape&, const at::Tensor& grad_y,
//                                                          const at::Tensor& x, const at::Tensor& W,
//                                                          bool compute_grad_x);
//   static at::Tensor nmu_forward(...);  static std::tuple<at::Tensor, at::Tensor> nmu_backward(...);
//       (the NAU's signatures)
// all called with checked arguments, and registers the ops with
// `UnitOps<Dev>::register_kernels(m)` in its TORCH_LIBRARY_IMPL.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "ops/nau_nmu/checks.h"

namespace nalu_cuda {

template <class Dev>
struct UnitOps {
  using Tensor = at::Tensor;
  using Tensor2 = std::tuple<Tensor, Tensor>;

  static Tensor nau_forward(const Tensor& x, const Tensor& W) {
    const char* op = "nalu_cuda::nau_forward";
    return Dev::nau_forward(device_checked(op, check_unit(op, x, W), x), x, W);
  }

  static Tensor2 nau_backward(const Tensor& grad_y, const Tensor& x, const Tensor& W, bool compute_grad_x) {
    const char* op = "nalu_cuda::nau_backward";
    return Dev::nau_backward(device_checked(op, check_unit_backward(op, grad_y, x, W), x), grad_y, x, W,
                             compute_grad_x);
  }

  static Tensor nmu_forward(const Tensor& x, const Tensor& W) {
    const char* op = "nalu_cuda::nmu_forward";
    const LayerShape s = device_checked(op, check_unit(op, x, W), x);
    Dev::check_nmu(op, s);
    return Dev::nmu_forward(s, x, W);
  }

  static Tensor2 nmu_backward(const Tensor& grad_y, const Tensor& x, const Tensor& W, bool compute_grad_x) {
    const char* op = "nalu_cuda::nmu_backward";
    const LayerShape s = device_checked(op, check_unit_backward(op, grad_y, x, W), x);
    Dev::check_nmu(op, s);
    return Dev::nmu_backward(s, grad_y, x, W, compute_grad_x);
  }

  static void register_kernels(torch::Library& m) {
    m.impl("nau_forward", &nau_forward);
    m.impl("nau_backward", &nau_backward);
    m.impl("nmu_forward", &nmu_forward);
    m.impl("nmu_backward", &nmu_backward);
  }

 private:
  // The device's own check of x, after the shared checks that gave s.
  static LayerShape device_checked(const char* op, const LayerShape& s, const Tensor& x) {
    Dev::check_input(op, "x", x);
    return s;
  }
};

}  // namespace nalu_cuda
