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
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import nalu_cuda  # noqa: E402
from nalu_cuda.testing import rand_input  # noqa: E402

SHAPES = {
    "paper": dict(E=None, B=128, I=100, O=2),
    "ensemble": dict(E=100, B=128, I=100, O=2),
}
UNITS = {"npu": nalu_cuda.NPU, "real_npu": nalu_cuda.RealNPU, "inalu": nalu_cuda.INALU}


def bench(unit, shape, min_run_time, rounds):
    """Statistics (harness.stats, ms) of fused and reference forward+backward, over ``rounds``
    interleaved rounds, after a check of the fused result against the reference."""
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

    calls = {"fused": step(fused), "reference": step(ref)}
    per_round = harness.interleaved({k: (lambda fn=fn: harness.cpu_times(fn, min_run_time / rounds))
                                     for k, fn in calls.items()}, rounds, warmup=True)
    return {k: harness.stats([t for block in blocks for t in block]) for k, blocks in per_round.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--units", nargs="+", default=list(UNITS), choices=list(UNITS))
    ap.add_argument("--min-run-time", type=float, default=1.0, help="seconds per provider, over all rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(harness.RESULTS, "power_units_cpu"), help="results stem")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, cells = [], []
    for shape in args.shapes:
        for unit in args.units:
            st = bench(unit, SHAPES[shape], args.min_run_time, args.rounds)
            f, r = st["fused"], st["reference"]
            rows.append({"unit": unit, "shape": shape, "fused": f, "reference": r,
                         "ratio": r["median_ms"] / f["median_ms"]})
            cells.append([unit, shape, f"{f['median_ms']:.3f} ({f['p20_ms']:.3f}-{f['p80_ms']:.3f})",
                          f"{r['median_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f})",
                          f"{r['median_ms'] / f['median_ms']:.2f}x"])
            print(harness.markdown_table(["unit", "shape", "fused ms (p20-p80)", "reference ms (p20-p80)",
                                          "reference / fused"], cells[-1:]).splitlines()[-1], flush=True)
    table = harness.markdown_table(["unit", "shape", "fused ms (p20-p80)", "reference ms (p20-p80)",
                                    "reference / fused"], cells)
    meta = {"command": harness.command(__file__, argv), **harness.machine("cpu", dtype="float32")}
    harness.write(args.out, meta, rows, table, title="NPU, RealNPU, iNALU: fused vs reference, forward+backward")
    print(harness.meta_lines(meta) + "\n\n" + table)


if __name__ == "__main__":
    main()
