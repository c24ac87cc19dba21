"""kevinzakka/NALU-pytorch: converters both ways and layers built with its eps (see nalu_cuda.compat)."""
from __future__ import annotations

import warnings

from typing import Mapping, Union

import torch
from torch import Tensor, nn

from ..modules import NAC, NALU
from ..reference import DEFAULT_EPS
from .common import (StateDict, _fail, _layer_prefixes, _need, _ours, _ours_out, _prefix_hint, _state_dict, _t,
                     _take, _theirs_out, _unexpected)


# ------------------------------------------------------------------------------------------------
# kevinzakka/NALU-pytorch
# ------------------------------------------------------------------------------------------------


_KZ_NAC = ("W_hat", "M_hat")
_KZ_NALU = ("G", "nac.W_hat", "nac.M_hat")


#: kevinzakka/NALU-pytorch's eps (``models/nalu.py``: ``log(|x| + 1e-10)``); nalu_cuda's default is 1e-7
KEVINZAKKA_EPS = 1e-10


def from_kevinzakka(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """A ``NeuralAccumulatorCell`` or ``NeuralArithmeticLogicUnitCell`` state dict (or the module, or a
    whole model's state dict with ``prefix`` naming the layer) -> ours (load it into ``NAC(in, out)``
    or ``NALU(in, out, eps=1e-10)``). The result is marked as nalu_cuda's (:func:`mark_nalu_cuda`).

    **eps**: their NALU computes ``log(|x| + 1e-10)`` (:data:`KEVINZAKKA_EPS`); nalu_cuda's default is
    1e-7, and a NALU built without ``eps=1e-10`` computes another function (near x = 0 its
    multiplicative path differs by orders of magnitude). Converting a NALU warns (UserWarning) to say
    so; :func:`kevinzakka_layer` / :func:`kevinzakka_model` build the layers with their eps."""
    return _from_kevinzakka("from_kevinzakka", state_dict, prefix, warn=True)


def _from_kevinzakka(fn: str, state_dict, prefix: str, warn: bool) -> StateDict:
    full = _state_dict(fn, state_dict)
    hint = _prefix_hint(full, prefix, _KZ_NALU + _KZ_NAC)
    sd = _take(fn, full, prefix, _KZ_NALU + _KZ_NAC)
    if "G" in sd:
        _unexpected(fn, sd, _KZ_NALU, "a nalu_cuda NALU (tied weights, input gate, no bias)", hint)
        _need(fn, sd, _KZ_NALU, "their NALU cell", hint)
        if warn:
            warnings.warn(
                "nalu_cuda.compat.from_kevinzakka: kevinzakka/NALU-pytorch's NALU uses eps=1e-10 "
                f"(log(|x| + 1e-10)); nalu_cuda's default is eps={DEFAULT_EPS}: load this into "
                "NALU(in_features, out_features, eps=1e-10) (nalu_cuda.compat.KEVINZAKKA_EPS), or build it with "
                "nalu_cuda.compat.kevinzakka_layer(state_dict, prefix=...), else the multiplicative path "
                "computes another function near x = 0", UserWarning, stacklevel=3)
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


def kevinzakka_layer(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "", **kwargs) -> nn.Module:
    """Their ``NeuralAccumulatorCell`` / ``NeuralArithmeticLogicUnitCell`` (a module, its state dict,
    or a whole model's with ``prefix``) as a nalu_cuda ``NAC`` / ``NALU`` with their weights and
    **their eps** (``NALU(in, out, eps=1e-10)``), on their device and dtype. ``kwargs`` go to the
    layer (``backend=``, ...). Construction leaves the global RNG untouched."""
    ours = _from_kevinzakka("kevinzakka_layer", state_dict, prefix, warn=False)
    W = ours["W_hat"]
    kw = {"device": W.device, "dtype": W.dtype, "init": "kaiming", **kwargs}
    eps = kw.pop("eps", KEVINZAKKA_EPS)  # a NAC has none
    with torch.random.fork_rng(devices=[]):
        layer = NALU(*W.shape, eps=eps, **kw) if "G" in ours else NAC(*W.shape, **kw)
    layer.load_state_dict(ours)
    return layer


def kevinzakka_model(state_dict: Union[Mapping[str, Tensor], nn.Module], **kwargs) -> nn.Sequential:
    """Their ``models.NAC`` / ``models.NALU`` stack (the module or its state dict: layers under
    ``model.i.``) as an ``nn.Sequential`` of :func:`kevinzakka_layer` (their eps), computing their
    forward (``self.model(x)``)."""
    sd = _state_dict("kevinzakka_model", state_dict)
    prefixes = _layer_prefixes(sd, _KZ_NALU + _KZ_NAC)
    if not prefixes:
        _fail("kevinzakka_model", f"no layer of theirs found (keys: {sorted(sd)[:8]})")
    return nn.Sequential(*(kevinzakka_layer(sd, prefix=p, **kwargs) for p in prefixes))
