"""Program evaluation: generated programs are valid Python that print their targets; models train."""
import os
import random
import re

import pytest
import torch

from nalu_cuda.experiments import registry
from nalu_cuda.experiments.tasks import programs

from .conftest import run_results, task_parser

SMALL = {"pool": 64, "n_val": 16, "n_test": 16, "n_curve": 8, "eval_every": 2, "batch": 8, "hidden": 6, "emb": 5}


def _execute(text):
    printed = []
    exec(text, {"__builtins__": {}, "print": printed.append})  # noqa: S102 (our own generated code)
    assert len(printed) == 1
    return printed[0]


@pytest.mark.parametrize("task", programs.TASKS)
@pytest.mark.parametrize("domain", list(programs.DOMAINS))
def test_programs_print_their_targets(task, domain):
    lo, hi = programs.DOMAINS[domain]
    texts, values = programs.make_programs(task, 300, lo, hi, seed=11)
    for text, value in zip(texts, values):
        assert _execute(text) == value, text
        a, b = (int(v) for v in re.match(r"a=(\d+);b=(\d+);", text).groups())
        assert lo <= a < hi and lo <= b < hi
        assert set(text) <= set(programs.CHARS)


def test_program_task_covers_its_grammar():
    texts, _ = programs.make_programs("program", 500, 0, 100, seed=1)
    joined = "\n".join(texts)
    for piece in ("if a<b", "if a>b", "else", "c=a+b", "c=a-b", "c=b-a", "print(c)", "print(c+a)", "print(c-b)"):
        assert piece in joined
    assert programs.make_program("add", random.Random(0), 5, 6) == ("a=5;b=5;print(a+b)", 10)


def test_generation_is_deterministic():
    assert programs.make_programs("program", 20, 0, 100, 3) == programs.make_programs("program", 20, 0, 100, 3)
    assert programs.make_programs("program", 20, 0, 100, 3) != programs.make_programs("program", 20, 0, 100, 4)


def test_encode_round_trip():
    texts = ["a=1;b=2;print(a+b)", "a=10;b=20;c=a-b if a<b else b-a;print(c-b)"]
    tok, mask = programs.encode_programs(texts)
    assert tok.shape == (2, len(texts[1]))
    for i, t in enumerate(texts):
        assert "".join(programs.VOCAB[j] for j in tok[i][mask[i]].tolist()) == t
    assert int(mask[0].sum()) == len(texts[0])


def test_padding_does_not_change_the_prediction():
    m = programs.ProgramReader(2, "ugrnn", emb=4, hidden=5)
    m.reset_parameters([0, 1])
    short = "a=1;b=2;print(a+b)"
    tok1, mask1 = programs.encode_programs([short])
    tok2, mask2 = programs.encode_programs([short, short + "          "[:0] + "a=100;b=200;print(a+b)"])
    e = lambda t: t.unsqueeze(0).expand(2, *t.shape)  # noqa: E731
    p1 = m(e(tok1), e(mask1))[:, 0]
    p2 = m(e(tok2), e(mask2))[:, 0]
    assert torch.allclose(p1, p2, atol=1e-5)


@pytest.mark.parametrize("task", programs.TASKS)
@pytest.mark.parametrize("model", programs.MODELS)
def test_every_model_trains(tmp_path, task, model):
    cfg = registry.Config("programs", f"{task}-{model}", 2, 4, {**SMALL, "task": task, "model": model})
    out = programs.run(cfg, registry.Context(device="cpu", work_dir=str(tmp_path), progress=False))
    assert len(out.records) == 2
    for r in out.records:
        for d in programs.DOMAINS:
            assert 0.0 <= r[f"acc_{d}"] <= 1.0
            assert r[f"mae_{d}"] >= 0
    cur = out.extra["curves"]
    assert cur["step"] == [0, 2, 4] and len(cur["4digit_acc"]) == 3 and len(cur["4digit_acc"][0]) == 2


def test_report_section_with_bands(tmp_path):
    cfgs = [registry.Config("programs", f"add-{model}", 3, 4, {**SMALL, "task": "add", "model": model})
            for model in ("lstm", "nalu")]
    results = run_results(programs, cfgs, tmp_path)
    text = programs.report_section(results, str(tmp_path))
    assert "Fig. 4" in text and "LSTM + NALU" in text
    # the claims by the one verdict rule: the UGRNN did not run; the NALU's claim has a verdict
    assert "add: the paper's claims, checked" in text and "UGRNN: not run" in text
    nalu_row = next(l for l in text.splitlines() if l.startswith("| add: the recurrent NALU extrapolates"))
    assert any(w in nalu_row for w in ("**holds**", "**inconclusive at this budget**", "**does not hold**"))
    assert os.path.exists(tmp_path / "programs_fig4.png")


def test_cli_arguments_are_checked():
    p = task_parser(programs)
    assert [c.name for c in programs.configs(p.parse_args(["--task", "add"]))] == ["add-lstm", "add-ugrnn", "add-nalu"]
    with pytest.raises(ValueError, match="--models"):
        programs.configs(p.parse_args(["--models", "dnc"]))
