// common.h: what every CPU kernel path shares: the thread grain, the float and
// layer-kind dispatch, the parallel vectorised loop, the weight construction, the pointer bundles
// of one call (with FwdOut and SavedPtrs of csrc/layer_types.h), the NALU epilogue and output
// gradients, and the sum of per-chunk partials.
// Included by ops/nac_nalu/cpu/kernels_impl.h (once per instruction set, NALU_CPU_ISA defined); it includes
// nothing itself and opens its namespaces itself.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

namespace nm = nalu_cuda::math;

// Work (multiply-adds or elementwise evaluations) under which a parallel loop runs inline.
constexpr int64_t kGrainWork = 32768;
// Rows per partial weight-gradient sum are at least this, so the partials stay smaller than x.
constexpr int64_t kMinChunkRows = 64;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, work_per_item));
}

// Calls f.template operator()<T>() with T = float or double: the kernels hold `#pragma omp simd`,
// which cannot sit inside the argument of the AT_DISPATCH macros. Dtypes are checked before.
template <typename F>
void dispatch_float(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat:
      f.template operator()<float>();
      break;
    case at::kDouble:
      f.template operator()<double>();
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "nalu_cuda: unchecked dtype ", st);
  }
}

// Calls f.template operator()<ADD, MUL, GATE>() for the layer kind. ADD/MUL/GATE are compile-time
// so the inner loops carry no branches: NAC+ <1, 0, kNone>, NAC* <0, 1, kNone>,
// NALU <1, 1, kInput | kIndependent>. Separate multiplicative weights only change a pointer.
template <typename F>
void dispatch_kind(const LayerKind& kind, F&& f) {
  if (kind.add && kind.mul) {
    if (kind.gate == Gate::kInput) {
      f.template operator()<true, true, Gate::kInput>();
    } else {
      f.template operator()<true, true, Gate::kIndependent>();
    }
  } else if (kind.add) {
    f.template operator()<true, false, Gate::kNone>();
  } else {
    f.template operator()<false, true, Gate::kNone>();
  }
}

// Elementwise loop over [0, n), parallel in chunks and vectorised inside each chunk.
template <typename F>
void parallel_simd(int64_t n, int64_t work_per_item, F&& f) {
  at::parallel_for(0, n, grain_for(work_per_item), [&](int64_t k0, int64_t k1) {
#pragma omp simd
    for (int64_t k = k0; k < k1; ++k) f(k);
  });
}

// out[k] = log(|x[k]| + eps) over [0, n): the faster log when eps is a normal number.
template <typename T>
void log_abs_run(const T* x, T* out, int64_t n, T eps) {
  if (eps >= std::numeric_limits<T>::min()) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) out[k] = nm::log_abs_normal_eps(x[k], eps);
  } else {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) out[k] = nm::log_abs(x[k], eps);
  }
}

// ---------------------------------------------------------------------------------------------
// Weight construction
// ---------------------------------------------------------------------------------------------

// out = tanh(w_hat) sigmoid(m_hat) over n entries.
template <typename T>
void build_weight(const T* w_hat, const T* m_hat, T* out, int64_t n) {
  parallel_simd(n, 64, [=](int64_t k) { out[k] = nm::nac_weight(w_hat[k], m_hat[k]); });
}

// (E, I, O) -> (E, O, I)
template <typename T>
void transpose_last2(const T* in, T* out, int64_t E, int64_t I, int64_t O) {
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t j = 0; j < O; ++j) out[(e * O + j) * I + i] = in[(e * I + i) * O + j];
    }
  }
}

// grad_w_hat, grad_m_hat from grad_w over n entries.
template <typename T>
void weight_backward_pass(const T* grad_w, const T* w_hat, const T* m_hat, T* grad_w_hat, T* grad_m_hat,
                          int64_t n) {
  parallel_simd(n, 64, [=](int64_t k) {
    nm::nac_weight_backward(grad_w[k], w_hat[k], m_hat[k], grad_w_hat + k, grad_m_hat + k);
  });
}

// ---------------------------------------------------------------------------------------------
// What the paths share: pointer bundles, the NALU epilogue, output gradients, partial sums
// ---------------------------------------------------------------------------------------------

// Raw pointers of one call, all contiguous. W, Wm, G are (E, O, I) on the rowwise path and
// (E, I, O) on the blas path; gind is sigmoid(G), (E, O), for an independent gate; Gb an input
// gate's bias, (E, O) (null: none).
template <typename T>
struct Ptrs {
  const T* x = nullptr;
  const T* W = nullptr;
  const T* Wm = nullptr;
  const T* G = nullptr;
  const T* gind = nullptr;
  const T* Gb = nullptr;
};

// The NALU epilogue over output elements [k0, k1): m = exp(u) (u is in m), the gate, y = blend.
// With an input gate g holds z and becomes sigmoid(z); an independent gate reads sigmoid(G) from
// gind, (E, O), for element k = (e N + n) O + j.
template <typename T, bool INPUT_GATE>
inline void nalu_epilogue(const T* a, T* m, T* g, T* y, const T* gind, int64_t k0, int64_t k1, int64_t NO,
                          int64_t O) {
#pragma omp simd
  for (int64_t k = k0; k < k1; ++k) {
    const T mv = nm::exp_(m[k]);
    m[k] = mv;
    if constexpr (INPUT_GATE) {
      const T gv = nm::sigmoid(g[k]);
      g[k] = gv;
      y[k] = nm::blend(a[k], mv, gv);
    } else {
      y[k] = nm::blend(a[k], mv, gind[(k / NO) * O + k % O]);
    }
  }
}

// Gradients w.r.t. the pre-activations of one output element: da (additive path), du (before
// the exp), dz (before the gate's sigmoid).
template <typename T, bool ADD, bool MUL>
inline void output_grads(T dy, T a, T m, T g, T* da, T* du, T* dz) {
  if constexpr (ADD && MUL) {
    nm::blend_backward(dy, a, m, g, da, du, dz);
  } else if constexpr (ADD) {
    *da = dy;
  } else {
    *du = dy * m;  // d exp(u) / du = exp(u) = m
  }
}

// The gradients reaching the kept parts of NALU output element o (SavedPtrs::ga, gm, gg, any of
// them null) added to its da, du and (input gate) dz. Called only when sv.part_grads().
template <typename T, Gate GATE>
inline void add_part_grads(const SavedPtrs<const T*>& sv, int64_t o, T* da, T* du, T* dz) {
  T unused = 0;
  constexpr bool kGateIn = GATE == Gate::kInput;
  nm::parts_backward(sv.ga ? sv.ga[o] : T(0), sv.gm ? sv.gm[o] : T(0), kGateIn && sv.gg ? sv.gg[o] : T(0), sv.m[o],
                     kGateIn ? sv.g[o] : T(0), da, du, kGateIn ? dz : &unused);
}

// The gate value of output element k = (e * N + n) * O + j.
template <typename T, Gate GATE>
inline T gate_at(const T* g, int64_t k, int64_t NO, int64_t O) {
  if constexpr (GATE == Gate::kInput) return g[k];
  if constexpr (GATE == Gate::kIndependent) return g[(k / NO) * O + k % O];
  return T(0);
}

// Backward outputs. dW, dWm, dG are gradients w.r.t. W, W_m and G (before the weight
// construction's backward), (E, I, O); dG is (E, O) for an independent gate.
template <typename T>
struct GradPtrs {
  T* dx = nullptr;
  T* dW = nullptr;
  T* dWm = nullptr;  // separate weights only
  T* dG = nullptr;
  T* dGb = nullptr;  // an input gate's bias only, (E, O)
};

// The layout of one partial weight-gradient sum of rowwise_backward and lanes_backward:
// [dW (O, I) | dW_m (O, I) when separate | dG: (O, I) for an input gate, (O) for an independent
// one | dG_bias (O) for a gate bias].
struct PartialLayout {
  int64_t gate_off = 0, bias_off = 0, size = 0;
};

template <Gate GATE>
PartialLayout partial_layout(const LayerKind& kind, const LayerShape& s) {
  const int64_t OI = s.O * s.I;
  PartialLayout l;
  l.gate_off = OI * (kind.sep() ? 2 : 1);
  l.bias_off = l.gate_off + (GATE == Gate::kInput ? OI : (GATE == Gate::kIndependent ? s.O : 0));
  l.size = l.bias_off + (GATE == Gate::kInput && kind.gate_bias ? s.O : 0);
  return l;
}

// The weight gradients of rowwise_backward and lanes_backward: each member's per-chunk partial
// sums (layout: PartialLayout) added in chunk order, transposing (O, I) back to (I, O).
template <typename T, Gate GATE>
void sum_partials(const LayerShape& s, bool sep, int64_t chunks, const PartialLayout& layout,
                  const std::vector<T>& partials, const GradPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, OI = O * I;
  const int64_t gate_off = layout.gate_off, part_size = layout.size;
  const bool bias = layout.size > layout.bias_off;
  at::parallel_for(0, s.E, grain_for(chunks * part_size), [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const T* base = partials.data() + e * chunks * part_size;
      auto reduce_t = [&](int64_t offset, T* dst) {  // (O, I) partials -> (I, O) sum
        for (int64_t j = 0; j < O; ++j) {
          for (int64_t i = 0; i < I; ++i) {
            T acc = 0;
            for (int64_t c = 0; c < chunks; ++c) acc += base[c * part_size + offset + j * I + i];
            dst[i * O + j] = acc;
          }
        }
      };
      reduce_t(0, out.dW + e * OI);
      if (sep) reduce_t(OI, out.dWm + e * OI);
      if constexpr (GATE == Gate::kInput) reduce_t(gate_off, out.dG + e * OI);
      auto reduce_o = [&](int64_t offset, T* dst) {  // (O) partials -> (O) sum
        for (int64_t j = 0; j < O; ++j) {
          T acc = 0;
          for (int64_t c = 0; c < chunks; ++c) acc += base[c * part_size + offset + j];
          dst[j] = acc;
        }
      };
      if constexpr (GATE == Gate::kIndependent) reduce_o(gate_off, out.dG + e * O);
      if (bias) reduce_o(layout.bias_off, out.dGb + e * O);
    }
  });
}

}  // namespace

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
