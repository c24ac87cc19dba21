// autograd.cpp: autograd for the forward ops (Autograd dispatch key, every device).
//
// Each forward op is a torch::autograd::Function whose backward is one call of the matching
// *_backward op through the dispatcher (so it runs on the inputs' device, and torch.compile
// traces it through the ops' fakes). Saved: the inputs and the forward's extra results
// (lx = log(|x| + eps); a, m, g for NALU); those extra results are marked non-differentiable.
// Written in C++ rather than with torch.library.register_autograd because at the paper's layer
// sizes the Python wrapper costs more than the whole fused forward. Double backward is not
// supported (the backward ops have no autograd): create_graph=True raises when it is used.
#include <torch/autograd.h>
#include <torch/library.h>

namespace nalu_cuda {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;
using OptTensor = c10::optional<Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

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
    auto [gw, gm] = op.call(grads[0], saved[0], saved[1]);
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
    auto [gx, gw, gm] = op.call(grads[0], s[0], s[1], s[2], need_x);
    return {need_x ? gx : Tensor(), gw, gm};
  }
};

class NacMulFunction : public torch::autograd::Function<NacMulFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                               double eps) {
    static auto op = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
        "nalu_cuda::nac_mul_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, lx] = op.call(x, W_hat, M_hat, eps);
    ctx->save_for_backward({x, W_hat, M_hat, y, lx});
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({lx});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for lx
    return {y, lx};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                const Tensor&, const Tensor&, const Tensor&,
                                                                double, bool)>("nalu_cuda::nac_mul_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    auto [gx, gw, gm] = op.call(grads[0], s[0], s[1], s[2], s[3], s[4], ctx->saved_data["eps"].toDouble(), need_x);
    return {need_x ? gx : Tensor(), gw, gm, Tensor()};
  }
};

class NaluFunction : public torch::autograd::Function<NaluFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                               const OptTensor& W_hat_m, const OptTensor& M_hat_m, const Tensor& G, double eps,
                               bool input_gate) {
    static auto op =
        find_op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                   const OptTensor&, const OptTensor&, const Tensor&,
                                                                   double, bool)>("nalu_cuda::nalu_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, a, m, g, lx] = op.call(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate);
    ctx->save_for_backward({x, W_hat, M_hat, or_undefined(W_hat_m), or_undefined(M_hat_m), G, a, m, g, lx});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["input_gate"] = input_gate;
    ctx->saved_data["separate"] = W_hat_m.has_value();
    ctx->mark_non_differentiable({a, m, g, lx});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for a, m, g, lx
    return {y, a, m, g, lx};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, bool, bool)>(
        "nalu_cuda::nalu_backward");
    if (!grads[0].defined()) return variable_list(8);
    auto s = ctx->get_saved_variables();
    const bool separate = ctx->saved_data["separate"].toBool();
    const OptTensor W_hat_m = separate ? OptTensor(s[3]) : c10::nullopt;
    const OptTensor M_hat_m = separate ? OptTensor(s[4]) : c10::nullopt;
    const bool need_x = ctx->needs_input_grad(0);
    auto [gx, gw, gm, gwm, gmm, gG] =
        op.call(grads[0], s[0], s[1], s[2], W_hat_m, M_hat_m, s[5], s[6], s[7], s[8], s[9],
                ctx->saved_data["eps"].toDouble(), ctx->saved_data["input_gate"].toBool(), need_x);
    return {need_x ? gx : Tensor(),
            gw,
            gm,
            separate ? gwm : Tensor(),
            separate ? gmm : Tensor(),
            gG,
            Tensor(),
            Tensor()};
  }
};

Tensor nac_weight_autograd(const Tensor& W_hat, const Tensor& M_hat) {
  return NacWeightFunction::apply(W_hat, M_hat);
}

Tensor nac_forward_autograd(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat) {
  return NacFunction::apply(x, W_hat, M_hat);
}

std::tuple<Tensor, Tensor> nac_mul_forward_autograd(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                                                    double eps) {
  auto r = NacMulFunction::apply(x, W_hat, M_hat, eps);
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> nalu_forward_autograd(const Tensor& x, const Tensor& W_hat,
                                                                         const Tensor& M_hat, const OptTensor& W_hat_m,
                                                                         const OptTensor& M_hat_m, const Tensor& G,
                                                                         double eps, bool input_gate) {
  auto r = NaluFunction::apply(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate);
  return {r[0], r[1], r[2], r[3], r[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, Autograd, m) {
  m.impl("nac_weight", &nac_weight_autograd);
  m.impl("nac_forward", &nac_forward_autograd);
  m.impl("nac_mul_forward", &nac_mul_forward_autograd);
  m.impl("nalu_forward", &nalu_forward_autograd);
}

}  // namespace nalu_cuda
