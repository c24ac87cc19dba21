"""Coming from another NALU implementation: state-dict converters and a stable-nalu unit.

This library stores weights ``(in, out)`` (``y = x W``); the codebases below store them
``(out, in)`` (``nn.Linear``'s layout, ``y = x W^T``), under other names. Each converter maps one
layer's state dict (keys under ``prefix``, e.g. ``"model.0."`` for layer 0 of their stacks) to
the state dict of a :class:`~nalu_cuda.NAC` or :class:`~nalu_cuda.NALU` and back; every matrix is
transposed, every vector copied. A NALU is recognised by its gate, a NAC by its absence.
Anything with no counterpart here raises a ValueError that names it. The forward formulas are the
same (``W = tanh(W_hat) sigmoid(M_hat)``, ``g = sigmoid(x G^T [+ b])``,
``y = g a + (1 - g) exp(log(|x| + eps) W_m)``); give the layer their ``eps``. Each converter takes
a state dict or the module itself (their checkpoints are pickled modules:
``torch.load(path, weights_only=False)``, then pass it or its ``.state_dict()``).

Loading their state dict without a converter is refused, as it would transpose silently (the names
are the same; a square layer even loads "All keys matched"). A nalu_cuda layer writes
``{"nalu_cuda": "(in, out)", "nalu_cuda_layer": <class>}`` into its entry of ``state_dict._metadata``
(which ``torch.save`` / ``torch.load(weights_only=True)`` keep), and its ``load_state_dict`` refuses,
with a RuntimeError that names these converters, strict or not:

* a state dict whose entry for the layer was written by another module class (``version`` and no
  mark: what ``their_module.state_dict()`` gives), or marked ``(out, in)`` (what :func:`to_kevinzakka`,
  :func:`to_stable_nalu` and :func:`to_linear_layout` return);
* a state dict without metadata (built by hand, copied key by key: ``{k: v.clone() for ...}``) whose
  matrices have the layer's shape transposed. One without metadata and with the layer's shapes loads:
  nothing says whose it is, and torch's own copies, ``torch.distributed.checkpoint`` and key-by-key
  copies (best-state snapshots) write such dicts of our weights; a square one of theirs built by hand
  is the case no check can catch.

:func:`from_kevinzakka`, :func:`from_stable_nalu` and :func:`from_linear_layout` mark their output as
ours; :func:`mark_nalu_cuda` declares a state dict ours by hand (one saved by a nalu_cuda version that
did not mark, or whose metadata came from another module). The other direction cannot be guarded:
their code loads our ``layer.state_dict()`` (under a NAC's names) without a word, transposed; use the
``to_*`` converters. A :class:`~nalu_cuda.NACMul` has no counterpart in either codebase and is refused.

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

from collections import OrderedDict
from typing import Dict, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .modules import (FOREIGN_LAYOUT, LAYOUT, NAC, NALU, STATE_DICT_KIND, STATE_DICT_MARK, _ArithmeticLayer,
                      _layer_kind)
from .reference import DEFAULT_EPS

__all__ = [
    "from_kevinzakka", "to_kevinzakka", "from_stable_nalu", "to_stable_nalu",
    "from_linear_layout", "to_linear_layout", "mark_nalu_cuda", "StableNALULayer", "StableNACLayer",
    "stable_nalu_units",
]

StateDict = Dict[str, Tensor]


def _t(v: Tensor) -> Tensor:
    """(…, a, b) -> (…, b, a), contiguous; vectors are copied as they are."""
    return v.transpose(-1, -2).contiguous() if v.dim() >= 2 else v.clone()


def _fail(fn: str, msg: str):
    raise ValueError(f"nalu_cuda.compat.{fn}: {msg}")


# ------------------------------------------------------------------------------------------------
# State-dict metadata (see nalu_cuda.modules.STATE_DICT_MARK): what says whose layout a dict holds
# ------------------------------------------------------------------------------------------------


def _module_prefixes(keys: Iterable[str]) -> set:
    """Every module prefix (as torch writes it in ``_metadata``: no trailing dot) the keys imply."""
    out = {""}
    for k in keys:
        parts = k.split(".")[:-1]
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def _stamped(sd: Mapping[str, Tensor], entry: dict, base: Optional[Mapping] = None) -> "OrderedDict[str, Tensor]":
    """``sd`` as an OrderedDict (same tensors) whose ``_metadata`` is ``base``'s, with ``entry`` added
    to every module prefix its keys imply."""
    out = OrderedDict(sd)
    meta = OrderedDict((k, dict(v)) for k, v in (getattr(base, "_metadata", None) or {}).items())
    for p in sorted(_module_prefixes(out)):
        meta.setdefault(p, {}).update(entry)
    out._metadata = meta  # type: ignore[attr-defined]
    return out


def _local_metadata(state_dict, prefix: str = "") -> dict:
    return (getattr(state_dict, "_metadata", None) or {}).get(prefix[:-1] if prefix else "", {})


def mark_nalu_cuda(state_dict: Union[Mapping[str, Tensor], nn.Module]) -> "OrderedDict[str, Tensor]":
    """Declares ``state_dict`` to hold nalu_cuda weights (``(in, out)``), so that nalu_cuda layers load it.

    A nalu_cuda layer refuses a state dict whose metadata says another module class wrote it (what
    ``their_module.state_dict()`` carries: their weights are ``(out, in)`` under the same names), or
    that :func:`to_kevinzakka`, :func:`to_stable_nalu` or :func:`to_linear_layout` wrote. Use this for
    one that really is ours: saved by a nalu_cuda version that did not mark its state dicts, or whose
    metadata was copied from another module. A state dict from a nalu_cuda layer's ``state_dict()``,
    and the output of :func:`from_kevinzakka`, :func:`from_stable_nalu` and :func:`from_linear_layout`,
    are marked already. Returns a new OrderedDict (the same tensors) whose ``_metadata`` marks every
    module prefix of its keys; the other metadata (``version``) is kept."""
    sd = _state_dict("mark_nalu_cuda", state_dict)
    return _stamped(sd, {STATE_DICT_MARK: LAYOUT}, base=sd)


def _ours_out(sd: Mapping[str, Tensor], kind: Optional[str]) -> "OrderedDict[str, Tensor]":
    entry = {"version": NAC._version, STATE_DICT_MARK: LAYOUT}
    if kind:
        entry[STATE_DICT_KIND] = kind
    return _stamped(sd, entry)


def _theirs_out(sd: Mapping[str, Tensor], kind: Optional[str] = None) -> "OrderedDict[str, Tensor]":
    """What a to_* converter returns: marked ``(out, in)``, so that loading it back into a nalu_cuda
    layer is refused (``version`` 1: what their modules write)."""
    entry = {"version": 1, STATE_DICT_MARK: FOREIGN_LAYOUT}
    if kind:
        entry[STATE_DICT_KIND] = kind
    return _stamped(sd, entry)


# ------------------------------------------------------------------------------------------------
# Argument checks
# ------------------------------------------------------------------------------------------------


def _state_dict(fn: str, obj) -> Mapping[str, Tensor]:
    """A state dict, from a state dict or a module (``obj.state_dict()``)."""
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if not isinstance(obj, Mapping):
        _fail(fn, f"expected a state dict (a mapping of names to tensors) or an nn.Module, got "
                  f"{type(obj).__name__}")
    for k, v in obj.items():
        if not isinstance(v, Tensor):
            wrapped = (f": a checkpoint that wraps the state dict? pass checkpoint[{k!r}]"
                       if isinstance(v, Mapping) else "")
            _fail(fn, f"key {k!r} holds a {type(v).__name__}, not a tensor{wrapped}")
    return obj


def _layer_prefixes(keys: Iterable[str], leaves: Sequence[str]) -> list:
    """The prefixes under which ``keys`` hold one layer's ``leaves`` (e.g. 'model.0.' for
    'model.0.nac.W_hat'), sorted."""
    leaves = sorted(leaves, key=len, reverse=True)
    out = set()
    for k in keys:
        for leaf in leaves:
            if k == leaf or k.endswith("." + leaf):
                out.add(k[: len(k) - len(leaf)])
                break
    return sorted(out, key=lambda p: [int(t) if t.isdigit() else t for t in p.split(".")])


def _prefix_hint(keys: Iterable[str], prefix: str, leaves: Sequence[str]) -> str:
    found = _layer_prefixes(keys, leaves)
    if not found or prefix in found:
        return ""
    shown = ", ".join(repr(p) for p in found[:6]) + (", ..." if len(found) > 6 else "")
    pick = next((p for p in found if p != prefix), found[0])
    return (f"; the keys hold layers under the prefixes {shown}: pass prefix={pick!r} "
            f"(one layer at a time), not prefix={prefix!r}")


def _take(fn: str, sd: Mapping[str, Tensor], prefix: str, leaves: Sequence[str]) -> StateDict:
    out = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not out:
        _fail(fn, f"no key starts with prefix {prefix!r} (keys: {sorted(sd)[:8]})" + _prefix_hint(sd, prefix, leaves))
    if _local_metadata(sd, prefix).get(STATE_DICT_MARK) == LAYOUT:
        _fail(fn, f"the state dict{f' under {prefix!r}' if prefix else ''} was written by a nalu_cuda layer: it is "
                  "in nalu_cuda's (in, out) layout already; load it as it is (the to_* converters go from ours "
                  "to theirs)")
    return out


def _check_plain(fn: str, ours: Mapping[str, Tensor]) -> None:
    if ours["W_hat"].dim() != 2:
        _fail(fn, f"'W_hat' has shape {list(ours['W_hat'].shape)}: an ensemble state dict has no counterpart in "
                  "that codebase; convert one member: {k: v[e] for k, v in state_dict.items()}")


def _unexpected(fn: str, keys, known, what: str, hint: str = "") -> None:
    extra = sorted(set(keys) - set(known))
    if extra:
        _fail(fn, f"keys with no counterpart in {what}: {extra}{hint}")


def _need(fn: str, sd: Mapping[str, Tensor], needed: Sequence[str], what: str, hint: str = "") -> None:
    missing = [k for k in needed if k not in sd]
    if missing:
        _fail(fn, f"missing key(s) {missing} ({what} has {list(needed)}; keys: {sorted(sd)[:8]}){hint}")


_OUR_KEYS = ("W_hat", "M_hat", "W_hat_m", "M_hat_m", "G", "G_bias")


def _ours(fn: str, state_dict, peer: str) -> StateDict:
    """One nalu_cuda NAC/NALU state dict (or the layer) bound for ``peer``; what has no counterpart
    there is refused."""
    if isinstance(state_dict, nn.Module):
        kind = _layer_kind(state_dict) if isinstance(state_dict, _ArithmeticLayer) else None
        meta = {}
    else:
        meta = _local_metadata(state_dict)
        kind = meta.get(STATE_DICT_KIND)
    if meta.get(STATE_DICT_MARK) == FOREIGN_LAYOUT:
        _fail(fn, "the state dict is marked (out, in): it was written by a nalu_cuda.compat.to_* converter, "
                  "and is in another codebase's layout already")
    if kind == "NACMul":
        mul = {"kevinzakka/NALU-pytorch": "it has only NAC and NALU",
               "stable-nalu": "its MNAC computes prod(x W + 1 - W), not exp(log(|x| + eps) W)"}[peer]
        _fail(fn, "a NACMul (multiplicative NAC: y = exp(log(|x| + eps) W)) has no counterpart in "
                  f"{peer} ({mul}); its state dict has a NAC's keys, and would convert into an additive NAC")
    if kind is not None and kind not in ("NAC", "NALU"):
        _fail(fn, f"a {kind} has no counterpart in {peer}: only NAC and NALU convert")
    sd = dict(_state_dict(fn, state_dict))
    found = [p for p in _layer_prefixes(sd, _OUR_KEYS) if p]
    hint = ""
    if found:
        shown = ", ".join(repr(p) for p in found[:6]) + (", ..." if len(found) > 6 else "")
        hint = (f"; the keys hold layers under the prefixes {shown}: pass one layer (the layer itself, or "
                f"net[i].state_dict()); prefix= is where its keys go in their model")
    _unexpected(fn, sd, _OUR_KEYS, "a nalu_cuda NAC/NALU", hint)
    _need(fn, sd, ("W_hat", "M_hat"), "a NAC or NALU state dict")
    _check_plain(fn, sd)
    return sd


# ------------------------------------------------------------------------------------------------
# kevinzakka/NALU-pytorch
# ------------------------------------------------------------------------------------------------


_KZ_NAC = ("W_hat", "M_hat")
_KZ_NALU = ("G", "nac.W_hat", "nac.M_hat")


def from_kevinzakka(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """A ``NeuralAccumulatorCell`` or ``NeuralArithmeticLogicUnitCell`` state dict (or the module, or a
    whole model's state dict with ``prefix`` naming the layer) -> ours (load it into ``NAC(in, out)``
    or ``NALU(in, out, eps=1e-10)``). The result is marked as nalu_cuda's (:func:`mark_nalu_cuda`)."""
    fn = "from_kevinzakka"
    full = _state_dict(fn, state_dict)
    hint = _prefix_hint(full, prefix, _KZ_NALU + _KZ_NAC)
    sd = _take(fn, full, prefix, _KZ_NALU + _KZ_NAC)
    if "G" in sd:
        _unexpected(fn, sd, _KZ_NALU, "a nalu_cuda NALU (tied weights, input gate, no bias)", hint)
        _need(fn, sd, _KZ_NALU, "their NALU cell", hint)
        return _ours_out({"W_hat": _t(sd["nac.W_hat"]), "M_hat": _t(sd["nac.M_hat"]), "G": _t(sd["G"])}, "NALU")
    _unexpected(fn, sd, _KZ_NAC, "a nalu_cuda NAC (no bias)", hint)
    _need(fn, sd, _KZ_NAC, "their NAC cell", hint)
    return _ours_out({"W_hat": _t(sd["W_hat"]), "M_hat": _t(sd["M_hat"])}, "NAC")


def to_kevinzakka(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """Ours (a plain NAC, or a NALU with tied weights, an input gate and no gate bias; its state dict or
    the layer) -> theirs. A NACMul is refused (they have no multiplicative NAC). The result is marked
    ``(out, in)``: a nalu_cuda layer refuses to load it."""
    fn = "to_kevinzakka"
    sd = _ours(fn, state_dict, "kevinzakka/NALU-pytorch")
    if "W_hat_m" in sd:
        _fail(fn, "'W_hat_m', 'M_hat_m' (separate multiplicative weights) have no counterpart: their NALU ties one NAC")
    if "G_bias" in sd:
        _fail(fn, "'G_bias' (a gate bias) has no counterpart: their gate has none")
    if "G" not in sd:
        return _theirs_out({prefix + "W_hat": _t(sd["W_hat"]), prefix + "M_hat": _t(sd["M_hat"])})
    if sd["G"].dim() != 2:
        _fail(fn, f"'G' has shape {list(sd['G'].shape)} (an input-independent gate): their gate is sigmoid(x G^T)")
    return _theirs_out({prefix + "G": _t(sd["G"]), prefix + "nac.W_hat": _t(sd["W_hat"]),
                        prefix + "nac.M_hat": _t(sd["M_hat"])})


# ------------------------------------------------------------------------------------------------
# AndreasMadsen/stable-nalu
# ------------------------------------------------------------------------------------------------


_SN_NAC = ("W_hat", "M_hat")
_SN_NALU = ("G_add", "bias_add", "nac_add.W_hat", "nac_add.M_hat", "nac_mul.W_hat", "nac_mul.M_hat")


def from_stable_nalu(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """A stable-nalu ``NACLayer`` or ``NALULayer`` state dict (or the module, or a whole model's state
    dict with ``prefix`` naming the layer) -> ours (load it into ``NAC(in, out)`` or
    ``NALU(in, out, tied=not nalu_two_nac, gate_bias=nalu_bias)``). The result is marked as
    nalu_cuda's (:func:`mark_nalu_cuda`)."""
    fn = "from_stable_nalu"
    full = _state_dict(fn, state_dict)
    leaves = _SN_NALU + ("G_mul", "bias_mul") + _KZ_NALU + _SN_NAC
    hint = _prefix_hint(full, prefix, leaves)
    sd = _take(fn, full, prefix, leaves)
    if "G_mul" in sd or "bias_mul" in sd:
        _fail(fn, "'G_mul' / 'bias_mul' (nalu_two_gate=True: a second gate for the multiplicative path) have "
                  "no counterpart: here the multiplicative path's weight is 1 - g")
    if "nac_mul.W_hat" in sd and "nac_mul.M_hat" not in sd:
        _fail(fn, "'nac_mul.W_hat' without 'nac_mul.M_hat' (nalu_mul='mnac': an MNAC multiplicative path) has no "
                  "counterpart: here the multiplicative path is exp(log(|x| + eps) W_m)")
    if "G_add" not in sd:
        if "G" in sd:  # their first NALULayer: the layout of kevinzakka's
            return from_kevinzakka(sd)
        _unexpected(fn, sd, _SN_NAC, "a nalu_cuda NAC (no bias)", hint)
        _need(fn, sd, _SN_NAC, "their NACLayer", hint)
        return _ours_out({"W_hat": _t(sd["W_hat"]), "M_hat": _t(sd["M_hat"])}, "NAC")
    _unexpected(fn, sd, _SN_NALU, "a nalu_cuda NALU", hint)
    _need(fn, sd, ("G_add", "nac_add.W_hat", "nac_add.M_hat"), "their NALULayer", hint)
    if "nac_mul.M_hat" in sd and "nac_mul.W_hat" not in sd:
        _need(fn, sd, ("nac_mul.W_hat", "nac_mul.M_hat"), "their NALULayer with nalu_two_nac=True", hint)
    out = {"W_hat": _t(sd["nac_add.W_hat"]), "M_hat": _t(sd["nac_add.M_hat"])}
    if "nac_mul.W_hat" in sd:
        out["W_hat_m"], out["M_hat_m"] = _t(sd["nac_mul.W_hat"]), _t(sd["nac_mul.M_hat"])
    out["G"] = _t(sd["G_add"])
    if "bias_add" in sd:
        out["G_bias"] = sd["bias_add"].clone()
    return _ours_out(out, "NALU")


def to_stable_nalu(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """Ours (a NAC or NALU: its state dict or the layer) -> stable-nalu's (``NACLayer``; ``NALULayer``
    with ``nalu_two_nac`` = separate weights and ``nalu_bias`` = a gate bias). A NACMul is refused
    (their MNAC has another formula). The result is marked ``(out, in)``: a nalu_cuda layer refuses
    to load it."""
    fn = "to_stable_nalu"
    sd = _ours(fn, state_dict, "stable-nalu")
    if "G" not in sd:
        return _theirs_out({prefix + "W_hat": _t(sd["W_hat"]), prefix + "M_hat": _t(sd["M_hat"])})
    if sd["G"].dim() != 2:
        _fail(fn, f"'G' has shape {list(sd['G'].shape)} (an input-independent gate): their gate is sigmoid(x G^T + b)")
    out = {prefix + "nac_add.W_hat": _t(sd["W_hat"]), prefix + "nac_add.M_hat": _t(sd["M_hat"])}
    if "W_hat_m" in sd:
        out[prefix + "nac_mul.W_hat"], out[prefix + "nac_mul.M_hat"] = _t(sd["W_hat_m"]), _t(sd["M_hat_m"])
    out[prefix + "G_add"] = _t(sd["G"])
    if "G_bias" in sd:
        out[prefix + "bias_add"] = sd["G_bias"].clone()
    return _theirs_out(out)


# ------------------------------------------------------------------------------------------------
# nn.Linear layout
# ------------------------------------------------------------------------------------------------


def to_linear_layout(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """Our keys, every matrix ``(in, out)`` -> ``(out, in)`` (ensembles: ``(E, in, out)`` -> ``(E, out, in)``).
    Vectors (``G`` of an independent gate, ``G_bias``) are copied. The result is marked ``(out, in)``:
    a nalu_cuda layer refuses to load it (:func:`from_linear_layout` converts it back)."""
    fn = "to_linear_layout"
    kind = (_layer_kind(state_dict) if isinstance(state_dict, _ArithmeticLayer)
            else _local_metadata(state_dict).get(STATE_DICT_KIND))
    sd = dict(_state_dict(fn, state_dict))
    _unexpected(fn, sd, _OUR_KEYS, "this library")
    _need(fn, sd, ("W_hat",), "a NAC, NACMul or NALU state dict")
    vectors = {"G_bias"} | ({"G"} if "G" in sd and sd["G"].dim() == sd["W_hat"].dim() - 1 else set())
    return _theirs_out({prefix + k: (v.clone() if k in vectors else _t(v)) for k, v in sd.items()}, kind)


def from_linear_layout(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """The inverse of :func:`to_linear_layout`; the result is marked as nalu_cuda's."""
    fn = "from_linear_layout"
    full = _state_dict(fn, state_dict)
    hint = _prefix_hint(full, prefix, _OUR_KEYS)
    sd = _take(fn, full, prefix, _OUR_KEYS)
    _unexpected(fn, sd, _OUR_KEYS, "this library", hint)
    _need(fn, sd, ("W_hat",), "a NAC, NACMul or NALU state dict", hint)
    vectors = {"G_bias"} | ({"G"} if "G" in sd and sd["G"].dim() == sd["W_hat"].dim() - 1 else set())
    kind = _local_metadata(full, prefix).get(STATE_DICT_KIND)
    return _ours_out({k: (v.clone() if k in vectors else _t(v)) for k, v in sd.items()}, kind)


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
