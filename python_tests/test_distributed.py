"""Data-parallel training: the modules under DistributedDataParallel (2 gloo ranks on the CPU,
localhost) give the gradients and trained parameters of one process over the same global batch,
and torch.compile traces the custom ops under DDP without graph breaks."""
import os
import socket
import tempfile
import time

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp

import nalu_cuda
from nalu_cuda.testing import rand_input

WORLD = 2
STEPS = 3
TIMEOUT_S = 600  # two fresh interpreters importing torch, and one compile, on a busy machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(unit: str, seed: int, dtype=torch.float64):
    torch.manual_seed(seed)
    first = {
        "nac": lambda: nalu_cuda.NAC(6, 3, dtype=dtype),
        "nac_mul": lambda: nalu_cuda.NACMul(6, 3, dtype=dtype),
        "nalu": lambda: nalu_cuda.NALU(6, 3, dtype=dtype),
        "nalu_sep_indep": lambda: nalu_cuda.NALU(6, 3, tied=False, gate="independent", dtype=dtype),
    }[unit]()
    return torch.nn.Sequential(first, nalu_cuda.NALU(3, 1, dtype=dtype))


def _data(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = rand_input((STEPS, 8 * WORLD, 6), dtype=dtype, generator=g)
    y = x[..., :2].sum(-1, keepdim=True) * x[..., 2:3]
    return x, y


def _train(model, x, y, rank=None):
    """STEPS of Adam on the global batch (rank=None) or on this rank's half of it; returns the first
    step's gradients and the final parameters."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first_grads = None
    for step in range(STEPS):
        xs, ys = x[step], y[step]
        if rank is not None:
            xs, ys = xs.chunk(WORLD)[rank], ys.chunk(WORLD)[rank]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
    return first_grads, [p.detach().clone() for p in model.parameters()]


UNITS = ["nac", "nac_mul", "nalu", "nalu_sep_indep"]


def _worker(rank, port, out_path):
    """One rank: every unit trained under DDP, then the NALU model compiled under DDP."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, y = _data(seed=1)
        results = {}
        for unit in UNITS:
            model = torch.nn.parallel.DistributedDataParallel(_model(unit, seed=0))
            results[unit] = _train(model, x, y, rank)
        # The inner model compiled with fullgraph=True (a graph break in the ops would raise), and
        # the whole DDP module compiled (dynamo's DDPOptimizer path; DDP's own wrapper breaks the
        # graph by design, the ops must not add breaks of their own).
        torch._dynamo.reset()
        model = torch.nn.parallel.DistributedDataParallel(torch.compile(_model("nalu", seed=0), fullgraph=True,
                                                                        backend="aot_eager"))
        results["compiled_inner"] = _train(model, x, y, rank)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = torch.compile(torch.nn.parallel.DistributedDataParallel(_model("nalu", seed=0)), backend="aot_eager")
        results["compiled_ddp"] = _train(model, x, y, rank)
        results["graph_breaks"] = list(torch._dynamo.utils.counters["graph_break"])
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results():
    """Runs the 2-rank group once for every test of this module."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        ctx = mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=5):  # raises if a rank failed
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {WORLD}-rank DDP group did not finish in {TIMEOUT_S} s")
        return torch.load(out)


def _assert_same(got, want):
    (g_grads, g_params), (w_grads, w_params) = got, want
    # Gradients are averaged over ranks (each rank's loss is a mean over its half of the batch).
    for g, w in zip(g_grads, w_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    for p, w in zip(g_params, w_params):
        torch.testing.assert_close(p, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("unit", UNITS)
def test_ddp_matches_single_process(unit, ddp_results):
    x, y = _data(seed=1)
    _assert_same(ddp_results[unit], _train(_model(unit, seed=0), x, y))


def test_ddp_with_torch_compile_has_no_graph_breaks(ddp_results):
    x, y = _data(seed=1)
    want = _train(_model("nalu", seed=0), x, y)
    _assert_same(ddp_results["compiled_inner"], want)
    _assert_same(ddp_results["compiled_ddp"], want)
    ours = [b for b in ddp_results["graph_breaks"] if "DistributedDataParallel" not in b and "Logger" not in b]
    assert ours == [], ours
