"""Up-front resource checks: a configuration whose run cannot fit in memory is refused before it starts.

A task module declares, in one function ``memory_needs(config) -> [Need]``, the few tensors that
dominate its run (the ensemble's batches, the evaluation sets, the model and its optimiser state...),
each with the command-line options that make it grow. :func:`check_memory` sums them per
configuration (configurations run one after another) and raises :class:`ResourceError`, naming the
options of the largest one, when the sum exceeds the memory of the machine (or of the GPU). The
estimates count only the dominant tensors once, so they stay below what a run really uses: they
refuse what cannot work, never a run that would fit.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Tuple

from .registry import Config, get

__all__ = ["Need", "ResourceError", "memory_limit", "config_bytes", "check_memory", "fmt_bytes", "digit_images"]

FLOAT = 4  # bytes of a float32 (the training dtype)
DOUBLE = 8
ADAM = 4   # a parameter, its gradient and Adam's two moments


@dataclass(frozen=True)
class Need:
    """``nbytes`` (a float: an absurd size must not cost time to multiply out) of ``what``, which
    grows with ``options`` (e.g. ``"--n-test, --seeds"``)."""

    what: str
    options: str
    nbytes: float


class ResourceError(ValueError):
    """A run that cannot fit (the CLI prints it and exits with 2)."""


def fmt_bytes(n: float) -> str:
    """``n`` bytes as a short text (``1.5 GiB``)."""
    if not math.isfinite(n):
        return "more bytes than a float can count"
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.3g} {units[i]}"


def _host_memory() -> Optional[float]:
    """The machine's physical memory, or the cgroup's limit where that is lower (None: unknown)."""
    try:
        total = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, float(limit))
    except OSError:
        pass
    return total


def memory_limit(device: str = "cpu") -> Optional[float]:
    """Bytes a run may use at most: the host's memory, and on a CUDA device also the GPU's."""
    limit = _host_memory()
    if str(device).startswith("cuda"):
        import torch  # local: only a CUDA device needs torch here

        if torch.cuda.is_available():
            dev = torch.device(device)
            gpu = float(torch.cuda.get_device_properties(dev.index or 0).total_memory)
            limit = gpu if limit is None else min(limit, gpu)
    return limit


def config_bytes(needs: Iterable[Need]) -> float:
    return float(sum(n.nbytes for n in needs))


def _declared(config: Config) -> Sequence[Need]:
    return get(config.experiment).memory(config)


def check_memory(configs: Sequence[Config], device: str = "cpu", limit: Optional[float] = None,
                 needs_of: Callable[[Config], Sequence[Need]] = _declared) -> None:
    """Raise :class:`ResourceError` for the first configuration whose estimated peak memory
    (``needs_of(config)``: by default what its experiment declares) exceeds ``limit`` (default
    :func:`memory_limit`)."""
    limit = memory_limit(device) if limit is None else limit
    if limit is None:
        return
    for cfg in configs:
        needs = list(needs_of(cfg))
        total = config_bytes(needs)
        if total <= limit:
            continue
        big = max(needs, key=lambda n: n.nbytes)
        where = "the GPU's and the machine's" if str(device).startswith("cuda") else "this machine's"
        raise ResourceError(f"{cfg.key} needs about {fmt_bytes(total)} of memory, more than {where} "
                            f"{fmt_bytes(limit)}: {fmt_bytes(big.nbytes)} of it for {big.what}, which grows "
                            f"with {big.options}")


def digit_images(mnist_dir: Optional[str]) -> Tuple[float, float]:
    """``(pixels per image, test images)`` of the digit images a task loads: MNIST's 28x28 and 10000
    test images with ``--mnist-dir``, else scikit-learn's 8x8 digits (a quarter of 1797 for testing)."""
    return (28.0 * 28, 10_000.0) if mnist_dir else (8.0 * 8, 450.0)
