"""The units' regularisers and their schedules, as the published numbers were produced (docs/units.md).

One module for every unit: Madsen & Johansen's sparsity regulariser (NAU, NMU) with its linear
schedule and the sparsity error; the NPU's L1 penalty with its stepwise schedule; iNALU's
regulariser, switch-on rule, stall test and re-initialisation. Every penalty takes
``ensemble=True`` for a leading member dimension and then gives one value per member, ``(E,)``.

Madsen & Johansen (NAU, NMU).

The published training loss ("Neural Arithmetic Units", ICLR 2020; stable-nalu's
``functional/regualizer.py`` and ``simple_function_static.py``) is

    loss = MSE + lambda * s(t) * sum over layers of R(W),   s(t) = clip((t - start) / (end - start), 0, 1)

with ``R_NAU = mean(min(|W|, 1 - |W|))`` and ``R_NMU = mean(min(|W|, |1 - W|))``; both are 0 exactly
when every weight is in {-1, 0, 1} (NAU) or {0, 1} (NMU). The published (lambda, start, end) per
model are in :data:`PUBLISHED_SCHEDULES`. The reported sparsity error is
``max over weights of min(|W|, |1 - |W||)``.

NPU / RealNPU (Heim et al. 2020, NeuralPowerUnits scripts): loss = MSE + beta(t) * L1, with
``L1 = sum |W_r| + sum |W_i|`` and a stepwise schedule ``beta(t) = min(beta_start * growth **
(t // step), beta_end)``: multiplied by 10 every 10,000 steps (their simple tasks: 1e-4 -> 1e-2).

iNALU (Schlör et al. 2020, daschloer/inalu): ``R = (1/20) sum over (W_hat, M_hat, W_hat_m,
M_hat_m, G) of mean(max(min(-v, v) + 20, 0))`` (pushes every parameter away from (-20, 20)),
switched on once the epoch is past 10 and the batch loss is below 1; all parameters re-drawn
from U(-2, 2) when the loss stalls above 1 (:func:`inalu_stalled`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "nau_sparsity", "nmu_sparsity", "sparsity", "schedule", "RegularizerSchedule", "PUBLISHED_SCHEDULES",
    "sparsity_error", "StepwiseSchedule", "npu_l1", "npu_l1_beta", "inalu_regularizer", "inalu_regularizer_active",
    "inalu_stalled", "inalu_reinitialize_",
]


def _mean(v: Tensor, ensemble: bool) -> Tensor:
    return v.flatten(1).mean(1) if ensemble else v.mean()


def nau_sparsity(W: Tensor, ensemble: bool = False) -> Tensor:
    """``R_NAU = mean(min(|W|, 1 - |W|))`` over every element of W, or per member ``(E,)``."""
    a = W.abs()
    return _mean(torch.minimum(a, 1 - a), ensemble)


def nmu_sparsity(W: Tensor, ensemble: bool = False) -> Tensor:
    """``R_NMU = mean(min(|W|, |1 - W|))`` over every element of W, or per member ``(E,)``."""
    return _mean(torch.minimum(W.abs(), (1 - W).abs()), ensemble)


def sparsity(module: nn.Module, ensemble: bool = False) -> Tensor:
    """The sum of R over every NAU and NMU in ``module`` (itself included); 0 if it has none.
    ``ensemble=True``: the modules carry a leading member dimension, one sum per member ``(E,)``."""
    from .modules import NAU, NMU

    terms = []
    for m in module.modules():
        if isinstance(m, NAU):
            terms.append(nau_sparsity(m.W, ensemble))
        elif isinstance(m, NMU):
            terms.append(nmu_sparsity(m.W, ensemble))
    if not terms:
        p = next(module.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    return torch.stack(terms).sum(0)


def schedule(step: Union[int, float], start: float, end: float) -> float:
    """``s(t) = clip((t - start) / (end - start), 0, 1)``: 0 before ``start``, 1 from ``end`` on."""
    if not end > start:
        raise ValueError(f"nalu_cuda.regularizers.schedule: 'end' must be greater than 'start', got start={start}, "
                         f"end={end}")
    return min(max((step - start) / (end - start), 0.0), 1.0)


@dataclass(frozen=True)
class RegularizerSchedule:
    """``lambda * s(t)``: the weight of the sparsity regulariser at step t."""

    scale: float  # lambda
    start: float
    end: float

    def __post_init__(self):
        if not (self.scale >= 0 and self.scale != float("inf")):
            raise ValueError(f"nalu_cuda.regularizers.RegularizerSchedule: 'scale' must be a finite number >= 0, "
                             f"got {self.scale}")
        schedule(0, self.start, self.end)  # checks start < end

    def weight(self, step: Union[int, float]) -> float:
        return self.scale * schedule(step, self.start, self.end)


@dataclass(frozen=True)
class StepwiseSchedule:
    """The NPU scripts' stepwise weight, in the terms of :class:`RegularizerSchedule`: 0 before
    ``start``, then ``scale / growth ** (stages - 1)``, multiplied by ``growth`` at each of
    ``stages - 1`` evenly spaced steps, reaching ``scale`` at ``end``. The published one
    (``beta = 1e-4``, x10 every 10,000 steps, at most 1e-2) is ``StepwiseSchedule(1e-2, 0, 2e4)``."""

    scale: float
    start: float
    end: float
    stages: int = 3
    growth: float = 10.0

    def __post_init__(self):
        RegularizerSchedule(self.scale, self.start, self.end)  # the same checks
        if self.stages < 1 or not self.growth >= 1:
            raise ValueError(f"nalu_cuda.regularizers.StepwiseSchedule: need stages >= 1 and growth >= 1, got "
                             f"stages={self.stages}, growth={self.growth}")

    def weight(self, step: Union[int, float]) -> float:
        if step < self.start:
            return 0.0
        if self.stages == 1:
            return self.scale
        every = (self.end - self.start) / (self.stages - 1)
        k = min(int((step - self.start) // every), self.stages - 1)
        return self.scale / self.growth ** (self.stages - 1 - k)


# Madsen & Johansen's static task (docs/units.md): "NMU model" NAU -> NMU and "NAU model" NAU -> NAU;
# the NPU scripts' L1 weight (1e-4, x10 every 1e4 steps, up to 1e-2).
PUBLISHED_SCHEDULES: Dict[str, Union[RegularizerSchedule, StepwiseSchedule]] = {
    "nmu": RegularizerSchedule(scale=10.0, start=1e6, end=2e6),
    "nau": RegularizerSchedule(scale=0.01, start=5e3, end=5e4),
    "npu": StepwiseSchedule(scale=1e-2, start=0.0, end=2e4),
}


def sparsity_error(weights: Union[Tensor, Iterable[Tensor]], ensemble: bool = False) -> Tensor:
    """``max over weights of min(|W|, |1 - |W||)``, the error Madsen & Johansen report.

    ``weights``: one tensor or several (the layers of a model). With ``ensemble=True`` every
    tensor has a leading member dimension E and the result has shape (E,), one error per member.
    """
    if isinstance(weights, Tensor):
        weights = [weights]
    errs = []
    for W in weights:
        a = W.detach().abs()
        d = torch.minimum(a, (1 - a).abs())
        errs.append(d.reshape(d.shape[0], -1).amax(dim=1) if ensemble else d.max())
    if not errs:
        raise ValueError("nalu_cuda.regularizers.sparsity_error: argument 'weights' must hold at least one tensor")
    return torch.stack(errs).amax(dim=0)


def npu_l1(module: nn.Module, ensemble: bool = False) -> Tensor:
    """``sum |W_r| + sum |W_i|`` of an :class:`~nalu_cuda.NPU` / :class:`~nalu_cuda.RealNPU`
    (the relevance gate is not penalised). With ``ensemble=True`` one value per member, shape ``(E,)``."""
    terms = [p for p in (module.W_r, module.W_i) if p is not None]
    if ensemble:
        return sum(p.abs().flatten(1).sum(1) for p in terms)
    return sum(p.abs().sum() for p in terms)


def npu_l1_beta(step: int, beta_start: float = 1e-4, beta_end: float = 1e-2, growth: float = 10.0,
                every: int = 10_000) -> float:
    """The NPU scripts' stepwise L1 weight: ``min(beta_start * growth ** (step // every), beta_end)``."""
    if step < 0 or every < 1:
        raise ValueError(f"nalu_cuda.regularizers.npu_l1_beta: need step >= 0 and every >= 1, got "
                         f"step={step!r}, every={every!r}")
    return min(beta_start * growth ** (step // every), beta_end)


def inalu_regularizer(module: nn.Module, bound: float = 20.0, scale: float = 1.0 / 20.0,
                      ensemble: bool = False) -> Tensor:
    """iNALU's ``scale * sum_v mean(max(min(-v, v) + bound, 0))`` over W_hat, M_hat, W_hat_m, M_hat_m
    and G. With ``ensemble=True`` the means are per member, shape ``(E,)``."""
    total = 0
    for p in (module.W_hat, module.M_hat, module.W_hat_m, module.M_hat_m, module.G):
        v = torch.clamp(torch.minimum(-p, p) + bound, min=0)
        total = total + (v.flatten(1).mean(1) if ensemble else v.mean())
    return scale * total


def inalu_regularizer_active(epoch: int, loss: float, after_epoch: int = 10, below: float = 1.0) -> bool:
    """The authors' switch: the regulariser applies on a batch once ``epoch > 10`` and its loss ``< 1``."""
    return epoch > after_epoch and loss < below


def inalu_stalled(losses: Sequence[float], min_count: int = 10_000, above: float = 1.0) -> bool:
    """The authors' stall test on the losses since the last (re)initialisation: more than
    ``min_count`` of them, the mean of the first half ``<=`` mean + std (population) of the second
    half, and the second half's mean above ``above``. (Their script checks it every step of every
    10th epoch after the first; the caller decides when to ask.)"""
    if len(losses) <= min_count:
        return False
    arr = np.asarray(losses, dtype=np.float64)
    first, second = arr[: len(arr) // 2], arr[len(arr) // 2:]
    return bool(first.mean() <= second.mean() + second.std() and second.mean() > above)


@torch.no_grad()
def inalu_reinitialize_(module: nn.Module, members: Optional[Sequence[int]] = None, low: float = -2.0,
                        high: float = 2.0, generator: Optional[torch.Generator] = None) -> None:
    """Re-draws every parameter of an :class:`~nalu_cuda.INALU` from U(low, high) (the authors'
    re-initialisation), for the given ensemble ``members`` or all of them."""
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"nalu_cuda.regularizers.inalu_reinitialize_: need finite low < high, got "
                         f"{low!r}, {high!r}")
    params = (module.W_hat, module.M_hat, module.W_hat_m, module.M_hat_m, module.G)

    def draw(t: Tensor) -> None:  # on the generator's device, then to the parameter's
        dev = generator.device if generator is not None else t.device
        t.copy_(torch.empty(t.shape, dtype=t.dtype, device=dev).uniform_(low, high, generator=generator))

    if members is None or module.ensemble is None:
        for p in params:
            draw(p)
        return
    for e in members:
        for p in params:
            draw(p[e])
