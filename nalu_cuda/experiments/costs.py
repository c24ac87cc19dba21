"""What a configuration costs to train: the cost model behind ``nalu-cuda list``'s hours, the
balance of :mod:`.distributed`'s shards and the price of the published budget that the verdicts
state beside an inconclusive claim (:mod:`.verdicts`). Only estimates: no result depends on them.

A configuration costs seeds x steps x its experiment's factor (:data:`COST_FACTORS`, declared by each
experiment as its ``cost_factor``) x its model's factor (:func:`config_factor`), in units of one
static NAC seed-step; one CPU core trains :data:`CPU_UNITS_PER_S` units a second.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Sequence

from .registry import Config, all_experiments

__all__ = ["COST_FACTORS", "MODEL_FACTORS", "MLP_FACTOR", "CPU_UNITS_PER_S", "model_factor", "config_factor",
           "estimated_cost", "estimated_hours", "fmt_hours"]


class _CostFactors(Mapping):
    """Relative cost of one training step of one seed, per experiment (static = 1): rough measurements
    of the quick profile on a CPU, declared by each experiment (its ``cost_factor``). Only the balance
    of the shards depends on them, never a result."""

    def _declared(self) -> Dict[str, float]:
        return {e.name: e.cost_factor for e in all_experiments()}

    def __getitem__(self, name: str) -> float:
        return self._declared()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._declared())

    def __len__(self) -> int:
        return len(self._declared())


COST_FACTORS: Mapping[str, float] = _CostFactors()

# Relative cost of a step per model and operation (``params["model"]``; NAC = 1, an unlisted model 1.5), on the
# 2-core CPU, 1 thread, since the static task's native steps (2026-12-03; benchmarks/RESULTS.md section 22):
# the standard profile's cells on two torchrun ranks give the NAU model 1.65 (100 seeds x 1e5 steps x 2
# operations in 672 s), the NMU model 0.95 (100 seeds x 3e6 steps as two blocks of 50, 2846 and 2786 s) and the MLPs MLP_FACTOR
# (standard-linear-add, 100 x 1.5e5 in 1158 s) against standard-nac-add's rate (CPU_UNITS_PER_S); whole
# static runs (`OMP_NUM_THREADS=1 python benchmarks/cost_factors.py`, 8 seeds x 600 steps, one op) NALU 1.5,
# NAC-mul 2.0, NALU separate/independent gate 3.3; whole recurrent runs (against the recurrent NAC) LSTM 24
# and GRU 21; a training step of a two-layer module stack (the units no task builds yet, against NAC's)
# NPU 5.6, RealNPU 5.5, iNALU 7.4. Good to about a factor of 1.5 (the machine is shared).
NMU_STANDARD = 0.95
MODEL_FACTORS: Dict[str, float] = {
    "nac": 1.0, "nac-mul": 2.0, "nalu": 1.5, "nalu-separate": 3.3, "nalu-indgate": 3.3, "nalu-separate-indgate": 3.3,
    "lstm": 24.0, "gru": 21.0, "nau": 1.65, "nmu": NMU_STANDARD, "npu": 5.6, "realnpu": 5.5, "real-npu": 5.5,
    "inalu": 7.4,
}
MLP_FACTOR = 3.7  # linear, relu, relu6 and the other activations: torch's batched products (autograd step)


def model_factor(model: Any) -> float:
    """:data:`MODEL_FACTORS` of a model name (any case, ``_`` for ``-``); 1 without a model,
    :data:`MLP_FACTOR` for ``linear`` and ``none``, else what an experiment declares for it (its
    ``model_costs``: the identity task's activations), 1.5 for a model not measured."""
    if not isinstance(model, str):
        return 1.0
    key = model.strip().lower().replace("_", "-")
    if key in MODEL_FACTORS:
        return MODEL_FACTORS[key]
    if key in ("linear", "none"):
        return MLP_FACTOR
    for exp in all_experiments():
        if key in exp.model_costs:
            return exp.model_costs[key]
    return 1.5


# Cost units (:func:`estimated_cost`) one CPU core trains per second: measured on the 2-core CPU machine,
# one thread per rank, two ranks (2026-12-03, `torchrun --nproc-per-node 2 -m nalu_cuda reproduce --profile
# standard`, the static task's native step, other work beside it): standard-nac-add (100 seeds x 5e5 steps)
# 1037 s and standard-nac-sub 101 s, 4.8e4 and 5.0e4 units/s. (Before the native step: 1396 s, 3.6e4.) So an
# estimate in hours (`nalu-cuda list`) is good to about a factor of 1.5 for the arithmetic tasks; the
# sequence tasks' cost factors are their CPU seconds per seed-step in these units, measured at their paper
# shapes (benchmarks/cost_factors.py --sequence, benchmarks/RESULTS.md sections 18, 22 and 23), to about 25%
# on a core of its own.
CPU_UNITS_PER_S = 4.8e4


def estimated_hours(cfgs: Sequence[Config], ranks: int = 1) -> float:
    """Hours to train ``cfgs`` on this machine's CPU cores, one per rank (seeds split into blocks)."""
    return sum(estimated_cost(c) for c in cfgs) / (CPU_UNITS_PER_S * ranks * 3600.0)


def config_factor(cfg: Config) -> float:
    """The relative cost of a step of ``cfg``'s model: what its experiment declares for the
    configuration by name or for its model (``model_costs``, measured per task where the task's
    other parts make the models' costs differ from the arithmetic tasks': the sequence tasks), else
    :func:`model_factor` of its model."""
    exp = next((e for e in all_experiments() if e.name == cfg.experiment), None)
    costs = exp.model_costs if exp is not None else {}
    model = cfg.params.get("model")
    key = model.strip().lower().replace("_", "-") if isinstance(model, str) else None
    for k in (cfg.name, key):
        if k in costs:
            return costs[k]
    return model_factor(model)


def estimated_cost(cfg: Config) -> float:
    """Seeds x steps x :data:`COST_FACTORS` of the experiment (1 for one not listed) x the model's
    factor (:func:`config_factor`) x the number of operations it trains (``params["ops"]``: the
    arithmetic tasks train one member per seed and operation; 1 without). A block of seeds costs its
    share of its configuration's seeds."""
    ops = cfg.params.get("ops")
    n_ops = len(ops) if isinstance(ops, (list, tuple)) and ops else 1
    return cfg.seeds * cfg.steps * COST_FACTORS.get(cfg.experiment, 1.0) * config_factor(cfg) * n_ops


def fmt_hours(h: float) -> str:
    """An estimated duration, in the unit that reads best (``<1 min``, ``~12 min``, ``~3.4 h``, ``~6 days``)."""
    if h * 60 < 1:
        return "<1 min"
    return f"~{h * 60:.0f} min" if h < 1 else f"~{h:.1f} h" if h < 100 else f"~{h / 24:.0f} days"
