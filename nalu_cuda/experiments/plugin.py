"""Writing a task module: registration, and the options and parameters every task reads.

A task module (see :mod:`nalu_cuda.experiments.tasks`) defines ``configs(args)``,
``profile_configs(profile)`` and ``run(config, ctx)``, and optionally ``add_arguments(parser)``,
``summarize(config, records, extra)``, ``report_section(results, out_dir)`` and
``memory_needs(config)`` (the run's dominant tensors, checked before it starts: :mod:`.resources`);
it ends with one call::

    EXPERIMENT = register_task(__name__, name="static", help="...", order=20)

which builds the :class:`~.registry.Experiment` from those functions and registers it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .registry import Config, Context, Experiment, register

__all__ = ["register_task", "add_backend_argument", "add_subset_argument", "subset_option", "add_task_model_arguments",
           "task_model_options", "run_options", "resolve_backend", "resolve_device", "seed_list", "run_setting",
           "profile_entry", "task_model_configs"]


def register_task(module_name: str, *, name: str, help: str, order: int,
                  summarize: Optional[Callable] = None, **declared: Any) -> Experiment:
    """Register the task module ``module_name`` (pass ``__name__``) from its functions, found by
    their names (``summarize`` overrides the module's own, e.g. :func:`.stats.interval_summary`).
    ``declared``: what the core reads of the task (:class:`~.registry.Experiment`'s ``merges``,
    ``derived_merges``, ``cost_factor``, ``model_costs``, ``published_budget``)."""
    mod = sys.modules[module_name]
    optional = {k: getattr(mod, k) for k in ("add_arguments", "report_section", "memory_needs")
                if hasattr(mod, k)}
    if hasattr(mod, "PROFILES"):
        optional["profiles"] = tuple(mod.PROFILES)
    return register(Experiment(name=name, help=help, configs=mod.configs, profile_configs=mod.profile_configs,
                               run=mod.run, summarize=summarize or getattr(mod, "summarize", None), order=order,
                               **optional, **declared))


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--backend auto|fused|reference`` for the NAC/NALU layers (skipped if the CLI already has it)."""
    try:
        parser.add_argument("--backend", choices=("auto", "fused", "reference"), default=None,
                            help="implementation of the NAC/NALU layers (default auto: fused where a kernel exists)")
    except argparse.ArgumentError:
        pass


def add_subset_argument(parser: argparse.ArgumentParser, option: str, allowed: Sequence[str]) -> None:
    """``option``: a comma-separated subset of ``allowed`` (default: all of them), read by :func:`subset_option`."""
    parser.add_argument(option, default=",".join(allowed), help=f"comma-separated subset of {','.join(allowed)}")


def subset_option(text: str, allowed: Sequence[str], option: str) -> List[str]:
    """The items of a comma-separated subset of ``allowed`` given to ``option`` (a ValueError naming the
    option for an empty list or an item not allowed)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or any(t not in allowed for t in items):
        raise ValueError(f"{option}: expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
    return items


def add_task_model_arguments(parser: argparse.ArgumentParser, tasks: Sequence[str], models: Sequence[str],
                             task_help: str) -> None:
    """``--task`` (one of ``tasks``, or ``both``) and ``--models`` (a subset of ``models``), read by
    :func:`task_model_options`."""
    parser.add_argument("--task", choices=tuple(tasks) + ("both",), default="both", help=task_help)
    add_subset_argument(parser, "--models", models)


def task_model_options(args: argparse.Namespace, tasks: Sequence[str],
                       models: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(tasks, models)`` chosen by the options of :func:`add_task_model_arguments`."""
    chosen = list(tasks) if args.task == "both" else [args.task]
    return chosen, subset_option(args.models, models, "--models")


def run_options(args: argparse.Namespace, params: Dict[str, Any], quick: Dict[str, Any]) -> Tuple[int, int]:
    """The common options of a subcommand: ``--backend`` into ``params`` when given; ``(seeds, steps)``
    from ``--seeds``/``--steps``, else the experiment's quick profile (``quick``)."""
    if getattr(args, "backend", None):
        params["backend"] = args.backend
    seeds = args.seeds if args.seeds is not None else quick["seeds"]
    steps = args.steps if args.steps is not None else quick["steps"]
    return seeds, steps


def resolve_backend(config: Config) -> str:
    """The NAC/NALU implementation of a configuration: its ``backend`` parameter (set from
    ``--backend``), else ``"auto"``."""
    return config.params.get("backend") or "auto"


def resolve_device(ctx: Context) -> torch.device:
    return torch.device(ctx.device or "cpu")


def run_setting(config: Config, ctx: Context) -> Tuple[torch.device, torch.dtype, str, List[int]]:
    """What every ``run`` starts from: ``(device, dtype, backend, seeds)``."""
    return resolve_device(ctx), getattr(torch, ctx.dtype or "float32"), resolve_backend(config), seed_list(config)


def profile_entry(experiment: str, profiles: Dict[str, Dict[str, Any]],
                  profile: str) -> Tuple[int, int, Dict[str, Any]]:
    """``(seeds, steps, params)`` of ``profile`` in a task's table of profiles (a clear error for an
    unknown one)."""
    if profile not in profiles:
        raise ValueError(f"{experiment}: unknown profile {profile!r}")
    pr = profiles[profile]
    return pr["seeds"], pr["steps"], dict(pr.get("params", {}))


def task_model_configs(experiment: str, tasks: Sequence[str], models: Sequence[str], seeds: int, steps: int,
                       **params) -> List[Config]:
    """One configuration ``<task>-<model>`` per pair, with parameters ``task`` and ``model``."""
    return [Config(experiment, f"{t}-{m}", seeds, steps, {**params, "task": t, "model": m})
            for t in tasks for m in models]


def seed_list(config: Config) -> List[int]:
    """Seed values of a configuration: ``first_seed .. first_seed + seeds - 1`` (default first 0)."""
    first = int(config.params.get("first_seed", 0))
    return list(range(first, first + int(config.seeds)))
