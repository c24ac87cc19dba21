// autograd.cpp: autograd for the forward ops of the NPU / RealNPU and iNALU (Autograd
// dispatch key, every device), as csrc/ops/nac_nalu/autograd.cpp does for NAC and NALU: each forward op is a
// torch::autograd::Function whose backward is one call of the matching *_backward op through the
// dispatcher. Saved: the inputs and the forward's extra results (NPU: s and lr; iNALU: a, u, msv,
// lx), which are marked non-differentiable.
// Double backward is not supported: the backward ops have no derivative of their own, so a
// backward run with create_graph=True raises (rather than return gradients that would silently
// lack their graph).

#include <tuple>
#include <utility>

#include "common/autograd.h"

namespace nalu_cuda {
namespace {

// Autograd runs a backward with grad mode on exactly when create_graph=True.
void check_no_double_backward(const char* op) {
  TORCH_CHECK(!torch::autograd::GradMode::is_enabled(), op,
              ": double backward (backward with create_graph=True) is not supported; use "
              "backend=\"reference\" for higher-order gradients");
}

class NpuFunction : public torch::autograd::Function<NpuFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_r, const OptTensor& W_i,
                               const Tensor& g, double eps) {
    static auto op = find_op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                                const Tensor&, double)>("nalu_cuda::npu_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, s, lr] = op.call(x, W_r, W_i, g, eps);
    ctx->save_for_backward({x, W_r, W_i.has_value() ? *W_i : Tensor(), g, y, s, lr});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["complex"] = W_i.has_value();
    ctx->mark_non_differentiable({s, lr});
    ctx->set_materialize_grads(false);
    return {y, s, lr};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<std::tuple<Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, double, bool)>("nalu_cuda::npu_backward");
    if (!grads[0].defined()) return variable_list(5);
    check_no_double_backward("nalu_cuda::npu_forward");
    auto s = ctx->get_saved_variables();
    const bool complex = ctx->saved_data["complex"].toBool();
    const bool need_x = ctx->needs_input_grad(0);
    auto [gx, gwr, gwi, gg] = op.call(grads[0], s[0], s[1], complex ? OptTensor(s[2]) : c10::nullopt, s[3], s[4],
                                      s[5], s[6], ctx->saved_data["eps"].toDouble(), need_x);
    return {need_x ? gx : Tensor(), gwr, complex ? gwi : Tensor(), gg, Tensor()};
  }
};

class InaluFunction : public torch::autograd::Function<InaluFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                               const Tensor& W_hat_m, const Tensor& M_hat_m, const Tensor& G, double eps,
                               double omega) {
    static auto op =
        find_op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                   const Tensor&, const Tensor&, const Tensor&, double,
                                                                   double)>("nalu_cuda::inalu_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, a, u, msv, lx] = op.call(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega);
    ctx->save_for_backward({x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, u, msv, lx});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["omega"] = omega;
    ctx->mark_non_differentiable({a, u, msv, lx});
    ctx->set_materialize_grads(false);
    return {y, a, u, msv, lx};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, bool)>("nalu_cuda::inalu_backward");
    if (!grads[0].defined()) return variable_list(8);
    check_no_double_backward("nalu_cuda::inalu_forward");
    auto s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    auto [gx, gw, gm, gwm, gmm, gG] =
        op.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9],
                ctx->saved_data["eps"].toDouble(), ctx->saved_data["omega"].toDouble(), need_x);
    return {need_x ? gx : Tensor(), gw, gm, gwm, gmm, gG, Tensor(), Tensor()};
  }
};

// A Function's first N outputs as the op's tuple of results.
template <size_t N>
auto results(const variable_list& r) {
  return [&]<size_t... K>(std::index_sequence<K...>) {
    return std::make_tuple(r[K]...);
  }(std::make_index_sequence<N>());
}

std::tuple<Tensor, Tensor, Tensor> npu_forward_autograd(const Tensor& x, const Tensor& W_r, const OptTensor& W_i,
                                                        const Tensor& g, double eps) {
  return results<3>(NpuFunction::apply(x, W_r, W_i, g, eps));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> inalu_forward_autograd(const Tensor& x, const Tensor& W_hat,
                                                                          const Tensor& M_hat, const Tensor& W_hat_m,
                                                                          const Tensor& M_hat_m, const Tensor& G,
                                                                          double eps, double omega) {
  return results<5>(InaluFunction::apply(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega));
}

}  // namespace

// The family's Autograd registration (every family registers its own: csrc/common/registration.h).
TORCH_LIBRARY_IMPL(nalu_cuda, Autograd, m) {
  m.impl("npu_forward", &npu_forward_autograd);
  m.impl("inalu_forward", &inalu_forward_autograd);
}

}  // namespace nalu_cuda
