// flat_adam_cuda.cpp: the CUDA kernel of nalu_cuda::flat_adam_step_resident (TORCH_LIBRARY_IMPL(nalu_cuda,
// CUDA)), the resident Adam step of FlatAdam.step_resident in two launches (csrc/experiments/cpu/flat_adam_cuda.cu).
// It checks its arguments (on the host, from their metadata alone: nothing is read back from the device),
// allocates the result and the scan's workspace through the caching allocator, and launches on param's
// device and current stream without waiting, so a CUDA graph can capture it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <sstream>
#include <string>

#include "experiments/cuda/flat_adam_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

using at::Tensor;

constexpr const char* kFn = "flat_adam_step_resident";

std::string describe(const Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream s;
  s << "a " << (t.is_contiguous() ? "" : "non-contiguous ") << t.scalar_type() << " tensor on " << t.device()
    << " of shape " << t.sizes();
  return s.str();
}

// t: on `device`, contiguous, of `dtype` and `shape`; `what` says all that in words for the message.
void check_arg(const char* name, const Tensor& t, const c10::Device& device, at::ScalarType dtype,
               at::IntArrayRef shape, const std::string& what) {
  TORCH_CHECK(t.defined() && t.device() == device && t.is_contiguous() && t.scalar_type() == dtype &&
                  t.sizes() == shape,
              kFn, ": argument '", name, "' must be ", what, ", got ", describe(t));
}

Tensor flat_adam_step_resident(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                               const Tensor& exp_avg_sq, const Tensor& segments, const Tensor& frozen,
                               const Tensor& step_t, double lr, double beta1, double beta2, double eps) {
  TORCH_CHECK(param.defined() && param.is_cuda() && param.dim() == 1 && param.is_contiguous() &&
                  (param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble),
              kFn, ": argument 'param' must be a contiguous 1-D float32 or float64 CUDA tensor, got ",
              describe(param));
  const c10::Device dev = param.device();
  const int64_t n = param.numel();
  std::ostringstream like;
  like << "a contiguous " << param.scalar_type() << " tensor on " << dev << " of shape [" << n << "] (as 'param')";
  check_arg("grad", grad, dev, param.scalar_type(), param.sizes(), like.str());
  check_arg("exp_avg", exp_avg, dev, param.scalar_type(), param.sizes(), like.str());
  check_arg("exp_avg_sq", exp_avg_sq, dev, param.scalar_type(), param.sizes(), like.str());
  TORCH_CHECK(frozen.defined() && frozen.dim() == 1 && frozen.numel() >= 1, kFn,
              ": argument 'frozen' must be a 1-D bool tensor with one flag per member (at least one), got ",
              describe(frozen));
  const int64_t E = frozen.numel();
  std::ostringstream where;
  where << " on " << dev << " (param's device)";
  check_arg("frozen", frozen, dev, at::kBool, {E}, "a contiguous 1-D bool tensor" + where.str());
  TORCH_CHECK(segments.defined() && segments.dim() == 2, kFn,
              ": argument 'segments' must be an int64 tensor of shape (P, 2) (offset, per_member), got ",
              describe(segments));
  const int64_t P = segments.size(0);
  check_arg("segments", segments, dev, at::kLong, {P, 2},
            "a contiguous int64 tensor of shape (P, 2) (offset, per_member)" + where.str());
  TORCH_CHECK(step_t.defined() && step_t.numel() == 1 && step_t.device() == dev &&
                  step_t.scalar_type() == at::kDouble,
              kFn, ": argument 'step_t' must be a float64 tensor of one element (the step count)", where.str(),
              ", got ", describe(step_t));
  const int64_t splits = training::flat_adam_nonfinite_splits(n, E);
  TORCH_CHECK(E <= std::numeric_limits<int32_t>::max() / splits, kFn, ": ", E, " members are more than one launch takes");

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Tensor nonfinite = at::empty({E}, frozen.options());
  Tensor partial = at::empty({E * splits}, frozen.options().dtype(at::kInt));
  training::FlatAdamResidentArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  a.n = n;
  a.segments = segments.const_data_ptr<int64_t>();
  a.P = P;
  a.E = E;
  a.frozen = frozen.const_data_ptr<bool>();
  a.step = step_t.data_ptr<double>();
  a.nonfinite = nonfinite.data_ptr<bool>();
  a.partial = partial.data_ptr<int>();
  a.splits = splits;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  training::flat_adam_step_resident(a, param.scalar_type() == at::kDouble, stream);
  return nonfinite;
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) { m.impl("flat_adam_step_resident", &flat_adam_step_resident); }

}  // namespace cuda
}  // namespace nalu_cuda
