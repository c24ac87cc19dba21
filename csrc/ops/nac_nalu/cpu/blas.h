// blas.h: the blas path (wider layers) on the CPU: the constructed weights as tensors,
// and the elementwise steps around the products of csrc/blas_path.h.
// Included by ops/nac_nalu/cpu/kernels_impl.h (once per instruction set, NALU_CPU_ISA defined); it includes
// nothing itself and opens its namespaces itself.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------------------
// Blas path
// ---------------------------------------------------------------------------------------------

// The constructed weights of a blas-path call, (E, I, O) tensors (bmm needs tensors), and
// sigmoid(G) for an independent gate.
struct BlasWeights {
  blas_path::Weights w;
  at::Tensor gind;
};

BlasWeights blas_weights(const LayerKind& kind, const LayerShape& s, const LayerParams& p) {
  const bool sep = kind.sep();
  auto opts = p.W_hat.options();
  BlasWeights b;
  dispatch_float(p.W_hat.scalar_type(), [&]<typename T>() {
    auto build = [&](const at::Tensor& wh, const at::Tensor& mh) {
      at::Tensor w = at::empty({s.E, s.I, s.O}, opts);
      build_weight<T>(wh.contiguous().const_data_ptr<T>(), mh.contiguous().const_data_ptr<T>(), w.data_ptr<T>(),
                      w.numel());
      return w;
    };
    b.w.W = build(p.W_hat, p.M_hat);
    b.w.Wm = sep ? build(p.W_hat_m, p.M_hat_m) : b.w.W;
    if (kind.gate == Gate::kInput) b.w.G = p.G.contiguous().view({s.E, s.I, s.O});
    if (p.G_bias.defined()) b.w.Gb = p.G_bias.view({s.E, s.O});
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

// blas path, forward: lx, then the products (csrc/blas_path.h), then one fused epilogue (exp,
// sigmoid, blend).
template <typename T>
void blas_forward(const LayerArgs& args, const LayerShape& s, const at::Tensor& x3, const BlasWeights& b, Forward& f) {
  const LayerKind& kind = args.kind;
  const T eps = static_cast<T>(args.eps);
  const int64_t count = s.E * s.N * s.O;
  if (kind.mul) {
    const T* x = x3.const_data_ptr<T>();
    T* lx = f.lx.data_ptr<T>();
    at::parallel_for(0, x3.numel(), grain_for(32), [=](int64_t k0, int64_t k1) {
      log_abs_run(x + k0, lx + k0, k1 - k0, eps);
    });
  }
  blas_path::forward(args, s, x3, b.w, f, [&] {
    T* y = f.y.data_ptr<T>();
    if (!kind.add) {  // NAC*: y holds u
      parallel_simd(count, 32, [=](int64_t k) { y[k] = nm::exp_(y[k]); });
      return;
    }
    const T* a = f.a.const_data_ptr<T>();
    T* m = f.m.data_ptr<T>();
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
  });
}

// blas path, backward: the products of csrc/blas_path.h, with du, da, dz each made by one fused
// pass into the one (E, N, O) buffer, and dx scaled by sign(x) / (|x| + eps) in place.
// dW, dWm: gradients w.r.t. W, W_m, (E, I, O); dG: w.r.t. G in G's shape; dx in x's shape.
template <typename T>
void blas_backward(const LayerArgs& args, const LayerShape& s, const at::Tensor& x3, const BlasWeights& b,
                   const SavedPtrs<const T*>& sv, const at::Tensor& lx, const at::Tensor& dx, const at::Tensor& dW,
                   const at::Tensor& dWm, const at::Tensor& dG, const at::Tensor& dGb) {
  const LayerKind& kind = args.kind;
  const T eps = static_cast<T>(args.eps);
  const int64_t O = s.O, NO = s.N * s.O, count = s.E * NO;
  at::Tensor d = at::empty({s.E, s.N, s.O}, x3.options());
  T* dp = d.data_ptr<T>();
  auto fill = [&](blas_path::OutputGrad which) {
    dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
      auto run = [&]<bool PARTS>() {  // PARTS: gradients reaching the kept parts (add_part_grads)
        parallel_simd(count, 16, [=](int64_t k) {
          T dav = 0, duv = 0, dzv = 0;
          output_grads<T, ADD, MUL>(sv.dy[k], ADD && MUL ? sv.a[k] : T(0), MUL ? sv.m[k] : T(0),
                                    gate_at<T, GATE>(sv.g, k, NO, O), &dav, &duv, &dzv);
          if constexpr (PARTS) add_part_grads<T, GATE>(sv, k, &dav, &duv, &dzv);
          dp[k] = which == blas_path::OutputGrad::kDa ? dav : (which == blas_path::OutputGrad::kDu ? duv : dzv);
        });
      };
      if constexpr (ADD && MUL) {
        if (sv.part_grads()) return run.template operator()<true>();
      }
      run.template operator()<false>();
    });
  };
  auto scale_dx = [&] {
    if (!kind.mul || !dx.defined()) return;
    const T* xp = x3.const_data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    parallel_simd(dx.numel(), 8, [=](int64_t k) { dxp[k] *= nm::log_abs_grad(xp[k], eps); });
  };
  blas_path::backward(args, s, x3, lx, b.w, d, dx, dW, dWm, dG, dGb, fill, scale_dx);
}

}  // namespace

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
