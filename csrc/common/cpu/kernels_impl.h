// kernels_impl.h: the definitions of every family's CPU kernels that are compiled per instruction
// set, included once per instruction set (kernels_base.cpp, kernels_avx2.cpp) with NALU_CPU_ISA
// set to the namespace to define. In this order: each part uses only what the parts before it
// define (the NAU's kernels run the NAC+'s rowwise path); they include nothing else (see isa.h).
#ifndef NALU_CPU_ISA
#error "define NALU_CPU_ISA (the namespace of this instruction set) before including kernels_impl.h"
#endif

#include "ops/nac_nalu/cpu/kernels_impl.h"  // NAC+, NAC*, NALU, the weight construction
#include "ops/nau_nmu/cpu/nau_kernels.h"    // nau_forward, nau_backward (on the parts above)
#include "ops/nau_nmu/cpu/nmu_kernels.h"    // nmu_forward, nmu_backward (uses only common.h's dispatch)
