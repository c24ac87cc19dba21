"""The power family (``csrc/ops/power/``): the NPU, the RealNPU (the NPU's op with ``W_i = None``)
and iNALU.

* the fakes, with the checks of ``csrc/ops/power/checks.cpp`` (iNALU's: the NALU's of
  :mod:`.nac_nalu`, then ``omega``);
* the flop-counter formulas (RealNPU: lr W_r and k W_r; NPU: those two and lr W_i, k W_i; iNALU:
  a = x W, u = lx W_m, and its sign product msv as a product reduction);
* :data:`POWER_KERNEL_DTYPES`, where the family's fused kernels exist;
* the thin wrappers :func:`npu`, :func:`real_npu` and :func:`inalu`, which :mod:`nalu_cuda.functional`
  re-exports.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import DEFAULT_EPS, DEFAULT_OMEGA
from . import _common
from ._common import (_check_float, _check_match, _check_scalar, _check_x_matches, _fail, _grad_or_empty, _like,
                      _matmul_flops, _ops_or_raise, _product_flops)
from .nac_nalu import _nalu_out_shape

# The (device type, dtype) pairs of nalu_cuda.ops._common.KERNEL_DTYPES where the power units and
# iNALU have kernels too (npu_forward, inalu_forward: registered together).
POWER_KERNEL_DTYPES = frozenset(
    (dev, dt) for dev, dt in _common.KERNEL_DTYPES
    if _common.has_kernel(dev, "npu_forward") and _common.has_kernel(dev, "inalu_forward")
)


# ------------------------------------------------------------------------------------------------
# Fakes
# ------------------------------------------------------------------------------------------------


def _npu_out_shape(op: str, x: Tensor, W_r: Tensor, W_i: Optional[Tensor], g: Tensor, eps: float) -> list:
    """The checks of csrc/ops/power/checks.cpp (check_npu) on metadata; returns y's shape."""
    _check_float(op, "x", x)
    _check_float(op, "W_r", W_r)
    _check_match(op, "W_r", W_r, "x", x)
    if W_r.dim() not in (2, 3):
        _fail(op, f"argument 'W_r' must have shape (in, out) or (E, in, out), got {list(W_r.shape)}")
    if W_i is not None:
        _check_float(op, "W_i", W_i)
        _check_match(op, "W_i", W_i, "x", x)
        if W_i.shape != W_r.shape:
            _fail(op, f"argument 'W_i' must have the shape of 'W_r' {list(W_r.shape)}, got {list(W_i.shape)}")
    I, O = _check_x_matches(op, x, W_r, "W_r")
    _check_float(op, "g", g)
    _check_match(op, "g", g, "x", x)
    want = list(W_r.shape[:-2]) + [I]
    if list(g.shape) != want:
        _fail(op, f"argument 'g' (the relevance gate) must have shape {'(E, in)' if W_r.dim() == 3 else '(in,)'} = "
                  f"{want}, got {list(g.shape)}")
    _check_scalar(op, "eps", eps, x.dtype)
    return list(x.shape[:-1]) + [O]


def _inalu_out_shape(op: str, x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega) -> list:
    shape = _nalu_out_shape(op, x, W_hat, M_hat, W_hat_m, M_hat_m, G, False, eps)
    _check_scalar(op, "omega", omega, x.dtype, positive=False)
    return shape


def _register_fakes() -> None:
    reg = torch.library.register_fake

    @reg("nalu_cuda::npu_forward")
    def _(x, W_r, W_i, g, eps):
        shape = _npu_out_shape("npu_forward", x, W_r, W_i, g, eps)
        return x.new_empty(shape), x.new_empty(shape), _like(x)

    @reg("nalu_cuda::npu_backward")
    def _(grad_y, x, W_r, W_i, g, y, s, lr, eps, compute_grad_x):
        _npu_out_shape("npu_backward", x, W_r, W_i, g, eps)
        return _grad_or_empty(compute_grad_x, x, x), _like(W_r), _grad_or_empty(W_i is not None, W_r, x), _like(g)

    @reg("nalu_cuda::inalu_forward")
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega):
        shape = _inalu_out_shape("inalu_forward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega)
        return tuple(x.new_empty(shape) for _ in range(4)) + (_like(x),)

    @reg("nalu_cuda::inalu_backward")
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, u, msv, lx, eps, omega, compute_grad_x):
        _inalu_out_shape("inalu_backward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega)
        return (_grad_or_empty(compute_grad_x, x, x), _like(W_hat), _like(M_hat), _like(W_hat_m), _like(M_hat_m),
                _like(G))


# ------------------------------------------------------------------------------------------------
# Flop counting. The NPU's backward always has the input-side products: the gate's gradient needs
# d lr and d k, with or without grad_x (the reference counts them too, g requiring grad). iNALU's
# sign product msv is a product reduction without an x gradient (sign(x) is flat).
# ------------------------------------------------------------------------------------------------


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import register_flop_formula

    ops = _common.ops

    @register_flop_formula(ops.npu_forward)
    def _(x, W_r, W_i, g, eps, *args, out_shape=None, **kwargs):
        return (4 if W_i is not None else 2) * _matmul_flops(x, W_r)

    @register_flop_formula(ops.npu_backward)
    def _(grad_y, x, W_r, W_i, g, y, s, lr, eps, compute_grad_x, *args, out_shape=None, **kwargs):
        return 2 * (4 if W_i is not None else 2) * _matmul_flops(x, W_r)

    @register_flop_formula(ops.inalu_forward)
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega, *args, out_shape=None, **kwargs):
        return 2 * _matmul_flops(x, W_hat) + _product_flops(x, W_hat_m)

    @register_flop_formula(ops.inalu_backward)
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, u, msv, lx, eps, omega, compute_grad_x,
          *args, out_shape=None, **kwargs):
        return (2 * (2 if compute_grad_x else 1) * _matmul_flops(x, W_hat)
                + _product_flops(x, W_hat_m, backward=True))


# ------------------------------------------------------------------------------------------------
# Wrappers (no direct bindings: always torch.ops)
# ------------------------------------------------------------------------------------------------


def npu(x: Tensor, W_r: Tensor, W_i: Optional[Tensor], g: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """NPU: ``y = exp(log(r) W_r - k W_i) cos(k W_r + log(r) W_i)``; see :func:`nalu_cuda.reference.npu`.
    ``W_i=None`` is the RealNPU."""
    y, _s, _lr = _ops_or_raise().npu_forward(x, W_r, W_i, g, eps)
    return y


def real_npu(x: Tensor, W_r: Tensor, g: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """RealNPU: :func:`npu` with ``W_i = 0``."""
    return npu(x, W_r, None, g, eps)


def inalu(
    x: Tensor,
    W_hat: Tensor,
    M_hat: Tensor,
    W_hat_m: Tensor,
    M_hat_m: Tensor,
    G: Tensor,
    eps: float = DEFAULT_EPS,
    omega: float = DEFAULT_OMEGA,
) -> Tensor:
    """iNALU: ``y = g a + (1 - g) m clip(msv, -1, 1)``; see :func:`nalu_cuda.reference.inalu`."""
    y, _a, _u, _msv, _lx = _ops_or_raise().inalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, omega)
    return y
