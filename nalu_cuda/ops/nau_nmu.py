"""The NAU/NMU family (``csrc/ops/nau_nmu/``): Madsen & Johansen's NAU and NMU, one weight ``W``.

* the fakes, with the checks of ``csrc/ops/nau_nmu/checks.cpp``'s ``check_unit``;
* the flop-counter formulas: the NAU is one product ``x clamp(W, -1, 1)``, counted as the reference's
  matrix product; the NMU is a product reduction, counted per factor by the library's rule
  (``nalu_cuda.ops._common.PRODUCT_*_FLOPS``), which the reference counts 0 for;
* the thin wrappers :func:`nau` and :func:`nmu`, which :mod:`nalu_cuda.functional` re-exports.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common
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
