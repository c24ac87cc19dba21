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
// Members never mix: at::parallel_for splits them over the intra-op threads and each member is
// computed whole by one thread in a fixed order, so the results are the same bits for any number
// of threads.
#include "experiments/cpu/step_common.h"

#include "common/cpu/isa.h"
#include "common/math.h"
#include "experiments/cpu/fp_contract.h"
#include "ops/nac_nalu/math.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

// The per-member kernels, once per instruction set (the ops pick one with cpu::use_avx2()).
#define NALU_STEP_KERNELS "experiments/cpu/recurrent_step_kernels.h"
#include "experiments/cpu/step_kernels_per_isa.h"

Kind kind_from_name(const char* op, const std::string& name) {
  if (name == "nac") return Kind::kNac;
  if (name == "nalu") return Kind::kNalu;
  TORCH_CHECK(false, op, ": argument 'model' must be 'nac' (a NAC+ cell, a NAC+ output layer) or 'nalu' (a NALU "
              "cell and output layer: tied weights, input gate, no gate bias), got '", name, "'");
}

// x (E, B, len, I), target (E, B, 1), the buffers; the hidden size from h0's row of segments.
RecurrentArgs check_recurrent(const char* op, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                              const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                              const std::string& model, double eps) {
  RecurrentArgs a{};
  a.kind = kind_from_name(op, model);
  check_x(op, x, 4, "(E, B, len, I)");
  a.E = x.size(0), a.B = x.size(1), a.len = x.size(2), a.I = x.size(3);
  const std::string like_x = check_target(op, target, x, a.E, a.B);
  const int64_t n = params_per_layer(a.kind);
  check_buffers(op, a.E, x.scalar_type(), like_x, param, grad, diverged, segments, 1 + 2 * n, model, eps);
  a.H = std::max<int64_t>(segments.const_data_ptr<int64_t>()[1], 1);  // (h0: (E, 1, H))
  std::vector<int64_t> want(1 + 2 * n, a.H);
  std::fill(want.begin() + 1, want.begin() + 1 + n, (a.I + a.H) * a.H);
  check_segment_rows(op, segments, param.numel(), a.E, want,
                     c10::str("rows h0, ", n, " of the cell, ", n, " of the output layer; I = ", a.I, ", hidden ", a.H));
  a.eps = eps;
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

}  // namespace
}  // namespace training
}  // namespace nalu_cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("recurrent_ensemble_grad", &nalu_cuda::training::recurrent_ensemble_grad);
  m.impl("recurrent_ensemble_step", &nalu_cuda::training::recurrent_ensemble_step);
}
