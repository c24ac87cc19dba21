"""Instructions per training step of ``bench_compat.py``'s stable-nalu setups, theirs against ours,
counted with callgrind (which the other jobs on a shared machine do not move, as they move timings).

The benchmark's own ``stable_models(0, **options)``, ``stable_data`` and ``make_step`` (their script's
step: ``zero_grad``, forward, MSE plus their regulariser term, backward, Adam), 30 warm-up steps,
then ``--steps`` more. The whole process is counted once with 0 and once with ``--steps`` more steps;
the difference over ``--steps`` is one step (import, model building and warm-up cancel out). One
intra-op thread, float32.

    python benchmarks/count_compat_step.py                      # both sides, every option, 300 steps
    python benchmarks/count_compat_step.py --no-optimizer       # the same without the optimiser step
    python benchmarks/count_compat_step.py --no-regularizer     # loss = MSE only
    python benchmarks/count_compat_step.py --run ours --steps 5 # one side's steps, uncounted (what is counted)

Needs ``valgrind`` on PATH; each count runs Python under callgrind (minutes on a slow machine).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 30


class _NoStep:
    """The optimiser with its step left out (``zero_grad`` still runs)."""

    def __init__(self, opt):
        self.opt = opt

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        pass


def run_side(side: str, steps: int, setup: str, optimizer: bool, regularizer: bool) -> None:
    sys.path.insert(0, HERE)
    import torch

    import bench_compat

    torch.set_num_threads(1)
    options = bench_compat.STABLE_OPTIONS if setup == "stable-nalu-options" else {}
    theirs, ours, optim = bench_compat.stable_models(0, **options)
    model = theirs if side == "theirs" else ours
    opt = optim(model.parameters())
    if not optimizer:
        opt = _NoStep(opt)
    batches = bench_compat.stable_data(torch.Generator().manual_seed(0))
    step = bench_compat.make_step(model, opt, batches, regularizer)
    for _ in range(WARMUP + steps):
        step()


def count(side: str, steps: int, args) -> int:
    """Instructions of the whole process (callgrind's 'Collected') for ``side`` with ``steps`` steps."""
    cmd = [sys.executable, os.path.abspath(__file__), "--run", side, "--steps", str(steps), "--setup", args.setup]
    if not args.optimizer:
        cmd.append("--no-optimizer")
    if not args.regularizer:
        cmd.append("--no-regularizer")
    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(args.keep or tmp, f"callgrind.{side}.{steps}.out")
        out = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={dest}"] + cmd,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"callgrind run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    found = re.findall(r"Collected\s*:\s*(\d+)", out.stderr)
    if not found:
        raise SystemExit(f"no 'Collected' line in callgrind's output:\n{out.stderr[-3000:]}")
    return int(found[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sides", nargs="+", default=["theirs", "ours"], choices=["theirs", "ours"])
    ap.add_argument("--setup", default="stable-nalu-options", choices=["stable-nalu", "stable-nalu-options"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--no-optimizer", dest="optimizer", action="store_false", help="leave out the optimiser step")
    ap.add_argument("--no-regularizer", dest="regularizer", action="store_false", help="loss = MSE only")
    ap.add_argument("--keep", metavar="DIR", help="keep callgrind's output files there (callgrind.SIDE.STEPS.out), "
                    "e.g. for callgrind_annotate --inclusive=yes on both and the difference per function")
    ap.add_argument("--run", choices=["theirs", "ours"], help="run one side's steps without counting (used by the counts)")
    args = ap.parse_args(argv)
    if args.run:
        run_side(args.run, args.steps, args.setup, args.optimizer, args.regularizer)
        return 0
    per_step = {}
    for side in args.sides:
        base, full = count(side, 0, args), count(side, args.steps, args)
        per_step[side] = (full - base) / args.steps
        print(f"{side}: {base} instructions with 0 steps, {full} with {args.steps}: "
              f"{per_step[side] / 1e6:.3f} M per step", flush=True)
    if len(per_step) == 2:
        print(f"theirs / ours: {per_step['theirs'] / per_step['ours']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
