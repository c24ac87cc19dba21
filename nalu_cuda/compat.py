"""Coming from another NALU implementation: state-dict converters and a stable-nalu unit.

This library stores weights ``(in, out)`` (``y = x W``); the codebases below store them
``(out, in)`` (``nn.Linear``'s layout, ``y = x W^T``), under other names. Each converter maps one
layer's state dict (keys under ``prefix``, e.g. ``"model.0."`` for layer 0 of their stacks) to
the state dict of a :class:`~nalu_cuda.NAC` or :class:`~nalu_cuda.NALU` and back; every matrix is
transposed, every vector copied. A NALU is recognised by its gate, a NAC by its absence.
Anything with no counterpart here raises a ValueError that names it. The forward formulas are the
same (``W = tanh(W_hat) sigmoid(M_hat)``, ``g = sigmoid(x G^T [+ b])``,
``y = g a + (1 - g) exp(log(|x| + eps) W_m)``); give the layer their ``eps``.

kevinzakka/NALU-pytorch (``models/nac.py``, ``models/nalu.py``; eps 1e-10; no gate bias)
    ==========================  ==================  ===============================
    theirs                      ours                shape (theirs -> ours)
    ==========================  ==================  ===============================
    ``W_hat`` / ``M_hat``       ``W_hat`` / ``M_hat``  NAC cell, (out, in) -> (in, out)
    ``nac.W_hat`` / ``nac.M_hat`` ``W_hat`` / ``M_hat``  NALU cell, (out, in) -> (in, out)
    ``G``                       ``G``               (out, in) -> (in, out)
    ==========================  ==================  ===============================

    The same keys are those of stable-nalu's first ``NALULayer`` (``stable_nalu/layer/nalu.py``
    before its ``AbstractNALULayer``): :func:`from_kevinzakka` reads those too.

AndreasMadsen/stable-nalu (``stable_nalu/layer/_abstract_nalu.py``, ``nac.py``; eps 1e-7)
    =================================  ==========================  ==============================
    theirs                             ours                        note
    =================================  ==========================  ==============================
    ``W_hat`` / ``M_hat`` (NACLayer)   ``W_hat`` / ``M_hat``       (out, in) -> (in, out)
    ``nac_add.W_hat`` / ``.M_hat``     ``W_hat`` / ``M_hat``       (out, in) -> (in, out)
    ``nac_mul.W_hat`` / ``.M_hat``     ``W_hat_m`` / ``M_hat_m``   ``nalu_two_nac=True``: ``tied=False``
    ``G_add``                          ``G``                       (out, in) -> (in, out)
    ``bias_add``                       ``G_bias``                  ``nalu_bias=True``: ``gate_bias=True``
    ``G_mul``, ``bias_mul``            none                        ``nalu_two_gate=True``: refused
    ``nac_mul.W_hat`` without M_hat    none                        ``nalu_mul='mnac'``: refused
    =================================  ==========================  ==============================

    Their ``nalu_mul`` ('safe', 'trig') and ``nalu_gate`` ('gumbel', ...) options leave no trace in
    a state dict: a checkpoint trained with them converts, but computes another function here.

``nn.Linear`` layout (:func:`to_linear_layout`, :func:`from_linear_layout`)
    Our own keys with every matrix transposed to ``(out, in)`` (``(E, out, in)`` for an
    ensemble); for code that multiplies ``F.linear(x, W)``.

:class:`StableNALULayer` and :class:`StableNACLayer` take stable-nalu's constructor arguments, so
they register as units there. stable-nalu collects regularisers (and ``optimize``, ``set_parameter``)
only from children that are its ``ExtendedTorchModule``: :func:`stable_nalu_units` makes classes that
are, so that a registered unit's gate regulariser reaches the loss::

    from stable_nalu.abstract import ExtendedTorchModule
    from stable_nalu.layer.generalized import unit_name_to_layer_class
    NACLayer, NALULayer = nalu_cuda.compat.stable_nalu_units(ExtendedTorchModule)
    unit_name_to_layer_class.update(NAC=NACLayer, NALU=NALULayer)
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
from torch import Tensor

from .modules import NAC, NALU
from .reference import DEFAULT_EPS

__all__ = [
    "from_kevinzakka", "to_kevinzakka", "from_stable_nalu", "to_stable_nalu",
    "from_linear_layout", "to_linear_layout", "StableNALULayer", "StableNACLayer", "stable_nalu_units",
]

StateDict = Dict[str, Tensor]


def _t(v: Tensor) -> Tensor:
    """(…, a, b) -> (…, b, a), contiguous; vectors are copied as they are."""
    return v.transpose(-1, -2).contiguous() if v.dim() >= 2 else v.clone()


def _fail(fn: str, msg: str):
    raise ValueError(f"nalu_cuda.compat.{fn}: {msg}")


def _take(fn: str, sd: Mapping[str, Tensor], prefix: str) -> StateDict:
    out = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not out:
        _fail(fn, f"no key starts with prefix {prefix!r} (keys: {sorted(sd)[:8]})")
    return out


def _check_plain(fn: str, ours: Mapping[str, Tensor]) -> None:
    if ours["W_hat"].dim() != 2:
        _fail(fn, f"'W_hat' has shape {list(ours['W_hat'].shape)}: an ensemble state dict has no counterpart in "
                  "that codebase; convert one member: {k: v[e] for k, v in state_dict.items()}")


def _unexpected(fn: str, keys, known, what: str) -> None:
    extra = sorted(set(keys) - set(known))
    if extra:
        _fail(fn, f"keys with no counterpart in {what}: {extra}")


def _ours(fn: str, state_dict: Mapping[str, Tensor]) -> StateDict:
    sd = dict(state_dict)
    _unexpected(fn, sd, ("W_hat", "M_hat", "W_hat_m", "M_hat_m", "G", "G_bias"), "a nalu_cuda NAC/NALU")
    for k in ("W_hat", "M_hat"):
        if k not in sd:
            _fail(fn, f"missing key {k!r} (a NAC or NALU state dict has 'W_hat', 'M_hat')")
    _check_plain(fn, sd)
    return sd


# ------------------------------------------------------------------------------------------------
# kevinzakka/NALU-pytorch
# ------------------------------------------------------------------------------------------------


def from_kevinzakka(state_dict: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """A ``NeuralAccumulatorCell`` or ``NeuralArithmeticLogicUnitCell`` state dict -> ours
    (load it into ``NAC(in, out)`` or ``NALU(in, out, eps=1e-10)``)."""
    fn = "from_kevinzakka"
    sd = _take(fn, state_dict, prefix)
    if "G" in sd:
        _unexpected(fn, sd, ("G", "nac.W_hat", "nac.M_hat"), "a nalu_cuda NALU (tied weights, input gate, no bias)")
        return {"W_hat": _t(sd["nac.W_hat"]), "M_hat": _t(sd["nac.M_hat"]), "G": _t(sd["G"])}
    _unexpected(fn, sd, ("W_hat", "M_hat"), "a nalu_cuda NAC (no bias)")
    return {"W_hat": _t(sd["W_hat"]), "M_hat": _t(sd["M_hat"])}


def to_kevinzakka(state_dict: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """Ours (a plain NAC, or a NALU with tied weights, an input gate and no gate bias) -> theirs."""
    fn = "to_kevinzakka"
    sd = _ours(fn, state_dict)
    if "W_hat_m" in sd:
        _fail(fn, "'W_hat_m', 'M_hat_m' (separate multiplicative weights) have no counterpart: their NALU ties one NAC")
    if "G_bias" in sd:
        _fail(fn, "'G_bias' (a gate bias) has no counterpart: their gate has none")
    if "G" not in sd:
        return {prefix + "W_hat": _t(sd["W_hat"]), prefix + "M_hat": _t(sd["M_hat"])}
    if sd["G"].dim() != 2:
        _fail(fn, f"'G' has shape {list(sd['G'].shape)} (an input-independent gate): their gate is sigmoid(x G^T)")
    return {prefix + "G": _t(sd["G"]), prefix + "nac.W_hat": _t(sd["W_hat"]), prefix + "nac.M_hat": _t(sd["M_hat"])}


# ------------------------------------------------------------------------------------------------
# AndreasMadsen/stable-nalu
# ------------------------------------------------------------------------------------------------


def from_stable_nalu(state_dict: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """A stable-nalu ``NACLayer`` or ``NALULayer`` state dict -> ours (load it into ``NAC(in, out)``
    or ``NALU(in, out, tied=not nalu_two_nac, gate_bias=nalu_bias)``)."""
    fn = "from_stable_nalu"
    sd = _take(fn, state_dict, prefix)
    if "G_mul" in sd or "bias_mul" in sd:
        _fail(fn, "'G_mul' / 'bias_mul' (nalu_two_gate=True: a second gate for the multiplicative path) have "
                  "no counterpart: here the multiplicative path's weight is 1 - g")
    if "nac_mul.W_hat" in sd and "nac_mul.M_hat" not in sd:
        _fail(fn, "'nac_mul.W_hat' without 'nac_mul.M_hat' (nalu_mul='mnac': an MNAC multiplicative path) has no "
                  "counterpart: here the multiplicative path is exp(log(|x| + eps) W_m)")
    if "G_add" not in sd:
        if "G" in sd:  # their first NALULayer: the layout of kevinzakka's
            return from_kevinzakka(sd)
        _unexpected(fn, sd, ("W_hat", "M_hat"), "a nalu_cuda NAC (no bias)")
        return {"W_hat": _t(sd["W_hat"]), "M_hat": _t(sd["M_hat"])}
    _unexpected(fn, sd, ("G_add", "bias_add", "nac_add.W_hat", "nac_add.M_hat", "nac_mul.W_hat", "nac_mul.M_hat"),
                "a nalu_cuda NALU")
    out = {"W_hat": _t(sd["nac_add.W_hat"]), "M_hat": _t(sd["nac_add.M_hat"])}
    if "nac_mul.W_hat" in sd:
        out["W_hat_m"], out["M_hat_m"] = _t(sd["nac_mul.W_hat"]), _t(sd["nac_mul.M_hat"])
    out["G"] = _t(sd["G_add"])
    if "bias_add" in sd:
        out["G_bias"] = sd["bias_add"].clone()
    return out


def to_stable_nalu(state_dict: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """Ours -> stable-nalu's (``NACLayer``; ``NALULayer`` with ``nalu_two_nac`` = separate weights and
    ``nalu_bias`` = a gate bias)."""
    fn = "to_stable_nalu"
    sd = _ours(fn, state_dict)
    if "G" not in sd:
        return {prefix + "W_hat": _t(sd["W_hat"]), prefix + "M_hat": _t(sd["M_hat"])}
    if sd["G"].dim() != 2:
        _fail(fn, f"'G' has shape {list(sd['G'].shape)} (an input-independent gate): their gate is sigmoid(x G^T + b)")
    out = {prefix + "nac_add.W_hat": _t(sd["W_hat"]), prefix + "nac_add.M_hat": _t(sd["M_hat"])}
    if "W_hat_m" in sd:
        out[prefix + "nac_mul.W_hat"], out[prefix + "nac_mul.M_hat"] = _t(sd["W_hat_m"]), _t(sd["M_hat_m"])
    out[prefix + "G_add"] = _t(sd["G"])
    if "G_bias" in sd:
        out[prefix + "bias_add"] = sd["G_bias"].clone()
    return out


# ------------------------------------------------------------------------------------------------
# nn.Linear layout
# ------------------------------------------------------------------------------------------------


def to_linear_layout(state_dict: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """Our keys, every matrix ``(in, out)`` -> ``(out, in)`` (ensembles: ``(E, in, out)`` -> ``(E, out, in)``).
    Vectors (``G`` of an independent gate, ``G_bias``) are copied."""
    sd = dict(state_dict)
    _unexpected("to_linear_layout", sd, ("W_hat", "M_hat", "W_hat_m", "M_hat_m", "G", "G_bias"), "this library")
    vectors = {"G_bias"} | ({"G"} if "G" in sd and sd["G"].dim() == sd["W_hat"].dim() - 1 else set())
    return {prefix + k: (v.clone() if k in vectors else _t(v)) for k, v in sd.items()}


def from_linear_layout(state_dict: Mapping[str, Tensor], prefix: str = "") -> StateDict:
    """The inverse of :func:`to_linear_layout`."""
    sd = _take("from_linear_layout", state_dict, prefix)
    _unexpected("from_linear_layout", sd, ("W_hat", "M_hat", "W_hat_m", "M_hat_m", "G", "G_bias"), "this library")
    vectors = {"G_bias"} | ({"G"} if "G" in sd and sd["G"].dim() == sd["W_hat"].dim() - 1 else set())
    return {k: (v.clone() if k in vectors else _t(v)) for k, v in sd.items()}


# ------------------------------------------------------------------------------------------------
# stable-nalu units
# ------------------------------------------------------------------------------------------------


class _StableUnit:
    """What stable-nalu's training loop calls on a unit (``ExtendedTorchModule``'s methods)."""

    def regualizer(self, merge_in: Optional[dict] = None) -> dict:
        return dict(merge_in or {})

    def optimize(self, loss) -> None:
        pass

    def log_gradients(self) -> None:
        pass

    def set_parameter(self, name: str, value) -> None:
        p = getattr(self, name, None)
        if isinstance(p, torch.nn.Parameter):
            with torch.no_grad():
                p.fill_(value)


class StableNACLayer(_StableUnit, NAC):
    """``NAC`` with stable-nalu's ``NACLayer(in_features, out_features, **kwargs)`` constructor.

    Every other keyword (``writer``, ``name``, ``regualizer_z``, ... : what stable-nalu passes to all
    units) is accepted and ignored. Parameters are drawn with ``init="stable-nalu-nac"`` when
    ``reset_parameters()`` is called, as theirs: the constructor leaves the global RNG untouched.
    """

    def __init__(self, in_features: int, out_features: int, *, init: str = "stable-nalu-nac",
                 backend: str = "auto", device=None, dtype=None, **ignored) -> None:
        with torch.random.fork_rng(devices=[]):
            super().__init__(in_features, out_features, init=init, backend=backend, device=device, dtype=dtype)


class StableNALULayer(_StableUnit, NALU):
    """``NALU`` with stable-nalu's ``NALULayer`` constructor and ``regualizer()``.

    ``nalu_two_nac`` -> ``tied=False``; ``nalu_bias`` -> ``gate_bias=True``;
    ``nalu_gate='regualized'`` -> ``regualizer()`` returns ``{'g': sum(g^2 (1 - g)^2)}`` over the
    last call's gate (kept with ``keep_parts``). Refused (ValueError): ``nalu_two_gate=True``,
    ``nalu_mul`` other than ``'normal'``, ``nalu_gate`` other than ``'normal'`` / ``'regualized'``.
    Every other keyword (``writer``, ``name``, ...) is accepted and ignored. As in
    :class:`StableNACLayer`, parameters are drawn by ``reset_parameters()`` with
    ``init="stable-nalu-nac"``, and construction leaves the global RNG untouched.
    """

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS, nalu_two_nac: bool = False,
                 nalu_two_gate: bool = False, nalu_bias: bool = False, nalu_mul: str = "normal",
                 nalu_gate: str = "normal", init: str = "stable-nalu-nac", backend: str = "auto", device=None,
                 dtype=None, **ignored) -> None:
        if nalu_two_gate:
            _fail("StableNALULayer", "nalu_two_gate=True (a second gate) has no counterpart here")
        if nalu_mul != "normal":
            _fail("StableNALULayer", f"nalu_mul={nalu_mul!r} has no counterpart here (only 'normal': "
                                     "exp(log(|x| + eps) W))")
        if nalu_gate not in ("normal", "regualized"):
            _fail("StableNALULayer", f"nalu_gate={nalu_gate!r} has no counterpart here (only 'normal', 'regualized')")
        with torch.random.fork_rng(devices=[]):
            super().__init__(in_features, out_features, eps=eps, tied=not nalu_two_nac, gate_bias=nalu_bias,
                             keep_parts=nalu_gate == "regualized", init=init, backend=backend, device=device,
                             dtype=dtype)
        self.nalu_gate = nalu_gate

    def regualizer(self, merge_in: Optional[dict] = None) -> dict:
        out = dict(merge_in or {})
        if self.nalu_gate == "regualized" and self.parts is not None:
            g = self.parts.g
            out["g"] = torch.sum(g ** 2 * (1 - g) ** 2)
        return out


def stable_nalu_units(base: type):
    """``(NACLayer, NALULayer)``: :class:`StableNACLayer` and :class:`StableNALULayer` that are also
    instances of ``base``, stable-nalu's ``ExtendedTorchModule`` (passed in: this library does not
    depend on stable-nalu). ``base.__init__(default_name, writer=..., name=...)`` runs with their
    ``writer`` and ``name``, so ``self.writer`` is their namespaced writer; parameters and state-dict
    keys are those of the plain classes. ``regualizer()`` returns a dict, as their recursion expects."""

    class _Base(base):
        # Reached through the modules' super().__init__(), which passes nothing: the arguments for
        # base were left on the instance by the constructor below.
        def __init__(self):
            default_name, writer, name = self.__dict__.pop("_stable_base_args")
            base.__init__(self, default_name, writer=writer, name=name)

    def unit(cls, default_name):
        def __init__(self, in_features, out_features, *, writer=None, name=None, **kwargs):
            object.__setattr__(self, "_stable_base_args", (default_name, writer, name))
            cls.__init__(self, in_features, out_features, **kwargs)

        return type(cls.__name__, (cls, _Base), {"__init__": __init__, "__module__": __name__,
                                                 "__qualname__": f"stable_nalu_units.<{cls.__name__}>"})

    return unit(StableNACLayer, "nac"), unit(StableNALULayer, "nalu")
