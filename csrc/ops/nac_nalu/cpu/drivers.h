// drivers.h: the tensor-level drivers: the ISA's layer_forward, layer_backward,
// weight and weight_backward (declared in kernels.h), which pick the path from the shape.
// Included by ops/nac_nalu/cpu/kernels_impl.h (once per instruction set, NALU_CPU_ISA defined); it includes
// nothing itself and opens its namespaces itself.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {
namespace {

// ---------------------------------------------------------------------------------------------
// Tensor-level drivers
// ---------------------------------------------------------------------------------------------

// The constructed weights of a rowwise-path call, transposed to (E, O, I), in one scratch buffer
// (no tensor allocations: at the paper's sizes they would cost more than the math).
template <typename T>
struct RowwiseWeights {
  std::vector<T> buf;
  Ptrs<T> ptrs;
};

// Backward needs the weights themselves only for the x-gradient (`matrices` false: no W, W_m, G,
// only an independent gate's sigmoid).
template <typename T>
RowwiseWeights<T> rowwise_weights(const LayerKind& kind, const LayerShape& s, const LayerParams& p, const T* x,
                                  bool matrices = true) {
  const bool sep = kind.sep();
  const int64_t n = s.E * s.I * s.O;
  const int64_t mats = 1 + (sep ? 1 : 0) + (kind.gate == Gate::kInput ? 1 : 0);
  RowwiseWeights<T> r;
  r.buf.resize(static_cast<size_t>(n * (mats + 1) + s.E * s.O));
  T* tmp = r.buf.data() + n * mats;  // (E, I, O) before transposing
  T* next = r.buf.data();
  auto build_t = [&](const at::Tensor& wh, const at::Tensor& mh) {
    build_weight<T>(wh.contiguous().const_data_ptr<T>(), mh.contiguous().const_data_ptr<T>(), tmp, n);
    transpose_last2<T>(tmp, next, s.E, s.I, s.O);
    next += n;
    return next - n;
  };
  r.ptrs.x = x;
  if (matrices) {
    r.ptrs.W = build_t(p.W_hat, p.M_hat);
    r.ptrs.Wm = sep ? build_t(p.W_hat_m, p.M_hat_m) : r.ptrs.W;
  }
  if (kind.gate == Gate::kInput && matrices) {
    transpose_last2<T>(p.G.contiguous().const_data_ptr<T>(), next, s.E, s.I, s.O);
    r.ptrs.G = next;
  } else if (kind.gate == Gate::kIndependent) {
    T* g = tmp + n;
    const at::Tensor gc = p.G.contiguous();  // owns the data gp points to
    const T* gp = gc.const_data_ptr<T>();
    for (int64_t k = 0; k < s.E * s.O; ++k) g[k] = nm::sigmoid(gp[k]);
    r.ptrs.gind = g;
  }
  if (p.G_bias.defined()) r.ptrs.Gb = p.G_bias.const_data_ptr<T>();  // contiguous, owned by p (ops.h)
  return r;
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

template <typename T>
const T* cptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// grad_W_hat, grad_M_hat from dW (E, I, O), through the weight construction.
template <typename T>
void weight_backward_into(const T* dW, const at::Tensor& W_hat, const at::Tensor& M_hat, at::Tensor& gw,
                          at::Tensor& gm) {
  gw = new_cpu_tensor(W_hat.sizes(), W_hat.options());
  gm = new_cpu_tensor(W_hat.sizes(), W_hat.options());
  weight_backward_pass<T>(dW, W_hat.contiguous().const_data_ptr<T>(), M_hat.contiguous().const_data_ptr<T>(),
                          gw.data_ptr<T>(), gm.data_ptr<T>(), gw.numel());
}

}  // namespace

Forward layer_forward(const LayerArgs& args, const LayerShape& s, const at::Tensor& x, const LayerParams& p) {
  const LayerKind& kind = args.kind;
  const bool nalu = kind.nalu();
  const at::Tensor xc = x.contiguous();
  auto opts = x.options();
  // Outputs in the caller's shapes; kernels see them as contiguous (E, N, O) / (E, N, I).
  Forward f;
  f.y = new_cpu_tensor(s.out_sizes, opts);
  if (kind.mul) f.lx = new_cpu_tensor(x.sizes(), opts);
  if (nalu) {
    f.a = new_cpu_tensor(s.out_sizes, opts);
    f.m = new_cpu_tensor(s.out_sizes, opts);
    if (kind.gate == Gate::kInput) f.g = new_cpu_tensor(s.out_sizes, opts);
  }
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    if (!rowwise_shape(s)) {
      const BlasWeights b = blas_weights(kind, s, p);
      if (kind.gate == Gate::kIndependent) f.g = b.gind;
      blas_forward<T>(args, s, xc.view({s.E, s.N, s.I}), b, f);
      return;
    }
    const RowwiseWeights<T> w = rowwise_weights<T>(kind, s, p, xc.const_data_ptr<T>());
    if (kind.gate == Gate::kIndependent) {
      f.g = new_cpu_tensor(p.G.sizes(), opts);
      std::copy(w.ptrs.gind, w.ptrs.gind + s.E * s.O, f.g.data_ptr<T>());
    }
    FwdOut<T*> out;
    out.y = f.y.data_ptr<T>();
    out.a = ptr_or_null<T>(f.a);
    out.m = ptr_or_null<T>(f.m);
    out.g = kind.gate == Gate::kInput ? f.g.data_ptr<T>() : nullptr;
    out.lx = ptr_or_null<T>(f.lx);
    dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
      if (lanes_shape(s)) {
        lanes_forward<T, ADD, MUL, GATE>(args, s, w.ptrs, out);
      } else {
        rowwise_forward<T, ADD, MUL, GATE>(args, s, w.ptrs, out);
      }
    });
  });
  return f;
}

Backward layer_backward(const LayerArgs& args, const LayerShape& s, const at::Tensor& grad_y, const at::Tensor& x,
                        const LayerParams& p, const Forward& saved, const PartGrads& parts) {
  const LayerKind& kind = args.kind;
  const bool nalu = kind.nalu();
  const bool sep = kind.sep();
  auto opts = x.options();
  const at::Tensor xc = x.contiguous();
  const at::Tensor dy = grad_y.contiguous();
  const at::Tensor a = nalu ? saved.a.contiguous() : at::Tensor();
  const at::Tensor m = kind.mul ? saved.m.contiguous() : at::Tensor();
  const at::Tensor g = kind.gate != Gate::kNone ? saved.g.contiguous() : at::Tensor();
  const at::Tensor lx = kind.mul ? saved.lx.contiguous() : at::Tensor();
  Backward r;
  if (args.compute_grad_x) r.grad_x = new_cpu_tensor(x.sizes(), opts);
  if (kind.gate != Gate::kNone) r.grad_G = new_cpu_tensor(p.G.sizes(), opts);
  if (p.G_bias.defined()) r.grad_G_bias = new_cpu_tensor(p.G_bias.sizes(), opts);

  dispatch_float(x.scalar_type(), [&]<typename T>() {
    SavedPtrs<const T*> sv;
    sv.dy = dy.const_data_ptr<T>();
    sv.a = cptr_or_null<T>(a);
    sv.m = cptr_or_null<T>(m);
    sv.g = cptr_or_null<T>(g);
    sv.lx = cptr_or_null<T>(lx);
    sv.ga = cptr_or_null<T>(parts.a);  // contiguous (ops.h)
    sv.gm = cptr_or_null<T>(parts.m);
    sv.gg = cptr_or_null<T>(parts.g);
    // Gradients w.r.t. W (and W_m), (E, I, O), before the weight construction's backward.
    const int64_t n = s.E * s.I * s.O;
    std::vector<T> dW(static_cast<size_t>(n * (sep ? 2 : 1)));
    if (!rowwise_shape(s)) {
      const BlasWeights b = blas_weights(kind, s, p);
      auto opts3 = at::TensorOptions().dtype(x.scalar_type());
      at::Tensor dW_t = at::from_blob(dW.data(), {s.E, s.I, s.O}, opts3);
      at::Tensor dWm_t = sep ? at::from_blob(dW.data() + n, {s.E, s.I, s.O}, opts3) : at::Tensor();
      blas_backward<T>(args, s, xc.view({s.E, s.N, s.I}), b, sv, lx, r.grad_x, dW_t, dWm_t, r.grad_G, r.grad_G_bias);
    } else {
      const RowwiseWeights<T> w = rowwise_weights<T>(kind, s, p, xc.const_data_ptr<T>(), args.compute_grad_x);
      GradPtrs<T> gp;
      gp.dx = ptr_or_null<T>(r.grad_x);
      gp.dW = dW.data();
      gp.dWm = sep ? dW.data() + n : nullptr;
      gp.dG = ptr_or_null<T>(r.grad_G);
      gp.dGb = ptr_or_null<T>(r.grad_G_bias);
      dispatch_kind(kind, [&]<bool ADD, bool MUL, Gate GATE>() {
        if (lanes_shape(s)) {
          lanes_backward<T, ADD, MUL, GATE>(args, s, w.ptrs, sv, gp);
        } else {
          rowwise_backward<T, ADD, MUL, GATE>(args, s, w.ptrs, sv, gp);
        }
      });
    }
    weight_backward_into<T>(dW.data(), p.W_hat, p.M_hat, r.grad_W_hat, r.grad_M_hat);
    if (sep) weight_backward_into<T>(dW.data() + n, p.W_hat_m, p.M_hat_m, r.grad_W_hat_m, r.grad_M_hat_m);
  });
  return r;
}

at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat) {
  at::Tensor out = new_cpu_tensor(W_hat.sizes(), W_hat.options());
  dispatch_float(W_hat.scalar_type(), [&]<typename T>() {
    build_weight<T>(W_hat.contiguous().const_data_ptr<T>(), M_hat.contiguous().const_data_ptr<T>(),
                    out.data_ptr<T>(), out.numel());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W, const at::Tensor& W_hat,
                                                   const at::Tensor& M_hat) {
  at::Tensor gw = new_cpu_tensor(W_hat.sizes(), W_hat.options());
  at::Tensor gm = new_cpu_tensor(W_hat.sizes(), W_hat.options());
  dispatch_float(W_hat.scalar_type(), [&]<typename T>() {
    weight_backward_pass<T>(grad_W.contiguous().const_data_ptr<T>(), W_hat.contiguous().const_data_ptr<T>(),
                            M_hat.contiguous().const_data_ptr<T>(), gw.data_ptr<T>(), gm.data_ptr<T>(), gw.numel());
  });
  return {gw, gm};
}

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
