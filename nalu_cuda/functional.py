"""The fused ops as differentiable functions, with the signatures of :mod:`nalu_cuda.reference`.

Each function is one call of a ``torch.ops.nalu_cuda`` op forward and one call of its backward
op in the backward pass. Shapes and conventions are those of :mod:`nalu_cuda.reference`.
Errors (wrong shapes, dtypes, devices, eps) come from the op and name it and the argument.

In eager mode the call goes through ``nalu_cuda._C``'s direct bindings of the same ops (the same
dispatcher call, without ``torch.ops``' per-call argument parsing, which costs more than the
fused forward itself at small sizes); while ``torch.compile`` traces, through ``torch.ops``.

The functions live with their family's specification, fakes and flop formulas in
:mod:`nalu_cuda.ops` (:mod:`~nalu_cuda.ops.nac_nalu`, :mod:`~nalu_cuda.ops.nau_nmu`,
:mod:`~nalu_cuda.ops.power`); this module is their one public name, listed from the families'
``FUNCTIONAL`` tables (:data:`nalu_cuda.ops.FAMILIES`).
"""
from __future__ import annotations

from .ops import export

__all__ = export(globals(), "FUNCTIONAL")
