// cuda_common.cuh: what every family's CUDA kernel files (csrc/ops/*/cuda/*.cu) share: the compute type of a storage type, typed
// loads and stores through untyped pointers, the storage-dtype dispatch, and two host-side size helpers. Included by .cu
// files only, after the CUDA and c10 headers they need (c10::Half, c10::BFloat16). Everything is in an anonymous
// namespace, as it was in each file: each kernel file keeps its own copy.
//
// The CUDA emulation (csrc/emulation/build.py) compiles this header as it is, through the .cu files
// that include it: it must hold no `__shared__` array and no `<<<` launch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>

#include "common/cuda/dtype.h"

namespace nalu_cuda {
namespace cuda {
namespace {

// The compute type A of a storage type T: float, or double for double storage.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccOf<T>::type;

// Element k of an untyped array of T, as A.
template <typename A, typename T>
__device__ __forceinline__ A ld(const void* p, int64_t k) {
  return static_cast<A>(static_cast<const T*>(p)[k]);
}

// Stores v, rounded to T, as element k of an untyped array of T.
template <typename T, typename A>
__device__ __forceinline__ void st(void* p, int64_t k, A v) {
  static_cast<T*>(p)[k] = static_cast<T>(v);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A product rounded on its own: never contracted by nvcc with a following addition into one fused
// multiply-add (where a result must match ATen's separately rounded ops bit for bit).
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
#else
template <typename T>
inline T mul_rn(T a, T b) {
  return a * b;
}
#endif

// Bytes of one value of the compute type of storage dtype dt.
inline size_t acc_bytes(DType dt) { return dt == DType::kDouble ? sizeof(double) : sizeof(float); }

}  // namespace
}  // namespace cuda
}  // namespace nalu_cuda

// Calls f with `scalar_t` bound to the storage type.
#define NALU_DISPATCH_DTYPE(DT, ...)        \
  switch (DT) {                             \
    case DType::kFloat: {                   \
      using scalar_t = float;               \
      __VA_ARGS__();                        \
      break;                                \
    }                                       \
    case DType::kDouble: {                  \
      using scalar_t = double;              \
      __VA_ARGS__();                        \
      break;                                \
    }                                       \
    case DType::kHalf: {                    \
      using scalar_t = c10::Half;           \
      __VA_ARGS__();                        \
      break;                                \
    }                                       \
    case DType::kBFloat16: {                \
      using scalar_t = c10::BFloat16;       \
      __VA_ARGS__();                        \
      break;                                \
    }                                       \
  }
