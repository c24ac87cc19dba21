// lanes.h: the lanes variant of the rowwise path (at most kLanesMaxIn inputs, layer_types.h):
// rows across the vector lanes.
// Included by ops/nac_nalu/cpu/kernels_impl.h (once per instruction set, NALU_CPU_ISA defined); it includes
// nothing itself and opens its namespaces itself.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------------------
// Lanes variant (rowwise layers with at most kLanesMaxIn inputs, e.g. the second layer of the
// paper's models, 2 -> 1). A dot product over so few inputs is all loop overhead, so the rows go
// across the vector lanes instead: a block of up to kLanesRows rows of one member is transposed
// to (I, rows) scratch, every output is a short sum of multiply-adds vectorised over the rows,
// and results go back row by row. Blocks start at multiples of kLanesRows of the member's rows:
// fixed by the shape, never by the thread count.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kLanesRows = 64;

// Between rows (R x K, row-major) and columns (K x kLanesRows). K is a std::integral_constant
// (known at compile time: the compiler turns the interleaved accesses into vector shuffles; most
// layers here have K <= 4) or an int64_t.
template <bool TO_COLUMNS, typename T, typename KT>
inline void move_rows(const T* src, T* dst, int64_t R, KT K) {
#pragma omp simd
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < K; ++i) {
      if constexpr (TO_COLUMNS) {
        dst[i * kLanesRows + r] = src[r * K + i];
      } else {
        dst[r * K + i] = src[i * kLanesRows + r];
      }
    }
  }
}

template <bool TO_COLUMNS, typename T>
inline void move_block(const T* src, T* dst, int64_t R, int64_t K) {
  switch (K) {
    case 1: return move_rows<TO_COLUMNS>(src, dst, R, std::integral_constant<int64_t, 1>{});
    case 2: return move_rows<TO_COLUMNS>(src, dst, R, std::integral_constant<int64_t, 2>{});
    case 3: return move_rows<TO_COLUMNS>(src, dst, R, std::integral_constant<int64_t, 3>{});
    case 4: return move_rows<TO_COLUMNS>(src, dst, R, std::integral_constant<int64_t, 4>{});
    default: return move_rows<TO_COLUMNS>(src, dst, R, K);
  }
}

// dst[i * kLanesRows + r] = src[r * K + i] for the block's R rows, and back.
template <typename T>
inline void to_columns(const T* src, T* dst, int64_t R, int64_t K) {
  move_block<true>(src, dst, R, K);
}

template <typename T>
inline void from_columns(const T* src, T* dst, int64_t R, int64_t K) {
  move_block<false>(src, dst, R, K);
}

template <typename T, bool ADD, bool MUL, Gate GATE>
void lanes_forward(const LayerArgs& args, const LayerShape& s, const Ptrs<T>& p, const FwdOut<T*>& out) {
  const int64_t I = s.I, O = s.O, N = s.N;
  const T eps = static_cast<T>(args.eps);
  const int64_t blocks = (N + kLanesRows - 1) / kLanesRows;
  constexpr bool kNalu = ADD && MUL;
  at::parallel_for(0, s.E * blocks, grain_for(kLanesRows * I * (O + 1) * 3), [&](int64_t t0, int64_t t1) {
    alignas(64) T xt[kLanesMaxIn * kLanesRows];
    alignas(64) T lt[MUL ? kLanesMaxIn * kLanesRows : 1];
    // Outputs by column, (O, rows): y, and for NALU a, m and an input gate's g.
    alignas(64) T yc[kRowwiseMaxOut * kLanesRows];
    alignas(64) T ac[ADD && MUL ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T mc[ADD && MUL ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T gc[GATE == Gate::kInput ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T acc_a[kLanesRows], acc_u[kLanesRows], acc_z[kLanesRows];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, n0 = (t % blocks) * kLanesRows;
      const int64_t R = std::min(kLanesRows, N - n0);
      const int64_t r0 = e * N + n0;  // flat index of the block's first row
      to_columns(p.x + r0 * I, xt, R, I);
      if constexpr (MUL) {
        for (int64_t i = 0; i < I; ++i) log_abs_run(xt + i * kLanesRows, lt + i * kLanesRows, R, eps);
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
          const T* xi = xt + i * kLanesRows;
          const T* li = lt + i * kLanesRows;
          const T wv = ADD ? wj[i] : T(0), wmv = MUL ? wmj[i] : T(0), gv = GATE == Gate::kInput ? gj[i] : T(0);
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) {
            if constexpr (ADD) acc_a[r] += xi[r] * wv;
            if constexpr (MUL) acc_u[r] += li[r] * wmv;
            if constexpr (GATE == Gate::kInput) acc_z[r] += xi[r] * gv;
          }
        }
        T* ycj = yc + j * kLanesRows;
        if constexpr (kNalu) {
          T* acj = ac + j * kLanesRows;
          T* mcj = mc + j * kLanesRows;
          T* gcj = GATE == Gate::kInput ? gc + j * kLanesRows : nullptr;
          const T gind = GATE == Gate::kIndependent ? p.gind[e * O + j] : T(0);
          const T gb = GATE == Gate::kInput && p.Gb != nullptr ? p.Gb[e * O + j] : T(0);  // gate bias
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) {
            const T mv = nm::exp_(acc_u[r]);
            T gv = gind;
            if constexpr (GATE == Gate::kInput) {
              gv = nm::sigmoid(acc_z[r] + gb);
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
void lanes_backward(const LayerArgs& args, const LayerShape& s, const Ptrs<T>& p, const SavedPtrs<const T*>& sv,
                    const GradPtrs<T>& out) {
  const int64_t I = s.I, O = s.O, N = s.N, E = s.E, OI = O * I;
  const bool sep = args.kind.sep(), compute_grad_x = args.compute_grad_x;
  const T eps = static_cast<T>(args.eps);
  const T* dy = sv.dy;
  const int64_t blocks = (N + kLanesRows - 1) / kLanesRows;
  constexpr bool kGateIn = GATE == Gate::kInput;
  constexpr bool kNalu = ADD && MUL;
  const PartialLayout layout = partial_layout<GATE>(args.kind, s);
  const int64_t gate_off = layout.gate_off, part_size = layout.size;
  const bool bias = kGateIn && args.kind.gate_bias, parts = kNalu && sv.part_grads();
  // One partial weight-gradient sum per block, added in block order by sum_partials.
  std::vector<T> partials(static_cast<size_t>(E * blocks * part_size));
  at::parallel_for(0, E * blocks, grain_for(kLanesRows * I * (O + 1) * 3), [&](int64_t t0, int64_t t1) {
    alignas(64) T xt[kLanesMaxIn * kLanesRows];
    alignas(64) T lt[MUL ? kLanesMaxIn * kLanesRows : 1];
    alignas(64) T dxt[kLanesMaxIn * kLanesRows];
    alignas(64) T sg[MUL ? kLanesRows : 1];
    // Saved values and output gradients by column, (O, rows).
    alignas(64) T dyc[kRowwiseMaxOut * kLanesRows];
    alignas(64) T ac[ADD && MUL ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T mc[MUL ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T gc[GATE == Gate::kInput ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T da[ADD ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T du[MUL ? kRowwiseMaxOut * kLanesRows : 1];
    alignas(64) T dz[GATE != Gate::kNone ? kRowwiseMaxOut * kLanesRows : 1];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, n0 = (t % blocks) * kLanesRows;
      const int64_t R = std::min(kLanesRows, N - n0);
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
        const int64_t c = j * kLanesRows;
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
        if constexpr (kNalu) {
          if (parts) {
            for (int64_t r = 0; r < R; ++r) add_part_grads<T, GATE>(sv, (r0 + r) * O + j, da + c + r, du + c + r, dz + c + r);
          }
        }
      }
      // The block's weight gradients: sums over its rows.
      T* pW = part;
      T* pWm = sep ? part + OI : part;
      T* pG = part + gate_off;
      for (int64_t j = 0; j < O; ++j) {
        const T* daj = da + j * kLanesRows;
        const T* duj = du + j * kLanesRows;
        const T* dzj = dz + j * kLanesRows;
        for (int64_t i = 0; i < I; ++i) {
          const T* xi = xt + i * kLanesRows;
          const T* li = lt + i * kLanesRows;
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
        if (GATE == Gate::kIndependent || bias) {  // sum_n dz: G's (independent) or G_bias's gradient
          T v = 0;
#pragma omp simd reduction(+ : v)
          for (int64_t r = 0; r < R; ++r) v += dzj[r];
          part[GATE == Gate::kIndependent ? gate_off + j : layout.bias_off + j] = v;
        }
      }
      if (!compute_grad_x) continue;
      // dx = sum_j (da W + dz G + du W_m sign(x) / (|x| + eps)), by column, then back to rows.
      for (int64_t i = 0; i < I; ++i) {
        const T* xi = xt + i * kLanesRows;
        T* di = dxt + i * kLanesRows;
        std::fill(di, di + R, T(0));
        if constexpr (MUL) {
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) sg[r] = nm::log_abs_grad(xi[r], eps);
        }
        for (int64_t j = 0; j < O; ++j) {
          const int64_t c = j * kLanesRows;
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
  sum_partials<T, GATE>(s, sep, blocks, layout, partials, out);
}

}  // namespace

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
