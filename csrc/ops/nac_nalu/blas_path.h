// blas_path.h: the blas path of NAC+, NAC* and NALU (layers wider than kRowwiseMaxOut), written
// once for both devices: an elementwise prologue, the batched products, an elementwise epilogue.
// The products are ATen's bmm / baddbmm on the call's device (BLAS on the CPU, cuBLAS on the GPU,
// batched over the ensemble); the device's code supplies the elementwise steps as callables
// (csrc/ops/nac_nalu/cpu/blas.h: fused vectorised loops; csrc/ops/nac_nalu/cuda/nac_nalu_cuda.cpp: the prologue and
// epilogue kernels of blas_kernels.cu). Which products run, in which order and into which
// buffers is decided here only, so both devices compute the same sums in the same order.
//
// Shapes as in layer_types.h: x3 (E, N, I), weights (E, I, O), outputs (E, N, O).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/sum.h>

#include "ops/nac_nalu/checks.h"

namespace nalu_cuda {
namespace blas_path {

// The constructed weights of a call: W = tanh(W_hat) sigmoid(M_hat), W_m (W itself when tied),
// and an input gate's G, each (E, I, O), and its bias Gb, (E, O). Undefined where the kind has none.
struct Weights {
  at::Tensor W, Wm, G, Gb;
};

// Forward. Before the call the device has built `w`, written lx (NAC*, NALU) into f.lx and an
// independent gate's sigmoid(G) into f.g; f's tensors have the caller's shapes (the products
// write them through (E, N, O) / (E, N, I) views). The products leave the pre-activations
// u (NAC*: in f.y; NALU: in f.m) and z (input gate: in f.g); then `epilogue()` makes
// m = exp(u), g = sigmoid(z) and y = g a + (1 - g) m. NAC+ has no epilogue.
template <typename Epilogue>
void forward(const LayerArgs& args, const Dims& d, const at::Tensor& x3, const Weights& w, Forward& f,
             Epilogue&& epilogue) {
  const LayerKind& kind = args.kind;
  at::Tensor y3 = f.y.view({d.E, d.N, d.O});
  if (!kind.mul) {  // NAC+
    at::bmm_out(y3, x3, w.W);
    return;
  }
  const at::Tensor lx3 = f.lx.view({d.E, d.N, d.I});
  if (!kind.add) {  // NAC*: u into y
    at::bmm_out(y3, lx3, w.W);
  } else {
    at::Tensor a3 = f.a.view({d.E, d.N, d.O});
    at::Tensor u3 = f.m.view({d.E, d.N, d.O});
    at::bmm_out(a3, x3, w.W);
    at::bmm_out(u3, lx3, w.Wm);
    if (kind.gate == Gate::kInput) {
      at::Tensor z3 = f.g.view({d.E, d.N, d.O});
      if (w.Gb.defined()) {  // z = G_bias + x G
        at::baddbmm_out(z3, w.Gb.view({d.E, 1, d.O}).expand({d.E, d.N, d.O}), x3, w.G);
      } else {
        at::bmm_out(z3, x3, w.G);
      }
    }
  }
  epilogue();
}

// The gradient at one set of pre-activations, written into the backward's one (E, N, O) buffer:
//   da = g dy;  du = (1 - g) dy m;  dz = (a - m) dy g (1 - g)   (NAC+: da = dy; NAC*: du = dy y)
enum class OutputGrad { kDa, kDu, kDz };

// Backward. The output gradients du, da, dz go in turn through `buf` (E, N, O), the only
// batch-sized scratch: `fill(which)` writes one of them (the device's first fill may also build
// `w`: no product reads w before it). dx (undefined: not asked for) is built in place:
//   du W_m^T, scaled by sign(x) / (|x| + eps), + da W^T, + dz G^T.
// dW, dWm are the gradients w.r.t. W, W_m (E, I, O; dWm undefined when tied: du's product adds
// into dW); dG is G's gradient in G's shape, dGb the gate bias's (undefined: none), sum_n dz. `after_weight_products()` runs once dW, dWm are final
// and dx holds du W_m^T only: there the device scales dx (NAC*, NALU) and may run the weight
// construction's backward.
template <typename Fill, typename AfterWeightProducts>
void backward(const LayerArgs& args, const Dims& d, const at::Tensor& x3, const at::Tensor& lx, const Weights& w,
              const at::Tensor& buf, const at::Tensor& dx, const at::Tensor& dW, const at::Tensor& dWm,
              const at::Tensor& dG, const at::Tensor& dGb, Fill&& fill, AfterWeightProducts&& after_weight_products) {
  const LayerKind& kind = args.kind;
  const bool sep = kind.sep();
  const at::Tensor xT = x3.transpose(1, 2);
  at::Tensor dx3 = dx.defined() ? dx.view({d.E, d.N, d.I}) : at::Tensor();
  at::Tensor dWt = dW, dWmt = dWm;  // bmm_out takes non-const outputs
  if (kind.mul) {
    fill(OutputGrad::kDu);
    const at::Tensor lxT = lx.view({d.E, d.N, d.I}).transpose(1, 2);
    at::bmm_out(sep ? dWmt : dWt, lxT, buf);
    if (dx.defined()) at::bmm_out(dx3, buf, w.Wm.transpose(1, 2));
  }
  if (kind.add) {
    fill(OutputGrad::kDa);
    if (kind.mul && !sep) {
      dWt.baddbmm_(xT, buf);
    } else {
      at::bmm_out(dWt, xT, buf);
    }
  }
  after_weight_products();
  if (dx.defined() && kind.add) {
    if (kind.mul) {
      dx3.baddbmm_(buf, w.W.transpose(1, 2));
    } else {
      at::bmm_out(dx3, buf, w.W.transpose(1, 2));
    }
  }
  if (kind.gate != Gate::kNone) {
    fill(OutputGrad::kDz);
    if (kind.gate == Gate::kInput) {
      at::Tensor dG3 = dG.view({d.E, d.I, d.O});
      at::bmm_out(dG3, xT, buf);
      if (dx.defined()) dx3.baddbmm_(buf, w.G.transpose(1, 2));
      if (dGb.defined()) {
        at::Tensor dGb2 = dGb.view({d.E, d.O});
        at::sum_out(dGb2, buf, at::IntArrayRef{1});
      }
    } else {
      at::Tensor dG2 = dG.view({d.E, d.O});
      at::sum_out(dG2, buf, at::IntArrayRef{1});
    }
  }
}

}  // namespace blas_path
}  // namespace nalu_cuda
