// lstm_sequence.cpp: the CPU kernels of lstm_sequence_forward and lstm_sequence_backward (schemas
// and contract: csrc/experiments/schema.cpp), the sequence tasks' ensemble LSTM over a whole
// unmasked sequence in one call each way (nalu_cuda.experiments.parts.sequence_models.EnsembleLSTM;
// its step-by-step torch version, _LSTMSequence there, is the reference the tests compare with).
// Per step: the product with the state weights for every member at once (ATen's baddbmm, BLAS),
// then ATen's sigmoid over the step's gates (vectorised), then one pass over the rows for the
// gates, the cell and the output
// (lstm_sequence_kernels.h), members split over the intra-op threads; the backward the same way
// back through time (one elementwise pass, then the weights' and the state's products).
#include "experiments/cpu/step_common.h"

#include "common/cpu/isa.h"
#include "common/math.h"
#include "experiments/cpu/fp_contract.h"
#include "ops/nac_nalu/math.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

// One rounding per operation, as in the training steps' kernels: no contraction into FMA.
NALU_FP_CONTRACT_OFF

namespace nalu_cuda {
namespace training {

// The sizes of one call: T steps, E members, B rows, H hidden units (4H gates).
struct LstmShape {
  int64_t T, E, B, H;
  int64_t G() const { return 4 * H; }
  // the offset of row b of member e at step t in a (T, E, B, width) tensor
  int64_t row(int64_t t, int64_t e, int64_t b, int64_t width) const { return ((t * E + e) * B + b) * width; }
};

// The per-member kernels, once per instruction set (the ops pick one: NALU_STEP_PER_ISA).
#define NALU_STEP_KERNELS "experiments/cpu/lstm_sequence_kernels.h"
#include "experiments/cpu/step_kernels_per_isa.h"

namespace {

bool floating(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

// xs (T, E, B, 4H) and W (E, H, 4H), float32 or float64, one dtype, contiguous CPU tensors.
LstmShape check_inputs(const char* op, const at::Tensor& xs, const at::Tensor& W) {
  check_cpu_tensor(op, "xs", xs, "a contiguous float32 or float64 CPU tensor of shape [T, E, B, 4 H] (the projected "
                   "inputs, time first)", floating(xs) && xs.dim() == 4);
  check_cpu_tensor(op, "W", W, c10::str("a contiguous CPU tensor of xs's dtype (", xs.scalar_type(), ") of shape [E, H, "
                   "4 H] (the state weights) with E = xs.size(1) = ", xs.size(1), " and 4 H = xs.size(3) = ", xs.size(3)),
                   W.defined() && W.scalar_type() == xs.scalar_type() && W.dim() == 3 && W.size(0) == xs.size(1) &&
                       W.size(2) == 4 * W.size(1) && W.size(2) == xs.size(3));
  const LstmShape s{xs.size(0), xs.size(1), xs.size(2), W.size(1)};
  TORCH_CHECK(s.T >= 1 && s.E >= 1 && s.B >= 1 && s.H >= 1, op, ": arguments 'xs' and 'W' must have at least one "
              "element along every dimension, got xs of shape ", xs.sizes(), " and W of shape ", W.sizes());
  return s;
}

// The gates' scale in the activation pass: 1 for the sigmoid gates i, f, o; 2 for the cell gate g.
template <typename T>
std::vector<T> gate_scale(int64_t H) {
  std::vector<T> scale(4 * H, T(1));
  std::fill(scale.begin() + 2 * H, scale.begin() + 3 * H, T(2));
  return scale;
}

std::tuple<at::Tensor, at::Tensor> lstm_sequence_forward(const at::Tensor& xs, const at::Tensor& W, bool save) {
  constexpr const char* kOp = "lstm_sequence_forward";
  const LstmShape s = check_inputs(kOp, xs, W);
  at::Tensor hs = at::empty({s.T, s.E, s.B, s.H}, xs.options());
  at::Tensor saved = at::empty({save ? s.T : 1, s.E, s.B, 6 * s.H}, xs.options());  // (one step's scratch without save)
  at::Tensor z = at::empty({s.E, s.B, s.G()}, xs.options());
  at::Tensor c = at::zeros({s.E, s.B, s.H}, xs.options());  // the cell states, zero before the first step
  AT_DISPATCH_FLOATING_TYPES(xs.scalar_type(), kOp, [&] {
    const std::vector<scalar_t> scale = gate_scale<scalar_t>(s.H);
    for (int64_t t = 0; t < s.T; ++t) {
      if (t > 0) at::baddbmm_out(z, xs[t], hs[t - 1], W);  // z = x_t + h_{t-1} W, every member
      else z.copy_(xs[0]);
      z.narrow(2, 2 * s.H, s.H).mul_(2);  // the cell gate's block at 2 z (exact)
      at::sigmoid_(z);
      const scalar_t* zp = z.const_data_ptr<scalar_t>();
      scalar_t* act = saved[save ? t : 0].data_ptr<scalar_t>();
      scalar_t* h = hs[t].data_ptr<scalar_t>();
      scalar_t* cp = c.data_ptr<scalar_t>();
      at::parallel_for(0, s.E, 1, [&](int64_t e0, int64_t e1) {
        auto run = [&](auto step) { step(s.H, s.B, e0, e1, zp, scale.data(), act, cp, h); };
        NALU_STEP_PER_ISA(run, lstm_forward_step<scalar_t>);
      });
    }
  });
  if (!save) saved = saved.narrow(0, 0, 0);  // the API's empty second result, without a new allocation
  return {hs, saved};
}

std::tuple<at::Tensor, at::Tensor> lstm_sequence_backward(const at::Tensor& grad_hs, const at::Tensor& W,
                                                          const at::Tensor& hs, const at::Tensor& saved) {
  constexpr const char* kOp = "lstm_sequence_backward";
  check_cpu_tensor(kOp, "hs", hs, "a contiguous float32 or float64 CPU tensor of shape [T, E, B, H] (the forward's "
                   "first result)", floating(hs) && hs.dim() == 4);
  check_cpu_tensor(kOp, "W", W, c10::str("a contiguous CPU tensor of hs's dtype (", hs.scalar_type(), ") of shape [",
                   hs.size(1), ", ", hs.size(3), ", ", 4 * hs.size(3), "] (the state weights)"),
                   W.defined() && W.scalar_type() == hs.scalar_type() && W.dim() == 3 && W.size(0) == hs.size(1) &&
                       W.size(1) == hs.size(3) && W.size(2) == 4 * hs.size(3));
  const LstmShape s{hs.size(0), hs.size(1), hs.size(2), hs.size(3)};
  TORCH_CHECK(s.T >= 1 && s.E >= 1 && s.B >= 1 && s.H >= 1, kOp, ": argument 'hs' must have at least one element along "
              "every dimension, got shape ", hs.sizes());
  const std::string like = c10::str("a contiguous CPU tensor of hs's dtype (", hs.scalar_type(), ") of shape [", s.T, ", ",
                                    s.E, ", ", s.B, ", ");
  check_cpu_tensor(kOp, "grad_hs", grad_hs, like + c10::str(s.H, "] (hs's shape)"),
                   grad_hs.defined() && grad_hs.scalar_type() == hs.scalar_type() && grad_hs.sizes() == hs.sizes());
  check_cpu_tensor(kOp, "saved", saved, like + c10::str(6 * s.H, "] (the forward's second result, run with save=True)"),
                   saved.defined() && saved.scalar_type() == hs.scalar_type() && saved.dim() == 4 &&
                       saved.size(0) == s.T && saved.size(1) == s.E && saved.size(2) == s.B && saved.size(3) == 6 * s.H);
  at::Tensor dxs = at::empty({s.T, s.E, s.B, s.G()}, hs.options());
  at::Tensor dW = at::zeros({s.E, s.H, s.G()}, hs.options());
  at::Tensor dh = at::zeros({s.E, s.B, s.H}, hs.options());  // carried from step t + 1 to step t
  at::Tensor dc = at::zeros({s.E, s.B, s.H}, hs.options());
  const at::Tensor Wt = W.transpose(1, 2);
  AT_DISPATCH_FLOATING_TYPES(hs.scalar_type(), kOp, [&] {
    for (int64_t t = s.T - 1; t >= 0; --t) {
      const scalar_t* dho = grad_hs[t].const_data_ptr<scalar_t>();
      const scalar_t* dhc = dh.const_data_ptr<scalar_t>();
      const scalar_t* sv = saved[t].const_data_ptr<scalar_t>();
      const scalar_t* svp = t > 0 ? saved[t - 1].const_data_ptr<scalar_t>() : nullptr;
      scalar_t* dz = dxs[t].data_ptr<scalar_t>();
      scalar_t* dcp = dc.data_ptr<scalar_t>();
      at::parallel_for(0, s.E, 1, [&](int64_t e0, int64_t e1) {
        auto run = [&](auto step) { step(s.H, s.B, e0, e1, dho, dhc, sv, svp, dz, dcp); };
        NALU_STEP_PER_ISA(run, lstm_backward_step<scalar_t>);
      });
      if (t > 0) {
        dW.baddbmm_(hs[t - 1].transpose(1, 2), dxs[t]);  // dW += h_{t-1}^T dz_t
        at::bmm_out(dh, dxs[t], Wt);                      // dh_{t-1} = dz_t W^T
      }
    }
  });
  return {dxs, dW};
}

}  // namespace
}  // namespace training
}  // namespace nalu_cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CPU, m) {
  m.impl("lstm_sequence_forward", &nalu_cuda::training::lstm_sequence_forward);
  m.impl("lstm_sequence_backward", &nalu_cuda::training::lstm_sequence_backward);
}
