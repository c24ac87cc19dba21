"""Times the raw fused ops (no autograd, no module) at the static task's 100-seed ensemble shapes.

    python benchmarks/bench_kernels.py              # 1 thread, float32
    python benchmarks/bench_kernels.py --threads 2

Layer 1 is x (100, 128, 100) -> 2 outputs per member, layer 2 is (100, 128, 2) -> 1: the two
layers of benchmarks/bench_training.py. A second table splits a NALU forward+backward at the
paper's shape (B=128, I=100, O=2) into the raw ops and the rest (module call, autograd node and
engine), beside the smallest autograd round trip there is (a 2-element multiply and its
backward). Each row is the median of torch.utils.benchmark's blocked_autorange (through
benchmarks/harness.py), pooled over --rounds interleaved rounds. This is the view for kernel work
(bench_ops.py and bench_training.py measure what a user sees); compare builds of two commits by
running it on each. Writes benchmarks/results/kernels_cpu.{md,csv,json} (--out).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
import nalu_cuda  # noqa: E402  (also registers torch.ops.nalu_cuda)
from nalu_cuda.testing import rand_input, rand_params  # noqa: E402

EPS = 1e-7


def cases(E: int, B: int, I: int, O: int):
    ops = torch.ops.nalu_cuda
    x = rand_input((E, B, I), dtype=torch.float32, low=1.0, high=2.0)
    W, M = rand_params((E, I, O), scale=0.3, dtype=torch.float32), rand_params((E, I, O), dtype=torch.float32)
    G = rand_params((E, I, O), scale=0.3, dtype=torch.float32)
    dy = torch.randn(E, B, O)
    _, lx = ops.nac_mul_forward(x, W, M, EPS)
    y, a, m, g, lxn, _r = ops.nalu_forward(x, W, M, None, None, G, EPS, True)
    y_mul = torch.exp(lx @ (torch.tanh(W) * torch.sigmoid(M)))
    return {
        "nac_forward": lambda: ops.nac_forward(x, W, M),
        "nac_backward (no grad_x)": lambda: ops.nac_backward(dy, x, W, M, False),
        "nac_backward (grad_x)": lambda: ops.nac_backward(dy, x, W, M, True),
        "nac_mul_forward": lambda: ops.nac_mul_forward(x, W, M, EPS),
        "nac_mul_backward (grad_x)": lambda: ops.nac_mul_backward(dy, x, W, M, y_mul, lx, EPS, True),
        "nalu_forward": lambda: ops.nalu_forward(x, W, M, None, None, G, EPS, True),
        "nalu_backward (no grad_x)": lambda: ops.nalu_backward(dy, x, W, M, None, None, G, a, m, g, lxn, EPS, True,
                                                               False),
        "nalu_backward (grad_x)": lambda: ops.nalu_backward(dy, x, W, M, None, None, G, a, m, g, lxn, EPS, True,
                                                            True),
    }


def paper_breakdown():
    import nalu_cuda._C as native

    ops = torch.ops.nalu_cuda
    x = rand_input((128, 100), dtype=torch.float32, low=1.0, high=2.0)
    dy = torch.randn(128, 2)
    fused = nalu_cuda.NALU(100, 2, backend="fused")
    ref = nalu_cuda.NALU(100, 2, backend="reference")
    ref.load_state_dict(fused.state_dict())
    W, M, G = (p.detach() for p in (fused.W_hat, fused.M_hat, fused.G))
    _, a, m, g, lx, _r = ops.nalu_forward(x, W, M, None, None, G, EPS, True)
    w2 = torch.randn(2, requires_grad=True)
    one = torch.ones(2)
    return {
        "autograd round trip (2-element mul)": lambda: (w2 * 2.0).backward(one),
        "nalu_forward op alone": lambda: native.nalu(x, W, M, None, None, G, EPS, True),
        "nalu_backward op alone": lambda: ops.nalu_backward(dy, x, W, M, None, None, G, a, m, g, lx, EPS, True,
                                                            False),
        "NALU module, fused, fwd+bwd": lambda: fused(x).backward(dy),
        "NALU module, reference, fwd+bwd": lambda: ref(x).backward(dy),
    }


def _time_all(calls, min_run_time: float, rounds: int):
    per_round = harness.interleaved({k: (lambda fn=fn: harness.cpu_times(fn, min_run_time / rounds))
                                     for k, fn in calls.items()}, rounds)
    return {k: harness.stats([t for b in blocks for t in b], 1e6, "us") for k, blocks in per_round.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement (all rounds)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--out", default=harness.RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    meta = {"command": harness.command(__file__, argv), **harness.machine("cpu", rounds=args.rounds)}
    print(harness.meta_lines(meta))
    rows = []
    for name, shape in [("layer 1: 100 x 128 x 100 -> 2", (100, 128, 100, 2)),
                        ("layer 2: 100 x 128 x 2 -> 1", (100, 128, 2, 1))]:
        for op, r in _time_all(cases(*shape), args.min_run_time, args.rounds).items():
            rows.append(dict(table="ensemble ops", layer=name, op=op, **r))
    for what, r in _time_all(paper_breakdown(), args.min_run_time, args.rounds).items():
        rows.append(dict(table="paper shape: B=128, I=100, O=2", layer="paper", op=what, **r))
    table = harness.markdown_table(
        ["layer", "op", "median us", "p20 us", "p80 us"],
        [[r["layer"], r["op"], f"{r['median_us']:.1f}", f"{r['p20_us']:.1f}", f"{r['p80_us']:.1f}"] for r in rows])
    harness.write(os.path.join(args.out, "kernels_cpu"), meta, rows, table, title="Raw fused ops (CPU)")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
