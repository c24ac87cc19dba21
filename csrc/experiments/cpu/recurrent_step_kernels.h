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
inline __attribute__((always_inline)) void store_lanes(T* p, const Lanes<T>& v) {
  *reinterpret_cast<typename LanesOf<T>::unaligned*>(p) = v;  // as load_lanes (layer_kernels.h)
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
// `rows`: room for S I offsets.
template <typename T>
void transpose_inputs(const T* x, int64_t B, int64_t S, int64_t I, int64_t C, int64_t Bp, T* z, int64_t* rows) {
  constexpr int64_t V = kLanes<T>;
  const int64_t K = S * I;  // the values of a row
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < I; ++i) rows[s * I + i] = (s * C + i) * Bp;
  auto row = [&](int64_t k) { return z + rows[k]; };
  int64_t b = 0;
  for (; b + V <= B; b += V) {
    const T* xb = x + b * K;
    int64_t k = 0;
    for (; k + V <= K; k += V) {
      Lanes<T> r[V];
#pragma GCC unroll 8
      for (int64_t l = 0; l < V; ++l) load_lanes(r[l], xb + l * K + k);
      transpose_lanes(r);
#pragma GCC unroll 8
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

// A layer's weights for the batch-major kernels: each weight of W (and the NALU's G) broadcast to
// a lane vector, (Out, In) vectors each, from Layer::prepare's Wt and Gt.
template <typename T>
struct LaneWeights {
  std::vector<T> w, g;
};

template <typename T>
void broadcast_weights(const Layer<T>& L, LaneWeights<T>& lw) {
  constexpr int64_t V = kLanes<T>;
  lw.w.resize(L.Wt.size() * V);
  lw.g.resize(L.Gt.size() * V);
  for (size_t k = 0; k < L.Wt.size(); ++k)
    for (int64_t l = 0; l < V; ++l) lw.w[k * V + l] = L.Wt[k];
  for (size_t k = 0; k < L.Gt.size(); ++k)
    for (int64_t l = 0; l < V; ++l) lw.g[k * V + l] = L.Gt[k];
}

// One application of a layer (its In inputs, Out outputs) to batch-major data: z (In, Bp); the
// NALU's lz = log(|z| + eps) (In, Bp) and a, m, g (Out, Bp), kept for the backward.
template <typename T>
struct BatchMajorStep {
  const T* z;
  T *lz, *a, *m, *g;
};

// NO outputs o0 .. o0 + NO - 1 of a layer's sums, every lane block of rows: sa = z W (into ya),
// and for the NALU sm = lz W (ym), sg = z G (yg); the inputs in increasing order.
template <typename T, int NO, bool NALU>
void forward_sums(const T* z, const T* lz, const LaneWeights<T>& lw, int64_t In, int64_t Bp, int64_t o0, T* ya,
                  T* ym, T* yg) {
  constexpr int64_t V = kLanes<T>;
  const T *w = lw.w.data() + o0 * In * V, *g = NALU ? lw.g.data() + o0 * In * V : nullptr;
  for (int64_t b = 0; b < Bp; b += V) {
    Lanes<T> sa[NO], sm[NO], sg[NO], zi, li, wk, gk;
    load_lanes(zi, z + b);  // input 0 sets the sums
    if (NALU) load_lanes(li, lz + b);
    for (int p = 0; p < NO; ++p) {
      load_lanes(wk, w + p * In * V);
      sa[p] = zi * wk;
      if (NALU) load_lanes(gk, g + p * In * V), sm[p] = li * wk, sg[p] = zi * gk;
    }
    for (int64_t i = 1; i < In; ++i) {
      load_lanes(zi, z + i * Bp + b);
      if (NALU) load_lanes(li, lz + i * Bp + b);
      for (int p = 0; p < NO; ++p) {
        load_lanes(wk, w + (p * In + i) * V);
        sa[p] += zi * wk;
        if (NALU) load_lanes(gk, g + (p * In + i) * V), sm[p] += li * wk, sg[p] += zi * gk;
      }
    }
    for (int p = 0; p < NO; ++p) {
      store_lanes(ya + (o0 + p) * Bp + b, sa[p]);
      if (NALU) store_lanes(ym + (o0 + p) * Bp + b, sm[p]), store_lanes(yg + (o0 + p) * Bp + b, sg[p]);
    }
  }
}

// y (Out, Bp) = the layer of z.
template <typename T>
void batch_major_forward(const Layer<T>& L, const LaneWeights<T>& lw, int64_t Bp, const BatchMajorStep<T>& st,
                         T* y) {
  const int64_t In = L.In, Out = L.Out;
  const T* z = st.z;
  if (L.kind != Kind::kNalu) {  // the NAC: y = z W
    int64_t o = 0;
    for (; o + 2 <= Out; o += 2) forward_sums<T, 2, false>(z, nullptr, lw, In, Bp, o, y, nullptr, nullptr);
    if (o < Out) forward_sums<T, 1, false>(z, nullptr, lw, In, Bp, o, y, nullptr, nullptr);
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
  int64_t o = 0;
  for (; o + 2 <= Out; o += 2) forward_sums<T, 2, true>(z, lz, lw, In, Bp, o, st.a, st.m, st.g);
  if (o < Out) forward_sums<T, 1, true>(z, lz, lw, In, Bp, o, st.a, st.m, st.g);
  T *a = st.a, *m = st.m, *g = st.g;
#pragma omp simd
  for (int64_t k = 0; k < Out * Bp; ++k) {
    m[k] = math::exp_(m[k]);
    g[k] = math::sigmoid(g[k]);
    y[k] = math::blend(a[k], m[k], g[k]);
  }
}

// The lanes of the weight gradients of NO outputs o0 .. on input i, accumulated over the Bp rows
// lane block by lane block: accW (o, i) += z_i c1_o (+ lz_i c2_o, the NALU's), accG (o, i) +=
// z_i c3_o (the NALU's); c1, c2, c3 (Out, Bp), accW and accG (Out, In) lane vectors.
template <typename T, int NO, bool NALU>
void weight_grad_lanes(const T* zi, const T* li, const T* c1, const T* c2, const T* c3, int64_t In, int64_t Bp,
                       int64_t o0, int64_t i, T* accW, T* accG) {
  constexpr int64_t V = kLanes<T>;
  Lanes<T> sw[NO], sg[NO], y, l, k;
  for (int p = 0; p < NO; ++p) {
    load_lanes(sw[p], accW + ((o0 + p) * In + i) * V);
    if (NALU) load_lanes(sg[p], accG + ((o0 + p) * In + i) * V);
  }
  for (int64_t b = 0; b < Bp; b += V) {
    load_lanes(y, zi + b);
    if (NALU) load_lanes(l, li + b);
    for (int p = 0; p < NO; ++p) {
      const int64_t r = (o0 + p) * Bp + b;
      load_lanes(k, c1 + r);
      sw[p] += y * k;
      if (NALU) {
        load_lanes(k, c2 + r);
        sw[p] += l * k;
        load_lanes(k, c3 + r);
        sg[p] += y * k;
      }
    }
  }
  for (int p = 0; p < NO; ++p) {
    store_lanes(accW + ((o0 + p) * In + i) * V, sw[p]);
    if (NALU) store_lanes(accG + ((o0 + p) * In + i) * V, sg[p]);
  }
}

template <typename T, bool NALU>
void weight_grads(const T* z, const T* lz, const T* c1, const T* c2, const T* c3, int64_t In, int64_t Out, int64_t Bp,
                  T* accW, T* accG) {
  for (int64_t i = 0; i < In; ++i) {
    const T *zi = z + i * Bp, *li = NALU ? lz + i * Bp : nullptr;
    int64_t o = 0;
    for (; o + 2 <= Out; o += 2) weight_grad_lanes<T, 2, NALU>(zi, li, c1, c2, c3, In, Bp, o, i, accW, accG);
    if (o < Out) weight_grad_lanes<T, 1, NALU>(zi, li, c1, c2, c3, In, Bp, o, i, accW, accG);
  }
}

// The backward of one batch_major_forward: dy (Out, Bp), padding lanes zero. Adds the weights'
// gradient lanes to accW (and the NALU's gate weights' to accG): (Out, In) lane vectors each;
// with dz, the gradient of the input rows [r0, In) into dz ((In - r0), Bp). `coef`: room for
// 3 Out Bp values (the NALU's da, dm, dg) plus In Bp.
template <typename T>
void batch_major_backward(const Layer<T>& L, const LaneWeights<T>& lw, int64_t B, int64_t Bp,
                          const BatchMajorStep<T>& st, const T* dy, T* accW, T* accG, int64_t r0, T* dz, T* coef) {
  constexpr int64_t V = kLanes<T>;
  const int64_t In = L.In, Out = L.Out;
  const T* z = st.z;
  if (L.kind != Kind::kNalu) {
    weight_grads<T, false>(z, nullptr, dy, nullptr, nullptr, In, Out, Bp, accW, nullptr);
    if (dz == nullptr) return;
    for (int64_t b = 0; b < Bp; b += V)
      for (int64_t i = r0; i < In; ++i) {
        Lanes<T> d, w, s;
        load_lanes(d, dy + b);
        load_lanes(w, lw.w.data() + i * V);
        s = d * w;
        for (int64_t o = 1; o < Out; ++o) {
          load_lanes(d, dy + o * Bp + b);
          load_lanes(w, lw.w.data() + (o * In + i) * V);
          s += d * w;
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
  weight_grads<T, true>(z, st.lz, da, dm, dg, In, Out, Bp, accW, accG);  // W: z da, then lz dm; G: z dg
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
        Lanes<T> va, vm, vg, w, g;
        load_lanes(va, da + o * Bp + b);
        load_lanes(vm, dm + o * Bp + b);
        load_lanes(vg, dg + o * Bp + b);
        load_lanes(w, lw.w.data() + (o * In + i) * V);
        load_lanes(g, lw.g.data() + (o * In + i) * V);
        s1 += va * w;
        s1 += vg * g;
        s2 += vm * w;
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

// One thread's work space: the cell and the output layer (parameters, and their weights as lane
// vectors), the inputs of every step, batch-major, z ((len + 1), I + H, Bp) (step len's state
// rows: the output layer's input), the NALU's lz (the same shape) and a, m, g ((len + 1), H, Bp),
// the output, the gradients and their lanes, the transposition's row offsets, the drawn batches.
template <typename T>
struct RecurrentWork {
  Layer<T> cell, out;
  LaneWeights<T> cell_w, out_w;
  int64_t Bp;
  std::vector<T> z, lz, a, m, g, y, dy, dh, dh2, coef, accW, accG, accWo, accGo;
  std::vector<int64_t> rows;
  std::vector<T> x, t;       // the drawn batches and targets (recurrent_members_drawn; sized there)
  std::vector<double> sums;  // their subset sums (draw_seeds)
};

// This thread's work space, shaped and zeroed for a's members: kept from call to call
// (thread_local) so that a step allocates nothing (member_buffers in ensemble_step_kernels.h says
// why); every buffer is zeroed as a new one would be, so a reused one gives the same bits.
template <typename T>
RecurrentWork<T>& recurrent_work(const RecurrentArgs& a) {
  constexpr int64_t V = kLanes<T>;
  const int64_t C = a.I + a.H, S = a.len;
  thread_local RecurrentWork<T> w;
  shape_layer(w.cell, a.kind, a.B, C, a.H, a.eps);
  shape_layer(w.out, a.kind, a.B, a.H, 1, a.eps);
  const int64_t Bp = w.Bp = (a.B + V - 1) / V * V;
  const bool nalu = a.kind == Kind::kNalu;
  w.z.assign((S + 1) * C * Bp, T(0));  // (the x rows' padding lanes stay zero)
  w.rows.assign(S * a.I, 0);
  w.lz.assign(nalu ? (S + 1) * C * Bp : 0, T(0));
  for (auto* v : {&w.a, &w.m, &w.g}) v->assign(nalu ? (S + 1) * a.H * Bp : 0, T(0));
  w.y.assign(Bp, T(0));
  w.dy.assign(Bp, T(0));
  w.dh.assign(a.H * Bp, T(0));
  w.dh2.assign(a.H * Bp, T(0));
  w.coef.assign(3 * a.H * Bp + C * Bp, T(0));
  w.accW.assign(C * a.H * V, T(0));
  w.accG.assign(nalu ? C * a.H * V : 0, T(0));
  w.accWo.assign(a.H * V, T(0));
  w.accGo.assign(nalu ? a.H * V : 0, T(0));
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
  broadcast_weights(w.cell, w.cell_w);
  broadcast_weights(w.out, w.out_w);
  T* z = w.z.data();
  transpose_inputs(x, B, S, I, C, Bp, z, w.rows.data());  // x_s into the first I rows of step s's input
  for (int64_t j = 0; j < H; ++j) {  // h0, the same for every row
    T* row = z + (I + j) * Bp;
    for (int64_t b = 0; b < B; ++b) row[b] = mp.h0[j];
  }
  for (int64_t s = 0; s < S; ++s) {
    T* h = z + ((s + 1) * C + I) * Bp;
    batch_major_forward(w.cell, w.cell_w, Bp, batch_major_step(a, w, s), h);
    zero_padding(h, H, B, Bp);
  }
  const BatchMajorStep<T> top = batch_major_step(a, w, S);
  batch_major_forward(w.out, w.out_w, Bp, top, w.y.data());
  const T loss = mse(w.y.data(), t, B);
  *bad = !std::isfinite(loss);
  mse_upstream(w.y.data(), t, B, (diverged || *bad) ? T(0) : T(1), w.dy.data());
  zero_padding(w.dy.data(), 1, B, Bp);
  std::fill(w.accWo.begin(), w.accWo.end(), T(0));
  std::fill(w.accGo.begin(), w.accGo.end(), T(0));
  batch_major_backward(w.out, w.out_w, B, Bp, top, w.dy.data(), w.accWo.data(), w.accGo.data(), 0, w.dh.data(),
                       w.coef.data());
  // back through time: every step's weight gradient into the same lanes, the state rows of its
  // input gradient the upstream gradient of the step before
  std::fill(w.accW.begin(), w.accW.end(), T(0));
  std::fill(w.accG.begin(), w.accG.end(), T(0));
  for (int64_t s = S - 1; s >= 0; --s) {
    batch_major_backward(w.cell, w.cell_w, B, Bp, batch_major_step(a, w, s), w.dh.data(), w.accW.data(), w.accG.data(), I,
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

// Member e on its batch x (B, len, I) and targets t (B): its loss and divergence flag.
template <typename T>
inline void train_member(const RecurrentArgs& a, const T* x, const T* t, T* ps, T* gs, const int64_t* seg, int64_t e,
                         RecurrentWork<T>& w, bool* div, T* loss) {
  const RecurrentParams<T> mp = recurrent_params(a, ps, gs, seg, e);
  bool bad = false;
  loss[e] = recurrent_member(a, x, t, mp, w, div[e], &bad);
  div[e] = div[e] || bad;
}

// Every member, split over the intra-op threads (each member whole on one thread): x (E, B, len,
// I), targets (E, B).
template <typename T>
void recurrent_members(const RecurrentArgs& a, const T* xs, const T* ts, T* ps, T* gs, const int64_t* seg, bool* div,
                       T* loss) {
  at::parallel_for(0, a.E, 1, [&](int64_t begin, int64_t end) {
    RecurrentWork<T>& w = recurrent_work<T>(a);
    for (int64_t e = begin; e < end; ++e)
      train_member(a, xs + e * a.B * a.len * a.I, ts + e * a.B, ps, gs, seg, e, w, div, loss);
  });
}

// Every member with its batch drawn in the call (float32): the seeds split over the intra-op
// threads; a thread draws kDrawSeeds seeds' batches and targets at a time into its own buffers
// (draw_seeds, recurrent_step.cpp) and trains each seed's members of every op on them.
inline void recurrent_members_drawn(const RecurrentArgs& a, const RecurrentDraw& d, float* ps, float* gs,
                                    const int64_t* seg, bool* div, float* loss) {
  at::parallel_for(0, d.S, 1, [&](int64_t begin, int64_t end) {
    RecurrentWork<float>& w = recurrent_work<float>(a);
    const int64_t n = a.B * a.len * a.I;
    w.x.resize(std::min(kDrawSeeds, end - begin) * n), w.t.resize(d.n_ops * kDrawSeeds * a.B);
    for (int64_t s0 = begin; s0 < end; s0 += kDrawSeeds) {
      const int64_t G = std::min(kDrawSeeds, end - s0);
      draw_seeds(a, d, s0, G, w.x.data(), w.t.data(), w.sums);
      for (int64_t j = 0; j < G; ++j)
        for (int64_t k = 0; k < d.n_ops; ++k)
          train_member(a, w.x.data() + j * n, w.t.data() + (k * G + j) * a.B, ps, gs, seg, k * d.S + s0 + j, w, div,
                       loss);
    }
  });
}
