// rowwise_kernels.cu: the rowwise path of NAC+, NAC* and NALU on the GPU (csrc/layer_types.h
// names the paths; the math, precision and saved values: ops/nac_nalu/cuda/kernels.cuh). The host chooses
// it from the kind, dtype and shape alone (plan_rowwise_*); the other layers take the blas path
// (blas_kernels.cu).
//
// Rowwise path: O <= kRowwiseMaxOut (16) and the weights plus one weight-gradient accumulator
// fit in 48 KiB of shared memory (the paper's layers: I = 2..100, O = 1..2). A block serves one ensemble member
// and a contiguous chunk of its rows; blockDim = (lanes, groups): a group of `lanes` threads
// (a power of two <= 32, ~I) handles one row at a time, lane l owning inputs i = l, l + lanes, ...
//   forward  (1 launch) each block builds W (and W_m, G) in shared memory, transposed to (O, I)
//            so the lanes read consecutive words, from W_hat/M_hat. Per row a lane computes lx for
//            its inputs (stored), accumulates its share of a, u = lx W_m, z = x G for every output
//            in registers, the group sums them with xor-shuffles (all lanes end with the totals)
//            and lane j mod lanes applies exp / sigmoid / blend and stores y, a, m, g for output j.
//   backward (1 launch when one block per member suffices, else 2) each block builds the weights
//            in shared memory; per row every lane of the group computes da, du, dz for all O
//            outputs from grad_y and the saved a, m, g, then for its inputs writes dx and adds
//            x da, lx du, x dz into its group's private accumulator slice (shared memory, no
//            atomics: a lane owns its columns). The block folds its group slices in group order;
//            with one block per member it applies the weight construction's backward right away,
//            otherwise it writes its partial to a workspace and a second kernel sums the partials
//            of each member in block order and finishes. Deterministic run to run: every sum has a
//            fixed order, and the chunking depends on the shape alone.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "ops/nac_nalu/cuda/kernels.cuh"

namespace nalu_cuda {
namespace cuda {
namespace {

// Calls f with `maxo_t::value` >= O, the register-array size of the rowwise kernels.
#define NALU_DISPATCH_MAXO(O, ...)                           \
  if ((O) <= 2) {                                            \
    using maxo_t = std::integral_constant<int, 2>;           \
    __VA_ARGS__();                                           \
  } else if ((O) <= 4) {                                     \
    using maxo_t = std::integral_constant<int, 4>;           \
    __VA_ARGS__();                                           \
  } else if ((O) <= 8) {                                     \
    using maxo_t = std::integral_constant<int, 8>;           \
    __VA_ARGS__();                                           \
  } else {                                                   \
    using maxo_t = std::integral_constant<int, 16>;          \
    __VA_ARGS__();                                           \
  }

static_assert(kRowwiseMaxOut == 16, "NALU_DISPATCH_MAXO's largest register array is 16 outputs");
constexpr int64_t kRowwiseMaxIn = 8192;     // keeps I, O I in int on the rowwise path
// Dynamic shared memory per block: under the 48 KiB a launch may use without an opt-in, leaving room
// for the forward kernel's static array (at most 16 doubles).
constexpr size_t kSmemLimit = 48 * 1024 - 256;
constexpr int64_t kTargetBlocks = 512;      // rows are split until about this many blocks...
constexpr int64_t kBwdRowsPerGroup = 4;     // ...but a backward block keeps >= 4 rows per group
// The forward splits rows further (its blocks are independent; its values do not depend on the
// split): about two full waves of an H200 (132 multiprocessors x 8 blocks of 256 threads), which
// the memory-bound shape needs to keep enough reads in flight (benchmarks/RESULTS.md, section 29).
constexpr int64_t kFwdTargetBlocks = 2048;
constexpr int kFwdLoads = 4;                // a lane's reads in flight per row in the forward

// ---------------------------------------------------------------------------------------------
// Rowwise path
// ---------------------------------------------------------------------------------------------

// Weight matrices a block keeps in shared memory: W (the only one for NAC+ and NAC*), W_m when
// separate, G for an input gate.
int64_t weight_mats(const LayerKind& k) {
  return 1 + (k.sep() ? 1 : 0) + (k.gate == Gate::kInput ? 1 : 0);
}

// Entries of one member's weight-gradient accumulator: dW (O, I), dW_m (O, I) when separate,
// then dG: (O, I) for an input gate, O for an independent gate, then dG_bias (O) for a gate bias.
int64_t slice_elems(const LayerKind& k, const Dims& d) {
  const int64_t OI = d.O * d.I;
  return OI * (k.sep() ? 2 : 1) + (k.gate == Gate::kInput ? OI : (k.gate == Gate::kIndependent ? d.O : 0)) +
         (k.gate == Gate::kInput && k.gate_bias ? d.O : 0);
}

int lanes_for(int64_t I) {
  int L = 1;
  while (L < I && L < 32) L <<= 1;
  return L;
}

// The geometry one rowwise-path launch needs on the device.
struct RowwiseGeom {
  int64_t N, rows, bpm, slice;
  int I, O;
};

// The lanes of this thread's group within its warp (groups are aligned runs of blockDim.x lanes).
__device__ __forceinline__ unsigned group_mask() {
  const int L = blockDim.x;
  if (L >= 32) return 0xffffffffu;
  const int lane_in_warp = (threadIdx.y * L + threadIdx.x) & 31;
  return ((1u << L) - 1u) << (lane_in_warp & ~(L - 1));
}

// Builds the block's weights in shared memory, transposed to (O, I): sW = W (the weights of the
// only path for NAC+/NAC*), sWm = W_m when separate, sG = G for an input gate.
template <typename T, int GATE>
__device__ __forceinline__ void build_shared_weights(const LayerPtrs& p, int64_t e, int I, int O, bool sep,
                                                     acc_t<T>* sW, acc_t<T>* sWm, acc_t<T>* sG) {
  using A = acc_t<T>;
  const int OI = O * I;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
  const int64_t base = e * static_cast<int64_t>(OI);
  for (int k = tid; k < OI; k += nt) {
    const int i = k / O, j = k % O;
    const int t = j * I + i;
    sW[t] = nm::nac_weight(ld<A, T>(p.W_hat, base + k), ld<A, T>(p.M_hat, base + k));
    if (sep) sWm[t] = nm::nac_weight(ld<A, T>(p.W_hat_m, base + k), ld<A, T>(p.M_hat_m, base + k));
    if (GATE == kGateInput) sG[t] = ld<A, T>(p.G, base + k);
  }
}

template <typename T, typename K, int MAXO>
__global__ void __launch_bounds__(kThreads)
    rowwise_forward_kernel(LayerPtrs p, FwdOut<void*> out, RowwiseGeom s, LayerArgs args) {
  using A = acc_t<T>;
  constexpr bool ADD = K::add, MUL = K::mul;
  constexpr int GATE = K::gate;
  const bool sep = args.kind.sep();
  const A eps = static_cast<A>(args.eps);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A s_gind[MAXO];  // sigmoid(G) of an independent gate
  const int I = s.I, O = s.O, OI = I * O;
  A* sW = reinterpret_cast<A*>(smem_raw);
  A* sWm = sep ? sW + OI : sW;
  A* sG = sW + OI * (sep ? 2 : 1);
  const int64_t e = blockIdx.x / s.bpm, c = blockIdx.x % s.bpm;

  build_shared_weights<T, GATE>(p, e, I, O, sep, sW, sWm, sG);
  if (GATE == kGateIndep) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    if (tid < O) {
      const A gv = nm::sigmoid(ld<A, T>(p.G, e * O + tid));
      s_gind[tid] = gv;
      if (c == 0) st<T>(out.g, e * O + tid, gv);  // the forward's g: sigmoid(G), G's shape
    }
  }
  __syncthreads();

  const int L = blockDim.x, lane = threadIdx.x;
  const unsigned mask = group_mask();
  const int64_t n_end = (c + 1) * s.rows < s.N ? (c + 1) * s.rows : s.N;
  for (int64_t n = c * s.rows + threadIdx.y; n < n_end; n += blockDim.y) {
    const int64_t row = e * s.N + n;
    const int64_t xoff = row * I;
    A acc_a[MAXO], acc_u[MAXO], acc_z[MAXO];
#pragma unroll
    for (int j = 0; j < MAXO; ++j) acc_a[j] = acc_u[j] = acc_z[j] = A(0);
    // A lane's inputs i = lane, lane + L, ... in runs of kFwdLoads: the run's loads are issued
    // before its math, so that a warp keeps several reads in flight (the same order of sums).
    for (int i0 = lane; i0 < I; i0 += kFwdLoads * L) {
      A xr[kFwdLoads];
#pragma unroll
      for (int u = 0; u < kFwdLoads; ++u) {
        const int i = i0 + u * L;
        xr[u] = i < I ? ld<A, T>(p.x, xoff + i) : A(0);
      }
#pragma unroll
      for (int u = 0; u < kFwdLoads; ++u) {
        const int i = i0 + u * L;
        if (i >= I) break;
        const A xv = xr[u];
        A lv = A(0);
        if (MUL) {
          lv = nm::log_abs(xv, eps);
          st<T>(out.lx, xoff + i, lv);
        }
#pragma unroll
        for (int j = 0; j < MAXO; ++j) {
          if (j < O) {
            if (ADD) acc_a[j] += xv * sW[j * I + i];
            if (MUL) acc_u[j] += lv * sWm[j * I + i];
            if (GATE == kGateInput) acc_z[j] += xv * sG[j * I + i];
          }
        }
      }
    }
    // Butterfly sums over the group: every lane ends with the totals.
    for (int off = L >> 1; off > 0; off >>= 1) {
#pragma unroll
      for (int j = 0; j < MAXO; ++j) {
        if (j < O) {
          if (ADD) acc_a[j] += __shfl_xor_sync(mask, acc_a[j], off, L);
          if (MUL) acc_u[j] += __shfl_xor_sync(mask, acc_u[j], off, L);
          if (GATE == kGateInput) acc_z[j] += __shfl_xor_sync(mask, acc_z[j], off, L);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < MAXO; ++j) {
      if (j < O && (j & (L - 1)) == lane) {
        const int64_t o = row * O + j;
        if (ADD && MUL) {
          const A mv = nm::exp_(acc_u[j]);
          A gv;
          if (GATE == kGateInput) {  // z = x G (+ G_bias)
            gv = nm::sigmoid(p.G_bias != nullptr ? acc_z[j] + ld<A, T>(p.G_bias, e * O + j) : acc_z[j]);
          } else {
            gv = s_gind[j];
          }
          st<T>(out.y, o, nm::blend(acc_a[j], mv, gv));
          st<T>(out.a, o, acc_a[j]);
          st_m<T>(out.m, o, mv);
          if (GATE == kGateInput) st<T>(out.g, o, gv);
        } else if (ADD) {
          st<T>(out.y, o, acc_a[j]);
        } else {
          st<T>(out.y, o, nm::exp_(acc_u[j]));
        }
      }
    }
  }
}

// Entry k of a member's (summed) weight-gradient slice -> the op's gradient outputs.
// dW, dW_m go through the weight construction's backward; dG and dG_bias are stored as they are.
template <typename T>
__device__ __forceinline__ void finish_entry(const LayerPtrs& p, const GradOut& out, int64_t e, int64_t k,
                                             acc_t<T> sum, int I, int O, bool sep, int gate) {
  using A = acc_t<T>;
  const int64_t OI = static_cast<int64_t>(O) * I;
  const int64_t gate_off = OI * (sep ? 2 : 1);
  if (k < gate_off) {
    const bool second = k >= OI;
    const int64_t t = second ? k - OI : k;
    const int64_t j = t / I, i = t % I;
    const int64_t w = e * OI + i * O + j;
    A gw, gm;
    if (!second) {
      nm::nac_weight_backward(sum, ld<A, T>(p.W_hat, w), ld<A, T>(p.M_hat, w), &gw, &gm);
      st<T>(out.dW_hat, w, gw);
      st<T>(out.dM_hat, w, gm);
    } else {
      nm::nac_weight_backward(sum, ld<A, T>(p.W_hat_m, w), ld<A, T>(p.M_hat_m, w), &gw, &gm);
      st<T>(out.dW_hat_m, w, gw);
      st<T>(out.dM_hat_m, w, gm);
    }
  } else if (gate == kGateInput && k >= gate_off + OI) {
    st<T>(out.dG_bias, e * O + (k - gate_off - OI), sum);
  } else if (gate == kGateInput) {
    const int64_t t = k - gate_off;
    const int64_t j = t / I, i = t % I;
    st<T>(out.dG, e * OI + i * O + j, sum);
  } else if (gate == kGateIndep) {
    st<T>(out.dG, e * O + (k - gate_off), sum);
  }
}

template <typename T, typename K, int MAXO>
__global__ void __launch_bounds__(kThreads)
    rowwise_backward_kernel(LayerPtrs p, SavedPtrs<const void*> sv, GradOut out, acc_t<T>* partials,
                            RowwiseGeom s, LayerArgs args) {
  using A = acc_t<T>;
  constexpr bool ADD = K::add, MUL = K::mul;
  constexpr int GATE = K::gate;
  const bool sep = args.kind.sep(), grad_x = args.compute_grad_x;
  const bool bias = GATE == kGateInput && args.kind.gate_bias, parts = ADD && MUL && sv.part_grads();
  const A eps = static_cast<A>(args.eps);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int I = s.I, O = s.O, OI = I * O;
  const int nmats = 1 + (sep ? 1 : 0) + (GATE == kGateInput ? 1 : 0);
  A* sW = reinterpret_cast<A*>(smem_raw);
  A* sWm = sep ? sW + OI : sW;
  A* sG = sW + OI * (sep ? 2 : 1);
  A* slices = sW + static_cast<int64_t>(OI) * nmats;  // (groups, slice)
  const int64_t e = blockIdx.x / s.bpm, c = blockIdx.x % s.bpm;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
  const int64_t slice = s.slice;
  const int64_t gate_off = static_cast<int64_t>(OI) * (sep ? 2 : 1);

  build_shared_weights<T, GATE>(p, e, I, O, sep, sW, sWm, sG);
  for (int64_t k = tid; k < slice * blockDim.y; k += nt) slices[k] = A(0);
  __syncthreads();

  const int L = blockDim.x, lane = threadIdx.x;
  A* acc = slices + threadIdx.y * slice;
  A* accW = acc;
  A* accWm = sep ? acc + OI : acc;
  A* accG = acc + gate_off;
  A* accGb = accG + OI;  // the gate bias's (input gate)
  const int64_t n_end = (c + 1) * s.rows < s.N ? (c + 1) * s.rows : s.N;
  for (int64_t n = c * s.rows + threadIdx.y; n < n_end; n += blockDim.y) {
    const int64_t row = e * s.N + n;
    A da[MAXO], du[MAXO], dz[MAXO];
#pragma unroll
    for (int j = 0; j < MAXO; ++j) {
      da[j] = du[j] = dz[j] = A(0);
      if (j < O) {
        const int64_t o = row * O + j;
        const A dyv = ld<A, T>(sv.dy, o);
        if (ADD && MUL) {
          const A gv = GATE == kGateInput ? ld<A, T>(sv.g, o) : ld<A, T>(sv.g, e * O + j);
          nm::blend_backward(dyv, ld<A, T>(sv.a, o), ld<A, T>(sv.m, o), gv, &da[j], &du[j], &dz[j]);
          if (parts) {
            A unused = A(0);
            nm::parts_backward(sv.ga != nullptr ? ld<A, T>(sv.ga, o) : A(0), sv.gm != nullptr ? ld<A, T>(sv.gm, o) : A(0),
                               GATE == kGateInput && sv.gg != nullptr ? ld<A, T>(sv.gg, o) : A(0), ld<A, T>(sv.m, o), gv,
                               &da[j], &du[j], GATE == kGateInput ? &dz[j] : &unused);
          }
        } else if (ADD) {
          da[j] = dyv;
        } else {
          du[j] = dyv * ld<A, T>(sv.m, o);  // d exp(u) / du = exp(u) = y
        }
      }
    }
    const int64_t xoff = row * I;
    for (int i = lane; i < I; i += L) {
      const A xv = ld<A, T>(p.x, xoff + i);
      const A lv = MUL ? ld<A, T>(sv.lx, xoff + i) : A(0);
      if (grad_x) {
        const A sg = MUL ? nm::log_abs_grad(xv, eps) : A(0);
        A v = A(0);
#pragma unroll
        for (int j = 0; j < MAXO; ++j) {
          if (j < O) {
            if (ADD) v += da[j] * sW[j * I + i];
            if (GATE == kGateInput) v += dz[j] * sG[j * I + i];
            if (MUL) v += sg * du[j] * sWm[j * I + i];
          }
        }
        st<T>(out.dx, xoff + i, v);
      }
#pragma unroll
      for (int j = 0; j < MAXO; ++j) {
        if (j < O) {
          const int t = j * I + i;
          if (sep) {
            accW[t] += xv * da[j];
            accWm[t] += lv * du[j];
          } else {
            A v = A(0);
            if (ADD) v += xv * da[j];
            if (MUL) v += lv * du[j];
            accW[t] += v;
          }
          if (GATE == kGateInput) accG[t] += xv * dz[j];
        }
      }
    }
    if ((GATE == kGateIndep || bias) && lane == 0) {
      A* acc_sum = GATE == kGateIndep ? accG : accGb;  // sum_n dz: G's (independent) or G_bias's
#pragma unroll
      for (int j = 0; j < MAXO; ++j) {
        if (j < O) acc_sum[j] += dz[j];
      }
    }
  }
  __syncthreads();

  // Fold the group slices in group order; finish, or leave the block's partial for the reduce.
  for (int64_t k = tid; k < slice; k += nt) {
    A sum = A(0);
    for (int y = 0; y < static_cast<int>(blockDim.y); ++y) sum += slices[y * slice + k];
    if (s.bpm == 1) {
      finish_entry<T>(p, out, e, k, sum, I, O, sep, GATE);
    } else {
      partials[blockIdx.x * slice + k] = sum;
    }
  }
}

// Sums each member's block partials in block order, then finishes (one thread per entry).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rowwise_backward_reduce_kernel(LayerPtrs p, GradOut out, const acc_t<T>* partials, RowwiseGeom s, int64_t E,
                                   LayerArgs args) {
  using A = acc_t<T>;
  const bool sep = args.kind.sep();
  const int gate = static_cast<int>(args.kind.gate);
  const int64_t total = E * s.slice;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = t / s.slice, k = t % s.slice;
    const A* base = partials + e * s.bpm * s.slice + k;
    A sum = A(0);
    for (int64_t c = 0; c < s.bpm; ++c) sum += base[c * s.slice];
    finish_entry<T>(p, out, e, k, sum, s.I, s.O, sep, gate);
  }
}

RowwisePlan plan_rowwise(DType dt, const LayerKind& k, const Dims& d, bool backward) {
  RowwisePlan plan;
  if (d.O > kRowwiseMaxOut || d.I > kRowwiseMaxIn || d.E < 1) return plan;
  const size_t ab = acc_bytes(dt);
  const int64_t slice = slice_elems(k, d);
  const size_t wbytes = static_cast<size_t>(weight_mats(k) * d.I * d.O) * ab;
  const size_t sbytes = static_cast<size_t>(slice) * ab;
  // One predicate for both directions: the weights and one accumulator slice fit.
  if (wbytes + sbytes > kSmemLimit) return plan;
  plan.lanes = lanes_for(d.I);
  const int max_groups = kThreads / plan.lanes;
  if (backward) {
    const size_t fit = sbytes == 0 ? static_cast<size_t>(max_groups) : (kSmemLimit - wbytes) / sbytes;
    plan.groups = static_cast<int>(std::min<size_t>(static_cast<size_t>(max_groups), fit));
    plan.smem_bytes = wbytes + static_cast<size_t>(plan.groups) * sbytes;
  } else {
    plan.groups = max_groups;
    plan.smem_bytes = wbytes;
  }
  const int64_t min_rows = backward ? kBwdRowsPerGroup * plan.groups : plan.groups;
  const int64_t target = backward ? kTargetBlocks : kFwdTargetBlocks;
  int64_t bpm = std::max<int64_t>(1, std::min(ceil_div(d.N, min_rows), std::max<int64_t>(1, target / d.E)));
  const int64_t rows = ceil_div(d.N, bpm);
  if (rows > 0) bpm = ceil_div(d.N, rows);  // no block without rows
  if (d.E > INT_MAX / bpm) return RowwisePlan{};
  plan.blocks_per_member = bpm;
  plan.rows_per_block = rows;
  plan.slice = slice;
  plan.workspace_bytes = backward && bpm > 1 ? static_cast<size_t>(d.E * bpm * slice) * ab : 0;
  plan.ok = true;
  return plan;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

RowwisePlan plan_rowwise_forward(DType dt, const LayerKind& kind, const Dims& d) {
  return plan_rowwise(dt, kind, d, false);
}

RowwisePlan plan_rowwise_backward(DType dt, const LayerKind& kind, const Dims& d) {
  return plan_rowwise(dt, kind, d, true);
}

void rowwise_forward(DType dt, const LayerArgs& args, const Dims& d, const RowwisePlan& plan, const LayerPtrs& p,
                     const FwdOut<void*>& out, cudaStream_t stream) {
  const RowwiseGeom s{d.N, plan.rows_per_block, plan.blocks_per_member, plan.slice, static_cast<int>(d.I),
                      static_cast<int>(d.O)};
  const dim3 block(plan.lanes, plan.groups);
  const unsigned grid = static_cast<unsigned>(d.E * plan.blocks_per_member);
  NALU_DISPATCH_DTYPE(dt, [&] {
    NALU_DISPATCH_KIND(args.kind, [&] {
      NALU_DISPATCH_MAXO(d.O, [&] {
        rowwise_forward_kernel<scalar_t, kind_t, maxo_t::value><<<grid, block, plan.smem_bytes, stream>>>(
            p, out, s, args);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

void rowwise_backward(DType dt, const LayerArgs& args, const Dims& d, const RowwisePlan& plan, const LayerPtrs& p,
                      const SavedPtrs<const void*>& saved, const GradOut& out, void* workspace, cudaStream_t stream) {
  const RowwiseGeom s{d.N, plan.rows_per_block, plan.blocks_per_member, plan.slice, static_cast<int>(d.I),
                      static_cast<int>(d.O)};
  const dim3 block(plan.lanes, plan.groups);
  const unsigned grid = static_cast<unsigned>(d.E * plan.blocks_per_member);
  NALU_DISPATCH_DTYPE(dt, [&] {
    using A = acc_t<scalar_t>;
    A* partials = static_cast<A*>(workspace);
    NALU_DISPATCH_KIND(args.kind, [&] {
      NALU_DISPATCH_MAXO(d.O, [&] {
        rowwise_backward_kernel<scalar_t, kind_t, maxo_t::value><<<grid, block, plan.smem_bytes, stream>>>(
            p, saved, out, partials, s, args);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    if (plan.blocks_per_member > 1 && s.slice > 0) {
      const int64_t n = d.E * s.slice;
      rowwise_backward_reduce_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(
          p, out, partials, s, d.E, args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}
}  // namespace cuda
}  // namespace nalu_cuda
