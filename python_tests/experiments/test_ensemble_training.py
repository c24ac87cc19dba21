"""The training loop as an object: train_ensemble is a thin front to EnsembleTraining (same numbers),
``optimizer`` is the documented name of the optimiser (``opt`` its alias), the hooks can be
overridden, and the loop's modules keep their functions short."""
import ast
import pathlib

import pytest
import torch

from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.parts.training import (DataOptions, EnsembleTraining, EvalOptions, OptimOptions, TrainOptions,
                                                  UnitHooks, train_ensemble)

from .conftest import static_model, sum_problem

E = 3
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "nalu_cuda" / "experiments"


def _model(kind="nalu"):
    return static_model(kind, E)


def _same(a, b):
    assert a.history == b.history
    assert torch.equal(a.best_step, b.best_step) and torch.equal(a.best_val, b.best_val)
    assert torch.equal(a.final_loss, b.final_loss) and torch.equal(a.diverged, b.diverged)
    for k in a.best_state:
        assert torch.equal(a.best_state[k], b.best_state[k]), k


def test_train_ensemble_is_the_object():
    x, t, val = sum_problem(E)
    ref = train_ensemble(_model(), E, lambda s: (x, t), 40, val, eval_every=10, lr=1e-2, clip_value=0.5,
                         lr_milestones=(0.5,))
    opts = TrainOptions(data=DataOptions(batch_fn=lambda s: (x, t)), evaluation=EvalOptions(val=val, eval_every=10),
                        optim=OptimOptions(lr=1e-2, lr_milestones=(0.5,)), units=UnitHooks(clip_value=0.5))
    _same(ref, EnsembleTraining(_model(), E, 40, opts).run())


def test_opt_is_an_alias_of_optimizer():
    x, t, val = sum_problem(E)
    runs = []
    for key in ("opt", "optimizer"):
        m = _model()
        runs.append(train_ensemble(m, E, lambda s: (x, t), 30, val, eval_every=10,
                                   **{key: FlatAdam(m.parameters(), [1e-2, 2e-2, 3e-2], ensemble=E)}))
    _same(*runs)
    # a factory under optimizer= gets (params, lr, ensemble=E, clip=clip)
    made = []

    def factory(params, lr, ensemble, clip):
        made.append((lr, ensemble, clip))
        return FlatAdam(params, lr, ensemble=ensemble, clip=clip)

    train_ensemble(_model(), E, lambda s: (x, t), 2, val, eval_every=1, lr=0.1, clip=1.0, optimizer=factory)
    assert made == [(0.1, E, 1.0)]
    m = _model()
    with pytest.raises(ValueError, match="give the optimiser once"):
        train_ensemble(m, E, lambda s: (x, t), 2, val, opt=FlatAdam(m.parameters(), 1e-2, ensemble=E),
                       optimizer=FlatAdam(m.parameters(), 1e-2, ensemble=E))
    with pytest.raises(ValueError, match="clip is the optimiser's"):
        train_ensemble(m, E, lambda s: (x, t), 2, val, optimizer=FlatAdam(m.parameters(), 1e-2, ensemble=E), clip=1.0)


def test_hooks_can_be_overridden():
    x, t, val = sum_problem(E)

    class Counting(EnsembleTraining):
        calls = 0

        def after_step(self, step, loss):
            Counting.calls += 1
            super().after_step(step, loss)

        def loss_penalty(self, step, loss):  # a zero penalty changes nothing
            return torch.zeros_like(loss)

    opts = TrainOptions(data=DataOptions(batch_fn=lambda s: (x, t)), evaluation=EvalOptions(val=val, eval_every=10),
                        optim=OptimOptions(lr=1e-2))
    res = Counting(_model(), E, 20, opts).run()
    assert Counting.calls == 20
    _same(res, train_ensemble(_model(), E, lambda s: (x, t), 20, val, eval_every=10, lr=1e-2))


def test_options_are_checked():
    with pytest.raises(ValueError, match="exactly one of batch_fn and step_loss"):
        TrainOptions().check()


def _lengths(path):
    tree = ast.parse(path.read_text())
    return {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_no_function_over_100_lines():
    """Anywhere in the package (the issue's rule for the training loop, the runner and the tasks)."""
    package = EXPERIMENTS.parent
    long = {f"{path.relative_to(package)}:{name}": n for path in sorted(package.rglob("*.py"))
            for name, n in _lengths(path).items() if n > 100}
    assert not long, f"split {long}"
