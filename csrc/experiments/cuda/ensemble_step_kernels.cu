// ensemble_step_kernels.cu: the kernel of the static task's training step on CUDA
// (static_ensemble_grad; the interface and what it computes: ensemble_step_kernels.h). One block
// per member, its work in phases separated by __syncthreads, every intermediate in the member's
// part of the workspace (global memory, L1/L2-resident at these sizes):
//
//   1. the effective weights of both layers (tanh(W_hat) sigmoid(M_hat); the NAU's clamp; the NMU's W
//      as stored), layer 1's transposed to (H, I) so that a warp's lanes read along the inputs;
//   2. layer 1: one warp per (row, output), lanes over the inputs, a butterfly reduction: a = x W,
//      and for the NALU m = exp(log(|x| + eps) W), g = sigmoid(x G), h = g a + (1 - g) m;
//   3. layer 2 (H -> 1), one thread per row; the MSE and the NMU model's penalty as block sums; the
//      objective's finiteness and the member's flag (thread 0);
//   4. d MSE / dy, layer 2's backward per row (its input gradient dh and its weights' terms), then
//      its weight gradients (one thread per weight, a sum over the rows);
//   5. layer 1's backward: the blend's gradients per (row, output), then the column sums: the rows
//      split into S = min(B, threads / I) strided slices, one thread per (slice, input column)
//      (adjacent threads read adjacent inputs) summing its slice for every output, then one thread
//      per weight adding the S partial sums in slice order, through the weight construction.
//
// A block has 1024 threads: at the paper's ensemble (100 members, fewer than an H200's 132
// multiprocessors) one block per member is all the parallelism there is, and 256 threads left
// three quarters of each multiprocessor's warp slots empty (benchmarks/RESULTS.md, section 29).
//
// With the batch drawn in the kernel (static_ensemble_grad_counter), an input is a function of
// (seed, step, index) computed wherever the kernel reads it (phases 2 and 5), never stored, and the
// targets are formed in phase 2 by the warps of output 0 from the same values.
//
// Every sum has one order fixed by the shapes (never by timing): a member's results are the same
// bits on every run. They are not the CPU kernels' bits (those sum in other orders): the two agree
// to rounding, as python_tests/test_native_step_cuda.py checks.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda/cuda_common.cuh"
#include "experiments/cuda/ensemble_step_kernels.h"
#include "experiments/target_ops.h"
#include "ops/nac_nalu/math.h"
#include "ops/nau_nmu/math.h"

namespace nalu_cuda {
namespace training {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off, 32);
  return v;
}

// The sum of every thread's v, returned to every thread (warp sums, then the warps' in order).
// Every thread of the block must call it; s_red has kWarps slots.
template <typename T>
__device__ T block_sum(T v, T* s_red) {
  v = warp_sum(v);
  __syncthreads();  // (the slots' earlier use is over)
  if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = v;
  __syncthreads();
  T s = T(0);
  for (int k = 0; k < static_cast<int>(blockDim.x / 32); ++k) s += s_red[k];
  return s;
}

template <typename T>
__device__ __forceinline__ bool is_finite(T v) {
  return v - v == T(0);  // false for NaN and +-Inf
}

// The sparsity term and its derivative of a NAU or NMU weight (0 for the other kinds).
template <typename T>
__device__ __forceinline__ T sparsity(StepKind k, T w) {
  return k == StepKind::kNau ? math::nau_sparsity(w) : (k == StepKind::kNmu ? math::nmu_sparsity(w) : T(0));
}
template <typename T>
__device__ __forceinline__ T sparsity_grad(StepKind k, T w) {
  return k == StepKind::kNau ? math::nau_sparsity_grad(w) : (k == StepKind::kNmu ? math::nmu_sparsity_grad(w) : T(0));
}

// The effective weight of element k of a layer's first parameter(s).
template <typename T>
__device__ __forceinline__ T effective_weight(StepKind kind, const T* p0, const T* p1, int64_t k) {
  if (kind == StepKind::kNac || kind == StepKind::kNalu) return math::nac_weight(p0[k], p1[k]);
  if (kind == StepKind::kNau) return math::clamp_unit(p0[k]);
  return p0[k];
}

// The stored parameters' gradients of weight element k from dW (and the NALU's dG), with the
// sparsity regulariser's term (weight rw, over n weights) for a NAU or NMU.
template <typename T>
__device__ __forceinline__ void param_grads(StepKind kind, const T* const* p, T* const* g, int64_t k, T dW, T dG,
                                            T rw, int64_t n) {
  if (kind == StepKind::kNac || kind == StepKind::kNalu) {
    math::nac_weight_backward(dW, p[0][k], p[1][k], &g[0][k], &g[1][k]);
    if (kind == StepKind::kNalu) g[2][k] = dG;
    return;
  }
  T v = kind == StepKind::kNau ? (math::clamp_unit_passes(p[0][k]) ? dW : T(0)) : dW;
  if (rw != T(0)) v += rw * sparsity_grad(kind, p[0][k]) / static_cast<T>(n);
  g[0][k] = v;
}

// The workspace of one member (static_grad_work_elems): the regions the kernel lays out below.
// The last region holds phase 5's partial column sums: S slices x I inputs <= kThreads (or S = 1),
// times H outputs x 3 sums.
__host__ __device__ inline int64_t work_elems(int64_t B, int64_t I, int64_t H) {
  const int64_t partials = 3 * H * (I > kThreads ? I : kThreads);
  return 2 * H * I + 2 * H + 9 * B * H + 8 * B + partials;
}

// Phase 5's slices of rows per input column: as many as the block's threads allow, at most B.
__host__ __device__ inline int64_t column_slices(int64_t B, int64_t I, int64_t nt) {
  const int64_t s = I > 0 ? nt / I : 1;
  return s < 1 ? 1 : (s > B ? (B > 0 ? B : 1) : s);
}

// One member's CounterStream input: element `index` of its step's (B, I) draw (counter_draw.h), x =
// lo + u (hi - lo) in float32 with the product rounded on its own, at most `top`.
struct MemberDraw {
  CounterKey key;
  float lo, width, top;

  __device__ __forceinline__ float operator()(int64_t index) const {
    const uint32_t h = key.word(static_cast<uint32_t>(index));
    const float u = static_cast<float>(h >> 9) * kCounterUnit;  // exact
    const float x = lo + cuda::mul_rn(u, width);
    return x < top ? x : top;
  }
};

__host__ __device__ inline int64_t params_of(StepKind k) { return k == StepKind::kNac ? 2 : (k == StepKind::kNalu ? 3 : 1); }

// DRAWN: the batch from a.draw (float only), regenerated at every read, and the targets computed by
// layer 1's warps of output 0 in the same pass over the inputs.
template <typename T, bool DRAWN>
__global__ void __launch_bounds__(kThreads) static_grad_kernel(StaticGradArgs a) {
  __shared__ T s_red[kWarps];
  __shared__ T s_scale[1];
  const int64_t e = blockIdx.x;
  const int64_t tid = threadIdx.x, nt = blockDim.x;
  const int64_t warp = tid / 32, nw = nt / 32;
  const int lane = static_cast<int>(tid % 32);
  const int64_t B = a.B, I = a.I, H = a.H;
  const StepKind k1 = a.kinds[0], k2 = a.kinds[1];
  const T eps = static_cast<T>(a.eps);

  // this member's parameters and gradients: layer l's j-th at p[l][j], g[l][j]
  const T* p[2][3] = {};
  T* g[2][3] = {};
  const int64_t n1 = params_of(k1);
  for (int64_t q = 0; q < n1 + params_of(k2); ++q) {
    const int l = q < n1 ? 0 : 1;
    const int64_t j = q < n1 ? q : q - n1;
    const int64_t o = a.offset[q] + e * a.per_member[q];
    p[l][j] = static_cast<const T*>(a.param) + o;
    g[l][j] = static_cast<T*>(a.grad) + o;
  }
  T* W1 = static_cast<T*>(a.work) + e * work_elems(B, I, H);
  T* G1 = W1 + H * I;
  T* w2 = G1 + H * I;
  T* g2 = w2 + H;
  T* h = g2 + H;      // (B, H) layer 1's output
  T* a1 = h + B * H;  // (B, H) the NALU's a, m, g of layer 1
  T* m1 = a1 + B * H;
  T* z1 = m1 + B * H;
  T* y = z1 + B * H;  // (B)
  T* f2 = y + B;      // (B, 3) the NALU's a, m, g of layer 2
  T* d2 = f2 + 3 * B; // (B, 3) d loss / d (a, log-space sum, gate logit) of layer 2 (dy alone for the others)
  T* c2 = d2 + 3 * B; // (B, H) the NMU's d loss / dW terms per row
  T* dh = c2 + B * H; // (B, H) d loss / dh
  T* d1 = dh + B * H; // (B, H, 3) layer 1's (da, dm, dz)
  T* drawn_t = d1 + 3 * B * H;  // (B) the drawn batch's targets
  T* part = drawn_t + B;        // (S, I, H, 3) phase 5's partial column sums

  // the member's inputs x(b, i) and targets
  const T* x = DRAWN ? nullptr : static_cast<const T*>(a.x) + e * B * I;
  const T* t = DRAWN ? drawn_t : static_cast<const T*>(a.target) + e * B;
  MemberDraw md{};
  const double* mask = nullptr;
  TargetOp op = TargetOp::kAdd;
  if (DRAWN) {
    const CounterDraw& d = a.draw;
    const int64_t s = e % d.S, step = *d.step;
    md = MemberDraw{CounterKey(d, s, step), d.lo, d.hi - d.lo, d.top};
    mask = d.masks + s * I * 2;
    op = static_cast<TargetOp>(d.ops[e / d.S]);
  }
  auto xin = [&](int64_t b, int64_t i) -> T {
    if (DRAWN) return static_cast<T>(md(b * I + i));
    return x[b * I + i];
  };

  // 1. the effective weights
  for (int64_t k = tid; k < I * H; k += nt) {
    const int64_t i = k / H, o = k % H;
    W1[o * I + i] = effective_weight(k1, p[0][0], p[0][1], k);
    if (k1 == StepKind::kNalu) G1[o * I + i] = p[0][2][k];
  }
  for (int64_t k = tid; k < H; k += nt) {
    w2[k] = effective_weight(k2, p[1][0], p[1][1], k);
    if (k2 == StepKind::kNalu) g2[k] = p[1][2][k];
  }
  __syncthreads();

  // 2. layer 1, one warp per (row, output)
  for (int64_t r = warp; r < B * H; r += nw) {
    const int64_t b = r / H, o = r % H;
    const T* wo = W1 + o * I;
    T sa = T(0), sm = T(0), sz = T(0);
    double ta = 0.0, tb = 0.0;  // the drawn targets' float64 sums (exact: their order does not matter)
    for (int64_t i = lane; i < I; i += 32) {
      const T xi = xin(b, i);
      if (DRAWN && o == 0) {
        ta += static_cast<double>(xi) * mask[2 * i];
        tb += static_cast<double>(xi) * mask[2 * i + 1];
      }
      sa += xi * wo[i];
      if (k1 == StepKind::kNalu) {
        sm += math::log_abs(xi, eps) * wo[i];
        sz += xi * G1[o * I + i];
      }
    }
    sa = warp_sum(sa);
    if (k1 == StepKind::kNalu) {
      sm = warp_sum(sm);
      sz = warp_sum(sz);
    }
    if (DRAWN && o == 0) {
      ta = warp_sum(ta);
      tb = warp_sum(tb);
      if (lane == 0) drawn_t[b] = static_cast<T>(apply_target(op, ta, tb));
    }
    if (lane == 0) {
      if (k1 == StepKind::kNalu) {
        const T m = math::exp_(sm), gz = math::sigmoid(sz);
        a1[r] = sa, m1[r] = m, z1[r] = gz;
        h[r] = math::blend(sa, m, gz);
      } else {
        h[r] = sa;
      }
    }
  }
  __syncthreads();

  // 3. layer 2 per row, the MSE, the penalty, the objective
  T sq = T(0);
  for (int64_t b = tid; b < B; b += nt) {
    const T* hb = h + b * H;
    T yv;
    if (k2 == StepKind::kNmu) {
      yv = T(1);
      for (int64_t i = 0; i < H; ++i) yv = yv * math::nmu_factor(w2[i], hb[i]);
    } else if (k2 == StepKind::kNalu) {
      T sa = T(0), sm = T(0), sz = T(0);
      for (int64_t i = 0; i < H; ++i) {
        sa += hb[i] * w2[i];
        sm += math::log_abs(hb[i], eps) * w2[i];
        sz += hb[i] * g2[i];
      }
      const T m = math::exp_(sm), gz = math::sigmoid(sz);
      f2[3 * b] = sa, f2[3 * b + 1] = m, f2[3 * b + 2] = gz;
      yv = math::blend(sa, m, gz);
    } else {
      yv = T(0);
      for (int64_t i = 0; i < H; ++i) yv += hb[i] * w2[i];
    }
    y[b] = yv;
    const T err = yv - t[b];
    sq += err * err;
  }
  const T loss = block_sum(sq, s_red) / static_cast<T>(B);
  const T rw = static_cast<T>(a.reg_weight);
  T pen = T(0);
  if (a.reg_weight != 0.0) {
    T s1 = T(0), s2 = T(0);
    for (int64_t k = tid; k < I * H; k += nt) s1 += sparsity(k1, p[0][0][k]);
    for (int64_t k = tid; k < H; k += nt) s2 += sparsity(k2, p[1][0][k]);
    s1 = block_sum(s1, s_red);
    s2 = block_sum(s2, s_red);
    pen = s1 / static_cast<T>(I * H) + s2 / static_cast<T>(H);
  }
  if (tid == 0) {
    const bool bad = !is_finite(a.reg_weight != 0.0 ? loss + rw * pen : loss);
    const bool was = a.diverged[e];
    s_scale[0] = (was || bad) ? T(0) : T(1);
    a.diverged[e] = was || bad;
    static_cast<T*>(a.loss)[e] = loss;
  }
  __syncthreads();
  const T scale = s_scale[0];
  const T rws = scale * rw;  // the penalty's weight in the gradient

  // 4. layer 2's backward per row, then its weight gradients
  for (int64_t b = tid; b < B; b += nt) {
    const T dy = scale / static_cast<T>(B) * (y[b] - t[b]) * T(2);
    const T* hb = h + b * H;
    T* db = dh + b * H;
    if (k2 == StepKind::kNmu) {
      for (int64_t i = 0; i < H; ++i) {
        T others = T(1);
        for (int64_t j = 0; j < H; ++j)
          if (j != i) others = others * math::nmu_factor(w2[j], hb[j]);
        others = dy * others;
        c2[b * H + i] = others * math::nmu_dfactor_dw(w2[i], hb[i]);
        db[i] = others * math::nmu_dfactor_dx(w2[i], hb[i]);
      }
    } else if (k2 == StepKind::kNalu) {
      T da, dm, dz;
      math::blend_backward(dy, f2[3 * b], f2[3 * b + 1], f2[3 * b + 2], &da, &dm, &dz);
      d2[3 * b] = da, d2[3 * b + 1] = dm, d2[3 * b + 2] = dz;
      for (int64_t i = 0; i < H; ++i)
        db[i] = da * w2[i] + dm * w2[i] * math::log_abs_grad(hb[i], eps) + dz * g2[i];
    } else {
      d2[3 * b] = dy;
      for (int64_t i = 0; i < H; ++i) db[i] = dy * w2[i];
    }
  }
  __syncthreads();
  for (int64_t i = tid; i < H; i += nt) {
    T dW = T(0), dL = T(0), dG = T(0);
    for (int64_t b = 0; b < B; ++b) {
      const T hv = h[b * H + i];
      if (k2 == StepKind::kNmu) {
        dW += c2[b * H + i];
      } else {
        dW += hv * d2[3 * b];
        if (k2 == StepKind::kNalu) {
          dL += math::log_abs(hv, eps) * d2[3 * b + 1];
          dG += hv * d2[3 * b + 2];
        }
      }
    }
    param_grads(k2, p[1], g[1], i, k2 == StepKind::kNalu ? dW + dL : dW, dG, rws, H);
  }

  // 5. layer 1's backward: the blend's gradients per (row, output), then the column sums
  for (int64_t r = tid; r < B * H; r += nt) {
    if (k1 == StepKind::kNalu) {
      math::blend_backward(dh[r], a1[r], m1[r], z1[r], &d1[3 * r], &d1[3 * r + 1], &d1[3 * r + 2]);
    } else {
      d1[3 * r] = dh[r];
    }
  }
  __syncthreads();
  // Partial sums: thread (s, i) over rows b = s, s + S, ..., every output (four at a time in
  // registers, each input drawn once per four outputs).
  const int64_t S = column_slices(B, I, nt);
  for (int64_t q = tid; q < S * I; q += nt) {
    const int64_t i = q % I, sl = q / I;
    for (int64_t o0 = 0; o0 < H; o0 += 4) {
      T dW[4] = {}, dL[4] = {}, dG[4] = {};
      for (int64_t b = sl; b < B; b += S) {
        const T xi = xin(b, i);
        const T li = k1 == StepKind::kNalu ? math::log_abs(xi, eps) : T(0);
        const T* c = d1 + 3 * (b * H + o0);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (o0 + u < H) {
            dW[u] += xi * c[3 * u];
            if (k1 == StepKind::kNalu) {
              dL[u] += li * c[3 * u + 1];
              dG[u] += xi * c[3 * u + 2];
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (o0 + u < H) {
          T* pq = part + 3 * ((sl * I + i) * H + o0 + u);
          pq[0] = dW[u], pq[1] = dL[u], pq[2] = dG[u];
        }
      }
    }
  }
  __syncthreads();
  // The slices' sums in slice order, one thread per weight (i, o).
  for (int64_t k = tid; k < I * H; k += nt) {
    T dW = T(0), dL = T(0), dG = T(0);
    for (int64_t sl = 0; sl < S; ++sl) {
      const T* pq = part + 3 * (sl * I * H + k);
      dW += pq[0];
      dL += pq[1];
      dG += pq[2];
    }
    param_grads(k1, p[0], g[0], k, k1 == StepKind::kNalu ? dW + dL : dW, dG, rws, I * H);
  }
}

}  // namespace

int64_t static_grad_work_elems(int64_t B, int64_t I, int64_t H) { return work_elems(B, I, H); }

void static_ensemble_grad_cuda(const StaticGradArgs& a, bool is_double, cudaStream_t stream) {
  if (a.E == 0) return;
  if (a.x == nullptr) {
    static_grad_kernel<float, true><<<static_cast<unsigned>(a.E), kThreads, 0, stream>>>(a);
  } else if (is_double) {
    static_grad_kernel<double, false><<<static_cast<unsigned>(a.E), kThreads, 0, stream>>>(a);
  } else {
    static_grad_kernel<float, false><<<static_cast<unsigned>(a.E), kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace training
}  // namespace nalu_cuda
