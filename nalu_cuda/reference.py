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
  ensemble), the same for every input.
* ``W_hat_m`` / ``M_hat_m``: separate weights of the multiplicative path. ``None`` ties the two
  paths to one ``W``, as in the paper.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["DEFAULT_EPS", "nac_weight", "log_abs", "nac", "nac_mul", "nalu", "GATES", "nau", "nmu"]

DEFAULT_EPS = 1e-7
GATES = ("input", "independent")


def nac_weight(W_hat: Tensor, M_hat: Tensor) -> Tensor:
    """``W = tanh(W_hat) * sigmoid(M_hat)``, elementwise; any shape."""
    return torch.tanh(W_hat) * torch.sigmoid(M_hat)


def log_abs(x: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """``log(|x| + eps)``."""
    return torch.log(torch.abs(x) + eps)


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
    return torch.exp(_matmul(log_abs(x, eps), nac_weight(W_hat, M_hat)))


def nalu(
    x: Tensor,
    W_hat: Tensor,
    M_hat: Tensor,
    G: Tensor,
    W_hat_m: Optional[Tensor] = None,
    M_hat_m: Optional[Tensor] = None,
    eps: float = DEFAULT_EPS,
    gate: str = "input",
) -> Tensor:
    """NALU: ``y = g a + (1 - g) m`` with ``a = x W``, ``m = exp(log(|x| + eps) W_m)``.

    ``W_m`` is ``W`` unless ``W_hat_m`` and ``M_hat_m`` are given. ``g = sigmoid(x G)`` for
    ``gate="input"``, ``g = sigmoid(G)`` broadcast over the batch for ``gate="independent"``.
    """
    if gate not in GATES:
        raise ValueError(f"nalu_cuda.reference.nalu: argument 'gate' must be one of {GATES}, got {gate!r}")
    if (W_hat_m is None) != (M_hat_m is None):
        raise ValueError("nalu_cuda.reference.nalu: give both 'W_hat_m' and 'M_hat_m' (separate weights) or neither")
    W = nac_weight(W_hat, M_hat)
    W_m = W if W_hat_m is None else nac_weight(W_hat_m, M_hat_m)
    a = _matmul(x, W)
    m = torch.exp(_matmul(log_abs(x, eps), W_m))
    if gate == "input":
        g = torch.sigmoid(_matmul(x, G))
    else:
        g = torch.sigmoid(G)
        if W_hat.dim() == 3:  # (E, O) -> (E, 1, ..., 1, O) against y of shape (E, ..., O)
            g = g.reshape(g.shape[0], *([1] * (x.dim() - 2)), g.shape[-1])
    return g * a + (1 - g) * m


# ------------------------------------------------------------------------------------------------
# Units beyond the paper (Madsen & Johansen, "Neural Arithmetic Units", ICLR 2020). The only
# parameter is W, (I, O) or (E, I, O), used as given: the published runs keep it in range by a
# projection after each optimiser step (nalu_cuda.NAU.project_, nalu_cuda.NMU.project_), not here.
# ------------------------------------------------------------------------------------------------


def nau(x: Tensor, W: Tensor) -> Tensor:
    """NAU (neural addition unit): ``y = x clamp(W, -1, 1)``."""
    return _matmul(x, torch.clamp(W, -1.0, 1.0))


def nmu(x: Tensor, W: Tensor) -> Tensor:
    """NMU (neural multiplication unit): ``y[..., o] = prod_i (W[i, o] x[..., i] + 1 - W[i, o])``.

    ``W = 0`` makes input i's factor the identity 1, ``W = 1`` makes it ``x_i``; no logarithm, so
    zero and negative inputs are fine. This specification materialises the ``(..., I, O)`` factors
    (the fused op does not).
    """
    if W.dim() == 3:  # (E, I, O) -> (E, 1, ..., 1, I, O) against x (E, ..., I, 1)
        W = W.reshape(W.shape[0], *([1] * (x.dim() - 2)), *W.shape[1:])
    factors = x.unsqueeze(-1) * W + (1 - W)
    return torch.prod(factors, dim=-2)
