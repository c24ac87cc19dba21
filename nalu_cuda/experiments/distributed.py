"""Sharded sweeps: every experiment command under ``torchrun`` splits its configurations across the
ranks of a ``torch.distributed`` process group, and rank 0 writes the one summary, CSVs and report.

Launch (any experiment command, or ``reproduce``)::

    torchrun --nproc-per-node 2 -m nalu_cuda reproduce --profile quick --out runs/quick

How a run goes (every step is collective; a problem on any rank stops every rank with one message):

1. The process group: gloo when ``--device cpu``, NCCL when ``--device cuda`` (each rank then runs on
   ``cuda:LOCAL_RANK``; ranks that must share a GPU, more of them than the node has, use gloo). The collectives only move pickled results, so their timeout is long
   (:data:`TIMEOUT`): ranks wait for the slowest shard, and ``torchrun`` stops the others when one dies.
2. The output directory: rank 0 locks ``--out`` (:class:`~.outdir.OutputDir`), then the first rank of
   every other node, then the rest. A rank whose ``--out`` is the directory rank 0 (or an earlier rank of
   its node) locked *joins* that lock (the lock file names this run); a rank on a machine with its own
   file system locks its own ``--out`` there. A second run into a locked directory is refused on every
   rank before any work.
3. The rules of :mod:`.runner` (existing results, ``--resume``, ``--overwrite``) are applied once per
   file system, by the rank that locked it.
4. The plan: every rank reports which configurations it finds finished (a valid ``result.json``) or
   started (a checkpoint) in its ``--out``; finished ones are kept by a rank that holds them, started
   ones go to a rank that holds their checkpoint, and the rest are balanced by estimated cost
   (:func:`estimated_cost`: seeds x steps x a per-experiment factor; the largest first, each to the
   least loaded rank). The plan is a pure function of what every rank sees, so every rank computes
   the same one.
5. Every rank runs its shard exactly as a single process would (:func:`.runner.run_one`: the same
   seeds and streams, the same ``result.json``, checkpoints for ``--resume``), then the results are
   gathered on rank 0 (``dist.gather_object``: no shared file system needed), which also writes them
   into its own ``runs/`` and rebuilds ``summary.json``, the CSVs and the report. ``meta`` in
   ``summary.json`` (and the report) say how many ranks ran, on which devices, and the time each
   spent working, waiting for the others and gathering.

Faults: a rank that dies loses only the configuration it was running (its finished ones are on its
disk, and that one's checkpoint too). ``torchrun`` then stops the other ranks, which lose the same at
most; under a launcher that does not, they finish their shards, rank 0 writes the outputs of what
finished, and every rank exits with a :class:`RunError`. Rerun with ``--resume``, with any number of
ranks. Under
``torchrun --max-restarts N`` a restarted group (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes: it
runs as if ``--resume`` were given (and never ``--overwrite``s what the first attempt finished).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .outdir import OutputDir, RunError
from .registry import Config, ConfigResult

__all__ = ["Ranks", "launched", "restart_count", "select_local_gpu", "init", "rank_device", "estimated_cost", "plan", "run_sharded",
           "TIMEOUT", "COST_FACTORS"]

# The collectives carry results, not gradients: a rank waits at the gather for the slowest shard.
TIMEOUT = _dt.timedelta(days=7)

# Relative cost of one training step of one seed, per experiment (static = 1): rough measurements of
# the quick profile on a CPU. Only the balance of the shards depends on them, never a result.
COST_FACTORS: Dict[str, float] = {"static": 1.0, "identity": 1.0, "parity": 1.0, "recurrent": 10.0,
                                  "programs": 10.0, "language": 20.0, "digits": 50.0}


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str


def launched() -> bool:
    """Whether this process is a rank started by ``torchrun`` (or another launcher that sets
    ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``), even the only one."""
    return all(k in os.environ for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"))


def restart_count() -> int:
    """How many times ``torchrun`` restarted this group (``TORCHELASTIC_RESTART_COUNT``; 0 otherwise)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: ``cuda`` (no index) becomes ``cuda:LOCAL_RANK`` (modulo the GPUs this
    machine has); an explicit device is kept."""
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    return device


def select_local_gpu() -> None:
    """Under a launcher, make ``cuda`` mean this rank's GPU from the start (``--device`` is probed on it
    while the arguments are parsed, before :func:`init`), so no rank touches another rank's GPU."""
    if launched() and torch.cuda.is_available():
        torch.cuda.set_device(rank_device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))


def init(device: str) -> Ranks:
    """Join the process group the launcher describes (``env://``); gloo for a CPU device, NCCL for CUDA."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(rank_device(device, local_rank))
    # NCCL needs a GPU of its own per rank; ranks that share one (more ranks than GPUs on a node) use
    # gloo, which carries the pickled results as well.
    own_gpu = dev.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count()
    backend = "nccl" if own_gpu else "gloo"
    if not dist.is_initialized():
        if own_gpu:
            torch.cuda.set_device(dev)
            dist.init_process_group(backend, timeout=TIMEOUT, device_id=dev)
        else:
            dist.init_process_group(backend, timeout=TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend())


def estimated_cost(cfg: Config) -> float:
    """Seeds x steps x :data:`COST_FACTORS` of the experiment (1 for one not listed)."""
    return cfg.seeds * cfg.steps * COST_FACTORS.get(cfg.experiment, 1.0)


def plan(costs: Sequence[float], world_size: int, done_at: Sequence[Sequence[int]] = (),
         checkpoint_at: Sequence[Sequence[int]] = ()) -> List[List[int]]:
    """Configuration indices per rank. ``done_at[i]``: ranks that hold configuration ``i`` finished
    (the lowest of them keeps it, at no cost); ``checkpoint_at[i]``: ranks that hold its checkpoint (it
    goes to the least loaded of them). The rest: longest first, each to the least loaded rank (ties to
    the lowest rank), so every rank computes the same plan."""
    n = len(costs)
    done_at = list(done_at) or [[] for _ in range(n)]
    checkpoint_at = list(checkpoint_at) or [[] for _ in range(n)]
    load = [0.0] * world_size
    shards: List[List[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        if done_at[i]:
            shards[min(done_at[i])].append(i)
            continue
        k = min(sorted(checkpoint_at[i]) or range(world_size), key=lambda k: (load[k], k))
        shards[k].append(i)
        load[k] += costs[i]
    return [sorted(s) for s in shards]


def _agree(problem: Optional[str], ranks: Ranks) -> None:
    """Collective: if any rank has a problem, every rank raises one :class:`RunError` naming them all."""
    problems: List[Optional[str]] = [None] * ranks.world_size
    dist.all_gather_object(problems, problem)
    found = [(r, p) for r, p in enumerate(problems) if p]
    if found:
        texts = list(dict.fromkeys(p for _, p in found))  # the same message from ranks that share --out once
        if ranks.world_size > 1 and len(found) < ranks.world_size:
            texts = [f"rank {r}: {p}" for r, p in found]
        raise RunError("\n".join(texts))


def _lock(out_dir: str, overwrite: bool, ranks: Ranks) -> OutputDir:
    """Lock ``out_dir`` on every rank, in three waves (rank 0; first rank of each other node; the rest),
    so that a rank whose directory an earlier rank locked finds this run's name in the lock file."""
    run_id = [uuid.uuid4().hex if ranks.rank == 0 else None]
    dist.broadcast_object_list(run_id, src=0)
    od: Optional[OutputDir] = None
    waves = (ranks.rank == 0, ranks.rank != 0 and ranks.local_rank == 0, ranks.rank != 0 and ranks.local_rank != 0)
    try:
        for mine in waves:
            problem = None
            if mine:
                try:
                    od = OutputDir(out_dir, overwrite=overwrite, run_id=run_id[0], join=ranks.rank != 0).open()
                except RunError as exc:
                    problem = str(exc)
            _agree(problem, ranks)
    except BaseException:
        if od is not None:
            od.close()
        raise
    assert od is not None
    return od


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _local_status(configs: Sequence[Config], out_dir: str) -> Tuple[List[bool], List[bool]]:
    """Per configuration: a valid result of it in ``out_dir``; a checkpoint of it there."""
    from .runner import _load_result, checkpoint_path, result_path

    done, started = [], []
    for cfg in configs:
        rp = result_path(out_dir, cfg)
        data, problem = _load_result(rp) if os.path.exists(rp) else (None, "absent")
        done.append(problem is None and data["fingerprint"] == cfg.fingerprint())
        started.append(os.path.exists(checkpoint_path(out_dir, cfg)))
    return done, started


def run_sharded(configs: Sequence[Config], out_dir: str, ranks: Ranks, *, device: str, resume: bool, overwrite: bool,
                progress: bool, log, meta: Optional[dict], checkpoint_every_s: float,
                report_every_s: float) -> List[ConfigResult]:
    """:func:`.runner.run_configs` over the ranks of the group (collective: every rank calls it with the
    same arguments). Returns every result on rank 0, this rank's shard elsewhere."""
    from . import runner

    t_start = time.perf_counter()
    names = [c.key for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"configuration names repeat: {sorted(dup)}")
    if ranks.world_size > 1:  # one write per line: the ranks share a terminal
        def rank_log(msg: str) -> None:
            sys.stderr.write(f"[rank {ranks.rank}] {msg}\n")
            sys.stderr.flush()
    else:
        rank_log = log
    my_device = rank_device(device, ranks.local_rank)
    od = _lock(out_dir, overwrite, ranks)
    try:
        problem = None
        if not od.joined:  # once per file system
            try:
                runner._prepare(configs, od, resume=resume, overwrite=overwrite, log=rank_log)
            except RunError as exc:
                problem = str(exc)
        _agree(problem, ranks)
        status: List[Any] = [None] * ranks.world_size
        dist.all_gather_object(status, _local_status(configs, out_dir))
        done_at = [[r for r in range(ranks.world_size) if status[r][0][i]] for i in range(len(configs))]
        ckpt_at = [[r for r in range(ranks.world_size) if status[r][1][i]] for i in range(len(configs))]
        shards = plan([estimated_cost(c) for c in configs], ranks.world_size, done_at, ckpt_at)
        mine = shards[ranks.rank]
        rank_log(f"{len(mine)} of {len(configs)} configurations on {my_device} "
                 f"({sum(estimated_cost(configs[i]) for i in mine):.3g} of "
                 f"{sum(estimated_cost(c) for c in configs):.3g} estimated cost)")

        # Work: this rank's shard, as a single process would run it.
        t_work = time.perf_counter()
        texts: Dict[str, str] = {}
        failure = None
        last_report = -float("inf")
        for n, i in enumerate(mine):
            cfg = configs[i]
            rank_log(f"[{n + 1}/{len(mine)}] {cfg.key}: {cfg.seeds} seeds x {cfg.steps} steps")
            try:
                r = runner.run_one(cfg, out_dir, device=my_device, resume=resume, overwrite=overwrite,
                                   progress=progress and ranks.rank == 0, log=rank_log,
                                   checkpoint_every_s=checkpoint_every_s)
            except Exception as exc:  # the others finish their shards; every finished result is kept
                failure = f"{cfg.key} failed on {socket.gethostname()} ({type(exc).__name__}: {exc})"
                rank_log(f"error: {failure}")
                break
            rank_log(f"[{n + 1}/{len(mine)}] {cfg.key}: done in {r.wall_s:.0f} s; " + runner._headline(r))
            texts[cfg.key] = _read(runner.result_path(out_dir, cfg))
            if ranks.rank == 0 and time.perf_counter() - last_report >= report_every_s:
                runner.write_outputs(out_dir, meta=meta, order=names, report=False, outdir=od)
                last_report = time.perf_counter()
        work_s = time.perf_counter() - t_work

        # Gather: wait for the slowest shard, then every result to rank 0.
        t_wait = time.perf_counter()
        try:
            dist.barrier()
            t_gather = time.perf_counter()
            shard_info = {"rank": ranks.rank, "host": socket.gethostname(), "device": my_device,
                          "configs": len(mine), "work_s": work_s, "wait_s": t_gather - t_wait, "failure": failure}
            gathered: Optional[List[Any]] = [None] * ranks.world_size if ranks.rank == 0 else None
            dist.gather_object((shard_info, texts), gathered, dst=0)
        except (RuntimeError, dist.DistError) as exc:  # a rank died: what this one finished is on its disk
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if ranks.rank == 0:  # summary.json and the CSVs of every result in its --out
                runner.write_outputs(out_dir, meta=meta, order=names, report=False, outdir=od)
            raise RunError(f"rank {ranks.rank} lost the process group while gathering ({why}): another rank "
                           f"died. Its finished configurations ({len(texts)} of this rank's {len(mine)}) are kept "
                           f"in {out_dir}; rerun with --resume, with any number of ranks") from None
        gather_s = time.perf_counter() - t_gather
        failures = None
        results: List[ConfigResult] = []
        if ranks.rank == 0:
            assert gathered is not None
            for _, their_texts in gathered:
                for key, text in their_texts.items():
                    cfg = configs[names.index(key)]
                    rp = runner.result_path(out_dir, cfg)
                    if not os.path.exists(rp) or _read(rp) != text:  # a rank with its own file system
                        runner.atomic_write_text(rp, text)
            infos = [info for info, _ in gathered]
            failures = [f"rank {info['rank']}: {info['failure']}" for info in infos if info["failure"]]
            meta = dict(meta or {})
            meta.update(ranks=ranks.world_size, backend=ranks.backend, shards=infos, gather_s=gather_s,
                        invocation_wall_s=time.perf_counter() - t_start)
            results = [r for r in runner.load_results(out_dir, names) if r.config.key in names]
            runner.write_outputs(out_dir, meta=meta, order=names, outdir=od)
        failures_box = [failures]
        dist.broadcast_object_list(failures_box, src=0)
        if failures_box[0]:
            raise RunError("\n".join(failures_box[0]) + f"\nthe finished configurations are kept in {out_dir} "
                           "(on each rank's machine); rerun with --resume, with any number of ranks")
        if ranks.rank != 0:
            results = [runner._result_from_data(json.loads(t)) for t in texts.values()]
        return results
    finally:
        od.close()
