// recurrent_step_kernels.h: the per-member work of the recurrent step (recurrent_step.cpp),
// included by it once per instruction set inside that set's namespace (base; avx2 under the AVX2
// target), after layer_kernels.h (the layers) and every header it needs: so no include guard and
// no includes here.

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

// One thread's work space: the cell once per time step (each keeps its step's intermediates for
// the backward through time), the output layer, the cell's inputs u_s = concat(x_s, h_{s-1})
// (len, B, I + H), the state, the output and the gradients.
template <typename T>
struct RecurrentWork {
  std::vector<Layer<T>> cells;
  Layer<T> out;
  std::vector<T> u, h, y, dy, dh, du, dW, dG;
};

template <typename T>
RecurrentWork<T> recurrent_work(const RecurrentArgs& a) {
  const int64_t C = a.I + a.H;
  RecurrentWork<T> w;
  w.cells.assign(a.len, make_layer<T>(a.kind, a.B, C, a.H, a.eps));
  w.out = make_layer<T>(a.kind, a.B, a.H, 1, a.eps);
  w.u.resize(a.len * a.B * C);
  w.h.resize(a.B * a.H);
  w.y.resize(a.B);
  w.dy.resize(a.B);
  w.dh.resize(a.B * a.H);
  w.du.resize(a.B * C);
  return w;
}

// One member: forward through time (x (B, len, I), targets t (B)), the MSE, its finiteness, the
// backward through time into the member's part of the gradient buffer. Returns the MSE; sets *bad
// when it is not finite.
template <typename T>
T recurrent_member(const RecurrentArgs& a, const T* x, const T* t, const RecurrentParams<T>& mp, RecurrentWork<T>& w,
                   bool diverged, bool* bad) {
  const int64_t B = a.B, I = a.I, H = a.H, C = I + H, S = a.len;
  Layer<T>& first = w.cells[0];
  first.prepare(mp.cell);
  for (int64_t s = 1; s < S; ++s) {  // the same weights at every step
    w.cells[s].Wt = first.Wt;
    w.cells[s].Gt = first.Gt;
  }
  w.out.prepare(mp.out);
  for (int64_t s = 0; s < S; ++s) {
    T* u = w.u.data() + s * B * C;
    for (int64_t b = 0; b < B; ++b) {  // (element loops: a library call per row of a few values costs more)
      const T *xb = x + (b * S + s) * I, *hb = s == 0 ? mp.h0 : w.h.data() + b * H;
      T* ub = u + b * C;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) ub[i] = xb[i];
      for (int64_t j = 0; j < H; ++j) ub[I + j] = hb[j];
    }
    w.cells[s].forward(u, w.h.data());
  }
  w.out.forward(w.h.data(), w.y.data());
  const T loss = mse(w.y.data(), t, B);
  *bad = !std::isfinite(loss);
  mse_upstream(w.y.data(), t, B, (diverged || *bad) ? T(0) : T(1), w.dy.data());
  w.out.backward(w.h.data(), w.dy.data(), mp.out, mp.g_out, w.dh.data());
  // back through time: each step's weight gradient added to the later steps' sum, the state part
  // of its input gradient the upstream gradient of the step before
  for (int64_t s = S - 1; s >= 0; --s) {
    Layer<T>& L = w.cells[s];
    L.weight_and_input_grads(w.u.data() + s * B * C, w.dh.data(), w.du.data());
    if (s == S - 1) {
      w.dW = L.dWt;
      w.dG = L.dGt;
    } else {
      for (size_t k = 0; k < w.dW.size(); ++k) w.dW[k] += L.dWt[k];
      for (size_t k = 0; k < w.dG.size(); ++k) w.dG[k] += L.dGt[k];
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < H; ++j) w.dh[b * H + j] = w.du[b * C + I + j];
  }
  for (int64_t j = 0; j < H; ++j) {  // h0 is broadcast over the rows: the sum of their gradients
    T sum = 0;
    for (int64_t b = 0; b < B; ++b) sum += w.dh[b * H + j];
    mp.g_h0[j] = sum;
  }
  first.dWt.swap(w.dW);
  first.dGt.swap(w.dG);
  first.param_grads(mp.cell, mp.g_cell);
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
