// nau_nmu_cuda.cpp: the CUDA device of the NAU and NMU ops (TORCH_LIBRARY_IMPL(nalu_cuda, CUDA)),
// registered through their entry points (csrc/ops/nau_nmu/ops.h: the signatures and the checks the
// CPU ops make too, so the messages are the same). The device's own checks are that x is a CUDA
// tensor of a supported dtype and, for the NMU, the kernels' size limit; then each op runs on x's
// device (CUDAGuard) and its current stream, without waiting for the GPU.
//
// NAU: clamp and cuBLAS through ATen (ops/nau_nmu/checks.h, the same code as on the CPU).
// NMU: the kernels of ops/nau_nmu/cuda/nau_nmu_kernels.cu. Besides the inputs and results it allocates the
// transposed weights (E, O, I), the weight gradient's partial sums (E, C, O, I) in the compute
// type (C chunks of rows, nmu_weight_chunks), and, for float16/bfloat16 storage, a float32
// grad_x accumulator: O(I O + N I), never (N, I, O).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops/nau_nmu/ops.h"
#include "common/cuda/ops_common.h"
#include "ops/nau_nmu/cuda/nau_nmu_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

using at::Tensor;

Tensor transposed_weights(const LayerShape& s, const Tensor& W) {
  return W.reshape({s.E, s.I, s.O}).transpose(1, 2).contiguous();
}

// The CUDA device of the ops' entry points (csrc/ops/nau_nmu/ops.h).
struct Cuda {
  static void check_input(const char* op, const char* name, const Tensor& t) { check_cuda_input(op, name, t); }

  static void check_nmu(const char* op, const LayerShape& s) {
    TORCH_CHECK(s.I <= kNmuMaxIn, op, ": the CUDA kernel takes at most ", kNmuMaxIn,
                " inputs (argument 'W' of shape (..., in, out) with in <= ", kNmuMaxIn, "), got in = ", s.I,
                " (backend=\"reference\" takes any size)");
  }

  static Tensor nau_forward(const LayerShape& s, const Tensor& x, const Tensor& W) {
    const c10::cuda::CUDAGuard guard(x.device());
    return nau_forward_math(s, x, W);
  }

  static std::tuple<Tensor, Tensor> nau_backward(const LayerShape& s, const Tensor& grad_y, const Tensor& x,
                                                 const Tensor& W, bool compute_grad_x) {
    const c10::cuda::CUDAGuard guard(x.device());
    return nau_backward_math(s, grad_y, x, W, compute_grad_x);
  }

  static Tensor nmu_forward(const LayerShape& s, const Tensor& x, const Tensor& W) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const Tensor xc = x.contiguous();
    const Tensor Wt = transposed_weights(s, W);
    Tensor y = at::empty(s.out_sizes, x.options());
    ::nalu_cuda::cuda::nmu_forward(storage_dtype(x), Dims{s.E, s.N, s.I, s.O}, xc.const_data_ptr(),
                                   Wt.const_data_ptr(), y.data_ptr(), stream);
    return y;
  }

  static std::tuple<Tensor, Tensor> nmu_backward(const LayerShape& s, const Tensor& grad_y, const Tensor& x,
                                                 const Tensor& W, bool compute_grad_x) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const Dims d{s.E, s.N, s.I, s.O};
    const DType dt = storage_dtype(x);
    const Tensor xc = x.contiguous();
    const Tensor dy = grad_y.contiguous();
    const Tensor Wt = transposed_weights(s, W);
    const auto acc = x.options().dtype(acc_dtype(x));

    const int64_t chunks = nmu_weight_chunks(d);
    Tensor partial = at::zeros({s.E, chunks, s.O, s.I}, acc);
    nmu_backward_w(dt, d, chunks, dy.const_data_ptr(), xc.const_data_ptr(), Wt.const_data_ptr(), partial.data_ptr(),
                   stream);
    // Sum the chunks (ATen's reduction: a fixed order for a given shape), back to (E, I, O) and the
    // storage dtype.
    const Tensor summed = chunks == 1 ? partial.select(1, 0) : partial.sum(1);
    Tensor gW = summed.transpose(1, 2).to(x.scalar_type()).contiguous().reshape(W.sizes());

    Tensor gx = empty_grad(x);
    if (compute_grad_x) {
      Tensor gx_acc = at::zeros(x.sizes(), acc);
      nmu_backward_x(dt, d, dy.const_data_ptr(), xc.const_data_ptr(), Wt.const_data_ptr(), gx_acc.data_ptr(),
                     stream);
      gx = gx_acc.scalar_type() == x.scalar_type() ? gx_acc : gx_acc.to(x.scalar_type());
    }
    return {gx, gW};
  }
};

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) { UnitOps<cuda::Cuda>::register_kernels(m); }

}  // namespace nalu_cuda
