// nalu_cpu_kernels.h: the CPU kernels of NAC+, NAC*, NALU and the weight construction.
// Included once per instruction set (kernels_base.cpp, kernels_avx2.cpp) with NALU_CPU_ISA set
// to the namespace to define; it includes nothing itself (see nalu_cpu.h).
//
// Math (member e, row n, input i, output j; each formula is in csrc/nalu_math.h):
//   forward   W = tanh(W_hat) sigmoid(M_hat);  lx = log(|x| + eps);  a = x W;  m = exp(lx W_m);
//             g = sigmoid(x G) or sigmoid(G);  y = g a + (1 - g) m
//   backward  da = g dy;  du = (1 - g) dy m;  dz = (a - m) dy g (1 - g)
//             dW = x^T da (+ lx^T du when tied);  dW_m = lx^T du;  dG = x^T dz (or sum_n dz)
//             dx = da W^T + dz G^T + (du W_m^T) sign(x) / (|x| + eps)
//             dW_hat, dM_hat from dW through the weight construction
// Saved by forward for backward: lx (the log is the costliest step on a CPU, and autograd's
// reference keeps it too), and a, m, g for NALU (m = y for NAC*). W is rebuilt in backward: it
// is I x O, small next to the batch.
//
// Two paths, chosen from the shape alone so that results never depend on the thread count:
//   rowwise  out <= kRowwiseMaxOut (the paper's layers): one pass over the rows per direction.
//            With at most kNarrowMaxIn inputs (the paper's second layers), the narrow variant
//            puts rows, not inputs, across the vector lanes.
//            Weights are kept transposed, (E, O, I), so each output is a vectorised dot product
//            over a row that is still in L1; weight gradients accumulate in per-chunk partial
//            sums that are added in a fixed order. No BLAS call, no batch-sized temporary.
//   blas     wider layers: products by ATen's bmm (MKL/oneDNN); each elementwise step around them
//            is one fused, vectorised, parallel loop. The backward's only batch-sized scratch is
//            one (E, N, O) buffer that holds du, da and dz in turn.
#ifndef NALU_CPU_ISA
#error "define NALU_CPU_ISA (the namespace of this instruction set) before including nalu_cpu_kernels.h"
#endif

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

namespace nm = nalu_cuda::math;

// Work (multiply-adds or elementwise evaluations) under which a parallel loop runs inline.
constexpr int64_t kGrainWork = 32768;
// Widest layer (out_features) that takes the rowwise path.
constexpr int64_t kRowwiseMaxOut = 16;
// Rows per partial weight-gradient sum are at least this, so the partials stay smaller than x.
constexpr int64_t kMinChunkRows = 64;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, work_per_item));
}

bool rowwise(const LayerShape& s) { return s.O <= kRowwiseMaxOut; }

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
// Rowwise path
// ---------------------------------------------------------------------------------------------

// Raw pointers of one call, all contiguous. W, Wm, G are (E, O, I) on the rowwise path and
// (E, I, O) on the blas path; gind is sigmoid(G), (E, O), for an independent gate.
template <typename T>
struct Ptrs {
  const T* x = nullptr;
  const T* W = nullptr;
  const T* Wm = nullptr;
  const T* G = nullptr;
  const T* gind = nullptr;
};

// Forward outputs, (E, N, O) each, lx (E, N, I).
template <typename T>
struct OutPtrs {
  T* y = nullptr;
  T* a = nullptr;
  T* m = nullptr;
  T* g = nullptr;  // input gate only
  T* lx = nullptr;
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

#ifdef NALU_CPU_ISA_IS_AVX2
// The dot products of four rows with one output's weights in float: a_k = x_k . w,
// u_k = lx_k . w_m, z_k = x_k . g, eight inputs per instruction, the last I % 8 by masked loads,
// and each group of four sums reduced together by horizontal adds (a fixed order: the result
// depends on I alone).
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

template <bool ADD, bool MUL, bool GATE_IN>
inline void quad_dots(const float* const* x, const float* const* l, const float* w, const float* wm,
                      const float* g, int64_t I, float* a, float* u, float* z) {
  __m256 A[4], U[4], Z[4];
  for (int k = 0; k < 4; ++k) A[k] = U[k] = Z[k] = _mm256_setzero_ps();
  // MASKED: the last I % 8 inputs (lanes past the row's end are neither read nor counted).
  auto body = [&]<bool MASKED>(int64_t i, __m256i mask) {
    auto load = [mask](const float* p) {
      if constexpr (MASKED) {
        return _mm256_maskload_ps(p, mask);
      } else {
        return _mm256_loadu_ps(p);
      }
    };
    __m256 xv[4];
    if constexpr (ADD || GATE_IN) {
      for (int k = 0; k < 4; ++k) xv[k] = load(x[k] + i);
    }
    if constexpr (ADD) {
      const __m256 wv = load(w + i);
      for (int k = 0; k < 4; ++k) A[k] = _mm256_fmadd_ps(xv[k], wv, A[k]);
    }
    if constexpr (MUL) {
      const __m256 wv = load(wm + i);
      for (int k = 0; k < 4; ++k) U[k] = _mm256_fmadd_ps(load(l[k] + i), wv, U[k]);
    }
    if constexpr (GATE_IN) {
      const __m256 gv = load(g + i);
      for (int k = 0; k < 4; ++k) Z[k] = _mm256_fmadd_ps(xv[k], gv, Z[k]);
    }
  };
  int64_t i = 0;
  const __m256i all = _mm256_set1_epi32(-1);
  for (; i + 8 <= I; i += 8) body.template operator()<false>(i, all);
  if (i < I) {
    alignas(32) static const int32_t kMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    body.template operator()<true>(i, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask + 8 - (I - i))));
  }
  if constexpr (ADD) _mm_storeu_ps(a, hsum4(A[0], A[1], A[2], A[3]));
  if constexpr (MUL) _mm_storeu_ps(u, hsum4(U[0], U[1], U[2], U[3]));
  if constexpr (GATE_IN) _mm_storeu_ps(z, hsum4(Z[0], Z[1], Z[2], Z[3]));
}
#endif

template <typename T, bool ADD, bool MUL, Gate GATE>
void rowwise_forward(const LayerShape& s, const Ptrs<T>& p, T eps, const OutPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, N = s.N;
  // Rows go four at a time (below) in quads aligned to multiples of 4 of the flat row index, and
  // the threads split the rows at quad boundaries: whether a row is computed in a quad or alone
  // depends on the row, never on the thread count, so neither do the results.
  const int64_t rows = s.E * N;
  at::parallel_for(0, (rows + 3) / 4, grain_for(4 * I * (O + 1) * 3), [&](int64_t q0, int64_t q1) {
    const int64_t r0 = 4 * q0, r1 = std::min(rows, 4 * q1);
    // The logs, a block of rows at a time in one flat loop (one scalar remainder per block, not
    // per row), just before the block's products read them back from L1.
    constexpr int64_t kLogRows = 32;
    int64_t logged = r0;
    auto log_rows_until = [&](int64_t upto) {
      if constexpr (MUL) {
        while (logged < upto) {
          const int64_t end = std::min(r1, logged + kLogRows);
          const T* xs = p.x + logged * I;
          T* ls = out.lx + logged * I;
          log_abs_run(xs, ls, (end - logged) * I, eps);
          logged = end;
        }
      }
    };
    // The products of row r, output j, go to the epilogue's inputs; exp, sigmoid and the blend
    // follow, vectorised over the chunk.
    auto store = [&](int64_t r, int64_t j, T acc_a, T acc_u, T acc_z) {
      const int64_t o = r * O + j;
      if constexpr (ADD && MUL) {
        out.a[o] = acc_a;
        out.m[o] = acc_u;
        if constexpr (GATE == Gate::kInput) out.g[o] = acc_z;
      } else if constexpr (ADD) {
        out.y[o] = acc_a;
      } else {
        out.y[o] = acc_u;
      }
    };
    for (int64_t r = r0; r < r1;) {
      const int64_t e = r / N;
      const T* w = p.W + e * O * I;
      const T* wm = p.Wm + e * O * I;
      const T* gt = GATE == Gate::kInput ? p.G + e * O * I : nullptr;
      const T* x0 = p.x + r * I;
      const T* l0 = MUL ? out.lx + r * I : nullptr;
      log_rows_until(std::min(r1, r + 4));
      if (r % 4 == 0 && r + 4 <= r1 && (r + 3) / N == e) {
        // Four rows of one member at once: each weight load serves four dot products.
        const T *x1 = x0 + I, *x2 = x1 + I, *x3 = x2 + I;
        const T *l1 = MUL ? l0 + I : nullptr, *l2 = MUL ? l1 + I : nullptr, *l3 = MUL ? l2 + I : nullptr;
        for (int64_t j = 0; j < O; ++j) {
          const T* wj = w + j * I;
          const T* wmj = wm + j * I;
          const T* gj = GATE == Gate::kInput ? gt + j * I : nullptr;
#ifdef NALU_CPU_ISA_IS_AVX2
          if constexpr (std::is_same_v<T, float>) {
            const float* xs[4] = {x0, x1, x2, x3};
            const float* ls[4] = {l0, l1, l2, l3};
            alignas(16) float av[4] = {}, uv[4] = {}, zv[4] = {};
            quad_dots<ADD, MUL, GATE == Gate::kInput>(xs, ls, wj, wmj, gj, I, av, uv, zv);
            for (int k = 0; k < 4; ++k) store(r + k, j, av[k], uv[k], zv[k]);
            continue;
          }
#endif
          T a0 = 0, a1 = 0, a2 = 0, a3 = 0, u0 = 0, u1 = 0, u2 = 0, u3 = 0, z0 = 0, z1 = 0, z2 = 0, z3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, u0, u1, u2, u3, z0, z1, z2, z3)
          for (int64_t i = 0; i < I; ++i) {
            if constexpr (ADD) {
              const T wv = wj[i];
              a0 += x0[i] * wv;
              a1 += x1[i] * wv;
              a2 += x2[i] * wv;
              a3 += x3[i] * wv;
            }
            if constexpr (MUL) {
              const T wv = wmj[i];
              u0 += l0[i] * wv;
              u1 += l1[i] * wv;
              u2 += l2[i] * wv;
              u3 += l3[i] * wv;
            }
            if constexpr (GATE == Gate::kInput) {
              const T gv = gj[i];
              z0 += x0[i] * gv;
              z1 += x1[i] * gv;
              z2 += x2[i] * gv;
              z3 += x3[i] * gv;
            }
          }
          store(r, j, a0, u0, z0);
          store(r + 1, j, a1, u1, z1);
          store(r + 2, j, a2, u2, z2);
          store(r + 3, j, a3, u3, z3);
        }
        r += 4;
        continue;
      }
      for (int64_t j = 0; j < O; ++j) {
        T acc_a = 0, acc_u = 0, acc_z = 0;
#pragma omp simd reduction(+ : acc_a, acc_u, acc_z)
        for (int64_t i = 0; i < I; ++i) {
          if constexpr (ADD) acc_a += x0[i] * w[j * I + i];
          if constexpr (MUL) acc_u += l0[i] * wm[j * I + i];
          if constexpr (GATE == Gate::kInput) acc_z += x0[i] * gt[j * I + i];
        }
        store(r, j, acc_a, acc_u, acc_z);
      }
      ++r;
    }
    // Epilogue over the chunk's outputs [r0 * O, r1 * O): m = exp(u), g = sigmoid(z), y = blend.
    const int64_t k0 = r0 * O, k1 = r1 * O;
    if constexpr (ADD && MUL) {
      nalu_epilogue<T, GATE == Gate::kInput>(out.a, out.m, out.g, out.y, p.gind, k0, k1, N * O, O);
    } else if constexpr (MUL) {
      T* y = out.y;
#pragma omp simd
      for (int64_t k = k0; k < k1; ++k) y[k] = nm::exp_(y[k]);
    }
  });
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

// Saved forward values (see Forward).
template <typename T>
struct SavedPtrs {
  const T* a = nullptr;   // (E, N, O), NALU
  const T* m = nullptr;   // (E, N, O), NALU and NAC*
  const T* g = nullptr;   // (E, N, O) input gate, (E, O) independent gate
  const T* lx = nullptr;  // (E, N, I), NALU and NAC*
};

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
};

// The weight gradients of rowwise_backward and narrow_backward: each member's per-chunk partial
// sums (layout [dW (O, I) | dW_m (O, I) when separate | dG (O, I) or (O)]) added in chunk order,
// transposing (O, I) back to (I, O).
template <typename T, Gate GATE>
void sum_partials(const LayerShape& s, bool sep, int64_t chunks, int64_t part_size, const std::vector<T>& partials,
                  const GradPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, OI = O * I;
  const int64_t gate_off = OI * (sep ? 2 : 1);
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
      if constexpr (GATE == Gate::kIndependent) {
        for (int64_t j = 0; j < O; ++j) {
          T acc = 0;
          for (int64_t c = 0; c < chunks; ++c) acc += base[c * part_size + gate_off + j];
          out.dG[e * O + j] = acc;
        }
      }
    }
  });
}

// sum_k ps[k][i] c[k] over a group of R rows; for four rows as a tree of two pairs (a short
// dependency chain; the order is fixed, so the result is too).
template <int R, typename T>
inline T group_dot(const T* const* ps, const T* c, int64_t i) {
  if constexpr (R == 4) {
    return (ps[0][i] * c[0] + ps[1][i] * c[1]) + (ps[2][i] * c[2] + ps[3][i] * c[3]);
  } else {
    T v = ps[0][i] * c[0];
    for (int k = 1; k < R; ++k) v += ps[k][i] * c[k];
    return v;
  }
}

template <typename T, bool ADD, bool MUL, Gate GATE>
void rowwise_backward(const LayerShape& s, bool sep, const Ptrs<T>& p, const SavedPtrs<T>& sv, const T* dy,
                      T eps, bool compute_grad_x, const GradPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, N = s.N, E = s.E, OI = O * I, NO = N * O;
  const int64_t row_work = I * (O + 1) * 3;
  // Each member's rows fall in fixed chunks; a chunk's weight gradients go to its own partial sum.
  const int64_t chunk_rows = std::max<int64_t>(kMinChunkRows, (4 * kGrainWork + row_work - 1) / row_work);
  const int64_t chunks = std::max<int64_t>(1, (N + chunk_rows - 1) / chunk_rows);
  constexpr bool kGateIn = GATE == Gate::kInput;
  const int64_t gate_off = OI * (sep ? 2 : 1);
  const int64_t part_size = gate_off + (kGateIn ? OI : (GATE == Gate::kIndependent ? O : 0));
  std::vector<T> partials(static_cast<size_t>(E * chunks * part_size));

  at::parallel_for(0, E * chunks, grain_for(std::min(N, chunk_rows) * row_work), [&](int64_t t0, int64_t t1) {
    std::vector<T> sx(MUL && compute_grad_x ? I : 0);
    // Output gradients of a chunk, (rows, O), in one vectorised pass before its rows.
    const size_t chunk_out = static_cast<size_t>(std::min(N, chunk_rows) * O);
    std::vector<T> da_c(ADD ? chunk_out : 0), du_c(MUL ? chunk_out : 0), dz_c(GATE != Gate::kNone ? chunk_out : 0);
    // The weight gradients take kGroup rows in one pass (one load and store of the partial sums
    // per kGroup rows instead of per row).
    constexpr int kGroup = 4;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / chunks, c = t % chunks;
      T* part = partials.data() + t * part_size;
      std::fill(part, part + part_size, T(0));
      T* pW = part;
      T* pWm = sep ? part + OI : part;
      T* pG = part + gate_off;
      const T* w = compute_grad_x ? p.W + e * OI : nullptr;
      const T* wm = compute_grad_x ? p.Wm + e * OI : nullptr;
      const T* gt = kGateIn && compute_grad_x ? p.G + e * OI : nullptr;
      const int64_t nb = c * chunk_rows, n1 = std::min(N, (c + 1) * chunk_rows);
      {
        const int64_t o0 = (e * N + nb) * O, count = (n1 - nb) * O;
        T* dap = da_c.data();
        T* dup = du_c.data();
        T* dzp = dz_c.data();
#pragma omp simd
        for (int64_t q = 0; q < count; ++q) {
          const int64_t o = o0 + q;
          T dav = 0, duv = 0, dzv = 0;
          output_grads<T, ADD, MUL>(dy[o], ADD && MUL ? sv.a[o] : T(0), MUL ? sv.m[o] : T(0),
                                    gate_at<T, GATE>(sv.g, o, NO, O), &dav, &duv, &dzv);
          if constexpr (ADD) dap[q] = dav;
          if constexpr (MUL) dup[q] = duv;
          if constexpr (GATE != Gate::kNone) dzp[q] = dzv;
        }
      }
      // Output gradient `vec` of the chunk's row n, output j.
      auto og = [&](const std::vector<T>& vec, int64_t n, int64_t j) { return vec.empty() ? T(0) : vec[(n - nb) * O + j]; };

      // Rows n0 .. n0 + R - 1 into the partial weight gradients.
      auto accumulate = [&]<int R>(int64_t n0) {
        const T* xs[R];
        const T* ls[R];
        for (int k = 0; k < R; ++k) {
          xs[k] = p.x + (e * N + n0 + k) * I;
          ls[k] = MUL ? sv.lx + (e * N + n0 + k) * I : nullptr;
        }
        for (int64_t j = 0; j < O; ++j) {
          T ca[R], cu[R], cz[R];
          for (int k = 0; k < R; ++k) {
            ca[k] = og(da_c, n0 + k, j);
            cu[k] = og(du_c, n0 + k, j);
            cz[k] = og(dz_c, n0 + k, j);
          }
          T* gw = pW + j * I;
          T* gwm = pWm + j * I;
          T* gg = kGateIn ? pG + j * I : nullptr;
          if (sep) {
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) {
              gw[i] += group_dot<R>(xs, ca, i);
              gwm[i] += group_dot<R>(ls, cu, i);
              if constexpr (kGateIn) gg[i] += group_dot<R>(xs, cz, i);
            }
          } else {
#pragma omp simd
            for (int64_t i = 0; i < I; ++i) {
              T v;
              if constexpr (ADD && MUL) {
                v = group_dot<R>(xs, ca, i) + group_dot<R>(ls, cu, i);
              } else if constexpr (ADD) {
                v = group_dot<R>(xs, ca, i);
              } else {
                v = group_dot<R>(ls, cu, i);
              }
              gw[i] += v;
              if constexpr (kGateIn) gg[i] += group_dot<R>(xs, cz, i);
            }
          }
          if constexpr (GATE == Gate::kIndependent) {
            for (int k = 0; k < R; ++k) pG[j] += cz[k];
          }
        }
      };

      for (int64_t g0 = nb; g0 < n1; g0 += kGroup) {
        const int rows = static_cast<int>(std::min<int64_t>(kGroup, n1 - g0));
        if (compute_grad_x) {
          for (int k = 0; k < rows; ++k) {
            const int64_t n = g0 + k, r = e * N + n;
            const T* xr = p.x + r * I;
            T* dxr = out.dx + r * I;
            T* sg = sx.data();
            if constexpr (MUL) {
#pragma omp simd
              for (int64_t i = 0; i < I; ++i) sg[i] = nm::log_abs_grad(xr[i], eps);
            }
            // One vectorised pass over the row per output (O is small; the row stays in L1).
            std::fill(dxr, dxr + I, T(0));
            for (int64_t j = 0; j < O; ++j) {
              const T* wj = w + j * I;
              const T* wmj = wm + j * I;
              const T* gj = kGateIn ? gt + j * I : nullptr;
              const T daj = og(da_c, n, j), duj = og(du_c, n, j), dzj = og(dz_c, n, j);
#pragma omp simd
              for (int64_t i = 0; i < I; ++i) {
                T v = 0;
                if constexpr (ADD) v += daj * wj[i];
                if constexpr (kGateIn) v += dzj * gj[i];
                if constexpr (MUL) v += sg[i] * duj * wmj[i];
                dxr[i] += v;
              }
            }
          }
        }
        if (rows == kGroup) {
          accumulate.template operator()<kGroup>(g0);
        } else {
          for (int k = 0; k < rows; ++k) accumulate.template operator()<1>(g0 + k);
        }
      }
    }
  });

  sum_partials<T, GATE>(s, sep, chunks, part_size, partials, out);
}

// ---------------------------------------------------------------------------------------------
// Narrow path (rowwise layers with at most kNarrowMaxIn inputs, e.g. the second layer of the
// paper's models, 2 -> 1). A dot product over so few inputs is all loop overhead, so the rows go
// across the vector lanes instead: a block of up to kNarrowRows rows of one member is transposed
// to (I, rows) scratch, every output is a short sum of multiply-adds vectorised over the rows,
// and results go back row by row. Blocks start at multiples of kNarrowRows of the member's rows:
// fixed by the shape, never by the thread count.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kNarrowMaxIn = 8;
constexpr int64_t kNarrowRows = 64;

bool narrow(const LayerShape& s) { return rowwise(s) && s.I <= kNarrowMaxIn; }

// Between rows (R x K, row-major) and columns (K x kNarrowRows). With K known at compile time the
// compiler turns the interleaved accesses into vector shuffles; most layers here have K <= 4.
template <bool TO_COLUMNS, typename T, int64_t K>
inline void move_block_k(const T* src, T* dst, int64_t R) {
#pragma omp simd
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < K; ++i) {
      if constexpr (TO_COLUMNS) {
        dst[i * kNarrowRows + r] = src[r * K + i];
      } else {
        dst[r * K + i] = src[i * kNarrowRows + r];
      }
    }
  }
}

template <bool TO_COLUMNS, typename T>
inline void move_block(const T* src, T* dst, int64_t R, int64_t K) {
  switch (K) {
    case 1: return move_block_k<TO_COLUMNS, T, 1>(src, dst, R);
    case 2: return move_block_k<TO_COLUMNS, T, 2>(src, dst, R);
    case 3: return move_block_k<TO_COLUMNS, T, 3>(src, dst, R);
    case 4: return move_block_k<TO_COLUMNS, T, 4>(src, dst, R);
    default:
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t i = 0; i < K; ++i) {
          if constexpr (TO_COLUMNS) {
            dst[i * kNarrowRows + r] = src[r * K + i];
          } else {
            dst[r * K + i] = src[i * kNarrowRows + r];
          }
        }
      }
  }
}

// dst[i * kNarrowRows + r] = src[r * K + i] for the block's R rows, and back.
template <typename T>
inline void to_columns(const T* src, T* dst, int64_t R, int64_t K) {
  move_block<true>(src, dst, R, K);
}

template <typename T>
inline void from_columns(const T* src, T* dst, int64_t R, int64_t K) {
  move_block<false>(src, dst, R, K);
}

template <typename T, bool ADD, bool MUL, Gate GATE>
void narrow_forward(const LayerShape& s, const Ptrs<T>& p, T eps, const OutPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, N = s.N;
  const int64_t blocks = (N + kNarrowRows - 1) / kNarrowRows;
  constexpr bool kNalu = ADD && MUL;
  at::parallel_for(0, s.E * blocks, grain_for(kNarrowRows * I * (O + 1) * 3), [&](int64_t t0, int64_t t1) {
    alignas(64) T xt[kNarrowMaxIn * kNarrowRows];
    alignas(64) T lt[MUL ? kNarrowMaxIn * kNarrowRows : 1];
    // Outputs by column, (O, rows): y, and for NALU a, m and an input gate's g.
    alignas(64) T yc[kRowwiseMaxOut * kNarrowRows];
    alignas(64) T ac[ADD && MUL ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T mc[ADD && MUL ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T gc[GATE == Gate::kInput ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T acc_a[kNarrowRows], acc_u[kNarrowRows], acc_z[kNarrowRows];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, n0 = (t % blocks) * kNarrowRows;
      const int64_t R = std::min(kNarrowRows, N - n0);
      const int64_t r0 = e * N + n0;  // flat index of the block's first row
      to_columns(p.x + r0 * I, xt, R, I);
      if constexpr (MUL) {
        for (int64_t i = 0; i < I; ++i) log_abs_run(xt + i * kNarrowRows, lt + i * kNarrowRows, R, eps);
        from_columns(lt, out.lx + r0 * I, R, I);
      }
      for (int64_t j = 0; j < O; ++j) {
        const T* wj = p.W + (e * O + j) * I;
        const T* wmj = p.Wm + (e * O + j) * I;
        const T* gj = GATE == Gate::kInput ? p.G + (e * O + j) * I : nullptr;
        std::fill(acc_a, acc_a + R, T(0));
        std::fill(acc_u, acc_u + R, T(0));
        std::fill(acc_z, acc_z + R, T(0));
        for (int64_t i = 0; i < I; ++i) {
          const T* xi = xt + i * kNarrowRows;
          const T* li = lt + i * kNarrowRows;
          const T wv = ADD ? wj[i] : T(0), wmv = MUL ? wmj[i] : T(0), gv = GATE == Gate::kInput ? gj[i] : T(0);
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) {
            if constexpr (ADD) acc_a[r] += xi[r] * wv;
            if constexpr (MUL) acc_u[r] += li[r] * wmv;
            if constexpr (GATE == Gate::kInput) acc_z[r] += xi[r] * gv;
          }
        }
        T* ycj = yc + j * kNarrowRows;
        if constexpr (kNalu) {
          T* acj = ac + j * kNarrowRows;
          T* mcj = mc + j * kNarrowRows;
          T* gcj = GATE == Gate::kInput ? gc + j * kNarrowRows : nullptr;
          const T gind = GATE == Gate::kIndependent ? p.gind[e * O + j] : T(0);
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) {
            const T mv = nm::exp_(acc_u[r]);
            T gv = gind;
            if constexpr (GATE == Gate::kInput) {
              gv = nm::sigmoid(acc_z[r]);
              gcj[r] = gv;
            }
            acj[r] = acc_a[r];
            mcj[r] = mv;
            ycj[r] = nm::blend(acc_a[r], mv, gv);
          }
        } else if constexpr (ADD) {
          std::copy(acc_a, acc_a + R, ycj);
        } else {
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) ycj[r] = nm::exp_(acc_u[r]);
        }
      }
      from_columns(yc, out.y + r0 * O, R, O);
      if constexpr (kNalu) {
        from_columns(ac, out.a + r0 * O, R, O);
        from_columns(mc, out.m + r0 * O, R, O);
        if constexpr (GATE == Gate::kInput) from_columns(gc, out.g + r0 * O, R, O);
      }
    }
  });
}

template <typename T, bool ADD, bool MUL, Gate GATE>
void narrow_backward(const LayerShape& s, bool sep, const Ptrs<T>& p, const SavedPtrs<T>& sv, const T* dy, T eps,
                     bool compute_grad_x, const GradPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, N = s.N, E = s.E, OI = O * I;
  const int64_t blocks = (N + kNarrowRows - 1) / kNarrowRows;
  constexpr bool kGateIn = GATE == Gate::kInput;
  constexpr bool kNalu = ADD && MUL;
  const int64_t gate_off = OI * (sep ? 2 : 1);
  const int64_t part_size = gate_off + (kGateIn ? OI : (GATE == Gate::kIndependent ? O : 0));
  // One partial weight-gradient sum per block, added in block order by sum_partials.
  std::vector<T> partials(static_cast<size_t>(E * blocks * part_size));
  at::parallel_for(0, E * blocks, grain_for(kNarrowRows * I * (O + 1) * 3), [&](int64_t t0, int64_t t1) {
    alignas(64) T xt[kNarrowMaxIn * kNarrowRows];
    alignas(64) T lt[MUL ? kNarrowMaxIn * kNarrowRows : 1];
    alignas(64) T dxt[kNarrowMaxIn * kNarrowRows];
    alignas(64) T sg[MUL ? kNarrowRows : 1];
    // Saved values and output gradients by column, (O, rows).
    alignas(64) T dyc[kRowwiseMaxOut * kNarrowRows];
    alignas(64) T ac[ADD && MUL ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T mc[MUL ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T gc[GATE == Gate::kInput ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T da[ADD ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T du[MUL ? kRowwiseMaxOut * kNarrowRows : 1];
    alignas(64) T dz[GATE != Gate::kNone ? kRowwiseMaxOut * kNarrowRows : 1];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, n0 = (t % blocks) * kNarrowRows;
      const int64_t R = std::min(kNarrowRows, N - n0);
      const int64_t r0 = e * N + n0;
      T* part = partials.data() + t * part_size;
      to_columns(p.x + r0 * I, xt, R, I);
      if constexpr (MUL) to_columns(sv.lx + r0 * I, lt, R, I);
      to_columns(dy + r0 * O, dyc, R, O);
      if constexpr (kNalu) to_columns(sv.a + r0 * O, ac, R, O);
      if constexpr (MUL) to_columns(sv.m + r0 * O, mc, R, O);
      if constexpr (kGateIn) to_columns(sv.g + r0 * O, gc, R, O);
      // Output gradients.
      for (int64_t j = 0; j < O; ++j) {
        const int64_t c = j * kNarrowRows;
        const T gind = GATE == Gate::kIndependent ? sv.g[e * O + j] : T(0);
#pragma omp simd
        for (int64_t r = 0; r < R; ++r) {
          T dav = 0, duv = 0, dzv = 0;
          output_grads<T, ADD, MUL>(dyc[c + r], kNalu ? ac[c + r] : T(0), MUL ? mc[c + r] : T(0),
                                    kGateIn ? gc[c + r] : gind, &dav, &duv, &dzv);
          if constexpr (ADD) da[c + r] = dav;
          if constexpr (MUL) du[c + r] = duv;
          if constexpr (GATE != Gate::kNone) dz[c + r] = dzv;
        }
      }
      // The block's weight gradients: sums over its rows.
      T* pW = part;
      T* pWm = sep ? part + OI : part;
      T* pG = part + gate_off;
      for (int64_t j = 0; j < O; ++j) {
        const T* daj = da + j * kNarrowRows;
        const T* duj = du + j * kNarrowRows;
        const T* dzj = dz + j * kNarrowRows;
        for (int64_t i = 0; i < I; ++i) {
          const T* xi = xt + i * kNarrowRows;
          const T* li = lt + i * kNarrowRows;
          T v = 0, vm = 0, vg = 0;
          if (sep) {
#pragma omp simd reduction(+ : v, vm, vg)
            for (int64_t r = 0; r < R; ++r) {
              v += xi[r] * daj[r];
              vm += li[r] * duj[r];
              if constexpr (kGateIn) vg += xi[r] * dzj[r];
            }
          } else {
#pragma omp simd reduction(+ : v, vg)
            for (int64_t r = 0; r < R; ++r) {
              if constexpr (ADD) v += xi[r] * daj[r];
              if constexpr (MUL) v += li[r] * duj[r];
              if constexpr (kGateIn) vg += xi[r] * dzj[r];
            }
          }
          pW[j * I + i] = v;
          if (sep) pWm[j * I + i] = vm;
          if constexpr (kGateIn) pG[j * I + i] = vg;
        }
        if constexpr (GATE == Gate::kIndependent) {
          T v = 0;
#pragma omp simd reduction(+ : v)
          for (int64_t r = 0; r < R; ++r) v += dzj[r];
          pG[j] = v;
        }
      }
      if (!compute_grad_x) continue;
      // dx = sum_j (da W + dz G + du W_m sign(x) / (|x| + eps)), by column, then back to rows.
      for (int64_t i = 0; i < I; ++i) {
        const T* xi = xt + i * kNarrowRows;
        T* di = dxt + i * kNarrowRows;
        std::fill(di, di + R, T(0));
        if constexpr (MUL) {
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) sg[r] = nm::log_abs_grad(xi[r], eps);
        }
        for (int64_t j = 0; j < O; ++j) {
          const int64_t c = j * kNarrowRows;
          const T wv = ADD ? p.W[e * OI + j * I + i] : T(0);
          const T wmv = MUL ? p.Wm[e * OI + j * I + i] : T(0);
          const T gv = kGateIn ? p.G[e * OI + j * I + i] : T(0);
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) {
            T v = 0;
            if constexpr (ADD) v += da[c + r] * wv;
            if constexpr (kGateIn) v += dz[c + r] * gv;
            if constexpr (MUL) v += sg[r] * du[c + r] * wmv;
            di[r] += v;
          }
        }
      }
      from_columns(dxt, out.dx + r0 * I, R, I);
    }
  });
  sum_partials<T, GATE>(s, sep, blocks, part_size, partials, out);
}

// ---------------------------------------------------------------------------------------------
// Tensor-level drivers
// ---------------------------------------------------------------------------------------------

// The constructed weights of a blas-path call, (E, I, O) tensors (bmm needs tensors), and
// sigmoid(G) for an independent gate.
struct BlasWeights {
  at::Tensor W, Wm, G, gind;
};

BlasWeights blas_weights(const LayerKind& kind, const LayerShape& s, const LayerParams& p) {
  const bool sep = kind.add && kind.mul && !kind.tied;
  auto opts = p.W_hat.options();
  BlasWeights b;
  dispatch_float(p.W_hat.scalar_type(), [&]<typename T>() {
    auto build = [&](const at::Tensor& wh, const at::Tensor& mh) {
      at::Tensor w = at::empty({s.E, s.I, s.O}, opts);
      build_weight<T>(wh.contiguous().const_data_ptr<T>(), mh.contiguous().const_data_ptr<T>(), w.data_ptr<T>(),
                      w.numel());
      return w;
    };
    b.W = build(p.W_hat, p.M_hat);
    b.Wm = sep ? build(p.W_hat_m, p.M_hat_m) : b.W;
    if (kind.gate == Gate::kInput) b.G = p.G.contiguous().view({s.E, s.I, s.O});
    if (kind.gate == Gate::kIndependent) {
      b.gind = at::empty(p.G.sizes(), opts);
      const at::Tensor gc = p.G.contiguous();  // owns the data gp points to
      const T* gp = gc.const_data_ptr<T>();
      T* out = b.gind.data_ptr<T>();
      for (int64_t k = 0; k < s.E * s.O; ++k) out[k] = nm::sigmoid(gp[k]);
    }
  });
  return b;
}

// The constructed weights of a rowwise-path call, transposed to (E, O, I), in one scratch buffer
// (no tensor allocations: at the paper's sizes they would cost more than the math).
template <typename T>
struct RowwiseWeights {
  std::vector<T> buf;
  Ptrs<T> ptrs;
};

// Backward needs the weights themselves only for the x-gradient (`matrices` false: no W, W_m, G,
// only an independent gate's sigmoid).
template <typename T>
RowwiseWeights<T> rowwise_weights(const LayerKind& kind, const LayerShape& s, const LayerParams& p, const T* x,
                                  bool matrices = true) {
  const bool sep = kind.add && kind.mul && !kind.tied;
  const int64_t n = s.E * s.I * s.O;
  const int64_t mats = 1 + (sep ? 1 : 0) + (kind.gate == Gate::kInput ? 1 : 0);
  RowwiseWeights<T> r;
  r.buf.resize(static_cast<size_t>(n * (mats + 1) + s.E * s.O));
  T* tmp = r.buf.data() + n * mats;  // (E, I, O) before transposing
  T* next = r.buf.data();
  auto build_t = [&](const at::Tensor& wh, const at::Tensor& mh) {
    build_weight<T>(wh.contiguous().const_data_ptr<T>(), mh.contiguous().const_data_ptr<T>(), tmp, n);
    transpose_last2<T>(tmp, next, s.E, s.I, s.O);
    next += n;
    return next - n;
  };
  r.ptrs.x = x;
  if (matrices) {
    r.ptrs.W = build_t(p.W_hat, p.M_hat);
    r.ptrs.Wm = sep ? build_t(p.W_hat_m, p.M_hat_m) : r.ptrs.W;
  }
  if (kind.gate == Gate::kInput && matrices) {
    transpose_last2<T>(p.G.contiguous().const_data_ptr<T>(), next, s.E, s.I, s.O);
    r.ptrs.G = next;
  } else if (kind.gate == Gate::kIndependent) {
    T* g = tmp + n;
    const at::Tensor gc = p.G.contiguous();  // owns the data gp points to
    const T* gp = gc.const_data_ptr<T>();
    for (int64_t k = 0; k < s.E * s.O; ++k) g[k] = nm::sigmoid(gp[k]);
    r.ptrs.gind = g;
  }
  return r;
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

template <typename T>
const T* cptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// blas path, forward: products by bmm, then one fused epilogue (exp, sigmoid, blend). The
// outputs have the caller's shapes; bmm writes them through (E, N, O) / (E, N, I) views.
template <typename T>
void blas_forward(const LayerKind& kind, const LayerShape& s, const at::Tensor& x3, const BlasWeights& b, T eps,
                  Forward& f) {
  const int64_t count = s.E * s.N * s.O;
  at::Tensor y3 = f.y.view({s.E, s.N, s.O});
  at::Tensor lx3 = kind.mul ? f.lx.view({s.E, s.N, s.I}) : at::Tensor();
  if (kind.mul) {
    const T* x = x3.const_data_ptr<T>();
    T* lx = f.lx.data_ptr<T>();
    at::parallel_for(0, x3.numel(), grain_for(32), [=](int64_t k0, int64_t k1) {
      log_abs_run(x + k0, lx + k0, k1 - k0, eps);
    });
  }
  if (!kind.mul) {  // NAC+
    at::bmm_out(y3, x3, b.W);
    return;
  }
  if (!kind.add) {  // NAC*
    at::bmm_out(y3, lx3, b.W);
    T* y = f.y.data_ptr<T>();
    parallel_simd(count, 32, [=](int64_t k) { y[k] = nm::exp_(y[k]); });
    return;
  }
  at::Tensor a3 = f.a.view({s.E, s.N, s.O});
  at::Tensor u3 = f.m.view({s.E, s.N, s.O});  // u, exponentiated below
  at::bmm_out(a3, x3, b.W);
  at::bmm_out(u3, lx3, b.Wm);
  if (kind.gate == Gate::kInput) {
    at::Tensor z3 = f.g.view({s.E, s.N, s.O});  // z, squashed below
    at::bmm_out(z3, x3, b.G);
  }
  const T* a = f.a.const_data_ptr<T>();
  T* m = f.m.data_ptr<T>();
  T* y = f.y.data_ptr<T>();
  const int64_t O = s.O, NO = s.N * s.O;
  if (kind.gate == Gate::kInput) {
    T* g = f.g.data_ptr<T>();
    at::parallel_for(0, count, grain_for(64), [=](int64_t k0, int64_t k1) {
      nalu_epilogue<T, true>(a, m, g, y, nullptr, k0, k1, NO, O);
    });
  } else {
    const T* gind = b.gind.const_data_ptr<T>();
    at::parallel_for(0, count, grain_for(32), [=](int64_t k0, int64_t k1) {
      nalu_epilogue<T, false>(a, m, nullptr, y, gind, k0, k1, NO, O);
    });
  }
}

// blas path, backward. The output gradients du, da, dz go in turn through one (E, N, O) buffer
// (a fused pass each, cheap next to the products), each followed by its products; dx is built in
// place: (du W_m^T) sign(x) / (|x| + eps), + da W^T, + dz G^T. So the only batch-sized scratch is
// that one buffer (three buffers and a (E, N, I) product before: issue 11's memory item).
// dW, dWm: gradients w.r.t. W, W_m, (E, I, O); dG: w.r.t. G in G's shape; dx in x's shape.
template <typename T>
void blas_backward(const LayerKind& kind, const LayerShape& s, bool sep, const at::Tensor& x3, const at::Tensor& dy,
                   const BlasWeights& b, const SavedPtrs<T>& sv, const at::Tensor& lx, T eps, at::Tensor dx,
                   at::Tensor dW, at::Tensor dWm, at::Tensor dG) {
  enum Which { kDa, kDu, kDz };
  const int64_t O = s.O, NO = s.N * s.O, count = s.E * NO;
  at::Tensor d = at::empty({s.E, s.N, s.O}, x3.options());
  T* dp = d.data_ptr<T>();
  const T* dyp = dy.const_data_ptr<T>();
  auto fill = [&](Which which) {
    dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
      parallel_simd(count, 16, [=](int64_t k) {
        T dav = 0, duv = 0, dzv = 0;
        output_grads<T, ADD, MUL>(dyp[k], ADD && MUL ? sv.a[k] : T(0), MUL ? sv.m[k] : T(0),
                                  gate_at<T, GATE>(sv.g, k, NO, O), &dav, &duv, &dzv);
        dp[k] = which == kDa ? dav : (which == kDu ? duv : dzv);
      });
    });
  };
  const at::Tensor xt = x3.transpose(1, 2);
  at::Tensor dx3 = dx.defined() ? dx.view({s.E, s.N, s.I}) : at::Tensor();
  if (kind.mul) {
    fill(kDu);
    const at::Tensor lxt = lx.view({s.E, s.N, s.I}).transpose(1, 2);
    at::bmm_out(sep ? dWm : dW, lxt, d);
    if (dx.defined()) {
      at::bmm_out(dx3, d, b.Wm.transpose(1, 2));
      const T* xp = x3.const_data_ptr<T>();
      T* dxp = dx.data_ptr<T>();
      parallel_simd(dx.numel(), 8, [=](int64_t k) { dxp[k] *= nm::log_abs_grad(xp[k], eps); });
    }
  }
  if (kind.add) {
    fill(kDa);
    if (kind.mul && !sep) {
      dW.baddbmm_(xt, d);
    } else {
      at::bmm_out(dW, xt, d);
    }
    if (dx.defined()) {
      if (kind.mul) {
        dx3.baddbmm_(d, b.W.transpose(1, 2));
      } else {
        at::bmm_out(dx3, d, b.W.transpose(1, 2));
      }
    }
  }
  if (kind.gate != Gate::kNone) {
    fill(kDz);
    if (kind.gate == Gate::kInput) {
      at::Tensor dG3 = dG.view({s.E, s.I, s.O});
      at::bmm_out(dG3, xt, d);
      if (dx.defined()) dx3.baddbmm_(d, b.G.transpose(1, 2));
    } else {
      at::Tensor dG2 = dG.view({s.E, s.O});
      at::sum_out(dG2, d, {1});
    }
  }
}

// grad_W_hat, grad_M_hat from dW (E, I, O), through the weight construction.
template <typename T>
void weight_backward_into(const T* dW, const at::Tensor& W_hat, const at::Tensor& M_hat, at::Tensor& gw,
                          at::Tensor& gm) {
  gw = at::empty(W_hat.sizes(), W_hat.options());
  gm = at::empty(W_hat.sizes(), W_hat.options());
  weight_backward_pass<T>(dW, W_hat.contiguous().const_data_ptr<T>(), M_hat.contiguous().const_data_ptr<T>(),
                          gw.data_ptr<T>(), gm.data_ptr<T>(), gw.numel());
}

}  // namespace

Forward layer_forward(const LayerKind& kind, const LayerShape& s, const at::Tensor& x, const LayerParams& p,
                      double eps) {
  const bool nalu = kind.add && kind.mul;
  const at::Tensor xc = x.contiguous();
  auto opts = x.options();
  // Outputs in the caller's shapes; kernels see them as contiguous (E, N, O) / (E, N, I).
  Forward f;
  f.y = at::empty(s.out_sizes, opts);
  if (kind.mul) f.lx = at::empty(x.sizes(), opts);
  if (nalu) {
    f.a = at::empty(s.out_sizes, opts);
    f.m = at::empty(s.out_sizes, opts);
    if (kind.gate == Gate::kInput) f.g = at::empty(s.out_sizes, opts);
  }
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    const T teps = static_cast<T>(eps);
    if (!rowwise(s)) {
      const BlasWeights b = blas_weights(kind, s, p);
      if (kind.gate == Gate::kIndependent) f.g = b.gind;
      blas_forward<T>(kind, s, xc.view({s.E, s.N, s.I}), b, teps, f);
      return;
    }
    const RowwiseWeights<T> w = rowwise_weights<T>(kind, s, p, xc.const_data_ptr<T>());
    if (kind.gate == Gate::kIndependent) {
      f.g = at::empty(p.G.sizes(), opts);
      std::copy(w.ptrs.gind, w.ptrs.gind + s.E * s.O, f.g.data_ptr<T>());
    }
    OutPtrs<T> out;
    out.y = f.y.data_ptr<T>();
    out.a = ptr_or_null<T>(f.a);
    out.m = ptr_or_null<T>(f.m);
    out.g = kind.gate == Gate::kInput ? f.g.data_ptr<T>() : nullptr;
    out.lx = ptr_or_null<T>(f.lx);
    dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
      if (narrow(s)) {
        narrow_forward<T, ADD, MUL, GATE>(s, w.ptrs, teps, out);
      } else {
        rowwise_forward<T, ADD, MUL, GATE>(s, w.ptrs, teps, out);
      }
    });
  });
  return f;
}

Backward layer_backward(const LayerKind& kind, const LayerShape& s, const at::Tensor& grad_y, const at::Tensor& x,
                        const LayerParams& p, const Forward& saved, double eps, bool compute_grad_x) {
  const bool nalu = kind.add && kind.mul;
  const bool sep = nalu && !kind.tied;
  auto opts = x.options();
  const at::Tensor xc = x.contiguous();
  const at::Tensor dy = grad_y.contiguous();
  const at::Tensor a = nalu ? saved.a.contiguous() : at::Tensor();
  const at::Tensor m = kind.mul ? saved.m.contiguous() : at::Tensor();
  const at::Tensor g = kind.gate != Gate::kNone ? saved.g.contiguous() : at::Tensor();
  const at::Tensor lx = kind.mul ? saved.lx.contiguous() : at::Tensor();
  Backward r;
  if (compute_grad_x) r.grad_x = at::empty(x.sizes(), opts);
  if (kind.gate != Gate::kNone) r.grad_G = at::empty(p.G.sizes(), opts);

  dispatch_float(x.scalar_type(), [&]<typename T>() {
    SavedPtrs<T> sv;
    sv.a = cptr_or_null<T>(a);
    sv.m = cptr_or_null<T>(m);
    sv.g = cptr_or_null<T>(g);
    sv.lx = cptr_or_null<T>(lx);
    const T teps = static_cast<T>(eps);
    // Gradients w.r.t. W (and W_m), (E, I, O), before the weight construction's backward.
    const int64_t n = s.E * s.I * s.O;
    std::vector<T> dW(static_cast<size_t>(n * (sep ? 2 : 1)));
    if (!rowwise(s)) {
      const BlasWeights b = blas_weights(kind, s, p);
      auto opts3 = at::TensorOptions().dtype(x.scalar_type());
      at::Tensor dW_t = at::from_blob(dW.data(), {s.E, s.I, s.O}, opts3);
      at::Tensor dWm_t = sep ? at::from_blob(dW.data() + n, {s.E, s.I, s.O}, opts3) : at::Tensor();
      blas_backward<T>(kind, s, sep, xc.view({s.E, s.N, s.I}), dy, b, sv, lx, teps, r.grad_x, dW_t, dWm_t,
                       r.grad_G);
    } else {
      const RowwiseWeights<T> w = rowwise_weights<T>(kind, s, p, xc.const_data_ptr<T>(), compute_grad_x);
      GradPtrs<T> gp;
      gp.dx = ptr_or_null<T>(r.grad_x);
      gp.dW = dW.data();
      gp.dWm = sep ? dW.data() + n : nullptr;
      gp.dG = ptr_or_null<T>(r.grad_G);
      const T* dyp = dy.const_data_ptr<T>();
      dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
        if (narrow(s)) {
          narrow_backward<T, ADD, MUL, GATE>(s, sep, w.ptrs, sv, dyp, teps, compute_grad_x, gp);
        } else {
          rowwise_backward<T, ADD, MUL, GATE>(s, sep, w.ptrs, sv, dyp, teps, compute_grad_x, gp);
        }
      });
    }
    weight_backward_into<T>(dW.data(), p.W_hat, p.M_hat, r.grad_W_hat, r.grad_M_hat);
    if (sep) weight_backward_into<T>(dW.data() + n, p.W_hat_m, p.M_hat_m, r.grad_W_hat_m, r.grad_M_hat_m);
  });
  return r;
}

at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat) {
  at::Tensor out = at::empty(W_hat.sizes(), W_hat.options());
  dispatch_float(W_hat.scalar_type(), [&]<typename T>() {
    build_weight<T>(W_hat.contiguous().const_data_ptr<T>(), M_hat.contiguous().const_data_ptr<T>(),
                    out.data_ptr<T>(), out.numel());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W, const at::Tensor& W_hat,
                                                   const at::Tensor& M_hat) {
  at::Tensor gw = at::empty(W_hat.sizes(), W_hat.options());
  at::Tensor gm = at::empty(W_hat.sizes(), W_hat.options());
  dispatch_float(W_hat.scalar_type(), [&]<typename T>() {
    weight_backward_pass<T>(grad_W.contiguous().const_data_ptr<T>(), W_hat.contiguous().const_data_ptr<T>(),
                            M_hat.contiguous().const_data_ptr<T>(), gw.data_ptr<T>(), gm.data_ptr<T>(), gw.numel());
  });
  return {gw, gm};
}

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
