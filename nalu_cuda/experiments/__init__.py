"""The paper's experiments, behind one plugin registry (see :mod:`.registry`), in three floors:

* the core, this folder: :mod:`.registry` (the plugin interface), :mod:`.runner` (runs configurations,
  writes results), :mod:`.report` (``report.md``, number formats, plots), :mod:`.stats` (summaries and
  intervals), :mod:`.plugin` (what a task module calls to register itself), :mod:`.argtypes` (the
  options' argument types);
* the shared parts, :mod:`.parts`: seeding, ensemble layers, models, Adam, the training loops, data;
* the tasks, :mod:`.tasks`: one thin module per experiment (its data, its model choice, its report).

Each floor imports only the floors below it (the core never imports a part or a task: what it needs
of a task, e.g. how its seed blocks merge, the task declares in :func:`~.plugin.register_task`), and
no modules import each other in a circle: ``lint-imports`` (pyproject.toml) and ``.ci/import_cycles.py``.

Every module named in :data:`EXPERIMENT_MODULES` (relative to this package) is imported here and
registers one :class:`~nalu_cuda.experiments.registry.Experiment`; the ``nalu-cuda`` CLI builds one
subcommand per registered experiment and ``nalu-cuda reproduce`` runs all of them. To add an
experiment, write a module that calls :func:`~nalu_cuda.experiments.registry.register` (or
:func:`~nalu_cuda.experiments.plugin.register_task`) and add its name here (one per line).
"""
from __future__ import annotations

import importlib

from .registry import (  # noqa: F401
    Config,
    ConfigResult,
    Context,
    Experiment,
    RunOutput,
    all_experiments,
    get,
    default_summary,
    register,
    wilson_interval,
)
from .parts.layers import EnsembleCNN, EnsembleEmbedding, EnsembleLinear, GatedCell  # noqa: F401
from .parts.optim import FlatAdam  # noqa: F401
from .parts.seeding import member_generators  # noqa: F401
from .parts.training import BestState, EvalSet, generator_state, train_ensemble  # noqa: F401
from .plugin import register_task, resolve_backend, resolve_device, run_options, seed_list  # noqa: F401
from .report import fmt_ci, fmt_num  # noqa: F401
from .stats import interval_summary, mean_ci  # noqa: F401

EXPERIMENT_MODULES = [
    "tasks.identity",
    "tasks.static",
    "tasks.recurrent",
    "tasks.digits", "tasks.language", "tasks.programs", "tasks.parity",
    "tasks.gridworld",
]



def _import_all() -> None:
    for name in EXPERIMENT_MODULES:
        importlib.import_module(f"{__name__}.{name}")


_import_all()
