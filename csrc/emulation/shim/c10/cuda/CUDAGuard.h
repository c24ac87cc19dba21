// Emulation shim (see ../../../build.py): CPU tensors need no device guard.
#pragma once
#include <c10/core/Device.h>
namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace cuda
}  // namespace c10
