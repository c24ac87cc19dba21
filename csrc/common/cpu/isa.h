// isa.h: the instruction sets of the CPU kernels, shared by every family. The kernels are compiled
// once per instruction set (csrc/common/cpu/kernels_base.cpp, kernels_avx2.cpp, from the families'
// headers listed in kernels.h): `base` (the compiler's default target) and, on x86-64, `avx2`
// (AVX2 + FMA), chosen at run time from what the processor supports (isa.cpp). A family declares
// its kernels per instruction set (NALU_CPU_FOR_EACH_ISA) in its cpu/kernels.h and calls them with
// NALU_CPU_CALL.
//
// Every header the kernels need is included here or by those kernels.h, before any
// `#pragma GCC target`, so that no inline function outside the kernels is ever compiled for AVX2
// (it could be linked into the baseline path and break processors without AVX2).
#pragma once

#include <ATen/EmptyTensor.h>
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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NALU_CPU_HAVE_AVX2 1
#endif

namespace nalu_cuda {
namespace cpu {

// An uninitialised CPU tensor of `sizes` with `opts` (a CPU tensor's options), for results the
// kernels write whole: at::detail::empty_cpu, what at::empty reaches on the CPU, without at::empty's
// round trip through the dispatcher, which costs several thousand instructions a call (a NALU
// call allocates about ten tensors: at the paper's sizes, more than a third of its kernels' work).
inline at::Tensor new_cpu_tensor(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  return at::Tensor(at::detail::empty_cpu(sizes, opts));
}

// DECL(base), and DECL(avx2) where the avx2 kernels are built: a family's kernel header declares
// its kernels once per instruction set with it.
#ifdef NALU_CPU_HAVE_AVX2
#define NALU_CPU_FOR_EACH_ISA(DECL) DECL(base) DECL(avx2)
#else
#define NALU_CPU_FOR_EACH_ISA(DECL) DECL(base)
#endif

// Whether to run the AVX2 + FMA code: the processor has it and NALU_CUDA_CPU_ISA is not "base"
// (decided once per process).
bool use_avx2();

// Whether the native training steps' kernels (csrc/experiments/cpu/step_kernels_per_isa.h) take
// their AVX-512 copy: use_avx2() and the processor has AVX-512 F, VL, DQ and BW, unless
// NALU_CUDA_CPU_ISA is "base" or "avx2". The same operations per element as the AVX2 copy (32
// vector registers instead of 16, 64-byte vectors in the element-wise loops and the column sums),
// so the same bits.
bool use_avx512();

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
