// flat_adam.h: one Adam step over the flat parameter buffers of an ensemble
// (nalu_cuda.experiments.training.FlatAdam), with the per-member divergence bookkeeping of its
// training loop, in one pass instead of a dozen tensor ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace nalu_cuda {
namespace training {

// param, grad, exp_avg, exp_avg_sq: contiguous 1-D CPU tensors of one floating dtype and size n.
// segments: int64 (P, 2); row p = (offset, per_member): elements [offset, offset + E * per_member)
//   are one parameter of shape (E, ...), member e's part the e-th run of per_member elements.
// frozen: bool (E,); a frozen member's gradient counts as zero (its moments decay, it does not move
//   once they are reset); with freeze_nonfinite, so does that of a member whose gradient has a NaN
//   or Inf in this step.
// lr_member: optional float64 (E,), one learning rate per member instead of lr.
// clip > 0: each member's gradient, over every segment, is rescaled by min(1, clip / (norm +
//   1e-12)) (the norm from the float64 sum of squares; the factor rounded to the gradient's dtype)
//   before the update, as FlatAdam.clip_grad_norm_ does; grad itself is not changed.
// Returns bool (E,): whether member e's gradient has a NaN or Inf anywhere (before freezing).
//
// The update is torch.optim.Adam's (no weight decay, no amsgrad), with the step `step` (>= 1):
//   m = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g g;
//   p = p - (lr / (1 - beta1^step)) m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// each operation rounded in the tensors' dtype (the division by sqrt(1 - beta2^step) as a product
// with its reciprocal, computed in double: within an ulp of torch's); every element is computed the same way wherever it
// sits in the buffer (no fused multiply-add in a vector body and not in its remainder), so member
// e of an ensemble gets exactly the update a one-member run gets. Members are split over the intra-op
// threads where the buffers are large enough (each member whole on one thread): the same bits for
// any number of threads.
at::Tensor flat_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& segments, const at::Tensor& frozen,
                          bool freeze_nonfinite, double lr, double beta1, double beta2, double eps, int64_t step,
                          const c10::optional<at::Tensor>& lr_member = c10::nullopt, double clip = 0.0);

}  // namespace training
}  // namespace nalu_cuda
