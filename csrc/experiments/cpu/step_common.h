// step_common.h: what the native training steps (the static task's, ensemble_step.cpp; the
// recurrent task's, recurrent_step.cpp) share outside their per-member kernels: the layer kinds,
// the argument checks and their messages, the in-call draws' target operations and argument checks,
// and the optimiser's part of a step (FlatAdam's fused step and the divergence flags).
#pragma once

#include "experiments/counter_draw.h"
#include "experiments/cpu/flat_adam.h"
#include "experiments/target_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace nalu_cuda {
namespace training {

enum class Kind { kNac, kNalu, kNau, kNmu };

// Parameters of one layer, in the order the layer registers them (FlatAdam's buffer order):
// NAC W_hat, M_hat; NALU W_hat, M_hat, G; NAU and NMU W.
inline int params_per_layer(Kind k) { return k == Kind::kNac ? 2 : k == Kind::kNalu ? 3 : 1; }

// The static task's two-layer models (the ops' argument 'model').
enum class Model { kNac, kNalu, kNmu };

inline Model model_from_name(const std::string& op, const std::string& name) {
  if (name == "nac") return Model::kNac;
  if (name == "nalu") return Model::kNalu;
  if (name == "nmu") return Model::kNmu;
  TORCH_CHECK(false, op, ": argument 'model' must be one of 'nac' (NAC+ -> NAC+), 'nalu' (NALU -> NALU, tied "
              "weights, input gate) or 'nmu' (NAU -> NMU), got '", name, "'");
}

// The layer kinds of a model, first and second layer.
inline void layer_kinds(Model m, Kind* first, Kind* second) {
  *first = m == Model::kNac ? Kind::kNac : m == Model::kNalu ? Kind::kNalu : Kind::kNau;
  *second = m == Model::kNac ? Kind::kNac : m == Model::kNalu ? Kind::kNalu : Kind::kNmu;
}

// The sparsity regulariser's weight: 0, or for the NMU model a finite number >= 0.
inline void check_reg_weight(const char* op, Model model, double reg_weight) {
  TORCH_CHECK(std::isfinite(reg_weight) && reg_weight >= 0.0 && (reg_weight == 0.0 || model == Model::kNmu), op,
              ": argument 'reg_weight' must be 0 (or, for model 'nmu', a finite number >= 0), got ", reg_weight);
}

inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream s;
  s << "a " << t.scalar_type() << " " << t.device() << " tensor of shape " << t.sizes()
    << (t.is_contiguous() ? "" : " (not contiguous)");
  return s.str();
}

inline void check_cpu_tensor(const char* op, const char* name, const at::Tensor& t, const std::string& want, bool ok) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous() && ok, op, ": argument '", name,
              "' must be ", want, ", got ", describe(t));
}

// The batch's inputs: a float32 or float64 tensor of `shape` (`dims` dimensions), each at least 1.
inline void check_x(const char* op, const at::Tensor& x, int64_t dims, const char* shape) {
  const bool fp = x.defined() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
  check_cpu_tensor(op, "x", x, c10::str("a contiguous float32 or float64 CPU tensor of shape ", shape),
                   fp && x.dim() == dims);
  for (int64_t d = 0; d < dims; ++d)
    TORCH_CHECK(x.size(d) >= 1, op, ": argument 'x' must have at least one element along every dimension ", shape,
                ", got shape ", x.sizes());
}

// The batch's targets (E, B, 1) in x's dtype; returns how the messages name that dtype.
inline std::string check_target(const char* op, const at::Tensor& target, const at::Tensor& x, int64_t E, int64_t B) {
  const std::string like_x = c10::str("a contiguous CPU tensor of x's dtype (", x.scalar_type(), ")");
  check_cpu_tensor(op, "target", target, like_x + c10::str(" of shape [", E, ", ", B, ", 1]"),
                   target.defined() && target.scalar_type() == x.scalar_type() && target.dim() == 3 &&
                       target.size(0) == E && target.size(1) == B && target.size(2) == 1);
  return like_x;
}

// FlatAdam's flat buffers param and grad in `dtype` (`like`: how the messages name it), the
// divergence flags of E members, and segments (P, 2) for `model`; then eps.
inline void check_buffers(const char* op, int64_t E, at::ScalarType dtype, const std::string& like,
                          const at::Tensor& param, const at::Tensor& grad, const at::Tensor& diverged,
                          const at::Tensor& segments, int64_t P, const std::string& model, double eps) {
  check_cpu_tensor(op, "param", param, like + " of one dimension (FlatAdam's flat buffer)",
                   param.defined() && param.scalar_type() == dtype && param.dim() == 1);
  check_cpu_tensor(op, "grad", grad, like + c10::str(" of param's shape [", param.numel(), "]"),
                   grad.defined() && grad.scalar_type() == dtype && grad.dim() == 1 && grad.numel() == param.numel());
  check_cpu_tensor(op, "diverged", diverged, c10::str("a contiguous bool CPU tensor of shape [", E, "] (one flag per member)"),
                   diverged.defined() && diverged.scalar_type() == at::kBool && diverged.dim() == 1 &&
                       diverged.numel() == E);
  check_cpu_tensor(op, "segments", segments, c10::str("a contiguous int64 CPU tensor of shape [", P, ", 2] (offset, "
                   "per_member) for model '", model, "'"), segments.defined() && segments.scalar_type() == at::kLong &&
                   segments.dim() == 2 && segments.size(0) == P && segments.size(1) == 2);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": argument 'eps' must be a finite number >= 0, got ", eps);
}

// The rows (offset, per_member) of `segments` (already checked to be (P, 2), P = want.size())
// against the per-member sizes `want` of the model's parameters, inside param's `numel` elements
// for E members; `what` names the shapes in the message.
inline void check_segment_rows(const char* op, const at::Tensor& segments, int64_t numel, int64_t E,
                               const std::vector<int64_t>& want, const std::string& what) {
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  for (size_t q = 0; q < want.size(); ++q)
    TORCH_CHECK(seg[2 * q + 1] == want[q] && seg[2 * q] >= 0 && seg[2 * q] + E * want[q] <= numel, op,
                ": argument 'segments' row ", q, " must be (offset, ", want[q], ") inside param's ", numel,
                " elements for E = ", E, ", ", what, ", got (", seg[2 * q], ", ", seg[2 * q + 1], ")");
}

// Adam's moments, checked like param.
inline void check_moments(const char* op, const at::Tensor& param, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, int64_t step) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}})
    check_cpu_tensor(op, name, *t, c10::str("a contiguous CPU tensor like param (", describe(param), ")"),
                     t->defined() && t->scalar_type() == param.scalar_type() && t->dim() == 1 &&
                         t->numel() == param.numel());
  TORCH_CHECK(step >= 1, op, ": argument 'step' must be at least 1 (the Adam step count after this step), got ", step);
}

// The targets' operation codes of the in-call draws: experiments/target_ops.h.
inline TargetOp target_op(const char* op, int64_t code) {
  TORCH_CHECK(code >= 0 && code < 6, op, ": argument 'ops' must list operation codes 0 .. 5 (add, sub, mul, div, "
              "squared, root), got ", code);
  return static_cast<TargetOp>(code);
}

// The shapes of an in-call draw: S seeds, I inputs, E = S * len(ops) members.
struct DrawShape {
  int64_t S, I, E;
};

// The draw's arguments every drawn op takes, checked: state (S, 4) (numpy's SFC64 words), weights
// (S, I, 2) (the subset masks), at least one op, one divergence flag per member, lo and hi finite.
inline DrawShape check_draw_args(const char* op, const at::Tensor& state, const at::Tensor& weights,
                                 const std::vector<TargetOp>& ops, double lo, double hi, const at::Tensor& diverged) {
  check_cpu_tensor(op, "state", state, "a contiguous int64 CPU tensor of shape (S, 4) (numpy's SFC64 words, one row "
                   "per seed)", state.defined() && state.scalar_type() == at::kLong && state.dim() == 2 &&
                   state.size(0) >= 1 && state.size(1) == 4);
  const int64_t S = state.size(0);
  check_cpu_tensor(op, "weights", weights, c10::str("a contiguous float64 CPU tensor of shape (", S, ", I, 2) (the "
                   "subset masks, one per seed)"), weights.defined() && weights.scalar_type() == at::kDouble &&
                   weights.dim() == 3 && weights.size(0) == S && weights.size(1) >= 1 && weights.size(2) == 2);
  TORCH_CHECK(!ops.empty(), op, ": argument 'ops' must name at least one operation, got none");
  const int64_t E = S * static_cast<int64_t>(ops.size());
  TORCH_CHECK(diverged.defined() && diverged.dim() == 1 && diverged.numel() == E, op, ": argument 'diverged' must "
              "have one flag per member, S * len(ops) = ", E, ", got ", describe(diverged));
  TORCH_CHECK(std::isfinite(lo) && std::isfinite(hi), op, ": arguments 'lo' and 'hi' must be finite, got ", lo, ", ", hi);
  return DrawShape{S, weights.size(1), E};
}

// The counter stream's arguments of static_ensemble_grad_counter (its CPU and CUDA kernels) and
// static_ensemble_step_counter, checked into d (all but d.step): keys (S, 2) int64, masks (S, I, 2)
// float64, 1 to kStepMaxOps op codes, lo < hi finite in float32, batch >= 1 with batch x I at most
// 2^32 values. `check(name, tensor, want, ok)` checks a tensor's device and contiguity too and says
// `want` (written for `device`, "CPU" or "CUDA") when it fails. Returns E = S x len(ops) and I.
template <typename Check>
std::pair<int64_t, int64_t> check_counter_args(const char* op, const char* device, Check check, const at::Tensor& keys,
                                               const at::Tensor& masks, at::IntArrayRef ops, double lo, double hi,
                                               int64_t batch, CounterDraw& d) {
  check("keys", keys, c10::str("a contiguous int64 ", device, " tensor of shape (S, 2) (CounterStream.keys)"),
        keys.defined() && keys.scalar_type() == at::kLong && keys.dim() == 2 && keys.size(0) >= 1 && keys.size(1) == 2);
  const int64_t S = keys.size(0);
  check("masks", masks, c10::str("a contiguous float64 ", device, " tensor of shape (", S, ", I, 2) (the subsets' "
        "weights, one per seed)"), masks.defined() && masks.scalar_type() == at::kDouble && masks.dim() == 3 &&
        masks.size(0) == S && masks.size(1) >= 1 && masks.size(2) == 2);
  TORCH_CHECK(!ops.empty() && static_cast<int64_t>(ops.size()) <= kStepMaxOps, op, ": argument 'ops' must list 1 to ",
              kStepMaxOps, " operation codes, got ", ops.size());
  for (size_t k = 0; k < ops.size(); ++k) d.ops[k] = static_cast<int>(target_op(op, ops[k]));
  TORCH_CHECK(std::isfinite(lo) && std::isfinite(hi) && static_cast<float>(lo) < static_cast<float>(hi), op,
              ": arguments 'lo' and 'hi' must be finite with lo < hi in float32, got ", lo, ", ", hi);
  TORCH_CHECK(batch >= 1, op, ": argument 'batch' must be at least 1, got ", batch);
  const int64_t I = masks.size(1);
  TORCH_CHECK(batch * I <= (int64_t{1} << 32), op, ": a step's draw must have at most 2^32 values (batch x I), got ",
              batch * I);
  d.keys = keys.const_data_ptr<int64_t>();
  d.masks = masks.const_data_ptr<double>();
  d.S = S;
  d.n_ops = static_cast<int64_t>(ops.size());
  d.lo = static_cast<float>(lo);
  d.hi = static_cast<float>(hi);
  d.top = std::nextafter(d.hi, d.lo);
  return {S * d.n_ops, I};
}

// FlatAdam's step after the gradient, in eager_step's order: frozen = the diverged members (this
// step's included) once any divergence is known (freeze), else none; then the members with a
// non-finite gradient are diverged too.
inline void adam_step_and_flags(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                const at::Tensor& exp_avg_sq, const at::Tensor& segments, const at::Tensor& diverged,
                                bool freeze, double lr, double beta1, double beta2, double adam_eps, int64_t step) {
  const at::Tensor frozen = freeze ? diverged.clone() : at::zeros_like(diverged);
  const at::Tensor nonfinite = flat_adam_step(param, grad, exp_avg, exp_avg_sq, segments, frozen, freeze, lr, beta1,
                                              beta2, adam_eps, step);
  diverged.logical_or_(nonfinite);
}

}  // namespace training
}  // namespace nalu_cuda
