"""What cannot work is refused before any work (exit code 2, naming the option): counts above their
bounds, non-finite numbers, ranges whose targets overflow, runs that cannot fit in memory; a file
that cannot be written during a run ends it with one line (exit code 1), not a traceback."""
import errno
import time

import pytest

from nalu_cuda import cli
from nalu_cuda.experiments import all_experiments, resources, runner
from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.tasks.static import static_config

from .test_cli import TINY, _exit_code

GiB = 2 ** 30
REAL_MEMORY_LIMIT = resources.memory_limit  # before the fixture replaces it
BIG = str(10 ** 10)


@pytest.fixture(autouse=True)
def _sixteen_gib(monkeypatch):
    """The same machine for every test: 16 GiB of memory."""
    monkeypatch.setattr(resources, "memory_limit", lambda device="cpu": 16.0 * GiB)


@pytest.mark.parametrize("argv, message", [
    # memory: estimated from the options before the run, naming the options that drive it
    (["static", "--n-test", BIG], "which grows with --n-test"),
    (["static", "--batch", BIG], "which grows with --batch"),
    (["static", "--hidden", BIG], "which grows with --hidden"),
    (["recurrent", "--extrap-length", BIG], "which grows with --train-length, --extrap-length"),
    (["gridworld", "--envs", BIG], "which grows with --envs"),
    (["gridworld", "--episodes", str(10 ** 12)], "which grows with --episodes"),
    (["reproduce", "--seeds", str(10 ** 6)], "--seeds"),
    (["digits", "--lengths", f"1,{10 ** 12}"], "which grows with --lengths"),
    (["parity", "--digits", str(10 ** 9)], "which grows with --digits"),
    (["programs", "--hidden", str(10 ** 7)], "which grows with --hidden"),
    (["language", "--hidden", f"10,{10 ** 6}"], "which grows with --hidden"),
    # counts that would hang or exhaust the machine
    (["static", "--threads", "100000"], "argument --threads: expected at most"),
    (["static", "--seeds", str(10 ** 8)], "argument --seeds: expected at most 1000000"),
    (["static", "--seeds", "1e8"], "argument --seeds: expected an integer >= 1, got '1e8'"),
    (["static", "--steps", "1e23"], "argument --steps: expected an integer >= 1, got '1e23'"),
    (["static", "--steps", str(10 ** 23)], "argument --steps: expected at most 1000000000000"),
    (["reproduce", "--steps", str(10 ** 23)], "argument --steps: expected at most"),
    (["digits", "--pretrain-steps", str(10 ** 13)], "argument --pretrain-steps: expected at most"),
    # numbers that have no meaning
    (["gridworld", "--lr", "inf"], "argument --lr: expected a finite number > 0, got 'inf'"),
    (["gridworld", "--lr", "-1"], "argument --lr: expected a finite number > 0, got '-1'"),
    (["gridworld", "--envs", "0"], "argument --envs: expected an integer >= 1, got '0'"),
    (["gridworld", "--episodes", "2.5"], "argument --episodes: expected an integer >= 1, got '2.5'"),
    (["gridworld", "--eval-t-max", "5"], "--eval-t-max must be at least 13"),
    # ranges whose targets (and success thresholds) overflow the training dtype
    (["static", "--extrap", "1e308", "1.7e308"], "--extrap (the extrapolation range)"),
    (["static", "--op", "mul", "--extrap", "1e18", "2e18"], "--extrap (the extrapolation range)"),
    (["static", "--interp", "1e37", "2e37", "--extrap", "2e37", "3e37"], "--interp (the training range)"),
    (["static", "--interp", "1e18", "2e18", "--extrap", "2e18", "3e18"], "their squares, the training loss,"),
    (["recurrent", "--interp", "1e18", "2e18"], "--interp with --train-length"),
    (["recurrent", "--extrap", "1e36", "2e36"], "--extrap with --extrap-length"),
])
def test_refused_before_any_work(argv, message, capsys, tmp_path):
    t0 = time.perf_counter()
    code, err = _exit_code(argv + ["--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) > 20
    assert time.perf_counter() - t0 < 5  # refused at start (well under a second on an idle machine)
    assert not (tmp_path / "out").exists()


def test_memory_message_names_what_and_the_limit(capsys, tmp_path):
    code, err = _exit_code(["static", "--n-test", BIG, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "static/nac-add-1_2-to-2_6 needs about" in err and "more than this machine's 16 GiB" in err
    assert "for the float64 inputs of the evaluation sets' targets, which grows with --n-test, --seeds" in err


def test_estimate_passes_what_fits_and_refuses_what_does_not():
    small = static_config("nac", ["add"], 4, 100)
    resources.check_memory([small], limit=1.0 * GiB)
    huge = static_config("nac", ["add", "mul"], 16, 100, hidden=10 ** 9)
    with pytest.raises(resources.ResourceError, match=r"which grows with --hidden, --seeds, --op"):
        resources.check_memory([small, huge], limit=16.0 * GiB)
    with pytest.raises(resources.ResourceError, match=r"which grows with --n-test"):
        resources.check_memory([static_config("nac", ["add"], 16, 100, n_test=10 ** 9)], limit=16.0 * GiB)


def test_every_profile_fits_in_a_few_gib():
    """The estimates never refuse the published budgets (the largest configuration is below 2 GiB)."""
    for exp in all_experiments():
        for profile in exp.profiles:
            for cfg in exp.profile_configs(profile):
                need = resources.config_bytes(exp.memory(cfg))
                assert 0 < need < 2 * GiB, (cfg.key, resources.fmt_bytes(need))


def test_memory_limit_reads_the_machine():
    assert REAL_MEMORY_LIMIT("cpu") > 2 ** 26


def test_fmt_bytes():
    assert resources.fmt_bytes(512) == "512 B"
    assert resources.fmt_bytes(1.5 * GiB) == "1.5 GiB"
    assert "float" in resources.fmt_bytes(float("inf"))


def test_largest_target_and_check_targets():
    r = ar.Range(((2.0, 6.0),))
    assert ar.largest_target("add", r, 25) == 300.0
    assert ar.largest_target("mul", r, 25) == 150.0 ** 2
    assert ar.largest_target("div", r, 25) == 3.0
    assert ar.largest_target("div", ar.Range(((-2.0, 2.0),)), 25) == 0.0  # no bound: not refused
    ar.check_targets(list(ar.OPS), r, 25, "--extrap")
    ar.check_targets(["add"], ar.Range(((1e18, 2e18),)), 25, "--extrap")  # a test range: targets finite
    with pytest.raises(ValueError, match=r"their squares, the training loss"):
        ar.check_targets(["add"], ar.Range(((1e18, 2e18),)), 25, "--interp", training=True)
    with pytest.raises(ValueError, match=r"^--extrap: .*a \* b up to"):
        ar.check_targets(["add", "mul"], ar.Range(((1e18, 2e18),)), 25, "--extrap")
    with pytest.raises(ValueError, match=r"a / b up to"):
        ar.check_targets(["div"], ar.Range(((1e-300, 1.0),)), 25, "--extrap")


@pytest.mark.parametrize("raised, words", [
    (OSError(errno.ENOSPC, "No space left on device", "x/result.json"),
     ["could not write x/result.json: No space left on device"]),
    (OSError(errno.ENOSPC, "No space left on device"), ["could not write a file in", "No space left on device"]),
    (MemoryError(), ["ran out of memory"]),
])
def test_failure_during_a_run_is_one_line(raised, words, monkeypatch, capsys, tmp_path):
    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(runner, "run_configs", fail)
    code, err = _exit_code(["static", *TINY, "--out", str(tmp_path)], capsys)
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    for w in words + ["the configurations that finished are kept in", "--resume"]:
        assert w in err


def test_full_disk_while_writing_a_result(monkeypatch, capsys, tmp_path):
    """The real writer fails: one line naming the file; a rerun with --resume finishes the run."""
    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(runner, "atomic_write_text", full)
        code, err = _exit_code(["static", "--model", "nac", *TINY, "--out", str(out)], capsys)
    assert code == 1 and "Traceback" not in err
    assert "could not write" in err and "result.json: No space left on device" in err and "--resume" in err
    assert cli.main(["static", "--model", "nac", *TINY, "--out", str(out), "--resume"]) == 0
