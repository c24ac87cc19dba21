// checks.h: what the NAU and NMU ops share across devices: argument checks, and the parts that are
// plain ATen (device-generic) code.
//
//   NAU  y = x clamp(W, -1, 1)                    (Madsen & Johansen's neural addition unit)
//   NMU  y[n, o] = prod_i (W[i, o] x[n, i] + 1 - W[i, o])   (neural multiplication unit)
//
// Shapes as for the NAC/NALU ops (csrc/ops/nac_nalu/checks.h): W (I, O) with x (..., I), or an ensemble
// W (E, I, O) with x (E, ..., I); y (..., O) / (E, ..., O). The only parameter is W, used as
// given (the published runs project it after every optimiser step, outside autograd).
//
// NAU's product goes to BLAS (at::mm / at::bmm: MKL/oneDNN on the CPU, cuBLAS on the GPU), so its
// forward and backward are the same ATen code on every device, registered for CPU and CUDA.
// NMU's kernels are device-specific (csrc/ops/nau_nmu/cpu/nau_nmu_cpu.cpp, csrc/ops/nau_nmu/cuda/nau_nmu_cuda.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "ops/nac_nalu/checks.h"

namespace nalu_cuda {

// Checks x and W of a unit call: floating, same dtype and device, W (I, O) or (E, I, O), x
// (..., I) or (E, ..., I). Messages name the op, the argument, what was expected and what came.
LayerShape check_unit(const char* op, const at::Tensor& x, const at::Tensor& W);

// The checks of a backward op: those of check_unit, and grad_y of the output's shape.
LayerShape check_unit_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& W);

// NAU forward / backward in ATen ops (shapes already checked). Differentiable: autograd uses
// nau_backward_math itself for double backward.
at::Tensor nau_forward_math(const LayerShape& s, const at::Tensor& x, const at::Tensor& W);
// -> (grad_x, grad_W); grad_x is empty_grad(x) when !compute_grad_x.
std::tuple<at::Tensor, at::Tensor> nau_backward_math(const LayerShape& s, const at::Tensor& grad_y,
                                                     const at::Tensor& x, const at::Tensor& W, bool compute_grad_x);

// NMU backward as differentiable ATen ops (exclusive products by cumprod, exact for zero
// factors). It materialises the (E, N, I, O) factors: autograd uses it only for double backward
// (create_graph=True); the fused backward kernels never do.
std::tuple<at::Tensor, at::Tensor> nmu_backward_composite(const LayerShape& s, const at::Tensor& grad_y,
                                                          const at::Tensor& x, const at::Tensor& W);

}  // namespace nalu_cuda
