"""The toolkit's shared pieces: the unit table and the trainer's unit hooks, typed parameters,
task registration, the one number format, the per-op plot, the backend choice."""
import dataclasses
import os
import sys
import types

import pytest
import torch

from nalu_cuda.experiments import registry
from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts import arithmetic_models as am
from nalu_cuda.experiments.params import task_params
from nalu_cuda.experiments.parts.training import train_ensemble
from nalu_cuda.experiments.plugin import register_task, resolve_backend
from nalu_cuda.experiments.report import fmt_num, plot_per_op
from nalu_cuda.experiments.tasks import recurrent, static
from nalu_cuda.experiments.tasks.recurrent import RecurrentParams, recurrent_config
from nalu_cuda.experiments.tasks.static import StaticParams, static_config

from .conftest import static_model, sum_problem

E = 3


def _model(kind="nac"):
    return static_model(kind, E)


def _train(model, steps=40, **hooks):
    x, t, val = sum_problem(E)
    return train_ensemble(model, E, lambda s: (x, t), steps, val, eval_every=20, lr=1e-2, **hooks)


def test_zero_regularizer_changes_nothing():
    plain, reg = _model(), _model()
    r0 = _train(plain)
    r1 = _train(reg, regularizer=lambda step, loss: torch.zeros(E))
    assert torch.equal(r0.final_loss, r1.final_loss)
    for (k, a), (_, b) in zip(plain.state_dict().items(), reg.state_dict().items()):
        assert torch.equal(a, b), k


def test_regularizer_acts_per_member():
    """A penalty on member 1 only moves member 1; members 0 and 2 train exactly as without it."""
    plain, reg = _model(), _model()
    _train(plain)
    W = reg.net[0].W_hat
    _train(reg, regularizer=lambda step, loss: torch.stack([W[0].sum() * 0, (W[1] ** 2).sum() * 10, W[2].sum() * 0]))
    a, b = plain.net[0].W_hat.detach(), reg.net[0].W_hat.detach()
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert (b[1] ** 2).sum() < (a[1] ** 2).sum()


def test_project_runs_after_every_step():
    model = _model()
    calls = []

    def clamp():
        calls.append(torch.is_grad_enabled())
        model.net[0].W_hat.clamp_(-0.05, 0.05)

    _train(model, steps=30, project=clamp)
    assert len(calls) == 30 and not any(calls)
    assert model.net[0].W_hat.abs().max() <= 0.05


def test_unit_table_entry_brings_its_hooks(monkeypatch):
    from nalu_cuda import regularizers as R

    seen = []
    unit = am.ArithmeticUnit(am.ARITHMETIC_UNITS["nac"].layer, penalty=lambda m: seen.append(m) or torch.ones(E),
                             schedule=R.RegularizerSchedule(2.0, 0, 10), clip_value=0.5)
    monkeypatch.setitem(am.ARITHMETIC_UNITS, "nac", unit)
    model = _model("nac")
    hooks = am.training_hooks(model)
    assert set(hooks) == {"regularizer", "clip_value"} and hooks["clip_value"] == 0.5
    assert hooks["regularizer"](0, torch.zeros(E)) is None and seen == []  # weight 0: not computed
    torch.testing.assert_close(hooks["regularizer"](5, torch.zeros(E)), torch.full((E,), 1.0))
    assert seen == [model]
    assert am.training_hooks(_model("relu")) == {}
    assert am.training_hooks(_model("nalu")) == {}


def test_typed_params_parse_ranges_once():
    cfg = static_config("nac", ["add", "sub"], 2, 10, interp=[[1, 2], [3, 4]], extrap=[[5, 6]])
    p = task_params(StaticParams, cfg, ar.task_defaults(static.DEFAULTS))
    assert p.interp == ar.Range(((1.0, 2.0), (3.0, 4.0))) and p.extrap == ar.Range(((5.0, 6.0),))
    assert p.ops == ("add", "sub") and p.model == "nac" and p.lr == cfg.params["lr"]
    r = task_params(RecurrentParams, recurrent_config("lstm", ["add"], 2, 10), ar.task_defaults(recurrent.DEFAULTS))
    assert r.cell_hidden == r.rnn_hidden and r.curve_lengths == tuple(r.curve_lengths)
    assert isinstance(r.interp, ar.Range)
    assert ar.as_range([1, 2, 3, 4]) == ar.as_range([[1, 2], [3, 4]]) == ar.Range(((1.0, 2.0), (3.0, 4.0)))
    bad = dataclasses.replace(cfg, params={**cfg.params, "extrap": [[6, 5]]})
    with pytest.raises(ValueError, match=r"parameter 'extrap' expects a range \(bounds"):
        task_params(StaticParams, bad, ar.task_defaults(static.DEFAULTS))
    fewer = dataclasses.replace(cfg, params={k: v for k, v in cfg.params.items() if k != "batch"})
    assert task_params(StaticParams, fewer, ar.task_defaults(static.DEFAULTS)).batch == static.DEFAULTS["batch"]


def test_register_task_builds_the_experiment_from_the_module():
    mod = types.ModuleType("nalu_cuda_test_task")
    mod.configs = lambda args: []
    mod.profile_configs = lambda profile: [registry.Config("toolkit-test", "one", 1, 1)]
    mod.run = lambda config, ctx: registry.RunOutput([{"seed": 0, "success": True}])
    mod.report_section = lambda results, out_dir: "## toolkit-test\n"
    sys.modules[mod.__name__] = mod
    try:
        exp = register_task(mod.__name__, name="toolkit-test", help="a test task", order=999)
        assert registry.get("toolkit-test") is exp
        assert exp.run is mod.run and exp.report_section is mod.report_section and exp.summarize is None
        cfg = mod.profile_configs("quick")[0]
        assert exp.summary(cfg, mod.run(cfg, None).records, {})["success_rate"] == 1.0
    finally:
        registry._REGISTRY.pop("toolkit-test", None)
        del sys.modules[mod.__name__]


def test_resolve_backend_reads_the_configuration():
    assert resolve_backend(registry.Config("x", "y", 1, 1, {"backend": "reference"})) == "reference"
    assert resolve_backend(registry.Config("x", "y", 1, 1)) == "auto"


def test_one_number_format():
    assert fmt_num(None) == "-"
    assert fmt_num(float("nan")) == "nan"
    assert fmt_num(0.0) == "0"
    assert fmt_num(1234.5) == "1.23e+03"
    assert fmt_num(12345.0) == "1.23e+04"
    assert fmt_num(0.0001234) == "1.23e-04"


def test_plot_per_op(tmp_path):
    curves = [("nac", "add", [1, 2, 4], [1e-3, 2e-3, None]), ("nalu", "mul", [1, 2, 4], [0.1, 0.0, 1.0])]
    name = plot_per_op(curves, str(tmp_path), "ops.png", "scale", mark_x=1.0)
    assert name == "ops.png" and os.path.getsize(tmp_path / name) > 0
    assert plot_per_op([], str(tmp_path), "none.png", "scale") is None
    assert not (tmp_path / "none.png").exists()
