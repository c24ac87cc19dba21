// layer_types.h: the plain data every NAC/NALU kernel agrees on, on the CPU and on the GPU: which
// paths a layer has (LayerKind), the scalar arguments of a call (LayerArgs), its sizes (Dims),
// which kernel path takes it, and the pointer bundles of a call. No ATen and no CUDA header: csrc/ops/nac_nalu/checks.h (the ATen-facing checks), the
// CPU kernels (csrc/ops/*/cpu/) and the CUDA kernels (csrc/ops/*/cuda/*.cu, compiled by nvcc without
// ATen) all include it.
//
// Layout: every tensor behind a pointer is contiguous; x (E, N, I), weights (E, I, O), outputs
// (E, N, O), an independent gate (E, O); E = 1 for a plain layer, N the rows per member.
#pragma once

#include <cstdint>

// LayerKind's predicates are called in the CUDA kernels too (they read a LayerArgs).
#ifdef __CUDACC__
#define NALU_LAYER_HD __host__ __device__
#else
#define NALU_LAYER_HD
#endif

namespace nalu_cuda {

// How a NALU blends its two paths: not at all (NAC+, NAC*), by g = sigmoid(x G) with G (I, O)
// (the paper's input gate), or by g = sigmoid(G) with G (O,) (an input-independent gate).
enum class Gate : int { kNone = 0, kInput = 1, kIndependent = 2 };

struct LayerKind {
  bool add;   // additive path a = x W
  bool mul;   // multiplicative path m = exp(log(|x| + eps) W_m)
  bool tied;  // W_m is W (only meaningful with add && mul)
  Gate gate;  // how a and m are blended (kNone: one path only)
  // An input gate with a bias: g = sigmoid(x G + G_bias), G_bias (E, O) (stable-nalu's nalu_bias).
  bool gate_bias = false;

  NALU_LAYER_HD constexpr bool nalu() const { return add && mul; }
  // Separate multiplicative weights (W_hat_m, M_hat_m): a NALU whose W_m is not W.
  NALU_LAYER_HD constexpr bool sep() const { return add && mul && !tied; }
};

// NAC+ and NAC*; a NALU's kind comes from its arguments (nalu_kind in ops/nac_nalu/checks.h).
constexpr LayerKind kNacAdd{true, false, true, Gate::kNone};
constexpr LayerKind kNacMul{false, true, true, Gate::kNone};

// The scalar arguments of one NAC/NALU call, together: made once by the op's entry point
// (csrc/ops/nac_nalu/ops.h) from the op's arguments and handed unchanged, by const reference (by
// value into a CUDA kernel), to the kernels, which read what they use (converting a double to the
// compute type there). A new scalar argument is one field here, set in ops.h and read in the
// kernel that needs it; no layer in between names it.
struct LayerArgs {
  LayerKind kind{};             // which paths (NAC+, NAC*, NALU with its gate, tied or separate weights)
  double eps = 0.0;             // NAC*, NALU: lx = log(|x| + eps)
  bool compute_grad_x = false;  // backward ops: whether grad_x is asked for
};

struct Dims {
  int64_t E = 1, N = 0, I = 0, O = 0;
};

// ---------------------------------------------------------------------------------------------
// Kernel paths: one vocabulary for both devices, chosen from the kind, dtype and shape alone (so
// results never depend on the thread count or the GPU model).
//   rowwise  O <= kRowwiseMaxOut (the paper's layers): one pass over the rows per direction, the
//            constructed weights in cache (CPU, csrc/ops/nac_nalu/cpu/rowwise.h) or shared memory
//            (CUDA, csrc/ops/nac_nalu/cuda/rowwise_kernels.cu, where the weights must
//            also fit in shared memory: plan_rowwise_*); no library product.
//   lanes    a rowwise layer with at most kLanesMaxIn inputs on the CPU (the paper's second
//            layers): rows, not inputs, across the vector lanes (csrc/ops/nac_nalu/cpu/lanes.h). On
//            the GPU rows are across threads on every rowwise layer, so it has no such variant.
//   blas     every other layer: elementwise prologue -> batched products (ATen's bmm: BLAS on the
//            CPU, cuBLAS on the GPU) -> elementwise epilogue, one host routine for both devices
//            (csrc/blas_path.h).
// ---------------------------------------------------------------------------------------------
constexpr int64_t kRowwiseMaxOut = 16;
constexpr int64_t kLanesMaxIn = 8;

constexpr bool rowwise_shape(const Dims& d) { return d.O <= kRowwiseMaxOut; }
constexpr bool lanes_shape(const Dims& d) { return rowwise_shape(d) && d.I <= kLanesMaxIn; }

// ---------------------------------------------------------------------------------------------
// Pointer bundles of one call. P is the pointer type: `T*` / `const T*` in the CPU kernels,
// `void*` / `const void*` (storage dtype behind them) at the CUDA kernels' interface. Pointers a
// kind does not use are null.
// ---------------------------------------------------------------------------------------------

// A forward's results: y, and what its backward needs besides the inputs (the families' schema.cpp (csrc/ops/*/schema.cpp)):
// a, m, g for NALU (g (E, N, O) for an input gate, (E, O) for an independent gate), lx for NAC*
// and NALU (x's shape).
template <typename P>
struct FwdOut {
  P y = nullptr, a = nullptr, m = nullptr, g = nullptr, lx = nullptr;
};

// What a backward reads besides the inputs: grad_y and the forward's results (m is NAC*'s y);
// for a NALU whose kept parts a, m, g had a loss of their own (nalu_parts), the gradients that
// reach them directly, ga, gm and (input gate) gg, each of y's shape (null: none): added to the
// pre-activation gradients as da += ga, du += gm m, dz += gg g (1 - g) (math::parts_backward).
template <typename CP>
struct SavedPtrs {
  CP dy = nullptr, a = nullptr, m = nullptr, g = nullptr, lx = nullptr;
  CP ga = nullptr, gm = nullptr, gg = nullptr;

  NALU_LAYER_HD bool part_grads() const { return ga != nullptr || gm != nullptr || gg != nullptr; }
};

}  // namespace nalu_cuda
