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
from torch.autograd.function import once_differentiable

import nalu_cuda
from nalu_cuda import _ops

from .layers import GatedCell, Generators

__all__ = ["EnsembleLSTM", "lstm_sequence", "EnsembleGRU", "EnsembleUGRNN", "RecurrentArithmetic", "make_recurrent", "RECURRENT_KINDS",
           "final_states", "frozen_states", "last_valid_step"]


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

    def _scan(self, xs: Tensor, mask: Optional[Tensor], step, n_states: int = 1) -> Tensor:
        """Run ``step(xt, states) -> new states`` over the steps of ``xs`` ``(T, E, B, G)`` (time
        first, so that ``xt``, the input projection of step t, is contiguous); the states start at
        zero and a masked-out step keeps them. Returns the first state after every step ``(E, B, T, H)``."""
        T, E, B, _ = xs.shape
        states = tuple(xs.new_zeros(E, B, self.hidden_size) for _ in range(n_states))
        outs = []
        for xt, mt in zip(xs.unbind(0), self._mask_steps(mask, T)):
            states = tuple(self._mask_step(mt, new, old) for new, old in zip(step(xt, states), states))
            outs.append(states[0])
        return torch.stack(outs, dim=2)


def last_valid_step(mask: Tensor) -> Tensor:
    """The index of each row's last valid step of a prefix mask ``(..., T)`` (valid steps first, then
    padding; 0 for a row with none)."""
    return (mask.sum(-1) - 1).clamp_min(0)


def final_states(h: Tensor, mask: Tensor) -> Tensor:
    """The state after each row's last valid step, ``(E, B, H)``, of an unmasked run's states
    ``h (E, B, T, H)`` and a prefix mask ``(E or 1, B, T)`` or ``(B, T)``: what a run masked with it
    ends in (a masked step keeps the state), without a select per step."""
    E, B, T, H = h.shape
    at = last_valid_step(mask).expand(E, B)
    return h.gather(2, at.reshape(E, B, 1, 1).expand(E, B, 1, H)).squeeze(2)


def frozen_states(h: Tensor, mask: Tensor) -> Tensor:
    """The states ``(E, B, T, H)`` of a run masked with a prefix mask ``(E or 1, B, T)`` or ``(B, T)``
    (each row's state kept after its last valid step), from an unmasked run's ``h``."""
    E, B, T, H = h.shape
    at = torch.minimum(torch.arange(T, device=h.device), last_valid_step(mask).unsqueeze(-1)).expand(E, B, T)
    return h.gather(2, at.unsqueeze(-1).expand(E, B, T, H))


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
        return self._run(xp.movedim(2, 0).contiguous(), mask)

    def forward_tokens(self, table: Tensor, tokens: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward` of the embedded tokens ``table[e, tokens[e]]`` (``table (E, V, in)``;
        ``tokens (E, B, T)``, or ``(B, T)`` shared by every member): ``x2h`` of the ``V`` rows of the
        table, then gathered per token (time first, as the scan reads them), the same function as
        projecting every token (a token's projection is its row's; the gradients reach the table
        through the gather) with ``V`` products instead of ``B * T``."""
        rows = self.x2h(table)
        E, V, G = rows.shape
        tok = tokens.expand(E, *tokens.shape[-2:])
        flat = (tok + torch.arange(E, device=tok.device).view(E, 1, 1) * V).permute(2, 0, 1)  # (T, E, B)
        xs = rows.reshape(E * V, G).index_select(0, flat.reshape(-1)).view(*flat.shape, G)
        return self._run(xs, mask)

    def _run(self, xs: Tensor, mask: Optional[Tensor]) -> Tensor:
        """The states after every step ``(E, B, T, H)`` of the projected inputs ``xs (T, E, B, G)``."""
        return self._scan(xs, mask, self.cell_step, self.N_STATES)


def _lstm_gates(z: Tensor, c: Tensor, grad: bool = True) -> Tuple[Tensor, Tensor, Tuple[Tensor, ...]]:
    """PyTorch's LSTM equations from the gates' pre-activations ``z (..., 4H)`` (i, f, g, o) and the
    cell state ``c``: ``h_new``, ``c_new`` and what :func:`_lstm_gates_grad` needs, ``(s, d, dtc, tc, c)``:
    ``s`` the sigmoid of the whole block, taken in one pass (the cell gate's block is then replaced
    by ``g = tanh``; on CPU an op over a column block of ``z`` is several times slower than over a
    contiguous tensor), ``d`` the gates' derivatives (``s (1 - s)``, the cell gate's ``1 - g^2``),
    ``tc = tanh(c_new)``, ``dtc = 1 - tc^2`` (not formed without ``grad``: an empty tuple)."""
    H = c.shape[-1]
    s = torch.sigmoid(z)
    g = s[..., 2 * H:3 * H]
    g.copy_(torch.tanh(z[..., 2 * H:3 * H].contiguous()))
    i, f, o = s[..., :H], s[..., H:2 * H], s[..., 3 * H:]
    c_new = torch.addcmul(f * c, i, g)
    tc = torch.tanh(c_new)
    if not grad:
        return o * tc, c_new, ()
    d = torch.addcmul(s, s, s, value=-1.0)
    one = torch.ones((), dtype=s.dtype, device=s.device)
    d[..., 2 * H:3 * H] = torch.addcmul(one, g, g, value=-1.0)
    return o * tc, c_new, (s, d, torch.addcmul(one, tc, tc, value=-1.0), tc, c)


def _lstm_gates_grad(saved: Tuple[Tensor, ...], dh: Tensor, dc_new: Tensor, dz: Tensor) -> Tensor:
    """The backward of :func:`_lstm_gates` (``saved``: what it returned for it): writes the gradient
    of ``z`` into ``dz`` (one buffer, no concatenation of its four blocks) and returns that of ``c``."""
    s, d, dtc, tc, c = saved
    H = c.shape[-1]
    i, f, g, o = s[..., :H], s[..., H:2 * H], s[..., 2 * H:3 * H], s[..., 3 * H:]
    dc = torch.addcmul(dc_new, dh * o, dtc)
    for k, (a, b) in enumerate(((dc, g), (dc, c), (dc, i), (dh, tc))):
        torch.mul(a * b, d[..., k * H:(k + 1) * H], out=dz[..., k * H:(k + 1) * H])
    return dc * f


class _LSTMGates(torch.autograd.Function):
    """One LSTM step from the gates' pre-activations: ``(z, c) -> (h, c_new)``, the backward written
    out (a few elementwise ops instead of autograd's graph of a dozen small ones)."""

    @staticmethod
    def forward(ctx, z: Tensor, c: Tensor):
        h, c_new, saved = _lstm_gates(z, c)
        ctx.save_for_backward(*saved)
        return h, c_new

    @staticmethod
    @once_differentiable
    def backward(ctx, dh: Tensor, dc_new: Tensor):
        saved = ctx.saved_tensors
        dz = torch.empty_like(saved[0])
        return dz, _lstm_gates_grad(saved, dh, dc_new, dz)


class _LSTMSequence(torch.autograd.Function):
    """An unmasked ensemble LSTM over a whole sequence: ``xs (T, E, B, 4H)`` (the projected inputs,
    time first) and the state weights ``W (E, H, 4H)`` -> the state after every step ``(T, E, B, H)``,
    from zero states (``grad``: whether a backward may follow). The backward runs the steps in reverse by hand: each step's input gradient is
    written into one ``(T, E, B, 4H)`` buffer and ``W``'s gradient accumulated in place, instead of
    autograd's graph of every step (and the concatenation of the steps' gradients)."""

    @staticmethod
    def forward(ctx, xs: Tensor, W: Tensor, grad: bool):
        T, E, B, _ = xs.shape
        H = W.shape[1]
        hs = xs.new_empty(T, E, B, H)
        h, c = xs.new_zeros(E, B, H), xs.new_zeros(E, B, H)
        saved = []
        for t in range(T):
            h_new, c_new, step_saved = _lstm_gates(torch.baddbmm(xs[t], h, W), c, grad)
            saved.append(step_saved)
            hs[t] = h_new
            h, c = hs[t], c_new
        ctx.saved = saved
        ctx.save_for_backward(W, hs)
        return hs

    @staticmethod
    @once_differentiable
    def backward(ctx, dhs: Tensor):
        W, hs = ctx.saved_tensors
        T, E, B, H = hs.shape
        dxs = dhs.new_empty(T, E, B, 4 * H)
        dW = torch.zeros_like(W)
        dh, dc = dhs.new_zeros(E, B, H), dhs.new_zeros(E, B, H)
        Wt = W.transpose(1, 2)
        for t in range(T - 1, -1, -1):
            dz = dxs[t]
            dc = _lstm_gates_grad(ctx.saved[t], dhs[t] + dh, dc, dz)
            if t > 0:
                dW.baddbmm_(hs[t - 1].transpose(1, 2), dz)
            dh = torch.bmm(dz, Wt)
        return dxs, dW, None


class _LSTMSequenceNative(torch.autograd.Function):
    """:class:`_LSTMSequence` as two native calls on the CPU (``nalu_cuda::lstm_sequence_forward``
    and ``lstm_sequence_backward``, ``csrc/experiments/cpu/lstm_sequence.cpp``): every step's gates,
    cell and output of a member in one pass along the gates' rows, and the backward through time in
    one pass back, instead of a dozen torch ops per step each way. The same equations; the sums'
    order (and so the last bits) differ from the torch version's, which stays the reference."""

    @staticmethod
    def forward(ctx, xs: Tensor, W: Tensor, grad: bool):
        W = W.contiguous()
        hs, saved = _ops.ops.lstm_sequence_forward(xs.contiguous(), W, grad)
        ctx.save_for_backward(W, hs, saved)
        return hs

    @staticmethod
    @once_differentiable
    def backward(ctx, dhs: Tensor):
        W, hs, saved = ctx.saved_tensors
        dxs, dW = _ops.ops.lstm_sequence_backward(dhs.contiguous(), W, hs, saved)
        return dxs, dW, None


def lstm_sequence(xs: Tensor, W: Tensor, grad: bool, native: bool = True) -> Tensor:
    """An unmasked ensemble LSTM over a whole sequence (``xs (T, E, B, 4H)``, ``W (E, H, 4H)`` ->
    ``(T, E, B, H)``): the native kernels where they run (CPU, float32 or float64, the extension
    loaded, ``native``), else the torch version :class:`_LSTMSequence`."""
    if (native and xs.device.type == "cpu" and xs.dtype in (torch.float32, torch.float64) and W.dtype == xs.dtype
            and _ops.has_kernel("cpu", "lstm_sequence_forward")):
        return _LSTMSequenceNative.apply(xs, W, grad)
    return _LSTMSequence.apply(xs, W, grad)


class EnsembleLSTM(_GatedRecurrent):
    """LSTM (PyTorch's gate equations) per member. Unmasked ensemble runs take the whole sequence in
    one step of autograd (:func:`lstm_sequence`: native kernels on the CPU unless ``native`` is
    False, else :class:`_LSTMSequence`); masked ones step by step."""

    GATES, H2H_BIAS, N_STATES = 4, False, 2
    native: bool = True  # the native sequence kernels where they run (False: the torch version)

    def cell_step(self, xt: Tensor, states: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        h, c = states
        return _LSTMGates.apply(self._gates(xt, h), c)

    def _run(self, xs: Tensor, mask: Optional[Tensor]) -> Tensor:
        if mask is None and self.h2h.weight.dim() == 3 and xs.dim() == 4:
            return lstm_sequence(xs, self.h2h.weight, torch.is_grad_enabled(), self.native).movedim(0, 2)
        return super()._run(xs, mask)


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
