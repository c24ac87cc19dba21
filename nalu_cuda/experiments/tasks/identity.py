"""Identity function (Trask et al. 2018, Fig. 1, Appendix A, Table 5).

An MLP of three hidden layers of 8 units learns ``y = x`` for ``x ~ U[-5, 5]`` (Adam, squared
loss, fresh batches). It is then tested on ``[-20, 20]`` (Fig. 1: absolute error against ``x``)
and on ``U[-1000, 1000]`` (Table 5: mean absolute error; predicting 0 everywhere scores 500).
One configuration per nonlinearity (all seeds as one ensemble), plus the same stack built from
NAC+ and from NALU layers.

The paper's claims checked in the report: MLPs learn the identity inside the training range and
fail outside it; sharper nonlinearities (sigmoid, tanh) extrapolate worse than mild ones
(PReLU, ELU).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..argtypes import finite_float, positive_float
from ..params import task_params
from ..costs import MLP_FACTOR
from ..parts import arithmetic_data as ar
from ..parts.arithmetic_models import ACTIVATIONS, StackedNet, check_model, member_generators
from ..parts.training import EvalSet, train_ensemble
from ..parts.uniform_stream import UniformStream
from ..plugin import register_task
from ..registry import Config, ConfigResult, Context, RunOutput, default_summary
from ..report import claim_row, fmt_num, fmt_rate, how_to_read, line_styles, md_table, plt, save_figure
from ..resources import ADAM, FLOAT, Need
from ..seed_blocks import concat, member_curve, total

__all__ = ["EXPERIMENT", "identity_config", "run", "IDENTITY_MODELS"]

MLP_NONLINEARITIES = ("none", "relu", "relu6", "sigmoid", "tanh", "hardtanh", "softsign", "elu", "selu", "prelu",
                      "leaky_relu", "softplus")
IDENTITY_MODELS = MLP_NONLINEARITIES + ("nac", "nalu")
SHARP = ("sigmoid", "tanh")
MILD = ("prelu", "elu")

DEFAULTS: Dict[str, Any] = dict(train_range=[-5.0, 5.0], hidden=[8, 8, 8], lr=1e-2, batch=128, eval_every=500,
                                n_valid=2000, fig_range=[-20.0, 20.0], fig_points=401, table_range=[-1000.0, 1000.0],
                                n_table=10_000, seed_offset=0, data_seed=0, backend="auto")


@dataclass(frozen=True)
class IdentityParams:
    """One configuration's parameters, parsed once from ``Config.params`` (the JSON form, whose
    defaults are :data:`DEFAULTS`): ranges as :class:`~..parts.arithmetic_data.Range`."""

    model: str
    train_range: ar.Range
    hidden: Tuple[int, ...]
    lr: float
    batch: int
    eval_every: int
    n_valid: int
    fig_range: Tuple[float, float]
    fig_points: int
    table_range: ar.Range
    n_table: int
    seed_offset: int
    data_seed: int
    backend: str


def identity_config(model: str, seeds: int, steps: int, **params) -> Config:
    key = str(model).strip().lower().replace("-", "_")
    key = {"linear": "none", "identity": "none"}.get(key, key)
    if key not in IDENTITY_MODELS:
        raise ValueError(f"unknown identity model {model!r}; choose from {', '.join(IDENTITY_MODELS)}")
    if seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {seeds}")
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown identity parameters {sorted(unknown)}")
    p = dict(DEFAULTS)
    p.update({k: v for k, v in params.items() if v is not None})
    lo, hi = p["train_range"]
    if not hi > lo:
        raise ValueError(f"empty training range [{lo}, {hi}]")
    p["model"] = key
    return Config("identity", key, int(seeds), int(steps), p)


def _net(model: str, sizes: Sequence[int], E: int, backend: str) -> StackedNet:
    if model in ("nac", "nalu"):
        return StackedNet(model, sizes, ensemble=E, backend=backend)
    return StackedNet("linear" if model == "none" else check_model(model, ACTIVATIONS), sizes, ensemble=E)


def run(cfg: Config, ctx: Context) -> RunOutput:
    p = task_params(IdentityParams, cfg, DEFAULTS)
    S = cfg.seeds
    seeds = [p.seed_offset + s for s in range(S)]
    dev = torch.device(ctx.device)
    sizes = [1] + list(p.hidden) + [1]
    model = _net(p.model, sizes, S, p.backend)
    model.reset_parameters(member_generators(seeds))
    model.to(dev)
    train = p.train_range
    stream = UniformStream(seeds, (p.batch, 1), train, chunk=64, prefetch=True)

    def batch_fn(step: int):
        x = stream.next().to(dev)
        return x, x

    def fixed(name: str, x: torch.Tensor) -> EvalSet:
        x = x.float().reshape(-1, 1)
        return EvalSet(name, x.to(dev), x.unsqueeze(0).expand(S, *x.shape).contiguous().to(dev))

    rng = np.random.default_rng(ar.seed_for(p.data_seed, "identity-valid"))
    val = fixed("valid", torch.from_numpy(train.sample(rng, (p.n_valid,))))
    grid = torch.linspace(p.fig_range[0], p.fig_range[1], p.fig_points, dtype=torch.float64)
    fig = fixed("fig", grid)
    try:
        res = train_ensemble(model, S, batch_fn, cfg.steps, val, [fig], lr=p.lr, eval_every=p.eval_every,
                             ctx=ctx, desc=f"identity {cfg.name}",
                             stream_state=(stream.state_dict, stream.load_state_dict))
    finally:
        stream.close()
    model.load_state_dict(res.best_state)
    model.eval()
    with torch.no_grad():
        yf = model(fig.x.unsqueeze(0).expand(S, *fig.x.shape).contiguous()).double().cpu()[..., 0]  # (S, P)
        abs_err = (yf - grid.unsqueeze(0)).abs()
        rng = np.random.default_rng(ar.seed_for(p.data_seed, "identity-table"))
        xt = torch.from_numpy(p.table_range.sample(rng, (p.n_table,))).float().reshape(-1, 1)
        yt = model(xt.unsqueeze(0).expand(S, *xt.shape).contiguous().to(dev)).double().cpu()[..., 0]
        mae_table = (yt - xt.double()[:, 0].unsqueeze(0)).abs().mean(1)
        xi = val.x.double().cpu()[:, 0]
        yi = model(val.x.unsqueeze(0).expand(S, *val.x.shape).contiguous()).double().cpu()[..., 0]
        mae_interp = (yi - xi.unsqueeze(0)).abs().mean(1)
    inside = (grid >= train.lo) & (grid <= train.hi)
    records = []
    for k in range(S):
        records.append({
            "seed": seeds[k], "model": p.model, "diverged": bool(res.diverged[k]), "best_step": int(res.best_step[k]),
            "interp_mae": float(mae_interp[k]), "fig_mae": float(abs_err[k].mean()),
            "fig_mae_outside": float(abs_err[k][~inside].mean()), "table_mae": float(mae_table[k]),
            "interp_mse": float(res.best_val[k]), "extrap_mse": float((abs_err[k] ** 2).mean()),
            "final_train_loss": float(res.final_loss[k]),
        })
    fig_err = abs_err[:, ::2]
    extra = {"fig_x": grid[::2].tolist(), "fig_abs_err_mean": mean_abs_error_curve(fig_err, res.diverged).tolist(),
             "fig_abs_err": fig_err.tolist(), "train_wall_s": res.wall_s}
    return RunOutput(records, extra)


def mean_abs_error_curve(abs_err: torch.Tensor, diverged: torch.Tensor) -> torch.Tensor:
    """Fig. 1's curve: the mean over the members that did not diverge of ``abs_err`` ``(S, P)`` (NaN
    where every member diverged). ``fig_abs_err`` keeps every member's row, from which
    :mod:`..seed_blocks` merges the curve of blocks of seeds."""
    ok = ~diverged
    return abs_err[ok].mean(0) if bool(ok.any()) else torch.full_like(abs_err[0], math.nan)


def summarize(cfg: Config, records: List[Dict[str, Any]], extra: Dict[str, Any]) -> Dict[str, Any]:
    s = default_summary(cfg, records)
    for k in ("hidden", "n_valid", "fig_points", "n_table", "seed_offset", "data_seed", "fig_range"):
        s.pop(k, None)
    for key in ("interp_mae", "fig_mae", "fig_mae_outside", "table_mae"):
        vals = [r[key] for r in records if not r["diverged"] and math.isfinite(r[key])]
        s[f"{key}_mean"] = float(np.mean(vals)) if vals else None
        s[f"{key}_median"] = float(np.median(vals)) if vals else None
    return s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", nargs="+", default=["all"], metavar="NAME",
                        help=f"nonlinearities and units: {', '.join(IDENTITY_MODELS)}, or 'all' (default)")
    parser.add_argument("--lr", type=positive_float, default=DEFAULTS["lr"], help="Adam learning rate (default: 1e-2)")
    parser.add_argument("--train-range", nargs=2, type=finite_float, default=DEFAULTS["train_range"],
                        metavar=("LO", "HI"),
                        help="training range (default: -5 5)")


def configs(args: argparse.Namespace) -> List[Config]:
    models = list(IDENTITY_MODELS) if [m.lower() for m in args.model] == ["all"] else args.model
    seeds = BUDGETS["quick"]["seeds"] if args.seeds is None else args.seeds  # the command's default: quick
    steps = BUDGETS["quick"]["steps"] if args.steps is None else args.steps
    return [identity_config(m, seeds, steps, lr=args.lr, train_range=list(args.train_range),
                            eval_every=min(DEFAULTS["eval_every"], steps)) for m in models]


# Seeds and steps per configuration of each profile; the command's defaults are the quick profile's.
# decisive: the published budget itself (every claim here is then final), which a CPU affords (about an
# hour of one core for all fourteen models: `nalu-cuda list --profile decisive`).
BUDGETS: Dict[str, Dict[str, int]] = {"quick": {"seeds": 8, "steps": 3000}, "decisive": {"seeds": 100, "steps": 50_000},
                                      "paper": {"seeds": 100, "steps": 50_000}}
PROFILES = tuple(BUDGETS)


def profile_configs(profile: str) -> List[Config]:
    if profile not in BUDGETS:
        raise ValueError(f"unknown profile {profile!r}")
    return [identity_config(m, BUDGETS[profile]["seeds"], BUDGETS[profile]["steps"]) for m in IDENTITY_MODELS]


# An MLP *fails outside* the training range when its Table-5 MAE is at least this fraction of the mean
# |x| of the Table-5 range (500 on U[-1000, 1000], so an MAE of 25); a model within it computes the
# identity to a few percent (PReLU's 0.6% of the mean |x| is no failure).
FAIL_REL_MAE = 0.05
# An MLP *learns* y = x inside the training range when its MAE there is below this (5% of the mean
# |x| of U[-5, 5]).
LEARN_MAE = 0.125
# Bounded nonlinearities: the network's output tends to a constant as |x| grows, so it cannot follow
# y = x far outside its training range, whatever the training.
BOUNDED = ("sigmoid", "tanh", "hardtanh", "softsign")


def mean_abs(lo: float, hi: float) -> float:
    """The mean |x| of U[lo, hi]."""
    if lo >= 0 or hi <= 0:
        return abs(lo + hi) / 2
    return (lo * lo + hi * hi) / (2 * (hi - lo))


def report_section(results: Sequence[ConfigResult], out_dir: str) -> str:
    out = ["## Identity function (Trask et al. Fig. 1 and Table 5)", ""]
    if not results:
        return "\n".join(out)
    p0 = results[0].config.params
    lo, hi = p0["table_range"]
    scale = mean_abs(lo, hi)
    out += how_to_read(
        f"every number is a mean absolute error |f(x) - x| (averaged over seeds, diverged seeds left out): inside "
        f"the training range U[{p0['train_range'][0]:g}, {p0['train_range'][1]:g}], on the part of the Fig. 1 grid "
        f"[{p0['fig_range'][0]:g}, {p0['fig_range'][1]:g}] outside it, and on U[{lo:g}, {hi:g}] (the paper's "
        f"Table 5 metric, whose published values are not available here). *Relative* is the Table-5 MAE over the "
        f"mean |x| of that range ({fmt_num(scale)}): predicting 0 everywhere scores 100%. An MLP *fails outside* at a "
        f"relative MAE of {100 * FAIL_REL_MAE:g}% or more: below it the network computes the identity to a few "
        "percent, which is no failure to extrapolate.")
    rows = []
    for r in results:
        s = r.summary
        t = s.get("table_mae_mean")
        rows.append([r.config.params["model"], r.config.seeds, r.config.steps, fmt_num(s.get("interp_mae_mean")),
                     fmt_num(s.get("fig_mae_outside_mean")), fmt_num(t),
                     "-" if t is None else f"{100 * t / scale:.2g}%", fmt_rate(s, "diverged")])
    rows.append(["(predict 0 everywhere)", "-", "-", "2.5", "-", fmt_num(scale), "100%", "-"])
    out += [md_table(["model", "seeds", "steps", "MAE inside (train range)",
                      f"MAE outside, [{p0['fig_range'][0]:g},{p0['fig_range'][1]:g}]",
                      f"MAE U[{lo:g},{hi:g}] (Table 5)", "Table-5 MAE / mean abs(x)", "diverged"], rows)]
    by = {r.config.params["model"]: r.summary for r in results}
    cfg = {r.config.params["model"]: r.config for r in results}

    def row(claim, rule, evidence, holds, models, **kw):
        return claim_row(claim, rule, evidence, holds, cells=[cfg[m] for m in models], experiment="identity",
                         models=models, **kw)

    def rel(m) -> float:
        v = by[m].get("table_mae_mean")
        return math.inf if v is None else v / scale

    claims = []
    mlps = [m for m in MLP_NONLINEARITIES if m in by and m != "none"]
    if mlps:
        learn = [m for m in mlps if (by[m].get("interp_mae_mean") if by[m].get("interp_mae_mean") is not None
                                     else math.inf) < LEARN_MAE]
        fail = [m for m in mlps if rel(m) >= FAIL_REL_MAE]
        ok = len(fail) == len(mlps) and len(learn) == len(mlps)
        extrapolates = [m for m in learn if m not in fail]
        ev = (f"learn inside: {len(learn)}/{len(mlps)}; fail outside: {len(fail)}/{len(mlps)}"
              + (f" (extrapolating: {', '.join(f'{m} {100 * rel(m):.2g}%' for m in extrapolates)})"
                 if extrapolates else "")
              + (f" (not learning inside: {', '.join(sorted(set(mlps) - set(learn)))})" if len(learn) < len(mlps) else ""))
        claims.append(row("MLPs learn y = x inside the training range and fail outside it",
                          f"every nonlinear MLP: MAE inside < {LEARN_MAE:g} and Table-5 MAE >= "
                          f"{100 * FAIL_REL_MAE:g}% of the mean abs(x) ({fmt_num(FAIL_REL_MAE * scale)})", ev, ok, mlps,
                          # final where an MLP learned and extrapolated anyway; otherwise more training could change it
                          budget_bound=not extrapolates,
                          structural=("every MLP here is built from a bounded nonlinearity, so its output tends to a "
                                      "constant as |x| grows" if ok and set(mlps) <= set(BOUNDED) else None)))
    sharp = [m for m in SHARP if m in by and by[m].get("table_mae_mean") is not None]
    mild = [m for m in MILD if m in by and by[m].get("table_mae_mean") is not None]
    if sharp and mild:
        ok = min(by[m]["table_mae_mean"] for m in sharp) > max(by[m]["table_mae_mean"] for m in mild)
        claims.append(row("Sharper nonlinearities (sigmoid, tanh) extrapolate worse than mild ones (PReLU, ELU)",
                          "min Table-5 MAE of sigmoid, tanh > max of PReLU, ELU",
                          ", ".join(f"{m}: {fmt_num(by[m].get('table_mae_mean'))}" for m in SHARP + MILD if m in by),
                          ok, sharp + mild))
    for unit in ("nac", "nalu"):
        if unit in by:
            s = by[unit]
            ok = (s.get("table_mae_mean") if s.get("table_mae_mean") is not None else math.inf) < 1.0
            claims.append(row(f"{unit.upper()} stack represents the identity and extrapolates",
                              f"Table-5 MAE < 1 ({fmt_num(100 / scale)}% of the mean abs(x))",
                              f"Table-5 MAE {fmt_num(s.get('table_mae_mean'))}, diverged {fmt_rate(s, 'diverged')}",
                              ok, [unit]))
    if claims:
        out += ["### The paper's claims, checked", "",
                md_table(["claim", "rule applied here", "our evidence", "verdict"], claims)]
    plot = _plot_fig1(results, out_dir)
    if plot:
        out += ["### Fig. 1: absolute error of the learned identity", "", f"![identity]({plot})", "",
                "Mean over seeds of |f(x) - x|; the shaded band is the training range; the y axis is clipped "
                "at 25 (the NALU's error spikes near x = 0, where its log path sees log(|x| + eps)).", ""]
    return "\n".join(out)


def _plot_fig1(results: Sequence[ConfigResult], out_dir: str) -> Optional[str]:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8.5, 5.0))
    drawn = [r for r in results if r.extra.get("fig_x")]
    if not drawn:
        pyplot.close(fig)
        return None
    for r, st in zip(drawn, line_styles(len(drawn))):
        xs, ys = r.extra["fig_x"], r.extra["fig_abs_err_mean"]
        model = r.config.params["model"]
        unit = model in ("nac", "nalu")
        ax.plot(xs, [math.nan if y is None else y for y in ys], lw=1.8 if unit else 1.1, ms=4,
                markevery=max(1, len(xs) // 12), label=model.upper() + " stack" if unit else f"MLP, {model}",
                **{**st, "ls": "--" if unit else "-"})
    lo, hi = results[0].config.params["train_range"]
    ax.axvspan(lo, hi, color="grey", alpha=0.15, label="training range")
    ax.set_xlabel("x")
    ax.set_ylabel("mean absolute error |f(x) - x| over seeds")
    ax.set_ylim(0, 25)  # NALU's log path spikes near x = 0 (|x| + eps -> eps): clipped
    ax.set_title("Learned identity y = x: error per model (MLPs 3 x 8 hidden, one per nonlinearity; "
                 "NAC / NALU stacks dashed)", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    return save_figure(fig, out_dir, "identity_fig1.png")


def memory_needs(cfg: Config) -> List[Need]:
    """The dominant tensors of a run (checked before it starts: :mod:`..resources`)."""
    p = task_params(IdentityParams, cfg, DEFAULTS)
    S, sizes = float(cfg.seeds), [1] + list(p.hidden) + [1]
    return [Need("the evaluation sets' per-seed targets and outputs", "--seeds",
                 S * (p.n_valid + p.fig_points + p.n_table) * FLOAT * 2),
            Need("the prefetched training batches", "--seeds", S * p.batch * FLOAT * 128),
            Need("the models and their optimisers", "--seeds",
                 S * sum(a * b for a, b in zip(sizes, sizes[1:])) * FLOAT * ADAM)]


EXPERIMENT = register_task(__name__, name="identity", order=10,
                           help="identity function: MLPs with many nonlinearities vs NAC/NALU on y = x "
                                "(Fig. 1, Table 5)",
                           merges={"train_wall_s": total, "fig_abs_err": concat},
                           derived_merges={"fig_abs_err_mean": ("fig_abs_err", member_curve(mean_abs_error_curve))},
                           cost_factor=1.0, model_costs={a.replace("_", "-"): MLP_FACTOR for a in ACTIVATIONS})
