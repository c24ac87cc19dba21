"""nalu_cuda: Neural Accumulators and Neural Arithmetic Logic Units (Trask et al., 2018) for
PyTorch, with fused CPU and CUDA kernels registered as torch custom ops.

    >>> import torch, nalu_cuda
    >>> layer = nalu_cuda.NALU(100, 2)            # weights (in, out): y = x W
    >>> y = layer(torch.rand(128, 100) + 1)       # (128, 2)

Modules: :class:`NAC`, :class:`NACMul`, :class:`NALU`; Madsen & Johansen's :class:`NAU`, :class:`NMU`
(with :func:`project_after_step` and :mod:`nalu_cuda.regularizers`); the power units :class:`NPU`,
:class:`RealNPU` and :class:`INALU`. Functions: :mod:`nalu_cuda.functional` (the fused ops) and
:mod:`nalu_cuda.reference` (the pure-PyTorch specification); the ops' fakes, flop formulas and
wrappers, one module per unit family: :mod:`nalu_cuda.ops`. Initialisation presets:
:mod:`nalu_cuda.init_presets`; other codebases' checkpoints and units: :mod:`nalu_cuda.compat`.
"""
from . import _ops, functional, init_presets, ops, reference, regularizers
from .layers_base import BACKENDS
from . import compat  # noqa: E402  (needs the layers)

__version__ = "0.1.0"
__all__ = ["BACKENDS", "functional", "reference", "regularizers", "init_presets", "compat",
           "has_extension", "build_info"]
# every unit family's layers (NAC, NACMul, NALU; NAU, NMU, project_after_step; NPU, RealNPU, INALU):
# its PUBLIC table
__all__ += ops.export(globals(), "PUBLIC")


def has_extension() -> bool:
    """True when the native ops are loaded (``torch.ops.nalu_cuda``)."""
    return _ops.ops is not None


def has_cuda_kernels() -> bool:
    """True when the loaded library has CUDA kernels."""
    return _ops.has_kernel("cuda")


def build_info() -> dict:
    """How the native library was built (version, OpenMP, CUDA), or {} when it is not loaded."""
    return dict(_ops.BUILD_INFO)
