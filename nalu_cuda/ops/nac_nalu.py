"""The NAC/NALU family (``csrc/ops/nac_nalu/``): NAC+, NAC* and the NALU, in one place.

* the fakes (``torch.library.register_fake``: shapes only, so ``torch.compile`` traces the ops
  without running them), with the checks and messages of ``csrc/ops/nac_nalu/checks.cpp``;
* the flop-counter formulas (``torch.utils.flop_counter``) of its ops;
* the thin wrappers, the fused ops as differentiable functions with the signatures of
  :mod:`nalu_cuda.reference` (:func:`nac_weight`, :func:`nac`, :func:`nac_mul`, :func:`nalu`,
  :func:`nalu_parts`), which :mod:`nalu_cuda.functional` re-exports.

Its shape checks (``_nac_out_shape``, ``_nalu_out_shape``) are iNALU's too (:mod:`.power`), as
``csrc/ops/power/`` includes ``csrc/ops/nac_nalu/checks.h``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import DEFAULT_EPS, GATES, _check_gate
from . import _common
from ._common import (_check_float, _check_match, _check_pair, _check_scalar, _check_x_matches, _fail, _fast,
                      _grad_or_empty, _like, _matmul_flops, _ops_or_raise)

# ------------------------------------------------------------------------------------------------
# Fakes: the same checks and messages as csrc/ops/nac_nalu/checks.cpp, on metadata only.
# ------------------------------------------------------------------------------------------------


def _nac_out_shape(op: str, x: Tensor, W_hat: Tensor, M_hat: Tensor, eps: Optional[float] = None) -> list:
    """The checks of ``x`` and the weight pair of a NAC layer (and of ``eps`` when given); returns y's shape."""
    _check_float(op, "x", x)
    _check_pair(op, W_hat, M_hat)
    _check_match(op, "W_hat", W_hat, "x", x)
    _, O = _check_x_matches(op, x, W_hat, "W_hat")
    if eps is not None:
        _check_scalar(op, "eps", eps, x.dtype)
    return list(x.shape[:-1]) + [O]


def _nalu_out_shape(op: str, x: Tensor, W_hat: Tensor, M_hat: Tensor, W_hat_m: Optional[Tensor],
                    M_hat_m: Optional[Tensor], G: Optional[Tensor], input_gate: bool, eps: float,
                    G_bias: Optional[Tensor] = None) -> list:
    """The NAC checks, then the separate weights of the multiplicative path, the gate, its bias and eps."""
    shape = _nac_out_shape(op, x, W_hat, M_hat)
    if (W_hat_m is None) != (M_hat_m is None):
        _fail(op, "separate multiplicative weights need both 'W_hat_m' and 'M_hat_m'")
    if W_hat_m is not None:
        _check_pair(op, W_hat_m, M_hat_m, "W_hat_m", "M_hat_m")
        if W_hat_m.shape != W_hat.shape:
            _fail(op, f"argument 'W_hat_m' must have the shape of 'W_hat' {list(W_hat.shape)}, "
                      f"got {list(W_hat_m.shape)}")
        _check_match(op, "W_hat_m", W_hat_m, "x", x)
    if G is not None:
        _check_float(op, "G", G)
        _check_match(op, "G", G, "x", x)
        if input_gate and G.shape != W_hat.shape:
            _fail(op, f"argument 'G' of an input-dependent gate must have the shape of 'W_hat' "
                      f"{list(W_hat.shape)}, got {list(G.shape)}")
        want = list(W_hat.shape[:-2]) + [W_hat.shape[-1]]
        if not input_gate and list(G.shape) != want:
            _fail(op, f"argument 'G' of an input-independent gate must have shape {want}, got {list(G.shape)}")
    if G_bias is not None:
        if not input_gate:
            _fail(op, "argument 'G_bias' needs an input-dependent gate (input_gate=True), got an input-independent gate")
        _check_float(op, "G_bias", G_bias)
        _check_match(op, "G_bias", G_bias, "x", x)
        want = list(W_hat.shape[:-2]) + [W_hat.shape[-1]]
        if list(G_bias.shape) != want:
            what = "(E, out)" if len(want) == 2 else "(out,)"
            _fail(op, f"argument 'G_bias' must have shape {what} = {want}, got {list(G_bias.shape)}")
    _check_scalar(op, "eps", eps, x.dtype)
    return shape


def _register_fakes() -> None:
    reg = torch.library.register_fake

    @reg("nalu_cuda::nac_weight")
    def _(W_hat, M_hat):
        _check_pair("nac_weight", W_hat, M_hat, layer_shape=False)
        return _like(W_hat)

    @reg("nalu_cuda::nac_weight_backward")
    def _(grad_W, W_hat, M_hat):
        _check_pair("nac_weight_backward", W_hat, M_hat, layer_shape=False)
        return _like(W_hat), _like(M_hat)

    @reg("nalu_cuda::nac_forward")
    def _(x, W_hat, M_hat):
        return x.new_empty(_nac_out_shape("nac_forward", x, W_hat, M_hat))

    @reg("nalu_cuda::nac_backward")
    def _(grad_y, x, W_hat, M_hat, compute_grad_x):
        _nac_out_shape("nac_backward", x, W_hat, M_hat)
        return _grad_or_empty(compute_grad_x, x, x), _like(W_hat), _like(M_hat)

    @reg("nalu_cuda::nac_mul_forward")
    def _(x, W_hat, M_hat, eps):
        return x.new_empty(_nac_out_shape("nac_mul_forward", x, W_hat, M_hat, eps)), _like(x)

    @reg("nalu_cuda::nac_mul_backward")
    def _(grad_y, x, W_hat, M_hat, y, lx, eps, compute_grad_x):
        _nac_out_shape("nac_mul_backward", x, W_hat, M_hat, eps)
        return _grad_or_empty(compute_grad_x, x, x), _like(W_hat), _like(M_hat)

    @reg("nalu_cuda::nalu_forward")
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias=None):
        shape = _nalu_out_shape("nalu_forward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, input_gate, eps, G_bias)
        g = x.new_empty(shape) if input_gate else _like(G)
        return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape), g, _like(x)

    @reg("nalu_cuda::nalu_backward")
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx, eps, input_gate, compute_grad_x, G_bias=None,
          grad_a=None, grad_m=None, grad_g=None):
        _nalu_out_shape("nalu_backward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, input_gate, eps, G_bias)
        sep = W_hat_m is not None
        return (
            _grad_or_empty(compute_grad_x, x, x),
            _like(W_hat),
            _like(M_hat),
            _grad_or_empty(sep, W_hat, x),
            _grad_or_empty(sep, W_hat, x),
            _like(G),
            _grad_or_empty(G_bias is not None, G_bias, x),
        )


# ------------------------------------------------------------------------------------------------
# Flop counting: as FlopCounterMode counts the reference's matrix products (2 flops per multiply-add;
# elementwise work counts 0 there, and here). Forward: one product per path (NAC: a = x W; NAC*:
# lx W; NALU: a = x W, u = lx W_m and, for an input gate, z = x G). Backward: per product, the
# weight gradient, and the input gradient when compute_grad_x.
# ------------------------------------------------------------------------------------------------


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import register_flop_formula

    ops = _common.ops
    register_flop_formula([ops.nac_forward, ops.nac_mul_forward])(_common._one_product_flops)
    register_flop_formula([ops.nac_backward, ops.nac_mul_backward])(_common._one_product_backward_flops)

    @register_flop_formula(ops.nalu_forward)
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, *args, out_shape=None, **kwargs):
        return (3 if input_gate else 2) * _matmul_flops(x, W_hat)

    @register_flop_formula(ops.nalu_backward)
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx, eps, input_gate, compute_grad_x,
          *args, out_shape=None, **kwargs):
        products = 3 if input_gate else 2
        return products * (2 if compute_grad_x else 1) * _matmul_flops(x, W_hat)


# ------------------------------------------------------------------------------------------------
# Wrappers: each one call of the forward op (through nalu_cuda._C's direct bindings in eager mode,
# torch.ops while compiling) and one call of its backward op in the backward pass.
# ------------------------------------------------------------------------------------------------


def nac_weight(W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """``W = tanh(W_hat) * sigmoid(M_hat)``."""
    fast = _fast(W_hat)
    if fast is not None:
        return fast.nac_weight(W_hat, M_hat)
    return _ops_or_raise().nac_weight(W_hat, M_hat)


def nac(x: Tensor, W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """NAC+: ``y = x W``."""
    fast = _fast(x)
    if fast is not None:
        return fast.nac(x, W_hat, M_hat)
    return _ops_or_raise().nac_forward(x, W_hat, M_hat)


def nac_mul(x: Tensor, W_hat: Tensor, M_hat: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """NAC*: ``y = exp(log(|x| + eps) W)``."""
    fast = _fast(x)
    if fast is not None:
        return fast.nac_mul(x, W_hat, M_hat, eps)
    y, _lx = _ops_or_raise().nac_mul_forward(x, W_hat, M_hat, eps)
    return y


def nalu(
    x: Tensor,
    W_hat: Tensor,
    M_hat: Tensor,
    G: Tensor,
    W_hat_m: Optional[Tensor] = None,
    M_hat_m: Optional[Tensor] = None,
    eps: float = DEFAULT_EPS,
    gate: str = "input",
    G_bias: Optional[Tensor] = None,
) -> Tensor:
    """NALU: ``y = g a + (1 - g) m``; see :func:`nalu_cuda.reference.nalu` (``G_bias``: an input gate's
    bias, an argument of the fused op)."""
    if G_bias is not None or gate not in GATES:
        _check_gate("functional.nalu", gate, G_bias, W_hat)
    fast = _fast(x)
    if fast is not None:
        return fast.nalu(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input", G_bias)
    y, _a, _m, _g, _lx = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input",
                                                      G_bias)
    return y


def nalu_parts(
    x: Tensor,
    W_hat: Tensor,
    M_hat: Tensor,
    G: Tensor,
    W_hat_m: Optional[Tensor] = None,
    M_hat_m: Optional[Tensor] = None,
    eps: float = DEFAULT_EPS,
    gate: str = "input",
    G_bias: Optional[Tensor] = None,
):
    """:func:`nalu` returning ``(y, a, m, g)`` from the one fused forward, all four differentiable
    (see :func:`nalu_cuda.reference.nalu_parts`; ``g`` has ``G``'s shape for an independent gate).

    The same op as :func:`nalu`, whose ``a``, ``m``, ``g`` are differentiable outputs: their gradients
    (a gate regulariser, a loss on a path) go to the fused backward with ``dL/dy`` (its ``grad_a``,
    ``grad_m``, ``grad_g``), so keeping the parts costs what :func:`nalu` does."""
    if G_bias is not None or gate not in GATES:
        _check_gate("functional.nalu_parts", gate, G_bias, W_hat)
    fast = _fast(x)
    if fast is not None:
        return fast.nalu_parts(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input", G_bias)
    y, a, m, g, _lx = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input", G_bias)
    return y, a, m, g
