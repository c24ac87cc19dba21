"""Training ``E`` seeds as one ensemble, with per-member divergence handling and model selection.

:func:`train_ensemble` is the toolkit's one training loop, for the arithmetic tasks (MSE on
``batch_fn`` batches, validation on an :class:`EvalSet`) and the sequence tasks (any per-member
loss from ``step_loss``, validation from ``validate``) alike. It runs Adam
(:class:`~.optim.FlatAdam`; iNALU: its published RMSProp, :class:`~.optim.FlatRMSProp`) on the sum
of the members' losses (so every member gets exactly the gradient of its own loss: members never
mix, and Adam is elementwise), and keeps, per member:

* divergence: a member whose loss or gradients go NaN/Inf is marked diverged, its gradients are
  zeroed from then on and its Adam moments reset at the next evaluation, so it stops moving; it
  never touches the others (no operation reduces across members; optional gradient clipping is
  per member);
* model selection on validation data only (:class:`BestState`): the parameters at the evaluation
  with the lowest validation loss are kept per member (``best_step``); test sets are evaluated for
  reporting and for "solved at" (the first evaluation whose extrapolation MSE is under the
  threshold), never for selection;
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

from ..integrity import CheckpointState
from ..registry import Context
from .optim import FlatAdam

__all__ = ["EvalSet", "TrainResult", "train_ensemble", "evaluate_mse", "progress_bar", "BestState",
           "generator_state"]


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
    val_name: str = "val"

    @property
    def curves(self) -> Dict[str, Any]:
        """The learning curves as JSON-ready columns: ``step`` (the evaluation steps),
        ``val_loss`` (per evaluation, the members' validation losses, None where not finite) and
        every series ``on_eval`` added (per evaluation, its list)."""
        rows = self.history[self.val_name]
        out: Dict[str, Any] = {"step": [int(r[0]) for r in rows],
                               "val_loss": [[v if math.isfinite(v) else None for v in r[1:]] for r in rows]}
        for name in self.history.get("_on_eval", []):
            out[name] = [r[1:] for r in self.history[name]]
        return out


def generator_state(generators: Sequence[torch.Generator]):
    """``(get, set)`` of the states of data generators, for ``train_ensemble(stream_state=...)``."""
    gens = list(generators)

    def get() -> List[Tensor]:
        return [g.get_state() for g in gens]

    def set_(states: List[Tensor]) -> None:
        for g, st in zip(gens, states):
            g.set_state(st)

    return get, set_


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


def checked_checkpoint(ck: Dict[str, Any], like: Dict[str, Any], steps: int, series: Sequence[str]):
    """``ck`` (a checkpoint's state, as :func:`train_ensemble` saves it) with every field checked
    against ``like`` (the state this run would save: same keys, kinds, tensor shapes and dtypes), the
    step an integer in ``[0, steps]``, ``best_step`` and ``solved_at`` no later than it, and the
    history's ``series`` (and ``loss``) rows of a step and ``E`` numbers. Returns it as a
    :class:`~..integrity.CheckpointState`; a field that is not right is a ``RunError`` naming it."""

    ck = ck if isinstance(ck, CheckpointState) else CheckpointState(ck)
    step = ck.field("step", like=int, within=(0, steps))
    for key in ("model", "opt", "diverged", "final_loss", "stream"):
        ck.field(key, like=like[key])
    best = ck.field("best", like=like["best"])
    best.field("best_step", like=like["best"]["best_step"], within=(0, step))
    ck.field("solved_at", like=like["solved_at"], within=(-1, step))
    if "wall_s" in ck:
        ck.field("wall_s", like=0.0, within=(0, math.inf))
    history = ck.field("history", like=dict)
    E = like["diverged"].numel()
    for name in ["loss", *series]:
        rows = history.field(name, like=list)
        for i, row in enumerate(rows):
            if not (isinstance(row, list) and len(row) == E + 1 and all(isinstance(v, (int, float)) for v in row)
                    and type(row[0]) is int and row[0] >= 0):
                raise history.error(f".{name}[{i}]", f"a list [step, {E} numbers]", repr(row)[:60])
    return ck


def train_ensemble(
    model: nn.Module,
    E: int,
    batch_fn: Optional[Callable[[int], Tuple[Tensor, Tensor]]] = None,
    steps: int = 0,
    val: Optional[EvalSet] = None,
    tests: Sequence[EvalSet] = (),
    *,
    step_loss: Optional[Callable[[int], Tensor]] = None,
    validate: Optional[Callable[[], Tensor]] = None,
    on_eval: Optional[Callable[[int], Dict[str, List[Any]]]] = None,
    opt: Optional[FlatAdam] = None,
    restore_best: bool = False,
    lr: float = 1e-3,
    eval_every: int = 1000,
    threshold: Optional[Tensor] = None,
    solved_on: Optional[str] = None,
    ctx: Optional[Context] = None,
    desc: str = "train",
    clip: Optional[float] = None,
    stream_state: Optional[Tuple[Callable[[], Any], Callable[[Any], None]]] = None,
    lr_milestones: Sequence[float] = (),
    lr_gamma: float = 0.1,
    regularizer: Optional[Callable[[int, Tensor], Optional[Tensor]]] = None,
    project: Optional[Callable[[], None]] = None,
    clip_value: Optional[float] = None,
    reinit: Optional[Callable[[List[int], int], None]] = None,
    stall_min_steps: int = 10_000,
    resident: bool = False,
    graph: bool = False,
    optimizer: Optional[Callable[..., FlatAdam]] = None,
    regularizer_steps: Sequence[str] = (),
) -> TrainResult:
    """Train the ensemble ``model`` for ``steps`` Adam steps.

    The training loss, per member ``(E,)``: the MSE of ``model`` (``(E, B, ...) -> (E, B, 1)``) on
    ``batch_fn(step) = (x, t)``, or ``step_loss(step)`` (any per-member loss; it must not call
    backward). The validation loss, which drives model selection: the MSE on ``val`` (an
    :class:`EvalSet`), or ``validate()`` (run under ``no_grad``). ``tests`` are evaluated at the
    same steps (history only); ``on_eval(step)`` adds series of its own to the history (see
    :attr:`TrainResult.curves`). ``threshold`` ``(E,)`` with ``solved_on`` (a test name) gives
    ``solved_at``. ``stream_state`` = (get, set) of the data stream's state (for generators:
    :func:`generator_state`), saved in checkpoints. ``opt``: a :class:`FlatAdam` over ``model``'s
    parameters (parameter groups, learning rates per member); by default one with ``lr`` and
    ``clip`` (per-member gradient-norm clipping). ``lr_milestones``: fractions of ``steps`` after
    which the learning rate is multiplied by ``lr_gamma`` (none: constant, the published
    protocol). ``restore_best``: end with each member's best-validation parameters loaded (else
    they are in ``best_state``).

    Hooks for units that need them (see :class:`~.arithmetic_models.ArithmeticUnit` and
    :func:`~.arithmetic_models.training_hooks`): ``regularizer(step, loss)`` gives a per-member
    penalty ``(E,)`` added to each member's training loss (not to the reported losses), or None
    when its weight is 0 at that step; ``project()`` runs after every optimiser step, under
    ``no_grad`` (e.g. to clamp weights into their range); ``clip_value`` clips every gradient
    element to ``[-clip_value, clip_value]``; ``reinit(members, step)`` re-draws the parameters of
    the members whose training loss stalled (iNALU's rule, :func:`nalu_cuda.regularizers.inalu_stalled`,
    applied at each evaluation to the mean losses of the evaluation windows since the member's last
    re-initialisation, over at least ``stall_min_steps`` steps); their Adam moments restart at 0.
    ``optimizer(params, lr, ensemble=E, clip=clip)`` builds the optimiser when ``opt`` is not given
    (default :class:`FlatAdam`; iNALU: :class:`~.optim.FlatRMSProp`). ``regularizer_steps``: names
    of the optimiser's parts (:class:`~.optim.FlatRMSProp`); the penalty is then not added to the
    training loss but, after each step, minimised on its own in one extra step per part, in that
    order, by the members whose penalty is not zero (iNALU's published runs: the weights, then the
    gate; clipping by ``clip_value`` applies to them too).

    ``resident``: the device-resident step (:class:`_ResidentStep`): ``batch_fn`` gets the step as a
    0-dim int64 tensor on the training device (e.g. :class:`~.counter_stream.CounterStream`), and
    nothing is read back to the host between evaluations (divergence flags, the loss sums and the
    Adam step count stay on the device; a member is frozen from its first non-finite step). With
    ``graph`` on a CUDA device, the step is captured once in a CUDA graph (after three warm-up
    steps on a side stream) and replayed; ``graph`` needs ``resident`` and no ``regularizer``,
    ``lr_milestones`` or ``reinit`` (host-side schedules would be frozen into the graph).
    """
    if (batch_fn is None) == (step_loss is None):
        raise ValueError("train_ensemble: give exactly one of batch_fn and step_loss")
    if (val is None) == (validate is None):
        raise ValueError("train_ensemble: give exactly one of val and validate")
    if resident and batch_fn is None:
        raise ValueError("train_ensemble: resident=True needs batch_fn (drawing from the step tensor)")
    if graph and not resident:
        raise ValueError("train_ensemble: graph=True needs resident=True")
    if graph and (regularizer is not None or lr_milestones or reinit is not None):
        raise ValueError("train_ensemble: graph=True cannot take a regularizer, lr_milestones or reinit (host-side "
                         "schedules and re-initialisation); run with graph=False")
    if regularizer_steps and graph:
        raise ValueError("train_ensemble: regularizer_steps cannot run under graph=True (they read the penalty on the host)")
    ctx = ctx or Context(device="cpu", work_dir=".", progress=False)
    if opt is None:
        opt = (optimizer or FlatAdam)(model.parameters(), lr, ensemble=E, clip=clip)
    elif clip is not None:
        raise ValueError("train_ensemble: clip is the optimiser's (FlatAdam(clip=...)) when opt is given")
    parts = getattr(opt, "part_masks", {})
    if any(part not in parts for part in regularizer_steps):
        raise ValueError(f"train_ensemble: regularizer_steps {tuple(regularizer_steps)} must name parts of the optimiser "
                         f"(FlatRMSProp(parts=...)); it has {sorted(parts) or 'none'}")
    base_lr = opt.lr
    params = opt.params
    val_name = val.name if val is not None else "val_loss"
    any_diverged = False
    dev = params[0].device
    # Per-member flags on the training device (no host sync per step); statistics on the host.
    diverged = torch.zeros(E, dtype=torch.bool, device=dev)
    no_member = torch.zeros(E, dtype=torch.bool, device=dev)
    best = BestState(model, E, dtype=torch.float64)
    solved_at = torch.full((E,), -1, dtype=torch.long)
    history: Dict[str, List[List[float]]] = {"loss": [], val_name: []}
    for t in tests:
        history[t.name] = []
    start = 0
    loss_acc = torch.zeros(E, dtype=torch.float64, device=dev)
    loss_n = 0
    final_loss = torch.full((E,), math.nan, dtype=torch.float64)
    wall_before = 0.0

    def saved_state(step: int, wall_s: float) -> Dict[str, Any]:
        """What a checkpoint holds (and what one read back is checked against)."""
        return {"model": model.state_dict(), "opt": opt.state_dict(), "diverged": diverged.cpu(),
                "best": best.state_dict(), "solved_at": solved_at, "history": history, "step": step,
                "final_loss": final_loss, "wall_s": wall_s,
                "stream": stream_state[0]() if stream_state is not None else None}

    ck = ctx.load_checkpoint()
    if ck is not None:
        ck = checked_checkpoint(ck, saved_state(0, 0.0), steps, [val_name, *(t.name for t in tests)])
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        diverged = ck["diverged"].to(dev)
        best.load_state_dict(ck["best"])
        solved_at = ck["solved_at"]
        history, start = dict(ck["history"]), ck["step"]  # a plain dict: saved again in the next checkpoint
        final_loss, wall_before = ck["final_loss"], ck.get("wall_s", 0.0)
        if stream_state is not None:
            stream_state[1](ck["stream"])
        any_diverged = bool(diverged.any())
        ctx.log(f"{desc}: resumed at step {start}")

    t0 = time.perf_counter()
    last_ck = time.monotonic()

    @torch.no_grad()
    def evaluate(step: int) -> None:
        nonlocal solved_at, any_diverged
        model.eval()
        v = evaluate_mse(model, val, E) if val is not None else validate().detach().double().cpu()
        history[val_name].append([step] + v.tolist())
        test_vals = {}
        for t in tests:
            tv = evaluate_mse(model, t, E)
            test_vals[t.name] = tv
            history[t.name].append([step] + tv.tolist())
        if on_eval is not None:
            for name, series in on_eval(step).items():
                if name not in history:
                    history[name] = []
                    history.setdefault("_on_eval", []).append(name)
                history[name].append([step] + list(series))
        model.train()
        div = diverged.cpu()
        best.update(v, step, eligible=~div)
        if threshold is not None and solved_on is not None:
            tv = test_vals[solved_on]
            newly = (solved_at < 0) & torch.isfinite(tv) & (tv < threshold) & ~div
            solved_at = torch.where(newly, torch.full_like(solved_at, step), solved_at)
        any_diverged = bool(div.any())
        if any_diverged:  # freeze diverged members: no momentum left to move them
            opt.reset_moments(diverged)

    def checkpoint(step: int) -> None:
        ctx.save_checkpoint(saved_state(step, wall_before + time.perf_counter() - t0))

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
            opt.reset_moments(members)
            history["reinit"].append([step if e in members else since[e] for e in range(E)])

    def training_loss(step: int) -> Tensor:
        if step_loss is not None:
            return step_loss(step)
        x, target = batch_fn(step)
        err = (model(x) - target).reshape(E, -1)
        return (err * err).mean(1)

    # The regulariser is added to the training loss, or (regularizer_steps) minimised in steps of its own.
    loss_penalty = None if regularizer_steps else regularizer
    step_penalty = regularizer if regularizer_steps else None

    def gradients(total: Tensor) -> None:
        """The gradient of ``total`` in the optimiser's buffer, clipped by value."""
        opt.zero_grad()
        total.backward()
        opt.gather_grads()
        if clip_value is not None:
            opt.grad.clamp_(-clip_value, clip_value)

    def penalty_steps(step: int, loss: Tensor) -> None:
        """``regularizer_steps``: one step per part on the penalty alone, for the members it applies to."""
        for part in regularizer_steps:
            penalty = step_penalty(step, loss)
            if penalty is None:
                return
            active = (penalty.detach() != 0) & torch.isfinite(penalty.detach()) & ~diverged
            if not bool(active.any()):
                return
            gradients(torch.where(active, penalty, torch.zeros_like(penalty)).sum())
            opt.step(part=part, members=active)

    def _eager_step(step: int) -> None:
        """One step (the default path, bit for bit the published runs')."""
        nonlocal diverged
        loss = training_loss(step)
        penalty = None if loss_penalty is None else loss_penalty(step, loss.detach())
        objective = loss if penalty is None else loss + penalty
        bad = ~torch.isfinite(objective.detach())
        diverged |= bad
        gradients(torch.where(diverged, torch.zeros_like(objective), objective).sum())
        # Diverged members are frozen once known at an evaluation (any_diverged); from then on,
        # so is every member that goes NaN/Inf, from its first bad step.
        frozen = diverged if any_diverged else no_member
        diverged |= opt.step_ensemble(frozen, freeze_nonfinite=any_diverged)
        if step_penalty is not None:
            penalty_steps(step, loss.detach())
        if project is not None:
            with torch.no_grad():
                project()
        loss_acc.add_(loss.detach().double())

    def resident_step(step: Optional[int]) -> None:
        """One step with no host round trip (see ``resident``); ``step`` is None under a graph."""
        x, target = batch_fn(data_step)
        err = (model(x) - target).reshape(E, -1)
        loss = (err * err).mean(1)
        penalty = None if loss_penalty is None else loss_penalty(step, loss.detach())
        objective = loss if penalty is None else loss + penalty
        diverged.bitwise_or_(~torch.isfinite(objective.detach()))
        total = torch.where(diverged, torch.zeros_like(objective), objective).sum()
        opt.zero_grad()
        total.backward()
        if clip_value is not None:
            opt.grad.clamp_(-clip_value, clip_value)
        diverged.bitwise_or_(opt.step_resident(diverged))
        if step_penalty is not None:
            penalty_steps(step, loss.detach())
        if project is not None:
            with torch.no_grad():
                project()
        loss_acc.add_(loss.detach().double())
        data_step.add_(1)

    if resident:
        data_step = torch.full((), start + 1, dtype=torch.int64, device=dev)
        runner = _ResidentStep(resident_step, graph and dev.type == "cuda")

    model.train()
    if start == 0:
        evaluate(0)
    bar = progress_bar(steps, desc, ctx.progress, initial=start)
    try:
        bounds = sorted(int(round(f * steps)) for f in lr_milestones)
        for step in range(start + 1, steps + 1):
            if bounds:
                opt.lr = base_lr * lr_gamma ** sum(step > b for b in bounds)
            if resident:
                runner(step)
            else:
                _eager_step(step)
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
                # solved= only where the experiment has a success criterion (a threshold to solve)
                shown = {} if threshold is None or solved_on is None else {"solved": int((solved_at >= 0).sum())}
                bar.set_postfix(loss=f"{fl.median().item():.3g}" if fl.numel() else "nan",
                                **shown, div=int(diverged.sum()), refresh=False)
                if step < steps and time.monotonic() - last_ck >= ctx.checkpoint_every_s:
                    checkpoint(step)
                    last_ck = time.monotonic()
            bar.update(1)
    finally:
        bar.close()
    if restore_best:
        best.restore()
        model.eval()
    return TrainResult(steps=steps, best_step=best.best_step, best_val=best.best, diverged=diverged.cpu().clone(),
                       solved_at=solved_at, final_loss=final_loss, history=history,
                       wall_s=wall_before + time.perf_counter() - t0, best_state=best.saved, val_name=val_name)


class _ResidentStep:
    """Runs the resident step: eagerly, or (``graph``, CUDA) captured once in a CUDA graph after
    three warm-up steps on a side stream, then replayed (one launch for the whole step)."""

    WARMUP = 3

    def __init__(self, body: Callable[[Optional[int]], None], graph: bool) -> None:
        self.body = body
        self.graph_enabled = graph
        self.graph = None
        self.warm = 0

    def __call__(self, step: int) -> None:
        if not self.graph_enabled:
            self.body(step)
            return
        if self.graph is None:
            if self.warm < self.WARMUP:  # warm-up steps are real steps, on a side stream
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.body(None)
                torch.cuda.current_stream().wait_stream(side)
                self.warm += 1
                return
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the step; it runs at the replay below
                self.body(None)
        self.graph.replay()
