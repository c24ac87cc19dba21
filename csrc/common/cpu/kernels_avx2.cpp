// kernels_avx2.cpp: every family's CPU kernels (kernels_impl.h) compiled for AVX2 + FMA (8 floats
// per instruction instead of SSE2's 4); the ops call them (NALU_CPU_CALL, isa.h) only on
// processors that report both. All headers come in through kernels.h before the target switch, so
// only the kernels themselves use AVX2.
#include "common/cpu/kernels.h"

#ifdef NALU_CPU_HAVE_AVX2
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define NALU_CPU_ISA avx2
#define NALU_CPU_ISA_IS_AVX2 1  // the float dot products of rowwise_forward use AVX2 intrinsics
#include "common/cpu/kernels_impl.h"
#pragma GCC pop_options
#endif
