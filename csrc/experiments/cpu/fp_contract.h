// fp_contract.h: NALU_FP_CONTRACT_OFF, written at file scope in a training/*.cpp after its includes:
// from there to the end of that file no a * b + c is contracted into a fused multiply-add, whatever
// -march the file is compiled with. A macro rather than a pragma in this header, so that the pragma
// stands where the macro is written, in the file it is meant for.
#pragma once

#if defined(__clang__)
#define NALU_FP_CONTRACT_OFF _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define NALU_FP_CONTRACT_OFF _Pragma("GCC optimize(\"fp-contract=off\")")
#else
#define NALU_FP_CONTRACT_OFF
#endif
