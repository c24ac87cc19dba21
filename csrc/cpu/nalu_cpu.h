// nalu_cpu.h: the interface between the CPU ops (nalu_cpu.cpp: checks, registration, choice of
// instruction set) and the CPU kernels, which are compiled once per instruction set from
// nalu_cpu_kernels.h: `base` (the compiler's default target) and, on x86-64, `avx2` (AVX2 + FMA),
// chosen at run time from what the processor supports.
//
// Every header the kernels need is included here, before any `#pragma GCC target`, so that no
// inline function outside the kernels is ever compiled for AVX2 (it could be linked into the
// baseline path and break processors without AVX2).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../blas_path.h"
#include "../nalu_layer.h"
#include "../nalu_math.h"
#include "../product_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NALU_CPU_HAVE_AVX2 1
#endif

namespace nalu_cuda {
namespace cpu {

// The kernels of one instruction set. Arguments are checked by the caller.
#define NALU_CPU_DECLARE_KERNELS(ISA)                                                              \
  namespace ISA {                                                                                 \
  Forward layer_forward(const LayerKind& kind, const LayerShape& s, const at::Tensor& x,          \
                        const LayerParams& p, double eps);                                        \
  Backward layer_backward(const LayerKind& kind, const LayerShape& s, const at::Tensor& grad_y,   \
                          const at::Tensor& x, const LayerParams& p, const Forward& saved,        \
                          double eps, bool compute_grad_x);                                       \
  at::Tensor weight(const at::Tensor& W_hat, const at::Tensor& M_hat);                            \
  std::tuple<at::Tensor, at::Tensor> weight_backward(const at::Tensor& grad_W, const at::Tensor& W_hat, \
                                                     const at::Tensor& M_hat);                     \
  at::Tensor nau_forward(const LayerShape& s, const at::Tensor& x, const at::Tensor& W);          \
  std::tuple<at::Tensor, at::Tensor> nau_backward(const LayerShape& s, const at::Tensor& grad_y,  \
                                                  const at::Tensor& x, const at::Tensor& W,       \
                                                  bool compute_grad_x);                           \
  at::Tensor nmu_forward(const LayerShape& s, const at::Tensor& x, const at::Tensor& W);          \
  std::tuple<at::Tensor, at::Tensor> nmu_backward(const LayerShape& s, const at::Tensor& grad_y,  \
                                                  const at::Tensor& x, const at::Tensor& W,       \
                                                  bool compute_grad_x);                           \
  }

NALU_CPU_DECLARE_KERNELS(base)
#ifdef NALU_CPU_HAVE_AVX2
NALU_CPU_DECLARE_KERNELS(avx2)
#endif

// Whether to run the AVX2 + FMA code: the processor has it and NALU_CUDA_CPU_ISA is not "base"
// (decided once per process).
bool use_avx2();

// fn(args...) of the best instruction set's kernels.
#ifdef NALU_CPU_HAVE_AVX2
#define NALU_CPU_CALL(fn, ...) (::nalu_cuda::cpu::use_avx2() ? avx2::fn(__VA_ARGS__) : base::fn(__VA_ARGS__))
#else
#define NALU_CPU_CALL(fn, ...) base::fn(__VA_ARGS__)
#endif

// The dtypes of every CPU kernel: float32 and float64.
const std::vector<at::ScalarType>& cpu_dtypes();

}  // namespace cpu
}  // namespace nalu_cuda
