"""The plugin interface every experiment implements, and the registry the CLI reads.

An experiment module builds one :class:`Experiment` and calls :func:`register` at import time;
:data:`nalu_cuda.experiments.EXPERIMENT_MODULES` lists the modules that the package imports, so
adding a module name there is all it takes to get:

* a subcommand ``nalu-cuda <name> ...`` (arguments from ``add_arguments``, configurations from
  ``configs``), with the shared options ``--device --seeds --steps --out --resume --overwrite
  --no-progress --threads``;
* a part of ``nalu-cuda reproduce --profile quick|paper`` (configurations from ``profile_configs``);
* one record per configuration in ``summary.json``, one row per seed in
  ``per_seed_<experiment>.csv``, a section of ``report.md``, checkpoints and ``--resume``.

The flow, driven by :mod:`nalu_cuda.experiments.runner`, for every :class:`Config`:

1. ``run(config, ctx)`` trains all seeds (ideally as one ensemble) and returns a
   :class:`RunOutput`: one JSON-serialisable dict per seed (``records``) and optional
   configuration-level data (``extra``: curves, predictions for plots; JSON-serialisable).
   Long runs call ``ctx.save_checkpoint(obj)`` now and then and start with
   ``ctx.load_checkpoint()`` (``None`` when there is nothing to resume).
2. The runner writes ``<out>/runs/<experiment>/<config.name>/result.json`` atomically, with the
   configuration's fingerprint, as soon as the configuration finishes; ``--resume`` skips
   configurations whose result is there and refuses (clear error) results or checkpoints whose
   fingerprint differs.
3. ``summarize(config, records, extra)`` gives the configuration's ``summary.json`` record. The
   default, :func:`default_summary`, copies the configuration's identity and parameters and adds
   the rates and medians of the standard per-seed keys below that the records have.
4. ``report_section(results, out_dir)`` returns the experiment's Markdown section of
   ``report.md`` (it may write PNG plots into ``out_dir`` and link them by relative path).

Standard per-seed keys (all optional; use them where they apply, so that summaries, CSVs and
reports stay comparable across experiments):

=================  ===========================================================================
``seed``           int, the seed of this member (always present)
``success``        bool, the experiment's success criterion (Madsen & Johansen 2020 for arithmetic)
``diverged``       bool, the loss, weights or gradients of this member went NaN/Inf
``solved_at``      int or None, first evaluated step meeting the success criterion
``best_step``      int, the step chosen by validation loss (model selection on validation only)
``interp_error``   float, the paper's normalised error (100 = random init, 0 = perfect), interpolation
``extrap_error``   float, the same on the extrapolation test
``interp_mse``     float, raw MSE on interpolation / validation data
``extrap_mse``     float, raw MSE on the extrapolation test
``sparsity_error`` float, max_ij min(|W_ij|, |1 - |W_ij||) (Madsen & Johansen)
``accuracy``       float in [0, 1], where an experiment measures accuracy
=================  ===========================================================================

This interface is kept stable: later changes only add optional fields with defaults.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .stats import default_summary, wilson_interval  # noqa: F401  (part of the plugin interface)

__all__ = [
    "Config",
    "Context",
    "RunOutput",
    "ConfigResult",
    "Experiment",
    "register",
    "get",
    "all_experiments",
    "wilson_interval",
    "default_summary",
    "PROFILES",
]

PROFILES = ("quick", "paper")


@dataclass(frozen=True)
class Config:
    """One configuration: every seed of it trains together and gives one ``summary.json`` record.

    ``name`` must be unique within the experiment and safe as a directory name (letters, digits,
    ``-_.=``). ``params`` holds everything else the run needs (model, op, ranges, learning rate...);
    it must be JSON-serialisable, and it is part of the fingerprint that guards ``--resume``.
    """

    experiment: str
    name: str
    seeds: int
    steps: int
    params: Dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.experiment}/{self.name}"

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Config":
        return Config(d["experiment"], d["name"], int(d["seeds"]), int(d["steps"]), dict(d.get("params", {})))

    def fingerprint(self) -> str:
        """A hash of everything that defines the run (not the device: results are comparable)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class Context:
    """What ``run`` gets besides its configuration.

    ``device``: torch device string. ``work_dir``: the configuration's own directory (exists).
    ``progress``: whether to show a tqdm bar. ``dtype``: ``"float32"`` or ``"float64"``.
    ``save_checkpoint(obj)`` / ``load_checkpoint()``: mid-run state for ``--resume`` (any object
    ``torch.save`` accepts; the runner stamps and checks the fingerprint). ``log(msg)``: a line
    for the user that does not break the progress bar.
    """

    device: str
    work_dir: str
    progress: bool = True
    dtype: str = "float32"
    save_checkpoint: Callable[[Any], None] = lambda obj: None
    load_checkpoint: Callable[[], Optional[Any]] = lambda: None
    log: Callable[[str], None] = print
    checkpoint_every_s: float = 60.0


@dataclass
class RunOutput:
    """What ``run`` returns: one dict per seed, and configuration-level extras (both JSON-able)."""

    records: List[Dict[str, Any]]
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ConfigResult:
    """A finished configuration as the report sees it.

    ``summaries``: every ``summary.json`` record of the configuration (one, or one per packed
    sub-configuration, e.g. per operation); ``summary`` is the first of them.
    """

    config: Config
    records: List[Dict[str, Any]]
    summary: Dict[str, Any]
    extra: Dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    summaries: List[Dict[str, Any]] = field(default_factory=list)


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    return None


def _default_report(results: Sequence[ConfigResult], out_dir: str) -> str:
    lines = ["| configuration | seeds | steps | success | diverged |", "|---|---|---|---|---|"]
    for r in results:
        s = r.summary
        succ = s.get("success_rate")
        succ_txt = "" if succ is None else f"{100 * succ:.0f}% [{100 * s['success_ci'][0]:.0f}, {100 * s['success_ci'][1]:.0f}]"
        div = s.get("divergence_rate")
        div_txt = "" if div is None else f"{100 * div:.0f}%"
        lines.append(f"| {r.config.name} | {r.config.seeds} | {r.config.steps} | {succ_txt} | {div_txt} |")
    return "\n".join(lines) + "\n"


@dataclass
class Experiment:
    """An experiment plugin.

    * ``name``: the subcommand and the ``experiment`` field of every record.
    * ``help``: one line for ``nalu-cuda --help``.
    * ``add_arguments(parser)``: the subcommand's own options (the shared ones are added by the CLI:
      ``--device --seeds --steps --out --resume --overwrite --no-progress --threads``). ``--seeds`` and
      ``--steps`` default to ``None``; ``configs`` picks the experiment's defaults then.
    * ``configs(args) -> [Config]``: the configurations of one subcommand call. Raise
      ``ValueError`` with a clear message for bad arguments (the CLI prints it and exits with 2).
    * ``profile_configs(profile) -> [Config]``: the configurations of ``reproduce --profile``
      (``"quick"``: a budget that fits a 2-core CPU; ``"paper"``: the published budgets).
    * ``run(config, ctx) -> RunOutput``.
    * ``summarize(config, records, extra) -> dict | [dict]``: the ``summary.json`` record (default
      :func:`default_summary`); a list when one configuration packs several (e.g. several
      operations trained as one ensemble: one record per operation).
    * ``report_section(results, out_dir) -> str``: Markdown for ``report.md`` (a default table).
    * ``order``: position in ``reproduce`` and in the report (lower first).
    * ``profiles``: the profiles it has (``reproduce --profile standard`` runs only the experiments
      that have one: the static task's, Madsen & Johansen's table at 100 seeds).
    * ``memory_needs(config) -> [resources.Need]``: the tensors that dominate a run's memory, each
      with the options that make it grow; the CLI refuses a configuration whose sum cannot fit
      (:func:`.resources.check_memory`). None: nothing is checked.

    What the core reads of a task instead of importing it (the core never imports a task):

    * ``merges``: how each field of ``extra`` merges when the configuration's seeds ran as blocks
      (``{field: rule}``, rules in :mod:`.seed_blocks`; a field not named must be equal in every
      block); ``None``: the experiment's seeds never split (:func:`.seed_blocks.splittable`).
      ``derived_merges``: ``{field: (source field, rule)}``, fields computed from merged ones after them.
    * ``cost_factor``: relative cost of one training step of one seed (static = 1), and
      ``model_costs``: relative cost of a step per model name of the task, or per configuration
      name (either over :data:`.costs.MODEL_FACTORS`, :func:`.costs.config_factor`);
      the balance of sharded runs and the estimates of ``nalu-cuda list`` depend on them.
    * ``published_budget``: ``(seeds, steps)`` of the publication the report compares with, where it
      is not the ``paper`` profile's (:func:`.verdicts.published_budget`).
    """

    name: str
    help: str
    configs: Callable[[argparse.Namespace], List[Config]]
    profile_configs: Callable[[str], List[Config]]
    run: Callable[[Config, Context], RunOutput]
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    summarize: Optional[Callable[[Config, List[Dict[str, Any]], Dict[str, Any]], Dict[str, Any]]] = None
    report_section: Callable[[Sequence[ConfigResult], str], str] = _default_report
    order: int = 100
    profiles: Tuple[str, ...] = ("quick", "paper")
    memory_needs: Optional[Callable[[Config], Sequence[Any]]] = None
    merges: Optional[Dict[str, Callable]] = None
    derived_merges: Dict[str, Tuple[str, Callable]] = field(default_factory=dict)
    cost_factor: float = 1.0
    model_costs: Dict[str, float] = field(default_factory=dict)
    published_budget: Optional[Tuple[int, float]] = None

    def memory(self, config: Config) -> List[Any]:
        """What ``memory_needs`` declares for ``config`` (nothing when the experiment declares nothing)."""
        return [] if self.memory_needs is None else list(self.memory_needs(config))

    def summary(self, config: Config, records: List[Dict[str, Any]], extra: Dict[str, Any]):
        if self.summarize is None:
            return default_summary(config, records)
        return self.summarize(config, records, extra)


_REGISTRY: Dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Add an experiment (called once at module import). Names must be unique."""
    if not isinstance(experiment, Experiment):
        raise TypeError(f"nalu_cuda.experiments.register: expected an Experiment, got {type(experiment).__name__}")
    old = _REGISTRY.get(experiment.name)
    if old is not None and old is not experiment and old.run.__module__ != experiment.run.__module__:
        raise ValueError(f"nalu_cuda.experiments.register: experiment {experiment.name!r} is already registered "
                         f"by {old.run.__module__}")
    _REGISTRY[experiment.name] = experiment
    return experiment


def get(name: str) -> Experiment:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def all_experiments() -> List[Experiment]:
    """Registered experiments in report order."""
    return sorted(_REGISTRY.values(), key=lambda e: (e.order, e.name))
