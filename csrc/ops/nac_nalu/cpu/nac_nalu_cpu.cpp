// nac_nalu_cpu.cpp: the CPU device of the NAC/NALU ops, registered through their entry points
// (csrc/ops/nac_nalu/ops.h, which checks the arguments): each runs the kernels of the best
// instruction set the processor has (kernels.h; compiled as `base` and, on x86-64, `avx2`: see
// csrc/common/cpu/isa.h).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops/nac_nalu/ops.h"
#include "ops/nac_nalu/cpu/kernels.h"

#include <utility>

namespace nalu_cuda {
namespace cpu {
namespace {

// The gate regulariser of `members` members of n values each: sum(g^2 (1 - g)^2) per member,
// accumulated in double in index order (so one value whatever the thread count), and its
// gradient grad 2 g (1 - g) (1 - 2 g). Elementwise and memory-bound: one instruction set.
template <typename T>
void gate_regularizer_kernel(const T* g, int64_t members, int64_t n, T* out) {
  for (int64_t e = 0; e < members; ++e) {
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = g[e * n + i];
      const double h = v * (1 - v);
      acc += h * h;
    }
    out[e] = static_cast<T>(acc);
  }
}

template <typename T>
void gate_regularizer_backward_kernel(const T* grad, const T* g, int64_t members, int64_t n, T* out) {
  for (int64_t e = 0; e < members; ++e) {
    const T two_grad = 2 * grad[e];
    for (int64_t i = 0; i < n; ++i) {
      const T v = g[e * n + i];
      out[e * n + i] = two_grad * (v * (1 - v)) * (1 - 2 * v);
    }
  }
}

// Members and values per member of a regulariser of shape `out` ([] or [E]) over g.
std::pair<int64_t, int64_t> gate_layout(const at::Tensor& g, at::IntArrayRef out) {
  const int64_t members = out.empty() ? 1 : out[0];
  return {members, members == 0 ? 0 : g.numel() / members};
}

// The CPU device of the ops' entry points (csrc/ops/nac_nalu/ops.h).
struct Cpu {
  static void check_input(const char* op, const char* name, const at::Tensor& t) {
    (void)name;  // the dtype message names the op and x's dtype
    check_dtype_supported(op, t, "CPU", cpu_dtypes());
  }
  static Forward forward(const LayerArgs& args, const LayerShape& s, const at::Tensor& x, const LayerParams& p) {
    return NALU_CPU_CALL(layer_forward, args, s, x, p);
  }
  static Backward backward(const LayerArgs& args, const LayerShape& s, const at::Tensor& grad_y, const at::Tensor& x,
                           const LayerParams& p, const Forward& saved, const PartGrads& parts) {
    return NALU_CPU_CALL(layer_backward, args, s, grad_y, x, p, saved, parts);
  }
  static at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat) {
    return NALU_CPU_CALL(weight, W_hat, M_hat);
  }
  static std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W, const at::Tensor& W_hat,
                                                            const at::Tensor& M_hat) {
    return NALU_CPU_CALL(weight_backward, grad_W, W_hat, M_hat);
  }
  static at::Tensor gate_regularizer(const at::Tensor& g, at::IntArrayRef out) {
    at::Tensor r = new_cpu_tensor(out, g.options());
    const auto [members, n] = gate_layout(g, out);
    AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "nalu_gate_regularizer", [&] {
      gate_regularizer_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), members, n, r.mutable_data_ptr<scalar_t>());
    });
    return r;
  }
  static at::Tensor gate_regularizer_backward(const at::Tensor& grad, const at::Tensor& g) {
    at::Tensor r = new_cpu_tensor(g.sizes(), g.options());
    const auto [members, n] = gate_layout(g, grad.sizes());
    AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "nalu_gate_regularizer_backward", [&] {
      gate_regularizer_backward_kernel<scalar_t>(grad.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                                                 members, n, r.mutable_data_ptr<scalar_t>());
    });
    return r;
  }
};

}  // namespace

}  // namespace cpu

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) { LayerOps<cpu::Cpu>::register_kernels(m); }

}  // namespace nalu_cuda
