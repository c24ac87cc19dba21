// module.cpp: the Python module nalu_cuda._C. Importing it loads this library, whose static
// initialisers register the ops with the dispatcher (reached as torch.ops.nalu_cuda.*).
//
// It also binds the forward ops directly with pybind11, for eager calls from nalu_cuda.functional:
// each binding makes the same typed call into the dispatcher that torch.ops does (so autograd,
// autocast and every device's kernel apply), but skips torch.ops' generic per-call argument
// parsing, which costs more than the whole fused forward at the paper's layer sizes. torch.compile
// must see the ops themselves, so functional.py uses torch.ops while compiling.
#include <torch/python.h>  // pybind11 and the tensor casters; not torch/extension.h (all of libtorch's C++ API: twice the compile time)

#include <tuple>

#include "common/registration.h"  // find_op
#include "experiments/cpu/flat_adam.h"
#include "experiments/cpu/uniform_fill.h"

#ifndef NALU_CUDA_VERSION
#define NALU_CUDA_VERSION "unknown"
#endif

namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

using nalu_cuda::find_op;

Tensor nac_weight(const Tensor& W_hat, const Tensor& M_hat) {
  static auto op = find_op<Tensor(const Tensor&, const Tensor&)>("nalu_cuda::nac_weight");
  return op.call(W_hat, M_hat);
}

Tensor nac(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat) {
  static auto op = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("nalu_cuda::nac_forward");
  return op.call(x, W_hat, M_hat);
}

Tensor nac_mul(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, double eps) {
  static auto op = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
      "nalu_cuda::nac_mul_forward");
  return std::get<0>(op.call(x, W_hat, M_hat, eps));
}

using NaluOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;  // y, a, m, g, lx, r

NaluOutputs nalu_forward(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m,
                         const OptTensor& M_hat_m, const Tensor& G, double eps, bool input_gate,
                         const OptTensor& G_bias, bool gate_regularizer = false) {
  static auto op = find_op<NaluOutputs(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                       const Tensor&, double, bool, const OptTensor&, bool)>("nalu_cuda::nalu_forward");
  return op.call(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias, gate_regularizer);
}

Tensor nalu(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m,
            const OptTensor& M_hat_m, const Tensor& G, double eps, bool input_gate, const OptTensor& G_bias) {
  return std::get<0>(nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias));
}

Tensor nalu_gate_regularizer(const Tensor& g, bool per_member) {
  static auto op = find_op<Tensor(const Tensor&, bool)>("nalu_cuda::nalu_gate_regularizer");
  return op.call(g, per_member);
}

// The same call returning (y, a, m, g), all differentiable: functional.nalu_parts.
std::tuple<Tensor, Tensor, Tensor, Tensor> nalu_parts(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                                                      const OptTensor& W_hat_m, const OptTensor& M_hat_m,
                                                      const Tensor& G, double eps, bool input_gate,
                                                      const OptTensor& G_bias) {
  auto [y, a, m, g, lx, r] = nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias);
  return {y, a, m, g};
}

// The same call with the gate regulariser sum(g^2 (1 - g)^2) of its gate: (y, a, m, g, r), one
// autograd node (functional.nalu_parts(..., gate_regularizer=True)).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> nalu_parts_regularized(
    const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m, const OptTensor& M_hat_m,
    const Tensor& G, double eps, bool input_gate, const OptTensor& G_bias) {
  auto [y, a, m, g, lx, r] = nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias, true);
  return {y, a, m, g, r};
}

// NAU and NMU: y = op(x, W).
Tensor nau(const Tensor& x, const Tensor& W) {
  static auto op = find_op<Tensor(const Tensor&, const Tensor&)>("nalu_cuda::nau_forward");
  return op.call(x, W);
}

Tensor nmu(const Tensor& x, const Tensor& W) {
  static auto op = find_op<Tensor(const Tensor&, const Tensor&)>("nalu_cuda::nmu_forward");
  return op.call(x, W);
}

// The resident Adam step of FlatAdam (the op nalu_cuda::flat_adam_step_resident: a CUDA kernel,
// csrc/experiments/cuda/flat_adam_cuda.cpp), through the dispatcher like the layers above.
Tensor flat_adam_step_resident(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                               const Tensor& exp_avg_sq, const Tensor& segments, const Tensor& frozen,
                               const Tensor& step_t, double lr, double beta1, double beta2, double eps) {
  static auto op = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, double, double, double, double)>(
      "nalu_cuda::flat_adam_step_resident");
  return op.call(param, grad, exp_avg, exp_avg_sq, segments, frozen, step_t, lr, beta1, beta2, eps);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "nalu_cuda native ops (registered as torch.ops.nalu_cuda.*) and fast eager entry points";
  m.def("build_info", []() {
    pybind11::dict info;
    info["version"] = NALU_CUDA_VERSION;
#ifdef _OPENMP
    info["openmp"] = true;
#else
    info["openmp"] = false;
#endif
#ifdef NALU_CUDA_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    return info;
  });
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  // Each returns the op's first result (y; nalu_parts: y, a, m, g; nalu_parts_regularized: y, a, m, g and the
  // gate regulariser); the others are saved for backward by autograd.
  m.def("nac_weight", &nac_weight, release());
  m.def("nac", &nac, release());
  m.def("nac_mul", &nac_mul, release());
  // nalu, nalu_parts: (x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias=None)
  const auto nalu_args = std::make_tuple(
      pybind11::arg("x"), pybind11::arg("W_hat"), pybind11::arg("M_hat"), pybind11::arg("W_hat_m"),
      pybind11::arg("M_hat_m"), pybind11::arg("G"), pybind11::arg("eps"), pybind11::arg("input_gate"),
      pybind11::arg("G_bias") = pybind11::none());
  std::apply([&](auto... a) { m.def("nalu", &nalu, release(), a...); }, nalu_args);
  std::apply([&](auto... a) { m.def("nalu_parts", &nalu_parts, release(), a...); }, nalu_args);
  std::apply([&](auto... a) { m.def("nalu_parts_regularized", &nalu_parts_regularized, release(), a...); }, nalu_args);
  m.def("nalu_gate_regularizer", &nalu_gate_regularizer, release(), pybind11::arg("g"),
        pybind11::arg("per_member") = false);
  m.def("nau", &nau, release());
  m.def("nmu", &nmu, release());
  // The training data of nalu_cuda.experiments.arithmetic.UniformStream (csrc/experiments/cpu/uniform_fill.h).
  m.def("sfc64_uniform_fill", &nalu_cuda::training::sfc64_uniform_fill, release(), pybind11::arg("state"),
        pybind11::arg("out"), pybind11::arg("lo"), pybind11::arg("hi"), pybind11::arg("raw") = false,
        pybind11::arg("weights") = pybind11::none(), pybind11::arg("sums") = pybind11::none(),
        "Fill out (rows, n), or (rows, G, n) for a state (G, 4), with numpy SFC64 float32 uniforms in "
        "[lo, hi) ([1, 2) when raw), advancing the int64 state(s) in place; with weights (G, seg, K) and "
        "sums (rows, G, n / seg, K), both float64, also the weighted sums of each segment of seg values.");
  // One Adam step of nalu_cuda.experiments.training.FlatAdam (csrc/experiments/cpu/flat_adam.h).
  m.def("flat_adam_step", &nalu_cuda::training::flat_adam_step, release(), pybind11::arg("param"), pybind11::arg("grad"),
        pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"), pybind11::arg("segments"), pybind11::arg("frozen"),
        pybind11::arg("freeze_nonfinite"), pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("step"),
        pybind11::arg("lr_member") = pybind11::none(), pybind11::arg("clip") = 0.0,
        "Adam on flat CPU buffers of an ensemble's (E, ...) parameters, members frozen where `frozen` (and, with "
        "freeze_nonfinite, where their gradient has a NaN or Inf); lr_member (E,) float64: a learning rate per "
        "member; clip > 0: each member's gradient norm clipped to it first; returns which members' gradients have "
        "a NaN or Inf.");
  // Its resident variant on CUDA (FlatAdam.step_resident): no host read, the step count a device tensor.
  m.def("flat_adam_step_resident", &flat_adam_step_resident, release(), pybind11::arg("param"),
        pybind11::arg("grad"), pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"), pybind11::arg("segments"),
        pybind11::arg("frozen"), pybind11::arg("step_t"), pybind11::arg("lr"), pybind11::arg("beta1"),
        pybind11::arg("beta2"), pybind11::arg("eps"),
        "Adam on flat CUDA buffers of an ensemble's (E, ...) parameters (segments (P, 2) int64 on the device), "
        "members with a NaN/Inf gradient or in `frozen` taking a zero gradient, the step count step_t (float64, "
        "on the device) incremented; returns which members' gradients have a NaN or Inf, without a host read.");
}
