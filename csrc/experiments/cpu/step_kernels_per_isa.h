// step_kernels_per_isa.h: the per-member kernels of a native training step, once per instruction
// set: layer_kernels.h and the step's own kernels (the header NALU_STEP_KERNELS names) inside
// namespace base, and again inside namespace avx2 under the AVX2 target where the build has it;
// NALU_STEP_PER_ISA(run, fn) calls run(avx2::fn) where the CPU has AVX2 (cpu::use_avx2()), else
// run(base::fn). Included by ensemble_step.cpp and
// recurrent_step.cpp after every header the kernels need; no include guard.
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
#endif

#ifdef NALU_CPU_HAVE_AVX2
#define NALU_STEP_PER_ISA(run, fn) (cpu::use_avx2() ? run(avx2::fn) : run(base::fn))
#else
#define NALU_STEP_PER_ISA(run, fn) run(base::fn)
#endif
