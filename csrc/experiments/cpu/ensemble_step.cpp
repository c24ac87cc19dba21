// ensemble_step.cpp: the CPU kernels of the ops static_ensemble_grad and static_ensemble_step, and
// of their variants that draw the batch in the call, from the SFC64 streams (static_ensemble_step_drawn)
// or the counter stream (static_ensemble_grad_counter, static_ensemble_step_counter) (schemas and
// their contract: csrc/experiments/schema.cpp): a whole training step of the static task's two-layer
// ensemble models in one call. Per member: forward through both layers, the MSE,
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
#include "experiments/cpu/step_common.h"

#include "common/cpu/isa.h"
#include "common/math.h"
#include "experiments/cpu/fp_contract.h"
#include "experiments/cpu/uniform_fill.h"
#include "ops/nac_nalu/math.h"
#include "ops/nau_nmu/math.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// One rounding everywhere in a loop (vector body and remainder alike): no contraction into FMA.
NALU_FP_CONTRACT_OFF

namespace nalu_cuda {
namespace training {
namespace {

// The scalar arguments of one call, checked.
struct StepArgs {
  Model model;
  Kind kinds[2];
  int64_t E, B, I, H;
  double eps, reg_weight;
};

// The in-call draw of static_ensemble_step_drawn: seed s draws its batch from a copy of SFC64
// generator s (exactly UniformStream's next batch for that seed) once, and its members e = k S + s
// of every op k train on it with the targets of op k (SumTargets: the float64 subset sums a, b, the
// op in float64, one rounding to float32), as the stream repeats a seed's batch for each op.
struct Draw {
  const int64_t* state;   // (S, 4) numpy's SFC64 words viewed as int64
  int64_t* state_out;     // (S, 4) the states after the draw
  const double* weights;  // (S, I, 2) the subset masks
  const TargetOp* ops;    // (n_ops)
  int64_t S, n_ops;
  double lo, hi;
  bool raw;
};

constexpr int64_t kDrawGroup = 8;  // seeds drawn together (two groups of four AVX2 lanes)

// Seeds s0 .. s0 + G - 1 (G <= kDrawGroup) draw x (G, B, I) and the targets of every op, t (n_ops,
// G, B), and leave their generators' states in state_out.
void draw_seeds(const StepArgs& a, const Draw& d, int64_t s0, int64_t G, float* x, float* t, std::vector<double>& w,
                std::vector<double>& sums) {
  uint64_t words[4 * kDrawGroup];
  w.resize(G * a.I * 2);
  sums.resize(G * a.B * 2);
  for (int64_t j = 0; j < G; ++j) {
    const int64_t s = s0 + j;
    std::memcpy(words + 4 * j, d.state + 4 * s, sizeof(uint64_t) * 4);
    std::copy(d.weights + s * a.I * 2, d.weights + (s + 1) * a.I * 2, w.begin() + j * a.I * 2);
  }
  const int64_t n = a.B * a.I;
  sfc64_fill_blocks(words, x, FillBlocks{G, 1, n, n, n, d.lo, d.hi, d.raw, w.data(), a.I, 2, sums.data()});
  for (int64_t k = 0; k < d.n_ops; ++k)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t b = 0; b < a.B; ++b)
        t[(k * G + j) * a.B + b] =
            static_cast<float>(apply_target(d.ops[k], sums[(j * a.B + b) * 2], sums[(j * a.B + b) * 2 + 1]));
  for (int64_t j = 0; j < G; ++j) std::memcpy(d.state_out + 4 * (s0 + j), words + 4 * j, sizeof(uint64_t) * 4);
}

}  // namespace

// The per-member kernels, once per instruction set (the ops pick one: NALU_STEP_PER_ISA).
#define NALU_STEP_KERNELS "experiments/cpu/ensemble_step_kernels.h"
#include "experiments/cpu/step_kernels_per_isa.h"

namespace {

// The checks of the parameters, gradients and flags every op gets, for a.E members of a.I inputs
// in `dtype` (`like`: how the messages name it); completes the call's shapes and scalars.
void check_params(const char* op, StepArgs& a, at::ScalarType dtype, const std::string& like, const at::Tensor& param,
                  const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                  const std::string& model, double eps, double reg_weight) {
  a.model = model_from_name(op, model);
  layer_kinds(a.model, &a.kinds[0], &a.kinds[1]);
  const int64_t P = params_per_layer(a.kinds[0]) + params_per_layer(a.kinds[1]);
  check_buffers(op, a.E, dtype, like, param, grad, diverged, segments, P, model, eps);
  a.H = std::max<int64_t>(segments.const_data_ptr<int64_t>()[1] / a.I, 1);  // (W_hat of the first layer: I x H)
  std::vector<int64_t> want(P, a.H);
  std::fill(want.begin(), want.begin() + params_per_layer(a.kinds[0]), a.I * a.H);
  check_segment_rows(op, segments, param.numel(), a.E, want, c10::str("I = ", a.I, ", hidden ", a.H));
  check_reg_weight(op, a.model, reg_weight);
  a.eps = eps;
  a.reg_weight = reg_weight;
}

// The checks of the ops that take the batch: x, target, then check_params.
StepArgs check_step(const char* op, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                    const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                    const std::string& model, double eps, double reg_weight) {
  StepArgs a{};
  model_from_name(op, model);
  check_x(op, x, 3, "(E, B, I)");
  a.E = x.size(0), a.B = x.size(1), a.I = x.size(2);
  const std::string like_x = check_target(op, target, x, a.E, a.B);
  check_params(op, a, x.scalar_type(), like_x, param, grad, segments, diverged, model, eps, reg_weight);
  return a;
}

// static_ensemble_grad's work: the batch from x and target, or drawn (float32 only) from the SFC64
// streams (`draw`) or the counter stream (`counter`).
at::Tensor grad_impl(const StepArgs& a, at::ScalarType dtype, const at::Tensor& x, const at::Tensor& target,
                     const Draw* draw, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& segments,
                     const at::Tensor& diverged, const CounterDraw* counter = nullptr) {
  at::Tensor loss = at::empty({a.E}, param.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "static_ensemble_grad", [&] {
    const bool drawn = draw != nullptr || counter != nullptr;
    const scalar_t* xs = drawn ? nullptr : x.const_data_ptr<scalar_t>();
    const scalar_t* ts = drawn ? nullptr : target.const_data_ptr<scalar_t>();
    auto run = [&](auto members) {
      members(a, xs, ts, draw, counter, param.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(),
              segments.const_data_ptr<int64_t>(), diverged.data_ptr<bool>(), loss.data_ptr<scalar_t>());
    };
    NALU_STEP_PER_ISA(run, all_members<scalar_t>);
  });
  return loss;
}

at::Tensor static_ensemble_grad(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                                c10::string_view model, double eps, double reg_weight) {
  const StepArgs a = check_step("static_ensemble_grad", x, target, param, grad, segments, diverged,
                                std::string(model), eps, reg_weight);
  return grad_impl(a, x.scalar_type(), x, target, nullptr, param, grad, segments, diverged);
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

// The optimiser's part of a step, after the gradient: FlatAdam's step, the divergence flags, the
// NMU model's projection.
void optimiser_step(const StepArgs& a, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& segments, const at::Tensor& diverged, bool freeze,
                    double lr, double beta1, double beta2, double adam_eps, int64_t step) {
  adam_step_and_flags(param, grad, exp_avg, exp_avg_sq, segments, diverged, freeze, lr, beta1, beta2, adam_eps, step);
  if (a.model == Model::kNmu) {
    AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "static_ensemble_step", [&] {
      project<scalar_t>(a, param.data_ptr<scalar_t>(), segments.const_data_ptr<int64_t>());
    });
  }
}

at::Tensor static_ensemble_step(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                const at::Tensor& segments, const at::Tensor& diverged, bool freeze,
                                c10::string_view model, double eps, double reg_weight, double lr, double beta1,
                                double beta2, double adam_eps, int64_t step) {
  constexpr const char* kOp = "static_ensemble_step";
  const StepArgs a = check_step(kOp, x, target, param, grad, segments, diverged, std::string(model), eps, reg_weight);
  check_moments(kOp, param, exp_avg, exp_avg_sq, step);
  at::Tensor loss = grad_impl(a, x.scalar_type(), x, target, nullptr, param, grad, segments, diverged);
  optimiser_step(a, param, grad, exp_avg, exp_avg_sq, segments, diverged, freeze, lr, beta1, beta2, adam_eps, step);
  return loss;
}

// The draw's arguments, checked (check_draw_args): state (S, 4), weights (S, I, 2), ops (E / S
// names), batch B with B * I even.
StepArgs check_draw(const char* op, const at::Tensor& state, const at::Tensor& weights, const std::vector<TargetOp>& ops,
                    double lo, double hi, int64_t batch, const at::Tensor& diverged) {
  StepArgs a{};
  const DrawShape d = check_draw_args(op, state, weights, ops, lo, hi, diverged);
  a.I = d.I, a.E = d.E, a.B = batch;
  TORCH_CHECK(batch >= 1 && (batch * a.I) % 2 == 0, op, ": argument 'batch' must be >= 1 with batch * I even (a "
              "step's draw ends on a whole 64-bit word), got batch ", batch, " for I = ", a.I);
  return a;
}

at::Tensor static_ensemble_step_drawn(const at::Tensor& state, const at::Tensor& weights, at::IntArrayRef ops,
                                      double lo, double hi, bool raw, int64_t batch, const at::Tensor& param,
                                      const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                      const at::Tensor& segments, const at::Tensor& diverged, bool freeze,
                                      c10::string_view model, double eps, double reg_weight, double lr, double beta1,
                                      double beta2, double adam_eps, int64_t step) {
  constexpr const char* kOp = "static_ensemble_step_drawn";
  std::vector<TargetOp> codes;
  for (const int64_t code : ops) codes.push_back(target_op(kOp, code));
  StepArgs a = check_draw(kOp, state, weights, codes, lo, hi, batch, diverged);
  check_params(kOp, a, at::kFloat, "a contiguous float32 CPU tensor (the drawn inputs' dtype)", param, grad, segments,
               diverged, std::string(model), eps, reg_weight);
  check_moments(kOp, param, exp_avg, exp_avg_sq, step);
  at::Tensor state_out = state.clone();
  const Draw d{state.const_data_ptr<int64_t>(), state_out.data_ptr<int64_t>(), weights.const_data_ptr<double>(),
               codes.data(), state.size(0), static_cast<int64_t>(codes.size()), lo, hi, raw};
  at::Tensor loss = grad_impl(a, at::kFloat, at::Tensor(), at::Tensor(), &d, param, grad, segments, diverged);
  state.copy_(state_out);
  optimiser_step(a, param, grad, exp_avg, exp_avg_sq, segments, diverged, freeze, lr, beta1, beta2, adam_eps, step);
  return loss;
}

// The counter stream's arguments (check_counter_args, on the CPU), then check_params in float32.
StepArgs check_counter(const char* op, const at::Tensor& keys, const at::Tensor& masks, at::IntArrayRef ops, double lo,
                       double hi, int64_t batch, CounterDraw& d, const at::Tensor& param, const at::Tensor& grad,
                       const at::Tensor& segments, const at::Tensor& diverged, const std::string& model, double eps,
                       double reg_weight) {
  StepArgs a{};
  model_from_name(op, model);
  auto check = [&](const char* name, const at::Tensor& t, const std::string& want, bool ok) {
    check_cpu_tensor(op, name, t, want, ok);
  };
  std::tie(a.E, a.I) = check_counter_args(op, "CPU", check, keys, masks, ops, lo, hi, batch, d);
  a.B = batch;
  check_params(op, a, at::kFloat, "a contiguous float32 CPU tensor (the drawn inputs' dtype)", param, grad, segments,
               diverged, model, eps, reg_weight);
  return a;
}

at::Tensor static_ensemble_grad_counter(const at::Tensor& keys, const at::Tensor& step, const at::Tensor& masks,
                                        at::IntArrayRef ops, double lo, double hi, int64_t batch,
                                        const at::Tensor& param, const at::Tensor& grad, const at::Tensor& segments,
                                        const at::Tensor& diverged, c10::string_view model, double eps,
                                        double reg_weight) {
  constexpr const char* kOp = "static_ensemble_grad_counter";
  CounterDraw d{};
  const StepArgs a = check_counter(kOp, keys, masks, ops, lo, hi, batch, d, param, grad, segments, diverged,
                                   std::string(model), eps, reg_weight);
  check_cpu_tensor(kOp, "step", step, "a contiguous int64 CPU tensor of one element (the step)",
                   step.defined() && step.scalar_type() == at::kLong && step.numel() == 1);
  d.step = step.const_data_ptr<int64_t>();
  return grad_impl(a, at::kFloat, at::Tensor(), at::Tensor(), nullptr, param, grad, segments, diverged, &d);
}

at::Tensor static_ensemble_step_counter(const at::Tensor& keys, int64_t data_step, const at::Tensor& masks,
                                        at::IntArrayRef ops, double lo, double hi, int64_t batch,
                                        const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                        const at::Tensor& exp_avg_sq, const at::Tensor& segments,
                                        const at::Tensor& diverged, bool freeze, c10::string_view model, double eps,
                                        double reg_weight, double lr, double beta1, double beta2, double adam_eps,
                                        int64_t step) {
  constexpr const char* kOp = "static_ensemble_step_counter";
  CounterDraw d{};
  const StepArgs a = check_counter(kOp, keys, masks, ops, lo, hi, batch, d, param, grad, segments, diverged,
                                   std::string(model), eps, reg_weight);
  check_moments(kOp, param, exp_avg, exp_avg_sq, step);
  d.step = &data_step;
  at::Tensor loss = grad_impl(a, at::kFloat, at::Tensor(), at::Tensor(), nullptr, param, grad, segments, diverged, &d);
  optimiser_step(a, param, grad, exp_avg, exp_avg_sq, segments, diverged, freeze, lr, beta1, beta2, adam_eps, step);
  return loss;
}

}  // namespace
}  // namespace training
}  // namespace nalu_cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("static_ensemble_grad", &nalu_cuda::training::static_ensemble_grad);
  m.impl("static_ensemble_step", &nalu_cuda::training::static_ensemble_step);
  m.impl("static_ensemble_step_drawn", &nalu_cuda::training::static_ensemble_step_drawn);
  m.impl("static_ensemble_grad_counter", &nalu_cuda::training::static_ensemble_grad_counter);
  m.impl("static_ensemble_step_counter", &nalu_cuda::training::static_ensemble_step_counter);
}
