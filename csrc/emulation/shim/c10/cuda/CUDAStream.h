// Emulation shim (see ../../../build.py): one implicit "stream", the calling thread.
#pragma once
#include <c10/core/Device.h>
#include <cuda_runtime_api.h>
namespace c10 {
namespace cuda {
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
