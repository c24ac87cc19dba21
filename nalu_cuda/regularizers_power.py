"""Regularisers, schedules and the re-initialisation rule of the power units and iNALU, as the
authors' training scripts use them (see UNITS.md).

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
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "npu_l1",
    "npu_l1_beta",
    "inalu_regularizer",
    "inalu_regularizer_active",
    "inalu_stalled",
    "inalu_reinitialize_",
]


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
        raise ValueError(f"nalu_cuda.regularizers_power.npu_l1_beta: need step >= 0 and every >= 1, got "
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
        raise ValueError(f"nalu_cuda.regularizers_power.inalu_reinitialize_: need finite low < high, got "
                         f"{low!r}, {high!r}")
    params = (module.W_hat, module.M_hat, module.W_hat_m, module.M_hat_m, module.G)
    if members is None or module.ensemble is None:
        for p in params:
            p.uniform_(low, high, generator=generator)
        return
    for e in members:
        for p in params:
            p[e].uniform_(low, high, generator=generator)
