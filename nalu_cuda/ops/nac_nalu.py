"""The NAC/NALU family (``csrc/ops/nac_nalu/``): NAC+, NAC* and the NALU, in one place.

* the fakes (``torch.library.register_fake``: shapes only, so ``torch.compile`` traces the ops
  without running them), with the checks and messages of ``csrc/ops/nac_nalu/checks.cpp``;
* the flop-counter formulas (``torch.utils.flop_counter``) of its ops;
* the thin wrappers, the fused ops as differentiable functions (:func:`nac_weight`, :func:`nac`,
  :func:`nac_mul`, :func:`nalu`, :func:`nalu_parts`, :func:`nalu_gate_regularizer`:
  :mod:`nalu_cuda.functional`'s);
* the specification they are tested against, with the same signatures (:func:`reference_nac`, ...:
  :mod:`nalu_cuda.reference`'s ``nac``, ...), and the conventions it shares with them
  (:class:`NaluParts`, :data:`GATES`, :func:`log_abs`).

* the layers :class:`NAC`, :class:`NACMul` and :class:`NALU` (``nalu_cuda.NALU``, ...).

``REFERENCE``, ``FUNCTIONAL`` and ``PUBLIC`` at the end say which names this family adds to
:mod:`nalu_cuda.reference`, :mod:`nalu_cuda.functional` and :mod:`nalu_cuda`.

Its shape checks (``_nac_out_shape``, ``_nalu_out_shape``) are iNALU's too (:mod:`.power`), as
``csrc/ops/power/`` includes ``csrc/ops/nac_nalu/checks.h``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import init_presets
from ..layers_base import _ArithmeticLayer, _check_scalar as _check_layer_scalar
from . import _common
from ._common import DEFAULT_EPS, _check_spec_scalar, _matmul, _per_member
from ._common import (_check_float, _check_match, _check_pair, _check_scalar, _check_x_matches, _fail, _fast,
                      _grad_or_empty, _like, _matmul_flops, _ops_or_raise)

# ------------------------------------------------------------------------------------------------
# The specification: plain differentiable PyTorch, what the fused ops are tested against
# (nalu_cuda.reference lists it under the names without ``reference_``).
# ------------------------------------------------------------------------------------------------

GATES = ("input", "independent")


def reference_nac_weight(W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """``W = tanh(W_hat) * sigmoid(M_hat)``, elementwise; any shape."""
    return torch.tanh(W_hat) * torch.sigmoid(M_hat)


def log_abs(x: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """``log(|x| + eps)``, whose gradient is ``sign(x) / (|x| + eps)`` with ``sign(0) = 0``.

    A zero x takes the constant branch of the ``where``, so its gradient is exactly 0; through
    ``abs`` it would be ``sign(0) * (upstream / eps)``, which is 0 * inf = NaN once the quotient
    overflows (a subnormal eps, or a large upstream gradient)."""
    return torch.log(torch.where(x == 0, eps, torch.abs(x) + eps))


def reference_nac(x: Tensor, W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """NAC+ (additive accumulator): ``y = x W``."""
    return _matmul(x, reference_nac_weight(W_hat, M_hat))


def reference_nac_mul(x: Tensor, W_hat: Tensor, M_hat: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """NAC* (multiplicative accumulator): ``y = exp(log(|x| + eps) W)``."""
    _check_spec_scalar("nac_mul", "eps", eps, x.dtype)
    return torch.exp(_matmul(log_abs(x, eps), reference_nac_weight(W_hat, M_hat)))


class NaluParts(NamedTuple):
    """The intermediates of one NALU call: additive path ``a``, multiplicative path ``m``, gate ``g``
    (``g`` has the shape of ``y`` for an input gate, of ``G`` for an independent one)."""

    a: Tensor
    m: Tensor
    g: Tensor


def _check_gate(fn: str, gate: str, G_bias: Optional[Tensor], W_hat: Tensor) -> None:
    """The checks of ``gate`` and of ``G_bias`` against it and ``W_hat``, for :func:`nalu_parts` and the fused
    :func:`nalu_cuda.functional.nalu` and ``nalu_parts`` (``fn`` names the function in the message)."""
    if gate not in GATES:
        raise ValueError(f"nalu_cuda.{fn}: argument 'gate' must be one of {GATES}, got {gate!r}")
    if G_bias is None:
        return
    if gate != "input":
        raise ValueError(f"nalu_cuda.{fn}: argument 'G_bias' needs gate='input', got gate={gate!r}")
    want = tuple(W_hat.shape[:-2]) + (W_hat.shape[-1],)
    if tuple(G_bias.shape) != want:
        raise ValueError(f"nalu_cuda.{fn}: argument 'G_bias' must have shape {list(want)} (the outputs, per member), "
                         f"got {list(G_bias.shape)}")


def reference_nalu_parts(
    x: Tensor,
    W_hat: Tensor,
    M_hat: Tensor,
    G: Tensor,
    W_hat_m: Optional[Tensor] = None,
    M_hat_m: Optional[Tensor] = None,
    eps: float = DEFAULT_EPS,
    gate: str = "input",
    G_bias: Optional[Tensor] = None,
    gate_regularizer: bool = False,
):
    """:func:`reference_nalu` returning ``(y, a, m, g)``: the output and its :class:`NaluParts`; with
    ``gate_regularizer``, ``(y, a, m, g, r)``, ``r`` the gate regulariser of ``g``
    (:func:`reference_nalu_gate_regularizer`: ``sum(g^2 (1 - g)^2)`` over all of ``g``)."""
    _check_gate("reference.nalu", gate, G_bias, W_hat)
    if (W_hat_m is None) != (M_hat_m is None):
        raise ValueError("nalu_cuda.reference.nalu: give both 'W_hat_m' and 'M_hat_m' (separate weights) or neither")
    _check_spec_scalar("nalu", "eps", eps, x.dtype)
    W = reference_nac_weight(W_hat, M_hat)
    W_m = W if W_hat_m is None else reference_nac_weight(W_hat_m, M_hat_m)
    a = _matmul(x, W)
    m = torch.exp(_matmul(log_abs(x, eps), W_m))
    if gate == "input":
        z = _matmul(x, G)
        if G_bias is not None:  # (O,) or (E, O) -> against z of shape (..., O) or (E, ..., O)
            z = z + _per_member(G_bias, x, G_bias.dim() == 2)
        g = torch.sigmoid(z)
        g_b = g
    else:
        g = torch.sigmoid(G)
        g_b = g
        if W_hat.dim() == 3:  # (E, O) -> (E, 1, ..., 1, O) against y of shape (E, ..., O)
            g_b = g.reshape(g.shape[0], *([1] * (x.dim() - 2)), g.shape[-1])
    y = g_b * a + (1 - g_b) * m
    if gate_regularizer:
        return y, a, m, g, reference_nalu_gate_regularizer(g)
    return y, a, m, g


def reference_nalu_gate_regularizer(g: Tensor, per_member: bool = False) -> Tensor:
    """The gate regulariser ``sum(g^2 (1 - g)^2)`` (stable-nalu's ``nalu_gate='regualized'``: 0 exactly
    when every gate value is 0 or 1), over every element of ``g``, or with ``per_member`` one value
    per member of an ensemble's ``g`` ``(E, ...)``: ``(E,)``. ``g`` is a NALU's gate,
    :class:`NaluParts`' ``g``."""
    if per_member and g.dim() == 0:
        raise ValueError("nalu_cuda.reference.nalu_gate_regularizer: argument 'g' must have a leading member "
                         "dimension (E, ...) with per_member=True, got shape []")
    v = g ** 2 * (1 - g) ** 2
    return v.flatten(1).sum(1) if per_member and g.dim() > 1 else v if per_member else v.sum()


def reference_nalu(
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
    """NALU: ``y = g a + (1 - g) m`` with ``a = x W``, ``m = exp(log(|x| + eps) W_m)``.

    ``W_m`` is ``W`` unless ``W_hat_m`` and ``M_hat_m`` are given. ``g = sigmoid(x G)`` (plus
    ``G_bias`` when given) for ``gate="input"``, ``g = sigmoid(G)`` broadcast over the batch for
    ``gate="independent"``.
    """
    return reference_nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m, eps, gate, G_bias)[0]


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


def _gate_regularizer_shape(op: str, g: Tensor, per_member: bool) -> list:
    """The checks of ``csrc/ops/nac_nalu/checks.cpp``'s ``check_gate_regularizer``; the result's shape."""
    _check_float(op, "g", g)
    if per_member and g.dim() == 0:
        _fail(op, "argument 'g' must have a leading member dimension (E, ...) with per_member=True, got shape []")
    return [g.shape[0]] if per_member else []


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
    def _(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate, G_bias=None, gate_regularizer=False):
        shape = _nalu_out_shape("nalu_forward", x, W_hat, M_hat, W_hat_m, M_hat_m, G, input_gate, eps, G_bias)
        g = x.new_empty(shape) if input_gate else _like(G)
        r = x.new_empty(() if gate_regularizer else (0,))
        return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape), g, _like(x), r

    @reg("nalu_cuda::nalu_gate_regularizer")
    def _(g, per_member=False):
        return g.new_empty(_gate_regularizer_shape("nalu_gate_regularizer", g, per_member))

    @reg("nalu_cuda::nalu_gate_regularizer_backward")
    def _(grad, g, per_member=False):
        op = "nalu_gate_regularizer_backward"
        shape = _gate_regularizer_shape(op, g, per_member)
        if list(grad.shape) != shape:
            _fail(op, f"argument 'grad' must have the regulariser's shape {shape}, got {list(grad.shape)}")
        _check_match(op, "grad", grad, "g", g)
        return _like(g)

    @reg("nalu_cuda::nalu_backward")
    def _(grad_y, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx, eps, input_gate, compute_grad_x, G_bias=None,
          grad_a=None, grad_m=None, grad_g=None, grad_gate_regularizer=None):
        op = "nalu_backward"
        if grad_gate_regularizer is not None:
            if grad_gate_regularizer.dim() != 0:
                _fail(op, f"argument 'grad_gate_regularizer' must have the regulariser's shape [], got "
                          f"{list(grad_gate_regularizer.shape)}")
            _check_match(op, "grad_gate_regularizer", grad_gate_regularizer, "x", x)
            _check_match(op, "g", g, "x", x)
        _nalu_out_shape(op, x, W_hat, M_hat, W_hat_m, M_hat_m, G, input_gate, eps, G_bias)
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
    y, _a, _m, _g, _lx, _r = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input",
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
    gate_regularizer: bool = False,
):
    """:func:`nalu` returning ``(y, a, m, g)`` from the one fused forward, all four differentiable
    (see :func:`nalu_cuda.reference.nalu_parts`; ``g`` has ``G``'s shape for an independent gate).

    The same op as :func:`nalu`, whose ``a``, ``m``, ``g`` are differentiable outputs: their gradients
    (a gate regulariser, a loss on a path) go to the fused backward with ``dL/dy`` (its ``grad_a``,
    ``grad_m``, ``grad_g``), so keeping the parts costs what :func:`nalu` does.

    ``gate_regularizer=True`` returns ``(y, a, m, g, r)``, ``r`` the gate regulariser
    ``sum(g^2 (1 - g)^2)`` of ``g`` (:func:`nalu_gate_regularizer`'s value) from the same op and
    autograd node: its gradient goes to the fused backward too (its ``grad_gate_regularizer``)."""
    if G_bias is not None or gate not in GATES:
        _check_gate("functional.nalu_parts", gate, G_bias, W_hat)
    fast = _fast(x)
    if fast is not None:
        if gate_regularizer:
            return fast.nalu_parts_regularized(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input", G_bias)
        return fast.nalu_parts(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input", G_bias)
    y, a, m, g, _lx, r = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input",
                                                      G_bias, bool(gate_regularizer))
    return (y, a, m, g, r) if gate_regularizer else (y, a, m, g)


def nalu_gate_regularizer(g: Tensor, per_member: bool = False) -> Tensor:
    """The gate regulariser ``sum(g^2 (1 - g)^2)`` as one fused op and one autograd node (see
    :func:`nalu_cuda.reference.nalu_gate_regularizer`): its gradient ``2 g (1 - g) (1 - 2 g)`` reaches
    the gate, e.g. :func:`nalu_parts`' ``g``, whose fused backward takes it as ``grad_g``."""
    fast = _fast(g)
    if fast is not None:
        return fast.nalu_gate_regularizer(g, per_member)
    return _ops_or_raise().nalu_gate_regularizer(g, per_member)


# ------------------------------------------------------------------------------------------------
# The layers (the paper's): conventions (layout, ``backend``, ``init``, ``generator``) in
# nalu_cuda.modules' docstring.
# ------------------------------------------------------------------------------------------------


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
        return reference_nac_weight(self.W_hat, self.M_hat)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if self.use_fused(x):
            return nac(x, self.W_hat, self.M_hat)
        return reference_nac(x, self.W_hat, self.M_hat)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, backend={self.backend!r}"


class NACMul(_ArithmeticLayer):
    """Multiplicative NAC (NAC*): ``y = exp(log(|x| + eps) W)``, ``W = tanh(W_hat) * sigmoid(M_hat)``."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None,
                 init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        self.eps = _check_layer_scalar("NACMul", "eps", eps, dtype=dtype or torch.get_default_dtype())
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    W = NAC.W

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if self.use_fused(x):
            return nac_mul(x, self.W_hat, self.M_hat, self.eps)
        return reference_nac_mul(x, self.W_hat, self.M_hat, self.eps)

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
    (:class:`NaluParts`: ``a``, ``m``, ``g``), from the same forward and in the
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
        self.eps = _check_layer_scalar("NALU", "eps", eps, dtype=dtype or torch.get_default_dtype())
        self.tied = tied
        self.gate = gate
        self.keep_parts = keep_parts
        self.parts: Optional[NaluParts] = None
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
        return reference_nac_weight(self.W_hat, self.M_hat)

    @property
    def W_m(self) -> Tensor:
        """The effective weights of the multiplicative path (``W`` when tied)."""
        return self.W if self.tied else reference_nac_weight(self.W_hat_m, self.M_hat_m)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        fused = self.use_fused(x)
        if self.keep_parts:
            fn = nalu_parts if fused else reference_nalu_parts
            y, a, m, g = fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                            G_bias=self.G_bias)
            # a plain attribute (never a parameter, buffer or module): set directly, without
            # nn.Module.__setattr__'s registry checks, on every call
            object.__setattr__(self, "parts", NaluParts(a, m, g))
            return y
        fn = nalu if fused else reference_nalu
        return fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                  G_bias=self.G_bias)

    def extra_repr(self) -> str:
        extra = (", gate_bias=True" if self.gate_bias else "") + (", keep_parts=True" if self.keep_parts else "")
        init = "" if self.init == init_presets.DEFAULT else f", init={self.init!r}"
        return (f"{self._base_repr()}, eps={self.eps}, tied={self.tied}, gate={self.gate!r}{extra}{init}, "
                f"backend={self.backend!r}")


# What this family adds to the public names: nalu_cuda.reference, nalu_cuda.functional and the
# package itself list these (nalu_cuda.ops.FAMILIES).
REFERENCE = {"nac_weight": reference_nac_weight, "log_abs": log_abs, "nac": reference_nac, "nac_mul": reference_nac_mul,
             "nalu": reference_nalu, "nalu_parts": reference_nalu_parts, "NaluParts": NaluParts, "GATES": GATES,
             "nalu_gate_regularizer": reference_nalu_gate_regularizer}
FUNCTIONAL = {"nac_weight": nac_weight, "nac": nac, "nac_mul": nac_mul, "nalu": nalu, "nalu_parts": nalu_parts,
              "NaluParts": NaluParts, "nalu_gate_regularizer": nalu_gate_regularizer}
PUBLIC = {"NAC": NAC, "NACMul": NACMul, "NALU": NALU}
