"""Output directories: one run at a time, --overwrite and --resume against damaged results, the user's
own files, file modes, and unusable --out paths. Every run is a tiny static-arithmetic one."""
import json
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from nalu_cuda import cli
from nalu_cuda.experiments import outdir, report, runner
from nalu_cuda.experiments.tasks.static import static_config

TINY = ["static", "--model", "nac", "relu6", "--op", "add", "--seeds", "1", "--steps", "20", "--eval-every", "20",
        "--n-test", "100", "--no-progress"]
SMALL = dict(eval_every=20, n_valid=100, n_test=100, baseline_models=2, threshold_samples=2_000)


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    # laying out and writing the report's figures takes most of a tiny run; they are tested in test_cli.py
    monkeypatch.setattr(report, "save_figure", lambda fig, out_dir, name, dpi=110, **kw: report.plt().close(fig))


def _run(argv, capsys):
    """(exit code, stderr) of one ``nalu-cuda`` call."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _results(out):
    return sorted(str(p) for p in out.glob("runs/static/*/result.json"))


def test_a_second_run_into_a_locked_directory_is_refused_until_the_holder_dies(tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        # outdir.py needs only the standard library: loaded alone, the holder starts in a blink
        [sys.executable, "-c", "import importlib.util, sys, time\n"
                               "spec = importlib.util.spec_from_file_location('outdir', sys.argv[1])\n"
                               "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
                               "m.OutputDir(sys.argv[2]).open()\nprint('locked', flush=True)\ntime.sleep(120)",
         outdir.__file__, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, err = _run([*TINY, "--out", str(out)], capsys)
        assert code == 2
        assert f"--out {out} is in use by another nalu-cuda run (pid {holder.pid} on host" in err
        assert not _results(out)
    finally:
        holder.kill()  # SIGKILL: the kernel drops the holder's lock, the lock file stays behind
        holder.wait()
    assert (out / outdir.LOCK_NAME).exists()
    code, err = _run([*TINY, "--out", str(out)], capsys)
    assert code == 0, err
    assert len(_results(out)) == 2


def test_overwrite_and_resume_with_a_damaged_result_later_in_the_run(tmp_path, capsys):
    out = tmp_path / "out"
    assert _run([*TINY, "--out", str(out)], capsys)[0] == 0
    first, second = _results(out)
    good = open(first).read()
    with open(second, "w") as f:
        f.write('{"fingerprint": "0", "trunc')
    # without --resume or --overwrite: the damaged file is named, with what is wrong and what to do
    code, err = _run([*TINY, "--out", str(out)], capsys)
    assert code == 2
    assert f"result file {second} is damaged (unreadable" in err and "--resume" in err and "--overwrite" in err
    # --overwrite discards every result of the run first, then runs them all (it used to fail again at the
    # damaged file after recomputing the first configuration, at every attempt)
    code, err = _run([*TINY, "--out", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert [json.load(open(p))["config"]["name"] for p in _results(out)] == ["nac-add-1_2-to-2_6", "relu6-add-1_2-to-2_6"]
    # --resume keeps the good result and recomputes the damaged one, with a warning
    good = open(first).read()
    with open(second, "w") as f:
        f.write("[]")
    code, err = _run([*TINY, "--out", str(out), "--resume"], capsys)
    assert code == 0, err
    assert f"warning: result file {second} is damaged (expected a JSON object, found list)" in err
    assert open(first).read() == good and json.load(open(second))["records"]
    assert open(second + ".damaged").read() == "[]"


def test_a_hand_edited_result_with_a_missing_field_is_named(tmp_path, capsys):
    out = tmp_path / "out"
    assert _run([*TINY, "--out", str(out)], capsys)[0] == 0
    rp = _results(out)[0]
    data = json.load(open(rp))
    del data["config"]["steps"]
    with open(rp, "w") as f:
        json.dump(data, f)
    code, err = _run([*TINY, "--out", str(out), "--resume"], capsys)
    assert code == 0, err
    assert f"warning: result file {rp} is damaged (field 'config.steps' is missing)" in err
    # a damaged result of a configuration outside the run: an error naming it, before any training
    with open(rp, "w") as f:
        json.dump({**data, "records": "none"}, f)
    code, err = _run(["static", "--model", "nac", "--op", "sub", *TINY[6:], "--out", str(out)], capsys)
    assert code == 2
    assert f"result file {rp} is damaged (field 'records' is a str, not a list); its configuration is not part" in err
    assert not (out / "runs" / "static" / "nac-sub").exists()
    # ... and that error comes before --overwrite deletes the run's own results
    kept = _results(out)[1]
    code, err = _run(["static", "--model", "relu6", *TINY[4:], "--out", str(out), "--overwrite"], capsys)
    assert code == 2 and f"result file {rp} is damaged" in err
    assert json.load(open(kept))["records"]


def test_a_hand_edited_checkpoint_with_a_missing_field_is_named(tmp_path, monkeypatch):
    cfg = static_config("nac", ["add"], 1, 60, **SMALL)
    out = str(tmp_path)
    save = runner.atomic_torch_save

    def interrupted(path, obj):
        save(path, obj)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "atomic_torch_save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_one(cfg, out, progress=False, checkpoint_every_s=0, log=lambda m: None)
    monkeypatch.setattr(runner, "atomic_torch_save", save)
    ck = runner.checkpoint_path(out, cfg)
    data = torch.load(ck, weights_only=True)
    history = data["state"].pop("history")
    torch.save(runner.seal(data), ck)  # sealed again: as if written so (edits alone break the checksum)
    other = static_config("nac", ["add"], 1, 80, name=cfg.name, **SMALL)  # same name, other settings
    with pytest.raises(runner.RunError, match=f"checkpoint {ck} belongs to a different configuration"):
        runner.run_one(other, out, progress=False, log=lambda m: None)
    with pytest.raises(runner.RunError, match=f"checkpoint {ck}: field 'state.history' is missing"):
        runner.run_one(cfg, out, resume=True, progress=False, log=lambda m: None)
    data["state"]["history"] = history
    name = next(iter(data["state"]["model"]))
    del data["state"]["model"][name]
    torch.save(runner.seal(data), ck)
    with pytest.raises(runner.RunError, match=f"checkpoint {ck}: field 'state.model.{name}' is missing, expected a"):
        runner.run_one(cfg, out, resume=True, progress=False, log=lambda m: None)
    del data["state"]
    torch.save(runner.seal(data), ck)
    with pytest.raises(runner.RunError, match="has no field 'state'"):
        runner.run_one(cfg, out, resume=True, progress=False, log=lambda m: None)


def test_files_of_the_user_are_never_replaced_without_overwrite(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("my notes")
    code, err = _run([*TINY, "--out", str(out)], capsys)
    assert code == 2
    assert f"--out {out} is not empty (report.md) and is not a nalu-cuda output directory" in err
    assert (out / "report.md").read_text() == "my notes" and not _results(out)
    code, err = _run([*TINY, "--out", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert "Static arithmetic" in (out / "report.md").read_text()
    # in a nalu-cuda directory, a file nalu-cuda did not write is refused by name
    (out / "per_seed_identity.csv").write_text("mine")
    with outdir.OutputDir(str(out)) as od:
        od.write_text("summary.json", "{}")  # written by nalu-cuda before: replaced
        with pytest.raises(runner.RunError, match="per_seed_identity.csv exists and was not written by nalu-cuda"):
            od.write_text("per_seed_identity.csv", "x")
    assert (out / "per_seed_identity.csv").read_text() == "mine"
    # a plot of the user's under the name of one of the report's: refused, the results are kept
    (out / "per_seed_identity.csv").unlink()
    (out / "static_error_vs_range.png").write_text("my plot")
    monkeypatch.undo()  # draw the figures
    code, err = _run([*TINY, "--out", str(out), "--resume"], capsys)
    assert code == 2 and "static_error_vs_range.png exists and was not written by nalu-cuda" in err
    assert (out / "static_error_vs_range.png").read_text() == "my plot" and len(_results(out)) == 2


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        cfg = static_config("nac", ["add"], 1, 20, **SMALL)
        runner.run_configs([cfg], str(tmp_path), progress=False, log=lambda m: None)
        runner.atomic_torch_save(str(tmp_path / "checkpoint.pt"), {})
    finally:
        os.umask(old)
    files = ["summary.json", "report.md", "per_seed_static.csv", "checkpoint.pt", runner.result_path("", cfg)]
    for name in files:
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name


@pytest.mark.parametrize("out, message", [
    ("/proc/nalu-cuda-out", "--out /proc/nalu-cuda-out: cannot write there"),
    ("/proc/self", "--out /proc/self: cannot write there"),
    ("FILE", "this is an existing file, not a directory"),
])
def test_unusable_out_paths_exit_2(out, message, tmp_path, capsys):
    if out == "FILE":
        out = str(tmp_path / "file")
        open(out, "w").close()
    code, err = _run([*TINY, "--out", out], capsys)
    assert code == 2
    assert message in err


def test_a_directory_of_an_older_nalu_cuda_is_taken_over(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"meta": {"nalu_cuda": "0.1"}, "records": []}))
    (out / "report.md").write_text("old report")
    (out / "identity_fig1.png").write_bytes(b"png")
    code, err = _run([*TINY, "--out", str(out)], capsys)
    assert code == 0, err
    assert "Static arithmetic" in (out / "report.md").read_text()


def _records(out):
    return [json.load(open(p))["records"] for p in _results(out)]


def test_ctrl_c_exits_130_releases_the_lock_and_resume_gives_the_uninterrupted_result(tmp_path, capsys, monkeypatch):
    argv = ["static", "--model", "nac", "--op", "add", "mul", *TINY[6:], "--steps", "80", "--checkpoint-every", "0"]
    assert _run([*argv, "--out", str(tmp_path / "a")], capsys)[0] == 0
    save = runner.atomic_torch_save

    def ctrl_c_after_the_second_checkpoint(path, obj, calls=[]):
        save(path, obj)
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "atomic_torch_save", ctrl_c_after_the_second_checkpoint)
    b = tmp_path / "b"
    code, err = _run([*argv, "--out", str(b)], capsys)
    assert code == 130 and "--resume" in err
    monkeypatch.setattr(runner, "atomic_torch_save", save)
    assert list(b.glob("runs/static/*/checkpoint.pt")) and not _results(b)
    code, err = _run([*argv, "--out", str(b), "--resume"], capsys)  # the lock went with the interrupted run
    assert code == 0, err
    assert "resumed at step 40" in err
    assert _records(b) == _records(tmp_path / "a")


def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_result(tmp_path, capsys):
    # The one test of a real SIGKILL (a subprocess, a few seconds): the lock dies with the process and
    # --resume continues bit for bit from the last checkpoint.
    argv = ["static", "--model", "nac", "--op", "add", *TINY[6:], "--steps", "300", "--checkpoint-every", "0"]
    b = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", "nalu_cuda", *argv, "--threads", "1", "--out", str(b)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        while proc.poll() is None and not list(b.glob("runs/static/*/checkpoint.pt")):
            time.sleep(0.01)
        proc.kill()
    finally:
        proc.wait()
    assert proc.returncode == -9, proc.stderr.read()
    assert not _results(b)
    code, err = _run([*argv, "--out", str(b), "--resume"], capsys)
    assert code == 0, err
    assert "resumed at step" in err
    assert _run([*argv, "--out", str(tmp_path / "a")], capsys)[0] == 0
    assert _records(b) == _records(tmp_path / "a")
