// kernels_base.cpp: every family's CPU kernels (kernels_impl.h) for the compiler's default target
// (runs on any CPU).
#include "common/cpu/kernels.h"

#define NALU_CPU_ISA base
#include "common/cpu/kernels_impl.h"
