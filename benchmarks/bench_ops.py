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
fused result matches the reference. Timing uses torch.utils.benchmark (warm-up, repeats).
Shapes: paper (B=128, I=100, O=2), ensemble (E=100 of those), large (B=4096, I=O=1024).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import sys
from typing import Callable, Dict

import torch
from torch.utils import benchmark

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

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


def timer(fn: Callable[[], object], min_run_time: float) -> Dict[str, float]:
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
    times = sorted(m.times)
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))]  # noqa: E731
    return {"median_ms": m.median * 1e3, "p20_ms": q(0.2) * 1e3, "p80_ms": q(0.8) * 1e3, "runs": len(times)}


def bench_shape(name, shape, device, dtype, min_run_time, with_compile):
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

    rows = []
    for mode in ("forward", "forward+backward"):
        results = {}
        for prov, mod in providers.items():
            if mode == "forward":
                with torch.no_grad():
                    results[prov] = timer(lambda: mod(x), min_run_time)
            else:
                results[prov] = timer(full(mod), min_run_time)
        if mode == "forward":
            with torch.no_grad():
                results["matmul"] = timer(lambda: mm(x), min_run_time)
        else:
            results["matmul"] = timer(mm_full, min_run_time)
        for prov, r in results.items():
            rows.append(dict(shape=name, mode=mode, provider=prov, **r, **{k: v for k, v in shape.items()}))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.shapes:
        print(f"-- {name} {SHAPES[name]}", flush=True)
        rows += bench_shape(name, SHAPES[name], args.device, dtype, args.min_run_time, not args.no_compile)

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "command": "python benchmarks/bench_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    stem = os.path.join(args.out, f"bench_ops_{args.device}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)

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
    with open(stem + ".md", "w") as f:
        f.write(f"{json.dumps(meta)}\n\n```\n{table}\n```\n")
    print(json.dumps(meta))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
