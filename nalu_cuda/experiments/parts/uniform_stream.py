"""The training stream of the arithmetic tasks: fresh uniform batches per seed, drawn ahead.

:class:`UniformStream` draws every member's batches from its own numpy ``SFC64`` generator seeded
from its seed (about 4x faster than ``torch.rand`` here, which matters when 100 seeds each draw
128 x 100 inputs a step), in chunks, optionally in a background thread, through the native fill
(``csrc/experiments/cpu/uniform_fill.cpp``, bit-identical to numpy's output) where it is built;
:class:`SumTargets` computes the subset sums ``a``, ``b`` and the targets in the same pass.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .arithmetic_ops import Range, apply_op, canonical_op
from .seeding import seed_for

__all__ = ["UniformStream", "SumTargets", "TARGET_OP_CODES"]

# The operations of SumTargets by their code in nalu_cuda::static_ensemble_step_drawn and
# recurrent_ensemble_step_drawn.
TARGET_OP_CODES = ("add", "sub", "mul", "div", "squared", "root")



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
    pass (``nalu_cuda._C.sfc64_uniform_fill``, csrc/experiments/cpu/uniform_fill.cpp); without it, or for a
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
        self._words: Optional[Tensor] = None  # the generators' states while a caller draws in-call
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

    def in_call_draw(self) -> Optional[Dict]:
        """What a caller needs to draw this stream's batches itself, bit for bit (the native steps:
        ``nalu_cuda::static_ensemble_step_drawn`` for inputs ``(B, I)``,
        ``nalu_cuda::recurrent_ensemble_step_drawn`` for ``(B, T, I)``): ``lo``, ``hi``, ``raw``,
        ``weights`` (``(S, I, 2)`` float64 tensor), ``ops`` (codes, :data:`TARGET_OP_CODES`),
        ``batch`` and ``length`` (``T``; None for inputs ``(B, I)``); None where it cannot: a union
        of ranges, no :class:`SumTargets` of two sums, inputs neither ``(B, I)`` nor ``(B, T, I)``,
        a batch of an odd number of values (it would end inside a 64-bit word), or the native fill
        switched off (``_USE_NATIVE_FILL``, for tests)."""
        ivs = self.range.intervals
        t = self.transform
        if (not _USE_NATIVE_FILL or len(ivs) != 1 or not isinstance(t, SumTargets) or t.weights.shape[2] != 2
                or len(self.shape) not in (2, 3) or self._n % 2
                or t.weights.shape[:2] != (len(self.seeds), self.shape[-1])):
            return None
        return {"lo": float(ivs[0][0]), "hi": float(ivs[0][1]), "raw": ivs == ((1.0, 2.0),),
                "weights": torch.from_numpy(t.weights), "ops": [TARGET_OP_CODES.index(op) for op in t.ops],
                "batch": self.shape[0], "length": self.shape[1] if len(self.shape) == 3 else None}

    def draw_words(self) -> Optional[Tensor]:
        """The generators' states, ``(S, 4)`` int64 (numpy's uint64 words), for a caller that draws
        the next batch itself and advances them in place; None while values drawn by the stream
        itself are waiting (the rest of a chunk, or the chunk drawn ahead): take those with
        :meth:`next`. The first call stops the drawing ahead; :meth:`next` and :meth:`state_dict`
        read the states back."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # the chunk it drew stays in _pending, for next()
            self._pool = None
        if self._pending is not None or (self._buffer is not None and self._pos < self.chunk):
            return None
        if self._words is None:
            words = np.stack([bg.state["state"]["state"] for bg in self._bitgens]).view(np.int64)
            self._words = torch.from_numpy(np.ascontiguousarray(words))
            self._buffer = self._extra = None
        return self._words

    def _sync(self) -> None:
        """Back from in-call drawing: the generators take the states the caller advanced."""
        if self._words is not None:
            for bg, new in zip(self._bitgens, self._words.numpy().view(np.uint64)):
                st = bg.state
                bg.state = {**st, "state": {"state": new.copy()}}  # has_uint32 / uinteger unchanged
            self._words = None

    def next(self):
        self._sync()
        if self._buffer is None or self._pos >= self.chunk:
            self._fill()
        x = self._buffer[self._pos]
        extra = None if self._extra is None else self._extra[self._pos]
        self._pos += 1
        return x if self.transform is None else (x, extra)

    def state_dict(self) -> Dict:
        """Plain Python (ints, lists, dicts): loadable with ``torch.load(weights_only=True)``."""
        self._sync()
        states = [bg.state for bg in self._bitgens] if self._buffer is None else self._chunk_states
        return {"states": [_plain_state(st) for st in states], "pos": None if self._buffer is None else self._pos}

    def load_state_dict(self, state: Dict) -> None:
        if len(state["states"]) != len(self._bitgens):
            raise ValueError("stream checkpoint has a different number of members")
        self._words = None
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


