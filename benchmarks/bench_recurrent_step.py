"""The recurrent task's training step, native (one call: ``nalu_cuda::recurrent_ensemble_step``,
``parts/native_step.py``) against autograd (``EnsembleTraining.eager_step``), and the native step
with its batch drawn in the call (``nalu_cuda::recurrent_ensemble_step_drawn``), at the decisive
profile's shape: 2 ops (add, sub) x 100 seeds = 200 members, batch 128, training length 10, 10
inputs, hidden size 2, for the models ``nac`` and ``nalu``.

What one step is: the task's own ``batch_fn`` (a fresh batch per seed from the SFC64 stream,
drawn ahead on its background thread, repeated for the second op, as ``nalu-cuda recurrent`` did
before the in-call draw; ``--fixed-batch``: one batch reused, the step alone), then the training
step through ``train_ensemble`` (the divergence check and Adam included); for the ``drawn`` path
``batch_fn`` names its stream, as the task's does now, and the step draws each seed's batch (and
the targets) itself, once for both ops. ``steps`` steps are timed after a warm-up of the same run;
``--repeats`` rounds time every row once, interleaved, and each row is the median (the rounds are
printed too). One intra-op thread unless ``--threads``.

    python benchmarks/bench_recurrent_step.py                  # about a minute on 2 slow cores
    python benchmarks/bench_recurrent_step.py --steps 50 --repeats 1   # a smoke run
    python benchmarks/bench_recurrent_step.py --paths native drawn     # the data: batch_fn or in the call
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
TIMED = {"warm": None, "t0": None}  # the timed window starts when the runner reaches step warm + 1
ROWS = {"autograd": "autograd step", "native": "native step, task batch_fn", "drawn": "native step, drawn in the call"}


def _recording_runner(self):
    runner = _step_runner(self)
    PATHS.append(self.step_path)

    def timed(step):
        if step == TIMED["warm"] + 1:
            TIMED["t0"] = time.perf_counter()
        runner(step)

    return timed


_step_runner, training.EnsembleTraining._step_runner = training.EnsembleTraining._step_runner, _recording_runner


def step_rate(model_name: str, path: str, steps: int, fixed_batch: bool) -> float:
    """Steps per second over `steps` steps after a warm-up; `path` one of :data:`ROWS`."""
    seeds = list(range(SEEDS))
    E = len(OPS) * SEEDS
    masks = torch.stack([ar.subset_layout(s, I).mask() for s in seeds])
    stream = ar.training_stream("sfc64", seeds, (B, T, I), ar.parse_range([1, 2]), "cpu", masks, list(OPS), chunk=8)
    model = build_recurrent_model(model_name, I, H, ensemble=E)
    model.reset_parameters(member_generators(seeds + [10_000 + s for s in seeds]))
    xv = torch.rand(16, T, I) + 1
    val = EvalSet("valid", xv, torch.zeros(E, 16, 1), shared=True)
    warm = TIMED["warm"] = max(20, steps // 10)
    first = None

    def batch_fn(step):
        nonlocal first
        if fixed_batch and first is not None:
            return first
        x, t = stream.next()
        first = (x.repeat(len(OPS), 1, 1, 1), t)
        return first

    if path == "drawn":
        batch_fn.uniform_stream = stream
    try:
        train_ensemble(model, E, batch_fn, warm + steps, val, lr=1e-2, eval_every=warm + steps,
                       ctx=Context(device="cpu", work_dir=".", progress=False), native=path != "autograd")
    finally:
        stream.close()
    rate = steps / (time.perf_counter() - TIMED["t0"])
    assert PATHS[-1] == ("autograd" if path == "autograd" else "native"), PATHS[-1]
    if path == "drawn":
        assert stream._words is not None  # the batches were drawn in the call
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per measurement (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is reported (default 3)")
    ap.add_argument("--models", nargs="+", default=["nac", "nalu"], choices=["nac", "nalu"])
    ap.add_argument("--paths", nargs="+", default=list(ROWS), choices=list(ROWS),
                    help="the steps to time (default: all three)")
    ap.add_argument("--fixed-batch", action="store_true",
                    help="reuse one batch: the step alone, no data (not for the drawn path)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args(argv)
    paths = [p for p in args.paths if not (args.fixed_batch and p == "drawn")]
    torch.set_num_threads(args.threads)
    rates = {(m, p): [] for m in args.models for p in paths}
    for _ in range(args.repeats):
        for key in rates:
            rates[key].append(step_rate(key[0], key[1], args.steps, args.fixed_batch))
    print(f"E = {len(OPS) * SEEDS} ({len(OPS)} ops x {SEEDS} seeds), B = {B}, T = {T}, I = {I}, H = {H}; "
          f"{args.steps} steps, {args.repeats} rounds, {args.threads} thread(s), "
          f"{'one fixed batch' if args.fixed_batch else 'the task data (SFC64 stream)'}")
    ratios = [(a, b) for a, b in (("native", "autograd"), ("drawn", "native"), ("drawn", "autograd"))
              if a in paths and b in paths]
    print("| model | " + " | ".join(f"{ROWS[p]} (ms)" for p in paths) + " | "
          + " | ".join(f"{a} / {b} speed-up" for a, b in ratios) + " | rounds " + " / ".join(paths) + " (steps/s) |")
    print("|---|" + "---:|" * (len(paths) + len(ratios)) + "---|")
    for m in args.models:
        med = {p: statistics.median(rates[(m, p)]) for p in paths}
        rounds = " / ".join(", ".join(f"{r:.1f}" for r in rates[(m, p)]) for p in paths)
        print(f"| {m} | " + " | ".join(f"{1e3 / med[p]:.2f}" for p in paths) + " | "
              + " | ".join(f"{med[a] / med[b]:.2f}x" for a, b in ratios) + f" | {rounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
