// blas_kernels.cu: the blas path's elementwise launches for NAC+, NAC* and NALU on the GPU
// (csrc/layer_types.h names the paths; the math, precision and saved values:
// ops/nac_nalu/cuda/kernels.cuh), for the layers wider than the rowwise path takes (rowwise_kernels.cu).
//
// Blas path (wider layers): the products go to cuBLAS through ATen (batched over E, made by the
// host routine of csrc/blas_path.h, which the CPU shares); everything elementwise is fused
// launches before or after them:
//   forward   forward_prologue (W, W_m, lx, sigmoid(G)) -> 1..3 bmm -> forward_epilogue
//   backward  one (E, N, O) buffer, filled by backward_prologue with du (and W, W_m), then da,
//             then dz, each followed by its products: dW_m, du W_m^T into dx; dW;
//             backward_epilogue (dx *= sign(x)/(|x|+eps); dW_hat, dM_hat, ...); da W^T into dx;
//             dG, dz G^T into dx
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "ops/nac_nalu/cuda/kernels.cuh"

namespace nalu_cuda {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Blas-path elementwise kernels (grid-stride loops, 64-bit indices)
// ---------------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void build_weight_entry(const PrologueArgs& a, int64_t k) {
  using A = acc_t<T>;
  st<T>(a.W, k, nm::nac_weight(ld<A, T>(a.W_hat, k), ld<A, T>(a.M_hat, k)));
  if (a.Wm != nullptr) st<T>(a.Wm, k, nm::nac_weight(ld<A, T>(a.W_hat_m, k), ld<A, T>(a.M_hat_m, k)));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) forward_prologue_kernel(PrologueArgs a) {
  using A = acc_t<T>;
  const A eps = static_cast<A>(a.args.eps);
  const int64_t total = a.n_w + a.n_lx + a.n_g;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (t < a.n_w) {
      build_weight_entry<T>(a, t);
    } else if (t < a.n_w + a.n_lx) {
      const int64_t k = t - a.n_w;
      st<T>(a.lx, k, nm::log_abs(ld<A, T>(a.x, k), eps));
    } else {
      const int64_t k = t - a.n_w - a.n_lx;
      st<T>(a.g, k, nm::sigmoid(ld<A, T>(a.G, k)));
    }
  }
}

template <typename T, typename K>
__global__ void __launch_bounds__(kThreads)
    forward_epilogue_kernel(LayerPtrs p, FwdOut<void*> out, LayerArgs args, int64_t n, int64_t NO, int64_t O) {
  using A = acc_t<T>;
  constexpr bool ADD = K::add, MUL = K::mul;
  constexpr int GATE = K::gate;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (ADD && MUL) {
      const A mv = nm::exp_(ld<A, T>(out.m, k));
      A gv;
      if (GATE == kGateInput) {
        gv = nm::sigmoid(ld<A, T>(out.g, k));
        st<T>(out.g, k, gv);
      } else {
        gv = nm::sigmoid(ld<A, T>(p.G, (k / NO) * O + k % O));
      }
      st_m<T>(out.m, k, mv);
      st<T>(out.y, k, nm::blend(ld<A, T>(out.a, k), mv, gv));
    } else if (MUL) {
      st<T>(out.y, k, nm::exp_(ld<A, T>(out.y, k)));
    }
  }
}

template <typename T, typename K>
__global__ void __launch_bounds__(kThreads)
    backward_prologue_kernel(PrologueArgs w, LayerArgs args, SavedPtrs<const void*> sv, void* da, void* du,
                             void* dz, int64_t n, int64_t NO, int64_t O) {
  using A = acc_t<T>;
  constexpr bool ADD = K::add, MUL = K::mul;
  constexpr int GATE = K::gate;
  const int64_t total = w.n_w + n;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (t < w.n_w) {
      build_weight_entry<T>(w, t);
      continue;
    }
    const int64_t k = t - w.n_w;
    const A dyv = ld<A, T>(sv.dy, k);
    if (ADD && MUL) {
      const A gv = GATE == kGateInput ? ld<A, T>(sv.g, k) : ld<A, T>(sv.g, (k / NO) * O + k % O);
      A dav, duv, dzv;
      nm::blend_backward(dyv, ld<A, T>(sv.a, k), ld<A, T>(sv.m, k), gv, &dav, &duv, &dzv);
      if (sv.part_grads()) {
        A unused = A(0);
        nm::parts_backward(sv.ga != nullptr ? ld<A, T>(sv.ga, k) : A(0), sv.gm != nullptr ? ld<A, T>(sv.gm, k) : A(0),
                           GATE == kGateInput && sv.gg != nullptr ? ld<A, T>(sv.gg, k) : A(0), ld<A, T>(sv.m, k), gv,
                           &dav, &duv, GATE == kGateInput ? &dzv : &unused);
      }
      if (da != nullptr) st<T>(da, k, dav);
      if (du != nullptr) st<T>(du, k, duv);
      if (dz != nullptr) st<T>(dz, k, dzv);
    } else if (ADD) {
      if (da != nullptr) st<T>(da, k, dyv);
    } else if (du != nullptr) {
      st<T>(du, k, dyv * ld<A, T>(sv.m, k));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) backward_epilogue_kernel(EpilogueArgs a) {
  using A = acc_t<T>;
  const A eps = static_cast<A>(a.args.eps);
  const int64_t total = a.n_dx + a.n_w;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (t < a.n_dx) {
      st<T>(a.dx, t, ld<A, T>(a.dx, t) * nm::log_abs_grad(ld<A, T>(a.x, t), eps));
      continue;
    }
    const int64_t k = t - a.n_dx;
    A gw, gm;
    nm::nac_weight_backward(ld<A, T>(a.dW, k), ld<A, T>(a.W_hat, k), ld<A, T>(a.M_hat, k), &gw, &gm);
    st<T>(a.dW_hat, k, gw);
    st<T>(a.dM_hat, k, gm);
    if (a.dWm != nullptr) {
      nm::nac_weight_backward(ld<A, T>(a.dWm, k), ld<A, T>(a.W_hat_m, k), ld<A, T>(a.M_hat_m, k), &gw, &gm);
      st<T>(a.dW_hat_m, k, gw);
      st<T>(a.dM_hat_m, k, gm);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

void forward_prologue(DType dt, const PrologueArgs& a, cudaStream_t stream) {
  const int64_t n = a.n_w + a.n_lx + a.n_g;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    forward_prologue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void forward_epilogue(DType dt, const LayerArgs& args, const Dims& d, const LayerPtrs& p, const FwdOut<void*>& out,
                      cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.O;
  if (n == 0 || !args.kind.mul) return;  // NAC+ has nothing after its product
  NALU_DISPATCH_DTYPE(dt, [&] {
    NALU_DISPATCH_KIND(args.kind, [&] {
      forward_epilogue_kernel<scalar_t, kind_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(
          p, out, args, n, d.N * d.O, d.O);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void backward_prologue(DType dt, const LayerArgs& args, const Dims& d, const PrologueArgs& w,
                       const SavedPtrs<const void*>& saved, void* da, void* du, void* dz, cudaStream_t stream) {
  const int64_t n = d.E * d.N * d.O;
  if (n + w.n_w == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    NALU_DISPATCH_KIND(args.kind, [&] {
      backward_prologue_kernel<scalar_t, kind_t><<<elementwise_blocks(n + w.n_w), kThreads, 0, stream>>>(
          w, args, saved, da, du, dz, n, d.N * d.O, d.O);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void backward_epilogue(DType dt, const EpilogueArgs& a, cudaStream_t stream) {
  const int64_t n = a.n_dx + a.n_w;
  if (n == 0) return;
  NALU_DISPATCH_DTYPE(dt, [&] {
    backward_epilogue_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace nalu_cuda
