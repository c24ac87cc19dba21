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


def make_adam(params, lr: float) -> torch.optim.Adam:
    """Adam (the fused single-kernel variant where this torch has it for the parameters' device)."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr, foreach=True)


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
) -> TrainResult:
    """Train ``model`` (``(E, B, ...) -> (E, B, 1)``) for ``steps`` Adam steps.

    ``batch_fn(step)`` gives one training batch ``(x, t)``. ``val`` drives model selection;
    ``tests`` are evaluated at the same steps (history only). ``threshold`` ``(E,)`` with
    ``solved_on`` (a test name) gives ``solved_at``. ``stream_state`` = (get, set) of the data
    stream's state, saved in checkpoints.
    """
    ctx = ctx or Context(device="cpu", work_dir=".", progress=False)
    params = [p for p in model.parameters()]
    opt = make_adam(params, lr)
    any_diverged = False
    diverged = torch.zeros(E, dtype=torch.bool)
    best_val = torch.full((E,), math.inf, dtype=torch.float64)
    best_step = torch.zeros(E, dtype=torch.long)
    solved_at = torch.full((E,), -1, dtype=torch.long)
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    history: Dict[str, List[List[float]]] = {"loss": [], val.name: []}
    for t in tests:
        history[t.name] = []
    start = 0
    loss_acc = torch.zeros(E, dtype=torch.float64)
    loss_n = 0
    final_loss = torch.full((E,), math.nan, dtype=torch.float64)
    wall_before = 0.0

    ck = ctx.load_checkpoint()
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        diverged, best_val, best_step, solved_at = ck["diverged"], ck["best_val"], ck["best_step"], ck["solved_at"]
        best_state, history, start = ck["best_state"], ck["history"], ck["step"]
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
        ok = torch.isfinite(v) & ~diverged
        improved = ok & (v < best_val)
        if bool(improved.any()):
            best_val = torch.where(improved, v, best_val)
            best_step = torch.where(improved, torch.full_like(best_step, step), best_step)
            with torch.no_grad():
                for k, p in model.state_dict().items():
                    if p.dim() >= 1 and p.shape[0] == E:
                        best_state[k].copy_(torch.where(_member_view(improved, p), p, best_state[k]))
        if threshold is not None and solved_on is not None:
            tv = test_vals[solved_on]
            newly = (solved_at < 0) & torch.isfinite(tv) & (tv < threshold) & ~diverged
            solved_at = torch.where(newly, torch.full_like(solved_at, step), solved_at)
        nonlocal any_diverged
        any_diverged = bool(diverged.any())
        if any_diverged:  # freeze diverged members: no momentum left to move them
            for p in params:
                st = opt.state.get(p)
                if st:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key in st:
                            st[key].masked_fill_(_member_view(diverged, st[key]), 0.0)

    def checkpoint(step: int) -> None:
        ctx.save_checkpoint({
            "model": model.state_dict(), "opt": opt.state_dict(), "diverged": diverged, "best_val": best_val,
            "best_step": best_step, "solved_at": solved_at, "best_state": best_state, "history": history,
            "step": step, "final_loss": final_loss, "wall_s": wall_before + time.perf_counter() - t0,
            "stream": stream_state[0]() if stream_state is not None else None,
        })

    if start == 0:
        evaluate(0)
    bar = progress_bar(steps, desc, ctx.progress, initial=start)
    try:
        for step in range(start + 1, steps + 1):
            x, target = batch_fn(step)
            y = model(x)
            err = (y - target).reshape(E, -1)
            loss = (err * err).mean(1)
            bad = ~torch.isfinite(loss)
            diverged |= bad
            total = torch.where(diverged, torch.zeros_like(loss), loss).sum()
            opt.zero_grad(set_to_none=True)
            total.backward()
            # A NaN/Inf anywhere in a member's gradients makes its per-member sum non-finite.
            grads = [p.grad for p in params if p.grad is not None]
            sums = torch.stack([g.reshape(E, -1).sum(1) for g in grads], 1)
            diverged |= ~torch.isfinite(sums).all(1)
            if any_diverged:  # known at the last evaluation; later ones are masked from the next
                for g in grads:
                    g.masked_fill_(_member_view(diverged, g), 0.0)
            if clip is not None:
                sq = sum((p.grad.reshape(E, -1).double() ** 2).sum(1) for p in params if p.grad is not None)
                scale = (clip / (sq.sqrt() + 1e-12)).clamp(max=1.0).float()
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(_member_view(scale, p.grad))
            opt.step()
            loss_acc += loss.detach().double()
            loss_n += 1
            if step % eval_every == 0 or step == steps:
                final_loss = loss_acc / max(1, loss_n)
                loss_acc.zero_()
                loss_n = 0
                history["loss"].append([step] + final_loss.tolist())
                evaluate(step)
                fl = final_loss[torch.isfinite(final_loss) & ~diverged]
                bar.set_postfix(loss=f"{fl.median().item():.3g}" if fl.numel() else "nan",
                                solved=int((solved_at >= 0).sum()), div=int(diverged.sum()), refresh=False)
                if step < steps and time.monotonic() - last_ck >= ctx.checkpoint_every_s:
                    checkpoint(step)
                    last_ck = time.monotonic()
            bar.update(1)
    finally:
        bar.close()
    return TrainResult(steps=steps, best_step=best_step, best_val=best_val, diverged=diverged.clone(),
                       solved_at=solved_at, final_loss=final_loss, history=history,
                       wall_s=wall_before + time.perf_counter() - t0, best_state=best_state)
