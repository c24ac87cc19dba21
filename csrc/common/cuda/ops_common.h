// ops_common.h: what the CUDA op files (nalu_cuda.cpp, power_cuda.cpp, ops/nau_nmu/cuda/nau_nmu_cuda.cpp) share:
// the dtypes the kernels take, the kernels' DType of a tensor, the check that an argument is a CUDA
// tensor of such a dtype, raw pointers of possibly undefined tensors, the weight-construction
// arguments of the prologue and epilogue launches, and the compute dtype.
// Host code (ATen); in an anonymous namespace, as it was in each file.
//
// The CUDA emulation (emulation/build.py) compiles the op files with `CUDA` read as `CPU` and
// `is_cuda()` as `is_cpu()`, and so this header too; it includes only headers every op file
// includes itself, so that those come in before the two macros.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "ops/nac_nalu/checks.h"
#include "ops/nac_nalu/cuda/kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

inline const std::vector<at::ScalarType>& cuda_dtypes() {
  static const std::vector<at::ScalarType> kTypes{at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};
  return kTypes;
}

// The kernels' name of t's (checked) dtype.
inline DType storage_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat;
    case at::kDouble:
      return DType::kDouble;
    case at::kHalf:
      return DType::kHalf;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_INTERNAL_ASSERT(false, "nalu_cuda: unchecked dtype ", t.scalar_type());
  }
}

// The shared checks already made every tensor share the device of x (or of W_hat); this one
// names the argument when that device is not a GPU, then checks that the kernels take its dtype.
inline void check_cuda_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": argument '", name, "' must be a CUDA tensor, got a tensor on ", t.device());
  check_dtype_supported(op, t, "CUDA", cuda_dtypes());
}

inline const void* cptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
inline void* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The weight-construction part of a forward_prologue launch: W from (W_hat, M_hat) over n_w
// entries, and W_m from (W_hat_m, M_hat_m) when those are given (undefined tensors: null).
inline PrologueArgs weight_prologue_args(int64_t n_w, const at::Tensor& W_hat, const at::Tensor& M_hat,
                                         const at::Tensor& W, const at::Tensor& W_hat_m = {},
                                         const at::Tensor& M_hat_m = {}, const at::Tensor& Wm = {}) {
  return {.n_w = n_w, .W_hat = cptr(W_hat), .M_hat = cptr(M_hat), .W = ptr(W), .W_hat_m = cptr(W_hat_m),
          .M_hat_m = cptr(M_hat_m), .Wm = ptr(Wm)};
}

// The weight-construction part of a backward_epilogue launch: (dW_hat, dM_hat) from dW over n_w
// entries, and (dW_hat_m, dM_hat_m) from dWm when those are given (undefined tensors: null).
inline EpilogueArgs weight_epilogue_args(int64_t n_w, const at::Tensor& dW, const at::Tensor& W_hat,
                                         const at::Tensor& M_hat, const at::Tensor& dW_hat,
                                         const at::Tensor& dM_hat, const at::Tensor& dWm = {},
                                         const at::Tensor& W_hat_m = {}, const at::Tensor& M_hat_m = {},
                                         const at::Tensor& dW_hat_m = {}, const at::Tensor& dM_hat_m = {}) {
  return {.n_w = n_w, .dW = cptr(dW), .W_hat = cptr(W_hat), .M_hat = cptr(M_hat), .dW_hat = ptr(dW_hat),
          .dM_hat = ptr(dM_hat), .dWm = cptr(dWm), .W_hat_m = cptr(W_hat_m), .M_hat_m = cptr(M_hat_m),
          .dW_hat_m = ptr(dW_hat_m), .dM_hat_m = ptr(dM_hat_m)};
}

// The compute dtype of a storage dtype: double for double, else float.
inline at::ScalarType acc_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace
}  // namespace cuda
}  // namespace nalu_cuda
