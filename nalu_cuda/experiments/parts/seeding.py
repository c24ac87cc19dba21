"""Seeds: every random stream of a run comes from ``(seed, purpose)`` through this module.

:func:`member_generators` gives one CPU ``torch.Generator`` per ensemble member, so that member
``e`` is initialised (or fed data) the same whatever the ensemble size. The purpose separates the
independent uses of one seed (the initialisation, the data stream, a test set ...). Two derivations
exist because the published numbers were made with them (changing either would change every result
of its tasks):

* a string purpose (the arithmetic tasks): :func:`seed_for`, a 63-bit seed from NumPy's
  ``SeedSequence`` of the seed and the purpose's characters;
* an integer purpose (the sequence tasks: digits, language, programs, parity, each with its own
  range of integers): ``seed * 1_000_003 + purpose``.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import numpy as np
import torch

__all__ = ["seed_for", "member_generators"]


def seed_for(seed: int, purpose: str) -> int:
    """A 63-bit seed derived from ``(seed, purpose)``, stable across runs and platforms."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32] + [ord(c) for c in purpose])
    lo, hi = (int(w) for w in ss.generate_state(2, dtype=np.uint32))
    return (lo | (hi << 32)) & ((1 << 63) - 1)


def member_generators(seeds: Sequence[int], purpose: Union[str, int] = "init") -> List[torch.Generator]:
    """One CPU generator per seed, for ``purpose`` (a string, or a sequence task's integer)."""
    if isinstance(purpose, str):
        return [torch.Generator().manual_seed(seed_for(int(s), purpose)) for s in seeds]
    return [torch.Generator().manual_seed(int(s) * 1_000_003 + int(purpose)) for s in seeds]
