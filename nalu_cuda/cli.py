"""The ``nalu-cuda`` command (also ``python -m nalu_cuda``).

One subcommand per registered experiment (:mod:`nalu_cuda.experiments`), plus ``reproduce``
(every experiment's profile) and ``list``. Examples::

    nalu-cuda static --model nac --op add sub --interp 1 2 --extrap 2 6 --seeds 16 --steps 50000 --out runs/nac
    nalu-cuda identity --seeds 8 --steps 3000 --out runs/identity
    nalu-cuda recurrent --model nac lstm --op add --out runs/rec
    nalu-cuda reproduce --profile quick --out runs/quick
    nalu-cuda reproduce --profile quick --out runs/quick --resume     # after an interruption
    torchrun --nproc-per-node 4 -m nalu_cuda reproduce --out runs/quick   # configurations split over 4 ranks

Exit codes: 0 success; 2 bad arguments (refused before any work, naming the option, the value and
what is allowed: counts above their bounds, non-finite numbers, ranges whose targets overflow, runs
whose estimated memory exceeds the machine's), result/checkpoint files that cannot be used as asked,
or an output directory that is in use by another run, not writable, or holds files nalu-cuda did not
write (the message says what to do); 1 a file could not be written during the run (a full disk...)
or the run ran out of memory (one line; finished configurations are kept: ``--resume``); 130
interrupted (finished configurations are kept: ``--resume``).
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from typing import List, Optional, Sequence

import torch

from . import __version__
from .experiments import all_experiments, distributed, get, runner
# The argument types: the experiments' plugin API, re-exported here (their home before).
from .experiments.argtypes import (MAX_SEEDS, MAX_STEPS, at_most, comma_list, device,  # noqa: F401
                                   directory, finite_float, non_negative_float, non_negative_int,
                                   phase_step_count, positive_float, positive_int, seed_count, step_count,
                                   thread_count)
from .experiments.parts.mnist_data import mnist_directory  # noqa: F401  (re-exported)
from .experiments.costs import estimated_hours, fmt_hours
from .experiments.resources import check_memory

# The budgets of ``reproduce`` (see nalu_cuda.experiments.registry.Experiment.profiles).
PROFILES = ("quick", "standard", "decisive", "paper")

__all__ = ["main", "build_parser", "positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "finite_float", "at_most", "seed_count", "step_count", "phase_step_count", "thread_count", "comma_list",
           "directory", "mnist_directory", "device", "MAX_SEEDS", "MAX_STEPS"]

def _add_common(p: argparse.ArgumentParser, *, defaults_note: str = "the experiment's default") -> None:
    g = p.add_argument_group("run options")
    g.add_argument("--device", type=device, default="cpu",
                   help="torch device: cpu (default) or cuda[:N]; checked at start by a NALU step on it")
    g.add_argument("--seeds", type=seed_count, default=None,
                   help=f"seeds per configuration, at most {MAX_SEEDS:,} ({defaults_note})")
    g.add_argument("--steps", type=step_count, default=None,
                   help=f"training steps, at most {MAX_STEPS:,} ({defaults_note})")
    g.add_argument("--out", type=directory, default=None, metavar="DIR",
                   help="output directory: summary.json, per-seed CSVs, report.md, plots, checkpoints; a new or "
                        "empty directory, or one nalu-cuda wrote; one run at a time (default: nalu-results/<command>)")
    g.add_argument("--resume", action="store_true",
                   help="keep finished configurations in DIR and continue interrupted ones from their checkpoints")
    g.add_argument("--overwrite", action="store_true",
                   help="discard every earlier result and checkpoint of these configurations in DIR before the run, "
                        "and let nalu-cuda replace files in DIR that it did not write")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--threads", type=thread_count, default=None,
                   help="torch CPU threads, at most the CPU cores (default: 1; tiny models gain nothing from more)")
    g.add_argument("--checkpoint-every", type=non_negative_float, default=60.0, metavar="SECONDS",
                   help="seconds between mid-run checkpoints (default: 60)")


# How long ``reproduce --profile quick`` takes: one statement for ``reproduce -h`` and the README
# (benchmarks/RESULTS.md, section 3: 21 minutes estimated at a quiet machine's speed, 39 measured on a busy one).
REPRODUCE_QUICK_TIME = "about 20-40 minutes on 2 CPU cores"


def _task_options(p: argparse.ArgumentParser, before: set) -> tuple:
    """``(dest, option, default)`` of the options an experiment added to its subparser (``before``: the
    dests the parser had), the default converted as argparse converts a string default."""
    out = []
    for a in p._actions:
        if a.dest in before or not a.option_strings or a.dest == "profile":
            continue
        default = a.default
        if isinstance(default, str) and callable(a.type):
            try:
                default = a.type(default)
            except Exception:  # noqa: BLE001  (compared as given)
                pass
        out.append((a.dest, a.option_strings[0], default))
    return tuple(out)


def _default_namespace(p: argparse.ArgumentParser) -> argparse.Namespace:
    return argparse.Namespace(**{a.dest: a.default for a in p._actions if a.dest != "help"})


def _budget_text(cfgs) -> str:
    """``seeds`` and ``steps`` of a list of configurations, in words (one value, or the range)."""
    def one(vals):
        vals = sorted(set(vals))
        return f"{vals[0]:,}" if len(vals) == 1 else f"{vals[0]:,} to {vals[-1]:,} by configuration"
    return one(c.seeds for c in cfgs), one(c.steps for c in cfgs)


def _set_default_help(p: argparse.ArgumentParser, exp) -> None:
    """``--seeds`` / ``--steps`` help of an experiment command with the numbers its configurations get
    without them (from ``exp.configs`` itself: one source of truth)."""
    try:
        cfgs = exp.configs(_default_namespace(p))
    except Exception:  # noqa: BLE001  (a task whose defaults need more: the generic words)
        return
    if not cfgs:
        return
    seeds, steps = _budget_text(cfgs)
    profiles = "|".join(exp.profiles)
    for a in p._actions:
        if a.dest == "seeds":
            a.help = (f"seeds per configuration, at most {MAX_SEEDS:,} (default: {seeds}; with --profile P: the "
                      f"profile's, see `nalu-cuda list --profile {profiles}`)")
        elif a.dest == "steps":
            a.help = (f"training steps per configuration, at most {MAX_STEPS:,} (default: {steps}; with --profile P: "
                      "the profile's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nalu-cuda",
        description="Reproduce the experiments of 'Neural Arithmetic Logic Units' (Trask et al. 2018) with "
                    "many seeds trained at once, scored by the paper's metric and Madsen & Johansen's "
                    "success criterion.",
        epilog="Run `nalu-cuda <command> -h` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"nalu_cuda {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for exp in all_experiments():
        p = sub.add_parser(exp.name, help=exp.help, description=exp.help)
        before = {a.dest for a in p._actions}
        exp.add_arguments(p)
        task_options = _task_options(p, before)  # the experiment's own options, which --profile excludes
        own_profile = any(a.dest == "profile" for a in p._actions)  # gridworld: its own --profile
        if not own_profile:
            p.add_argument("--profile", choices=tuple(exp.profiles), default=None,
                           help=f"run the {exp.name} configurations of a profile instead of the ones the options "
                                f"below build: exactly what `nalu-cuda reproduce --profile P --only {exp.name}` runs "
                                "and `nalu-cuda list --profile P` lists (--seeds/--steps override its budget; the "
                                "experiment's other options cannot be combined with it)")
        _add_common(p)
        _set_default_help(p, exp)
        p.set_defaults(_experiment=exp.name, _own_profile=own_profile, _task_options=task_options)
    r = sub.add_parser("reproduce", help="run every experiment's profile and write one report",
                       description="Run the configurations of every registered experiment at a profile: 'quick' "
                                   f"({REPRODUCE_QUICK_TIME} for every experiment), 'standard' "
                                   "(the static task only: Madsen & Johansen's table at 100 seeds with budgets from "
                                   "their solved-at statistics; see benchmarks/RESULTS.md for its cost), 'decisive' "
                                   "(for each claim the least budget measured to decide it, on a CPU; hours, meant "
                                   "for several sittings with --resume or torchrun ranks) or 'paper' "
                                   "(the published budgets; days on a CPU, meant for a GPU).")
    r.add_argument("--profile", choices=PROFILES, default="quick",
                   help="budget (default: quick); `nalu-cuda list --profile P` lists its configurations")
    r.add_argument("--only", nargs="+", metavar="EXPERIMENT", default=None,
                   help=f"run only these experiments ({', '.join(e.name for e in all_experiments())})")
    _add_common(r, defaults_note="override every configuration's value")
    r.set_defaults(_experiment=None)
    ls = sub.add_parser("list", help="list the configurations each command trains (seeds x steps)",
                        description="Without --profile: the configurations each experiment command trains with no "
                                    "options (`nalu-cuda identity`, ...). With --profile P: those of `nalu-cuda "
                                    "reproduce --profile P` (and of `nalu-cuda <command> --profile P`).")
    ls.add_argument("--profile", choices=PROFILES, default=None,
                    help="list this profile's configurations (default: the commands' own defaults)")
    ls.set_defaults(_experiment="__list__")
    return parser


def _with_budget(cfgs, args: argparse.Namespace):
    """A profile's configurations with ``--seeds`` / ``--steps`` applied (as ``reproduce`` does)."""
    out = []
    for c in cfgs:
        if args.seeds is not None:
            c = replace(c, seeds=args.seeds)
        if args.steps is not None:
            c = replace(c, steps=args.steps)
        out.append(c)
    return out


def _configs(args: argparse.Namespace):
    profile = getattr(args, "profile", None)
    if args._experiment is not None and profile is not None and not args._own_profile:
        exp = get(args._experiment)
        given = [opt for dest, opt, default in args._task_options if getattr(args, dest, default) != default]
        if given:
            raise ValueError(f"--profile {profile} fixes the {exp.name} configurations (`nalu-cuda list --profile "
                             f"{profile}` lists them); it cannot be combined with {', '.join(given)}: drop "
                             "--profile to build configurations from the options")
        return _with_budget(exp.profile_configs(profile), args)
    if args._experiment is None:  # reproduce
        names = [e.name for e in all_experiments()]
        if args.only:
            unknown = [n for n in args.only if n not in names]
            if unknown:
                raise ValueError(f"--only: unknown experiment(s) {unknown}; known: {', '.join(names)}")
            names = [n for n in names if n in args.only]
        cfgs = []
        for n in names:
            if args.profile not in get(n).profiles:
                continue
            cfgs += _with_budget(get(n).profile_configs(args.profile), args)
        return cfgs
    return get(args._experiment).configs(args)


def _failure(exc: BaseException, out: str) -> str:
    """One line for an error of the machine during a run (a file that could not be written, memory
    that ran out): what failed, and that the finished configurations are kept."""
    if isinstance(exc, MemoryError):
        what = "the run ran out of memory (lower --seeds or the sizes of the task)"
    else:
        target = exc.filename if getattr(exc, "filename", None) else f"a file in {out}"
        writing = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
        what = f"could not write {target}: {exc.strerror or exc}" if writing else f"{target}: {exc.strerror or exc}"
    return (f"{what}; the configurations that finished are kept in {out}: continue with the same command "
            "plus --resume")


def _print_list(parser: argparse.ArgumentParser, profile: Optional[str]) -> None:
    """``nalu-cuda list``: every configuration a command builds, from the functions the commands use."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if profile is None:
        print("The configurations each command trains with no options (`nalu-cuda <command>`); "
              "`nalu-cuda list --profile quick|standard|decisive|paper` lists a profile's.")
    else:
        print(f"Profile {profile}: the configurations of `nalu-cuda reproduce --profile {profile}` and of "
              f"`nalu-cuda <command> --profile {profile}` (--seeds/--steps override).")
    grand = 0.0
    for exp in all_experiments():
        if profile is None:
            cfgs = exp.configs(_default_namespace(sub.choices[exp.name]))
        elif profile in exp.profiles:
            cfgs = exp.profile_configs(profile)
        else:
            print(f"\n{exp.name}: no {profile} profile")
            continue
        print(f"\n{exp.name}: {exp.help}")
        for c in cfgs:
            print(f"    {c.name}: {c.seeds:,} seeds x {c.steps:,} steps, {fmt_hours(estimated_hours([c]))}")
        total, hours = sum(c.seeds * c.steps for c in cfgs), estimated_hours(cfgs)
        print(f"    ({len(cfgs)} configuration{'s' if len(cfgs) != 1 else ''}, {total:,} seed-steps in all: "
              f"{fmt_hours(hours)} on one core, {fmt_hours(hours / 2)} on two torchrun ranks)")
        grand += hours
    print(f"\nIn all: {fmt_hours(grand)} on one CPU core, {fmt_hours(grand / 2)} on two ranks (estimated from the measured "
          "cost factors: experiments.costs; a GPU is faster)")




# The headline numbers of a summary.json record, first present first: (key, label, scale).
_HEADLINES = (
    ("interp_error_median", "interp err", 1), ("extrap_error_median", "extrap err", 1),
    ("interp_mae_mean", "MAE inside", 1), ("fig_mae_outside_mean", "MAE outside", 1),
    ("table_mae_mean", "MAE U[-1000,1000]", 1), ("accuracy_mean", "accuracy", 100),
    ("test_mae_mean", "test MAE", 1), ("val_return_mean", "val return", 1),
    ("train_range_success_mean", "success T in train", 100), ("success_T13_19_mean", "success T 13-19", 100),
)


def _fmt(v: float, scale: float) -> str:
    return f"{100 * v:.0f}%" if scale == 100 else f"{v:.3g}"


def _result_line(rec: dict) -> str:
    n = rec.get("n_records") or rec.get("seeds")
    parts = []
    if rec.get("success_rate") is not None:
        parts.append(f"solved {rec.get('success_count')}/{n}")
    for key, label, scale in _HEADLINES:
        v = rec.get(key)
        if isinstance(v, (int, float)) and len(parts) < 4:
            parts.append(f"{label} {_fmt(float(v), scale)}")
    div = rec.get("divergence_count", rec.get("diverged_count"))
    if div is not None:
        parts.append(f"diverged {div}/{n}")
    return ", ".join(parts)


def _print_results(configs, out: str) -> None:
    """A short table of this run's results, one line per summary.json record (the report has the rest)."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            records = json.load(f)["records"]
    except (OSError, ValueError, KeyError):
        return
    ours = {(c.experiment, c.name) for c in configs}
    rows = []
    for rec in records:
        if (rec.get("experiment"), rec.get("config")) not in ours:
            continue
        name = f"{rec['experiment']}/{rec['config']}"
        if rec.get("op") and f"{rec['op']}" not in rec["config"].split("-"):
            name += f" ({rec['op']})"
        rows.append((name, f"{rec.get('seeds')} x {rec.get('steps')}", _result_line(rec)))
    if not rows:
        return
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    print(f"\nResults (seeds x steps; errors are medians over seeds, MAE and accuracy means; 'err' is the paper's "
          f"normalised error, 100 = a random model). Tables and figures: {os.path.join(out, 'report.md')}")
    for r in rows:
        print(f"  {r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}")


def _collapse(message: str) -> str:
    """An error of many lines that differ only in their leading path (one per configuration) as one line
    with a count."""
    groups: dict = {}  # the rest of a line that starts with a path -> those paths; other lines as they are
    for i, line in enumerate(message.split("\n")):
        head, _, rest = line.partition(" ")
        if os.sep in head and rest:
            groups.setdefault(("path", rest), []).append(head)
        else:
            groups[("line", i)] = [line]
    lines = []
    for (kind, rest), heads in groups.items():
        if kind == "line":
            lines.append(heads[0])
        elif len(heads) == 1:
            lines.append(f"{heads[0]} {rest}")
        else:
            lines.append(f"{len(heads)} files ({heads[0]} ... {heads[-1]}) each {rest}")
    return "\n".join(lines)


class _SkipCollapser:
    """The log of a ``--resume`` run with the three lines of every configuration kept from before ("[i/n]
    key: ...", "[skip] key: finished earlier (kept)", "[i/n] key: done ...") as one line with a count."""

    def __init__(self, configs, out: str):
        self._log = runner.log_default
        self._maybe = {c.key for c in configs if os.path.exists(runner.result_path(out, c))}
        self._skipped: List[str] = []
        self._seen: set = set()

    def flush(self) -> None:
        if self._skipped:
            k = self._skipped
            self._log(f"[skip] {len(k)} configuration{'s' if len(k) > 1 else ''} finished earlier, kept: "
                      + (k[0] if len(k) == 1 else f"{k[0]} ... {k[-1]}"))
            self._skipped = []

    def __call__(self, msg: str) -> None:
        if msg.startswith("[skip] "):
            key = msg[len("[skip] "):].split(":", 1)[0]
            self._skipped.append(key)
            self._seen.add(key)
            return
        if msg.startswith("[") and "] " in msg:
            key = msg.split("] ", 1)[1].split(":", 1)[0]
            done = msg.split(": ", 1)[-1].startswith("done")
            if (key in self._seen and done) or (key in self._maybe and not done):
                return
        self.flush()
        self._log(msg)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    distributed.select_local_gpu()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._experiment == "__list__":
        _print_list(parser, args.profile)
        return 0
    try:
        configs = _configs(args)
        check_memory(configs, args.device)
    except ValueError as exc:
        parser.exit(2, f"nalu-cuda: error: {exc}\n")
    if not configs:
        parser.exit(2, "nalu-cuda: error: no configurations to run\n")
    if args.resume and args.overwrite:
        parser.exit(2, "nalu-cuda: error: --resume and --overwrite contradict each other\n")
    torch.set_num_threads(args.threads or 1)
    out = args.out if args.out is not None else os.path.join("nalu-results", args.command)
    meta = {"command": "nalu-cuda " + " ".join(shlex.quote(a) for a in argv), "device": args.device}
    if args.command == "reproduce":
        meta["profile"] = args.profile
    resume, overwrite = args.resume, args.overwrite
    if distributed.restart_count() > 0:  # torchrun --max-restarts: continue what the failed attempt finished
        sys.stderr.write(f"nalu-cuda: restart {distributed.restart_count()} of this torchrun group: continuing as "
                         "with --resume\n")
        resume, overwrite = True, False
    run_kw = dict(device=args.device, resume=resume, overwrite=overwrite, progress=not args.no_progress, meta=meta,
                  checkpoint_every_s=args.checkpoint_every)
    kept = _SkipCollapser(configs, out) if resume else None
    t0 = time.perf_counter()
    ranks = distributed.init(args.device) if distributed.launched() else None
    talk = ranks is None or ranks.rank == 0  # one message per run, not one per rank
    try:
        if ranks is None:
            runner.run_configs(configs, out, **run_kw, **({"log": kept} if kept is not None else {}))
        else:
            distributed.run_sharded(configs, out, ranks, log=runner.log_default, report_every_s=60.0, **run_kw)
    except (runner.RunError, ValueError) as exc:
        parser.exit(2, f"nalu-cuda: error: {_collapse(str(exc))}\n" if talk else None)
    except (OSError, MemoryError) as exc:
        parser.exit(1, f"nalu-cuda: error: {_failure(exc, out)}\n" if talk else None)
    except KeyboardInterrupt:
        if talk:
            print(f"\nnalu-cuda: interrupted; finished configurations are kept in {out}; continue with the same "
                  "command plus --resume", file=sys.stderr)
        return 130
    finally:
        if kept is not None:
            kept.flush()
        if ranks is not None:
            torch.distributed.destroy_process_group()
    if talk:
        _print_results(configs, out)
        print(f"nalu-cuda: done in {time.perf_counter() - t0:.0f} s; report: {os.path.join(out, 'report.md')}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
