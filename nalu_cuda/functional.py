"""The fused ops as differentiable functions, with the signatures of :mod:`nalu_cuda.reference`.

Each function is one call of a ``torch.ops.nalu_cuda`` op forward and one call of its backward
op in the backward pass. Shapes and conventions are those of :mod:`nalu_cuda.reference`.
Errors (wrong shapes, dtypes, devices, eps) come from the op and name it and the argument.

In eager mode the call goes through ``nalu_cuda._C``'s direct bindings of the same ops (the same
dispatcher call, without ``torch.ops``' per-call argument parsing, which costs more than the
fused forward itself at small sizes); while ``torch.compile`` traces, through ``torch.ops``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _ops
from .reference import DEFAULT_EPS, GATES

__all__ = ["nac_weight", "nac", "nac_mul", "nalu", "nau", "nmu"]


def _ops_or_raise():
    if _ops.ops is None:
        raise RuntimeError(
            f"nalu_cuda: the native extension is not loaded ({_ops.LOAD_ERROR}); build it with "
            "`pip install --no-build-isolation -e .` or use the reference path (backend='reference')"
        )
    return _ops.ops


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _fast(x: Tensor):
    """The direct bindings, or None where torch.ops must be used: while compiling, without the _C
    module (a library loaded from NALU_CUDA_LIBRARY), and where __torch_function__ could apply (a
    Tensor subclass input, or an active TorchFunctionMode), which the bindings would bypass."""
    if (
        _ops.fast is None
        or torch.compiler.is_compiling()
        or type(x) not in _PLAIN_TENSORS
        or torch._C._is_torch_function_mode_enabled()
    ):
        return None
    return _ops.fast


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
) -> Tensor:
    """NALU: ``y = g a + (1 - g) m``; see :func:`nalu_cuda.reference.nalu`."""
    if gate not in GATES:
        raise ValueError(f"nalu_cuda.functional.nalu: argument 'gate' must be one of {GATES}, got {gate!r}")
    fast = _fast(x)
    if fast is not None:
        return fast.nalu(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input")
    y, _a, _m, _g, _lx = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input")
    return y


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
