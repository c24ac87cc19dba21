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

# Relative cost of a step per model (``params["model"]``; NAC = 1, an unlisted model 1.5), measured on a
# 2-core CPU, 1 thread, with ``OMP_NUM_THREADS=1 python benchmarks/cost_factors.py`` (2026-12-01, a load of
# about 4, so +-20%): whole static runs (8 seeds x 600 steps, one op) gave NAC-mul 1.08, NALU 1.45,
# NALU separate/independent gate 1.58, the torch MLPs (linear, ReLU) 1.58-1.62; whole recurrent runs
# LSTM 3.73 and GRU 3.70 against the recurrent NAC; a training step of a two-layer module stack (the
# units no task builds yet) NAU 1.22, NMU 1.28, NPU 3.6, RealNPU 3.34, iNALU 4.89 against NAC's. The
# static task's "nmu" model (NAU -> NMU, weights clamped every step) at 50 seeds: 2.0 (CPU_UNITS_PER_S).
MODEL_FACTORS: Dict[str, float] = {
    "nac": 1.0, "nac-mul": 1.1, "nalu": 1.5, "nalu-separate": 1.6, "nalu-indgate": 1.6, "nalu-separate-indgate": 1.6,
    "lstm": 3.7, "gru": 3.7, "nau": 1.2, "nmu": 2.0, "npu": 3.6, "realnpu": 3.3, "real-npu": 3.3, "inalu": 4.9,
}
MLP_FACTOR = 1.6  # linear, relu, relu6 and the other activations: torch's batched products


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
# one thread per rank, two ranks (2026-12-03, `torchrun --nproc-per-node 2 -m nalu_cuda static --profile
# standard --threads 1`): standard-nac-add (100 seeds x 5e5 steps) 1396 s and standard-nac-sub 140 s,
# both 3.6e4 units/s; standard-linear-add 2.8e4; the NMU model's cell 50 seeds x 2.22e5 steps in 606 s
# (2.0 x NAC's cost per seed-step, with a third process beside the ranks). So an estimate in hours
# (`nalu-cuda list`) is good to about a factor of 1.5 for the arithmetic tasks; the sequence tasks' cost
# factors are measured at their paper shapes relative to standard-nac-add (benchmarks/cost_factors.py
# --sequence, benchmarks/RESULTS.md section 18), to about 25% on a core of its own.
CPU_UNITS_PER_S = 3.6e4


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
    factor (:func:`config_factor`). A block of seeds costs its share of its configuration's seeds."""
    return cfg.seeds * cfg.steps * COST_FACTORS.get(cfg.experiment, 1.0) * config_factor(cfg)


def fmt_hours(h: float) -> str:
    """An estimated duration, in the unit that reads best (``<1 min``, ``~12 min``, ``~3.4 h``, ``~6 days``)."""
    if h * 60 < 1:
        return "<1 min"
    return f"~{h * 60:.0f} min" if h < 1 else f"~{h:.1f} h" if h < 100 else f"~{h / 24:.0f} days"
