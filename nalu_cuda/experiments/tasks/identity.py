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
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...cli import finite_float, positive_float
from ..parts import arithmetic_data as ar
from ..parts.arithmetic_models import ACTIVATIONS, StackedNet, check_model, member_generators
from ..parts.training import EvalSet, train_ensemble
from ..parts.uniform_stream import UniformStream
from ..plugin import register_task
from ..registry import Config, ConfigResult, Context, RunOutput, default_summary
from ..resources import ADAM, FLOAT, Need

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

    @staticmethod
    def from_params(params: Dict[str, Any]) -> "IdentityParams":
        p = {**DEFAULTS, **params}
        p.update(train_range=ar.as_range(p["train_range"], "training range"), hidden=tuple(p["hidden"]),
                 fig_range=tuple(p["fig_range"]), table_range=ar.as_range(p["table_range"], "table range"))
        return IdentityParams(**{f.name: p[f.name] for f in fields(IdentityParams)})


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
    p = IdentityParams.from_params(cfg.params)
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
    seeds = 8 if args.seeds is None else args.seeds
    steps = 5000 if args.steps is None else args.steps
    return [identity_config(m, seeds, steps, lr=args.lr, train_range=list(args.train_range),
                            eval_every=min(DEFAULTS["eval_every"], steps)) for m in models]


def profile_configs(profile: str) -> List[Config]:
    if profile == "quick":
        return [identity_config(m, 8, 3000) for m in IDENTITY_MODELS]
    if profile == "paper":
        return [identity_config(m, 100, 50_000) for m in IDENTITY_MODELS]
    raise ValueError(f"unknown profile {profile!r}")


def report_section(results: Sequence[ConfigResult], out_dir: str) -> str:
    from ..report import claim_row, fmt_num, fmt_rate, md_table

    out = ["## Identity function (Trask et al. Fig. 1 and Table 5)", ""]
    if not results:
        return "\n".join(out)
    p0 = results[0].config.params
    rows = []
    for r in results:
        s = r.summary
        rows.append([r.config.params["model"], r.config.seeds, r.config.steps, fmt_num(s.get("interp_mae_mean")),
                     fmt_num(s.get("fig_mae_outside_mean")), fmt_num(s.get("table_mae_mean")),
                     fmt_rate(s, "diverged")])
    lo, hi = p0["table_range"]
    rows.append(["(predict 0 everywhere)", "-", "-", "2.5", "-", "500", "-"])
    out += [f"Mean absolute error, averaged over seeds (diverged seeds left out). Training range "
            f"U[{p0['train_range'][0]:g}, {p0['train_range'][1]:g}]; *outside* is the part of the "
            f"[{p0['fig_range'][0]:g}, {p0['fig_range'][1]:g}] grid outside it (Fig. 1); *Table 5* is U[{lo:g}, {hi:g}] "
            "(the paper's Table 5 metric, whose published values are not available here).", "",
            md_table(["model", "seeds", "steps", "MAE inside (train range)", "MAE outside, [-20,20]",
                      "MAE U[-1000,1000] (Table 5)", "diverged"], rows)]
    by = {r.config.params["model"]: r.summary for r in results}
    claims = []
    mlps = [m for m in MLP_NONLINEARITIES if m in by and m != "none"]
    if mlps:
        fail = [m for m in mlps if (by[m].get("table_mae_mean") or 0) > 10 * max(by[m].get("interp_mae_mean") or 0, 0.01)]
        learn = [m for m in mlps if (by[m].get("interp_mae_mean") or 1e9) < 0.25]
        ok = len(fail) == len(mlps) and len(learn) == len(mlps)
        claims.append(claim_row("MLPs learn y = x inside the training range and fail outside it",
                                "every nonlinear MLP: MAE inside < 0.25 and Table-5 MAE > 10x that",
                                f"learn inside: {len(learn)}/{len(mlps)}; fail outside: {len(fail)}/{len(mlps)}"
                                + (f" (not failing: {', '.join(sorted(set(mlps) - set(fail)))})" if len(fail) < len(mlps) else ""),
                                ok))
    sharp = [by[m]["table_mae_mean"] for m in SHARP if m in by and by[m].get("table_mae_mean") is not None]
    mild = [by[m]["table_mae_mean"] for m in MILD if m in by and by[m].get("table_mae_mean") is not None]
    if sharp and mild:
        ok = min(sharp) > max(mild)
        claims.append(claim_row("Sharper nonlinearities (sigmoid, tanh) extrapolate worse than mild ones (PReLU, ELU)",
                                "min Table-5 MAE of sigmoid, tanh > max of PReLU, ELU",
                                ", ".join(f"{m}: {fmt_num(by[m].get('table_mae_mean'))}" for m in SHARP + MILD if m in by),
                                ok))
    for unit in ("nac", "nalu"):
        if unit in by:
            s = by[unit]
            ok = (s.get("table_mae_mean") or 1e9) < 1.0
            claims.append(claim_row(f"{unit.upper()} stack represents the identity and extrapolates",
                                    "Table-5 MAE < 1", f"Table-5 MAE {fmt_num(s.get('table_mae_mean'))}, "
                                    f"diverged {fmt_rate(s, 'diverged')}", ok))
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
    from ..report import plt, save_figure

    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7.5, 4.5))
    n = 0
    for r in results:
        xs, ys = r.extra.get("fig_x"), r.extra.get("fig_abs_err_mean")
        if not xs:
            continue
        style = "--" if r.config.params["model"] in ("nac", "nalu") else "-"
        ax.plot(xs, ys, style, lw=1.2, label=r.config.params["model"])
        n += 1
    if not n:
        pyplot.close(fig)
        return None
    lo, hi = results[0].config.params["train_range"]
    ax.axvspan(lo, hi, color="grey", alpha=0.15)
    ax.set_xlabel("x")
    ax.set_ylabel("mean absolute error")
    ax.set_ylim(0, 25)  # NALU's log path spikes near x = 0 (|x| + eps -> eps): clipped
    ax.set_title("MLPs (3 x 8 hidden) trained on y = x")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, out_dir, "identity_fig1.png")


def memory_needs(cfg: Config) -> List[Need]:
    """The dominant tensors of a run (checked before it starts: :mod:`..resources`)."""
    p = IdentityParams.from_params(cfg.params)
    S, sizes = float(cfg.seeds), [1] + list(p.hidden) + [1]
    return [Need("the evaluation sets' per-seed targets and outputs", "--seeds",
                 S * (p.n_valid + p.fig_points + p.n_table) * FLOAT * 2),
            Need("the prefetched training batches", "--seeds", S * p.batch * FLOAT * 128),
            Need("the models and their optimisers", "--seeds",
                 S * sum(a * b for a, b in zip(sizes, sizes[1:])) * FLOAT * ADAM)]


EXPERIMENT = register_task(__name__, name="identity", order=10,
                           help="identity function: MLPs with many nonlinearities vs NAC/NALU on y = x "
                                "(Fig. 1, Table 5)")
