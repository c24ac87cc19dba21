"""Compatibility module: the layers of the units beyond the paper, now at home with their family's
ops and specification: :class:`NPU`, :class:`RealNPU` and :class:`INALU` in
:mod:`nalu_cuda.ops.power`, :class:`NAU`, :class:`NMU` and :func:`project_after_step` in
:mod:`nalu_cuda.ops.nau_nmu`. The names stay importable from here (and from :mod:`nalu_cuda`), so
that earlier code and pickled models (``torch.save(model)``) still find them.
"""
from .ops.nau_nmu import NAU, NMU, _ProjectedUnit, project_after_step  # noqa: F401  (_ProjectedUnit: isinstance checks)
from .ops.power import INALU, NPU, RealNPU, _PowerLayer  # noqa: F401

__all__ = ["NPU", "RealNPU", "INALU", "NAU", "NMU", "project_after_step"]
