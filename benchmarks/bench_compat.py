"""One training step in two public NALU codebases, their layer against nalu_cuda's drop-in.

Each codebase's layer is re-implemented here from its published code (weights ``(out, in)``,
``F.linear``, their formulas, eps and initialisation), in the setting of its own training script:

* ``kevinzakka``: kevinzakka/NALU-pytorch's ``function_learning.py``: a stack of two
  ``NeuralArithmeticLogicUnitCell`` (2 -> 2 -> 1, eps 1e-10, Kaiming initialisation), the whole
  training set of 500 pairs (sums of 5 of 100 values in U[5, 10]) each step, MSE, RMSprop lr 1e-3.
* ``stable-nalu``: stable-nalu's ``simple_function_static.py`` with ``--layer-type NALU``: two
  ``NALULayer`` (100 -> 2 -> 1, eps 1e-7, their ``NACWeight`` autograd function, the NAC called once
  per path), batches of 128 inputs in U[1, 2], target a + b over overlapping subsets, Adam lr 1e-3,
  and their script's loss: MSE plus its regulariser term over the network's ``regualizer()``
  (their modules' entries merged by key, each NAC forming its weight for its NAU-z entry, 0 at
  their default ``--regualizer-z 0``).
* ``stable-nalu-options``: the same with every option of their ``NALULayer`` that nalu_cuda's has
  a counterpart for: ``nalu_two_nac=True`` (two NACs), ``nalu_bias=True`` (a gate bias) and
  ``nalu_gate='regualized'`` (their gate regulariser ``sum(g^2 (1 - g)^2)`` in the loss): nalu_cuda's
  ``StableNALULayer`` with ``tied=False, gate_bias=True, keep_parts=True``.

nalu_cuda's side: ``nalu_cuda.NALU`` (``init="kaiming"``) / ``nalu_cuda.compat.StableNALULayer``
loaded with the same starting weights through :mod:`nalu_cuda.compat`, same data, same optimiser.
Before timing, both sides train 10 steps in float64 from the same weights on the same batches
and the script checks that their losses agree to 1e-9 (relative); it then reports the float32
losses of both after ``--check-steps`` steps. (kevinzakka's task is chaotic under RMSprop: a
difference in the last bit of a gradient grows by about 1e5 every five steps, in their own code
as much as here, so only the first steps can be compared closely.)

A step is ``zero_grad``, forward, loss, backward, optimiser step, on batches drawn beforehand
(identical for both sides). Timed with ``torch.utils.benchmark`` (one intra-op thread), the two
sides interleaved over ``--rounds`` rounds; the table gives each side's median over rounds and the
range of the per-round ratios.

    python benchmarks/bench_compat.py            # about a minute on 2 slow cores

Writes ``benchmarks/results/compat.json``.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import nalu_cuda  # noqa: E402
from nalu_cuda import compat, init_presets  # noqa: E402


# --- kevinzakka/NALU-pytorch (models/nac.py, models/nalu.py), re-implemented ------------------------


class ZakkaNAC(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.W_hat = nn.Parameter(torch.empty(out_dim, in_dim))
        self.M_hat = nn.Parameter(torch.empty(out_dim, in_dim))
        nn.init.kaiming_uniform_(self.W_hat)
        nn.init.kaiming_uniform_(self.M_hat)

    def forward(self, x):
        return F.linear(x, torch.tanh(self.W_hat) * torch.sigmoid(self.M_hat))


class ZakkaNALU(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.eps = 1e-10
        self.G = nn.Parameter(torch.empty(out_dim, in_dim))
        self.nac = ZakkaNAC(in_dim, out_dim)
        nn.init.kaiming_uniform_(self.G, a=math.sqrt(5))

    def forward(self, x):
        a = self.nac(x)
        g = torch.sigmoid(F.linear(x, self.G))
        m = torch.exp(self.nac(torch.log(torch.abs(x) + self.eps)))
        return g * a + (1 - g) * m


def zakka_data(gen):
    values = torch.empty(100).uniform_(5, 10, generator=gen)
    X = []
    for _ in range(500):
        idx = torch.randperm(100, generator=gen)[:10]
        X.append([values[idx[:5]].sum(), values[idx[5:]].sum()])
    X = torch.tensor(X)
    return [(X, X.sum(1, keepdim=True))]


def zakka_models(seed):
    torch.manual_seed(seed)
    theirs = nn.Sequential(ZakkaNALU(2, 2), ZakkaNALU(2, 1))
    ours = nn.Sequential(nalu_cuda.NALU(2, 2, eps=1e-10, init="kaiming"),
                         nalu_cuda.NALU(2, 1, eps=1e-10, init="kaiming"))
    sd = theirs.state_dict()
    for i, layer in enumerate(ours):
        layer.load_state_dict(compat.from_kevinzakka(sd, prefix=f"{i}."))
    return theirs, ours, lambda p: torch.optim.RMSprop(p, lr=1e-3)


# --- AndreasMadsen/stable-nalu (layer/nac.py, layer/_abstract_nalu.py, functional), re-implemented ----


class NACWeight(torch.autograd.Function):
    """stable-nalu's ``nac_weight(mode='normal')``."""

    @staticmethod
    def forward(ctx, w_hat, m_hat):
        t, s = torch.tanh(w_hat), torch.sigmoid(m_hat)
        ctx.save_for_backward(t, s)
        return t * s

    @staticmethod
    def backward(ctx, grad):
        t, s = ctx.saved_tensors
        return grad * (1 - t * t) * s, grad * t * s * (1 - s)


class StableNAC(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.W_hat = nn.Parameter(torch.empty(out_features, in_features))
        self.M_hat = nn.Parameter(torch.empty(out_features, in_features))
        r = init_presets.nac_optimal_bound(in_features, out_features)
        nn.init.uniform_(self.W_hat, -r, r)
        nn.init.uniform_(self.M_hat, -r, r)

    def forward(self, x):
        return F.linear(x, NACWeight.apply(self.W_hat, self.M_hat))

    def regualizer(self):
        """Their ``NACLayer.regualizer``: forms ``W`` (with its graph) for the NAU-z term, which
        their ``RegualizerNAUZ(zero=True)`` makes 0 at their default ``--regualizer-z 0``."""
        NACWeight.apply(self.W_hat, self.M_hat)
        return {"z": 0}


def merged(own, children):
    """Their ``ExtendedTorchModule.regualizer``: the module's own entries, then each child's, summed
    by key into a ``defaultdict(int)``."""
    out = defaultdict(int)
    for entries in [own] + [child.regualizer() for child in children]:
        for key, value in entries.items():
            out[key] += value
    return out


def training_regualizer(r):
    """Their ``simple_function_static.py`` loss term at their defaults (``--regualizer 10``,
    ``--regualizer-z 0``, ``--regualizer-oob 1``; ``r_w_scale`` multiplies a 0 here)."""
    return 10 * 1.0 * r["W"] + r["g"] + 0 * r["z"] + 1 * r["W-OOB"]


class StableNALU(nn.Module):
    """Their ``NALULayer`` with its options: ``nalu_two_nac`` (a second NAC for the multiplicative
    path), ``nalu_bias`` (a gate bias ``bias_add``, initialised to 0) and ``nalu_gate='regualized'``
    (the last call's gate kept, ``regualizer()['g'] = sum(g^2 (1 - g)^2)``)."""

    def __init__(self, in_features, out_features, eps=1e-7, nalu_two_nac=False, nalu_bias=False,
                 nalu_gate="normal"):
        super().__init__()
        self.eps, self.nalu_gate = eps, nalu_gate
        self.nac_add = StableNAC(in_features, out_features)
        self.nac_mul = StableNAC(in_features, out_features) if nalu_two_nac else None  # None: nac_add
        self.G_add = nn.Parameter(torch.empty(out_features, in_features))
        self.bias_add = nn.Parameter(torch.zeros(out_features)) if nalu_bias else None
        nn.init.xavier_uniform_(self.G_add, gain=nn.init.calculate_gain("sigmoid"))
        self._last_gate = None

    def regualizer(self):
        own = {}
        if self.nalu_gate == "regualized":
            g = self._last_gate
            own["g"] = torch.sum(g ** 2 * (1 - g) ** 2)
        return merged(own, [self.nac_add] + ([] if self.nac_mul is None else [self.nac_mul]))

    def forward(self, x):
        g = torch.sigmoid(F.linear(x, self.G_add, self.bias_add))
        if self.nalu_gate == "regualized":
            self._last_gate = g
        a = self.nac_add(x)
        nac_mul = self.nac_add if self.nac_mul is None else self.nac_mul
        m = torch.exp(nac_mul(torch.log(torch.abs(x) + self.eps)))
        return g * a + (1 - g) * m


class StableNet(nn.Module):
    """SimpleFunctionStaticNetwork: two layers; their script's loss is MSE + ``training_regualizer``
    of the network's merged ``regualizer()``."""

    def __init__(self, layer):
        super().__init__()
        self.layer_1, self.layer_2 = layer(100, 2), layer(2, 1)

    def forward(self, x):
        return self.layer_2(self.layer_1(x))

    def regualizer(self):
        return merged({}, [self.layer_1, self.layer_2])


def stable_data(gen, batches=64):
    perm = torch.randperm(100, generator=gen)
    a_idx, b_idx = perm[:25], perm[12:37]  # subset ratio 0.25, overlap ratio 0.5
    out = []
    for _ in range(batches):
        x = torch.empty(128, 100).uniform_(1, 2, generator=gen)
        out.append((x, (x[:, a_idx].sum(1) + x[:, b_idx].sum(1)).unsqueeze(1)))
    return out


def stable_models(seed, **options):
    torch.manual_seed(seed)
    theirs = StableNet(lambda i, o: StableNALU(i, o, **options))
    ours = StableNet(lambda i, o: compat.StableNALULayer(i, o, **options))
    for name in ("layer_1", "layer_2"):
        getattr(ours, name).load_state_dict(compat.from_stable_nalu(getattr(theirs, name).state_dict()))
    return theirs, ours, lambda p: torch.optim.Adam(p, lr=1e-3)


# stable-nalu's NALU with every option our layer has a counterpart for.
STABLE_OPTIONS = dict(nalu_two_nac=True, nalu_bias=True, nalu_gate="regualized")

SETUPS = {"kevinzakka": (zakka_models, zakka_data), "stable-nalu": (stable_models, stable_data),
          "stable-nalu-options": (lambda seed: stable_models(seed, **STABLE_OPTIONS), stable_data)}


def make_step(model, opt, batches, with_reg):
    state = {"i": 0}

    def step():
        x, t = batches[state["i"] % len(batches)]
        state["i"] += 1
        opt.zero_grad()
        loss = F.mse_loss(model(x), t)
        if with_reg:
            loss = loss + training_regualizer(model.regualizer())
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def run(setup: str, seed: int, rounds: int, min_time: float, check_steps: int) -> dict:
    models, data = SETUPS[setup]
    batches = data(torch.Generator().manual_seed(seed))
    with_reg = setup.startswith("stable-nalu")
    # correctness: both sides from the same weights, same batches, float64
    theirs, ours, optim = models(seed)
    b64 = [(x.double(), t.double()) for x, t in batches]
    steps = {k: make_step(m.double(), optim(m.parameters()), b64, with_reg) for k, m in (("theirs", theirs), ("ours", ours))}
    exact = {k: [float(s()) for _ in range(10)] for k, s in steps.items()}
    for lt, lo in zip(exact["theirs"], exact["ours"]):
        if not math.isclose(lt, lo, rel_tol=1e-9):
            raise SystemExit(f"{setup}: float64 losses differ: theirs {exact['theirs']}, ours {exact['ours']}")
    # float32, as timed
    theirs, ours, optim = models(seed)
    steps = {k: make_step(m, optim(m.parameters()), batches, with_reg) for k, m in (("theirs", theirs), ("ours", ours))}
    losses = {k: [float(s()) for _ in range(check_steps)] for k, s in steps.items()}
    # timing, interleaved
    times = harness.interleaved({k: (lambda s=s: harness.cpu_timer(s, min_time)["median_ms"]) for k, s in steps.items()},
                                rounds)
    ratios = [a / b for a, b in zip(times["theirs"], times["ours"])]
    return {"setup": setup, "theirs_ms": statistics.median(times["theirs"]), "ours_ms": statistics.median(times["ours"]),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rounds": times, "first_loss": [losses["theirs"][0], losses["ours"][0]],
            "last_loss": [losses["theirs"][-1], losses["ours"][-1]], "check_steps": check_steps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--check-steps", type=int, default=200)
    harness.timing_args(ap, "compat", per="side")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run(s, args.seed, args.rounds, args.min_time, args.check_steps) for s in args.setups]
    table = harness.markdown_table(
        ["codebase", "their layer, ms/step", "nalu_cuda, ms/step", "speed-up (median, range over rounds)",
         "loss after check steps (theirs / ours)"],
        [[r["setup"], f"{r['theirs_ms']:.3f}", f"{r['ours_ms']:.3f}",
          f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})",
          f"{r['last_loss'][0]:.6g} / {r['last_loss'][1]:.6g} after {r['check_steps']}"] for r in rows])
    meta = {"command": harness.command(__file__, argv), **harness.machine("cpu", dtype="float32")}
    harness.write(args.out, meta, rows, table, title="Drop-in for the peers' layers: a training step, theirs vs ours")
    print(harness.meta_lines(meta) + "\n\n" + table)


if __name__ == "__main__":
    main()
