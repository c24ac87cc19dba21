// kernels.h: the declarations of every family's CPU kernels that are compiled per instruction set
// (each family's cpu/kernels.h), included by kernels_base.cpp and kernels_avx2.cpp before any
// `#pragma GCC target` (see isa.h). The definitions: kernels_impl.h.
#pragma once

#include "ops/nac_nalu/cpu/kernels.h"
#include "ops/nau_nmu/cpu/kernels.h"
