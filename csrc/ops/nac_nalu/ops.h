// ops.h: the NAC/NALU ops' entry points, written once for every device: one C++ signature
// per op (matching its schema in csrc/ops/nac_nalu/schema.cpp), the shared argument checks, and the
// registration of the ten kernels under a device's dispatch key.
//
// Each entry point gathers the op's scalar arguments into one LayerArgs (csrc/common/layer_types.h:
// the kind, eps, compute_grad_x), once, and every layer below passes that struct on unchanged.
// A device (csrc/ops/nac_nalu/cpu/nac_nalu_cpu.cpp, csrc/ops/nac_nalu/cuda/nac_nalu_cuda.cpp) supplies a struct `Dev` with
//   static void check_input(const char* op, const char* name, const at::Tensor& t);
//       what only that device requires of the argument the op runs on (its device, its dtypes)
//   static Forward forward(const LayerArgs&, const LayerShape&, const at::Tensor& x, const LayerParams&);
//   static Backward backward(const LayerArgs&, const LayerShape&, const at::Tensor& grad_y,
//                            const at::Tensor& x, const LayerParams&, const Forward& saved,
//                            const PartGrads& parts);
//   static at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat);
//   static std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W,
//                                                            const at::Tensor& W_hat, const at::Tensor& M_hat);
//   static at::Tensor gate_regularizer(const at::Tensor& g, at::IntArrayRef out);  // out: [] or [E]
//   static at::Tensor gate_regularizer_backward(const at::Tensor& grad, const at::Tensor& g);
// all called with checked arguments (the parameters contiguous and owned by the LayerParams for the
// whole call), and registers the ops with `LayerOps<Dev>::register_kernels(m)` in its
// TORCH_LIBRARY_IMPL. So adding a scalar argument to an op touches its schema, its signature here
// (one field of the LayerArgs it builds), the LayerArgs field, the kernels that read it, autograd,
// the fast path in csrc/module.cpp and the Python wrapper (nalu_cuda/ops/nac_nalu.py): not every
// layer in between, nor one copy per device (ARCHITECTURE.md, "Add a scalar argument to a NAC/NALU op").
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops/nac_nalu/checks.h"

namespace nalu_cuda {

template <class Dev>
struct LayerOps {
  using Tensor = at::Tensor;
  using OptTensor = c10::optional<at::Tensor>;
  using Tensor2 = std::tuple<Tensor, Tensor>;
  using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
  using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
  using Tensor6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
  using Tensor7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

  // ---------------------------------------------------------------------------------------------
  // The ops (schemas: the families' schema.cpp (csrc/ops/*/schema.cpp))
  // ---------------------------------------------------------------------------------------------

  static Tensor nac_weight(const Tensor& W_hat, const Tensor& M_hat) {
    const char* op = "nalu_cuda::nac_weight";
    check_weight_pair(op, W_hat, M_hat, "W_hat", "M_hat", /*layer_shape=*/false);
    Dev::check_input(op, "W_hat", W_hat);
    return Dev::weight(W_hat.contiguous(), M_hat.contiguous());
  }

  static Tensor2 nac_weight_backward(const Tensor& grad_W, const Tensor& W_hat, const Tensor& M_hat) {
    const char* op = "nalu_cuda::nac_weight_backward";
    check_weight_pair(op, W_hat, M_hat, "W_hat", "M_hat", /*layer_shape=*/false);
    Dev::check_input(op, "W_hat", W_hat);
    check_like(op, "grad_W", grad_W, W_hat.sizes(), W_hat);
    return Dev::weight_backward(grad_W.contiguous(), W_hat.contiguous(), M_hat.contiguous());
  }

  static Tensor nac_forward(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat) {
    return forward("nalu_cuda::nac_forward", {.kind = kNacAdd}, x, params(W_hat, M_hat)).y;
  }

  static Tensor3 nac_backward(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                              bool compute_grad_x) {
    const Backward g = backward("nalu_cuda::nac_backward", {.kind = kNacAdd, .compute_grad_x = compute_grad_x},
                                grad_y, x, params(W_hat, M_hat), Forward{});
    return {g.grad_x, g.grad_W_hat, g.grad_M_hat};
  }

  static Tensor2 nac_mul_forward(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, double eps) {
    const Forward f = forward("nalu_cuda::nac_mul_forward", {.kind = kNacMul, .eps = eps}, x, params(W_hat, M_hat));
    return {f.y, f.lx};
  }

  static Tensor3 nac_mul_backward(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                                  const Tensor& y, const Tensor& lx, double eps, bool compute_grad_x) {
    Forward saved;
    saved.m = y;  // NAC*'s y is its multiplicative path
    saved.lx = lx;
    const Backward g = backward("nalu_cuda::nac_mul_backward",
                                {.kind = kNacMul, .eps = eps, .compute_grad_x = compute_grad_x}, grad_y, x,
                                params(W_hat, M_hat), saved);
    return {g.grad_x, g.grad_W_hat, g.grad_M_hat};
  }

  // gate_regularizer: also the gate regulariser sum(g^2 (1 - g)^2) of this call's g (the device's
  // nalu_gate_regularizer kernel), else a (0,)-shaped tensor in its place.
  static Tensor6 nalu_forward(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m,
                              const OptTensor& M_hat_m, const Tensor& G, double eps, bool input_gate,
                              const OptTensor& G_bias, bool gate_regularizer) {
    const Forward f =
        forward("nalu_cuda::nalu_forward", {.kind = nalu_kind(W_hat_m, M_hat_m, input_gate, G_bias), .eps = eps}, x,
                params(W_hat, M_hat, W_hat_m, M_hat_m, G, G_bias));
    Tensor r = gate_regularizer ? Dev::gate_regularizer(f.g, {}) : empty_grad(x);
    return {f.y, f.a, f.m, f.g, f.lx, std::move(r)};
  }

  // grad_a, grad_m, grad_g: gradients reaching the kept parts directly. The kernels add them at
  // the pre-activations of each output element; an input-independent gate's g has G's shape, so
  // its grad_g adds grad_g g (1 - g) to grad_G here. grad_gate_regularizer (0-dim: the gradient of
  // the forward's gate regulariser) joins grad_g as grad 2 g (1 - g) (1 - 2 g), by the device's
  // nalu_gate_regularizer_backward kernel.
  static Tensor7 nalu_backward(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                               const OptTensor& W_hat_m, const OptTensor& M_hat_m, const Tensor& G, const Tensor& a,
                               const Tensor& m, const Tensor& g, const Tensor& lx, double eps, bool input_gate,
                               bool compute_grad_x, const OptTensor& G_bias, const OptTensor& grad_a,
                               const OptTensor& grad_m, const OptTensor& grad_g,
                               const OptTensor& grad_gate_regularizer) {
    const char* op = "nalu_cuda::nalu_backward";
    const Forward saved{Tensor(), a, m, g, lx};
    const LayerArgs args{.kind = nalu_kind(W_hat_m, M_hat_m, input_gate, G_bias), .eps = eps,
                         .compute_grad_x = compute_grad_x};
    PartGrads given{own(grad_a), own(grad_m), own(grad_g)};
    check_part_grads(op, given, x, a, m, g);
    if (grad_gate_regularizer.has_value()) {
      const Tensor& gr = *grad_gate_regularizer;
      check_gate_regularizer_grad(op, gr, x, g);  // g's shape: checked with the saved values below
      Dev::check_input(op, "x", x);
      const Tensor d = Dev::gate_regularizer_backward(gr, g.contiguous());
      given.g = given.g.defined() ? given.g.add(d) : d;
    }
    const PartGrads parts{given.a, given.m, input_gate ? given.g : Tensor()};
    Backward r = backward(op, args, grad_y, x, params(W_hat, M_hat, W_hat_m, M_hat_m, G, G_bias), saved, parts);
    if (!input_gate && given.g.defined()) r.grad_G = r.grad_G.add(given.g.mul(g.sub(g.mul(g))));  // g (1 - g)
    return {r.grad_x, r.grad_W_hat, r.grad_M_hat, r.grad_W_hat_m, r.grad_M_hat_m, r.grad_G, r.grad_G_bias};
  }

  // The gate regulariser sum(g^2 (1 - g)^2), over all of g or per member (schema.cpp).
  static Tensor nalu_gate_regularizer(const Tensor& g, bool per_member) {
    const char* op = "nalu_cuda::nalu_gate_regularizer";
    const std::vector<int64_t> out = check_gate_regularizer(op, g, per_member);
    Dev::check_input(op, "g", g);
    return Dev::gate_regularizer(g.contiguous(), out);
  }

  static Tensor nalu_gate_regularizer_backward(const Tensor& grad, const Tensor& g, bool per_member) {
    const char* op = "nalu_cuda::nalu_gate_regularizer_backward";
    check_gate_regularizer(op, g, per_member, grad);
    Dev::check_input(op, "g", g);
    return Dev::gate_regularizer_backward(grad.contiguous(), g.contiguous());
  }

  static void register_kernels(torch::Library& m) {
    m.impl("nac_weight", &nac_weight);
    m.impl("nac_weight_backward", &nac_weight_backward);
    m.impl("nac_forward", &nac_forward);
    m.impl("nac_backward", &nac_backward);
    m.impl("nac_mul_forward", &nac_mul_forward);
    m.impl("nac_mul_backward", &nac_mul_backward);
    m.impl("nalu_forward", &nalu_forward);
    m.impl("nalu_backward", &nalu_backward);
    m.impl("nalu_gate_regularizer", &nalu_gate_regularizer);
    m.impl("nalu_gate_regularizer_backward", &nalu_gate_regularizer_backward);
  }

 private:
  // The parameters of one call, each made contiguous here, once, and owned by the LayerParams for
  // the whole call: kernels read them through raw pointers, which must never point into a
  // temporary copy (a `t.contiguous().data_ptr()` of a non-contiguous `t` dangles at the `;`).
  static Tensor own(const Tensor& t) { return t.defined() ? t.contiguous() : t; }
  static Tensor own(const OptTensor& t) { return t.has_value() ? own(*t) : Tensor(); }

  static LayerParams params(const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m = c10::nullopt,
                            const OptTensor& M_hat_m = c10::nullopt, const Tensor& G = Tensor(),
                            const OptTensor& G_bias = c10::nullopt) {
    LayerParams p;
    p.W_hat = own(W_hat);
    p.M_hat = own(M_hat);
    p.W_hat_m = own(W_hat_m);
    p.M_hat_m = own(M_hat_m);
    p.G = own(G);
    p.G_bias = own(G_bias);
    return p;
  }

  static Forward forward(const char* op, const LayerArgs& args, const Tensor& x, const LayerParams& p) {
    const LayerShape s = check_layer(op, args, x, p);
    Dev::check_input(op, "x", x);
    return Dev::forward(args, s, x, p);
  }

  // Gradients that were not asked for (grad_x when compute_grad_x is false, the separate weights'
  // when tied, G_bias's without one) come back as the (0,)-shaped tensors of the schema.
  static Backward backward(const char* op, const LayerArgs& args, const Tensor& grad_y, const Tensor& x,
                           const LayerParams& p, const Forward& saved, const PartGrads& parts = {}) {
    const LayerShape s = check_layer(op, args, x, p);
    Dev::check_input(op, "x", x);
    check_saved(op, args.kind, s, x, p.G, grad_y, saved.a, saved.m, saved.g, saved.lx);
    Backward r = Dev::backward(args, s, grad_y, x, p, saved, parts);
    if (!r.grad_G_bias.defined()) r.grad_G_bias = empty_grad(x);
    if (!r.grad_x.defined()) r.grad_x = empty_grad(x);
    if (args.kind.nalu() && args.kind.tied) {
      r.grad_W_hat_m = empty_grad(x);
      r.grad_M_hat_m = empty_grad(x);
    }
    return r;
  }
};

}  // namespace nalu_cuda
