"""Fused vs reference forward+backward of the power units and iNALU (NPU, RealNPU, INALU).

    python benchmarks/bench_power_units.py --threads 1
    python benchmarks/bench_power_units.py --shapes paper --units npu --min-run-time 0.5

For each unit and shape it checks the fused result (values and every gradient) against the
reference, then times one forward+backward with torch.utils.benchmark (warm-up, repeats) of
  fused      the module with backend="fused" (one fused op per direction)
  reference  the module with backend="reference" (the pure-PyTorch specification, eager)
and prints medians with 20th/80th percentiles and the ratio reference / fused, as a Markdown table.
Shapes: paper (B=128, I=100, O=2) and ensemble (E=100 of those, the 100-seed shape).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
from torch.utils import benchmark

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import nalu_cuda  # noqa: E402
from nalu_cuda.testing import rand_input  # noqa: E402

SHAPES = {
    "paper": dict(E=None, B=128, I=100, O=2),
    "ensemble": dict(E=100, B=128, I=100, O=2),
}
UNITS = {"npu": nalu_cuda.NPU, "real_npu": nalu_cuda.RealNPU, "inalu": nalu_cuda.INALU}


def timer(fn, min_run_time):
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
    times = sorted(m.times)
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))] * 1e3  # noqa: E731
    return m.median * 1e3, q(0.2), q(0.8)


def bench(unit, shape, min_run_time):
    cls = UNITS[unit]
    E, B, I, O = shape["E"], shape["B"], shape["I"], shape["O"]
    fused = cls(I, O, ensemble=E, backend="fused")
    ref = cls(I, O, ensemble=E, backend="reference")
    if unit != "inalu":  # the published gate g = 0.5 everywhere; give W_i something to do
        with torch.no_grad():
            fused.g.uniform_(0.2, 0.8)
            if fused.W_i is not None:
                fused.W_i.normal_(0, 0.05)
    ref.load_state_dict(fused.state_dict())
    lead = () if E is None else (E,)
    x = rand_input(lead + (B, I), dtype=torch.float32, low=0.5, high=1.5)
    dy = torch.randn(lead + (B, O))
    y_f, y_r = fused(x), ref(x)
    torch.testing.assert_close(y_f, y_r, rtol=1e-4, atol=1e-4)
    y_f.backward(dy)
    y_r.backward(dy)
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3, msg=lambda m: f"{unit} {name}: {m}")

    def step(layer):
        def run():
            layer.zero_grad(set_to_none=True)
            layer(x).backward(dy)
        return run

    return timer(step(fused), min_run_time), timer(step(ref), min_run_time)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--units", nargs="+", default=list(UNITS), choices=list(UNITS))
    ap.add_argument("--min-run-time", type=float, default=1.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {args.threads}, "
          "float32, forward+backward")
    print("| unit | shape | fused ms (p20-p80) | reference ms (p20-p80) | reference / fused |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        for unit in args.units:
            (fm, f20, f80), (rm, r20, r80) = bench(unit, SHAPES[shape], args.min_run_time)
            print(f"| {unit} | {shape} | {fm:.3f} ({f20:.3f}-{f80:.3f}) | {rm:.3f} ({r20:.3f}-{r80:.3f}) | "
                  f"{rm / fm:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
