// kernels/blas.h: the blas path (wider layers): the constructed weights as tensors, and
// the forward and backward around ATen's bmm.
// Included by nalu_cpu_kernels.h (once per instruction set, NALU_CPU_ISA defined); it includes
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
  at::Tensor W, Wm, G, gind;
};

BlasWeights blas_weights(const LayerKind& kind, const LayerShape& s, const LayerParams& p) {
  const bool sep = kind.add && kind.mul && !kind.tied;
  auto opts = p.W_hat.options();
  BlasWeights b;
  dispatch_float(p.W_hat.scalar_type(), [&]<typename T>() {
    auto build = [&](const at::Tensor& wh, const at::Tensor& mh) {
      at::Tensor w = at::empty({s.E, s.I, s.O}, opts);
      build_weight<T>(wh.contiguous().const_data_ptr<T>(), mh.contiguous().const_data_ptr<T>(), w.data_ptr<T>(),
                      w.numel());
      return w;
    };
    b.W = build(p.W_hat, p.M_hat);
    b.Wm = sep ? build(p.W_hat_m, p.M_hat_m) : b.W;
    if (kind.gate == Gate::kInput) b.G = p.G.contiguous().view({s.E, s.I, s.O});
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

// blas path, forward: products by bmm, then one fused epilogue (exp, sigmoid, blend). The
// outputs have the caller's shapes; bmm writes them through (E, N, O) / (E, N, I) views.
template <typename T>
void blas_forward(const LayerKind& kind, const LayerShape& s, const at::Tensor& x3, const BlasWeights& b, T eps,
                  Forward& f) {
  const int64_t count = s.E * s.N * s.O;
  at::Tensor y3 = f.y.view({s.E, s.N, s.O});
  at::Tensor lx3 = kind.mul ? f.lx.view({s.E, s.N, s.I}) : at::Tensor();
  if (kind.mul) {
    const T* x = x3.const_data_ptr<T>();
    T* lx = f.lx.data_ptr<T>();
    at::parallel_for(0, x3.numel(), grain_for(32), [=](int64_t k0, int64_t k1) {
      log_abs_run(x + k0, lx + k0, k1 - k0, eps);
    });
  }
  if (!kind.mul) {  // NAC+
    at::bmm_out(y3, x3, b.W);
    return;
  }
  if (!kind.add) {  // NAC*
    at::bmm_out(y3, lx3, b.W);
    T* y = f.y.data_ptr<T>();
    parallel_simd(count, 32, [=](int64_t k) { y[k] = nm::exp_(y[k]); });
    return;
  }
  at::Tensor a3 = f.a.view({s.E, s.N, s.O});
  at::Tensor u3 = f.m.view({s.E, s.N, s.O});  // u, exponentiated below
  at::bmm_out(a3, x3, b.W);
  at::bmm_out(u3, lx3, b.Wm);
  if (kind.gate == Gate::kInput) {
    at::Tensor z3 = f.g.view({s.E, s.N, s.O});  // z, squashed below
    at::bmm_out(z3, x3, b.G);
  }
  const T* a = f.a.const_data_ptr<T>();
  T* m = f.m.data_ptr<T>();
  T* y = f.y.data_ptr<T>();
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
}

// blas path, backward. The output gradients du, da, dz go in turn through one (E, N, O) buffer
// (a fused pass each, cheap next to the products), each followed by its products; dx is built in
// place: (du W_m^T) sign(x) / (|x| + eps), + da W^T, + dz G^T. So the only batch-sized scratch is
// that one buffer (three buffers and a (E, N, I) product before: issue 11's memory item).
// dW, dWm: gradients w.r.t. W, W_m, (E, I, O); dG: w.r.t. G in G's shape; dx in x's shape.
template <typename T>
void blas_backward(const LayerKind& kind, const LayerShape& s, bool sep, const at::Tensor& x3, const at::Tensor& dy,
                   const BlasWeights& b, const SavedPtrs<T>& sv, const at::Tensor& lx, T eps, at::Tensor dx,
                   at::Tensor dW, at::Tensor dWm, at::Tensor dG) {
  enum Which { kDa, kDu, kDz };
  const int64_t O = s.O, NO = s.N * s.O, count = s.E * NO;
  at::Tensor d = at::empty({s.E, s.N, s.O}, x3.options());
  T* dp = d.data_ptr<T>();
  const T* dyp = dy.const_data_ptr<T>();
  auto fill = [&](Which which) {
    dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
      parallel_simd(count, 16, [=](int64_t k) {
        T dav = 0, duv = 0, dzv = 0;
        output_grads<T, ADD, MUL>(dyp[k], ADD && MUL ? sv.a[k] : T(0), MUL ? sv.m[k] : T(0),
                                  gate_at<T, GATE>(sv.g, k, NO, O), &dav, &duv, &dzv);
        dp[k] = which == kDa ? dav : (which == kDu ? duv : dzv);
      });
    });
  };
  const at::Tensor xt = x3.transpose(1, 2);
  at::Tensor dx3 = dx.defined() ? dx.view({s.E, s.N, s.I}) : at::Tensor();
  if (kind.mul) {
    fill(kDu);
    const at::Tensor lxt = lx.view({s.E, s.N, s.I}).transpose(1, 2);
    at::bmm_out(sep ? dWm : dW, lxt, d);
    if (dx.defined()) {
      at::bmm_out(dx3, d, b.Wm.transpose(1, 2));
      const T* xp = x3.const_data_ptr<T>();
      T* dxp = dx.data_ptr<T>();
      parallel_simd(dx.numel(), 8, [=](int64_t k) { dxp[k] *= nm::log_abs_grad(xp[k], eps); });
    }
  }
  if (kind.add) {
    fill(kDa);
    if (kind.mul && !sep) {
      dW.baddbmm_(xt, d);
    } else {
      at::bmm_out(dW, xt, d);
    }
    if (dx.defined()) {
      if (kind.mul) {
        dx3.baddbmm_(d, b.W.transpose(1, 2));
      } else {
        at::bmm_out(dx3, d, b.W.transpose(1, 2));
      }
    }
  }
  if (kind.gate != Gate::kNone) {
    fill(kDz);
    if (kind.gate == Gate::kInput) {
      at::Tensor dG3 = dG.view({s.E, s.I, s.O});
      at::bmm_out(dG3, xt, d);
      if (dx.defined()) dx3.baddbmm_(d, b.G.transpose(1, 2));
    } else {
      at::Tensor dG2 = dG.view({s.E, s.O});
      at::sum_out(dG2, d, {1});
    }
  }
}

}  // namespace

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
