"""``nn.Module`` layers of the units beyond the paper: the power units :class:`NPU`, :class:`RealNPU`
and :class:`INALU`, and Madsen & Johansen's :class:`NAU` and :class:`NMU` with
:func:`project_after_step`.

They share :class:`nalu_cuda.layers_base._ArithmeticLayer` (shapes, ensembles, ``backend``,
generators) with NAC, NACMul and NALU, and are re-exported from :mod:`nalu_cuda.modules` and
:mod:`nalu_cuda`. This module imports the base, not :mod:`nalu_cuda.modules` (which imports it).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from . import functional, init_presets, reference
from .layers_base import Generators, _ArithmeticLayer, _check_scalar
from .ops.power import POWER_KERNEL_DTYPES
from .reference import DEFAULT_EPS

__all__ = ["NPU", "RealNPU", "INALU", "NAU", "NMU", "project_after_step"]


# ------------------------------------------------------------------------------------------------
# Units beyond the paper (csrc/ops/power/math.h, nalu_cuda.reference.npu / inalu): initialisations as
# in the authors' code, see the class docstrings.
# ------------------------------------------------------------------------------------------------


class _PowerLayer(_ArithmeticLayer):
    """What NPU, RealNPU and INALU share: the fused path where their kernels exist."""

    _kernel_dtypes = POWER_KERNEL_DTYPES

    def _check_scalar(self, name: str, value, positive: bool = True, dtype=None) -> float:
        return _check_scalar(type(self).__name__, name, value, positive, dtype or torch.get_default_dtype())


class NPU(_PowerLayer):
    """Neural Power Unit (Heim, Pevný, Šmídl 2020): ``y = exp(log(r) W_r - k W_i) cos(k W_r + log(r) W_i)``.

    ``r = g (|x| + eps) + (1 - g)`` and ``k = g pi [x < 0]`` with the relevance gate ``g`` of
    shape ``(in,)`` (``(E, in)``), clamped to [0, 1] in the forward; :meth:`project_` clamps the
    parameter itself in place (call it after each optimiser step, as a projection, to keep the
    gate where its gradient is not cut by the clamp). Weights ``W_r``, ``W_i`` are ``(in, out)``.
    Published initialisation: ``W_r`` Glorot uniform U(-sqrt(6 / (in + out)), +sqrt(6 / (in + out))),
    ``W_i = 0``, ``g = 0.5``.
    """

    real = False

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)
        self.eps = self._check_scalar("eps", eps, dtype=dtype)
        self.W_r = self._param(in_features, out_features)
        if self.real:
            self.register_parameter("W_i", None)
        else:
            self.W_i = self._param(in_features, out_features)
        self.g = self._param(in_features)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        bound = math.sqrt(6.0 / (self.in_features + self.out_features))
        for idx, gen in self._members(generator):
            self.W_r[idx].uniform_(-bound, bound, generator=gen)
            if self.W_i is not None:
                self.W_i[idx].zero_()
            self.g[idx].fill_(0.5)

    @torch.no_grad()
    def project_(self) -> None:
        """Clamps the relevance gate ``g`` to [0, 1] in place (the authors' projection)."""
        self.g.clamp_(0.0, 1.0)

    def forward(self, x: Tensor) -> Tensor:
        fn = functional.npu if self.use_fused(x) else reference.npu
        return fn(x, self.W_r, self.W_i, self.g, self.eps)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, eps={self.eps}, backend={self.backend!r}"


class RealNPU(NPU):
    """RealNPU: the :class:`NPU` with ``W_i = 0`` (no ``W_i`` parameter), ``y = exp(log(r) W_r) cos(k W_r)``."""

    real = True


class INALU(_PowerLayer):
    """iNALU (Schlör, Ring, Hotho 2020): ``y = g a + (1 - g) m clip(msv, -1, 1)``.

    Separate weights: ``a = x W`` with ``W = tanh(W_hat) sigmoid(M_hat)``, and
    ``m = exp(min(log(max(|x|, eps)) W_m, omega))`` with ``W_m`` from ``W_hat_m``, ``M_hat_m``;
    the sign ``msv = prod_i (sign(x_i) |W_m[i]| + 1 - |W_m[i]|)``; the input-independent gate
    ``g = sigmoid(G)``, ``G`` of shape ``(out,)``. Parameter names are those of
    ``NALU(tied=False, gate="independent")``.
    Initialisation of the authors' scripts: ``W_hat``, ``W_hat_m`` ~ N(1, 0.1);
    ``M_hat``, ``M_hat_m`` ~ N(-1, 0.1); ``G`` ~ N(0, 0.1). Their re-initialisation on a stalled
    loss and their regulariser are in :mod:`nalu_cuda.regularizers`.
    """

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS,
                 omega: float = reference.DEFAULT_OMEGA, ensemble: Optional[int] = None, backend: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)
        self.eps = self._check_scalar("eps", eps, dtype=dtype)
        self.omega = self._check_scalar("omega", omega, positive=False, dtype=dtype)
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.W_hat_m = self._param(in_features, out_features)
        self.M_hat_m = self._param(in_features, out_features)
        self.G = self._param(out_features)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        for idx, gen in self._members(generator):
            self.W_hat[idx].normal_(1.0, 0.1, generator=gen)
            self.M_hat[idx].normal_(-1.0, 0.1, generator=gen)
            self.W_hat_m[idx].normal_(1.0, 0.1, generator=gen)
            self.M_hat_m[idx].normal_(-1.0, 0.1, generator=gen)
            self.G[idx].normal_(0.0, 0.1, generator=gen)

    def project_(self) -> None:
        """No projection: iNALU's parameters are unconstrained (the method exists for uniformity)."""

    @property
    def W(self) -> Tensor:
        """The effective weights of the additive path, ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    @property
    def W_m(self) -> Tensor:
        """The effective weights of the multiplicative path, ``tanh(W_hat_m) * sigmoid(M_hat_m)``."""
        return reference.nac_weight(self.W_hat_m, self.M_hat_m)

    def forward(self, x: Tensor) -> Tensor:
        fn = functional.inalu if self.use_fused(x) else reference.inalu
        return fn(x, self.W_hat, self.M_hat, self.W_hat_m, self.M_hat_m, self.G, self.eps, self.omega)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, eps={self.eps}, omega={self.omega}, backend={self.backend!r}"


# ------------------------------------------------------------------------------------------------
# Madsen & Johansen's units ("Neural Arithmetic Units", ICLR 2020): NAU and NMU. One parameter W,
# (in, out) or (E, in, out), used as is by the forward; the published runs keep it in range by a
# projection after every optimiser step: ``project_()``, or ``project_after_step(optimizer, ...)``.
# ------------------------------------------------------------------------------------------------


class _ProjectedUnit(_ArithmeticLayer):
    """What NAU and NMU share: the weight ``W`` and its projection onto ``[low, high]``."""

    W_RANGE: tuple = (-1.0, 1.0)
    INIT_ROLE: str = "nau"  # the role of ``W`` in nalu_cuda.init_presets

    def __init__(self, in_features: int, out_features: int, *, ensemble: Optional[int] = None,
                 backend: str = "auto", device=None, dtype=None, init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        self.W = self._param(in_features, out_features)
        self.reset_parameters()

    def _init_roles(self):
        return [(self.W, self.INIT_ROLE)]

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        """Draws ``W`` from the preset ``self.init`` (see :mod:`nalu_cuda.init_presets`): the default
        ``"stable-nalu"`` in ``(in, out)`` order, ``"stable-nalu-nac"`` the same distribution in
        stable-nalu's ``(out, in)`` order (their ``ReRegualizedLinearNAC`` / ``MNAC``: same seed, same numbers)."""
        init_presets.reset(type(self).__name__, self.init, self._init_roles(), self._members(generator),
                           self.in_features, self.out_features)

    @torch.no_grad()
    def project_(self) -> None:
        """Clamp ``W`` in place to ``W_RANGE``, as the published runs do after every optimiser step.

        A projection, outside autograd: call it after ``optimizer.step()``, or register it once
        with :func:`project_after_step`."""
        self.W.clamp_(*self.W_RANGE)

    def forward(self, x: Tensor) -> Tensor:
        fn = self._fused if self.use_fused(x) else self._reference
        return fn(x, self.W)

    def extra_repr(self) -> str:
        init = "" if self.init == init_presets.DEFAULT else f", init={self.init!r}"
        return f"{self._base_repr()}{init}, backend={self.backend!r}"


class NAU(_ProjectedUnit):
    """Neural addition unit: ``y = x clamp(W, -1, 1)``, no bias.

    Initialisation (``reset_parameters``): ``W ~ U(-r, r)``, ``r = min(0.5, sqrt(3) sqrt(2 / (in + out)))``,
    drawn in ``(in, out)`` order; ``init="stable-nalu-nac"`` draws in stable-nalu's ``(out, in)`` order
    (their ``ReRegualizedLinearNAC``: same seed, same numbers). ``project_()`` clamps ``W`` to
    ``[-1, 1]``. Input ``(..., in)`` gives ``(..., out)``; with
    ``ensemble=E``, ``(E, ..., in)`` gives ``(E, ..., out)``.
    """

    W_RANGE = (-1.0, 1.0)
    INIT_ROLE = "nau"
    _fused = staticmethod(functional.nau)
    _reference = staticmethod(reference.nau)


class NMU(_ProjectedUnit):
    """Neural multiplication unit: ``y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o])``.

    Initialisation: ``W ~ U(0.25, 0.75)`` (the authors' code, which produced their tables; their
    paper's text speaks of variance 1/4), in ``(in, out)`` order; ``init="stable-nalu-nac"`` draws in
    their ``(out, in)`` order (their ``ReRegualizedLinearMNAC``: same seed, same numbers).
    ``project_()`` clamps ``W`` to ``[0, 1]``. Shapes as
    for :class:`NAU`. The fused op never materialises the ``(..., in, out)`` factors.
    """

    W_RANGE = (0.0, 1.0)
    INIT_RANGE = (0.25, 0.75)
    INIT_ROLE = "nmu"
    _fused = staticmethod(functional.nmu)
    _reference = staticmethod(reference.nmu)


def project_after_step(optimizer: torch.optim.Optimizer, modules):
    """Register the projection of every NAU / NMU in ``modules`` (one module, or an iterable of
    modules, whose sub-modules are searched too) to run after each ``optimizer.step()``.

    Returns the hook's handle (``handle.remove()`` undoes it). Raises ValueError when no NAU or
    NMU is found (a projection that silently does nothing would hide a wrong argument).
    """
    if isinstance(modules, nn.Module):
        modules = [modules]
    units = [m for root in modules for m in root.modules() if isinstance(m, _ProjectedUnit)]
    if not units:
        raise ValueError("nalu_cuda.project_after_step: argument 'modules' must contain at least one NAU or NMU, "
                         "got none")

    def hook(_optimizer, _args, _kwargs):
        for unit in units:
            unit.project_()

    return optimizer.register_step_post_hook(hook)
