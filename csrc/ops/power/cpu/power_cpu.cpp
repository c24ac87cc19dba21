// power_cpu.cpp: the CPU device of the NPU / RealNPU and iNALU ops, registered through their entry
// points (csrc/ops/power/ops.h, which checks the arguments): fused OpenMP loops around ATen's bmm
// (MKL/oneDNN) for the products. Scalar math and every derivative: csrc/ops/power/math.h.
//
// NPU (member e, row n, input i, output o; C = 2 O for the NPU, O for the RealNPU):
//   forward   prologue  LK[e] = [lr; k] (2N, I), lr = log r, k = g pi [x < 0], g clamped
//             product   P[e] = LK[e] Wc[e] (2N, C), Wc = [W_r, W_i] (I, 2O), or W_r for RealNPU
//             epilogue  U = L W_r - K W_i, V = K W_r + L W_i read from P; y = exp(U) cos(V),
//                       s = exp(U) sin(V)
//   backward  epilogue  dU = dy y, dV = -dy s into D[e] (2N, C): rows of L get [dU, dV], rows of
//                       K get [dV, -dU] (RealNPU: dU, then dV), so that
//             products  [dW_r, dW_i] = LK^T D  and  [dlr; dk] = D Wc^T
//             prologue  dx = dlr g sign(x) / r;  dg = sum_n (dlr (|x| + eps - 1) / r + dk pi [x < 0])
//                       where 0 <= g <= 1 (the clamp's derivative), else 0
//   saved     y, s (the imaginary part) and lr (x's shape); k is recomputed in backward.
//
// iNALU:
//   forward   W, W_m from the hat weights; lx = log(max(|x|, eps)); a = x W; u = lx W_m (bmm);
//             one fused pass per row: msv = prod_i f(x_i, W_m[i]) and y = g a + (1 - g) m clip(msv)
//   backward  da, du, dmsv, dG per output (inalu_blend_backward); dW = x^T da; dW_m = lx^T du plus
//             the product's term sum_n dmsv f'(x_i, W_m[i]) prod_{k != i} f(x_k, W_m[k]) from
//             exclusive (prefix/suffix) products, exact when a factor is zero, never a (B, I, O)
//             tensor; dx = da W^T + (du W_m^T) d lx / dx; the hat weights' gradients as for NAC.
//   saved     a, u (before the omega clip), msv and lx.
//
// Every reduction over rows runs in a fixed order per output element (columns are split across
// threads, rows never), so results do not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/cpu/isa.h"  // cpu_dtypes()
#include "ops/power/math.h"
#include "ops/power/ops.h"

namespace nalu_cuda {
namespace cpu {
namespace {

using at::Tensor;
namespace pm = nalu_cuda::math;

constexpr int64_t kGrainWork = 32768;
int64_t grain_for(int64_t work_per_item) { return std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, work_per_item)); }

// Calls f.template operator()<T>() with T = float or double (checked before): the loops hold
// `#pragma omp simd`, which cannot sit inside the argument of the AT_DISPATCH macros.
template <typename F>
void dispatch_float(at::ScalarType st, F&& f) {
  if (st == at::kDouble) {
    f.template operator()<double>();
  } else {
    f.template operator()<float>();
  }
}

// A (rows, cols) view of one member per leading index: (E, rows, cols), contiguous and owned.
Tensor as3(const Tensor& t, int64_t E, int64_t rows, int64_t cols) { return t.contiguous().reshape({E, rows, cols}); }

// Sums rows of part (E, N, C) into out (E, C) in row order, columns split across threads.
template <typename T>
void column_sums(const T* part, T* out, int64_t E, int64_t N, int64_t C) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  at::parallel_for(0, E * blocks, grain_for(N * kBlock), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = t / blocks, c0 = (t % blocks) * kBlock, c1 = std::min(C, c0 + kBlock);
      T* o = out + e * C;
      for (int64_t c = c0; c < c1; ++c) o[c] = T(0);
      for (int64_t n = 0; n < N; ++n) {
        const T* p = part + (e * N + n) * C;
        for (int64_t c = c0; c < c1; ++c) o[c] += p[c];
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// NPU / RealNPU
// ------------------------------------------------------------------------------------------------

// Fills LK (E, 2N, I): rows [0, N) lr, rows [N, 2N) k; and lr (E, N, I) when given.
template <typename T>
void npu_prologue(const T* x, const T* g, T eps, T* LK, T* lr_out, int64_t E, int64_t N, int64_t I) {
  at::parallel_for(0, E * N, grain_for(I * 8), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t e = r / N, n = r % N;
      const T* xr = x + r * I;
      const T* ge = g + e * I;
      T* L = LK + (e * 2 * N + n) * I;
      T* K = LK + (e * 2 * N + N + n) * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const T gc = pm::npu_gate(ge[i]);
        pm::npu_prologue(xr[i], gc, eps, &L[i], &K[i]);
      }
      if (lr_out != nullptr) std::copy(L, L + I, lr_out + r * I);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// iNALU
// ------------------------------------------------------------------------------------------------

// W = tanh(W_hat) sigmoid(M_hat), elementwise.
template <typename T>
Tensor nac_weight_of(const Tensor& W_hat, const Tensor& M_hat) {
  const Tensor w = W_hat.contiguous(), m = M_hat.contiguous();
  Tensor out = at::empty(w.sizes(), w.options());
  const T* wp = w.data_ptr<T>();
  const T* mp = m.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, w.numel(), grain_for(32), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) op[k] = pm::nac_weight(wp[k], mp[k]);
  });
  return out;
}

// (dW_hat, dM_hat) from dW, elementwise.
template <typename T>
std::tuple<Tensor, Tensor> nac_weight_grads(const Tensor& dW, const Tensor& W_hat, const Tensor& M_hat) {
  const Tensor d = dW.contiguous(), w = W_hat.contiguous(), m = M_hat.contiguous();
  Tensor gw = at::empty(w.sizes(), w.options()), gm = at::empty(w.sizes(), w.options());
  const T* dp = d.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* mp = m.data_ptr<T>();
  T* gwp = gw.data_ptr<T>();
  T* gmp = gm.data_ptr<T>();
  at::parallel_for(0, w.numel(), grain_for(64), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) pm::nac_weight_backward(dp[k], wp[k], mp[k], &gwp[k], &gmp[k]);
  });
  return {gw, gm};
}

// The CPU device of the ops' entry points (csrc/ops/power/ops.h).
struct Cpu {
  static void check_input(const char* op, const char* name, const Tensor& t) {
    (void)name;  // the dtype message names the op and x's dtype
    check_dtype_supported(op, t, "CPU", cpu_dtypes());
  }
  static void check_inalu_backward(const char*, const LayerShape&, const Tensor&) {}  // any size

  // NPU / RealNPU

  static std::tuple<Tensor, Tensor, Tensor> npu_forward(const LayerShape& s, const Tensor& x, const Tensor& W_r,
                                                        const Tensor& W_i, const Tensor& g, double eps) {
    const bool complex = W_i.defined();
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O, C = complex ? 2 * O : O;
    const Tensor x3 = as3(x, E, N, I);
    const Tensor gc = g.contiguous();
    const Tensor Wr3 = as3(W_r, E, I, O);
    const Tensor Wc = complex ? at::cat({Wr3, as3(W_i, E, I, O)}, 2) : Wr3;
    Tensor LK = at::empty({E, 2 * N, I}, x.options());
    Tensor lr = at::empty(x.sizes(), x.options());
    Tensor y = at::empty(s.out_sizes, x.options());
    Tensor sy = at::empty(s.out_sizes, x.options());
    dispatch_float(x.scalar_type(), [&]<typename scalar_t>() {
      npu_prologue<scalar_t>(x3.data_ptr<scalar_t>(), gc.data_ptr<scalar_t>(), static_cast<scalar_t>(eps),
                             LK.data_ptr<scalar_t>(), lr.data_ptr<scalar_t>(), E, N, I);
      const Tensor P = at::bmm(LK, Wc);  // (E, 2N, C)
      const scalar_t* p = P.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      scalar_t* sp = sy.data_ptr<scalar_t>();
      at::parallel_for(0, E * N, grain_for(O * 16), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = r / N, n = r % N;
          const scalar_t* pl = p + (e * 2 * N + n) * C;      // lr [W_r, W_i]
          const scalar_t* pk = p + (e * 2 * N + N + n) * C;  // k [W_r, W_i]
          for (int64_t o = 0; o < O; ++o) {
            const scalar_t U = complex ? pl[o] - pk[O + o] : pl[o];
            const scalar_t V = complex ? pk[o] + pl[O + o] : pk[o];
            pm::npu_epilogue(U, V, &yp[r * O + o], &sp[r * O + o]);
          }
        }
      });
    });
    return {y, sy, lr};
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor> npu_backward(const LayerShape& s, const Tensor& grad_y,
                                                                 const Tensor& x, const Tensor& W_r, const Tensor& W_i,
                                                                 const Tensor& g, const Tensor& y, const Tensor& sy,
                                                                 const Tensor& lr, double eps, bool compute_grad_x) {
    const bool complex = W_i.defined();
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O, C = complex ? 2 * O : O;
    const Tensor x3 = as3(x, E, N, I);
    const Tensor gc = g.contiguous();
    const Tensor gy3 = as3(grad_y, E, N, O), y3 = as3(y, E, N, O), s3 = as3(sy, E, N, O), lr3 = as3(lr, E, N, I);
    const Tensor Wr3 = as3(W_r, E, I, O);
    const Tensor Wc = complex ? at::cat({Wr3, as3(W_i, E, I, O)}, 2) : Wr3;
    Tensor D = at::empty({E, 2 * N, C}, x.options());
    Tensor LK = at::empty({E, 2 * N, I}, x.options());
    Tensor grad_x = compute_grad_x ? at::empty(x.sizes(), x.options()) : empty_grad(x);
    Tensor grad_g = at::empty(g.sizes(), x.options());
    Tensor grad_W_r, grad_W_i;
    dispatch_float(x.scalar_type(), [&]<typename scalar_t>() {
      using T = scalar_t;
      const T ep = static_cast<T>(eps);
      const T *gyp = gy3.data_ptr<T>(), *yp = y3.data_ptr<T>(), *sp = s3.data_ptr<T>();
      const T *xp = x3.data_ptr<T>(), *lrp = lr3.data_ptr<T>(), *gp = gc.data_ptr<T>();
      T *dp = D.data_ptr<T>(), *lkp = LK.data_ptr<T>();
      at::parallel_for(0, E * N, grain_for(O * 4 + I * 2), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = r / N, n = r % N;
          T* dl = dp + (e * 2 * N + n) * C;
          T* dk = dp + (e * 2 * N + N + n) * C;
          for (int64_t o = 0; o < O; ++o) {
            T dU, dV;
            pm::npu_epilogue_backward(gyp[r * O + o], yp[r * O + o], sp[r * O + o], &dU, &dV);
            dl[o] = dU;
            dk[o] = dV;
            if (complex) {
              dl[O + o] = dV;
              dk[O + o] = -dU;
            }
          }
          // LK again: lr from the forward, k recomputed.
          T* L = lkp + (e * 2 * N + n) * I;
          T* K = lkp + (e * 2 * N + N + n) * I;
          const T* ge = gp + e * I;
#pragma omp simd
          for (int64_t i = 0; i < I; ++i) {
            L[i] = lrp[r * I + i];
            K[i] = pm::npu_k(xp[r * I + i], pm::npu_gate(ge[i]));
          }
        }
      });
      const Tensor dWc = at::bmm(LK.transpose(1, 2), D);  // (E, I, C)
      std::tie(grad_W_r, grad_W_i) = npu_weight_grads(dWc, W_r, x, complex);
      Tensor dLK = at::bmm(D, Wc.transpose(1, 2));  // (E, 2N, I): [dlr; dk]
      T* dlk = dLK.data_ptr<T>();
      T* gxp = compute_grad_x ? grad_x.data_ptr<T>() : nullptr;
      // Per element: dx into grad_x, dg (masked by the clamp) over dlr, then summed over rows.
      at::parallel_for(0, E * N, grain_for(I * 8), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = r / N, n = r % N;
          T* dL = dlk + (e * 2 * N + n) * I;
          const T* dK = dlk + (e * 2 * N + N + n) * I;
          const T* ge = gp + e * I;
          // dx goes to grad_x, or back over dK (read already) when grad_x was not asked for.
          T* dxo = gxp != nullptr ? gxp + r * I : dlk + (e * 2 * N + N + n) * I;
#pragma omp simd
          for (int64_t i = 0; i < I; ++i) {
            T dx, dg;
            pm::npu_prologue_backward(xp[r * I + i], pm::npu_gate(ge[i]), ep, dL[i], dK[i], &dx, &dg);
            dxo[i] = dx;
            dL[i] = pm::npu_gate_passes(ge[i]) ? dg : T(0);
          }
        }
      });
      // Rows [0, N) of each member hold dg: sum them (a (E, N, I) view with member stride 2 N I).
      const Tensor dg_part = dLK.narrow(1, 0, N).contiguous();
      column_sums<T>(dg_part.data_ptr<T>(), grad_g.data_ptr<T>(), E, N, I);
    });
    return {grad_x, grad_W_r, grad_W_i, grad_g};
  }

  // iNALU

  static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> inalu_forward(const LayerShape& s, const Tensor& x,
                                                                          const LayerParams& p, double eps,
                                                                          double omega) {
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O;
    const Tensor x3 = as3(x, E, N, I);
    const Tensor Gc = p.G.contiguous();
    Tensor lx = at::empty(x.sizes(), x.options());
    Tensor y = at::empty(s.out_sizes, x.options());
    Tensor msv = at::empty(s.out_sizes, x.options());
    Tensor a, u;
    dispatch_float(x.scalar_type(), [&]<typename scalar_t>() {
      using T = scalar_t;
      const T ep = static_cast<T>(eps), om = static_cast<T>(omega);
      const Tensor W = nac_weight_of<T>(p.W_hat, p.M_hat).reshape({E, I, O});
      const Tensor Wm = nac_weight_of<T>(p.W_hat_m, p.M_hat_m).reshape({E, I, O});
      const T* xp = x3.data_ptr<T>();
      T* lxp = lx.data_ptr<T>();
      at::parallel_for(0, x3.numel(), grain_for(32), [&](int64_t k0, int64_t k1) {
#pragma omp simd
        for (int64_t k = k0; k < k1; ++k) lxp[k] = pm::inalu_log(xp[k], ep);
      });
      a = at::bmm(x3, W).reshape(s.out_sizes);
      u = at::bmm(lx.reshape({E, N, I}), Wm).reshape(s.out_sizes);
      const T* ap = a.data_ptr<T>();
      const T* up = u.data_ptr<T>();
      const T* wmp = Wm.data_ptr<T>();
      const T* Gp = Gc.data_ptr<T>();
      T* yp = y.data_ptr<T>();
      T* mp = msv.data_ptr<T>();
      at::parallel_for(0, E * N, grain_for(I * O * 2), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t e = r / N;
          T* prod = mp + r * O;
          for (int64_t o = 0; o < O; ++o) prod[o] = T(1);
          const T* xr = xp + r * I;
          for (int64_t i = 0; i < I; ++i) {
            const T* w = wmp + (e * I + i) * O;
            for (int64_t o = 0; o < O; ++o) prod[o] *= pm::inalu_sign_factor(xr[i], w[o]);
          }
          for (int64_t o = 0; o < O; ++o) {
            const T g = pm::sigmoid(Gp[e * O + o]);
            yp[r * O + o] = pm::inalu_blend(ap[r * O + o], pm::inalu_m(up[r * O + o], om), prod[o], g);
          }
        }
      });
    });
    return {y, a, u, msv, lx};
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> inalu_backward(
      const LayerShape& s, const Tensor& grad_y, const Tensor& x, const LayerParams& p, const Tensor& a,
      const Tensor& u, const Tensor& msv, const Tensor& lx, double eps, double omega, bool compute_grad_x) {
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O;
    const Tensor x3 = as3(x, E, N, I), lx3 = as3(lx, E, N, I);
    const Tensor gy3 = as3(grad_y, E, N, O), a3 = as3(a, E, N, O), u3 = as3(u, E, N, O), msv3 = as3(msv, E, N, O);
    const Tensor Gc = p.G.contiguous();
    Tensor da = at::empty({E, N, O}, x.options()), du = at::empty({E, N, O}, x.options());
    Tensor dmsv = at::empty({E, N, O}, x.options()), dGp = at::empty({E, N, O}, x.options());
    Tensor grad_G = at::empty(p.G.sizes(), x.options());
    Tensor grad_x = empty_grad(x);
    Tensor gW, gM, gWm, gMm;
    dispatch_float(x.scalar_type(), [&]<typename scalar_t>() {
      using T = scalar_t;
      const T ep = static_cast<T>(eps), om = static_cast<T>(omega);
      const Tensor W = nac_weight_of<T>(p.W_hat, p.M_hat).reshape({E, I, O});
      const Tensor Wm = nac_weight_of<T>(p.W_hat_m, p.M_hat_m).reshape({E, I, O});
      const T *gyp = gy3.data_ptr<T>(), *ap = a3.data_ptr<T>(), *up = u3.data_ptr<T>(), *msp = msv3.data_ptr<T>();
      const T* Gp = Gc.data_ptr<T>();
      T *dap = da.data_ptr<T>(), *dup = du.data_ptr<T>(), *dmp = dmsv.data_ptr<T>(), *dgp = dGp.data_ptr<T>();
      at::parallel_for(0, E * N * O, grain_for(16), [&](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k) {
          const int64_t e = k / (N * O), o = k % O;
          pm::inalu_blend_backward(gyp[k], ap[k], up[k], msp[k], pm::sigmoid(Gp[e * O + o]), om, &dap[k], &dup[k],
                                   &dmp[k], &dgp[k]);
        }
      });
      column_sums<T>(dgp, grad_G.data_ptr<T>(), E, N, O);

      const Tensor dW = at::bmm(x3.transpose(1, 2), da);  // (E, I, O)
      Tensor dWm = at::bmm(lx3.transpose(1, 2), du);      // (E, I, O), plus the sign product's term:
      // per (e, o), over rows in order: dWm[i] += dmsv f'(x_i) prod_{k<i} f_k prod_{k>i} f_k.
      {
        const T* xp = x3.data_ptr<T>();
        const T* wmp = Wm.data_ptr<T>();
        T* dwmp = dWm.data_ptr<T>();
        at::parallel_for(0, E * O, grain_for(N * I * 4), [&](int64_t t0, int64_t t1) {
          std::vector<T> w(I), prefix(I), acc(I);
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t e = t / O, o = t % O;
            for (int64_t i = 0; i < I; ++i) {
              w[i] = wmp[(e * I + i) * O + o];
              acc[i] = T(0);
            }
            for (int64_t n = 0; n < N; ++n) {
              const T* xr = xp + (e * N + n) * I;
              const T d = dmp[(e * N + n) * O + o];
              T run = T(1);
              for (int64_t i = 0; i < I; ++i) {
                prefix[i] = run;
                run *= pm::inalu_sign_factor(xr[i], w[i]);
              }
              T suffix = T(1);
              for (int64_t i = I - 1; i >= 0; --i) {
                acc[i] += d * pm::inalu_sign_factor_grad(xr[i], w[i]) * (prefix[i] * suffix);
                suffix *= pm::inalu_sign_factor(xr[i], w[i]);
              }
            }
            for (int64_t i = 0; i < I; ++i) dwmp[(e * I + i) * O + o] += acc[i];
          }
        });
      }
      std::tie(gW, gM) = nac_weight_grads<T>(dW.reshape(p.W_hat.sizes()), p.W_hat, p.M_hat);
      std::tie(gWm, gMm) = nac_weight_grads<T>(dWm.reshape(p.W_hat_m.sizes()), p.W_hat_m, p.M_hat_m);

      if (compute_grad_x) {
        grad_x = at::bmm(da, W.transpose(1, 2));            // (E, N, I)
        const Tensor dlx = at::bmm(du, Wm.transpose(1, 2));  // (E, N, I)
        const T* xp = x3.data_ptr<T>();
        const T* dlp = dlx.data_ptr<T>();
        T* gxp = grad_x.data_ptr<T>();
        at::parallel_for(0, grad_x.numel(), grain_for(16), [&](int64_t k0, int64_t k1) {
#pragma omp simd
          for (int64_t k = k0; k < k1; ++k) gxp[k] += dlp[k] * pm::inalu_log_grad(xp[k], ep);
        });
        grad_x = grad_x.reshape(x.sizes());
      }
    });
    return {grad_x, gW, gM, gWm, gMm, grad_G};
  }
};

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) { PowerOps<cpu::Cpu>::register_kernels(m); }

}  // namespace nalu_cuda
