// counter_draw.h: CounterStream's values (nalu_cuda/experiments/parts/counter_stream.py) for the
// static step's kernels that draw their batch themselves: the CUDA kernel
// (cuda/ensemble_step_kernels.cu, static_ensemble_grad_counter) and the CPU kernels
// (cpu/ensemble_step.cpp, static_ensemble_grad_counter and static_ensemble_step_counter). Element
// `index` of seed s's draw at `step` is a chain of three lowbias32 hashes of (index, the seed's key,
// the step); its top 23 bits are u in [0, 1) on a 2^-23 grid, and x = lo + u (hi - lo) in float32
// (the product rounded on its own), at most `top` = nextafter(hi, lo). Plain C++ and NALU_HD: no
// ATen here (nvcc and the CUDA emulator compile it too). The hash is a template, so that the CPU
// kernels run it on lane vectors (GCC vector extensions) and the CUDA kernel on one uint32_t.
#pragma once

#include <cstdint>

#include "common/math.h"  // NALU_HD

namespace nalu_cuda {
namespace training {

constexpr int kStepMaxOps = 16;

// The draw's arguments: member e = k S + s trains on seed s's batch with target op ops[k]
// (target_ops.h's codes): the float64 sums of its inputs with masks[s] columns 0 and 1.
struct CounterDraw {
  const int64_t* keys;   // (S, 2) the seeds' keys, 32-bit values
  const int64_t* step;   // the step (one int64 where the kernel runs: a captured CUDA graph advances it)
  const double* masks;   // (S, I, 2) the subsets' weights
  int64_t S, n_ops;
  int ops[kStepMaxOps];
  float lo, hi, top;     // the interval, and the largest value drawn: nextafter(hi, lo) in float32
};

// lowbias32 (C. Wellons' integer-hash search), counter_stream.py's hash32, in place on a uint32_t
// or on a vector of them (in place: a 32-byte vector returned by value would change the ABI of the
// CPU kernels' copy built without AVX).
template <typename U>
NALU_HD void lowbias32(U& x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
}

// One seed's words at one step (counter_stream.py's uniform_bits, lane 0).
struct CounterKey {
  uint32_t k0, k1, s_lo, s_hi;

  NALU_HD CounterKey() : k0(0), k1(0), s_lo(0), s_hi(0) {}
  NALU_HD CounterKey(const CounterDraw& d, int64_t seed, int64_t step)
      : k0(static_cast<uint32_t>(d.keys[2 * seed])), k1(static_cast<uint32_t>(d.keys[2 * seed + 1])),
        s_lo(static_cast<uint32_t>(step & 0xFFFFFFFF)), s_hi(static_cast<uint32_t>((step >> 32) & 0xFFFFFFFF)) {}

  // h: the elements' indices on entry, their 32-bit words on return (U: uint32_t or a vector of them)
  template <typename U>
  NALU_HD void words(U& h) const {
    h += k0;
    lowbias32(h);
    h = (h ^ s_lo) + k1;
    lowbias32(h);
    h = (h ^ s_hi) + 0x632BE5ABu;
    lowbias32(h);
  }

  NALU_HD uint32_t word(uint32_t index) const {
    words(index);
    return index;
  }
};

// u = the word's top 23 bits times 2^-23 (exact), in [0, 1).
constexpr float kCounterUnit = 1.1920928955078125e-07f;

}  // namespace training
}  // namespace nalu_cuda
