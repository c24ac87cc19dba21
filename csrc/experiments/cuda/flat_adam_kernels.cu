// flat_adam_kernels.cu: the kernels of the resident Adam step (see flat_adam_cuda.h), two launches:
//
//   nonfinite_kernel  block (e, s) of E x splits: whether the s-th share of member e's gradient (over
//                     every segment) has a NaN or Inf -> partial[e * splits + s] (every slot written, so
//                     the workspace needs no zeroing launch); block 0 also increments the step count.
//   update_kernel     grid-stride over each segment's E * per_member elements: member e is dropped
//                     when frozen[e] or any of its partials; a dropped gradient becomes 0 (in grad
//                     too); then the Adam update. The first E threads also write nonfinite[e].
//
// Rounding: each element's arithmetic is that of the tensor ops of FlatAdam.step_resident as ATen's
// CUDA kernels compute them, one op after another, in the buffers' dtype: exp_avg.lerp_ (whose
// `self + w (end - self)` nvcc contracts into one fused multiply-add, as fma_ below), mul_ and
// addcmul_ (`self + (alpha t1) t2`, also one fma), sqrt, a true division by the rounded
// sqrt(bias correction 2), + eps, the division m / denom, the product with the rounded step size
// (1 / bc1) lr and the subtraction. The products that ATen rounds on their own are __fmul_rn /
// __dmul_rn here, so nvcc cannot fuse them into the next addition. The bias corrections are computed
// in double from the device step count, as the tensor ops do (1 - pow(beta, t)).
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "common/cuda/cuda_common.cuh"
#include "experiments/cuda/flat_adam_kernels.h"

namespace nalu_cuda {
namespace training {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;    // grid-stride loops beyond this
constexpr int64_t kPerThread = 16;       // gradient elements per thread of a scan block before it splits
constexpr int64_t kMaxSplits = 64;

__device__ __forceinline__ float fma_(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_(double a, double b, double c) { return fma(a, b, c); }
__device__ __forceinline__ float sqrt_(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_(double v) { return sqrt(v); }
using cuda::mul_rn;  // a product rounded on its own (common/cuda/cuda_common.cuh)

// Whether segment row (off, per) lies inside the buffer of n elements with E members (and is not empty).
__device__ __forceinline__ bool segment_ok(int64_t off, int64_t per, int64_t n, int64_t E) {
  return off >= 0 && per > 0 && off <= n && per <= (n - off) / E;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) nonfinite_kernel(FlatAdamResidentArgs a) {
  __shared__ int any_bad[1];
  const int64_t e = blockIdx.x / a.splits;
  const int64_t s = blockIdx.x % a.splits;
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.step += 1.0;
  const T* g = static_cast<const T*>(a.grad);
  bool bad = false;
  for (int64_t q = 0; q < a.P; ++q) {
    const int64_t off = a.segments[2 * q], per = a.segments[2 * q + 1];
    if (!segment_ok(off, per, a.n, a.E)) continue;
    const T* run = g + off + e * per;
    for (int64_t k = s * kThreads + threadIdx.x; k < per; k += a.splits * kThreads) {
      const T d = run[k] - run[k];  // 0 for a finite value, NaN for NaN or Inf
      bad = bad || d != d;
    }
  }
  if (threadIdx.x == 0) any_bad[0] = 0;
  __syncthreads();
  if (bad) any_bad[0] = 1;
  __syncthreads();
  if (threadIdx.x == 0) a.partial[blockIdx.x] = any_bad[0];
}

template <typename T>
__global__ void __launch_bounds__(kThreads) update_kernel(FlatAdamResidentArgs a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t e = tid; e < a.E; e += stride) {
    int bad = 0;
    for (int64_t s = 0; s < a.splits; ++s) bad |= a.partial[e * a.splits + s];
    a.nonfinite[e] = bad != 0;
  }
  const double t = *a.step;  // already incremented by nonfinite_kernel
  const double bc1 = 1.0 - pow(a.beta1, t);
  const double bc2 = 1.0 - pow(a.beta2, t);
  const T step_size = static_cast<T>((1.0 / bc1) * a.lr);  // lr / bc1 on a tensor: reciprocal, then product
  const T sqrt_bc2 = static_cast<T>(sqrt(bc2));
  const T w = static_cast<T>(1.0 - a.beta1);
  const T one_minus_w = T(1) - w;
  const bool lerp_small = (w < T(0) ? -w : w) < T(0.5);
  const T beta2 = static_cast<T>(a.beta2);
  const T alpha = static_cast<T>(1.0 - a.beta2);
  const T eps = static_cast<T>(a.eps);
  T* p = static_cast<T*>(a.param);
  T* gr = static_cast<T*>(a.grad);
  T* m_ = static_cast<T*>(a.exp_avg);
  T* v_ = static_cast<T*>(a.exp_avg_sq);
  for (int64_t q = 0; q < a.P; ++q) {
    const int64_t off = a.segments[2 * q], per = a.segments[2 * q + 1];
    if (!segment_ok(off, per, a.n, a.E)) continue;
    const int64_t len = a.E * per;
    for (int64_t k = tid; k < len; k += stride) {
      const int64_t e = k / per;
      const int64_t i = off + k;
      int drop = a.frozen[e] ? 1 : 0;
      for (int64_t s = 0; s < a.splits; ++s) drop |= a.partial[e * a.splits + s];
      T g = gr[i];
      if (drop) {
        g = T(0);
        gr[i] = T(0);
      }
      const T m0 = m_[i];
      const T d = g - m0;
      const T m = lerp_small ? fma_(w, d, m0) : fma_(-d, one_minus_w, g);
      T v = mul_rn(v_[i], beta2);
      v = fma_(mul_rn(alpha, g), g, v);
      const T denom = sqrt_(v) / sqrt_bc2 + eps;
      m_[i] = m;
      v_[i] = v;
      p[i] = p[i] - mul_rn(m / denom, step_size);
    }
  }
}

template <typename T>
void launch(const FlatAdamResidentArgs& a, cudaStream_t stream) {
  nonfinite_kernel<T><<<static_cast<unsigned>(a.E * a.splits), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t work = std::max<int64_t>(a.n, a.E);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxBlocks));
  update_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int64_t flat_adam_nonfinite_splits(int64_t n, int64_t E) {
  const int64_t per_member = n / std::max<int64_t>(E, 1);
  const int64_t want = (per_member + kThreads * kPerThread - 1) / (kThreads * kPerThread);
  return std::max<int64_t>(1, std::min(want, kMaxSplits));
}

void flat_adam_step_resident(const FlatAdamResidentArgs& a, bool is_double, cudaStream_t stream) {
  if (is_double) {
    launch<double>(a, stream);
  } else {
    launch<float>(a, stream);
  }
}

}  // namespace training
}  // namespace nalu_cuda
