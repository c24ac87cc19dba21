"""Recurrent arithmetic (Trask et al. 2018, Table 1, bottom).

The static task summed over time: ``x_1..x_T`` in R^10, ``a`` and ``b`` the sums of two
overlapping subsets of every ``x_t`` over all steps, target ``op(a, b)``. Training and
interpolation at length 10, extrapolation at length 1000 (same input range, far larger sums).

Models (:class:`~nalu_cuda.experiments.parts.arithmetic_models.RecurrentNet`): a recurrent NAC/NALU cell over
``concat(x_t, h_{t-1})`` (hidden size 2, learned initial state) with a second NAC/NALU on the final
state, "two stacked" units as in the paper; LSTM and GRU baselines with a linear read-out.

Success uses the same idea as Madsen & Johansen's static criterion: the extrapolation MSE at the
best-validation step is below that of an epsilon-perfect recurrent accumulator
(:func:`~nalu_cuda.experiments.parts.arithmetic_data.recurrent_mse_threshold`; no published threshold exists
for this task, so there is nothing to compare it with).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..argtypes import finite_float, positive_float, positive_int
from ..params import task_params
from ..parts import arithmetic_data as ar
from ..parts.arithmetic_results import final_errors, member_records, per_op_summaries, run_members
from ..parts.arithmetic_models import (resident_graph, RECURRENT_MODELS, build_recurrent_model, check_model, member_generators,
                                       default_lr, regularizer_schedule, training_hooks)
from ..parts.arithmetic_plots import plot_per_op
from ..parts.training import EvalSet, evaluate_mse, train_ensemble
from ..plugin import register_task
from ..registry import Config, ConfigResult, Context, RunOutput
from ..report import claim_row, fmt_num, fmt_rate, fmt_ratio, how_to_read, md_table
from ..resources import ADAM, DOUBLE, FLOAT, Need
from ..seed_blocks import median_curve, total
from .static_report import extrap_ratio

__all__ = ["EXPERIMENT", "recurrent_config", "RecurrentParams", "run"]

DEFAULTS: Dict[str, Any] = dict(
    interp=[[1.0, 2.0]], extrap=[[1.0, 2.0]], input_size=10, subset_ratio=0.25, overlap_ratio=0.5, hidden=2,
    rnn_hidden=16, train_length=10, extrap_length=1000, lr=1e-3, batch=128, eval_every=1000, n_valid=2000,
    n_test=2000, n_extrap=1000, baseline_models=50, seed_offset=0, data_seed=0, backend="auto", eps=1e-7,
    threshold_samples=5000, clip=None, curve_lengths=[10, 30, 100, 300, 1000],
)


@dataclass(frozen=True)
class RecurrentParams(ar.TaskParams):
    """One configuration's parameters, parsed once from ``Config.params`` (defaults :data:`DEFAULTS`)."""

    rnn_hidden: int
    train_length: int
    extrap_length: int
    n_extrap: int
    clip: Optional[float]
    curve_lengths: Tuple[int, ...]


    @property
    def cell_hidden(self) -> int:
        """The recurrent layer's size: ``rnn_hidden`` for the LSTM/GRU baselines, else ``hidden``."""
        return self.rnn_hidden if self.model in ("lstm", "gru") else self.hidden


def recurrent_config(model: str, ops: Sequence[str], seeds: int, steps: int, *, name: Optional[str] = None,
                     **params) -> Config:
    model = check_model(model, RECURRENT_MODELS)
    ops = [ar.canonical_op(o) for o in ops]
    if len(set(ops)) != len(ops):
        raise ValueError(f"operations repeat: {ops}")
    unknown = set(params) - set(DEFAULTS) - set(ar.REG_DEFAULTS) - set(ar.STEP_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown recurrent parameters {sorted(unknown)}")
    if seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {seeds}")
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    p = dict(DEFAULTS)
    p.update({k: v for k, v in params.items() if v is not None})
    if params.get("lr") is None:
        p["lr"] = default_lr(model, DEFAULTS["lr"])
    interp, extrap = ar.as_range(p["interp"], "interpolation range"), ar.as_range(p["extrap"], "extrapolation range")
    if p["extrap_length"] <= p["train_length"] and interp.contains(extrap):
        raise ValueError(f"extrapolation (range {extrap}, length {p['extrap_length']}) lies inside training "
                         f"(range {interp}, length {p['train_length']}): make the sequences longer or the range wider")
    if "root" in ops and interp.lo < 0:
        raise ValueError("sqrt(a) needs a >= 0: the training range must be non-negative for op 'root'")
    for k in ("batch", "eval_every", "n_valid", "n_test", "n_extrap", "train_length", "extrap_length", "hidden",
              "rnn_hidden", "baseline_models"):
        if int(p[k]) < 1:
            raise ValueError(f"{k} must be at least 1, got {p[k]}")
    size, _ = ar.subset_sizes(p["input_size"], p["subset_ratio"], p["overlap_ratio"])
    ar.check_targets(ops, interp, size * int(p["train_length"]), "--interp with --train-length", training=True)
    ar.check_targets(ops, extrap, size * int(p["extrap_length"]), "--extrap with --extrap-length")
    p["interp"], p["extrap"] = interp.to_list(), extrap.to_list()
    p["model"], p["ops"] = model, ops
    ar.reg_params(p, regularizer_schedule)
    ar.step_params(p, "recurrent")
    if name is None:
        name = f"{model}-{'+'.join(ops) if len(ops) < 6 else 'allops'}-T{p['train_length']}-to-T{p['extrap_length']}"
    return Config("recurrent", name, int(seeds), int(steps), p)


def _shared_targets(x: torch.Tensor, masks: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """``x`` ``(N, T, I)`` shared by all seeds -> ``(len(ops) * S, N, 1)``."""
    sums = x.double().sum(-2)  # (N, I)
    ab = torch.einsum("ni,sij->snj", sums, masks.double())
    return torch.cat([ar.apply_op(op, ab[..., 0], ab[..., 1]) for op in ops], 0).unsqueeze(-1).float()


def run(cfg: Config, ctx: Context) -> RunOutput:
    p = task_params(RecurrentParams, cfg, ar.task_defaults(DEFAULTS))
    ops, S, seeds, member_seeds, E = run_members(p, cfg)
    I, T, L = p.input_size, p.train_length, p.extrap_length
    interp, extrap = p.interp, p.extrap
    dev = torch.device(ctx.device)
    masks = torch.stack([ar.subset_layout(s, I, p.subset_ratio, p.overlap_ratio).mask() for s in seeds])
    hidden = p.cell_hidden
    model = build_recurrent_model(p.model, I, hidden, ensemble=E, backend=p.backend, eps=p.eps)
    model.reset_parameters(member_generators(member_seeds))
    model.to(dev)
    counter = p.stream == "counter"
    # the counter stream on CUDA: the resident step; on the CPU the step of the host's loop (the
    # native step on batch_fn's batches, the stream's draw of each step)
    resident = counter and dev.type == "cuda"
    stream = ar.training_stream(p.stream, seeds, (p.batch, T, I), interp, dev, masks, ops, chunk=8)

    def batch_fn(step):
        x, t = stream.draw(step) if counter else stream.next()
        x, t = x.to(dev), t.to(dev)
        return (x if len(ops) == 1 else x.repeat(len(ops), 1, 1, 1)), t

    if not counter:
        batch_fn.uniform_stream = stream  # the native step draws the stream's batches in-call (parts/native_step.py)

    def fixed(name: str, rng_range: ar.Range, n: int, length: int) -> EvalSet:
        rng = np.random.default_rng(ar.seed_for(p.data_seed, f"rec-{name}"))
        x = torch.from_numpy(rng_range.sample(rng, (n, length, I))).float()
        return EvalSet(name, x.to(dev), _shared_targets(x, masks, ops).to(dev), batch=512, shared=True)

    val = fixed("valid", interp, p.n_valid, T)
    test_i = fixed("interp-test", interp, p.n_test, T)
    test_x = fixed("extrap-test", extrap, p.n_extrap, L)
    thresholds = {op: ar.recurrent_mse_threshold(op, extrap, L, I, p.subset_ratio, p.overlap_ratio,
                                                 samples=p.threshold_samples) for op in ops}
    thr = torch.tensor([thresholds[op] for op in ops for _ in seeds], dtype=torch.float64)
    hooks = training_hooks(model, p.reg, member_seeds)
    try:
        res = train_ensemble(model, E, batch_fn, cfg.steps, val, [test_x], lr=p.lr, eval_every=p.eval_every,
                             threshold=thr, solved_on=test_x.name, ctx=ctx, desc=f"recurrent {cfg.name}",
                             clip=p.clip, stream_state=None if counter else (stream.state_dict, stream.load_state_dict),
                             resident=resident, graph=resident_graph(p, dev, hooks), native=p.native, **hooks)
    finally:
        stream.close()
    errors = final_errors(model, res, test_i, test_x, E)
    base = _baseline(p, ops, test_i, test_x, dev)
    curve = _length_curve(model, p, ops, masks, interp, S, dev, res.diverged)
    records = member_records(p.model, ops, member_seeds, res, errors, base, thresholds)
    extra = {"thresholds": thresholds, "baseline_mse": {op: {"interp": base[op][0], "extrap": base[op][1]} for op in ops},
             "length_curve": curve, "train_wall_s": res.wall_s,
             "step_path": res.step_path}  # which step trained (EnsembleTraining.step_path)
    return RunOutput(records, extra)


BASELINE_ROWS = 200


@torch.no_grad()
def _baseline(p: RecurrentParams, ops, test_i: EvalSet, test_x: EvalSet, dev) -> Dict[str, tuple]:
    """Mean MSE of randomly initialised models (own layouts), per operation: the paper's 100."""
    R = p.baseline_models
    bseeds = [10_000_000 + r for r in range(R)]
    I = p.input_size
    hidden = p.cell_hidden
    model = build_recurrent_model(p.model, I, hidden, ensemble=R, backend=p.backend, eps=p.eps)
    model.reset_parameters(member_generators(bseeds))
    model.to(dev).eval()
    masks = torch.stack([ar.subset_layout(s, I, p.subset_ratio, p.overlap_ratio).mask() for s in bseeds])
    out = {op: [] for op in ops}
    for ev in (test_i, test_x):
        # The mean of random models is stable on a few hundred samples; long sequences are costly.
        x = ev.x[:BASELINE_ROWS]
        ys = torch.cat([model(x[s:s + 500]).double().cpu() for s in range(0, x.shape[0], 500)], 1)
        t = _shared_targets(x.cpu(), masks, ops).double()
        for j, op in enumerate(ops):
            mse = ((ys - t[j * R:(j + 1) * R]) ** 2).mean(dim=(1, 2))
            mse = mse[torch.isfinite(mse)]
            out[op].append(float(mse.mean()) if mse.numel() else math.nan)
    return {op: tuple(v) for op, v in out.items()}


@torch.no_grad()
def _length_curve(model, p: RecurrentParams, ops, masks, interp, S, dev, diverged, n: int = 500) -> Dict[str, Any]:
    E = len(ops) * S
    lengths = list(p.curve_lengths)
    med: Dict[str, List[Optional[float]]] = {op: [] for op in ops}
    members = []  # every member's MSE, from which seed_blocks merges the curve of blocks of seeds
    for length in lengths:
        rng = np.random.default_rng(ar.seed_for(p.data_seed, f"rec-curve-{length}"))
        x = torch.from_numpy(interp.sample(rng, (n, length, p.input_size))).float()
        mse = evaluate_mse(model, EvalSet("curve", x.to(dev), _shared_targets(x, masks, ops).to(dev), batch=500,
                                          shared=True), E)
        members.append(mse.tolist())
        for j, op in enumerate(ops):
            m = mse[j * S:(j + 1) * S][~diverged[j * S:(j + 1) * S]]
            m = m[torch.isfinite(m)]
            med[op].append(float(m.median()) if m.numel() else None)
    return {"lengths": lengths, "median_mse": med, "member_mse": members}


# ------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ar.add_model_op_arguments(parser, RECURRENT_MODELS)
    parser.add_argument("--interp", nargs="+", type=finite_float, default=[1.0, 2.0], metavar="X",
                        help="input range for training and both tests: LO HI [LO HI ...] (default: 1 2)")
    parser.add_argument("--extrap", nargs="+", type=finite_float, default=None, metavar="X",
                        help="input range of the extrapolation test (default: the --interp range)")
    parser.add_argument("--train-length", type=positive_int, default=DEFAULTS["train_length"], help="default: 10")
    parser.add_argument("--extrap-length", type=positive_int, default=DEFAULTS["extrap_length"], help="default: 1000")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help="learning rate (default: 1e-3 for Adam; iNALU: 1e-2, its published RMSProp)")
    parser.add_argument("--eval-every", type=positive_int, default=DEFAULTS["eval_every"], help="default: 1000")
    parser.add_argument("--clip", type=positive_float, default=None,
                        help="per-member gradient-norm clipping (default: none)")
    ar.add_reg_arguments(parser)
    ar.add_step_arguments(parser)
    parser.add_argument("--backend", choices=("auto", "fused", "reference"), default="auto")


def configs(args: argparse.Namespace) -> List[Config]:
    ops = ar.chosen_ops(args)
    seeds = 8 if args.seeds is None else args.seeds
    steps = 20_000 if args.steps is None else args.steps
    interp = ar.parse_range(args.interp, "--interp").to_list()
    extrap = interp if args.extrap is None else ar.parse_range(args.extrap, "--extrap").to_list()
    return [recurrent_config(m, ops, seeds, steps, interp=interp, extrap=extrap, train_length=args.train_length,
                             extrap_length=args.extrap_length, lr=args.lr, eval_every=min(args.eval_every, steps),
                             clip=args.clip, backend=args.backend, **ar.reg_step_options(args)) for m in args.model]


PROFILES = ("quick", "decisive", "paper")


def profile_configs(profile: str) -> List[Config]:
    if profile == "quick":
        q = dict(eval_every=1000, n_valid=1000, n_test=1000, n_extrap=300, baseline_models=20,
                 threshold_samples=3000, lr=1e-2)
        return [
            recurrent_config("nac", ["add", "sub"], 8, 5000, **q),
            recurrent_config("nalu", ["add", "mul", "div"], 8, 3000, **q),
            recurrent_config("lstm", ["add", "sub"], 8, 2000, **q),
        ]
    if profile == "decisive":
        # The published budget the verdicts compare with (the paper profile's 100 seeds x 5e5 steps), on the
        # cells the claim "recurrent NAC/NALU extrapolate + and -" needs, at lr 1e-2: at 1e5 steps it gave the
        # NAC 7/8 on a - b and 0/8 on a + b (lr 1e-3: fewer), so the budget, not the rate, is what is missing.
        # Estimated with `nalu-cuda list --profile decisive`; continued across sittings with --resume.
        d = dict(eval_every=5000, n_valid=1000, n_test=1000, n_extrap=300, baseline_models=20,
                 threshold_samples=3000, lr=1e-2)
        return [recurrent_config(m, ["add", "sub"], 100, 500_000, name=f"decisive-{m}-add+sub", **d)
                for m in ("nac", "nalu")]
    if profile == "paper":
        return [recurrent_config(m, list(ar.OPS), 100, 500_000) for m in
                ("nac", "nac-mul", "nalu", "nalu-separate", "nalu-indgate", "nalu-separate-indgate", "lstm", "gru")]
    raise ValueError(f"unknown profile {profile!r}")


def summarize(cfg: Config, records: List[Dict[str, Any]], extra: Dict[str, Any]) -> List[Dict[str, Any]]:
    return per_op_summaries(cfg, records, extra, ("ops", "baseline_models", "threshold_samples", "n_valid", "n_test",
                                                  "n_extrap", "data_seed", "seed_offset", "curve_lengths"))


def report_section(results: Sequence[ConfigResult], out_dir: str) -> str:
    out = ["## Recurrent arithmetic (Trask et al. Table 1, bottom)", ""]
    out += how_to_read(
        "*Success*: the extrapolation MSE (length 1000) of a seed's best-validation model below that of an "
        "epsilon-perfect recurrent accumulator (eps = 1e-5; no published threshold exists for this task). The primary "
        "extrapolation figure is **extrap. MSE / threshold** (median over seeds; below 1 = solved, above 1 = failed by "
        "that factor). *interp. error* is the paper's normalised error at the training length (100 = randomly "
        "initialised models of the same architecture, 0 = perfect): whether the model fit at all. The recurrent cell "
        "must learn recurrent weights of exactly 1: an error of 1e-3 compounds over 1000 steps, so short budgets show "
        "interpolation long before extrapolation. The published budget the verdicts compare with is the paper "
        "profile's (the paper states none for this task).")
    summ = [s for r in results for s in (r.summaries or [r.summary])]
    rows = [[s["model"], ar.OP_SYMBOLS[s["op"]],
             f"T={s['train_length']} -> T={s['extrap_length']}, {s['interp']}, lr {s.get('lr', 1e-3):g}",
             f"{s['seeds']} x {s['steps']:g}", fmt_rate(s), fmt_num(s.get("solved_at_median")),
             fmt_rate(s, "diverged"), fmt_ratio(extrap_ratio(s)), fmt_num(s.get("threshold")),
             fmt_num(s.get("interp_error_median"))] for s in summ]
    out += [md_table(["model", "op", "setting", "seeds x steps", "success [95% CI]", "solved at (median)",
                      "diverged", "extrap. MSE / threshold", "threshold", "interp. error (normalised)"], rows)]

    def row(claim, rule, evidence, holds, cells, **kw):
        return claim_row(claim, rule, evidence, holds, cells=cells, experiment="recurrent",
                         models=[c["model"] for c in cells], **kw)

    claims = []
    arith = [s for s in summ if s["model"] not in ("lstm", "gru") and s["op"] in ("add", "sub")]
    if arith:
        ok = all((s.get("success_rate") or 0) >= 0.5 for s in arith)
        claims.append(row("Recurrent NAC/NALU extrapolate addition/subtraction to length 1000",
                          "success >= 50% for every NAC/NALU cell on + and -",
                          "; ".join(f"{s['model']} {ar.OP_SYMBOLS[s['op']]}: {fmt_rate(s)}" for s in arith), ok, arith))
    base = [s for s in summ if s["model"] in ("lstm", "gru")]
    if base:
        ok = all((s.get("success_rate") or 0) == 0 for s in base)
        claims.append(row("Recurrent baselines (LSTM/GRU) fail to extrapolate", "0% success",
                          "; ".join(f"{s['model']} {ar.OP_SYMBOLS[s['op']]}: {fmt_rate(s)}, extrap. MSE / threshold "
                                    f"{fmt_num(extrap_ratio(s))}" for s in base), ok, base, negative=True))
    div = [s for s in summ if s["op"] == "div"]
    if div:
        ok = all((s.get("success_rate") or 0) == 0 for s in div)
        claims.append(row("No model extrapolates division", "0% success on a / b for every model",
                          "; ".join(f"{s['model']}: {fmt_rate(s)}" for s in div), ok, div, negative=True))
    if claims:
        out += ["### The paper's claims, checked", "", md_table(["claim", "rule applied here", "our evidence", "verdict"], claims)]
    plot = _plot_lengths(results, out_dir)
    if plot:
        out += ["### Error against sequence length", "", f"![MSE against sequence length]({plot})", "",
                "Median MSE over (non-diverged) seeds of the selected models; training length 10. For a / b the "
                "raw MSE falls with length for any model that predicts a constant: the ratio of two long sums "
                "concentrates around its mean; the threshold accounts for that.", ""]
    return "\n".join(out)


def _plot_lengths(results, out_dir) -> Optional[str]:
    curves = [(r.config.params["model"], op, r.extra["length_curve"]["lengths"], med)
              for r in results if r.extra.get("length_curve") for op, med in r.extra["length_curve"]["median_mse"].items()]
    hlines = {}
    for r in results:  # the success threshold, at the extrapolation length it is defined for
        L = r.config.params.get("extrap_length", DEFAULTS["extrap_length"])
        for op, thr in (r.extra.get("thresholds") or {}).items():
            hlines.setdefault(op, (thr, L / 1.6, L * 1.6, f"success threshold at length {L}"))
    return plot_per_op(curves, out_dir, "recurrent_error_vs_length.png", "sequence length",
                       ylabel="median MSE over seeds", mark_label="training length", hlines=hlines,
                       mark_x=results[0].config.params.get("train_length", DEFAULTS["train_length"]) if results else None,
                       title="Recurrent task: median MSE of the selected models against the sequence length")


def memory_needs(cfg: Config) -> List[Need]:
    """The dominant tensors of a run (checked before it starts: :mod:`..resources`)."""
    p = task_params(RecurrentParams, cfg, ar.task_defaults(DEFAULTS))
    S, E, I, H = float(cfg.seeds), float(cfg.seeds * len(p.ops)), p.input_size, p.cell_hidden
    T, L, gates = float(p.train_length), float(p.extrap_length), 4 if p.model in ("lstm", "gru") else 1
    return [Need("the evaluation sequences", "--train-length, --extrap-length",
                 ((p.n_valid + p.n_test) * T + p.n_extrap * L) * I * (FLOAT + DOUBLE)),
            Need("the prefetched training batches and their activations", "--train-length, --seeds, --op",
                 S * p.batch * T * I * FLOAT * 16 + E * p.batch * T * (I + gates * H) * FLOAT),
            Need("the model and its optimiser", "--model, --seeds, --op", E * (I + H) * gates * H * FLOAT * ADAM)]


EXPERIMENT = register_task(__name__, name="recurrent", order=30,
                           help="recurrent arithmetic: sums over time steps, train length 10, "
                                "test length 1000 (Table 1)",
                           merges={"train_wall_s": total, "length_curve": median_curve("lengths")},
                           # per member-step (seed x operation) of the native NAC step against the static NAC's:
                           # the decisive NAC cell's last 205,000 steps (100 seeds x 2 ops, T = 10) took 20 min,
                           # 2.9e-5 s against 2.1e-5 (costs.CPU_UNITS_PER_S); the NALU cell 2.2x the NAC's
                           # (benchmarks/cost_factors.py, whole recurrent runs). benchmarks/RESULTS.md section 22.
                           cost_factor=1.4, model_costs={"nalu": 2.2})
