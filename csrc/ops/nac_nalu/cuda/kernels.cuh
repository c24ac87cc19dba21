// kernels.cuh: what the two kernel files of NAC+, NAC* and NALU share
// (rowwise_kernels.cu: the rowwise path; blas_kernels.cu: the blas path's elementwise launches):
// the math, the storage of NALU's m, the layer-kind dispatch and the launch sizes.
//
// Math (member e, row n, input i, output j; every formula comes from csrc/ops/nac_nalu/math.h):
//   forward   W = tanh(W_hat) sigmoid(M_hat);  lx = log(|x| + eps);  a = x W;  m = exp(lx W_m);
//             g = sigmoid(x G) or sigmoid(G);  y = g a + (1 - g) m
//   backward  da = g dy;  du = (1 - g) dy m;  dz = (a - m) dy g (1 - g)
//             dW = x^T da (+ lx^T du when tied);  dW_m = lx^T du;  dG = x^T dz (or sum_n dz)
//             dx = da W^T + dz G^T + (du W_m^T) sign(x) / (|x| + eps)
//             dW_hat, dM_hat from dW through the weight construction
// Saved by forward for backward (the families' schema.cpp (csrc/ops/*/schema.cpp)): lx, and a, m, g for NALU (m = y for NAC*);
// in float16/bfloat16 NALU's m saturates at the type's largest finite value (st_m).
// W is rebuilt in backward from W_hat, M_hat.
//
// Precision: storage may be float, double, float16 or bfloat16; every value is loaded into the
// compute type A (float, or double for double storage), all math and every accumulation runs in
// A, and only results are rounded to the storage type. On the device exp/log/tanh are CUDA's
// expf/logf/tanhf (never the fast-math intrinsics).
//
//
// Included by those .cu files only, after cuda_common.cuh. In an anonymous namespace, like
// cuda_common.cuh: each kernel file keeps its own copy. The CUDA emulation (emulation/build.py)
// compiles it as it is, through the .cu files: it must hold no `__shared__` array and no `<<<`.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#include "ops/nac_nalu/math.h"
#include "common/cuda/cuda_common.cuh"
#include "ops/nac_nalu/cuda/kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

namespace nm = nalu_cuda::math;

// NALU's m = exp(u), saved for the backward. In float16 it overflows past u ~ 11.09 while y, blended
// in the compute type, stays finite; an inf m would make du = (1 - g) dy m and dz = (a - m) dy
// g (1 - g) inf or NaN. So a 2-byte storage type keeps m saturated at its largest finite value
// (NaN stays NaN); wider types store it as is.
template <typename T, typename A>
__device__ __forceinline__ void st_m(void* p, int64_t k, A m) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    m = m > A(65504.0f) ? A(65504.0f) : m;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    m = m > A(3.38953139e38f) ? A(3.38953139e38f) : m;
  }
  st<T>(p, k, m);
}

template <bool ADD, bool MUL, int GATE>
struct KindTag {
  static constexpr bool add = ADD;
  static constexpr bool mul = MUL;
  static constexpr int gate = GATE;  // Gate (layer_types.h) as int
};
constexpr int kGateNone = static_cast<int>(Gate::kNone), kGateInput = static_cast<int>(Gate::kInput),
              kGateIndep = static_cast<int>(Gate::kIndependent);

// Calls f with `kind_t` bound to the KindTag of the layer: NAC+, NAC*, NALU with either gate.
#define NALU_DISPATCH_KIND(K, ...)                          \
  if ((K).add && (K).mul) {                                 \
    if ((K).gate == Gate::kInput) {                     \
      using kind_t = KindTag<true, true, kGateInput>;       \
      __VA_ARGS__();                                        \
    } else {                                                \
      using kind_t = KindTag<true, true, kGateIndep>;       \
      __VA_ARGS__();                                        \
    }                                                       \
  } else if ((K).add) {                                     \
    using kind_t = KindTag<true, false, kGateNone>;         \
    __VA_ARGS__();                                          \
  } else {                                                  \
    using kind_t = KindTag<false, true, kGateNone>;         \
    __VA_ARGS__();                                          \
  }

constexpr int kThreads = 256;  // threads per block, every kernel
constexpr int64_t kMaxElementwiseBlocks = 8192;

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(n, kThreads), kMaxElementwiseBlocks)));
}

}  // namespace
}  // namespace cuda
}  // namespace nalu_cuda
