// ensemble_step.cpp: the CPU kernels of the ops static_ensemble_grad and static_ensemble_step
// (schemas and their contract: csrc/experiments/schema.cpp): a whole training step of the static
// task's two-layer ensemble models in one call. Per member: forward through both layers, the MSE,
// the objective's finiteness, the backward into the optimiser's flat gradient buffer; then (the
// step op) FlatAdam's own fused step (flat_adam.h, called, not copied) and the NMU model's
// projection.
//
// Members never mix: at::parallel_for splits them over the intra-op threads and each member is
// computed whole by one thread in a fixed order, so the results are the same bits for any number
// of threads (and a member's bits do not depend on the ensemble's size).
//
// To add a model: a Model value and its name (model_from_name), its layer kinds (layer_kinds),
// its parameter count per layer (params_per_layer), and where a layer kind is new, its forward and
// backward in Layer below; the Python side lists the model in nalu_cuda/experiments/parts/native_step.py.
#include "experiments/cpu/flat_adam.h"

#include "common/cpu/isa.h"
#include "common/math.h"
#include "experiments/cpu/fp_contract.h"
#include "ops/nac_nalu/math.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

// One rounding everywhere in a loop (vector body and remainder alike): no contraction into FMA.
NALU_FP_CONTRACT_OFF

namespace nalu_cuda {
namespace training {
namespace {

enum class Model { kNac, kNalu, kNmu };
enum class Kind { kNac, kNalu, kNau, kNmu };

Model model_from_name(const std::string& op, const std::string& name) {
  if (name == "nac") return Model::kNac;
  if (name == "nalu") return Model::kNalu;
  if (name == "nmu") return Model::kNmu;
  TORCH_CHECK(false, op, ": argument 'model' must be one of 'nac' (NAC+ -> NAC+), 'nalu' (NALU -> NALU, tied "
              "weights, input gate) or 'nmu' (NAU -> NMU), got '", name, "'");
}

// The layer kinds of a model, first and second layer.
void layer_kinds(Model m, Kind* first, Kind* second) {
  *first = m == Model::kNac ? Kind::kNac : m == Model::kNalu ? Kind::kNalu : Kind::kNau;
  *second = m == Model::kNac ? Kind::kNac : m == Model::kNalu ? Kind::kNalu : Kind::kNmu;
}

// Parameters of one layer, in the order the layer registers them (FlatAdam's buffer order):
// NAC W_hat, M_hat; NALU W_hat, M_hat, G; NAU and NMU W.
int params_per_layer(Kind k) { return k == Kind::kNac ? 2 : k == Kind::kNalu ? 3 : 1; }

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream s;
  s << "a " << t.scalar_type() << " " << t.device() << " tensor of shape " << t.sizes()
    << (t.is_contiguous() ? "" : " (not contiguous)");
  return s.str();
}

// The scalar arguments of one call, checked.
struct StepArgs {
  Model model;
  Kind kinds[2];
  int64_t E, B, I, H;
  double eps, reg_weight;
};

}  // namespace

// The per-member kernels, once per instruction set (the ops pick one with cpu::use_avx2()).
namespace base {
#include "experiments/cpu/ensemble_step_kernels.h"
}  // namespace base
#ifdef NALU_CPU_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "experiments/cpu/ensemble_step_kernels.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

void check_cpu_tensor(const char* op, const char* name, const at::Tensor& t, const std::string& want, bool ok) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous() && ok, op, ": argument '", name,
              "' must be ", want, ", got ", describe(t));
}

// The checks every argument of both ops gets; returns the call's shapes and scalars.
StepArgs check_step(const char* op, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                    const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                    const std::string& model, double eps, double reg_weight) {
  StepArgs a{};
  a.model = model_from_name(op, model);
  layer_kinds(a.model, &a.kinds[0], &a.kinds[1]);
  const bool fp = x.defined() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
  check_cpu_tensor(op, "x", x, "a contiguous float32 or float64 CPU tensor of shape (E, B, I)", fp && x.dim() == 3);
  a.E = x.size(0), a.B = x.size(1), a.I = x.size(2);
  TORCH_CHECK(a.E >= 1 && a.B >= 1 && a.I >= 1, op, ": argument 'x' must have at least one member, sample and "
              "input, got shape ", x.sizes());
  const std::string like_x = c10::str("a contiguous CPU tensor of x's dtype (", x.scalar_type(), ")");
  check_cpu_tensor(op, "target", target, like_x + c10::str(" of shape [", a.E, ", ", a.B, ", 1]"),
                   target.defined() && target.scalar_type() == x.scalar_type() && target.dim() == 3 &&
                       target.size(0) == a.E && target.size(1) == a.B && target.size(2) == 1);
  check_cpu_tensor(op, "param", param, like_x + " of one dimension (FlatAdam's flat buffer)",
                   param.defined() && param.scalar_type() == x.scalar_type() && param.dim() == 1);
  check_cpu_tensor(op, "grad", grad, like_x + c10::str(" of param's shape [", param.numel(), "]"),
                   grad.defined() && grad.scalar_type() == x.scalar_type() && grad.dim() == 1 &&
                       grad.numel() == param.numel());
  check_cpu_tensor(op, "diverged", diverged, c10::str("a contiguous bool CPU tensor of shape [", a.E, "] (one flag per member)"),
                   diverged.defined() && diverged.scalar_type() == at::kBool && diverged.dim() == 1 &&
                       diverged.numel() == a.E);
  const int64_t P = params_per_layer(a.kinds[0]) + params_per_layer(a.kinds[1]);
  check_cpu_tensor(op, "segments", segments, c10::str("a contiguous int64 CPU tensor of shape [", P, ", 2] (offset, "
                   "per_member) for model '", model, "'"), segments.defined() && segments.scalar_type() == at::kLong &&
                   segments.dim() == 2 && segments.size(0) == P && segments.size(1) == 2);
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  a.H = seg[1] / a.I;
  for (int64_t q = 0; q < P; ++q) {
    const int64_t want = q < params_per_layer(a.kinds[0]) ? a.I * a.H : a.H;
    TORCH_CHECK(a.H >= 1 && seg[1] == a.I * a.H && seg[2 * q + 1] == want && seg[2 * q] >= 0 &&
                    seg[2 * q] + a.E * want <= param.numel(),
                op, ": argument 'segments' row ", q, " must be (offset, ", want, ") inside param's ", param.numel(),
                " elements for E = ", a.E, ", I = ", a.I, ", hidden ", a.H, ", got (", seg[2 * q], ", ", seg[2 * q + 1], ")");
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": argument 'eps' must be a finite number >= 0, got ", eps);
  TORCH_CHECK(std::isfinite(reg_weight) && reg_weight >= 0.0 && (reg_weight == 0.0 || a.model == Model::kNmu), op,
              ": argument 'reg_weight' must be 0 (or, for model 'nmu', a finite number >= 0), got ", reg_weight);
  a.eps = eps;
  a.reg_weight = reg_weight;
  return a;
}

at::Tensor grad_impl(const StepArgs& a, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                     const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged) {
  at::Tensor loss = at::empty({a.E}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "static_ensemble_grad", [&] {
#ifdef NALU_CPU_HAVE_AVX2
    if (cpu::use_avx2()) {
      avx2::all_members<scalar_t>(a, x, target, param, grad, segments, diverged, loss.data_ptr<scalar_t>());
      return;
    }
#endif
    base::all_members<scalar_t>(a, x, target, param, grad, segments, diverged, loss.data_ptr<scalar_t>());
  });
  return loss;
}

at::Tensor static_ensemble_grad(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                                c10::string_view model, double eps, double reg_weight) {
  const StepArgs a = check_step("static_ensemble_grad", x, target, param, grad, segments, diverged,
                                std::string(model), eps, reg_weight);
  return grad_impl(a, x, target, param, grad, segments, diverged);
}

// The NMU model's projection after the optimiser step: NAU W to [-1, 1], NMU W to [0, 1].
template <typename T>
void project(const StepArgs& a, T* param, const int64_t* seg) {
  for (int l = 0; l < 2; ++l) {
    const T lo = a.kinds[l] == Kind::kNau ? T(-1) : T(0);
    T* w = param + seg[2 * l];
    for (int64_t k = 0; k < a.E * seg[2 * l + 1]; ++k) w[k] = w[k] < lo ? lo : (w[k] > T(1) ? T(1) : w[k]);
  }
}

at::Tensor static_ensemble_step(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                const at::Tensor& segments, const at::Tensor& diverged, bool freeze,
                                c10::string_view model, double eps, double reg_weight, double lr, double beta1,
                                double beta2, double adam_eps, int64_t step) {
  constexpr const char* kOp = "static_ensemble_step";
  const StepArgs a = check_step(kOp, x, target, param, grad, segments, diverged, std::string(model), eps, reg_weight);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}})
    check_cpu_tensor(kOp, name, *t, c10::str("a contiguous CPU tensor like param (", describe(param), ")"),
                     t->defined() && t->scalar_type() == param.scalar_type() && t->dim() == 1 &&
                         t->numel() == param.numel());
  TORCH_CHECK(step >= 1, kOp, ": argument 'step' must be at least 1 (the Adam step count after this step), got ", step);
  at::Tensor loss = grad_impl(a, x, target, param, grad, segments, diverged);
  // eager_step's order: frozen = the diverged members (this step's included) once any divergence is
  // known (freeze), else none; then the members with a non-finite gradient are diverged too
  const at::Tensor frozen = freeze ? diverged.clone() : at::zeros_like(diverged);
  const at::Tensor nonfinite = flat_adam_step(param, grad, exp_avg, exp_avg_sq, segments, frozen, freeze, lr, beta1,
                                              beta2, adam_eps, step);
  diverged.logical_or_(nonfinite);
  if (a.model == Model::kNmu) {
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), kOp, [&] {
      project<scalar_t>(a, param.data_ptr<scalar_t>(), segments.const_data_ptr<int64_t>());
    });
  }
  return loss;
}

}  // namespace
}  // namespace training
}  // namespace nalu_cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("static_ensemble_grad", &nalu_cuda::training::static_ensemble_grad);
  m.impl("static_ensemble_step", &nalu_cuda::training::static_ensemble_step);
}
