// schema.cpp: the schemas of the NAC/NALU ops (NAC+, NAC*, NALU and the weight construction),
// declared once. NALU_CUDA_OP_FAMILY (csrc/common/registration.h) defines them and registers the
// autocast policy of every one of them; nalu_cuda._ops reads the op names back from the library.
//
// The family's other parts, in this folder: ops.h (one C++ entry point per op over a device struct:
// the shared checks and the registration of the device kernels), checks.h/.cpp (argument checks),
// math.h (host/device math), blas_path.h (the blas path's products), autograd.cpp; cpu/ (the CPU
// device: nac_nalu_cpu.cpp, the kernels in the other headers, compiled per instruction set by
// csrc/common/cpu/kernels_*.cpp) and cuda/ (nac_nalu_cuda.cpp, the kernels in *.cu).
// Shapes: weights (I, O) with x (..., I), or (E, I, O) with x (E, ..., I).
//
// Forward ops also return what their backward needs beyond the inputs: lx = log(|x| + eps) (the
// costliest step on a CPU; autograd's reference path keeps it too), and a, m, g for NALU. W is
// rebuilt from W_hat and M_hat in backward: it is in x out, small next to the batch.
// A gradient that was not asked for (compute_grad_x = false, tied weights, no gate bias) comes back as a tensor
// of shape (0,), so that every return is a plain Tensor.
#include "common/registration.h"

namespace nalu_cuda {
namespace {

constexpr const char* kSchemas[] = {
  // W = tanh(W_hat) * sigmoid(M_hat), elementwise.
  "nac_weight(Tensor W_hat, Tensor M_hat) -> Tensor",
  // (grad_W_hat, grad_M_hat) from grad_W.
  "nac_weight_backward(Tensor grad_W, Tensor W_hat, Tensor M_hat) -> (Tensor, Tensor)",

  // NAC+: y = x W.
  "nac_forward(Tensor x, Tensor W_hat, Tensor M_hat) -> Tensor",
  // -> (grad_x, grad_W_hat, grad_M_hat)
  "nac_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, bool compute_grad_x)"
      " -> (Tensor, Tensor, Tensor)",

  // NAC*: y = exp(log(|x| + eps) W). Returns (y, lx).
  "nac_mul_forward(Tensor x, Tensor W_hat, Tensor M_hat, float eps) -> (Tensor, Tensor)",
  // -> (grad_x, grad_W_hat, grad_M_hat); y and lx come from the forward.
  "nac_mul_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, Tensor y, Tensor lx,"
      " float eps, bool compute_grad_x) -> (Tensor, Tensor, Tensor)",

  // NALU: y = g a + (1 - g) m with a = x W, m = exp(log(|x| + eps) W_m) and g = sigmoid(x G + G_bias)
  // (input_gate; G_bias of shape (O,) / (E, O), optional: stable-nalu's nalu_bias) or sigmoid(G)
  // (G of shape (O,) / (E, O)). W_m is W when W_hat_m and M_hat_m are None (the paper's tied
  // weights). Returns (y, a, m, g, lx, r); g has the shape of y for an input gate and of G otherwise;
  // r is the gate regulariser sum(g^2 (1 - g)^2) over all of g (nalu_gate_regularizer's) when
  // gate_regularizer, else a tensor of shape (0,). Under autograd a, m, g and r are differentiable
  // (nalu_parts: a loss on the gate or a path; r: stable-nalu's gate regulariser from the same call).
  "nalu_forward(Tensor x, Tensor W_hat, Tensor M_hat, Tensor? W_hat_m, Tensor? M_hat_m,"
      " Tensor G, float eps, bool input_gate, Tensor? G_bias=None, bool gate_regularizer=False)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
  // -> (grad_x, grad_W_hat, grad_M_hat, grad_W_hat_m, grad_M_hat_m, grad_G, grad_G_bias). grad_a,
  // grad_m, grad_g: gradients that reach the forward's a, m, g directly (each of a's, m's, g's
  // shape; None: none), added to those through y. grad_gate_regularizer: the gradient (0-dim) that
  // reaches the forward's r, whose gradient grad 2 g (1 - g) (1 - 2 g) is added to grad_g.
  "nalu_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, Tensor? W_hat_m,"
      " Tensor? M_hat_m, Tensor G, Tensor a, Tensor m, Tensor g, Tensor lx, float eps, bool input_gate,"
      " bool compute_grad_x, Tensor? G_bias=None, Tensor? grad_a=None, Tensor? grad_m=None,"
      " Tensor? grad_g=None, Tensor? grad_gate_regularizer=None)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",

  // The gate regulariser sum(g^2 (1 - g)^2) over every element of a gate g (stable-nalu's
  // nalu_gate='regualized': it pushes each gate value to 0 or 1): a 0-dim tensor, or with
  // per_member one value per member of an ensemble's g (E, ...): (E,).
  "nalu_gate_regularizer(Tensor g, bool per_member=False) -> Tensor",
  // grad_g = grad 2 g (1 - g) (1 - 2 g), grad of the regulariser's shape.
  "nalu_gate_regularizer_backward(Tensor grad, Tensor g, bool per_member=False) -> Tensor",
};

}  // namespace
}  // namespace nalu_cuda

NALU_CUDA_OP_FAMILY(nac_nalu, kLayer, nalu_cuda::kSchemas)
