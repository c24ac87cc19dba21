"""The native ops on the Python side, one module per unit family, as ``csrc/ops/<family>/`` holds
their kernels:

* :mod:`._common`: the loading of the library (``nalu_cuda._C``, or ``NALU_CUDA_LIBRARY``), the op
  lists read back from its schemas (``OP_NAMES``, ``UNIT_OP_NAMES``, ``TRAINING_OP_NAMES``,
  ``OP_FAMILIES``), ``has_kernel``, ``KERNEL_DTYPES``, the metadata checks the fakes are made of and
  the flop-counting units (counterpart of ``csrc/common/``);
* :mod:`.nac_nalu` (NAC+, NAC*, NALU), :mod:`.nau_nmu` (NAU, NMU), :mod:`.power` (NPU, RealNPU,
  iNALU), listed in :data:`FAMILIES`: each its family's specification (pure PyTorch, listed by
  :mod:`nalu_cuda.reference`), fakes (``torch.library.register_fake``, so ``torch.compile`` traces
  the ops), flop-counter formulas, thin wrappers (the differentiable functions of
  :mod:`nalu_cuda.functional`) and layers (``nalu_cuda.NALU``, ...), and the tables ``REFERENCE``, ``FUNCTIONAL`` and ``PUBLIC`` of the
  names it adds to :mod:`nalu_cuda.reference`, :mod:`nalu_cuda.functional` and :mod:`nalu_cuda`;
* :mod:`.training`: the fake of the experiments' op (``csrc/experiments/``).

Importing this package loads the library and registers every fake and formula. ``nalu_cuda._ops``
re-exports the names other code reads (``ops``, ``fast``, ``OP_NAMES``, ``KERNEL_DTYPES``, ...).
"""
from . import _common, nac_nalu, nau_nmu, power, training  # noqa: F401  (training: importing registers its fake)

__all__ = ["FAMILIES", "export", "nac_nalu", "nau_nmu", "power", "training"]

# The unit families, in the order their names are listed: a new family is one module here (its
# specification, fakes, flop formulas, wrappers, layers and the REFERENCE / FUNCTIONAL / PUBLIC tables
# of its public names) and its entry in this tuple.
FAMILIES = (nac_nalu, nau_nmu, power)


def export(namespace: dict, table: str) -> list:
    """Put every family's ``table`` (``"REFERENCE"``, ``"FUNCTIONAL"`` or ``"PUBLIC"``) into a module's
    ``namespace`` (its ``globals()``); the names, for its ``__all__``."""
    names = []
    for family in FAMILIES:
        entries = getattr(family, table)
        namespace.update(entries)
        names += list(entries)
    return names

if _common.ops is not None:
    for _family in FAMILIES:
        _family._register_fakes()
        _family._register_flop_formulas()
    del _family
