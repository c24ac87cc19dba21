// kernels_impl.h: the CPU kernels of NAC+, NAC*, NALU and the weight construction, in the headers
// beside it. Included once per instruction set (csrc/common/cpu/kernels_impl.h, from
// kernels_base.cpp and kernels_avx2.cpp) with NALU_CPU_ISA set to the namespace to define; it and
// its parts include nothing else (see csrc/common/cpu/isa.h).
//
// Math (member e, row n, input i, output j; each formula is in csrc/ops/nac_nalu/math.h):
//   forward   W = tanh(W_hat) sigmoid(M_hat);  lx = log(|x| + eps);  a = x W;  m = exp(lx W_m);
//             g = sigmoid(x G) or sigmoid(G);  y = g a + (1 - g) m
//   backward  da = g dy;  du = (1 - g) dy m;  dz = (a - m) dy g (1 - g)
//             dW = x^T da (+ lx^T du when tied);  dW_m = lx^T du;  dG = x^T dz (or sum_n dz)
//             dx = da W^T + dz G^T + (du W_m^T) sign(x) / (|x| + eps)
//             dW_hat, dM_hat from dW through the weight construction
// Saved by forward for backward: lx (the log is the costliest step on a CPU, and autograd's
// reference keeps it too), and a, m, g for NALU (m = y for NAC*). W is rebuilt in backward: it
// is I x O, small next to the batch.
//
// The paths (csrc/common/layer_types.h names them for both devices), chosen from the shape alone so
// that results never depend on the thread count:
//   rowwise  out <= kRowwiseMaxOut (the paper's layers): one pass over the rows per direction.
//            With at most kLanesMaxIn inputs (the paper's second layers), the lanes variant
//            puts rows, not inputs, across the vector lanes.
//            Weights are kept transposed, (E, O, I), so each output is a vectorised dot product
//            over a row that is still in L1; weight gradients accumulate in per-chunk partial
//            sums that are added in a fixed order. No BLAS call, no batch-sized temporary.
//   blas     wider layers: the products of csrc/ops/nac_nalu/blas_path.h (ATen's bmm: MKL/oneDNN); each
//            elementwise step around them is one fused, vectorised, parallel loop. The backward's only batch-sized scratch is
//            one (E, N, O) buffer that holds du, da and dz in turn.
#ifndef NALU_CPU_ISA
#error "define NALU_CPU_ISA (the namespace of this instruction set) before including kernels_impl.h"
#endif

// In this order: each part uses only what the parts before it define.
#include "ops/nac_nalu/cpu/common.h"   // dispatch, loops, weight construction, pointer bundles, epilogue
#include "ops/nac_nalu/cpu/rowwise.h"  // rowwise path
#include "ops/nac_nalu/cpu/lanes.h"    // lanes variant (rowwise layers with few inputs)
#include "ops/nac_nalu/cpu/blas.h"     // blas path (wider layers: elementwise steps around blas_path.h)
#include "ops/nac_nalu/cpu/drivers.h"  // layer_forward, layer_backward, weight, weight_backward
