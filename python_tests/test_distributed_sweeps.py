"""Sharded sweeps (nalu_cuda.experiments.distributed): the plan, the shared output-directory lock, and
two 2-rank gloo groups on localhost: a sharded static sweep writes the numbers of the single-process
sweep (the ranks with separate output directories, as on machines without a shared file system),
and a rank killed mid-sweep loses only its unfinished configuration (``--resume`` with one process
completes the sweep and keeps every finished result). Each group costs two interpreter starts and
imports of torch (10-60 s on a busy 2-core machine), hence only two."""
import json
import os
import signal
import socket
import time

import pytest
import torch.multiprocessing as mp

from nalu_cuda import cli
from nalu_cuda.experiments import costs, distributed, outdir
from nalu_cuda.experiments.outdir import OutputDir, RunError
from nalu_cuda.experiments.registry import Config
from nalu_cuda.experiments.tasks.static import static_config

WORLD = 2
TIMEOUT_S = 300  # two fresh interpreters importing torch on a busy machine
SWEEP = ["static", "--model", "nac", "nalu", "relu", "linear", "--op", "add", "--seeds", "2", "--steps", "30",
         "--eval-every", "10", "--n-test", "64", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the plan ------------------------------------------------------------------------------------


def test_plan_balances_cost_and_is_deterministic():
    costs = [7.0, 1.0, 5.0, 3.0, 3.0, 1.0]
    shards = distributed.plan(costs, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shards]
    assert loads == [10.0, 10.0]
    assert distributed.plan(costs, 2) == shards
    assert distributed.plan(costs, 1) == [list(range(len(costs)))]
    assert distributed.plan([1.0], 3) == [[0], [], []]


def test_plan_keeps_finished_and_checkpointed_where_they_are():
    costs = [4.0, 4.0, 4.0, 4.0]
    shards = distributed.plan(costs, 2, done_at=[[1], [0, 1], [], []], checkpoint_at=[[], [], [1], []])
    assert 0 in shards[1] and 1 in shards[0]  # finished: kept by the lowest rank holding it
    assert 2 in shards[1]  # continued where its checkpoint is
    assert 3 in shards[0]  # the least loaded rank


def test_estimated_cost():
    cfg = Config("static", "c", seeds=4, steps=100)
    assert costs.estimated_cost(cfg) == 400 * costs.COST_FACTORS["static"]
    # one member per seed and operation: two operations cost twice one
    two = Config("static", "c2", seeds=4, steps=100, params={"ops": ["add", "sub"]})
    assert costs.estimated_cost(two) == 2 * costs.estimated_cost(Config("static", "c1", 4, 100, {"ops": ["add"]}))
    assert costs.estimated_cost(Config("digits", "d", 1, 10)) > costs.estimated_cost(Config("static", "s", 1, 10))
    nac, nalu, lstm = (costs.estimated_cost(Config("recurrent", m, 4, 100, {"model": m})) for m in ("nac", "nalu", "lstm"))
    assert nac < nalu < lstm
    assert costs.model_factor("iNALU") > costs.model_factor("NAU") > costs.model_factor("nac")
    assert costs.model_factor("relu6") == costs.model_factor("linear") == costs.MLP_FACTOR


def test_config_factor_prefers_what_the_task_declares():
    """A task's model_costs (per configuration name, else per model) come before MODEL_FACTORS; a
    model it does not name keeps MODEL_FACTORS'."""
    from nalu_cuda.experiments.registry import get

    digits = get("digits")
    lstm = Config("digits", "counting-lstm", 10, 100, {"model": "lstm"})
    assert costs.config_factor(lstm) == digits.model_costs["lstm"] != costs.model_factor("lstm")
    assert costs.estimated_cost(lstm) == 1000 * digits.cost_factor * digits.model_costs["lstm"]
    programs = get("programs")
    name = next(iter(programs.model_costs))
    assert costs.config_factor(Config("programs", name, 1, 1, {"model": "x"})) == programs.model_costs[name]
    assert costs.config_factor(Config("recurrent", "r", 1, 1, {"model": "lstm"})) == costs.model_factor("lstm")


def test_split_rule_and_units():
    assert distributed.split_rule(10.0, 8, 10.0) == 1  # a rank's share: the plan balances it whole
    assert distributed.split_rule(25.0, 8, 10.0) == 3
    assert distributed.split_rule(25.0, 2, 10.0) == 2  # at most one block per seed
    big = static_config("nac", ["add"], 6, 100)
    small = static_config("nac", ["sub"], 1, 100)
    fresh = [[(False, False, [], [])] * 2] * 2
    work = distributed.units([big, small], 2, fresh)  # share 350: the 600 of big in 2 blocks
    assert [(u.index, u.block) for u in work] == [(0, (0, 3)), (0, (3, 6)), (1, None)]
    # resumed by one rank: the finished block stays, the rest of the seeds is one new block
    status = [[(False, False, [(0, 3)], []), (False, False, [], [])]]
    assert [(u.block, u.done_at) for u in distributed.units([big, small], 1, status)][:2] == [((0, 3), (0,)), ((3, 6), ())]
    # a configuration checkpointed whole continues whole
    status = [[(False, True, [], []), (False, False, [], [])]] * 2
    assert [u.block for u in distributed.units([big, small], 2, status)] == [None, None]


def test_rank_device_and_restart(monkeypatch):
    assert distributed.rank_device("cpu", 3) == "cpu"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert distributed.restart_count() == 2
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not distributed.launched()
    monkeypatch.setenv("WORLD_SIZE", "1")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "0")
    assert distributed.launched()  # torchrun --nproc-per-node 1: a group of one


# -- the lock with many ranks ----------------------------------------------------------------------


def test_ranks_of_one_run_join_the_lock_and_another_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(outdir, "JOIN_PATIENCE_S", 0.1)
    out = str(tmp_path / "out")
    with OutputDir(out, run_id="run-a"):
        rank1 = OutputDir(out, run_id="run-a", join=True).open()
        assert rank1.joined
        rank1.close()
        with pytest.raises(RunError, match="in use by another nalu-cuda run"):
            OutputDir(out, run_id="run-b", join=True).open()
        with pytest.raises(RunError, match="in use by another nalu-cuda run"):
            OutputDir(out, run_id="run-a").open()  # only a rank of the run joins
    alone = OutputDir(out, run_id="run-b", join=True).open()  # the run's first rank on this file system
    assert not alone.joined
    alone.close()


# -- 2-rank groups -----------------------------------------------------------------------------------


def _worker(rank, port, argv, die_at, machines):
    """One rank of a torchrun-like launch running the CLI; ``die_at``: rank 1 is killed (SIGKILL) when it
    starts its ``die_at``-th configuration; ``machines``: each rank runs in ``machines/rank<r>`` (a relative
    --out then stands for ranks on machines that share no file system)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    if machines is not None:
        os.makedirs(os.path.join(machines, f"rank{rank}"))
        os.chdir(os.path.join(machines, f"rank{rank}"))
    if die_at is not None and rank == 1:
        from nalu_cuda.experiments import runner

        real, started = runner.run_one, []

        def run_one(cfg, *a, **k):
            started.append(cfg.key)
            if len(started) == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(cfg, *a, **k)

        runner.run_one = run_one
    raise SystemExit(cli.main(argv))


def _launch(argv, die_at=None, machines=None):
    """The exit codes of the ranks."""
    ctx = mp.start_processes(_worker, args=(_free_port(), argv, die_at, machines), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    for p in ctx.processes:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"the {WORLD}-rank group did not finish in {TIMEOUT_S} s"
    return [p.exitcode for p in ctx.processes]


def _numbers(out):
    """summary.json's records without wall-clock times, and the per-seed CSV."""
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    records = [{k: v for k, v in r.items() if k != "wall_s"} for r in summary["records"]]
    with open(os.path.join(out, "per_seed_static.csv")) as f:
        return summary["meta"], records, f.read()


def test_sharded_sweep_equals_single_process(tmp_path):
    """Ranks without a shared file system: rank 1 keeps its results in its own --out, rank 0 gets
    them through the process group."""
    machines = str(tmp_path / "machines")
    assert _launch(SWEEP + ["--out", "sweep"], machines=machines) == [0, 0]
    sharded, single = os.path.join(machines, "rank0", "sweep"), str(tmp_path / "single")
    rank1 = os.path.join(machines, "rank1", "sweep")
    assert len(os.listdir(os.path.join(rank1, "runs", "static"))) == 2
    assert not os.path.exists(os.path.join(rank1, "summary.json"))
    assert len(os.listdir(os.path.join(sharded, "runs", "static"))) == 4
    assert cli.main(SWEEP + ["--out", single]) == 0
    meta, records, csv_text = _numbers(sharded)
    meta1, records1, csv_text1 = _numbers(single)
    assert len(records) == 4 and records == records1 and csv_text == csv_text1
    assert meta["ranks"] == WORLD and meta["backend"] == "gloo" and "ranks" not in meta1
    assert sorted(s["configs"] for s in meta["shards"]) == [2, 2]
    with open(os.path.join(sharded, "report.md")) as f:
        assert f"sharded over {WORLD} ranks" in f.read()


def test_blocks_of_seeds_of_one_configuration_equal_single_process(tmp_path):
    """One static configuration of 4 seeds on 2 ranks: two blocks of 2 seeds, one a rank, merged on
    rank 0 into the result, summary and CSV of the single-process run."""
    argv = ["static", "--model", "nalu", "--op", "add", "mul", "--seeds", "4", "--steps", "30", "--eval-every", "10",
            "--n-test", "64", "--no-progress"]
    sharded, single = str(tmp_path / "sharded"), str(tmp_path / "single")
    assert _launch(argv + ["--out", sharded]) == [0, 0]
    assert cli.main(argv + ["--out", single]) == 0
    meta, records, csv_text = _numbers(sharded)
    meta1, records1, csv_text1 = _numbers(single)
    assert len(records) == 2 and records == records1 and csv_text == csv_text1
    assert [(s["configs"], s["seed_blocks"]) for s in meta["shards"]] == [(0, 1), (0, 1)]
    (name,) = os.listdir(os.path.join(sharded, "runs", "static"))
    results = []
    for out in (sharded, single):
        with open(os.path.join(out, "runs", "static", name, "result.json")) as f:
            data = json.load(f)
        assert os.listdir(os.path.join(out, "runs", "static", name)) == ["result.json"]
        results.append((data["records"], {k: v for k, v in data["extra"].items() if k != "train_wall_s"}))
    assert results[0] == results[1]
    assert data.get("seed_blocks") is None  # the single run's; the merged one names its blocks


def test_killed_rank_then_resume_loses_nothing_finished(tmp_path):
    out = str(tmp_path / "out")
    codes = _launch(SWEEP + ["--out", out], die_at=2)  # rank 1 dies as it starts its second configuration
    assert codes[1] == -signal.SIGKILL and codes[0] == 2  # a RunError naming --resume, not a traceback
    runs = os.path.join(out, "runs", "static")
    finished = {n: open(os.path.join(runs, n, "result.json")).read() for n in sorted(os.listdir(runs))
                if os.path.exists(os.path.join(runs, n, "result.json"))}
    assert len(finished) == 3  # rank 0's two, rank 1's first
    _, records, _ = _numbers(out)  # rank 0 summarised what finished before it stopped
    assert len(records) == 3
    with pytest.raises(SystemExit):  # without --resume the finished results are refused, not replaced
        cli.main(SWEEP + ["--out", out])
    assert cli.main(SWEEP + ["--out", out, "--resume"]) == 0  # one process now
    for n, text in finished.items():
        assert open(os.path.join(runs, n, "result.json")).read() == text  # kept, not recomputed
    _, records, _ = _numbers(out)
    assert len(records) == 4 and all(r["n_records"] == 2 for r in records)


def test_elastic_restart_continues_as_resume(tmp_path, monkeypatch):
    """A group that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0) keeps what the first attempt
    finished, even when the command says --overwrite."""
    out = str(tmp_path / "out")
    argv = ["static", "--model", "linear", "--op", "add", "--seeds", "1", "--steps", "5", "--eval-every", "5",
            "--n-test", "32", "--no-progress", "--out", out]
    assert cli.main(argv) == 0
    rp = os.path.join(out, "runs", "static", "linear-add-1_2-to-2_6", "result.json")
    first = open(rp).read()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert cli.main(argv + ["--overwrite"]) == 0
    assert open(rp).read() == first
