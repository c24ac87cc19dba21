"""AndreasMadsen/stable-nalu: converters both ways and drop-in layers and cells (see nalu_cuda.compat)."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from ..modules import NAC, NALU, NAU, NMU
from ..functional import NaluParts, nalu_gate_regularizer, nalu_parts
from ..reference import DEFAULT_EPS, nalu_gate_regularizer as reference_gate_regularizer
from .common import (StateDict, _UNIT_KEYS, _fail, _need, _ours, _ours_out, _prefix_hint, _state_dict, _t, _take,
                     _theirs_out, _unexpected)
from .kevinzakka import _KZ_NALU, _from_kevinzakka


# ------------------------------------------------------------------------------------------------
# AndreasMadsen/stable-nalu
# ------------------------------------------------------------------------------------------------


_SN_NAC = ("W_hat", "M_hat")
_SN_NALU = ("G_add", "bias_add", "nac_add.W_hat", "nac_add.M_hat", "nac_mul.W_hat", "nac_mul.M_hat")


def from_stable_nalu(state_dict: Union[Mapping[str, Tensor], nn.Module], prefix: str = "") -> StateDict:
    """A stable-nalu ``NACLayer``, ``NALULayer``, ``ReRegualizedLinearNACLayer`` or
    ``ReRegualizedLinearMNACLayer`` state dict (or the module, or a whole model's state dict with
    ``prefix`` naming the layer) -> ours (load it into ``NAC(in, out)``,
    ``NALU(in, out, tied=not nalu_two_nac, gate_bias=nalu_bias)``, ``NAU(in, out)`` or
    ``NMU(in, out)``: their NAU and NMU both store one ``W``). The result is marked as nalu_cuda's
    (:func:`mark_nalu_cuda`)."""
    fn = "from_stable_nalu"
    full = _state_dict(fn, state_dict)
    leaves = _SN_NALU + ("G_mul", "bias_mul", "nac_add.W", "nac_mul.W") + _KZ_NALU + _SN_NAC + _UNIT_KEYS
    hint = _prefix_hint(full, prefix, leaves)
    sd = _take(fn, full, prefix, leaves)
    if "nac_add.W" in sd or "nac_mul.W" in sd:
        _fail(fn, "'nac_add.W' / 'nac_mul.W' (their ReRegualizedLinearNALU: a NALU whose paths are a NAU and an "
                  "NMU) has no counterpart here; its paths convert one at a time into a NAU / NMU "
                  f"(from_stable_nalu(state_dict, prefix={prefix + 'nac_add.'!r})), its gate into none")
    if "W" in sd and "W_hat" not in sd:  # their ReRegualizedLinearNAC / MNAC: W (out, in)
        _unexpected(fn, sd, _UNIT_KEYS, "a nalu_cuda NAU / NMU (no bias)", hint)
        return _ours_out({"W": _t(sd["W"])}, None)
    if "G_mul" in sd or "bias_mul" in sd:
        _fail(fn, "'G_mul' / 'bias_mul' (nalu_two_gate=True: a second gate for the multiplicative path) have "
                  "no counterpart: here the multiplicative path's weight is 1 - g")
    if "nac_mul.W_hat" in sd and "nac_mul.M_hat" not in sd:
        _fail(fn, "'nac_mul.W_hat' without 'nac_mul.M_hat' (nalu_mul='mnac': an MNAC multiplicative path) has no "
                  "counterpart: here the multiplicative path is exp(log(|x| + eps) W_m)")
    if "G_add" not in sd:
        if "G" in sd:  # their first NALULayer: the layout of kevinzakka's (with stable-nalu's eps)
            return _from_kevinzakka(fn, sd, "", warn=False)
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
    """Ours (a NAC, NALU, NAU or NMU: its state dict or the layer) -> stable-nalu's (``NACLayer``;
    ``NALULayer`` with ``nalu_two_nac`` = separate weights and ``nalu_bias`` = a gate bias;
    ``ReRegualizedLinearNACLayer`` / ``ReRegualizedLinearMNACLayer``). A NACMul is refused
    (their MNAC has another formula). The result is marked ``(out, in)``: a nalu_cuda layer refuses
    to load it."""
    fn = "to_stable_nalu"
    sd = _ours(fn, state_dict, "stable-nalu")
    if "W" in sd:  # a NAU / NMU -> their ReRegualizedLinearNAC / MNAC
        return _theirs_out({prefix + "W": _t(sd["W"])})
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
# stable-nalu units
# ------------------------------------------------------------------------------------------------


def _writer_on(writer) -> bool:
    """Whether ``writer`` is one to log to (their ``DummySummaryWriter`` discards everything)."""
    return writer is not None and type(writer).__name__ != "DummySummaryWriter"


def _would_log(writer, verbose_only: bool = True) -> bool:
    """Whether their ``SummaryWriterNamespace`` would write a scalar now (so that its value need not be
    computed on the other steps); True for a writer without their ``is_*`` methods."""
    try:
        return bool(writer.is_log_iteration() and writer.is_logging_enabled() and writer.is_verbose(verbose_only))
    except AttributeError:
        return True


def _sparsity_error(W: Tensor) -> Tensor:
    """stable-nalu's ``sparsity_error``: ``max(min(|W|, |1 - |W||))``."""
    return torch.max(torch.min(torch.abs(W), torch.abs(1 - torch.abs(W))))


def _log_weight(writer, W: Tensor) -> None:
    """What their NAC layers write on every forward: ``W`` (theirs, ``(out, in)``) as a histogram (which
    raises ValueError('nan detected') on a NaN, on every step), as text, and its sparsity error."""
    writer.add_histogram("W", W)
    writer.add_tensor("W", W)
    if _would_log(writer, False):
        writer.add_scalar("W/sparsity_error", _sparsity_error(W), verbose_only=False)


def _log_grads(writer, params) -> None:
    """Their ``ExtendedTorchModule.log_gradients`` for ``(their name, our parameter)`` pairs: the first
    row of the gradient in their ``(out, in)`` layout, as ``{name}/grad`` summary and histogram."""
    for name, p in params:
        if p is None or not p.requires_grad or p.grad is None:
            continue
        grad = p.grad.detach()
        gradient, *_ = grad.t() if grad.dim() == 2 else grad
        writer.add_summary(f"{name}/grad", gradient)
        writer.add_histogram(f"{name}/grad", gradient)


def _theirs(W: Tensor) -> Tensor:
    """Our ``(in, out)`` matrix as theirs, ``(out, in)``, in their memory order (so that their means
    reduce in their order)."""
    return W.t().contiguous()


def _merge(out: dict, key: str, value) -> None:
    """``out[key] += value`` as their ``defaultdict(int)`` sums, without the op of ``0 + value``
    for a key's first tensor (the same value: these terms are sums of squares or 0)."""
    if key in out:
        out[key] += value
    else:
        out[key] = value


class _StableUnit:
    """What stable-nalu's training loop calls on a unit (``ExtendedTorchModule``'s methods), and their
    layers' side effects: the writer's logs and the ``regualizer_z`` input store.

    A unit has ``_n_paths()`` NAC paths (their child NACs: a NALU's ``nac_add``, ``nac_mul``), each
    with its ``regualizer_z`` input store and weight ``_sn_weight(path)``; ``_own_regualizers()``
    and ``_their_params()`` list, per module of theirs, its writer and its entries / parameters."""

    _default_name = "nac"
    _z_target = 0.0  # NAU-z: (0 - mean(x))^2; NMU-z: (1 - mean(x))^2

    def _stable_setup(self, writer, name, regualizer_z) -> None:
        if "writer" not in self.__dict__:  # a plain class: no ExtendedTorchModule put its writer there
            self.writer = (writer.namespace(self._default_name if name is None else name)
                           if writer is not None else None)
        self.regualizer_z = regualizer_z
        self._z_inputs = [[] for _ in range(self._n_paths())]

    def _n_paths(self) -> int:
        return 1

    def _logging(self) -> bool:
        return _writer_on(getattr(self, "writer", None))

    def _z_on(self) -> bool:
        return getattr(self, "regualizer_z", 0) != 0 and getattr(self, "allow_random", True)

    def _z_append(self, *inputs: Tensor) -> None:
        """Their ``RegualizerNAUZ.append_input`` (one input per NAC path), while ``allow_random``."""
        if self._z_on():
            for store, x in zip(self._z_inputs, inputs):
                store.append(x)

    def _z(self, path: int):
        """Their ``RegualizerNAUZ`` / ``RegualizerNMUZ``: ``mean((1 - |W|) (0 - mean(x))^2)`` (NMU:
        ``mean((1 - W) (1 - mean(x))^2)``, ``W`` the path's weight ``_sn_weight(path)``) over the
        inputs stored since the last ``optimize``; 0 when ``regualizer_z == 0`` (or nothing is stored),
        without forming ``W`` (a NAC's ``tanh * sigmoid`` in the graph, for nothing)."""
        store = self._z_inputs[path] if getattr(self, "regualizer_z", 0) != 0 else None
        if not store:
            return 0
        x_mean = torch.mean(torch.cat([x.reshape(-1, x.shape[-1]) for x in store], dim=0), dim=0, keepdim=True)
        Wt = _theirs(self._sn_weight(path))
        if self._z_target == 0.0:
            return torch.mean((1 - torch.abs(Wt)) * (0 - x_mean) ** 2)
        return torch.mean((1 - Wt) * (1 - x_mean) ** 2)

    def _own_regualizers(self) -> list:
        """``(writer, {key: value})`` per module of theirs, in their recursion's order."""
        return [(self.writer, {"z": self._z(0)})]

    def regualizer(self, merge_in: Optional[dict] = None) -> dict:
        """Their ``regualizer()``: each of their modules' entries logged as ``regualizer/{key}`` under its
        namespace, and summed into a ``defaultdict(int)`` (``merge_in``'s entries too)."""
        out = defaultdict(int)
        if not merge_in and not self._logging():  # the common case: nothing to log, entries merged in order
            for _, entries in self._own_regualizers():
                for key, value in entries.items():
                    _merge(out, key, value)
            return out
        for key, value in (merge_in or {}).items():
            if self._logging():
                self.writer.add_scalar(f"regualizer/{key}", value)
            _merge(out, key, value)
        for writer, entries in self._own_regualizers():
            for key, value in entries.items():
                if _writer_on(writer):
                    writer.add_scalar(f"regualizer/{key}", value)
                _merge(out, key, value)
        return out

    def optimize(self, loss) -> None:
        """Their ``optimize``: the ``regualizer_z`` input store is emptied (and ``nac_oob='clip'`` clamps)."""
        for store in getattr(self, "_z_inputs", ()):
            store.clear()

    def log_gradients(self) -> None:
        if self._logging():
            for writer, params in self._their_params():
                _log_grads(writer, params)

    def set_parameter(self, name: str, value) -> None:
        p = getattr(self, name, None)
        if isinstance(p, torch.nn.Parameter):
            with torch.no_grad():
                p.fill_(value)


class StableNACLayer(_StableUnit, NAC):
    """``NAC`` with stable-nalu's ``NACLayer(in_features, out_features, **kwargs)`` constructor.

    ``regualizer_z`` as theirs: the inputs of the forwards since the last ``optimize()`` (while
    ``allow_random``) give ``regualizer()['z'] = mean((1 - |W|) mean(x)^2)``. ``writer`` (their
    ``SummaryWriterNamespace``; the unit logs to ``writer.namespace(name or 'nac')``) gets what their
    layer writes: ``W`` (histogram, text, ``W/sparsity_error``) on every forward, ``regualizer/z``,
    and the gradients in ``log_gradients()``, all in their ``(out, in)`` layout. Every other keyword
    (``eps``, ``nalu_*``, ... : what stable-nalu passes to all units) is accepted and ignored.
    Parameters are drawn with ``init="stable-nalu-nac"`` when ``reset_parameters()`` is called, as
    theirs: the constructor leaves the global RNG untouched.
    """

    def __init__(self, in_features: int, out_features: int, *, regualizer_z: float = 0, writer=None, name=None,
                 init: str = "stable-nalu-nac", backend: str = "auto", device=None, dtype=None, **ignored) -> None:
        with torch.random.fork_rng(devices=[]):
            super().__init__(in_features, out_features, init=init, backend=backend, device=device, dtype=dtype)
        self._stable_setup(writer, name, regualizer_z)

    def _sn_weight(self, path: int) -> Tensor:
        return self.W

    def _their_params(self):
        return [(self.writer, [("W_hat", self.W_hat), ("M_hat", self.M_hat)])]

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        self._z_append(x)
        if self._logging():
            _log_weight(self.writer, _theirs(self.W.detach()))
        return y


class StableNALULayer(_StableUnit, NALU):
    """``NALU`` with stable-nalu's ``NALULayer`` constructor and ``regualizer()``.

    ``nalu_two_nac`` -> ``tied=False``; ``nalu_bias`` -> ``gate_bias=True``;
    ``nalu_gate='regualized'`` -> ``regualizer()['g'] = sum(g^2 (1 - g)^2)`` over the last call's
    gate (kept with ``keep_parts``); ``regualizer_z`` -> ``regualizer()['z']``, their NAC's, summed
    over the NAC paths (tied: one NAC that sees ``x`` and ``log(|x| + eps)``). Refused (ValueError):
    ``nalu_two_gate=True``, ``nalu_mul`` other than ``'normal'``, ``nalu_gate`` other than
    ``'normal'`` / ``'regualized'``. ``writer``: their layer's logs, under ``name or 'nalu'`` and its
    NACs' namespaces (``nac``; ``nac_add`` / ``nac_mul`` with ``nalu_two_nac``), from the one fused
    forward (``keep_parts`` is on while a writer is): ``gate`` (histogram), ``gate/mean``, the NACs'
    ``W``, ``W/sparsity_error``, ``add``, ``mul``; ``regualizer/*``; ``log_gradients()``
    (``G_add``, ``bias_add``, the NACs' ``W_hat``, ``M_hat``). Every other keyword is accepted and
    ignored. As in :class:`StableNACLayer`, parameters are drawn by ``reset_parameters()`` with
    ``init="stable-nalu-nac"``, and construction leaves the global RNG untouched.
    """

    _default_name = "nalu"

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS, nalu_two_nac: bool = False,
                 nalu_two_gate: bool = False, nalu_bias: bool = False, nalu_mul: str = "normal",
                 nalu_gate: str = "normal", regualizer_z: float = 0, writer=None, name=None,
                 init: str = "stable-nalu-nac", backend: str = "auto", device=None, dtype=None, **ignored) -> None:
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
        self._stable_setup(writer, name, regualizer_z)
        w = self.writer
        self._nac_writers = ([] if w is None else [w.namespace("nac")] if self.tied
                             else [w.namespace("nac_add"), w.namespace("nac_mul")])
        if self._logging():
            self.keep_parts = True  # the gate and both paths, for the logs, from the same forward

    def _n_paths(self) -> int:
        return 1 if self.tied else 2

    def _sn_weight(self, path: int) -> Tensor:
        return self.W if path == 0 else self.W_m

    def _their_params(self):
        out = [(self.writer, [("G_add", self.G), ("bias_add", self.G_bias)]),
               (self._nac_writers[0], [("W_hat", self.W_hat), ("M_hat", self.M_hat)])]
        if not self.tied:
            out.append((self._nac_writers[1], [("W_hat", self.W_hat_m), ("M_hat", self.M_hat_m)]))
        return out

    def _regualized_forward(self, x: Tensor):
        """``NALU.forward`` with ``keep_parts`` on the fused backend, whose one op (and autograd node) also
        returns their gate regulariser ``sum(g^2 (1 - g)^2)`` of this call's gate, kept with the parts
        for ``regualizer()``; None where the fused ops do not run (the reference backend, a device or
        dtype without kernels), for ``NALU.forward``."""
        if not self.keep_parts:
            return None
        self._check_input(x)
        if not self.use_fused(x):
            return None
        y, a, m, g, r = nalu_parts(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                                   G_bias=self.G_bias, gate_regularizer=True)
        parts = NaluParts(a, m, g)
        # plain attributes, set without nn.Module.__setattr__'s registry checks (as NALU.forward's parts)
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "_parts_regualizer", (parts, r))
        return y

    def forward(self, x: Tensor) -> Tensor:
        y = self._regualized_forward(x) if self.nalu_gate == "regualized" else None
        if y is None:
            y = super().forward(x)
        if self._z_on():
            log_x = torch.log(torch.abs(x) + self.eps)
            if self.tied:  # their one NAC sees x, then log(|x| + eps) (nac_mul reuses nac_add)
                self._z_inputs[0].extend((x, log_x))
            else:
                self._z_append(x, log_x)
        if self._logging():
            w, parts = self.writer, self.parts
            g = parts.g.detach()
            w.add_histogram("gate", g)
            if _would_log(w, False):
                w.add_scalar("gate/mean", torch.mean(g), verbose_only=False)
            W = _theirs(self.W.detach())
            _log_weight(self._nac_writers[0], W)
            _log_weight(self._nac_writers[-1], W if self.tied else _theirs(self.W_m.detach()))
            w.add_histogram("add", parts.a.detach())
            w.add_histogram("mul", parts.m.detach())
        return y

    def _gate_regualizer(self) -> Tensor:
        """Their ``regualizer()['g']``: ``sum(g^2 (1 - g)^2)`` of the last call's gate."""
        parts = self.parts
        if parts is None:  # their stored gate before any forward: tensor([0])
            return torch.zeros((), dtype=self.G.dtype, device=self.G.device)
        kept = self.__dict__.get("_parts_regualizer")
        if kept is not None and kept[0] is parts:  # from the last forward's fused op, in its graph
            return kept[1]
        g = parts.g  # one fused op on the fused backend
        return (nalu_gate_regularizer if self.use_fused(g) else reference_gate_regularizer)(g)

    def regualizer(self, merge_in: Optional[dict] = None) -> dict:
        if merge_in or self._logging() or getattr(self, "regualizer_z", 0) != 0:
            return super().regualizer(merge_in)
        # the common case (nothing to merge in or log, their default regualizer_z 0): what the general
        # path returns, their own 'g' (nalu_gate='regualized') and their NACs' 'z' summed (0 + 0)
        out = defaultdict(int)
        if self.nalu_gate == "regualized":
            out["g"] = self._gate_regualizer()
        out["z"] = 0
        return out

    def _own_regualizers(self) -> list:
        own = {}
        if self.nalu_gate == "regualized":
            own["g"] = self._gate_regualizer()
        out = [(self.writer, own)]
        nac_writers = self._nac_writers or [None] * len(self._z_inputs)
        for path, writer in enumerate(nac_writers):
            out.append((writer, {"z": self._z(path)}))
        return out


_SHAPES = ("squared", "linear")
_OOB = ("regualized", "clip")


class _StableProjected(_StableUnit):
    """What :class:`StableNAULayer` and :class:`StableNMULayer` share (their ``ReRegualizedLinear*``)."""

    def __init__(self, in_features: int, out_features: int, *, nac_oob: str = "regualized",
                 regualizer_shape: str = "squared", regualizer_z: float = 0, writer=None, name=None,
                 init: str = "stable-nalu-nac", backend: str = "auto", device=None, dtype=None, **ignored) -> None:
        cls = type(self).__name__
        if nac_oob not in _OOB:
            _fail(cls, f"nac_oob={nac_oob!r}: stable-nalu's options are {_OOB}")
        if regualizer_shape not in _SHAPES:
            _fail(cls, f"regualizer_shape={regualizer_shape!r}: stable-nalu's options are {_SHAPES}")
        with torch.random.fork_rng(devices=[]):
            super().__init__(in_features, out_features, init=init, backend=backend, device=device, dtype=dtype)
        self.nac_oob, self.regualizer_shape = nac_oob, regualizer_shape
        self._stable_setup(writer, name, regualizer_z)

    def _used_weight(self) -> Tensor:
        """The weight their forward uses (ours, ``(in, out)``)."""
        return torch.clamp(self.W, *self.W_RANGE)

    def _sn_weight(self, path: int) -> Tensor:
        return self.W

    def _their_params(self):
        return [(self.writer, [("W", self.W)])]

    def forward(self, x: Tensor) -> Tensor:
        self._z_append(x)
        W = self._used_weight()
        if self._logging():
            _log_weight(self.writer, _theirs(W.detach()))
        fn = self._fused if self.use_fused(x) else self._reference
        return fn(x, W)

    def _own_regualizers(self) -> list:
        W = _theirs(self.W)
        bias, oob = self._bias_and_oob(W)
        if self.nac_oob == "clip":
            oob = 0
        else:
            oob = torch.mean(oob ** 2 if self.regualizer_shape == "squared" else oob)
        return [(self.writer, {"W": bias, "z": self._z(0), "W-OOB": oob})]

    def optimize(self, loss) -> None:
        super().optimize(loss)
        if self.nac_oob == "clip":
            with torch.no_grad():
                self.W.clamp_(*self.W_RANGE)


class StableNAULayer(_StableProjected, NAU):
    """:class:`~nalu_cuda.NAU` with stable-nalu's ``ReRegualizedLinearNACLayer`` constructor,
    ``regualizer()`` and ``optimize()``: their unit ``'ReRegualizedLinearNAC'``.

    ``y = x clamp(W, -1, 1)`` as theirs (``W`` here ``(in, out)``: :func:`from_stable_nalu` /
    :func:`to_stable_nalu` convert). ``regualizer()`` returns their ``{'W', 'z', 'W-OOB'}``:
    ``W``: ``mean(W^2 (1 - |W|)^2)`` (``regualizer_shape='squared'``) or ``mean(min(|W|, |1 - |W||))``
    (``'linear'``); ``z``: ``mean((1 - |W|) mean(x)^2)`` over the inputs since the last ``optimize()``
    (0 when ``regualizer_z == 0``); ``W-OOB``: ``mean(relu(|W| - 1)^2)`` (or without the square),
    0 with ``nac_oob='clip'``, where ``optimize()`` clamps ``W`` to [-1, 1] instead. ``writer``: their
    logs (``W``, ``W/sparsity_error``, ``regualizer/*``, ``W/grad``) under ``name or 'nac'``.
    Parameters are drawn by ``reset_parameters()`` with ``init="stable-nalu-nac"`` (their numbers
    for the same seed); construction leaves the global RNG untouched. Every other keyword
    (``eps``, ``mnac_epsilon``, ``nalu_*``, ...) is accepted and ignored, as theirs does.
    """

    def _bias_and_oob(self, W: Tensor):
        if self.regualizer_shape == "squared":
            bias = torch.mean(W ** 2 * (1 - torch.abs(W)) ** 2)
        else:
            bias = torch.mean(torch.min(torch.abs(W), torch.abs(1 - torch.abs(W))))
        oob = torch.relu(torch.abs(W) - 1)
        return bias, oob


class StableNMULayer(_StableProjected, NMU):
    """:class:`~nalu_cuda.NMU` with stable-nalu's ``ReRegualizedLinearMNACLayer`` constructor,
    ``regualizer()`` and ``optimize()``: their unit ``'ReRegualizedLinearMNAC'``.

    ``y = prod_i (W x_i + 1 - W)`` over ``clamp(W, 0, 1)`` (``nac_oob='regualized'``) or ``W``
    (``'clip'``, where ``optimize()`` clamps ``W`` to [0, 1]), as theirs. ``regualizer()``: ``W``:
    ``mean(W^2 (1 - W)^2)`` (or ``mean(min(|W|, |1 - W|))``), ``z``: ``mean((1 - W) (1 - mean(x))^2)``,
    ``W-OOB``: ``mean(relu(|W - 0.5| - 0.5)^2)`` (0 with ``'clip'``). Refused (ValueError):
    ``mnac_epsilon`` other than 0 and ``mnac_normalized=True``. The rest as :class:`StableNAULayer`.
    """

    _z_target = 1.0

    def __init__(self, in_features: int, out_features: int, *, mnac_epsilon: float = 0,
                 mnac_normalized: bool = False, **kwargs) -> None:
        if mnac_epsilon != 0:
            _fail(type(self).__name__, f"mnac_epsilon={mnac_epsilon!r} has no counterpart here (the NMU clamps W to "
                                       "[0, 1]); run with mnac_epsilon=0 (their default)")
        if mnac_normalized:
            _fail(type(self).__name__, "mnac_normalized=True has no counterpart here; run with "
                                       "mnac_normalized=False (their default)")
        super().__init__(in_features, out_features, **kwargs)

    def _used_weight(self) -> Tensor:
        return torch.clamp(self.W, 0.0, 1.0) if self.nac_oob == "regualized" else self.W

    def _bias_and_oob(self, W: Tensor):
        if self.regualizer_shape == "squared":
            bias = torch.mean(W ** 2 * (1 - W) ** 2)
        else:
            bias = torch.mean(torch.min(torch.abs(W), torch.abs(1 - W)))
        return bias, torch.relu(torch.abs(W - 0.5) - 0.5)

    @torch.no_grad()
    def reset_parameters(self, generator=None) -> None:
        super().reset_parameters(generator)
        for store in getattr(self, "_z_inputs", ()):  # theirs empties the NMU-z store here too
            store.clear()


# ------------------------------------------------------------------------------------------------
# Classes that are also stable-nalu's ExtendedTorchModule (built once per base class; picklable)
# ------------------------------------------------------------------------------------------------


#: their unit name -> (our unit, their default writer namespace)
_STABLE_LAYERS = {
    "NAC": (StableNACLayer, "nac"),
    "NALU": (StableNALULayer, "nalu"),
    "ReRegualizedLinearNAC": (StableNAULayer, "nac"),
    "ReRegualizedLinearMNAC": (StableNMULayer, "nac"),
}
STABLE_NALU_UNIT_NAMES = tuple(_STABLE_LAYERS)

_BUILT: Dict[type, Dict[str, type]] = {}


def _rebuild_stable_unit(base: type, key: str):
    """Unpickling: an empty instance of the class built for ``base`` (the state follows)."""
    cls = _built(base)[key]
    return cls.__new__(cls)


def _reducer(base: type, key: str):
    def __reduce_ex__(self, protocol):
        # what pickle would do for a module-level class (copyreg.__newobj__, (cls,), state, ...), with
        # the class named by (base, key): rebuilt on load by stable_nalu_units(base), not looked up
        rv = object.__reduce_ex__(self, max(int(protocol), 2))
        return (_rebuild_stable_unit, (base, key)) + tuple(rv[2:])

    return __reduce_ex__


def _built(base: type) -> Dict[str, type]:
    if not isinstance(base, type) or not issubclass(base, nn.Module):
        _fail("stable_nalu_units", f"expected stable-nalu's ExtendedTorchModule class (an nn.Module subclass), got "
                                   f"{base!r}")
    got = _BUILT.get(base)
    if got is not None:
        return got

    class _Base(base):
        # Reached through the modules' super().__init__(), which passes nothing: the arguments for
        # base were left on the instance by the constructor below.
        def __init__(self):
            default_name, writer, name = self.__dict__.pop("_stable_base_args")
            base.__init__(self, default_name, writer=writer, name=name)

    def layer(key, cls, default_name):
        def __init__(self, in_features, out_features, *, writer=None, name=None, **kwargs):
            object.__setattr__(self, "_stable_base_args", (default_name, writer, name))
            cls.__init__(self, in_features, out_features, **kwargs)

        return type(cls.__name__, (cls, _Base), {
            "__init__": __init__, "__module__": __name__, "__qualname__": f"stable_nalu_layers.<{key}>",
            "__reduce_ex__": _reducer(base, "layer:" + key)})

    def cell(key, Layer):
        # their AbstractRecurrentCell: op(cat(x_t, h_tm1)) with op = Layer(input + hidden, hidden)
        def __init__(self, input_size, hidden_size, writer=None, **kwargs):
            base.__init__(self, "recurrent", writer=writer, **kwargs)
            self.input_size, self.hidden_size = input_size, hidden_size
            self.op = Layer(input_size + hidden_size, hidden_size, writer=self.writer, **kwargs)

        def reset_parameters(self):
            self.op.reset_parameters()

        def forward(self, x_t, h_tm1):
            return self.op(torch.cat((x_t, h_tm1), dim=1))

        def extra_repr(self):
            return f"input_size={self.input_size}, hidden_size={self.hidden_size}"

        return type(f"{key}Cell", (base,), {
            "__init__": __init__, "reset_parameters": reset_parameters, "forward": forward,
            "extra_repr": extra_repr, "__module__": __name__, "__qualname__": f"stable_nalu_cells.<{key}>",
            "__reduce_ex__": _reducer(base, "cell:" + key)})

    got = {}
    for key, (cls, default_name) in _STABLE_LAYERS.items():
        got["layer:" + key] = layer(key, cls, default_name)
        got["cell:" + key] = cell(key, got["layer:" + key])
    _BUILT[base] = got
    return got


def stable_nalu_layers(base: type) -> Dict[str, type]:
    """``{their unit name: class}`` for ``unit_name_to_layer_class.update(...)``: ``'NAC'``
    (:class:`StableNACLayer`), ``'NALU'`` (:class:`StableNALULayer`), ``'ReRegualizedLinearNAC'``
    (:class:`StableNAULayer`) and ``'ReRegualizedLinearMNAC'`` (:class:`StableNMULayer`), each also
    an instance of ``base``, stable-nalu's ``ExtendedTorchModule`` (passed in: this library does not
    depend on stable-nalu). ``base.__init__(default_name, writer=..., name=...)`` runs with their
    ``writer`` and ``name``, so ``self.writer`` is their namespaced writer, and their recursions
    (``regualizer``, ``optimize``, ``log_gradients``, ``set_parameter``, ``no_random``) reach the units.
    Parameters and state-dict keys are those of the plain classes. The classes are built once per
    ``base`` (the same classes on every call) and pickle (``torch.save(model)``, their ``save_model``):
    an instance is rebuilt on load through ``base``, which must be importable there."""
    got = _built(base)
    return {key: got["layer:" + key] for key in _STABLE_LAYERS}


def stable_nalu_cells(base: type) -> Dict[str, type]:
    """``{their unit name: cell class}`` for ``unit_name_to_cell_class.update(...)``: their
    ``AbstractRecurrentCell`` over the units of :func:`stable_nalu_layers` (``h_t = op(cat(x_t, h_tm1))``,
    ``op = Unit(input_size + hidden_size, hidden_size)``, writer namespace ``'recurrent'``), under
    the names ``'NAC'``, ``'NALU'``, ``'ReRegualizedLinearNAC'``, ``'ReRegualizedLinearMNAC'``;
    state-dict keys ``op.*``. Built once per ``base``, picklable, as the layers."""
    got = _built(base)
    return {key: got["cell:" + key] for key in _STABLE_LAYERS}


def stable_nalu_units(base: type):
    """``(NACLayer, NALULayer)``: ``stable_nalu_layers(base)['NAC']`` and ``['NALU']`` (see
    :func:`stable_nalu_layers`, which has the NAU / NMU units too)."""
    layers = stable_nalu_layers(base)
    return layers["NAC"], layers["NALU"]
