// nmu_kernels.h: the NMU's CPU kernels (the product units' fused forward and backward).
// Included by ops/nac_nalu/cpu/kernels_impl.h (once per instruction set, NALU_CPU_ISA defined); it includes
// nothing itself and opens its namespaces itself. The ops (checks, registration) are in
// csrc/ops/nau_nmu/cpu/nau_nmu_cpu.cpp.
//
// NMU, fused: y[e, n, o] = prod_i f(W[e, i, o], x[e, n, i]) with f = W x + 1 - W.
//   forward   one pass over the factors; nothing is saved beyond the inputs (the backward
//             recomputes the factors, which costs less than storing (E, N, I, O) of them).
//   backward  grad_x[n, i] = sum_o dy[n, o] W[i, o] E[n, i, o]
//             grad_W[i, o] = sum_n dy[n, o] (x[n, i] - 1) E[n, i, o]
//             with E the exclusive products (ops/nau_nmu/math.h: prefix times suffix, no division,
//             exact when a factor is zero).
// Memory: W transposed to (E, O, I) (so every product reads its weights contiguously), and per
// task O(I R) scratch; no (N, I, O) tensor. The work is split into tasks that each own their
// outputs: forward by blocks of R rows; the backward of an ensemble by member (one pass serving
// both gradients), of a single layer or a small ensemble by blocks of rows for grad_x and by
// (member, output) for grad_W, each summing its rows in order. So every result is the same for any
// number of threads (no cross-thread reductions), and the same under either backward schedule.
// Rows are handled R at a time, transposed into an (I, R) block, so that each step of a product
// is a vector operation over R independent rows.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

using at::Tensor;

// Exclusive products on the host, for R independent products at once (R rows of a batch, the
// lanes of the vector loops): calls visit(i, E) for i = 0..n-1 in order, E[r] = prod_{k < i}
// f(k, r) * prod_{k > i} f(k, r). `suffix` is scratch of (n + 1) R values. f(k, r) is evaluated
// twice (once per sweep), so it reads its inputs rather than needing (n, R) storage; the R
// products are independent, so each sweep is a vector loop over r. It lives here, not in
// ops/nau_nmu/math.h, so that it is compiled for this instruction set: a function compiled for the
// baseline cannot inline the AVX2 lambdas it is given, and would call them once per element.
template <int R, typename A, typename Factor, typename Visit>
inline void exclusive_products(int64_t n, A* suffix, Factor f, Visit visit) {
  for (int r = 0; r < R; ++r) suffix[n * R + r] = A(1);
  for (int64_t i = n - 1; i >= 0; --i) {
    A* s = suffix + i * R;
#pragma omp simd
    for (int r = 0; r < R; ++r) s[r] = s[R + r] * f(i, r);
  }
  A prefix[R], excl[R];
  for (int r = 0; r < R; ++r) prefix[r] = A(1);
  for (int64_t i = 0; i < n; ++i) {
    const A* s = suffix + (i + 1) * R;
#pragma omp simd
    for (int r = 0; r < R; ++r) excl[r] = prefix[r] * s[r];
    visit(i, excl);
#pragma omp simd
    for (int r = 0; r < R; ++r) prefix[r] = prefix[r] * f(i, r);
  }
}

constexpr int kRows = 16;                 // R: rows per block, the width of the vector loops
constexpr int64_t kMinWorkPerTask = 1 << 17;  // factor evaluations below which a task is not split off
constexpr int64_t kMembersForOnePass = 8;     // ensembles of at least this many members: one backward pass

int64_t grain(int64_t work_per_task) { return std::max<int64_t>(1, kMinWorkPerTask / std::max<int64_t>(1, work_per_task)); }

// Rows n0 .. n0 + nr (nr <= R) of x (N, I) into xt (I, R), padding with 0.
template <typename T>
void transpose_rows(const T* x, int64_t I, int64_t nr, T* xt) {
  for (int64_t i = 0; i < I; ++i) {
    for (int r = 0; r < kRows; ++r) xt[i * kRows + r] = r < nr ? x[r * I + i] : T(0);
  }
}

// The (E, N, I) / (E, I, O) / (E, O, I) raw views one NMU call needs.
struct NmuArgs {
  Tensor x, Wt;  // contiguous x (E, N, I), W transposed (E, O, I)
  int64_t E, N, I, O;
};

NmuArgs nmu_args(const LayerShape& s, const Tensor& x, const Tensor& W) {
  return {x.contiguous(), W.reshape({s.E, s.I, s.O}).transpose(1, 2).contiguous(), s.E, s.N, s.I, s.O};
}

template <typename T>
void nmu_forward_kernel(const NmuArgs& a, T* y) {
  const int64_t blocks = (a.N + kRows - 1) / kRows;
  const T* x = a.x.const_data_ptr<T>();
  const T* Wt = a.Wt.const_data_ptr<T>();
  at::parallel_for(0, a.E * blocks, grain(kRows * a.I * a.O), [&](int64_t t0, int64_t t1) {
    std::vector<T> xt(a.I * kRows);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, n0 = (t % blocks) * kRows, nr = std::min<int64_t>(kRows, a.N - n0);
      transpose_rows(x + (e * a.N + n0) * a.I, a.I, nr, xt.data());
      for (int64_t o = 0; o < a.O; ++o) {
        const T* w = Wt + (e * a.O + o) * a.I;
        T acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = T(1);
        for (int64_t i = 0; i < a.I; ++i) {
          const T wi = w[i];
          const T* xi = xt.data() + i * kRows;
#pragma omp simd
          for (int r = 0; r < kRows; ++r) acc[r] = acc[r] * nm::nmu_factor(wi, xi[r]);
        }
        for (int64_t r = 0; r < nr; ++r) y[(e * a.N + n0 + r) * a.O + o] = acc[r];
      }
    }
  });
}

// One block of R rows of member e against output o: the exclusive products of each row, and
// their contributions to grad_x (gxt (I, R)) and to grad_W's column o (gwl (I, R): per-lane sums
// over the blocks, of the nr real rows only, as a padded row's factors need not be finite), each
// when not null. Both backward schedules below call this and fold gwl the same way
// (fold_lanes), so they give the same bits.
template <typename T>
void nmu_backward_block(int64_t I, const T* w, const T* xt, const T* g, int64_t nr, T* suffix, T* gxt, T* gwl) {
  exclusive_products<kRows, T>(
      I, suffix, [&](int64_t i, int r) { return nm::nmu_factor(w[i], xt[i * kRows + r]); },
      [&](int64_t i, const T* excl) {
        if (gxt != nullptr) {
          const T d = nm::nmu_dfactor_dx(w[i], T(0));
#pragma omp simd
          for (int r = 0; r < kRows; ++r) gxt[i * kRows + r] += g[r] * d * excl[r];
        }
        if (gwl != nullptr) {
#pragma omp simd
          for (int r = 0; r < kRows; ++r) {
            gwl[i * kRows + r] += r < nr ? g[r] * nm::nmu_dfactor_dw(w[i], xt[i * kRows + r]) * excl[r] : T(0);
          }
        }
      });
}

// grad_W[e, :, o] = the sum of the lane sums gwl (I, R), lanes in order.
template <typename T>
void fold_lanes(const NmuArgs& a, const T* gwl, int64_t e, int64_t o, T* gW) {
  for (int64_t i = 0; i < a.I; ++i) {
    T sum = T(0);
    for (int r = 0; r < kRows; ++r) sum += gwl[i * kRows + r];
    gW[(e * a.I + i) * a.O + o] = sum;
  }
}

// dy of rows n0 .. n0 + nr for output o, padded with 0 to R.
template <typename T>
void load_dy(const NmuArgs& a, const T* dy, int64_t e, int64_t n0, int64_t nr, int64_t o, T* g) {
  for (int r = 0; r < kRows; ++r) g[r] = r < nr ? dy[(e * a.N + n0 + r) * a.O + o] : T(0);
}

template <typename T>
void store_gx(const NmuArgs& a, const T* gxt, int64_t e, int64_t n0, int64_t nr, T* gx) {
  for (int64_t r = 0; r < nr; ++r) {
    T* out = gx + (e * a.N + n0 + r) * a.I;
    for (int64_t i = 0; i < a.I; ++i) out[i] = gxt[i * kRows + r];
  }
}

// Backward, one task per ensemble member (used when there are enough members to share out): a
// member's row blocks in order, each block's exclusive products serving grad_x and grad_W.
template <typename T>
void nmu_backward_members(const NmuArgs& a, const T* dy, T* gx, T* gW) {
  const int64_t blocks = (a.N + kRows - 1) / kRows;
  const T* x = a.x.const_data_ptr<T>();
  const T* Wt = a.Wt.const_data_ptr<T>();
  at::parallel_for(0, a.E, grain(2 * a.N * a.I * a.O), [&](int64_t e0, int64_t e1) {
    std::vector<T> xt(a.I * kRows), gxt(a.I * kRows), gwl(a.O * a.I * kRows), suffix((a.I + 1) * kRows);
    for (int64_t e = e0; e < e1; ++e) {
      std::fill(gwl.begin(), gwl.end(), T(0));
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * kRows, nr = std::min<int64_t>(kRows, a.N - n0);
        transpose_rows(x + (e * a.N + n0) * a.I, a.I, nr, xt.data());
        std::fill(gxt.begin(), gxt.end(), T(0));
        for (int64_t o = 0; o < a.O; ++o) {
          T g[kRows];
          load_dy(a, dy, e, n0, nr, o, g);
          nmu_backward_block<T>(a.I, Wt + (e * a.O + o) * a.I, xt.data(), g, nr, suffix.data(),
                                gx != nullptr ? gxt.data() : nullptr, gwl.data() + o * a.I * kRows);
        }
        if (gx != nullptr) store_gx(a, gxt.data(), e, n0, nr, gx);
      }
      for (int64_t o = 0; o < a.O; ++o) fold_lanes(a, gwl.data() + o * a.I * kRows, e, o, gW);
    }
  });
}

// Backward for few members: grad_x by blocks of rows (all outputs), then grad_W by (member,
// output) over all rows in order. Every factor is evaluated twice as often as in
// nmu_backward_members, for the parallelism a single layer with many rows needs.
template <typename T>
void nmu_backward_split(const NmuArgs& a, const T* dy, T* gx, T* gW) {
  const int64_t blocks = (a.N + kRows - 1) / kRows;
  const T* x = a.x.const_data_ptr<T>();
  const T* Wt = a.Wt.const_data_ptr<T>();
  if (gx != nullptr) {
    at::parallel_for(0, a.E * blocks, grain(2 * kRows * a.I * a.O), [&](int64_t t0, int64_t t1) {
      std::vector<T> xt(a.I * kRows), gxt(a.I * kRows), suffix((a.I + 1) * kRows);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t e = t / blocks, n0 = (t % blocks) * kRows, nr = std::min<int64_t>(kRows, a.N - n0);
        transpose_rows(x + (e * a.N + n0) * a.I, a.I, nr, xt.data());
        std::fill(gxt.begin(), gxt.end(), T(0));
        for (int64_t o = 0; o < a.O; ++o) {
          T g[kRows];
          load_dy(a, dy, e, n0, nr, o, g);
          nmu_backward_block<T>(a.I, Wt + (e * a.O + o) * a.I, xt.data(), g, nr, suffix.data(), gxt.data(), nullptr);
        }
        store_gx(a, gxt.data(), e, n0, nr, gx);
      }
    });
  }
  at::parallel_for(0, a.E * a.O, grain(2 * a.N * a.I), [&](int64_t t0, int64_t t1) {
    std::vector<T> xt(a.I * kRows), gwl(a.I * kRows), suffix((a.I + 1) * kRows);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / a.O, o = t % a.O;
      std::fill(gwl.begin(), gwl.end(), T(0));
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * kRows, nr = std::min<int64_t>(kRows, a.N - n0);
        transpose_rows(x + (e * a.N + n0) * a.I, a.I, nr, xt.data());
        T g[kRows];
        load_dy(a, dy, e, n0, nr, o, g);
        nmu_backward_block<T>(a.I, Wt + (e * a.O + o) * a.I, xt.data(), g, nr, suffix.data(), nullptr, gwl.data());
      }
      fold_lanes(a, gwl.data(), e, o, gW);
    }
  });
}

}  // namespace

Tensor nmu_forward(const LayerShape& s, const Tensor& x, const Tensor& W) {
  const NmuArgs a = nmu_args(s, x, W);
  Tensor y = at::empty(s.out_sizes, x.options());
  dispatch_float(x.scalar_type(), [&]<typename T>() { nmu_forward_kernel<T>(a, y.data_ptr<T>()); });
  return y;
}

std::tuple<Tensor, Tensor> nmu_backward(const LayerShape& s, const Tensor& grad_y, const Tensor& x, const Tensor& W,
                                        bool compute_grad_x) {
  const NmuArgs a = nmu_args(s, x, W);
  const Tensor dy = grad_y.contiguous();
  Tensor gW = at::empty(W.sizes(), W.options());
  Tensor gx = compute_grad_x ? at::empty(x.sizes(), x.options()) : empty_grad(x);
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    const T* dyp = dy.const_data_ptr<T>();
    T* gxp = compute_grad_x ? gx.data_ptr<T>() : nullptr;
    // By shape alone (either schedule gives the same bits): a task per member once there are
    // enough members to keep every core busy, or when the whole call is one task's work anyway.
    if (s.E >= kMembersForOnePass || s.E * s.N * s.I * s.O <= kMinWorkPerTask) {
      nmu_backward_members<T>(a, dyp, gxp, gW.data_ptr<T>());
    } else {
      nmu_backward_split<T>(a, dyp, gxp, gW.data_ptr<T>());
    }
  });
  return {gx, gW};
}

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
