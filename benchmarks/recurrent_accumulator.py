"""Why the recurrent NAC/NAU fail a + b over long sequences: the accumulating weight over training.

The recurrent task (``nalu-cuda recurrent``) trains ``h_t = unit([x_t, h_{t-1}])`` on sequences of
length 10 and tests at length 1000. Extrapolating a sum needs the state-to-state weights ``W_hh``
(the last ``hidden`` rows of the cell's weight) to be exactly an accumulator: 1 on the units that
carry the sum. A weight ``1 - d`` keeps ``(1 - (1 - d)^T) / (T d)`` of the mass at length ``T``
(0.63 for ``T d = 1``), so at ``T = 1000`` a gap ``d`` of 1e-4 already costs 5%.

With several hidden units the sum can be carried by a mix of them (``[[.5, .5], [.5, .5]]`` carries
it as exactly as the identity), so the accumulating factor per step is the spectral radius
``rho`` of ``W_hh``: the largest modulus of its eigenvalues, and the carried mass at length ``T``
follows from ``d = 1 - rho`` as above.

This script runs the recurrent task itself (``tasks.recurrent.run``, the same protocol, data and
seeds as the command) with one addition: at every evaluation it records, per member, ``rho`` and
the gap ``|1 - rho|``, and the largest single weight ``max W_hh``. It writes
``accumulator.json`` (the series and the runs' success counts) and ``accumulator.png`` (the
median gap over training, one line per model and learning rate, the members' range shaded).

    python benchmarks/recurrent_accumulator.py --out benchmarks/results/recurrent_accumulator \\
        --runs nac:0.01 nau:0.01 nau:0.001 --op add sub --seeds 8 --steps 50000

See benchmarks/RESULTS.md for what it found.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from nalu_cuda.experiments.parts import arithmetic_models as am
from nalu_cuda.experiments.registry import Context
from nalu_cuda.experiments.tasks import recurrent


def state_weights(model, inputs: int) -> torch.Tensor:
    """The cell's state-to-state weights ``(E, H, H)`` (NAC: tanh * sigmoid; NAU: clamped)."""
    (W,) = am.arithmetic_weights(model.cell)
    return W[..., inputs:, :]


def run_one(model: str, lr: float, ops, seeds: int, steps: int, eval_every: int, work_dir: str) -> dict:
    cfg = recurrent.recurrent_config(model, ops, seeds, steps, lr=lr, eval_every=eval_every)
    inputs = cfg.params["input_size"]
    seen = {}
    original = recurrent.train_ensemble

    def tracking(net, *args, **kwargs):  # the task's own call, with one on_eval series added
        def on_eval(step):
            W = state_weights(net, inputs).double()
            rho = torch.linalg.eigvals(W).abs().max(-1).values
            return {"w_max": W.flatten(1).max(1).values.tolist(), "rho": rho.tolist(), "gap": (1 - rho).abs().tolist()}
        res = original(net, *args, on_eval=on_eval, **kwargs)
        seen["curves"] = res.curves
        return res

    recurrent.train_ensemble = tracking
    try:
        t0 = time.perf_counter()
        out = recurrent.run(cfg, Context(device="cpu", work_dir=work_dir, progress=False))
    finally:
        recurrent.train_ensemble = original
    records = out.records
    return {"model": model, "lr": lr, "ops": list(ops), "seeds": seeds, "steps": steps,
            "wall_s": time.perf_counter() - t0,
            "success": {op: sum(bool(r["success"]) for r in records if r["op"] == op) for op in ops},
            "interp_mse_median": {op: float(torch.tensor([r["interp_mse"] for r in records if r["op"] == op]).median())
                                  for op in ops},
            "solved_at": {op: [r["solved_at"] for r in records if r["op"] == op] for op in ops},
            "curves": seen["curves"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=["nac:0.01", "nau:0.01", "nau:0.001"], metavar="MODEL:LR")
    ap.add_argument("--op", nargs="+", default=["add", "sub"])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "accumulator.json")
    done = json.load(open(path)) if os.path.exists(path) else {"command": " ".join(sys.argv), "runs": []}
    for spec in args.runs:
        model, lr = spec.split(":")
        if any(r["model"] == model and r["lr"] == float(lr) for r in done["runs"]):
            continue  # finished earlier: kept
        print(f"{model} lr {lr}: {args.seeds} seeds x {args.steps} steps", flush=True)
        r = run_one(model, float(lr), args.op, args.seeds, args.steps, args.eval_every, args.out)
        print(f"  {r['wall_s']:.0f} s; solved {r['success']}", flush=True)
        done["runs"].append(r)
        with open(path + ".tmp", "w") as f:
            json.dump(done, f)
        os.replace(path + ".tmp", path)
    plot(done, os.path.join(args.out, "accumulator.png"))
    return 0


def plot(done: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = done["runs"][0]["ops"] if done["runs"] else []
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4), squeeze=False)
    for k, op in enumerate(ops):
        ax = axes[0][k]
        for r in done["runs"]:
            steps = r["curves"]["step"]
            gap = torch.tensor([[g if g is not None else float("nan") for g in row] for row in r["curves"]["gap"]])
            n = r["seeds"]
            g = gap[:, k * n:(k + 1) * n].clamp_min(1e-9)  # members of this op (op-major)
            label = f"{r['model'].upper()}, lr {r['lr']:g} ({r['success'][op]}/{n} solved)"
            line, = ax.plot(steps, g.median(1).values, label=label)
            ax.fill_between(steps, g.min(1).values, g.max(1).values, color=line.get_color(), alpha=0.15)
        ax.axhline(1e-3, color="grey", ls=":", lw=1)
        ax.text(0, 1.1e-3, "T d = 1 at T = 1000", fontsize=7, color="grey")
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("|1 - rho(W_hh)| (median over seeds, range shaded)")
        ax.set_title(f"recurrent {op}: train T = 10, test T = 1000")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
