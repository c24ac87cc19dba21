"""Initialisation presets: one table, shared by every module (``init=`` argument).

A preset maps a parameter *role* to a fill function. A module lists its parameters with their
roles (``NALU``: ``W_hat``, ``M_hat``, ``W_hat_m``, ``M_hat_m`` are ``"nac"``, ``G`` is ``"gate"``
or ``"gate_independent"``, ``G_bias`` is ``"gate_bias"``; ``NAU``'s ``W`` is ``"nau"``, ``NMU``'s
``"nmu"``) and :func:`reset` fills them, member by member of an ensemble, parameter by parameter in
the listed order. A new module plugs in by naming its roles and, for a role no preset has yet, calling :func:`register` once per preset.

A fill function is ``fill(view, fan_in, fan_out, generator)``; it fills ``view`` in place.
``view`` is one member's parameter in this library's layout: ``(in, out)`` for a matrix, ``(out,)``
for a vector. Presets copied from a codebase that stores ``(out, in)`` (``nn.Linear``'s layout)
draw into an ``(out, in)`` buffer and copy its transpose, so that the same seed gives the same
numbers as that codebase.

=================  ====================================================================================
preset             what it draws
=================  ====================================================================================
``stable-nalu``    (the default) ``"nac"``: U(-r, r), ``r = min(0.5, sqrt(3) sqrt(2 / (in + out)))``
                   (Madsen & Johansen's NAU bound); ``"gate"``: Glorot uniform,
                   U(-sqrt(6 / (in + out)), +sqrt(6 / (in + out))) (their NALU gate: gain 1);
                   ``"gate_independent"``, ``"gate_bias"``: 0; ``"nau"`` (NAU's ``W``): U(-r, r), the
                   same ``r``; ``"nmu"`` (NMU's ``W``): U(0.25, 0.75). Drawn in ``(in, out)`` order.
``stable-nalu-nac`` exactly what stable-nalu's ``NACLayer`` / ``NALULayer.reset_parameters`` draw, in
                   their ``(out, in)`` order: ``"nac"``: U(-r, r) with ``r`` the root of
                   ``max(in + out, 5) * Var[tanh(w) sigmoid(m)](r) = 2`` (their ``nac_w_optimal_r``,
                   solved by bisection on [0, 10]); ``"gate"``: Glorot uniform as above;
                   ``"gate_bias"``: 0 (their ``bias_add``); ``"nau"``, ``"nmu"``: the distributions of
                   ``"stable-nalu"``, in the ``(out, in)`` order of their ``ReRegualizedLinearNAC`` /
                   ``ReRegualizedLinearMNAC.reset_parameters``.
``kaiming``        kevinzakka/NALU-pytorch, in its ``(out, in)`` order: ``"nac"``:
                   ``kaiming_uniform_`` (a = 0), U(-sqrt(6 / in), +sqrt(6 / in)); ``"gate"``:
                   ``kaiming_uniform_(a=sqrt(5))``, U(-1 / sqrt(in), +1 / sqrt(in));
                   ``"gate_independent"``, ``"gate_bias"``: 0 (that code has neither); no ``"nau"``,
                   ``"nmu"`` (that code has no NAU / NMU: ``NAU(init="kaiming")`` is refused).
=================  ====================================================================================

The paper (Trask et al., 2018) states no initialisation distribution (only that the best of 10
initialisations was kept), so there is no ``"paper"`` preset.

Reproducibility: :func:`reset` takes one ``torch.Generator``, or one per ensemble member; member
``e`` filled with generator ``g_e`` equals a plain layer filled with ``g_e``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["PRESETS", "DEFAULT", "Fill", "register", "fill_for", "reset", "check_preset", "nac_optimal_bound"]

Fill = Callable[[Tensor, int, int, Optional[torch.Generator]], None]

DEFAULT = "stable-nalu"


def _uniform(bound: Callable[[int, int], float]) -> Fill:
    def fill(view: Tensor, fan_in: int, fan_out: int, generator: Optional[torch.Generator]) -> None:
        r = bound(fan_in, fan_out)
        view.uniform_(-r, r, generator=generator)

    return fill


def _range(low: float, high: float) -> Fill:
    def fill(view: Tensor, fan_in: int, fan_out: int, generator: Optional[torch.Generator]) -> None:
        view.uniform_(low, high, generator=generator)

    return fill


# stable-nalu's ReRegualizedLinearMNAC: U(0.5 - r, 0.5 + r), r = min(0.25, sqrt(3) sqrt(1/4)) = 0.25
NMU_INIT_RANGE = (0.25, 0.75)


def _zeros(view: Tensor, fan_in: int, fan_out: int, generator: Optional[torch.Generator]) -> None:
    view.zero_()


def _out_in_order(fill: Fill) -> Fill:
    """``fill`` drawn in ``(out, in)`` order (``nn.Linear``'s), copied transposed into an ``(in, out)`` view."""

    def wrapped(view: Tensor, fan_in: int, fan_out: int, generator: Optional[torch.Generator]) -> None:
        if view.dim() != 2:
            fill(view, fan_in, fan_out, generator)
            return
        buf = torch.empty(view.shape[1], view.shape[0], dtype=view.dtype, device=view.device)
        fill(buf, fan_in, fan_out, generator)
        view.copy_(buf.t())

    return wrapped


def nau_bound(fan_in: int, fan_out: int) -> float:
    return min(0.5, math.sqrt(3.0) * math.sqrt(2.0 / (fan_in + fan_out)))


def _glorot_bound(fan_in: int, fan_out: int) -> float:
    return math.sqrt(6.0 / (fan_in + fan_out))


def _nac_weight_variance(r: float) -> float:
    """Var[tanh(w) sigmoid(m)] for w, m ~ U(-r, r) (stable-nalu's ``nac_w_variance``)."""
    if r == 0:
        return 0.0
    return (1 - math.tanh(r) / r) * (r - math.tanh(r / 2)) * (1 / (2 * r))


def nac_optimal_bound(fan_in: int, fan_out: int) -> float:
    """stable-nalu's ``nac_w_optimal_r``: the r in [0, 10] with ``max(in + out, 5) Var(r) = 2``.

    Bisection to the last bit (stable-nalu's ``scipy.optimize.bisect`` stops at about 2e-12; the
    bound's draws then differ from theirs by at most that, relatively).
    """
    fan = max(fan_in + fan_out, 5)
    lo, hi = 0.0, 10.0
    f_lo = fan * _nac_weight_variance(lo) - 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        f_mid = fan * _nac_weight_variance(mid) - 2
        if (f_mid < 0) == (f_lo < 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _kaiming(a: float) -> Fill:
    def fill(buf: Tensor, fan_in: int, fan_out: int, generator: Optional[torch.Generator]) -> None:
        torch.nn.init.kaiming_uniform_(buf, a=a, generator=generator)

    return fill


# preset -> role -> fill. Modules of other units add their roles with register().
PRESETS: Dict[str, Dict[str, Fill]] = {
    "stable-nalu": {
        "nac": _uniform(nau_bound),
        "gate": _uniform(_glorot_bound),
        "gate_independent": _zeros,
        "gate_bias": _zeros,
        "nau": _uniform(nau_bound),
        "nmu": _range(*NMU_INIT_RANGE),
    },
    "stable-nalu-nac": {
        "nac": _out_in_order(_uniform(nac_optimal_bound)),
        "gate": _out_in_order(_uniform(_glorot_bound)),
        "gate_independent": _zeros,
        "gate_bias": _zeros,
        "nau": _out_in_order(_uniform(nau_bound)),
        "nmu": _out_in_order(_range(*NMU_INIT_RANGE)),
    },
    "kaiming": {
        "nac": _out_in_order(_kaiming(0.0)),
        "gate": _out_in_order(_kaiming(math.sqrt(5.0))),
        "gate_independent": _zeros,
        "gate_bias": _zeros,
    },
}


def register(preset: str, role: str, fill: Fill) -> None:
    """Add (or replace) the fill of ``role`` under ``preset``; a new preset name starts a new preset."""
    PRESETS.setdefault(preset, {})[role] = fill


def check_preset(owner: str, preset) -> str:
    """``preset`` if it names a preset, else a ValueError naming ``owner``'s argument ``init``."""
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"nalu_cuda.{owner}: argument 'init' must be one of {tuple(PRESETS)}, got {preset!r}")
    return preset


def fill_for(owner: str, preset: str, role: str) -> Fill:
    fills = PRESETS[check_preset(owner, preset)]
    if role not in fills:
        raise ValueError(f"nalu_cuda.{owner}: init preset {preset!r} has no rule for parameters of role {role!r} "
                         f"(it has {tuple(fills)}); add one with nalu_cuda.init_presets.register")
    return fills[role]


@torch.no_grad()
def reset(owner: str, preset: str, params: Sequence[Tuple[Tensor, str]], members, fan_in: int, fan_out: int) -> None:
    """Fill ``params`` ((parameter, role) pairs, in draw order) for each ``(index, generator)`` of
    ``members`` (``()`` indexes a plain layer's parameter, ``(e,)`` member e of an ensemble)."""
    fills = [(p, fill_for(owner, preset, role)) for p, role in params]
    for idx, gen in members:
        for p, fill in fills:
            fill(p[idx], fan_in, fan_out, gen)
