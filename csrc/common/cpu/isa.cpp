// isa.cpp: the choice of instruction set of every CPU kernel (isa.h). The environment variable
// NALU_CUDA_CPU_ISA=base forces the baseline kernels (the tests use it to check both builds);
// NALU_CUDA_CPU_ISA=avx2 keeps the training steps' kernels off their AVX-512 copy.
#include "common/cpu/isa.h"

#include <cstdlib>
#include <cstring>

namespace nalu_cuda {
namespace cpu {

const std::vector<at::ScalarType>& cpu_dtypes() {
  static const std::vector<at::ScalarType> kTypes{at::kFloat, at::kDouble};
  return kTypes;
}

bool use_avx2() {
#ifdef NALU_CPU_HAVE_AVX2
  static const bool kUse = [] {
    const char* forced = std::getenv("NALU_CUDA_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "base") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return kUse;
#else
  return false;
#endif
}

bool use_avx512() {
#ifdef NALU_CPU_HAVE_AVX2
  static const bool kUse = [] {
    const char* forced = std::getenv("NALU_CUDA_CPU_ISA");  // ("base": use_avx2() is false)
    if (forced != nullptr && std::strcmp(forced, "avx2") == 0) return false;
    return use_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
  }();
  return kUse;
#else
  return false;
#endif
}

}  // namespace cpu
}  // namespace nalu_cuda
