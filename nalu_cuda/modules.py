"""``nn.Module`` layers: :class:`NAC` (additive), :class:`NACMul` (multiplicative) and :class:`NALU`.

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

Initialisation (``reset_parameters``), following Madsen & Johansen's stable-nalu:
``W_hat``, ``M_hat`` (and ``W_hat_m``, ``M_hat_m``) ~ U(-r, r) with
``r = min(0.5, sqrt(3) * sqrt(2 / (in + out)))``; an input gate ``G`` ~ Glorot uniform,
U(-sqrt(6 / (in + out)), +sqrt(6 / (in + out))); an input-independent gate ``G = 0`` (g = 1/2).
Passing ``generator`` (one ``torch.Generator``, or one per ensemble member) makes it reproducible;
member ``e`` initialised with generator ``g_e`` equals a single layer initialised with ``g_e``.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import _ops, functional, reference
from .reference import DEFAULT_EPS, GATES

__all__ = ["NAC", "NACMul", "NALU", "NAU", "NMU", "BACKENDS", "project_after_step"]

BACKENDS = ("auto", "fused", "reference")
Generators = Union[None, torch.Generator, Sequence[torch.Generator]]

_warned_fallback = False


def _warn_fallback_once() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"nalu_cuda: native extension not available ({_ops.LOAD_ERROR}); backend='auto' uses the "
            "pure-PyTorch reference path. Build with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_positive_int(cls: str, name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"nalu_cuda.{cls}: argument '{name}' must be a positive int, got {value!r}")


class _ArithmeticLayer(nn.Module):
    """What NAC, NACMul and NALU share: shapes, backend choice, initialisation helpers."""

    def __init__(self, in_features: int, out_features: int, ensemble: Optional[int], backend: str,
                 device=None, dtype=None) -> None:
        super().__init__()
        name = type(self).__name__
        _check_positive_int(name, "in_features", in_features)
        _check_positive_int(name, "out_features", out_features)
        _check_positive_int(name, "ensemble", ensemble, allow_none=True)
        if backend not in BACKENDS:
            raise ValueError(f"nalu_cuda.{name}: argument 'backend' must be one of {BACKENDS}, got {backend!r}")
        if backend == "fused" and _ops.ops is None:
            raise RuntimeError(
                f"nalu_cuda.{name}: backend='fused' needs the native extension, which failed to load: "
                f"{_ops.LOAD_ERROR}"
            )
        if backend == "auto" and _ops.ops is None:
            _warn_fallback_once()
        self.in_features = in_features
        self.out_features = out_features
        self.ensemble = ensemble
        self.backend = backend
        self._factory = {"device": device, "dtype": dtype}

    def _param(self, *shape: int) -> nn.Parameter:
        lead = () if self.ensemble is None else (self.ensemble,)
        return nn.Parameter(torch.empty(*lead, *shape, **self._factory))

    def _members(self, generator: Generators):
        """(index into the parameters, generator) per member; index () for a plain layer."""
        if self.ensemble is None:
            if generator is not None and not isinstance(generator, torch.Generator):
                raise ValueError(f"nalu_cuda.{type(self).__name__}.reset_parameters: a plain layer takes one "
                                 f"torch.Generator, got {type(generator).__name__}")
            return [((), generator)]
        if generator is None or isinstance(generator, torch.Generator):
            return [((e,), generator) for e in range(self.ensemble)]
        gens = list(generator)
        if len(gens) != self.ensemble:
            raise ValueError(f"nalu_cuda.{type(self).__name__}.reset_parameters: expected {self.ensemble} "
                             f"generators (one per member), got {len(gens)}")
        return [((e,), g) for e, g in enumerate(gens)]

    @property
    def nac_bound(self) -> float:
        std = math.sqrt(2.0 / (self.in_features + self.out_features))
        return min(0.5, math.sqrt(3.0) * std)

    def use_fused(self, x: Tensor) -> bool:
        """Whether a call on ``x`` runs the native ops (constant for a given device and dtype)."""
        if self.backend == "reference":
            return False
        if self.backend == "fused":
            return True
        return (x.device.type, x.dtype) in _ops.KERNEL_DTYPES

    def _base_repr(self) -> str:
        ens = "" if self.ensemble is None else f", ensemble={self.ensemble}"
        return f"in_features={self.in_features}, out_features={self.out_features}{ens}"


class NAC(_ArithmeticLayer):
    """Neural Accumulator (NAC+): ``y = x W``, ``W = tanh(W_hat) * sigmoid(M_hat)``, no bias.

    Input ``(..., in)`` gives ``(..., out)``; with ``ensemble=E``, ``(E, ..., in)`` gives ``(E, ..., out)``.
    """

    def __init__(self, in_features: int, out_features: int, *, ensemble: Optional[int] = None,
                 backend: str = "auto", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        r = self.nac_bound
        for idx, gen in self._members(generator):
            self.W_hat[idx].uniform_(-r, r, generator=gen)
            self.M_hat[idx].uniform_(-r, r, generator=gen)

    @property
    def W(self) -> Tensor:
        """The effective weights ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_fused(x):
            return functional.nac(x, self.W_hat, self.M_hat)
        return reference.nac(x, self.W_hat, self.M_hat)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, backend={self.backend!r}"


class NACMul(_ArithmeticLayer):
    """Multiplicative NAC (NAC*): ``y = exp(log(|x| + eps) W)``, ``W = tanh(W_hat) * sigmoid(M_hat)``."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)
        if not (isinstance(eps, (int, float)) and 0 < eps < math.inf):
            raise ValueError(f"nalu_cuda.NACMul: argument 'eps' must be a positive finite number, got {eps!r}")
        self.eps = float(eps)
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    reset_parameters = NAC.reset_parameters
    W = NAC.W

    def forward(self, x: Tensor) -> Tensor:
        if self.use_fused(x):
            return functional.nac_mul(x, self.W_hat, self.M_hat, self.eps)
        return reference.nac_mul(x, self.W_hat, self.M_hat, self.eps)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, eps={self.eps}, backend={self.backend!r}"


class NALU(_ArithmeticLayer):
    """Neural Arithmetic Logic Unit: ``y = g a + (1 - g) m``.

    ``a = x W`` and ``m = exp(log(|x| + eps) W_m)`` with ``W = tanh(W_hat) * sigmoid(M_hat)``;
    ``W_m = W`` when ``tied=True`` (the paper), else built from its own ``W_hat_m``, ``M_hat_m``.
    ``gate="input"``: ``g = sigmoid(x G)``, ``G`` of shape ``(in, out)`` (the paper);
    ``gate="independent"``: ``g = sigmoid(G)``, ``G`` of shape ``(out,)``.
    """

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS, tied: bool = True,
                 gate: str = "input", ensemble: Optional[int] = None, backend: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)
        if not (isinstance(eps, (int, float)) and 0 < eps < math.inf):
            raise ValueError(f"nalu_cuda.NALU: argument 'eps' must be a positive finite number, got {eps!r}")
        if gate not in GATES:
            raise ValueError(f"nalu_cuda.NALU: argument 'gate' must be one of {GATES}, got {gate!r}")
        if not isinstance(tied, bool):
            raise ValueError(f"nalu_cuda.NALU: argument 'tied' must be a bool, got {tied!r}")
        self.eps = float(eps)
        self.tied = tied
        self.gate = gate
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        if tied:
            self.register_parameter("W_hat_m", None)
            self.register_parameter("M_hat_m", None)
        else:
            self.W_hat_m = self._param(in_features, out_features)
            self.M_hat_m = self._param(in_features, out_features)
        self.G = self._param(in_features, out_features) if gate == "input" else self._param(out_features)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        r = self.nac_bound
        gate_bound = math.sqrt(6.0 / (self.in_features + self.out_features))
        for idx, gen in self._members(generator):
            self.W_hat[idx].uniform_(-r, r, generator=gen)
            self.M_hat[idx].uniform_(-r, r, generator=gen)
            if not self.tied:
                self.W_hat_m[idx].uniform_(-r, r, generator=gen)
                self.M_hat_m[idx].uniform_(-r, r, generator=gen)
            if self.gate == "input":
                self.G[idx].uniform_(-gate_bound, gate_bound, generator=gen)
            else:
                self.G[idx].zero_()

    @property
    def W(self) -> Tensor:
        """The effective weights of the additive path, ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    @property
    def W_m(self) -> Tensor:
        """The effective weights of the multiplicative path (``W`` when tied)."""
        return self.W if self.tied else reference.nac_weight(self.W_hat_m, self.M_hat_m)

    def forward(self, x: Tensor) -> Tensor:
        fn = functional.nalu if self.use_fused(x) else reference.nalu
        return fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate)

    def extra_repr(self) -> str:
        return (f"{self._base_repr()}, eps={self.eps}, tied={self.tied}, gate={self.gate!r}, "
                f"backend={self.backend!r}")


# ------------------------------------------------------------------------------------------------
# Madsen & Johansen's units ("Neural Arithmetic Units", ICLR 2020): NAU and NMU. One parameter W,
# (in, out) or (E, in, out), used as is by the forward; the published runs keep it in range by a
# projection after every optimiser step: ``project_()``, or ``project_after_step(optimizer, ...)``.
# ------------------------------------------------------------------------------------------------


class _ProjectedUnit(_ArithmeticLayer):
    """What NAU and NMU share: the weight ``W`` and its projection onto ``[low, high]``."""

    W_RANGE: tuple = (-1.0, 1.0)

    def __init__(self, in_features: int, out_features: int, ensemble: Optional[int], backend: str,
                 device, dtype) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)
        self.W = self._param(in_features, out_features)
        self.reset_parameters()

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
        return f"{self._base_repr()}, backend={self.backend!r}"


class NAU(_ProjectedUnit):
    """Neural addition unit: ``y = x clamp(W, -1, 1)``, no bias.

    Initialisation (``reset_parameters``): ``W ~ U(-r, r)``, ``r = min(0.5, sqrt(3) sqrt(2 / (in + out)))``.
    ``project_()`` clamps ``W`` to ``[-1, 1]``. Input ``(..., in)`` gives ``(..., out)``; with
    ``ensemble=E``, ``(E, ..., in)`` gives ``(E, ..., out)``.
    """

    W_RANGE = (-1.0, 1.0)
    _fused = staticmethod(functional.nau)
    _reference = staticmethod(reference.nau)

    def __init__(self, in_features: int, out_features: int, *, ensemble: Optional[int] = None,
                 backend: str = "auto", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        r = self.nac_bound
        for idx, gen in self._members(generator):
            self.W[idx].uniform_(-r, r, generator=gen)


class NMU(_ProjectedUnit):
    """Neural multiplication unit: ``y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o])``.

    Initialisation: ``W ~ U(0.25, 0.75)`` (the authors' code, which produced their tables; their
    paper's text speaks of variance 1/4). ``project_()`` clamps ``W`` to ``[0, 1]``. Shapes as
    for :class:`NAU`. The fused op never materialises the ``(..., in, out)`` factors.
    """

    W_RANGE = (0.0, 1.0)
    INIT_RANGE = (0.25, 0.75)
    _fused = staticmethod(functional.nmu)
    _reference = staticmethod(reference.nmu)

    def __init__(self, in_features: int, out_features: int, *, ensemble: Optional[int] = None,
                 backend: str = "auto", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype)

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        for idx, gen in self._members(generator):
            self.W[idx].uniform_(*self.INIT_RANGE, generator=gen)


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
