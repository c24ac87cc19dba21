"""What every ``nn.Module`` layer of nalu_cuda shares: :class:`_ArithmeticLayer` (shapes, ensembles,
the ``backend`` choice, initialisation helpers, the input check) and the state-dict guard that
refuses another codebase's ``(out, in)`` weights.

The base of every unit family's layers (in :mod:`nalu_cuda.ops`: NAC, NACMul, NALU, NAU, NMU, NPU,
RealNPU, INALU), which import it and not each other's; see :mod:`nalu_cuda.modules`
for the conventions (layout, ``backend``, ``init``, ``generator``). The names are re-exported by
:mod:`nalu_cuda.modules`, where :mod:`nalu_cuda.compat` reads them.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import init_presets
from .ops import _common

__all__ = ["BACKENDS", "Generators", "STATE_DICT_MARK", "STATE_DICT_KIND", "LAYOUT", "FOREIGN_LAYOUT"]

BACKENDS = ("auto", "fused", "reference")
Generators = Union[None, torch.Generator, Sequence[torch.Generator]]

_warned_fallback = False


def _warn_fallback_once() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"nalu_cuda: native extension not available ({_common.LOAD_ERROR}); backend='auto' uses the "
            "pure-PyTorch reference path. Build with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_scalar(cls: str, name: str, value, positive: bool = True, dtype: Optional[torch.dtype] = None) -> float:
    """A scalar argument (eps, omega) as a float: any real number type (float, int, numpy scalars),
    finite (and positive), and so in the layer's dtype when it has one (reference.scalar_problem)."""
    problem = _common.scalar_problem(name, value, dtype, positive)
    if problem:
        raise ValueError(f"nalu_cuda.{cls}: {problem}")
    return float(value)


def _check_positive_int(cls: str, name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"nalu_cuda.{cls}: argument '{name}' must be a positive int, got {value!r}")


# State-dict metadata: every nalu_cuda layer's entry in ``state_dict._metadata`` carries
# ``STATE_DICT_MARK: LAYOUT`` (and the layer's kind), so that loading a state dict written by another
# module class, whose same-named weights are (out, in), is refused instead of transposing silently.
# nalu_cuda.compat.mark_nalu_cuda stamps it on a state dict by hand; its to_* converters stamp
# FOREIGN_LAYOUT on what they write for other codebases.
STATE_DICT_MARK = "nalu_cuda"
STATE_DICT_KIND = "nalu_cuda_layer"
LAYOUT = "(in, out)"
FOREIGN_LAYOUT = "(out, in)"


def _layer_kind(module: nn.Module) -> str:
    """The public nalu_cuda class a layer is (StableNACLayer -> 'NAC'), by its MRO."""
    for cls in type(module).__mro__:
        home = cls.__module__
        if home.startswith("nalu_cuda.ops.") and not cls.__name__.startswith("_"):
            return cls.__name__
    return type(module).__name__


def _layout_problem(layer: nn.Module, state_dict, prefix: str, local_metadata) -> Optional[str]:
    """Why ``state_dict`` must not be loaded into ``layer`` (keys under ``prefix``), or None."""
    own = {n: p for n, p in layer._parameters.items() if p is not None}
    present = {n: state_dict[prefix + n] for n in own if prefix + n in state_dict}
    if not present:
        return None
    name = type(layer).__name__
    where = f"the keys under {prefix!r}" if prefix else "the state dict"
    layout = local_metadata.get(STATE_DICT_MARK)
    convert = ("convert it with nalu_cuda.compat.from_kevinzakka(state_dict, prefix=...) (kevinzakka/NALU-pytorch) "
               "or nalu_cuda.compat.from_stable_nalu(state_dict, prefix=...) (stable-nalu), or "
               "nalu_cuda.compat.from_linear_layout (nn.Linear's layout)")
    if layout == LAYOUT:
        return None
    if layout is not None or "version" in local_metadata:
        if layout is not None:
            said = f"its metadata says the weights are {layout}" + (
                " (written by nalu_cuda.compat.to_*)" if layout == FOREIGN_LAYOUT else "")
        else:
            said = (f"its metadata (version {local_metadata['version']}, no {STATE_DICT_MARK!r} mark) comes from "
                    "another module class")
        return (f"nalu_cuda.{name}: {where} was not written by a nalu_cuda layer: {said}. nalu_cuda stores "
                f"weights {LAYOUT} (y = x W); other NALU codebases store the same names (out, in) (y = x W^T), "
                f"and loading those here would compute another function. If it comes from another codebase, "
                f"{convert}; if it really holds nalu_cuda weights (saved by a version that did not mark its state "
                "dicts, or its metadata copied from another module), "
                "declare it with nalu_cuda.compat.mark_nalu_cuda(state_dict).")
    # no metadata (a dict built by hand or copied key by key): nothing says whose it is, but a
    # matrix with our shape transposed is another codebase's (out, in) layout
    for n, v in present.items():
        want = own[n].shape
        if (isinstance(v, torch.Tensor) and v.dim() == len(want) >= 2 and v.shape != want
                and v.shape == (*want[:-2], want[-1], want[-2])):
            return (f"nalu_cuda.{name}: {n!r} in {where} has shape {list(v.shape)}, the transpose of this layer's "
                    f"{list(want)} {LAYOUT}: it looks like another codebase's (out, in) layout; {convert}.")
    return None


class _ArithmeticLayer(nn.Module):
    """What every layer shares (NAC, NACMul, NALU; NPU, RealNPU, INALU; NAU, NMU): shapes, backend
    choice, initialisation helpers, the input check, the state-dict guard."""

    # (device type, dtype) pairs where backend="auto" runs the fused ops
    _kernel_dtypes: frozenset = _common.KERNEL_DTYPES

    def __init__(self, in_features: int, out_features: int, ensemble: Optional[int], backend: str,
                 device=None, dtype=None, init: str = init_presets.DEFAULT) -> None:
        super().__init__()
        name = type(self).__name__
        _check_positive_int(name, "in_features", in_features)
        _check_positive_int(name, "out_features", out_features)
        _check_positive_int(name, "ensemble", ensemble, allow_none=True)
        if backend not in BACKENDS:
            raise ValueError(f"nalu_cuda.{name}: argument 'backend' must be one of {BACKENDS}, got {backend!r}")
        if backend == "fused" and _common.ops is None:
            raise RuntimeError(
                f"nalu_cuda.{name}: backend='fused' needs the native extension, which failed to load: "
                f"{_common.LOAD_ERROR}"
            )
        if backend == "auto" and _common.ops is None:
            _warn_fallback_once()
        self.in_features = in_features
        self.out_features = out_features
        self.ensemble = ensemble
        self.backend = backend
        self.init = init_presets.check_preset(name, init)
        self._factory = {"device": device, "dtype": dtype}

    def _param(self, *shape: int) -> nn.Parameter:
        lead = () if self.ensemble is None else (self.ensemble,)
        return nn.Parameter(torch.empty(*lead, *shape, **self._factory))

    def _members(self, generator: Generators):
        """(index into the parameters, generator) per member; index () for a plain layer."""
        if self.ensemble is None:
            if generator is not None and not isinstance(generator, torch.Generator):
                raise ValueError(f"nalu_cuda.{type(self).__name__}.reset_parameters: a plain layer takes one "
                                 f"torch.Generator, got {type(generator).__name__}")
            return [((), generator)]
        if generator is None or isinstance(generator, torch.Generator):
            return [((e,), generator) for e in range(self.ensemble)]
        gens = list(generator)
        if len(gens) != self.ensemble:
            raise ValueError(f"nalu_cuda.{type(self).__name__}.reset_parameters: expected {self.ensemble} "
                             f"generators (one per member), got {len(gens)}")
        return [((e,), g) for e, g in enumerate(gens)]

    def _init_roles(self):
        """(parameter, role) pairs in draw order, for :func:`nalu_cuda.init_presets.reset`."""
        return [(self.W_hat, "nac"), (self.M_hat, "nac")]

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        """Draws the parameters from the preset ``self.init``; see :mod:`nalu_cuda.init_presets`."""
        init_presets.reset(type(self).__name__, self.init, self._init_roles(), self._members(generator),
                           self.in_features, self.out_features)

    def use_fused(self, x: Tensor) -> bool:
        """Whether a call on ``x`` runs the native ops (constant for a given device and dtype)."""
        if self.backend == "reference":
            return False
        if self.backend == "fused":
            return True
        return (x.device.type, x.dtype) in self._kernel_dtypes

    def _check_input(self, x: Tensor) -> None:
        """x must be a floating-point tensor of the parameters' dtype; under autocast any floating
        dtype (autocast casts both sides). Checked here, not left to the matmul, so that the error
        names the layer and the argument on every backend."""
        dtype = self.W_hat.dtype
        if x.dtype == dtype:
            return
        name = type(self).__name__
        if not x.dtype.is_floating_point:
            raise ValueError(f"nalu_cuda.{name}: argument 'x' must be a floating-point tensor, got dtype {x.dtype}")
        if not torch.is_autocast_enabled(x.device.type):
            raise ValueError(
                f"nalu_cuda.{name}: argument 'x' must have the dtype of the layer's parameters ({dtype}), got "
                f"{x.dtype}; convert one of them (layer.to({x.dtype}) or x.to({dtype})) or run under torch.autocast"
            )

    def __prepare_scriptable__(self):
        # torch.jit.script calls this before compiling a module: fail with a clear message rather
        # than on the first Python construct TorchScript lacks.
        raise RuntimeError(
            f"nalu_cuda.{type(self).__name__}: torch.jit.script is not supported (the layer chooses between "
            "the fused ops and the reference in Python, and TorchScript is deprecated); use torch.compile or torch.export"
        )

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # nn.Module.state_dict put this layer's local metadata ({"version": ...}) in
        # destination._metadata[prefix[:-1]] before calling here: mark it as ours.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        local = getattr(destination, "_metadata", {}).get(prefix[:-1])
        if isinstance(local, dict):
            local[STATE_DICT_MARK] = LAYOUT
            local[STATE_DICT_KIND] = _layer_kind(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A state dict written by another module class (same names, (out, in) weights) is refused
        # through error_msgs, which load_state_dict raises as a RuntimeError, strict or not.
        problem = _layout_problem(self, state_dict, prefix, local_metadata)
        if problem is not None:
            error_msgs.append(problem)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _base_repr(self) -> str:
        ens = "" if self.ensemble is None else f", ensemble={self.ensemble}"
        return f"in_features={self.in_features}, out_features={self.out_features}{ens}"
