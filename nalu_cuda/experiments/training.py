"""Training ``E`` seeds as one ensemble, with per-member divergence handling and model selection.

:func:`train_ensemble` runs Adam on the sum of the members' losses (so every member gets exactly
the gradient of its own loss: members never mix, and Adam is elementwise), and keeps, per member:

* divergence: a member whose loss or gradients go NaN/Inf is marked diverged, its gradients are
  zeroed from then on and its Adam moments reset at the next evaluation, so it stops moving; it
  never touches the others (no operation reduces across members; optional gradient clipping is
  per member);
* model selection on validation data only: the parameters at the evaluation with the lowest
  validation MSE are kept per member (``best_step``); test sets are evaluated for reporting and
  for "solved at" (the first evaluation whose extrapolation MSE is under the threshold), never
  for selection;
* checkpoints through the run context (every ``ctx.checkpoint_every_s`` seconds, at evaluation
  steps), from which ``--resume`` continues bit for bit.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .registry import Context

__all__ = ["EvalSet", "TrainResult", "train_ensemble", "evaluate_mse", "progress_bar"]


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, initial=initial, disable=not enabled, dynamic_ncols=True, leave=False,
                mininterval=0.5, smoothing=0.05)


@dataclass
class EvalSet:
    """A fixed evaluation set: inputs shared by every member, targets per member ``(E, N, 1)``.

    ``shared``: the model takes the shared inputs ``(N, ...)`` itself (no ``E`` copies; the
    recurrent models do, which matters for sequences of length 1000).
    """

    name: str
    x: Tensor
    targets: Tensor
    batch: int = 2048
    shared: bool = False


@torch.no_grad()
def evaluate_mse(model: nn.Module, ev: EvalSet, E: int, max_elems: int = 4_000_000) -> Tensor:
    """Per-member MSE ``(E,)`` in float64 accumulation, evaluating in chunks of samples."""
    N = ev.x.shape[0]
    per_row = max(1, int(torch.tensor(ev.x.shape[1:]).prod().item()))
    copies = 1 if ev.shared else E
    chunk = max(1, min(ev.batch, max_elems // max(1, copies * per_row)))
    total = torch.zeros(E, dtype=torch.float64)
    for s in range(0, N, chunk):
        x = ev.x[s:s + chunk]
        xe = x if ev.shared else x.unsqueeze(0).expand(E, *x.shape).contiguous()
        y = model(xe)
        d = (y - ev.targets[:, s:s + chunk]).double()
        total += (d * d).reshape(E, -1).sum(1).cpu()
    return total / (N * ev.targets.shape[-1])


@dataclass
class TrainResult:
    """Per-member results (tensors of shape ``(E,)`` unless noted)."""

    steps: int
    best_step: Tensor
    best_val: Tensor
    diverged: Tensor
    solved_at: Tensor                     # -1 where never solved
    final_loss: Tensor
    history: Dict[str, List[List[float]]]  # name -> [[step, v_1..v_E], ...]
    wall_s: float
    best_state: Dict[str, Tensor] = field(default_factory=dict)


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
                g.masked_fill_(_member_view(mask, g), 0.0)
        self.step()
        return nonfinite

    def state_dict(self) -> dict:
        return {"exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(), "step": self.step_count,
                "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step_count = int(state["step"])


def _member_view(mask: Tensor, t: Tensor) -> Tensor:
    return mask.reshape(-1, *([1] * (t.dim() - 1)))


def train_ensemble(
    model: nn.Module,
    E: int,
    batch_fn: Callable[[int], Tuple[Tensor, Tensor]],
    steps: int,
    val: EvalSet,
    tests: Sequence[EvalSet] = (),
    *,
    lr: float = 1e-3,
    eval_every: int = 1000,
    threshold: Optional[Tensor] = None,
    solved_on: Optional[str] = None,
    ctx: Optional[Context] = None,
    desc: str = "train",
    clip: Optional[float] = None,
    stream_state: Optional[Tuple[Callable[[], dict], Callable[[dict], None]]] = None,
    lr_milestones: Sequence[float] = (),
    lr_gamma: float = 0.1,
) -> TrainResult:
    """Train ``model`` (``(E, B, ...) -> (E, B, 1)``) for ``steps`` Adam steps.

    ``batch_fn(step)`` gives one training batch ``(x, t)``. ``val`` drives model selection;
    ``tests`` are evaluated at the same steps (history only). ``threshold`` ``(E,)`` with
    ``solved_on`` (a test name) gives ``solved_at``. ``stream_state`` = (get, set) of the data
    stream's state, saved in checkpoints. ``lr_milestones``: fractions of ``steps`` after which
    the learning rate is multiplied by ``lr_gamma`` (none: constant, the published protocol).
    """
    ctx = ctx or Context(device="cpu", work_dir=".", progress=False)
    params = [p for p in model.parameters()]
    opt = FlatAdam(params, lr)
    any_diverged = False
    dev = params[0].device
    # Per-member flags on the training device (no host sync per step); statistics on the host.
    diverged = torch.zeros(E, dtype=torch.bool, device=dev)
    no_member = torch.zeros(E, dtype=torch.bool, device=dev)
    best_val = torch.full((E,), math.inf, dtype=torch.float64)
    best_step = torch.zeros(E, dtype=torch.long)
    solved_at = torch.full((E,), -1, dtype=torch.long)
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    history: Dict[str, List[List[float]]] = {"loss": [], val.name: []}
    for t in tests:
        history[t.name] = []
    start = 0
    loss_acc = torch.zeros(E, dtype=torch.float64, device=dev)
    loss_n = 0
    final_loss = torch.full((E,), math.nan, dtype=torch.float64)
    wall_before = 0.0

    ck = ctx.load_checkpoint()
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        diverged = ck["diverged"].to(dev)
        best_val, best_step, solved_at = ck["best_val"], ck["best_step"], ck["solved_at"]
        best_state = {k: v.to(best_state[k].device) for k, v in ck["best_state"].items()}
        history, start = ck["history"], ck["step"]
        final_loss, wall_before = ck["final_loss"], ck.get("wall_s", 0.0)
        if stream_state is not None:
            stream_state[1](ck["stream"])
        any_diverged = bool(diverged.any())
        ctx.log(f"{desc}: resumed at step {start}")

    t0 = time.perf_counter()
    last_ck = time.monotonic()

    def evaluate(step: int) -> None:
        nonlocal best_val, best_step, solved_at
        model.eval()
        v = evaluate_mse(model, val, E)
        history[val.name].append([step] + v.tolist())
        test_vals = {}
        for t in tests:
            tv = evaluate_mse(model, t, E)
            test_vals[t.name] = tv
            history[t.name].append([step] + tv.tolist())
        model.train()
        div = diverged.cpu()
        ok = torch.isfinite(v) & ~div
        improved = ok & (v < best_val)
        if bool(improved.any()):
            best_val = torch.where(improved, v, best_val)
            best_step = torch.where(improved, torch.full_like(best_step, step), best_step)
            with torch.no_grad():
                for k, p in model.state_dict().items():
                    if p.dim() >= 1 and p.shape[0] == E:
                        best_state[k].copy_(torch.where(_member_view(improved.to(p.device), p), p, best_state[k]))
        if threshold is not None and solved_on is not None:
            tv = test_vals[solved_on]
            newly = (solved_at < 0) & torch.isfinite(tv) & (tv < threshold) & ~div
            solved_at = torch.where(newly, torch.full_like(solved_at, step), solved_at)
        nonlocal any_diverged
        any_diverged = bool(div.any())
        if any_diverged:  # freeze diverged members: no momentum left to move them
            for i in range(len(params)):
                for mom in opt.moment_views(i):
                    mom.masked_fill_(_member_view(diverged, mom), 0.0)

    def checkpoint(step: int) -> None:
        ctx.save_checkpoint({
            "model": model.state_dict(), "opt": opt.state_dict(), "diverged": diverged.cpu(), "best_val": best_val,
            "best_step": best_step, "solved_at": solved_at, "best_state": best_state, "history": history,
            "step": step, "final_loss": final_loss, "wall_s": wall_before + time.perf_counter() - t0,
            "stream": stream_state[0]() if stream_state is not None else None,
        })

    if start == 0:
        evaluate(0)
    bar = progress_bar(steps, desc, ctx.progress, initial=start)
    try:
        bounds = sorted(int(round(f * steps)) for f in lr_milestones)
        for step in range(start + 1, steps + 1):
            opt.lr = lr * lr_gamma ** sum(step > b for b in bounds)
            x, target = batch_fn(step)
            y = model(x)
            err = (y - target).reshape(E, -1)
            loss = (err * err).mean(1)
            bad = ~torch.isfinite(loss)
            diverged |= bad
            total = torch.where(diverged, torch.zeros_like(loss), loss).sum()
            opt.zero_grad()
            total.backward()
            opt.gather_grads()
            if clip is None:
                # Diverged members are frozen once known at an evaluation (any_diverged); from then
                # on, so is every member that goes NaN/Inf, from its first bad step.
                frozen = diverged if any_diverged else no_member
                diverged |= opt.step_ensemble(frozen, freeze_nonfinite=any_diverged)
            else:
                # A NaN/Inf anywhere in a member's gradients makes its per-member sum non-finite.
                grads = [p.grad for p in params]
                sums = torch.stack([g.reshape(E, -1).sum(1) for g in grads], 1)
                diverged |= ~torch.isfinite(sums).all(1)
                if any_diverged:  # known at the last evaluation; later ones are masked from the next
                    for g in grads:
                        g.masked_fill_(_member_view(diverged, g), 0.0)
                sq = sum((p.grad.reshape(E, -1).double() ** 2).sum(1) for p in params if p.grad is not None)
                scale = (clip / (sq.sqrt() + 1e-12)).clamp(max=1.0).float()
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(_member_view(scale, p.grad))
                opt.step()
            loss_acc += loss.detach().double()
            loss_n += 1
            if step % eval_every == 0 or step == steps:
                final_loss = (loss_acc / max(1, loss_n)).cpu()
                loss_acc.zero_()
                loss_n = 0
                history["loss"].append([step] + final_loss.tolist())
                evaluate(step)
                fl = final_loss[torch.isfinite(final_loss) & ~diverged.cpu()]
                bar.set_postfix(loss=f"{fl.median().item():.3g}" if fl.numel() else "nan",
                                solved=int((solved_at >= 0).sum()), div=int(diverged.sum()), refresh=False)
                if step < steps and time.monotonic() - last_ck >= ctx.checkpoint_every_s:
                    checkpoint(step)
                    last_ck = time.monotonic()
            bar.update(1)
    finally:
        bar.close()
    return TrainResult(steps=steps, best_step=best_step, best_val=best_val, diverged=diverged.cpu().clone(),
                       solved_at=solved_at, final_loss=final_loss, history=history,
                       wall_s=wall_before + time.perf_counter() - t0, best_state=best_state)
