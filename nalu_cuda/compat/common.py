"""What the converters share: state-dict metadata (whose layout a dict holds), argument checks
with the messages that say what to do, the transpose, and the nn.Linear-layout converters."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, Mapping, Optional, Sequence, Union

from torch import Tensor, nn

from ..modules import FOREIGN_LAYOUT, LAYOUT, NAC, STATE_DICT_KIND, STATE_DICT_MARK, _ArithmeticLayer, _layer_kind



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
_UNIT_KEYS = ("W",)  # NAU, NMU
_ALL_KEYS = _OUR_KEYS + _UNIT_KEYS


def _ours(fn: str, state_dict, peer: str) -> StateDict:
    """One nalu_cuda NAC/NALU (NAU/NMU for stable-nalu) state dict (or the layer) bound for ``peer``;
    what has no counterpart there is refused."""
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
    units = ("NAU", "NMU") if peer == "stable-nalu" else ()
    if kind is not None and kind not in ("NAC", "NALU") + units:
        _fail(fn, f"a {kind} has no counterpart in {peer}: only {', '.join(('NAC', 'NALU') + units)} convert")
    sd = dict(_state_dict(fn, state_dict))
    found = [p for p in _layer_prefixes(sd, _ALL_KEYS) if p]
    hint = ""
    if found:
        shown = ", ".join(repr(p) for p in found[:6]) + (", ..." if len(found) > 6 else "")
        hint = (f"; the keys hold layers under the prefixes {shown}: pass one layer (the layer itself, or "
                f"net[i].state_dict()); prefix= is where its keys go in their model")
    if "W" in sd:
        if not units:
            _fail(fn, f"'W' (a NAU / NMU weight) has no counterpart in {peer}: it has only NAC and NALU")
        _unexpected(fn, sd, _UNIT_KEYS, "a nalu_cuda NAU / NMU", hint)
        if sd["W"].dim() != 2:
            _fail(fn, f"'W' has shape {list(sd['W'].shape)}: an ensemble state dict has no counterpart in that "
                      "codebase; convert one member: {k: v[e] for k, v in state_dict.items()}")
        return sd
    _unexpected(fn, sd, _OUR_KEYS, "a nalu_cuda NAC/NALU", hint)
    _need(fn, sd, ("W_hat", "M_hat"), "a NAC or NALU state dict")
    _check_plain(fn, sd)
    return sd



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
    _unexpected(fn, sd, _ALL_KEYS, "this library")
    _need(fn, sd, ("W" if "W" in sd else "W_hat",), "a NAC, NACMul, NALU, NAU or NMU state dict")
    vectors = {"G_bias"} | ({"G"} if "G" in sd and sd["G"].dim() == sd["W_hat"].dim() - 1 else set())
    return _theirs_out({prefix + k: (v.clone() if k in vectors else _t(v)) for k, v in sd.items()}, kind)


def from_linear_layout(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """The inverse of :func:`to_linear_layout`; the result is marked as nalu_cuda's."""
    fn = "from_linear_layout"
    full = _state_dict(fn, state_dict)
    hint = _prefix_hint(full, prefix, _ALL_KEYS)
    sd = _take(fn, full, prefix, _ALL_KEYS)
    _unexpected(fn, sd, _ALL_KEYS, "this library", hint)
    _need(fn, sd, ("W" if "W" in sd else "W_hat",), "a NAC, NACMul, NALU, NAU or NMU state dict", hint)
    vectors = {"G_bias"} | ({"G"} if "G" in sd and sd["G"].dim() == sd["W_hat"].dim() - 1 else set())
    kind = _local_metadata(full, prefix).get(STATE_DICT_KIND)
    return _ours_out({k: (v.clone() if k in vectors else _t(v)) for k, v in sd.items()}, kind)
