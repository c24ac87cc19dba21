// nac_nalu_cuda.cpp: the CUDA kernels of the NAC/NALU ops (TORCH_LIBRARY_IMPL(nalu_cuda, CUDA)),
// registered through their entry points (csrc/ops/nac_nalu/ops.h: the signatures and the checks the CPU
// ops make too, so the messages are the same; they also make every tensor share x's device).
// The device's own check is that x is a CUDA tensor of a supported dtype; then each op runs on x's
// device (CUDAGuard) and on the current stream of that device. Nothing here waits for the GPU, so
// the ops can be captured in CUDA graphs (torch.compile mode="reduce-overhead").
//
// Math, saved values and kernel design: ops/nac_nalu/cuda/kernels.cuh, rowwise_kernels.cu and
// blas_kernels.cu. This file picks the path (plan_rowwise_*: one-pass kernels for layers with few
// outputs, else the blas path), allocates the results and any workspace through the caching
// allocator, and runs the blas path's products through the host routine the CPU shares
// (csrc/blas_path.h: ATen's bmm/baddbmm, cuBLAS batched over the ensemble). Products on the blas
// path run in the storage dtype (for float16/bfloat16, cuBLAS accumulates in float32 under torch's
// matmul settings, as for the reference; float32 products follow torch's TF32 setting, while the
// rowwise path is always full float32); every elementwise step computes in float32 (float64 for
// float64).
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
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops/nac_nalu/blas_path.h"
#include "ops/nac_nalu/ops.h"
#include "ops/nac_nalu/checks.h"
#include "common/cuda/ops_common.h"
#include "ops/nac_nalu/cuda/kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

using at::Tensor;

LayerPtrs layer_ptrs(const Tensor& x, const LayerParams& p) {
  return {.x = cptr(x), .W_hat = cptr(p.W_hat), .M_hat = cptr(p.M_hat), .W_hat_m = cptr(p.W_hat_m),
          .M_hat_m = cptr(p.M_hat_m), .G = cptr(p.G), .G_bias = cptr(p.G_bias)};
}

// The CUDA device of the ops' entry points (csrc/ops/nac_nalu/ops.h): parameters arrive contiguous.
// The gate regulariser (ops.h) in ATen ops on g's device and stream, computed in float32 for
// float16/bfloat16 (float64 for float64): an elementwise term of the loss, small next to the layer,
// not worth a kernel of its own. g is viewed as (members, n) for a regulariser of shape `out`.
Tensor gate_terms(const Tensor& g, at::IntArrayRef out, bool backward) {
  const Tensor gf = g.scalar_type() == at::kDouble ? g : g.to(at::kFloat);
  const int64_t members = out.empty() ? 1 : out[0];
  const Tensor v = gf.reshape({members, members == 0 ? 0 : g.numel() / members});
  const Tensor h = v.sub(v.mul(v));
  return backward ? h.mul(v.mul(-2).add(1)).mul(2) : h.mul(h);
}

struct Cuda {
  static void check_input(const char* op, const char* name, const Tensor& t) { check_cuda_input(op, name, t); }

  static Tensor gate_regularizer(const Tensor& g, at::IntArrayRef out) {
    const c10::cuda::CUDAGuard guard(g.device());
    return at::sum(gate_terms(g, out, false), {1}).reshape(out).to(g.scalar_type());
  }

  static Tensor gate_regularizer_backward(const Tensor& grad, const Tensor& g) {
    const c10::cuda::CUDAGuard guard(g.device());
    const Tensor d = gate_terms(g, grad.sizes(), true);
    return d.mul(grad.reshape({d.size(0), 1}).to(d.scalar_type())).reshape(g.sizes()).to(g.scalar_type());
  }

  static Forward forward(const LayerArgs& args, const LayerShape& s, const Tensor& x_in, const LayerParams& p) {
    const LayerKind& kind = args.kind;
    const c10::cuda::CUDAGuard guard(x_in.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const DType dt = storage_dtype(x_in);
    const Tensor x = x_in.contiguous();
    auto opts = x.options();

    Forward f;
    f.y = at::empty(s.out_sizes, opts);
    if (kind.mul) f.lx = at::empty(x.sizes(), opts);
    if (kind.nalu()) {
      f.a = at::empty(s.out_sizes, opts);
      f.m = at::empty(s.out_sizes, opts);
      f.g = kind.gate == Gate::kInput ? at::empty(s.out_sizes, opts) : at::empty(p.G.sizes(), opts);
    }
    const FwdOut<void*> out{.y = ptr(f.y), .a = ptr(f.a), .m = ptr(f.m), .g = ptr(f.g), .lx = ptr(f.lx)};

    const RowwisePlan plan = plan_rowwise_forward(dt, kind, s);
    if (plan.ok) {
      rowwise_forward(dt, args, s, plan, layer_ptrs(x, p), out, stream);
      return f;
    }

    // Blas path: prologue (weights, lx, sigmoid(G)) -> products -> epilogue.
    const blas_path::Weights w = weight_buffers(kind, s, p, opts);
    PrologueArgs pa = weight_prologue_args(s.E * s.I * s.O, p.W_hat, p.M_hat, w.W, p.W_hat_m, p.M_hat_m,
                                           kind.sep() ? w.Wm : Tensor());
    if (kind.mul) {
      pa.n_lx = x.numel();
      pa.x = cptr(x);
      pa.lx = ptr(f.lx);
    }
    pa.args = args;
    if (kind.gate == Gate::kIndependent) {
      pa.n_g = p.G.numel();
      pa.G = cptr(p.G);
      pa.g = ptr(f.g);
    }
    forward_prologue(dt, pa, stream);
    blas_path::forward(args, s, x.view({s.E, s.N, s.I}), w, f,
                       [&] { forward_epilogue(dt, args, s, layer_ptrs(x, p), out, stream); });
    return f;
  }

  static Backward backward(const LayerArgs& args, const LayerShape& s, const Tensor& grad_y, const Tensor& x_in,
                           const LayerParams& p, const Forward& saved, const PartGrads& parts) {
    const LayerKind& kind = args.kind;
    const c10::cuda::CUDAGuard guard(x_in.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const DType dt = storage_dtype(x_in);
    const Tensor x = x_in.contiguous();
    auto contig = [](const Tensor& t) { return t.defined() ? t.contiguous() : t; };
    const Tensor dy = grad_y.contiguous();
    const Tensor a = kind.nalu() ? contig(saved.a) : Tensor();
    const Tensor m = kind.mul ? contig(saved.m) : Tensor();
    const Tensor g = kind.gate != Gate::kNone ? contig(saved.g) : Tensor();
    const Tensor lx = kind.mul ? contig(saved.lx) : Tensor();
    auto opts = x.options();

    Backward r;
    r.grad_W_hat = at::empty(p.W_hat.sizes(), opts);
    r.grad_M_hat = at::empty(p.W_hat.sizes(), opts);
    if (kind.sep()) {
      r.grad_W_hat_m = at::empty(p.W_hat.sizes(), opts);
      r.grad_M_hat_m = at::empty(p.W_hat.sizes(), opts);
    }
    if (kind.gate != Gate::kNone) r.grad_G = at::empty(p.G.sizes(), opts);
    if (p.G_bias.defined()) r.grad_G_bias = at::empty(p.G_bias.sizes(), opts);
    if (args.compute_grad_x) r.grad_x = at::empty(x.sizes(), opts);

    // the parts' gradients arrive contiguous (ops.h)
    const SavedPtrs<const void*> sv{.dy = cptr(dy), .a = cptr(a), .m = cptr(m), .g = cptr(g), .lx = cptr(lx),
                                    .ga = cptr(parts.a), .gm = cptr(parts.m), .gg = cptr(parts.g)};

    const RowwisePlan plan = plan_rowwise_backward(dt, kind, s);
    if (plan.ok) {
      const GradOut out{.dx = ptr(r.grad_x), .dW_hat = ptr(r.grad_W_hat), .dM_hat = ptr(r.grad_M_hat),
                        .dW_hat_m = ptr(r.grad_W_hat_m), .dM_hat_m = ptr(r.grad_M_hat_m), .dG = ptr(r.grad_G),
                        .dG_bias = ptr(r.grad_G_bias)};
      Tensor workspace;
      if (plan.workspace_bytes > 0) {
        workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes)}, opts.dtype(at::kByte));
      }
      rowwise_backward(dt, args, s, plan, layer_ptrs(x, p), sv, out, ptr(workspace), stream);
      return r;
    }

    // Blas path (csrc/blas_path.h). Each fill is one backward_prologue launch into the one (E, N, O)
    // buffer; the first also rebuilds W, W_m. The epilogue launch (dx *= sign(x) / (|x| + eps), the
    // weight construction's backward) runs once the weight-gradient products are done.
    const int64_t n_w = s.E * s.I * s.O;
    const blas_path::Weights w = weight_buffers(kind, s, p, opts);
    Tensor buf = at::empty({s.E, s.N, s.O}, opts);
    Tensor dW = at::empty({s.E, s.I, s.O}, opts);
    Tensor dWm = kind.sep() ? at::empty({s.E, s.I, s.O}, opts) : Tensor();
    const PrologueArgs build_w =
        weight_prologue_args(n_w, p.W_hat, p.M_hat, w.W, p.W_hat_m, p.M_hat_m, kind.sep() ? w.Wm : Tensor());
    bool weights_built = false;
    auto fill = [&](blas_path::OutputGrad which) {
      using blas_path::OutputGrad;
      backward_prologue(dt, args, s, weights_built ? PrologueArgs{} : build_w, sv,
                        which == OutputGrad::kDa ? ptr(buf) : nullptr, which == OutputGrad::kDu ? ptr(buf) : nullptr,
                        which == OutputGrad::kDz ? ptr(buf) : nullptr, stream);
      weights_built = true;
    };
    // (the separate weights' tensors are undefined when tied: null pointers)
    EpilogueArgs ep = weight_epilogue_args(n_w, dW, p.W_hat, p.M_hat, r.grad_W_hat, r.grad_M_hat, dWm, p.W_hat_m,
                                           p.M_hat_m, r.grad_W_hat_m, r.grad_M_hat_m);
    if (kind.mul && args.compute_grad_x) {
      ep.n_dx = x.numel();
      ep.dx = ptr(r.grad_x);
      ep.x = cptr(x);
    }
    ep.args = args;
    blas_path::backward(args, s, x.view({s.E, s.N, s.I}), lx, w, buf, r.grad_x, dW, dWm, r.grad_G, r.grad_G_bias, fill,
                        [&] { backward_epilogue(dt, ep, stream); });
    return r;
  }

  static Tensor weight(const Tensor& W_hat, const Tensor& M_hat) {
    const c10::cuda::CUDAGuard guard(W_hat.device());
    Tensor out = at::empty(W_hat.sizes(), W_hat.options());
    forward_prologue(storage_dtype(W_hat), weight_prologue_args(out.numel(), W_hat, M_hat, out),
                     c10::cuda::getCurrentCUDAStream());
    return out;
  }

  static std::tuple<Tensor, Tensor> weight_backward(const Tensor& grad_W, const Tensor& W_hat, const Tensor& M_hat) {
    const c10::cuda::CUDAGuard guard(W_hat.device());
    Tensor gw = at::empty(W_hat.sizes(), W_hat.options());
    Tensor gm = at::empty(W_hat.sizes(), W_hat.options());
    backward_epilogue(storage_dtype(W_hat), weight_epilogue_args(gw.numel(), grad_W, W_hat, M_hat, gw, gm),
                      c10::cuda::getCurrentCUDAStream());
    return {gw, gm};
  }

 private:
  // The blas path's weight buffers, (E, I, O): W, W_m (W itself when tied) for the prologue to
  // fill, and an input gate's G and bias as given.
  static blas_path::Weights weight_buffers(const LayerKind& kind, const LayerShape& s, const LayerParams& p,
                                           const at::TensorOptions& opts) {
    blas_path::Weights w;
    w.W = at::empty({s.E, s.I, s.O}, opts);
    w.Wm = kind.sep() ? at::empty({s.E, s.I, s.O}, opts) : w.W;
    if (kind.gate == Gate::kInput) w.G = p.G.view({s.E, s.I, s.O});
    if (p.G_bias.defined()) w.Gb = p.G_bias.view({s.E, s.O});
    return w;
  }
};

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) { LayerOps<cuda::Cuda>::register_kernels(m); }

}  // namespace nalu_cuda
