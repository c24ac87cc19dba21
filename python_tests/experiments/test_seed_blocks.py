"""Blocks of seeds (nalu_cuda.experiments.seed_blocks): a configuration run as blocks of seeds and
merged writes the result.json of the whole configuration (every field but the timings), for each
experiment that splits; a finished block is kept when a resumed run continues from the blocks."""
import json
import os

import pytest

from nalu_cuda.experiments import runner, seed_blocks
from nalu_cuda.experiments.registry import get
from nalu_cuda.experiments.tasks.identity import identity_config
from nalu_cuda.experiments.tasks.recurrent import recurrent_config
from nalu_cuda.experiments.tasks.static import static_config

QUIET = dict(progress=False, log=lambda msg: None)
TIMINGS = ("wall_s", "finished", "train_wall_s", "device", "seed_blocks", "checksum")

CONFIGS = {
    "static": lambda: static_config("nalu-separate", ["add", "mul"], 4, 40, eval_every=10, n_valid=300, n_test=300,
                                    baseline_models=4, threshold_samples=2000),
    "identity": lambda: identity_config("prelu", 5, 40, eval_every=10, n_valid=200, fig_points=41, n_table=200),
    "recurrent": lambda: recurrent_config("lstm", ["add", "sub"], 3, 30, eval_every=10, n_valid=100, n_test=100,
                                          n_extrap=40, baseline_models=4, threshold_samples=200, extrap_length=40,
                                          curve_lengths=[10, 40]),
}


def _numbers(path):
    """A result.json without its timings."""
    with open(path) as f:
        data = json.load(f)
    for s in data["summaries"]:
        s.pop("wall_s")
    data["extra"].pop("train_wall_s", None)
    return {k: v for k, v in data.items() if k not in TIMINGS}


@pytest.mark.parametrize("experiment", sorted(CONFIGS))
def test_blocks_merge_into_the_whole_configuration(tmp_path, experiment):
    cfg = CONFIGS[experiment]()
    assert seed_blocks.splittable(cfg)
    whole = runner.run_one(cfg, str(tmp_path / "whole"), **QUIET)
    out = str(tmp_path / "blocks")
    merged = runner.run_blocks(cfg, out, seed_blocks.even_blocks(0, cfg.seeds, 2), **QUIET)
    assert merged.records == whole.records
    assert _numbers(runner.result_path(out, cfg)) == _numbers(runner.result_path(str(tmp_path / "whole"), cfg))
    assert os.listdir(runner.config_dir(out, cfg)) == ["result.json"]  # the blocks are gone once merged


def test_resume_keeps_finished_blocks(tmp_path, monkeypatch):
    cfg = CONFIGS["static"]()
    out = str(tmp_path / "out")
    first = runner.run_one(seed_blocks.block_config(cfg, 0, 2), out, **QUIET)  # a rank finished [0, 2), then died
    exp, ran = get("static"), []
    real = exp.run
    monkeypatch.setattr(exp, "run", lambda c, ctx: ran.append(c.name) or real(c, ctx))
    with pytest.raises(runner.RunError, match="blocks of seeds"):
        runner.run_configs([cfg], out, **QUIET)  # without --resume the block is refused, not replaced
    r = runner.run_configs([cfg], out, resume=True, **QUIET)[0]
    assert ran == [f"{cfg.name}/seeds-2-4"]  # only what was missing
    assert r.records[:2] == first.records[:2] and len(r.records) == 8
    whole = runner.run_one(cfg, str(tmp_path / "whole"), **QUIET)
    assert r.records == whole.records


def test_layout_keeps_what_is_on_disk():
    assert seed_blocks.even_blocks(0, 10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert seed_blocks.even_blocks(0, 2, 5) == [(0, 1), (1, 2)]
    assert seed_blocks.layout(10, [(4, 7)], [(0, 3), (2, 5)], lambda lo, hi: 1) == [(0, 3), (3, 4), (4, 7), (7, 10)]
    assert seed_blocks.layout(8, [], [], lambda lo, hi: 2) == [(0, 4), (4, 8)]
