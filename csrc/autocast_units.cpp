// autocast_units.cpp: the autocast policy of the NAU and NMU ops, the one of csrc/autocast.cpp:
// inside an autocast region the op runs in float32 (float16/bfloat16 arguments cast once, autocast
// then off, results left float32). For the NMU a float16 product of 100 factors leaves float16's
// range long before the layer's useful range does; the NAU follows so that one model stays in one
// dtype. float64 arguments are left as they are.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <tuple>

#include "registration.h"

namespace nalu_cuda {
namespace {

using at::Tensor;
using T = const at::Tensor&;

using ForwardSig = Tensor(T, T);
using BackwardSig = std::tuple<Tensor, Tensor>(T, T, T, bool);
using ForwardOp = c10::TypedOperatorHandle<ForwardSig>;
using BackwardOp = c10::TypedOperatorHandle<BackwardSig>;

template <c10::DispatchKey K, c10::DeviceType D>
Tensor forward_f32(const ForwardOp& op, T x, T W) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
  return op.call(at::autocast::cached_cast(at::kFloat, x, D), at::autocast::cached_cast(at::kFloat, W, D));
}

template <c10::DispatchKey K, c10::DeviceType D>
std::tuple<Tensor, Tensor> backward_f32(const BackwardOp& op, T gy, T x, T W, bool gx) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
  auto f32 = [](T t) { return at::autocast::cached_cast(at::kFloat, t, D); };
  return op.call(f32(gy), f32(x), f32(W), gx);
}

}  // namespace

// Registered by autocast.cpp (registration.h). Each lambda looks its own op up once (a static inside
// a shared helper would be shared by all).
template <c10::DispatchKey K, c10::DeviceType D>
void register_units_autocast(torch::Library& m) {
  m.impl("nau_forward", [](T x, T W) {
    static const auto op = find_op<ForwardSig>("nalu_cuda::nau_forward");
    return forward_f32<K, D>(op, x, W);
  });
  m.impl("nmu_forward", [](T x, T W) {
    static const auto op = find_op<ForwardSig>("nalu_cuda::nmu_forward");
    return forward_f32<K, D>(op, x, W);
  });
  m.impl("nau_backward", [](T gy, T x, T W, bool gx) {
    static const auto op = find_op<BackwardSig>("nalu_cuda::nau_backward");
    return backward_f32<K, D>(op, gy, x, W, gx);
  });
  m.impl("nmu_backward", [](T gy, T x, T W, bool gx) {
    static const auto op = find_op<BackwardSig>("nalu_cuda::nmu_backward");
    return backward_f32<K, D>(op, gy, x, W, gx);
  });
}

template void register_units_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(torch::Library&);
template void register_units_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(torch::Library&);

}  // namespace nalu_cuda
