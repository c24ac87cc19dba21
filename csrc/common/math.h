// math.h: the host/device primitives every family's kernels share: NALU_HD (`__host__
// __device__`, always inlined), and exp, log, tanh, abs in float and double (exp_, log_, tanh_,
// abs_ in nalu_cuda::math). Only these differ by platform: CUDA's libdevice functions on the
// device; on the host, float uses the branch-free Cephes polynomials below, which the compiler
// vectorises inside `#pragma omp simd` loops (glibc's scalar expf/logf would not be), and double
// uses <cmath>. Each family's formulas are in its own math.h (csrc/ops/*/math.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Always inlined on the host too: the CPU kernels are compiled for several instruction sets
// (csrc/common/cpu/kernels_*.cpp), and gcc would otherwise keep some of these as calls into the
// baseline-ISA copy, which also stops the loop around them from being vectorised.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define NALU_HD __host__ __device__ __forceinline__
#define NALU_HOST_INLINE __forceinline__
#elif defined(__GNUC__)
#define NALU_HD inline __attribute__((always_inline))
#define NALU_HOST_INLINE inline __attribute__((always_inline))
#else
#define NALU_HD inline
#define NALU_HOST_INLINE inline
#endif

namespace nalu_cuda {
namespace math {

#if !defined(__CUDA_ARCH__)
// ---------------------------------------------------------------------------------------------
// Host float primitives: branch-free (selects, no calls) so that loops over them vectorise.
// Accuracy: about 1 ulp on the whole range, like the Cephes library they come from; special values
// (NaN, +-inf, 0, negative arguments of log, subnormal results of exp) follow IEEE/libm.
// ---------------------------------------------------------------------------------------------
NALU_HOST_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
NALU_HOST_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// 2^n for n in [-126, 127], built from the exponent bits.
NALU_HOST_INLINE float pow2i(int32_t n) { return bits_to_float(static_cast<uint32_t>(n + 127) << 23); }

// exp(x): Cephes expf. x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, then
// scaling by 2^n in two steps (each a normal float) so that n = 128 and subnormal results come
// out right. Special values need no selects (which gcc would not vectorise under AVX2): clamping
// x to [-104, 89] makes the scaling overflow to +inf above 88.72 and round to 0 below -103.97,
// and a NaN flows through the arithmetic.
NALU_HOST_INLINE float host_expf(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  xc = xc > 89.0f ? 89.0f : xc;
  const float fx = xc * 1.44269504088896341f;
  // fx + 0.5 rounded toward zero, with 0.5's sign that of fx: a bitwise copysign (gcc turned the
  // select fx >= 0 ? 0.5 : -0.5 into both paths and blends). The same n: for fx = -0 both round to 0.
  const float half = bits_to_float(float_to_bits(0.5f) | (float_to_bits(fx) & 0x80000000u));
  const int32_t n = static_cast<int32_t>(fx + half);
  const float fn = static_cast<float>(n);
  float r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t n1 = n >> 1;  // n = n1 + (n - n1), both halves in [-75, 64]
  return y * pow2i(n1) * pow2i(n - n1);
}

// log(x): Cephes logf. x = 2^e * f with f in [sqrt(1/2), sqrt(2)), log(f) by a degree-9 polynomial.
NALU_HOST_INLINE float host_logf(float x) {
  const bool subnormal = x < 1.17549435e-38f;  // also true for x <= 0, which is fixed up below
  const float xs = subnormal ? x * 8388608.0f : x;  // * 2^23
  const uint32_t bits = float_to_bits(xs);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xffu) - 126;
  e = subnormal ? e - 23 : e;
  const float f = bits_to_float((bits & 0x007fffffu) | 0x3f000000u);  // in [0.5, 1)
  const bool lower = f < 0.707106781186547524f;
  const float fe = static_cast<float>(e) - (lower ? 1.0f : 0.0f);
  const float t = lower ? f + f - 1.0f : f - 1.0f;
  const float z = t * t;
  float y = 7.0376836292e-2f;
  y = y * t - 1.1514610310e-1f;
  y = y * t + 1.1676998740e-1f;
  y = y * t - 1.2420140846e-1f;
  y = y * t + 1.4249322787e-1f;
  y = y * t - 1.6668057665e-1f;
  y = y * t + 2.0000714765e-1f;
  y = y * t - 2.4999993993e-1f;
  y = y * t + 3.3333331174e-1f;
  y = y * t * z;
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  float r = t + y;
  r += 0.693359375f * fe;
  r = x == std::numeric_limits<float>::infinity() ? x : r;
  r = x == 0.0f ? -std::numeric_limits<float>::infinity() : r;
  return ((x < 0.0f) | (x != x)) ? std::numeric_limits<float>::quiet_NaN() : r;
}

// log(y) for y > 0 normal, +inf or NaN only (no zero, subnormal or negative argument): the
// reduction and polynomial of FreeBSD's logf (msun e_logf.c, after fdlibm). y = 2^k m with m in
// [sqrt(1/2), sqrt(2)) by an integer offset of the bits (no selects), f = m - 1,
// s = f / (2 + f), log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)). About 0.75 ulp; nearly twice as
// fast as host_logf, which is why log(|x| + eps) takes it whenever eps is a normal float.
NALU_HOST_INLINE float host_logf_positive(float y) {
  const uint32_t bits = float_to_bits(y);
  const uint32_t u = bits - 0x3f3504f3u;  // 0x3f3504f3 = sqrt(1/2)
  const int32_t k = static_cast<int32_t>(u) >> 23;
  const float f = bits_to_float((u & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
  const float s = f / (2.0f + f);
  const float z = s * s;
  const float w = z * z;
  const float t1 = w * (4.0000972152e-01f + w * 2.4279078841e-01f);
  const float t2 = z * (6.6666662693e-01f + w * 2.8498786688e-01f);
  const float r = t2 + t1;
  const float hfsq = 0.5f * f * f;
  const float dk = static_cast<float>(k);
  const float out = dk * 6.9313812256e-01f - ((hfsq - (s * (hfsq + r) + dk * 9.0580006145e-06f)) - f);
  return static_cast<int32_t>(bits) >= 0x7f800000 ? y : out;  // +inf and NaN (y has no sign bit)
}

// tanh(x): Cephes tanhf. An odd polynomial for |x| < 0.625 (where 1 - 2/(e^2x + 1) would cancel),
// 1 - 2 / (exp(2|x|) + 1) with the sign of x elsewhere.
NALU_HOST_INLINE float host_tanhf(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float near_zero = p * z * x + x;
  const float far_abs = 1.0f - 2.0f / (host_expf(ax + ax) + 1.0f);
  const float far = bits_to_float(float_to_bits(far_abs) | (float_to_bits(x) & 0x80000000u));  // copysign
  // A bitwise select: gcc keeps `?:` between two computed floats as a branch under AVX2.
  const uint32_t near_mask = 0u - static_cast<uint32_t>(ax < 0.625f);
  return bits_to_float((float_to_bits(near_zero) & near_mask) | (float_to_bits(far) & ~near_mask));
}
#endif  // !__CUDA_ARCH__

// ---------------------------------------------------------------------------------------------
// Primitives by platform and precision: in float, CUDA's function on the device and the host
// version above (or std::fabs) on the host; in double, the C library's on both.
// ---------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__)
#define NALU_PRIMITIVE(NAME, DEVICE_F, HOST_F, DOUBLE_F) \
  NALU_HD float NAME(float v) { return DEVICE_F(v); }    \
  NALU_HD double NAME(double v) { return DOUBLE_F(v); }
#else
#define NALU_PRIMITIVE(NAME, DEVICE_F, HOST_F, DOUBLE_F) \
  NALU_HD float NAME(float v) { return HOST_F(v); }      \
  NALU_HD double NAME(double v) { return DOUBLE_F(v); }
#endif
NALU_PRIMITIVE(exp_, expf, host_expf, ::exp)
NALU_PRIMITIVE(log_, logf, host_logf, ::log)
NALU_PRIMITIVE(tanh_, tanhf, host_tanhf, ::tanh)
NALU_PRIMITIVE(abs_, fabsf, std::fabs, ::fabs)
#undef NALU_PRIMITIVE

}  // namespace math
}  // namespace nalu_cuda
