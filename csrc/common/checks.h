// checks.h: the pieces every family's argument checks are made of (csrc/ops/*/checks.h), so that
// the messages agree: each names the op, the argument, what was expected and what was given.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "common/layer_types.h"

namespace nalu_cuda {

// A checked call's sizes (Dims: E, N, I, O) and how the caller sees them.
struct LayerShape : Dims {
  bool ensemble = false;
  std::vector<int64_t> out_sizes;  // x.sizes()[:-1] + [O]
};

// The pieces every unit's checks are made of (csrc/ops/*/checks.cpp), so that
// the messages agree: `sizes` as "[2, 3]"; that argument `name` is a floating-point tensor; that
// `t` has the dtype and device of `ref` (named `ref_name`); that a scalar argument is finite (and,
// for `positive`, above 0) in the precision the kernels compute it in for tensors of `dtype`
// (float64 for float64, float32 for every narrower type): a double eps of 1e-50 is 0 in float32
// and 1e39 is inf, and both are refused, not computed with.
std::string sizes_str(at::IntArrayRef sizes);
void check_floating(const char* op, const char* name, const at::Tensor& t);
void check_matches(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                   const at::Tensor& ref);
void check_scalar(const char* op, const char* name, double value, at::ScalarType dtype, bool positive);
inline void check_eps(const char* op, double eps, at::ScalarType dtype) { check_scalar(op, "eps", eps, dtype, true); }

// The shape of a layer call with weights W (named `w_name`, rank 2 or 3: already checked), after
// checking that x is (..., I) for W (I, O), or (E, ..., I) for ensemble weights W (E, I, O).
LayerShape layer_shape(const char* op, const at::Tensor& x, const at::Tensor& W, const char* w_name);

// Checks that `t` (named `name`) has exactly `sizes` and the dtype/device of `like`.
void check_like(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes,
                const at::Tensor& like);

// Checks that the kernel of `device_name` supports `dtype` (listed in `supported`).
void check_dtype_supported(const char* op, const at::Tensor& x, const char* device_name,
                           const std::vector<at::ScalarType>& supported);

// What an op returns for a gradient it was not asked for (tied weights, skipped grad_x): a tensor
// of shape (0,) with the options of `like`, so that the op's return schema stays all-Tensor.
at::Tensor empty_grad(const at::Tensor& like);

}  // namespace nalu_cuda
