"""``nn.Module`` layers: :class:`NAC` (additive), :class:`NACMul` (multiplicative) and :class:`NALU`;
the units beyond the paper (NPU, RealNPU, INALU, NAU, NMU) are in :mod:`nalu_cuda.unit_modules`,
re-exported here.

Parameters use the ``(in, out)`` layout of the paper's ``y = x W``; with ``ensemble=E`` every
parameter gains a leading ``E`` and the layer runs ``E`` independent models on ``x`` of shape
``(E, ..., in)``.

``backend`` chooses the implementation:

* ``"fused"``: the native ops (:mod:`nalu_cuda.functional`); an error where none exists.
* ``"reference"``: the pure-PyTorch specification (:mod:`nalu_cuda.reference`), any device/dtype.
* ``"auto"`` (default): fused where a kernel exists for the input's device and dtype, else the
  reference. If the native extension is missing, ``"auto"`` warns once and uses the reference,
  unless the environment sets ``NALU_CUDA_REQUIRE_EXT=1``, which makes it an import error.

Parameter names, shapes and ``state_dict`` keys are the same for every backend.

Initialisation (``reset_parameters``): the preset named by ``init`` (see
:mod:`nalu_cuda.init_presets`): ``"stable-nalu"`` (the default), ``"stable-nalu-nac"`` (stable-nalu's
NAC/NALU draws, in their order) or ``"kaiming"`` (kevinzakka/NALU-pytorch's, in their order).
Passing ``generator`` (one ``torch.Generator``, or one per ensemble member) makes it reproducible;
member ``e`` initialised with generator ``g_e`` equals a single layer initialised with ``g_e``.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import _ops, functional, init_presets, reference
from .reference import DEFAULT_EPS, GATES

__all__ = ["NAC", "NACMul", "NALU", "NAU", "NMU", "NPU", "RealNPU", "INALU", "BACKENDS", "project_after_step"]

BACKENDS = ("auto", "fused", "reference")
Generators = Union[None, torch.Generator, Sequence[torch.Generator]]

_warned_fallback = False


def _warn_fallback_once() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"nalu_cuda: native extension not available ({_ops.LOAD_ERROR}); backend='auto' uses the "
            "pure-PyTorch reference path. Build with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_scalar(cls: str, name: str, value, positive: bool = True, dtype: Optional[torch.dtype] = None) -> float:
    """A scalar argument (eps, omega) as a float: any real number type (float, int, numpy scalars),
    finite (and positive), and so in the layer's dtype when it has one (reference.scalar_problem)."""
    problem = reference.scalar_problem(name, value, dtype, positive)
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
        if cls.__module__ in ("nalu_cuda.modules", "nalu_cuda.unit_modules") and not cls.__name__.startswith("_"):
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
    """What NAC, NACMul and NALU share: shapes, backend choice, initialisation helpers."""

    # (device type, dtype) pairs where backend="auto" runs the fused ops
    _kernel_dtypes: frozenset = _ops.KERNEL_DTYPES

    def __init__(self, in_features: int, out_features: int, ensemble: Optional[int], backend: str,
                 device=None, dtype=None, init: str = init_presets.DEFAULT) -> None:
        super().__init__()
        name = type(self).__name__
        _check_positive_int(name, "in_features", in_features)
        _check_positive_int(name, "out_features", out_features)
        _check_positive_int(name, "ensemble", ensemble, allow_none=True)
        if backend not in BACKENDS:
            raise ValueError(f"nalu_cuda.{name}: argument 'backend' must be one of {BACKENDS}, got {backend!r}")
        if backend == "fused" and _ops.ops is None:
            raise RuntimeError(
                f"nalu_cuda.{name}: backend='fused' needs the native extension, which failed to load: "
                f"{_ops.LOAD_ERROR}"
            )
        if backend == "auto" and _ops.ops is None:
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


class NAC(_ArithmeticLayer):
    """Neural Accumulator (NAC+): ``y = x W``, ``W = tanh(W_hat) * sigmoid(M_hat)``, no bias.

    Input ``(..., in)`` gives ``(..., out)``; with ``ensemble=E``, ``(E, ..., in)`` gives ``(E, ..., out)``.
    """

    def __init__(self, in_features: int, out_features: int, *, ensemble: Optional[int] = None,
                 backend: str = "auto", device=None, dtype=None, init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    @property
    def W(self) -> Tensor:
        """The effective weights ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if self.use_fused(x):
            return functional.nac(x, self.W_hat, self.M_hat)
        return reference.nac(x, self.W_hat, self.M_hat)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, backend={self.backend!r}"


class NACMul(_ArithmeticLayer):
    """Multiplicative NAC (NAC*): ``y = exp(log(|x| + eps) W)``, ``W = tanh(W_hat) * sigmoid(M_hat)``."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None,
                 init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        self.eps = _check_scalar("NACMul", "eps", eps, dtype=dtype or torch.get_default_dtype())
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        self.reset_parameters()

    W = NAC.W

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        if self.use_fused(x):
            return functional.nac_mul(x, self.W_hat, self.M_hat, self.eps)
        return reference.nac_mul(x, self.W_hat, self.M_hat, self.eps)

    def extra_repr(self) -> str:
        return f"{self._base_repr()}, eps={self.eps}, backend={self.backend!r}"


class NALU(_ArithmeticLayer):
    """Neural Arithmetic Logic Unit: ``y = g a + (1 - g) m``.

    ``a = x W`` and ``m = exp(log(|x| + eps) W_m)`` with ``W = tanh(W_hat) * sigmoid(M_hat)``;
    ``W_m = W`` when ``tied=True`` (the paper), else built from its own ``W_hat_m``, ``M_hat_m``.
    ``gate="input"``: ``g = sigmoid(x G)``, ``G`` of shape ``(in, out)`` (the paper), or
    ``g = sigmoid(x G + G_bias)`` with ``gate_bias=True`` (stable-nalu's ``nalu_bias``; ``G_bias`` of
    shape ``(out,)``, initialised to 0); ``gate="independent"``: ``g = sigmoid(G)``, ``G`` of shape ``(out,)``.

    ``keep_parts=True`` keeps the gate and both paths of the last call in ``self.parts``
    (:class:`nalu_cuda.functional.NaluParts`: ``a``, ``m``, ``g``), from the same forward and in the
    autograd graph, so that a gate regulariser (``(parts.g * (1 - parts.g)).sum()``) trains ``G``.
    """

    def __init__(self, in_features: int, out_features: int, *, eps: float = DEFAULT_EPS, tied: bool = True,
                 gate: str = "input", gate_bias: bool = False, keep_parts: bool = False,
                 ensemble: Optional[int] = None, backend: str = "auto", device=None, dtype=None,
                 init: str = init_presets.DEFAULT) -> None:
        super().__init__(in_features, out_features, ensemble, backend, device, dtype, init)
        if gate not in GATES:
            raise ValueError(f"nalu_cuda.NALU: argument 'gate' must be one of {GATES}, got {gate!r}")
        for name, flag in (("tied", tied), ("gate_bias", gate_bias), ("keep_parts", keep_parts)):
            if not isinstance(flag, bool):
                raise ValueError(f"nalu_cuda.NALU: argument '{name}' must be a bool, got {flag!r}")
        if gate_bias and gate != "input":
            raise ValueError("nalu_cuda.NALU: argument 'gate_bias' needs gate='input' (an input-independent "
                             f"gate sigmoid(G) is its own bias), got gate={gate!r}")
        self.eps = _check_scalar("NALU", "eps", eps, dtype=dtype or torch.get_default_dtype())
        self.tied = tied
        self.gate = gate
        self.keep_parts = keep_parts
        self.parts: Optional[functional.NaluParts] = None
        self.W_hat = self._param(in_features, out_features)
        self.M_hat = self._param(in_features, out_features)
        if tied:
            self.register_parameter("W_hat_m", None)
            self.register_parameter("M_hat_m", None)
        else:
            self.W_hat_m = self._param(in_features, out_features)
            self.M_hat_m = self._param(in_features, out_features)
        self.G = self._param(in_features, out_features) if gate == "input" else self._param(out_features)
        self.G_bias = self._param(out_features) if gate_bias else None
        self.reset_parameters()

    @property
    def gate_bias(self) -> bool:
        return self.G_bias is not None

    def _init_roles(self):
        roles = [(self.W_hat, "nac"), (self.M_hat, "nac")]
        if not self.tied:
            roles += [(self.W_hat_m, "nac"), (self.M_hat_m, "nac")]
        roles.append((self.G, "gate" if self.gate == "input" else "gate_independent"))
        if self.G_bias is not None:
            roles.append((self.G_bias, "gate_bias"))
        return roles

    @property
    def W(self) -> Tensor:
        """The effective weights of the additive path, ``tanh(W_hat) * sigmoid(M_hat)``."""
        return reference.nac_weight(self.W_hat, self.M_hat)

    @property
    def W_m(self) -> Tensor:
        """The effective weights of the multiplicative path (``W`` when tied)."""
        return self.W if self.tied else reference.nac_weight(self.W_hat_m, self.M_hat_m)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        fused = self.use_fused(x)
        if self.keep_parts:
            fn = functional.nalu_parts if fused else reference.nalu_parts
            y, a, m, g = fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                            G_bias=self.G_bias)
            self.parts = functional.NaluParts(a, m, g)
            return y
        fn = functional.nalu if fused else reference.nalu
        return fn(x, self.W_hat, self.M_hat, self.G, self.W_hat_m, self.M_hat_m, self.eps, self.gate,
                  G_bias=self.G_bias)

    def extra_repr(self) -> str:
        extra = (", gate_bias=True" if self.gate_bias else "") + (", keep_parts=True" if self.keep_parts else "")
        init = "" if self.init == init_presets.DEFAULT else f", init={self.init!r}"
        return (f"{self._base_repr()}, eps={self.eps}, tied={self.tied}, gate={self.gate!r}{extra}{init}, "
                f"backend={self.backend!r}")


# The units beyond the paper live in their own module; their names stay importable from here.
from .unit_modules import INALU, NAU, NMU, NPU, RealNPU, project_after_step  # noqa: E402
