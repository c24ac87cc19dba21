"""``nn.Module`` layers: :class:`NAC` (additive), :class:`NACMul` (multiplicative) and :class:`NALU`;
the units beyond the paper (NPU, RealNPU, INALU, NAU, NMU) are with their families in
:mod:`nalu_cuda.ops.power` and :mod:`nalu_cuda.ops.nau_nmu`, re-exported here. What every layer shares (:class:`_ArithmeticLayer`, the state-dict guard) is in
:mod:`nalu_cuda.layers_base`, which both modules import (neither imports the other's base).

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

from typing import Optional

import torch
from torch import Tensor

from . import functional, init_presets, reference
# The shared base and the state-dict guard; their names stay importable from here (nalu_cuda.compat
# reads them from this module).
from .layers_base import (BACKENDS, FOREIGN_LAYOUT, LAYOUT, STATE_DICT_KIND, STATE_DICT_MARK,  # noqa: F401
                          Generators, _ArithmeticLayer, _check_positive_int, _check_scalar, _layer_kind,
                          _layout_problem, _warn_fallback_once)
from .reference import DEFAULT_EPS, GATES
# The units beyond the paper live with their families (on the same base); their names stay
# importable from here.
from .ops.nau_nmu import NAU, NMU, project_after_step  # noqa: F401
from .ops.power import INALU, NPU, RealNPU  # noqa: F401

__all__ = ["NAC", "NACMul", "NALU", "NAU", "NMU", "NPU", "RealNPU", "INALU", "BACKENDS", "project_after_step"]


class NAC(_ArithmeticLayer):
    """Neural Accumulator (NAC+): ``y = x W``, ``W = tanh(W_hat) * sigmoid(M_hat)``, no bias.

    Input ``(..., in)`` gives ``(..., out)``; with ``ensemble=E``, ``(E, ..., in)`` gives ``(E, ..., out)``.
    """

    def __init__(self, in_features: int, out_features: int, *, ensemble: Optional[int] = None,
                 backend: str = "auto", device=None, dtype=None, init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    @property
    def W(self) -> Tensor:
        """The effective weights ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if self.use_fused(x):
            return functional.nac(x, self.W_hat, self.M_hat)
        return reference.nac(x, self.W_hat, self.M_hat)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, backend={self.backend!r}"


class NACMul(_ArithmeticLayer):
    """Multiplicative NAC (NAC*): ``y = exp(log(|x| + eps) W)``, ``W = tanh(W_hat) * sigmoid(M_hat)``."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None,
                 init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        self.eps = _check_scalar("NACMul", "eps", eps, dtype=dtype or torch.get_default_dtype())
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    W = NAC.W

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if self.use_fused(x):
            return functional.nac_mul(x, self.W_hat, self.M_hat, self.eps)
        return reference.nac_mul(x, self.W_hat, self.M_hat, self.eps)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, eps={self.eps}, backend={self.backend!r}"


class NALU(_ArithmeticLayer):
    """Neural Arithmetic Logic Unit: ``y = g a + (1 - g) m``.

    ``a = x W`` and ``m = exp(log(|x| + eps) W_m)`` with ``W = tanh(W_hat) * sigmoid(M_hat)``;
    ``W_m = W`` when ``tied=True`` (the paper), else built from its own ``W_hat_m``, ``M_hat_m``.
    ``gate="input"``: ``g = sigmoid(x G)``, ``G`` of shape ``(in, out)`` (the paper), or
    ``g = sigmoid(x G + G_bias)`` with ``gate_bias=True`` (stable-nalu's ``nalu_bias``; ``G_bias`` of
    shape ``(out,)``, initialised to 0); ``gate="independent"``: ``g = sigmoid(G)``, ``G`` of shape ``(out,)``.

    ``keep_parts=True`` keeps the gate and both paths of the last call in ``self.parts``
    (:class:`nalu_cuda.functional.NaluParts`: ``a``, ``m``, ``g``), from the same forward and in the
    autograd graph, so that a gate regulariser (``(parts.g * (1 - parts.g)).sum()``) trains ``G``.
    """

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS, tied: bool = True,
                 gate: str = "input", gate_bias: bool = False, keep_parts: bool = False,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None,
                 init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        if gate not in GATES:
            raise ValueError(f"nalu_cuda.NALU: argument 'gate' must be one of {GATES}, got {gate!r}")
        for name, flag in (("tied", tied), ("gate_bias", gate_bias), ("keep_parts", keep_parts)):
            if not isinstance(flag, bool):
                raise ValueError(f"nalu_cuda.NALU: argument '{name}' must be a bool, got {flag!r}")
        if gate_bias and gate != "input":
            raise ValueError("nalu_cuda.NALU: argument 'gate_bias' needs gate='input' (an input-independent "
                             f"gate sigmoid(G) is its own bias), got gate={gate!r}")
        self.eps = _check_scalar("NALU", "eps", eps, dtype=dtype or torch.get_default_dtype())
        self.tied = tied
        self.gate = gate
        self.keep_parts = keep_parts
        self.parts: Optional[functional.NaluParts] = None
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        if tied:
            self.register_parameter("W_hat_m", None)
            self.register_parameter("M_hat_m", None)
        else:
            self.W_hat_m = self._param(in_features, out_features)
            self.M_hat_m = self._param(in_features, out_features)
        self.G = self._param(in_features, out_features) if gate == "input" else self._param(out_features)
        self.G_bias = self._param(out_features) if gate_bias else None
        self.reset_parameters()

    @property
    def gate_bias(self) -> bool:
        return self.G_bias is not None

    def _init_roles(self):
        roles = [(self.W_hat, "nac"), (self.M_hat, "nac")]
        if not self.tied:
            roles += [(self.W_hat_m, "nac"), (self.M_hat_m, "nac")]
        roles.append((self.G, "gate" if self.gate == "input" else "gate_independent"))
        if self.G_bias is not None:
            roles.append((self.G_bias, "gate_bias"))
        return roles

    @property
    def W(self) -> Tensor:
        """The effective weights of the additive path, ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    @property
    def W_m(self) -> Tensor:
        """The effective weights of the multiplicative path (``W`` when tied)."""
        return self.W if self.tied else reference.nac_weight(self.W_hat_m, self.M_hat_m)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        fused = self.use_fused(x)
        if self.keep_parts:
            fn = functional.nalu_parts if fused else reference.nalu_parts
            y, a, m, g = fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                            G_bias=self.G_bias)
            self.parts = functional.NaluParts(a, m, g)
            return y
        fn = functional.nalu if fused else reference.nalu
        return fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                  G_bias=self.G_bias)

    def extra_repr(self) -> str:
        extra = (", gate_bias=True" if self.gate_bias else "") + (", keep_parts=True" if self.keep_parts else "")
        init = "" if self.init == init_presets.DEFAULT else f", init={self.init!r}"
        return (f"{self._base_repr()}, eps={self.eps}, tied={self.tied}, gate={self.gate!r}{extra}{init}, "
                f"backend={self.backend!r}")
