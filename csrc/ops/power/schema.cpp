// schema.cpp: the schemas of the power units' ops (NPU / RealNPU, iNALU), declared once; the family's
// registration (csrc/common/registration.h) defines them and gives them the autocast policy. Entry
// points: ops.h; kernels: cpu/power_cpu.cpp, cuda/power_cuda.cpp; autograd: autograd.cpp; math:
// math.h; checks: checks.h.
// Shapes as the NAC/NALU ops' (csrc/ops/nac_nalu/schema.cpp).
#include "common/registration.h"

namespace nalu_cuda {
namespace {

constexpr const char* kSchemas[] = {
  // NPU: y = exp(U) cos(V), U = lr W_r - k W_i, V = k W_r + lr W_i, with r = g (|x| + eps) + (1 - g),
  // lr = log r, k = g pi [x < 0], g = clamp(g, 0, 1) of shape (in,) / (E, in). RealNPU: W_i None
  // (W_i = 0). Returns (y, s, lr) with s = exp(U) sin(V) (y + i s = exp(U + i V)). Math:
  // csrc/ops/power/math.h.
  "npu_forward(Tensor x, Tensor W_r, Tensor? W_i, Tensor g, float eps) -> (Tensor, Tensor, Tensor)",
  // -> (grad_x, grad_W_r, grad_W_i, grad_g); grad_W_i has shape (0,) for RealNPU.
  "npu_backward(Tensor grad_y, Tensor x, Tensor W_r, Tensor? W_i, Tensor g, Tensor y, Tensor s, Tensor lr,"
      " float eps, bool compute_grad_x) -> (Tensor, Tensor, Tensor, Tensor)",

  // iNALU: y = g a + (1 - g) m clip(msv, -1, 1) with a = x W, u = log(max(|x|, eps)) W_m,
  // m = exp(min(u, omega)), msv = prod_i (sign(x_i) |W_m[i]| + 1 - |W_m[i]|), g = sigmoid(G) (G of
  // shape (out,) / (E, out)); W from (W_hat, M_hat), W_m from (W_hat_m, M_hat_m) as for NAC.
  // Returns (y, a, u, msv, lx) with lx = log(max(|x|, eps)).
  "inalu_forward(Tensor x, Tensor W_hat, Tensor M_hat, Tensor W_hat_m, Tensor M_hat_m, Tensor G, float eps,"
      " float omega) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
  // -> (grad_x, grad_W_hat, grad_M_hat, grad_W_hat_m, grad_M_hat_m, grad_G)
  "inalu_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, Tensor W_hat_m, Tensor M_hat_m,"
      " Tensor G, Tensor a, Tensor u, Tensor msv, Tensor lx, float eps, float omega, bool compute_grad_x)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
};

}  // namespace
}  // namespace nalu_cuda

NALU_CUDA_OP_FAMILY(power, kLayer, nalu_cuda::kSchemas)
