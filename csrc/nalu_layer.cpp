// nalu_layer.cpp: argument checks shared by the CPU and CUDA kernels, and the pieces the checks of
// every unit are made of (see nalu_layer.h).
#include "nalu_layer.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace nalu_cuda {

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

void check_matches(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                   const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": argument '", name,
              "' must have the dtype of '", ref_name, "' (", ref.scalar_type(), "), got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": argument '", name, "' must be on the device of '",
              ref_name, "' (", ref.device(), "), got ", t.device());
}

namespace {
const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(dtype);
  }
}
}  // namespace

void check_scalar(const char* op, const char* name, double value, at::ScalarType dtype, bool positive) {
  const char* what = positive ? "a positive finite number" : "a finite number";
  TORCH_CHECK(std::isfinite(value) && (!positive || value > 0.0), op, ": argument '", name, "' must be ", what,
              ", got ", value);
  if (dtype == at::kDouble) return;
  // The narrower types compute in float32 (acc_t); the range test comes first, as converting a
  // double beyond float's range is undefined behaviour.
  const bool fits = std::fabs(value) <= static_cast<double>(std::numeric_limits<float>::max());
  const float narrow = fits ? static_cast<float>(value) : 0.0f;
  TORCH_CHECK(fits && (!positive || narrow > 0.0f), op, ": argument '", name, "' must be ", what,
              " in float32 (the precision the op computes in for tensors of dtype ", dtype_name(dtype), "), got ",
              value, ", which is ",
              fits ? "0" : (value > 0 ? "inf" : "-inf"), " there");
}

LayerShape layer_shape(const char* op, const at::Tensor& x, const at::Tensor& W, const char* w_name) {
  LayerShape s;
  s.ensemble = W.dim() == 3;
  s.E = s.ensemble ? W.size(0) : 1;
  s.I = W.size(-2);
  s.O = W.size(-1);
  if (s.ensemble) {
    TORCH_CHECK(x.dim() >= 2 && x.size(0) == s.E && x.size(-1) == s.I, op,
                ": argument 'x' must have shape (E, ..., in) = (", s.E, ", ..., ", s.I,
                ") to match ensemble weights '", w_name, "' ", sizes_str(W.sizes()), ", got ",
                sizes_str(x.sizes()));
  } else {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == s.I, op, ": argument 'x' must have shape (..., in) = (..., ",
                s.I, ") to match '", w_name, "' ", sizes_str(W.sizes()), ", got ", sizes_str(x.sizes()));
  }
  // Rows per member: the product of the batch dimensions (after E for an ensemble).
  s.N = s.ensemble ? c10::multiply_integers(x.sizes().slice(1, x.dim() - 2))
                   : c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  s.out_sizes = x.sizes().vec();
  s.out_sizes.back() = s.O;
  return s;
}

at::Tensor empty_grad(const at::Tensor& like) { return at::empty({0}, like.options()); }

void check_weight_pair(const char* op, const at::Tensor& W_hat, const at::Tensor& M_hat,
                       const char* w_name, const char* m_name, bool layer_shape) {
  check_floating(op, w_name, W_hat);
  check_floating(op, m_name, M_hat);
  TORCH_CHECK(!layer_shape || W_hat.dim() == 2 || W_hat.dim() == 3, op, ": argument '", w_name,
              "' must have shape (in, out) or (E, in, out), got ", sizes_str(W_hat.sizes()));
  TORCH_CHECK(M_hat.sizes() == W_hat.sizes(), op, ": argument '", m_name,
              "' must have the shape of '", w_name, "' ", sizes_str(W_hat.sizes()), ", got ",
              sizes_str(M_hat.sizes()));
  check_matches(op, m_name, M_hat, w_name, W_hat);
}

LayerShape check_layer(const char* op, const LayerKind& kind, const at::Tensor& x,
                       const LayerParams& p, double eps) {
  check_floating(op, "x", x);
  check_weight_pair(op, p.W_hat, p.M_hat);
  check_matches(op, "W_hat", p.W_hat, "x", x);

  const LayerShape s = layer_shape(op, x, p.W_hat, "W_hat");

  if (kind.mul && kind.add && !kind.tied) {
    TORCH_CHECK(p.W_hat_m.defined() && p.M_hat_m.defined(), op,
                ": separate multiplicative weights need both 'W_hat_m' and 'M_hat_m', got ",
                p.W_hat_m.defined() ? "only 'W_hat_m'" : (p.M_hat_m.defined() ? "only 'M_hat_m'" : "neither"));
    check_weight_pair(op, p.W_hat_m, p.M_hat_m, "W_hat_m", "M_hat_m");
    TORCH_CHECK(p.W_hat_m.sizes() == p.W_hat.sizes(), op,
                ": argument 'W_hat_m' must have the shape of 'W_hat' ", sizes_str(p.W_hat.sizes()),
                ", got ", sizes_str(p.W_hat_m.sizes()));
    check_matches(op, "W_hat_m", p.W_hat_m, "x", x);
  }
  if (kind.gate != Gate::kNone) {
    check_floating(op, "G", p.G);
    check_matches(op, "G", p.G, "x", x);
    if (kind.gate == Gate::kInput) {
      TORCH_CHECK(p.G.sizes() == p.W_hat.sizes(), op,
                  ": argument 'G' of an input-dependent gate must have the shape of 'W_hat' ",
                  sizes_str(p.W_hat.sizes()), ", got ", sizes_str(p.G.sizes()));
    } else {
      std::vector<int64_t> want = s.ensemble ? std::vector<int64_t>{s.E, s.O} : std::vector<int64_t>{s.O};
      TORCH_CHECK(p.G.sizes() == at::IntArrayRef(want), op,
                  ": argument 'G' of an input-independent gate must have shape ",
                  s.ensemble ? "(E, out) = " : "(out,) = ", sizes_str(want), ", got ",
                  sizes_str(p.G.sizes()));
    }
  }
  if (kind.mul) check_eps(op, eps, x.scalar_type());
  return s;
}

void check_like(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes,
                const at::Tensor& like) {
  TORCH_CHECK(t.defined(), op, ": argument '", name, "' must be a tensor, got None");
  TORCH_CHECK(t.sizes() == sizes, op, ": argument '", name, "' must have shape ", sizes_str(sizes),
              ", got ", sizes_str(t.sizes()));
  check_matches(op, name, t, "x", like);
}

void check_saved(const char* op, const LayerKind& kind, const LayerShape& s, const at::Tensor& x,
                 const at::Tensor& G, const at::Tensor& grad_y, const at::Tensor& a,
                 const at::Tensor& m, const at::Tensor& g, const at::Tensor& lx) {
  check_like(op, "grad_y", grad_y, s.out_sizes, x);
  if (kind.add && kind.mul) {
    check_like(op, "a", a, s.out_sizes, x);
    check_like(op, "m", m, s.out_sizes, x);
    check_like(op, "g", g, kind.gate == Gate::kInput ? at::IntArrayRef(s.out_sizes) : G.sizes(), x);
  } else if (kind.mul) {
    check_like(op, "y", m, s.out_sizes, x);
  }
  if (kind.mul) check_like(op, "lx", lx, x.sizes(), x);
}

void check_dtype_supported(const char* op, const at::Tensor& x, const char* device_name,
                           const std::vector<at::ScalarType>& supported) {
  for (auto st : supported) {
    if (x.scalar_type() == st) return;
  }
  std::ostringstream os;
  for (size_t i = 0; i < supported.size(); ++i) os << (i ? ", " : "") << supported[i];
  TORCH_CHECK(false, op, ": the ", device_name, " kernel supports dtypes ", os.str(), ", got ",
              x.scalar_type(), " (backend=\"reference\" runs any dtype)");
}

}  // namespace nalu_cuda
