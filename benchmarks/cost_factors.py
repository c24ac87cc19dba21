"""Rough per-model cost factors for the sharded sweeps' plan (distributed.MODEL_FACTORS): seconds per
seed-step of one configuration of each model, relative to NAC, on this machine's CPU (1 thread).

    OMP_NUM_THREADS=1 python benchmarks/cost_factors.py
    OMP_NUM_THREADS=1 python benchmarks/cost_factors.py --sequence [TASK ...]
    OMP_NUM_THREADS=1 python benchmarks/cost_factors.py --gridworld-profile a3c|nac

``--sequence``: the sequence tasks' cost factors (each experiment's ``cost_factor`` and
``model_costs``): every ``paper`` configuration of each task run twice, at a few and at more
steps, in CPU seconds of this process; the difference is the cost of the extra steps (with
their evaluations), per seed-step, in the cost model's units (CPU seconds x
distributed.CPU_UNITS_PER_S, the wall rate of static standard-nac-add on a rank), and beside it
relative to the same measure of standard-nac-add in this invocation (for a loaded machine). The grid world's
steps (each plays whole episodes) are timed on their own (:func:`gridworld_step_time`).

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


# (first, second) step counts of the two runs per task: a multiple of neither needs to be the
# evaluation period (language's paper runs evaluate every 1000 steps, a small part of its step).
SEQUENCE_STEPS = {"language": (50, 250), "digits": (50, 250), "programs": (20, 120), "parity": (100, 300)}


def cpu_run(cfg, out) -> float:
    """CPU seconds of this process for one whole run of ``cfg`` (in a new folder below ``out``)."""
    import tempfile

    t = time.process_time()
    runner.run_one(cfg, tempfile.mkdtemp(dir=out), **QUIET)
    return time.process_time() - t


def per_seed_step(cfg, steps, out) -> float:
    """CPU seconds per seed-step of ``cfg``'s training (and evaluations) between two step counts."""
    import dataclasses

    a, b = (cpu_run(dataclasses.replace(cfg, steps=n), out) for n in steps)
    return (b - a) / ((steps[1] - steps[0]) * cfg.seeds)


def gridworld_step_time(agent: str, n: int = 4, profile: bool = False) -> float:
    """CPU seconds per seed-step of a paper-profile grid-world training step (the episodes, the A2C
    loss, backward and the optimiser step), after one step of warm-up; ``profile``: the timed steps
    under torch.profiler, its table of ops by their own CPU time printed."""
    from nalu_cuda.experiments.parts.gridworld_agent import GridAgent, a2c_loss, episode_seed, play
    from nalu_cuda.experiments.parts.gridworld_env import GridWorldVectorEnv
    from nalu_cuda.experiments.parts.optim import FlatAdam
    from nalu_cuda.experiments.tasks.gridworld import PROFILES, GridworldParams

    p = GridworldParams(agent=agent, **PROFILES["paper"]["params"])
    E = PROFILES["paper"]["seeds"]
    model = GridAgent(E, agent, hidden=p.hidden, features=p.features, conv=p.conv, pool=p.pool, nac_size=p.nac_size)
    model.reset_parameters(list(range(E)))
    opt = FlatAdam(model.parameters(), p.lr, ensemble=E, clip=p.clip)
    env = GridWorldVectorEnv(E * p.envs, t_low=p.t_low, t_high=p.t_high, slack=p.slack)
    gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    for i in range(n + 1):
        if i == 1:
            t = time.process_time()
            if prof is not None:
                prof.__enter__()
        ep = play(model, env, seed=episode_seed(gens[0]), act_gen=gens[1])
        loss, _ = a2c_loss(ep["logits"], ep["values"], ep["actions"], ep["rewards"], ep["done"], ep["mask"],
                           gamma=p.gamma, lmbda=p.lmbda, value_coef=p.value_coef, entropy_coef=p.entropy_coef)
        opt.zero_grad()
        loss.sum().backward()
        opt.step_ensemble(torch.zeros(E, dtype=torch.bool), False)
    spent = time.process_time() - t
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return spent / (n * E)


def sequence_factors(tasks, out) -> None:
    """Print each sequence configuration's measured cost relative to static's standard-nac-add, the
    factor it implies (over its model's distributed.model_factor) and the plan's estimate against
    the measured cost at the paper budget (both in hours of one core at the static reference's rate)."""
    import dataclasses

    from nalu_cuda.experiments import distributed
    from nalu_cuda.experiments.registry import get
    from nalu_cuda.experiments.tasks.static import profile_configs as static_profile

    ref_cfg = next(c for c in static_profile("standard") if c.name == "standard-nac-add")
    ref = per_seed_step(ref_cfg, (500, 2500), out)
    print(f"static standard-nac-add: {ref:.3g} CPU s per seed-step ({1 / ref:.3g} units/s; "
          f"distributed.CPU_UNITS_PER_S = {distributed.CPU_UNITS_PER_S:.3g})")
    for task in tasks:
        for cfg in get(task).profile_configs("paper"):
            if task == "gridworld":
                cost = gridworld_step_time(cfg.params["agent"])
            else:
                cost = per_seed_step(cfg, SEQUENCE_STEPS[task], out)
            units = cost * distributed.CPU_UNITS_PER_S  # the cost model's units per seed-step
            measured_h = cost * cfg.seeds * cfg.steps / 3600
            est_h = distributed.estimated_hours([dataclasses.replace(cfg)])
            print(f"{task} {cfg.name}: {cost:.3g} CPU s per seed-step ({cost / ref:.3g} x this static reference); "
                  f"{units:.3g} units (1 / CPU_UNITS_PER_S s), factor {units / distributed.model_factor(cfg.params.get('model')):.3g} "
                  f"over the model's {distributed.model_factor(cfg.params.get('model'))}; paper budget: estimate "
                  f"{est_h:.3g} h, measured {measured_h:.3g} h of CPU", flush=True)


def main():
    import sys
    import tempfile

    if "--gridworld-profile" in sys.argv:  # one agent's paper-profile update, timed and profiled
        torch.set_num_threads(1)
        agent = sys.argv[sys.argv.index("--gridworld-profile") + 1]
        per = gridworld_step_time(agent, profile=True)
        print(f"gridworld {agent}: {per:.3g} CPU s per seed-step, {per * 10:.3g} s per update of the 10 seeds")
        return

    if "--sequence" in sys.argv:
        torch.set_num_threads(1)
        tasks = [a for a in sys.argv[sys.argv.index("--sequence") + 1:] if not a.startswith("-")]
        sequence_factors(tasks or ["language", "digits", "programs", "parity", "gridworld"], tempfile.mkdtemp())
        return

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
