"""Seeds: every random stream of a run comes from ``(seed, purpose)`` through this module.

:func:`member_generators` gives one CPU ``torch.Generator`` per ensemble member, so that member
``e`` is initialised (or fed data) the same whatever the ensemble size. The purpose, a string,
separates the independent uses of one seed (the initialisation, the data stream, a test set ...);
:func:`seed_for` turns ``(seed, purpose)`` into a 63-bit seed through NumPy's ``SeedSequence``.
Tasks name their purposes ``"<task>/<use>"`` (``"digits/cnn"``, ``"parity/data"``); the
arithmetic tasks' initialisation is ``"init"``.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

__all__ = ["seed_for", "member_generators"]


def seed_for(seed: int, purpose: str) -> int:
    """A 63-bit seed derived from ``(seed, purpose)``, stable across runs and platforms."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32] + [ord(c) for c in purpose])
    lo, hi = (int(w) for w in ss.generate_state(2, dtype=np.uint32))
    return (lo | (hi << 32)) & ((1 << 63) - 1)


def member_generators(seeds: Sequence[int], purpose: str = "init") -> List[torch.Generator]:
    """One CPU generator per seed, for ``purpose``."""
    if not isinstance(purpose, str):
        raise TypeError(f"member_generators: purpose must be a string, got {type(purpose).__name__} {purpose!r}")
    return [torch.Generator().manual_seed(seed_for(int(s), purpose)) for s in seeds]
