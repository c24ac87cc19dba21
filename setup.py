"""Build of nalu_cuda and its native extension nalu_cuda._C.

    pip install --no-build-isolation -e .

builds the CPU kernels (C++, OpenMP) always, and the CUDA kernels when the installed torch was
built with CUDA and a CUDA toolkit is found. Switches (environment variables):

    NALU_CUDA_FORCE_CUDA=1   build the CUDA kernels or fail
    NALU_CUDA_NO_CUDA=1      never build the CUDA kernels
    NALU_CUDA_DEBUG=1        -O0 -g instead of -O3 -g0
    TORCH_CUDA_ARCH_LIST     CUDA architectures (default: the local GPU's, else "8.0;9.0+PTX")
    MAX_JOBS                 parallel compile jobs
    CXX                      the C++ compiler (checked first: see _check_compiler)
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _default_cuda_home():
    # torch guesses CUDA_HOME from the nvcc on PATH; a wrapper script such as /usr/local/bin/nvcc
    # makes that guess /usr/local. Prefer the conventional toolkit location when it has nvcc.
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        if os.path.exists("/usr/local/cuda/bin/nvcc"):
            os.environ["CUDA_HOME"] = "/usr/local/cuda"


_default_cuda_home()

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _flag(name):
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _want_cuda():
    if _flag("NALU_CUDA_NO_CUDA"):
        return False
    have = torch.version.cuda is not None and CUDA_HOME is not None and (
        os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")) or shutil.which("nvcc") is not None
    )
    if _flag("NALU_CUDA_FORCE_CUDA") and not have:
        raise RuntimeError(
            "NALU_CUDA_FORCE_CUDA=1 but no CUDA build is possible: "
            f"torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={CUDA_HOME!r}"
        )
    return have


def _announce(sources, cuda):
    # The build takes minutes (about 8 on 2 cores) and pip shows nothing of it unless run with -v
    # (`pip install -v --no-build-isolation -e .`): say what is compiled, one line per source folder.
    groups = {}
    for src in sources:
        groups.setdefault(os.path.dirname(src), []).append(os.path.basename(src))
    print(f"nalu_cuda: building nalu_cuda._C from {len(sources)} sources ({'CPU and CUDA' if cuda else 'CPU only'}; "
          f"MAX_JOBS={os.environ.get('MAX_JOBS', 'all cores')}):", file=sys.stderr, flush=True)
    for folder, names in groups.items():
        print(f"nalu_cuda:   {folder}/: {', '.join(names)}", file=sys.stderr, flush=True)


CSRC = os.path.join(HERE, "csrc")  # the include root: every #include "..." of csrc/ is relative to it


def _sources(cuda):
    """Every source of the extension, by one rule that CMakeLists.txt repeats: each *.cpp under
    csrc/ (the Python module csrc/module.cpp included), those in a cuda/ folder and every *.cu only
    when building the CUDA kernels, never csrc/emulation/ (a developer tool)."""
    found = glob.glob("csrc/**/*.cpp", recursive=True) + (glob.glob("csrc/**/*.cu", recursive=True) if cuda else [])
    return sorted(p for p in found if not p.startswith("csrc/emulation/")
                  and (cuda or "/cuda/" not in p))


_PROBE = r"""#include <cstring>
#include <sstream>
extern "C" void f(long v, char* out) { std::ostringstream o; o << v; std::strcpy(out, o.str().c_str()); }
"""


def _check_compiler():
    """Fail early, with the remedy, on a C++ compiler whose shared libraries carry their own copy of
    libstdc++ (a wrapper that links it statically; seen as the default g++ of a GPU image): an
    extension built with it loads beside torch's libstdc++ and crashes (SIGSEGV) in its first error
    message, at the first integer it formats. The probe: a one-function library built with the
    compiler torch's build uses ($CXX, else c++) formats an integer in a process that has imported
    torch. A compiler that cannot build the probe is left to the build to report."""
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "probe.cpp"), os.path.join(d, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            if subprocess.run(shlex.split(cxx) + ["-shared", "-fPIC", "-O1", "-o", lib, src],
                              capture_output=True).returncode != 0:
                return
        except OSError:
            return
        code = ("import ctypes, torch; b = ctypes.create_string_buffer(32); "
                f"ctypes.CDLL({lib!r}).f(ctypes.c_long(12345), b); assert b.value == b'12345'")
        if subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0:
            raise RuntimeError(
                f"nalu_cuda: the C++ compiler {cxx!r} ($CXX, else c++) builds shared libraries that link their "
                "own copy of libstdc++ and crash formatting an integer beside torch: the extension would crash in "
                "its first error message. Build with a compiler that links libstdc++ dynamically, e.g. "
                "CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation -e .")


def _extension():
    _check_compiler()
    debug = _flag("NALU_CUDA_DEBUG")
    opt = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    sources = _sources(cuda=False)
    macros = [("NALU_CUDA_VERSION", f'"{VERSION}"')]
    # -fno-trapping-math lets gcc turn the selects of csrc/common/math.h into vector blends (it
    # changes no result: nothing here reads floating-point exception flags).
    cxx = opt + ["-fopenmp", "-fno-trapping-math", "-Wall", "-Wno-unknown-pragmas"]
    link = ["-fopenmp"]
    if _want_cuda():
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # No GPU to ask: Ampere and Hopper machine code, plus PTX for anything newer.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
        # The cuda/ folders' *.cpp (the ops: checks, cuBLAS calls, registration) go to the host
        # compiler, every *.cu (the kernels, no ATen headers) to nvcc.
        sources = _sources(cuda=True)
        macros.append(("NALU_CUDA_WITH_CUDA", None))
        nvcc = opt[:1] + ["-lineinfo"] if not debug else ["-O0", "-g", "-G"]
        _announce(sources, cuda=True)
        return CUDAExtension(
            "nalu_cuda._C",
            sources,
            include_dirs=[CSRC],
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=link,
        )
    _announce(sources, cuda=False)
    return CppExtension(
        "nalu_cuda._C", sources, include_dirs=[CSRC], define_macros=macros, extra_compile_args={"cxx": cxx},
        extra_link_args=link,
    )


def _have_ninja():
    # A machine without ninja (some GPU hosts) builds with setuptools' own compile loop. torch runs
    # `ninja` from PATH, so ask torch rather than whether the Python package imports.
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available()


setup(
    name="nalu_cuda",
    version=VERSION,
    packages=find_packages(include=["nalu_cuda", "nalu_cuda.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=_have_ninja())},
)
