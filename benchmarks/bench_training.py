"""Training throughput on the static arithmetic task: one seed vs. 100 seeds as one ensemble.

What one "step" is, for every row: draw a fresh batch of 128 inputs in R^100 per seed (U[1,2]),
compute the targets a + b (both on the stream's background thread, as ``nalu-cuda static`` does;
``--no-prefetch`` draws them on the training thread), forward and backward through a two-layer model of hidden size 2, check
every member for NaN/Inf, and take an Adam step: exactly the loop of
``nalu_cuda.experiments.parts.training.train_ensemble`` used by ``nalu-cuda static`` (a tiny validation
set is evaluated once at the start and once at the end).

Rows (``--models`` NAC+ -> NAC+ and NALU -> NALU by default; ``nmu`` is Madsen's NMU model, NAU -> NMU,
timed with its regulariser on and its weights clamped after every step, as in the published runs
once the regulariser has started):

* ``E=1 reference``: one seed, eager pure-PyTorch layers. Training 100 seeds one after another
  (how the published protocol ran them) costs 100 times one such run; that is the baseline.
* ``E=1 fused``: one seed, the fused kernels.
* ``E=100 reference`` / ``E=100 fused``: 100 seeds as one ensemble (``fused``: the fused layers
  through autograd, train_ensemble's default step); ``E=100 fused-native``: the native one-call
  step (``train_ensemble(native=True)``, ``parts/native_step.py``: forward, loss, backward,
  divergence check and Adam in one native call, each member's batch and targets drawn inside it
  from the same SFC64 streams, so no background thread); ``E=100 fused-native-prefetched``: the
  same native step on batches the stream draws ahead on its background thread, as the reference
  rows get theirs (the like-for-like comparison with them: with prefetch, every row but the
  in-call one also uses a second core for the drawing); ``E=100 fused-native-counter``: the native
  step on the counter stream (``--stream counter``: other random numbers, drawn in the call from
  (seed, step, index), ``static_ensemble_step_counter``).
* ``plain loop``: a minimal single-seed script a user would write (``torch.rand`` batches,
  ``nn.Module`` layers without an ensemble dimension, ``torch.optim.Adam``, no divergence checks),
  to show the baseline is not handicapped by our trainer.

The speed-up is ``(E=100 steps/s * 100) / (baseline steps/s)``: seed-steps per second of the
ensemble over those of single-seed runs done one after another. The published protocol (5e6 steps
x 100 seeds, "about 8 CPU-hours per seed") is extrapolated from the measured rates.

    python benchmarks/bench_training.py                     # about 2-4 minutes on 2 slow cores
    python benchmarks/bench_training.py --steps 300 --quick # a smoke run

Writes ``benchmarks/results/training.json``, ``training.csv`` and ``training.md`` (``training_t2.*``
with ``--threads 2``). Timings are wall clock with one intra-op thread by default (``--threads``),
over the steps after a warm-up of the same run (at least 64 steps, so that the data stream has
drawn its first chunks); ``--repeats`` rounds each time every configuration once, interleaved, and
each row is the median. On a shared machine run it when the machine is otherwise idle, and look at
the spread of the rounds (``training.json``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import harness  # benchmarks/harness.py (this script's folder is on sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nalu_cuda  # noqa: E402
from nalu_cuda.experiments.parts import arithmetic_data as ar  # noqa: E402
from nalu_cuda.experiments.parts import uniform_stream as us  # noqa: E402
from nalu_cuda import regularizers  # noqa: E402
from nalu_cuda.experiments.parts.arithmetic_models import (build_static_model, member_generators,  # noqa: E402
                                                           training_hooks)
from nalu_cuda.experiments.registry import Context  # noqa: E402
from nalu_cuda.experiments.parts.training import EvalSet, train_ensemble  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
I, B = 100, 128
PUBLISHED_STEPS, PUBLISHED_SEEDS, PUBLISHED_HOURS_PER_SEED = 5_000_000, 100, 8.0
WARMUP_STEPS = 64  # untimed steps at the start of each measured run (4 chunks of the data stream)


def _trainer_rate(model_name: str, E: int, backend: str, steps: int, prefetch: bool = True,
                  fixed_batch: bool = False, native: bool = False, in_call: bool = True, counter: bool = False) -> float:
    """Steps per second of train_ensemble for E seeds: `steps` steps timed after a warm-up of the
    same run (by then the data stream has its buffers and one chunk drawn ahead, as in any run of
    more than a few dozen steps; the published protocol runs 5e6). `counter`: the data from the
    counter stream (``--stream counter``), which the native step draws in its call. The clock starts
    as the trainer begins step ``warm + 1`` (its step runner, wrapped): the native steps that draw in
    their call never call batch_fn."""
    from nalu_cuda.experiments.parts.counter_stream import CounterStream
    from nalu_cuda.experiments.parts.training import EnsembleTraining

    seeds = list(range(E))
    masks = torch.stack([ar.subset_layout(s, I).mask() for s in seeds])
    interp = ar.parse_range([1, 2])
    xv = torch.rand(64, I) + 1
    tv = torch.einsum("ni,eij->enj", xv, masks).sum(-1, keepdim=True)
    val = EvalSet("valid", xv, tv)
    ctx = Context(device="cpu", work_dir=".", progress=False)
    warm = max(WARMUP_STEPS, steps // 10)
    total = warm + steps
    model = build_static_model(model_name, I, 2, ensemble=E, backend=backend)
    model.reset_parameters(member_generators(seeds))
    if counter:
        stream = CounterStream(seeds, (B, I), interp, masks=masks.double(), ops=["add"])
    else:
        stream = us.UniformStream(seeds, (B, I), interp, chunk=16, prefetch=prefetch,
                                  transform=us.SumTargets(masks.numpy(), ["add"]))
    first = stream.draw(1) if counter else stream.next()

    def batch_fn(step):
        if fixed_batch:
            return first
        return stream.draw(step) if counter else stream.next()

    if counter:
        batch_fn.counter_stream = stream  # the native step draws it in the call (parts/native_step.py)
    elif native and in_call and not fixed_batch:
        batch_fn.uniform_stream = stream  # the same, from the stream's SFC64 generators
    t0 = None
    runner = EnsembleTraining._step_runner

    def timed_runner(self):
        run = runner(self)

        def step(k):
            nonlocal t0
            if k == warm + 1:
                t0 = time.perf_counter()
            run(k)

        return step

    EnsembleTraining._step_runner = timed_runner
    try:
        # the regulariser at full strength from step 0 (NMU model): its costliest phase
        hooks = training_hooks(model, {"start": 0, "end": 1} if model_name == "nmu" else None, seeds)
        train_ensemble(model, E, batch_fn, total, val, lr=1e-3, eval_every=total, ctx=ctx, native=native, **hooks)
    finally:
        EnsembleTraining._step_runner = runner
        stream.close()
    return steps / (time.perf_counter() - t0)


def _plain_rate(model_name: str, steps: int) -> float:
    """A minimal single-seed eager loop, as a user would write it (no ensemble, no checks)."""
    torch.manual_seed(0)
    layers = {"nac": (nalu_cuda.NAC, nalu_cuda.NAC), "nalu": (nalu_cuda.NALU, nalu_cuda.NALU),
              "nmu": (nalu_cuda.NAU, nalu_cuda.NMU)}[model_name]
    model = torch.nn.Sequential(layers[0](I, 2, backend="reference"), layers[1](2, 1, backend="reference"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if model_name == "nmu":
        nalu_cuda.project_after_step(opt, model)
    reg = regularizers.PUBLISHED_SCHEDULES["nmu"].scale if model_name == "nmu" else 0.0
    mask = ar.subset_layout(0, I).mask()

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x = torch.rand(B, I) + 1
            t = (x @ mask).sum(-1, keepdim=True)
            loss = torch.nn.functional.mse_loss(model(x), t)
            if reg:
                loss = loss + reg * regularizers.sparsity(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return time.perf_counter() - t0

    run(max(20, steps // 10))
    return steps / run(steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per measurement (default 2000)")
    ap.add_argument("--ensemble", type=int, default=100, help="seeds in the ensemble (default 100)")
    ap.add_argument("--models", nargs="+", default=["nac", "nalu"], choices=["nac", "nalu", "nmu"])
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each times every configuration once); the median is reported")
    ap.add_argument("--quick", action="store_true", help="one repeat (smoke test)")
    ap.add_argument("--no-prefetch", action="store_true", help="draw data on the training thread")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="output directory")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every row (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    repeats = 1 if args.quick else args.repeats
    E = args.ensemble
    rows = []
    for model in args.models:
        ens_steps = max(50, args.steps // 4)
        runs = {
            "plain": lambda: _plain_rate(model, args.steps),
            "1-reference": lambda: _trainer_rate(model, 1, "reference", args.steps, not args.no_prefetch),
            "1-fused": lambda: _trainer_rate(model, 1, "fused", args.steps, not args.no_prefetch),
            f"{E}-reference": lambda: _trainer_rate(model, E, "reference", ens_steps, not args.no_prefetch),
            # fused: the fused layers through autograd, ATen's loss and divergence checks and FlatAdam's
            # step (train_ensemble's default); fused-native: the native one-call step (parts/native_step.py)
            f"{E}-fused": lambda: _trainer_rate(model, E, "fused", ens_steps, not args.no_prefetch),
            f"{E}-fused-native": lambda: _trainer_rate(model, E, "fused", ens_steps, not args.no_prefetch,
                                                       native=True),
            # the native step on batches the stream draws ahead in its own thread, as the reference
            # rows get theirs (with prefetch; without, on the training thread, before each step)
            f"{E}-fused-native-prefetched": lambda: _trainer_rate(model, E, "fused", ens_steps, not args.no_prefetch,
                                                                  native=True, in_call=False),
            # the native step on the counter stream (--stream counter), each batch drawn in its call
            f"{E}-fused-native-counter": lambda: _trainer_rate(model, E, "fused", ens_steps, native=True,
                                                               counter=True),
            # The training math alone (one batch drawn once, reused): what the kernels and optimiser
            # cost without the per-seed random numbers (100 seeds x 128 x 100 uniforms a step).
            "math-1-reference": lambda: _trainer_rate(model, 1, "reference", args.steps, fixed_batch=True),
            f"math-{E}-fused": lambda: _trainer_rate(model, E, "fused", ens_steps, fixed_batch=True),
            f"math-{E}-fused-native": lambda: _trainer_rate(model, E, "fused", ens_steps, fixed_batch=True,
                                                            native=True),
        }
        # Repeats are interleaved (each round times every configuration once), so that a slow phase
        # of a shared machine falls on all of them alike; each row reports the median of its rounds.
        rounds = harness.interleaved(runs, repeats)
        meas = {key: (statistics.median(v), v) for key, v in rounds.items()}
        baseline = max(meas["plain"][0], meas["1-reference"][0])  # the faster single-seed eager run
        # The same ratio within each round (its own baseline): the spread a noisy machine gives.
        round_base = [max(a, b) for a, b in zip(rounds["plain"], rounds["1-reference"])]
        for key, (rate, vals) in meas.items():
            math_only = key.startswith("math-")
            k = key[5:] if math_only else key
            seeds = E if k.startswith(f"{E}-") else 1
            if key == "plain":
                label = "1 seed, plain eager loop (user script)"
            else:
                kind = {"fused": "fused (autograd step)", "fused-native": "fused (native step)",
                        "fused-native-prefetched": "fused (native step, data drawn ahead)",
                        "fused-native-counter": "fused (native step, counter stream drawn in the call)"}.get(
                    k.split("-", 1)[1], k.split("-", 1)[1]) if seeds > 1 else k.split("-", 1)[1]
                label = f"{seeds} seed{'s' if seeds > 1 else ''}, {kind}" + (" ensemble" if seeds > 1 else "")
            base = meas["math-1-reference"][0] if math_only else baseline
            per_round = [v * seeds / b for v, b in zip(vals, rounds["math-1-reference"] if math_only else round_base)]
            if math_only:
                label += " [training math only: one batch reused, no data drawing]"
            rows.append({
                "model": model, "config": label, "seeds": seeds, "steps_per_s": rate,
                "seed_steps_per_s": rate * seeds, "speedup_vs_sequential_eager": rate * seeds / base,
                "repeats": [round(v, 2) for v in vals],
                "speedup_per_round": [round(v, 2) for v in per_round],
                "published_protocol_cpu_hours": PUBLISHED_STEPS * PUBLISHED_SEEDS / (rate * seeds) / 3600,
            })
        print(f"{model}: " + ", ".join(f"{k} {v[0]:.0f} steps/s" for k, v in meas.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"command": harness.command(__file__, argv),
            **harness.machine("cpu", steps=args.steps, ensemble=E, batch=B, inputs=I, prefetch=not args.no_prefetch),
            "load": " ".join(f"{v:.1f}" for v in load_start) + " (start), "
                    + " ".join(f"{v:.1f}" for v in os.getloadavg()) + " (end)"}
    stem = "training" if args.threads == 1 else f"training_t{args.threads}"
    lines = ["| model | configuration | steps/s | seed-steps/s | speed-up vs. seeds one after another (eager) | "
             "speed-up within each round (min-max) | published protocol (5e6 steps x 100 seeds), CPU-hours |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        pr = r["speedup_per_round"]
        lines.append(f"| {r['model']} | {r['config']} | {r['steps_per_s']:.0f} | {r['seed_steps_per_s']:.0f} | "
                     f"{r['speedup_vs_sequential_eager']:.1f}x | {min(pr):.1f}-{max(pr):.1f}x | "
                     f"{r['published_protocol_cpu_hours']:.0f} |")
    lines += ["", "Speed-up: seed-steps per second over those of the faster single-seed eager baseline (the plain "
              "loop or our trainer with E=1 and the reference backend), i.e. over training the seeds one after "
              "another; for the [training math only] rows, over the same measurement at E=1 (reference). "
              f"Madsen & Johansen report about {PUBLISHED_HOURS_PER_SEED:g} CPU-hours per seed "
              f"({PUBLISHED_HOURS_PER_SEED * PUBLISHED_SEEDS:g} for 100 seeds) for the published protocol.",
              "", "Load average during the run (other processes share this machine): " + meta["load"]]
    harness.write(os.path.join(args.out, stem), meta, rows, "\n".join(lines),
                  title="Training throughput, static task (batch 128, x in R^100, hidden 2)")
    print(harness.meta_lines(meta))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
