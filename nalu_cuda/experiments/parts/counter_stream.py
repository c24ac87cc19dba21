"""Per-member random inputs drawn on the training device, as a pure function of (seed, step, index).

:class:`CounterStream` is the device-resident counterpart of :class:`~.uniform_stream.UniformStream`:
no generator state and no host round trip. Element ``i`` of step ``t`` of member ``e`` is a hash of
``(key(seed_e, purpose), t, i)``: a counter-based stream in the manner of Philox (Salmon et al.,
2011), here a chain of 32-bit ``lowbias32`` mixes (C. Wellons' integer-hash search) computed with
int64 tensor ops, so that CPU and CUDA give the same bits and the draw can be captured in a CUDA
graph (the step is a device tensor that the captured step advances in place). Member ``e`` draws the
same values whatever the ensemble size, and a resumed run only needs the step.

These are *other* streams than the CPU path's SFC64 streams (``UniformStream``): a run with
``--stream counter`` is reproducible from its seeds on any device, but its numbers are not those
of the default CPU run.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .arithmetic_ops import Range, apply_op
from .seeding import seed_for

__all__ = ["CounterStream", "hash32", "uniform_bits"]

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2^32`` for ``x`` in [0, 2^32) held in int64 (no int64 overflow: the constant is
    applied in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def hash32(x: Tensor) -> Tensor:
    """``lowbias32``: a bijective 32-bit integer hash, on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_bits(keys: Tensor, step: Tensor, index: Tensor, lane: int = 0) -> Tensor:
    """32-bit words ``(S, n)``: member keys ``(S, 2)`` int64, ``step`` a 0-dim int64 tensor, ``index``
    ``(n,)`` int64; ``lane`` separates independent words of the same element."""
    k0, k1 = keys[:, :1], keys[:, 1:]
    s_lo, s_hi = step & _M32, (step >> 32) & _M32
    h = hash32((index.unsqueeze(0) + k0 + lane * 0x9E3779B9) & _M32)
    h = hash32(((h ^ s_lo) + k1) & _M32)
    return hash32(((h ^ s_hi) + 0x632BE5AB) & _M32)


class CounterStream:
    """Per-member float32 uniforms ``(S, *shape)`` on ``device`` for step ``t``, from ``rng_range``.

    ``draw(step)`` takes the step as a 0-dim int64 tensor on ``device`` (a captured CUDA graph
    advances it in place), or an int. With ``masks`` ``(S, I, 2)`` and ``ops``, ``draw`` also gives
    the targets ``(len(ops) * S, B, 1)`` of the static task (for sequences ``(S, B, T, I)``, of the
    recurrent task: of the sums over time), computed on the device in float64 from the float32
    inputs, like :class:`~.uniform_stream.SumTargets`.
    """

    def __init__(self, seeds: Sequence[int], shape: Sequence[int], rng_range: Range, device="cpu",
                 purpose: str = "train-counter", masks: Optional[Tensor] = None, ops: Sequence[str] = ()):
        self.shape = tuple(int(s) for s in shape)
        self.range = rng_range
        words = [seed_for(int(s), purpose) for s in seeds]
        self.keys = torch.tensor([[w & _M32, (w >> 32) & _M32] for w in words], dtype=torch.int64, device=device)
        self.device = self.keys.device  # with its index ("cuda" -> "cuda:0"), as the tensors it is compared with
        n = 1
        for s in self.shape:
            n *= s
        self.index = torch.arange(n, dtype=torch.int64, device=self.device)
        lengths = torch.tensor([hi - lo for lo, hi in rng_range.intervals], dtype=torch.float64)
        self._cum = (lengths.cumsum(0) / lengths.sum())[:-1].to(self.device)
        self._lo = torch.tensor([lo for lo, _ in rng_range.intervals], dtype=torch.float32, device=self.device)
        self._hi = torch.tensor([hi for _, hi in rng_range.intervals], dtype=torch.float32, device=self.device)
        self.masks = None if masks is None else masks.to(device=self.device, dtype=torch.float64)
        self.ops = tuple(ops)

    def inputs(self, step) -> Tensor:
        if not isinstance(step, Tensor):
            step = torch.tensor(int(step), dtype=torch.int64, device=self.device)
        S = self.keys.shape[0]
        u = (uniform_bits(self.keys, step, self.index) >> 9).to(torch.float32) * (2.0 ** -23)  # [0, 1), 2^-23 grid
        if len(self.range.intervals) == 1:
            lo, hi = self._lo[0], self._hi[0]
        else:
            pick_u = (uniform_bits(self.keys, step, self.index, lane=1) >> 8).to(torch.float64) * (2.0 ** -24)
            pick = (pick_u.unsqueeze(-1) >= self._cum).sum(-1)
            lo, hi = self._lo[pick], self._hi[pick]
        x = lo + u * (hi - lo)
        x = torch.minimum(x, torch.nextafter(hi, lo) if isinstance(hi, Tensor) else hi)  # stay inside [lo, hi)
        return x.reshape(S, *self.shape)

    def close(self) -> None:
        """Nothing to release (no prefetching thread, unlike :class:`~.uniform_stream.UniformStream`)."""

    def draw(self, step) -> Tuple[Tensor, Optional[Tensor]]:
        x = self.inputs(step)
        if self.masks is None:
            return x, None
        xs = x.double()
        if xs.dim() == 4:  # sequences (S, B, T, I): the targets are those of the sums over time
            xs = xs.sum(-2)
        ab = torch.bmm(xs, self.masks)  # (S, B, 2), exact sums of the float32 inputs
        t = torch.cat([apply_op(op, ab[..., 0], ab[..., 1]) for op in self.ops], 0).unsqueeze(-1).float()
        return x, t
