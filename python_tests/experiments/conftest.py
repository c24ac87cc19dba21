import argparse

import pytest
import torch

from nalu_cuda.experiments import registry
from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators
from nalu_cuda.experiments.parts.training import EvalSet


@pytest.fixture(autouse=True)
def _one_thread():
    # The experiment models are tiny: a second intra-op thread only adds synchronisation, and on a
    # loaded 2-core machine it slows training steps by an order of magnitude.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def task_parser(task) -> argparse.ArgumentParser:
    """A parser with the options of ``task`` (a task module) and the ``--seeds``/``--steps`` that its
    ``configs`` reads, as the command line gives them."""
    p = argparse.ArgumentParser()
    task.add_arguments(p)
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    return p


def run_results(task, cfgs, tmp_path):
    """``task.run`` of every configuration on the CPU, as the results (with the task's summaries)
    that its ``report_section`` reads."""
    ctx = registry.Context(device="cpu", work_dir=str(tmp_path), progress=False)
    results = []
    for cfg in cfgs:
        out = task.run(cfg, ctx)
        results.append(registry.ConfigResult(cfg, out.records, task.EXPERIMENT.summary(cfg, out.records, out.extra),
                                             out.extra))
    return results


def sum_problem(members):
    """A small static task for an ensemble of ``members``: ``(x, t, val)``, 64 inputs in [1, 2)^10 per
    member, the target ``x0 + x1 + x2 + x3 + x4 + x5`` (two sums of three), and a validation set of
    100 inputs shared by every member."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(members, 64, 10, generator=g) + 1
    t = x[..., :3].sum(-1, keepdim=True) + x[..., 3:6].sum(-1, keepdim=True)
    vx = torch.rand(100, 10, generator=g) + 1
    vt = vx[:, :3].sum(-1, keepdim=True) + vx[:, 3:6].sum(-1, keepdim=True)
    return x, t, EvalSet("valid", vx, vt.expand(members, 100, 1))


def static_model(kind, members):
    """The static task's model ``kind`` (10 inputs, 2 hidden) for ``members`` seeds, each member
    initialised from its own generator."""
    m = build_static_model(kind, 10, 2, ensemble=members)
    m.reset_parameters(member_generators(range(members)))
    return m
