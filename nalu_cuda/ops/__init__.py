"""The native ops on the Python side, one module per unit family, as ``csrc/ops/<family>/`` holds
their kernels:

* :mod:`._common`: the loading of the library (``nalu_cuda._C``, or ``NALU_CUDA_LIBRARY``), the op
  lists read back from its schemas (``OP_NAMES``, ``UNIT_OP_NAMES``, ``TRAINING_OP_NAMES``,
  ``OP_FAMILIES``), ``has_kernel``, ``KERNEL_DTYPES``, the metadata checks the fakes are made of and
  the flop-counting units (counterpart of ``csrc/common/``);
* :mod:`.nac_nalu` (NAC+, NAC*, NALU), :mod:`.nau_nmu` (NAU, NMU), :mod:`.power` (NPU, RealNPU,
  iNALU): each its family's fakes (``torch.library.register_fake``, so ``torch.compile`` traces the
  ops), its flop-counter formulas and its thin wrappers (the differentiable functions
  :mod:`nalu_cuda.functional` re-exports);
* :mod:`.training`: the fake of the experiments' op (``csrc/experiments/``).

Importing this package loads the library and registers every fake and formula. ``nalu_cuda._ops``
re-exports the names other code reads (``ops``, ``fast``, ``OP_NAMES``, ``KERNEL_DTYPES``, ...).
"""
from . import _common, nac_nalu, nau_nmu, power, training  # noqa: F401  (training: importing registers its fake)

__all__ = ["nac_nalu", "nau_nmu", "power", "training"]

if _common.ops is not None:
    for _family in (nac_nalu, nau_nmu, power):
        _family._register_fakes()
        _family._register_flop_formulas()
    del _family
