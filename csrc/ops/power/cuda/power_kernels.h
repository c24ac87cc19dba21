// power_kernels.h: the interface between the CUDA ops of the NPU / RealNPU and iNALU
// (power_cuda.cpp: checks, allocation, cuBLAS products through ATen, registration) and their
// kernels (ops/power/cuda/power_kernels.cu). Plain data only, as csrc/ops/nac_nalu/cuda/kernels.h (DType:
// csrc/common/cuda/dtype.h, Dims: csrc/common/layer_types.h): every pointer is to a contiguous tensor, x (E, N, I), weights (E, I, O), outputs
// (E, N, O). "acc" buffers hold the compute type (float, or double for double storage); all
// others the storage dtype. Every function launches on `stream`, checks the launch and does not
// synchronise with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/cuda/dtype.h"
#include "common/layer_types.h"

namespace nalu_cuda {
namespace cuda {

// out[e, c] = sum_n part[e, n, c] in row order (part: acc, out: storage), E C threads.
void column_sums(DType dt, int64_t E, int64_t N, int64_t C, const void* part, void* out, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// NPU / RealNPU (math: csrc/ops/power/math.h). LK is (E, 2N, I): rows [0, N) lr, rows [N, 2N) k.
// C = 2 O for the NPU (products against [W_r, W_i]), O for the RealNPU (against W_r).
// ---------------------------------------------------------------------------------------------

// LK and lr (E, N, I) from x and the gate g (E, I).
void npu_prologue(DType dt, const Dims& d, const void* x, const void* g, double eps, void* LK, void* lr,
                  cudaStream_t stream);

// y, s (E, N, O) from the products P = LK [W_r, W_i] (E, 2N, C).
void npu_epilogue(DType dt, const Dims& d, bool complex, const void* P, void* y, void* s, cudaStream_t stream);

// D (E, 2N, C) from dy, y, s (rows of L: [dU, dV], rows of K: [dV, -dU]; RealNPU: dU, dV), and LK
// rebuilt from the saved lr and k = g pi [x < 0].
void npu_backward_prologue(DType dt, const Dims& d, bool complex, const void* dy, const void* y, const void* s,
                           const void* x, const void* g, const void* lr, void* D, void* LK, cudaStream_t stream);

// From dLK = D Wc^T (E, 2N, I): dx (null: not asked for) and the gate's per-row terms dg_part
// (acc, E N I), zero where the clamp cuts the gradient.
void npu_backward_epilogue(DType dt, const Dims& d, const void* x, const void* g, double eps, const void* dLK,
                           void* dx, void* dg_part, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// iNALU (math: csrc/ops/power/math.h). W and W_m are built by forward_prologue, the hat weights'
// gradients by backward_epilogue (ops/nac_nalu/cuda/kernels.h).
// ---------------------------------------------------------------------------------------------

// lx = log(max(|x|, eps)) over n entries.
void inalu_log(DType dt, int64_t n, const void* x, double eps, void* lx, cudaStream_t stream);

// Per output: msv = prod_i (sign(x_i) |W_m[i]| + 1 - |W_m[i]|) and y = g a + (1 - g) m clip(msv),
// m = exp(min(u, omega)), g = sigmoid(G) (E, O); a and u from the products.
void inalu_epilogue(DType dt, const Dims& d, const void* x, const void* Wm, const void* G, const void* a,
                    const void* u, double omega, void* msv, void* y, cudaStream_t stream);

// Per output: da, du (storage, for the products), dmsv and dG_part (acc).
void inalu_backward_prologue(DType dt, const Dims& d, const void* dy, const void* a, const void* u,
                             const void* msv, const void* G, double omega, void* da, void* du, void* dmsv,
                             void* dG_part, cudaStream_t stream);

// dWm[e, i, o] += sum_n dmsv[e, n, o] f'(x_i, W_m[i, o]) prod_{k != i} f(x_k, W_m[k, o]), from
// exclusive (prefix/suffix) products, never a (B, I, O) tensor. `workspace` holds
// inalu_sign_workspace_bytes(dt, d) bytes (per-chunk partials, summed in chunk order).
size_t inalu_sign_workspace_bytes(DType dt, const Dims& d);
// Shared memory the kernel needs per block; the op checks it against kInaluSignMaxSmem.
size_t inalu_sign_smem_bytes(DType dt, const Dims& d);
constexpr size_t kInaluSignMaxSmem = 48 * 1024;
void inalu_sign_backward(DType dt, const Dims& d, const void* x, const void* Wm, const void* dmsv, void* dWm,
                         void* workspace, cudaStream_t stream);

// dx (holding du W_m^T) *= d log(max(|x|, eps)) / dx, over n entries.
void inalu_log_backward(DType dt, int64_t n, const void* x, double eps, void* dx, cudaStream_t stream);

}  // namespace cuda
}  // namespace nalu_cuda
