// checks.cpp: argument checks of the NAU and NMU ops and their device-generic ATen parts (ops/nau_nmu/checks.h).
#include "ops/nau_nmu/checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace nalu_cuda {
namespace {

// Views of x, grad_y as (E, N, I) / (E, N, O) and W as (E, I, O).
at::Tensor rows(const LayerShape& s, const at::Tensor& t, int64_t last) { return t.reshape({s.E, s.N, last}); }
at::Tensor weights(const LayerShape& s, const at::Tensor& W) { return W.reshape({s.E, s.I, s.O}); }

}  // namespace

LayerShape check_unit(const char* op, const at::Tensor& x, const at::Tensor& W) {
  check_floating(op, "x", x);
  check_floating(op, "W", W);
  TORCH_CHECK(W.dim() == 2 || W.dim() == 3, op, ": argument 'W' must have shape (in, out) or (E, in, out), got ",
              sizes_str(W.sizes()));
  check_matches(op, "W", W, "x", x);
  return layer_shape(op, x, W, "W");
}

LayerShape check_unit_backward(const char* op, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& W) {
  const LayerShape s = check_unit(op, x, W);
  check_like(op, "grad_y", grad_y, s.out_sizes, x);
  return s;
}

// A few outputs (the arithmetic tasks' O = 1 or 2): the products with O as the rows of the result,
// (W^T x^T)^T and (grad_y^T x)^T, which batched BLAS runs 1.5x and 3.8x faster than x W and x^T grad_y
// at E=100, B=128, I=100, O=2 (CPU, MKL); the same sums.
constexpr int64_t kNauFewOutputs = 16;

at::Tensor nau_forward_math(const LayerShape& s, const at::Tensor& x, const at::Tensor& W) {
  const at::Tensor Wc = weights(s, W).clamp(-1, 1);
  if (s.O <= kNauFewOutputs) {
    return at::bmm(Wc.transpose(1, 2), rows(s, x, s.I).transpose(1, 2)).transpose(1, 2).contiguous().reshape(s.out_sizes);
  }
  return at::bmm(rows(s, x, s.I), Wc).reshape(s.out_sizes);
}

std::tuple<at::Tensor, at::Tensor> nau_backward_math(const LayerShape& s, const at::Tensor& grad_y,
                                                     const at::Tensor& x, const at::Tensor& W, bool compute_grad_x) {
  const at::Tensor W3 = weights(s, W);
  const at::Tensor gy = rows(s, grad_y, s.O);
  // d clamp(W) / dW = 1 on [-1, 1] (ends included, as torch.clamp's derivative), else 0.
  const at::Tensor inside = at::logical_and(W3 >= -1, W3 <= 1);
  const at::Tensor xtg = s.O <= kNauFewOutputs ? at::bmm(gy.transpose(1, 2), rows(s, x, s.I)).transpose(1, 2)
                                               : at::bmm(rows(s, x, s.I).transpose(1, 2), gy);
  const at::Tensor gW = at::where(inside, xtg, 0).reshape(W.sizes());
  at::Tensor gx = compute_grad_x ? at::bmm(gy, W3.clamp(-1, 1).transpose(1, 2)).reshape(x.sizes()) : empty_grad(x);
  return {gx, gW};
}

std::tuple<at::Tensor, at::Tensor> nmu_backward_composite(const LayerShape& s, const at::Tensor& grad_y,
                                                          const at::Tensor& x, const at::Tensor& W) {
  const at::Tensor x4 = x.reshape({s.E, s.N, s.I, 1});
  const at::Tensor W4 = W.reshape({s.E, 1, s.I, s.O});
  const at::Tensor f = x4 * W4 + (1 - W4);  // (E, N, I, O)
  at::Tensor excl;
  if (s.I == 0) {
    excl = f;
  } else {
    const at::Tensor one = at::ones_like(f.narrow(2, 0, 1));
    const at::Tensor before = at::cumprod(at::cat({one, f.narrow(2, 0, s.I - 1)}, 2), 2);
    const at::Tensor after = at::cumprod(at::cat({f.narrow(2, 1, s.I - 1), one}, 2).flip({2}), 2).flip({2});
    excl = before * after;
  }
  const at::Tensor g = grad_y.reshape({s.E, s.N, 1, s.O}) * excl;
  const at::Tensor gx = (g * W4).sum(3).reshape(x.sizes());
  const at::Tensor gW = (g * (x4 - 1)).sum(1).reshape(W.sizes());
  return {gx, gW};
}

}  // namespace nalu_cuda
