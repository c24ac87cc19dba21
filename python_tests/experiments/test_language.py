"""Language to number: the number-word generator, the paper's split, every head end to end."""
import os

import numpy as np
import pytest

from nalu_cuda.experiments import registry
from nalu_cuda.experiments.tasks import language

from .conftest import run_results, task_parser

SMALL = {"sizes": [[8, 4], [8, 5]], "lrs": [0.01, 0.1], "eval_every": 2, "n_phrases": 3}

KNOWN = {
    0: "zero", 7: "seven", 10: "ten", 13: "thirteen", 19: "nineteen", 20: "twenty", 21: "twenty one",
    40: "forty", 58: "fifty eight", 99: "ninety nine", 100: "one hundred", 101: "one hundred and one",
    110: "one hundred and ten", 115: "one hundred and fifteen", 300: "three hundred",
    310: "three hundred and ten", 515: "five hundred and fifteen", 740: "seven hundred and forty",
    999: "nine hundred and ninety nine",
}


@pytest.mark.parametrize("n,words", sorted(KNOWN.items()))
def test_number_words_known_values(n, words):
    assert language.number_to_words(n) == words


@pytest.mark.parametrize("bad", [-1, 1000, 2.5, "7"])
def test_number_words_reject_out_of_range(bad):
    with pytest.raises(ValueError):
        language.number_to_words(bad)


def _parse(words):
    """An independent reader of the phrases (the inverse of the generator)."""
    ones = {w: i for i, w in enumerate(language.ONES)}
    tens = {w: 10 * i for i, w in enumerate(language.TENS) if w}
    total, cur = 0, 0
    for w in words.split():
        if w in ones:
            cur += ones[w]
        elif w in tens:
            cur += tens[w]
        elif w == "hundred":
            cur *= 100
        elif w == "and":
            continue
        else:
            raise AssertionError(w)
    return total + cur


def test_every_phrase_is_unique_short_and_reads_back():
    phrases = [language.number_to_words(n) for n in range(1000)]
    assert len(set(phrases)) == 1000
    assert max(len(p.split()) for p in phrases) == language.MAX_TOKENS
    assert all(_parse(p) == n for n, p in enumerate(phrases))
    assert set(w for p in phrases for w in p.split()) == set(language.VOCAB[1:])


def test_split_sizes_disjoint_and_covering():
    s = language.make_split(0)
    assert {k: len(v) for k, v in s.items()} == {"train": 169, "val": 200, "test": 631}
    tr, va, te = (set(s[k].tolist()) for k in ("train", "val", "test"))
    assert not (tr & va) and not (tr & te) and not (va & te)
    assert tr | va | te == set(range(1000))
    assert set(range(20)) <= tr
    again = language.make_split(0)
    assert all(np.array_equal(s[k], again[k]) for k in s)
    assert not np.array_equal(s["test"], language.make_split(1)["test"])


def test_tokens_tensor_pads_and_masks():
    tok, mask = language.tokens_tensor([5, 515])
    assert tok.shape == (2, language.MAX_TOKENS)
    assert mask.sum(1).tolist() == [1, 4]
    assert [language.VOCAB[i] for i in tok[1, :4].tolist()] == ["five", "hundred", "and", "fifteen"]
    assert tok[0, 1:].tolist() == [0] * (language.MAX_TOKENS - 1)


def test_fig3_numbers_come_from_the_test_set():
    s = language.make_split(0)
    picks = language.fig3_numbers(s["test"], 5)
    assert len(picks) == 5 and set(picks) <= set(s["test"].tolist())
    assert any(" and " in language.number_to_words(n) for n in picks)


def test_running_estimate_ignores_padding():
    """The estimate after the last real token equals the one at the padded end."""
    m = language.NumberReader(2, "nalu", 6, 4)
    m.reset_parameters([0, 1])
    tok, mask = language.tokens_tensor([5, 515, 21])
    run = m(tok, mask)
    assert run.shape == (2, 3, language.MAX_TOKENS)
    assert np.allclose(run[:, 0, 0].detach().numpy(), run[:, 0, -1].detach().numpy())
    assert np.allclose(run[:, 2, 1].detach().numpy(), run[:, 2, -1].detach().numpy())


@pytest.mark.parametrize("head", language.HEADS)
def test_every_head_trains_and_selects_on_validation(tmp_path, head):
    cfg = registry.Config("language", f"lstm-{head}", 2, 4, {**SMALL, "head": head})
    ctx = registry.Context(device="cpu", work_dir=str(tmp_path), progress=False)
    out = language.run(cfg, ctx)
    assert [r["seed"] for r in out.records] == [0, 1]
    for r in out.records:
        assert r["chosen_lr"] in SMALL["lrs"] and r["chosen_hidden"] in (4, 5)
        assert np.isfinite(r["test_mae"]) and np.isfinite(r["val_mse"])
    sel = out.extra["selected"]
    assert sel["val_mse"] == min(r["val_mse"] for r in out.records)
    assert len(out.extra["fig3"]) == 3
    for it in out.extra["fig3"]:
        assert len(it["running"]) == len(it["words"].split())


def test_resume_skips_finished_sizes(tmp_path):
    cfg = registry.Config("language", "lstm-nac", 1, 3, {**SMALL, "head": "nac"})
    saved = []
    ctx = registry.Context(device="cpu", work_dir=str(tmp_path), progress=False,
                           save_checkpoint=lambda o: saved.append(o), checkpoint_every_s=1e9)
    full = language.run(cfg, ctx)
    after_first = [c for c in saved if c["phase"] == 1][0]
    ctx2 = registry.Context(device="cpu", work_dir=str(tmp_path), progress=False,
                            load_checkpoint=lambda: after_first, log=lambda m: None)
    resumed = language.run(cfg, ctx2)
    assert resumed.records[0]["test_mae"] == pytest.approx(full.records[0]["test_mae"], rel=1e-6)


def test_report_section(tmp_path):
    cfgs = [registry.Config("language", f"lstm-{head}", 2, 2, {**SMALL, "head": head}) for head in ("linear-sum", "nalu")]
    results = run_results(language, cfgs, tmp_path)
    text = language.report_section(results, str(tmp_path))
    assert "Table 3" in text and "LSTM + NALU" in text and "Fig. 3" in text
    assert os.path.exists(tmp_path / "language_fig3.png")


def test_cli_arguments_are_checked():
    p = task_parser(language)
    cfgs = language.configs(p.parse_args(["--heads", "nalu", "--hidden", "10", "--lrs", "0.01"]))
    assert len(cfgs) == 1 and cfgs[0].params["sizes"] == [[64, 10]]
    with pytest.raises(ValueError, match="--heads"):
        language.configs(p.parse_args(["--heads", "gru"]))
