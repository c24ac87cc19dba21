"""The paper's experiments, behind one plugin registry (see :mod:`.registry`).

Every module named in :data:`EXPERIMENT_MODULES` is imported here and registers one
:class:`~nalu_cuda.experiments.registry.Experiment`; the ``nalu-cuda`` CLI builds one subcommand
per registered experiment and ``nalu-cuda reproduce`` runs all of them. To add an experiment,
write a module that calls :func:`~nalu_cuda.experiments.registry.register` and add its name here
(one per line).
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
    register,
    wilson_interval,
)

EXPERIMENT_MODULES = [
    "identity",
    "static",
    "recurrent",
    "digits", "language", "programs", "parity",
    "gridworld",
]



def _import_all() -> None:
    for name in EXPERIMENT_MODULES:
        importlib.import_module(f"{__name__}.{name}")


_import_all()
