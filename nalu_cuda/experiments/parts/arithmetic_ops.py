"""The operations and input ranges of the arithmetic tasks (:mod:`.arithmetic_data` re-exports all of
it): the lowest floor of the arithmetic parts, which the training streams (:mod:`.counter_stream`,
:mod:`.uniform_stream`) and :mod:`.arithmetic_data` build on."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
from torch import Tensor

__all__ = ["OPS", "OP_SYMBOLS", "OP_ALIASES", "EPS_PERFECT", "PUBLISHED_THRESHOLDS", "canonical_op", "apply_op",
           "FLOAT32_MAX", "largest_target", "check_targets", "Range",
           "parse_range", "as_range"]

OPS = ("add", "sub", "mul", "div", "squared", "root")
OP_SYMBOLS = {"add": "a + b", "sub": "a - b", "mul": "a * b", "div": "a / b", "squared": "a^2", "root": "sqrt(a)"}
OP_ALIASES = {"+": "add", "-": "sub", "*": "mul", "x": "mul", "/": "div", "square": "squared", "sq": "squared",
              "sqrt": "root", "a^2": "squared", "a+b": "add", "a-b": "sub", "a*b": "mul", "a/b": "div"}

EPS_PERFECT = 1e-5

# Madsen & Johansen (2020), thresholds for U[1,2] -> U[2,6], I = 100, subsets 25%, overlap 50%.
PUBLISHED_THRESHOLDS = {"add": 1.4786e-5, "sub": 1.3844e-8, "mul": 0.16001, "div": 4.9381e-12,
                        "squared": 0.15947, "root": 8.9553e-9}


def canonical_op(name: str) -> str:
    key = str(name).strip().lower()
    key = OP_ALIASES.get(key, key)
    if key not in OPS:
        raise ValueError(f"unknown operation {name!r}; choose from {', '.join(OPS)} "
                         f"(aliases: {', '.join(sorted(OP_ALIASES))})")
    return key


def apply_op(op: str, a, b):
    """``op(a, b)`` on tensors or arrays (``squared`` and ``root`` use ``a`` only)."""
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / b
    if op == "squared":
        return a * a
    if op == "root":
        return a.sqrt() if isinstance(a, Tensor) else np.sqrt(a)
    raise ValueError(f"unknown operation {op!r}")


# The largest float32 (the training dtype): a target beyond it makes every loss infinite.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def largest_target(op: str, r: "Range", terms: int) -> float:
    """An upper bound of ``|op(a, b)|`` for ``a``, ``b`` sums of ``terms`` inputs drawn from ``r``
    (``inf`` when it overflows; for ``div`` 0 when ``r`` reaches 0, where no quotient bound exists)."""
    big = terms * max(abs(r.lo), abs(r.hi))
    if op in ("add", "sub"):
        return 2 * big
    if op in ("mul", "squared"):
        return big * big
    if op == "root":
        return math.sqrt(big)
    small = terms * (r.lo if r.lo > 0 else -r.hi if r.hi <= 0 else 0.0)  # smallest |b|
    return big / small if small > 0 else 0.0


def check_targets(ops: Sequence[str], r: "Range", terms: int, what: str, training: bool = False) -> None:
    """Refuse (a ValueError naming ``what``, the option) a range whose targets overflow float32, the
    training dtype, or, for the ``training`` range, whose squares (the loss of a model that has not
    learned yet) do. A range that passes has a finite success threshold too: its float64 sum of
    squared epsilon-perfect errors, each at most a few targets."""
    limit = math.sqrt(FLOAT32_MAX) if training else FLOAT32_MAX
    for op in ops:
        top = largest_target(op, r, terms)
        if not top < limit:
            why = "their squares, the training loss," if training else "they"
            raise ValueError(f"{what}: the range {r} gives targets {OP_SYMBOLS[op]} up to {top:.3g} (a and b sum "
                             f"{terms} inputs); {why} would exceed the largest float32 ({FLOAT32_MAX:.3g}), the "
                             "training dtype, and not be finite; choose smaller numbers")


# ------------------------------------------------------------------------------------------------
# Ranges
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """A union of disjoint intervals ``[lo, hi)``; sampling picks an interval in proportion to its length."""

    intervals: Tuple[Tuple[float, float], ...]

    # How a task's parameters (nalu_cuda.experiments.params.task_params) name and parse a field of
    # this type: a configuration stores a range as its JSON form (Range.to_list).
    param_name = "a range (bounds [lo, hi, ...] or pairs [[lo, hi], ...])"

    @classmethod
    def from_param(cls, value: Any) -> "Range":
        return as_range(value)

    def __post_init__(self):
        if not self.intervals:
            raise ValueError("a range needs at least one interval")
        for lo, hi in self.intervals:
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(f"range bounds must be finite, got [{lo}, {hi}]")
            if not hi > lo:
                raise ValueError(f"empty range [{lo}, {hi}]: the upper bound must exceed the lower")
        ivs = sorted(self.intervals)
        for (lo1, hi1), (lo2, hi2) in zip(ivs, ivs[1:]):
            if lo2 < hi1:
                raise ValueError(f"overlapping intervals [{lo1}, {hi1}] and [{lo2}, {hi2}] in one range")

    @property
    def lo(self) -> float:
        return min(lo for lo, _ in self.intervals)

    @property
    def hi(self) -> float:
        return max(hi for _, hi in self.intervals)

    @property
    def length(self) -> float:
        return sum(hi - lo for lo, hi in self.intervals)

    def to_list(self) -> List[List[float]]:
        return [[float(lo), float(hi)] for lo, hi in self.intervals]

    def __str__(self) -> str:
        return " u ".join(f"U[{_fmt(lo)},{_fmt(hi)}]" for lo, hi in self.intervals)

    def contains(self, other: "Range") -> bool:
        """Whether every interval of ``other`` lies inside one interval of this range."""
        return all(any(lo <= olo and ohi <= hi for lo, hi in self.intervals) for olo, ohi in other.intervals)

    def sample(self, rng: np.random.Generator, shape, dtype=np.float64) -> np.ndarray:
        """Uniform samples (float64 by default, for the fixed evaluation sets and Monte Carlo)."""
        u = rng.random(shape, dtype=dtype)
        return self._map(u, rng)

    def _map(self, u: np.ndarray, rng: Optional[np.random.Generator], select: Optional[np.ndarray] = None) -> np.ndarray:
        if len(self.intervals) == 1:
            lo, hi = self.intervals[0]
            u *= u.dtype.type(hi - lo)
            u += u.dtype.type(lo)
            return u
        lengths = np.array([hi - lo for lo, hi in self.intervals])
        if select is None:
            select = rng.random(u.shape)
        idx = np.searchsorted(np.cumsum(lengths) / lengths.sum(), select, side="right").clip(0, len(lengths) - 1)
        los = np.array([lo for lo, _ in self.intervals], dtype=u.dtype)[idx]
        widths = lengths.astype(u.dtype)[idx]
        return (los + u * widths).astype(u.dtype)


def _fmt(v: float) -> str:
    return f"{v:g}"


def parse_range(values: Sequence[float], what: str = "range") -> Range:
    """``[lo, hi]`` or ``[lo1, hi1, lo2, hi2, ...]`` (a union) from the command line."""
    vals = [float(v) for v in values]
    if not vals or len(vals) % 2:
        raise ValueError(f"{what}: give bounds in pairs 'LO HI [LO HI ...]', got {list(values)}")
    try:
        return Range(tuple((vals[i], vals[i + 1]) for i in range(0, len(vals), 2)))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def as_range(r: Union["Range", Sequence], what: str = "range") -> Range:
    """A :class:`Range` from a Range, flat bounds ``[lo, hi, ...]`` or pairs ``[[lo, hi], ...]`` (the
    JSON form of :meth:`Range.to_list`, as configurations store ranges)."""
    if isinstance(r, Range):
        return r
    flat = [v for item in r for v in (item if isinstance(item, (list, tuple)) else [item])]
    return parse_range(flat, what)
