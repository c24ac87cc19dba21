// checks.cpp: the NAC/NALU ops' argument checks, shared by the CPU and CUDA kernels (checks.h);
// made of the pieces of csrc/common/checks.h.
#include "ops/nac_nalu/checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace nalu_cuda {

void check_weight_pair(const char* op, const at::Tensor& W_hat, const at::Tensor& M_hat,
                       const char* w_name, const char* m_name, bool layer_shape) {
  check_floating(op, w_name, W_hat);
  check_floating(op, m_name, M_hat);
  TORCH_CHECK(!layer_shape || W_hat.dim() == 2 || W_hat.dim() == 3, op, ": argument '", w_name,
              "' must have shape (in, out) or (E, in, out), got ", sizes_str(W_hat.sizes()));
  TORCH_CHECK(M_hat.sizes() == W_hat.sizes(), op, ": argument '", m_name,
              "' must have the shape of '", w_name, "' ", sizes_str(W_hat.sizes()), ", got ",
              sizes_str(M_hat.sizes()));
  check_matches(op, m_name, M_hat, w_name, W_hat);
}

namespace {

// Checks that `t` (argument `name`, `what` it is) has one value per output: shape (out,), or
// (E, out) for an ensemble.
void check_per_output(const char* op, const char* name, const char* what, const at::Tensor& t, const LayerShape& s) {
  std::vector<int64_t> want = s.ensemble ? std::vector<int64_t>{s.E, s.O} : std::vector<int64_t>{s.O};
  TORCH_CHECK(t.sizes() == at::IntArrayRef(want), op, ": argument '", name, "'", what, " must have shape ",
              s.ensemble ? "(E, out) = " : "(out,) = ", sizes_str(want), ", got ", sizes_str(t.sizes()));
}

}  // namespace

LayerShape check_layer(const char* op, const LayerKind& kind, const at::Tensor& x,
                       const LayerParams& p, double eps) {
  check_floating(op, "x", x);
  check_weight_pair(op, p.W_hat, p.M_hat);
  check_matches(op, "W_hat", p.W_hat, "x", x);

  const LayerShape s = layer_shape(op, x, p.W_hat, "W_hat");

  if (kind.mul && kind.add && !kind.tied) {
    TORCH_CHECK(p.W_hat_m.defined() && p.M_hat_m.defined(), op,
                ": separate multiplicative weights need both 'W_hat_m' and 'M_hat_m', got ",
                p.W_hat_m.defined() ? "only 'W_hat_m'" : (p.M_hat_m.defined() ? "only 'M_hat_m'" : "neither"));
    check_weight_pair(op, p.W_hat_m, p.M_hat_m, "W_hat_m", "M_hat_m");
    TORCH_CHECK(p.W_hat_m.sizes() == p.W_hat.sizes(), op,
                ": argument 'W_hat_m' must have the shape of 'W_hat' ", sizes_str(p.W_hat.sizes()),
                ", got ", sizes_str(p.W_hat_m.sizes()));
    check_matches(op, "W_hat_m", p.W_hat_m, "x", x);
  }
  if (kind.gate != Gate::kNone) {
    check_floating(op, "G", p.G);
    check_matches(op, "G", p.G, "x", x);
    if (kind.gate == Gate::kInput) {
      TORCH_CHECK(p.G.sizes() == p.W_hat.sizes(), op,
                  ": argument 'G' of an input-dependent gate must have the shape of 'W_hat' ",
                  sizes_str(p.W_hat.sizes()), ", got ", sizes_str(p.G.sizes()));
    } else {
      check_per_output(op, "G", " of an input-independent gate", p.G, s);
    }
  }
  if (p.G_bias.defined()) {
    TORCH_CHECK(kind.gate == Gate::kInput, op,
                ": argument 'G_bias' needs an input-dependent gate (input_gate=True), got an input-independent gate");
    check_floating(op, "G_bias", p.G_bias);
    check_matches(op, "G_bias", p.G_bias, "x", x);
    check_per_output(op, "G_bias", "", p.G_bias, s);
  }
  if (kind.mul) check_eps(op, eps, x.scalar_type());
  return s;
}

LayerShape check_layer(const char* op, const LayerArgs& args, const at::Tensor& x, const LayerParams& p) {
  return check_layer(op, args.kind, x, p, args.eps);
}

void check_saved(const char* op, const LayerKind& kind, const LayerShape& s, const at::Tensor& x,
                 const at::Tensor& G, const at::Tensor& grad_y, const at::Tensor& a,
                 const at::Tensor& m, const at::Tensor& g, const at::Tensor& lx) {
  check_like(op, "grad_y", grad_y, s.out_sizes, x);
  if (kind.add && kind.mul) {
    check_like(op, "a", a, s.out_sizes, x);
    check_like(op, "m", m, s.out_sizes, x);
    check_like(op, "g", g, kind.gate == Gate::kInput ? at::IntArrayRef(s.out_sizes) : G.sizes(), x);
  } else if (kind.mul) {
    check_like(op, "y", m, s.out_sizes, x);
  }
  if (kind.mul) check_like(op, "lx", lx, x.sizes(), x);
}

void check_part_grads(const char* op, const PartGrads& pg, const at::Tensor& x, const at::Tensor& a,
                      const at::Tensor& m, const at::Tensor& g) {
  if (pg.a.defined()) check_like(op, "grad_a", pg.a, a.sizes(), x);
  if (pg.m.defined()) check_like(op, "grad_m", pg.m, m.sizes(), x);
  if (pg.g.defined()) check_like(op, "grad_g", pg.g, g.sizes(), x);
}

void check_gate_regularizer_grad(const char* op, const at::Tensor& grad, const at::Tensor& x, const at::Tensor& g) {
  TORCH_CHECK(grad.dim() == 0, op, ": argument 'grad_gate_regularizer' must have the regulariser's shape [], got ",
              sizes_str(grad.sizes()));
  check_matches(op, "grad_gate_regularizer", grad, "x", x);
  check_matches(op, "g", g, "x", x);
}

std::vector<int64_t> check_gate_regularizer(const char* op, const at::Tensor& g, bool per_member,
                                            const at::Tensor& grad) {
  check_floating(op, "g", g);
  TORCH_CHECK(!per_member || g.dim() >= 1, op,
              ": argument 'g' must have a leading member dimension (E, ...) with per_member=True, got shape ",
              sizes_str(g.sizes()));
  std::vector<int64_t> out;
  if (per_member) out.push_back(g.size(0));
  if (grad.defined()) {
    TORCH_CHECK(grad.sizes() == at::IntArrayRef(out), op, ": argument 'grad' must have the regulariser's shape ",
                sizes_str(out), ", got ", sizes_str(grad.sizes()));
    check_matches(op, "grad", grad, "g", g);
  }
  return out;
}

}  // namespace nalu_cuda
