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

// One layer of one member: u (B, In) -> y (B, Out), its parameters p[0..2] (each (In, Out)
// row-major) and their gradients g[0..2]. The weights are held transposed, (Out, In), so that every
// inner loop runs over the contiguous input dimension.
template <typename T>
struct Layer {
  Kind kind;
  int64_t B, In, Out;
  T eps;
  bool normal_eps;
  std::vector<T> Wt, Gt, lu, a, m, g;  // Wt, Gt (Out, In); lu (B, In); a, m, g (B, Out)

  void prepare(const T* const* p);
  void forward(const T* u, T* y);
  void backward(const T* u, const T* dy, const T* const* p, T* const* grads, T* du);
};

template <typename T>
void Layer<T>::prepare(const T* const* p) {
  Wt.assign(Out * In, T(0));
  Gt.assign(kind == Kind::kNalu ? Out * In : 0, T(0));
  for (int64_t i = 0; i < In; ++i) {
    for (int64_t o = 0; o < Out; ++o) {
      const int64_t k = i * Out + o;
      T w;
      if (kind == Kind::kNac || kind == Kind::kNalu) w = math::nac_weight(p[0][k], p[1][k]);
      else if (kind == Kind::kNau) w = math::clamp_unit(p[0][k]);
      else w = p[0][k];  // the NMU uses W as given (the projection keeps it in [0, 1])
      Wt[o * In + i] = w;
      if (kind == Kind::kNalu) Gt[o * In + i] = p[2][k];
    }
  }
}

template <typename T>
void Layer<T>::forward(const T* u, T* y) {
  a.resize(B * Out);
  if (kind == Kind::kNmu) {  // y = prod_i (W x_i + 1 - W); a holds y for the backward
    for (int64_t b = 0; b < B; ++b)
      for (int64_t o = 0; o < Out; ++o) {
        T prod = T(1);
        for (int64_t i = 0; i < In; ++i) prod = prod * (Wt[o * In + i] * u[b * In + i] + (T(1) - Wt[o * In + i]));
        a[b * Out + o] = y[b * Out + o] = prod;
      }
    return;
  }
  const bool nalu = kind == Kind::kNalu;
  if (nalu) {
    lu.resize(B * In);
    m.resize(B * Out);
    g.resize(B * Out);
    for (int64_t k = 0; k < B * In; ++k)  // log(|u| + eps)
      lu[k] = normal_eps ? math::log_abs_normal_eps(u[k], eps) : math::log_abs(u[k], eps);
  }
  for (int64_t b = 0; b < B; ++b) {
    const T* ub = u + b * In;
    for (int64_t o = 0; o < Out; ++o) {
      const T* w = Wt.data() + o * In;
      T sa = 0;
#pragma omp simd reduction(+ : sa)
      for (int64_t i = 0; i < In; ++i) sa += ub[i] * w[i];
      a[b * Out + o] = sa;
      if (!nalu) {
        y[b * Out + o] = sa;
        continue;
      }
      const T* lb = lu.data() + b * In;
      const T* gw = Gt.data() + o * In;
      T sm = 0, sz = 0;
#pragma omp simd reduction(+ : sm, sz)
      for (int64_t i = 0; i < In; ++i) {
        sm += lb[i] * w[i];
        sz += ub[i] * gw[i];
      }
      const T mm = math::exp_(sm), gg = math::sigmoid(sz);
      m[b * Out + o] = mm;
      g[b * Out + o] = gg;
      y[b * Out + o] = math::blend(sa, mm, gg);
    }
  }
}

// The NMU's dy/dW[i] and dy/dx[i] for one output: the product of the other factors (prefix and
// suffix products, no division), times (x_i - 1) and W_i.
template <typename T>
void nmu_row_backward(const T* u, const T* w, int64_t In, T dy, T* dWt, T* du) {
  std::vector<T> suffix(In + 1);
  suffix[In] = T(1);
  for (int64_t i = In - 1; i >= 0; --i) suffix[i] = suffix[i + 1] * (w[i] * u[i] + (T(1) - w[i]));
  T prefix = T(1);
  for (int64_t i = 0; i < In; ++i) {
    const T others = dy * (prefix * suffix[i + 1]);
    dWt[i] += others * (u[i] - T(1));
    if (du != nullptr) du[i] += others * w[i];
    prefix = prefix * (w[i] * u[i] + (T(1) - w[i]));
  }
}

template <typename T>
void Layer<T>::backward(const T* u, const T* dy, const T* const* p, T* const* grads, T* du) {
  std::vector<T> dWt(Out * In, T(0)), dGt(kind == Kind::kNalu ? Out * In : 0, T(0));
  if (du != nullptr) std::fill(du, du + B * In, T(0));
  const bool nalu = kind == Kind::kNalu;
  for (int64_t b = 0; b < B; ++b) {
    const T* ub = u + b * In;
    for (int64_t o = 0; o < Out; ++o) {
      const T d = dy[b * Out + o];
      T* dw = dWt.data() + o * In;
      const T* w = Wt.data() + o * In;
      if (kind == Kind::kNmu) {
        nmu_row_backward(ub, w, In, d, dw, du == nullptr ? nullptr : du + b * In);
        continue;
      }
      if (!nalu) {
#pragma omp simd
        for (int64_t i = 0; i < In; ++i) dw[i] += ub[i] * d;
        if (du != nullptr)
          for (int64_t i = 0; i < In; ++i) du[b * In + i] += d * w[i];
        continue;
      }
      T da, dm, dz;
      math::blend_backward(d, a[b * Out + o], m[b * Out + o], g[b * Out + o], &da, &dm, &dz);
      const T* lb = lu.data() + b * In;
      T* dg = dGt.data() + o * In;
#pragma omp simd
      for (int64_t i = 0; i < In; ++i) {
        dw[i] += ub[i] * da + lb[i] * dm;
        dg[i] += ub[i] * dz;
      }
      if (du != nullptr)
        for (int64_t i = 0; i < In; ++i)
          du[b * In + i] += da * w[i] + dm * w[i] * math::log_abs_grad(ub[i], eps) + dz * Gt[o * In + i];
    }
  }
  for (int64_t i = 0; i < In; ++i) {
    for (int64_t o = 0; o < Out; ++o) {
      const int64_t k = i * Out + o;
      const T dW = dWt[o * In + i];
      if (kind == Kind::kNac || kind == Kind::kNalu) {
        math::nac_weight_backward(dW, p[0][k], p[1][k], &grads[0][k], &grads[1][k]);
        if (nalu) grads[2][k] = dGt[o * In + i];
      } else if (kind == Kind::kNau) {  // through clamp(W, -1, 1): 1 inside, ends included
        grads[0][k] = math::clamp_unit_passes(p[0][k]) ? dW : T(0);
      } else {
        grads[0][k] = dW;
      }
    }
  }
}

// Madsen's sparsity term of a NAU (mean(min(|W|, 1 - |W|))) or NMU (mean(min(|W|, |1 - W|))), on
// the parameter W as stored (the published runs keep it in range by the projection).
template <typename T>
T sparsity_term(Kind kind, T w) {
  const T aw = w < T(0) ? -w : w;
  if (kind == Kind::kNau) return aw < T(1) - aw ? aw : T(1) - aw;
  const T om = T(1) - w < T(0) ? w - T(1) : T(1) - w;
  return aw < om ? aw : om;
}


// d/dW of the sparsity term (torch.minimum's gradient: half to each side on a tie; abs: sign, 0 at 0).
template <typename T>
T sparsity_grad(Kind kind, T w) {
  const T sw = w > T(0) ? T(1) : (w < T(0) ? T(-1) : T(0));
  const T aw = w < T(0) ? -w : w;
  if (kind == Kind::kNau) {
    const T other = T(1) - aw;
    return aw < other ? sw : (aw > other ? -sw : T(0));
  }
  const T v = T(1) - w;
  const T sv = v > T(0) ? T(1) : (v < T(0) ? T(-1) : T(0));
  const T om = v < T(0) ? -v : v;
  return aw < om ? sw : (aw > om ? -sv : T(0.5) * (sw - sv));
}

// The sparsity regulariser of one layer (NAU, NMU; 0 for the others): its mean over W, and with
// a weight, weight * its gradient added into grads[0].
template <typename T>
T layer_sparsity(Kind kind, const T* W, int64_t n, T weight, T* dW) {
  if (kind != Kind::kNau && kind != Kind::kNmu) return T(0);
  T sum = 0;
  for (int64_t k = 0; k < n; ++k) sum += sparsity_term(kind, W[k]);
  if (dW != nullptr)
    for (int64_t k = 0; k < n; ++k) dW[k] += weight * sparsity_grad(kind, W[k]) / static_cast<T>(n);
  return sum / static_cast<T>(n);
}

// Pointers to one member's parameters and gradients: layer l's j-th parameter at [l][j].
template <typename T>
struct MemberParams {
  const T* p[2][3];
  T* g[2][3];
};

template <typename T>
MemberParams<T> member_params(const StepArgs& a, T* param, T* grad, const int64_t* seg, int64_t e) {
  MemberParams<T> mp{};
  int q = 0;
  for (int l = 0; l < 2; ++l)
    for (int j = 0; j < params_per_layer(a.kinds[l]); ++j, ++q) {
      const int64_t o = seg[2 * q] + e * seg[2 * q + 1];
      mp.p[l][j] = param + o;
      mp.g[l][j] = grad + o;
    }
  return mp;
}

// One member: forward, loss, objective check, backward into its part of the gradient buffer.
// Returns the member's MSE; sets *bad when its objective is not finite.
template <typename T>
T member_step(const StepArgs& a, const T* x, const T* t, MemberParams<T>& mp, Layer<T> (&layers)[2],
              std::vector<T>& h, std::vector<T>& y, std::vector<T>& dh, bool diverged, bool* bad) {
  const int64_t B = a.B;
  for (int l = 0; l < 2; ++l) layers[l].prepare(mp.p[l]);
  layers[0].forward(x, h.data());
  layers[1].forward(h.data(), y.data());
  T sq = 0;
  for (int64_t b = 0; b < B; ++b) {
    const T err = y[b] - t[b];
    sq += err * err;
  }
  const T loss = sq / static_cast<T>(B);
  const T w = static_cast<T>(a.reg_weight);
  T objective = loss;
  if (a.reg_weight != 0.0) {
    T pen = 0;
    for (int l = 0; l < 2; ++l) pen += layer_sparsity<T>(a.kinds[l], mp.p[l][0], layers[l].In * layers[l].Out, T(0), nullptr);
    objective = loss + w * pen;
  }
  *bad = !std::isfinite(objective);
  // d objective / dy, zero (times the error, as autograd: NaN for a non-finite error) for a
  // member that has diverged
  const T scale = (diverged || *bad) ? T(0) : T(1);
  std::vector<T> dy(B);
  for (int64_t b = 0; b < B; ++b) dy[b] = scale / static_cast<T>(B) * (y[b] - t[b]) * T(2);
  layers[1].backward(h.data(), dy.data(), mp.p[1], mp.g[1], dh.data());
  layers[0].backward(x, dh.data(), mp.p[0], mp.g[0], nullptr);
  if (a.reg_weight != 0.0)
    for (int l = 0; l < 2; ++l)
      layer_sparsity<T>(a.kinds[l], mp.p[l][0], layers[l].In * layers[l].Out, scale * w, mp.g[l][0]);
  return loss;
}

// Every member, split over the intra-op threads (each member whole on one thread).
template <typename T>
void all_members(const StepArgs& a, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                 const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged, T* loss) {
  const T* xs = x.const_data_ptr<T>();
  const T* ts = target.const_data_ptr<T>();
  T* ps = param.data_ptr<T>();
  T* gs = grad.data_ptr<T>();
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  bool* div = diverged.data_ptr<bool>();
  const bool normal = a.eps >= static_cast<double>(std::numeric_limits<T>::min());
  at::parallel_for(0, a.E, 1, [&](int64_t begin, int64_t end) {
    Layer<T> layers[2] = {{a.kinds[0], a.B, a.I, a.H, static_cast<T>(a.eps), normal, {}, {}, {}, {}, {}, {}},
                          {a.kinds[1], a.B, a.H, 1, static_cast<T>(a.eps), normal, {}, {}, {}, {}, {}, {}}};
    std::vector<T> h(a.B * a.H), y(a.B), dh(a.B * a.H);
    for (int64_t e = begin; e < end; ++e) {
      MemberParams<T> mp = member_params(a, ps, gs, seg, e);
      bool bad = false;
      loss[e] = member_step(a, xs + e * a.B * a.I, ts + e * a.B, mp, layers, h, y, dh, div[e], &bad);
      div[e] = div[e] || bad;
    }
  });
}

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
    all_members<scalar_t>(a, x, target, param, grad, segments, diverged, loss.data_ptr<scalar_t>());
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
