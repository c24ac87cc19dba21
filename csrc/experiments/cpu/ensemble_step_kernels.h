// ensemble_step_kernels.h: the per-member work of the static step (ensemble_step.cpp), included
// by it once per instruction set inside that set's namespace (base; avx2 under the AVX2 target),
// after every header it needs: so no include guard and no includes here.

// One layer of one member: u (B, In) -> y (B, Out), its parameters p[0..2] (each (In, Out)
// row-major) and their gradients g[0..2]. The weights are held transposed, (Out, In), so that every
// inner loop runs over the contiguous input dimension.
template <typename T>
struct Layer {
  Kind kind;
  int64_t B, In, Out;
  T eps;
  bool normal_eps;
  std::vector<T> Wt, Gt, lu, a, m, g;  // Wt, Gt (Out, In); lu (B, In); a, m, g (B, Out)

  void prepare(const T* const* p);
  void forward(const T* u, T* y);
  void backward(const T* u, const T* dy, const T* const* p, T* const* grads, T* du);
};

template <typename T>
void Layer<T>::prepare(const T* const* p) {
  Wt.assign(Out * In, T(0));
  Gt.assign(kind == Kind::kNalu ? Out * In : 0, T(0));
  for (int64_t i = 0; i < In; ++i) {
    for (int64_t o = 0; o < Out; ++o) {
      const int64_t k = i * Out + o;
      T w;
      if (kind == Kind::kNac || kind == Kind::kNalu) w = math::nac_weight(p[0][k], p[1][k]);
      else if (kind == Kind::kNau) w = math::clamp_unit(p[0][k]);
      else w = p[0][k];  // the NMU uses W as given (the projection keeps it in [0, 1])
      Wt[o * In + i] = w;
      if (kind == Kind::kNalu) Gt[o * In + i] = p[2][k];
    }
  }
}

template <typename T>
void Layer<T>::forward(const T* u, T* y) {
  a.resize(B * Out);
  if (kind == Kind::kNmu) {  // y = prod_i (W x_i + 1 - W); a holds y for the backward
    for (int64_t b = 0; b < B; ++b)
      for (int64_t o = 0; o < Out; ++o) {
        T prod = T(1);
        for (int64_t i = 0; i < In; ++i) prod = prod * (Wt[o * In + i] * u[b * In + i] + (T(1) - Wt[o * In + i]));
        a[b * Out + o] = y[b * Out + o] = prod;
      }
    return;
  }
  const bool nalu = kind == Kind::kNalu;
  if (nalu) {
    lu.resize(B * In);
    m.resize(B * Out);
    g.resize(B * Out);
    T* l = lu.data();
    if (normal_eps) {  // log(|u| + eps)
#pragma omp simd
      for (int64_t k = 0; k < B * In; ++k) l[k] = math::log_abs_normal_eps(u[k], eps);
    } else {
#pragma omp simd
      for (int64_t k = 0; k < B * In; ++k) l[k] = math::log_abs(u[k], eps);
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const T* ub = u + b * In;
    for (int64_t o = 0; o < Out; ++o) {
      const T* w = Wt.data() + o * In;
      T sa = 0;
#pragma omp simd reduction(+ : sa)
      for (int64_t i = 0; i < In; ++i) sa += ub[i] * w[i];
      a[b * Out + o] = sa;
      if (!nalu) {
        y[b * Out + o] = sa;
        continue;
      }
      const T* lb = lu.data() + b * In;
      const T* gw = Gt.data() + o * In;
      T sm = 0, sz = 0;
#pragma omp simd reduction(+ : sm, sz)
      for (int64_t i = 0; i < In; ++i) {
        sm += lb[i] * w[i];
        sz += ub[i] * gw[i];
      }
      const T mm = math::exp_(sm), gg = math::sigmoid(sz);
      m[b * Out + o] = mm;
      g[b * Out + o] = gg;
      y[b * Out + o] = math::blend(sa, mm, gg);
    }
  }
}

// The NMU's dy/dW[i] and dy/dx[i] for one output: the product of the other factors (prefix and
// suffix products, no division), times (x_i - 1) and W_i.
template <typename T>
void nmu_row_backward(const T* u, const T* w, int64_t In, T dy, T* dWt, T* du) {
  std::vector<T> suffix(In + 1);
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

template <typename T>
void Layer<T>::backward(const T* u, const T* dy, const T* const* p, T* const* grads, T* du) {
  std::vector<T> dWt(Out * In, T(0)), dGt(kind == Kind::kNalu ? Out * In : 0, T(0));
  if (du != nullptr) std::fill(du, du + B * In, T(0));
  const bool nalu = kind == Kind::kNalu;
  for (int64_t b = 0; b < B; ++b) {
    const T* ub = u + b * In;
    for (int64_t o = 0; o < Out; ++o) {
      const T d = dy[b * Out + o];
      T* dw = dWt.data() + o * In;
      const T* w = Wt.data() + o * In;
      if (kind == Kind::kNmu) {
        nmu_row_backward(ub, w, In, d, dw, du == nullptr ? nullptr : du + b * In);
        continue;
      }
      if (!nalu) {
#pragma omp simd
        for (int64_t i = 0; i < In; ++i) dw[i] += ub[i] * d;
        if (du != nullptr)
          for (int64_t i = 0; i < In; ++i) du[b * In + i] += d * w[i];
        continue;
      }
      T da, dm, dz;
      math::blend_backward(d, a[b * Out + o], m[b * Out + o], g[b * Out + o], &da, &dm, &dz);
      const T* lb = lu.data() + b * In;
      T* dg = dGt.data() + o * In;
#pragma omp simd
      for (int64_t i = 0; i < In; ++i) {
        dw[i] += ub[i] * da + lb[i] * dm;
        dg[i] += ub[i] * dz;
      }
      if (du != nullptr)
        for (int64_t i = 0; i < In; ++i)
          du[b * In + i] += da * w[i] + dm * w[i] * math::log_abs_grad(ub[i], eps) + dz * Gt[o * In + i];
    }
  }
  for (int64_t i = 0; i < In; ++i) {
    for (int64_t o = 0; o < Out; ++o) {
      const int64_t k = i * Out + o;
      const T dW = dWt[o * In + i];
      if (kind == Kind::kNac || kind == Kind::kNalu) {
        math::nac_weight_backward(dW, p[0][k], p[1][k], &grads[0][k], &grads[1][k]);
        if (nalu) grads[2][k] = dGt[o * In + i];
      } else if (kind == Kind::kNau) {  // through clamp(W, -1, 1): 1 inside, ends included
        grads[0][k] = math::clamp_unit_passes(p[0][k]) ? dW : T(0);
      } else {
        grads[0][k] = dW;
      }
    }
  }
}

// Madsen's sparsity term of a NAU (mean(min(|W|, 1 - |W|))) or NMU (mean(min(|W|, |1 - W|))), on
// the parameter W as stored (the published runs keep it in range by the projection).
template <typename T>
T sparsity_term(Kind kind, T w) {
  const T aw = w < T(0) ? -w : w;
  if (kind == Kind::kNau) return aw < T(1) - aw ? aw : T(1) - aw;
  const T om = T(1) - w < T(0) ? w - T(1) : T(1) - w;
  return aw < om ? aw : om;
}


// d/dW of the sparsity term (torch.minimum's gradient: half to each side on a tie; abs: sign, 0 at 0).
template <typename T>
T sparsity_grad(Kind kind, T w) {
  const T sw = w > T(0) ? T(1) : (w < T(0) ? T(-1) : T(0));
  const T aw = w < T(0) ? -w : w;
  if (kind == Kind::kNau) {
    const T other = T(1) - aw;
    return aw < other ? sw : (aw > other ? -sw : T(0));
  }
  const T v = T(1) - w;
  const T sv = v > T(0) ? T(1) : (v < T(0) ? T(-1) : T(0));
  const T om = v < T(0) ? -v : v;
  return aw < om ? sw : (aw > om ? -sv : T(0.5) * (sw - sv));
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

// One member: forward, loss, objective check, backward into its part of the gradient buffer.
// Returns the member's MSE; sets *bad when its objective is not finite.
template <typename T>
T member_step(const StepArgs& a, const T* x, const T* t, MemberParams<T>& mp, Layer<T> (&layers)[2],
              std::vector<T>& h, std::vector<T>& y, std::vector<T>& dh, bool diverged, bool* bad) {
  const int64_t B = a.B;
  for (int l = 0; l < 2; ++l) layers[l].prepare(mp.p[l]);
  layers[0].forward(x, h.data());
  layers[1].forward(h.data(), y.data());
  T sq = 0;
  for (int64_t b = 0; b < B; ++b) {
    const T err = y[b] - t[b];
    sq += err * err;
  }
  const T loss = sq / static_cast<T>(B);
  const T w = static_cast<T>(a.reg_weight);
  T objective = loss;
  if (a.reg_weight != 0.0) {
    T pen = 0;
    for (int l = 0; l < 2; ++l) pen += layer_sparsity<T>(a.kinds[l], mp.p[l][0], layers[l].In * layers[l].Out, T(0), nullptr);
    objective = loss + w * pen;
  }
  *bad = !std::isfinite(objective);
  // d objective / dy, zero (times the error, as autograd: NaN for a non-finite error) for a
  // member that has diverged
  const T scale = (diverged || *bad) ? T(0) : T(1);
  std::vector<T> dy(B);
  for (int64_t b = 0; b < B; ++b) dy[b] = scale / static_cast<T>(B) * (y[b] - t[b]) * T(2);
  layers[1].backward(h.data(), dy.data(), mp.p[1], mp.g[1], dh.data());
  layers[0].backward(x, dh.data(), mp.p[0], mp.g[0], nullptr);
  if (a.reg_weight != 0.0)
    for (int l = 0; l < 2; ++l)
      layer_sparsity<T>(a.kinds[l], mp.p[l][0], layers[l].In * layers[l].Out, scale * w, mp.g[l][0]);
  return loss;
}

// Every member, split over the intra-op threads (each member whole on one thread).
template <typename T>
void all_members(const StepArgs& a, const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                 const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged, T* loss) {
  const T* xs = x.const_data_ptr<T>();
  const T* ts = target.const_data_ptr<T>();
  T* ps = param.data_ptr<T>();
  T* gs = grad.data_ptr<T>();
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  bool* div = diverged.data_ptr<bool>();
  const bool normal = a.eps >= static_cast<double>(std::numeric_limits<T>::min());
  at::parallel_for(0, a.E, 1, [&](int64_t begin, int64_t end) {
    Layer<T> layers[2] = {{a.kinds[0], a.B, a.I, a.H, static_cast<T>(a.eps), normal, {}, {}, {}, {}, {}, {}},
                          {a.kinds[1], a.B, a.H, 1, static_cast<T>(a.eps), normal, {}, {}, {}, {}, {}, {}}};
    std::vector<T> h(a.B * a.H), y(a.B), dh(a.B * a.H);
    for (int64_t e = begin; e < end; ++e) {
      MemberParams<T> mp = member_params(a, ps, gs, seg, e);
      bool bad = false;
      loss[e] = member_step(a, xs + e * a.B * a.I, ts + e * a.B, mp, layers, h, y, dh, div[e], &bad);
      div[e] = div[e] || bad;
    }
  });
}

