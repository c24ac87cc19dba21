"""Adam for ensembles: every parameter leads with the member dimension ``E`` and members never mix.

:class:`FlatAdam` is the toolkit's one optimiser, for every task: every parameter a view of one
flat buffer, on CPU one fused native pass per step (``csrc/experiments/cpu/flat_adam.cpp``) that also
freezes diverged members, on CUDA two kernel launches for the device-resident step
(``csrc/experiments/cuda/flat_adam_kernels.cu``); optionally a learning rate per parameter group and per
member, and gradient-norm clipping per member (the sequence tasks use both).
:class:`FlatRMSProp` is the same buffers with TensorFlow 1's RMSProp, the update iNALU's published
runs use, including their alternation of weight and gate steps.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["FlatAdam", "FlatRMSProp"]


LearningRate = Union[float, Sequence[float]]


class FlatAdam:
    """Adam over one flat buffer holding every parameter (and one holding every gradient).

    The update is ``torch.optim.Adam``'s (``exp_avg.lerp_``, ``exp_avg_sq`` with ``addcmul_``, bias
    corrections, ``addcdiv_``), but as six elementwise ops on one buffer instead of a dozen per
    parameter: at these model sizes the optimiser's per-tensor overhead is a large part of a step.
    The parameters become views of the buffer and their ``.grad`` views of the gradient buffer
    (backward accumulates into them), so :meth:`zero_grad` is one ``zero_``.

    ``params``: tensors, or parameter groups ``{"params": [...], "lr": ...}`` as in
    ``torch.optim`` (a group without ``lr`` takes ``lr``). A learning rate is a float, or, with
    ``ensemble=E``, a sequence of ``E`` floats (one per member). ``clip`` (needs ``ensemble``):
    each member's gradient, over all parameters, is rescaled to norm at most ``clip``. With
    ``ensemble``, every parameter must hold the members in member-major order along its first
    dimension: ``(E, ...)``, or ``(E * C, ...)`` (grouped-convolution weights).

    Why not ``Adam(fused=True)``: on CPU its result for an element depends on the element's
    position in the tensor (vectorised body vs. scalar tail), so member ``e`` of an ensemble would
    not equal the single run of its seed. Every op here gives the same result at any position.
    """

    def __init__(self, params, lr: LearningRate = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, *,
                 ensemble: Optional[int] = None, clip: Optional[float] = None):
        groups = _groups(params, lr)
        self.params = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("FlatAdam: no parameters")
        if clip is not None and ensemble is None:
            raise ValueError("FlatAdam: clip is per member and needs ensemble=E")
        ref = self.params[0]
        n = sum(p.numel() for p in self.params)
        self.ensemble, self.clip = ensemble, clip
        self.beta1, self.beta2, self.eps = betas[0], betas[1], eps
        self.flat = torch.empty(n, dtype=ref.dtype, device=ref.device)
        self.grad = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.step_count = 0
        self._step_t: Optional[Tensor] = None  # the step count on the device (resident steps)
        self._pending_sq: Optional[Tensor] = None  # the members' squared norms, for the next clip
        self._segments = None
        self._resident = None  # (E, device) and the CUDA kernel of step_resident, see _resident_native
        self._views = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                if p.dtype != ref.dtype or p.device != ref.device:
                    raise ValueError("FlatAdam: every parameter must share one dtype and device")
                if ensemble is not None and (p.dim() == 0 or p.shape[0] % ensemble):
                    raise ValueError(f"FlatAdam: parameter of shape {tuple(p.shape)} has no leading member "
                                     f"dimension {ensemble}")
                k = p.numel()
                self.flat[off:off + k].copy_(p.reshape(-1))
                p.data = self.flat[off:off + k].view_as(p)
                p.grad = self.grad[off:off + k].view_as(p)
                self._views.append((off, k, p.shape))
                off += k
        self._set_learning_rates(groups)

    def _set_learning_rates(self, groups) -> None:
        """``self.lr`` (a float) where one learning rate serves every element; otherwise also
        ``self.lr_flat``, one learning rate per element of the buffer."""
        lrs = [torch.as_tensor(g["lr"], dtype=torch.float64).flatten() for g in groups]
        E = self.ensemble
        for t in lrs:
            if t.numel() != 1 and (E is None or t.numel() != E):
                raise ValueError(f"FlatAdam: {t.numel()} learning rates for {E or 1} members")
        self.lr = float(lrs[0][0])
        self.lr_flat = None
        # one learning rate per member, the same for every parameter (the fused CPU step's lr_member), else None
        self.lr_member: Optional[Tensor] = None
        if E is not None and all(t.numel() == lrs[0].numel() and torch.equal(t, lrs[0]) for t in lrs):
            self.lr_member = lrs[0].expand(E).contiguous()
        if any(t.numel() != 1 or float(t[0]) != self.lr for t in lrs):
            parts = []
            for g, t in zip(groups, lrs):
                for p in g["params"]:
                    per = t.expand(E) if E is not None else t
                    parts.append(per.repeat_interleave(p.numel() // per.numel()))
            self.lr_flat = torch.cat(parts).to(device=self.flat.device, dtype=self.flat.dtype)

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

    def reset_moments(self, members: Union[Tensor, List[int]]) -> None:
        """Adam's moments of ``members`` (a mask ``(E,)`` or a list of indices) back to 0."""
        E = members.numel() if isinstance(members, Tensor) else self.ensemble
        for buf in (self.exp_avg, self.exp_avg_sq):
            for off, k, _ in self._views:
                seg = buf[off:off + k].view(E, -1)
                if isinstance(members, Tensor):
                    seg.masked_fill_(members.to(seg.device).unsqueeze(1), 0.0)
                else:
                    seg[members] = 0.0

    def _member_grads(self, E: int) -> List[Tensor]:
        return [self.grad[off:off + k].view(E, -1) for off, k, _ in self._views]

    def _member_sq(self, E: int) -> Tensor:
        """Each member's squared gradient norm over every parameter, in float64 ``(E,)``."""
        return sum((g.double() ** 2).sum(1) for g in self._member_grads(E))

    @torch.no_grad()
    def clip_grad_norm_(self) -> None:
        """Rescale each member's gradient (over every parameter) to norm at most ``clip`` (the norms
        :meth:`_zero_frozen_grads` found, where it ran just before)."""
        grads = self._member_grads(self.ensemble)
        sq, self._pending_sq = self._pending_sq, None
        if sq is None:
            sq = self._member_sq(self.ensemble)
        scale = (self.clip / (sq.sqrt() + 1e-12)).clamp(max=1.0).to(self.grad.dtype)
        for g in grads:
            g.mul_(scale.unsqueeze(1))

    @torch.no_grad()
    def step(self) -> None:
        if self.clip is not None:
            self.clip_grad_norm_()
        self.step_count += 1
        t = self.step_count
        bc1 = 1 - self.beta1 ** t
        bc2 = 1 - self.beta2 ** t
        g = self.grad
        self.exp_avg.lerp_(g, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(self.eps)
        if self.lr_flat is None:
            self.flat.addcdiv_(self.exp_avg, denom, value=-self.lr / bc1)
        else:
            self.flat.addcdiv_(self.exp_avg * self.lr_flat, denom, value=-1.0 / bc1)

    def member_segments(self, E: int, device=None) -> Tensor:
        """The ``(P, 2)`` int64 rows ``(offset, per-member size)`` of the parameters in the flat
        buffers, each an ``(E, ...)`` block (the native steps' and fused kernels' ``segments``); on
        the CPU unless ``device`` says otherwise."""
        return torch.tensor([[off, k // E] for off, k, _ in self._views], dtype=torch.long, device=device)

    def _native_step(self, E: int):
        """The fused CPU step (csrc/experiments/cpu/flat_adam.cpp), the (offset, per-member size) of
        every parameter, the members' learning rates (or None: one for all) and the clip (0: none),
        or None where it does not apply (not CPU, extension not built, learning rates that differ
        within a member, clipping over another number of members than ``ensemble``, a parameter
        without the leading member dimension E)."""
        if self._segments is None or self._segments[0] != E:  # worked out once per E, not per step
            from nalu_cuda import _ops

            native = None
            fn = getattr(_ops.fast, "flat_adam_step", None)
            lr_member = None if self.lr_flat is None else self.lr_member
            if (fn is not None and self.flat.device.type == "cpu" and (self.lr_flat is None or lr_member is not None)
                    and (self.clip is None or (E == self.ensemble and 0 < self.clip < math.inf))
                    and (lr_member is None or lr_member.numel() == E)
                    and all(len(s) and s[0] % E == 0 for _, _, s in self._views)):
                native = (fn, self.member_segments(E), lr_member, 0.0 if self.clip is None else float(self.clip))
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
            fn, segs, lr_member, clip = native
            self.step_count += 1
            return fn(self.flat, self.grad, self.exp_avg, self.exp_avg_sq, segs, frozen.contiguous(),
                      freeze_nonfinite, self.lr, self.beta1, self.beta2, self.eps, self.step_count,
                      lr_member=lr_member, clip=clip)
        nonfinite = self._zero_frozen_grads(frozen, freeze_nonfinite, read_back=True)
        self.step()
        return nonfinite

    def _zero_frozen_grads(self, frozen: Tensor, freeze_nonfinite: bool, read_back: bool = False) -> Tensor:
        """Zeroes the gradients of the members in ``frozen`` (E,) and, with ``freeze_nonfinite``, of
        the members whose gradient has a NaN or Inf; returns the latter ``(E,)``. With clipping, one
        pass gives both the non-finite members (a NaN or Inf makes the float64 sum of squares
        non-finite; a float32 gradient's squares cannot overflow it) and the norms the clip then
        uses (0 for a zeroed member, as it would find). ``read_back`` (the eager CPU step): skip the
        zeroing where no member is to be zeroed (one read of the host's own memory)."""
        E = frozen.numel()
        grads = self._member_grads(E)
        if self.clip is not None and E == self.ensemble:
            sq = self._member_sq(E)
            nonfinite = ~torch.isfinite(sq)
        else:
            sq, nonfinite = None, ~torch.stack([torch.isfinite(g).all(1) for g in grads], 1).all(1)
        drop = frozen | nonfinite if freeze_nonfinite else frozen
        if sq is not None:
            self._pending_sq = torch.where(drop, torch.zeros_like(sq), sq)
        if not (read_back and drop.device.type == "cpu") or bool(drop.any()):
            for g in grads:
                g.masked_fill_(drop.unsqueeze(1), 0.0)
        return nonfinite

    # step_resident takes the CUDA kernel where it applies; False (on an instance) keeps the tensor ops.
    native_resident = True

    def _resident_native(self, E: int):
        """The CUDA kernel of :meth:`step_resident` (``flat_adam_step_resident``,
        csrc/experiments/cuda/flat_adam_kernels.cu) and the (offset, per-member size) of every parameter as an
        int64 tensor on the device, or None where it does not apply (not CUDA, no CUDA kernel built,
        a dtype other than float32/float64, learning rates per element or clipping, a parameter
        without the leading member dimension E). Worked out once per E (not under a graph capture:
        the warm-up steps before it build the segments)."""
        key = (E, self.flat.device)
        if self._resident is None or self._resident[0] != key:
            from nalu_cuda import _ops

            native = None
            if (self.flat.is_cuda and self.flat.dtype in (torch.float32, torch.float64) and self.lr_flat is None
                    and self.clip is None and all(len(s) and s[0] % E == 0 for _, _, s in self._views)
                    and _ops.has_kernel("cuda", "flat_adam_step_resident")):
                fn = getattr(_ops.fast, "flat_adam_step_resident", None) or _ops.ops.flat_adam_step_resident
                native = (fn, self.member_segments(E, self.flat.device))
            self._resident = (key, native)
        return self._resident[1]

    @torch.no_grad()
    def step_resident(self, frozen: Tensor) -> Tensor:
        """The step of :meth:`step_ensemble` with no host round trip (nothing is read back, the
        step count lives on the device), so that a CUDA graph can capture it: members in
        ``frozen`` (E,) and members whose gradient has a NaN or Inf take a zero gradient; returns
        the latter ``(E,)``. The bias corrections are computed on the device from the step count,
        so the update is Adam's, but not bit-identical to :meth:`step`'s (host scalars). On CUDA
        (no clipping, one learning rate) two kernel launches (``_resident_native``) with the same
        arithmetic as these tensor ops, element by element; elsewhere the tensor ops."""
        if self._step_t is None or self._step_t.device != self.flat.device:
            self._step_t = torch.full((), float(self.step_count), dtype=torch.float64, device=self.flat.device)
        E = frozen.numel()
        native = self._resident_native(E) if self.native_resident else None
        if native is not None:
            fn, segs = native
            return fn(self.flat, self.grad, self.exp_avg, self.exp_avg_sq, segs, frozen.contiguous(), self._step_t,
                      self.lr, self.beta1, self.beta2, self.eps)
        nonfinite = self._zero_frozen_grads(frozen, True)
        if self.clip is not None:
            self.clip_grad_norm_()
        self._step_t += 1
        bc1 = 1 - torch.pow(self.beta1, self._step_t)
        bc2 = 1 - torch.pow(self.beta2, self._step_t)
        g = self.grad
        self.exp_avg.lerp_(g, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (self.exp_avg_sq.sqrt() / bc2.sqrt().to(g.dtype)).add_(self.eps)
        lr = self.lr if self.lr_flat is None else self.lr_flat
        self.flat.sub_(self.exp_avg / denom * (lr / bc1).to(g.dtype))
        return nonfinite

    def sync_step_count(self) -> None:
        """After resident steps: the host's step count from the device's (one read, at evaluations)."""
        if self._step_t is not None:
            self.step_count = int(self._step_t.item())

    def state_dict(self) -> dict:
        self.sync_step_count()
        return {"exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(), "step": self.step_count,
                "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step_count = int(state["step"])
        self._step_t = None


class FlatRMSProp(FlatAdam):
    """TensorFlow 1's ``RMSPropOptimizer`` (no momentum, not centred) over :class:`FlatAdam`'s flat
    buffers: ``ms <- ms + (1 - decay) (g^2 - ms)``, ``p <- p - lr g / sqrt(ms + eps)``, with ``ms``
    starting at 1 and ``eps`` inside the square root, as iNALU's published runs train
    (daschloer/inalu: lr 0.01, decay 0.9, eps 1e-10; docs/units.md).

    ``parts``: named groups of parameters ``{name: [tensors]}`` (every parameter in at most one);
    :meth:`step` with ``part=name`` updates only that group, as the authors' separate
    ``apply_gradients`` over one ``var_list`` do (the other parameters' ``ms`` stay as they are).
    ``alternate=(k, n, first, second)``: a step without ``part`` updates ``first`` in the first
    ``k`` of every ``n`` steps (counted from 0) and ``second`` in the others (iNALU: 8 of 10 steps
    the weights, 2 the gate). ``members`` ``(E,)`` (with ``ensemble``): only those members move.
    The update runs as tensor ops (there is no fused native kernel for it); frozen members and
    clipping as in :class:`FlatAdam`. A member's moments "restart" (:meth:`reset_moments`) at
    ``ms = 1``.
    """

    def __init__(self, params, lr: LearningRate = 1e-2, decay: float = 0.9, eps: float = 1e-10, *,
                 ensemble: Optional[int] = None, clip: Optional[float] = None,
                 parts: Optional[Dict[str, Sequence[Tensor]]] = None,
                 alternate: Optional[Tuple[int, int, str, str]] = None):
        super().__init__(params, lr, betas=(0.0, decay), eps=eps, ensemble=ensemble, clip=clip)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"FlatRMSProp: decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.exp_avg_sq.fill_(1.0)  # TF1's "rms" slot starts at ones
        self.exp_avg = torch.zeros(0, dtype=self.flat.dtype, device=self.flat.device)  # no first moment
        self.part_masks: Dict[str, Tensor] = {}
        where = {id(p): (off, k) for p, (off, k, _) in zip(self.params, self._views)}
        for name, tensors in (parts or {}).items():
            mask = torch.zeros(self.flat.numel(), dtype=torch.bool, device=self.flat.device)
            for t in tensors:
                if id(t) not in where:
                    raise ValueError(f"FlatRMSProp: part {name!r} holds a tensor that is not one of the parameters")
                off, k = where[id(t)]
                mask[off:off + k] = True
            self.part_masks[name] = mask
        if alternate is not None:
            k, n, first, second = alternate
            if not 0 < k < n or first not in self.part_masks or second not in self.part_masks:
                raise ValueError(f"FlatRMSProp: alternate must be (k, n, part, part) with 0 < k < n and named parts, "
                                 f"got {alternate!r} with parts {sorted(self.part_masks)}")
        self.alternate = alternate
        self._member_of = None
        if ensemble is not None:
            self._member_of = torch.cat([torch.arange(ensemble, device=self.flat.device).repeat_interleave(k // ensemble)
                                         for _, k, _ in self._views])

    def _native_step(self, E: int):
        return None

    def _resident_native(self, E: int):
        return None

    def reset_moments(self, members: Union[Tensor, List[int]]) -> None:
        """The RMS accumulator of ``members`` (a mask ``(E,)`` or a list of indices) back to 1."""
        E = members.numel() if isinstance(members, Tensor) else self.ensemble
        for off, k, _ in self._views:
            seg = self.exp_avg_sq[off:off + k].view(E, -1)
            if isinstance(members, Tensor):
                seg.masked_fill_(members.to(seg.device).unsqueeze(1), 1.0)
            else:
                seg[members] = 1.0

    def part_at(self, step_index: int) -> Optional[str]:
        """The part :meth:`step` updates at the 0-based step ``step_index`` (None: every parameter)."""
        if self.alternate is None:
            return None
        k, n, first, second = self.alternate
        return first if step_index % n < k else second

    @torch.no_grad()
    def step(self, part: Optional[str] = None, members: Optional[Tensor] = None) -> None:
        """One update. Without ``part`` the alternation (if any) picks it from the step count;
        only counted steps (those without ``part``) advance the alternation."""
        if self.clip is not None:
            self.clip_grad_norm_()
        if part is None:
            part = self.part_at(self.step_count)
            self.step_count += 1
        elif part not in self.part_masks:
            raise ValueError(f"FlatRMSProp.step: unknown part {part!r}; parts: {sorted(self.part_masks)}")
        g = self.grad
        mask = None if part is None else self.part_masks[part]
        if members is not None:
            if self._member_of is None:
                raise ValueError("FlatRMSProp.step: members needs ensemble=E")
            m = members.to(self.flat.device)[self._member_of]
            mask = m if mask is None else mask & m
        new_ms = self.exp_avg_sq + (g * g - self.exp_avg_sq) * (1.0 - self.decay)
        lr = self.lr if self.lr_flat is None else self.lr_flat
        update = g * lr / (new_ms + self.eps).sqrt()
        if mask is None:
            self.exp_avg_sq.copy_(new_ms)
            self.flat.sub_(update)
        else:
            self.exp_avg_sq.copy_(torch.where(mask, new_ms, self.exp_avg_sq))
            self.flat.sub_(torch.where(mask, update, torch.zeros_like(update)))

    @torch.no_grad()
    def step_resident(self, frozen: Tensor) -> Tensor:
        """:meth:`step_ensemble` freezing non-finite members too (the alternation reads the host's
        step count, so this step cannot be captured in a CUDA graph)."""
        return self.step_ensemble(frozen, freeze_nonfinite=True)

    def state_dict(self) -> dict:
        return {"exp_avg_sq": self.exp_avg_sq.clone(), "step": self.step_count, "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step_count = int(state["step"])


def _groups(params, lr: LearningRate) -> List[dict]:
    """``params`` as a list of ``{"params": [...], "lr": ...}`` (tensors form one group)."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{"params": [p for p in g["params"] if p.requires_grad], "lr": g.get("lr", lr)} for g in items]
    return [{"params": [p for p in items if p.requires_grad], "lr": lr}]
