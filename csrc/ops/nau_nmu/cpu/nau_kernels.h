// nau_kernels.h: the NAU's CPU kernels, on the NAC+'s rowwise path (csrc/ops/nac_nalu/cpu/).
// Included by csrc/common/cpu/kernels.h after the NAC/NALU kernels (once per instruction set,
// NALU_CPU_ISA defined); it includes nothing itself and opens its namespaces itself. The ops
// (checks, registration) are in nau_nmu_cpu.cpp.

namespace nalu_cuda {
namespace cpu {
namespace NALU_CPU_ISA {

// ---------------------------------------------------------------------------------------------
// NAU, y = x clamp(W, -1, 1), on the rowwise path (O <= kRowwiseMaxOut; the caller sends wider
// layers to BLAS): the NAC+'s kernels with the clamped weights in place of tanh * sigmoid. At the
// arithmetic tasks' first layer (E=100, B=128, I=100, O=2) the two batched BLAS products it
// replaces spent about 20x the time it takes to read x.
// ---------------------------------------------------------------------------------------------

at::Tensor nau_forward(const LayerShape& s, const at::Tensor& x, const at::Tensor& W) {
  TORCH_INTERNAL_ASSERT(rowwise_shape(s), "nalu_cuda: nau_forward's rowwise path called with O = ", s.O);
  const at::Tensor xc = x.contiguous();
  const at::Tensor Wc = W.contiguous();
  at::Tensor y = at::empty(s.out_sizes, x.options());
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    const int64_t n = s.E * s.I * s.O;
    std::vector<T> buf(static_cast<size_t>(2 * n));
    const T* w = Wc.const_data_ptr<T>();
    for (int64_t k = 0; k < n; ++k) buf[k] = nm::clamp_unit(w[k]);
    transpose_last2<T>(buf.data(), buf.data() + n, s.E, s.I, s.O);
    Ptrs<T> p;
    p.x = xc.const_data_ptr<T>();
    p.W = p.Wm = buf.data() + n;
    FwdOut<T*> out;
    out.y = y.data_ptr<T>();
    const LayerArgs args{kNacAdd};  // the NAC+'s kernels on the clamped weights
    if (lanes_shape(s)) {
      lanes_forward<T, true, false, Gate::kNone>(args, s, p, out);
    } else {
      rowwise_forward<T, true, false, Gate::kNone>(args, s, p, out);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> nau_backward(const LayerShape& s, const at::Tensor& grad_y, const at::Tensor& x,
                                                const at::Tensor& W, bool compute_grad_x) {
  TORCH_INTERNAL_ASSERT(rowwise_shape(s), "nalu_cuda: nau_backward's rowwise path called with O = ", s.O);
  const at::Tensor xc = x.contiguous();
  const at::Tensor dy = grad_y.contiguous();
  const at::Tensor Wc = W.contiguous();
  at::Tensor gx = compute_grad_x ? at::empty(x.sizes(), x.options()) : empty_grad(x);
  at::Tensor gW = at::empty(W.sizes(), W.options());
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    const int64_t n = s.E * s.I * s.O;
    const T* w = Wc.const_data_ptr<T>();
    std::vector<T> buf(static_cast<size_t>(compute_grad_x ? 2 * n : 0));
    Ptrs<T> p;
    p.x = xc.const_data_ptr<T>();
    if (compute_grad_x) {
      for (int64_t k = 0; k < n; ++k) buf[k] = nm::clamp_unit(w[k]);
      transpose_last2<T>(buf.data(), buf.data() + n, s.E, s.I, s.O);
      p.W = p.Wm = buf.data() + n;
    }
    SavedPtrs<const T*> sv;
    sv.dy = dy.const_data_ptr<T>();
    GradPtrs<T> gp;
    gp.dx = compute_grad_x ? gx.data_ptr<T>() : nullptr;
    gp.dW = gW.data_ptr<T>();
    const LayerArgs args{kNacAdd, 0.0, compute_grad_x};
    if (lanes_shape(s)) {
      lanes_backward<T, true, false, Gate::kNone>(args, s, p, sv, gp);
    } else {
      rowwise_backward<T, true, false, Gate::kNone>(args, s, p, sv, gp);
    }
    T* g = gW.data_ptr<T>();
    for (int64_t k = 0; k < n; ++k) {
      if (!nm::clamp_unit_passes(w[k])) g[k] = T(0);
    }
  });
  return {gx, gW};
}

}  // namespace NALU_CPU_ISA
}  // namespace cpu
}  // namespace nalu_cuda
