// math.h: the scalar math of NAC and NALU, shared by the CPU and CUDA kernels (and by the other
// families' math: sigmoid, the weight construction, clamp_unit, log_abs).
//
// Conventions (see nalu_cuda/reference.py, the executable specification):
//   weight construction  W = tanh(W_hat) * sigmoid(M_hat)
//   log path             lx = log(|x| + eps),  d lx / dx = sign(x) / (|x| + eps), sign(0) = 0
//   multiply path        m = exp(u),  u = lx W_m
//   gate                 g = sigmoid(z),  z = x G (input gate) or z = g_param (independent gate)
//   blend                y = g a + (1 - g) m
//
// Every function here is `__host__ __device__` so that the CPU tests exercise the very formulas the
// GPU runs. Only the transcendental primitives (exp, log, tanh: csrc/common/math.h) differ by
// platform.
#pragma once

#include "common/math.h"

namespace nalu_cuda {
namespace math {

// ---------------------------------------------------------------------------------------------
// The units' math. T is the compute type (float or double); storage may be narrower on the GPU.
// ---------------------------------------------------------------------------------------------

// sigmoid(z) = 1 / (1 + exp(-z)); exp(-z) -> inf gives 0 and -> 0 gives 1, so no overflow branch.
template <typename T>
NALU_HD T sigmoid(T z) {
  return T(1) / (T(1) + exp_(-z));
}

// W = tanh(W_hat) * sigmoid(M_hat)
template <typename T>
NALU_HD T nac_weight(T w_hat, T m_hat) {
  return tanh_(w_hat) * sigmoid(m_hat);
}

// dW_hat = dW (1 - tanh(W_hat)^2) sigmoid(M_hat);  dM_hat = dW tanh(W_hat) sigmoid(M_hat) (1 - sigmoid(M_hat))
template <typename T>
NALU_HD void nac_weight_backward(T grad_w, T w_hat, T m_hat, T* grad_w_hat, T* grad_m_hat) {
  const T t = tanh_(w_hat);
  const T s = sigmoid(m_hat);
  *grad_w_hat = grad_w * (T(1) - t * t) * s;
  *grad_m_hat = grad_w * t * s * (T(1) - s);
}

// clamp(v, -1, 1) (NaN stays NaN, as torch.clamp), and whether its derivative is 1: v in
// [-1, 1], ends included, as torch.clamp's derivative (NaN: no). The NAU's weights and iNALU's
// sign-recovery clip.
template <typename T>
NALU_HD T clamp_unit(T w) {
  return w < T(-1) ? T(-1) : (w > T(1) ? T(1) : w);
}
template <typename T>
NALU_HD bool clamp_unit_passes(T w) {
  return w >= T(-1) && w <= T(1);
}

// lx = log(|x| + eps)
template <typename T>
NALU_HD T log_abs(T x, T eps) {
  return log_(abs_(x) + eps);
}

// lx = log(|x| + eps) for eps >= the smallest normal of T (then |x| + eps is a positive normal
// number, +inf or NaN): the same value as log_abs up to the last bit, faster on the host.
NALU_HD float log_abs_normal_eps(float x, float eps) {
#if defined(__CUDA_ARCH__)
  return log_abs(x, eps);
#else
  return host_logf_positive(std::fabs(x) + eps);
#endif
}
NALU_HD double log_abs_normal_eps(double x, double eps) { return log_abs(x, eps); }

// d log(|x| + eps) / dx = sign(x) / (|x| + eps), with sign(0) = 0 (and NaN for NaN, as autograd)
template <typename T>
NALU_HD T log_abs_grad(T x, T eps) {
  const T sign = x > T(0) ? T(1) : (x < T(0) ? T(-1) : (x == T(0) ? T(0) : x));
  return sign / (abs_(x) + eps);
}

// y = g a + (1 - g) m  (written as the reference writes it, so Inf/NaN propagate identically)
template <typename T>
NALU_HD T blend(T a, T m, T g) {
  return g * a + (T(1) - g) * m;
}

// Gradients of the blend for one output element, given dy = dL/dy:
//   da = g dy;  du = (1 - g) dy m  (through m = exp(u));  dz = (a - m) dy g (1 - g)  (through g = sigmoid(z))
template <typename T>
NALU_HD void blend_backward(T dy, T a, T m, T g, T* da, T* du, T* dz) {
  *da = g * dy;
  *du = (T(1) - g) * dy * m;
  *dz = (a - m) * dy * g * (T(1) - g);
}

// The gradients that reach the kept parts of one output element directly (nalu_parts: a loss on
// a, m or g), added to those of the blend: a = a;  m = exp(u);  g = sigmoid(z) (input gate).
//   da += ga;  du += gm m;  dz += gg g (1 - g)
template <typename T>
NALU_HD void parts_backward(T ga, T gm, T gg, T m, T g, T* da, T* du, T* dz) {
  *da += ga;
  *du += gm * m;
  *dz += gg * g * (T(1) - g);
}

}  // namespace math
}  // namespace nalu_cuda
