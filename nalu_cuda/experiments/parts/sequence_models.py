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

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

import nalu_cuda

from .layers import GatedCell, Generators, ensemble_gather

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

    def _scan(self, xp: Tensor, mask: Optional[Tensor], step, n_states: int = 1) -> Tensor:
        """Run ``step(xt, states) -> new states`` over the steps of ``xp`` ``(E, B, T, G)`` (``xt``:
        the input projection of step t); the states start at zero and a masked-out step keeps them.
        Returns the first state after every step ``(E, B, T, H)``."""
        E, B, T, _ = xp.shape
        states = tuple(xp.new_zeros(E, B, self.hidden_size) for _ in range(n_states))
        outs = []
        steps = xp.movedim(2, 0).contiguous().unbind(0)  # each step's input contiguous, in one copy
        for xt, mt in zip(steps, self._mask_steps(mask, T)):
            states = tuple(self._mask_step(mt, new, old) for new, old in zip(step(xt, states), states))
            outs.append(states[0])
        return torch.stack(outs, dim=2)


class _GatedRecurrent(GatedCell, _Recurrent):
    """A gated cell over a sequence: ``forward(x, mask)`` projects every step's input at once
    (``x2h``), then runs :meth:`cell_step` (``xt``: a step's projected input) over the steps. :meth:`forward_tokens` takes token ids and a
    table of their embeddings instead, and projects each table row once."""

    N_STATES = 1

    def cell_step(self, xt: Tensor, states: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        raise NotImplementedError

    def _gates(self, xt: Tensor, h: Tensor) -> Tensor:
        """``xt + h2h(h)`` in one batched product where the cell is an ensemble (``baddbmm``)."""
        W = self.h2h.weight
        if W.dim() == 3 and h.dim() == 3 and self.h2h.bias is None:
            return torch.baddbmm(xt, h, W)
        return xt + self.h2h(h)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self.forward_projected(self.x2h(x), mask)

    def forward_projected(self, xp: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward` on inputs already projected by ``x2h``: ``xp (E, B, T, GATES * H)``."""
        return self._scan(xp, mask, self.cell_step, self.N_STATES)

    def forward_tokens(self, table: Tensor, tokens: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward` of the embedded tokens ``table[e, tokens[e]]`` (``table (E, V, in)``;
        ``tokens (E, B, T)``, or ``(B, T)`` shared by every member): ``x2h`` of the ``V`` rows of the
        table, then gathered per token, the same function as projecting every token (a token's
        projection is its row's; the gradients reach the table through the gather) with ``V``
        products instead of ``B * T``."""
        rows = self.x2h(table)
        if tokens.dim() == 2:  # shared by every member: one index along the rows
            xp = rows.index_select(1, tokens.reshape(-1)).reshape(rows.shape[0], *tokens.shape, rows.shape[-1])
        else:
            xp = ensemble_gather(rows, tokens)
        return self.forward_projected(xp, mask)


class EnsembleLSTM(_GatedRecurrent):
    """LSTM (PyTorch's gate equations) per member."""

    GATES, H2H_BIAS, N_STATES = 4, False, 2

    def cell_step(self, xt: Tensor, states: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        h, c = states
        z = self._gates(xt, h)
        # the sigmoid of every gate in one pass over the contiguous block (the cell gate's is not used):
        # on CPU an op over a column block of z is several times slower than over a contiguous tensor
        i, f, _, o = torch.sigmoid(z).chunk(4, dim=-1)
        H = self.hidden_size
        c_new = f * c + i * torch.tanh(z[..., 2 * H:3 * H].contiguous())
        return o * torch.tanh(c_new), c_new


class EnsembleGRU(_GatedRecurrent):
    """GRU (PyTorch's gate equations) per member."""

    GATES, H2H_BIAS = 3, True

    def cell_step(self, xt: Tensor, states: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        (h,) = states
        xr, xz, xn = xt.chunk(3, dim=-1)
        hr, hz, hn = self.h2h(h).chunk(3, dim=-1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        return ((1 - z) * torch.tanh(xn + r * hn) + z * h,)


class EnsembleUGRNN(_GatedRecurrent):
    """Update-gate RNN (Collins, Sohl-Dickstein, Sussillo 2017), the paper's UGRNN baseline:
    ``c = tanh(W_c [x, h] + b_c)``, ``g = sigmoid(W_g [x, h] + b_g)``, ``h = g h + (1 - g) c``."""

    GATES, H2H_BIAS = 2, False

    def cell_step(self, xt: Tensor, states: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        (h,) = states
        zc, zg = (z.contiguous() for z in self._gates(xt, h).chunk(2, dim=-1))  # see EnsembleLSTM.cell_step
        g = torch.sigmoid(zg)
        return (g * h + (1 - g) * torch.tanh(zc),)


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
