"""Rough per-model cost factors for the sharded sweeps' plan (distributed.MODEL_FACTORS): seconds per
seed-step of one configuration of each model, relative to NAC, on this machine's CPU (1 thread).

    OMP_NUM_THREADS=1 python benchmarks/cost_factors.py

Whole runs (training, evaluations, baselines) of the static task (8 seeds x 600 steps, one op) and the
recurrent task (4 seeds x 200 steps); the units that no task builds yet (NAU, NMU, NPU, RealNPU, iNALU)
by a training step of a two-layer stack of the module (100 -> 2 -> 1, 8 members, batch 128)."""
import time

import torch

import nalu_cuda
from nalu_cuda.experiments import runner
from nalu_cuda.experiments.tasks.recurrent import recurrent_config
from nalu_cuda.experiments.tasks.static import static_config

QUIET = dict(progress=False, log=lambda m: None)


def run_time(cfg, out):
    t = time.perf_counter()
    runner.run_one(cfg, out, **QUIET)
    return (time.perf_counter() - t) / (cfg.seeds * cfg.steps)


def step_time(cls, E=8, n=300):
    torch.manual_seed(0)
    net = torch.nn.Sequential(cls(100, 2, ensemble=E), cls(2, 1, ensemble=E))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    x = torch.rand(E, 128, 100) + 1
    for i in range(n + 20):
        if i == 20:
            t = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    return (time.perf_counter() - t) / n


def main():
    import tempfile

    torch.set_num_threads(1)
    out = tempfile.mkdtemp()
    q = dict(eval_every=200, n_valid=1000, n_test=1000, baseline_models=10, threshold_samples=20000)
    static = {m: run_time(static_config(m, ["mul"], 8, 600, hidden=16 if m in ("relu", "relu6") else 2, **q), out)
              for m in ("nac", "nac-mul", "nalu", "nalu-separate-indgate", "relu", "linear")}
    print("static, s per seed-step:", {m: f"{v:.2e}" for m, v in static.items()})
    print("static, relative to nac:", {m: round(v / static["nac"], 2) for m, v in static.items()})
    rq = dict(eval_every=100, n_valid=200, n_test=200, n_extrap=50, baseline_models=4, threshold_samples=200,
              extrap_length=100, curve_lengths=[10, 100])
    rec = {m: run_time(recurrent_config(m, ["add"], 4, 200, **rq), out) for m in ("nac", "nalu", "lstm", "gru")}
    print("recurrent, relative to nac:", {m: round(v / rec["nac"], 2) for m, v in rec.items()})
    units = {c: step_time(getattr(nalu_cuda, c)) for c in ("NAC", "NALU", "NAU", "NMU", "NPU", "RealNPU", "INALU")}
    print("module steps, relative to NAC:", {c: round(v / units["NAC"], 2) for c, v in units.items()})


if __name__ == "__main__":
    main()
