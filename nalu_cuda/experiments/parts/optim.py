"""Adam for ensembles: every parameter leads with the member dimension ``E`` and members never mix.

* :class:`FlatAdam`: the arithmetic tasks' optimiser: every parameter a view of one flat buffer,
  and on CPU one fused native pass per step (``csrc/cpu/flat_adam.cpp``) that also freezes
  diverged members.
* :class:`EnsembleAdam`: the sequence tasks' optimiser: a learning rate and optional gradient
  clipping per member.

The two differ in the order of their floating-point operations (``lerp_`` and ``sqrt(v)/sqrt(c2)``
against ``mul_().add_()`` and ``sqrt(v/c2)``), so each task family keeps the one its published
numbers were made with; merging them would change the last bits of every sequence-task result.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional

import torch
from torch import Tensor, nn

__all__ = ["FlatAdam", "EnsembleAdam", "member_view"]


def member_view(mask: Tensor, t: Tensor) -> Tensor:
    """``mask (E,)`` shaped to broadcast over ``t (E, ...)``."""
    return mask.reshape(-1, *([1] * (t.dim() - 1)))


class FlatAdam:
    """Adam over one flat buffer holding every parameter (and one holding every gradient).

    The update is ``torch.optim.Adam``'s (``exp_avg.lerp_``, ``exp_avg_sq`` with ``addcmul_``, bias
    corrections, ``addcdiv_``), but as six elementwise ops on one buffer instead of a dozen per
    parameter: at these model sizes the optimiser's per-tensor overhead is a large part of a step.
    The parameters become views of the buffer and their ``.grad`` views of the gradient buffer
    (backward accumulates into them), so :meth:`zero_grad` is one ``zero_``.

    Why not ``Adam(fused=True)``: on CPU its result for an element depends on the element's
    position in the tensor (vectorised body vs. scalar tail), so member ``e`` of an ensemble would
    not equal the single run of its seed. Every op here gives the same result at any position.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("FlatAdam: no parameters")
        ref = self.params[0]
        n = sum(p.numel() for p in self.params)
        self.lr, self.beta1, self.beta2, self.eps = float(lr), betas[0], betas[1], eps
        self.flat = torch.empty(n, dtype=ref.dtype, device=ref.device)
        self.grad = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.step_count = 0
        self._segments = None
        self._views = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                if p.dtype != ref.dtype or p.device != ref.device:
                    raise ValueError("FlatAdam: every parameter must share one dtype and device")
                k = p.numel()
                self.flat[off:off + k].copy_(p.reshape(-1))
                p.data = self.flat[off:off + k].view_as(p)
                p.grad = self.grad[off:off + k].view_as(p)
                self._views.append((off, k, p.shape))
                off += k

    def zero_grad(self) -> None:
        self.grad.zero_()

    def gather_grads(self) -> None:
        """After backward: make sure every gradient is in the buffer (autograd accumulates into an
        existing ``.grad`` in place; should it ever have replaced one, copy it back)."""
        for p, (off, k, shape) in zip(self.params, self._views):
            view = self.grad[off:off + k]
            if p.grad is None:
                p.grad = view.view(shape)
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
                p.grad = view.view(shape)

    def moment_views(self, p_index: int):
        off, k, shape = self._views[p_index]
        return self.exp_avg[off:off + k].view(shape), self.exp_avg_sq[off:off + k].view(shape)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        t = self.step_count
        bc1 = 1 - self.beta1 ** t
        bc2 = 1 - self.beta2 ** t
        g = self.grad
        self.exp_avg.lerp_(g, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(self.eps)
        self.flat.addcdiv_(self.exp_avg, denom, value=-self.lr / bc1)

    def _native_step(self, E: int):
        """The fused CPU step (csrc/cpu/flat_adam.cpp) and the (offset, per-member size) of every
        parameter, or None where it does not apply (not CPU, extension not built, a parameter
        without the leading member dimension E)."""
        if self._segments is None or self._segments[0] != E:  # worked out once per E, not per step
            from nalu_cuda import _ops

            native = None
            fn = getattr(_ops.fast, "flat_adam_step", None)
            if fn is not None and self.flat.device.type == "cpu" and all(s[:1] == (E,) for _, _, s in self._views):
                native = (fn, torch.tensor([[off, k // E] for off, k, _ in self._views], dtype=torch.long))
            self._segments = (E, native)
        return self._segments[1]

    @torch.no_grad()
    def step_ensemble(self, frozen: Tensor, freeze_nonfinite: bool) -> Tensor:
        """One step for an ensemble whose parameters all lead with the member dimension E.

        Members flagged in ``frozen`` (E,) -- and, with ``freeze_nonfinite``, members whose
        gradient has a NaN or Inf in this step -- take a zero gradient. Returns which members'
        gradients have a NaN or Inf (before freezing). On CPU one fused pass over the buffers;
        elsewhere the same with tensor ops.
        """
        E = frozen.numel()
        native = self._native_step(E)
        if native is not None:
            fn, segs = native
            self.step_count += 1
            return fn(self.flat, self.grad, self.exp_avg, self.exp_avg_sq, segs, frozen.contiguous(),
                      freeze_nonfinite, self.lr, self.beta1, self.beta2, self.eps, self.step_count)
        grads = [p.grad for p in self.params]
        nonfinite = ~torch.stack([torch.isfinite(g).reshape(E, -1).all(1) for g in grads], 1).all(1)
        mask = frozen | nonfinite if freeze_nonfinite else frozen
        if freeze_nonfinite or bool(frozen.any()):
            for g in grads:
                g.masked_fill_(member_view(mask, g), 0.0)
        self.step()
        return nonfinite

    def state_dict(self) -> dict:
        return {"exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(), "step": self.step_count,
                "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step_count = int(state["step"])


class EnsembleAdam:
    """Adam on ensemble parameters with a learning rate per member.

    Every parameter must hold the ``E`` members in member-major order along its first dimension:
    shape ``(E, ...)``, or ``(E * C, ...)`` for grouped-convolution weights. ``lr``: a float or a
    sequence of ``E`` floats. ``clip``: if given, each member's gradient (over all its parameters)
    is rescaled to norm at most ``clip``, independently of the other members.
    """

    def __init__(self, params: Iterable[nn.Parameter], ensemble: int, lr, betas=(0.9, 0.999), eps: float = 1e-8,
                 clip: Optional[float] = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.E = ensemble
        for p in self.params:
            if p.dim() == 0 or p.shape[0] % ensemble:
                raise ValueError(f"EnsembleAdam: parameter of shape {tuple(p.shape)} has no leading member dim {ensemble}")
        lr_t = torch.as_tensor(lr, dtype=torch.float32).flatten()
        if lr_t.numel() == 1:
            lr_t = lr_t.expand(ensemble)
        if lr_t.numel() != ensemble:
            raise ValueError(f"EnsembleAdam: {lr_t.numel()} learning rates for {ensemble} members")
        self.lr = lr_t.clone()
        self.b1, self.b2 = betas
        self.eps = eps
        self.clip = clip
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        if not self.params:
            return
        E = self.E
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(E, -1) for p in self.params]
        if self.clip is not None:
            sq = sum(g.pow(2).sum(1) for g in grads)
            scale = (self.clip / (sq.sqrt() + 1e-12)).clamp(max=1.0)
            grads = [g * scale.unsqueeze(1) for g in grads]
        c1 = 1 - self.b1 ** self.t
        c2 = 1 - self.b2 ** self.t
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m2, v2, p2 = m.view(E, -1), v.view(E, -1), p.data.view(E, -1)
            m2.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v2.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            denom = (v2 / c2).sqrt_().add_(self.eps)
            lr = self.lr.to(device=p.device, dtype=p.dtype).unsqueeze(1)
            p2.sub_(lr * (m2 / c1) / denom)

    def state_dict(self) -> Dict:
        return {"t": self.t, "m": [m.clone() for m in self.m], "v": [v.clone() for v in self.v], "lr": self.lr.clone()}

    def load_state_dict(self, state: Dict) -> None:
        self.t = int(state["t"])
        for dst, src in zip(self.m, state["m"]):
            dst.copy_(src)
        for dst, src in zip(self.v, state["v"]):
            dst.copy_(src)
        self.lr = state["lr"].clone()
