// recurrent_step.cpp: the CPU kernels of the ops recurrent_ensemble_grad and recurrent_ensemble_step
// (schemas and their contract: csrc/experiments/schema.cpp): a whole training step of the recurrent
// task's NAC and NALU models (nalu_cuda.experiments.parts.arithmetic_models.RecurrentNet) in one
// call. Per member: h_s = cell(concat(x_s, h_{s-1})) for s = 1 .. len from the learned h_0, the
// output layer on h_len, the MSE, its finiteness, the backward through time into the optimiser's
// flat gradient buffer; then (the step op) FlatAdam's own fused step (step_common.h, flat_adam.h).
// The per-member kernels (recurrent_step_kernels.h) run along the batch rows (batch-major data);
// the weights' preparation and the parameters' gradients are the static step's Layer
// (layer_kernels.h), the checks and the optimiser step shared with it (step_common.h).
//
// recurrent_ensemble_step_drawn is the same step with the batch drawn in the call: each seed's
// batch (B, len, I) once, from its SFC64 state, with the targets of every op in the same pass
// (the float64 sums over the time steps and the subsets, the op in float64, one rounding), then
// the seed's members of every op trained on it; the values are exactly UniformStream's (with
// SumTargets) for that seed, so the step is bit for bit recurrent_ensemble_step on the stream's
// batch.
//
// Members never mix: at::parallel_for splits them over the intra-op threads and each member is
// computed whole by one thread in a fixed order, so the results are the same bits for any number
// of threads.
#include "experiments/cpu/step_common.h"

#include "common/cpu/isa.h"
#include "common/math.h"
#include "experiments/cpu/fp_contract.h"
#include "experiments/cpu/uniform_fill.h"
#include "ops/nac_nalu/math.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

// One rounding everywhere in a loop (vector body and remainder alike): no contraction into FMA.
NALU_FP_CONTRACT_OFF

namespace nalu_cuda {
namespace training {
namespace {

// The scalar arguments of one call, checked: the layers' kind (cell and output layer alike), E
// members, B rows, len time steps, I inputs per step, hidden size H.
struct RecurrentArgs {
  Kind kind;
  int64_t E, B, len, I, H;
  double eps;
};

// The in-call draw of recurrent_ensemble_step_drawn: seed s's batch from its SFC64 state (row s,
// advanced in place), its members k S + s (op k) trained on it.
struct RecurrentDraw {
  int64_t* state;         // (S, 4) numpy's SFC64 words viewed as int64
  const double* weights;  // (S, I, 2) the subset masks
  const TargetOp* ops;    // (n_ops)
  int64_t S, n_ops;
  double lo, hi;
  bool raw;
};

constexpr int64_t kDrawSeeds = 8;  // seeds drawn together (two groups of four AVX2 lanes)

// Seeds s0 .. s0 + G - 1 (G <= kDrawSeeds) draw x (G, B, len, I) and the targets t (n_ops, G, B)
// of their members: SumTargets' a and b, the float64 sums of each (row, step) from the fill, added
// over the steps in increasing order (numpy's sum over that axis), the op applied in float64.
void draw_seeds(const RecurrentArgs& a, const RecurrentDraw& d, int64_t s0, int64_t G, float* x, float* t,
                std::vector<double>& sums) {
  const int64_t rows = a.B * a.len, n = rows * a.I;
  sums.resize(G * rows * 2);
  sfc64_fill_blocks(reinterpret_cast<uint64_t*>(d.state + 4 * s0), x,
                    FillBlocks{G, 1, n, n, n, d.lo, d.hi, d.raw, d.weights + s0 * a.I * 2, a.I, 2, sums.data()});
  for (int64_t j = 0; j < G; ++j)
    for (int64_t b = 0; b < a.B; ++b) {
      const double* s = sums.data() + (j * rows + b * a.len) * 2;
      double sa = s[0], sb = s[1];
      for (int64_t u = 1; u < a.len; ++u) sa += s[2 * u], sb += s[2 * u + 1];
      for (int64_t k = 0; k < d.n_ops; ++k)
        t[(k * G + j) * a.B + b] = static_cast<float>(apply_target(d.ops[k], sa, sb));
    }
}

// The per-member kernels, once per instruction set (the ops pick one: NALU_STEP_PER_ISA).
#define NALU_STEP_KERNELS "experiments/cpu/recurrent_step_kernels.h"
#include "experiments/cpu/step_kernels_per_isa.h"

Kind kind_from_name(const char* op, const std::string& name) {
  if (name == "nac") return Kind::kNac;
  if (name == "nalu") return Kind::kNalu;
  TORCH_CHECK(false, op, ": argument 'model' must be 'nac' (a NAC+ cell, a NAC+ output layer) or 'nalu' (a NALU "
              "cell and output layer: tied weights, input gate, no gate bias), got '", name, "'");
}

// The buffers of E members of a.I inputs in `dtype` (`like`: how the messages name it); completes
// a with the hidden size (from h0's row of segments) and eps.
void check_recurrent_params(const char* op, RecurrentArgs& a, at::ScalarType dtype, const std::string& like,
                            const at::Tensor& param, const at::Tensor& grad, const at::Tensor& segments,
                            const at::Tensor& diverged, const std::string& model, double eps) {
  a.kind = kind_from_name(op, model);
  const int64_t n = params_per_layer(a.kind);
  check_buffers(op, a.E, dtype, like, param, grad, diverged, segments, 1 + 2 * n, model, eps);
  a.H = std::max<int64_t>(segments.const_data_ptr<int64_t>()[1], 1);  // (h0: (E, 1, H))
  std::vector<int64_t> want(1 + 2 * n, a.H);
  std::fill(want.begin() + 1, want.begin() + 1 + n, (a.I + a.H) * a.H);
  check_segment_rows(op, segments, param.numel(), a.E, want,
                     c10::str("rows h0, ", n, " of the cell, ", n, " of the output layer; I = ", a.I, ", hidden ", a.H));
  a.eps = eps;
}

// x (E, B, len, I), target (E, B, 1), then the buffers.
RecurrentArgs check_recurrent(const char* op, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                              const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                              const std::string& model, double eps) {
  RecurrentArgs a{};
  kind_from_name(op, model);
  check_x(op, x, 4, "(E, B, len, I)");
  a.E = x.size(0), a.B = x.size(1), a.len = x.size(2), a.I = x.size(3);
  const std::string like_x = check_target(op, target, x, a.E, a.B);
  check_recurrent_params(op, a, x.scalar_type(), like_x, param, grad, segments, diverged, model, eps);
  return a;
}

at::Tensor grad_impl(const RecurrentArgs& a, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                     const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged) {
  at::Tensor loss = at::empty({a.E}, param.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "recurrent_ensemble_grad", [&] {
    auto run = [&](auto members) {
      members(a, x.const_data_ptr<scalar_t>(), target.const_data_ptr<scalar_t>(), param.data_ptr<scalar_t>(),
              grad.data_ptr<scalar_t>(), segments.const_data_ptr<int64_t>(), diverged.data_ptr<bool>(),
              loss.data_ptr<scalar_t>());
    };
    NALU_STEP_PER_ISA(run, recurrent_members<scalar_t>);
  });
  return loss;
}

at::Tensor recurrent_ensemble_grad(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                   const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                                   c10::string_view model, double eps) {
  const RecurrentArgs a = check_recurrent("recurrent_ensemble_grad", x, target, param, grad, segments, diverged,
                                          std::string(model), eps);
  return grad_impl(a, x, target, param, grad, segments, diverged);
}

at::Tensor recurrent_ensemble_step(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                   const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                   const at::Tensor& segments, const at::Tensor& diverged, bool freeze,
                                   c10::string_view model, double eps, double lr, double beta1, double beta2,
                                   double adam_eps, int64_t step) {
  constexpr const char* kOp = "recurrent_ensemble_step";
  const RecurrentArgs a = check_recurrent(kOp, x, target, param, grad, segments, diverged, std::string(model), eps);
  check_moments(kOp, param, exp_avg, exp_avg_sq, step);
  at::Tensor loss = grad_impl(a, x, target, param, grad, segments, diverged);
  adam_step_and_flags(param, grad, exp_avg, exp_avg_sq, segments, diverged, freeze, lr, beta1, beta2, adam_eps, step);
  return loss;
}

// recurrent_ensemble_grad's work with the batch drawn in the call (float32).
at::Tensor drawn_grad_impl(const RecurrentArgs& a, const RecurrentDraw& d, const at::Tensor& param,
                           const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged) {
  at::Tensor loss = at::empty({a.E}, param.options());
  auto run = [&](auto members) {
    members(a, d, param.data_ptr<float>(), grad.data_ptr<float>(), segments.const_data_ptr<int64_t>(),
            diverged.data_ptr<bool>(), loss.data_ptr<float>());
  };
  NALU_STEP_PER_ISA(run, recurrent_members_drawn);
  return loss;
}

at::Tensor recurrent_ensemble_step_drawn(const at::Tensor& state, const at::Tensor& weights, at::IntArrayRef ops,
                                         double lo, double hi, bool raw, int64_t batch, int64_t length,
                                         const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                         const at::Tensor& exp_avg_sq, const at::Tensor& segments,
                                         const at::Tensor& diverged, bool freeze, c10::string_view model, double eps,
                                         double lr, double beta1, double beta2, double adam_eps, int64_t step) {
  constexpr const char* kOp = "recurrent_ensemble_step_drawn";
  kind_from_name(kOp, std::string(model));
  std::vector<TargetOp> codes;
  for (const int64_t code : ops) codes.push_back(target_op(kOp, code));
  const DrawShape ds = check_draw_args(kOp, state, weights, codes, lo, hi, diverged);
  TORCH_CHECK(batch >= 1 && length >= 1 && (batch * length * ds.I) % 2 == 0, kOp, ": arguments 'batch' and 'length' "
              "must be >= 1 with batch * length * I even (a step's draw ends on a whole 64-bit word), got batch ", batch,
              ", length ", length, " for I = ", ds.I);
  RecurrentArgs a{};
  a.E = ds.E, a.B = batch, a.len = length, a.I = ds.I;
  check_recurrent_params(kOp, a, at::kFloat, "a contiguous float32 CPU tensor (the drawn inputs' dtype)", param, grad,
                         segments, diverged, std::string(model), eps);
  check_moments(kOp, param, exp_avg, exp_avg_sq, step);
  const RecurrentDraw d{state.data_ptr<int64_t>(), weights.const_data_ptr<double>(), codes.data(), ds.S,
                        static_cast<int64_t>(codes.size()), lo, hi, raw};
  at::Tensor loss = drawn_grad_impl(a, d, param, grad, segments, diverged);
  adam_step_and_flags(param, grad, exp_avg, exp_avg_sq, segments, diverged, freeze, lr, beta1, beta2, adam_eps, step);
  return loss;
}

}  // namespace
}  // namespace training
}  // namespace nalu_cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("recurrent_ensemble_grad", &nalu_cuda::training::recurrent_ensemble_grad);
  m.impl("recurrent_ensemble_step", &nalu_cuda::training::recurrent_ensemble_step);
  m.impl("recurrent_ensemble_step_drawn", &nalu_cuda::training::recurrent_ensemble_step_drawn);
}
