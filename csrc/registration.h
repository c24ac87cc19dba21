// registration.h: the registrations of the power units' and the NAU/NMU ops under the Autograd
// key, each defined in its own file and called from the one TORCH_LIBRARY_IMPL of that key
// (autograd.cpp), and the dispatcher look-up those files share. (The autocast keys need no such
// list: autocast.cpp registers one boxed kernel for every layer op.)
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <torch/library.h>

namespace nalu_cuda {

// The typed dispatcher handle of the op `name` ("nalu_cuda::..."); callers keep it in a static of
// their own (one per op: a static in a shared helper would be shared by every op of one signature).
template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Autograd: npu_forward, inalu_forward (autograd_power.cpp)
void register_power_autograd(torch::Library& m);

// Autograd: nau_forward, nmu_forward (autograd_units.cpp)
void register_units_autograd(torch::Library& m);

}  // namespace nalu_cuda
