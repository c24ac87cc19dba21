// schema.cpp: the one dispatcher op of the experiments' native helpers (not a layer: no autocast),
// flat_adam_step_resident, the resident Adam step of the experiments' FlatAdam. Its kernel is CUDA only
// (cuda/flat_adam_cuda.cpp); on any other device, or in a build without CUDA kernels, the kernel
// below says so. The other helpers of this folder (cpu/: the fused Adam step on the CPU, the uniform
// fill) are no dispatcher ops: csrc/module.cpp binds them with pybind11.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "common/registration.h"

namespace nalu_cuda {
namespace {

constexpr const char* kSchemas[] = {
  // The resident Adam step of FlatAdam.step_resident (nalu_cuda/experiments/parts/optim.py), no clipping,
  // one learning rate: param, grad, exp_avg, exp_avg_sq are the flat buffers (n,); segments (P, 2) int64
  // rows (offset, per_member) of the (E, ...) parameters; frozen (E,) bool; step_t a float64 scalar, the
  // step count, incremented here. Members in frozen or with a NaN/Inf gradient take a zero gradient (grad
  // is zeroed there). Returns nonfinite (E,) bool. Nothing is read back to the host (CUDA-graph capturable).
  "flat_adam_step_resident(Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq,"
      " Tensor segments, Tensor frozen, Tensor(e!) step_t, float lr, float beta1, float beta2, float eps) -> Tensor",
};

}  // namespace
}  // namespace nalu_cuda

NALU_CUDA_OP_FAMILY(experiments, kTraining, nalu_cuda::kSchemas)

namespace {

// Every device without a kernel of flat_adam_step_resident (any but CUDA; every one in a build
// without CUDA kernels): a clear error instead of the dispatcher's.
at::Tensor flat_adam_step_resident_unsupported(const at::Tensor& param, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, double, double, double) {
#ifdef NALU_CUDA_WITH_CUDA
  const char* build = "";
#else
  const char* build = " (and this build of nalu_cuda has no CUDA kernels: it was built without CUDA)";
#endif
  TORCH_CHECK(false, "flat_adam_step_resident: argument 'param' must be a CUDA tensor, got ",
              param.defined() ? c10::str("a tensor on ", param.device()) : std::string("an undefined tensor"),
              build, "; the fused step on the CPU is nalu_cuda._C.flat_adam_step");
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, CompositeExplicitAutograd, m) {
  m.impl("flat_adam_step_resident", &flat_adam_step_resident_unsupported);
}
