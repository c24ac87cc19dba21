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

import math
from typing import Optional

import torch
from torch import Tensor

from ..layers_base import Generators, _ArithmeticLayer, _check_scalar as _check_layer_scalar
from . import _common
from ._common import DEFAULT_EPS, _check_spec_scalar, _clamp, _matmul, _per_member
from ._common import (_check_float, _check_match, _check_scalar, _check_x_matches, _fail, _grad_or_empty, _like,
                      _matmul_flops, _ops_or_raise, _product_flops)
from .nac_nalu import _nalu_out_shape, reference_nac_weight

# The (device type, dtype) pairs of nalu_cuda.ops._common.KERNEL_DTYPES where the power units and
# iNALU have kernels too (npu_forward, inalu_forward: registered together).
POWER_KERNEL_DTYPES = frozenset(
    (dev, dt) for dev, dt in _common.KERNEL_DTYPES
    if _common.has_kernel(dev, "npu_forward") and _common.has_kernel(dev, "inalu_forward")
)


# ------------------------------------------------------------------------------------------------
# The specification: plain differentiable PyTorch, what the fused ops are tested against
# (nalu_cuda.reference lists it under the names without ``reference_``). Formulas as the published
# numbers were produced (the authors' code); see also csrc/ops/power/math.h.
# ------------------------------------------------------------------------------------------------

DEFAULT_OMEGA = 20.0


def reference_npu(x: Tensor, W_r: Tensor, W_i: Optional[Tensor], g: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Neural Power Unit (Heim et al., 2020): the real part of a complex power of the inputs.

    ``r = g (|x| + eps) + (1 - g)``, ``k = g pi [x < 0]`` with the relevance gate ``g`` (shape
    ``(in,)``, ``(E, in)`` for an ensemble) clamped to [0, 1];
    ``y = exp(log(r) W_r - k W_i) cos(k W_r + log(r) W_i)``. ``W_i=None`` is the RealNPU
    (``W_i = 0``): ``y = exp(log(r) W_r) cos(k W_r)``. A gate of 0 ignores its input (r = 1, k = 0).
    """
    _check_spec_scalar("npu", "eps", eps, x.dtype)
    gc = _per_member(_clamp(g, 0.0, 1.0), x, W_r.dim() == 3)
    r = gc * (x.abs() + eps) + (1 - gc)
    k = gc * math.pi * (x < 0).to(x.dtype)
    lr = torch.log(r)
    if W_i is None:
        return torch.exp(_matmul(lr, W_r)) * torch.cos(_matmul(k, W_r))
    U = _matmul(lr, W_r) - _matmul(k, W_i)
    V = _matmul(k, W_r) + _matmul(lr, W_i)
    return torch.exp(U) * torch.cos(V)


def reference_real_npu(x: Tensor, W_r: Tensor, g: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """RealNPU: :func:`reference_npu` with ``W_i = 0``, ``y = exp(log(r) W_r) cos(k W_r)``."""
    return reference_npu(x, W_r, None, g, eps)


def reference_inalu(
    x: Tensor,
    W_hat: Tensor,
    M_hat: Tensor,
    W_hat_m: Tensor,
    M_hat_m: Tensor,
    G: Tensor,
    eps: float = DEFAULT_EPS,
    omega: float = DEFAULT_OMEGA,
) -> Tensor:
    """iNALU (Schlör et al., 2020): ``y = g a + (1 - g) m clip(msv, -1, 1)``.

    Separate weights ``W = tanh(W_hat) sigmoid(M_hat)`` and ``W_m`` likewise from ``W_hat_m``,
    ``M_hat_m``; ``a = x W``; ``m = exp(min(log(max(|x|, eps)) W_m, omega))`` (eps a floor, not
    added, and the exponent clipped at omega); the sign ``msv = prod_i (sign(x_i) |W_m[i]| + 1 -
    |W_m[i]|)``, the NMU-like product that gives ``m`` the sign of the inputs it uses; the
    input-independent gate ``g = sigmoid(G)``, ``G`` of shape ``(out,)`` (``(E, out)``).
    """
    _check_spec_scalar("inalu", "eps", eps, x.dtype)
    _check_spec_scalar("inalu", "omega", omega, x.dtype, positive=False)
    W = reference_nac_weight(W_hat, M_hat)
    W_m = reference_nac_weight(W_hat_m, M_hat_m)
    a = _matmul(x, W)
    m = torch.exp(_matmul(torch.log(x.abs().clamp_min(eps)), W_m).clamp(max=omega))
    W_abs = W_m.abs()
    if W_m.dim() == 3:  # (E, I, O) -> (E, 1, ..., 1, I, O) against x (E, ..., I, 1)
        W_abs = W_abs.reshape(W_abs.shape[0], *([1] * (x.dim() - 2)), *W_abs.shape[1:])
    msv = (torch.sign(x).unsqueeze(-1) * W_abs + 1 - W_abs).prod(dim=-2)
    g = _per_member(torch.sigmoid(G), x, W_hat.dim() == 3)
    return g * a + (1 - g) * (m * msv.clamp(-1, 1))


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


# ------------------------------------------------------------------------------------------------
# The layers; initialisations as in the authors' code, see the class docstrings.
# ------------------------------------------------------------------------------------------------


class _PowerLayer(_ArithmeticLayer):
    """What NPU, RealNPU and INALU share: the fused path where their kernels exist."""

    _kernel_dtypes = POWER_KERNEL_DTYPES

    def _check_scalar(self, name: str, value, positive: bool = True, dtype=None) -> float:
        return _check_layer_scalar(type(self).__name__, name, value, positive, dtype or torch.get_default_dtype())


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
        fn = npu if self.use_fused(x) else reference_npu
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
                 omega: float = DEFAULT_OMEGA, ensemble: Optional[int] = None, backend: str = "auto",
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
        return reference_nac_weight(self.W_hat, self.M_hat)

    @property
    def W_m(self) -> Tensor:
        """The effective weights of the multiplicative path, ``tanh(W_hat_m) * sigmoid(M_hat_m)``."""
        return reference_nac_weight(self.W_hat_m, self.M_hat_m)

    def forward(self, x: Tensor) -> Tensor:
        fn = inalu if self.use_fused(x) else reference_inalu
        return fn(x, self.W_hat, self.M_hat, self.W_hat_m, self.M_hat_m, self.G, self.eps, self.omega)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, eps={self.eps}, omega={self.omega}, backend={self.backend!r}"


# What this family adds to the public names: nalu_cuda.reference, nalu_cuda.functional and the
# package itself list these (nalu_cuda.ops.FAMILIES).
REFERENCE = {"npu": reference_npu, "real_npu": reference_real_npu, "inalu": reference_inalu, "DEFAULT_OMEGA": DEFAULT_OMEGA}
FUNCTIONAL = {"npu": npu, "real_npu": real_npu, "inalu": inalu}
PUBLIC = {"NPU": NPU, "RealNPU": RealNPU, "INALU": INALU}
