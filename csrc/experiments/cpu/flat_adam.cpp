// flat_adam.cpp: see flat_adam.h.
#include "experiments/cpu/flat_adam.h"

#include "common/cpu/isa.h"  // use_avx2(), use_avx512()
#include "experiments/cpu/fp_contract.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <algorithm>
#include <string>
#include <vector>

// Same rounding in the vector body and the scalar remainder of every loop: no contraction into FMA.
NALU_FP_CONTRACT_OFF

namespace nalu_cuda {
namespace training {
namespace {

template <typename T>
struct AdamScalars {
  T one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps, neg_step_size;
};

#if defined(__GNUC__)
#define NALU_ADAM_INLINE inline __attribute__((always_inline))
#else
#define NALU_ADAM_INLINE inline
#endif

// Whether a run of n gradient elements has a NaN or Inf.
template <typename T>
bool nonfinite_run(const T* g, int64_t n) {
  T bad = 0;  // g - g is 0 for a finite g, NaN for NaN or Inf
#pragma omp simd reduction(+ : bad)
  for (int64_t k = 0; k < n; ++k) bad += g[k] - g[k];
  return bad != T(0);
}

// The sum of squares of a run of n gradient elements, in float64 (the clip's norm).
template <typename T>
double squares_run(const T* g, int64_t n) {
  double sq = 0.0;
#pragma omp simd reduction(+ : sq)
  for (int64_t k = 0; k < n; ++k) sq += static_cast<double>(g[k]) * static_cast<double>(g[k]);
  return sq;
}

// The update of one member's run of n elements.
template <typename T>
NALU_ADAM_INLINE void update_run_impl(T* p, const T* g, T* m, T* v, int64_t n, bool frozen, T gscale,
                                      const AdamScalars<T>& s) {
  // m: torch's lerp with weight w = 1 - beta1 (the second form for w >= 0.5, as torch has it)
  const T w = s.one_minus_beta1;
  const bool lerp_low = w < T(0.5);
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    const T gk = frozen ? T(0) : g[k] * gscale;  // (gscale: the clip's factor, else 1: exact)
    const T mk = lerp_low ? m[k] + w * (gk - m[k]) : gk - (gk - m[k]) * (T(1) - w);
    T vk = v[k] * s.beta2;
    vk = vk + s.one_minus_beta2 * gk * gk;
    const T denom = std::sqrt(vk) * s.inv_sqrt_bc2 + s.eps;
    m[k] = mk;
    v[k] = vk;
    p[k] = p[k] + s.neg_step_size * mk / denom;
  }
}

// update_run_impl compiled under the target in force where it is written: NAME<T>.
#define NALU_ADAM_UPDATE_RUN(NAME)                                                                          \
  template <typename T>                                                                                     \
  void NAME(T* p, const T* g, T* m, T* v, int64_t n, bool frozen, T gscale, const AdamScalars<T>& s) {    \
    update_run_impl(p, g, m, v, n, frozen, gscale, s);                                                      \
  }

NALU_ADAM_UPDATE_RUN(update_run)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NALU_ADAM_HAVE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
NALU_ADAM_UPDATE_RUN(update_run_avx2)
#pragma GCC pop_options
// The same element-wise loop in 64-byte vectors where the processor has AVX-512 (cpu::use_avx512()):
// every element's operations are the same (no contraction, NALU_FP_CONTRACT_OFF above), so the same bits.
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512vl,avx512dq,prefer-vector-width=512")
NALU_ADAM_UPDATE_RUN(update_run_avx512)
#pragma GCC pop_options
#endif

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " " << t.device() << " tensor of shape " << t.sizes();
  return s.str();
}

}  // namespace

at::Tensor flat_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& segments, const at::Tensor& frozen,
                          bool freeze_nonfinite, double lr, double beta1, double beta2, double eps,
                          int64_t step, const c10::optional<at::Tensor>& lr_member, double clip) {
  constexpr const char* kFn = "flat_adam_step";
  TORCH_CHECK(param.defined() && param.device().is_cpu() && param.dim() == 1 && param.is_contiguous() &&
                  (param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble),
              kFn, ": param must be a contiguous 1-D float32 or float64 CPU tensor, got a ",
              param.defined() ? describe(param) : std::string("undefined tensor"));
  const int64_t n = param.numel();
  const std::pair<const char*, const at::Tensor*> bufs[] = {{"grad", &grad}, {"exp_avg", &exp_avg},
                                                            {"exp_avg_sq", &exp_avg_sq}};
  for (const auto& [name, t] : bufs) {
    TORCH_CHECK(t->defined() && t->device().is_cpu() && t->dim() == 1 && t->is_contiguous() &&
                    t->scalar_type() == param.scalar_type() && t->numel() == n,
                kFn, ": ", name, " must be a contiguous 1-D CPU tensor like param (", describe(param), "), got a ",
                t->defined() ? describe(*t) : std::string("undefined tensor"));
  }
  TORCH_CHECK(frozen.defined() && frozen.device().is_cpu() && frozen.dim() == 1 && frozen.is_contiguous() &&
                  frozen.scalar_type() == at::kBool,
              kFn, ": frozen must be a contiguous 1-D bool CPU tensor (one flag per member), got a ",
              frozen.defined() ? describe(frozen) : std::string("undefined tensor"));
  const int64_t E = frozen.numel();
  TORCH_CHECK(E >= 1, kFn, ": frozen must have one flag per member (at least one), got none");
  TORCH_CHECK(segments.defined() && segments.device().is_cpu() && segments.scalar_type() == at::kLong &&
                  segments.is_contiguous() && segments.dim() == 2 && segments.size(1) == 2,
              kFn, ": segments must be a contiguous int64 CPU tensor of shape (P, 2) (offset, per_member), got a ",
              segments.defined() ? describe(segments) : std::string("undefined tensor"));
  TORCH_CHECK(step >= 1, kFn, ": step must be at least 1, got ", step);
  const bool per_member = lr_member.has_value() && lr_member->defined();
  if (per_member)
    TORCH_CHECK(lr_member->device().is_cpu() && lr_member->dim() == 1 && lr_member->is_contiguous() &&
                    lr_member->scalar_type() == at::kDouble && lr_member->numel() == E,
                kFn, ": lr_member must be a contiguous 1-D float64 CPU tensor of ", E, " learning rates (one per "
                "member), got a ", describe(*lr_member));
  TORCH_CHECK(std::isfinite(clip), kFn, ": clip must be a finite number (> 0: each member's gradient norm is clipped "
              "to it; <= 0: no clipping), got ", clip);
  const int64_t P = segments.size(0);
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  for (int64_t q = 0; q < P; ++q) {
    const int64_t off = seg[2 * q], per = seg[2 * q + 1];
    TORCH_CHECK(off >= 0 && per >= 0 && off + E * per <= n, kFn, ": segment ", q, " = (offset ", off,
                ", per_member ", per, ") runs past the buffer of ", n, " elements with E = ", E, " members");
  }
  at::Tensor nonfinite = at::zeros({E}, frozen.options());
  bool* bad = nonfinite.data_ptr<bool>();
  const bool* fz = frozen.const_data_ptr<bool>();
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const double* lrs = per_member ? lr_member->const_data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "flat_adam_step", [&] {
    using T = scalar_t;
    const AdamScalars<T> s{static_cast<T>(1.0 - beta1), static_cast<T>(beta2), static_cast<T>(1.0 - beta2),
                           static_cast<T>(1.0 / std::sqrt(bc2)), static_cast<T>(eps), static_cast<T>(-lr / bc1)};
    auto run = &update_run<T>;
#ifdef NALU_ADAM_HAVE_AVX2
    if (cpu::use_avx2()) run = cpu::use_avx512() ? &update_run_avx512<T> : &update_run_avx2<T>;
#endif
    T* p = param.data_ptr<T>();
    const T* g = grad.const_data_ptr<T>();
    T* m = exp_avg.data_ptr<T>();
    T* v = exp_avg_sq.data_ptr<T>();
    // Members split over the intra-op threads, each member whole on one thread (its runs in segment
    // order, as one thread takes them): the same bits for any thread count. At least kGrainElems
    // elements per thread, so that a small model's step stays on the calling thread.
    constexpr int64_t kGrainElems = 16384;
    int64_t per_member = 0;
    for (int64_t q = 0; q < P; ++q) per_member += seg[2 * q + 1];
    const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(per_member, 1));
    at::parallel_for(0, E, grain, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        double sq = 0.0;
        for (int64_t q = 0; q < P; ++q) {
          const int64_t o = seg[2 * q] + e * seg[2 * q + 1], per = seg[2 * q + 1];
          if (clip > 0.0)
            sq += squares_run(g + o, per);  // a NaN or Inf anywhere makes it non-finite
          else
            bad[e] = bad[e] || nonfinite_run(g + o, per);
        }
        T gscale = T(1);
        if (clip > 0.0) {
          bad[e] = !std::isfinite(sq);
          // FlatAdam.clip_grad_norm_: min(1, clip / (norm + 1e-12)) in float64, then in the gradient's dtype
          gscale = static_cast<T>(std::min(1.0, clip / (std::sqrt(sq) + 1e-12)));
        }
        AdamScalars<T> se = s;
        if (lrs != nullptr) se.neg_step_size = static_cast<T>(-lrs[e] / bc1);
        const bool frozen_e = fz[e] || (freeze_nonfinite && bad[e]);
        for (int64_t q = 0; q < P; ++q) {
          const int64_t o = seg[2 * q] + e * seg[2 * q + 1];
          run(p + o, g + o, m + o, v + o, seg[2 * q + 1], frozen_e, gscale, se);
        }
      }
    });
  });
  return nonfinite;
}

}  // namespace training
}  // namespace nalu_cuda
