// registration.cpp: the record of every op family (csrc/common/registration.h) and its export.
#include "common/registration.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

namespace nalu_cuda {
namespace {

struct Family {
  std::string name;
  OpKind kind;
  std::vector<std::string> ops;
};

std::mutex& families_mutex() {
  static std::mutex mu;
  return mu;
}

// Filled by the families' static initialisers, in whatever order the linker put them.
std::vector<Family>& families() {
  static std::vector<Family> all;
  return all;
}

}  // namespace

void define_family(torch::Library& m, const char* family, OpKind kind, const char* const* schemas, size_t n) {
  Family f{family, kind, {}};
  for (size_t i = 0; i < n; ++i) {
    m.def(schemas[i]);
    f.ops.push_back(op_name(schemas[i]));
  }
  std::lock_guard<std::mutex> lock(families_mutex());
  families().push_back(std::move(f));
}

}  // namespace nalu_cuda

// The op list of this library, one line per family: "<layer|training> <family> <op> <op> ...",
// families sorted by name, ops in the order of their schemas. A C function, so that nalu_cuda._ops
// reads it with ctypes from the Python module and from a library loaded with
// torch.ops.load_library (the CMake build, the CUDA emulation) alike.
extern "C" __attribute__((visibility("default"))) const char* nalu_cuda_op_list() {
  static const std::string list = [] {
    using nalu_cuda::Family;
    std::lock_guard<std::mutex> lock(nalu_cuda::families_mutex());
    std::vector<Family> sorted = nalu_cuda::families();
    std::sort(sorted.begin(), sorted.end(), [](const Family& a, const Family& b) { return a.name < b.name; });
    std::string out;
    for (const Family& f : sorted) {
      out += f.kind == nalu_cuda::OpKind::kLayer ? "layer " : "training ";
      out += f.name;
      for (const std::string& op : f.ops) out += " " + op;
      out += "\n";
    }
    return out;
  }();
  return list.c_str();
}
