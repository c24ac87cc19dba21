"""The arithmetic tasks of Trask et al. (2018), Table 1, with Madsen & Johansen's (2020) protocol.

Static task: ``x`` in R^I (I = 100); ``a`` and ``b`` are sums of two overlapping subsets of ``x``
(each ``floor(subset_ratio * I)`` = 25 long, overlapping by ``floor(overlap_ratio * 25)`` = 12, at a
random offset drawn per seed); the target is ``op(a, b)``. Recurrent task: the same over a sequence
``x_1..x_T`` in R^10, ``a`` and ``b`` summing their subsets over every time step.

Everything random derives from integer seeds, so that a member of an ensemble sees exactly the
data and initialisation of a single run with its seed:

* the subset layout from ``seed`` (:func:`subset_layout`);
* the training stream from ``seed`` (:class:`UniformStream`, a numpy ``SFC64`` generator: about 4x
  faster than ``torch.rand`` here, which matters when 100 seeds each draw 128 x 100 inputs a step);
* the validation and test sets from fixed data seeds, shared by all members.

The success criterion (Madsen & Johansen 2020, Section 4): the extrapolation MSE, at the step with
the best validation MSE, is below the MSE of an *epsilon-perfect* solution, one whose used weights
are ``1 - eps`` and unused weights ``eps`` (eps = 1e-5), with the exact operation on top. The
threshold is estimated by Monte Carlo in float64 (:func:`mse_threshold`). Their R script
(``export/function_task_static_mse_expectation.r``) indexes ``a.start:a.end`` inclusively, so its
subsets are one element longer (26) than those of their data set (25); :func:`mse_threshold` with
``layout="madsen"`` reproduces their published thresholds, ``layout="task"`` (the default used for
the success criterion here) is the epsilon-perfect solution of the task actually trained.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "SumTargets",
    "OPS",
    "OP_SYMBOLS",
    "OP_ALIASES",
    "canonical_op",
    "Range",
    "parse_range",
    "SubsetLayout",
    "subset_layout",
    "UniformStream",
    "apply_op",
    "mse_threshold",
    "recurrent_mse_threshold",
    "PUBLISHED_THRESHOLDS",
    "EPS_PERFECT",
    "seed_for",
]

# The six operations (names as in stable-nalu).
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


def seed_for(seed: int, purpose: str) -> int:
    """A 63-bit seed derived from ``(seed, purpose)``, stable across runs and platforms."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(seed) >> 32] + [ord(c) for c in purpose])
    lo, hi = (int(w) for w in ss.generate_state(2, dtype=np.uint32))
    return (lo | (hi << 32)) & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------------
# Ranges
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """A union of disjoint intervals ``[lo, hi)``; sampling picks an interval in proportion to its length."""

    intervals: Tuple[Tuple[float, float], ...]

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


# ------------------------------------------------------------------------------------------------
# Subsets
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubsetLayout:
    """``a = sum(x[a_start:a_end])``, ``b = sum(x[b_start:b_end])`` (0-based, end exclusive)."""

    input_size: int
    a_start: int
    a_end: int
    b_start: int
    b_end: int

    def mask(self, dtype=torch.float32) -> Tensor:
        """``(input_size, 2)`` 0/1 matrix: ``x @ mask`` gives ``(a, b)``."""
        m = torch.zeros(self.input_size, 2, dtype=dtype)
        m[self.a_start:self.a_end, 0] = 1
        m[self.b_start:self.b_end, 1] = 1
        return m


def subset_sizes(input_size: int, subset_ratio: float, overlap_ratio: float) -> Tuple[int, int]:
    size = int(math.floor(subset_ratio * input_size))
    overlap = int(math.floor(overlap_ratio * size))
    if size < 1:
        raise ValueError(f"subset ratio {subset_ratio} of {input_size} inputs leaves an empty subset")
    if 2 * size - overlap > input_size:
        raise ValueError(f"two subsets of {size} overlapping by {overlap} do not fit in {input_size} inputs")
    return size, overlap


def subset_layout(seed: int, input_size: int, subset_ratio: float = 0.25, overlap_ratio: float = 0.5,
                  random_offset: bool = True) -> SubsetLayout:
    """Madsen & Johansen's layout: fixed sizes, an offset drawn from the seed (0 if not random)."""
    size, overlap = subset_sizes(input_size, subset_ratio, overlap_ratio)
    span = 2 * size - overlap
    start = 0
    if random_offset:
        start = int(np.random.default_rng(seed_for(seed, "subset")).integers(0, input_size - span + 1))
    return SubsetLayout(input_size, start, start + size, start + size - overlap, start + 2 * size - overlap)


# ------------------------------------------------------------------------------------------------
# Training stream
# ------------------------------------------------------------------------------------------------


# False makes UniformStream use its numpy code even when the native fill is built (for tests).
_USE_NATIVE_FILL = True


class SumTargets:
    """A :class:`UniformStream` transform: targets ``op(a, b)`` of weighted sums of the inputs.

    ``weights`` ``(S, I, 2)``: member ``s``'s ``a`` is ``sum_i x[..., i] weights[s, i, 0]`` over the
    last axis (and over the time axis too for inputs ``(B, T, I)``), ``b`` likewise with column
    1. Inputs ``(C, S, B, [T,] I)`` -> targets ``(C, len(ops) * S, B, 1)`` float32, op by op.
    ``a`` and ``b`` are float64 sums, exact for the inputs of every uniform range here (float32
    values on a common grid; so any order of summation gives the same bits), the operation is
    applied in float64 and rounded once. With the native fill, the stream computes the sums while
    drawing (no second pass over the chunk): :meth:`from_sums`; otherwise ``__call__`` does both.
    """

    def __init__(self, weights: np.ndarray, ops: Sequence[str]):
        self.weights = np.ascontiguousarray(weights, dtype=np.float64)
        if self.weights.ndim != 3 or self.weights.shape[2] != 2:
            raise ValueError(f"SumTargets: weights must be (S, I, 2), got shape {self.weights.shape}")
        self.ops = [canonical_op(op) for op in ops]

    def sums(self, arr: np.ndarray) -> np.ndarray:
        """``(C, S, B, [T,] I)`` -> ``(C, S, B, [T,] 2)`` in float64 (numpy; one step at a time)."""
        w = self.weights.reshape(self.weights.shape[0], *([1] * (arr.ndim - 4)), *self.weights.shape[1:])
        return np.stack([np.matmul(step.astype(np.float64), w) for step in arr])

    def from_sums(self, sums: np.ndarray) -> np.ndarray:
        """``(C, S, B, [T,] 2)`` float64 sums -> targets ``(C, len(ops) * S, B, 1)`` float32."""
        if sums.ndim == 5:
            sums = sums.sum(3)  # over time steps
        a, b = sums[..., 0], sums[..., 1]
        C, S, B = a.shape
        t = np.empty((C, len(self.ops) * S, B, 1), dtype=np.float32)
        for k, op in enumerate(self.ops):
            t[:, k * S:(k + 1) * S, :, 0] = apply_op(op, a, b)
        return t

    def __call__(self, arr: np.ndarray) -> np.ndarray:
        return self.from_sums(self.sums(arr))


class UniformStream:
    """Per-member float32 uniform inputs, ``chunk`` steps at a time, from one SFC64 generator a member.

    ``next()`` returns ``(E, *shape)`` for one step (with ``transform``: ``(x, extra)``, where
    ``transform`` maps the chunk's array ``(chunk, E, *shape)`` to ``(chunk, E', ...)``, e.g. the
    targets, and ``extra`` is its slice for the step). Member
    ``e`` draws exactly what a single stream with its seed draws (the chunk size is fixed, never
    derived from ``E``). The state for ``--resume`` is the generators' state at the start of the
    current chunk plus the position in it (:meth:`state_dict`), so a resumed stream continues bit
    for bit.

    ``prefetch=True`` draws the next chunk (and its ``transform``) on a background thread while
    the current one is consumed: the fill releases the GIL, so on a machine with a spare core the
    data costs no training time. The values are the same either way.

    Floats come from the generator's raw 64-bit words: each gives two 32-bit words, whose top 23
    bits fill a float32 mantissa in [1, 2), mapped affinely to the range (a 2^-23 grid, the float32
    resolution of U[1,2); for U[1,2) itself no mapping is needed). For a union of intervals, the
    low bit of the same word picks the interval when there are two of equal length; otherwise a
    second draw does. For a single interval the native extension computes the same bits in one
    pass (``nalu_cuda._C.sfc64_uniform_fill``, csrc/cpu/uniform_fill.cpp); without it, or for a
    union, numpy does.
    """

    def __init__(self, seeds: Sequence[int], shape: Sequence[int], rng_range: Range, chunk: int = 16,
                 purpose: str = "train", prefetch: bool = False,
                 transform: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        self.seeds = [int(s) for s in seeds]
        self.shape = tuple(int(s) for s in shape)
        self.range = rng_range
        self.chunk = int(chunk)
        self.purpose = purpose
        self.transform = transform
        self._bitgens = [np.random.SFC64(seed_for(s, purpose)) for s in self.seeds]
        self._chunk_states = None
        self._buffer: Optional[Tensor] = None
        self._extra: Optional[Tensor] = None
        self._pos = 0
        self._n = int(np.prod(self.shape))
        self._pool = None
        self._pending = None
        self._spares: List[np.ndarray] = []
        if prefetch:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nalu-data")

    def _generate(self):
        # Stored step-major, (chunk, E, *shape), so that every step's batch is one contiguous
        # tensor (the fused ops would otherwise copy a strided input in forward and backward).
        E = len(self.seeds)
        states = [bg.state for bg in self._bitgens]
        out = self._chunk_array((self.chunk, E, self._n))
        sums = None
        if isinstance(self.transform, SumTargets):  # sums drawn with the values (native fill only)
            k = self.transform.weights.shape[-1]
            sums = np.empty((self.chunk, E, self._n // self.shape[-1], k), dtype=np.float64)
        if self._draw_native(self._bitgens, out, sums):
            extra = None if sums is None else self.transform.from_sums(sums.reshape(self.chunk, E, *self.shape[:-1], -1))
            out = out.reshape(self.chunk, E, *self.shape)
        else:
            for e, bg in enumerate(self._bitgens):
                self._draw_into(bg, out[:, e, :])
            out = out.reshape(self.chunk, E, *self.shape)
            extra = None if self.transform is None else self.transform(out)
        return states, out, None if extra is None else np.ascontiguousarray(extra)

    def _chunk_array(self, shape: Tuple[int, ...]) -> np.ndarray:
        """An array for the next chunk: one of the last few whose tensors and views are all gone,
        else a new one. Writing into fresh memory costs the OS a page fault and a zeroed page per
        4 KiB (for 100 seeds, more than drawing the numbers); every element is overwritten."""
        for a in self._spares:
            # References: the list, the loop variable and getrefcount's argument, nothing else.
            if a.shape == shape and sys.getrefcount(a) == 3:
                return a
        a = np.empty(shape, dtype=np.float32)
        if len(self._spares) < 3:  # the chunk in use, the one drawn ahead, one still held briefly
            self._spares.append(a)
        return a

    def _fill(self) -> None:
        if self._pending is not None:
            states, arr, extra = self._pending.result()
            self._pending = None
        else:
            states, arr, extra = self._generate()
        self._chunk_states = states
        self._buffer = torch.from_numpy(arr)
        self._extra = None if extra is None else torch.from_numpy(extra)
        self._pos = 0
        if self._pool is not None:
            self._pending = self._pool.submit(self._generate)

    def _draw_native(self, bitgens: Sequence[np.random.SFC64], out: np.ndarray,
                     sums: Optional[np.ndarray] = None) -> bool:
        """Fill ``out`` (rows, len(bitgens), n), column block ``e`` from ``bitgens[e]``, with the
        native fill, bit for bit as :meth:`_draw_into`; False (nothing drawn) when it does not apply.
        With ``sums`` (the stream's :class:`SumTargets`), also the weighted sums of the values."""
        ivs = self.range.intervals
        if not _USE_NATIVE_FILL or len(ivs) != 1 or out.ndim != 3 or out.strides[2] != out.itemsize:
            return False
        from nalu_cuda import _ops

        fill = getattr(_ops.fast, "sfc64_uniform_fill", None)
        if fill is None:  # extension not built (or the CMake library, which has no Python entry points)
            return False
        states = [bg.state for bg in bitgens]
        words = np.stack([st["state"]["state"] for st in states]).view(np.int64)  # (G, 4), a copy
        lo, hi = ivs[0]
        extra = () if sums is None else (torch.from_numpy(self.transform.weights), torch.from_numpy(sums))
        fill(torch.from_numpy(words), torch.from_numpy(out), lo, hi, ivs == ((1.0, 2.0),), *extra)
        for bg, st, new in zip(bitgens, states, words.view(np.uint64)):
            bg.state = {**st, "state": {"state": new}}  # has_uint32 / uinteger unchanged, as random_raw
        return True

    def _draw_into(self, bg: np.random.SFC64, out: np.ndarray) -> None:
        """Fill ``out`` (any shape, possibly strided) in C order from ``bg`` with numpy."""
        n = out.size
        words = bg.random_raw((n + 1) // 2).view(np.uint32)[:n].reshape(out.shape)
        ivs = self.range.intervals
        select = None
        if len(ivs) == 2 and math.isclose(ivs[0][1] - ivs[0][0], ivs[1][1] - ivs[1][0]):
            select = (words & np.uint32(1)).astype(bool)
        bits = out.view(np.uint32)
        np.right_shift(words, np.uint32(9), out=bits)
        np.bitwise_or(bits, np.uint32(0x3F800000), out=bits)  # out now holds floats in [1, 2)
        if ivs == ((1.0, 2.0),):
            return
        out -= np.float32(1.0)
        if len(ivs) == 1:
            lo, hi = ivs[0]
            out *= np.float32(hi - lo)
            out += np.float32(lo)
            return
        sel = np.random.Generator(bg).random(n).reshape(out.shape) if select is None else np.where(select, 0.75, 0.25)
        out[...] = self.range._map(np.ascontiguousarray(out), None, select=sel)

    def next(self):
        if self._buffer is None or self._pos >= self.chunk:
            self._fill()
        x = self._buffer[self._pos]
        extra = None if self._extra is None else self._extra[self._pos]
        self._pos += 1
        return x if self.transform is None else (x, extra)

    def state_dict(self) -> Dict:
        """Plain Python (ints, lists, dicts): loadable with ``torch.load(weights_only=True)``."""
        states = [bg.state for bg in self._bitgens] if self._buffer is None else self._chunk_states
        return {"states": [_plain_state(st) for st in states], "pos": None if self._buffer is None else self._pos}

    def load_state_dict(self, state: Dict) -> None:
        if len(state["states"]) != len(self._bitgens):
            raise ValueError("stream checkpoint has a different number of members")
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        for bg, st in zip(self._bitgens, state["states"]):
            bg.state = _numpy_state(st)
        self._buffer = None
        if state["pos"] is not None:
            self._fill()
            self._pos = int(state["pos"])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            self._pending = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _plain_state(st: Dict) -> Dict:
    out = dict(st)
    out["state"] = {k: ([int(v) for v in val] if isinstance(val, np.ndarray) else val)
                    for k, val in st["state"].items()}
    return out


def _numpy_state(st: Dict) -> Dict:
    out = dict(st)
    out["state"] = {k: (np.array(val, dtype=np.uint64) if isinstance(val, list) else val)
                    for k, val in st["state"].items()}
    return out


# ------------------------------------------------------------------------------------------------
# Thresholds of the success criterion
# ------------------------------------------------------------------------------------------------


def _mc_chunks(samples: int, chunk: int):
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        yield n
        done += n


def mse_threshold(op: str, extrap: Range, input_size: int = 100, subset_ratio: float = 0.25,
                  overlap_ratio: float = 0.5, eps: float = EPS_PERFECT, samples: int = 1_000_000,
                  seed: int = 0, layout: str = "task") -> float:
    """MSE of the epsilon-perfect static solution on ``extrap``, by Monte Carlo in float64.

    The first layer has ``1 - eps`` on the subset weights and ``eps`` everywhere else; the exact
    operation is applied to its two outputs. ``layout="task"``: the subsets of the data
    (``floor(ratio * I)`` long); ``layout="madsen"``: one longer, as in Madsen & Johansen's R script
    that produced their published thresholds. Only the subset sizes matter (inputs are i.i.d.).
    """
    op = canonical_op(op)
    size, overlap = subset_sizes(input_size, subset_ratio, overlap_ratio)
    if layout == "madsen":
        a_len, b_len, overlap_len = size + 1, size + 1, overlap + 1
    elif layout == "task":
        a_len, b_len, overlap_len = size, size, overlap
    else:
        raise ValueError(f"layout must be 'task' or 'madsen', got {layout!r}")
    a_only, b_only = a_len - overlap_len, b_len - overlap_len
    rng = np.random.default_rng(seed_for(seed, f"threshold-{op}"))
    total = 0.0
    for n in _mc_chunks(samples, 50_000):
        x = extrap.sample(rng, (n, input_size))
        sa = x[:, :a_only].sum(1)
        so = x[:, a_only:a_only + overlap_len].sum(1)
        sb = x[:, a_only + overlap_len:a_only + overlap_len + b_only].sum(1)
        s = x.sum(1)
        a0, b0 = sa + so, sb + so
        # (1 - eps) on the used inputs and eps on the others: a_eps = a0 + eps (S - 2 a0)
        a1, b1 = a0 + eps * (s - 2 * a0), b0 + eps * (s - 2 * b0)
        err = apply_op(op, a1, b1) - apply_op(op, a0, b0)
        total += float(np.sum(err * err))
    return total / samples


def recurrent_mse_threshold(op: str, extrap: Range, length: int, input_size: int = 10,
                            subset_ratio: float = 0.25, overlap_ratio: float = 0.5,
                            eps: float = EPS_PERFECT, samples: int = 10_000, seed: int = 0) -> float:
    """The same for the recurrent task: an epsilon-perfect recurrent accumulator.

    ``h_t = x_t W_x + h_{t-1} W_h`` with ``W_x`` = ``1 - eps`` on the subsets and ``eps`` elsewhere,
    ``W_h`` = ``1 - eps`` on the diagonal and ``eps`` off it; the exact operation on ``h_T``.
    ``W_h`` has eigenvectors (1, 1) (eigenvalue 1) and (1, -1) (eigenvalue 1 - 2 eps), so
    ``h_T`` follows from the per-step sums without a loop over time.
    """
    op = canonical_op(op)
    size, overlap = subset_sizes(input_size, subset_ratio, overlap_ratio)
    rng = np.random.default_rng(seed_for(seed, f"rthreshold-{op}-{length}"))
    decay = (1 - 2 * eps) ** np.arange(length - 1, -1, -1, dtype=np.float64)  # weight of step t in h_T
    total = 0.0
    chunk = max(1, 2_000_000 // (length * input_size))
    for n in _mc_chunks(samples, chunk):
        x = extrap.sample(rng, (n, length, input_size))
        a_t = x[..., :size].sum(-1)
        b_t = x[..., size - overlap:2 * size - overlap].sum(-1)
        s_t = x.sum(-1)
        u1 = a_t + eps * (s_t - 2 * a_t)
        u2 = b_t + eps * (s_t - 2 * b_t)
        plus = (u1 + u2).sum(1)
        minus = ((u1 - u2) * decay).sum(1)
        h1, h2 = 0.5 * (plus + minus), 0.5 * (plus - minus)
        a0, b0 = a_t.sum(1), b_t.sum(1)
        err = apply_op(op, h1, h2) - apply_op(op, a0, b0)
        total += float(np.sum(err * err))
    return total / samples
