// step_kernels_per_isa.h: the per-member kernels of a native training step, once per instruction
// set: layer_kernels.h and the step's own kernels (the header NALU_STEP_KERNELS names) inside
// namespace base, and again inside namespace avx2 under the AVX2 target and inside namespace avx512
// under the AVX-512 target where the build has them; NALU_STEP_PER_ISA(run, fn) calls run(avx512::fn)
// where the CPU has AVX-512 (cpu::use_avx512()), else run(avx2::fn) where it has AVX2
// (cpu::use_avx2()), else run(base::fn). The AVX-512 copy is the AVX2 copy's code with 32 vector
// registers, and 64-byte vectors where the compiler vectorises an element-wise loop (the
// logarithms of a NALU's inputs) and in the column sums (one column per lane); the other sums run
// on their 32-byte lane vectors in every copy, so every copy gives the same bits
// (python_tests/test_step_isa.py). Included by ensemble_step.cpp, recurrent_step.cpp and
// lstm_sequence.cpp after every header the kernels need; no include guard.
#ifndef NALU_STEP_KERNELS
#error "define NALU_STEP_KERNELS (the step's kernel header) before including step_kernels_per_isa.h"
#endif

namespace base {
#include "experiments/cpu/layer_kernels.h"
#include NALU_STEP_KERNELS
}  // namespace base
#ifdef NALU_CPU_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "experiments/cpu/layer_kernels.h"
#include NALU_STEP_KERNELS
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl,avx512dq,avx512bw,prefer-vector-width=512")
#undef NALU_STEP_COLUMN_BYTES  // (32, as layer_kernels.h set it for the copies above)
#define NALU_STEP_COLUMN_BYTES 64
namespace avx512 {
#include "experiments/cpu/layer_kernels.h"
#include NALU_STEP_KERNELS
}  // namespace avx512
#undef NALU_STEP_COLUMN_BYTES
#pragma GCC pop_options
#endif

#ifdef NALU_CPU_HAVE_AVX2
#define NALU_STEP_PER_ISA(run, fn) \
  (cpu::use_avx512() ? run(avx512::fn) : cpu::use_avx2() ? run(avx2::fn) : run(base::fn))
#else
#define NALU_STEP_PER_ISA(run, fn) run(base::fn)
#endif
