"""The NAU/NMU family (``csrc/ops/nau_nmu/``): Madsen & Johansen's NAU and NMU, one weight ``W``.

* the fakes, with the checks of ``csrc/ops/nau_nmu/checks.cpp``'s ``check_unit``;
* the flop-counter formulas: the NAU is one product ``x clamp(W, -1, 1)``, counted as the reference's
  matrix product; the NMU is a product reduction, counted per factor by the library's rule
  (``nalu_cuda.ops._common.PRODUCT_*_FLOPS``), which the reference counts 0 for;
* the thin wrappers :func:`nau` and :func:`nmu` (:mod:`nalu_cuda.functional`'s);
* the specification, :func:`reference_nau` and :func:`reference_nmu` (:mod:`nalu_cuda.reference`'s
  ``nau`` and ``nmu``);
* the layers :class:`NAU` and :class:`NMU` and :func:`project_after_step` (``nalu_cuda.NAU``, ...).

``REFERENCE``, ``FUNCTIONAL`` and ``PUBLIC`` at the end say which names this family adds to
:mod:`nalu_cuda.reference`, :mod:`nalu_cuda.functional` and :mod:`nalu_cuda`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import init_presets
from ..layers_base import Generators, _ArithmeticLayer
from . import _common
from ._common import _clamp, _matmul
from ._common import _check_float, _check_grad_y, _check_x_matches, _fail, _fast, _grad_or_empty, _like, _ops_or_raise

# ------------------------------------------------------------------------------------------------
# Fakes: one weight W, checks as csrc/ops/nau_nmu/checks.cpp's check_unit.
# ------------------------------------------------------------------------------------------------


def _unit_out_shape(op: str, x: Tensor, W: Tensor) -> list:
    _check_float(op, "x", x)
    _check_float(op, "W", W)
    if W.dim() not in (2, 3):
        _fail(op, f"argument 'W' must have shape (in, out) or (E, in, out), got {list(W.shape)}")
    if W.dtype != x.dtype:
        _fail(op, f"argument 'W' must have the dtype of 'x' ({x.dtype}), got {W.dtype}")
    if W.device != x.device:
        _fail(op, f"argument 'W' must be on the device of 'x' ({x.device}), got {W.device}")
    _, O = _check_x_matches(op, x, W, "W")
    return list(x.shape[:-1]) + [O]


def _register_fakes() -> None:
    reg = torch.library.register_fake

    def forward(name):
        @reg(f"nalu_cuda::{name}")
        def _(x, W):
            return x.new_empty(_unit_out_shape(name, x, W))

    def backward(name):
        @reg(f"nalu_cuda::{name}")
        def _(grad_y, x, W, compute_grad_x):
            _check_grad_y(name, grad_y, _unit_out_shape(name, x, W), x)
            return _grad_or_empty(compute_grad_x, x, x), _like(W)

    for unit in ("nau", "nmu"):
        forward(f"{unit}_forward")
        backward(f"{unit}_backward")


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import register_flop_formula

    ops = _common.ops
    register_flop_formula([ops.nau_forward])(_common._one_product_flops)
    register_flop_formula([ops.nau_backward])(_common._one_product_backward_flops)

    @register_flop_formula(ops.nmu_forward)
    def _(x, W, *args, out_shape=None, **kwargs):
        return _common._product_flops(x, W)

    @register_flop_formula(ops.nmu_backward)
    def _(grad_y, x, W, compute_grad_x, *args, out_shape=None, **kwargs):
        return _common._product_flops(x, W, backward=True, grad_x=compute_grad_x)


# ------------------------------------------------------------------------------------------------
# Wrappers
# ------------------------------------------------------------------------------------------------


def nau(x: Tensor, W: Tensor) -> Tensor:
    """NAU: ``y = x clamp(W, -1, 1)``; see :func:`nalu_cuda.reference.nau`."""
    fast = _fast(x)
    if fast is not None:
        return fast.nau(x, W)
    return _ops_or_raise().nau_forward(x, W)


def nmu(x: Tensor, W: Tensor) -> Tensor:
    """NMU: ``y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o])``, without materialising the
    factors; see :func:`nalu_cuda.reference.nmu`."""
    fast = _fast(x)
    if fast is not None:
        return fast.nmu(x, W)
    return _ops_or_raise().nmu_forward(x, W)


# ------------------------------------------------------------------------------------------------
# The specification: plain differentiable PyTorch, what the fused ops are tested against
# (nalu_cuda.reference lists it). The only parameter is W, (I, O) or (E, I, O), used as given: the
# published runs keep it in range by a projection after each optimiser step (NAU.project_,
# NMU.project_), not here.
# ------------------------------------------------------------------------------------------------


def reference_nau(x: Tensor, W: Tensor) -> Tensor:
    """The specification (:func:`nalu_cuda.reference.nau`). NAU (neural addition unit): ``y = x clamp(W, -1, 1)``."""
    return _matmul(x, _clamp(W, -1.0, 1.0))


def reference_nmu(x: Tensor, W: Tensor) -> Tensor:
    """The specification (:func:`nalu_cuda.reference.nmu`). NMU (neural multiplication unit): ``y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o])``.

    ``W = 0`` makes input i's factor the identity 1, ``W = 1`` makes it ``x_i``; no logarithm, so
    zero and negative inputs are fine. This specification materialises the ``(..., I, O)`` factors
    (the fused op does not).
    """
    if W.dim() == 3:  # (E, I, O) -> (E, 1, ..., 1, I, O) against x (E, ..., I, 1)
        W = W.reshape(W.shape[0], *([1] * (x.dim() - 2)), *W.shape[1:])
    factors = x.unsqueeze(-1) * W + (1 - W)
    return _ExclusiveProduct.apply(factors)


class _ExclusiveProduct(torch.autograd.Function):
    """``factors.prod(-2)`` whose gradient for factor i is the product of the other factors (prefix
    times suffix products, in the fused kernels' order), exact at zero and infinite factors:
    ``torch.prod``'s backward divides the result by the factor, NaN at an infinite one. The
    backward is differentiable (double backward)."""

    @staticmethod
    def forward(ctx, factors: Tensor) -> Tensor:
        ctx.save_for_backward(factors)
        return factors.prod(dim=-2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (f,) = ctx.saved_tensors
        n = f.shape[-2]
        if n == 0:
            return torch.zeros_like(f)
        ones = torch.ones_like(f.narrow(-2, 0, 1))
        prefix = torch.cat([ones, f.narrow(-2, 0, n - 1)], dim=-2).cumprod(dim=-2)
        suffix = torch.cat([f.narrow(-2, 1, n - 1), ones], dim=-2).flip(-2).cumprod(dim=-2).flip(-2)
        return grad.unsqueeze(-2) * (prefix * suffix)


# ------------------------------------------------------------------------------------------------
# The layers (Madsen & Johansen, "Neural Arithmetic Units", ICLR 2020). One parameter W, (in, out)
# or (E, in, out), used as is by the forward; the published runs keep it in range by a projection
# after every optimiser step: ``project_()``, or ``project_after_step(optimizer, ...)``.
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
    _fused = staticmethod(nau)
    _reference = staticmethod(reference_nau)


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
    _fused = staticmethod(nmu)
    _reference = staticmethod(reference_nmu)


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


# What this family adds to the public names: nalu_cuda.reference, nalu_cuda.functional and the
# package itself list these (nalu_cuda.ops.FAMILIES).
REFERENCE = {"nau": reference_nau, "nmu": reference_nmu}
FUNCTIONAL = {"nau": nau, "nmu": nmu}
PUBLIC = {"NAU": NAU, "NMU": NMU, "project_after_step": project_after_step}
