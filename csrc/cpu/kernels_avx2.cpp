// kernels_avx2.cpp: the CPU kernels compiled for AVX2 + FMA (8 floats per instruction instead of
// SSE2's 4); nalu_cpu.cpp calls them only on processors that report both. All headers come in
// through nalu_cpu.h before the target switch, so only the kernels themselves use AVX2.
#include "nalu_cpu.h"

#ifdef NALU_CPU_HAVE_AVX2
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define NALU_CPU_ISA avx2
#define NALU_CPU_ISA_IS_AVX2 1  // the float dot products of rowwise_forward use AVX2 intrinsics
#include "nalu_cpu_kernels.h"
#pragma GCC pop_options
#endif
