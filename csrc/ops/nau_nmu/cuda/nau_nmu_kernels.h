// nau_nmu_kernels.h: the interface between the CUDA ops of the NMU (ops/nau_nmu/cuda/nau_nmu_cuda.cpp: checks,
// allocation, registration) and its kernels (ops/nau_nmu/cuda/nau_nmu_kernels.cu). Plain data only, as in
// csrc/ops/nac_nalu/cuda/kernels.h (DType: csrc/common/cuda/dtype.h, Dims: csrc/common/layer_types.h): x (E, N, I) and the transposed weights
// Wt (E, O, I) contiguous, in the storage dtype; accumulators in the compute type (float, or
// double for double storage). Every function launches on `stream`, checks the launch and does not
// synchronise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cuda/dtype.h"
#include "common/layer_types.h"

namespace nalu_cuda {
namespace cuda {

// Largest I the NMU kernels take: a warp keeps one suffix product per 32 inputs (256 of them).
constexpr int64_t kNmuMaxIn = 8192;

// y (E, N, O) = prod_i (W x + 1 - W).
void nmu_forward(DType dt, const Dims& d, const void* x, const void* Wt, void* y, cudaStream_t stream);

// gx_acc (E, N, I), compute type, zero on entry: += sum_o dy W E (E: exclusive products).
void nmu_backward_x(DType dt, const Dims& d, const void* dy, const void* x, const void* Wt, void* gx_acc,
                    cudaStream_t stream);

// How many chunks of rows the weight gradient is split into (from the shape alone, so the result
// is the same run to run): enough warps to fill a GPU, at most one chunk per 8 rows, and partial
// sums of at most 1/8 of the size of x and y.
int64_t nmu_weight_chunks(const Dims& d);

// partial (E, C, O, I), compute type, zero on entry: partial[e, c, o, i] = sum over the rows of
// chunk c of dy (x - 1) E. The caller sums over c in order.
void nmu_backward_w(DType dt, const Dims& d, int64_t chunks, const void* dy, const void* x, const void* Wt,
                    void* partial, cudaStream_t stream);

}  // namespace cuda
}  // namespace nalu_cuda
