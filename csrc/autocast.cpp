// autocast.cpp: the autocast policy of every nalu_cuda op.
//
// Inside an autocast region, every op runs in float32: float16/bfloat16 arguments are cast to
// float32 once, then the op runs with autocast switched off, and its results stay float32 (they
// are not cast back). Like torch.exp and torch.log, which autocast also runs in float32, the
// multiplicative path overflows float16 for modest inputs (exp(u) > 65504 once u > 11.1), so a
// low-precision result would be wrong more often than it is useful. float64 arguments are left
// as they are. Gradients reach float16/bfloat16 parameters through the casts, in their own dtype.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "registration.h"

namespace nalu_cuda {
namespace {

template <c10::DeviceType D>
at::Tensor f32(const at::Tensor& t) {
  return at::autocast::cached_cast(at::kFloat, t, D);
}

template <c10::DeviceType D>
c10::optional<at::Tensor> f32(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(f32<D>(*t)) : c10::nullopt;
}

// Runs `op` on the float32 casts of its tensor arguments, outside autocast.
template <c10::DispatchKey K, c10::DeviceType D, typename Ret, typename... Args>
struct Float32Op;

template <c10::DispatchKey K, c10::DeviceType D, typename Ret, typename... Args>
struct Float32Op<K, D, Ret(Args...)> {
  static Ret call(const char* name, Args... args) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow(name, "")
                         .template typed<Ret(Args...)>();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(K);
    return op.call(cast(args)...);
  }
  template <typename A>
  static decltype(auto) cast(A&& a) {
    using Plain = std::decay_t<A>;
    if constexpr (std::is_same_v<Plain, at::Tensor> || std::is_same_v<Plain, c10::optional<at::Tensor>>) {
      return f32<D>(a);
    } else {
      return std::forward<A>(a);
    }
  }
};

using T = const at::Tensor&;
using OT = const c10::optional<at::Tensor>&;
using Tensor = at::Tensor;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Tensor6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// One wrapper per op, for one autocast key.
template <c10::DispatchKey K, c10::DeviceType D>
void register_autocast(torch::Library& m) {
  m.impl("nac_weight", [](T w, T mh) { return Float32Op<K, D, Tensor(T, T)>::call("nalu_cuda::nac_weight", w, mh); });
  m.impl("nac_weight_backward", [](T g, T w, T mh) {
    return Float32Op<K, D, Tensor2(T, T, T)>::call("nalu_cuda::nac_weight_backward", g, w, mh);
  });
  m.impl("nac_forward", [](T x, T w, T mh) {
    return Float32Op<K, D, Tensor(T, T, T)>::call("nalu_cuda::nac_forward", x, w, mh);
  });
  m.impl("nac_backward", [](T gy, T x, T w, T mh, bool gx) {
    return Float32Op<K, D, Tensor3(T, T, T, T, bool)>::call("nalu_cuda::nac_backward", gy, x, w, mh, gx);
  });
  m.impl("nac_mul_forward", [](T x, T w, T mh, double eps) {
    return Float32Op<K, D, Tensor2(T, T, T, double)>::call("nalu_cuda::nac_mul_forward", x, w, mh, eps);
  });
  m.impl("nac_mul_backward", [](T gy, T x, T w, T mh, T y, T lx, double eps, bool gx) {
    return Float32Op<K, D, Tensor3(T, T, T, T, T, T, double, bool)>::call("nalu_cuda::nac_mul_backward", gy, x,
                                                                           w, mh, y, lx, eps, gx);
  });
  m.impl("nalu_forward", [](T x, T w, T mh, OT wm, OT mm, T G, double eps, bool ig) {
    return Float32Op<K, D, Tensor5(T, T, T, OT, OT, T, double, bool)>::call("nalu_cuda::nalu_forward", x, w, mh,
                                                                             wm, mm, G, eps, ig);
  });
  m.impl("nalu_backward", [](T gy, T x, T w, T mh, OT wm, OT mm, T G, T a, T mv, T g, T lx, double eps,
                             bool ig, bool gx) {
    return Float32Op<K, D, Tensor6(T, T, T, T, OT, OT, T, T, T, T, T, double, bool, bool)>::call(
        "nalu_cuda::nalu_backward", gy, x, w, mh, wm, mm, G, a, mv, g, lx, eps, ig, gx);
  });
}

}  // namespace

// The one registration of the autocast keys: the ops of this file, then those of
// autocast_power.cpp and autocast_units.cpp (registration.h).
TORCH_LIBRARY_IMPL(nalu_cuda, AutocastCPU, m) {
  register_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m);
  register_power_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m);
  register_units_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m);
}

TORCH_LIBRARY_IMPL(nalu_cuda, AutocastCUDA, m) {
  register_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m);
  register_power_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m);
  register_units_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m);
}

}  // namespace nalu_cuda
