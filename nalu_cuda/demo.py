"""A short demonstration: ``python -m nalu_cuda.demo`` (about half a minute on an idle CPU core; each row
prints as it finishes, with its time).

Trains small models on ``y = a + b`` and ``y = a * b`` from inputs ``(a, b)`` drawn from U[1, 2],
and prints each model's error inside the training range (interpolation, U[1, 2]) and outside it
(extrapolation, U[2, 6]). (``nalu-cuda static`` runs the paper's harder version, with a and b
sums of hidden slices of a 100-dimensional input.)

Every model is trained for several seeds at once as one ensemble (``ensemble=S``): the NAC/NALU
layers run all seeds in one fused call. The table reports the median over seeds of the mean
squared error, and how many seeds extrapolate to within 1%: every one of the 4096 test points drawn
from U[2, 6] predicted within 1% of the true value (the largest relative error |pred - y| / |y| below
0.01).

Expect the MLP to interpolate well and extrapolate badly, NAC+ to extrapolate a + b, NAC* to
extrapolate a * b, and the NALU to be hit or miss: its gate must pick the right path, which it
does for some seeds and not others (Madsen & Johansen 2020 explain why).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from . import NAC, NALU, NACMul

IN_FEATURES = 2


def make_batch(op: str, seeds: int, batch: int, low: float, high: float, gen: torch.Generator):
    x = torch.rand(seeds, batch, IN_FEATURES, generator=gen) * (high - low) + low
    a, b = x[..., 0], x[..., 1]
    y = a + b if op == "add" else a * b
    return x, y.unsqueeze(-1)


class EnsembleMLP(nn.Module):
    """A ReLU MLP per seed, all seeds in one batched matmul: (S, B, in) -> (S, B, 1)."""

    def __init__(self, seeds: int, hidden: int = 32):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(seeds, IN_FEATURES, hidden) / IN_FEATURES**0.5)
        self.b1 = nn.Parameter(torch.zeros(seeds, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(seeds, hidden, 1) / hidden**0.5)
        self.b2 = nn.Parameter(torch.zeros(seeds, 1, 1))

    def forward(self, x):
        return torch.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def models(seeds: int):
    return {
        "MLP (ReLU)": lambda: EnsembleMLP(seeds),
        "NAC+": lambda: NAC(IN_FEATURES, 1, ensemble=seeds),
        "NAC*": lambda: NACMul(IN_FEATURES, 1, ensemble=seeds),
        "NALU": lambda: NALU(IN_FEATURES, 1, ensemble=seeds),
    }


def train_and_eval(make, op: str, seeds: int, steps: int, lr: float, seed: int):
    torch.manual_seed(seed)
    model = make()
    try:  # the fused CPU Adam (torch >= 2.4) takes a third less time per step on these tiny models
        opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x, y = make_batch(op, seeds, 64, 1.0, 2.0, gen)
        # sum over seeds of each seed's mean loss: every member gets its own gradient
        loss = (model(x) - y).square().mean(dim=(1, 2))
        loss = torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    test_gen = torch.Generator().manual_seed(1234)
    out = {}
    with torch.no_grad():
        for name, (low, high) in {"interpolation": (1.0, 2.0), "extrapolation": (2.0, 6.0)}.items():
            x, y = make_batch(op, seeds, 4096, low, high, test_gen)
            pred = model(x)
            mse = (pred - y).square().mean(dim=(1, 2))
            rel = ((pred - y).abs() / y.abs()).amax(dim=(1, 2))
            out[name] = (mse.nanmedian().item(), int((rel < 0.01).sum().item()))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nalu_cuda.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8, help="models trained at once per row (default 8)")
    parser.add_argument("--steps", type=int, default=5000, help="Adam steps per model (default 5000)")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 1:
        parser.error("--seeds and --steps must be >= 1")
    torch.set_num_threads(1)  # tensors of a few hundred numbers: more threads only add overhead
    rows = 2 * len(models(args.seeds))
    print(f"y = a + b and y = a * b from (a, b): {rows} rows, each {args.seeds} seeds (one ensemble) x {args.steps} "
          f"Adam steps on (a, b) ~ U[1,2]; about {_estimate_s(args):.0f} s on an idle CPU core, more on a busy one")
    header = f"{'op':<6}{'model':<15}{'interp MSE':>13}{'extrap MSE':>13}{'extrap within 1%':>18}{'time':>7}"
    print(header)
    print("-" * len(header))
    t0 = time.time()
    for op in ("add", "mul"):
        for name, make in models(args.seeds).items():
            t_row = time.time()
            r = train_and_eval(make, op, args.seeds, args.steps, args.lr, seed=0)
            (mi, _), (me, solved) = r["interpolation"], r["extrapolation"]
            print(f"{'a+b' if op == 'add' else 'a*b':<6}{name:<15}{mi:>13.3g}{me:>13.3g}"
                  f"{f'{solved}/{args.seeds} seeds':>18}{f'{time.time() - t_row:.0f} s':>7}", flush=True)
    print(f"({time.time() - t0:.0f} s in all.) MSE: the median over seeds of each seed's mean squared error, inside\n"
          "the training range (interp, U[1,2]) and outside it (extrap, U[2,6]). Extrap within 1%: the seeds whose\n"
          "largest relative error |pred - y| / |y| over 4096 test points from U[2,6] is below 1%.")
    return 0


# Seconds per Adam step of one row (8 seeds) on an idle core of the 2-core machine of
# benchmarks/RESULTS.md: the MLP about 0.7 ms, NAC+/NAC*/NALU 0.5-0.6 ms (measured with this file).
_STEP_S = 0.6e-3


def _estimate_s(args) -> float:
    return 2 * len(models(1)) * args.steps * _STEP_S * max(1.0, args.seeds / 8)


if __name__ == "__main__":
    raise SystemExit(main())
