// math.h: the scalar math of the power units (NPU, RealNPU) and of iNALU, shared by the CPU
// and CUDA kernels. The primitives (exp_, log_, tanh_, abs_, sigmoid, nac_weight) come from
// ops/nac_nalu/math.h; see nalu_cuda/reference.py (npu, real_npu, inalu) for the executable specification.
//
// NPU (Heim et al. 2020), per input i with relevance gate g_i clamped to [0, 1]:
//   r = g (|x| + eps) + (1 - g)        lr = log r         k = g pi [x < 0]
//   U = lr W_r - k W_i                 V = k W_r + lr W_i (the two products, done by BLAS)
//   y = exp(U) cos(V),  s = exp(U) sin(V)   (y + i s = exp(U + i V), the complex power)
// RealNPU is the NPU with W_i = 0.
//
// iNALU (Schloer et al. 2020), independent gate g = sigmoid(G):
//   a = x W_a                          lx = log(max(|x|, eps))
//   u = lx W_m                         m = exp(min(u, omega))
//   msv = prod_i (sign(x_i) |W_m[i]| + 1 - |W_m[i]|)
//   y = g a + (1 - g) m clip(msv, -1, 1)
#pragma once

#include "ops/nac_nalu/math.h"

namespace nalu_cuda {
namespace math {

// cos_ and sin_ in float: CUDA's function on the device, the standard library's on the host.
#if defined(__CUDA_ARCH__)
#define NALU_POWER_FLOAT_FN(device_fn, host_fn) device_fn
#else
#define NALU_POWER_FLOAT_FN(device_fn, host_fn) host_fn
#endif
NALU_HD float cos_(float v) { return NALU_POWER_FLOAT_FN(cosf, std::cos)(v); }
NALU_HD double cos_(double v) { return ::cos(v); }
NALU_HD float sin_(float v) { return NALU_POWER_FLOAT_FN(sinf, std::sin)(v); }
NALU_HD double sin_(double v) { return ::sin(v); }
#undef NALU_POWER_FLOAT_FN

// pi in the compute type (k = g pi for a negative input).
template <typename T>
NALU_HD T pi_() {
  return T(3.14159265358979323846);
}

// sign(x) with sign(0) = 0 (and NaN for NaN).
template <typename T>
NALU_HD T sign_(T x) {
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : (x == T(0) ? T(0) : x));
}

// ---------------------------------------------------------------------------------------------
// NPU
// ---------------------------------------------------------------------------------------------

// The gate as used: clamp(g, 0, 1). Its derivative is 1 on [0, 1] (ends included, as torch.clamp)
// and 0 outside: npu_gate_passes.
template <typename T>
NALU_HD T npu_gate(T g) {
  return g < T(0) ? T(0) : (g > T(1) ? T(1) : g);
}
template <typename T>
NALU_HD bool npu_gate_passes(T g) {
  return g >= T(0) && g <= T(1);
}

// r = g (|x| + eps) + (1 - g), for the clamped gate g
template <typename T>
NALU_HD T npu_r(T x, T g, T eps) {
  return g * (abs_(x) + eps) + (T(1) - g);
}

// k = g pi [x < 0]
template <typename T>
NALU_HD T npu_k(T x, T g) {
  return x < T(0) ? g * pi_<T>() : T(0);
}

// Prologue of one input: (lr, k).
template <typename T>
NALU_HD void npu_prologue(T x, T g, T eps, T* lr, T* k) {
  *lr = log_(npu_r(x, g, eps));
  *k = npu_k(x, g);
}

// Epilogue of one output: y = exp(U) cos(V), s = exp(U) sin(V).
template <typename T>
NALU_HD void npu_epilogue(T U, T V, T* y, T* s) {
  const T e = exp_(U);
  *y = e * cos_(V);
  *s = e * sin_(V);
}

// Backward of the epilogue, given dy = dL/dy:  dU = dy y  (d exp(U) cos(V) / dU = y);
// dV = -dy s  (d exp(U) cos(V) / dV = -exp(U) sin(V)).
template <typename T>
NALU_HD void npu_epilogue_backward(T dy, T y, T s, T* dU, T* dV) {
  *dU = dy * y;
  *dV = -dy * s;
}

// Backward of the prologue of one input, given dlr = dL/dlr and dk = dL/dk, for the clamped gate g:
//   d lr / dx = g sign(x) / r                        (d |x| / dx = sign(x), sign(0) = 0)
//   d lr / dg = (|x| + eps - 1) / r                  d k / dg = pi [x < 0]   (d k / dx = 0)
// *dg is the derivative with respect to the clamped gate; the caller applies npu_gate_passes.
template <typename T>
NALU_HD void npu_prologue_backward(T x, T g, T eps, T dlr, T dk, T* dx, T* dg) {
  const T r = npu_r(x, g, eps);
  const T dlr_r = dlr / r;
  *dx = dlr_r * g * sign_(x);
  *dg = dlr_r * (abs_(x) + eps - T(1)) + (x < T(0) ? dk * pi_<T>() : T(0));
}

// ---------------------------------------------------------------------------------------------
// iNALU
// ---------------------------------------------------------------------------------------------

// lx = log(max(|x|, eps)); d lx / dx = sign(x) / |x| where |x| >= eps (torch.clamp_min passes the
// gradient at the end point), 0 below and at a NaN x. A NaN x stays NaN (torch.clamp_min
// propagates NaN), so that its row's m is NaN and gets no gradient, as in the reference.
template <typename T>
NALU_HD T inalu_log(T x, T eps) {
  const T ax = abs_(x);
  return log_(ax < eps ? eps : ax);
}
template <typename T>
NALU_HD T inalu_log_grad(T x, T eps) {
  const T ax = abs_(x);
  return ax >= eps ? sign_(x) / ax : T(0);
}

// m = exp(min(u, omega)); dm/du = m where u <= omega (torch.clamp(max=) passes at the end), else 0
// (a NaN u included). A NaN u gives a NaN m, as torch.clamp does, not the clipped e^omega.
template <typename T>
NALU_HD T inalu_m(T u, T omega) {
  return exp_(u > omega ? omega : u);
}

// One factor of the sign product: f = sign(x) |w| + 1 - |w| (w = W_m[i, o]).
//   d f / dw = (sign(x) - 1) sign(w)    (d sign(x) / dx = 0: no gradient to x)
template <typename T>
NALU_HD T inalu_sign_factor(T x, T w) {
  const T aw = abs_(w);
  return sign_(x) * aw + T(1) - aw;
}
template <typename T>
NALU_HD T inalu_sign_factor_grad(T x, T w) {
  return (sign_(x) - T(1)) * sign_(w);
}

// y = g a + (1 - g) m clip(msv)  (written as the reference writes it, so Inf/NaN propagate alike)
template <typename T>
NALU_HD T inalu_blend(T a, T m, T msv, T g) {
  return g * a + (T(1) - g) * (m * clamp_unit(msv));
}

// Gradients of the blend for one output element, given dy = dL/dy:
//   da = g dy
//   du = (1 - g) dy clip(msv) m [u <= omega]         (through m = exp(min(u, omega)))
//   dmsv = (1 - g) dy m [-1 <= msv <= 1]              (through clip)
//   dG = (a - m clip(msv)) dy g (1 - g)               (through g = sigmoid(G))
template <typename T>
NALU_HD void inalu_blend_backward(T dy, T a, T u, T msv, T g, T omega, T* da, T* du, T* dmsv, T* dG) {
  const T m = inalu_m(u, omega);
  const T c = clamp_unit(msv);
  const T dmc = (T(1) - g) * dy;
  *da = g * dy;
  *du = u <= omega ? dmc * c * m : T(0);
  *dmsv = clamp_unit_passes(msv) ? dmc * m : T(0);
  *dG = (a - m * c) * dy * g * (T(1) - g);
}

}  // namespace math
}  // namespace nalu_cuda
