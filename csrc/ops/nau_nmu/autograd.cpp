// autograd.cpp: autograd of the NAU and NMU forward ops (Autograd dispatch key, every
// device), as csrc/ops/nac_nalu/autograd.cpp does for NAC/NALU: the backward is one call of the matching
// *_backward op through the dispatcher. Saved: x and W (the NMU backward recomputes its factors).
//
// Double backward (create_graph=True): the backward then runs as differentiable ATen ops instead
// of the backward op, so that its own graph is recorded: NAU's clamp and matrix products
// (ops/nau_nmu/checks.h nau_backward_math), and NMU's exclusive products by cumprod (nmu_backward_composite,
// which materialises the (E, N, I, O) factors: fine for the rare second-order use, never on the
// first-order path).
#include <ATen/core/grad_mode.h>

#include "common/autograd.h"
#include "ops/nau_nmu/checks.h"

namespace nalu_cuda {
namespace {

using ForwardSig = Tensor(const Tensor&, const Tensor&);
using BackwardSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, bool);

// NAU and NMU differ only in their ops and their differentiable backward.
template <typename Unit>
class UnitFunction : public torch::autograd::Function<UnitFunction<Unit>> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& W) {
    static auto op = find_op<ForwardSig>(Unit::kForward);
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, W});
    return op.call(x, W);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<BackwardSig>(Unit::kBackward);
    auto s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    if (at::GradMode::is_enabled()) {  // create_graph=True
      const LayerShape shape = check_unit_backward(Unit::kBackward, grads[0], s[0], s[1]);
      auto [gx, gW] = Unit::differentiable_backward(shape, grads[0], s[0], s[1], need_x);
      return {need_x ? gx : Tensor(), gW};
    }
    auto [gx, gW] = op.call(grads[0], s[0], s[1], need_x);
    return {need_x ? gx : Tensor(), gW};
  }
};

struct Nau {
  static constexpr const char* kForward = "nalu_cuda::nau_forward";
  static constexpr const char* kBackward = "nalu_cuda::nau_backward";
  static std::tuple<Tensor, Tensor> differentiable_backward(const LayerShape& s, const Tensor& gy, const Tensor& x,
                                                            const Tensor& W, bool need_x) {
    return nau_backward_math(s, gy, x, W, need_x);
  }
};

struct Nmu {
  static constexpr const char* kForward = "nalu_cuda::nmu_forward";
  static constexpr const char* kBackward = "nalu_cuda::nmu_backward";
  static std::tuple<Tensor, Tensor> differentiable_backward(const LayerShape& s, const Tensor& gy, const Tensor& x,
                                                            const Tensor& W, bool /*need_x*/) {
    return nmu_backward_composite(s, gy, x, W);
  }
};

Tensor nau_forward_autograd(const Tensor& x, const Tensor& W) { return UnitFunction<Nau>::apply(x, W); }
Tensor nmu_forward_autograd(const Tensor& x, const Tensor& W) { return UnitFunction<Nmu>::apply(x, W); }

}  // namespace

// The family's Autograd registration (every family registers its own: csrc/common/registration.h).
TORCH_LIBRARY_IMPL(nalu_cuda, Autograd, m) {
  m.impl("nau_forward", &nau_forward_autograd);
  m.impl("nmu_forward", &nmu_forward_autograd);
}

}  // namespace nalu_cuda
