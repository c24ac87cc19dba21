// autocast_power.cpp: the autocast policy of the power units' ops (npu_*, inalu_*), the one of
// csrc/autocast.cpp: inside an autocast region the op runs in float32 (float16/bfloat16 arguments
// cast once, autocast then off, results left float32): exp of a power of the inputs leaves
// float16's range for modest inputs, as the NALU's multiplicative path does. float64 arguments are
// left as they are.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <tuple>

#include "registration.h"

namespace nalu_cuda {
namespace {

using at::Tensor;
using T = const at::Tensor&;
using OptT = const c10::optional<at::Tensor>&;

using NpuForwardSig = std::tuple<Tensor, Tensor, Tensor>(T, T, OptT, T, double);
using NpuBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(T, T, T, OptT, T, T, T, T, double, bool);
using InaluForwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(T, T, T, T, T, T, double, double);
using InaluBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(T, T, T, T, T, T, T, T, T, T, T,
                                                                                    double, double, bool);

}  // namespace

// Registered by autocast.cpp (registration.h). Each lambda looks its own op up once (a static inside
// a shared helper would be shared by all).
template <c10::DispatchKey K, c10::DeviceType D>
void register_power_autocast(torch::Library& m) {
  m.impl("npu_forward", [](T x, T W_r, OptT W_i, T g, double eps) {
    static const auto op = find_op<NpuForwardSig>("nalu_cuda::npu_forward");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
    auto f = [](auto&& t) { return at::autocast::cached_cast(at::kFloat, t, D); };
    return op.call(f(x), f(W_r), f(W_i), f(g), eps);
  });
  m.impl("npu_backward", [](T gy, T x, T W_r, OptT W_i, T g, T y, T s, T lr, double eps, bool gx) {
    static const auto op = find_op<NpuBackwardSig>("nalu_cuda::npu_backward");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
    auto f = [](auto&& t) { return at::autocast::cached_cast(at::kFloat, t, D); };
    return op.call(f(gy), f(x), f(W_r), f(W_i), f(g), f(y), f(s), f(lr), eps, gx);
  });
  m.impl("inalu_forward", [](T x, T Wh, T Mh, T Whm, T Mhm, T G, double eps, double omega) {
    static const auto op = find_op<InaluForwardSig>("nalu_cuda::inalu_forward");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
    auto f = [](auto&& t) { return at::autocast::cached_cast(at::kFloat, t, D); };
    return op.call(f(x), f(Wh), f(Mh), f(Whm), f(Mhm), f(G), eps, omega);
  });
  m.impl("inalu_backward", [](T gy, T x, T Wh, T Mh, T Whm, T Mhm, T G, T a, T u, T msv, T lx, double eps,
                              double omega, bool gx) {
    static const auto op = find_op<InaluBackwardSig>("nalu_cuda::inalu_backward");
    c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
    auto f = [](auto&& t) { return at::autocast::cached_cast(at::kFloat, t, D); };
    return op.call(f(gy), f(x), f(Wh), f(Mh), f(Whm), f(Mhm), f(G), f(a), f(u), f(msv), f(lx), eps, omega, gx);
  });
}

template void register_power_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(torch::Library&);
template void register_power_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(torch::Library&);

}  // namespace nalu_cuda
