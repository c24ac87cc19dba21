// module.cpp: the Python module nalu_cuda._C. Importing it loads this library, whose static
// initialisers register the ops with the dispatcher (they are reached as torch.ops.nalu_cuda.*);
// the module itself only reports how the library was built.
#include <pybind11/pybind11.h>

#ifndef NALU_CUDA_VERSION
#define NALU_CUDA_VERSION "unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "nalu_cuda native ops (registered as torch.ops.nalu_cuda.*)";
  m.def("build_info", []() {
    pybind11::dict info;
    info["version"] = NALU_CUDA_VERSION;
#ifdef _OPENMP
    info["openmp"] = true;
#else
    info["openmp"] = false;
#endif
#ifdef NALU_CUDA_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    return info;
  });
}
