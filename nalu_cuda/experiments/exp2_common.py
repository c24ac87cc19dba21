"""What the Experiments II modules (digits, language, programs, parity) share.

* :func:`train_ensemble`: the training loop of one configuration, all seeds as one ensemble, with
  a progress bar, model selection on validation loss per member (:class:`BestState`), divergence
  detection per member, optional learning curves, and mid-run checkpoints for ``--resume``.
* :func:`interval_summary`: the ``summary.json`` record: the registry's default plus, for every
  numeric per-seed metric, its mean over seeds with a 95% Student-t interval (``<key>_ci``).
* Markdown helpers for the report tables.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .recurrent_units import BestState, EnsembleAdam, mean_ci
from .registry import Config, Context, default_summary

__all__ = ["TrainResult", "train_ensemble", "interval_summary", "fmt_ci", "fmt_num", "add_backend_argument",
           "resolve_backend", "resolve_device", "seed_list", "finite_or_none"]


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--backend auto|fused|reference`` for the NAC/NALU layers (skipped if the CLI already has it)."""
    try:
        parser.add_argument("--backend", choices=("auto", "fused", "reference"), default=None,
                            help="implementation of the NAC/NALU layers (default auto: fused where a kernel exists)")
    except argparse.ArgumentError:
        pass


def run_options(args: argparse.Namespace, params: Dict[str, Any], quick: Dict[str, Any]) -> Tuple[int, int]:
    """The common options of a subcommand: ``--backend`` into ``params`` when given; ``(seeds, steps)``
    from ``--seeds``/``--steps``, else the experiment's quick profile (``quick``)."""
    if getattr(args, "backend", None):
        params["backend"] = args.backend
    seeds = args.seeds if args.seeds is not None else quick["seeds"]
    steps = args.steps if args.steps is not None else quick["steps"]
    return seeds, steps


def resolve_backend(config: Config, ctx: Context) -> str:
    return config.params.get("backend") or getattr(ctx, "backend", None) or "auto"


def resolve_device(ctx: Context) -> torch.device:
    return torch.device(ctx.device or "cpu")


def seed_list(config: Config) -> List[int]:
    """Seed values of a configuration: ``first_seed .. first_seed + seeds - 1`` (default first 0)."""
    first = int(config.params.get("first_seed", 0))
    return list(range(first, first + int(config.seeds)))


def finite_or_none(x) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class TrainResult:
    best: BestState
    diverged: Tensor                      # (E,) bool
    curves: Dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    wall_s: float = 0.0


def train_ensemble(*, ctx: Context, model: nn.Module, opt: EnsembleAdam, ensemble: int, steps: int, eval_every: int,
                   train_step: Callable[[int], Tensor], validate: Callable[[], Tensor],
                   on_eval: Optional[Callable[[int], Dict[str, List[float]]]] = None,
                   generators: Optional[Dict[str, torch.Generator]] = None, desc: str = "train") -> TrainResult:
    """Train ``model`` for ``steps`` steps.

    ``train_step(step)`` returns the per-member training losses ``(E,)`` (it must not call backward);
    the loop sums them, back-propagates and steps ``opt``. Every ``eval_every`` steps and at the end,
    ``validate()`` gives the per-member validation losses ``(E,)`` (under ``no_grad``), the best
    parameters per member are kept, and ``on_eval(step)`` (if given) adds learning-curve points.
    A member whose training loss or parameters turn NaN/Inf is marked diverged (it keeps training,
    harmlessly: members never mix). ``generators`` (the data samplers) are saved in checkpoints.
    At the end the model holds each member's best-validation parameters.
    """
    from tqdm.auto import tqdm

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
            curves.setdefault("val_loss", []).append([finite_or_none(v) for v in val])
            if on_eval is not None:
                for k, v in on_eval(step).items():
                    curves.setdefault(k, []).append(v)
        model.train()

    t0 = time.perf_counter()
    last_ck = time.perf_counter()
    bar = tqdm(total=steps, initial=start, desc=desc, disable=not ctx.progress, leave=False, dynamic_ncols=True)
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
    return TrainResult(best=best, diverged=diverged, curves=curves, steps_done=steps,
                       wall_s=time.perf_counter() - t0)


_SKIP = {"seed", "best_step", "diverged", "success", "solved_at"}


def interval_summary(config: Config, records: List[Dict[str, Any]], extra: Dict[str, Any]) -> Dict[str, Any]:
    """The registry's default summary plus ``<key>_mean`` and ``<key>_ci`` (95% Student-t over seeds)
    for every numeric per-seed key (non-finite values left out; ``<key>_n`` says how many counted)."""
    out = default_summary(config, records)
    keys = []
    for r in records:
        for k, v in r.items():
            if k in _SKIP or k in keys or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            keys.append(k)
    for k in keys:
        m, lo, hi = mean_ci(r.get(k) for r in records)
        out[f"{k}_mean"] = m
        out[f"{k}_ci"] = [lo, hi]
        out[f"{k}_n"] = sum(1 for r in records if isinstance(r.get(k), (int, float)) and math.isfinite(r[k]))
    if records and any("diverged" in r for r in records):
        out["diverged_count"] = sum(bool(r.get("diverged")) for r in records)
    return out


def fmt_num(x: Optional[float], digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    ax = abs(x)
    if ax != 0 and (ax >= 1e5 or ax < 1e-3):
        return f"{x:.2e}"
    return f"{x:.{digits}g}"


def fmt_ci(summary: Dict[str, Any], key: str, pct: bool = False, digits: int = 3) -> str:
    """``mean [lo, hi]`` of a summary key (``pct``: as percentages)."""
    m = summary.get(f"{key}_mean")
    ci = summary.get(f"{key}_ci") or [None, None]
    if m is None:
        return "n/a"
    if pct:
        lo, hi = ci
        if lo is None:
            return f"{100 * m:.1f}%"
        return f"{100 * m:.1f}% [{100 * max(0.0, lo):.1f}, {100 * min(1.0, hi):.1f}]"
    if ci[0] is None or ci[0] == ci[1]:
        return fmt_num(m, digits)
    return f"{fmt_num(m, digits)} [{fmt_num(ci[0], digits)}, {fmt_num(ci[1], digits)}]"
