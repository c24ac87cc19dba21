// recurrent_step_kernels.h: the per-member work of the recurrent step (recurrent_step.cpp),
// included by it once per instruction set inside that set's namespace (base; avx2 under the AVX2
// target), after layer_kernels.h (Layer's parameter preparation and gradients, Lanes, the MSE) and
// every header it needs: so no include guard and no includes here.
//
// The batch is the wide dimension of a recurrent cell (B rows against I + H inputs and H
// outputs), so a member's data is held batch-major: row i of a step's input z is
// concat(x_s, h_{s-1})[.][i] over the rows b, padded to Bp = B rounded up to whole lane vectors
// (kLanes elements), and every inner loop is a lane vector of consecutive rows. The padding lanes
// are kept at zero wherever they could reach a sum over the rows (the inputs, each step's output,
// the gradients that multiply the inputs), so they add +0 and never a NaN.
//
// Every sum has one fixed order: an output's sums over the inputs in increasing i; a weight's
// gradient over the rows and steps in lane vectors (lane l takes the rows b = l (mod kLanes) in
// increasing b, the steps from the last to the first), then the lanes added 0 + 1 + ... in order.

// Pointers to one member's parameters and gradients, in FlatAdam's order (RecurrentNet's
// parameters()): h0 (H), the cell's (I + H, H) and the output layer's (H, 1).
template <typename T>
struct RecurrentParams {
  const T* h0;
  T* g_h0;
  const T* cell[3];
  T* g_cell[3];
  const T* out[3];
  T* g_out[3];
};

template <typename T>
RecurrentParams<T> recurrent_params(const RecurrentArgs& a, T* param, T* grad, const int64_t* seg, int64_t e) {
  RecurrentParams<T> mp{};
  auto locate = [&](int64_t q, T*& g) {
    const int64_t o = seg[2 * q] + e * seg[2 * q + 1];
    g = grad + o;
    return static_cast<const T*>(param + o);
  };
  mp.h0 = locate(0, mp.g_h0);
  const int n = params_per_layer(a.kind);
  for (int j = 0; j < n; ++j) {
    mp.cell[j] = locate(1 + j, mp.g_cell[j]);
    mp.out[j] = locate(1 + n + j, mp.g_out[j]);
  }
  return mp;
}

template <typename T>
inline void store_lanes(T* p, const Lanes<T>& v) {
  __builtin_memcpy(p, &v, sizeof v);
}

// V rows of V values each (V = kLanes: 8 floats, 4 doubles) transposed in place, r[l][k] <- r[k][l]:
// value moves only, so the bits are kept.
inline void transpose_lanes(Lanes<float>* r) {
  typedef int32_t Mask __attribute__((vector_size(32)));
  Lanes<float> t[8], u[8];
  for (int p = 0; p < 4; ++p) {  // rows 2p, 2p+1 interleaved within each half: r0 r1 pairs of columns 0 1 4 5, 2 3 6 7
    t[2 * p] = __builtin_shuffle(r[2 * p], r[2 * p + 1], Mask{0, 8, 1, 9, 4, 12, 5, 13});
    t[2 * p + 1] = __builtin_shuffle(r[2 * p], r[2 * p + 1], Mask{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int p = 0; p < 2; ++p) {  // four rows' column c and c + 4 in u[4p + c]
    u[4 * p] = __builtin_shuffle(t[4 * p], t[4 * p + 2], Mask{0, 1, 8, 9, 4, 5, 12, 13});
    u[4 * p + 1] = __builtin_shuffle(t[4 * p], t[4 * p + 2], Mask{2, 3, 10, 11, 6, 7, 14, 15});
    u[4 * p + 2] = __builtin_shuffle(t[4 * p + 1], t[4 * p + 3], Mask{0, 1, 8, 9, 4, 5, 12, 13});
    u[4 * p + 3] = __builtin_shuffle(t[4 * p + 1], t[4 * p + 3], Mask{2, 3, 10, 11, 6, 7, 14, 15});
  }
  for (int c = 0; c < 4; ++c) {  // the halves of rows 0-3 and 4-7 joined
    r[c] = __builtin_shuffle(u[c], u[4 + c], Mask{0, 1, 2, 3, 8, 9, 10, 11});
    r[c + 4] = __builtin_shuffle(u[c], u[4 + c], Mask{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

inline void transpose_lanes(Lanes<double>* r) {
  typedef int64_t Mask __attribute__((vector_size(32)));
  Lanes<double> t[4];
  for (int p = 0; p < 2; ++p) {  // rows 2p, 2p+1: columns 0 2, 1 3 interleaved
    t[2 * p] = __builtin_shuffle(r[2 * p], r[2 * p + 1], Mask{0, 4, 2, 6});
    t[2 * p + 1] = __builtin_shuffle(r[2 * p], r[2 * p + 1], Mask{1, 5, 3, 7});
  }
  for (int c = 0; c < 2; ++c) {
    r[c] = __builtin_shuffle(t[c], t[2 + c], Mask{0, 1, 4, 5});
    r[c + 2] = __builtin_shuffle(t[c], t[2 + c], Mask{2, 3, 6, 7});
  }
}

// One member's x (B, S, I) into the x rows of every step's batch-major input: z[(s C + i) Bp + b]
// = x[(b S + s) I + i] (C = I + H rows a step). Blocks of kLanes rows by kLanes values, transposed
// in registers; the values and rows left one by one.
template <typename T>
void transpose_inputs(const T* x, int64_t B, int64_t S, int64_t I, int64_t C, int64_t Bp, T* z) {
  constexpr int64_t V = kLanes<T>;
  const int64_t K = S * I;  // the values of a row
  auto row = [&](int64_t k) { return z + ((k / I) * C + k % I) * Bp; };
  int64_t b = 0;
  for (; b + V <= B; b += V) {
    const T* xb = x + b * K;
    int64_t k = 0;
    for (; k + V <= K; k += V) {
      Lanes<T> r[V];
      for (int64_t l = 0; l < V; ++l) load_lanes(r[l], xb + l * K + k);
      transpose_lanes(r);
      for (int64_t c = 0; c < V; ++c) store_lanes(row(k + c) + b, r[c]);
    }
    for (; k < K; ++k) {
      T* zr = row(k) + b;
      for (int64_t l = 0; l < V; ++l) zr[l] = xb[l * K + k];
    }
  }
  for (; b < B; ++b)
    for (int64_t k = 0; k < K; ++k) row(k)[b] = x[b * K + k];
}

// Zero the padding lanes [B, Bp) of `rows` rows of Bp.
template <typename T>
inline void zero_padding(T* p, int64_t rows, int64_t B, int64_t Bp) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = B; b < Bp; ++b) p[r * Bp + b] = T(0);
}

// One application of a layer (its In inputs, Out outputs, weights L.Wt and L.Gt (Out, In)) to
// batch-major data: z (In, Bp); the NALU's lz = log(|z| + eps) (In, Bp) and a, m, g (Out, Bp),
// kept for the backward.
template <typename T>
struct BatchMajorStep {
  const T* z;
  T *lz, *a, *m, *g;
};

// y (Out, Bp) = the layer of z.
template <typename T>
void batch_major_forward(const Layer<T>& L, int64_t Bp, const BatchMajorStep<T>& st, T* y) {
  constexpr int64_t V = kLanes<T>;
  const int64_t In = L.In, Out = L.Out;
  const T* z = st.z;
  if (L.kind != Kind::kNalu) {  // the NAC: y = z W
    for (int64_t b = 0; b < Bp; b += V)
      for (int64_t o = 0; o < Out; ++o) {
        const T* w = L.Wt.data() + o * In;
        Lanes<T> zi, acc;
        load_lanes(zi, z + b);
        acc = zi * w[0];
        for (int64_t i = 1; i < In; ++i) {
          load_lanes(zi, z + i * Bp + b);
          acc += zi * w[i];
        }
        store_lanes(y + o * Bp + b, acc);
      }
    return;
  }
  // the NALU: a = z W, m = exp(lz W), g = sigmoid(z G), y = g a + (1 - g) m
  T* lz = st.lz;
  if (L.normal_eps) {
#pragma omp simd
    for (int64_t k = 0; k < In * Bp; ++k) lz[k] = math::log_abs_normal_eps(z[k], L.eps);
  } else {
#pragma omp simd
    for (int64_t k = 0; k < In * Bp; ++k) lz[k] = math::log_abs(z[k], L.eps);
  }
  for (int64_t b = 0; b < Bp; b += V)
    for (int64_t o = 0; o < Out; ++o) {
      const T *w = L.Wt.data() + o * In, *G = L.Gt.data() + o * In;
      Lanes<T> zi, li, sa, sm, sg;
      load_lanes(zi, z + b);
      load_lanes(li, lz + b);
      sa = zi * w[0];
      sm = li * w[0];
      sg = zi * G[0];
      for (int64_t i = 1; i < In; ++i) {
        load_lanes(zi, z + i * Bp + b);
        load_lanes(li, lz + i * Bp + b);
        sa += zi * w[i];
        sm += li * w[i];
        sg += zi * G[i];
      }
      store_lanes(st.a + o * Bp + b, sa);
      store_lanes(st.m + o * Bp + b, sm);
      store_lanes(st.g + o * Bp + b, sg);
    }
  T *a = st.a, *m = st.m, *g = st.g;
#pragma omp simd
  for (int64_t k = 0; k < Out * Bp; ++k) {
    m[k] = math::exp_(m[k]);
    g[k] = math::sigmoid(g[k]);
    y[k] = math::blend(a[k], m[k], g[k]);
  }
}

// The lanes of a weight's gradient, acc (one lane vector) += y1 c1 (+ y2 c2) over the Bp rows,
// lane block by lane block (the second product, where y2 is given, added after the first).
template <typename T>
inline void add_row_products(const T* y1, const T* c1, const T* y2, const T* c2, int64_t Bp, T* acc) {
  constexpr int64_t V = kLanes<T>;
  Lanes<T> s, y, k;
  load_lanes(s, acc);
  for (int64_t b = 0; b < Bp; b += V) {
    load_lanes(y, y1 + b);
    load_lanes(k, c1 + b);
    s += y * k;
    if (y2 != nullptr) {
      load_lanes(y, y2 + b);
      load_lanes(k, c2 + b);
      s += y * k;
    }
  }
  store_lanes(acc, s);
}

// The backward of one batch_major_forward: dy (Out, Bp), padding lanes zero. Adds the weights'
// gradient lanes to accW (and the NALU's gate weights' to accG): (Out, In) lane vectors each;
// with dz, the gradient of the input rows [r0, In) into dz ((In - r0), Bp). `coef`: room for
// 3 Out Bp values (the NALU's da, dm, dg) plus In Bp.
template <typename T>
void batch_major_backward(const Layer<T>& L, int64_t B, int64_t Bp, const BatchMajorStep<T>& st, const T* dy,
                          T* accW, T* accG, int64_t r0, T* dz, T* coef) {
  constexpr int64_t V = kLanes<T>;
  const int64_t In = L.In, Out = L.Out;
  const T* z = st.z;
  if (L.kind != Kind::kNalu) {
    for (int64_t o = 0; o < Out; ++o)
      for (int64_t i = 0; i < In; ++i)
        add_row_products<T>(z + i * Bp, dy + o * Bp, nullptr, nullptr, Bp, accW + (o * In + i) * V);
    if (dz == nullptr) return;
    for (int64_t b = 0; b < Bp; b += V)
      for (int64_t i = r0; i < In; ++i) {
        Lanes<T> d, s;
        load_lanes(d, dy + b);
        s = d * L.Wt[i];
        for (int64_t o = 1; o < Out; ++o) {
          load_lanes(d, dy + o * Bp + b);
          s += d * L.Wt[o * In + i];
        }
        store_lanes(dz + (i - r0) * Bp + b, s);
      }
    return;
  }
  T *da = coef, *dm = coef + Out * Bp, *dg = coef + 2 * Out * Bp;
  {
    const T *a = st.a, *m = st.m, *g = st.g;
#pragma omp simd
    for (int64_t k = 0; k < Out * Bp; ++k) math::blend_backward(dy[k], a[k], m[k], g[k], &da[k], &dm[k], &dg[k]);
  }
  zero_padding(coef, 3 * Out, B, Bp);  // (m may be Inf on a padding lane: 0 times it is not 0)
  for (int64_t o = 0; o < Out; ++o)
    for (int64_t i = 0; i < In; ++i) {  // W: z da, then lz dm; G: z dg
      add_row_products<T>(z + i * Bp, da + o * Bp, st.lz + i * Bp, dm + o * Bp, Bp, accW + (o * In + i) * V);
      add_row_products<T>(z + i * Bp, dg + o * Bp, nullptr, nullptr, Bp, accG + (o * In + i) * V);
    }
  if (dz == nullptr) return;
  // dz_i = sum_o (da_o W_io + dg_o G_io) + lg_i sum_o dm_o W_io, lg = d log(|z| + eps) / dz
  T* lg = coef + 3 * Out * Bp;
  {
    const T* zr = z + r0 * Bp;
    const T eps = L.eps;
#pragma omp simd
    for (int64_t k = 0; k < (In - r0) * Bp; ++k) lg[k] = math::log_abs_grad(zr[k], eps);
  }
  for (int64_t b = 0; b < Bp; b += V)
    for (int64_t i = r0; i < In; ++i) {
      Lanes<T> s1 = {}, s2 = {};
      for (int64_t o = 0; o < Out; ++o) {
        Lanes<T> va, vm, vg;
        load_lanes(va, da + o * Bp + b);
        load_lanes(vm, dm + o * Bp + b);
        load_lanes(vg, dg + o * Bp + b);
        s1 += va * L.Wt[o * In + i];
        s1 += vg * L.Gt[o * In + i];
        s2 += vm * L.Wt[o * In + i];
      }
      Lanes<T> l;
      load_lanes(l, lg + (i - r0) * Bp + b);
      store_lanes(dz + (i - r0) * Bp + b, s1 + s2 * l);
    }
}

// The lanes of accW (and accG) added in lane order into L.dWt (L.dGt), then the stored
// parameters' gradients (Layer::param_grads).
template <typename T>
void batch_major_param_grads(Layer<T>& L, const T* accW, const T* accG, const T* const* p, T* const* grads) {
  constexpr int64_t V = kLanes<T>;
  const int64_t n = L.In * L.Out;
  L.dWt.resize(n);
  L.dGt.resize(L.kind == Kind::kNalu ? n : 0);
  for (int64_t k = 0; k < n; ++k) {
    Lanes<T> v;
    load_lanes(v, accW + k * V);
    L.dWt[k] = add_lanes<T>(v);
    if (L.kind == Kind::kNalu) {
      load_lanes(v, accG + k * V);
      L.dGt[k] = add_lanes<T>(v);
    }
  }
  L.param_grads(p, grads);
}

// One thread's work space: the cell and the output layer (parameters), the inputs of every step,
// batch-major, z ((len + 1), I + H, Bp) (step len's state rows: the output layer's input), the
// NALU's lz (the same shape) and a, m, g ((len + 1), H, Bp), the output, the gradients.
template <typename T>
struct RecurrentWork {
  Layer<T> cell, out;
  int64_t Bp;
  std::vector<T> z, lz, a, m, g, y, dy, dh, dh2, coef, accW, accG, accWo, accGo;
};

template <typename T>
RecurrentWork<T> recurrent_work(const RecurrentArgs& a) {
  constexpr int64_t V = kLanes<T>;
  const int64_t C = a.I + a.H, S = a.len;
  RecurrentWork<T> w;
  w.cell = make_layer<T>(a.kind, a.B, C, a.H, a.eps);
  w.out = make_layer<T>(a.kind, a.B, a.H, 1, a.eps);
  const int64_t Bp = w.Bp = (a.B + V - 1) / V * V;
  const bool nalu = a.kind == Kind::kNalu;
  w.z.assign((S + 1) * C * Bp, T(0));  // (the x rows' padding lanes stay zero)
  w.lz.resize(nalu ? (S + 1) * C * Bp : 0);
  for (auto* v : {&w.a, &w.m, &w.g}) v->resize(nalu ? (S + 1) * a.H * Bp : 0);
  w.y.resize(Bp);
  w.dy.resize(Bp);
  w.dh.resize(a.H * Bp);
  w.dh2.resize(a.H * Bp);
  w.coef.resize(3 * a.H * Bp + C * Bp);
  w.accW.resize(C * a.H * V);
  w.accG.resize(nalu ? C * a.H * V : 0);
  w.accWo.resize(a.H * V);
  w.accGo.resize(nalu ? a.H * V : 0);
  return w;
}

// Step s's pointers into the work space (s = len: the output layer's, its input step len's state).
template <typename T>
BatchMajorStep<T> batch_major_step(const RecurrentArgs& a, RecurrentWork<T>& w, int64_t s) {
  const int64_t C = a.I + a.H, Bp = w.Bp, first = s == a.len ? a.I * Bp : 0;
  const bool nalu = a.kind == Kind::kNalu;
  BatchMajorStep<T> st{};
  st.z = w.z.data() + s * C * Bp + first;
  if (nalu) {
    st.lz = w.lz.data() + s * C * Bp + first;
    st.a = w.a.data() + s * a.H * Bp;
    st.m = w.m.data() + s * a.H * Bp;
    st.g = w.g.data() + s * a.H * Bp;
  }
  return st;
}

// One member: forward through time (x (B, len, I), targets t (B)), the MSE, its finiteness, the
// backward through time into the member's part of the gradient buffer. Returns the MSE; sets *bad
// when it is not finite.
template <typename T>
T recurrent_member(const RecurrentArgs& a, const T* x, const T* t, const RecurrentParams<T>& mp, RecurrentWork<T>& w,
                   bool diverged, bool* bad) {
  const int64_t B = a.B, I = a.I, H = a.H, C = I + H, S = a.len, Bp = w.Bp;
  w.cell.prepare(mp.cell);
  w.out.prepare(mp.out);
  T* z = w.z.data();
  transpose_inputs(x, B, S, I, C, Bp, z);  // x_s into the first I rows of step s's input
  for (int64_t j = 0; j < H; ++j) {  // h0, the same for every row
    T* row = z + (I + j) * Bp;
    for (int64_t b = 0; b < B; ++b) row[b] = mp.h0[j];
  }
  for (int64_t s = 0; s < S; ++s) {
    T* h = z + ((s + 1) * C + I) * Bp;
    batch_major_forward(w.cell, Bp, batch_major_step(a, w, s), h);
    zero_padding(h, H, B, Bp);
  }
  const BatchMajorStep<T> top = batch_major_step(a, w, S);
  batch_major_forward(w.out, Bp, top, w.y.data());
  const T loss = mse(w.y.data(), t, B);
  *bad = !std::isfinite(loss);
  mse_upstream(w.y.data(), t, B, (diverged || *bad) ? T(0) : T(1), w.dy.data());
  zero_padding(w.dy.data(), 1, B, Bp);
  std::fill(w.accWo.begin(), w.accWo.end(), T(0));
  std::fill(w.accGo.begin(), w.accGo.end(), T(0));
  batch_major_backward(w.out, B, Bp, top, w.dy.data(), w.accWo.data(), w.accGo.data(), 0, w.dh.data(),
                       w.coef.data());
  // back through time: every step's weight gradient into the same lanes, the state rows of its
  // input gradient the upstream gradient of the step before
  std::fill(w.accW.begin(), w.accW.end(), T(0));
  std::fill(w.accG.begin(), w.accG.end(), T(0));
  for (int64_t s = S - 1; s >= 0; --s) {
    batch_major_backward(w.cell, B, Bp, batch_major_step(a, w, s), w.dh.data(), w.accW.data(), w.accG.data(), I,
                         w.dh2.data(), w.coef.data());
    w.dh.swap(w.dh2);
  }
  constexpr int64_t V = kLanes<T>;
  for (int64_t j = 0; j < H; ++j) {  // h0 is broadcast over the rows: the sum of their gradients
    Lanes<T> s = {}, v;
    for (int64_t b = 0; b < Bp; b += V) {
      load_lanes(v, w.dh.data() + j * Bp + b);
      s += v;
    }
    mp.g_h0[j] = add_lanes<T>(s);
  }
  batch_major_param_grads(w.out, w.accWo.data(), w.accGo.data(), mp.out, mp.g_out);
  batch_major_param_grads(w.cell, w.accW.data(), w.accG.data(), mp.cell, mp.g_cell);
  return loss;
}

// Every member, split over the intra-op threads (each member whole on one thread): x (E, B, len,
// I), targets (E, B).
template <typename T>
void recurrent_members(const RecurrentArgs& a, const T* xs, const T* ts, T* ps, T* gs, const int64_t* seg, bool* div,
                       T* loss) {
  at::parallel_for(0, a.E, 1, [&](int64_t begin, int64_t end) {
    RecurrentWork<T> w = recurrent_work<T>(a);
    for (int64_t e = begin; e < end; ++e) {
      const RecurrentParams<T> mp = recurrent_params(a, ps, gs, seg, e);
      bool bad = false;
      loss[e] = recurrent_member(a, xs + e * a.B * a.len * a.I, ts + e * a.B, mp, w, div[e], &bad);
      div[e] = div[e] || bad;
    }
  });
}
