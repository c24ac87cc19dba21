// uniform_fill.h: float32 uniforms from numpy's SFC64 generator, bit for bit as the numpy code of
// nalu_cuda.experiments.arithmetic.UniformStream computes them, but in one pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace nalu_cuda {
namespace training {

// Fills `out` in C order from SFC64 generators and advances their states in place.
//
//   state  int64, contiguous: (4,) for one generator (then `out` is (rows, n)), or (G, 4) for G
//          generators (then `out` is (rows, G, n) and generator g fills out[:, g, :]). A row of
//          `state` is numpy's uint64 state array (s[3] is the counter) viewed as int64.
//   out    float32, last dimension contiguous, other strides free; regions must not overlap.
//
// A generator fills its rows*n values from ceil(rows*n / 2) 64-bit outputs, low 32 bits first
// (numpy's random_raw(...).view(np.uint32)); a pair may straddle two rows, and the unused high
// half of the last output, when rows*n is odd, is dropped. Value from word u: the float with bits
// (u >> 9) | 0x3F800000, in [1, 2); unless `raw`, then f = ((f - 1) * float(hi - lo)) + float(lo)
// in float32 with a rounding after each operation (hi - lo in double first, as Python does).
//
// Optionally, weighted sums of the values in the same pass (the static task's a and b, without a
// second pass over the chunk): with `weights` float64 (G, seg, K) and `sums` float64
// (rows, G, n / seg, K), both contiguous, each row of a generator is n / seg segments of seg
// values, and sums[r, g, b, k] = sum_i out[r, g, b * seg + i] * weights[g, i, k], in float64
// (exact, so the same as any other order of summation, whenever float64 holds the sum exactly,
// as it does for the values of every uniform range of the experiments).
void sfc64_uniform_fill(const at::Tensor& state, const at::Tensor& out, double lo, double hi, bool raw,
                        const std::optional<at::Tensor>& weights = std::nullopt,
                        const std::optional<at::Tensor>& sums = std::nullopt);

// The same fill on raw memory, for callers that have checked their arguments (sfc64_uniform_fill
// above; the static step's in-call draw, csrc/experiments/cpu/ensemble_step.cpp): generator g <
// gens (words states[4 g .. 4 g + 3], advanced in place) fills rows x n values, row r at
// data + g * gen_stride + r * row_stride; with `weights` (gens, seg, K) float64, not null, also
// sums (rows, gens, n / seg, K) as above.
struct FillBlocks {
  int64_t gens, rows, n, gen_stride, row_stride;
  double lo, hi;
  bool raw;
  const double* weights;
  int64_t seg, K;
  double* sums;
};
void sfc64_fill_blocks(uint64_t* states, float* data, const FillBlocks& f);

}  // namespace training
}  // namespace nalu_cuda
