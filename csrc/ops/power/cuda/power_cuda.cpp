// power_cuda.cpp: the CUDA device of the NPU / RealNPU and iNALU ops (TORCH_LIBRARY_IMPL(nalu_cuda,
// CUDA)), registered through their entry points (csrc/ops/power/ops.h: the signatures and the checks
// the CPU ops make too, so the messages are the same). The device's own checks are that x is a CUDA
// tensor of a supported dtype and, for inalu_backward, the sign kernel's size limit; then each op runs
// on x's device (CUDAGuard) and its current stream, without waiting for the GPU. Products go to
// cuBLAS through ATen's bmm (batched over the ensemble, in the storage dtype); every elementwise
// step is one launch of ops/power/cuda/power_kernels.cu (math in float32, float64 for float64). The weight
// construction of iNALU and its backward are ops/nac_nalu/cuda/kernels.h's forward_prologue and
// backward_epilogue. Pipeline and saved values: as the CPU ops (csrc/ops/power/cpu/power_cpu.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops/power/ops.h"
#include "common/cuda/ops_common.h"
#include "ops/power/cuda/power_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

using at::Tensor;

// Accumulator options: float for float/half/bfloat16 storage, double for double.
at::TensorOptions acc_options(const Tensor& x) {
  return x.options().dtype(acc_dtype(x));
}

// ------------------------------------------------------------------------------------------------
// iNALU
// ------------------------------------------------------------------------------------------------

struct InaluInputs {
  Tensor x, W_hat, M_hat, W_hat_m, M_hat_m, G;
};

InaluInputs inalu_inputs(const Tensor& x, const LayerParams& p) {
  return {x.contiguous(), p.W_hat.contiguous(), p.M_hat.contiguous(), p.W_hat_m.contiguous(),
          p.M_hat_m.contiguous(), p.G.contiguous()};
}

// W and W_m (E, I, O) from the hat weights (nalu_cuda_kernels' forward_prologue).
std::tuple<Tensor, Tensor> inalu_weights(DType dt, const InaluInputs& in, const LayerShape& s, cudaStream_t stream) {
  Tensor W = at::empty({s.E, s.I, s.O}, in.x.options()), Wm = at::empty({s.E, s.I, s.O}, in.x.options());
  forward_prologue(dt, weight_prologue_args(s.E * s.I * s.O, in.W_hat, in.M_hat, W, in.W_hat_m, in.M_hat_m, Wm),
                   stream);
  return {W, Wm};
}

// The CUDA device of the ops' entry points (csrc/ops/power/ops.h).
struct Cuda {
  static void check_input(const char* op, const char* name, const Tensor& t) { check_cuda_input(op, name, t); }

  // The sign product's backward keeps 4 I values of the compute type per block in shared memory.
  static void check_inalu_backward(const char* op, const LayerShape& s, const Tensor& x) {
    const DType dt = storage_dtype(x);
    TORCH_CHECK(inalu_sign_smem_bytes(dt, Dims{s.E, s.N, s.I, s.O}) <= kInaluSignMaxSmem, op,
                ": the CUDA kernel takes at most ", kInaluSignMaxSmem / (4 * (dt == DType::kDouble ? 8 : 4)),
                " inputs for dtype ", x.scalar_type(), ", got ", s.I, " (backend=\"reference\" has no limit)");
  }

  // NPU / RealNPU

  static std::tuple<Tensor, Tensor, Tensor> npu_forward(const LayerShape& s, const Tensor& x, const Tensor& W_r,
                                                        const Tensor& W_i, const Tensor& g, double eps) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool complex = W_i.defined();
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O;
    const Dims d{E, N, I, O};
    const DType dt = storage_dtype(x);
    const Tensor xc = x.contiguous(), gc = g.contiguous();
    const Tensor Wr3 = W_r.contiguous().view({E, I, O});
    const Tensor Wc = complex ? at::cat({Wr3, W_i.contiguous().view({E, I, O})}, 2) : Wr3;
    auto opts = x.options();
    Tensor LK = at::empty({E, 2 * N, I}, opts);
    Tensor lr = at::empty(x.sizes(), opts);
    Tensor y = at::empty(s.out_sizes, opts), sy = at::empty(s.out_sizes, opts);
    npu_prologue(dt, d, cptr(xc), cptr(gc), eps, ptr(LK), ptr(lr), stream);
    const Tensor P = at::bmm(LK, Wc);
    npu_epilogue(dt, d, complex, cptr(P), ptr(y), ptr(sy), stream);
    return {y, sy, lr};
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor> npu_backward(const LayerShape& s, const Tensor& grad_y,
                                                                 const Tensor& x, const Tensor& W_r, const Tensor& W_i,
                                                                 const Tensor& g, const Tensor& y, const Tensor& sy,
                                                                 const Tensor& lr, double eps, bool compute_grad_x) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool complex = W_i.defined();
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O, C = complex ? 2 * O : O;
    const Dims d{E, N, I, O};
    const DType dt = storage_dtype(x);
    const Tensor xc = x.contiguous(), gc = g.contiguous(), dy = grad_y.contiguous(), yc = y.contiguous(),
                 sc = sy.contiguous(), lrc = lr.contiguous();
    const Tensor Wr3 = W_r.contiguous().view({E, I, O});
    const Tensor Wc = complex ? at::cat({Wr3, W_i.contiguous().view({E, I, O})}, 2) : Wr3;
    auto opts = x.options();
    Tensor D = at::empty({E, 2 * N, C}, opts);
    Tensor LK = at::empty({E, 2 * N, I}, opts);
    npu_backward_prologue(dt, d, complex, cptr(dy), cptr(yc), cptr(sc), cptr(xc), cptr(gc), cptr(lrc), ptr(D), ptr(LK),
                          stream);
    const Tensor dWc = at::bmm(LK.transpose(1, 2), D);  // (E, I, C)
    const auto [grad_W_r, grad_W_i] = npu_weight_grads(dWc, W_r, x, complex);
    const Tensor dLK = at::bmm(D, Wc.transpose(1, 2));  // (E, 2N, I)
    Tensor grad_x = compute_grad_x ? at::empty(x.sizes(), opts) : empty_grad(x);
    Tensor dg_part = at::empty({E, N, I}, acc_options(x));
    npu_backward_epilogue(dt, d, cptr(xc), cptr(gc), eps, cptr(dLK), compute_grad_x ? ptr(grad_x) : nullptr,
                          ptr(dg_part), stream);
    Tensor grad_g = at::empty(g.sizes(), opts);
    column_sums(dt, E, N, I, cptr(dg_part), ptr(grad_g), stream);
    return {grad_x, grad_W_r, grad_W_i, grad_g};
  }

  // iNALU

  static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> inalu_forward(const LayerShape& s, const Tensor& x,
                                                                          const LayerParams& p, double eps,
                                                                          double omega) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O;
    const Dims d{E, N, I, O};
    const DType dt = storage_dtype(x);
    const InaluInputs in = inalu_inputs(x, p);
    auto [W, Wm] = inalu_weights(dt, in, s, stream);
    auto opts = x.options();
    Tensor lx = at::empty(x.sizes(), opts);
    inalu_log(dt, x.numel(), cptr(in.x), eps, ptr(lx), stream);
    Tensor a = at::empty(s.out_sizes, opts), u = at::empty(s.out_sizes, opts);
    Tensor msv = at::empty(s.out_sizes, opts), y = at::empty(s.out_sizes, opts);
    Tensor a3 = a.view({E, N, O}), u3 = u.view({E, N, O});
    at::bmm_out(a3, in.x.view({E, N, I}), W);
    at::bmm_out(u3, lx.view({E, N, I}), Wm);
    inalu_epilogue(dt, d, cptr(in.x), cptr(Wm), cptr(in.G), cptr(a), cptr(u), omega, ptr(msv), ptr(y), stream);
    return {y, a, u, msv, lx};
  }

  static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> inalu_backward(
      const LayerShape& s, const Tensor& grad_y, const Tensor& x, const LayerParams& p, const Tensor& a,
      const Tensor& u, const Tensor& msv, const Tensor& lx, double eps, double omega, bool compute_grad_x) {
    const int64_t E = s.E, N = s.N, I = s.I, O = s.O;
    const Dims d{E, N, I, O};
    const DType dt = storage_dtype(x);
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const InaluInputs in = inalu_inputs(x, p);
    auto [W, Wm] = inalu_weights(dt, in, s, stream);
    auto opts = x.options();
    const Tensor dy = grad_y.contiguous(), ac = a.contiguous(), uc = u.contiguous(), mc = msv.contiguous(),
                 lxc = lx.contiguous();
    Tensor da = at::empty({E, N, O}, opts), du = at::empty({E, N, O}, opts);
    Tensor dmsv = at::empty({E, N, O}, acc_options(x)), dG_part = at::empty({E, N, O}, acc_options(x));
    inalu_backward_prologue(dt, d, cptr(dy), cptr(ac), cptr(uc), cptr(mc), cptr(in.G), omega, ptr(da), ptr(du),
                            ptr(dmsv), ptr(dG_part), stream);
    Tensor grad_G = at::empty(p.G.sizes(), opts);
    column_sums(dt, E, N, O, cptr(dG_part), ptr(grad_G), stream);

    const Tensor x3 = in.x.view({E, N, I}), lx3 = lxc.view({E, N, I});
    Tensor dW = at::bmm(x3.transpose(1, 2), da);
    Tensor dWm = at::bmm(lx3.transpose(1, 2), du);
    Tensor workspace = at::empty({static_cast<int64_t>(inalu_sign_workspace_bytes(dt, d))}, opts.dtype(at::kByte));
    inalu_sign_backward(dt, d, cptr(in.x), cptr(Wm), cptr(dmsv), ptr(dWm), ptr(workspace), stream);

    Tensor gW = at::empty(p.W_hat.sizes(), opts), gM = at::empty(p.W_hat.sizes(), opts);
    Tensor gWm = at::empty(p.W_hat.sizes(), opts), gMm = at::empty(p.W_hat.sizes(), opts);
    backward_epilogue(
        dt, weight_epilogue_args(E * I * O, dW, in.W_hat, in.M_hat, gW, gM, dWm, in.W_hat_m, in.M_hat_m, gWm, gMm),
        stream);

    Tensor grad_x = empty_grad(x);
    if (compute_grad_x) {
      grad_x = at::empty(x.sizes(), opts);
      Tensor gx3 = grad_x.view({E, N, I});
      at::bmm_out(gx3, du, Wm.transpose(1, 2));
      inalu_log_backward(dt, x.numel(), cptr(in.x), eps, ptr(grad_x), stream);
      gx3.baddbmm_(da, W.transpose(1, 2));
    }
    return {grad_x, gW, gM, gWm, gMm, grad_G};
  }
};

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) { PowerOps<cuda::Cuda>::register_kernels(m); }

}  // namespace nalu_cuda
