// checks.cpp: argument checks of the power units and iNALU (see ops/power/checks.h), built from the
// pieces of ops/nac_nalu/checks.h, so that the dtype, device and shape wording is that of every other op.
#include "ops/power/checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <vector>

namespace nalu_cuda {

LayerShape check_npu(const char* op, const at::Tensor& x, const at::Tensor& W_r, const at::Tensor& W_i,
                     const at::Tensor& g, double eps) {
  check_floating(op, "x", x);
  check_floating(op, "W_r", W_r);
  check_matches(op, "W_r", W_r, "x", x);
  TORCH_CHECK(W_r.dim() == 2 || W_r.dim() == 3, op,
              ": argument 'W_r' must have shape (in, out) or (E, in, out), got ", sizes_str(W_r.sizes()));
  if (W_i.defined()) {
    check_floating(op, "W_i", W_i);
    check_matches(op, "W_i", W_i, "x", x);
    TORCH_CHECK(W_i.sizes() == W_r.sizes(), op, ": argument 'W_i' must have the shape of 'W_r' ",
                sizes_str(W_r.sizes()), ", got ", sizes_str(W_i.sizes()));
  }
  const LayerShape s = layer_shape(op, x, W_r, "W_r");
  check_floating(op, "g", g);
  check_matches(op, "g", g, "x", x);
  const std::vector<int64_t> want = s.ensemble ? std::vector<int64_t>{s.E, s.I} : std::vector<int64_t>{s.I};
  TORCH_CHECK(g.sizes() == at::IntArrayRef(want), op, ": argument 'g' (the relevance gate) must have shape ",
              s.ensemble ? "(E, in) = " : "(in,) = ", sizes_str(want), ", got ", sizes_str(g.sizes()));
  check_eps(op, eps, x.scalar_type());
  return s;
}

void check_npu_saved(const char* op, const LayerShape& s, const at::Tensor& x, const at::Tensor& grad_y,
                     const at::Tensor& y, const at::Tensor& sy, const at::Tensor& lr) {
  check_like(op, "grad_y", grad_y, s.out_sizes, x);
  check_like(op, "y", y, s.out_sizes, x);
  check_like(op, "s", sy, s.out_sizes, x);
  check_like(op, "lr", lr, x.sizes(), x);
}

std::tuple<at::Tensor, at::Tensor> npu_weight_grads(const at::Tensor& dWc, const at::Tensor& W_r, const at::Tensor& x,
                                                    bool complex) {
  if (!complex) return {dWc.reshape(W_r.sizes()), empty_grad(x)};
  const int64_t O = W_r.size(-1);
  return {dWc.narrow(2, 0, O).contiguous().reshape(W_r.sizes()), dWc.narrow(2, O, O).contiguous().reshape(W_r.sizes())};
}

LayerParams inalu_params(const at::Tensor& W_hat, const at::Tensor& M_hat, const at::Tensor& W_hat_m,
                         const at::Tensor& M_hat_m, const at::Tensor& G) {
  LayerParams p;
  p.W_hat = W_hat;
  p.M_hat = M_hat;
  p.W_hat_m = W_hat_m;
  p.M_hat_m = M_hat_m;
  p.G = G;
  return p;
}

LayerShape check_inalu(const char* op, const at::Tensor& x, const LayerParams& p, double eps, double omega) {
  LayerShape s = check_layer(op, kInalu, x, p, eps);
  check_scalar(op, "omega", omega, x.scalar_type(), false);
  return s;
}

void check_inalu_saved(const char* op, const LayerShape& s, const at::Tensor& x, const at::Tensor& grad_y,
                       const at::Tensor& a, const at::Tensor& u, const at::Tensor& msv, const at::Tensor& lx) {
  check_like(op, "grad_y", grad_y, s.out_sizes, x);
  check_like(op, "a", a, s.out_sizes, x);
  check_like(op, "u", u, s.out_sizes, x);
  check_like(op, "msv", msv, s.out_sizes, x);
  check_like(op, "lx", lx, x.sizes(), x);
}

}  // namespace nalu_cuda
