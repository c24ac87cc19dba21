// registration.h: how every op family registers itself, one pattern for all of them.
//
// A family (a folder of csrc/ops/, or csrc/experiments/) writes its op list once, as the schemas in
// its schema.cpp, and ends that file with
//
//     NALU_CUDA_OP_FAMILY(<family>, kLayer, nalu_cuda::kSchemas)
//
// which (1) defines every schema in the nalu_cuda library (a TORCH_LIBRARY_FRAGMENT per family),
// (2) for layer ops (kLayer; not the training op of csrc/experiments/, kTraining), registers the
// autocast policy (csrc/common/autocast.cpp) of every op under AutocastCPU and AutocastCUDA, and
// (3) records the family and its op names, which nalu_cuda._ops reads back from the library
// (nalu_cuda_op_list below) to derive OP_NAMES, UNIT_OP_NAMES and TRAINING_OP_NAMES.
// The family's kernels register in its cpu/ and cuda/ files (TORCH_LIBRARY_IMPL(nalu_cuda, CPU /
// CUDA)), its autograd functions in its autograd.cpp (TORCH_LIBRARY_IMPL(nalu_cuda, Autograd)).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <torch/library.h>

#include <cstddef>
#include <iterator>
#include <string>

namespace nalu_cuda {

// The typed dispatcher handle of the op `name` ("nalu_cuda::..."); callers keep it in a static of
// their own (one per op: a static in a shared helper would be shared by every op of one signature).
template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The name of the op of a schema: what comes before its "(".
inline std::string op_name(const char* schema) {
  const std::string s(schema);
  return s.substr(0, s.find('('));
}

// What a family's ops are: layer ops get the autocast policy; training ops do not.
enum class OpKind { kLayer, kTraining };

// (1) and (3) above: defines the n schemas in m and records the family.
void define_family(torch::Library& m, const char* family, OpKind kind, const char* const* schemas, size_t n);

// (2) above: the float32 autocast kernel (csrc/common/autocast.cpp) of every op of the n schemas,
// registered in m (a library of the key AutocastCPU for device CPU, AutocastCUDA for CUDA).
void register_autocast(torch::Library& m, c10::DeviceType device, const char* const* schemas, size_t n);

}  // namespace nalu_cuda

// The family's operator library, autocast and record; see the top of this file.
#define NALU_CUDA_OP_FAMILY(FAMILY, KIND, SCHEMAS)                                                         \
  TORCH_LIBRARY_FRAGMENT(nalu_cuda, m) {                                                                   \
    ::nalu_cuda::define_family(m, #FAMILY, ::nalu_cuda::OpKind::KIND, SCHEMAS, std::size(SCHEMAS));       \
  }                                                                                                        \
  TORCH_LIBRARY_IMPL(nalu_cuda, AutocastCPU, m) {                                                          \
    if (::nalu_cuda::OpKind::KIND == ::nalu_cuda::OpKind::kLayer)                                          \
      ::nalu_cuda::register_autocast(m, c10::DeviceType::CPU, SCHEMAS, std::size(SCHEMAS));               \
  }                                                                                                        \
  TORCH_LIBRARY_IMPL(nalu_cuda, AutocastCUDA, m) {                                                         \
    if (::nalu_cuda::OpKind::KIND == ::nalu_cuda::OpKind::kLayer)                                          \
      ::nalu_cuda::register_autocast(m, c10::DeviceType::CUDA, SCHEMAS, std::size(SCHEMAS));              \
  }
