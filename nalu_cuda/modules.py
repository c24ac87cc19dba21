"""The ``nn.Module`` layers under one name, and their conventions. Each layer lives with its unit
family's ops and specification: :class:`NAC` (additive), :class:`NACMul` (multiplicative) and
:class:`NALU` in :mod:`nalu_cuda.ops.nac_nalu`; NAU, NMU and ``project_after_step`` in
:mod:`nalu_cuda.ops.nau_nmu`; NPU, RealNPU and INALU in :mod:`nalu_cuda.ops.power`. They are
re-exported here (earlier code and pickled models that name ``nalu_cuda.modules`` keep working), with
the base's names: what every layer shares (:class:`_ArithmeticLayer`, the state-dict guard) is in
:mod:`nalu_cuda.layers_base`.

Parameters use the ``(in, out)`` layout of the paper's ``y = x W``; with ``ensemble=E`` every
parameter gains a leading ``E`` and the layer runs ``E`` independent models on ``x`` of shape
``(E, ..., in)``.

``backend`` chooses the implementation:

* ``"fused"``: the native ops (:mod:`nalu_cuda.functional`); an error where none exists.
* ``"reference"``: the pure-PyTorch specification (:mod:`nalu_cuda.reference`), any device/dtype.
* ``"auto"`` (default): fused where a kernel exists for the input's device and dtype, else the
  reference. If the native extension is missing, ``"auto"`` warns once and uses the reference,
  unless the environment sets ``NALU_CUDA_REQUIRE_EXT=1``, which makes it an import error.

Parameter names, shapes and ``state_dict`` keys are the same for every backend.

Initialisation (``reset_parameters``): the preset named by ``init`` (see
:mod:`nalu_cuda.init_presets`): ``"stable-nalu"`` (the default), ``"stable-nalu-nac"`` (stable-nalu's
NAC/NALU draws, in their order) or ``"kaiming"`` (kevinzakka/NALU-pytorch's, in their order).
Passing ``generator`` (one ``torch.Generator``, or one per ensemble member) makes it reproducible;
member ``e`` initialised with generator ``g_e`` equals a single layer initialised with ``g_e``.
"""
from __future__ import annotations

# The shared base and the state-dict guard; their names stay importable from here (nalu_cuda.compat
# reads them from this module).
from .layers_base import (BACKENDS, FOREIGN_LAYOUT, LAYOUT, STATE_DICT_KIND, STATE_DICT_MARK,  # noqa: F401
                          Generators, _ArithmeticLayer, _check_positive_int, _check_scalar, _layer_kind,
                          _layout_problem, _warn_fallback_once)
from .ops.nac_nalu import NAC, NALU, NACMul  # noqa: F401
from .ops.nau_nmu import NAU, NMU, project_after_step  # noqa: F401
from .ops.power import INALU, NPU, RealNPU  # noqa: F401

__all__ = ["NAC", "NACMul", "NALU", "NAU", "NMU", "NPU", "RealNPU", "INALU", "BACKENDS", "project_after_step"]
