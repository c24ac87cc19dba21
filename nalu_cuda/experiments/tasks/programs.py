"""Program evaluation (the paper's Fig. 4): read a small program character by character and output
the value it prints.

Tasks (``task``):

* ``add``: plain addition of two integers, ``a=47;b=82;print(a+b)``;
* ``program``: assignments, a conditional, addition and subtraction,
  ``a=47;b=82;c=a-b if a>b else b-a;print(c+a)`` (the two expressions, the comparison and the
  printed expression are drawn at random).

Every generated program is valid Python and prints its target (the tests execute them).
Training integers are drawn from [0, 100); the test uses 3-digit [100, 1000) and 4-digit
[1000, 10000) integers, plus an interpolation test on fresh [0, 100) programs.

Models (``model``): a character embedding, then

* ``lstm``: LSTM, linear read-out of the last state;
* ``ugrnn``: UGRNN (update-gate RNN, the paper's strongest baseline), linear read-out;
* ``nalu``: LSTM with a :class:`nalu_cuda.NALU` read-out of the last state (the NALU-headed model).

All seeds train as one ensemble (Adam, squared loss, fresh batches from a pool of training
programs); the checkpoint kept per seed is the one with the lowest validation loss (held-out
[0, 100) programs). Learning curves of every test domain are recorded for the Fig. 4 plot (mean
over seeds with 2-sigma bands, as in the paper).
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

import nalu_cuda

from ..argtypes import positive_int
from .. import registry
from ..params import task_params
from ..resources import ADAM, FLOAT, Need
from ..parts.layers import EnsembleEmbedding, EnsembleLinear, ensemble_gather
from ..parts.seeding import member_generators
from ..parts.sequence_models import final_states, make_recurrent
from ..parts.training import generator_state, train_ensemble
from ..plugin import (add_backend_argument, add_task_model_arguments, profile_entry, register_task, run_options,
                      run_setting, task_model_configs, task_model_options)
from ..report import (LEARNED_KEPT_RULE, LEARNED_R2, claim_row, figure_lines, fmt_ci, fmt_num, generalisation,
                      generalisation_claim, how_to_read, line_styles, md_table, plt as pyplot, save_figure)
from ..stats import interval_summary

NAME = "programs"
TASKS = ("add", "program")
MODELS = ("lstm", "ugrnn", "nalu")
DOMAINS = {"interp": (0, 100), "3digit": (100, 1000), "4digit": (1000, 10000)}
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz=;+-<>() "
VOCAB = ["<pad>"] + list(CHARS)
CHAR_ID = {c: i for i, c in enumerate(VOCAB) if i > 0}

_EXPRS = ("a+b", "a-b", "b-a")
_PRINTS = ("c", "c+a", "c-b")


def make_program(task: str, rng: random.Random, low: int, high: int) -> Tuple[str, int]:
    """One program with integers drawn uniformly from ``[low, high)``, and the value it prints."""
    a, b = rng.randrange(low, high), rng.randrange(low, high)
    if task == "add":
        return f"a={a};b={b};print(a+b)", a + b
    if task == "program":
        cmp_ = rng.choice("<>")
        e1, e2 = rng.choice(_EXPRS), rng.choice(_EXPRS)
        out = rng.choice(_PRINTS)
        env = {"a": a, "b": b}
        cond = a < b if cmp_ == "<" else a > b
        env["c"] = _eval_expr(e1 if cond else e2, env)
        return f"a={a};b={b};c={e1} if a{cmp_}b else {e2};print({out})", _eval_expr(out, env)
    raise ValueError(f"programs: task must be one of {TASKS}, got {task!r}")


def _eval_expr(expr: str, env: Dict[str, int]) -> int:
    """``x``, ``x+y`` or ``x-y`` over single-letter variables (no ``eval``)."""
    for op in "+-":
        if op in expr:
            x, y = expr.split(op)
            return env[x] + env[y] if op == "+" else env[x] - env[y]
    return env[expr]


def make_programs(task: str, n: int, low: int, high: int, seed: int) -> Tuple[List[str], List[int]]:
    rng = random.Random(seed)
    progs = [make_program(task, rng, low, high) for _ in range(n)]
    return [p for p, _ in progs], [v for _, v in progs]


def encode_programs(texts: Sequence[str]) -> Tuple[Tensor, Tensor]:
    """Character ids ``(N, T)`` (right-padded with 0, ``T`` the longest program) and the valid mask."""
    T = max(len(t) for t in texts)
    ids = torch.zeros(len(texts), T, dtype=torch.long)
    for i, t in enumerate(texts):
        ids[i, :len(t)] = torch.tensor([CHAR_ID[c] for c in t])
    return ids, ids != 0


class ProgramReader(nn.Module):
    """Character embedding -> recurrent layer -> read-out of the last state, ``E`` members."""

    def __init__(self, ensemble: int, model: str, emb: int = 32, hidden: int = 32, backend: str = "auto",
                 out_scale: float = 1.0) -> None:
        super().__init__()
        self.out_scale = float(out_scale)
        if model not in MODELS:
            raise ValueError(f"programs: model must be one of {MODELS}, got {model!r}")
        self.kind = model
        self.embedding = EnsembleEmbedding(len(VOCAB), emb, ensemble=ensemble)
        self.rec = make_recurrent("ugrnn" if model == "ugrnn" else "lstm", ensemble, emb, hidden)
        if model == "nalu":
            self.head = nalu_cuda.NALU(hidden, 1, ensemble=ensemble, backend=backend)
        else:
            self.head = EnsembleLinear(hidden, 1, ensemble=ensemble)

    def reset_parameters(self, seeds: Sequence[int]) -> None:
        self.embedding.reset_parameters(member_generators(seeds, "programs/embedding"))
        self.rec.reset_parameters(member_generators(seeds, "programs/recurrent"))
        self.head.reset_parameters(member_generators(seeds, "programs/head"))

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """``tokens``, ``mask``: ``(E, B, T)`` (the valid characters a prefix of every row) ->
        predictions ``(E, B)``. The recurrent layer projects the embedding table once per character
        (``forward_tokens``) and runs unmasked; the head reads each row's state after its last
        character, which is the final state of the masked run."""
        h = final_states(self.rec.forward_tokens(self.embedding.weight, tokens), mask)
        return self.head(h).squeeze(-1) * self.out_scale


@dataclass(frozen=True)
class ProgramsParams:
    """The parameters of a programs configuration (``Config.params``, typed by :func:`task_params`)."""

    task: str                   # add or program (set by every configuration)
    model: str                  # one of MODELS (set by every configuration)
    batch: int = 32
    lr: float = 0.01
    emb: int = 32
    hidden: int = 32
    out_scale: float = 100.0    # fixed factor on every model's output, the same for all models: the
                                # training range, so that linear read-outs start at the right scale
    clip: float = 100.0
    pool: int = 20000           # training programs generated once; batches are drawn from them
    n_val: int = 200
    n_test: int = 1000          # per test domain at the end
    n_curve: int = 100          # per test domain at every evaluation (learning curves)
    eval_every: int = 50
    data_seed: int = 0


def _metrics(pred: Tensor, y: Tensor) -> Dict[str, Tensor]:
    pred = torch.nan_to_num(pred, nan=float("inf"))
    err = (pred - y).abs()
    mae = err.mean(-1)
    return {"acc": (pred.round() == y).float().mean(-1), "mae": mae, "relerr": mae / y.abs().mean().clamp_min(1e-12)}


def run(config: registry.Config, ctx: registry.Context) -> registry.RunOutput:
    p = task_params(ProgramsParams, config)
    task, kind = p.task, p.model
    device, dtype, backend, seeds = run_setting(config, ctx)
    E = len(seeds)
    ds = p.data_seed
    lo, hi = DOMAINS["interp"]
    tr_text, tr_y = make_programs(task, p.pool, lo, hi, ds * 7919 + 1)
    tr_tok, tr_mask = encode_programs(tr_text)
    tr_tok, tr_mask = tr_tok.to(device), tr_mask.to(device)
    tr_y = torch.tensor(tr_y, dtype=dtype, device=device)
    va_text, va_y = make_programs(task, p.n_val, lo, hi, ds * 7919 + 2)

    def as_set(texts, ys):
        tok, mask = encode_programs(texts)
        return (tok.to(device), mask.to(device), torch.tensor(ys, dtype=dtype, device=device))

    val = as_set(va_text, va_y)
    curve_sets = {d: as_set(*make_programs(task, p.n_curve, a, b, ds * 7919 + 10 + i))
                  for i, (d, (a, b)) in enumerate(DOMAINS.items())}
    test_sets = {d: as_set(*make_programs(task, p.n_test, a, b, ds * 7919 + 20 + i))
                 for i, (d, (a, b)) in enumerate(DOMAINS.items())}

    model = ProgramReader(E, kind, p.emb, p.hidden, backend=backend, out_scale=p.out_scale)
    model.reset_parameters(seeds)
    model.to(device=device, dtype=dtype)
    gens = member_generators(seeds, "programs/data")
    B = p.batch

    def expand(t: Tensor) -> Tensor:
        return t.unsqueeze(0).expand(E, *t.shape)

    def train_step(step: int) -> Tensor:
        idx = torch.stack([torch.randint(len(tr_y), (B,), generator=g) for g in gens]).to(device)  # (E, B)
        tok = ensemble_gather(expand(tr_tok), idx)
        mask = ensemble_gather(expand(tr_mask), idx)
        T = int(mask.sum(-1).max())  # trim the padding this batch does not need
        pred = model(tok[..., :T], mask[..., :T])
        return ((pred - tr_y[idx]) ** 2).mean(-1)

    def validate() -> Tensor:
        tok, mask, y = val
        return ((model(expand(tok), expand(mask)) - y) ** 2).mean(-1)

    def on_eval(step: int) -> Dict[str, List[float]]:
        out = {}
        for d, (tok, mask, y) in curve_sets.items():
            m = _metrics(model(expand(tok), expand(mask)), y)
            out[f"{d}_acc"] = m["acc"].tolist()
            out[f"{d}_relerr"] = [x if math.isfinite(x) else None for x in m["relerr"].tolist()]
        return out

    res = train_ensemble(model, E, steps=config.steps, step_loss=train_step, validate=validate, on_eval=on_eval, ctx=ctx,
                         lr=p.lr, clip=p.clip, eval_every=p.eval_every,
                         stream_state=generator_state(gens), restore_best=True, desc=f"programs {config.name}")
    final = {}
    with torch.no_grad():
        for d, (tok, mask, y) in test_sets.items():
            final[d] = _metrics(model(expand(tok), expand(mask)), y)
    records = []
    for e, s in enumerate(seeds):
        rec: Dict[str, Any] = {"seed": s, "best_step": int(res.best_step[e]), "diverged": bool(res.diverged[e]),
                               "interp_mse": float(res.best_val[e])}
        for d, m in final.items():
            for k, v in m.items():
                rec[f"{k}_{d}"] = float(v[e])
        rec["accuracy"] = rec["acc_interp"]
        records.append(rec)
    examples = {d: [make_program(task, random.Random(ds * 7919 + 30 + i), a, b)[0]] for i, (d, (a, b)) in
                enumerate(DOMAINS.items())}
    var = float(val[2].var(unbiased=False))  # validation MSE of the best constant prediction
    return registry.RunOutput(records=records, extra={"backend": backend, "curves": res.curves, "examples": examples,
                                                      "val_target_var": var})


# ------------------------------------------------------------------------------------------------
# Configurations
# ------------------------------------------------------------------------------------------------

PROFILES = {
    "quick": {"seeds": 10, "steps": 500},
    "paper": {"seeds": 10, "steps": 20000, "params": {"hidden": 64, "batch": 64, "eval_every": 500}},
}
# decisive: the paper profile itself, at which every model learns [0, 100) (validation R^2 >= 0.98), so
# that extrapolation can be judged (benchmarks/results/decisive/programs/, run with --profile paper: the
# same configurations).
PROFILES["decisive"] = PROFILES["paper"]


def profile_configs(profile: str) -> List[registry.Config]:
    seeds, steps, params = profile_entry(NAME, PROFILES, profile)
    return task_model_configs(NAME, TASKS, MODELS, seeds, steps, **params)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_task_model_arguments(parser, TASKS, MODELS, "add, program or both")
    parser.add_argument("--hidden", type=positive_int, default=ProgramsParams.hidden, help="recurrent units")
    add_backend_argument(parser)


def configs(args: argparse.Namespace) -> List[registry.Config]:
    tasks, models = task_model_options(args, TASKS, MODELS)
    if args.hidden < 1:
        raise ValueError(f"--hidden must be positive, got {args.hidden}")
    params: Dict[str, Any] = {"hidden": args.hidden}
    seeds, steps = run_options(args, params, PROFILES["quick"])
    return task_model_configs(NAME, tasks, models, seeds, steps, **params)


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

CLAIM = ("Paper (Fig. 4): on programs of additions and on programs mixing assignments, conditionals, "
         "addition and subtraction, trained on integers in [0, 100) and tested on 3- and 4-digit integers, "
         "all models (UGRNN, LSTM, DNC, NALU) solve the training domain, the UGRNN beats the LSTM on "
         "addition, and only the recurrent NALU extrapolates. 10 runs, 2-sigma bands. The figure's values "
         "are not available here; we compare with these claims. (No DNC here.)")

LABELS = {"lstm": "LSTM", "ugrnn": "UGRNN", "nalu": "LSTM + NALU"}


def _plot(results: Sequence[registry.ConfigResult], out_dir: str) -> Optional[str]:
    try:
        plt = pyplot()
    except Exception:  # no matplotlib: the report goes without the figure
        return None
    by = {(r.config.params.get("task"), r.config.params.get("model")): r for r in results}
    tasks = [t for t in TASKS if any(k[0] == t for k in by)]
    if not tasks:
        return None
    fig, axes = plt.subplots(2 * len(tasks), len(DOMAINS), figsize=(4 * len(DOMAINS), 3.0 * 2 * len(tasks)),
                             squeeze=False)
    styles = dict(zip(MODELS, line_styles(len(MODELS))))
    for ti, task in enumerate(tasks):
        for di, d in enumerate(DOMAINS):
            for mi, metric in enumerate(("acc", "relerr")):
                ax = axes[2 * ti + mi][di]
                for m in MODELS:
                    r = by.get((task, m))
                    if r is None or not (r.extra or {}).get("curves"):
                        continue
                    cur = r.extra["curves"]
                    vals = cur.get(f"{d}_{metric}")
                    if not vals:
                        continue
                    arr = np.array([[np.nan if v is None else v for v in row] for row in vals], dtype=float)
                    steps = np.array(cur["step"][:len(arr)])
                    mean = np.nanmean(arr, axis=1)
                    sd = np.nanstd(arr, axis=1)
                    ax.plot(steps, mean, label=LABELS[m], ms=3, markevery=max(1, len(steps) // 10), **styles[m])
                    lo, hi = mean - 2 * sd, mean + 2 * sd
                    if metric == "acc":
                        lo, hi = np.clip(lo, 0, 1), np.clip(hi, 0, 1)
                    else:
                        lo = np.maximum(lo, 1e-4)
                    ax.fill_between(steps, lo, hi, alpha=0.15, color=styles[m]["color"])
                if metric == "relerr":
                    ax.set_yscale("log")
                lo_, hi_ = DOMAINS[d]
                ax.set_title(f"{task}: {'accuracy' if metric == 'acc' else 'relative error'}, ints in [{lo_}, {hi_})",
                             fontsize=8)
                ax.set_xlabel("training step", fontsize=8)
                if di == 0 and ti == 0 and mi == 0:
                    ax.legend(fontsize=7)
    fig.suptitle("Program evaluation (cf. Fig. 4): test accuracy and relative error per domain during training "
                 "(mean over seeds, 2-sigma bands)", fontsize=10)
    return save_figure(fig, out_dir, "programs_fig4.png", dpi=100)


def _claims(by: Dict[Tuple[str, str], registry.ConfigResult], task: str, models: Sequence[str]) -> List[List[str]]:
    """The claims-table rows of ``task`` (Fig. 4's claims by :func:`..report.generalisation_claim`)."""
    gens = {m: (generalisation(by[(task, m)], LABELS[m], "relerr_interp",
                               [("3-digit", "relerr_3digit"), ("4-digit", "relerr_4digit")]), by[(task, m)])
            for m in models}
    missing = lambda ms: [LABELS[m] for m in ms if m not in gens]  # noqa: E731
    rows = []
    if gens:
        every = list(gens.values())
        learned = None if missing(MODELS) else all(g.learned for g, _ in every)
        rows.append(claim_row(f"{task}: every model learns the training domain [0, 100)",
                              f"validation R^2 >= {LEARNED_R2} for every model",
                              "; ".join([f"{g.label}: R^2 {'?' if g.r2 is None else f'{g.r2:.2f}'}" for g, _ in every]
                                        + [f"{m}: not run" for m in missing(MODELS)]),
                              learned, cells=[r for _, r in every], experiment=NAME, models=list(gens)))
    if "nalu" in gens:
        rows.append(generalisation_claim(f"{task}: the recurrent NALU extrapolates to 3- and 4-digit integers",
                                         [gens["nalu"]], extrapolates=True, experiment=NAME))
    base = [gens[m] for m in ("lstm", "ugrnn") if m in gens]
    if base:
        rows.append(generalisation_claim(f"{task}: the LSTM and the UGRNN do not extrapolate", base,
                                         extrapolates=False, experiment=NAME, missing=missing(("lstm", "ugrnn"))))
    if task == "add" and "lstm" in gens and "ugrnn" in gens:
        (u, ur), (l, lr_) = gens["ugrnn"], gens["lstm"]
        beats = None if u.err_train is None or l.err_train is None else u.err_train < l.err_train
        rows.append(claim_row("add: the UGRNN beats the LSTM", "UGRNN's relative error on [0, 100) below the LSTM's",
                              f"UGRNN {fmt_num(u.err_train)}, LSTM {fmt_num(l.err_train)}", beats, cells=[ur, lr_],
                              experiment=NAME, models=["ugrnn", "lstm"], budget_bound=True))
    return rows


def report_section(results: Sequence[registry.ConfigResult], out_dir: str) -> str:
    if not results:
        return ""
    by = {(r.config.params.get("task"), r.config.params.get("model")): r for r in results}
    c0 = results[0].config
    lines = [CLAIM, ""]
    lines += how_to_read(
                 f"{c0.seeds} seeds per model, {c0.steps} steps; checkpoint per seed chosen on validation programs "
                 "with integers in [0, 100); final test on 1000 programs per domain; means over seeds, accuracies (a "
                 "rate) with 95% Wilson intervals (one trial per seed), relative errors with 95% Student-t intervals. "
                 "Accuracy: rounded output equals the printed value. Relative error: MAE / "
                 f"mean |target|. Every model's output is multiplied by a fixed {fmt_num(c0.params.get('out_scale', ProgramsParams.out_scale))} "
                 "(the training range) so that linear read-outs start at the targets' scale. The published budget the verdicts "
                 "compare with is the paper profile's (the paper states 10 runs, not their steps).")
    lines.append("")
    for task in TASKS:
        rows = [m for m in MODELS if (task, m) in by]
        if not rows:
            continue
        ex = (by[(task, rows[0])].extra or {}).get("examples", {})
        if ex:
            lines.append(f"**{task}** (e.g. `{ex.get('interp', [''])[0]}` / `{ex.get('4digit', [''])[0]}`)")
        else:
            lines.append(f"**{task}**")
        lines.append("")
        lines.append("| model | accuracy [0,100) | accuracy 3-digit | accuracy 4-digit | rel. error [0,100) | "
                     "rel. error 3-digit | rel. error 4-digit | diverged |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for m in rows:
            s = by[(task, m)].summary
            lines.append(f"| {LABELS[m]} | " + " | ".join(fmt_ci(s, f"acc_{d}", pct=True) for d in DOMAINS) + " | "
                         + " | ".join(fmt_ci(s, f"relerr_{d}") for d in DOMAINS)
                         + f" | {s.get('diverged_count', 0)}/{s.get('seeds')} |")
        lines.append("")
        claims = _claims(by, task, rows)
        if claims:
            lines += [f"**{task}: the paper's claims, checked** ({LEARNED_KEPT_RULE}; here the training range is "
                      "[0, 100), the ranges outside 3- and 4-digit integers; relative errors are means over seeds)", "",
                      md_table(["claim", "rule applied here", "our evidence", "verdict"], claims)]
    lines += figure_lines(_plot(results, out_dir), "learning curves per test domain, mean and 2-sigma bands over seeds")
    return "\n".join(lines)


PROGRAM_CHARS = 20  # the shortest of the longest programs of a set (additions of 2-digit numbers)


def memory_needs(config: registry.Config) -> List[Need]:
    """The dominant tensors of a run (checked before it starts: :mod:`..resources`)."""
    p = task_params(ProgramsParams, config)
    E, H, T = float(config.seeds), float(p.hidden), PROGRAM_CHARS
    return [Need("the recurrent layer and its optimiser", "--hidden, --seeds", E * (p.emb + H) * 4 * H * FLOAT * ADAM),
            Need("the recurrent states of a test set", "--hidden, --seeds", E * p.n_test * T * H * FLOAT),
            Need("the recurrent states of a training batch", "--hidden, --seeds", E * p.batch * T * 4 * H * FLOAT * 2)]


# Cost per seed-step relative to the static task (costs.estimated_cost), measured with
# `OMP_NUM_THREADS=1 python benchmarks/cost_factors.py --sequence` (paper configurations, CPU time
# against static's standard-nac-add in the same run; 2-core shared CPU, 1 thread; benchmarks/RESULTS.md
# sections 18 and 23). Per configuration: the programs are about twice as
# long as the additions, and the models differ.
EXPERIMENT = register_task(__name__, name=NAME, order=70, summarize=interval_summary, cost_factor=100.0,
                           model_costs={"add-lstm": 2.3, "add-ugrnn": 1.55, "add-nalu": 1.9,
                                        "program-lstm": 5.55, "program-ugrnn": 2.55, "program-nalu": 5.5},
                           help="program evaluation (Fig. 4): "
                                "LSTM, UGRNN and LSTM+NALU read code character by character")
