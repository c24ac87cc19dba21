import argparse

import pytest
import torch

from nalu_cuda.experiments import registry


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
