"""Identity and recurrent experiments: small versions that check real behaviour."""
import math

import pytest
import torch

from nalu_cuda.experiments.parts.arithmetic_models import build_recurrent_model, member_generators
from nalu_cuda.experiments.tasks.identity import identity_config, run as run_identity
from nalu_cuda.experiments.tasks.recurrent import recurrent_config, run as run_recurrent
from nalu_cuda.experiments.registry import Context

CTX = Context(device="cpu", work_dir=".", progress=False)
RSMALL = dict(eval_every=50, n_valid=200, n_test=200, n_extrap=50, baseline_models=4, threshold_samples=200,
              extrap_length=60, curve_lengths=[10, 60])


def test_mlps_fail_identity_extrapolation_nac_does_not():
    sig = run_identity(identity_config("sigmoid", 2, 400), CTX).records
    relu = run_identity(identity_config("relu", 2, 400), CTX).records
    nac = run_identity(identity_config("nac", 2, 400), CTX).records
    for r in sig:  # saturates: about as bad as predicting 0 (500) on U[-1000, 1000]
        assert r["interp_mae"] < 0.3 and r["table_mae"] > 300
    for r in relu:  # learns inside, off by orders of magnitude outside
        assert r["interp_mae"] < 0.3 and r["table_mae"] > 30 * r["interp_mae"]
    for r in nac:
        assert r["table_mae"] < 1.0 and not r["diverged"]


def test_identity_members_equal_single_runs():
    ens = run_identity(identity_config("prelu", 3, 60, eval_every=20), CTX).records
    one = run_identity(identity_config("prelu", 1, 60, eval_every=20, seed_offset=2), CTX).records
    # MLPs go through torch.baddbmm, whose BLAS may round differently for another batch count.
    assert ens[2]["final_train_loss"] == pytest.approx(one[0]["final_train_loss"], rel=1e-6)
    assert ens[2]["table_mae"] == pytest.approx(one[0]["table_mae"], rel=1e-6)


@pytest.mark.parametrize("model", ["nalu", "lstm", "gru", "nac-mul"])
def test_recurrent_shared_inputs_equal_copied_inputs(model):
    m = build_recurrent_model(model, 10, 3, ensemble=3)
    m.reset_parameters(member_generators([0, 1, 2]))
    x = torch.rand(5, 7, 10) + 1
    assert torch.allclose(m(x), m(x.unsqueeze(0).expand(3, 5, 7, 10).contiguous()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", ["nac", "lstm"])
def test_recurrent_members_equal_single_runs(model):
    ens = run_recurrent(recurrent_config(model, ["add", "sub"], 2, 60, **RSMALL), CTX).records
    one = run_recurrent(recurrent_config(model, ["add", "sub"], 1, 60, seed_offset=1, **RSMALL), CTX).records
    for r in one:
        e = [x for x in ens if x["op"] == r["op"] and x["seed"] == 1][0]
        assert e["final_train_loss"] == pytest.approx(r["final_train_loss"], rel=1e-6)
        assert e["extrap_mse"] == pytest.approx(r["extrap_mse"], rel=1e-5)


def test_recurrent_nac_learns_subtraction_better_than_lstm():
    nac = run_recurrent(recurrent_config("nac", ["sub"], 2, 500, lr=3e-2, **RSMALL), CTX).records
    lstm = run_recurrent(recurrent_config("lstm", ["sub"], 2, 500, lr=1e-2, **RSMALL), CTX).records
    for r in nac + lstm:
        assert math.isfinite(r["threshold"]) and r["threshold"] > 0
        assert {"success", "diverged", "solved_at", "interp_error", "extrap_error"} <= set(r)
    assert max(r["extrap_error"] for r in nac) < min(r["extrap_error"] for r in lstm)
