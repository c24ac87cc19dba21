// checks.cpp: the pieces every family's argument checks are made of (checks.h).
#include "common/checks.h"

#include <ATen/EmptyTensor.h>
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

at::Tensor empty_grad(const at::Tensor& like) {
  // on the CPU without at::empty's dispatcher round trip (several thousand instructions a call)
  return like.is_cpu() ? at::Tensor(at::detail::empty_cpu({0}, like.options())) : at::empty({0}, like.options());
}

void check_like(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes,
                const at::Tensor& like) {
  TORCH_CHECK(t.defined(), op, ": argument '", name, "' must be a tensor, got None");
  TORCH_CHECK(t.sizes() == sizes, op, ": argument '", name, "' must have shape ", sizes_str(sizes),
              ", got ", sizes_str(t.sizes()));
  check_matches(op, name, t, "x", like);
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
