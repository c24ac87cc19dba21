// schema.cpp: the dispatcher ops of the experiments' native helpers (not layers: no autocast).
// flat_adam_step_resident, the resident Adam step of the experiments' FlatAdam: a CUDA kernel only
// (cuda/flat_adam_cuda.cpp). static_ensemble_grad and static_ensemble_step, the static task's whole
// training step in one call: CPU kernels (cpu/ensemble_step.cpp), and static_ensemble_grad also a CUDA
// kernel (cuda/ensemble_step_cuda.cpp: segments stays on the CPU there; the CUDA step is it and
// flat_adam_step_resident, native_step.py); recurrent_ensemble_grad and
// recurrent_ensemble_step (and recurrent_ensemble_step_drawn, the batch drawn in the call), the
// recurrent task's (cpu/recurrent_step.cpp); lstm_sequence_forward and lstm_sequence_backward, the
// sequence tasks' ensemble LSTM over a whole sequence (cpu/lstm_sequence.cpp). On any other device, or in a
// build without the kernel, the kernels below say so. The other helpers of this folder (cpu/: the
// fused Adam step on the CPU, the uniform fill) are no dispatcher ops: csrc/module.cpp binds them
// with pybind11.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "common/registration.h"

namespace nalu_cuda {
namespace {

constexpr const char* kSchemas[] = {
  // The resident Adam step of FlatAdam.step_resident (nalu_cuda/experiments/parts/optim.py), no clipping,
  // one learning rate: param, grad, exp_avg, exp_avg_sq are the flat buffers (n,); segments (P, 2) int64
  // rows (offset, per_member) of the (E, ...) parameters; frozen (E,) bool; step_t a float64 scalar, the
  // step count, incremented here. Members in frozen or with a NaN/Inf gradient take a zero gradient (grad
  // is zeroed there). Returns nonfinite (E,) bool. Nothing is read back to the host (CUDA-graph capturable).
  "flat_adam_step_resident(Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq,"
      " Tensor segments, Tensor frozen, Tensor(e!) step_t, float lr, float beta1, float beta2, float eps) -> Tensor",
  // The static task's training step without its optimiser step, for the two-layer ensemble models
  // 'nac' (NAC+ -> NAC+), 'nalu' (NALU -> NALU: tied weights, input gate, eps) and 'nmu' (NAU -> NMU,
  // with Madsen's sparsity regulariser at weight reg_weight; 0 for the others): x (E, B, I) and target
  // (E, B, 1) of one floating dtype; param and grad FlatAdam's flat buffers, segments its (P, 2) int64
  // rows (offset, per_member), in the layers' parameter order (NAC: W_hat, M_hat; NALU: W_hat, M_hat,
  // G; NAU, NMU: W), the hidden size read from them. Per member: the forward, the MSE (returned, (E,)
  // in x's dtype), diverged |= the objective (MSE + penalty) is not finite, and the gradient of the
  // objective written over the member's part of grad (zero upstream for a diverged member, as
  // train_ensemble's eager step). Members are split over the intra-op threads, each whole on one. On
  // CUDA (x on the GPU, segments a CPU tensor) one block per member, one launch, nothing read back.
  "static_ensemble_grad(Tensor x, Tensor target, Tensor param, Tensor(a!) grad, Tensor segments,"
      " Tensor(b!) diverged, str model, float eps, float reg_weight) -> Tensor",
  // static_ensemble_grad with the batch drawn in the kernel, CPU (cpu/ensemble_step.cpp) and CUDA
  // (cuda/ensemble_step_cuda.cpp) kernels, float32: member e = k S + s (S = keys.size(0) seeds, k < len(ops))
  // trains on CounterStream's batch (batch, I) of seed s at `step` (keys (S, 2) int64 and step, one
  // int64, on the device: nalu_cuda/experiments/parts/counter_stream.py, one interval [lo, hi)),
  // never stored: each input is computed where the kernel reads it; its targets op_k(a, b), a and
  // b the float64 sums of the inputs with masks (S, I, 2) columns 0 and 1 (codes as below). The
  // rest as static_ensemble_grad (segments on the CPU). Nothing read back: graph-capturable.
  "static_ensemble_grad_counter(Tensor keys, Tensor step, Tensor masks, int[] ops, float lo, float hi, int batch,"
      " Tensor param, Tensor(a!) grad, Tensor segments, Tensor(b!) diverged, str model, float eps,"
      " float reg_weight) -> Tensor",
  // static_ensemble_grad_counter on the CPU with the data step as an int (data_step), then the
  // optimiser's part of static_ensemble_step below (FlatAdam's fused CPU step, the flags, the NMU
  // model's projection): the static task's whole step in one call with --stream counter on the CPU.
  "static_ensemble_step_counter(Tensor keys, int data_step, Tensor masks, int[] ops, float lo, float hi, int batch,"
      " Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq, Tensor segments,"
      " Tensor(e!) diverged, bool freeze, str model, float eps, float reg_weight, float lr, float beta1,"
      " float beta2, float adam_eps, int step) -> Tensor",
  // static_ensemble_grad, then FlatAdam's fused CPU step (flat_adam_step, at step count `step`) with
  // frozen = diverged where `freeze` (train_ensemble's any_diverged) and freeze_nonfinite = freeze,
  // diverged |= the members whose gradient has a NaN or Inf, and for 'nmu' the projection (NAU W to
  // [-1, 1], NMU W to [0, 1]). One call is train_ensemble's eager step for these models.
  "static_ensemble_step(Tensor x, Tensor target, Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg,"
      " Tensor(d!) exp_avg_sq, Tensor segments, Tensor(e!) diverged, bool freeze, str model, float eps,"
      " float reg_weight, float lr, float beta1, float beta2, float adam_eps, int step) -> Tensor",
  // static_ensemble_step with the batch drawn in the call (float32; nothing of it is stored): member
  // e = k S + s (S = state.size(0) seeds, k < len(ops)) trains on the batch x I uniforms of seed s's
  // SFC64 generator (state row s: numpy's uint64 words viewed as int64; drawn once per seed for every
  // op), exactly the next batch of UniformStream for that seed (range [lo, hi); raw: [1, 2) itself),
  // and its targets op_k(a, b), a and b the float64 sums of the inputs with weights (S, I, 2) columns 0 and 1, op
  // codes 0 .. 5 = add, sub, mul, div, squared, root (SumTargets). state is advanced by one batch.
  "static_ensemble_step_drawn(Tensor(f!) state, Tensor weights, int[] ops, float lo, float hi, bool raw, int batch,"
      " Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq, Tensor segments,"
      " Tensor(e!) diverged, bool freeze, str model, float eps, float reg_weight, float lr, float beta1,"
      " float beta2, float adam_eps, int step) -> Tensor",
  // The recurrent task's training step without its optimiser step, for its models 'nac' (a NAC+ cell,
  // a NAC+ output layer) and 'nalu' (NALU cell and output layer: tied weights, input gate, no gate
  // bias, eps): h_s = cell(concat(x_s, h_{s-1})) for s = 1 .. len from the learned h_0, the output
  // layer on h_len (RecurrentNet). x (E, B, len, I) and target (E, B, 1) of one floating dtype; param
  // and grad FlatAdam's flat buffers, segments its (P, 2) int64 rows (offset, per_member) in
  // RecurrentNet's parameter order (h0 (E, 1, H), then the cell's and the output layer's: W_hat,
  // M_hat (, G)), the hidden size read from h0's row. Per member: the forward, the MSE (returned,
  // (E,) in x's dtype), diverged |= the MSE is not finite, and the gradient (through time) written
  // over the member's part of grad (zero upstream for a diverged member, as train_ensemble's eager
  // step). Members are split over the intra-op threads, each whole on one (cpu/recurrent_step.cpp).
  "recurrent_ensemble_grad(Tensor x, Tensor target, Tensor param, Tensor(a!) grad, Tensor segments,"
      " Tensor(b!) diverged, str model, float eps) -> Tensor",
  // recurrent_ensemble_grad, then FlatAdam's fused CPU step, as static_ensemble_step (frozen =
  // diverged where `freeze`, freeze_nonfinite = freeze, diverged |= a NaN or Inf in the gradient).
  "recurrent_ensemble_step(Tensor x, Tensor target, Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg,"
      " Tensor(d!) exp_avg_sq, Tensor segments, Tensor(e!) diverged, bool freeze, str model, float eps,"
      " float lr, float beta1, float beta2, float adam_eps, int step) -> Tensor",
  // recurrent_ensemble_step with the batch drawn in the call (float32; nothing of it is stored): seed
  // s (S = state.size(0), state row s: numpy's SFC64 uint64 words viewed as int64) draws batch x length
  // x I uniforms once, exactly UniformStream's next (batch, length, I) batch for that seed (range
  // [lo, hi); raw: [1, 2) itself), and member e = k S + s (k < len(ops)) trains on it with targets
  // op_k(a, b), a and b the float64 sums over the steps of the inputs with weights (S, I, 2) columns
  // 0 and 1, op codes 0 .. 5 = add, sub, mul, div, squared, root (SumTargets). batch * length * I
  // must be even; state is advanced by one batch.
  "recurrent_ensemble_step_drawn(Tensor(f!) state, Tensor weights, int[] ops, float lo, float hi, bool raw,"
      " int batch, int length, Tensor(a!) param, Tensor(b!) grad, Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq,"
      " Tensor segments, Tensor(e!) diverged, bool freeze, str model, float eps, float lr, float beta1,"
      " float beta2, float adam_eps, int step) -> Tensor",
  // The sequence tasks' ensemble LSTM (PyTorch's gate equations, gates i, f, g, o) over a whole
  // unmasked sequence from zero states: xs (T, E, B, 4H) the projected inputs, time first, and W
  // (E, H, 4H) the state weights, one floating dtype; z_t = xs[t] + h_{t-1} W per member. Returns
  // hs (T, E, B, H), the state after every step, and saved (T, E, B, 6H) the rows [i f g o | c |
  // tanh(c)] of every step that the backward reads (zero steps when save is False).
  "lstm_sequence_forward(Tensor xs, Tensor W, bool save) -> (Tensor, Tensor)",
  // Its backward from grad_hs (hs's shape), W and the forward's hs and saved: (grad_xs, grad_W).
  "lstm_sequence_backward(Tensor grad_hs, Tensor W, Tensor hs, Tensor saved) -> (Tensor, Tensor)",
};

}  // namespace
}  // namespace nalu_cuda

NALU_CUDA_OP_FAMILY(experiments, kTraining, nalu_cuda::kSchemas)

namespace {

// Every device without a kernel of flat_adam_step_resident (any but CUDA; every one in a build
// without CUDA kernels): a clear error instead of the dispatcher's.
at::Tensor flat_adam_step_resident_unsupported(const at::Tensor& param, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, double, double, double) {
#ifdef NALU_CUDA_WITH_CUDA
  const char* build = "";
#else
  const char* build = " (and this build of nalu_cuda has no CUDA kernels: it was built without CUDA)";
#endif
  TORCH_CHECK(false, "flat_adam_step_resident: argument 'param' must be a CUDA tensor, got ",
              param.defined() ? c10::str("a tensor on ", param.device()) : std::string("an undefined tensor"),
              build, "; the fused step on the CPU is nalu_cuda._C.flat_adam_step");
}

// The static and recurrent steps' ops on any device but the CPU (every argument on the CPU is needed): a clear
// error naming the op and the arguments that are elsewhere.
// `other`: what runs instead on other devices.
[[noreturn]] void static_step_unsupported(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> args,
                                          const char* other = "the CUDA training step is train_ensemble's resident step") {
  std::string where;
  for (const auto& [name, t] : args)
    if (t->defined() && !t->device().is_cpu()) where += c10::str(where.empty() ? "" : ", ", "'", name, "' on ", t->device());
  TORCH_CHECK(false, op, ": every tensor argument must be a CPU tensor (this op has CPU kernels only; ", other,
              "), got ", where.empty() ? std::string("none on the CPU") : where);
}

at::Tensor static_ensemble_grad_unsupported(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                            const at::Tensor& grad, const at::Tensor& segments,
                                            const at::Tensor& diverged, c10::string_view, double, double) {
  TORCH_CHECK(false, "static_ensemble_grad: the tensor arguments must all be CPU tensors (the CPU kernel), or x, "
              "target, param, grad and diverged CUDA tensors with segments on the CPU (the CUDA kernel), got x on ",
              x.device(), ", target on ", target.device(), ", param on ", param.device(), ", grad on ", grad.device(),
              ", segments on ", segments.device(), ", diverged on ", diverged.device(),
#ifdef NALU_CUDA_WITH_CUDA
              ""
#else
              " (and this build of nalu_cuda has no CUDA kernels: it was built without CUDA)"
#endif
  );
}

at::Tensor static_ensemble_grad_counter_unsupported(const at::Tensor& keys, const at::Tensor& step,
                                                    const at::Tensor& masks, at::IntArrayRef, double, double, int64_t,
                                                    const at::Tensor& param, const at::Tensor& grad,
                                                    const at::Tensor& segments, const at::Tensor& diverged,
                                                    c10::string_view, double, double) {
  TORCH_CHECK(false, "static_ensemble_grad_counter: the tensor arguments must all be CPU tensors (the CPU kernel), "
              "or all CUDA tensors on one device but segments, on the CPU (the CUDA kernel), got keys on ",
              keys.device(), ", step on ", step.device(), ", masks on ", masks.device(), ", param on ", param.device(),
              ", grad on ", grad.device(), ", segments on ", segments.device(), ", diverged on ", diverged.device(),
#ifdef NALU_CUDA_WITH_CUDA
              ""
#else
              " (and this build of nalu_cuda has no CUDA kernels: it was built without CUDA)"
#endif
  );
}

at::Tensor static_ensemble_step_unsupported(const at::Tensor& x, const at::Tensor& target, const at::Tensor& param,
                                            const at::Tensor& grad, const at::Tensor& exp_avg,
                                            const at::Tensor& exp_avg_sq, const at::Tensor& segments,
                                            const at::Tensor& diverged, bool, c10::string_view, double, double,
                                            double, double, double, double, int64_t) {
  static_step_unsupported("static_ensemble_step", {{"x", &x}, {"target", &target}, {"param", &param},
                          {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq},
                          {"segments", &segments}, {"diverged", &diverged}});
}

// (the in-call draw's op: its tensors first, then the step's, named as its schema names them)
using TensorArg = const at::Tensor&;
at::Tensor static_ensemble_step_drawn_unsupported(TensorArg state, TensorArg weights, at::IntArrayRef, double, double, bool,
    int64_t, TensorArg param, TensorArg grad, TensorArg m1, TensorArg m2, TensorArg segments, TensorArg diverged, bool,
    c10::string_view, double, double, double, double, double, double, int64_t) {
  static_step_unsupported("static_ensemble_step_drawn", {{"state", &state}, {"weights", &weights}, {"param", &param},
      {"grad", &grad}, {"exp_avg", &m1}, {"exp_avg_sq", &m2}, {"segments", &segments}, {"diverged", &diverged}});
}

at::Tensor static_ensemble_step_counter_unsupported(TensorArg keys, int64_t, TensorArg masks, at::IntArrayRef, double,
    double, int64_t, TensorArg param, TensorArg grad, TensorArg m1, TensorArg m2, TensorArg segments,
    TensorArg diverged, bool, c10::string_view, double, double, double, double, double, double, int64_t) {
  static_step_unsupported("static_ensemble_step_counter", {{"keys", &keys}, {"masks", &masks}, {"param", &param},
      {"grad", &grad}, {"exp_avg", &m1}, {"exp_avg_sq", &m2}, {"segments", &segments}, {"diverged", &diverged}},
      "on CUDA the static task's step with --stream counter is static_ensemble_grad_counter's kernel, then "
      "FlatAdam's resident step");
}

at::Tensor recurrent_ensemble_grad_unsupported(TensorArg x, TensorArg target, TensorArg param, TensorArg grad,
                                               TensorArg segments, TensorArg diverged, c10::string_view, double) {
  static_step_unsupported("recurrent_ensemble_grad", {{"x", &x}, {"target", &target}, {"param", &param},
                          {"grad", &grad}, {"segments", &segments}, {"diverged", &diverged}});
}

at::Tensor recurrent_ensemble_step_unsupported(TensorArg x, TensorArg target, TensorArg param, TensorArg grad,
    TensorArg m1, TensorArg m2, TensorArg segments, TensorArg diverged, bool, c10::string_view, double, double, double,
    double, double, int64_t) {
  static_step_unsupported("recurrent_ensemble_step", {{"x", &x}, {"target", &target}, {"param", &param},
      {"grad", &grad}, {"exp_avg", &m1}, {"exp_avg_sq", &m2}, {"segments", &segments}, {"diverged", &diverged}});
}

at::Tensor recurrent_ensemble_step_drawn_unsupported(TensorArg state, TensorArg weights, at::IntArrayRef, double, double,
    bool, int64_t, int64_t, TensorArg param, TensorArg grad, TensorArg m1, TensorArg m2, TensorArg segments,
    TensorArg diverged, bool, c10::string_view, double, double, double, double, double, int64_t) {
  static_step_unsupported("recurrent_ensemble_step_drawn", {{"state", &state}, {"weights", &weights},
      {"param", &param}, {"grad", &grad}, {"exp_avg", &m1}, {"exp_avg_sq", &m2}, {"segments", &segments},
      {"diverged", &diverged}});
}

// The ensemble LSTM's ops on any device but the CPU.
constexpr const char* kLstmElsewhere = "on other devices EnsembleLSTM runs its torch version, _LSTMSequence";
std::tuple<at::Tensor, at::Tensor> lstm_sequence_forward_unsupported(TensorArg xs, TensorArg W, bool) {
  static_step_unsupported("lstm_sequence_forward", {{"xs", &xs}, {"W", &W}}, kLstmElsewhere);
}

std::tuple<at::Tensor, at::Tensor> lstm_sequence_backward_unsupported(TensorArg grad_hs, TensorArg W, TensorArg hs,
                                                                      TensorArg saved) {
  static_step_unsupported("lstm_sequence_backward", {{"grad_hs", &grad_hs}, {"W", &W}, {"hs", &hs}, {"saved", &saved}},
                          kLstmElsewhere);
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, CompositeExplicitAutograd, m) {
  m.impl("flat_adam_step_resident", &flat_adam_step_resident_unsupported);
  m.impl("static_ensemble_grad", &static_ensemble_grad_unsupported);
  m.impl("static_ensemble_grad_counter", &static_ensemble_grad_counter_unsupported);
  m.impl("static_ensemble_step", &static_ensemble_step_unsupported);
  m.impl("static_ensemble_step_drawn", &static_ensemble_step_drawn_unsupported);
  m.impl("static_ensemble_step_counter", &static_ensemble_step_counter_unsupported);
  m.impl("recurrent_ensemble_grad", &recurrent_ensemble_grad_unsupported);
  m.impl("recurrent_ensemble_step", &recurrent_ensemble_step_unsupported);
  m.impl("recurrent_ensemble_step_drawn", &recurrent_ensemble_step_drawn_unsupported);
  m.impl("lstm_sequence_forward", &lstm_sequence_forward_unsupported);
  m.impl("lstm_sequence_backward", &lstm_sequence_backward_unsupported);
}
