// nalu_ops.cpp: the schema of every nalu_cuda op, declared once.
//
// Kernels register per dispatch key elsewhere:
//   CPU       csrc/cpu/nalu_cpu.cpp (NAC, NAC*, NALU; kernels in csrc/cpu/kernels/), power_cpu.cpp
//             (NPU / RealNPU, iNALU), units_cpu.cpp (NAU, NMU)
//   CUDA      csrc/cuda/nalu_cuda.cpp, power_cuda.cpp, units_cuda.cpp (kernels in the *.cu beside
//             them); built only with CUDA
//   (the NAC/NALU ops of both devices go through one set of entry points, csrc/layer_ops.h: one
//   C++ signature per op, the shared checks, the registration; the device supplies the kernels)
//   Autograd  csrc/autograd.cpp, the one TORCH_LIBRARY_IMPL, which also registers the functions of
//             autograd_power.cpp and autograd_units.cpp (in C++: at the paper's sizes a Python
//             autograd wrapper costs more than the fused forward)
//   Autocast  csrc/autocast.cpp, the one TORCH_LIBRARY_IMPL per key (AutocastCPU, AutocastCUDA):
//             one boxed float32 kernel for every layer op
// (csrc/registration.h declares what those files export.) The fakes that torch.compile traces are
// registered from Python (nalu_cuda/_ops.py). The training helpers of csrc/training/ (flat_adam,
// uniform_fill) are no dispatcher ops: csrc/module.cpp binds them with pybind11, CPU only.
// Shapes: weights (I, O) with x (..., I), or (E, I, O) with x (E, ..., I).
//
// Forward ops also return what their backward needs beyond the inputs: lx = log(|x| + eps) (the
// costliest step on a CPU; autograd's reference path keeps it too), and a, m, g for NALU. W is
// rebuilt from W_hat and M_hat in backward: it is in x out, small next to the batch.
// A gradient that was not asked for (compute_grad_x = false, tied weights) comes back as a tensor
// of shape (0,), so that every return is a plain Tensor.
//
// One training op besides the layers: flat_adam_step_resident, the resident Adam step of the
// experiments' FlatAdam (a CUDA kernel only: csrc/cuda/flat_adam_cuda.cpp; on any other device, or in a
// build without CUDA kernels, the kernel below says so).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

TORCH_LIBRARY(nalu_cuda, m) {
  // W = tanh(W_hat) * sigmoid(M_hat), elementwise.
  m.def("nac_weight(Tensor W_hat, Tensor M_hat) -> Tensor");
  // (grad_W_hat, grad_M_hat) from grad_W.
  m.def("nac_weight_backward(Tensor grad_W, Tensor W_hat, Tensor M_hat) -> (Tensor, Tensor)");

  // NAC+: y = x W.
  m.def("nac_forward(Tensor x, Tensor W_hat, Tensor M_hat) -> Tensor");
  // -> (grad_x, grad_W_hat, grad_M_hat)
  m.def(
      "nac_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, bool compute_grad_x)"
      " -> (Tensor, Tensor, Tensor)");

  // NAC*: y = exp(log(|x| + eps) W). Returns (y, lx).
  m.def("nac_mul_forward(Tensor x, Tensor W_hat, Tensor M_hat, float eps) -> (Tensor, Tensor)");
  // -> (grad_x, grad_W_hat, grad_M_hat); y and lx come from the forward.
  m.def(
      "nac_mul_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, Tensor y, Tensor lx,"
      " float eps, bool compute_grad_x) -> (Tensor, Tensor, Tensor)");

  // NALU: y = g a + (1 - g) m with a = x W, m = exp(log(|x| + eps) W_m) and g = sigmoid(x G)
  // (input_gate) or sigmoid(G) (G of shape (O,) / (E, O)). W_m is W when W_hat_m and M_hat_m are
  // None (the paper's tied weights). Returns (y, a, m, g, lx); g has the shape of y for an input
  // gate and of G otherwise.
  m.def(
      "nalu_forward(Tensor x, Tensor W_hat, Tensor M_hat, Tensor? W_hat_m, Tensor? M_hat_m,"
      " Tensor G, float eps, bool input_gate) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // -> (grad_x, grad_W_hat, grad_M_hat, grad_W_hat_m, grad_M_hat_m, grad_G)
  m.def(
      "nalu_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, Tensor? W_hat_m,"
      " Tensor? M_hat_m, Tensor G, Tensor a, Tensor m, Tensor g, Tensor lx, float eps, bool input_gate,"
      " bool compute_grad_x) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

  // NPU: y = exp(U) cos(V), U = lr W_r - k W_i, V = k W_r + lr W_i, with r = g (|x| + eps) + (1 - g),
  // lr = log r, k = g pi [x < 0], g = clamp(g, 0, 1) of shape (in,) / (E, in). RealNPU: W_i None
  // (W_i = 0). Returns (y, s, lr) with s = exp(U) sin(V) (y + i s = exp(U + i V)). Math:
  // csrc/power_math.h.
  m.def("npu_forward(Tensor x, Tensor W_r, Tensor? W_i, Tensor g, float eps) -> (Tensor, Tensor, Tensor)");
  // -> (grad_x, grad_W_r, grad_W_i, grad_g); grad_W_i has shape (0,) for RealNPU.
  m.def(
      "npu_backward(Tensor grad_y, Tensor x, Tensor W_r, Tensor? W_i, Tensor g, Tensor y, Tensor s, Tensor lr,"
      " float eps, bool compute_grad_x) -> (Tensor, Tensor, Tensor, Tensor)");

  // iNALU: y = g a + (1 - g) m clip(msv, -1, 1) with a = x W, u = log(max(|x|, eps)) W_m,
  // m = exp(min(u, omega)), msv = prod_i (sign(x_i) |W_m[i]| + 1 - |W_m[i]|), g = sigmoid(G) (G of
  // shape (out,) / (E, out)); W from (W_hat, M_hat), W_m from (W_hat_m, M_hat_m) as for NAC.
  // Returns (y, a, u, msv, lx) with lx = log(max(|x|, eps)).
  m.def(
      "inalu_forward(Tensor x, Tensor W_hat, Tensor M_hat, Tensor W_hat_m, Tensor M_hat_m, Tensor G, float eps,"
      " float omega) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // -> (grad_x, grad_W_hat, grad_M_hat, grad_W_hat_m, grad_M_hat_m, grad_G)
  m.def(
      "inalu_backward(Tensor grad_y, Tensor x, Tensor W_hat, Tensor M_hat, Tensor W_hat_m, Tensor M_hat_m,"
      " Tensor G, Tensor a, Tensor u, Tensor msv, Tensor lx, float eps, float omega, bool compute_grad_x)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

  // NAU (neural addition unit): y = x clamp(W, -1, 1). W is the only parameter, (I, O) or (E, I, O).
  m.def("nau_forward(Tensor x, Tensor W) -> Tensor");
  // -> (grad_x, grad_W)
  m.def("nau_backward(Tensor grad_y, Tensor x, Tensor W, bool compute_grad_x) -> (Tensor, Tensor)");

  // NMU (neural multiplication unit): y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o]). Nothing
  // is saved beyond the inputs: the backward recomputes the factors (csrc/product_math.h).
  m.def("nmu_forward(Tensor x, Tensor W) -> Tensor");
  // -> (grad_x, grad_W)
  m.def("nmu_backward(Tensor grad_y, Tensor x, Tensor W, bool compute_grad_x) -> (Tensor, Tensor)");

  // The resident Adam step of FlatAdam.step_resident (nalu_cuda/experiments/parts/optim.py), no clipping,
  // one learning rate: param, grad, exp_avg, exp_avg_sq are the flat buffers (n,); segments (P, 2) int64
  // rows (offset, per_member) of the (E, ...) parameters; frozen (E,) bool; step_t a float64 scalar, the
  // step count, incremented here. Members in frozen or with a NaN/Inf gradient take a zero gradient (grad
  // is zeroed there). Returns nonfinite (E,) bool. Nothing is read back to the host (CUDA-graph capturable).
  m.def(
      "flat_adam_step_resident(Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq,"
      " Tensor segments, Tensor frozen, Tensor(e!) step_t, float lr, float beta1, float beta2, float eps) -> Tensor");
}

namespace {

// Every device without a kernel of flat_adam_step_resident (any but CUDA; every one in a build
// without CUDA kernels): a clear error instead of the dispatcher's.
at::Tensor flat_adam_step_resident_unsupported(const at::Tensor& param, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, double, double, double) {
#ifdef NALU_CUDA_WITH_CUDA
  const char* build = "";
#else
  const char* build = " (and this build of nalu_cuda has no CUDA kernels: it was built without CUDA)";
#endif
  TORCH_CHECK(false, "flat_adam_step_resident: argument 'param' must be a CUDA tensor, got ",
              param.defined() ? c10::str("a tensor on ", param.device()) : std::string("an undefined tensor"),
              build, "; the fused step on the CPU is nalu_cuda._C.flat_adam_step");
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, CompositeExplicitAutograd, m) {
  m.impl("flat_adam_step_resident", &flat_adam_step_resident_unsupported);
}
