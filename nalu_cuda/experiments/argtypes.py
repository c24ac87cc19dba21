"""Argument types of the experiments' options (the ``nalu-cuda`` CLI's and every task's
``add_arguments``): a value that has no meaning is refused by argparse at start (exit 2, naming the
option, the value and what is allowed), never discovered after training.

Part of the plugin API (a task module imports them from here; :mod:`nalu_cuda.cli` re-exports them).
``mnist_directory`` lives beside the MNIST reader, in :mod:`.parts.mnist_data`.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, List

import torch

from ..modules import NALU

__all__ = ["positive_int", "non_negative_int", "positive_float", "non_negative_float", "finite_float", "at_most",
           "seed_count", "step_count", "phase_step_count", "thread_count", "comma_list", "directory", "device",
           "MAX_SEEDS", "MAX_STEPS"]

# Upper bounds of counts whose larger values only hang or exhaust the machine.
MAX_SEEDS = 10 ** 6   # every seed is a member of one ensemble, trained at once
MAX_STEPS = 10 ** 12  # a step takes at least a microsecond: 1e12 steps would run for over 11 days


# ------------------------------------------------------------------------------------------------
# Argument types, shared by every subcommand's options (the experiments' own options too): a value
# that has no meaning is refused by argparse at start (exit 2, naming the option, the value and
# what is allowed), never discovered after training.
# ------------------------------------------------------------------------------------------------


def _number(text: str, kind: type, allowed: str, ok: Callable[[float], bool]):
    try:
        v = kind(text)
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, steps)."""
    return _number(text, int, "an integer >= 1", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (seeds, optional phases that 0 switches off)."""
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, clipping norms)."""
    return _number(text, float, "a finite number > 0", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (intervals in seconds)."""
    return _number(text, float, "a finite number >= 0", lambda v: v >= 0)


def finite_float(text: str) -> float:
    """A finite number (ends of input ranges)."""
    return _number(text, float, "a finite number", lambda v: True)


def at_most(item: Callable[[str], int], high: int, why: str) -> Callable[[str], int]:
    """``item`` (e.g. :func:`positive_int`) bounded above by ``high``, for the reason ``why``."""
    def parse(text: str) -> int:
        v = item(text)
        if v > high:
            raise argparse.ArgumentTypeError(f"expected at most {high} ({why}), got {text!r}")
        return v

    parse.__name__ = item.__name__
    return parse


_STEPS_WHY = "a step takes at least a microsecond: more would run for weeks"
seed_count = at_most(positive_int, MAX_SEEDS, "every seed is a member of one ensemble, trained at once")
step_count = at_most(positive_int, MAX_STEPS, _STEPS_WHY)
phase_step_count = at_most(non_negative_int, MAX_STEPS, _STEPS_WHY)  # steps of an optional phase (0: none)


def thread_count(text: str) -> int:
    """An integer from 1 to the number of CPU cores (more threads only compete for the same cores)."""
    cores = os.cpu_count() or 1
    return at_most(positive_int, cores, "the CPU cores of this machine")(text)


def comma_list(item: Callable[[str], Any]) -> Callable[[str], List[Any]]:
    """A comma-separated, non-empty list whose items are each checked by ``item`` (one of the above)."""
    def parse(text: str) -> List[Any]:
        parts = [t.strip() for t in text.split(",")]
        if not text.strip() or not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return [item(t) for t in parts]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (in the list {text!r})") from None

    parse.__name__ = f"comma-separated {item.__name__}"
    return parse


def directory(text: str) -> str:
    """A directory path (not empty; whether it can be used is checked when the run locks it)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got an empty path ''")
    return text


def device(text: str) -> str:
    """A torch device on which a NALU layer runs forward and backward and copies back: what every
    experiment does. Checked at start (a 'meta' device used to fail only after training)."""
    allowed = "cpu" + (", cuda or cuda:N" if torch.cuda.is_available() else " (this torch sees no CUDA device)")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; allowed: {allowed}") from None
    try:
        _probe(dev)
    except Exception as exc:  # whatever the device cannot do, the experiments cannot either
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise argparse.ArgumentTypeError(f"device {text!r} cannot run the experiments here ({why}); "
                                         f"allowed: {allowed}") from None
    return str(dev)


def _probe(dev) -> None:
    with torch.random.fork_rng(devices=[]):  # the layer's initialisation must not move the global RNG
        layer = NALU(3, 2).to(dev)
    x = torch.full((4, 3), 0.5, device=dev)
    layer(x).sum().backward()
    float(layer.G.grad.sum().cpu())
