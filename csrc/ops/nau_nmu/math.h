// math.h: the scalar math of the product units, shared by the CPU and CUDA kernels.
//
// A product unit reduces I factors per output by multiplication:
//   z[b, o] = prod_i f(W[i, o], x[b, i])
// NMU (Madsen & Johansen):  f = W x + 1 - W,   df/dx = W,   df/dW = x - 1
// Its gradients need, for every input i, the product of the other factors (the "exclusive
// product") E_i = prod_{k != i} f_k:
//   dz/dx_i = E_i df/dx(i),  dz/dW_i = E_i df/dW(i)
// E_i is built from an exclusive prefix product (k < i) and an exclusive suffix product (k > i),
// never as z / f_i, which is 0 / 0 when a factor is zero and inexact when one is tiny.
//
// The same pattern serves every unit of this family: iNALU's sign-recovery product
// msv = prod_i (sign(x_i) |W_m[i, o]| + 1 - |W_m[i, o]|) is an NMU product of sign(x) and |W_m|,
// and NRU/NMRU are products of other factor maps. A new unit needs only its factor and derivative
// functions here; `exclusive_products` in csrc/ops/nau_nmu/cpu/nmu_kernels.h (host, vectorised over rows,
// compiled per instruction set with the kernels that call it) and `warp_exclusive_products` in
// csrc/ops/nau_nmu/cuda/nau_nmu_kernels.cu (device: one warp per product, exact for zero factors, in a fixed
// order) are written against a factor functor and a visitor and can be reused as they are.
#pragma once

#include "ops/nac_nalu/math.h"  // NALU_HD

namespace nalu_cuda {
namespace math {

// NMU factor f = W x + 1 - W (W = 0 gives the identity factor 1, W = 1 gives x).
template <typename A>
NALU_HD A nmu_factor(A w, A x) {
  return w * x + (A(1) - w);
}
// df/dx = W
template <typename A>
NALU_HD A nmu_dfactor_dx(A w, A /*x*/) {
  return w;
}
// df/dW = x - 1
template <typename A>
NALU_HD A nmu_dfactor_dw(A /*w*/, A x) {
  return x - A(1);
}

// Madsen & Johansen's sparsity regulariser, per weight, on the parameter W as stored (the published
// runs keep it in range by the projection): NAU min(|W|, 1 - |W|), NMU min(|W|, |1 - W|), and their
// derivatives d/dW (torch.minimum's gradient: half to each side on a tie; abs: sign, 0 at 0). The
// static task's native training steps (csrc/experiments/: CPU and CUDA) train with them.
template <typename A>
NALU_HD A nau_sparsity(A w) {
  const A aw = w < A(0) ? -w : w;
  return aw < A(1) - aw ? aw : A(1) - aw;
}
template <typename A>
NALU_HD A nmu_sparsity(A w) {
  const A aw = w < A(0) ? -w : w;
  const A om = A(1) - w < A(0) ? w - A(1) : A(1) - w;
  return aw < om ? aw : om;
}
template <typename A>
NALU_HD A nau_sparsity_grad(A w) {
  const A sw = w > A(0) ? A(1) : (w < A(0) ? A(-1) : A(0));
  const A aw = w < A(0) ? -w : w;
  const A other = A(1) - aw;
  return aw < other ? sw : (aw > other ? -sw : A(0));
}
template <typename A>
NALU_HD A nmu_sparsity_grad(A w) {
  const A sw = w > A(0) ? A(1) : (w < A(0) ? A(-1) : A(0));
  const A aw = w < A(0) ? -w : w;
  const A v = A(1) - w;
  const A sv = v > A(0) ? A(1) : (v < A(0) ? A(-1) : A(0));
  const A om = v < A(0) ? -v : v;
  return aw < om ? sw : (aw > om ? -sv : A(0.5) * (sw - sv));
}


}  // namespace math
}  // namespace nalu_cuda
