"""Compatibility module: the names other code reads from ``nalu_cuda._ops``, now at home in
:mod:`nalu_cuda.ops` (one module per unit family: ``nac_nalu``, ``nau_nmu``, ``power``, with the
family's fakes, flop-counter formulas and wrappers; ``_common`` for the library loading, the op
lists and the shared checks).

Plain re-exports, bound once at import: the library is loaded once, so ``ops``, ``fast``,
``LOAD_ERROR`` and the lists are the objects of :mod:`nalu_cuda.ops._common`. (Rebinding a name
here, as a test's monkeypatch does, changes what readers of ``nalu_cuda._ops`` see, not the
wrappers', which read :mod:`nalu_cuda.ops._common`.)
"""
from .ops import _common
from .ops._common import (BUILD_INFO, KERNEL_DTYPES, LOAD_ERROR, OP_FAMILIES, OP_NAMES, PRODUCT_BACKWARD_FLOPS,
                          PRODUCT_FORWARD_FLOPS, PRODUCT_GRAD_X_FLOPS, TRAINING_OP_NAMES, UNIT_OP_NAMES, fast,
                          has_kernel, ops)
from .ops.power import POWER_KERNEL_DTYPES

_LIBRARY_FILE = _common._LIBRARY_FILE

__all__ = ["ops", "fast", "LOAD_ERROR", "BUILD_INFO", "OP_FAMILIES", "OP_NAMES", "UNIT_OP_NAMES",
           "TRAINING_OP_NAMES", "has_kernel", "KERNEL_DTYPES", "POWER_KERNEL_DTYPES", "PRODUCT_FORWARD_FLOPS",
           "PRODUCT_BACKWARD_FLOPS", "PRODUCT_GRAD_X_FLOPS"]
