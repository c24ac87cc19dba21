// power_layer.cpp: argument checks of the power units and iNALU (see power_layer.h). The dtype,
// device and shape wording is that of nalu_layer.cpp.
#include "power_layer.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace nalu_cuda {
namespace {

std::string sizes_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": argument '", name, "' must be a tensor, got None");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": argument '", name,
              "' must be a floating-point tensor, got dtype ", t.scalar_type());
}

void check_matches(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": argument '", name, "' must have the dtype of 'x' (",
              x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": argument '", name, "' must be on the device of 'x' (", x.device(),
              "), got ", t.device());
}

void check_eps(const char* op, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps > 0.0, op, ": argument 'eps' must be a positive finite number, got ", eps);
}

}  // namespace

LayerShape check_npu(const char* op, const at::Tensor& x, const at::Tensor& W_r, const at::Tensor& W_i,
                     const at::Tensor& g, double eps) {
  check_floating(op, "x", x);
  check_floating(op, "W_r", W_r);
  check_matches(op, "W_r", W_r, x);
  TORCH_CHECK(W_r.dim() == 2 || W_r.dim() == 3, op,
              ": argument 'W_r' must have shape (in, out) or (E, in, out), got ", sizes_str(W_r.sizes()));
  if (W_i.defined()) {
    check_floating(op, "W_i", W_i);
    check_matches(op, "W_i", W_i, x);
    TORCH_CHECK(W_i.sizes() == W_r.sizes(), op, ": argument 'W_i' must have the shape of 'W_r' ",
                sizes_str(W_r.sizes()), ", got ", sizes_str(W_i.sizes()));
  }
  LayerShape s;
  s.ensemble = W_r.dim() == 3;
  s.E = s.ensemble ? W_r.size(0) : 1;
  s.I = W_r.size(-2);
  s.O = W_r.size(-1);
  if (s.ensemble) {
    TORCH_CHECK(x.dim() >= 2 && x.size(0) == s.E && x.size(-1) == s.I, op,
                ": argument 'x' must have shape (E, ..., in) = (", s.E, ", ..., ", s.I,
                ") to match ensemble weights 'W_r' ", sizes_str(W_r.sizes()), ", got ", sizes_str(x.sizes()));
  } else {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == s.I, op, ": argument 'x' must have shape (..., in) = (..., ", s.I,
                ") to match 'W_r' ", sizes_str(W_r.sizes()), ", got ", sizes_str(x.sizes()));
  }
  check_floating(op, "g", g);
  check_matches(op, "g", g, x);
  const std::vector<int64_t> want = s.ensemble ? std::vector<int64_t>{s.E, s.I} : std::vector<int64_t>{s.I};
  TORCH_CHECK(g.sizes() == at::IntArrayRef(want), op, ": argument 'g' (the relevance gate) must have shape ",
              s.ensemble ? "(E, in) = " : "(in,) = ", sizes_str(want), ", got ", sizes_str(g.sizes()));
  check_eps(op, eps);
  s.N = s.ensemble ? c10::multiply_integers(x.sizes().slice(1, x.dim() - 2))
                   : c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  s.out_sizes = x.sizes().vec();
  s.out_sizes.back() = s.O;
  return s;
}

void check_npu_saved(const char* op, const LayerShape& s, const at::Tensor& x, const at::Tensor& grad_y,
                     const at::Tensor& y, const at::Tensor& sy, const at::Tensor& lr) {
  check_like(op, "grad_y", grad_y, s.out_sizes, x);
  check_like(op, "y", y, s.out_sizes, x);
  check_like(op, "s", sy, s.out_sizes, x);
  check_like(op, "lr", lr, x.sizes(), x);
}

LayerShape check_inalu(const char* op, const at::Tensor& x, const at::Tensor& W_hat, const at::Tensor& M_hat,
                       const at::Tensor& W_hat_m, const at::Tensor& M_hat_m, const at::Tensor& G, double eps,
                       double omega) {
  LayerParams p;
  p.W_hat = W_hat;
  p.M_hat = M_hat;
  p.W_hat_m = W_hat_m;
  p.M_hat_m = M_hat_m;
  p.G = G;
  LayerShape s = check_layer(op, kInalu, x, p, eps);
  TORCH_CHECK(std::isfinite(omega), op, ": argument 'omega' must be a finite number, got ", omega);
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
