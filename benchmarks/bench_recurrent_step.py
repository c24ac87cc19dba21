"""The recurrent task's training step, native (one call: ``nalu_cuda::recurrent_ensemble_step``,
``parts/native_step.py``) against autograd (``EnsembleTraining.eager_step``), at the decisive
profile's shape: 2 ops (add, sub) x 100 seeds = 200 members, batch 128, training length 10, 10
inputs, hidden size 2, for the models ``nac`` and ``nalu``.

What one step is: the task's own ``batch_fn`` (a fresh batch per seed from the SFC64 stream,
drawn ahead on its background thread, repeated for the second op, as ``nalu-cuda recurrent`` does;
``--fixed-batch``: one batch reused, the step alone), then the training step through
``train_ensemble`` (the divergence check and Adam included). ``steps`` steps are timed after a
warm-up of the same run; ``--repeats`` rounds time every row once, interleaved, and each row is the
median (the rounds are printed too). One intra-op thread unless ``--threads``.

    python benchmarks/bench_recurrent_step.py                  # about a minute on 2 slow cores
    python benchmarks/bench_recurrent_step.py --steps 50 --repeats 1   # a smoke run
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts.arithmetic_models import build_recurrent_model, member_generators
from nalu_cuda.experiments.parts import training
from nalu_cuda.experiments.parts.training import EvalSet, train_ensemble
from nalu_cuda.experiments.registry import Context

OPS, SEEDS, B, T, I, H = ("add", "sub"), 100, 128, 10, 10, 2
PATHS = []  # the step path of every run (EnsembleTraining.step_path), checked against the row's


def _recording_runner(self):
    runner = _step_runner(self)
    PATHS.append(self.step_path)
    return runner


_step_runner, training.EnsembleTraining._step_runner = training.EnsembleTraining._step_runner, _recording_runner


def step_rate(model_name: str, native: bool, steps: int, fixed_batch: bool) -> float:
    """Steps per second over `steps` steps after a warm-up."""
    seeds = list(range(SEEDS))
    E = len(OPS) * SEEDS
    masks = torch.stack([ar.subset_layout(s, I).mask() for s in seeds])
    stream = ar.training_stream("sfc64", seeds, (B, T, I), ar.parse_range([1, 2]), "cpu", masks, list(OPS), chunk=8)
    model = build_recurrent_model(model_name, I, H, ensemble=E)
    model.reset_parameters(member_generators(seeds + [10_000 + s for s in seeds]))
    xv = torch.rand(16, T, I) + 1
    val = EvalSet("valid", xv, torch.zeros(E, 16, 1), shared=True)
    warm = max(20, steps // 10)
    t0 = None
    first = None

    def batch_fn(step):
        nonlocal t0, first
        if step == warm + 1:
            t0 = time.perf_counter()
        if fixed_batch and first is not None:
            return first
        x, t = stream.next()
        first = (x.repeat(len(OPS), 1, 1, 1), t)
        return first

    try:
        train_ensemble(model, E, batch_fn, warm + steps, val, lr=1e-2, eval_every=warm + steps,
                       ctx=Context(device="cpu", work_dir=".", progress=False), native=native)
    finally:
        stream.close()
    rate = steps / (time.perf_counter() - t0)
    assert PATHS[-1] == ("native" if native else "autograd"), PATHS[-1]
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per measurement (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is reported (default 3)")
    ap.add_argument("--models", nargs="+", default=["nac", "nalu"], choices=["nac", "nalu"])
    ap.add_argument("--fixed-batch", action="store_true", help="reuse one batch: the step alone, no data")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rates = {(m, n): [] for m in args.models for n in (True, False)}
    for _ in range(args.repeats):
        for key in rates:
            rates[key].append(step_rate(key[0], key[1], args.steps, args.fixed_batch))
    print(f"E = {len(OPS) * SEEDS} ({len(OPS)} ops x {SEEDS} seeds), B = {B}, T = {T}, I = {I}, H = {H}; "
          f"{args.steps} steps, {args.repeats} rounds, {args.threads} thread(s), "
          f"{'one fixed batch' if args.fixed_batch else 'the task batch_fn (SFC64 stream)'}")
    print("| model | autograd step (ms) | native step (ms) | speed-up | rounds autograd / native (steps/s) |")
    print("|---|---:|---:|---:|---|")
    for m in args.models:
        nat, aut = statistics.median(rates[(m, True)]), statistics.median(rates[(m, False)])
        rounds = (", ".join(f"{r:.1f}" for r in rates[(m, False)]) + " / "
                  + ", ".join(f"{r:.1f}" for r in rates[(m, True)]))
        print(f"| {m} | {1e3 / aut:.2f} | {1e3 / nat:.2f} | {nat / aut:.1f}x | {rounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
