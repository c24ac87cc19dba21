// dtype.h: the storage dtype tag that every family's CUDA ops pass to their kernels (plain data,
// no ATen: the .cu files include no ATen header).
#pragma once

namespace nalu_cuda {
namespace cuda {

// Storage dtype. The math runs in float for float/half/bfloat16 storage and in double for double.
enum class DType : int { kFloat, kDouble, kHalf, kBFloat16 };

}  // namespace cuda
}  // namespace nalu_cuda
