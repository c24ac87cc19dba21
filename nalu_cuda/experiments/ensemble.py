"""Models of the arithmetic experiments, for one seed or ``E`` seeds trained as one ensemble.

Every module takes ``ensemble=None`` (a plain model: ``x`` is ``(B, ..., in)``) or
``ensemble=E`` (``E`` independent models: ``x`` is ``(E, B, ..., in)``, member ``e`` sees only
``x[e]`` and its own parameters, which carry a leading ``E``). The NAC/NALU layers are the
library's (:mod:`nalu_cuda.modules`, fused kernels); the baselines (linear layers, MLPs with any
of :data:`ACTIVATIONS`, LSTM and GRU cells) are plain PyTorch with batched matrix products.

``reset_parameters(generators)`` initialises member ``e`` from ``generators[e]`` (one
``torch.Generator`` for a plain model), visiting the layers in a fixed order, so that a member
equals the single model initialised with the same generator (see :func:`member_generators`).

Model names (``--model``) for the arithmetic tasks, all with hidden size 2 as in Madsen &
Johansen (2020); a model is ``first layer -> second layer``:

=========================  =========================================================
``linear``                 Linear -> Linear (no nonlinearity)
``relu`` ``relu6`` ...     Linear + activation -> Linear (any name of ACTIVATIONS)
``nac``                    NAC+ -> NAC+
``nac-mul``                NAC+ -> NAC* (Madsen's "NAC-mul")
``nalu``                   NALU -> NALU, tied weights, input-dependent gate (the paper)
``nalu-separate``          separate weights for the multiplicative path, input gate
``nalu-indgate``           tied weights, input-independent gate ``sigmoid(g)``
``nalu-separate-indgate``  separate weights and an input-independent gate
``lstm`` ``gru``           recurrent task only: the cell -> Linear
=========================  =========================================================

In the recurrent task the first layer is a recurrent cell over ``concat(x_t, h_{t-1})``, with a
learned initial state (zeros at initialisation), and the second layer reads the final state.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nalu_cuda

from .arithmetic import seed_for

__all__ = [
    "ACTIVATIONS",
    "ARITHMETIC_MODELS",
    "MLP_MODELS",
    "RECURRENT_MODELS",
    "member_generators",
    "EnsembleLinear",
    "Activation",
    "EnsembleMLP",
    "StackedNet",
    "RecurrentNet",
    "build_static_model",
    "build_recurrent_model",
    "arithmetic_weights",
    "sparsity_error",
    "reset_members",
]

ACTIVATIONS = ("none", "relu", "relu6", "sigmoid", "tanh", "hardtanh", "softsign", "elu", "selu", "prelu",
               "leaky_relu", "softplus")

NALU_VARIANTS = {
    "nalu": dict(tied=True, gate="input"),
    "nalu-separate": dict(tied=False, gate="input"),
    "nalu-indgate": dict(tied=True, gate="independent"),
    "nalu-separate-indgate": dict(tied=False, gate="independent"),
}
ARITHMETIC_MODELS = ("nac", "nac-mul") + tuple(NALU_VARIANTS)
MLP_MODELS = ("linear",) + tuple(a for a in ACTIVATIONS if a != "none")
RECURRENT_MODELS = ARITHMETIC_MODELS + ("lstm", "gru")

Generators = Union[None, torch.Generator, Sequence[torch.Generator]]


def member_generators(seeds: Sequence[int], purpose: str = "init") -> List[torch.Generator]:
    """One CPU generator per seed; ``purpose`` separates independent uses of one seed."""
    return [torch.Generator().manual_seed(seed_for(int(s), purpose)) for s in seeds]


def _per_member(ensemble: Optional[int], generator: Generators):
    """[(index, generator)] as in nalu_cuda's layers: index () for a plain module."""
    if ensemble is None:
        if isinstance(generator, (list, tuple)):
            if len(generator) != 1:
                raise ValueError(f"a plain model takes one generator, got {len(generator)}")
            generator = generator[0]
        return [((), generator)]
    if generator is None or isinstance(generator, torch.Generator):
        return [((e,), generator) for e in range(ensemble)]
    gens = list(generator)
    if len(gens) != ensemble:
        raise ValueError(f"expected {ensemble} generators (one per member), got {len(gens)}")
    return [((e,), g) for e, g in enumerate(gens)]


def _lead(ensemble: Optional[int]):
    return () if ensemble is None else (ensemble,)


def _bmm(x: Tensor, W: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x W (+ bias)``: plain (W ``(I, O)``) or per member (W ``(E, I, O)``, x ``(E, ..., I)``)."""
    if W.dim() == 2:
        return F.linear(x, W.t(), bias) if bias is not None else x @ W
    E, I, O = W.shape
    x3 = x.reshape(E, -1, I)
    out = torch.baddbmm(bias.unsqueeze(1), x3, W) if bias is not None else torch.bmm(x3, W)
    return out.reshape(*x.shape[:-1], O)


class EnsembleLinear(nn.Module):
    """``y = x W + b`` with ``W`` of shape ``([E,] in, out)``; PyTorch's default initialisation."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, ensemble: Optional[int] = None):
        super().__init__()
        self.in_features, self.out_features, self.ensemble = in_features, out_features, ensemble
        self.weight = nn.Parameter(torch.empty(*_lead(ensemble), in_features, out_features))
        self.bias = nn.Parameter(torch.empty(*_lead(ensemble), out_features)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform(a=sqrt(5)), as nn.Linear
        for idx, g in _per_member(self.ensemble, generator):
            self.weight[idx].uniform_(-bound, bound, generator=g)
            if self.bias is not None:
                self.bias[idx].uniform_(-bound, bound, generator=g)

    def forward(self, x: Tensor) -> Tensor:
        return _bmm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        ens = "" if self.ensemble is None else f", ensemble={self.ensemble}"
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}{ens}"


class Activation(nn.Module):
    """One of :data:`ACTIVATIONS`; ``prelu`` has one slope per member (initialised 0.25)."""

    def __init__(self, name: str, *, ensemble: Optional[int] = None):
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {name!r}; choose from {', '.join(ACTIVATIONS)}")
        self.name, self.ensemble = name, ensemble
        self.slope = nn.Parameter(torch.full(_lead(ensemble) or (1,), 0.25)) if name == "prelu" else None

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        if self.slope is not None:
            self.slope.fill_(0.25)

    def forward(self, x: Tensor) -> Tensor:
        n = self.name
        if n == "none":
            return x
        if n == "prelu":
            a = self.slope if self.ensemble is None else self.slope.reshape(-1, *([1] * (x.dim() - 1)))
            return torch.where(x >= 0, x, a * x)
        fn = {"relu": F.relu, "relu6": F.relu6, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
              "hardtanh": F.hardtanh, "softsign": F.softsign, "elu": F.elu, "selu": F.selu,
              "leaky_relu": F.leaky_relu, "softplus": F.softplus}[n]
        return fn(x)

    def extra_repr(self) -> str:
        return self.name


def reset_members(layers: Sequence[nn.Module], generator: Generators) -> None:
    """Initialise ``layers`` in order, each member from its own generator."""
    for layer in layers:
        layer.reset_parameters(generator)


class EnsembleMLP(nn.Module):
    """Linear layers of ``sizes`` with ``activation`` after every layer but the last."""

    def __init__(self, sizes: Sequence[int], activation: str, *, ensemble: Optional[int] = None):
        super().__init__()
        self.ensemble = ensemble
        layers: List[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(EnsembleLinear(a, b, ensemble=ensemble))
            if i < len(sizes) - 2:
                layers.append(Activation(activation, ensemble=ensemble))
        self.layers = nn.Sequential(*layers)

    def reset_parameters(self, generator: Generators = None) -> None:
        reset_members(list(self.layers), generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def _arith_layer(kind: str, i: int, o: int, ensemble, backend: str, last: bool, eps: float) -> nn.Module:
    if kind == "nac" or (kind == "nac-mul" and not last):
        return nalu_cuda.NAC(i, o, ensemble=ensemble, backend=backend)
    if kind == "nac-mul":
        return nalu_cuda.NACMul(i, o, eps=eps, ensemble=ensemble, backend=backend)
    if kind in NALU_VARIANTS:
        return nalu_cuda.NALU(i, o, eps=eps, ensemble=ensemble, backend=backend, **NALU_VARIANTS[kind])
    raise ValueError(f"unknown arithmetic model {kind!r}")


def check_model(name: str, allowed: Sequence[str]) -> str:
    key = str(name).strip().lower().replace("_", "-")
    if key == "leaky-relu":
        key = "leaky_relu"
    if key not in allowed:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(allowed)}")
    return key


class StackedNet(nn.Module):
    """A feed-forward stack of ``sizes``: arithmetic units or an MLP (see the module docstring)."""

    def __init__(self, model: str, sizes: Sequence[int], *, ensemble: Optional[int] = None, backend: str = "auto",
                 eps: float = 1e-7):
        super().__init__()
        self.model, self.ensemble = model, ensemble
        if model in ARITHMETIC_MODELS:
            n = len(sizes) - 1
            self.net = nn.Sequential(*[_arith_layer(model, a, b, ensemble, backend, k == n - 1, eps)
                                       for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))])
        else:
            act = "none" if model == "linear" else model
            self.net = EnsembleMLP(sizes, act, ensemble=ensemble)

    def reset_parameters(self, generator: Generators = None) -> None:
        if isinstance(self.net, EnsembleMLP):
            self.net.reset_parameters(generator)
        else:
            reset_members(list(self.net), generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def build_static_model(model: str, input_size: int = 100, hidden: int = 2, *, ensemble: Optional[int] = None,
                       backend: str = "auto", eps: float = 1e-7) -> StackedNet:
    model = check_model(model, ARITHMETIC_MODELS + MLP_MODELS)
    return StackedNet(model, [input_size, hidden, 1], ensemble=ensemble, backend=backend, eps=eps)


# ------------------------------------------------------------------------------------------------
# Recurrent models
# ------------------------------------------------------------------------------------------------


class _GatedCell(nn.Module):
    """LSTM or GRU cell with weights ``([E,] in + H, k H)``; PyTorch's U(-1/sqrt(H), 1/sqrt(H)) init."""

    def __init__(self, kind: str, input_size: int, hidden: int, ensemble: Optional[int]):
        super().__init__()
        self.kind, self.hidden, self.ensemble = kind, hidden, ensemble
        k = 4 if kind == "lstm" else 3
        self.W_x = nn.Parameter(torch.empty(*_lead(ensemble), input_size, k * hidden))
        self.W_h = nn.Parameter(torch.empty(*_lead(ensemble), hidden, k * hidden))
        self.b_x = nn.Parameter(torch.empty(*_lead(ensemble), k * hidden))
        self.b_h = nn.Parameter(torch.empty(*_lead(ensemble), k * hidden))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        bound = 1.0 / math.sqrt(self.hidden)
        for idx, g in _per_member(self.ensemble, generator):
            for p in (self.W_x, self.W_h, self.b_x, self.b_h):
                p[idx].uniform_(-bound, bound, generator=g)

    def forward(self, x: Tensor, state):
        H = self.hidden
        if self.kind == "lstm":
            h, c = state
            z = _bmm(x, self.W_x, self.b_x) + _bmm(h, self.W_h, self.b_h)
            i, f, g, o = z.split(H, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            return h, (h, c)
        h = state
        zx = _bmm(x, self.W_x, self.b_x)
        zh = _bmm(h, self.W_h, self.b_h)
        rx, ux, nx = zx.split(H, dim=-1)
        rh, uh, nh = zh.split(H, dim=-1)
        r = torch.sigmoid(rx + rh)
        u = torch.sigmoid(ux + uh)
        n = torch.tanh(nx + r * nh)
        h = (1 - u) * n + u * h
        return h, h


class RecurrentNet(nn.Module):
    """A recurrent first layer over ``x_t`` (``(…, T, in)``), then a second layer on the last state.

    NAC/NALU models: ``h_t = unit(concat(x_t, h_{t-1}))`` with a learned ``h_0`` (zeros at
    initialisation, as in stable-nalu) and the second unit of the model on ``h_T``. ``lstm``/``gru``:
    the cell (hidden size ``hidden``), learned zero states, a linear read-out.
    """

    def __init__(self, model: str, input_size: int = 10, hidden: int = 2, *, ensemble: Optional[int] = None,
                 backend: str = "auto", eps: float = 1e-7):
        super().__init__()
        self.model = check_model(model, RECURRENT_MODELS)
        self.ensemble, self.hidden = ensemble, hidden
        n_states = 2 if self.model == "lstm" else 1
        self.h0 = nn.Parameter(torch.zeros(*_lead(ensemble), n_states, hidden))
        if self.model in ("lstm", "gru"):
            self.cell = _GatedCell(self.model, input_size, hidden, ensemble)
            self.out = EnsembleLinear(hidden, 1, ensemble=ensemble)
        else:
            self.cell = _arith_layer(self.model, input_size + hidden, hidden, ensemble, backend, False, eps)
            self.out = _arith_layer(self.model, hidden, 1, ensemble, backend, True, eps)

    def reset_parameters(self, generator: Generators = None) -> None:
        with torch.no_grad():
            self.h0.zero_()
        reset_members([self.cell, self.out], generator)

    def _initial(self, batch_shape):
        # h0: ([E,] S, H) -> per state ([E,] B..., H)
        if self.ensemble is None:
            states = [self.h0[s].expand(*batch_shape, self.hidden) for s in range(self.h0.shape[-2])]
        else:
            E = self.ensemble
            mid = [1] * (len(batch_shape) - 1)
            states = [self.h0[:, s].reshape(E, *mid, self.hidden).expand(*batch_shape, self.hidden)
                      for s in range(self.h0.shape[-2])]
        return states

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``([E,] B, T, in)``; an ensemble also takes ``(B, T, in)``, the same inputs for
        every member (broadcast one step at a time, never copied ``E`` times)."""
        shared = self.ensemble is not None and x.dim() == 3
        batch_shape = ((self.ensemble,) + tuple(x.shape[:-2])) if shared else tuple(x.shape[:-2])
        states = self._initial(batch_shape)
        T = x.shape[-2]

        def step(t: int) -> Tensor:
            xt = x[..., t, :]
            return xt.unsqueeze(0).expand(self.ensemble, *xt.shape) if shared else xt

        if self.model in ("lstm", "gru"):
            state = (states[0], states[1]) if self.model == "lstm" else states[0]
            h = states[0]
            for t in range(T):
                h, state = self.cell(step(t), state)
        else:
            h = states[0]
            for t in range(T):
                h = self.cell(torch.cat([step(t), h], dim=-1))
        return self.out(h)


def build_recurrent_model(model: str, input_size: int = 10, hidden: int = 2, *, ensemble: Optional[int] = None,
                          backend: str = "auto", eps: float = 1e-7) -> RecurrentNet:
    return RecurrentNet(model, input_size, hidden, ensemble=ensemble, backend=backend, eps=eps)


# ------------------------------------------------------------------------------------------------
# Sparsity error (Madsen & Johansen 2020)
# ------------------------------------------------------------------------------------------------


def arithmetic_weights(module: nn.Module) -> List[Tensor]:
    """The effective weights ``W`` (and ``W_m`` of separate NALUs) of every NAC-family layer."""
    out = []
    for m in module.modules():
        if isinstance(m, (nalu_cuda.NAC, nalu_cuda.NACMul)):
            out.append(m.W)
        elif isinstance(m, nalu_cuda.NALU):
            out.append(m.W)
            if not m.tied:
                out.append(m.W_m)
    return out


@torch.no_grad()
def sparsity_error(module: nn.Module, ensemble: Optional[int]) -> Optional[Tensor]:
    """``max_ij min(|W_ij|, |1 - |W_ij||)`` over the arithmetic layers, per member; None for MLPs."""
    ws = arithmetic_weights(module)
    if not ws:
        return None
    errs = []
    for W in ws:
        a = W.abs()
        e = torch.minimum(a, (1 - a).abs())
        errs.append(e.reshape(e.shape[0], -1).amax(1) if ensemble is not None else e.amax().reshape(1))
    return torch.stack(errs, 0).amax(0)
