// autocast.cpp: the autocast policy of every nalu_cuda layer op, one boxed kernel for all of them.
//
// Inside an autocast region, every op runs in float32: float16/bfloat16 arguments are cast to
// float32 once, then the op runs with autocast switched off, and its results stay float32 (they
// are not cast back). Like torch.exp and torch.log, which autocast also runs in float32, the
// NALU's multiplicative path overflows float16 for modest inputs (exp(u) > 65504 once u > 11.1);
// so do the power units' exp of a power of the inputs and the NMU's product of up to `in`
// factors; the NAU follows so that one model stays in one dtype. A low-precision result would be
// wrong more often than it is useful. float64 arguments are left as they are. Gradients reach
// float16/bfloat16 parameters through the casts, in their own dtype.
//
// The kernel is boxed: it casts whatever tensor arguments the op's schema has, so an op's
// arguments are written only in its schema, its kernels and its Python wrapper, never here.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

namespace nalu_cuda {
namespace {

// The layer ops (schemas: csrc/nalu_ops.cpp). Not the training op flat_adam_step_resident, whose
// float32 state buffers are no activations to cast.
constexpr const char* kLayerOps[] = {
    "nac_weight",   "nac_weight_backward", "nac_forward",  "nac_backward", "nac_mul_forward", "nac_mul_backward",
    "nalu_forward", "nalu_backward",       "npu_forward",  "npu_backward", "inalu_forward",   "inalu_backward",
    "nau_forward",  "nau_backward",        "nmu_forward",  "nmu_backward",
};

// Casts the op's float16/bfloat16 tensor arguments (on device type D) to float32 in place on the
// stack, then runs the op below autocast.
template <c10::DispatchKey K, c10::DeviceType D>
void float32_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(n); it != stack->end(); ++it) {
    if (it->isTensor()) *it = at::autocast::cached_cast(at::kFloat, it->toTensor(), D);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
  op.callBoxed(stack);
}

template <c10::DispatchKey K, c10::DeviceType D>
void register_autocast(torch::Library& m) {
  for (const char* name : kLayerOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&float32_kernel<K, D>>());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, AutocastCPU, m) {
  register_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m);
}

TORCH_LIBRARY_IMPL(nalu_cuda, AutocastCUDA, m) {
  register_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m);
}

}  // namespace nalu_cuda
