// nalu_cuda.cpp: the CUDA ops (TORCH_LIBRARY_IMPL(nalu_cuda, CUDA)), under the schemas of
// csrc/nalu_ops.cpp. Each op checks its arguments with the checks the CPU ops use
// (csrc/nalu_layer.h, so the messages are the same; they also make every tensor share x's
// device), then that x is a CUDA tensor and of a supported dtype, then runs on x's device
// (CUDAGuard) and on the current stream of that device. Nothing here waits for the GPU, so the
// ops can be captured in CUDA graphs (torch.compile mode="reduce-overhead").
//
// Math, saved values and kernel design: csrc/cuda/nalu_cuda_kernels.cu. This file picks the path
// (plan_small_*: one-pass kernels for narrow layers, else cuBLAS), allocates the results and any
// workspace through the caching allocator, and makes the products with ATen's bmm/baddbmm
// (cuBLAS, batched over the ensemble). Products on the cuBLAS path run in the storage dtype (for
// float16/bfloat16, cuBLAS accumulates in float32 under torch's matmul settings, as for the
// reference); every elementwise step computes in float32 (float64 for float64).
//
// Dtypes: float32, float64, float16, bfloat16. Under autocast every op runs in float32
// (csrc/autocast.cpp), so these kernels see float16/bfloat16 only when called outside autocast.
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../nalu_layer.h"
#include "cuda_ops_common.h"
#include "nalu_cuda_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

KindArgs kind_args(const LayerKind& k) {
  KindArgs a;
  a.add = k.add;
  a.mul = k.mul;
  a.sep = k.add && k.mul && !k.tied;
  a.gate = k.gate == Gate::kInput ? GateKind::kInput
                                  : (k.gate == Gate::kIndependent ? GateKind::kIndependent : GateKind::kNone);
  return a;
}

LayerParams params(const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m = c10::nullopt,
                   const OptTensor& M_hat_m = c10::nullopt, const Tensor& G = Tensor()) {
  LayerParams p;
  p.W_hat = W_hat;
  p.M_hat = M_hat;
  if (W_hat_m.has_value()) p.W_hat_m = *W_hat_m;
  if (M_hat_m.has_value()) p.M_hat_m = *M_hat_m;
  p.G = G;
  return p;
}

Tensor contig(const Tensor& t) { return t.defined() ? t.contiguous() : t; }

// The parameters of a call, contiguous, and their raw pointers.
struct Inputs {
  Tensor x, W_hat, M_hat, W_hat_m, M_hat_m, G;
  LayerPtrs ptrs() const {
    return {.x = cptr(x), .W_hat = cptr(W_hat), .M_hat = cptr(M_hat), .W_hat_m = cptr(W_hat_m),
            .M_hat_m = cptr(M_hat_m), .G = cptr(G)};
  }
};

Inputs contiguous_inputs(const Tensor& x, const LayerParams& p, const KindArgs& k) {
  Inputs in;
  in.x = x.contiguous();
  in.W_hat = p.W_hat.contiguous();
  in.M_hat = p.M_hat.contiguous();
  if (k.sep) {
    in.W_hat_m = p.W_hat_m.contiguous();
    in.M_hat_m = p.M_hat_m.contiguous();
  }
  if (k.gate != GateKind::kNone) in.G = p.G.contiguous();
  return in;
}

// A forward op's results (see csrc/nalu_ops.cpp); undefined where the kind has none.
struct Forward {
  Tensor y, a, m, g, lx;
};

struct Backward {
  Tensor grad_x, grad_W_hat, grad_M_hat, grad_W_hat_m, grad_M_hat_m, grad_G;
};

// What forward and backward derive from a checked call (under the call's device guard): the
// kernels' kind, dims and dtype, and the contiguous inputs.
struct Call {
  KindArgs k;
  Dims d;
  DType dt;
  Inputs in;
};

Call prepare(const LayerKind& kind, const LayerShape& s, const Tensor& x, const LayerParams& p) {
  const KindArgs k = kind_args(kind);
  return Call{k, Dims{s.E, s.N, s.I, s.O}, storage_dtype(x), contiguous_inputs(x, p, k)};
}

// Checks shared with the CPU ops, then the CUDA-specific ones.
LayerShape check_cuda_layer(const char* op, const LayerKind& kind, const Tensor& x, const LayerParams& p,
                            double eps) {
  const LayerShape s = check_layer(op, kind, x, p, eps);
  check_cuda_input(op, "x", x);
  return s;
}

Forward forward(const char* op, const LayerKind& kind, const Tensor& x, const LayerParams& p, double eps) {
  const LayerShape s = check_cuda_layer(op, kind, x, p, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto [k, d, dt, in] = prepare(kind, s, x, p);
  const bool nalu = kind.add && kind.mul;
  auto opts = x.options();

  Forward f;
  f.y = at::empty(s.out_sizes, opts);
  if (kind.mul) f.lx = at::empty(x.sizes(), opts);
  if (nalu) {
    f.a = at::empty(s.out_sizes, opts);
    f.m = at::empty(s.out_sizes, opts);
    f.g = kind.gate == Gate::kInput ? at::empty(s.out_sizes, opts) : at::empty(p.G.sizes(), opts);
  }
  const FwdOut out{.y = ptr(f.y), .a = ptr(f.a), .m = ptr(f.m), .g = ptr(f.g), .lx = ptr(f.lx)};

  const SmallPlan plan = plan_small_forward(dt, k, d);
  if (plan.ok) {
    small_forward(dt, k, d, plan, in.ptrs(), out, eps, stream);
    return f;
  }

  // cuBLAS path: prologue (weights, lx, sigmoid(G)) -> products -> epilogue.
  Tensor W = at::empty({s.E, s.I, s.O}, opts);
  Tensor Wm = k.sep ? at::empty({s.E, s.I, s.O}, opts) : W;
  PrologueArgs pa = weight_prologue_args(s.E * s.I * s.O, in.W_hat, in.M_hat, W, in.W_hat_m, in.M_hat_m,
                                         k.sep ? Wm : Tensor());
  if (kind.mul) {
    pa.n_lx = x.numel();
    pa.x = cptr(in.x);
    pa.lx = ptr(f.lx);
    pa.eps = eps;
  }
  if (kind.gate == Gate::kIndependent) {
    pa.n_g = p.G.numel();
    pa.G = cptr(in.G);
    pa.g = ptr(f.g);
  }
  forward_prologue(dt, pa, stream);

  const Tensor x3 = in.x.view({s.E, s.N, s.I});
  Tensor y3 = f.y.view({s.E, s.N, s.O});
  if (!kind.mul) {  // NAC+
    at::bmm_out(y3, x3, W);
    return f;
  }
  const Tensor lx3 = f.lx.view({s.E, s.N, s.I});
  if (!kind.add) {  // NAC*: u into y, exponentiated by the epilogue
    at::bmm_out(y3, lx3, W);
  } else {
    Tensor a3 = f.a.view({s.E, s.N, s.O});
    Tensor m3 = f.m.view({s.E, s.N, s.O});
    at::bmm_out(a3, x3, W);
    at::bmm_out(m3, lx3, Wm);  // u
    if (kind.gate == Gate::kInput) {
      Tensor g3 = f.g.view({s.E, s.N, s.O});
      at::bmm_out(g3, x3, in.G.view({s.E, s.I, s.O}));  // z
    }
  }
  forward_epilogue(dt, k, d, in.ptrs(), out, stream);
  return f;
}

Backward backward(const char* op, const LayerKind& kind, const Tensor& grad_y, const Tensor& x, const LayerParams& p,
                  const Forward& saved, double eps, bool compute_grad_x) {
  const LayerShape s = check_cuda_layer(op, kind, x, p, eps);
  check_saved(op, kind, s, x, p.G, grad_y, saved.a, saved.m, saved.g, saved.lx);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto [k, d, dt, in] = prepare(kind, s, x, p);
  const bool nalu = kind.add && kind.mul;
  const Tensor dy = grad_y.contiguous();
  const Tensor a = nalu ? contig(saved.a) : Tensor();
  const Tensor m = kind.mul ? contig(saved.m) : Tensor();
  const Tensor g = kind.gate != Gate::kNone ? contig(saved.g) : Tensor();
  const Tensor lx = kind.mul ? contig(saved.lx) : Tensor();
  auto opts = x.options();

  Backward r;
  r.grad_W_hat = at::empty(p.W_hat.sizes(), opts);
  r.grad_M_hat = at::empty(p.W_hat.sizes(), opts);
  if (k.sep) {
    r.grad_W_hat_m = at::empty(p.W_hat.sizes(), opts);
    r.grad_M_hat_m = at::empty(p.W_hat.sizes(), opts);
  }
  if (kind.gate != Gate::kNone) r.grad_G = at::empty(p.G.sizes(), opts);
  if (compute_grad_x) r.grad_x = at::empty(x.sizes(), opts);

  const SavedPtrs sv{.dy = cptr(dy), .a = cptr(a), .m = cptr(m), .g = cptr(g), .lx = cptr(lx)};

  const SmallPlan plan = plan_small_backward(dt, k, d);
  if (plan.ok) {
    const GradOut out{.dx = ptr(r.grad_x), .dW_hat = ptr(r.grad_W_hat), .dM_hat = ptr(r.grad_M_hat),
                      .dW_hat_m = ptr(r.grad_W_hat_m), .dM_hat_m = ptr(r.grad_M_hat_m), .dG = ptr(r.grad_G)};
    Tensor workspace;
    if (plan.workspace_bytes > 0) {
      workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes)}, opts.dtype(at::kByte));
    }
    small_backward(dt, k, d, plan, in.ptrs(), sv, out, ptr(workspace), eps, compute_grad_x, stream);
    return r;
  }

  // cuBLAS path. One (E, N, O) buffer holds du, da, dz in turn (a prologue launch each; the first
  // also rebuilds W, W_m), each followed by its products: du -> dW_m (dW when tied), du W_m^T into
  // dx; da -> dW; epilogue (dx scaling, weight construction backward); da W^T into dx;
  // dz -> dG, dz G^T into dx.
  const int64_t E = s.E, N = s.N, I = s.I, O = s.O;
  Tensor W = at::empty({E, I, O}, opts);
  Tensor Wm = k.sep ? at::empty({E, I, O}, opts) : W;
  Tensor buf = at::empty({E, N, O}, opts);
  const PrologueArgs w =
      weight_prologue_args(E * I * O, in.W_hat, in.M_hat, W, in.W_hat_m, in.M_hat_m, k.sep ? Wm : Tensor());
  PrologueArgs no_weights;  // n_w = 0: the weights are built by the first launch
  bool weights_built = false;
  auto output_grad = [&](bool is_da, bool is_du, bool is_dz) {
    backward_prologue(dt, k, d, weights_built ? no_weights : w, sv, is_da ? ptr(buf) : nullptr,
                      is_du ? ptr(buf) : nullptr, is_dz ? ptr(buf) : nullptr, stream);
    weights_built = true;
  };

  const Tensor x3 = in.x.view({E, N, I});
  const Tensor xT = x3.transpose(1, 2);
  Tensor dW = at::empty({E, I, O}, opts);
  Tensor dWm = k.sep ? at::empty({E, I, O}, opts) : Tensor();
  Tensor dx3 = compute_grad_x ? r.grad_x.view({E, N, I}) : Tensor();
  // (the separate weights' tensors are undefined when tied: null pointers)
  EpilogueArgs ep = weight_epilogue_args(E * I * O, dW, in.W_hat, in.M_hat, r.grad_W_hat, r.grad_M_hat, dWm,
                                         in.W_hat_m, in.M_hat_m, r.grad_W_hat_m, r.grad_M_hat_m);
  if (kind.mul) {
    output_grad(false, true, false);  // du
    const Tensor lxT = lx.view({E, N, I}).transpose(1, 2);
    at::bmm_out(k.sep ? dWm : dW, lxT, buf);
    if (compute_grad_x) {
      at::bmm_out(dx3, buf, Wm.transpose(1, 2));  // scaled by sign(x) / (|x| + eps) in the epilogue
      ep.n_dx = x.numel();
      ep.dx = ptr(r.grad_x);
      ep.x = cptr(in.x);
      ep.eps = eps;
    }
  }
  if (kind.add) {
    output_grad(true, false, false);  // da
    if (kind.mul && !k.sep) {
      dW.baddbmm_(xT, buf);
    } else {
      at::bmm_out(dW, xT, buf);
    }
  }
  backward_epilogue(dt, ep, stream);
  if (compute_grad_x && kind.add) {
    if (kind.mul) {
      dx3.baddbmm_(buf, W.transpose(1, 2));
    } else {
      at::bmm_out(dx3, buf, W.transpose(1, 2));
    }
  }
  if (kind.gate != Gate::kNone) {
    output_grad(false, false, true);  // dz
    if (kind.gate == Gate::kInput) {
      const Tensor G3 = in.G.view({E, I, O});
      Tensor dG3 = r.grad_G.view({E, I, O});
      at::bmm_out(dG3, xT, buf);
      if (compute_grad_x) dx3.baddbmm_(buf, G3.transpose(1, 2));
    } else {
      Tensor dG2 = r.grad_G.view({E, O});
      at::sum_out(dG2, buf, at::IntArrayRef{1});
    }
  }
  return r;
}

// Fills in the (0,)-shaped tensors of gradients that were not asked for.
Backward finish(Backward r, const LayerKind& kind, const Tensor& x) {
  if (!r.grad_x.defined()) r.grad_x = empty_grad(x);
  if (kind.add && kind.mul && kind.tied) {
    r.grad_W_hat_m = empty_grad(x);
    r.grad_M_hat_m = empty_grad(x);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------------

Tensor nac_weight_cuda(const Tensor& W_hat, const Tensor& M_hat) {
  const char* op = "nalu_cuda::nac_weight";
  check_weight_pair(op, W_hat, M_hat, "W_hat", "M_hat", /*layer_shape=*/false);
  check_cuda_input(op, "W_hat", W_hat);
  const c10::cuda::CUDAGuard guard(W_hat.device());
  const Tensor wh = W_hat.contiguous(), mh = M_hat.contiguous();
  Tensor out = at::empty(W_hat.sizes(), W_hat.options());
  forward_prologue(storage_dtype(W_hat), weight_prologue_args(out.numel(), wh, mh, out),
                   c10::cuda::getCurrentCUDAStream());
  return out;
}

std::tuple<Tensor, Tensor> nac_weight_backward_cuda(const Tensor& grad_W, const Tensor& W_hat, const Tensor& M_hat) {
  const char* op = "nalu_cuda::nac_weight_backward";
  check_weight_pair(op, W_hat, M_hat, "W_hat", "M_hat", /*layer_shape=*/false);
  check_cuda_input(op, "W_hat", W_hat);
  check_like(op, "grad_W", grad_W, W_hat.sizes(), W_hat);
  const c10::cuda::CUDAGuard guard(W_hat.device());
  const Tensor gW = grad_W.contiguous(), wh = W_hat.contiguous(), mh = M_hat.contiguous();
  Tensor gw = at::empty(W_hat.sizes(), W_hat.options());
  Tensor gm = at::empty(W_hat.sizes(), W_hat.options());
  backward_epilogue(storage_dtype(W_hat), weight_epilogue_args(gw.numel(), gW, wh, mh, gw, gm),
                    c10::cuda::getCurrentCUDAStream());
  return {gw, gm};
}

Tensor nac_forward_cuda(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat) {
  return forward("nalu_cuda::nac_forward", kNacAdd, x, params(W_hat, M_hat), 0.0).y;
}

std::tuple<Tensor, Tensor, Tensor> nac_backward_cuda(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat,
                                                     const Tensor& M_hat, bool compute_grad_x) {
  Backward g = finish(backward("nalu_cuda::nac_backward", kNacAdd, grad_y, x, params(W_hat, M_hat), Forward{}, 0.0,
                               compute_grad_x),
                      kNacAdd, x);
  return {g.grad_x, g.grad_W_hat, g.grad_M_hat};
}

std::tuple<Tensor, Tensor> nac_mul_forward_cuda(const Tensor& x, const Tensor& W_hat, const Tensor& M_hat,
                                                double eps) {
  Forward f = forward("nalu_cuda::nac_mul_forward", kNacMul, x, params(W_hat, M_hat), eps);
  return {f.y, f.lx};
}

std::tuple<Tensor, Tensor, Tensor> nac_mul_backward_cuda(const Tensor& grad_y, const Tensor& x, const Tensor& W_hat,
                                                         const Tensor& M_hat, const Tensor& y, const Tensor& lx,
                                                         double eps, bool compute_grad_x) {
  Forward saved;
  saved.m = y;
  saved.lx = lx;
  Backward g = finish(backward("nalu_cuda::nac_mul_backward", kNacMul, grad_y, x, params(W_hat, M_hat), saved, eps,
                               compute_grad_x),
                      kNacMul, x);
  return {g.grad_x, g.grad_W_hat, g.grad_M_hat};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> nalu_forward_cuda(const Tensor& x, const Tensor& W_hat,
                                                                     const Tensor& M_hat, const OptTensor& W_hat_m,
                                                                     const OptTensor& M_hat_m, const Tensor& G,
                                                                     double eps, bool input_gate) {
  Forward f = forward("nalu_cuda::nalu_forward", nalu_kind(W_hat_m, M_hat_m, input_gate), x,
                      params(W_hat, M_hat, W_hat_m, M_hat_m, G), eps);
  return {f.y, f.a, f.m, f.g, f.lx};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> nalu_backward_cuda(
    const Tensor& grad_y, const Tensor& x, const Tensor& W_hat, const Tensor& M_hat, const OptTensor& W_hat_m,
    const OptTensor& M_hat_m, const Tensor& G, const Tensor& a, const Tensor& m, const Tensor& g, const Tensor& lx,
    double eps, bool input_gate, bool compute_grad_x) {
  const LayerKind kind = nalu_kind(W_hat_m, M_hat_m, input_gate);
  Forward saved{Tensor(), a, m, g, lx};
  Backward r = finish(backward("nalu_cuda::nalu_backward", kind, grad_y, x, params(W_hat, M_hat, W_hat_m, M_hat_m, G),
                               saved, eps, compute_grad_x),
                      kind, x);
  return {r.grad_x, r.grad_W_hat, r.grad_M_hat, r.grad_W_hat_m, r.grad_M_hat_m, r.grad_G};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) {
  m.impl("nac_weight", &cuda::nac_weight_cuda);
  m.impl("nac_weight_backward", &cuda::nac_weight_backward_cuda);
  m.impl("nac_forward", &cuda::nac_forward_cuda);
  m.impl("nac_backward", &cuda::nac_backward_cuda);
  m.impl("nac_mul_forward", &cuda::nac_mul_forward_cuda);
  m.impl("nac_mul_backward", &cuda::nac_mul_backward_cuda);
  m.impl("nalu_forward", &cuda::nalu_forward_cuda);
  m.impl("nalu_backward", &cuda::nalu_backward_cuda);
}

}  // namespace nalu_cuda
