// kernels_base.cpp: the CPU kernels for the compiler's default target (runs on any CPU).
#include "nalu_cpu.h"

#define NALU_CPU_ISA base
#include "nalu_cpu_kernels.h"
