// kernels.h: the interface between the NAC/NALU CUDA ops (nac_nalu_cuda.cpp: checks, allocation,
// cuBLAS products through ATen, registration) and the CUDA kernels (rowwise_kernels.cu,
// blas_kernels.cu).
//
// Only plain data crosses it (raw pointers, sizes, a dtype tag, the stream), so the .cu file
// includes no ATen header: nvcc compiles it quickly and with the minimal toolkit this project
// builds on. Every tensor behind a pointer is contiguous, laid out as in csrc/ops/nac_nalu/checks.h:
// x (E, N, I), weights (E, I, O), outputs (E, N, O), an independent gate (E, O).
// Pointers a kind does not use are null. Every launch function launches on `stream` and checks
// the launch (C10_CUDA_KERNEL_LAUNCH_CHECK); none synchronises with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/cuda/dtype.h"
#include "common/layer_types.h"

namespace nalu_cuda {
namespace cuda {

// LayerKind, LayerArgs (a call's scalar arguments: each launch takes them whole, each kernel reads
// what it uses), Dims, the path names and the FwdOut / SavedPtrs bundles (as FwdOut<void*>,
// SavedPtrs<const void*>) are the CPU's too: csrc/common/layer_types.h.

// The inputs of a layer call (storage dtype).
struct LayerPtrs {
  const void* x = nullptr;
  const void* W_hat = nullptr;
  const void* M_hat = nullptr;
  const void* W_hat_m = nullptr;  // separate weights only
  const void* M_hat_m = nullptr;
  const void* G = nullptr;  // (E, I, O) input gate or (E, O) independent gate
  const void* G_bias = nullptr;  // an input gate's bias, (E, O)
};

// Backward results (null: not asked for).
struct GradOut {
  void* dx = nullptr;
  void* dW_hat = nullptr;
  void* dM_hat = nullptr;
  void* dW_hat_m = nullptr;
  void* dM_hat_m = nullptr;
  void* dG = nullptr;
  void* dG_bias = nullptr;  // an input gate's bias only
};

// ---------------------------------------------------------------------------------------------
// Rowwise path: one kernel per forward, one (or two) per backward.
// ---------------------------------------------------------------------------------------------

// How a rowwise-path launch is laid out; ok = false when the layer does not fit (then the caller
// takes the blas path). Decided from the kind, dtype and shape alone, so results never depend
// on the GPU model.
struct RowwisePlan {
  bool ok = false;
  int lanes = 1;                    // threads per row (blockDim.x), a power of two <= 32
  int groups = 1;                   // rows in flight per block (blockDim.y)
  int64_t blocks_per_member = 1;    // blocks per ensemble member
  int64_t rows_per_block = 0;       // rows of one member per block
  int64_t slice = 0;                // backward: weight-gradient entries per member (accumulator slice)
  size_t smem_bytes = 0;            // dynamic shared memory per block
  // Backward with blocks_per_member > 1: bytes of the float/double workspace for block partials.
  size_t workspace_bytes = 0;
};

RowwisePlan plan_rowwise_forward(DType dt, const LayerKind& kind, const Dims& d);
RowwisePlan plan_rowwise_backward(DType dt, const LayerKind& kind, const Dims& d);

void rowwise_forward(DType dt, const LayerArgs& args, const Dims& d, const RowwisePlan& plan, const LayerPtrs& p,
                     const FwdOut<void*>& out, cudaStream_t stream);

// `workspace` holds plan.workspace_bytes (unused, may be null, when it is 0).
void rowwise_backward(DType dt, const LayerArgs& args, const Dims& d, const RowwisePlan& plan, const LayerPtrs& p,
                      const SavedPtrs<const void*>& saved, const GradOut& out, void* workspace, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Blas path: elementwise prologues and epilogues around the products (made by the host routine
// of csrc/ops/nac_nalu/blas_path.h).
// ---------------------------------------------------------------------------------------------

// One launch over three index ranges (any may be empty):
//   weights  W = tanh(W_hat) sigmoid(M_hat) over n_w entries (and W_m from W_hat_m, M_hat_m
//            when those are non-null)
//   log      lx = log(|x| + eps) over n_lx entries (eps: args.eps)
//   gate     g = sigmoid(G) over n_g entries (independent gate)
struct PrologueArgs {
  int64_t n_w = 0;
  const void* W_hat = nullptr;
  const void* M_hat = nullptr;
  void* W = nullptr;
  const void* W_hat_m = nullptr;
  const void* M_hat_m = nullptr;
  void* Wm = nullptr;
  int64_t n_lx = 0;
  const void* x = nullptr;
  void* lx = nullptr;
  LayerArgs args{};  // the call's scalar arguments (none needed for the weights alone)
  int64_t n_g = 0;
  const void* G = nullptr;
  void* g = nullptr;
};
void forward_prologue(DType dt, const PrologueArgs& a, cudaStream_t stream);

// After the products: m = exp(u) (u in out.m; NAC*: u in out.y), g = sigmoid(z) (z in out.g,
// input gate) or sigmoid(G) (independent gate, from p.G), y = g a + (1 - g) m.
void forward_epilogue(DType dt, const LayerArgs& args, const Dims& d, const LayerPtrs& p, const FwdOut<void*>& out,
                      cudaStream_t stream);

// One launch: rebuilds W (and W_m) as in forward_prologue (w.n_w entries; n_lx, n_g unused), and
// computes the gradients at the pre-activations over E N O entries:
//   da = g dy;  du = (1 - g) dy m;  dz = (a - m) dy g (1 - g)   (NAC+: da = dy; NAC*: du = dy y)
// plus, for a NALU, the gradients reaching its kept parts (saved.ga, gm, gg: math::parts_backward).
// Each of da, du, dz may be null (not written): the host computes them one at a time into one
// buffer, so that a backward holds a single (E, N, O) scratch tensor.
void backward_prologue(DType dt, const LayerArgs& args, const Dims& d, const PrologueArgs& w,
                       const SavedPtrs<const void*>& saved, void* da, void* du, void* dz, cudaStream_t stream);

// One launch over three index ranges:
//   dx *= sign(x) / (|x| + eps)  over n_dx entries (dx holds du W_m^T; eps: args.eps)
//   (dW_hat, dM_hat) from dW through the weight construction over n_w entries
//   (dW_hat_m, dM_hat_m) from dWm likewise when dWm is non-null
struct EpilogueArgs {
  int64_t n_dx = 0;
  void* dx = nullptr;
  const void* x = nullptr;
  LayerArgs args{};  // the call's scalar arguments (none needed for the weights alone)
  int64_t n_w = 0;
  const void* dW = nullptr;
  const void* W_hat = nullptr;
  const void* M_hat = nullptr;
  void* dW_hat = nullptr;
  void* dM_hat = nullptr;
  const void* dWm = nullptr;
  const void* W_hat_m = nullptr;
  const void* M_hat_m = nullptr;
  void* dW_hat_m = nullptr;
  void* dM_hat_m = nullptr;
};
void backward_epilogue(DType dt, const EpilogueArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace nalu_cuda
