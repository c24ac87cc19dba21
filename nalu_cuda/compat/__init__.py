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

kevinzakka/NALU-pytorch (``models/nac.py``, ``models/nalu.py``; **eps 1e-10**; no gate bias)
    ==========================  ==================  ===============================
    theirs                      ours                shape (theirs -> ours)
    ==========================  ==================  ===============================
    ``W_hat`` / ``M_hat``       ``W_hat`` / ``M_hat``  NAC cell, (out, in) -> (in, out)
    ``nac.W_hat`` / ``nac.M_hat`` ``W_hat`` / ``M_hat``  NALU cell, (out, in) -> (in, out)
    ``G``                       ``G``               (out, in) -> (in, out)
    ==========================  ==================  ===============================

    The same keys are those of stable-nalu's first ``NALULayer`` (``stable_nalu/layer/nalu.py``
    before its ``AbstractNALULayer``): :func:`from_kevinzakka` reads those too.

    Their NALU's eps is 1e-10 (:data:`KEVINZAKKA_EPS`), nalu_cuda's default 1e-7: a converted NALU
    needs ``NALU(in, out, eps=1e-10)``, and :func:`from_kevinzakka` warns so on every NALU it
    converts. :func:`kevinzakka_layer` (one layer) and :func:`kevinzakka_model` (their ``models.NAC``
    / ``models.NALU`` stack) build our layers with their eps and weights.

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
    ``W`` (ReRegualizedLinearNAC)      ``NAU.W``                   (out, in) -> (in, out)
    ``W`` (ReRegualizedLinearMNAC)     ``NMU.W``                   (out, in) -> (in, out)
    ``nac_add.W``, ``nac_mul.W``       none                        ReRegualizedLinearNALU: refused
    =================================  ==========================  ==============================

    Their ``nalu_mul`` ('safe', 'trig') and ``nalu_gate`` ('gumbel', ...) options leave no trace in
    a state dict: a checkpoint trained with them converts, but computes another function here.

``nn.Linear`` layout (:func:`to_linear_layout`, :func:`from_linear_layout`)
    Our own keys with every matrix transposed to ``(out, in)`` (``(E, out, in)`` for an
    ensemble); for code that multiplies ``F.linear(x, W)``.

:class:`StableNACLayer`, :class:`StableNALULayer`, :class:`StableNAULayer` and :class:`StableNMULayer`
take the constructor arguments of stable-nalu's ``NACLayer``, ``NALULayer``, ``ReRegualizedLinearNACLayer``
and ``ReRegualizedLinearMNACLayer``, draw their initialisation (same seed, same numbers), return their
``regualizer()`` entries (``'g'``, ``'z'`` from ``regualizer_z``; ``'W'``, ``'z'``, ``'W-OOB'``), run their
``optimize()`` and write their writer's logs (same tags, same conditions, their ``(out, in)`` layout).
stable-nalu collects regularisers (and ``optimize``, ``log_gradients``, ``set_parameter``) only from
children that are its ``ExtendedTorchModule``: :func:`stable_nalu_layers` and :func:`stable_nalu_cells`
make classes that are (built once per base class, picklable: their ``save_model`` works), registrable
under their unit names::

    from stable_nalu.abstract import ExtendedTorchModule
    from stable_nalu.layer.generalized import unit_name_to_layer_class, unit_name_to_cell_class
    unit_name_to_layer_class.update(nalu_cuda.compat.stable_nalu_layers(ExtendedTorchModule))
    unit_name_to_cell_class.update(nalu_cuda.compat.stable_nalu_cells(ExtendedTorchModule))

(``'NAC'``, ``'NALU'``, ``'ReRegualizedLinearNAC'``, ``'ReRegualizedLinearMNAC'``; their other units
are not provided.) :func:`stable_nalu_units` returns the first two, as before.
"""
from __future__ import annotations

from .common import from_linear_layout, mark_nalu_cuda, to_linear_layout
from .kevinzakka import KEVINZAKKA_EPS, from_kevinzakka, kevinzakka_layer, kevinzakka_model, to_kevinzakka
from .stable_nalu import (STABLE_NALU_UNIT_NAMES, StableNACLayer, StableNALULayer, StableNAULayer, StableNMULayer,
                          from_stable_nalu, stable_nalu_cells, stable_nalu_layers, stable_nalu_units, to_stable_nalu)

__all__ = [
    "from_kevinzakka", "to_kevinzakka", "kevinzakka_layer", "kevinzakka_model", "KEVINZAKKA_EPS",
    "from_stable_nalu", "to_stable_nalu", "from_linear_layout", "to_linear_layout", "mark_nalu_cuda",
    "StableNALULayer", "StableNACLayer", "StableNAULayer", "StableNMULayer", "stable_nalu_units",
    "stable_nalu_layers", "stable_nalu_cells", "STABLE_NALU_UNIT_NAMES",
]
