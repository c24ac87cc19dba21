// autograd.cpp: autograd for the forward ops (Autograd dispatch key, every device).
//
// Each forward op is a torch::autograd::Function whose backward is one call of the matching
// *_backward op through the dispatcher (so it runs on the inputs' device, and torch.compile
// traces it through the ops' fakes). Saved: the inputs and the forward's extra results
// (lx = log(|x| + eps); a, m, g for NALU); lx is marked non-differentiable, NALU's a, m, g are
// not (their gradients go to nalu_backward as grad_a, grad_m, grad_g: nalu_parts), nor is its gate
// regulariser r when the forward computed it (its gradient goes as grad_gate_regularizer).
// Written in C++ rather than with torch.library.register_autograd because at the paper's layer
// sizes the Python wrapper costs more than the whole fused forward.
//
// Double backward: the *_backward ops have no autograd of their own, so when grad mode is on
// inside backward (create_graph=True: gradient penalties, meta-learning, Hessian-vector
// products), each backward instead calls its *_backward_composite below: the same gradients by
// the formulas of the reference's derivative (s(x) = sign(x) / (|x| + eps), sign(0) = 0), in
// differentiable ATen ops that recompute W, lx, a, m and g from the saved inputs, so that
// autograd records a graph for every second derivative. The plain backward keeps the fused op.

#include "common/autograd.h"

namespace nalu_cuda {
namespace {

Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

// The scalar arguments of a forward op, in its schema's order, as one unit: one argument of the
// Function's apply (so one gradient slot, always undefined), one saved value, passed whole to the
// forward op and to its backward op (whose schema takes the same scalars in the same order, then
// compute_grad_x). A new scalar argument is one more type here and one more parameter of the op's
// *_autograd entry at the end of this file.
using NacMulScalars = std::tuple<double>;      // eps
using NaluScalars = std::tuple<double, bool>;  // eps, input_gate (gate_regularizer: an argument of its own)

// The typed signature Ret(Before..., the scalars of Scalars..., After...) of an op.
template <typename Ret, typename Scalars, typename... Before>
struct WithScalars;
template <typename Ret, typename... S, typename... Before>
struct WithScalars<Ret, std::tuple<S...>, Before...> {
  template <typename... After>
  using sig = Ret(Before..., S..., After...);
};

// The scalars as the forward saved them (ctx->saved_data["scalars"] = scalars).
template <typename Scalars>
Scalars saved_scalars(AutogradContext* ctx) {
  return ctx->saved_data["scalars"].to<Scalars>();
}

// ------------------------------------------------------------------------------------------------
// Differentiable backward (create_graph=True), one function per op, in ATen ops only.
// Shapes: a plain layer has W (I, O) and x (..., I); an ensemble W (E, I, O) and x (E, ..., I).
// ------------------------------------------------------------------------------------------------

// Rows of x per ensemble member (all of them for a plain layer): the batch dims flattened.
int64_t batch_rows(const Tensor& x, bool ensemble) {
  int64_t rows = 1;
  for (int64_t d = ensemble ? 1 : 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// x W for a plain layer or an ensemble (the reference's _matmul).
Tensor layer_matmul(const Tensor& x, const Tensor& W) {
  auto shape = x.sizes().vec();
  shape.back() = W.size(-1);
  if (W.dim() == 2) return at::matmul(x, W);
  const int64_t E = W.size(0);
  return at::bmm(x.reshape({E, batch_rows(x, true), W.size(1)}), W).reshape(shape);
}

// dL/dW of y = x W from dy = dL/dy: x^T dy summed over the batch, shaped like W.
Tensor layer_weight_grad(const Tensor& x, const Tensor& dy, const Tensor& W) {
  const bool ensemble = W.dim() == 3;
  const int64_t rows = batch_rows(x, ensemble), I = W.size(-2), O = W.size(-1);
  if (!ensemble) return at::mm(x.reshape({rows, I}).t(), dy.reshape({rows, O}));
  const int64_t E = W.size(0);
  return at::bmm(x.reshape({E, rows, I}).transpose(1, 2), dy.reshape({E, rows, O}));
}

// d lx / dx = sign(x) / (|x| + eps), 0 at x = 0.
Tensor log_abs_derivative(const Tensor& x, double eps) { return at::sign(x) / (at::abs(x) + eps); }

// W = tanh(W_hat) * sigmoid(M_hat).
Tensor nac_weight_composite(const Tensor& W_hat, const Tensor& M_hat) {
  return at::tanh(W_hat) * at::sigmoid(M_hat);
}

// dW_hat = dW (1 - tanh^2) sigmoid,  dM_hat = dW tanh sigmoid (1 - sigmoid).
std::tuple<Tensor, Tensor> nac_weight_backward_composite(const Tensor& grad_W, const Tensor& W_hat,
                                                         const Tensor& M_hat) {
  const Tensor t = at::tanh(W_hat), s = at::sigmoid(M_hat);
  return {grad_W * (1 - t * t) * s, grad_W * t * s * (1 - s)};
}

// y = x W:  dx = dy W^T,  dW = x^T dy.
variable_list nac_backward_composite(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat,
                                     const Tensor& M_hat, bool need_x) {
  const Tensor W = nac_weight_composite(W_hat, M_hat);
  auto [gw, gm] = nac_weight_backward_composite(layer_weight_grad(x, grad_y, W), W_hat, M_hat);
  return {need_x ? layer_matmul(grad_y, W.transpose(-1, -2)) : Tensor(), gw, gm};
}

// y = exp(u), u = lx W:  du = dy y,  dW = lx^T du,  dx = (du W^T) s(x).
variable_list nac_mul_backward_composite(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat,
                                         const Tensor& M_hat, double eps, bool need_x) {
  const Tensor W = nac_weight_composite(W_hat, M_hat);
  const Tensor lx = at::log(at::abs(x) + eps);
  const Tensor du = grad_y * at::exp(layer_matmul(lx, W));
  auto [gw, gm] = nac_weight_backward_composite(layer_weight_grad(lx, du, W), W_hat, M_hat);
  Tensor gx;
  if (need_x) gx = layer_matmul(du, W.transpose(-1, -2)) * log_abs_derivative(x, eps);
  return {gx, gw, gm};
}

// (E, O) -> (E, 1, ..., 1, O), a per-member vector (an independent gate, a gate bias) against
// outputs of shape (E, ..., O); a plain layer's (O,) broadcasts as it is.
Tensor per_member(const Tensor& v, const Tensor& x, bool ensemble) {
  if (!ensemble) return v;
  std::vector<int64_t> shape(x.dim(), 1);
  shape.front() = v.size(0);
  shape.back() = v.size(-1);
  return v.reshape(shape);
}

// The sum over the batch of d (outputs' shape) into a per-member vector's shape ((O,) / (E, O)).
Tensor batch_sum(const Tensor& d, const Tensor& x, bool ensemble, int64_t O) {
  const int64_t rows = batch_rows(x, ensemble);
  return ensemble ? d.reshape({d.size(0), rows, O}).sum(1) : d.reshape({rows, O}).sum(0);
}

// y = g a + (1 - g) m (docs/units.md), z = x G + G_bias: da = g dy, du = (1 - g) dy m,
// dz = (a - m) dy g (1 - g), and the gradients reaching the parts directly (nalu_parts; undefined:
// none): da += ga, du += gm m, dz += gg g (1 - g) (an independent gate's gg, G's shape, adds
// gg g (1 - g) to dG instead), where gg also has the gate regulariser's gr 2 g (1 - g) (1 - 2 g). dW = x^T da (+ lx^T du when tied), dW_m = lx^T du, dG = x^T dz
// (input gate) or the batch sum of dz, dG_bias = the batch sum of dz; dx = da W^T + dz G^T (input
// gate) + (du W_m^T) s(x). Returns (dx, dW_hat, dM_hat, dW_hat_m, dM_hat_m, dG, dG_bias); dW_hat_m,
// dM_hat_m undefined when tied, dG_bias without a bias.
variable_list nalu_backward_composite(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                                      const OptTensor& W_hat_m, const OptTensor& M_hat_m, const Tensor& G,
                                      const OptTensor& G_bias, double eps, bool input_gate, bool need_x,
                                      const Tensor& ga, const Tensor& gm, const Tensor& gg_parts,
                                      const Tensor& gr) {
  const bool separate = W_hat_m.has_value();
  const bool ensemble = W_hat.dim() == 3;
  const int64_t O = W_hat.size(-1);
  const Tensor W = nac_weight_composite(W_hat, M_hat);
  const Tensor W_m = separate ? nac_weight_composite(*W_hat_m, *M_hat_m) : W;
  const Tensor lx = at::log(at::abs(x) + eps);
  const Tensor a = layer_matmul(x, W);
  const Tensor m = at::exp(layer_matmul(lx, W_m));
  Tensor g;
  if (input_gate) {
    Tensor z = layer_matmul(x, G);
    if (G_bias.has_value()) z = z + per_member(*G_bias, x, ensemble);
    g = at::sigmoid(z);
  } else {
    g = per_member(at::sigmoid(G), x, ensemble);
  }
  Tensor gg = gg_parts;
  if (gr.defined()) {  // the regulariser's gradient at g (G's shape for an independent gate)
    const Tensor gate = input_gate ? g : at::sigmoid(G);
    const Tensor h = gate - gate * gate;
    const Tensor d = gr * 2 * h * (1 - 2 * gate);
    gg = gg.defined() ? gg + d : d;
  }
  Tensor da = g * grad_y;
  if (ga.defined()) da = da + ga;
  Tensor du = (1 - g) * grad_y;
  if (gm.defined()) du = du + gm;
  du = du * m;
  Tensor dz = (a - m) * grad_y;
  if (gg.defined() && input_gate) dz = dz + gg;
  dz = dz * g * (1 - g);
  Tensor dW = layer_weight_grad(x, da, W);
  const Tensor dW_m = layer_weight_grad(lx, du, W_m);
  Tensor dG = input_gate ? layer_weight_grad(x, dz, G) : batch_sum(dz, x, ensemble, O);
  if (gg.defined() && !input_gate) {
    const Tensor s = at::sigmoid(G);
    dG = dG + gg * s * (1 - s);
  }
  const Tensor dG_bias = G_bias.has_value() ? batch_sum(dz, x, ensemble, O) : Tensor();
  Tensor gw, gm_hat, gwm, gmm;
  if (separate) {
    std::tie(gwm, gmm) = nac_weight_backward_composite(dW_m, *W_hat_m, *M_hat_m);
  } else {
    dW = dW + dW_m;
  }
  std::tie(gw, gm_hat) = nac_weight_backward_composite(dW, W_hat, M_hat);
  Tensor gx;
  if (need_x) {
    gx = layer_matmul(da, W.transpose(-1, -2)) + layer_matmul(du, W_m.transpose(-1, -2)) * log_abs_derivative(x, eps);
    if (input_gate) gx = gx + layer_matmul(dz, G.transpose(-1, -2));
  }
  return {gx, gw, gm_hat, gwm, gmm, dG, dG_bias};
}

class NacWeightFunction : public torch::autograd::Function<NacWeightFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& W_hat, const Tensor& M_hat) {
    static auto op = find_op<Tensor(const Tensor&, const Tensor&)>("nalu_cuda::nac_weight");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({W_hat, M_hat});
    return op.call(W_hat, M_hat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&)>(
        "nalu_cuda::nac_weight_backward");
    auto saved = ctx->get_saved_variables();
    auto [gw, gm] = at::GradMode::is_enabled() ? nac_weight_backward_composite(grads[0], saved[0], saved[1])
                                               : op.call(grads[0], saved[0], saved[1]);
    return {gw, gm};
  }
};

class NacFunction : public torch::autograd::Function<NacFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat) {
    static auto op = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("nalu_cuda::nac_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, W_hat, M_hat});
    return op.call(x, W_hat, M_hat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                const Tensor&, bool)>("nalu_cuda::nac_backward");
    auto s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    if (at::GradMode::is_enabled()) return nac_backward_composite(grads[0], s[0], s[1], s[2], need_x);
    auto [gx, gw, gm] = op.call(grads[0], s[0], s[1], s[2], need_x);
    return {need_x ? gx : Tensor(), gw, gm};
  }
};

class NacMulFunction : public torch::autograd::Function<NacMulFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                               const NacMulScalars& scalars) {
    static auto op = find_op<WithScalars<std::tuple<Tensor, Tensor>, NacMulScalars, const Tensor&, const Tensor&,
                                         const Tensor&>::sig<>>("nalu_cuda::nac_mul_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, lx] = std::apply([&](auto... sc) { return op.call(x, W_hat, M_hat, sc...); }, scalars);
    ctx->save_for_backward({x, W_hat, M_hat, y, lx});
    ctx->saved_data["scalars"] = scalars;
    ctx->mark_non_differentiable({lx});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for lx
    return {y, lx};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<WithScalars<std::tuple<Tensor, Tensor, Tensor>, NacMulScalars, const Tensor&,
                                         const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                         const Tensor&>::sig<bool>>("nalu_cuda::nac_mul_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    const auto scalars = saved_scalars<NacMulScalars>(ctx);
    if (at::GradMode::is_enabled()) {
      const auto [eps] = scalars;
      auto r = nac_mul_backward_composite(grads[0], s[0], s[1], s[2], eps, need_x);
      r.emplace_back();
      return r;
    }
    auto [gx, gw, gm] = std::apply(
        [&](auto... sc) { return op.call(grads[0], s[0], s[1], s[2], s[3], s[4], sc..., need_x); }, scalars);
    return {need_x ? gx : Tensor(), gw, gm, Tensor()};
  }
};

// a, m and g are differentiable outputs (nalu_parts: a gate regulariser, a loss on a path): their
// gradients go to the backward op as grad_a, grad_m, grad_g; lx is not; r (the gate regulariser,
// when gate_regularizer) is, its gradient going as grad_gate_regularizer.
class NaluFunction : public torch::autograd::Function<NaluFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                               const OptTensor& W_hat_m, const OptTensor& M_hat_m, const Tensor& G,
                               const NaluScalars& scalars, const OptTensor& G_bias, bool gate_regularizer) {
    static auto op = find_op<WithScalars<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>, NaluScalars,
                                         const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                         const Tensor&>::sig<const OptTensor&, bool>>("nalu_cuda::nalu_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, a, m, g, lx, r] = std::apply(
        [&](auto... sc) { return op.call(x, W_hat, M_hat, W_hat_m, M_hat_m, G, sc..., G_bias, gate_regularizer); },
        scalars);
    ctx->save_for_backward(
        {x, W_hat, M_hat, or_undefined(W_hat_m), or_undefined(M_hat_m), G, a, m, g, lx, or_undefined(G_bias)});
    ctx->saved_data["scalars"] = scalars;
    ctx->saved_data["separate"] = W_hat_m.has_value();
    ctx->saved_data["bias"] = G_bias.has_value();
    if (gate_regularizer) {
      ctx->mark_non_differentiable({lx});
    } else {
      ctx->mark_non_differentiable({lx, r});  // r: a (0,)-shaped placeholder
    }
    ctx->set_materialize_grads(false);  // undefined, not zero-filled, gradients for the outputs without one
    return {y, a, m, g, lx, r};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<WithScalars<
        std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>, NaluScalars, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&>::sig<bool, const OptTensor&, const OptTensor&, const OptTensor&,
                                           const OptTensor&, const OptTensor&>>("nalu_cuda::nalu_backward");
    const Tensor &ga = grads[1], &gm = grads[2], &gg = grads[3], &gr = grads[5];
    if (!grads[0].defined() && !ga.defined() && !gm.defined() && !gg.defined() && !gr.defined()) {
      return variable_list(9);
    }
    auto s = ctx->get_saved_variables();
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(s[6]);  // a loss on the parts only
    const bool separate = ctx->saved_data["separate"].toBool();
    const OptTensor W_hat_m = separate ? OptTensor(s[3]) : c10::nullopt;
    const OptTensor M_hat_m = separate ? OptTensor(s[4]) : c10::nullopt;
    const OptTensor G_bias = ctx->saved_data["bias"].toBool() ? OptTensor(s[10]) : c10::nullopt;
    const bool need_x = ctx->needs_input_grad(0);
    const auto scalars = saved_scalars<NaluScalars>(ctx);
    if (at::GradMode::is_enabled()) {
      const auto [eps, input_gate] = scalars;
      auto r = nalu_backward_composite(dy, s[0], s[1], s[2], W_hat_m, M_hat_m, s[5], G_bias, eps, input_gate, need_x,
                                       ga, gm, gg, gr);
      return {r[0], r[1], r[2], r[3], r[4], r[5], Tensor(), r[6], Tensor()};
    }
    auto opt = [](const Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; };
    auto [gx, gw, gm_hat, gwm, gmm, gG, gGb] = std::apply(
        [&](auto... sc) {
          return op.call(dy, s[0], s[1], s[2], W_hat_m, M_hat_m, s[5], s[6], s[7], s[8], s[9], sc..., need_x, G_bias,
                         opt(ga), opt(gm), opt(gg), opt(gr));
        },
        scalars);
    return {need_x ? gx : Tensor(), gw, gm_hat, separate ? gwm : Tensor(), separate ? gmm : Tensor(), gG, Tensor(),
            G_bias.has_value() ? gGb : Tensor(), Tensor()};
  }
};

Tensor nac_weight_autograd(const Tensor& W_hat, const Tensor& M_hat) {
  return NacWeightFunction::apply(W_hat, M_hat);
}

Tensor nac_forward_autograd(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat) {
  return NacFunction::apply(x, W_hat, M_hat);
}

// The gate regulariser: one node; its backward is nalu_gate_regularizer_backward, or under
// create_graph the same formula, grad 2 g (1 - g) (1 - 2 g), in differentiable ATen ops.
class GateRegularizerFunction : public torch::autograd::Function<GateRegularizerFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& g, bool per_member) {
    static auto op = find_op<Tensor(const Tensor&, bool)>("nalu_cuda::nalu_gate_regularizer");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({g});
    ctx->saved_data["per_member"] = per_member;
    return op.call(g, per_member);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<Tensor(const Tensor&, const Tensor&, bool)>("nalu_cuda::nalu_gate_regularizer_backward");
    const Tensor g = ctx->get_saved_variables()[0];
    const bool per_member = ctx->saved_data["per_member"].toBool();
    if (!at::GradMode::is_enabled()) return {op.call(grads[0], g, per_member), Tensor()};
    std::vector<int64_t> grad_shape(static_cast<size_t>(g.dim()), 1);  // grad broadcast over g
    if (per_member) grad_shape[0] = g.size(0);
    const Tensor h = g - g * g;
    return {grads[0].reshape(grad_shape) * 2 * h * (1 - 2 * g), Tensor()};
  }
};

Tensor nalu_gate_regularizer_autograd(const Tensor& g, bool per_member) {
  return GateRegularizerFunction::apply(g, per_member);
}

std::tuple<Tensor, Tensor> nac_mul_forward_autograd(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                                                    double eps) {
  auto r = NacMulFunction::apply(x, W_hat, M_hat, NacMulScalars{eps});
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nalu_forward_autograd(
    const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m, const OptTensor& M_hat_m,
    const Tensor& G, double eps, bool input_gate, const OptTensor& G_bias, bool gate_regularizer) {
  auto r = NaluFunction::apply(x, W_hat, M_hat, W_hat_m, M_hat_m, G, NaluScalars{eps, input_gate}, G_bias,
                               gate_regularizer);
  return {r[0], r[1], r[2], r[3], r[4], r[5]};
}

}  // namespace

// The family's Autograd registration (every family registers its own: csrc/common/registration.h).
TORCH_LIBRARY_IMPL(nalu_cuda, Autograd, m) {
  m.impl("nac_weight", &nac_weight_autograd);
  m.impl("nac_forward", &nac_forward_autograd);
  m.impl("nac_mul_forward", &nac_mul_forward_autograd);
  m.impl("nalu_forward", &nalu_forward_autograd);
  m.impl("nalu_gate_regularizer", &nalu_gate_regularizer_autograd);
}

}  // namespace nalu_cuda
