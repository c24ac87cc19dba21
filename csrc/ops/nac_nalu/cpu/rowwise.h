// rowwise.h: the rowwise path (out <= kRowwiseMaxOut): forward (with the AVX2
// float dot products) and backward, one pass over the rows per direction.
// Included by ops/nac_nalu/cpu/kernels_impl.h (once per instruction set, NALU_CPU_ISA defined); it includes
// nothing itself and opens its namespaces itself.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------------------
// Rowwise path
// ---------------------------------------------------------------------------------------------

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
void rowwise_forward(const LayerArgs& args, const LayerShape& s, const Ptrs<T>& p, const FwdOut<T*>& out) {
  const int64_t I = s.I, O = s.O, N = s.N;
  const T eps = static_cast<T>(args.eps);
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
    // The products of row r, output j, go to the epilogue's inputs (z with the gate's bias gb,
    // member r's (O) or null); exp, sigmoid and the blend follow, vectorised over the chunk.
    auto store = [&](int64_t r, int64_t j, T acc_a, T acc_u, T acc_z, const T* gb) {
      const int64_t o = r * O + j;
      if constexpr (ADD && MUL) {
        out.a[o] = acc_a;
        out.m[o] = acc_u;
        if constexpr (GATE == Gate::kInput) out.g[o] = gb != nullptr ? acc_z + gb[j] : acc_z;
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
      const T* gb = GATE == Gate::kInput && p.Gb != nullptr ? p.Gb + e * O : nullptr;
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
            for (int k = 0; k < 4; ++k) store(r + k, j, av[k], uv[k], zv[k], gb);
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
          store(r, j, a0, u0, z0, gb);
          store(r + 1, j, a1, u1, z1, gb);
          store(r + 2, j, a2, u2, z2, gb);
          store(r + 3, j, a3, u3, z3, gb);
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
        store(r, j, acc_a, acc_u, acc_z, gb);
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
void rowwise_backward(const LayerArgs& args, const LayerShape& s, const Ptrs<T>& p, const SavedPtrs<const T*>& sv,
                      const GradPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, N = s.N, E = s.E, OI = O * I, NO = N * O;
  const bool sep = args.kind.sep(), compute_grad_x = args.compute_grad_x;
  const T eps = static_cast<T>(args.eps);
  const T* dy = sv.dy;
  const int64_t row_work = I * (O + 1) * 3;
  // Each member's rows fall in fixed chunks; a chunk's weight gradients go to its own partial sum.
  const int64_t chunk_rows = std::max<int64_t>(kMinChunkRows, (4 * kGrainWork + row_work - 1) / row_work);
  const int64_t chunks = std::max<int64_t>(1, (N + chunk_rows - 1) / chunk_rows);
  constexpr bool kGateIn = GATE == Gate::kInput;
  const PartialLayout layout = partial_layout<GATE>(args.kind, s);
  const int64_t gate_off = layout.gate_off, part_size = layout.size;
  const bool bias = kGateIn && args.kind.gate_bias, parts = ADD && MUL && sv.part_grads();
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
      T* pGb = part + layout.bias_off;
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
        if constexpr (ADD && MUL) {
          if (parts) {
            for (int64_t q = 0; q < count; ++q) add_part_grads<T, GATE>(sv, o0 + q, dap + q, dup + q, dzp + q);
          }
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
          if (bias) {
            for (int k = 0; k < R; ++k) pGb[j] += cz[k];
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

  sum_partials<T, GATE>(s, sep, chunks, layout, partials, out);
}

}  // namespace

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
