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
import math
import os
import shlex
import sys
import time
from dataclasses import replace
from typing import Any, Callable, List, Optional, Sequence

# The budgets of ``reproduce`` (see nalu_cuda.experiments.registry.Experiment.profiles).
PROFILES = ("quick", "standard", "paper")

__all__ = ["main", "build_parser", "positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "finite_float", "at_most", "seed_count", "step_count", "phase_step_count", "thread_count", "comma_list",
           "directory", "mnist_directory", "device", "MAX_SEEDS", "MAX_STEPS"]

# Upper bounds of counts whose larger values only hang or exhaust the machine.
MAX_SEEDS = 10 ** 6   # every seed is a member of one ensemble, trained at once
MAX_STEPS = 10 ** 12  # a step takes at least a microsecond: 1e12 steps would run for over 11 days


# ------------------------------------------------------------------------------------------------
# Argument types, shared by every subcommand's options (the experiments' own options too): a value
# that has no meaning is refused by argparse at start (exit 2, naming the option, the value and
# what is allowed), never discovered after training.
# ------------------------------------------------------------------------------------------------


def _number(text: str, kind: type, allowed: str, ok: Callable[[float], bool]):
    try:
        v = kind(text)
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, steps)."""
    return _number(text, int, "an integer >= 1", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (seeds, optional phases that 0 switches off)."""
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, clipping norms)."""
    return _number(text, float, "a finite number > 0", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (intervals in seconds)."""
    return _number(text, float, "a finite number >= 0", lambda v: v >= 0)


def finite_float(text: str) -> float:
    """A finite number (ends of input ranges)."""
    return _number(text, float, "a finite number", lambda v: True)


def at_most(item: Callable[[str], int], high: int, why: str) -> Callable[[str], int]:
    """``item`` (e.g. :func:`positive_int`) bounded above by ``high``, for the reason ``why``."""
    def parse(text: str) -> int:
        v = item(text)
        if v > high:
            raise argparse.ArgumentTypeError(f"expected at most {high} ({why}), got {text!r}")
        return v

    parse.__name__ = item.__name__
    return parse


_STEPS_WHY = "a step takes at least a microsecond: more would run for weeks"
seed_count = at_most(positive_int, MAX_SEEDS, "every seed is a member of one ensemble, trained at once")
step_count = at_most(positive_int, MAX_STEPS, _STEPS_WHY)
phase_step_count = at_most(non_negative_int, MAX_STEPS, _STEPS_WHY)  # steps of an optional phase (0: none)


def thread_count(text: str) -> int:
    """An integer from 1 to the number of CPU cores (more threads only compete for the same cores)."""
    cores = os.cpu_count() or 1
    return at_most(positive_int, cores, "the CPU cores of this machine")(text)


def comma_list(item: Callable[[str], Any]) -> Callable[[str], List[Any]]:
    """A comma-separated, non-empty list whose items are each checked by ``item`` (one of the above)."""
    def parse(text: str) -> List[Any]:
        parts = [t.strip() for t in text.split(",")]
        if not text.strip() or not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return [item(t) for t in parts]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (in the list {text!r})") from None

    parse.__name__ = f"comma-separated {item.__name__}"
    return parse


def directory(text: str) -> str:
    """A directory path (not empty; whether it can be used is checked when the run locks it)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got an empty path ''")
    return text


def mnist_directory(text: str) -> str:
    """A directory holding the four MNIST IDX files; returned absolute."""
    from .experiments.parts.mnist_data import find_mnist_files

    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a directory with the four MNIST IDX files, got {text!r}, "
                                         "which is not a directory")
    try:
        find_mnist_files(text)
    except FileNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace(f"--mnist-dir {text!r}: ", f"{text!r} has ")) from None
    return os.path.abspath(text)


def device(text: str) -> str:
    """A torch device on which a NALU layer runs forward and backward and copies back: what every
    experiment does. Checked at start (a 'meta' device used to fail only after training)."""
    import torch

    allowed = "cpu" + (", cuda or cuda:N" if torch.cuda.is_available() else " (this torch sees no CUDA device)")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; allowed: {allowed}") from None
    try:
        _probe(dev)
    except Exception as exc:  # whatever the device cannot do, the experiments cannot either
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise argparse.ArgumentTypeError(f"device {text!r} cannot run the experiments here ({why}); "
                                         f"allowed: {allowed}") from None
    return str(dev)


def _probe(dev) -> None:
    import torch

    from .modules import NALU

    with torch.random.fork_rng(devices=[]):  # the layer's initialisation must not move the global RNG
        layer = NALU(3, 2).to(dev)
    x = torch.full((4, 3), 0.5, device=dev)
    layer(x).sum().backward()
    float(layer.G.grad.sum().cpu())


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


def build_parser() -> argparse.ArgumentParser:
    from .experiments import all_experiments

    parser = argparse.ArgumentParser(
        prog="nalu-cuda",
        description="Reproduce the experiments of 'Neural Arithmetic Logic Units' (Trask et al. 2018) with "
                    "many seeds trained at once, scored by the paper's metric and Madsen & Johansen's "
                    "success criterion.",
        epilog="Run `nalu-cuda <command> -h` for the options of a command.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"nalu_cuda {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for exp in all_experiments():
        p = sub.add_parser(exp.name, help=exp.help, description=exp.help)
        exp.add_arguments(p)
        _add_common(p)
        p.set_defaults(_experiment=exp.name)
    r = sub.add_parser("reproduce", help="run every experiment's profile and write one report",
                       description="Run the configurations of every registered experiment at a profile: 'quick' "
                                   "(about 20 minutes for every experiment on 2 idle CPU cores), 'standard' "
                                   "(the static task only: Madsen & Johansen's table at 100 seeds with budgets from "
                                   "their solved-at statistics; see benchmarks/RESULTS.md for its cost) or 'paper' "
                                   "(the published budgets; days on a CPU, meant for a GPU).")
    r.add_argument("--profile", choices=PROFILES, default="quick", help="budget (default: quick)")
    r.add_argument("--only", nargs="+", metavar="EXPERIMENT", default=None,
                   help=f"run only these experiments ({', '.join(e.name for e in all_experiments())})")
    _add_common(r, defaults_note="override every configuration's value")
    r.set_defaults(_experiment=None)
    ls = sub.add_parser("list", help="list the experiments and the configurations of a profile")
    ls.add_argument("--profile", choices=PROFILES, default="quick")
    ls.set_defaults(_experiment="__list__")
    return parser


def _configs(args: argparse.Namespace):
    from .experiments import all_experiments, get

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
            for c in get(n).profile_configs(args.profile):
                if args.seeds is not None:
                    c = replace(c, seeds=args.seeds)
                if args.steps is not None:
                    c = replace(c, steps=args.steps)
                cfgs.append(c)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .experiments import distributed

    distributed.select_local_gpu()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._experiment == "__list__":
        from .experiments import all_experiments

        for exp in all_experiments():
            if args.profile not in exp.profiles:
                continue
            cfgs = exp.profile_configs(args.profile)
            print(f"{exp.name}: {exp.help}")
            for c in cfgs:
                print(f"    {c.name}: {c.seeds} seeds x {c.steps} steps")
        return 0
    from .experiments.resources import check_memory
    from .experiments.runner import RunError, run_configs

    try:
        configs = _configs(args)
        check_memory(configs, args.device)
    except ValueError as exc:
        parser.exit(2, f"nalu-cuda: error: {exc}\n")
    if not configs:
        parser.exit(2, "nalu-cuda: error: no configurations to run\n")
    if args.resume and args.overwrite:
        parser.exit(2, "nalu-cuda: error: --resume and --overwrite contradict each other\n")
    import torch

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
    t0 = time.perf_counter()
    ranks = distributed.init(args.device) if distributed.launched() else None
    talk = ranks is None or ranks.rank == 0  # one message per run, not one per rank
    try:
        if ranks is None:
            run_configs(configs, out, **run_kw)
        else:
            from .experiments.runner import _log_default

            distributed.run_sharded(configs, out, ranks, log=_log_default, report_every_s=60.0, **run_kw)
    except (RunError, ValueError) as exc:
        parser.exit(2, f"nalu-cuda: error: {exc}\n" if talk else None)
    except (OSError, MemoryError) as exc:
        parser.exit(1, f"nalu-cuda: error: {_failure(exc, out)}\n" if talk else None)
    except KeyboardInterrupt:
        if talk:
            print(f"\nnalu-cuda: interrupted; finished configurations are kept in {out}; continue with the same "
                  "command plus --resume", file=sys.stderr)
        return 130
    finally:
        if ranks is not None:
            torch.distributed.destroy_process_group()
    if talk:
        print(f"nalu-cuda: done in {time.perf_counter() - t0:.0f} s; report: {os.path.join(out, 'report.md')}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
