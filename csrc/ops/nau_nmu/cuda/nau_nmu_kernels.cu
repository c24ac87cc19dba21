// nau_nmu_kernels.cu: the CUDA kernels of the NMU (math in csrc/ops/nau_nmu/math.h).
//
//   forward   y[e, n, o] = prod_i f(W[e, i, o], x[e, n, i]),  f = W x + 1 - W
//   backward  gx[n, i] = sum_o dy[n, o] W[i, o] E[n, i, o];  gW[i, o] = sum_n dy[n, o] (x[n, i] - 1) E[n, i, o]
//             E[n, i, o] = prod_{k != i} f(W[k, o], x[n, k]), the exclusive products
//
// One warp per product: lane l owns the inputs i = l, l + 32, ... (coalesced loads of a row of x
// and of a row of the transposed weights Wt (E, O, I)), so a product is a lane-local product over
// its "rounds" of 32 inputs and a butterfly (xor shuffles) across the lanes. Nothing of size
// (N, I, O) is stored: the backward recomputes the factors.
//
// Exclusive products, exact when a factor is zero (no division): `warp_exclusive_products` runs
// two sweeps over the rounds. The first, from the last round down, keeps the product of the
// rounds after each round (256 values per warp at most: kNmuMaxIn); the second, from the first
// round, keeps the product of the rounds before; inside a round one butterfly gives every lane the
// product of the lanes below and above it. E_i = before * below * above * after. It takes a
// factor functor and a visitor, so any product unit (iNALU's sign recovery, NRU, NMRU) can use it.
//
//   nmu_forward_kernel    warp per (e, n, o)
//   nmu_backward_x_kernel warp per (e, n): for o in order, adds dy W E to its row of gx
//   nmu_backward_w_kernel warp per (e, o, chunk of rows): adds dy (x - 1) E over its rows in order
//                         into its own partial row; the host sums the chunks in order
// Every sum has a fixed order that depends on the shape alone: results are the same run to run.
// Precision: loads are converted to the compute type A (float, double for double storage); every
// product and sum runs in A.
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "ops/nau_nmu/math.h"
#include "common/cuda/cuda_common.cuh"
#include "ops/nau_nmu/cuda/nau_nmu_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

namespace nm = nalu_cuda::math;

constexpr int kWarps = 8;  // warps per block
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRounds = static_cast<int>(kNmuMaxIn / 32);
constexpr int64_t kMaxBlocks = 65535;  // grid-stride loops beyond this
constexpr int64_t kTargetWarps = 4096;  // weight-gradient chunks are split until about this many warps
constexpr int64_t kMinChunkRows = 8;

template <typename A, typename T>
__device__ __forceinline__ A load(const T* p, int64_t k) {
  return static_cast<A>(p[k]);
}

// The product of the lanes below this one (`below`), above it (`above`) and of all 32 (`all`, the
// same on every lane), by a butterfly of xor shuffles.
template <typename A>
struct LaneProducts {
  A below, above, all;
};
template <typename A>
__device__ __forceinline__ LaneProducts<A> lane_products(A f, int lane) {
  LaneProducts<A> p{A(1), A(1), f};
  for (int d = 1; d < 32; d <<= 1) {
    const A other = __shfl_xor_sync(0xffffffffu, p.all, d, 32);  // the partner half's product
    if (lane & d) {
      p.below = other * p.below;
      p.all = other * p.all;
    } else {
      p.above = p.above * other;
      p.all = p.all * other;
    }
  }
  return p;
}

// Calls visit(i, E_i) on the lane that owns input i, for every i < I, with E_i the product of
// factor(k) over k != i (see the file comment). factor(i) is called twice per i; lanes past I
// use 1. Every lane of the warp must call this with the same I.
template <typename A, typename Factor, typename Visit>
__device__ void warp_exclusive_products(int64_t I, int lane, Factor factor, Visit visit) {
  const int rounds = static_cast<int>((I + 31) / 32);
  A after[kMaxRounds];  // after[r]: product of the rounds > r
  A run = A(1);
  for (int r = rounds - 1; r >= 0; --r) {
    const int64_t i = static_cast<int64_t>(r) * 32 + lane;
    const A f = i < I ? factor(i) : A(1);
    after[r] = run;
    run = lane_products<A>(f, lane).all * run;
  }
  run = A(1);  // the product of the rounds < r
  for (int r = 0; r < rounds; ++r) {
    const int64_t i = static_cast<int64_t>(r) * 32 + lane;
    const A f = i < I ? factor(i) : A(1);
    const LaneProducts<A> p = lane_products<A>(f, lane);
    if (i < I) visit(i, (run * p.below) * (p.above * after[r]));
    run = run * p.all;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) nmu_forward_kernel(Dims d, const T* x, const T* Wt, T* y) {
  using A = typename AccOf<T>::type;
  const int lane = threadIdx.x % 32;
  const int64_t total = d.E * d.N * d.O;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < total;
       item += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t o = item % d.O, en = item / d.O, e = en / d.N;
    const T* xr = x + en * d.I;
    const T* wr = Wt + (e * d.O + o) * d.I;
    A acc = A(1);
    for (int64_t i = lane; i < d.I; i += 32) acc = acc * nm::nmu_factor(load<A>(wr, i), load<A>(xr, i));
    acc = lane_products<A>(acc, lane).all;
    if (lane == 0) y[item] = static_cast<T>(acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) nmu_backward_x_kernel(Dims d, const T* dy, const T* x, const T* Wt,
                                                                  typename AccOf<T>::type* gx) {
  using A = typename AccOf<T>::type;
  const int lane = threadIdx.x % 32;
  const int64_t total = d.E * d.N;
  for (int64_t en = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; en < total;
       en += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t e = en / d.N;
    const T* xr = x + en * d.I;
    A* gr = gx + en * d.I;
    for (int64_t o = 0; o < d.O; ++o) {
      const T* wr = Wt + (e * d.O + o) * d.I;
      const A g = load<A>(dy, en * d.O + o);
      warp_exclusive_products<A>(
          d.I, lane, [&](int64_t i) { return nm::nmu_factor(load<A>(wr, i), load<A>(xr, i)); },
          [&](int64_t i, A excl) {
            const A w = load<A>(wr, i);
            gr[i] += g * nm::nmu_dfactor_dx(w, load<A>(xr, i)) * excl;
          });
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) nmu_backward_w_kernel(Dims d, int64_t chunks, const T* dy, const T* x,
                                                                  const T* Wt, typename AccOf<T>::type* partial) {
  using A = typename AccOf<T>::type;
  const int lane = threadIdx.x % 32;
  const int64_t total = d.E * chunks * d.O;
  const int64_t rows_per_chunk = (d.N + chunks - 1) / chunks;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < total;
       item += static_cast<int64_t>(gridDim.x) * kWarps) {
    // item = (e * chunks + c) * O + o: the index of this warp's partial row.
    const int64_t o = item % d.O, ec = item / d.O, c = ec % chunks, e = ec / chunks;
    const T* wr = Wt + (e * d.O + o) * d.I;
    A* pr = partial + item * d.I;
    const int64_t n1 = (c + 1) * rows_per_chunk < d.N ? (c + 1) * rows_per_chunk : d.N;
    for (int64_t n = c * rows_per_chunk; n < n1; ++n) {
      const T* xr = x + (e * d.N + n) * d.I;
      const A g = load<A>(dy, (e * d.N + n) * d.O + o);
      warp_exclusive_products<A>(
          d.I, lane, [&](int64_t i) { return nm::nmu_factor(load<A>(wr, i), load<A>(xr, i)); },
          [&](int64_t i, A excl) { pr[i] += g * nm::nmu_dfactor_dw(load<A>(wr, i), load<A>(xr, i)) * excl; });
    }
  }
}

unsigned blocks_for(int64_t warps) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min((warps + kWarps - 1) / kWarps, kMaxBlocks)));
}

}  // namespace

void nmu_forward(DType dt, const Dims& d, const void* x, const void* Wt, void* y, cudaStream_t stream) {
  const int64_t warps = d.E * d.N * d.O;
  if (warps == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    nmu_forward_kernel<scalar_t><<<blocks_for(warps), kThreads, 0, stream>>>(
        d, static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(Wt), static_cast<scalar_t*>(y));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void nmu_backward_x(DType dt, const Dims& d, const void* dy, const void* x, const void* Wt, void* gx_acc,
                    cudaStream_t stream) {
  const int64_t warps = d.E * d.N;
  if (warps == 0 || d.I == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    using A = typename AccOf<scalar_t>::type;
    nmu_backward_x_kernel<scalar_t><<<blocks_for(warps), kThreads, 0, stream>>>(
        d, static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(Wt),
        static_cast<A*>(gx_acc));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

int64_t nmu_weight_chunks(const Dims& d) {
  const int64_t columns = std::max<int64_t>(1, d.E * d.O);
  const int64_t want = (kTargetWarps + columns - 1) / columns;
  const int64_t most_rows = std::max<int64_t>(1, d.N / kMinChunkRows);
  // The partials (E, C, O, I) stay within 1/8 of x and y: (E, N, I + O).
  const int64_t most_memory = std::max<int64_t>(1, d.N * (d.I + d.O) / (8 * std::max<int64_t>(1, d.O * d.I)));
  return std::max<int64_t>(1, std::min({want, most_rows, most_memory}));
}

void nmu_backward_w(DType dt, const Dims& d, int64_t chunks, const void* dy, const void* x, const void* Wt,
                    void* partial, cudaStream_t stream) {
  const int64_t warps = d.E * chunks * d.O;
  if (warps == 0 || d.I == 0 || d.N == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    using A = typename AccOf<scalar_t>::type;
    nmu_backward_w_kernel<scalar_t><<<blocks_for(warps), kThreads, 0, stream>>>(
        d, chunks, static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x),
        static_cast<const scalar_t*>(Wt), static_cast<A*>(partial));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace nalu_cuda
