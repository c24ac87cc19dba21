// layer_kernels.h: one NAC, NALU, NAU or NMU layer of one member, forward and backward, for the
// native training steps (the static task's, ensemble_step.cpp; the recurrent task's,
// recurrent_step.cpp), and the MSE they both train on. Included by those files once per
// instruction set inside that set's namespace (base; avx2 and avx512 under their targets), after
// every header it needs (and step_common.h's Kind): so no include guard and no includes here.

// The wide loops of a layer run on lane vectors of kLanes elements (32 bytes: one AVX2 register,
// two SSE registers in the base build, half an AVX-512 register). Every sum has one fixed order,
// whatever the thread count and the instruction set: in row_dots, lane l of an accumulator takes
// the terms i = l (mod kLanes) in increasing i, the lanes are added 0 + 1 + ... in order, then the
// sum of the remainder columns (taken in increasing i); nalu_pair_dots takes the remainder in one
// more masked vector and adds the lanes as a tree (reduce_lanes); the column sums run over the rows
// in increasing order, one column per lane.
template <typename T>
struct LanesOf;
// (`unaligned`: the same vector at the element's alignment, read in place, as immintrin.h's __m256_u)
template <>
struct LanesOf<float> {
  typedef float type __attribute__((vector_size(32)));
  typedef float unaligned __attribute__((vector_size(32), aligned(4), may_alias));
};
template <>
struct LanesOf<double> {
  typedef double type __attribute__((vector_size(32)));
  typedef double unaligned __attribute__((vector_size(32), aligned(8), may_alias));
};
template <typename T>
using Lanes = typename LanesOf<T>::type;

template <typename T>
constexpr int64_t kLanes = static_cast<int64_t>(32 / sizeof(T));

// (an output argument, not a return value: the base build has no AVX, and a 32-byte vector
// returned there would change the ABI). One unaligned vector load, always inlined: a memcpy here
// was copied through the stack in 16-byte halves, which stalled every multiply on its operands'
// store forwarding and kept the accumulators in memory (RESULTS.md section 24).
template <typename T>
inline __attribute__((always_inline)) void load_lanes(Lanes<T>& v, const T* p) {
  v = *reinterpret_cast<const typename LanesOf<T>::unaligned*>(p);
}

template <typename T>
inline T add_lanes(const Lanes<T>& v) {
  T s = v[0];
  for (int64_t l = 1; l < kLanes<T>; ++l) s += v[l];
  return s;
}

// The column sums' vectors: one column per lane, each column's sum taken over the rows in order, so
// any width gives the same bits. NALU_STEP_COLUMN_BYTES (64 in the AVX-512 copy, set by
// step_kernels_per_isa.h; else 32, the lane vectors' width).
#ifndef NALU_STEP_COLUMN_BYTES
#define NALU_STEP_COLUMN_BYTES 32
#endif
template <typename T>
struct ColsOf {
  typedef T type __attribute__((vector_size(NALU_STEP_COLUMN_BYTES)));
  typedef T unaligned __attribute__((vector_size(NALU_STEP_COLUMN_BYTES), aligned(sizeof(T)), may_alias));
};
template <typename T>
using Cols = typename ColsOf<T>::type;
template <typename T>
constexpr int64_t kCols = static_cast<int64_t>(NALU_STEP_COLUMN_BYTES / sizeof(T));

template <typename T>
inline __attribute__((always_inline)) void load_cols(Cols<T>& v, const T* p) {
  v = *reinterpret_cast<const typename ColsOf<T>::unaligned*>(p);
}

// Row dot products, R rows and NP (matrix, vector) pairs per pass over the inputs:
// dots[p * B + b] = sum_i X[p][b * In + i] * V[p][i] for every row b < B.
template <typename T, int NP, int R>
void row_dots_block(const T* const* X, const T* const* V, int64_t b0, int64_t B, int64_t In, T* dots) {
  constexpr int64_t L = kLanes<T>;
  // zeroed element by element: an aggregate `= {}` became a `rep stos` of the whole array on the
  // stack in every call, about 7% of the NAC's forward (RESULTS.md section 24)
  Lanes<T> acc[R][NP];
  T tail[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) {
      acc[r][p] = Lanes<T>{};
      tail[r][p] = T(0);
    }
  int64_t i = 0;
  for (; i + L <= In; i += L) {
    Lanes<T> v[NP];
    for (int p = 0; p < NP; ++p) load_lanes(v[p], V[p] + i);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) {
        Lanes<T> x;
        load_lanes(x, X[p] + (b0 + r) * In + i);
        acc[r][p] += x * v[p];
      }
  }
  for (; i < In; ++i)
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) tail[r][p] += X[p][(b0 + r) * In + i] * V[p][i];
  // (a layer narrower than one lane vector has only the remainder sums: 0 + tail, the bits of
  // add_lanes of the untouched zero accumulators + tail, without their 7 additions each)
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) dots[p * B + b0 + r] = (In < L ? T(0) : add_lanes<T>(acc[r][p])) + tail[r][p];
}

// The sums of kLanes<T> lane vectors at once: out[k] = the sum of v[k]'s lanes, as the tree
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (float; double: (l0 + l1) + (l2 + l3)), by
// shuffles that add the vectors' lanes pairwise side by side: 7 additions and 14 shuffles for 8
// sums in float, where one sum at a time takes 7 additions and 7 lane extractions each.
#if defined(__clang__)
#define NALU_SHUFFLE(a, b, M, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define NALU_SHUFFLE(a, b, M, ...) __builtin_shuffle(a, b, M{__VA_ARGS__})
#endif
inline void reduce_lanes(const Lanes<float>* v, float* out) {
  typedef int32_t M __attribute__((vector_size(32)));
  Lanes<float> t[4], u[2];
  for (int k = 0; k < 4; ++k)
    t[k] = NALU_SHUFFLE(v[2 * k], v[2 * k + 1], M, 0, 8, 2, 10, 4, 12, 6, 14) +
           NALU_SHUFFLE(v[2 * k], v[2 * k + 1], M, 1, 9, 3, 11, 5, 13, 7, 15);
  for (int k = 0; k < 2; ++k)
    u[k] = NALU_SHUFFLE(t[2 * k], t[2 * k + 1], M, 0, 1, 8, 9, 4, 5, 12, 13) +
           NALU_SHUFFLE(t[2 * k], t[2 * k + 1], M, 2, 3, 10, 11, 6, 7, 14, 15);
  const Lanes<float> s = NALU_SHUFFLE(u[0], u[1], M, 0, 1, 2, 3, 8, 9, 10, 11) +
                         NALU_SHUFFLE(u[0], u[1], M, 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 8; ++k) out[k] = s[k];
}
inline void reduce_lanes(const Lanes<double>* v, double* out) {
  typedef int64_t M __attribute__((vector_size(32)));
  Lanes<double> t[2];
  for (int k = 0; k < 2; ++k)
    t[k] = NALU_SHUFFLE(v[2 * k], v[2 * k + 1], M, 0, 4, 2, 6) + NALU_SHUFFLE(v[2 * k], v[2 * k + 1], M, 1, 5, 3, 7);
  const Lanes<double> s = NALU_SHUFFLE(t[0], t[1], M, 0, 1, 4, 5) + NALU_SHUFFLE(t[0], t[1], M, 2, 3, 6, 7);
  for (int k = 0; k < 4; ++k) out[k] = s[k];
}
#undef NALU_SHUFFLE

// Integer lanes of the same width, for bit masks.
template <typename T>
struct LaneBitsOf;
template <>
struct LaneBitsOf<float> {
  typedef int32_t type __attribute__((vector_size(32)));
};
template <>
struct LaneBitsOf<double> {
  typedef int64_t type __attribute__((vector_size(32)));
};
template <typename T>
using LaneBits = typename LaneBitsOf<T>::type;

// A NALU's three sums for two outputs at once, one pass over the rows (In >= kLanes<T>): for every
// row b, q[k * B + b] for k = 0..5 = sum_i of u[b, i] W0[i], l[b, i] W0[i], u[b, i] G0[i], u[b, i] W1[i],
// l[b, i] W1[i], u[b, i] G1[i] (l: the logarithms of u). Two rows per pass, each input and logarithm
// vector loaded once for the six products (where one output per pass loaded them three times); the
// inputs in whole lane vectors, the last In mod kLanes in one more vector that ends at In, its lanes
// already counted masked to zero (bitwise: no 0 * inf); the lanes summed by reduce_lanes. One fixed
// order per sum, so the same bits on any thread and in every instruction set's copy.
template <typename T>
void nalu_pair_dots(const T* u, const T* l, const T* const* V, int64_t B, int64_t In, T* q) {
  constexpr int64_t L = kLanes<T>;
  constexpr int NP = 6;
  const int64_t full = In / L * L, rest = In - full;
  LaneBits<T> keep;
  for (int64_t k = 0; k < L; ++k) keep[k] = k >= L - rest ? -1 : 0;
  auto rows = [&](auto rows_per_pass, int64_t b0) {
    constexpr int R = decltype(rows_per_pass)::value;
    Lanes<T> acc[R * NP + L];  // (the reduction reads whole groups of L: the ones past R * NP stay zero)
    for (int k = 0; k < R * NP + L; ++k) acc[k] = Lanes<T>{};
    auto pass = [&](int64_t i, bool masked) {
      Lanes<T> w0, w1, g0, g1;
      load_lanes(w0, V[0] + i), load_lanes(w1, V[1] + i), load_lanes(g0, V[2] + i), load_lanes(g1, V[3] + i);
      for (int r = 0; r < R; ++r) {
        Lanes<T> xu, xl;
        load_lanes(xu, u + (b0 + r) * In + i);
        load_lanes(xl, l + (b0 + r) * In + i);
        if (masked) {
          xu = (Lanes<T>)((LaneBits<T>)xu & keep);
          xl = (Lanes<T>)((LaneBits<T>)xl & keep);
        }
        Lanes<T>* a = acc + r * NP;
        a[0] += xu * w0, a[1] += xl * w0, a[2] += xu * g0;
        a[3] += xu * w1, a[4] += xl * w1, a[5] += xu * g1;
      }
    };
    for (int64_t i = 0; i < full; i += L) pass(i, false);
    if (rest > 0) pass(In - L, true);
    T sums[R * NP + L];
    for (int k = 0; k < R * NP; k += L) reduce_lanes(acc + k, sums + k);
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < NP; ++k) q[k * B + b0 + r] = sums[r * NP + k];
  };
  int64_t b = 0;
  for (; b + 2 <= B; b += 2) rows(std::integral_constant<int, 2>{}, b);
  for (; b < B; ++b) rows(std::integral_constant<int, 1>{}, b);
}

template <typename T, int NP>
void row_dots(const T* const* X, const T* const* V, int64_t B, int64_t In, T* dots) {
  constexpr int R = NP <= 2 ? 4 : 2;
  int64_t b = 0;
  for (; b + R <= B; b += R) row_dots_block<T, NP, R>(X, V, b, B, In, dots);
  for (; b < B; ++b) row_dots_block<T, NP, 1>(X, V, b, B, In, dots);
}

// Column sums, NP (matrix, coefficient column) pairs per pass over the rows:
// G[into[p]][i] (+)= sum_b Y[p][b * In + i] * c[p][b * cs] for every column i < In, pairs with the
// same `into` added in pair order (the first one sets it).
template <typename T, int NP>
void col_sums(const T* const* Y, const T* const* c, int64_t cs, const int* into, int64_t B, int64_t In, T* const* G) {
  constexpr int64_t L = kCols<T>;
  auto store = [&](int p, int64_t i, T v) {
    bool first = true;
    for (int q = 0; q < p; ++q) first = first && into[q] != into[p];
    G[into[p]][i] = first ? v : G[into[p]][i] + v;
  };
  int64_t i = 0;
  for (; i + 2 * L <= In; i += 2 * L) {
    Cols<T> acc[NP][2];
    for (int p = 0; p < NP; ++p) acc[p][0] = acc[p][1] = Cols<T>{};
    for (int64_t b = 0; b < B; ++b)
      for (int p = 0; p < NP; ++p) {
        const T k = c[p][b * cs];
        Cols<T> y0, y1;
        load_cols(y0, Y[p] + b * In + i);
        load_cols(y1, Y[p] + b * In + i + L);
        acc[p][0] += y0 * k;
        acc[p][1] += y1 * k;
      }
    for (int p = 0; p < NP; ++p)
      for (int64_t l = 0; l < L; ++l) {
        store(p, i + l, acc[p][0][l]);
        store(p, i + L + l, acc[p][1][l]);
      }
  }
  // the columns left (fewer than 2 L: the narrow inputs of a recurrent cell are nothing else): one
  // block of L, then the rest side by side; every column's sum is over b in increasing order from
  // 0, as in the blocks above (the same bits whichever path a column takes)
  // (and where fewer than L columns are left of a row of at least L: the last L columns, of which
  // only the ones left are stored, the others were stored above with the same bits)
  auto block = [&](int64_t i0, int64_t from) {
    Cols<T> acc[NP];
    for (int p = 0; p < NP; ++p) acc[p] = Cols<T>{};
    for (int64_t b = 0; b < B; ++b)
      for (int p = 0; p < NP; ++p) {
        Cols<T> y;
        load_cols(y, Y[p] + b * In + i0);
        acc[p] += y * c[p][b * cs];
      }
    for (int p = 0; p < NP; ++p)
      for (int64_t l = from; l < L; ++l) store(p, i0 + l, acc[p][l]);
  };
  if (i + L <= In) {
    block(i, 0);
    i += L;
  }
  if (i < In && In >= L) {
    block(In - L, i - (In - L));
    return;
  }
  const int64_t r = In - i;
  T acc[NP][L] = {};
  for (int64_t b = 0; b < B && r > 0; ++b)
    for (int p = 0; p < NP; ++p) {
      const T k = c[p][b * cs], *y = Y[p] + b * In + i;
      for (int64_t j = 0; j < r; ++j) acc[p][j] += y[j] * k;
    }
  for (int64_t j = 0; j < r; ++j)
    for (int p = 0; p < NP; ++p) store(p, i + j, acc[p][j]);
}

// The NALU's weight gradients of two outputs at once (In >= kCols<T>), one pass over the rows:
// with (da, dm, dz) of output k in c[k][b * 3 + 0..2], G[2 k][i] = sum_b u[b, i] da + sum_b l[b, i] dm
// (dW) and G[2 k + 1][i] = sum_b u[b, i] dz (dG), each input and logarithm vector loaded once for
// the six products. Every column's sums run over b in increasing order from 0 and dW adds the two
// in that order, as col_sums<T, 3> does for one output with into = {0, 0, 1}: the same bits.
template <typename T>
void nalu_pair_col_sums(const T* u, const T* l, const T* const* c, int64_t B, int64_t In, T* const* G) {
  constexpr int64_t L = kCols<T>;
  // W lane vectors of columns from i0; the lanes from `from` on stored
  auto block = [&](auto width, int64_t i0, int64_t from) {
    constexpr int W = decltype(width)::value;
    Cols<T> acc[6][W];
    for (int k = 0; k < 6; ++k)
      for (int w = 0; w < W; ++w) acc[k][w] = Cols<T>{};
    for (int64_t b = 0; b < B; ++b) {
      const T* c0 = c[0] + b * 3;
      const T* c1 = c[1] + b * 3;
      for (int w = 0; w < W; ++w) {
        Cols<T> xu, xl;
        load_cols(xu, u + b * In + i0 + w * L);
        load_cols(xl, l + b * In + i0 + w * L);
        acc[0][w] += xu * c0[0], acc[1][w] += xl * c0[1], acc[2][w] += xu * c0[2];
        acc[3][w] += xu * c1[0], acc[4][w] += xl * c1[1], acc[5][w] += xu * c1[2];
      }
    }
    for (int w = 0; w < W; ++w) {
      const Cols<T> dW0 = acc[0][w] + acc[1][w], dW1 = acc[3][w] + acc[4][w];
      for (int64_t k = w == 0 ? from : 0; k < L; ++k) {
        const int64_t i = i0 + w * L + k;
        G[0][i] = dW0[k], G[1][i] = acc[2][w][k], G[2][i] = dW1[k], G[3][i] = acc[5][w][k];
      }
    }
  };
  int64_t i = 0;
  for (; i + 2 * L <= In; i += 2 * L) block(std::integral_constant<int, 2>{}, i, 0);
  if (i + L <= In) {
    block(std::integral_constant<int, 1>{}, i, 0);
    i += L;
  }
  if (i < In) block(std::integral_constant<int, 1>{}, In - L, i - (In - L));  // the last L columns, the new ones stored
}

// One layer of one member: u (B, In) -> y (B, Out), its parameters p[0..2] (each (In, Out)
// row-major) and their gradients g[0..2]. The weights are held transposed, (Out, In), so that every
// inner loop runs over the contiguous input dimension.
template <typename T>
struct Layer {
  Kind kind;
  int64_t B, In, Out;
  T eps;
  bool normal_eps;
  // Wt, Gt, dWt, dGt (Out, In); th, sg (In, Out): tanh(W_hat), sigmoid(M_hat) of a NAC or NALU;
  // lu (B, In); a, m, g (B, Out); q: row sums or coefficients
  std::vector<T> Wt, Gt, th, sg, lu, a, m, g, q, dWt, dGt;

  void prepare(const T* const* p);
  void forward(const T* u, T* y);
  void backward(const T* u, const T* dy, const T* const* p, T* const* grads, T* du);
  void weight_and_input_grads(const T* u, const T* dy, T* du);
  void forward_nmu(const T* u, T* y);
  void forward_nalu(const T* u, T* y);
  void backward_input(const T* u, const T* dy, T* du);
  void param_grads(const T* const* p, T* const* grads);
};

// L made a layer of `kind`, In -> Out on B rows, with the NALU's eps; its buffers kept (every
// kernel writes a buffer before it reads it, so a layer reused from an earlier call computes the
// same bits as a new one).
template <typename T>
void shape_layer(Layer<T>& L, Kind kind, int64_t B, int64_t In, int64_t Out, double eps) {
  L.kind = kind, L.B = B, L.In = In, L.Out = Out;
  L.eps = static_cast<T>(eps);
  L.normal_eps = eps >= static_cast<double>(std::numeric_limits<T>::min());
}

template <typename T>
void Layer<T>::prepare(const T* const* p) {
  const int64_t n = In * Out;
  Wt.resize(n);
  Gt.resize(kind == Kind::kNalu ? n : 0);
  th.resize(n);
  sg.resize(n);
  T *t = th.data(), *sgm = sg.data();
  if (kind == Kind::kNac || kind == Kind::kNalu) {  // W = tanh(W_hat) sigmoid(M_hat), in storage order
    const T *wh = p[0], *mh = p[1];
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) {
      t[k] = math::tanh_(wh[k]);
      sgm[k] = math::sigmoid(mh[k]);
    }
  }
  for (int64_t i = 0; i < In; ++i) {
    for (int64_t o = 0; o < Out; ++o) {
      const int64_t k = i * Out + o;
      T w;
      if (kind == Kind::kNac || kind == Kind::kNalu) w = t[k] * sgm[k];
      else if (kind == Kind::kNau) w = math::clamp_unit(p[0][k]);
      else w = p[0][k];  // the NMU uses W as given (the projection keeps it in [0, 1])
      Wt[o * In + i] = w;
      if (kind == Kind::kNalu) Gt[o * In + i] = p[2][k];
    }
  }
}

template <typename T>
void Layer<T>::forward_nmu(const T* u, T* y) {  // y = prod_i (W x_i + 1 - W); a holds y for the backward
  for (int64_t b = 0; b < B; ++b)
    for (int64_t o = 0; o < Out; ++o) {
      T prod = T(1);
      for (int64_t i = 0; i < In; ++i) prod = prod * (Wt[o * In + i] * u[b * In + i] + (T(1) - Wt[o * In + i]));
      a[b * Out + o] = y[b * Out + o] = prod;
    }
}

// The NALU: a = x W, m = exp(log(|x| + eps) W), g = sigmoid(x G), y = g a + (1 - g) m; the three
// sums of two outputs per pass over the rows where the layer is wide (nalu_pair_dots), else of one.
template <typename T>
void Layer<T>::forward_nalu(const T* u, T* y) {
  lu.resize(B * In);
  m.resize(B * Out);
  g.resize(B * Out);
  q.resize(B * 3);
  T* l = lu.data();
  if (normal_eps) {  // log(|u| + eps)
#pragma omp simd
    for (int64_t k = 0; k < B * In; ++k) l[k] = math::log_abs_normal_eps(u[k], eps);
  } else {
#pragma omp simd
    for (int64_t k = 0; k < B * In; ++k) l[k] = math::log_abs(u[k], eps);
  }
  // output o from its three sums qa, qa + B, qa + 2 B
  auto finish = [&](int64_t o, T* qa) {
    T *qm = qa + B, *qz = qa + 2 * B;
#pragma omp simd
    for (int64_t b = 0; b < B; ++b) {
      qm[b] = math::exp_(qm[b]);
      qz[b] = math::sigmoid(qz[b]);
    }
    for (int64_t b = 0; b < B; ++b) {
      a[b * Out + o] = qa[b];
      m[b * Out + o] = qm[b];
      g[b * Out + o] = qz[b];
      y[b * Out + o] = math::blend(qa[b], qm[b], qz[b]);
    }
  };
  int64_t o = 0;
  if (In >= kLanes<T>) {  // two outputs per pass over the rows (a wide layer: the first)
    q.resize(B * 6);
    for (; o + 2 <= Out; o += 2) {
      const T* V[4] = {Wt.data() + o * In, Wt.data() + (o + 1) * In, Gt.data() + o * In, Gt.data() + (o + 1) * In};
      nalu_pair_dots(u, l, V, B, In, q.data());
      finish(o, q.data());
      finish(o + 1, q.data() + 3 * B);
    }
  }
  for (; o < Out; ++o) {  // one output per pass
    const T* X[3] = {u, l, u};
    const T* V[3] = {Wt.data() + o * In, Wt.data() + o * In, Gt.data() + o * In};
    row_dots<T, 3>(X, V, B, In, q.data());
    finish(o, q.data());
  }
}

template <typename T>
void Layer<T>::forward(const T* u, T* y) {
  a.resize(B * Out);
  if (kind == Kind::kNmu) return forward_nmu(u, y);
  if (kind == Kind::kNalu) return forward_nalu(u, y);
  // NAC, NAU: a = x W, two outputs per pass over the rows
  q.resize(B * 3);
  int64_t o = 0;
  for (; o + 2 <= Out; o += 2) {
    const T* X[2] = {u, u};
    const T* V[2] = {Wt.data() + o * In, Wt.data() + (o + 1) * In};
    row_dots<T, 2>(X, V, B, In, q.data());
    for (int64_t b = 0; b < B; ++b) {
      a[b * Out + o] = y[b * Out + o] = q[b];
      a[b * Out + o + 1] = y[b * Out + o + 1] = q[B + b];
    }
  }
  if (o < Out) {
    const T* X[1] = {u};
    const T* V[1] = {Wt.data() + o * In};
    row_dots<T, 1>(X, V, B, In, q.data());
    for (int64_t b = 0; b < B; ++b) a[b * Out + o] = y[b * Out + o] = q[b];
  }
}

// The NMU's dy/dW[i] and dy/dx[i] for one output: the product of the other factors (prefix and
// suffix products, no division), times (x_i - 1) and W_i. `suffix` has room for In + 1 values.
template <typename T>
void nmu_row_backward(const T* u, const T* w, int64_t In, T dy, T* dWt, T* du, T* suffix) {
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

// d loss / d u of a NAC, NAU or NALU layer (the second layer's; its input is narrow).
template <typename T>
void Layer<T>::backward_input(const T* u, const T* dy, T* du) {
  std::fill(du, du + B * In, T(0));
  if (kind == Kind::kNalu) {  // d log(|u| + eps) / du, once per element (into lu: the forward's logs are used up)
    T* l = lu.data();
#pragma omp simd
    for (int64_t k = 0; k < B * In; ++k) l[k] = math::log_abs_grad(u[k], eps);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t o = 0; o < Out; ++o) {
      const T* w = Wt.data() + o * In;
      T* db = du + b * In;
      if (kind != Kind::kNalu) {
        for (int64_t i = 0; i < In; ++i) db[i] += dy[b * Out + o] * w[i];
        continue;
      }
      const T *qb = q.data() + (o * B + b) * 3, *lg = lu.data() + b * In, *G = Gt.data() + o * In;
#pragma omp simd
      for (int64_t i = 0; i < In; ++i) db[i] += qb[0] * w[i] + qb[1] * w[i] * lg[i] + qb[2] * G[i];
    }
}

// dW (and dG) of a NAC, NAU or NALU layer into dWt (dGt): column sums over the rows, two outputs
// (NAC, NAU) or one output's three terms (NALU) per pass.
template <typename T>
void layer_weight_grads(Layer<T>& L, const T* u, const T* dy) {
  const int64_t B = L.B, In = L.In, Out = L.Out;
  if (L.kind == Kind::kNalu) {
    L.q.resize(Out * B * 3);  // (da, dm, dz) per output and row
    for (int64_t o = 0; o < Out; ++o)
      for (int64_t b = 0; b < B; ++b) {
        T* qb = L.q.data() + (o * B + b) * 3;
        math::blend_backward(dy[b * Out + o], L.a[b * Out + o], L.m[b * Out + o], L.g[b * Out + o], &qb[0], &qb[1], &qb[2]);
      }
    int64_t o = 0;
    if (In >= kCols<T>)  // two outputs per pass over the rows (a wide layer: the first)
      for (; o + 2 <= Out; o += 2) {
        const T* c[2] = {L.q.data() + o * B * 3, L.q.data() + (o + 1) * B * 3};
        T* G[4] = {L.dWt.data() + o * In, L.dGt.data() + o * In, L.dWt.data() + (o + 1) * In, L.dGt.data() + (o + 1) * In};
        nalu_pair_col_sums(u, L.lu.data(), c, B, In, G);
      }
    for (; o < Out; ++o) {
      const T* Y[3] = {u, L.lu.data(), u};
      const T* qo = L.q.data() + o * B * 3;
      const T* c[3] = {qo, qo + 1, qo + 2};
      const int into[3] = {0, 0, 1};
      T* G[2] = {L.dWt.data() + o * In, L.dGt.data() + o * In};
      col_sums<T, 3>(Y, c, 3, into, B, In, G);
    }
    return;
  }
  int64_t o = 0;
  for (; o + 2 <= Out; o += 2) {
    const T* Y[2] = {u, u};
    const T* c[2] = {dy + o, dy + o + 1};
    const int into[2] = {0, 1};
    T* G[2] = {L.dWt.data() + o * In, L.dWt.data() + (o + 1) * In};
    col_sums<T, 2>(Y, c, Out, into, B, In, G);
  }
  if (o < Out) {
    const T* Y[1] = {u};
    const T* c[1] = {dy + o};
    const int into[1] = {0};
    T* G[1] = {L.dWt.data() + o * In};
    col_sums<T, 1>(Y, c, Out, into, B, In, G);
  }
}

template <typename T>
void Layer<T>::backward(const T* u, const T* dy, const T* const* p, T* const* grads, T* du) {
  weight_and_input_grads(u, dy, du);
  param_grads(p, grads);
}

// dWt (and dGt) of this call's rows, and with du the gradient of the input u (else nullptr).
template <typename T>
void Layer<T>::weight_and_input_grads(const T* u, const T* dy, T* du) {
  const bool nalu = kind == Kind::kNalu;
  dWt.assign(Out * In, T(0));
  dGt.assign(nalu ? Out * In : 0, T(0));
  if (kind == Kind::kNmu) {
    if (du != nullptr) std::fill(du, du + B * In, T(0));
    q.resize(In + 1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t o = 0; o < Out; ++o)
        nmu_row_backward(u + b * In, Wt.data() + o * In, In, dy[b * Out + o], dWt.data() + o * In,
                         du == nullptr ? nullptr : du + b * In, q.data());
  } else {
    layer_weight_grads(*this, u, dy);
    if (du != nullptr) backward_input(u, dy, du);
  }
}

// The gradients of the stored parameters from dWt (and dGt): through W = tanh(W_hat) sigmoid(M_hat)
// (NAC, NALU; math::nac_weight_backward's expressions on the values prepare() kept), the clamp (NAU),
// as is (NMU).
template <typename T>
void Layer<T>::param_grads(const T* const* p, T* const* grads) {
  const int64_t n = In * Out;
  q.resize(n);
  T* dW = q.data();
  for (int64_t i = 0; i < In; ++i)
    for (int64_t o = 0; o < Out; ++o) dW[i * Out + o] = dWt[o * In + i];
  if (kind == Kind::kNac || kind == Kind::kNalu) {
    const T *t = th.data(), *sgm = sg.data();
    T *g0 = grads[0], *g1 = grads[1];
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) {
      g0[k] = dW[k] * (T(1) - t[k] * t[k]) * sgm[k];
      g1[k] = dW[k] * t[k] * sgm[k] * (T(1) - sgm[k]);
    }
    if (kind == Kind::kNalu)
      for (int64_t i = 0; i < In; ++i)
        for (int64_t o = 0; o < Out; ++o) grads[2][i * Out + o] = dGt[o * In + i];
  } else if (kind == Kind::kNau) {  // through clamp(W, -1, 1): 1 inside, ends included
    for (int64_t k = 0; k < n; ++k) grads[0][k] = math::clamp_unit_passes(p[0][k]) ? dW[k] : T(0);
  } else {
    for (int64_t k = 0; k < n; ++k) grads[0][k] = dW[k];
  }
}

// The MSE of one member's B outputs y against its targets t.
template <typename T>
T mse(const T* y, const T* t, int64_t B) {
  T sq = 0;
  for (int64_t b = 0; b < B; ++b) {
    const T err = y[b] - t[b];
    sq += err * err;
  }
  return sq / static_cast<T>(B);
}

// d MSE / dy into dy (B), times `scale`: 0 for a member that has diverged (times the error, as
// autograd's zero upstream gradient: NaN for a non-finite error).
template <typename T>
void mse_upstream(const T* y, const T* t, int64_t B, T scale, T* dy) {
  for (int64_t b = 0; b < B; ++b) dy[b] = scale / static_cast<T>(B) * (y[b] - t[b]) * T(2);
}
