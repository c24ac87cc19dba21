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

from . import _ops, reference
from .reference import DEFAULT_EPS, DEFAULT_OMEGA, GATES, NaluParts, _check_gate_bias, _matmul

__all__ = ["nac_weight", "nac", "nac_mul", "nalu", "nalu_parts", "NaluParts", "npu", "real_npu", "inalu", "nau",
           "nmu"]


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


def _with_gate_bias(x, W_hat, M_hat, W_hat_m, M_hat_m, G, G_bias):
    """The same layer on ``[x, 1]``: a zero row appended to the path weights (``tanh(0) = 0``, so
    the ones column adds exactly 0 to ``a`` and to ``log(|x| + eps) W_m``) and ``G_bias`` appended
    to ``G`` as its row, so that the fused op computes ``sigmoid(x G + G_bias)``. Gradients reach
    the originals through the concatenations; the appended rows' own gradients are dropped."""
    x1 = torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], -1)

    def zero_row(w):
        return None if w is None else torch.cat([w, w.new_zeros(w.shape[:-2] + (1, w.shape[-1]))], -2)

    return (x1, zero_row(W_hat), zero_row(M_hat), zero_row(W_hat_m), zero_row(M_hat_m),
            torch.cat([G, G_bias.unsqueeze(-2)], -2))


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
    """NALU: ``y = g a + (1 - g) m``; see :func:`nalu_cuda.reference.nalu`.

    With ``G_bias`` (input gate only) the fused op runs on ``[x, 1]`` (see ``_with_gate_bias``).
    """
    if gate not in GATES:
        raise ValueError(f"nalu_cuda.functional.nalu: argument 'gate' must be one of {GATES}, got {gate!r}")
    if G_bias is not None:
        _check_gate_bias("functional.nalu", W_hat, G_bias, gate)
        x, W_hat, M_hat, W_hat_m, M_hat_m, G = _with_gate_bias(x, W_hat, M_hat, W_hat_m, M_hat_m, G, G_bias)
    fast = _fast(x)
    if fast is not None:
        return fast.nalu(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input")
    y, _a, _m, _g, _lx = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input")
    return y


def _matmul_vjp(x: Tensor, W: Tensor, dout: Tensor):
    """For ``out = x W`` (plain or ensemble, as :func:`nalu_cuda.reference._matmul`): ``(dout W^T, x^T dout)``."""
    dx = _matmul(dout, W.transpose(-1, -2))
    if W.dim() == 2:
        dW = x.reshape(-1, x.shape[-1]).t() @ dout.reshape(-1, dout.shape[-1])
    else:
        E = W.shape[0]
        dW = torch.bmm(x.reshape(E, -1, x.shape[-1]).transpose(1, 2), dout.reshape(E, -1, dout.shape[-1]))
    return dx, dW


def _nac_weight_vjp(dW: Tensor, W_hat: Tensor, M_hat: Tensor):
    """``(dW_hat, dM_hat)`` from ``dW`` through ``W = tanh(W_hat) sigmoid(M_hat)``."""
    t, s = torch.tanh(W_hat), torch.sigmoid(M_hat)
    return dW * (1 - t * t) * s, dW * t * s * (1 - s)


class _NaluParts(torch.autograd.Function):
    """The fused NALU op with ``a``, ``m``, ``g`` differentiable outputs.

    Backward: the ``nalu_backward`` op for ``dL/dy``; the gradients that reach ``a``, ``m`` or ``g``
    directly (a gate regulariser, a loss on a path) add, only when present:
    ``da``: ``dx += da W^T``, ``dW += x^T da``;  ``dm``: ``du = dm m``, ``dx += (du W_m^T) sign(x) / (|x| + eps)``,
    ``dW_m += lx^T du``;  ``dg``: ``dz = dg g (1 - g)``, ``dx += dz G^T``, ``dG += x^T dz`` (an
    independent gate: ``dG += dz``). :func:`nalu`, which returns ``y`` only, never pays for this.
    """

    @staticmethod
    def forward(ctx, x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate):
        y, a, m, g, lx = _ops_or_raise().nalu_forward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, input_gate)
        ctx.save_for_backward(x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx)
        ctx.eps, ctx.input_gate = eps, input_gate
        ctx.set_materialize_grads(False)
        return y, a, m, g

    @staticmethod
    def backward(ctx, dy, da, dm, dg):
        x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True: the backward op has no autograd of its own, so differentiate the
            # reference instead (a differentiable backward, never a disconnected graph).
            return _NaluParts._differentiable_backward(ctx, (x, W_hat, M_hat, W_hat_m, M_hat_m, G),
                                                      (dy, da, dm, dg))
        sep = W_hat_m is not None
        need_x = ctx.needs_input_grad[0]
        if dy is None:
            dy = torch.zeros_like(a)
        gx, gw, gm, gwm, gmm, gG = _ops_or_raise().nalu_backward(
            dy, x, W_hat, M_hat, W_hat_m, M_hat_m, G, a, m, g, lx, ctx.eps, ctx.input_gate, need_x)
        if da is not None or dm is not None or dg is not None:
            dx = torch.zeros_like(x)
            dW = torch.zeros_like(W_hat)
            dWm = torch.zeros_like(W_hat) if sep else dW
            if da is not None:
                ddx, ddW = _matmul_vjp(x, reference.nac_weight(W_hat, M_hat), da)
                dx, dW = dx + ddx, dW + ddW
                if not sep:
                    dWm = dW
            if dm is not None:
                W_m = reference.nac_weight(W_hat_m, M_hat_m) if sep else reference.nac_weight(W_hat, M_hat)
                dlx, ddW = _matmul_vjp(lx, W_m, dm * m)
                dx = dx + dlx * torch.sign(x) / (x.abs() + ctx.eps)
                if sep:
                    dWm = dWm + ddW
                else:
                    dW = dW + ddW
            if dg is not None:
                dz = dg * g * (1 - g)
                if ctx.input_gate:
                    ddx, ddG = _matmul_vjp(x, G, dz)
                    dx, gG = dx + ddx, gG + ddG
                else:
                    gG = gG + dz
            ew, em = _nac_weight_vjp(dW, W_hat, M_hat)
            gw, gm = gw + ew, gm + em
            if sep:
                ew, em = _nac_weight_vjp(dWm, W_hat_m, M_hat_m)
                gwm, gmm = gwm + ew, gmm + em
            if need_x:
                gx = gx + dx
        return (gx if need_x else None, gw, gm, gwm if sep else None, gmm if sep else None, gG, None, None)

    @staticmethod
    def _differentiable_backward(ctx, inputs, grads):
        x, W_hat, M_hat, W_hat_m, M_hat_m, G = inputs
        gate = "input" if ctx.input_gate else "independent"
        outs = reference.nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m, ctx.eps, gate)
        pairs = [(o, go) for o, go in zip(outs, grads) if go is not None]
        wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
        got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [go for _, go in pairs],
                                  create_graph=True, allow_unused=True)
        result = [None] * len(inputs)
        for i, gr in zip(wanted, got):
            result[i] = gr
        return (*result, None, None)


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
    (see :func:`nalu_cuda.reference.nalu_parts`; ``g`` has ``G``'s shape for an independent gate)."""
    if gate not in GATES:
        raise ValueError(f"nalu_cuda.functional.nalu_parts: argument 'gate' must be one of {GATES}, got {gate!r}")
    if G_bias is not None:
        _check_gate_bias("functional.nalu_parts", W_hat, G_bias, gate)
        x, W_hat, M_hat, W_hat_m, M_hat_m, G = _with_gate_bias(x, W_hat, M_hat, W_hat_m, M_hat_m, G, G_bias)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        # the ops' autocast policy (csrc/common/autocast.cpp): float16/bfloat16 arguments cast to float32
        # once, the op run outside autocast; here before the Function, so that what it saves for
        # backward has the dtype the ops ran in.
        def f32(t):
            return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t

        x, W_hat, M_hat, W_hat_m, M_hat_m, G = map(f32, (x, W_hat, M_hat, W_hat_m, M_hat_m, G))
        with torch.autocast(dev, enabled=False):
            return _NaluParts.apply(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input")
    return _NaluParts.apply(x, W_hat, M_hat, W_hat_m, M_hat_m, G, eps, gate == "input")


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
