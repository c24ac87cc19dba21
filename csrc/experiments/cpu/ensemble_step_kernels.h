// ensemble_step_kernels.h: the per-member work of the static step (ensemble_step.cpp), included
// by it once per instruction set inside that set's namespace (base; avx2 under the AVX2 target),
// after layer_kernels.h (the layers) and every header it needs: so no include guard and no
// includes here.

// Madsen's sparsity term of a NAU or NMU weight and its derivative (csrc/ops/nau_nmu/math.h).
template <typename T>
T sparsity_term(Kind kind, T w) {
  return kind == Kind::kNau ? math::nau_sparsity(w) : math::nmu_sparsity(w);
}

template <typename T>
T sparsity_grad(Kind kind, T w) {
  return kind == Kind::kNau ? math::nau_sparsity_grad(w) : math::nmu_sparsity_grad(w);
}

// The sparsity regulariser of one layer (NAU, NMU; 0 for the others): its mean over W, and with
// a weight, weight * its gradient added into grads[0].
template <typename T>
T layer_sparsity(Kind kind, const T* W, int64_t n, T weight, T* dW) {
  if (kind != Kind::kNau && kind != Kind::kNmu) return T(0);
  T sum = 0;
  for (int64_t k = 0; k < n; ++k) sum += sparsity_term(kind, W[k]);
  if (dW != nullptr)
    for (int64_t k = 0; k < n; ++k) dW[k] += weight * sparsity_grad(kind, W[k]) / static_cast<T>(n);
  return sum / static_cast<T>(n);
}

// Pointers to one member's parameters and gradients: layer l's j-th parameter at [l][j].
template <typename T>
struct MemberParams {
  const T* p[2][3];
  T* g[2][3];
};

template <typename T>
MemberParams<T> member_params(const StepArgs& a, T* param, T* grad, const int64_t* seg, int64_t e) {
  MemberParams<T> mp{};
  int q = 0;
  for (int l = 0; l < 2; ++l)
    for (int j = 0; j < params_per_layer(a.kinds[l]); ++j, ++q) {
      const int64_t o = seg[2 * q] + e * seg[2 * q + 1];
      mp.p[l][j] = param + o;
      mp.g[l][j] = grad + o;
    }
  return mp;
}

// One thread's buffers for its members: the two layers', the hidden values and the gradients of
// the step, the drawn batches and targets. Kept from call to call (thread_local, member_buffers),
// so that a step allocates and frees nothing (they were made anew in every call).
template <typename T>
struct MemberBuffers {
  Layer<T> layers[2];
  std::vector<T> h, y, dh, dy, x, t;
  std::vector<double> w, sums;
};

// This thread's buffers, shaped for a's members (the layers' and step's; x and t as the caller needs).
template <typename T>
MemberBuffers<T>& member_buffers(const StepArgs& a) {
  thread_local MemberBuffers<T> m;
  shape_layer(m.layers[0], a.kinds[0], a.B, a.I, a.H, a.eps);
  shape_layer(m.layers[1], a.kinds[1], a.B, a.H, 1, a.eps);
  m.h.resize(a.B * a.H), m.dh.resize(a.B * a.H), m.y.resize(a.B), m.dy.resize(a.B);
  return m;
}

// One member: forward, loss, objective check, backward into its part of the gradient buffer.
// Returns the member's MSE; sets *bad when its objective is not finite.
template <typename T>
T member_step(const StepArgs& a, const T* x, const T* t, MemberParams<T>& mp, MemberBuffers<T>& m, bool diverged,
              bool* bad) {
  const int64_t B = a.B;
  Layer<T>(&layers)[2] = m.layers;
  std::vector<T>&h = m.h, &y = m.y, &dh = m.dh, &dy = m.dy;
  for (int l = 0; l < 2; ++l) layers[l].prepare(mp.p[l]);
  layers[0].forward(x, h.data());
  layers[1].forward(h.data(), y.data());
  const T loss = mse(y.data(), t, B);
  const T w = static_cast<T>(a.reg_weight);
  T objective = loss;
  if (a.reg_weight != 0.0) {
    T pen = 0;
    for (int l = 0; l < 2; ++l) pen += layer_sparsity<T>(a.kinds[l], mp.p[l][0], layers[l].In * layers[l].Out, T(0), nullptr);
    objective = loss + w * pen;
  }
  *bad = !std::isfinite(objective);
  // d objective / dy, zero (times the error) for a member that has diverged
  const T scale = (diverged || *bad) ? T(0) : T(1);
  mse_upstream(y.data(), t, B, scale, dy.data());
  layers[1].backward(h.data(), dy.data(), mp.p[1], mp.g[1], dh.data());
  layers[0].backward(x, dh.data(), mp.p[0], mp.g[0], nullptr);
  if (a.reg_weight != 0.0)
    for (int l = 0; l < 2; ++l)
      layer_sparsity<T>(a.kinds[l], mp.p[l][0], layers[l].In * layers[l].Out, scale * w, mp.g[l][0]);
  return loss;
}

// Seed s's batch x (B, I) and the targets of every op, t (n_ops, B), from the counter stream
// (experiments/counter_draw.h): the words of eight inputs at a time in one lane vector, the same
// values as CounterStream's (and the CUDA kernel's); the targets op_k(a, b) from the float64 sums of
// the inputs with the seed's masks, exact (so the same in any order: the order the vector loop
// takes). `ma`, `mb`: room for I values each (the masks' two columns, contiguous).
inline void counter_draw_seed(const StepArgs& a, const CounterDraw& d, int64_t s, float* x, float* t, double* ma,
                              double* mb) {
  typedef uint32_t U8 __attribute__((vector_size(32)));
  typedef int32_t I8 __attribute__((vector_size(32)));
  typedef float F8 __attribute__((vector_size(32)));
  typedef float F8u __attribute__((vector_size(32), aligned(4), may_alias));
  const int64_t n = a.B * a.I, I = a.I;
  const CounterKey key(d, s, *d.step);
  const float lo = d.lo, width = d.hi - d.lo, top = d.top;
  const F8 lo8 = F8{} + lo, width8 = F8{} + width, top8 = F8{} + top;
  U8 idx = {0, 1, 2, 3, 4, 5, 6, 7};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8, idx += 8u) {  // (the index as uint32_t, as the stream's words take it)
    U8 h = idx;
    key.words(h);
    const F8 u = __builtin_convertvector((I8)(h >> 9), F8) * kCounterUnit;  // < 2^23: exact as int32
    const F8 v = lo8 + u * width8;  // (no contraction in this file: the product rounded on its own)
    *reinterpret_cast<F8u*>(x + k) = v < top8 ? v : top8;
  }
  for (; k < n; ++k) {
    const float u = static_cast<float>(key.word(static_cast<uint32_t>(k)) >> 9) * kCounterUnit;
    const float v = lo + u * width;
    x[k] = v < top ? v : top;
  }
  const double* mask = d.masks + s * I * 2;
  for (int64_t i = 0; i < I; ++i) ma[i] = mask[2 * i], mb[i] = mask[2 * i + 1];
  for (int64_t b = 0; b < a.B; ++b) {
    const float* xb = x + b * I;
    double sa = 0.0, sb = 0.0;
#pragma omp simd reduction(+ : sa, sb)
    for (int64_t i = 0; i < I; ++i) {
      sa += static_cast<double>(xb[i]) * ma[i];
      sb += static_cast<double>(xb[i]) * mb[i];
    }
    for (int64_t op = 0; op < d.n_ops; ++op)
      t[op * a.B + b] = static_cast<float>(apply_target(static_cast<TargetOp>(d.ops[op]), sa, sb));
  }
}

// One member's step on its batch x (B, I) and targets t (B): its loss into loss[e], its flag into div[e].
template <typename T>
void train_member(const StepArgs& a, const T* x, const T* t, T* ps, T* gs, const int64_t* seg, int64_t e,
                  MemberBuffers<T>& m, bool* div, T* loss) {
  MemberParams<T> mp = member_params(a, ps, gs, seg, e);
  bool bad = false;
  loss[e] = member_step(a, x, t, mp, m, div[e], &bad);
  div[e] = div[e] || bad;
}

// Every member, split over the intra-op threads (each member whole on one thread), its batch from
// xs (E, B, I) and ts (E, B) or, float32 only, drawn here: then the seeds are split over the threads,
// and a thread draws a seed's batch once, with the targets of every op, and trains the seed's
// members of every op on it (e = k S + s), from the seeds' SFC64 generators (`draw`, kDrawGroup seeds
// at a time) or the counter stream (`counter`).
template <typename T>
void all_members(const StepArgs& a, const T* xs, const T* ts, const Draw* draw, const CounterDraw* counter, T* ps,
                 T* gs, const int64_t* seg, bool* div, T* loss) {
  if constexpr (std::is_same_v<T, float>) {
    if (draw != nullptr || counter != nullptr) {
      const int64_t S = draw != nullptr ? draw->S : counter->S;
      const int64_t n_ops = draw != nullptr ? draw->n_ops : counter->n_ops;
      const int64_t group = draw != nullptr ? kDrawGroup : 1;
      at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
        MemberBuffers<T>& m = member_buffers<T>(a);
        const int64_t n = a.B * a.I;
        m.x.resize(std::min(group, end - begin) * n), m.t.resize(n_ops * group * a.B);
        for (int64_t s0 = begin; s0 < end; s0 += group) {
          const int64_t G = std::min(group, end - s0);
          if (draw != nullptr) {
            draw_seeds(a, *draw, s0, G, m.x.data(), m.t.data(), m.w, m.sums);
          } else {
            m.w.resize(2 * a.I);
            counter_draw_seed(a, *counter, s0, m.x.data(), m.t.data(), m.w.data(), m.w.data() + a.I);
          }
          for (int64_t j = 0; j < G; ++j)
            for (int64_t k = 0; k < n_ops; ++k)
              train_member(a, m.x.data() + j * n, m.t.data() + (k * G + j) * a.B, ps, gs, seg, k * S + s0 + j, m, div,
                           loss);
        }
      });
      return;
    }
  }
  at::parallel_for(0, a.E, 1, [&](int64_t begin, int64_t end) {
    MemberBuffers<T>& m = member_buffers<T>(a);
    for (int64_t e = begin; e < end; ++e)
      train_member(a, xs + e * a.B * a.I, ts + e * a.B, ps, gs, seg, e, m, div, loss);
  });
}
