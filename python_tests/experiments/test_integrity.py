"""Results and checkpoints prove their integrity on --resume: a hand-damaged result or checkpoint (its
checksum, or its fingerprint, no longer fits its content) is named, kept aside and recomputed, to the
records of the undamaged run bit for bit; a sealed checkpoint holding a field unlike the state this run
saves is a RunError naming the file and the field. Every case damages a copy of one tiny run."""
import json
import os
import shutil

import pytest
import torch

from nalu_cuda import cli
from nalu_cuda.experiments import report, runner, seed_blocks
from nalu_cuda.experiments.tasks.static import static_config

SMALL = dict(eval_every=20, n_valid=100, n_test=100, baseline_models=2, threshold_samples=2_000)
CFG = static_config("nac", ["add"], 2, 60, **SMALL)
QUIET = dict(progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """``(records, finished out dir, interrupted out dir)`` of CFG: the interrupted one holds the
    checkpoint at step 20 of 60."""
    root = tmp_path_factory.mktemp("integrity")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests' own runs (conftest)
    save = runner.atomic_torch_save

    def interrupted(path, obj):
        save(path, obj)
        raise KeyboardInterrupt

    try:
        records = runner.run_one(CFG, str(root / "done"), **QUIET).records
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(runner, "atomic_torch_save", interrupted)
            with pytest.raises(KeyboardInterrupt):
                runner.run_one(CFG, str(root / "part"), checkpoint_every_s=0, **QUIET)
    finally:
        torch.set_num_threads(threads)
    return records, str(root / "done"), str(root / "part")


def _copy(src, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(src, out)
    return out


def _json_edit(edit):
    def damage(text):
        data = json.loads(text)
        edit(data)
        return json.dumps(data)
    return damage


def _resealed(edit):
    """An edit, then the checksum made to fit again (as a careful hand, or another program, would)."""
    return _json_edit(lambda d: (edit(d), d.update(runner.seal(d))))


def _set(path, value):
    def edit(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value(d[last]) if callable(value) else value
    return edit


RESULT_DAMAGES = {
    "records emptied": _json_edit(_set(["records"], [])),
    "records duplicated": _json_edit(_set(["records"], lambda r: r + r)),
    "success flipped": _json_edit(_set(["records", 0, "success"], lambda v: not v)),
    "config.seeds edited": _json_edit(_set(["config", "seeds"], 1)),
    "config.name edited": _json_edit(_set(["config", "name"], "other")),
    "config.experiment edited": _json_edit(_set(["config", "experiment"], "identity")),
    "summaries edited": _json_edit(_set(["summaries", 0, "n_records"], 3)),
    "extra edited": _json_edit(_set(["extra", "thresholds"], None)),
    "fingerprint edited": _json_edit(_set(["fingerprint"], "0" * 16)),
    "checksum edited": _json_edit(_set(["checksum"], "0" * 64)),
    "checksum removed (an older nalu-cuda)": _json_edit(lambda d: (d.pop("checksum"), d.update(version=1))),
    "resealed with another configuration": _resealed(_set(["config", "seeds"], 1)),
    "truncated": lambda text: text[:len(text) // 2],
    "emptied": lambda text: "",
    "not an object": lambda text: "[]",
}


@pytest.mark.parametrize("damage", sorted(RESULT_DAMAGES))
def test_a_damaged_result_is_kept_aside_and_recomputed(clean, tmp_path, damage):
    records, done, _ = clean
    out = _copy(done, tmp_path)
    rp = runner.result_path(out, CFG)
    damaged = RESULT_DAMAGES[damage](open(rp).read())
    with open(rp, "w") as f:
        f.write(damaged)
    with pytest.raises(runner.RunError, match=f"result file {rp} is damaged .*--resume"):
        runner.run_one(CFG, out, **QUIET)  # without --resume: named, and left as it is
    assert open(rp).read() == damaged
    logs = []
    res = runner.run_one(CFG, out, resume=True, progress=False, log=logs.append)
    assert any(m.startswith(f"warning: result file {rp} is damaged (") and "result.json.damaged" in m for m in logs)
    assert res.records == records and runner.read_result(rp)["records"] == records
    assert open(rp + ".damaged").read() == damaged


def test_a_second_damage_keeps_the_first(clean, tmp_path):
    records, done, _ = clean
    out = _copy(done, tmp_path)
    rp = runner.result_path(out, CFG)
    for text in ("", "[]"):
        with open(rp, "w") as f:
            f.write(text)
        assert runner.run_one(CFG, out, resume=True, **QUIET).records == records
    assert open(rp + ".damaged").read() == "" and open(rp + ".damaged-2").read() == "[]"


def test_resume_recomputes_an_emptied_result_in_every_output(clean, tmp_path, capsys, monkeypatch):
    # the reproduction: records set to [] were kept, and summary.json disagreed with the CSV
    monkeypatch.setattr(report, "save_figure", lambda fig, out_dir, name, dpi=110, **kw: report.plt().close(fig))
    out = str(tmp_path / "out")
    argv = ["static", "--model", "nac", "--op", "add", "--seeds", "2", "--steps", "40", "--eval-every", "20",
            "--n-test", "100", "--no-progress", "--out", out]
    assert cli.main(argv) == 0
    rp = next(os.path.join(d, "result.json") for d, _, files in os.walk(out) if "result.json" in files)
    good = json.load(open(rp))["records"]
    damaged = _json_edit(_set(["records"], []))(open(rp).read())
    with open(rp, "w") as f:
        f.write(damaged)
    capsys.readouterr()
    assert cli.main(argv + ["--resume"]) == 0
    assert f"warning: result file {rp} is damaged" in capsys.readouterr().err
    assert json.load(open(rp))["records"] == good
    summary = json.load(open(os.path.join(out, "summary.json")))["records"]
    rows = open(os.path.join(out, "per_seed_static.csv")).read().splitlines()[1:]
    assert summary[0]["n_records"] == len(rows) == 2


def _state(path, value):
    return _set(["state", *path], value)


def _pop(path):
    def edit(d):
        for k in ["state", *path[:-1]]:
            d = d[k]
        d.pop(path[-1])
    return edit


def _first_model_tensor(value):
    def edit(d):
        model = d["state"]["model"]
        model[next(iter(model))] = value
    return edit


# name: (edit of the checkpoint's data, the field a sealed one is refused for)
CHECKPOINT_DAMAGES = {
    "step 10**6": (_state(["step"], 10 ** 6), "state.step"),
    "step -5": (_state(["step"], -5), "state.step"),
    "step 1.5": (_state(["step"], 1.5), "state.step"),
    "step '7'": (_state(["step"], "7"), "state.step"),
    "step None": (_state(["step"], None), "state.step"),
    "step missing": (_pop(["step"]), "state.step"),
    "diverged of another shape": (_state(["diverged"], torch.zeros(3, dtype=torch.bool)), "state.diverged"),
    "diverged of another dtype": (_state(["diverged"], torch.zeros(2)), "state.diverged"),
    "diverged None": (_state(["diverged"], None), "state.diverged"),
    "opt.exp_avg of another shape": (_state(["opt", "exp_avg"], lambda t: t[:-1]), "state.opt.exp_avg"),
    "opt.exp_avg None": (_state(["opt", "exp_avg"], None), "state.opt.exp_avg"),
    "opt.exp_avg_sq missing": (_pop(["opt", "exp_avg_sq"]), "state.opt.exp_avg_sq"),
    "opt.step a string": (_state(["opt", "step"], "20"), "state.opt.step"),
    "stream None": (_state(["stream"], None), "state.stream"),
    "stream of one member": (_state(["stream", "states"], lambda s: s[:1]), "state.stream.states"),
    "best_step -5": (_state(["best", "best_step"], lambda t: torch.full_like(t, -5)), "state.best.best_step"),
    "best_step after the step": (_state(["best", "best_step"], lambda t: t + 1000), "state.best.best_step"),
    "best.saved None": (_state(["best", "saved"], None), "state.best.saved"),
    "solved_at of another shape": (_state(["solved_at"], lambda t: t[:1]), "state.solved_at"),
    "final_loss None": (_state(["final_loss"], None), "state.final_loss"),
    "history None": (_state(["history"], None), "state.history"),
    "history row cut": (_state(["history", "loss", 0], lambda r: r[:1]), "state.history.loss[0]"),
    "history step negative": (_state(["history", "loss", 0, 0], -20), "state.history.loss[0]"),
    "model tensor of another shape": (_first_model_tensor(torch.zeros(7)), "state.model."),
    "model tensor None": (_first_model_tensor(None), "state.model."),
}


def _ck_write(ck, edit, sealed):
    data = torch.load(ck, map_location="cpu", weights_only=True)
    edit(data)
    torch.save(runner.seal(data) if sealed else data, ck)


def test_an_intact_checkpoint_resumes_to_the_same_records(clean, tmp_path):
    records, _, part = clean
    out = _copy(part, tmp_path)
    logs = []
    assert runner.run_one(CFG, out, resume=True, progress=False, log=logs.append).records == records
    assert any("resumed at step 20" in m for m in logs)


def test_a_resumed_run_checkpoints_what_resumes_again(clean, tmp_path, monkeypatch):
    records, _, part = clean
    out = _copy(part, tmp_path)
    save = runner.atomic_torch_save

    def interrupted(path, obj):
        save(path, obj)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "atomic_torch_save", interrupted)
    with pytest.raises(KeyboardInterrupt):  # resumed at step 20, interrupted at its checkpoint at step 40
        runner.run_one(CFG, out, resume=True, checkpoint_every_s=0, **QUIET)
    monkeypatch.setattr(runner, "atomic_torch_save", save)
    logs = []
    assert runner.run_one(CFG, out, resume=True, progress=False, log=logs.append).records == records
    assert any("resumed at step 40" in m for m in logs) and not any("damaged" in m for m in logs)


@pytest.mark.parametrize("damage", sorted(CHECKPOINT_DAMAGES))
def test_a_hand_edited_checkpoint_is_kept_aside_and_recomputed(clean, tmp_path, damage):
    records, _, part = clean
    out = _copy(part, tmp_path)
    ck = runner.checkpoint_path(out, CFG)
    _ck_write(ck, CHECKPOINT_DAMAGES[damage][0], sealed=False)
    damaged = open(ck, "rb").read()
    logs = []
    res = runner.run_one(CFG, out, resume=True, progress=False, log=logs.append)
    assert any(m.startswith(f"warning: checkpoint {ck} is damaged (its checksum does not match") for m in logs)
    assert not any("resumed" in m for m in logs)  # from the start
    assert res.records == records and open(ck + ".damaged", "rb").read() == damaged


@pytest.mark.parametrize("damage", sorted(CHECKPOINT_DAMAGES))
def test_a_sealed_checkpoint_with_a_wrong_field_is_refused_naming_it(clean, tmp_path, damage):
    _, _, part = clean
    out = _copy(part, tmp_path)
    ck = runner.checkpoint_path(out, CFG)
    edit, field = CHECKPOINT_DAMAGES[damage]
    _ck_write(ck, edit, sealed=True)
    with pytest.raises(runner.RunError) as err:
        runner.run_one(CFG, out, resume=True, **QUIET)
    msg = str(err.value)
    assert msg.startswith(f"checkpoint {ck}: field '{field}") and ", expected " in msg and "--overwrite" in msg
    assert os.path.exists(ck)  # a sound file of another shape is not damage: it stays where it is


@pytest.mark.parametrize("damage", ["truncated", "garbage", "checksum removed", "not a dictionary"])
def test_a_damaged_checkpoint_file_is_kept_aside_and_recomputed(clean, tmp_path, damage):
    records, _, part = clean
    out = _copy(part, tmp_path)
    ck = runner.checkpoint_path(out, CFG)
    raw = open(ck, "rb").read()
    if damage == "checksum removed":  # as an older nalu-cuda wrote them
        _ck_write(ck, lambda d: (d.pop("checksum"), d.update(version=1)), sealed=False)
    elif damage == "not a dictionary":
        torch.save([1, 2], ck)
    else:
        with open(ck, "wb") as f:
            f.write(raw[:len(raw) // 2] if damage == "truncated" else b"not a checkpoint")
    damaged = open(ck, "rb").read()
    with pytest.raises(runner.RunError, match=f"checkpoint {ck} is damaged .*--resume"):
        runner.run_one(CFG, out, **QUIET)
    logs = []
    assert runner.run_one(CFG, out, resume=True, progress=False, log=logs.append).records == records
    assert any(m.startswith(f"warning: checkpoint {ck} is damaged") for m in logs)
    assert open(ck + ".damaged", "rb").read() == damaged


def test_blocks_of_seeds_are_sealed_and_a_damaged_one_recomputed(clean, tmp_path):
    records, _, _ = clean
    out = str(tmp_path / "out")
    blocks = [seed_blocks.block_config(CFG, 0, 1), seed_blocks.block_config(CFG, 1, 2)]
    for b in blocks:
        runner.run_one(b, out, **QUIET)
    parts = [((i, i + 1), runner.read_result(runner.result_path(out, b))) for i, b in enumerate(blocks)]
    tampered = dict(parts[0][1], records=[])
    with pytest.raises(runner.RunError, match=r"block \[0, 1\) is damaged \(its checksum"):
        seed_blocks.merge(CFG, [((0, 1), tampered), parts[1]])  # as rank 0 merges what the ranks sent
    bp = runner.result_path(out, blocks[0])
    with open(bp, "w") as f:
        f.write(json.dumps(tampered))
    logs = []
    res = runner.run_one(CFG, out, resume=True, progress=False, log=logs.append)
    assert any(m.startswith(f"warning: result file {bp} is damaged") for m in logs)
    assert res.records == records and runner.read_result(runner.result_path(out, CFG))["records"] == records
    assert os.listdir(os.path.dirname(bp)) == ["result.json.damaged"]  # the merge keeps the damaged file


def test_a_result_records_its_thread_count(clean):
    # The blas path's weight gradients (layers wider than 16 outputs) depend on the thread count.
    _, done, _ = clean
    data = runner.read_result(runner.result_path(done, CFG))
    assert data["threads"] == 1
