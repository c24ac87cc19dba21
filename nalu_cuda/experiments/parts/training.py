"""Training ``E`` seeds as one ensemble, with per-member divergence handling and model selection.

:func:`train_ensemble` (a thin front to :class:`EnsembleTraining`, whose options
:class:`TrainOptions` groups by concern) is the toolkit's one training loop, for the arithmetic tasks (MSE on
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
from .native_step import native_resident_step, native_step
from .optim import FlatAdam

__all__ = ["EvalSet", "TrainResult", "train_ensemble", "evaluate_mse", "progress_bar", "BestState",
           "generator_state", "EnsembleTraining", "TrainOptions", "DataOptions", "EvalOptions", "OptimOptions",
           "UnitHooks", "StepOptions"]


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
    step_path: Optional[str] = None   # EnsembleTraining.step_path: which step trained
    batch_in_kernel: bool = False     # the native resident step drew each batch inside its kernel

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


# ------------------------------------------------------------------------------------------------
# The training loop: its options grouped by concern, and the loop itself as an object with hooks
# ------------------------------------------------------------------------------------------------


@dataclass
class DataOptions:
    """Where the training loss comes from: exactly one of ``batch_fn(step) = (x, t)`` (the MSE of
    the model, ``(E, B, ...) -> (E, B, 1)``, on it) and ``step_loss(step)`` (any per-member loss
    ``(E,)``; it must not call backward). ``stream_state`` = (get, set) of the data stream's state,
    saved in checkpoints (for generators: :func:`generator_state`)."""

    batch_fn: Optional[Callable[[Any], Tuple[Tensor, Tensor]]] = None
    step_loss: Optional[Callable[[int], Tensor]] = None
    stream_state: Optional[Tuple[Callable[[], Any], Callable[[Any], None]]] = None


@dataclass
class EvalOptions:
    """Evaluation every ``eval_every`` steps (and at the last). The validation loss, which drives
    model selection: the MSE on ``val`` or ``validate()`` (under ``no_grad``; exactly one of the two).
    ``tests`` are evaluated at the same steps (history only); ``on_eval(step)`` adds series of its own
    (see :attr:`TrainResult.curves`). ``threshold`` ``(E,)`` with ``solved_on`` (a test name) gives
    ``solved_at``. ``restore_best``: end with each member's best-validation parameters loaded (else
    they are in ``best_state``)."""

    val: Optional[EvalSet] = None
    validate: Optional[Callable[[], Tensor]] = None
    tests: Sequence[EvalSet] = ()
    on_eval: Optional[Callable[[int], Dict[str, List[Any]]]] = None
    eval_every: int = 1000
    threshold: Optional[Tensor] = None
    solved_on: Optional[str] = None
    restore_best: bool = False


@dataclass
class OptimOptions:
    """The optimiser. ``optimizer``: an optimiser over the model's parameters (a :class:`FlatAdam`
    or subclass: parameter groups, learning rates per member), or a factory
    ``optimizer(params, lr, ensemble=E, clip=clip)`` (iNALU: :class:`~.optim.FlatRMSProp`), or None
    for ``FlatAdam`` with ``lr`` and ``clip`` (per-member gradient-norm clipping; a given optimiser
    has its own, so ``clip`` must then be None). ``lr_milestones``: fractions of the steps after
    which the learning rate is multiplied by ``lr_gamma`` (none: constant, the published protocol)."""

    optimizer: Any = None
    lr: float = 1e-3
    clip: Optional[float] = None
    lr_milestones: Sequence[float] = ()
    lr_gamma: float = 0.1


@dataclass
class UnitHooks:
    """The extras some units need (see :class:`~.arithmetic_models.ArithmeticUnit` and
    :func:`~.arithmetic_models.training_hooks`).

    ``regularizer(step, loss)``: a per-member penalty ``(E,)`` added to each member's training loss
    (not to the reported losses), or None when its weight is 0 at that step. ``regularizer_steps``:
    names of the optimiser's parts (:class:`~.optim.FlatRMSProp`); the penalty is then not added to
    the loss but, after each step, minimised on its own in one extra step per part, in that order, by
    the members whose penalty is not zero (iNALU's published runs: the weights, then the gate).
    ``project()`` runs after every optimiser step, under ``no_grad`` (e.g. to clamp weights into
    their range). ``clip_value`` clips every gradient element to ``[-clip_value, clip_value]`` (the
    penalty steps' too). ``reinit(members, step)`` re-draws the parameters of the members whose
    training loss stalled (iNALU's rule, :func:`nalu_cuda.regularizers.inalu_stalled`, applied at
    each evaluation to the mean losses of the evaluation windows since the member's last
    re-initialisation, over at least ``stall_min_steps`` steps); their moments restart at 0."""

    regularizer: Optional[Callable[[Optional[int], Tensor], Optional[Tensor]]] = None
    regularizer_steps: Sequence[str] = ()
    project: Optional[Callable[[], None]] = None
    clip_value: Optional[float] = None
    reinit: Optional[Callable[[List[int], int], None]] = None
    stall_min_steps: int = 10_000


@dataclass
class StepOptions:
    """``resident``: the device-resident step (:class:`_ResidentStep`): ``batch_fn`` gets the step
    as a 0-dim int64 tensor on the training device (e.g. :class:`~.counter_stream.CounterStream`),
    and nothing is read back to the host between evaluations (divergence flags, the loss sums and the
    Adam step count stay on the device; a member is frozen from its first non-finite step). With
    ``graph`` on a CUDA device, the step is captured once in a CUDA graph (after three warm-up steps
    on a side stream) and replayed; ``graph`` needs ``resident`` and no ``regularizer``,
    ``lr_milestones`` or ``reinit`` (host-side schedules would be frozen into the graph).

    ``native``: where the model is one the native step implements (the static task's NAC, NALU and
    NMU models, the recurrent task's NAC and NALU models, on the CPU: :mod:`.native_step`), each
    step (not resident) is one native call (``nalu_cuda::static_ensemble_step``,
    ``recurrent_ensemble_step``) instead of the autograd step; the same numbers up to float rounding
    (``python_tests/test_native_step.py``, ``test_recurrent_native_step.py`` state the tolerances).
    With ``resident`` on CUDA, the static task's models take the gradient from a CUDA kernel instead
    of autograd (:func:`.native_step.native_resident_step`, ``step_path`` "resident-native").
    Off by default here (the autograd step, :meth:`EnsembleTraining.eager_step`, is the library's
    reference); the static and recurrent tasks turn it on by default (``--autograd-step`` turns it
    off): faster for the static task's three models (benchmarks/RESULTS.md, section 20), for the
    recurrent task's see section 20c."""

    resident: bool = False
    graph: bool = False
    native: bool = False


@dataclass
class TrainOptions:
    """Everything :class:`EnsembleTraining` takes besides the model, ``E`` and the step count."""

    data: DataOptions = field(default_factory=DataOptions)
    evaluation: EvalOptions = field(default_factory=EvalOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    units: UnitHooks = field(default_factory=UnitHooks)
    step: StepOptions = field(default_factory=StepOptions)
    ctx: Optional[Context] = None
    desc: str = "train"

    def check(self) -> None:
        """A ``ValueError`` for options that do not go together."""
        d, ev, u, s = self.data, self.evaluation, self.units, self.step
        if (d.batch_fn is None) == (d.step_loss is None):
            raise ValueError("train_ensemble: give exactly one of batch_fn and step_loss")
        if (ev.val is None) == (ev.validate is None):
            raise ValueError("train_ensemble: give exactly one of val and validate")
        if s.resident and d.batch_fn is None:
            raise ValueError("train_ensemble: resident=True needs batch_fn (drawing from the step tensor)")
        if s.graph and not s.resident:
            raise ValueError("train_ensemble: graph=True needs resident=True")
        if s.graph and (u.regularizer is not None or self.optim.lr_milestones or u.reinit is not None):
            raise ValueError("train_ensemble: graph=True cannot take a regularizer, lr_milestones or reinit (host-side "
                             "schedules and re-initialisation); run with graph=False")
        if u.regularizer_steps and s.graph:
            raise ValueError("train_ensemble: regularizer_steps cannot run under graph=True (they read the penalty on "
                             "the host)")


def _is_optimizer(obj: Any) -> bool:
    """An optimiser instance (as opposed to a factory of one)."""
    return obj is not None and hasattr(obj, "step_ensemble")


class EnsembleTraining:
    """The training loop of :func:`train_ensemble`: ``EnsembleTraining(model, E, steps, options).run()``.

    Adam (or the given optimiser) on the sum of the members' losses. Per member: divergence (a
    member whose loss or gradients go NaN/Inf is marked diverged, its gradients zeroed from then on
    and its moments reset at the next evaluation), model selection on validation data
    (:class:`BestState`), "solved at", and checkpoints through ``ctx`` (every
    ``ctx.checkpoint_every_s`` seconds, at evaluation steps) from which a new instance resumes bit
    for bit. The construction builds the optimiser and loads a checkpoint if ``ctx`` has one.

    Hooks a subclass may override (the defaults run :class:`UnitHooks`): :meth:`training_loss`,
    :meth:`loss_penalty`, :meth:`clip_gradients`, :meth:`after_step`, :meth:`stalled_members`.
    """

    def __init__(self, model: nn.Module, E: int, steps: int, options: TrainOptions) -> None:
        options.check()
        self.model, self.E, self.steps, self.options = model, E, steps, options
        self.ctx = options.ctx or Context(device="cpu", work_dir=".", progress=False)
        self.opt = self._build_optimizer()
        self.base_lr = self.opt.lr
        self.val_name = options.evaluation.val.name if options.evaluation.val is not None else "val_loss"
        self.dev = self.opt.params[0].device
        self._init_state()
        self._resume()

    # -- set-up ------------------------------------------------------------------------------------

    def _build_optimizer(self) -> FlatAdam:
        o, u = self.options.optim, self.options.units
        if _is_optimizer(o.optimizer):
            if o.clip is not None:
                raise ValueError("train_ensemble: clip is the optimiser's (FlatAdam(clip=...)) when an optimiser "
                                 "instance is given (optimizer=, or its alias opt=)")
            opt = o.optimizer
        else:
            opt = (o.optimizer or FlatAdam)(self.model.parameters(), o.lr, ensemble=self.E, clip=o.clip)
        parts = getattr(opt, "part_masks", {})
        if any(part not in parts for part in u.regularizer_steps):
            raise ValueError(f"train_ensemble: regularizer_steps {tuple(u.regularizer_steps)} must name parts of the "
                             f"optimiser (FlatRMSProp(parts=...)); it has {sorted(parts) or 'none'}")
        return opt

    def _init_state(self) -> None:
        E, dev = self.E, self.dev
        # Per-member flags on the training device (no host sync per step); statistics on the host.
        self.diverged = torch.zeros(E, dtype=torch.bool, device=dev)
        self.no_member = torch.zeros(E, dtype=torch.bool, device=dev)
        self.any_diverged = False
        self.step_path: Optional[str] = None  # set by run(): "native", "autograd", "resident" or "resident-native"
        self.batch_in_kernel = False  # set by run(): the native resident step draws the batch in its kernel
        self.best = BestState(self.model, E, dtype=torch.float64)
        self.solved_at = torch.full((E,), -1, dtype=torch.long)
        self.history: Dict[str, List[List[float]]] = {"loss": [], self.val_name: []}
        for t in self.options.evaluation.tests:
            self.history[t.name] = []
        self.start = 0
        self.loss_acc = torch.zeros(E, dtype=torch.float64, device=dev)
        self.loss_n = 0
        self.final_loss = torch.full((E,), math.nan, dtype=torch.float64)
        self.wall_before = 0.0
        self.t0 = time.perf_counter()

    def saved_state(self, step: int, wall_s: float) -> Dict[str, Any]:
        """What a checkpoint holds (and what one read back is checked against)."""
        stream = self.options.data.stream_state
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "diverged": self.diverged.cpu(),
                "best": self.best.state_dict(), "solved_at": self.solved_at, "history": self.history, "step": step,
                "final_loss": self.final_loss, "wall_s": wall_s,
                "stream": stream[0]() if stream is not None else None}

    def _resume(self) -> None:
        ck = self.ctx.load_checkpoint()
        if ck is None:
            return
        series = [self.val_name, *(t.name for t in self.options.evaluation.tests)]
        ck = checked_checkpoint(ck, self.saved_state(0, 0.0), self.steps, series)
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        self.diverged = ck["diverged"].to(self.dev)
        self.best.load_state_dict(ck["best"])
        self.solved_at = ck["solved_at"]
        self.history, self.start = dict(ck["history"]), ck["step"]  # a plain dict: saved again in the next checkpoint
        self.final_loss, self.wall_before = ck["final_loss"], ck.get("wall_s", 0.0)
        if self.options.data.stream_state is not None:
            self.options.data.stream_state[1](ck["stream"])
        self.any_diverged = bool(self.diverged.any())
        self.ctx.log(f"{self.options.desc}: resumed at step {self.start}")

    # -- evaluation, checkpoints, re-initialisation -----------------------------------------------

    @torch.no_grad()
    def evaluate(self, step: int) -> None:
        """Record the validation, test and ``on_eval`` series at ``step``; update the per-member best
        state and "solved at"; freeze the members known to have diverged."""
        self.model.eval()
        v, test_vals = self._record_series(step)
        self.model.train()
        div = self.diverged.cpu()
        self.best.update(v, step, eligible=~div)
        ev = self.options.evaluation
        if ev.threshold is not None and ev.solved_on is not None:
            tv = test_vals[ev.solved_on]
            newly = (self.solved_at < 0) & torch.isfinite(tv) & (tv < ev.threshold) & ~div
            self.solved_at = torch.where(newly, torch.full_like(self.solved_at, step), self.solved_at)
        self.any_diverged = bool(div.any())
        if self.any_diverged:  # freeze diverged members: no momentum left to move them
            self.opt.reset_moments(self.diverged)

    def _record_series(self, step: int) -> Tuple[Tensor, Dict[str, Tensor]]:
        """The validation losses ``(E,)`` and the test MSEs by name, all appended to the history."""
        ev, history, E = self.options.evaluation, self.history, self.E
        v = evaluate_mse(self.model, ev.val, E) if ev.val is not None else ev.validate().detach().double().cpu()
        history[self.val_name].append([step] + v.tolist())
        test_vals = {}
        for t in ev.tests:
            tv = evaluate_mse(self.model, t, E)
            test_vals[t.name] = tv
            history[t.name].append([step] + tv.tolist())
        if ev.on_eval is not None:
            for name, series in ev.on_eval(step).items():
                if name not in history:
                    history[name] = []
                    history.setdefault("_on_eval", []).append(name)
                history[name].append([step] + list(series))
        return v, test_vals

    def checkpoint(self, step: int) -> None:
        self.ctx.save_checkpoint(self.saved_state(step, self.wall_before + time.perf_counter() - self.t0))

    def stalled_members(self, step: int) -> None:
        """iNALU's re-initialisation of the members whose loss windows since their last one stalled."""
        from nalu_cuda.regularizers import inalu_stalled

        u, E, history = self.options.units, self.E, self.history
        since = history.setdefault("reinit", [[0] * E])[-1]
        min_windows = max(1, u.stall_min_steps // self.options.evaluation.eval_every)
        div = self.diverged.cpu()
        members = [e for e in range(E) if not bool(div[e]) and inalu_stalled(
            [row[1 + e] for row in history["loss"] if row[0] > since[e]], min_count=min_windows)]
        if members:
            u.reinit(members, step)
            self.opt.reset_moments(members)
            history["reinit"].append([step if e in members else since[e] for e in range(E)])

    # -- one training step --------------------------------------------------------------------------

    def _mse(self, batch: Tuple[Tensor, Tensor]) -> Tensor:
        x, target = batch
        err = (self.model(x) - target).reshape(self.E, -1)
        return (err * err).mean(1)

    def training_loss(self, step: int) -> Tensor:
        """The per-member training loss ``(E,)`` of ``step`` (eager path)."""
        data = self.options.data
        if data.step_loss is not None:
            return data.step_loss(step)
        return self._mse(data.batch_fn(step))

    def loss_penalty(self, step: Optional[int], loss: Tensor) -> Optional[Tensor]:
        """Hook: the penalty added to the objective (the regulariser, unless it has steps of its own)."""
        u = self.options.units
        if u.regularizer is None or u.regularizer_steps:
            return None
        return u.regularizer(step, loss)

    def _objective(self, step: Optional[int], loss: Tensor) -> Tensor:
        penalty = self.loss_penalty(step, loss.detach())
        return loss if penalty is None else loss + penalty

    def clip_gradients(self) -> None:
        """Hook: clip the optimiser's gradient buffer by value (``clip_value``)."""
        clip_value = self.options.units.clip_value
        if clip_value is not None:
            self.opt.grad.clamp_(-clip_value, clip_value)

    def gradients(self, total: Tensor) -> None:
        """The gradient of ``total`` in the optimiser's buffer, clipped by value."""
        self.opt.zero_grad()
        total.backward()
        self.opt.gather_grads()
        self.clip_gradients()

    def penalty_steps(self, step: Optional[int], loss: Tensor) -> None:
        """``regularizer_steps``: one step per part on the penalty alone, for the members it applies to."""
        u = self.options.units
        for part in u.regularizer_steps:
            penalty = u.regularizer(step, loss)
            if penalty is None:
                return
            active = (penalty.detach() != 0) & torch.isfinite(penalty.detach()) & ~self.diverged
            if not bool(active.any()):
                return
            self.gradients(torch.where(active, penalty, torch.zeros_like(penalty)).sum())
            self.opt.step(part=part, members=active)

    def after_step(self, step: Optional[int], loss: Tensor) -> None:
        """Hook after each optimiser step: the penalty's own steps, ``project()``, the loss sums."""
        u = self.options.units
        if u.regularizer is not None and u.regularizer_steps:
            self.penalty_steps(step, loss.detach())
        if u.project is not None:
            with torch.no_grad():
                u.project()
        self.loss_acc.add_(loss.detach().double())

    def eager_step(self, step: int) -> None:
        """One step (the default path, bit for bit the published runs')."""
        loss = self.training_loss(step)
        objective = self._objective(step, loss)
        self.diverged |= ~torch.isfinite(objective.detach())
        self.gradients(torch.where(self.diverged, torch.zeros_like(objective), objective).sum())
        # Diverged members are frozen once known at an evaluation (any_diverged); from then on,
        # so is every member that goes NaN/Inf, from its first bad step.
        frozen = self.diverged if self.any_diverged else self.no_member
        self.diverged |= self.opt.step_ensemble(frozen, freeze_nonfinite=self.any_diverged)
        self.after_step(step, loss)

    def resident_step(self, step: Optional[int]) -> None:
        """One step with no host round trip (see :class:`StepOptions`); ``step`` is None under a graph."""
        loss = self._mse(self.options.data.batch_fn(self.data_step))
        objective = self._objective(step, loss)
        self.diverged.bitwise_or_(~torch.isfinite(objective.detach()))
        total = torch.where(self.diverged, torch.zeros_like(objective), objective).sum()
        self.opt.zero_grad()
        total.backward()
        self.clip_gradients()
        self.diverged.bitwise_or_(self.opt.step_resident(self.diverged))
        self.after_step(step, loss)
        self.data_step.add_(1)

    # -- the loop -----------------------------------------------------------------------------------

    def _step_runner(self) -> Callable[[int], None]:
        s = self.options.step
        if not s.resident:
            step = native_step(self, EnsembleTraining)
            self.step_path = "autograd" if step is None else "native"
            return self.eager_step if step is None else step
        self.data_step = torch.full((), self.start + 1, dtype=torch.int64, device=self.dev)
        body = native_resident_step(self, EnsembleTraining)
        self.step_path = "resident" if body is None else "resident-native"
        return _ResidentStep(self.resident_step if body is None else body, s.graph and self.dev.type == "cuda")

    def end_window(self, step: int) -> None:
        """At an evaluation step: the window's mean losses, re-initialisation, evaluation."""
        self.final_loss = (self.loss_acc / max(1, self.loss_n)).cpu()
        self.loss_acc.zero_()
        self.loss_n = 0
        self.history["loss"].append([step] + self.final_loss.tolist())
        if self.options.units.reinit is not None:
            self.stalled_members(step)
        self.evaluate(step)

    def _show(self, bar) -> None:
        fl = self.final_loss[torch.isfinite(self.final_loss) & ~self.diverged.cpu()]
        ev = self.options.evaluation
        # solved= only where the experiment has a success criterion (a threshold to solve)
        shown = {} if ev.threshold is None or ev.solved_on is None else {"solved": int((self.solved_at >= 0).sum())}
        bar.set_postfix(loss=f"{fl.median().item():.3g}" if fl.numel() else "nan",
                        **shown, div=int(self.diverged.sum()), refresh=False)

    def run(self) -> TrainResult:
        """Train from the start (or the checkpoint) to ``steps``; the per-member results."""
        o, steps = self.options, self.steps
        self.t0 = time.perf_counter()
        last_ck = time.monotonic()
        runner = self._step_runner()
        self.model.train()
        if self.start == 0:
            self.evaluate(0)
        bar = progress_bar(steps, o.desc, self.ctx.progress, initial=self.start)
        try:
            bounds = sorted(int(round(f * steps)) for f in o.optim.lr_milestones)
            for step in range(self.start + 1, steps + 1):
                if bounds:
                    self.opt.lr = self.base_lr * o.optim.lr_gamma ** sum(step > b for b in bounds)
                runner(step)
                self.loss_n += 1
                if step % o.evaluation.eval_every == 0 or step == steps:
                    self.end_window(step)
                    self._show(bar)
                    if step < steps and time.monotonic() - last_ck >= self.ctx.checkpoint_every_s:
                        self.checkpoint(step)
                        last_ck = time.monotonic()
                bar.update(1)
        finally:
            bar.close()
        return self._result()

    def _result(self) -> TrainResult:
        if self.options.evaluation.restore_best:
            self.best.restore()
            self.model.eval()
        return TrainResult(steps=self.steps, best_step=self.best.best_step, best_val=self.best.best,
                           diverged=self.diverged.cpu().clone(), solved_at=self.solved_at, final_loss=self.final_loss,
                           history=self.history, wall_s=self.wall_before + time.perf_counter() - self.t0,
                           best_state=self.best.saved, val_name=self.val_name, step_path=self.step_path,
                           batch_in_kernel=self.batch_in_kernel)


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
    optimizer: Optional[Any] = None,
    regularizer_steps: Sequence[str] = (),
    native: bool = False,
) -> TrainResult:
    """Train the ensemble ``model`` for ``steps`` steps: :class:`EnsembleTraining` with these options.

    The options, by concern (each documented on its group): the data (:class:`DataOptions`:
    ``batch_fn``, ``step_loss``, ``stream_state``), evaluation and model selection
    (:class:`EvalOptions`: ``val``, ``validate``, ``tests``, ``on_eval``, ``eval_every``,
    ``threshold``, ``solved_on``, ``restore_best``), the optimiser (:class:`OptimOptions`:
    ``optimizer``, ``lr``, ``clip``, ``lr_milestones``, ``lr_gamma``), the units' extras
    (:class:`UnitHooks`: ``regularizer``, ``regularizer_steps``, ``project``, ``clip_value``,
    ``reinit``, ``stall_min_steps``), the step (:class:`StepOptions`: ``resident``, ``graph``, ``native``), and
    ``ctx`` (checkpoints, progress) and ``desc`` (the progress bar's label).

    ``optimizer`` is the documented name for the optimiser: an instance (e.g. a :class:`FlatAdam`
    with per-member learning rates) or a factory ``optimizer(params, lr, ensemble=E, clip=clip)``.
    ``opt`` is its older alias, kept for compatibility: ``opt=X`` is ``optimizer=X`` for an
    instance ``X``; where both are given, ``opt`` is the optimiser and a factory in ``optimizer``
    is not used (as before the alias), while two instances are an error.
    """
    if opt is not None and _is_optimizer(optimizer):
        raise ValueError("train_ensemble: give the optimiser once, as optimizer= (opt= is its older alias)")
    options = TrainOptions(
        data=DataOptions(batch_fn=batch_fn, step_loss=step_loss, stream_state=stream_state),
        evaluation=EvalOptions(val=val, validate=validate, tests=tests, on_eval=on_eval, eval_every=eval_every,
                               threshold=threshold, solved_on=solved_on, restore_best=restore_best),
        optim=OptimOptions(optimizer=opt if opt is not None else optimizer, lr=lr, clip=clip,
                           lr_milestones=lr_milestones, lr_gamma=lr_gamma),
        units=UnitHooks(regularizer=regularizer, regularizer_steps=regularizer_steps, project=project,
                        clip_value=clip_value, reinit=reinit, stall_min_steps=stall_min_steps),
        step=StepOptions(resident=resident, graph=graph, native=native), ctx=ctx, desc=desc)
    return EnsembleTraining(model, E, steps, options).run()


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
