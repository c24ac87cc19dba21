// ensemble_step_cuda.cpp: the CUDA kernels of nalu_cuda::static_ensemble_grad and
// static_ensemble_grad_counter (the batch drawn in the kernel) (TORCH_LIBRARY_IMPL(nalu_cuda, CUDA)), the static task's gradient step on the GPU: the schema and
// its contract are csrc/experiments/schema.cpp's, the work the CPU op's (cpu/ensemble_step.cpp), the
// kernel ensemble_step_kernels.cu. It checks its arguments on the host from their metadata and from
// `segments`, which stays a CPU tensor here (its rows are the kernel's launch arguments: nothing is
// read back from the device), allocates the workspace through the caching allocator and launches on
// x's device and current stream without waiting, so that a CUDA graph can capture it. The optimiser's
// part of a step on CUDA is FlatAdam's resident step (flat_adam_cuda.cpp), called after this one by
// nalu_cuda/experiments/parts/native_step.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "experiments/cpu/step_common.h"
#include "experiments/cuda/ensemble_step_kernels.h"

namespace nalu_cuda {
namespace training {
namespace {

// t on `device` (or, with device unset, a CUDA tensor), contiguous and `ok`; `want` says all that in words.
void check_on(const char* op, const char* name, const at::Tensor& t, const c10::optional<c10::Device>& device,
              const std::string& want, bool ok) {
  TORCH_CHECK(t.defined() && t.is_cuda() && (!device || t.device() == *device) && t.is_contiguous() && ok, op,
              ": argument '", name, "' must be ", want, ", got ", describe(t));
}

StepKind step_kind(Kind k) { return static_cast<StepKind>(static_cast<int>(k)); }

// The checks of the arguments both ops take after the batch (x's dtype and device `like`, E members
// of I inputs), and the launch: fills a's model, shapes and parameter segments, allocates, launches.
at::Tensor check_and_launch(const char* op, StaticGradArgs& a, at::ScalarType dtype, const c10::Device& dev,
                            const std::string& like, const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& segments, const at::Tensor& diverged, c10::string_view model_name,
                            double eps, double reg_weight) {
  const Model model = model_from_name(op, std::string(model_name));
  const int64_t E = a.E, B = a.B, I = a.I;
  check_on(op, "param", param, dev, like + " of one dimension (FlatAdam's flat buffer)",
           param.scalar_type() == dtype && param.dim() == 1);
  check_on(op, "grad", grad, dev, like + c10::str(" of param's shape [", param.numel(), "]"),
           grad.scalar_type() == dtype && grad.dim() == 1 && grad.numel() == param.numel());
  check_on(op, "diverged", diverged, dev,
           c10::str("a contiguous bool tensor on ", dev, " of shape [", E, "] (one flag per member)"),
           diverged.scalar_type() == at::kBool && diverged.dim() == 1 && diverged.numel() == E);
  Kind kinds[2];
  layer_kinds(model, &kinds[0], &kinds[1]);
  const int64_t P = params_per_layer(kinds[0]) + params_per_layer(kinds[1]);
  TORCH_CHECK(segments.defined() && segments.device().is_cpu() && segments.is_contiguous() &&
                  segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(0) == P &&
                  segments.size(1) == 2,
              op, ": argument 'segments' must be a contiguous int64 CPU tensor of shape [", P, ", 2] (offset, "
              "per_member) for model '", std::string(model_name), "' (its rows are the CUDA kernel's launch "
              "arguments: it stays on the host), got ", describe(segments));
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": argument 'eps' must be a finite number >= 0, got ", eps);
  check_reg_weight(op, model, reg_weight);
  const int64_t* seg = segments.const_data_ptr<int64_t>();
  const int64_t H = std::max<int64_t>(seg[1] / I, 1);  // (W_hat of the first layer: I x H)
  std::vector<int64_t> want(P, H);
  std::fill(want.begin(), want.begin() + params_per_layer(kinds[0]), I * H);
  check_segment_rows(op, segments, param.numel(), E, want, c10::str("I = ", I, ", hidden ", H));

  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor loss = at::empty({E}, param.options());
  at::Tensor work = at::empty({E * static_grad_work_elems(B, I, H)}, param.options());
  a.param = param.const_data_ptr();
  a.grad = grad.data_ptr();
  a.diverged = diverged.data_ptr<bool>();
  a.loss = loss.data_ptr();
  a.work = work.data_ptr();
  a.H = H;
  a.kinds[0] = step_kind(kinds[0]);
  a.kinds[1] = step_kind(kinds[1]);
  for (int64_t q = 0; q < P; ++q) a.offset[q] = seg[2 * q], a.per_member[q] = seg[2 * q + 1];
  a.eps = eps;
  a.reg_weight = reg_weight;
  static_ensemble_grad_cuda(a, dtype == at::kDouble, c10::cuda::getCurrentCUDAStream());
  return loss;
}

at::Tensor static_ensemble_grad_cuda_op(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                        const at::Tensor& grad, const at::Tensor& segments, const at::Tensor& diverged,
                                        c10::string_view model, double eps, double reg_weight) {
  constexpr const char* kOp = "static_ensemble_grad";
  model_from_name(kOp, std::string(model));
  const bool fp = x.defined() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble);
  check_on(kOp, "x", x, c10::nullopt, "a contiguous float32 or float64 CUDA tensor of shape (E, B, I)",
           fp && x.dim() == 3);
  for (int64_t d = 0; d < 3; ++d)
    TORCH_CHECK(x.size(d) >= 1, kOp, ": argument 'x' must have at least one element along every dimension (E, B, "
                "I), got shape ", x.sizes());
  const c10::Device dev = x.device();
  StaticGradArgs a{};
  a.E = x.size(0), a.B = x.size(1), a.I = x.size(2);
  const std::string like = c10::str("a contiguous ", x.scalar_type(), " tensor on ", dev, " (x's dtype and device)");
  check_on(kOp, "target", target, dev, like + c10::str(" of shape [", a.E, ", ", a.B, ", 1]"),
           target.scalar_type() == x.scalar_type() && target.dim() == 3 && target.size(0) == a.E &&
               target.size(1) == a.B && target.size(2) == 1);
  a.x = x.const_data_ptr();
  a.target = target.const_data_ptr();
  return check_and_launch(kOp, a, x.scalar_type(), dev, like, param, grad, segments, diverged, model, eps, reg_weight);
}

at::Tensor static_ensemble_grad_counter_cuda_op(const at::Tensor& keys, const at::Tensor& step,
                                                const at::Tensor& masks, at::IntArrayRef ops, double lo, double hi,
                                                int64_t batch, const at::Tensor& param, const at::Tensor& grad,
                                                const at::Tensor& segments, const at::Tensor& diverged,
                                                c10::string_view model, double eps, double reg_weight) {
  constexpr const char* kOp = "static_ensemble_grad_counter";
  model_from_name(kOp, std::string(model));
  const c10::Device dev = keys.defined() && keys.is_cuda() ? keys.device() : c10::Device(c10::kCUDA);
  auto check = [&](const char* name, const at::Tensor& t, const std::string& want, bool ok) {
    check_on(kOp, name, t, dev, want, ok);
  };
  StaticGradArgs a{};
  std::tie(a.E, a.I) = check_counter_args(kOp, "CUDA", check, keys, masks, ops, lo, hi, batch, a.draw);
  check_on(kOp, "step", step, dev, c10::str("a contiguous int64 tensor of one element on ", dev, " (the step)"),
           step.scalar_type() == at::kLong && step.numel() == 1);
  a.B = batch;
  a.draw.step = step.const_data_ptr<int64_t>();
  const std::string like = c10::str("a contiguous float32 tensor on ", dev, " (the drawn inputs' dtype, keys' device)");
  return check_and_launch(kOp, a, at::kFloat, dev, like, param, grad, segments, diverged, model, eps, reg_weight);
}

}  // namespace
}  // namespace training
}  // namespace nalu_cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) {
  m.impl("static_ensemble_grad", &nalu_cuda::training::static_ensemble_grad_cuda_op);
  m.impl("static_ensemble_grad_counter", &nalu_cuda::training::static_ensemble_grad_counter_cuda_op);
}
