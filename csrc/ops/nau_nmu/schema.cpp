// schema.cpp: the schemas of the NAU and NMU ops, declared once; the family's registration
// (csrc/common/registration.h) defines them and gives them the autocast policy. Entry points: ops.h;
// kernels: cpu/nau_nmu_cpu.cpp, cuda/nau_nmu_cuda.cpp; autograd: autograd.cpp; math: math.h;
// checks: checks.h.
#include "common/registration.h"

namespace nalu_cuda {
namespace {

constexpr const char* kSchemas[] = {
  // NAU (neural addition unit): y = x clamp(W, -1, 1). W is the only parameter, (I, O) or (E, I, O).
  "nau_forward(Tensor x, Tensor W) -> Tensor",
  // -> (grad_x, grad_W)
  "nau_backward(Tensor grad_y, Tensor x, Tensor W, bool compute_grad_x) -> (Tensor, Tensor)",

  // NMU (neural multiplication unit): y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o]). Nothing
  // is saved beyond the inputs: the backward recomputes the factors (csrc/ops/nau_nmu/math.h).
  "nmu_forward(Tensor x, Tensor W) -> Tensor",
  // -> (grad_x, grad_W)
  "nmu_backward(Tensor grad_y, Tensor x, Tensor W, bool compute_grad_x) -> (Tensor, Tensor)",
};

}  // namespace
}  // namespace nalu_cuda

NALU_CUDA_OP_FAMILY(nau_nmu, kLayer, nalu_cuda::kSchemas)
