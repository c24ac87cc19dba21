// autocast.cpp: the autocast policy of every nalu_cuda layer op, one boxed kernel for all of them,
// registered for every op of every layer family by NALU_CUDA_OP_FAMILY (csrc/common/registration.h).
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
// arguments are written only in its schema, its kernels and its Python wrapper, and its name only in
// its schema: the list of ops comes from the families' schema tables, never from here.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include "common/registration.h"

namespace nalu_cuda {
namespace {

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
void register_float32(torch::Library& m, const char* const* schemas, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    m.impl(op_name(schemas[i]).c_str(), torch::CppFunction::makeFromBoxedFunction<&float32_kernel<K, D>>());
  }
}

}  // namespace

void register_autocast(torch::Library& m, c10::DeviceType device, const char* const* schemas, size_t n) {
  if (device == c10::DeviceType::CUDA) {
    register_float32<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m, schemas, n);
  } else {
    TORCH_INTERNAL_ASSERT(device == c10::DeviceType::CPU, "nalu_cuda: no autocast key for ", device);
    register_float32<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m, schemas, n);
  }
}

}  // namespace nalu_cuda
