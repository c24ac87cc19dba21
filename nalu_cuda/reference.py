"""The pure-PyTorch reference: the executable specification of every nalu_cuda op.

Everything here is plain differentiable PyTorch; the fused ops (:mod:`nalu_cuda.functional`) are
tested against these functions for values and gradients. Each unit family writes its specification
next to its fused ops, in its module of :mod:`nalu_cuda.ops` (``reference_nalu`` in
:mod:`nalu_cuda.ops.nac_nalu` is ``nalu`` here); this module lists them all under one name, from the
families' ``REFERENCE`` tables (:data:`nalu_cuda.ops.FAMILIES`), with the conventions below.

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

from .ops import export
from .ops._common import DEFAULT_EPS, scalar_problem

__all__ = ["DEFAULT_EPS", "scalar_problem"]
__all__ += export(globals(), "REFERENCE")
