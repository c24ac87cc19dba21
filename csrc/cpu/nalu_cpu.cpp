// nalu_cpu.cpp: the CPU ops. Each checks its arguments (csrc/nalu_layer.h), then runs the kernels
// of the best instruction set the processor has (nalu_cpu_kernels.h, compiled as `base` and, on
// x86-64, `avx2`). The environment variable NALU_CUDA_CPU_ISA=base forces the baseline kernels
// (the tests use it to check both builds).
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "nalu_cpu.h"

namespace nalu_cuda {
namespace cpu {
namespace {

const std::vector<at::ScalarType>& cpu_dtypes() {
  static const std::vector<at::ScalarType> kTypes{at::kFloat, at::kDouble};
  return kTypes;
}

#ifdef NALU_CPU_HAVE_AVX2
#define NALU_CPU_CALL(fn, ...) (use_avx2() ? avx2::fn(__VA_ARGS__) : base::fn(__VA_ARGS__))
#else
#define NALU_CPU_CALL(fn, ...) base::fn(__VA_ARGS__)
#endif

// The parameters of one call, each made contiguous here, once, and owned by the LayerParams for
// the whole call: the kernels read them through raw pointers, which must never point into a
// temporary copy (a `t.contiguous().data_ptr()` of a non-contiguous `t` dangles at the `;`).
LayerParams params(const at::Tensor& W_hat, const at::Tensor& M_hat,
                   const c10::optional<at::Tensor>& W_hat_m = c10::nullopt,
                   const c10::optional<at::Tensor>& M_hat_m = c10::nullopt, const at::Tensor& G = at::Tensor()) {
  auto own = [](const at::Tensor& t) { return t.defined() ? t.contiguous() : t; };
  LayerParams p;
  p.W_hat = own(W_hat);
  p.M_hat = own(M_hat);
  if (W_hat_m.has_value()) p.W_hat_m = own(*W_hat_m);
  if (M_hat_m.has_value()) p.M_hat_m = own(*M_hat_m);
  p.G = own(G);
  return p;
}

Forward forward(const char* op, const LayerKind& kind, const at::Tensor& x, const LayerParams& p, double eps) {
  const LayerShape s = check_layer(op, kind, x, p, eps);
  check_dtype_supported(op, x, "CPU", cpu_dtypes());
  return NALU_CPU_CALL(layer_forward, kind, s, x, p, eps);
}

Backward backward(const char* op, const LayerKind& kind, const at::Tensor& grad_y, const at::Tensor& x,
                  const LayerParams& p, const Forward& saved, double eps, bool compute_grad_x) {
  const LayerShape s = check_layer(op, kind, x, p, eps);
  check_dtype_supported(op, x, "CPU", cpu_dtypes());
  check_saved(op, kind, s, x, p.G, grad_y, saved.a, saved.m, saved.g, saved.lx);
  Backward g = NALU_CPU_CALL(layer_backward, kind, s, grad_y, x, p, saved, eps, compute_grad_x);
  if (!g.grad_x.defined()) g.grad_x = empty_grad(x);
  if (kind.add && kind.mul && kind.tied) {
    g.grad_W_hat_m = empty_grad(x);
    g.grad_M_hat_m = empty_grad(x);
  }
  return g;
}

at::Tensor nac_weight_cpu(const at::Tensor& W_hat, const at::Tensor& M_hat) {
  const char* op = "nalu_cuda::nac_weight";
  check_weight_pair(op, W_hat, M_hat, "W_hat", "M_hat", /*layer_shape=*/false);
  check_dtype_supported(op, W_hat, "CPU", cpu_dtypes());
  return NALU_CPU_CALL(weight, W_hat, M_hat);
}

std::tuple<at::Tensor, at::Tensor> nac_weight_backward_cpu(const at::Tensor& grad_W, const at::Tensor& W_hat,
                                                           const at::Tensor& M_hat) {
  const char* op = "nalu_cuda::nac_weight_backward";
  check_weight_pair(op, W_hat, M_hat, "W_hat", "M_hat", /*layer_shape=*/false);
  check_dtype_supported(op, W_hat, "CPU", cpu_dtypes());
  check_like(op, "grad_W", grad_W, W_hat.sizes(), W_hat);
  return NALU_CPU_CALL(weight_backward, grad_W, W_hat, M_hat);
}

at::Tensor nac_forward_cpu(const at::Tensor& x, const at::Tensor& W_hat, const at::Tensor& M_hat) {
  return forward("nalu_cuda::nac_forward", kNacAdd, x, params(W_hat, M_hat), 0.0).y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nac_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                                const at::Tensor& W_hat, const at::Tensor& M_hat,
                                                                bool compute_grad_x) {
  Backward g = backward("nalu_cuda::nac_backward", kNacAdd, grad_y, x, params(W_hat, M_hat), Forward{}, 0.0,
                        compute_grad_x);
  return {g.grad_x, g.grad_W_hat, g.grad_M_hat};
}

std::tuple<at::Tensor, at::Tensor> nac_mul_forward_cpu(const at::Tensor& x, const at::Tensor& W_hat,
                                                       const at::Tensor& M_hat, double eps) {
  Forward f = forward("nalu_cuda::nac_mul_forward", kNacMul, x, params(W_hat, M_hat), eps);
  return {f.y, f.lx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nac_mul_backward_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& W_hat, const at::Tensor& M_hat,
                                                                    const at::Tensor& y, const at::Tensor& lx,
                                                                    double eps, bool compute_grad_x) {
  Forward saved;
  saved.m = y;
  saved.lx = lx;
  Backward g = backward("nalu_cuda::nac_mul_backward", kNacMul, grad_y, x, params(W_hat, M_hat), saved, eps,
                        compute_grad_x);
  return {g.grad_x, g.grad_W_hat, g.grad_M_hat};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> nalu_forward_cpu(
    const at::Tensor& x, const at::Tensor& W_hat, const at::Tensor& M_hat, const c10::optional<at::Tensor>& W_hat_m,
    const c10::optional<at::Tensor>& M_hat_m, const at::Tensor& G, double eps, bool input_gate) {
  Forward f = forward("nalu_cuda::nalu_forward", nalu_kind(W_hat_m, M_hat_m, input_gate), x,
                      params(W_hat, M_hat, W_hat_m, M_hat_m, G), eps);
  return {f.y, f.a, f.m, f.g, f.lx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> nalu_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& W_hat, const at::Tensor& M_hat,
    const c10::optional<at::Tensor>& W_hat_m, const c10::optional<at::Tensor>& M_hat_m, const at::Tensor& G,
    const at::Tensor& a, const at::Tensor& m, const at::Tensor& g, const at::Tensor& lx, double eps,
    bool input_gate, bool compute_grad_x) {
  Forward saved{at::Tensor(), a, m, g, lx};
  Backward r = backward("nalu_cuda::nalu_backward", nalu_kind(W_hat_m, M_hat_m, input_gate), grad_y, x,
                        params(W_hat, M_hat, W_hat_m, M_hat_m, G), saved, eps, compute_grad_x);
  return {r.grad_x, r.grad_W_hat, r.grad_M_hat, r.grad_W_hat_m, r.grad_M_hat_m, r.grad_G};
}

}  // namespace

bool use_avx2() {
#ifdef NALU_CPU_HAVE_AVX2
  static const bool kUse = [] {
    const char* forced = std::getenv("NALU_CUDA_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "base") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return kUse;
#else
  return false;
#endif
}

}  // namespace cpu

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("nac_weight", &cpu::nac_weight_cpu);
  m.impl("nac_weight_backward", &cpu::nac_weight_backward_cpu);
  m.impl("nac_forward", &cpu::nac_forward_cpu);
  m.impl("nac_backward", &cpu::nac_backward_cpu);
  m.impl("nac_mul_forward", &cpu::nac_mul_forward_cpu);
  m.impl("nac_mul_backward", &cpu::nac_mul_backward_cpu);
  m.impl("nalu_forward", &cpu::nalu_forward_cpu);
  m.impl("nalu_backward", &cpu::nalu_backward_cpu);
}

}  // namespace nalu_cuda
