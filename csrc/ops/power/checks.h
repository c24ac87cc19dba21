// checks.h: what the NPU / RealNPU and iNALU kernels (CPU or CUDA) agree on before touching
// data: the argument checks, once, so that both devices give the same messages (each names the op,
// the argument, what was expected and what was given). Shapes as in ops/nac_nalu/checks.h: weights (I, O)
// with x (..., I), or (E, I, O) with x (E, ..., I); kernels see contiguous (E, N, I) / (E, I, O) /
// (E, N, O) with E = 1 for a plain layer.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "ops/nac_nalu/checks.h"

namespace nalu_cuda {

// iNALU: NALU's separate weights (W_hat, M_hat additive; W_hat_m, M_hat_m multiplicative) and its
// input-independent gate G of shape (O,) / (E, O).
constexpr LayerKind kInalu{true, true, false, Gate::kIndependent};

// NPU (W_i defined) or RealNPU (W_i undefined): W_r (I, O) / (E, I, O), W_i of its shape, the
// relevance gate g of shape (I,) / (E, I); eps positive and finite.
LayerShape check_npu(const char* op, const at::Tensor& x, const at::Tensor& W_r, const at::Tensor& W_i,
                     const at::Tensor& g, double eps);

// Checks an npu_backward's grad_y and the forward's y, s (x's shape with O last) and lr (x's shape).
void check_npu_saved(const char* op, const LayerShape& s, const at::Tensor& x, const at::Tensor& grad_y,
                     const at::Tensor& y, const at::Tensor& sy, const at::Tensor& lr);

// The NPU's weight gradients from the product dWc = LK^T D (E, I, C): grad_W_r and grad_W_i of W_r's
// shape, or for the RealNPU (C = O) grad_W_i the (0,)-shaped empty_grad(x). Plain ATen, every device.
std::tuple<at::Tensor, at::Tensor> npu_weight_grads(const at::Tensor& dWc, const at::Tensor& W_r, const at::Tensor& x,
                                                    bool complex);

// iNALU's five parameters as the NAC/NALU ops' LayerParams (used as given, not made contiguous).
LayerParams inalu_params(const at::Tensor& W_hat, const at::Tensor& M_hat, const at::Tensor& W_hat_m,
                         const at::Tensor& M_hat_m, const at::Tensor& G);

// iNALU: check_layer of kInalu plus omega (finite).
LayerShape check_inalu(const char* op, const at::Tensor& x, const LayerParams& p, double eps, double omega);

// Checks an inalu_backward's grad_y and the forward's a, u, msv (y's shape) and lx (x's shape).
void check_inalu_saved(const char* op, const LayerShape& s, const at::Tensor& x, const at::Tensor& grad_y,
                       const at::Tensor& a, const at::Tensor& u, const at::Tensor& msv, const at::Tensor& lx);

}  // namespace nalu_cuda
