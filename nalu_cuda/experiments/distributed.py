"""Sharded sweeps: every experiment command under ``torchrun`` splits its configurations across the
ranks of a ``torch.distributed`` process group, and rank 0 writes the one summary, CSVs and report.

Launch (any experiment command, or ``reproduce``)::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m nalu_cuda reproduce --profile quick --out runs/quick

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
4. The shards (:func:`units`): whole configurations, and blocks of seeds of a large one
   (:mod:`.seed_blocks`; static, identity and recurrent only): a configuration whose estimated cost
   exceeds a rank's fair share (the sweep's total / the number of ranks) is split into the fewest
   even blocks that each fit in that share (:func:`split_rule`). The plan: every rank reports which
   shards it finds finished (a valid ``result.json``) or started (a checkpoint) in its ``--out``;
   finished ones are kept by a rank that holds them, started ones go to a rank that holds their
   checkpoint (blocks found on disk are kept as they are, whatever the number of ranks now), and the
   rest are balanced by estimated cost (:func:`estimated_cost`: seeds x steps x a per-experiment
   factor x a per-model factor; the largest first, each to the least loaded rank). The plan is a
   pure function of what every rank sees, so every rank computes the same one.
5. Every rank runs its shards exactly as a single process would (:func:`.runner.run_one`: the same
   seeds and streams, the same ``result.json``, checkpoints for ``--resume``), then the results are
   gathered on rank 0 (``dist.gather_object``: no shared file system needed), which merges the blocks
   of each configuration into its one ``result.json`` (the numbers of a single run of it), writes the
   others into its own ``runs/`` and rebuilds ``summary.json``, the CSVs and the report. ``meta`` in
   ``summary.json`` (and the report) say how many ranks ran, on which devices, and the time each
   spent working, waiting for the others and gathering.

Faults: a rank that dies loses only the shard it was running (its finished ones are on its
disk, and that one's checkpoint too). ``torchrun`` then stops the other ranks, which lose the same at
most; under a launcher that does not, they finish their shards, rank 0 writes the outputs of what
finished, and every rank exits with a :class:`RunError`. Rerun with ``--resume``, with any number of
ranks. Under
``torchrun --max-restarts N`` a restarted group (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes: it
runs as if ``--resume`` were given (and never ``--overwrite``s what the first attempt finished), its
process group meeting under a prefix of its own in torchrun's store (:func:`group_store`).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import runner, seed_blocks
from .integrity import checkpoint_path, load_result, result_path
from .outdir import OutputDir, RunError
# the cost model (its names also read from here)
from .costs import COST_FACTORS, CPU_UNITS_PER_S, MODEL_FACTORS, config_factor, estimated_cost, estimated_hours, model_factor
from .registry import Config, ConfigResult

__all__ = ["Ranks", "launched", "restart_count", "select_local_gpu", "group_store", "init", "rank_device",
           "estimated_cost", "estimated_hours", "CPU_UNITS_PER_S", "model_factor", "config_factor", "split_rule", "units", "plan", "run_sharded", "TIMEOUT", "COST_FACTORS",
           "MODEL_FACTORS"]

# The collectives carry results, not gradients: a rank waits at the gather for the slowest shard.
TIMEOUT = _dt.timedelta(days=7)

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


def group_store(timeout: _dt.timedelta = TIMEOUT) -> Optional[dist.Store]:
    """The store this attempt's process group meets in: under ``torchrun`` (which shares its rendezvous
    TCPStore with the workers, ``TORCHELASTIC_USE_AGENT_STORE=True``) a client of that store behind a
    prefix of its own per attempt (``TORCHELASTIC_RESTART_COUNT``) and world size; None otherwise
    (``env://``: rank 0 hosts a fresh store at ``MASTER_PORT``).

    Why: torchrun keeps that one store for the whole job and (in torch 2.13, and other recent releases)
    gives ``env://`` no per-attempt prefix, so a restarted group found the keys its first attempt wrote,
    among them the addresses gloo's ``connectFullMesh`` publishes: a new rank read a dead rank's address
    before its successor overwrote it, and failed with "Connection refused" (or waited on a port that
    nobody would open again). The default process group's keys are the same in every attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"nalu_cuda/restart_{restart_count()}/world_{world}", store)


def init(device: str) -> Ranks:
    """Join the process group the launcher describes (its store: :func:`group_store`, else ``env://``);
    gloo for a CPU device, NCCL for CUDA."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(rank_device(device, local_rank))
    # NCCL needs a GPU of its own per rank; ranks that share one (more ranks than GPUs on a node) use
    # gloo, which carries the pickled results as well.
    own_gpu = dev.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count()
    backend = "nccl" if own_gpu else "gloo"
    if not dist.is_initialized():
        store = group_store()
        where: Dict[str, Any] = {} if store is None else dict(
            store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        if own_gpu:
            torch.cuda.set_device(dev)
            dist.init_process_group(backend, timeout=TIMEOUT, device_id=dev, **where)
        else:
            dist.init_process_group(backend, timeout=TIMEOUT, **where)
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend())


def _test_fault(started: int, ranks: Ranks, out_dir: str, cfg: Config) -> None:
    """Fault injection, for tests only (python_tests/test_distributed_elastic.py); unset, nothing. On the
    first attempt (no torchrun restart yet), rank ``NALU_CUDA_TEST_KILL_RANK`` SIGKILLs itself when it is
    about to start unit ``NALU_CUDA_TEST_KILL_AFTER`` + 1 of its shard (after that many), or, with
    ``NALU_CUDA_TEST_KILL_AT=checkpoint``, as soon as that unit's first checkpoint is written."""
    rank = os.environ.get("NALU_CUDA_TEST_KILL_RANK")
    if rank is None or int(rank) != ranks.rank or restart_count() > 0 or \
            started != int(os.environ.get("NALU_CUDA_TEST_KILL_AFTER", "0")):
        return
    import signal  # local: fault injection, for tests only
    import threading

    ck = checkpoint_path(out_dir, cfg)
    at_checkpoint = os.environ.get("NALU_CUDA_TEST_KILL_AT") == "checkpoint"

    def kill() -> None:
        while at_checkpoint and not os.path.exists(ck):
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)

    if at_checkpoint:
        threading.Thread(target=kill, daemon=True).start()
    else:
        kill()


def split_rule(cost: float, seeds: int, share: float) -> int:
    """How many blocks of seeds a configuration that can split (:func:`.seed_blocks.splittable`) is run
    as: 1 while its estimated ``cost`` is at most a rank's fair ``share`` (the sweep's total cost / the
    number of ranks), else the fewest blocks that each fit in that share, ``ceil(cost / share)``, at most
    one per seed. (Smaller ensembles train fewer seed-steps per second, so nothing is split that the
    plan can balance whole.)"""
    if share <= 0 or cost <= share * (1 + 1e-9):
        return 1
    return max(1, min(seeds, math.ceil(cost / share - 1e-9)))


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


def _local_status(configs: Sequence[Config], out_dir: str) -> List[Tuple[bool, bool, list, list]]:
    """Per configuration: a valid result of it in ``out_dir``; a checkpoint of it there; its blocks of
    seeds there, finished and started."""
    status = []
    for cfg in configs:
        rp = result_path(out_dir, cfg)
        data, problem = load_result(rp) if os.path.exists(rp) else (None, "absent")
        blocks = seed_blocks.on_disk(out_dir, cfg)[:2] if seed_blocks.splittable(cfg) else ([], [])
        status.append((problem is None and data["fingerprint"] == cfg.fingerprint(),
                       os.path.exists(checkpoint_path(out_dir, cfg)), *blocks))
    return status


@dataclass(frozen=True)
class Unit:
    """One shard of the plan: configuration ``index`` whole (``block`` None) or its seeds ``block``."""

    index: int
    block: Optional[Tuple[int, int]]
    config: Config
    done_at: Tuple[int, ...]
    checkpoint_at: Tuple[int, ...]


def units(configs: Sequence[Config], world_size: int, status: Sequence[Sequence[Any]]) -> List[Unit]:
    """The shards of a sweep, from every rank's :func:`_local_status` (``status[rank][config]``): a
    configuration that some rank finished or checkpointed whole stays whole; one with blocks of seeds on
    some rank continues from them (the finished, then the started, new blocks for the seeds not in
    them); otherwise a configuration that can split is split by :func:`split_rule`."""
    ranks = range(world_size)
    share = sum(estimated_cost(c) for c in configs) / world_size
    out: List[Unit] = []
    for i, cfg in enumerate(configs):
        done = tuple(r for r in ranks if status[r][i][0])
        ckpt = tuple(r for r in ranks if status[r][i][1])
        bdone = sorted({tuple(b) for r in ranks for b in status[r][i][2]})
        bstarted = sorted({tuple(b) for r in ranks for b in status[r][i][3]})
        cost = estimated_cost(cfg)
        if done or ckpt or not seed_blocks.splittable(cfg) or \
                (not bdone and not bstarted and split_rule(cost, cfg.seeds, share) == 1):
            out.append(Unit(i, None, cfg, done, ckpt))
            continue
        blocks = seed_blocks.layout(cfg.seeds, bdone, bstarted,
                                    lambda lo, hi: split_rule(cost * (hi - lo) / cfg.seeds, hi - lo, share))
        for lo, hi in blocks:
            out.append(Unit(i, (lo, hi), seed_blocks.block_config(cfg, lo, hi),
                            tuple(r for r in ranks if (lo, hi) in status[r][i][2]),
                            tuple(r for r in ranks if (lo, hi) in status[r][i][3])))
    return out


def _merge_blocks(configs: Sequence[Config], work: Sequence[Unit], texts: Dict[str, str], out_dir: str) -> List[str]:
    """On rank 0: every configuration whose blocks of seeds all finished gets its merged ``result.json``
    (:func:`.runner.write_merged`); returns the problems, as failures of the run."""
    problems = []
    by_config: Dict[int, List[Unit]] = {}
    for unit in work:
        if unit.block is not None:
            by_config.setdefault(unit.index, []).append(unit)
    for i, blocks in by_config.items():
        if all(u.config.key in texts for u in blocks):
            try:
                runner.write_merged(configs[i], out_dir, [(u.block, json.loads(texts[u.config.key])) for u in blocks])
            except RunError as exc:
                problems.append(f"rank 0: {exc}")
    return problems


def _rank_logger(ranks: Ranks, log):
    """``log`` for one process; with several ranks one write per line, prefixed with the rank (the
    ranks share a terminal)."""
    if ranks.world_size == 1:
        return log

    def rank_log(msg: str) -> None:
        sys.stderr.write(f"[rank {ranks.rank}] {msg}\n")
        sys.stderr.flush()
    return rank_log


def _run_shard(mine: Sequence[Unit], names: List[str], out_dir: str, ranks: Ranks, od, *, device: str,
               resume: bool, overwrite: bool, progress: bool, log, meta: Optional[dict],
               checkpoint_every_s: float, report_every_s: float) -> Tuple[Dict[str, str], Optional[str]]:
    """This rank's shard, as a single process would run it: the result texts of what finished, and
    the first failure (the rank stops there; every finished result is kept)."""
    texts: Dict[str, str] = {}
    last_report = -float("inf")
    for n, unit in enumerate(mine):
        cfg = unit.config
        log(f"[{n + 1}/{len(mine)}] {cfg.key}: {cfg.seeds} seeds x {cfg.steps} steps")
        _test_fault(n, ranks, out_dir, cfg)
        try:
            r = runner.run_one(cfg, out_dir, device=device, resume=resume, overwrite=overwrite,
                               progress=progress and ranks.rank == 0, log=log, checkpoint_every_s=checkpoint_every_s)
        except Exception as exc:  # the others finish their shards; every finished result is kept
            failure = f"{cfg.key} failed on {socket.gethostname()} ({type(exc).__name__}: {exc})"
            log(f"error: {failure}")
            return texts, failure
        log(f"[{n + 1}/{len(mine)}] {cfg.key}: done in {r.wall_s:.0f} s; " + runner.headline(r))
        texts[cfg.key] = _read(runner.result_path(out_dir, cfg))
        if ranks.rank == 0 and time.perf_counter() - last_report >= report_every_s:
            runner.write_outputs(out_dir, meta=meta, order=names, report=False, outdir=od)
            last_report = time.perf_counter()
    return texts, None


def _write_gathered(configs: Sequence[Config], work: Sequence[Unit], gathered: List[Any],
                    out_dir: str) -> List[str]:
    """On rank 0: every rank's result texts written to ``out_dir`` (the results of ranks with their
    own file systems; blocks of seeds merged); returns the failures of every rank."""
    texts = {key: text for _, their_texts in gathered for key, text in their_texts.items()}
    failures = [f"rank {info['rank']}: {info['failure']}" for info, _ in gathered if info["failure"]]
    failures += _merge_blocks(configs, work, texts, out_dir)
    for unit in work:
        text = texts.get(unit.config.key)
        rp = runner.result_path(out_dir, unit.config)
        merged = unit.block is not None and os.path.exists(runner.result_path(out_dir, configs[unit.index]))
        if text is not None and not merged and (not os.path.exists(rp) or _read(rp) != text):
            os.makedirs(os.path.dirname(rp), exist_ok=True)
            runner.atomic_write_text(rp, text)
    return failures


def run_sharded(configs: Sequence[Config], out_dir: str, ranks: Ranks, *, device: str, resume: bool, overwrite: bool,
                progress: bool, log, meta: Optional[dict], checkpoint_every_s: float,
                report_every_s: float) -> List[ConfigResult]:
    """:func:`.runner.run_configs` over the ranks of the group (collective: every rank calls it with the
    same arguments). Returns every result on rank 0, this rank's shard elsewhere."""
    t_start = time.perf_counter()
    names = [c.key for c in configs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"configuration names repeat: {sorted(dup)}")
    rank_log = _rank_logger(ranks, log)
    my_device = rank_device(device, ranks.local_rank)
    od = _lock(out_dir, overwrite, ranks)
    try:
        problem = None
        if not od.joined:  # once per file system
            try:
                runner.prepare(configs, od, resume=resume, overwrite=overwrite, log=rank_log)
            except RunError as exc:
                problem = str(exc)
        _agree(problem, ranks)
        status: List[Any] = [None] * ranks.world_size
        dist.all_gather_object(status, _local_status(configs, out_dir))
        work = units(configs, ranks.world_size, status)
        shards = plan([estimated_cost(u.config) for u in work], ranks.world_size, [u.done_at for u in work],
                      [u.checkpoint_at for u in work])
        mine = [work[k] for k in shards[ranks.rank]]
        n_blocks = sum(u.block is not None for u in mine)
        rank_log(f"{len(mine) - n_blocks} of {len(configs)} configurations"
                 + (f" and {n_blocks} blocks of seeds" if n_blocks else "") + f" on {my_device} "
                 f"({sum(estimated_cost(u.config) for u in mine):.3g} of "
                 f"{sum(estimated_cost(c) for c in configs):.3g} estimated cost)")
        t_work = time.perf_counter()
        texts, failure = _run_shard(mine, names, out_dir, ranks, od, device=my_device, resume=resume,
                                    overwrite=overwrite, progress=progress, log=rank_log, meta=meta,
                                    checkpoint_every_s=checkpoint_every_s, report_every_s=report_every_s)
        work_s = time.perf_counter() - t_work

        # Gather: wait for the slowest shard, then every result to rank 0.
        t_wait = time.perf_counter()
        try:
            dist.barrier()
            t_gather = time.perf_counter()
            shard_info = {"rank": ranks.rank, "host": socket.gethostname(), "device": my_device,
                          "configs": len(mine) - n_blocks, "seed_blocks": n_blocks, "work_s": work_s,
                          "wait_s": t_gather - t_wait, "failure": failure}
            gathered: Optional[List[Any]] = [None] * ranks.world_size if ranks.rank == 0 else None
            dist.gather_object((shard_info, texts), gathered, dst=0)
            gather_s = time.perf_counter() - t_gather
        except (RuntimeError, dist.DistError) as exc:  # a rank died: what this one finished is on its disk
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if ranks.rank == 0:  # summary.json and the CSVs of every result in its --out
                runner.write_outputs(out_dir, meta=meta, order=names, report=False, outdir=od)
            raise RunError(f"rank {ranks.rank} lost the process group while gathering ({why}): another rank "
                           f"died. Its finished shards ({len(texts)} of this rank's {len(mine)}) are kept "
                           f"in {out_dir}; rerun with --resume, with any number of ranks") from None
        failures_box: List[Any] = [None]
        results: List[ConfigResult] = []
        if ranks.rank == 0:
            assert gathered is not None
            failures_box[0] = _write_gathered(configs, work, gathered, out_dir)
            meta = dict(meta or {})
            meta.update(ranks=ranks.world_size, backend=ranks.backend, shards=[info for info, _ in gathered],
                        gather_s=gather_s, invocation_wall_s=time.perf_counter() - t_start)
            results = [r for r in runner.load_results(out_dir, names) if r.config.key in names]
            runner.write_outputs(out_dir, meta=meta, order=names, outdir=od)
        dist.broadcast_object_list(failures_box, src=0)
        if failures_box[0]:
            raise RunError("\n".join(failures_box[0]) + f"\nthe finished configurations are kept in {out_dir} "
                           "(on each rank's machine); rerun with --resume, with any number of ranks")
        if ranks.rank != 0:
            results = [runner.result_from_data(json.loads(t)) for t in texts.values()]
        return results
    finally:
        od.close()
