"""Madsen & Johansen's sparsity regulariser for the NAU and NMU, its schedule, and the sparsity error.

The published training loss ("Neural Arithmetic Units", ICLR 2020; stable-nalu's
``functional/regualizer.py`` and ``simple_function_static.py``) is

    loss = MSE + lambda * s(t) * sum over layers of R(W),   s(t) = clip((t - start) / (end - start), 0, 1)

with ``R_NAU = mean(min(|W|, 1 - |W|))`` and ``R_NMU = mean(min(|W|, |1 - W|))``; both are 0 exactly
when every weight is in {-1, 0, 1} (NAU) or {0, 1} (NMU). The published (lambda, start, end) per
model are in :data:`PUBLISHED_SCHEDULES`. The reported sparsity error is
``max over weights of min(|W|, |1 - |W||)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Union

import torch
from torch import Tensor, nn

__all__ = [
    "nau_sparsity", "nmu_sparsity", "sparsity", "schedule", "RegularizerSchedule", "PUBLISHED_SCHEDULES",
    "sparsity_error",
]


def nau_sparsity(W: Tensor) -> Tensor:
    """``R_NAU = mean(min(|W|, 1 - |W|))`` over every element of W (ensemble members included)."""
    a = W.abs()
    return torch.minimum(a, 1 - a).mean()


def nmu_sparsity(W: Tensor) -> Tensor:
    """``R_NMU = mean(min(|W|, |1 - W|))`` over every element of W."""
    return torch.minimum(W.abs(), (1 - W).abs()).mean()


def sparsity(module: nn.Module) -> Tensor:
    """The sum of R over every NAU and NMU in ``module`` (itself included); 0 if it has none."""
    from .modules import NAU, NMU

    terms = []
    for m in module.modules():
        if isinstance(m, NAU):
            terms.append(nau_sparsity(m.W))
        elif isinstance(m, NMU):
            terms.append(nmu_sparsity(m.W))
    if not terms:
        p = next(module.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    return torch.stack(terms).sum()


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


# Madsen & Johansen's static task (UNITS.md): "NMU model" NAU -> NMU and "NAU model" NAU -> NAU.
PUBLISHED_SCHEDULES: Dict[str, RegularizerSchedule] = {
    "nmu": RegularizerSchedule(scale=10.0, start=1e6, end=2e6),
    "nau": RegularizerSchedule(scale=0.01, start=5e3, end=5e4),
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
