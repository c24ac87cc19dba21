"""The NALU's options on the fused path: what each costs in a layer pair's forward and backward.

The pair is stable-nalu's static-task network (``NALU(100, 2)`` then ``NALU(2, 1)``, a batch of
128 inputs in U[1, 2], float32, one intra-op thread); one call is a forward, an MSE loss and a
backward (no optimiser step). Four settings of both layers:

* ``plain``: the paper's NALU (tied weights, input gate without bias);
* ``gate_bias``: ``gate_bias=True`` (stable-nalu's ``nalu_bias``);
* ``keep_parts``: ``keep_parts=True`` (the gate and both paths of the call kept, loss on y only);
* ``all options``: ``gate_bias=True, tied=False, keep_parts=True`` and stable-nalu's gate
  regulariser ``sum(g^2 (1 - g)^2)`` of both layers added to the loss (``nalu_gate='regualized'``).

Timed with ``torch.utils.benchmark``, the settings interleaved over ``--rounds`` rounds; the table
gives each setting's median over rounds and its ratio to ``plain``.

    python benchmarks/bench_nalu_options.py          # about half a minute on 2 slow cores

Writes ``benchmarks/results/nalu_options.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import nalu_cuda  # noqa: E402

SETTINGS = {
    "plain": dict(opts={}, reg=False),
    "gate_bias": dict(opts=dict(gate_bias=True), reg=False),
    "keep_parts": dict(opts=dict(keep_parts=True), reg=False),
    "all options": dict(opts=dict(gate_bias=True, tied=False, keep_parts=True), reg=True),
}


def make_call(setting: str, batch: int, seed: int):
    opts, reg = SETTINGS[setting]["opts"], SETTINGS[setting]["reg"]
    torch.manual_seed(seed)
    layers = [nalu_cuda.NALU(100, 2, backend="fused", **opts), nalu_cuda.NALU(2, 1, backend="fused", **opts)]
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(batch, 100).uniform_(1, 2, generator=gen)
    t = x[:, :25].sum(1, keepdim=True) + x[:, 12:37].sum(1, keepdim=True)

    def call():
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        loss = F.mse_loss(layers[1](layers[0](x)), t)
        if reg:
            for layer in layers:
                g = layer.parts.g
                loss = loss + torch.sum(g ** 2 * (1 - g) ** 2)
        loss.backward()

    return call


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    harness.timing_args(ap, "nalu_options", per="setting")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    calls = {s: make_call(s, args.batch, args.seed) for s in SETTINGS}
    times = harness.interleaved({s: (lambda c=c: harness.cpu_timer(c, args.min_time)["median_ms"])
                                 for s, c in calls.items()}, args.rounds, warmup=True)
    plain = statistics.median(times["plain"])
    rows = [{"setting": s, "ms": statistics.median(v), "vs_plain": statistics.median(v) / plain, "rounds": v}
            for s, v in times.items()]
    table = harness.markdown_table(["setting (both layers)", "forward+backward, ms (median)", "vs plain"],
                                   [[r["setting"], f"{r['ms']:.3f}", f"{r['vs_plain']:.2f}x"] for r in rows])
    meta = {"command": harness.command(__file__, argv), **harness.machine("cpu", dtype="float32")}
    harness.write(args.out, meta, rows, table, title="The NALU's options on the fused path: a layer pair's step")
    print(harness.meta_lines(meta) + "\n\n" + table)


if __name__ == "__main__":
    main()
