// checks.h: what every NAC/NALU kernel (CPU or CUDA) agrees on before touching data.
//
// A layer is described by a LayerKind (which paths it has) and, once its arguments are checked,
// a LayerShape. Weights are (I, O), x is (..., I) and y is (..., O), as in the paper's y = x W;
// with an ensemble, weights are (E, I, O) and x is (E, ..., I): E independent models in one call.
// Kernels see every tensor as contiguous (E, N, I) / (E, I, O) / (E, N, O) with E = 1 for a plain
// layer and N the number of rows per member.
//
// The argument checks live here, once, so that the CPU and CUDA kernels give the same messages:
// each names the op, the argument, what was expected and what was given (their pieces, shared by
// every family: csrc/common/checks.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "common/checks.h"
#include "common/layer_types.h"

namespace nalu_cuda {

// The three units: NAC+ and NAC* (kNacAdd, kNacMul: layer_types.h) and NALU, whose weights are
// tied unless W_hat_m or M_hat_m is given (then both must be), and whose gate has a bias when
// G_bias is given (check_layer: only an input gate may).
inline LayerKind nalu_kind(const c10::optional<at::Tensor>& W_hat_m, const c10::optional<at::Tensor>& M_hat_m,
                           bool input_gate, const c10::optional<at::Tensor>& G_bias = c10::nullopt) {
  return LayerKind{true, true, !W_hat_m.has_value() && !M_hat_m.has_value(),
                   input_gate ? Gate::kInput : Gate::kIndependent, G_bias.has_value()};
}

// The weights and gate of one call, as given (possibly undefined when not used).
struct LayerParams {
  at::Tensor W_hat, M_hat;      // (I, O) or (E, I, O)
  at::Tensor W_hat_m, M_hat_m;  // separate multiplicative weights, undefined when tied or unused
  at::Tensor G;                 // (I, O) / (E, I, O) input gate, (O,) / (E, O) independent gate
  at::Tensor G_bias;            // an input gate's bias, (O,) / (E, O); undefined when it has none
};

// A forward op's results, on either device (the families' schema.cpp (csrc/ops/*/schema.cpp)): y, and what its backward needs
// besides the inputs: a, m, g for NALU (g of y's shape for an input gate, of G's for an
// independent gate), m = y for NAC*, lx = log(|x| + eps) (x's shape) for NAC* and NALU.
struct Forward {
  at::Tensor y, a, m, g, lx;
};

// A backward op's results; a gradient that was not asked for is undefined until the op entry
// (ops.h) makes it the (0,)-shaped tensor of the schema.
struct Backward {
  at::Tensor grad_x, grad_W_hat, grad_M_hat, grad_W_hat_m, grad_M_hat_m, grad_G, grad_G_bias;
};

// The gradients that reach a NALU forward's a, m, g directly (nalu_backward's grad_a, grad_m,
// grad_g; undefined: none).
struct PartGrads {
  at::Tensor a, m, g;
  bool any() const { return a.defined() || m.defined() || g.defined(); }
};

// Checks a pair (W_hat, M_hat) of weight tensors: floating, same dtype/device/shape, and, for a
// layer (`layer_shape`), rank 2 (in, out) or 3 (E, in, out). The weight-construction ops are
// elementwise and take any shape.
void check_weight_pair(const char* op, const at::Tensor& W_hat, const at::Tensor& M_hat,
                       const char* w_name = "W_hat", const char* m_name = "M_hat", bool layer_shape = true);

// Checks x and every parameter of a layer call and returns the shape. `eps` is checked when the
// layer has a multiplicative path.
LayerShape check_layer(const char* op, const LayerKind& kind, const at::Tensor& x,
                       const LayerParams& params, double eps);

// The same for the scalar arguments of a NAC/NALU call (the entry points, ops.h): a scalar that
// must be checked is checked here.
LayerShape check_layer(const char* op, const LayerArgs& args, const at::Tensor& x, const LayerParams& params);

// Checks a backward op's grad_y and the forward results it was given: a, m, g for NALU; m (the
// forward's y) for NAC*; lx for both. Undefined tensors are not checked (not used by the kind).
void check_saved(const char* op, const LayerKind& kind, const LayerShape& s, const at::Tensor& x,
                 const at::Tensor& G, const at::Tensor& grad_y, const at::Tensor& a,
                 const at::Tensor& m, const at::Tensor& g, const at::Tensor& lx);

// Checks the gradients given for a NALU forward's kept parts: each like the part it is for.
void check_part_grads(const char* op, const PartGrads& pg, const at::Tensor& x, const at::Tensor& a,
                      const at::Tensor& m, const at::Tensor& g);

// Checks nalu_backward's grad_gate_regularizer (0-dim, the regulariser's shape) and that it and g
// have x's dtype and device.
void check_gate_regularizer_grad(const char* op, const at::Tensor& grad, const at::Tensor& x, const at::Tensor& g);

// Checks the gate g of nalu_gate_regularizer (floating; with per_member, a leading member dimension)
// and, for its backward, grad (the regulariser's shape, g's dtype and device); returns that shape:
// [] or [E].
std::vector<int64_t> check_gate_regularizer(const char* op, const at::Tensor& g, bool per_member,
                                            const at::Tensor& grad = at::Tensor());

}  // namespace nalu_cuda
