"""The recurrent layers of the sequence tasks (digits, language, programs, parity).

All take ``x`` of shape ``(E, B, T, in)`` and an optional mask ``(E or 1, B, T)`` of valid steps (a
masked step leaves the state unchanged), and return every step's output ``(E, B, T, H)``:

* :class:`EnsembleLSTM`, :class:`EnsembleGRU`, :class:`EnsembleUGRNN` (Collins et al. 2017,
  "update-gate RNN"), on the one :class:`~.layers.GatedCell` base;
* :class:`RecurrentArithmetic`: a NAC or NALU applied to ``concat(x_t, h_{t-1})`` at every step
  (the paper's recurrent NAC / NALU);
* :func:`make_recurrent`: one of :data:`RECURRENT_KINDS` by name.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

import nalu_cuda

from .layers import GatedCell, Generators

__all__ = ["EnsembleLSTM", "EnsembleGRU", "EnsembleUGRNN", "RecurrentArithmetic", "make_recurrent", "RECURRENT_KINDS"]


# ------------------------------------------------------------------------------------------------
# Recurrent cells. All take x of shape (E, B, T, in) and an optional mask (E or 1, B, T) of valid
# steps (a masked step leaves the state unchanged), and return every step's output (E, B, T, H).
# ------------------------------------------------------------------------------------------------


class _Recurrent(nn.Module):
    hidden_size: int

    @staticmethod
    def _mask_steps(mask: Optional[Tensor], T: int) -> List[Optional[Tensor]]:
        """Per-step masks ``(E or 1, B, 1)``; ``unbind`` (not indexing) keeps backward linear in T."""
        if mask is None:
            return [None] * T
        return list(mask.unsqueeze(-1).unbind(2))

    @staticmethod
    def _mask_step(m: Optional[Tensor], new: Tensor, old: Tensor) -> Tensor:
        return new if m is None else torch.where(m, new, old)

    def _scan(self, x: Tensor, mask: Optional[Tensor], step, n_states: int = 1) -> Tensor:
        """Run ``step(xt, states) -> new states`` over the steps of ``x`` ``(E, B, T, I)`` (``xt``:
        the input projection of step t, all steps projected at once); the states start at zero and a
        masked-out step keeps them. Returns the first state after every step ``(E, B, T, H)``."""
        E, B, T, _ = x.shape
        xp = self.x2h(x)
        states = tuple(x.new_zeros(E, B, self.hidden_size) for _ in range(n_states))
        outs = []
        for xt, mt in zip(xp.unbind(2), self._mask_steps(mask, T)):
            states = tuple(self._mask_step(mt, new, old) for new, old in zip(step(xt, states), states))
            outs.append(states[0])
        return torch.stack(outs, dim=2)


class EnsembleLSTM(GatedCell, _Recurrent):
    """LSTM (PyTorch's gate equations) per member; ``output_sum=True`` also returns the running sum."""

    GATES, H2H_BIAS = 4, False

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        def step(xt: Tensor, states):
            h, c = states
            i, f, g, o = (xt + self.h2h(h)).chunk(4, dim=-1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c_new), c_new

        return self._scan(x, mask, step, n_states=2)


class EnsembleGRU(GatedCell, _Recurrent):
    """GRU (PyTorch's gate equations) per member."""

    GATES, H2H_BIAS = 3, True

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        def step(xt: Tensor, states):
            (h,) = states
            xr, xz, xn = xt.chunk(3, dim=-1)
            hr, hz, hn = self.h2h(h).chunk(3, dim=-1)
            r = torch.sigmoid(xr + hr)
            z = torch.sigmoid(xz + hz)
            return ((1 - z) * torch.tanh(xn + r * hn) + z * h,)

        return self._scan(x, mask, step)


class EnsembleUGRNN(GatedCell, _Recurrent):
    """Update-gate RNN (Collins, Sohl-Dickstein, Sussillo 2017), the paper's UGRNN baseline:
    ``c = tanh(W_c [x, h] + b_c)``, ``g = sigmoid(W_g [x, h] + b_g)``, ``h = g h + (1 - g) c``."""

    GATES, H2H_BIAS = 2, False

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        def step(xt: Tensor, states):
            (h,) = states
            zc, zg = (xt + self.h2h(h)).chunk(2, dim=-1)
            g = torch.sigmoid(zg)
            return (g * h + (1 - g) * torch.tanh(zc),)

        return self._scan(x, mask, step)


class RecurrentArithmetic(_Recurrent):
    """The paper's recurrent NAC / NALU: ``h_t = cell(concat(x_t, h_{t-1}))``, ``h_0 = 0``.

    ``kind`` is ``"nac"`` (:class:`nalu_cuda.NAC`), ``"nau"`` (:class:`nalu_cuda.NAU`: call
    ``cell.project_()`` after each optimiser step, as the published runs do) or ``"nalu"`` (:class:`nalu_cuda.NALU`, the
    paper's tied weights and input-dependent gate); ``backend`` goes to the layer. The state is the
    output: there is no read-out layer, so a count or a sum lives in one linear unit of ``h``.
    """

    def __init__(self, input_size: int, hidden_size: int, *, ensemble: int, kind: str = "nac",
                 backend: str = "auto", **nalu_kwargs) -> None:
        super().__init__()
        self.hidden_size, self.kind = hidden_size, kind
        if kind == "nac":
            self.cell = nalu_cuda.NAC(input_size + hidden_size, hidden_size, ensemble=ensemble, backend=backend)
        elif kind == "nau":
            self.cell = nalu_cuda.NAU(input_size + hidden_size, hidden_size, ensemble=ensemble, backend=backend)
        elif kind == "nalu":
            self.cell = nalu_cuda.NALU(input_size + hidden_size, hidden_size, ensemble=ensemble, backend=backend,
                                       **nalu_kwargs)
        else:
            raise ValueError(f"RecurrentArithmetic: kind must be 'nac', 'nau' or 'nalu', got {kind!r}")

    def reset_parameters(self, generator: Generators = None) -> None:
        self.cell.reset_parameters(list(generator))

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, h0: Optional[Tensor] = None) -> Tensor:
        E, B, T, _ = x.shape
        h = x.new_zeros(E, B, self.hidden_size) if h0 is None else h0
        outs = []
        for xt, mt in zip(x.unbind(2), self._mask_steps(mask, T)):
            h = self._mask_step(mt, self.cell(torch.cat([xt, h], dim=-1)), h)
            outs.append(h)
        return torch.stack(outs, dim=2)


ARITHMETIC_KINDS = ("nac", "nau", "nalu")
RECURRENT_KINDS = ("lstm", "gru", "ugrnn") + ARITHMETIC_KINDS


def make_recurrent(kind: str, ensemble: int, input_size: int, hidden_size: int, backend: str = "auto") -> _Recurrent:
    """A recurrent layer by name (``RECURRENT_KINDS``)."""
    if kind == "lstm":
        return EnsembleLSTM(input_size, hidden_size, ensemble=ensemble)
    if kind == "gru":
        return EnsembleGRU(input_size, hidden_size, ensemble=ensemble)
    if kind == "ugrnn":
        return EnsembleUGRNN(input_size, hidden_size, ensemble=ensemble)
    if kind in ARITHMETIC_KINDS:
        return RecurrentArithmetic(input_size, hidden_size, ensemble=ensemble, kind=kind, backend=backend)
    raise ValueError(f"unknown recurrent kind {kind!r}; expected one of {RECURRENT_KINDS}")
