// autograd.h: what every family's autograd.cpp (csrc/ops/*/autograd.cpp) shares: torch's
// autograd Function API under the short names those files use, and the family registration.
#pragma once

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "common/registration.h"

namespace nalu_cuda {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

}  // namespace nalu_cuda
