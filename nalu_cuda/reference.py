"""The pure-PyTorch reference: the executable specification of every nalu_cuda op.

Everything here is plain differentiable PyTorch; the fused ops (:mod:`nalu_cuda.functional`) are
tested against these functions for values and gradients.

Conventions
-----------
* Weight layout is ``(in, out)``, as in the paper's ``y = x W`` (not ``nn.Linear``'s ``(out, in)``).
* Shapes: weights ``(I, O)`` with ``x`` of shape ``(..., I)`` give ``y`` of shape ``(..., O)``.
  An *ensemble* of ``E`` independent layers has weights ``(E, I, O)`` and ``x`` of shape
  ``(E, ..., I)``; member ``e`` sees only ``x[e]`` and its own weights.
* ``W = tanh(W_hat) * sigmoid(M_hat)``: the effective weights, pushed towards {-1, 0, 1}.
* The log path is ``log(|x| + eps)`` (eps is *added*, not a floor); its derivative is
  ``sign(x) / (|x| + eps)`` with ``sign(0) = 0``, so a zero input contributes no gradient to x
  through the multiplicative path.
* Gates: ``gate="input"`` is the paper's ``g = sigmoid(x G)`` with ``G`` shaped like ``W``;
  ``gate="independent"`` is ``g = sigmoid(G)`` with ``G`` of shape ``(O,)`` (``(E, O)`` for an
  ensemble), the same for every input. An input gate may have a bias ``G_bias`` of shape ``(O,)``
  (``(E, O)``): ``g = sigmoid(x G + G_bias)`` (stable-nalu's ``nalu_bias``).
* ``W_hat_m`` / ``M_hat_m``: separate weights of the multiplicative path. ``None`` ties the two
  paths to one ``W``, as in the paper.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["DEFAULT_EPS", "DEFAULT_OMEGA", "scalar_problem", "nac_weight", "log_abs", "nac", "nac_mul", "nalu", "nalu_parts", "NaluParts",
           "GATES", "npu", "real_npu", "inalu", "nau", "nmu"]

DEFAULT_EPS = 1e-7
GATES = ("input", "independent")


def scalar_problem(name: str, value, dtype: Optional[torch.dtype] = None, positive: bool = True) -> Optional[str]:
    """What is wrong with a scalar argument (``eps``, ``omega``), or None: a real number (not a bool),
    finite and, for ``positive``, above 0; with ``dtype``, still so in the precision the ops compute
    in for tensors of that dtype (float64 for float64, float32 for every narrower type: an eps of
    1e-50 is 0 in float32 and 1e39 is inf). The fused ops' checks (csrc/common/checks.cpp
    ``check_scalar``) say the same words."""
    what = "a positive finite number" if positive else "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"argument '{name}' must be {what}, got {value!r}"
    v = float(value)
    if not (math.isfinite(v) and (v > 0 or not positive)):
        return f"argument '{name}' must be {what}, got {value!r}"
    if dtype is None or dtype == torch.float64:
        return None
    fits = abs(v) <= torch.finfo(torch.float32).max
    narrow = float(torch.tensor(v, dtype=torch.float64).to(torch.float32)) if fits else 0.0
    if fits and (narrow > 0 or not positive):
        return None
    there = "0" if fits else ("inf" if v > 0 else "-inf")
    return (f"argument '{name}' must be {what} in float32 (the precision the op computes in for tensors of "
            f"dtype {str(dtype).replace('torch.', '')}), got {value!r}, which is {there} there")


def _check_scalar(fn: str, name: str, value, dtype: torch.dtype, positive: bool = True) -> None:
    problem = scalar_problem(name, value, dtype, positive)
    if problem:
        raise ValueError(f"nalu_cuda.reference.{fn}: {problem}")


def nac_weight(W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """``W = tanh(W_hat) * sigmoid(M_hat)``, elementwise; any shape."""
    return torch.tanh(W_hat) * torch.sigmoid(M_hat)


def log_abs(x: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """``log(|x| + eps)``, whose gradient is ``sign(x) / (|x| + eps)`` with ``sign(0) = 0``.

    A zero x takes the constant branch of the ``where``, so its gradient is exactly 0; through
    ``abs`` it would be ``sign(0) * (upstream / eps)``, which is 0 * inf = NaN once the quotient
    overflows (a subnormal eps, or a large upstream gradient)."""
    return torch.log(torch.where(x == 0, eps, torch.abs(x) + eps))


def _matmul(x: Tensor, W: Tensor) -> Tensor:
    """``x W`` for a plain layer (W ``(I, O)``) or an ensemble (W ``(E, I, O)``, x ``(E, ..., I)``)."""
    if W.dim() == 2:
        return torch.matmul(x, W)
    E, I, O = W.shape
    rows = 1
    for d in x.shape[1:-1]:
        rows *= d
    out = torch.bmm(x.reshape(E, rows, I), W)  # (not -1: x may have no elements)
    return out.reshape(*x.shape[:-1], O)


def nac(x: Tensor, W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """NAC+ (additive accumulator): ``y = x W``."""
    return _matmul(x, nac_weight(W_hat, M_hat))


def nac_mul(x: Tensor, W_hat: Tensor, M_hat: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """NAC* (multiplicative accumulator): ``y = exp(log(|x| + eps) W)``."""
    _check_scalar("nac_mul", "eps", eps, x.dtype)
    return torch.exp(_matmul(log_abs(x, eps), nac_weight(W_hat, M_hat)))


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
    """:func:`nalu` returning ``(y, a, m, g)``: the output and its :class:`NaluParts`."""
    _check_gate("reference.nalu", gate, G_bias, W_hat)
    if (W_hat_m is None) != (M_hat_m is None):
        raise ValueError("nalu_cuda.reference.nalu: give both 'W_hat_m' and 'M_hat_m' (separate weights) or neither")
    _check_scalar("nalu", "eps", eps, x.dtype)
    W = nac_weight(W_hat, M_hat)
    W_m = W if W_hat_m is None else nac_weight(W_hat_m, M_hat_m)
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
    return g_b * a + (1 - g_b) * m, a, m, g


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
    """NALU: ``y = g a + (1 - g) m`` with ``a = x W``, ``m = exp(log(|x| + eps) W_m)``.

    ``W_m`` is ``W`` unless ``W_hat_m`` and ``M_hat_m`` are given. ``g = sigmoid(x G)`` (plus
    ``G_bias`` when given) for ``gate="input"``, ``g = sigmoid(G)`` broadcast over the batch for
    ``gate="independent"``.
    """
    return nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m, eps, gate, G_bias)[0]


# ------------------------------------------------------------------------------------------------
# Units beyond the paper: the power units (NPU, RealNPU) and iNALU. Formulas as the published
# numbers were produced (the authors' code); see also csrc/ops/power/math.h.
# ------------------------------------------------------------------------------------------------

DEFAULT_OMEGA = 20.0


def _clamp(t: Tensor, low: float, high: float) -> Tensor:
    """``clamp(t, low, high)`` whose derivative is 1 on the closed interval [low, high] and 0
    outside it, written out so that it does not depend on how a torch release differentiates
    ``torch.clamp`` at the bounds (the kernels follow this convention)."""
    inside = (t >= low) & (t <= high)
    return torch.where(inside, t, t.detach().clamp(low, high))


def _per_member(t: Tensor, x: Tensor, ensemble: bool) -> Tensor:
    """A per-member vector ``(E, K)`` as ``(E, 1, ..., 1, K)`` against ``x`` of shape ``(E, ..., *)``."""
    if not ensemble:
        return t
    return t.reshape(t.shape[0], *([1] * (x.dim() - 2)), t.shape[-1])


def npu(x: Tensor, W_r: Tensor, W_i: Optional[Tensor], g: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Neural Power Unit (Heim et al., 2020): the real part of a complex power of the inputs.

    ``r = g (|x| + eps) + (1 - g)``, ``k = g pi [x < 0]`` with the relevance gate ``g`` (shape
    ``(in,)``, ``(E, in)`` for an ensemble) clamped to [0, 1];
    ``y = exp(log(r) W_r - k W_i) cos(k W_r + log(r) W_i)``. ``W_i=None`` is the RealNPU
    (``W_i = 0``): ``y = exp(log(r) W_r) cos(k W_r)``. A gate of 0 ignores its input (r = 1, k = 0).
    """
    _check_scalar("npu", "eps", eps, x.dtype)
    gc = _per_member(_clamp(g, 0.0, 1.0), x, W_r.dim() == 3)
    r = gc * (x.abs() + eps) + (1 - gc)
    k = gc * math.pi * (x < 0).to(x.dtype)
    lr = torch.log(r)
    if W_i is None:
        return torch.exp(_matmul(lr, W_r)) * torch.cos(_matmul(k, W_r))
    U = _matmul(lr, W_r) - _matmul(k, W_i)
    V = _matmul(k, W_r) + _matmul(lr, W_i)
    return torch.exp(U) * torch.cos(V)


def real_npu(x: Tensor, W_r: Tensor, g: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """RealNPU: :func:`npu` with ``W_i = 0``, ``y = exp(log(r) W_r) cos(k W_r)``."""
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
    """iNALU (Schlör et al., 2020): ``y = g a + (1 - g) m clip(msv, -1, 1)``.

    Separate weights ``W = tanh(W_hat) sigmoid(M_hat)`` and ``W_m`` likewise from ``W_hat_m``,
    ``M_hat_m``; ``a = x W``; ``m = exp(min(log(max(|x|, eps)) W_m, omega))`` (eps a floor, not
    added, and the exponent clipped at omega); the sign ``msv = prod_i (sign(x_i) |W_m[i]| + 1 -
    |W_m[i]|)``, the NMU-like product that gives ``m`` the sign of the inputs it uses; the
    input-independent gate ``g = sigmoid(G)``, ``G`` of shape ``(out,)`` (``(E, out)``).
    """
    _check_scalar("inalu", "eps", eps, x.dtype)
    _check_scalar("inalu", "omega", omega, x.dtype, positive=False)
    W = nac_weight(W_hat, M_hat)
    W_m = nac_weight(W_hat_m, M_hat_m)
    a = _matmul(x, W)
    m = torch.exp(_matmul(torch.log(x.abs().clamp_min(eps)), W_m).clamp(max=omega))
    W_abs = W_m.abs()
    if W_m.dim() == 3:  # (E, I, O) -> (E, 1, ..., 1, I, O) against x (E, ..., I, 1)
        W_abs = W_abs.reshape(W_abs.shape[0], *([1] * (x.dim() - 2)), *W_abs.shape[1:])
    msv = (torch.sign(x).unsqueeze(-1) * W_abs + 1 - W_abs).prod(dim=-2)
    g = _per_member(torch.sigmoid(G), x, W_hat.dim() == 3)
    return g * a + (1 - g) * (m * msv.clamp(-1, 1))


# ------------------------------------------------------------------------------------------------
# Units beyond the paper (Madsen & Johansen, "Neural Arithmetic Units", ICLR 2020). The only
# parameter is W, (I, O) or (E, I, O), used as given: the published runs keep it in range by a
# projection after each optimiser step (nalu_cuda.NAU.project_, nalu_cuda.NMU.project_), not here.
# ------------------------------------------------------------------------------------------------


def nau(x: Tensor, W: Tensor) -> Tensor:
    """NAU (neural addition unit): ``y = x clamp(W, -1, 1)``."""
    return _matmul(x, _clamp(W, -1.0, 1.0))


def nmu(x: Tensor, W: Tensor) -> Tensor:
    """NMU (neural multiplication unit): ``y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o])``.

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
