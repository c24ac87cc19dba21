"""The nalu-cuda command: outputs, argument errors (exit code 2), resume and checkpoint safety."""
import json
import os
import subprocess
import sys

import pytest
import torch

from nalu_cuda import cli
from nalu_cuda.experiments import runner
from nalu_cuda.experiments.tasks.static import static_config

SMALL = dict(eval_every=20, n_valid=200, n_test=200, baseline_models=4, threshold_samples=5_000)
TINY = ["--seeds", "2", "--steps", "40", "--eval-every", "20", "--n-test", "200", "--no-progress"]


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["static", "--model", "transformer"], "unknown model"),
    (["static", "--op", "pow"], "unknown operation"),
    (["static", "--interp", "2", "1"], "empty range"),
    (["static", "--interp", "1"], "pairs"),
    (["static", "--interp", "1", "2", "--extrap", "1.2", "1.8"], "inside the training range"),
    (["static", "--seeds", "0"], "argument --seeds: expected an integer >= 1, got '0'"),
    (["static", "--steps", "-5"], "argument --steps: expected an integer >= 1, got '-5'"),
    (["static", "--steps", "1.5"], "argument --steps: expected an integer >= 1, got '1.5'"),
    (["recurrent", "--clip", "-1"], "argument --clip: expected a finite number > 0, got '-1'"),
    (["recurrent", "--clip", "0"], "argument --clip: expected a finite number > 0, got '0'"),
    (["static", "--lr", "-1"], "argument --lr: expected a finite number > 0, got '-1'"),
    (["identity", "--lr", "inf"], "argument --lr: expected a finite number > 0, got 'inf'"),
    (["identity", "--train-range", "-5", "nan"], "argument --train-range: expected a finite number, got 'nan'"),
    (["static", "--interp", "1", "inf"], "argument --interp: expected a finite number, got 'inf'"),
    (["static", "--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
    (["static", "--n-test", "0"], "argument --n-test: expected an integer >= 1, got '0'"),
    (["recurrent", "--train-length", "0"], "argument --train-length: expected an integer >= 1, got '0'"),
    (["digits", "--max-train", "0"], "argument --max-train: expected an integer >= 1, got '0'"),
    (["digits", "--pretrain-steps", "-1"], "argument --pretrain-steps: expected an integer >= 0, got '-1'"),
    (["parity", "--max-train", "-3"], "argument --max-train: expected an integer >= 1, got '-3'"),
    (["programs", "--hidden", "0"], "argument --hidden: expected an integer >= 1, got '0'"),
    (["language", "--lrs", "0.1,nan"], "argument --lrs: expected a finite number > 0, got 'nan' (in the list"),
    (["language", "--hidden", "10,"], "argument --hidden: expected a comma-separated list, got '10,'"),
    (["language", "--split-seed", "-1"], "argument --split-seed: expected an integer >= 0, got '-1'"),
    (["static", "--checkpoint-every", "-1"], "argument --checkpoint-every: expected a finite number >= 0, got '-1'"),
    (["static", "--checkpoint-every", "nan"], "argument --checkpoint-every: expected a finite number >= 0, got 'nan'"),
    (["static", "--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
    (["static", "--device", "meta"], "argument --device: device 'meta' cannot run the experiments here"),
    (["static", "--device", "mps"], "argument --device: device 'mps' cannot run the experiments here"),
    (["static", "--device", "tpu9"], "argument --device: unknown device 'tpu9'; allowed: cpu"),
    (["reproduce", "--device", "meta"], "argument --device: device 'meta' cannot run the experiments here"),
    (["reproduce", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    (["identity", "--model", "swish"], "unknown identity model"),
    (["recurrent", "--model", "transformer"], "unknown model"),
    (["recurrent", "--extrap-length", "5"], "inside training"),
    (["reproduce", "--only", "nothing"], "unknown experiment"),
    (["reproduce", "--profile", "huge"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2(argv, message, capsys, tmp_path):
    code, err = _exit_code(argv + ["--out", str(tmp_path)] if argv[0] != "frobnicate" else argv, capsys)
    assert code == 2
    assert message in err


def test_out_is_not_an_empty_path(capsys):
    code, err = _exit_code(["static", "--out", ""], capsys)
    assert code == 2 and "argument --out: expected a directory, got an empty path ''" in err


def test_mnist_dir_without_the_files_exits_2(tmp_path, capsys):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    for cmd in ("digits", "parity"):
        code, err = _exit_code([cmd, "--mnist-dir", str(tmp_path), "--out", str(tmp_path / "out")], capsys)
        assert code == 2
        assert f"argument --mnist-dir: '{tmp_path}' has no train-labels-idx1-ubyte[.gz] file" in err
        code, err = _exit_code([cmd, "--mnist-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out")], capsys)
        assert code == 2 and "which is not a directory" in err
    assert not (tmp_path / "out").exists()


def test_static_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["static", "--model", "nac", "relu6", "--op", "add", "sub", *TINY, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    recs = summary["records"]
    assert {(r["model"], r["op"]) for r in recs} == {("nac", "add"), ("nac", "sub"), ("relu6", "add"), ("relu6", "sub")}
    for r in recs:
        for k in ("experiment", "model", "op", "interp", "extrap", "seeds", "steps", "success_rate", "success_ci",
                  "solved_at_median", "interp_error_median", "extrap_error_median", "divergence_rate"):
            assert k in r, k
    rows = (out / "per_seed_static.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2 * 2 * 2
    report = (out / "report.md").read_text()
    assert "Static arithmetic" in report and "Madsen" in report and "_The report section of" not in report
    assert (out / "static_error_vs_range.png").stat().st_size > 1000
    # rerunning without --resume refuses to overwrite; --resume keeps the results
    code, err = _exit_code(["static", "--model", "nac", "relu6", "--op", "add", "sub", *TINY, "--out", str(out)], capsys)
    assert code == 2 and "--resume" in err
    mtime = os.path.getmtime(runner.result_path(str(out), static_config("nac", ["add", "sub"], 2, 40, eval_every=20,
                                                                           n_valid=200, n_test=200)))
    assert cli.main(["static", "--model", "nac", "relu6", "--op", "add", "sub", *TINY, "--out", str(out), "--resume"]) == 0
    assert os.path.getmtime(runner.result_path(str(out), static_config("nac", ["add", "sub"], 2, 40, eval_every=20,
                                                                         n_valid=200, n_test=200))) == mtime


def interrupted_at_third_checkpoint(cfg, out: str, monkeypatch) -> None:
    """Run ``cfg`` into ``out`` with a checkpoint at every evaluation, killed (KeyboardInterrupt)
    right after its third checkpoint is written."""
    save = runner.atomic_torch_save
    calls = []

    def killed_after_third_checkpoint(path, obj):
        save(path, obj)
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "atomic_torch_save", killed_after_third_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        runner.run_one(cfg, out, progress=False, checkpoint_every_s=0, log=lambda m: None)
    monkeypatch.setattr(runner, "atomic_torch_save", save)


def test_resume_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    cfg = static_config("nalu", ["add", "mul"], 2, 120, **SMALL)
    ref = runner.run_one(cfg, str(tmp_path / "a"), progress=False, log=lambda m: None)
    b = str(tmp_path / "b")
    interrupted_at_third_checkpoint(cfg, b, monkeypatch)
    assert os.path.exists(runner.checkpoint_path(b, cfg)) and not os.path.exists(runner.result_path(b, cfg))
    with pytest.raises(runner.RunError, match="--resume"):
        runner.run_one(cfg, b, progress=False, log=lambda m: None)
    logs = []
    res = runner.run_one(cfg, b, progress=False, resume=True, checkpoint_every_s=0, log=logs.append)
    assert any("resumed at step 60" in m for m in logs)
    assert res.records == ref.records
    assert not os.path.exists(runner.checkpoint_path(b, cfg))


def test_corrupt_or_mismatched_files_are_refused(tmp_path):
    out = str(tmp_path)
    cfg = static_config("nac", ["add"], 1, 20, **SMALL)
    os.makedirs(runner.config_dir(out, cfg))
    ck = runner.checkpoint_path(out, cfg)
    with open(ck, "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(runner.RunError, match="damaged"):
        runner.run_one(cfg, out, progress=False, log=lambda m: None)
    logs = []  # --resume recomputes from the start, says so, and keeps the damaged checkpoint aside
    assert len(runner.run_one(cfg, out, resume=True, progress=False, log=logs.append).records) == 1
    assert any("damaged" in m and ck in m for m in logs) and open(ck + ".damaged", "rb").read() == b"not a checkpoint"
    os.unlink(runner.result_path(out, cfg))
    other = static_config("nac", ["add"], 1, 20, name=cfg.name, **{**SMALL, "lr": 0.5})
    torch.save(runner.seal({"fingerprint": other.fingerprint(), "config": other.to_dict(), "state": {}}), ck)
    with pytest.raises(runner.RunError, match="different configuration"):
        runner.run_one(cfg, out, resume=True, progress=False, log=lambda m: None)
    os.unlink(ck)
    rp = runner.result_path(out, cfg)
    with open(rp, "w") as f:
        f.write('{"truncated": ')
    with pytest.raises(runner.RunError, match="damaged"):
        runner.run_one(cfg, out, progress=False, log=lambda m: None)
    logs = []  # --resume recomputes a damaged result, says so, and keeps the damaged file aside
    res = runner.run_one(cfg, out, resume=True, progress=False, log=logs.append)
    assert len(res.records) == 1 and any("damaged" in m and rp in m for m in logs)
    assert open(rp + ".damaged").read() == '{"truncated": '
    res = runner.run_one(cfg, out, overwrite=True, progress=False, log=lambda m: None)
    assert len(res.records) == 1
    runner.run_one(other, out, overwrite=True, progress=False, log=lambda m: None)
    with pytest.raises(runner.RunError, match="different configuration"):
        runner.run_one(cfg, out, resume=True, progress=False, log=lambda m: None)


def test_list_and_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "nalu_cuda", "list"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    for name in ("identity", "static", "recurrent"):
        assert f"{name}:" in proc.stdout


def test_list_prints_what_the_commands_build(capsys):
    """`list` (the commands' defaults) and `list --profile P` (the profile's) come from the functions the
    commands use: every configuration of `identity` and of `identity --profile quick` is listed."""
    parser = cli.build_parser()
    for argv, listed in ((["identity"], ["list"]), (["identity", "--profile", "paper"], ["list", "--profile", "paper"])):
        want = cli._configs(parser.parse_args(argv))
        assert cli.main(listed) == 0
        out = capsys.readouterr().out
        for c in want:
            assert f"    {c.name}: {c.seeds:,} seeds x {c.steps:,} steps, " in out
        assert ("Profile paper" in out) == ("--profile" in listed)
        assert "on two torchrun ranks)" in out and "In all: " in out


def test_list_hours_follow_the_measured_rate():
    """The estimate is seeds x steps x the cost factors over the measured CPU rate: the standard
    profile's NAC+ cell (measured 1037 s on a rank, on the native step) is listed at about 17 minutes."""
    from nalu_cuda.experiments import distributed
    from nalu_cuda.experiments.tasks import static

    (nac_add,) = [c for c in static.profile_configs("standard") if c.name == "standard-nac-add"]
    assert 1037 / 1.5 < distributed.estimated_hours([nac_add]) * 3600 < 1037 * 1.5
    assert distributed.estimated_hours([nac_add], ranks=2) == distributed.estimated_hours([nac_add]) / 2
    from nalu_cuda.experiments.costs import fmt_hours
    assert fmt_hours(0.001) == "<1 min" and fmt_hours(0.5) == "~30 min" and fmt_hours(4.63) == "~4.6 h"


def test_every_command_takes_profile_and_its_help_shows_the_defaults(capsys):
    from nalu_cuda.experiments import all_experiments, get

    parser = cli.build_parser()
    for exp in all_experiments():
        for profile in exp.profiles:
            args = parser.parse_args([exp.name, "--profile", profile, "--seeds", "3"])
            got = cli._configs(args)
            assert [c.name for c in got] == [c.name for c in exp.profile_configs(profile)]
            assert {c.seeds for c in got} == {3}
        default = cli._configs(parser.parse_args([exp.name]))
        with pytest.raises(SystemExit):
            cli.main([exp.name, "-h"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert f"(default: {default[0].seeds:,}" in help_text and f"(default: {default[0].steps:,}" in help_text
    # the identity command trains what the quick profile does (one budget)
    assert [c.fingerprint() for c in cli._configs(parser.parse_args(["identity"]))] == \
        [c.fingerprint() for c in get("identity").profile_configs("quick")]
    code, err = _exit_code(["static", "--profile", "paper", "--model", "nalu"], capsys)
    assert code == 2 and "cannot be combined with --model" in err


def test_results_table_and_one_line_for_a_rerun(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = ["identity", "--model", "none", "nac", "--seeds", "2", "--steps", "20", "--no-progress", "--out", out]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "identity/none" in printed and "identity/nac" in printed and "MAE outside" in printed
    code, err = _exit_code(argv, capsys)  # a rerun: one line for both configurations, with the count
    assert code == 2 and "2 files (" in err and err.count("already holds") == 1
    assert cli.main(argv + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "[skip] 2 configurations finished earlier, kept" in err and "[1/2]" not in err and "[2/2]" not in err
