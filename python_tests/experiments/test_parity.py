"""Parity ablation: composed images, labels, every final layer trains; the NAC has no bias."""

import pytest
import torch

import nalu_cuda
from nalu_cuda.experiments import registry
from nalu_cuda.experiments.tasks import parity

from .conftest import run_results, task_parser

SMALL = {"batch": 8, "hidden": 6, "channels": [2, 3], "eval_every": 2, "n_val": 20, "n_test": 30}


def test_compose_places_digits_side_by_side():
    images = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 3)
    idx = torch.tensor([[[1, 3], [0, 0]]])  # (1, 2, K=2)
    out = parity.compose(images, idx)
    assert out.shape == (1, 2, 2, 6)
    assert torch.equal(out[0, 0, :, :3], images[1]) and torch.equal(out[0, 0, :, 3:], images[3])
    assert torch.equal(out[0, 1, :, :3], images[0]) and torch.equal(out[0, 1, :, 3:], images[0])


def test_parity_labels():
    labels = torch.tensor([0, 1, 2, 3, 9])
    idx = torch.tensor([[0, 1], [1, 3], [2, 4], [4, 4], [3, 2]])
    assert parity.parity_labels(labels, idx).tolist() == [1, 0, 1, 0, 1]


def test_final_layers():
    shapes = (8, 16)
    nac = parity.ParityModel(2, shapes, "nac", hidden=4, channels=(2, 3))
    assert isinstance(nac.final, nalu_cuda.NAC) and nac.bias is None
    assert not any("bias" in n for n, _ in nac.final.named_parameters())
    assert parity.ParityModel(2, shapes, "nac-bias", hidden=4, channels=(2, 3)).bias is not None
    assert parity.ParityModel(2, shapes, "affine", hidden=4, channels=(2, 3)).final.bias is not None
    assert parity.ParityModel(2, shapes, "linear-nobias", hidden=4, channels=(2, 3)).final.bias is None
    with pytest.raises(ValueError):
        parity.ParityModel(2, shapes, "mlp")


@pytest.mark.parametrize("final", parity.FINALS)
def test_every_final_layer_trains(tmp_path, final):
    cfg = registry.Config("parity", final, 2, 4, {**SMALL, "final": final})
    out = parity.run(cfg, registry.Context(device="cpu", work_dir=str(tmp_path), progress=False))
    assert len(out.records) == 2
    for r in out.records:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["error"] == pytest.approx(1 - r["accuracy"])
        assert r["accuracy_wilson_lo"] <= r["accuracy"] <= r["accuracy_wilson_hi"]
    s = parity.EXPERIMENT.summary(cfg, out.records, out.extra)
    assert "accuracy_ci" in s


def test_parity_is_learnable(tmp_path):
    """A short run on one digit per image (odd or even) gets well above chance (50%) on test images."""
    cfg = registry.Config("parity", "nac", 1, 150, {"final": "nac", "digits": 1, "eval_every": 150, "n_val": 200,
                                                    "n_test": 400})
    out = parity.run(cfg, registry.Context(device="cpu", work_dir=str(tmp_path), progress=False))
    assert out.records[0]["accuracy"] > 0.7


def test_report_section(tmp_path):
    cfgs = [registry.Config("parity", final, 2, 2, {**SMALL, "final": final}) for final in ("affine", "nac")]
    results = run_results(parity, cfgs, tmp_path)
    text = parity.report_section(results, str(tmp_path))
    assert "Table 4" in text and "NAC" in text


def test_cli_arguments_are_checked():
    p = task_parser(parity)
    assert [c.name for c in parity.configs(p.parse_args([]))] == list(parity.FINALS)
    with pytest.raises(ValueError, match="--finals"):
        parity.configs(p.parse_args(["--finals", "relu"]))
