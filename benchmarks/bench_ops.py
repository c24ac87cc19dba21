"""Microbenchmark of one NALU layer: fused ops vs the eager reference vs torch.compile of it.

    python benchmarks/bench_ops.py                 # CPU, every shape, writes benchmarks/results/
    python benchmarks/bench_ops.py --shapes paper --threads 1

For each shape and mode (forward; forward+backward) it times:
  fused      nalu_cuda.NALU(backend="fused"): one fused op per direction
  reference  nalu_cuda.NALU(backend="reference"): the pure-PyTorch specification, eager
  compiled   torch.compile(reference module), warmed up before timing
  matmul     the layer's matrix products alone through autograd (3 forward, 5 backward
             with an input gradient): what BLAS needs at the least, the floor at large shapes
and prints medians (with the 20th/80th percentiles) and the ratios, after checking that the
fused result matches the reference. Timing: benchmarks/harness.py (torch.utils.benchmark's
blocked_autorange, warm-up included), in --rounds interleaved rounds (each round times every
provider of a mode once); the statistics pool the blocks of all rounds.
Shapes: paper (B=128, I=100, O=2), ensemble (E=100 of those), large (B=4096, I=O=1024).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import harness  # noqa: E402
import nalu_cuda  # noqa: E402
from nalu_cuda.testing import rand_input  # noqa: E402

SHAPES = {
    "paper": dict(E=None, B=128, I=100, O=2),
    "ensemble": dict(E=100, B=128, I=100, O=2),
    "large": dict(E=None, B=4096, I=1024, O=1024),
}


def make_layers(shape, device, dtype):
    E, I, O = shape["E"], shape["I"], shape["O"]
    fused = nalu_cuda.NALU(I, O, ensemble=E, backend="fused").to(device, dtype)
    ref = nalu_cuda.NALU(I, O, ensemble=E, backend="reference").to(device, dtype)
    ref.load_state_dict(fused.state_dict())
    return fused, ref


def matmul_floor(layer, x):
    """The products of one NALU layer, alone: a = x W, u = lx W, z = x G (lx = x here)."""
    W, G = layer.W_hat, layer.G
    if W.dim() == 2:
        return lambda xx: (xx @ W, xx @ W, xx @ G)
    return lambda xx: (torch.bmm(xx, W), torch.bmm(xx, W), torch.bmm(xx, G))


def bench_shape(name, shape, device, dtype, min_run_time, with_compile, rounds=3):
    torch._dynamo.reset()
    fused, ref = make_layers(shape, device, dtype)
    lead = () if shape["E"] is None else (shape["E"],)
    x = rand_input(lead + (shape["B"], shape["I"]), dtype=dtype, device=device, low=1.0, high=2.0)
    for p in list(fused.parameters()) + list(ref.parameters()):
        p.data.mul_(0.1)  # keep exp() of the multiplicative path modest at I = 1024
    dy = torch.randn(lead + (shape["B"], shape["O"]), dtype=dtype, device=device)

    # correctness first
    y_f, y_r = fused(x), ref(x)
    torch.testing.assert_close(y_f, y_r, rtol=1e-4, atol=1e-5)
    y_f.backward(dy)
    y_r.backward(dy)
    for p, q in zip(fused.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)

    providers = {"fused": fused, "reference": ref}
    if with_compile:
        compiled = torch.compile(ref)
        for _ in range(3):  # compile forward and backward graphs before timing
            compiled(x).backward(dy)
        providers["compiled"] = compiled
    mm = matmul_floor(fused, x)
    W_leaf = [fused.W_hat, fused.G]

    def full(mod):
        def run():
            mod(x).backward(dy)
        return run

    def mm_full():
        a, u, z = mm(x)
        torch.autograd.backward((a, u, z), (dy, dy, dy), inputs=W_leaf)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    rows = []
    for mode in ("forward", "forward+backward"):
        calls = {prov: (no_grad(lambda mod=mod: mod(x)) if mode == "forward" else full(mod))
                 for prov, mod in providers.items()}
        calls["matmul"] = no_grad(lambda: mm(x)) if mode == "forward" else mm_full
        per_round = harness.interleaved(
            {prov: (lambda fn=fn: harness.cpu_times(fn, min_run_time / rounds)) for prov, fn in calls.items()}, rounds)
        for prov, blocks in per_round.items():
            r = harness.stats([t for b in blocks for t in b])
            rows.append(dict(shape=name, mode=mode, provider=prov, **r, **{k: v for k, v in shape.items()}))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement (all rounds)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.shapes:
        print(f"-- {name} {SHAPES[name]}", flush=True)
        rows += bench_shape(name, SHAPES[name], args.device, dtype, args.min_run_time, not args.no_compile,
                            args.rounds)

    meta = {"command": harness.command(__file__, argv), **harness.machine(args.device, dtype=args.dtype,
                                                                         rounds=args.rounds)}
    stem = os.path.join(args.out, f"bench_ops_{args.device}")

    # the table, with ratios against the fused path
    lines = [f"{'shape':<9}{'mode':<18}{'fused ms':>10}{'reference ms':>14}{'compiled ms':>13}{'matmul ms':>11}"
             f"{'ref/fused':>11}{'compiled/fused':>16}{'fused/matmul':>14}"]
    by = {(r["shape"], r["mode"], r["provider"]): r["median_ms"] for r in rows}
    for name in args.shapes:
        for mode in ("forward", "forward+backward"):
            f = by[(name, mode, "fused")]
            r = by[(name, mode, "reference")]
            c = by.get((name, mode, "compiled"))
            m = by[(name, mode, "matmul")]
            lines.append(f"{name:<9}{mode:<18}{f:>10.3f}{r:>14.3f}{(f'{c:.3f}' if c else '-'):>13}{m:>11.3f}"
                         f"{r / f:>10.2f}x{(f'{c / f:.2f}x' if c else '-'):>16}{f / m:>13.2f}x")
    table = "\n".join(lines)
    harness.write(stem, meta, rows, f"```\n{table}\n```", title="One NALU layer: fused vs reference vs compiled")
    print(harness.meta_lines(meta))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
