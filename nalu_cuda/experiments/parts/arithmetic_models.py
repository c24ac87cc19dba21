"""Models of the arithmetic experiments, for one seed or ``E`` seeds trained as one ensemble.

Every module takes ``ensemble=None`` (a plain model: ``x`` is ``(B, ..., in)``) or
``ensemble=E`` (``E`` independent models: ``x`` is ``(E, B, ..., in)``, member ``e`` sees only
``x[e]`` and its own parameters, which carry a leading ``E``). The NAC/NALU layers are the
library's (``nalu_cuda.NAC``, ..., fused kernels); the baselines (linear layers, MLPs with any
of :data:`ACTIVATIONS`, LSTM and GRU cells) are plain PyTorch with batched matrix products.

``reset_parameters(generators)`` initialises member ``e`` from ``generators[e]`` (one
``torch.Generator`` for a plain model), visiting the layers in a fixed order, so that a member
equals the single model initialised with the same generator (see :func:`.seeding.member_generators`).

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
``nau`` (``nau-nau``)      NAU -> NAU (Madsen's "NAU model")
``nmu``                    NAU -> NMU (Madsen's "NMU model")
``npu``                    NAU -> NPU (the NPU as the multiplicative layer of Madsen's task)
``realnpu``                NAU -> RealNPU
``inalu``                  iNALU -> iNALU
``lstm`` ``gru``           recurrent task only: the cell -> Linear
=========================  =========================================================

The units after the NALU train with their published extras, each a field of
:class:`ArithmeticUnit` (docs/units.md): a penalty and its schedule (Madsen's sparsity regulariser for
NAU/NMU models, the NPU's stepwise L1, iNALU's regulariser once a member's loss is below 1), a
projection after every optimiser step (NAU/NMU weights, the NPU gate), iNALU's gradient clipping by
value and its re-initialisation of stalled members. :func:`training_hooks` turns them into the
trainer's arguments.

In the recurrent task the first layer is a recurrent cell over ``concat(x_t, h_{t-1})``, with a
learned initial state (zeros at initialisation), and the second layer reads the final state.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nalu_cuda
from nalu_cuda import reference
from nalu_cuda import regularizers as R

from .layers import EnsembleLinear, GatedCell, Generators, lead_shape
from .optim import FlatRMSProp
from .seeding import member_generators  # noqa: F401  (re-exported: the tasks' one seeding function)

__all__ = [
    "ACTIVATIONS",
    "ARITHMETIC_MODELS",
    "ARITHMETIC_UNITS",
    "ArithmeticUnit",
    "training_hooks",
    "default_lr",
    "INALU_ALTERNATE",
    "regularizer_schedule",
    "MODEL_ALIASES",
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


class Activation(nn.Module):
    """One of :data:`ACTIVATIONS`; ``prelu`` has one slope per member (initialised 0.25)."""

    def __init__(self, name: str, *, ensemble: Optional[int] = None):
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {name!r}; choose from {', '.join(ACTIVATIONS)}")
        self.name, self.ensemble = name, ensemble
        self.slope = nn.Parameter(torch.full(lead_shape(ensemble) or (1,), 0.25)) if name == "prelu" else None

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


Schedule = Union[R.RegularizerSchedule, R.StepwiseSchedule]


@dataclass(frozen=True)
class ArithmeticUnit:
    """One entry of :data:`ARITHMETIC_UNITS`: how a model name builds its arithmetic layers and
    what its training adds to Adam on the squared loss.

    ``layer(in, out, *, ensemble, backend, eps, last)`` builds one layer (``last``: the model's
    output layer). ``penalty(model)`` is the unscaled per-member regulariser ``(E,)``, weighted by
    ``schedule.weight(step)`` (the published schedule; ``--reg-scale/--reg-start/--reg-end``
    replace it); with ``penalty_below`` it applies only to members whose batch loss is below that.
    ``project``: call ``project_()`` of every layer that has one after each optimiser step.
    ``clip_value``: clip every gradient element to ``[-clip_value, clip_value]``. ``reinit``:
    re-draw the parameters of the members whose loss stalled (iNALU's rule). ``rmsprop``: train
    with the authors' optimiser instead of Adam: :class:`~.optim.FlatRMSProp` at learning rate
    ``lr``, 8 of every 10 steps on the weights and 2 on the gate, and the penalty minimised in
    extra steps of its own (weights, then gate) instead of being added to the loss (iNALU).
    """

    layer: Callable[..., nn.Module]
    penalty: Optional[Callable[[nn.Module], Tensor]] = None
    schedule: Optional[Schedule] = None
    penalty_below: Optional[float] = None
    project: bool = False
    clip_value: Optional[float] = None
    reinit: bool = False
    rmsprop: bool = False
    lr: Optional[float] = None


def _nac(i: int, o: int, *, ensemble, backend: str, eps: float, last: bool) -> nn.Module:
    return nalu_cuda.NAC(i, o, ensemble=ensemble, backend=backend)


def _nac_mul(i: int, o: int, *, ensemble, backend: str, eps: float, last: bool) -> nn.Module:
    """Madsen's "NAC-mul": NAC+ layers, a NAC* output layer."""
    if not last:
        return _nac(i, o, ensemble=ensemble, backend=backend, eps=eps, last=last)
    return nalu_cuda.NACMul(i, o, eps=eps, ensemble=ensemble, backend=backend)


def _nalu(tied: bool, gate: str) -> Callable[..., nn.Module]:
    def layer(i: int, o: int, *, ensemble, backend: str, eps: float, last: bool) -> nn.Module:
        return nalu_cuda.NALU(i, o, eps=eps, ensemble=ensemble, backend=backend, tied=tied, gate=gate)

    return layer


def _nau_then(last_layer: Optional[Callable[..., nn.Module]]) -> Callable[..., nn.Module]:
    """NAU layers, ``last_layer`` (no eps: NAU, NMU; eps: the power units) as the output layer."""

    def layer(i: int, o: int, *, ensemble, backend: str, eps: float, last: bool) -> nn.Module:
        if not last or last_layer is None:
            return nalu_cuda.NAU(i, o, ensemble=ensemble, backend=backend)
        if last_layer is nalu_cuda.NMU:
            return nalu_cuda.NMU(i, o, ensemble=ensemble, backend=backend)
        return last_layer(i, o, eps=eps, ensemble=ensemble, backend=backend)

    return layer


def _inalu(i: int, o: int, *, ensemble, backend: str, eps: float, last: bool) -> nn.Module:
    return nalu_cuda.INALU(i, o, eps=eps, ensemble=ensemble, backend=backend)


def _npu_l1(model: nn.Module) -> Tensor:
    return sum(R.npu_l1(m, ensemble=True) for m in model.modules() if isinstance(m, nalu_cuda.NPU))


def _inalu_penalty(model: nn.Module) -> Tensor:
    return sum(R.inalu_regularizer(m, ensemble=True) for m in model.modules() if isinstance(m, nalu_cuda.INALU))


# iNALU's regulariser: on from "epoch 10" (here 1e4 steps: ten evaluation windows of 1e3 steps, the
# static task's default) for the members whose batch loss is below 1; weight 1 (its 1/20 is inside).
INALU_SCHEDULE = R.StepwiseSchedule(scale=1.0, start=1e4, end=1e4 + 1, stages=1)

ARITHMETIC_UNITS: Dict[str, ArithmeticUnit] = {
    "nac": ArithmeticUnit(_nac),
    "nac-mul": ArithmeticUnit(_nac_mul),
    "nalu": ArithmeticUnit(_nalu(tied=True, gate="input")),
    "nalu-separate": ArithmeticUnit(_nalu(tied=False, gate="input")),
    "nalu-indgate": ArithmeticUnit(_nalu(tied=True, gate="independent")),
    "nalu-separate-indgate": ArithmeticUnit(_nalu(tied=False, gate="independent")),
    "nau": ArithmeticUnit(_nau_then(None), lambda m: R.sparsity(m, ensemble=True),
                          R.PUBLISHED_SCHEDULES["nau"], project=True),
    "nmu": ArithmeticUnit(_nau_then(nalu_cuda.NMU), lambda m: R.sparsity(m, ensemble=True),
                          R.PUBLISHED_SCHEDULES["nmu"], project=True),
    "npu": ArithmeticUnit(_nau_then(nalu_cuda.NPU), _npu_l1, R.PUBLISHED_SCHEDULES["npu"], project=True),
    "realnpu": ArithmeticUnit(_nau_then(nalu_cuda.RealNPU), _npu_l1, R.PUBLISHED_SCHEDULES["npu"], project=True),
    "inalu": ArithmeticUnit(_inalu, _inalu_penalty, INALU_SCHEDULE, penalty_below=1.0, clip_value=0.1,
                            reinit=True, rmsprop=True, lr=1e-2),
}
MODEL_ALIASES = {"nau-nau": "nau"}
ARITHMETIC_MODELS = tuple(ARITHMETIC_UNITS)
MLP_MODELS = ("linear",) + tuple(a for a in ACTIVATIONS if a != "none")
RECURRENT_MODELS = ARITHMETIC_MODELS + ("lstm", "gru")


def _arith_layer(kind: str, i: int, o: int, ensemble, backend: str, last: bool, eps: float) -> nn.Module:
    return ARITHMETIC_UNITS[kind].layer(i, o, ensemble=ensemble, backend=backend, eps=eps, last=last)


def training_hooks(model: nn.Module, reg: Optional[Dict[str, Optional[float]]] = None,
                   seeds: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """The trainer's ``regularizer`` / ``project`` / ``clip_value`` / ``reinit`` arguments for a
    :class:`StackedNet` or :class:`RecurrentNet` (empty for MLPs, LSTMs, NAC and NALU models).

    ``reg``: ``{"scale", "start", "end"}``, each None for the published value of the model's
    schedule (see :func:`regularizer_schedule`). ``seeds``: the members' seeds, from which a
    re-initialisation draws (purpose ``"reinit-<step>"``); required for iNALU models."""
    unit = ARITHMETIC_UNITS.get(getattr(model, "model", ""))
    if unit is None:
        return {}
    hooks: Dict[str, Any] = {}
    sched = regularizer_schedule(model.model, reg)
    if unit.penalty is not None and sched is not None and sched.scale > 0:
        below = unit.penalty_below

        def regularizer(step: int, loss: Tensor) -> Optional[Tensor]:
            w = sched.weight(step)
            if w == 0:
                return None
            pen = w * unit.penalty(model)
            return pen if below is None else torch.where(loss < below, pen, torch.zeros_like(pen))

        if model.model in ("nau", "nmu"):  # Madsen's sparsity: the native step (.native_step) computes it itself
            regularizer.native_sparsity = (model, sched)
        hooks["regularizer"] = regularizer
    if unit.project:
        projected = [m for m in model.modules() if isinstance(m, (nalu_cuda.NAU, nalu_cuda.NMU, nalu_cuda.NPU))]

        def project() -> None:
            for m in projected:
                m.project_()

        project.native_projection = model  # every layer's W_RANGE clamp, which the native step also does
        hooks["project"] = project
    if unit.clip_value is not None:
        hooks["clip_value"] = unit.clip_value
    inalus = [m for m in model.modules() if isinstance(m, nalu_cuda.INALU)]
    if unit.reinit:
        if seeds is None:
            raise ValueError(f"training_hooks: model {model.model!r} re-initialises stalled members and needs 'seeds'")

        def reinit(members: List[int], step: int) -> None:
            gens = member_generators([seeds[e] for e in members], f"reinit-{step}")
            for e, gen in zip(members, gens):
                for m in inalus:
                    R.inalu_reinitialize_(m, [e], generator=gen)

        hooks["reinit"] = reinit
    if unit.rmsprop:
        parts = {"weights": [p for m in inalus for p in (m.W_hat, m.M_hat, m.W_hat_m, m.M_hat_m)],
                 "gate": [m.G for m in inalus]}
        hooks["optimizer"] = functools.partial(FlatRMSProp, parts=parts, alternate=INALU_ALTERNATE)
        hooks["regularizer_steps"] = ("weights", "gate")
    return hooks


# iNALU's published runs: of every 10 steps, the first 8 update the weights and the last 2 the gate.
INALU_ALTERNATE = (8, 10, "weights", "gate")


def default_lr(model: str, adam_lr: float) -> float:
    """The learning rate ``model`` trains with when none is given: its own optimiser's published
    one (iNALU's RMSProp: 1e-2), else the task's Adam default ``adam_lr``."""
    unit = ARITHMETIC_UNITS.get(model)
    return unit.lr if unit is not None and unit.lr is not None else adam_lr


def regularizer_schedule(model: str, reg: Optional[Dict[str, Optional[float]]] = None) -> Optional[Schedule]:
    """The model's regulariser schedule: the published one, with any of ``reg``'s ``scale``,
    ``start``, ``end`` that are not None in its place; None for a model without a regulariser."""
    unit = ARITHMETIC_UNITS.get(model)
    if unit is None or unit.schedule is None:
        if reg and any(v is not None for v in reg.values()):
            raise ValueError(f"model {model!r} has no regulariser: --reg-scale/--reg-start/--reg-end apply to "
                             f"{', '.join(m for m, u in ARITHMETIC_UNITS.items() if u.schedule is not None)}")
        return None
    base = unit.schedule
    over = {k: v for k, v in (reg or {}).items() if v is not None}
    if not over:
        return base
    return dataclasses.replace(base, **{k: float(v) for k, v in over.items()})


def check_model(name: str, allowed: Sequence[str]) -> str:
    key = str(name).strip().lower().replace("_", "-")
    key = MODEL_ALIASES.get(key, key)
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


class StepCell(GatedCell):
    """The recurrent task's LSTM or GRU cell: both projections with bias, PyTorch's gate equations,
    one step at a time with an explicit state (``(h, c)`` for the LSTM)."""

    H2H_BIAS = True
    # the published streams draw, per member, W_x, W_h, then b_x, b_h
    INIT_ORDER = ("x2h.weight", "h2h.weight", "x2h.bias", "h2h.bias")

    def __init__(self, kind: str, input_size: int, hidden: int, ensemble: Optional[int]):
        self.kind, self.GATES = kind, (4 if kind == "lstm" else 3)
        super().__init__(input_size, hidden, ensemble=ensemble)

    def forward(self, x: Tensor, state):
        H = self.hidden_size
        if self.kind == "lstm":
            h, c = state
            z = self.x2h(x) + self.h2h(h)
            i, f, g, o = z.split(H, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            return h, (h, c)
        h = state
        rx, ux, nx = self.x2h(x).split(H, dim=-1)
        rh, uh, nh = self.h2h(h).split(H, dim=-1)
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
        self.h0 = nn.Parameter(torch.zeros(*lead_shape(ensemble), n_states, hidden))
        if self.model in ("lstm", "gru"):
            self.cell = StepCell(self.model, input_size, hidden, ensemble)
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
    """The effective weights of every arithmetic layer: ``W`` (and ``W_m`` of separate NALUs and
    iNALUs) of the NAC family, ``W`` of NAU/NMU, ``W_r`` (and ``W_i``) of the power units. The
    tanh * sigmoid weights are computed one member at a time: a member's weights are then the same
    bits whatever its ensemble's size (ATen computes the last elements of a tensor in scalar code,
    whose tanh and sigmoid round differently)."""
    out = []
    for m in module.modules():
        if isinstance(m, (nalu_cuda.NAC, nalu_cuda.NACMul, nalu_cuda.NALU, nalu_cuda.INALU)):
            out.append(_member_wise(m.W_hat, m.M_hat))
            if isinstance(m, nalu_cuda.INALU) or (isinstance(m, nalu_cuda.NALU) and not m.tied):
                out.append(_member_wise(m.W_hat_m, m.M_hat_m))
        elif isinstance(m, (nalu_cuda.NAU, nalu_cuda.NMU)):
            out.append(m.W)
        elif isinstance(m, nalu_cuda.NPU):
            out += [w for w in (m.W_r, m.W_i) if w is not None]
    return out


def _member_wise(W_hat: Tensor, M_hat: Tensor) -> Tensor:
    if W_hat.dim() < 3:
        return reference.nac_weight(W_hat, M_hat)
    return torch.stack([reference.nac_weight(w, m) for w, m in zip(W_hat, M_hat)])


@torch.no_grad()
def sparsity_error(module: nn.Module, ensemble: Optional[int]) -> Optional[Tensor]:
    """Madsen's sparsity error (:func:`nalu_cuda.regularizers.sparsity_error`) over the arithmetic
    layers, per member ``(E,)`` (``(1,)`` for a plain model); None for MLPs."""
    ws = arithmetic_weights(module)
    if not ws:
        return None
    return R.sparsity_error(ws, ensemble=ensemble is not None).reshape(-1)


def resident_graph(p, device: torch.device, hooks: Dict[str, Any], lr_milestones: Sequence[float] = ()) -> bool:
    """Whether a task's resident step runs as a CUDA graph: ``--stream counter`` on CUDA, graphs not
    turned off, and nothing the host must decide per step (a regulariser schedule, a
    re-initialisation, learning-rate milestones)."""
    return (p.stream == "counter" and p.graph and device.type == "cuda" and not lr_milestones
            and "regularizer" not in hooks and "reinit" not in hooks)
