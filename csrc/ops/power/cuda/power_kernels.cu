// power_kernels.cu: the CUDA kernels of the NPU / RealNPU and iNALU: the elementwise steps
// around the products (which power_cuda.cpp makes with cuBLAS through ATen), the iNALU sign
// product and its exact backward, and the fixed-order column sums of the gate gradients.
//
// Math (every formula and derivative in csrc/ops/power/math.h, shared with the CPU kernels):
//   NPU      prologue LK = [lr; k] -> P = LK [W_r, W_i] -> epilogue y = exp(U) cos(V), s = exp(U) sin(V)
//            backward D = [[dU, dV], [dV, -dU]] -> [dW_r, dW_i] = LK^T D, [dlr; dk] = D Wc^T
//            -> dx = dlr g sign(x) / r, dg = sum_n (dlr (|x| + eps - 1) / r + dk pi [x < 0]) [0 <= g <= 1]
//   iNALU    lx = log(max(|x|, eps)) -> a = x W, u = lx W_m -> epilogue msv (a product over I per
//            output), y = g a + (1 - g) m clip(msv)
//            backward da, du, dmsv, dG -> dW = x^T da, dW_m = lx^T du + the sign product's term
//            (exclusive products) -> dx = da W^T + (du W_m^T) d lx / dx
//
// Precision: storage float, double, float16 or bfloat16; every value is loaded into the compute
// type A (float, or double for double storage), all math and accumulation run in A, results are
// rounded to the storage type once. Every sum has a fixed order decided by the shape alone (no
// atomics), so results are the same run to run. Indices are 64-bit throughout.
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "ops/power/math.h"
#include "common/cuda/cuda_common.cuh"
#include "ops/power/cuda/power_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

namespace pm = nalu_cuda::math;

constexpr int kThreads = 256;
constexpr int kSignThreads = 128;             // threads per block of the sign-product backward
constexpr int64_t kMaxElementwiseBlocks = 8192;
constexpr int64_t kSignRowsPerChunk = 256;    // rows per block of the sign-product backward...
constexpr int64_t kSignMaxChunks = 16;        // ...in at most this many chunks per (member, output)

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(n, kThreads), kMaxElementwiseBlocks)));
}

int64_t sign_chunks(const Dims& d) {
  return std::max<int64_t>(1, std::min(ceil_div(d.N, kSignRowsPerChunk), kSignMaxChunks));
}

#define POWER_GRID_STRIDE(k, n)                                                       \
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < (n); \
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------------------------------------
// Column sums
// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) column_sums_kernel(int64_t E, int64_t N, int64_t C, const void* part,
                                                               void* out) {
  using A = acc_t<T>;
  const A* p = static_cast<const A*>(part);
  POWER_GRID_STRIDE(t, E * C) {
    const int64_t e = t / C, c = t % C;
    A sum = A(0);
    for (int64_t n = 0; n < N; ++n) sum += p[(e * N + n) * C + c];
    st<T>(out, t, sum);
  }
}

// ---------------------------------------------------------------------------------------------
// NPU / RealNPU
// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) npu_prologue_kernel(Dims d, const void* x, const void* g, double eps,
                                                                void* LK, void* lr) {
  using A = acc_t<T>;
  const A ep = static_cast<A>(eps);
  POWER_GRID_STRIDE(k, d.E * d.N * d.I) {
    const int64_t i = k % d.I, r = k / d.I, e = r / d.N, n = r % d.N;
    const A gc = pm::npu_gate(ld<A, T>(g, e * d.I + i));
    A lrv, kv;
    pm::npu_prologue(ld<A, T>(x, k), gc, ep, &lrv, &kv);
    st<T>(LK, (e * 2 * d.N + n) * d.I + i, lrv);
    st<T>(LK, (e * 2 * d.N + d.N + n) * d.I + i, kv);
    st<T>(lr, k, lrv);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) npu_epilogue_kernel(Dims d, bool complex, const void* P, void* y,
                                                                void* s) {
  using A = acc_t<T>;
  const int64_t O = d.O, C = complex ? 2 * O : O;
  POWER_GRID_STRIDE(k, d.E * d.N * O) {
    const int64_t o = k % O, r = k / O, e = r / d.N, n = r % d.N;
    const int64_t pl = (e * 2 * d.N + n) * C, pk = (e * 2 * d.N + d.N + n) * C;
    const A U = complex ? ld<A, T>(P, pl + o) - ld<A, T>(P, pk + O + o) : ld<A, T>(P, pl + o);
    const A V = complex ? ld<A, T>(P, pk + o) + ld<A, T>(P, pl + O + o) : ld<A, T>(P, pk + o);
    A yv, sv;
    pm::npu_epilogue(U, V, &yv, &sv);
    st<T>(y, k, yv);
    st<T>(s, k, sv);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    npu_backward_prologue_kernel(Dims d, bool complex, const void* dy, const void* y, const void* s, const void* x,
                                 const void* g, const void* lr, void* D, void* LK) {
  using A = acc_t<T>;
  const int64_t O = d.O, C = complex ? 2 * O : O;
  const int64_t nO = d.E * d.N * O, nI = d.E * d.N * d.I;
  POWER_GRID_STRIDE(t, nO + nI) {
    if (t < nO) {
      const int64_t o = t % O, r = t / O, e = r / d.N, n = r % d.N;
      A dU, dV;
      pm::npu_epilogue_backward(ld<A, T>(dy, t), ld<A, T>(y, t), ld<A, T>(s, t), &dU, &dV);
      const int64_t dl = (e * 2 * d.N + n) * C, dk = (e * 2 * d.N + d.N + n) * C;
      st<T>(D, dl + o, dU);
      st<T>(D, dk + o, dV);
      if (complex) {
        st<T>(D, dl + O + o, dV);
        st<T>(D, dk + O + o, -dU);
      }
    } else {
      const int64_t k = t - nO;
      const int64_t i = k % d.I, r = k / d.I, e = r / d.N, n = r % d.N;
      st<T>(LK, (e * 2 * d.N + n) * d.I + i, ld<A, T>(lr, k));
      st<T>(LK, (e * 2 * d.N + d.N + n) * d.I + i,
            pm::npu_k(ld<A, T>(x, k), pm::npu_gate(ld<A, T>(g, e * d.I + i))));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) npu_backward_epilogue_kernel(Dims d, const void* x, const void* g,
                                                                         double eps, const void* dLK, void* dx,
                                                                         void* dg_part) {
  using A = acc_t<T>;
  const A ep = static_cast<A>(eps);
  POWER_GRID_STRIDE(k, d.E * d.N * d.I) {
    const int64_t i = k % d.I, r = k / d.I, e = r / d.N, n = r % d.N;
    const A graw = ld<A, T>(g, e * d.I + i);
    A dxv, dgv;
    pm::npu_prologue_backward(ld<A, T>(x, k), pm::npu_gate(graw), ep, ld<A, T>(dLK, (e * 2 * d.N + n) * d.I + i),
                              ld<A, T>(dLK, (e * 2 * d.N + d.N + n) * d.I + i), &dxv, &dgv);
    if (dx != nullptr) st<T>(dx, k, dxv);
    static_cast<A*>(dg_part)[k] = pm::npu_gate_passes(graw) ? dgv : A(0);
  }
}

// ---------------------------------------------------------------------------------------------
// iNALU
// ---------------------------------------------------------------------------------------------

// lx = log(max(|x|, eps)) into out; kGrad: out *= d lx / dx instead (the backward, in place).
template <typename T, bool kGrad>
__global__ void __launch_bounds__(kThreads) inalu_log_kernel(int64_t n, const void* x, double eps, void* out) {
  using A = acc_t<T>;
  const A ep = static_cast<A>(eps);
  POWER_GRID_STRIDE(k, n) {
    if constexpr (kGrad) {
      st<T>(out, k, ld<A, T>(out, k) * pm::inalu_log_grad(ld<A, T>(x, k), ep));
    } else {
      st<T>(out, k, pm::inalu_log(ld<A, T>(x, k), ep));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) inalu_epilogue_kernel(Dims d, const void* x, const void* Wm,
                                                                  const void* G, const void* a, const void* u,
                                                                  double omega, void* msv, void* y) {
  using A = acc_t<T>;
  const A om = static_cast<A>(omega);
  POWER_GRID_STRIDE(k, d.E * d.N * d.O) {
    const int64_t o = k % d.O, r = k / d.O, e = r / d.N;
    A prod = A(1);
    for (int64_t i = 0; i < d.I; ++i) {
      prod *= pm::inalu_sign_factor(ld<A, T>(x, r * d.I + i), ld<A, T>(Wm, (e * d.I + i) * d.O + o));
    }
    const A gv = pm::sigmoid(ld<A, T>(G, e * d.O + o));
    st<T>(msv, k, prod);
    st<T>(y, k, pm::inalu_blend(ld<A, T>(a, k), pm::inalu_m(ld<A, T>(u, k), om), prod, gv));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    inalu_backward_prologue_kernel(Dims d, const void* dy, const void* a, const void* u, const void* msv,
                                   const void* G, double omega, void* da, void* du, void* dmsv, void* dG_part) {
  using A = acc_t<T>;
  const A om = static_cast<A>(omega);
  POWER_GRID_STRIDE(k, d.E * d.N * d.O) {
    const int64_t o = k % d.O, e = k / (d.N * d.O);
    A dav, duv, dmv, dgv;
    pm::inalu_blend_backward(ld<A, T>(dy, k), ld<A, T>(a, k), ld<A, T>(u, k), ld<A, T>(msv, k),
                             pm::sigmoid(ld<A, T>(G, e * d.O + o)), om, &dav, &duv, &dmv, &dgv);
    st<T>(da, k, dav);
    st<T>(du, k, duv);
    static_cast<A*>(dmsv)[k] = dmv;
    static_cast<A*>(dG_part)[k] = dgv;
  }
}

// One block per (member e, output o, chunk c of rows). Per row, thread 0 writes the exclusive
// prefix products and thread 1 the exclusive suffix products of the factors into shared memory;
// then thread j adds dmsv f'(x_i, w_i) (prefix_i suffix_i) to its inputs' accumulators (also in
// shared memory, each owned by one thread). Shared: w, prefix, suffix, acc, I entries each.
template <typename T>
__global__ void __launch_bounds__(kSignThreads)
    inalu_sign_backward_kernel(Dims d, int64_t chunks, int64_t rows, const void* x, const void* Wm, const void* dmsv,
                               void* workspace) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char power_smem[];
  const int64_t I = d.I, O = d.O;
  A* w = reinterpret_cast<A*>(power_smem);
  A* pre = w + I;
  A* suf = pre + I;
  A* acc = suf + I;
  const int64_t b = blockIdx.x;
  const int64_t c = b % chunks, o = (b / chunks) % O, e = b / (chunks * O);
  const int64_t n0 = c * rows, n1 = n0 + rows < d.N ? n0 + rows : d.N;
  const A* dm = static_cast<const A*>(dmsv);
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    w[i] = ld<A, T>(Wm, (e * I + i) * O + o);
    acc[i] = A(0);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t xr = (e * d.N + n) * I;
    __syncthreads();
    if (threadIdx.x == 0) {
      A run = A(1);
      for (int64_t i = 0; i < I; ++i) {
        pre[i] = run;
        run *= pm::inalu_sign_factor(ld<A, T>(x, xr + i), w[i]);
      }
    }
    if (threadIdx.x == (blockDim.x > 1 ? 1 : 0)) {
      A run = A(1);
      for (int64_t i = I - 1; i >= 0; --i) {
        suf[i] = run;
        run *= pm::inalu_sign_factor(ld<A, T>(x, xr + i), w[i]);
      }
    }
    __syncthreads();
    const A dv = dm[(e * d.N + n) * O + o];
    for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
      acc[i] += dv * pm::inalu_sign_factor_grad(ld<A, T>(x, xr + i), w[i]) * (pre[i] * suf[i]);
    }
  }
  A* ws = static_cast<A*>(workspace);
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) ws[((e * chunks + c) * I + i) * O + o] = acc[i];
}

// dWm[e, i, o] += sum over chunks (in order) of the partials.
template <typename T>
__global__ void __launch_bounds__(kThreads) inalu_sign_reduce_kernel(Dims d, int64_t chunks, const void* workspace,
                                                                     void* dWm) {
  using A = acc_t<T>;
  const A* ws = static_cast<const A*>(workspace);
  const int64_t IO = d.I * d.O;
  POWER_GRID_STRIDE(k, d.E * IO) {
    const int64_t e = k / IO, io = k % IO;
    A sum = A(0);
    for (int64_t c = 0; c < chunks; ++c) sum += ws[(e * chunks + c) * IO + io];
    st<T>(dWm, k, ld<A, T>(dWm, k) + sum);
  }
}

// inalu_log and inalu_log_backward: one launch of inalu_log_kernel.
template <bool kGrad>
void launch_inalu_log(DType dt, int64_t n, const void* x, double eps, void* out, cudaStream_t stream) {
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    inalu_log_kernel<scalar_t, kGrad><<<elementwise_blocks(n), kThreads, 0, stream>>>(n, x, eps, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

void column_sums(DType dt, int64_t E, int64_t N, int64_t C, const void* part, void* out, cudaStream_t stream) {
  if (E * C == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    column_sums_kernel<scalar_t><<<elementwise_blocks(E * C), kThreads, 0, stream>>>(E, N, C, part, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void npu_prologue(DType dt, const Dims& d, const void* x, const void* g, double eps, void* LK, void* lr,
                  cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.I;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    npu_prologue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, x, g, eps, LK, lr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void npu_epilogue(DType dt, const Dims& d, bool complex, const void* P, void* y, void* s, cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.O;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    npu_epilogue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, complex, P, y, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void npu_backward_prologue(DType dt, const Dims& d, bool complex, const void* dy, const void* y, const void* s,
                           const void* x, const void* g, const void* lr, void* D, void* LK, cudaStream_t stream) {
  const int64_t n = d.E * d.N * (d.O + d.I);
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    npu_backward_prologue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, complex, dy, y, s, x,
                                                                                            g, lr, D, LK);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void npu_backward_epilogue(DType dt, const Dims& d, const void* x, const void* g, double eps, const void* dLK,
                           void* dx, void* dg_part, cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.I;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    npu_backward_epilogue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, x, g, eps, dLK, dx,
                                                                                            dg_part);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void inalu_log(DType dt, int64_t n, const void* x, double eps, void* lx, cudaStream_t stream) {
  launch_inalu_log<false>(dt, n, x, eps, lx, stream);
}

void inalu_epilogue(DType dt, const Dims& d, const void* x, const void* Wm, const void* G, const void* a,
                    const void* u, double omega, void* msv, void* y, cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.O;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    inalu_epilogue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, x, Wm, G, a, u, omega, msv,
                                                                                     y);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void inalu_backward_prologue(DType dt, const Dims& d, const void* dy, const void* a, const void* u,
                             const void* msv, const void* G, double omega, void* da, void* du, void* dmsv,
                             void* dG_part, cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.O;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    inalu_backward_prologue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, dy, a, u, msv, G,
                                                                                              omega, da, du, dmsv,
                                                                                              dG_part);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

size_t inalu_sign_workspace_bytes(DType dt, const Dims& d) {
  return static_cast<size_t>(d.E * sign_chunks(d) * d.I * d.O) * acc_bytes(dt);
}

size_t inalu_sign_smem_bytes(DType dt, const Dims& d) { return static_cast<size_t>(4 * d.I) * acc_bytes(dt); }

void inalu_sign_backward(DType dt, const Dims& d, const void* x, const void* Wm, const void* dmsv, void* dWm,
                         void* workspace, cudaStream_t stream) {
  const int64_t chunks = sign_chunks(d);
  const int64_t blocks = d.E * d.O * chunks;
  if (blocks == 0 || d.I == 0) return;
  const size_t smem = inalu_sign_smem_bytes(dt, d);
  NALU_DISPATCH_DTYPE(dt, [&] {
    inalu_sign_backward_kernel<scalar_t><<<static_cast<unsigned>(blocks), kSignThreads, smem, stream>>>(
        d, chunks, ceil_div(d.N, chunks), x, Wm, dmsv, workspace);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    inalu_sign_reduce_kernel<scalar_t><<<elementwise_blocks(d.E * d.I * d.O), kThreads, 0, stream>>>(d, chunks,
                                                                                                      workspace, dWm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void inalu_log_backward(DType dt, int64_t n, const void* x, double eps, void* dx, cudaStream_t stream) {
  launch_inalu_log<true>(dt, n, x, eps, dx, stream);
}

}  // namespace cuda
}  // namespace nalu_cuda
