// nau_nmu_cuda.cpp: the CUDA ops of the NAU and NMU (TORCH_LIBRARY_IMPL(nalu_cuda, CUDA)), under the
// schemas of the families' schema.cpp (csrc/ops/*/schema.cpp). Each op checks its arguments with the checks the CPU ops use
// (csrc/ops/nau_nmu/checks.h), then that x is a CUDA tensor of a supported dtype, then runs on x's device
// (CUDAGuard) and its current stream, without waiting for the GPU.
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

#include "ops/nau_nmu/checks.h"
#include "common/cuda/ops_common.h"
#include "ops/nau_nmu/cuda/nau_nmu_kernels.h"

namespace nalu_cuda {
namespace cuda {
namespace {

using at::Tensor;

LayerShape check_cuda_unit(const char* op, const Tensor& x, const Tensor& W, const Tensor& grad_y = Tensor()) {
  const LayerShape s = grad_y.defined() ? check_unit_backward(op, grad_y, x, W) : check_unit(op, x, W);
  check_cuda_input(op, "x", x);
  return s;
}

void check_nmu_in(const char* op, const LayerShape& s) {
  TORCH_CHECK(s.I <= kNmuMaxIn, op, ": the CUDA kernel takes at most ", kNmuMaxIn,
              " inputs (argument 'W' of shape (..., in, out) with in <= ", kNmuMaxIn, "), got in = ", s.I,
              " (backend=\"reference\" takes any size)");
}

Tensor transposed_weights(const LayerShape& s, const Tensor& W) {
  return W.reshape({s.E, s.I, s.O}).transpose(1, 2).contiguous();
}

Tensor nau_forward_cuda(const Tensor& x, const Tensor& W) {
  const char* op = "nalu_cuda::nau_forward";
  const LayerShape s = check_cuda_unit(op, x, W);
  const c10::cuda::CUDAGuard guard(x.device());
  return nau_forward_math(s, x, W);
}

std::tuple<Tensor, Tensor> nau_backward_cuda(const Tensor& grad_y, const Tensor& x, const Tensor& W,
                                             bool compute_grad_x) {
  const char* op = "nalu_cuda::nau_backward";
  const LayerShape s = check_cuda_unit(op, x, W, grad_y);
  const c10::cuda::CUDAGuard guard(x.device());
  return nau_backward_math(s, grad_y, x, W, compute_grad_x);
}

Tensor nmu_forward_cuda(const Tensor& x, const Tensor& W) {
  const char* op = "nalu_cuda::nmu_forward";
  const LayerShape s = check_cuda_unit(op, x, W);
  check_nmu_in(op, s);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Tensor xc = x.contiguous();
  const Tensor Wt = transposed_weights(s, W);
  Tensor y = at::empty(s.out_sizes, x.options());
  nmu_forward(storage_dtype(x), Dims{s.E, s.N, s.I, s.O}, xc.const_data_ptr(), Wt.const_data_ptr(), y.data_ptr(),
              stream);
  return y;
}

std::tuple<Tensor, Tensor> nmu_backward_cuda(const Tensor& grad_y, const Tensor& x, const Tensor& W,
                                             bool compute_grad_x) {
  const char* op = "nalu_cuda::nmu_backward";
  const LayerShape s = check_cuda_unit(op, x, W, grad_y);
  check_nmu_in(op, s);
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
    nmu_backward_x(dt, d, dy.const_data_ptr(), xc.const_data_ptr(), Wt.const_data_ptr(), gx_acc.data_ptr(), stream);
    gx = gx_acc.scalar_type() == x.scalar_type() ? gx_acc : gx_acc.to(x.scalar_type());
  }
  return {gx, gW};
}

}  // namespace

TORCH_LIBRARY_IMPL(nalu_cuda, CUDA, m) {
  m.impl("nau_forward", &nau_forward_cuda);
  m.impl("nau_backward", &nau_backward_cuda);
  m.impl("nmu_forward", &nmu_forward_cuda);
  m.impl("nmu_backward", &nmu_backward_cuda);
}

}  // namespace cuda
}  // namespace nalu_cuda
