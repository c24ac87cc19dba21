"""Training ``E`` seeds as one ensemble, with per-member divergence handling and model selection.

Two loops share the pieces here (:class:`BestState`, :func:`progress_bar`, checkpoints through the
run context): :func:`train_ensemble`, the arithmetic tasks' loop (MSE on ``batch_fn`` batches,
:class:`~.optim.FlatAdam`), and :func:`train_sequence_ensemble`, the sequence tasks' loop (any
per-member loss from ``train_step``, :class:`~.optim.EnsembleAdam`). They stay two because their
published numbers were made with two update orders and two divergence policies (below).

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..registry import Context
from .optim import EnsembleAdam, FlatAdam, member_view

__all__ = ["EvalSet", "TrainResult", "train_ensemble", "evaluate_mse", "progress_bar", "BestState",
           "SequenceTrainResult", "train_sequence_ensemble"]


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
    """Per-member MSE ``(E,)`` in float64 accumulation, evaluating in chunks of samples.

    A member's MSE does not depend on ``E`` (so blocks of seeds give the numbers of the whole
    ensemble): the float64 sums run over chunks sized for one copy of the inputs, and when ``E``
    copies of a chunk exceed ``max_elems`` the model sees it in pieces of a multiple of 64 rows, none
    shorter than 256 (a shorter last piece joins the one before). Measured here: the fused CPU
    kernels compute rows 4 at a time (a call's last ``n % 4`` rows in a different order), and MKL's
    batched products give other bits below about 200 rows; a row's output is the same in any call
    of 256 or more rows whose start is a multiple of 4 rows away."""
    N = ev.x.shape[0]
    per_row = max(1, int(torch.tensor(ev.x.shape[1:]).prod().item()))
    copies = 1 if ev.shared else E
    chunk = max(1, min(ev.batch, max_elems // per_row))
    piece = max(256, max_elems // (copies * per_row) // 64 * 64)
    total = torch.zeros(E, dtype=torch.float64)
    for s in range(0, N, chunk):
        end = min(N, s + chunk)
        cuts = list(range(s, end, piece)) + [end]
        if len(cuts) > 2 and end - cuts[-2] < 256:
            del cuts[-2]
        ys = [model(ev.x[a:b] if ev.shared else ev.x[a:b].unsqueeze(0).expand(E, b - a, *ev.x.shape[1:]).contiguous())
              for a, b in zip(cuts, cuts[1:])]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, 1)
        d = (y - ev.targets[:, s:end]).double()
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


class BestState:
    """Per-member copy of the parameters at each member's best validation loss so far.

    Tensors lead with the members: ``(E, ...)``, or ``(E * C, ...)`` in member-major blocks
    (grouped convolutions); others (no member dimension) are left as they were.
    """

    def __init__(self, module: nn.Module, ensemble: int, dtype: torch.dtype = torch.float32) -> None:
        self.module = module
        self.E = ensemble
        self.best = torch.full((ensemble,), math.inf, dtype=dtype)
        self.best_step = torch.zeros(ensemble, dtype=torch.long)
        self.saved = {k: v.detach().clone() for k, v in module.state_dict().items()}

    @torch.no_grad()
    def update(self, val_loss: Tensor, step: int, eligible: Optional[Tensor] = None) -> Tensor:
        """Record members whose ``val_loss`` (E,) improved (non-finite never does, nor a member
        outside ``eligible``); returns the mask."""
        val_loss = val_loss.detach().to(self.best.dtype).cpu()
        better = torch.isfinite(val_loss) & (val_loss < self.best)
        if eligible is not None:
            better &= eligible.cpu()
        if bool(better.any()):
            self.best = torch.where(better, val_loss, self.best)
            self.best_step = torch.where(better, torch.full_like(self.best_step, step), self.best_step)
            for k, v in self.module.state_dict().items():
                m = self._member_mask(better, v)
                if m is not None:
                    self.saved[k] = torch.where(m, v.detach(), self.saved[k])
        return better

    def _member_mask(self, better: Tensor, v: Tensor) -> Optional[Tensor]:
        """``better`` shaped over ``v``'s members, or None for a tensor that holds no members."""
        if v.dim() == 0 or v.shape[0] % self.E:
            return None
        if v.shape[0] == self.E:
            return better.to(v.device).reshape(self.E, *([1] * (v.dim() - 1)))
        # grouped-conv tensors: (E * C, ...) with member-major channel blocks
        per = v.shape[0] // self.E
        return better.to(v.device).repeat_interleave(per).reshape(v.shape[0], *([1] * (v.dim() - 1)))

    @torch.no_grad()
    def restore(self) -> None:
        """Load the best parameters into the module (members never improved keep their initial ones)."""
        self.module.load_state_dict(self.saved)

    def state_dict(self) -> Dict:
        return {"best": self.best.clone(), "best_step": self.best_step.clone(),
                "saved": {k: v.clone() for k, v in self.saved.items()}}

    def load_state_dict(self, state: Dict) -> None:
        self.best = state["best"].clone()
        self.best_step = state["best_step"].clone()
        self.saved = {k: v.clone() for k, v in state["saved"].items()}


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
    regularizer: Optional[Callable[[int, Tensor], Optional[Tensor]]] = None,
    project: Optional[Callable[[], None]] = None,
    clip_value: Optional[float] = None,
    reinit: Optional[Callable[[List[int], int], None]] = None,
    stall_min_steps: int = 10_000,
) -> TrainResult:
    """Train ``model`` (``(E, B, ...) -> (E, B, 1)``) for ``steps`` Adam steps.

    ``batch_fn(step)`` gives one training batch ``(x, t)``. ``val`` drives model selection;
    ``tests`` are evaluated at the same steps (history only). ``threshold`` ``(E,)`` with
    ``solved_on`` (a test name) gives ``solved_at``. ``stream_state`` = (get, set) of the data
    stream's state, saved in checkpoints. ``lr_milestones``: fractions of ``steps`` after which
    the learning rate is multiplied by ``lr_gamma`` (none: constant, the published protocol).

    Hooks for units that need them (see :class:`~.arithmetic_models.ArithmeticUnit` and
    :func:`~.arithmetic_models.training_hooks`): ``regularizer(step, loss)`` gives a per-member
    penalty ``(E,)`` added to each member's training loss (not to the reported losses), or None
    when its weight is 0 at that step; ``project()`` runs after every optimiser step, under
    ``no_grad`` (e.g. to clamp weights into their range); ``clip_value`` clips every gradient
    element to ``[-clip_value, clip_value]``; ``reinit(members, step)`` re-draws the parameters of
    the members whose training loss stalled (iNALU's rule, :func:`nalu_cuda.regularizers.inalu_stalled`,
    applied at each evaluation to the mean losses of the evaluation windows since the member's last
    re-initialisation, over at least ``stall_min_steps`` steps); their Adam moments restart at 0.
    """
    ctx = ctx or Context(device="cpu", work_dir=".", progress=False)
    params = [p for p in model.parameters()]
    opt = FlatAdam(params, lr)
    any_diverged = False
    dev = params[0].device
    # Per-member flags on the training device (no host sync per step); statistics on the host.
    diverged = torch.zeros(E, dtype=torch.bool, device=dev)
    no_member = torch.zeros(E, dtype=torch.bool, device=dev)
    best = BestState(model, E, dtype=torch.float64)
    solved_at = torch.full((E,), -1, dtype=torch.long)
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
        best.load_state_dict(ck["best"])
        solved_at = ck["solved_at"]
        history, start = ck["history"], ck["step"]
        final_loss, wall_before = ck["final_loss"], ck.get("wall_s", 0.0)
        if stream_state is not None:
            stream_state[1](ck["stream"])
        any_diverged = bool(diverged.any())
        ctx.log(f"{desc}: resumed at step {start}")

    t0 = time.perf_counter()
    last_ck = time.monotonic()

    def evaluate(step: int) -> None:
        nonlocal solved_at
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
        best.update(v, step, eligible=~div)
        if threshold is not None and solved_on is not None:
            tv = test_vals[solved_on]
            newly = (solved_at < 0) & torch.isfinite(tv) & (tv < threshold) & ~div
            solved_at = torch.where(newly, torch.full_like(solved_at, step), solved_at)
        nonlocal any_diverged
        any_diverged = bool(div.any())
        if any_diverged:  # freeze diverged members: no momentum left to move them
            for i in range(len(params)):
                for mom in opt.moment_views(i):
                    mom.masked_fill_(member_view(diverged, mom), 0.0)

    def checkpoint(step: int) -> None:
        ctx.save_checkpoint({
            "model": model.state_dict(), "opt": opt.state_dict(), "diverged": diverged.cpu(), "best": best.state_dict(),
            "solved_at": solved_at, "history": history,
            "step": step, "final_loss": final_loss, "wall_s": wall_before + time.perf_counter() - t0,
            "stream": stream_state[0]() if stream_state is not None else None,
        })

    def stalled_members(step: int) -> None:
        """iNALU's re-initialisation of the members whose loss windows since their last one stalled."""
        from nalu_cuda.regularizers import inalu_stalled

        since = history.setdefault("reinit", [[0] * E])[-1]
        min_windows = max(1, stall_min_steps // eval_every)
        div = diverged.cpu()
        members = [e for e in range(E) if not bool(div[e]) and inalu_stalled(
            [row[1 + e] for row in history["loss"] if row[0] > since[e]], min_count=min_windows)]
        if members:
            reinit(members, step)
            for i in range(len(params)):
                for mom in opt.moment_views(i):
                    mom[members] = 0.0
            history["reinit"].append([step if e in members else since[e] for e in range(E)])

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
            penalty = None if regularizer is None else regularizer(step, loss.detach())
            objective = loss if penalty is None else loss + penalty
            bad = ~torch.isfinite(objective)
            diverged |= bad
            total = torch.where(diverged, torch.zeros_like(objective), objective).sum()
            opt.zero_grad()
            total.backward()
            opt.gather_grads()
            if clip_value is not None:
                opt.grad.clamp_(-clip_value, clip_value)
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
                        g.masked_fill_(member_view(diverged, g), 0.0)
                sq = sum((p.grad.reshape(E, -1).double() ** 2).sum(1) for p in params if p.grad is not None)
                scale = (clip / (sq.sqrt() + 1e-12)).clamp(max=1.0).float()
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(member_view(scale, p.grad))
                opt.step()
            if project is not None:
                with torch.no_grad():
                    project()
            loss_acc += loss.detach().double()
            loss_n += 1
            if step % eval_every == 0 or step == steps:
                final_loss = (loss_acc / max(1, loss_n)).cpu()
                loss_acc.zero_()
                loss_n = 0
                history["loss"].append([step] + final_loss.tolist())
                if reinit is not None:
                    stalled_members(step)
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
    return TrainResult(steps=steps, best_step=best.best_step, best_val=best.best, diverged=diverged.cpu().clone(),
                       solved_at=solved_at, final_loss=final_loss, history=history,
                       wall_s=wall_before + time.perf_counter() - t0, best_state=best.saved)


@dataclass
class SequenceTrainResult:
    """What :func:`train_sequence_ensemble` returns: the best-state keeper (best losses and steps
    per member), divergence flags, learning curves."""

    best: BestState
    diverged: Tensor                      # (E,) bool
    curves: Dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    wall_s: float = 0.0


def train_sequence_ensemble(*, ctx: Context, model: nn.Module, opt: EnsembleAdam, ensemble: int, steps: int,
                            eval_every: int, train_step: Callable[[int], Tensor], validate: Callable[[], Tensor],
                            on_eval: Optional[Callable[[int], Dict[str, List[float]]]] = None,
                            generators: Optional[Dict[str, torch.Generator]] = None,
                            desc: str = "train") -> SequenceTrainResult:
    """Train ``model`` for ``steps`` steps (the sequence tasks' loop).

    ``train_step(step)`` returns the per-member training losses ``(E,)`` (it must not call backward);
    the loop sums them, back-propagates and steps ``opt``. Every ``eval_every`` steps and at the end,
    ``validate()`` gives the per-member validation losses ``(E,)`` (under ``no_grad``), the best
    parameters per member are kept, and ``on_eval(step)`` (if given) adds learning-curve points.
    A member whose training loss or parameters turn NaN/Inf is marked diverged (it keeps training,
    harmlessly: members never mix). ``generators`` (the data samplers) are saved in checkpoints.
    At the end the model holds each member's best-validation parameters.
    """
    generators = generators or {}
    best = BestState(model, ensemble)
    diverged = torch.zeros(ensemble, dtype=torch.bool)
    curves: Dict[str, Any] = {"step": []}
    start = 0
    ck = ctx.load_checkpoint()
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        best.load_state_dict(ck["best"])
        diverged = ck["diverged"].clone()
        curves = ck["curves"]
        for k, g in generators.items():
            g.set_state(ck["generators"][k])
        start = int(ck["step"])
        ctx.log(f"{desc}: resuming at step {start}/{steps}")

    def checkpoint(step: int) -> None:
        ctx.save_checkpoint({"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                             "best": best.state_dict(), "diverged": diverged.clone(), "curves": curves,
                             "generators": {k: g.get_state() for k, g in generators.items()}})

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            val = validate().detach().float().cpu()
            best.update(val, step)
            curves["step"].append(step)
            curves.setdefault("val_loss", []).append([v if math.isfinite(v) else None for v in val.tolist()])
            if on_eval is not None:
                for k, v in on_eval(step).items():
                    curves.setdefault(k, []).append(v)
        model.train()

    t0 = time.perf_counter()
    last_ck = time.perf_counter()
    bar = progress_bar(steps, desc, ctx.progress, initial=start)
    model.train()
    if start == 0:
        evaluate(0)
    for step in range(start + 1, steps + 1):
        losses = train_step(step)
        bad = ~torch.isfinite(losses.detach()).cpu()
        diverged |= bad
        opt.zero_grad()
        # a diverged member contributes nothing more (its NaN gradients would only touch itself,
        # but keeping them out keeps its Adam state finite for inspection)
        total = torch.where(bad.to(losses.device), torch.zeros_like(losses), losses).sum()
        total.backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            evaluate(step)
            with torch.no_grad():
                for p in model.parameters():
                    per = p.detach().reshape(ensemble, -1)
                    diverged |= ~torch.isfinite(per).all(1).cpu()
        if ctx.progress:
            bar.update(1)
            if step % 50 == 0:
                fin = losses.detach()[torch.isfinite(losses.detach())]
                bar.set_postfix(loss=f"{fin.median().item():.4g}" if fin.numel() else "nan")
        if time.perf_counter() - last_ck > ctx.checkpoint_every_s and step < steps:
            checkpoint(step)
            last_ck = time.perf_counter()
    bar.close()
    best.restore()
    model.eval()
    return SequenceTrainResult(best=best, diverged=diverged, curves=curves, steps_done=steps,
                       wall_s=time.perf_counter() - t0)
