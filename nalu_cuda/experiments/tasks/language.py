"""Language to number (the paper's Table 3 and Fig. 3): English number words -> the number.

Data: the 1000 numbers 0..999 written as words ("five hundred and fifteen" -> 515; tokens are the
words, at most five). Split as in the paper: 169 training numbers (0..19 always, plus 149 drawn from
20..999), 200 validation, 631 test, disjoint, fixed by ``split_seed``.

Model: token embedding -> LSTM -> head, where the head reads the LSTM state after every token (its
output after the last token is the prediction; after earlier tokens it is the running estimate of
the paper's Fig. 3):

* ``linear``: a linear layer on the last state (plain LSTM);
* ``linear-sum``: a linear layer on the sum of the states so far (the paper's "summed-state LSTM"
  baseline, which its appendix says generalised slightly better);
* ``nac``: :class:`nalu_cuda.NAC` on the state;
* ``nalu``: :class:`nalu_cuda.NALU` on the state (the paper's LSTM + NALU).

Training: Adam on the whole training set, squared loss, for ``steps`` steps; every (layer size,
learning rate, seed) is one ensemble member. Model selection uses validation data only: per seed,
the (size, learning rate) whose best checkpoint has the lowest validation loss; and one overall
model per head (lowest validation loss over everything) for the Fig. 3 view.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

import nalu_cuda

from ..argtypes import comma_list, non_negative_int, positive_float, positive_int
from .. import registry
from ..params import task_params
from ..resources import ADAM, FLOAT, Need
from ..parts.layers import EnsembleEmbedding, EnsembleLinear
from ..parts.number_words import SPLIT_SIZES, VOCAB, make_split, number_to_words, tokens_tensor
from ..parts.number_words import MAX_TOKENS, ONES, TENS  # noqa: F401  (the task's names for its data)
from ..parts.optim import FlatAdam
from ..parts.seeding import member_generators
from ..parts.sequence_models import EnsembleLSTM, final_states, frozen_states
from ..parts.training import train_ensemble
from ..plugin import (add_backend_argument, add_subset_argument, profile_entry, register_task, run_options,
                      run_setting, subset_option)
from ..report import figure_lines, fmt_ci, fmt_num, how_to_read, line_styles, plt as pyplot, save_figure
from ..stats import interval_summary
from ..verdicts import published_budget, run_budget, verdict

NAME = "language"
HEADS = ("linear", "linear-sum", "nac", "nalu")


class NumberReader(nn.Module):
    """Embedding -> LSTM -> head, ``E`` members; ``forward`` gives the running estimate ``(E, N, T)``."""

    def __init__(self, ensemble: int, head: str, emb: int, hidden: int, backend: str = "auto") -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"language: head must be one of {HEADS}, got {head!r}")
        self.head_kind = head
        self.embedding = EnsembleEmbedding(len(VOCAB), emb, ensemble=ensemble)
        self.lstm = EnsembleLSTM(emb, hidden, ensemble=ensemble)
        if head in ("linear", "linear-sum"):
            self.head = EnsembleLinear(hidden, 1, ensemble=ensemble)
        elif head == "nac":
            self.head = nalu_cuda.NAC(hidden, 1, ensemble=ensemble, backend=backend)
        else:
            self.head = nalu_cuda.NALU(hidden, 1, ensemble=ensemble, backend=backend)

    def reset_parameters(self, seeds: Sequence[int]) -> None:
        self.embedding.reset_parameters(member_generators(seeds, "language/embedding"))
        self.lstm.reset_parameters(member_generators(seeds, "language/lstm"))
        gens = member_generators(seeds, "language/head")
        if isinstance(self.head, EnsembleLinear):
            self.head.reset_parameters(gens)
        else:
            self.head.reset_parameters(gens)

    def states(self, tokens: Tensor, mask: Tensor, last: bool = False) -> Tensor:
        """The LSTM state after every token ``(E, N, T, H)``, frozen after the last token (``last``:
        only the state after the last token, ``(E, N, H)``), for ``tokens``, ``mask``: ``(N, T)``
        shared by all members, the valid tokens a prefix of every row (right padding). The input
        projection of an embedded token is computed once per vocabulary word
        (:meth:`EnsembleLSTM.forward_tokens`). The LSTM runs unmasked and the states after a row's
        last token are read from that step: the values of a masked run, without a select per step."""
        h = self.lstm.forward_tokens(self.embedding.weight, tokens)
        return final_states(h, mask) if last else frozen_states(h, mask)

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """``tokens``, ``mask``: ``(N, T)`` shared by all members -> running estimates ``(E, N, T)``."""
        h = self.states(tokens, mask)
        if self.head_kind == "linear-sum":
            h = torch.cumsum(h * mask.unsqueeze(-1).to(h.dtype), dim=2)
        return self.head(h).squeeze(-1)

    @torch.no_grad()
    def nalu_gate(self, tokens: Tensor, mask: Tensor) -> Optional[Tensor]:
        """Mean gate ``g`` of a NALU head on the final states, per member (1: additive path, 0: the
        multiplicative one); ``None`` for other heads."""
        if self.head_kind != "nalu":
            return None
        E = self.embedding.weight.shape[0]
        h = self.states(tokens, mask, last=True)  # (E, N, H)
        G = self.head.G
        g = torch.sigmoid(torch.bmm(h, G)) if self.head.gate == "input" else torch.sigmoid(G).unsqueeze(1)
        return g.reshape(E, -1).mean(1)

    def predict(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """The estimate after the last token, ``(E, N)``: the head on the last state only (the
        summed-state head: on the sum of the states over the valid tokens)."""
        if self.head_kind == "linear-sum":
            h = self.lstm.forward_tokens(self.embedding.weight, tokens)  # unmasked: the masked sum below
            last = (h * mask.unsqueeze(-1).to(h.dtype)).sum(2)
        else:
            last = self.states(tokens, mask, last=True)
        return self.head(last).squeeze(-1)


def _mae(pred: Tensor, target: Tensor) -> Tensor:
    return torch.nan_to_num((pred - target).abs(), nan=float("inf")).mean(-1)


@dataclass(frozen=True)
class LanguageParams:
    """The parameters of a language configuration (``Config.params``, typed by :func:`task_params`)."""

    head: str                   # one of HEADS (set by every configuration)
    sizes: Tuple[Tuple[int, int], ...] = ((64, 10), (64, 20))  # (embedding, LSTM units): the paper's 2 layer sizes
    lrs: Tuple[float, ...] = (1e-3, 1e-2)                      # the paper's 2 learning rates
    eval_every: int = 50
    split_seed: int = 0
    clip: float = 100.0
    n_phrases: int = 5


def fig3_numbers(test: Sequence[int], k: int = 5) -> List[int]:
    """A few test numbers for the Fig. 3 view: compositional ones with "and", one without."""
    test = sorted(int(t) for t in test)
    with_and = [n for n in test if n > 100 and n % 100 >= 13]
    picks = []
    for target in (515, 745, 321, 999, 882, 463):  # spread over the range; nearest test number
        if len(picks) >= k - 1 or not with_and:
            break
        n = min(with_and, key=lambda x: (abs(x - target), x))
        if n not in picks:
            picks.append(n)
    two_digit = [n for n in test if 20 < n < 100]
    if two_digit:
        picks.append(two_digit[len(two_digit) // 2])
    return picks[:k]


def run(config: registry.Config, ctx: registry.Context) -> registry.RunOutput:
    p = task_params(LanguageParams, config)
    device, dtype, backend, seeds = run_setting(config, ctx)
    split = make_split(p.split_seed)
    data = {}
    for part, nums in split.items():
        tok, mask = tokens_tensor(nums)
        data[part] = (tok.to(device), mask.to(device), torch.tensor(nums, dtype=dtype, device=device))

    # members of one size: (lr, seed) pairs, seed-major inside each learning rate
    members = [(lr, s) for lr in p.lrs for s in seeds]
    ck = ctx.load_checkpoint()
    done: List[Dict[str, Any]] = [] if ck is None else list(ck.get("done", []))
    for phase, size in enumerate(p.sizes):
        if phase < len(done):
            continue
        model, res = _train_size(config, ctx, p, phase, size, members, data, done, backend)
        done.append({"size": list(size), "val_loss": [float(v) for v in res.best_val],
                     "best_step": [int(v) for v in res.best_step],
                     "diverged": [bool(v) for v in res.diverged], **_size_metrics(model, data, split, p, device),
                     "curves_val": res.curves.get("val_loss")})
        ctx.save_checkpoint({"phase": phase + 1, "done": done, "state": None})

    records, overall = _select_models(seeds, members, done)
    extra: Dict[str, Any] = {"backend": backend, "split_sizes": {k: len(v) for k, v in split.items()},
                             "members": [[lr, s] for lr, s in members], "sizes": [list(s) for s in p.sizes]}
    if overall is not None:
        extra.update(_selected(overall))
    return registry.RunOutput(records=records, extra=extra)


def _train_size(config: registry.Config, ctx: registry.Context, p: LanguageParams, phase: int,
                size: Tuple[int, int], members: List[Tuple[float, int]], data: Dict[str, Tuple[Tensor, Tensor, Tensor]],
                done: List[Dict[str, Any]], backend: str):
    """Train every (learning rate, seed) member at one layer size (``phase``), checkpointing inside
    the phase through ``ctx``; the model (best-validation parameters loaded) and its result."""
    emb, hidden = size
    E = len(members)
    device, dtype = data["train"][2].device, data["train"][2].dtype

    def save(obj):
        ctx.save_checkpoint({"phase": phase, "done": done, "state": obj})

    def load():
        c = ctx.load_checkpoint()
        if c is None or c.get("phase") != phase or c.get("state") is None:
            return None
        return c["state"]

    sub = replace(ctx, save_checkpoint=save, load_checkpoint=load)
    # members with the same seed share their initialisation across learning rates
    model = NumberReader(E, p.head, emb, hidden, backend=backend)
    model.reset_parameters([s for _, s in members])
    model.to(device=device, dtype=dtype)
    opt = FlatAdam(model.parameters(), [lr for lr, _ in members], ensemble=E, clip=p.clip)
    tr_tok, tr_mask, tr_y = data["train"]
    va_tok, va_mask, va_y = data["val"]

    def train_step(step: int) -> Tensor:
        pred = model.predict(tr_tok, tr_mask)
        return ((pred - tr_y) ** 2).mean(-1)

    def validate() -> Tensor:
        return ((model.predict(va_tok, va_mask) - va_y) ** 2).mean(-1)

    res = train_ensemble(model, E, steps=config.steps, step_loss=train_step, validate=validate, optimizer=opt,
                         ctx=sub, eval_every=p.eval_every, restore_best=True,
                         desc=f"language {p.head} {emb}x{hidden}")
    return model, res


@torch.no_grad()
def _size_metrics(model: "NumberReader", data: Dict[str, Tuple[Tensor, Tensor, Tensor]],
                  split: Dict[str, List[int]], p: LanguageParams, device) -> Dict[str, Any]:
    """A trained size's per-member metrics, and its running estimates on the Fig. 3 phrases."""
    out = {}
    for part in ("train", "val", "test"):
        tok, mask, y = data[part]
        out[f"{part}_mae"] = _mae(model.predict(tok, mask), y).tolist()
    te_tok, te_mask, te_y = data["test"]
    pred = model.predict(te_tok, te_mask)
    for lo, hi, key in ((20, 100, "test_mae_2digit"), (100, 1000, "test_mae_3digit")):
        sel = (te_y >= lo) & (te_y < hi)
        out[key] = _mae(pred[:, sel], te_y[sel]).tolist()
    gate = model.nalu_gate(te_tok, te_mask)
    if gate is not None:
        out["nalu_gate_test"] = gate.tolist()
    phrases = fig3_numbers(split["test"], p.n_phrases)
    ph_tok, ph_mask = tokens_tensor(phrases)
    running = model(ph_tok.to(device), ph_mask.to(device)).cpu()
    return {"metrics": out, "phrases": phrases, "running": running.tolist()}


def _select_models(seeds: Sequence[int], members: List[Tuple[float, int]], done: List[Dict[str, Any]]):
    """Model selection on validation: per seed over (size, lr) (the records), and overall over
    everything (``(val, phase, member, lr, seed)``, or None where every member diverged)."""
    records = []
    overall = None
    for s in seeds:
        best = None
        for ph in done:
            for i, (lr, ms) in enumerate(members):
                if ms != s:
                    continue
                v = ph["val_loss"][i]
                if math.isfinite(v) and (best is None or v < best[0]):
                    best = (v, ph, i, lr)
        rec: Dict[str, Any] = {"seed": s}
        if best is None:
            rec.update({"diverged": True})
        else:
            v, ph, i, lr = best
            rec.update({"diverged": any(p2["diverged"][j] for p2 in done for j, (_, ms) in enumerate(members) if ms == s),
                        "best_step": ph["best_step"][i], "val_mse": v, "chosen_lr": lr,
                        "chosen_hidden": ph["size"][1], "chosen_emb": ph["size"][0]})
            for k, vals in ph["metrics"].items():
                rec[k] = float(vals[i])
            if overall is None or v < overall[0]:
                overall = (v, ph, i, lr, s)
        records.append(rec)
    return records, overall


def _selected(overall) -> Dict[str, Any]:
    """The overall selected model's summary and its Fig. 3 running estimates."""
    v, ph, i, lr, s = overall
    return {"selected": {"seed": s, "lr": lr, "size": ph["size"], "val_mse": v,
                         **{k: float(vals[i]) for k, vals in ph["metrics"].items()}},
            "fig3": [{"number": int(n), "words": number_to_words(int(n)),
                      "running": [float(x) for x in ph["running"][i][j][:len(number_to_words(int(n)).split())]]}
                     for j, n in enumerate(ph["phrases"])]}


# ------------------------------------------------------------------------------------------------
# Configurations
# ------------------------------------------------------------------------------------------------

PROFILES = {
    # quick: 1000 steps instead of 300K, so the learning-rate grid is shifted up (at 1e-3 the linear
    # heads cannot even reach the scale of the targets, 0..999, in 1000 steps)
    "quick": {"seeds": 3, "steps": 1000, "params": {"lrs": [1e-2, 1e-1]}},
    # the paper: 300K steps, 10 initialisations, embedding about 256
    "paper": {"seeds": 10, "steps": 300_000, "params": {"sizes": [[256, 10], [256, 20]], "lrs": [1e-3, 1e-2],
                                                         "eval_every": 1000}},
}
# decisive: the published 300K steps with the paper's model selection (the claim needs nothing less; about
# 3.7 h on two torchrun ranks since the native LSTM: `nalu-cuda list --profile decisive`).
PROFILES["decisive"] = PROFILES["paper"]


def make_configs(heads: Sequence[str], seeds: int, steps: int, **params) -> List[registry.Config]:
    return [registry.Config(NAME, f"lstm-{h}", seeds, steps, {**params, "head": h}) for h in heads]


def profile_configs(profile: str) -> List[registry.Config]:
    seeds, steps, params = profile_entry(NAME, PROFILES, profile)
    return make_configs(HEADS, seeds, steps, **params)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_subset_argument(parser, "--heads", HEADS)
    parser.add_argument("--hidden", type=comma_list(positive_int), default="10,20",
                        help="LSTM sizes tried in model selection (comma-separated)")
    parser.add_argument("--emb", type=positive_int, default=64, help="embedding size")
    parser.add_argument("--lrs", type=comma_list(positive_float), default="0.01,0.1",
                        help="learning rates tried in model selection")
    parser.add_argument("--split-seed", type=non_negative_int, default=0,
                        help="seed of the train/validation/test split")
    add_backend_argument(parser)


def configs(args: argparse.Namespace) -> List[registry.Config]:
    heads = subset_option(args.heads, HEADS, "--heads")
    params: Dict[str, Any] = {"sizes": [[args.emb, h] for h in args.hidden], "lrs": args.lrs,
                              "split_seed": args.split_seed}
    seeds, steps = run_options(args, params, PROFILES["quick"])
    return make_configs(heads, seeds, steps, **params)


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

CLAIM = ("Paper (Table 3): LSTM + NALU generalises best by a wide margin when translating number words "
         "(0..999, 169 training examples) to numbers; the LSTM baseline is the summed-state LSTM; models "
         "chosen by validation loss over 2 layer sizes, 2 learning rates and 10 initialisations, 300K Adam "
         "steps. Fig. 3: the NALU's intermediate outputs track the value of the words read so far. The "
         "table's values are not available here; we compare with these claims.")

LABELS = {"linear": "LSTM + linear", "linear-sum": "LSTM (summed states) + linear", "nac": "LSTM + NAC",
          "nalu": "LSTM + NALU"}


def _verdict(by: Dict[str, registry.ConfigResult]) -> str:
    nalu = by.get("nalu")
    if nalu is None:
        return ""
    s_n = nalu.summary
    lines: List[str] = []
    claim_ok: List[bool] = []
    for base in ("linear", "linear-sum"):
        b = by.get(base)
        if b is None:
            continue
        s_b = b.summary
        m_n, ci_n = s_n.get("test_mae_mean"), s_n.get("test_mae_ci") or [None, None]
        m_b, ci_b = s_b.get("test_mae_mean"), s_b.get("test_mae_ci") or [None, None]
        if m_n is None or m_b is None:
            continue
        clearly = ci_n[1] is not None and ci_b[0] is not None and ci_n[1] < ci_b[0]
        sel_n = (nalu.extra or {}).get("selected", {}).get("test_mae")
        sel_b = (b.extra or {}).get("selected", {}).get("test_mae")
        txt = (f"LSTM + NALU test MAE {fmt_num(m_n)} vs {LABELS[base]} {fmt_num(m_b)} (mean over seeds; "
               f"validation-selected single models: {fmt_num(sel_n)} vs {fmt_num(sel_b)}): ")
        claim_ok.append(bool(clearly))
        if clearly:
            txt += "NALU clearly lower (the 95% intervals do not overlap), as the paper claims."
        elif m_n < m_b:
            txt += "NALU lower on average, but the intervals overlap, so not clearly below."
        else:
            txt += "NALU is NOT below the baseline here, contrary to the paper's claim."
        lines.append(txt)
    if claim_ok:
        cells = [by[h] for h in ("nalu", "linear", "linear-sum") if h in by]
        lines.append("Claim 'LSTM + NALU generalises best' (rule: its test-MAE interval lies below every "
                     "baseline's): " + verdict(all(claim_ok), run_budget(cells), published_budget(NAME, list(by))) + ".")
    lines.extend(_why(by))
    return "\n\n".join(lines)


def _why(by: Dict[str, registry.ConfigResult]) -> List[str]:
    """Diagnostics from the measured numbers that explain the comparison."""
    out = []
    nalu, nac = by.get("nalu"), by.get("nac")
    steps = next(iter(by.values())).config.steps
    if nalu is not None:
        s = nalu.summary
        gate = s.get("nalu_gate_test_mean")
        tr, te = s.get("train_mae_mean"), s.get("test_mae_mean")
        base_tr = [by[b].summary.get("train_mae_mean") for b in ("linear", "linear-sum") if b in by]
        base_tr = [v for v in base_tr if v is not None]
        txt = (f"Why (LSTM + NALU): train MAE {fmt_num(tr)}, test MAE {fmt_num(te)}"
               + (f" (baselines' train MAE {', '.join(fmt_num(v) for v in base_tr)})" if base_tr else "") + ".")
        if gate is not None:
            path = "the multiplicative path" if gate < 0.5 else "the additive path"
            txt += (f" Its mean gate on the test phrases is {gate:.2f} (1 = additive, 0 = multiplicative), so it "
                    f"answers mostly through {path}")
            if gate < 0.5:
                txt += (": exp(W log|h|) on LSTM states bounded by 1 reaches hundreds only by dividing by small "
                        "|h|, a mapping that fits the 169 training numbers but transfers poorly to unseen ones")
            txt += "."
        if steps < 300_000:
            txt += (f" This run trains {steps} steps per model, the paper {300_000}; with so few steps the selection "
                    "favours whatever fits fastest, and the paper's claim is not reproduced at this budget.")
        else:
            txt += (f" This run trains {steps} steps per model, as the paper: the budget does not explain the gap.")
        out.append(txt)
    if nac is not None:
        s = nac.summary
        sizes = nac.config.params.get("sizes", LanguageParams.sizes)
        width = max(int(h) for _, h in sizes)
        out.append(f"Why (LSTM + NAC): with |h| <= 1 and NAC weights in [-1, 1] its output is bounded by the LSTM "
                   f"width ({width} at most here), far below the targets (up to 999): train MAE "
                   f"{fmt_num(s.get('train_mae_mean'))}.")
    return out


def _plot_fig3(by: Dict[str, registry.ConfigResult], out_dir: str) -> Optional[str]:
    nalu = by.get("nalu")
    if nalu is None or not (nalu.extra or {}).get("fig3"):
        return None
    try:
        plt = pyplot()
    except Exception:  # no matplotlib: the report goes without the figure
        return None
    items = nalu.extra["fig3"]
    fig, axes = plt.subplots(1, len(items), figsize=(3.2 * len(items), 3.2), squeeze=False)
    styles = dict(zip(by, line_styles(len(by))))
    for ax, it in zip(axes[0], items):
        words = it["words"].split()
        xs = list(range(len(words)))
        for h, r in by.items():
            f3 = {x["number"]: x for x in (r.extra or {}).get("fig3", [])}
            if it["number"] in f3:
                ax.plot(xs, f3[it["number"]]["running"], ms=4, label=LABELS.get(h, h), **styles[h])
        ax.axhline(it["number"], color="k", lw=0.8, ls="--", label="the number")
        ax.set_xticks(xs)
        ax.set_xticklabels(words, rotation=45, ha="right", fontsize=8)
        ax.set_title(str(it["number"]), fontsize=9)
    axes[0][0].set_ylabel("output after each token")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Language to number (cf. Fig. 3): each head's running output after every token of unseen test "
                 "phrases", fontsize=9)
    return save_figure(fig, out_dir, "language_fig3.png")


def report_section(results: Sequence[registry.ConfigResult], out_dir: str) -> str:
    if not results:
        return ""
    by = {r.config.params.get("head"): r for r in results}
    c0 = results[0].config
    lines = [CLAIM, ""]
    sizes = c0.params.get("sizes", [list(s) for s in LanguageParams.sizes])
    lrs = c0.params.get("lrs", list(LanguageParams.lrs))
    lines += how_to_read(
                 "every number is a mean absolute error between the predicted and the true number (lower is "
                 "better; the test phrases never occur in training). "
                 f"Split {SPLIT_SIZES}; {c0.steps} full-batch Adam steps; model selection on validation loss "
                 f"over sizes (embedding, LSTM) {sizes} and learning rates {lrs}; {c0.seeds} seeds. 'Mean over "
                 "seeds' picks, for each seed, the size and learning rate with the lowest validation loss "
                 "(95% Student-t intervals); 'selected' is the one model per head with the lowest "
                 "validation loss overall.")
    lines.append("| model | test MAE (mean over seeds) | test MAE 20..99 | test MAE 100..999 | train MAE | "
                 "validation MAE | selected model: test MAE | diverged |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for h in HEADS:
        r = by.get(h)
        if r is None:
            continue
        s = r.summary
        sel = (r.extra or {}).get("selected", {})
        lines.append(f"| {LABELS[h]} | {fmt_ci(s, 'test_mae')} | {fmt_ci(s, 'test_mae_2digit')} | "
                     f"{fmt_ci(s, 'test_mae_3digit')} | {fmt_ci(s, 'train_mae')} | {fmt_ci(s, 'val_mae')} | "
                     f"{fmt_num(sel.get('test_mae'))} | {s.get('diverged_count', 0)}/{s.get('seeds')} |")
    lines.append("")
    v = _verdict(by)
    if v:
        lines.append("Measured: " + v)
        lines.append("")
    # Fig. 3 as a table
    nalu = by.get("nalu")
    if nalu is not None and (nalu.extra or {}).get("fig3"):
        lines.append("**Fig. 3 view**: output after each token of a few test phrases (never seen in training), "
                     "validation-selected model of each head.")
        lines.append("")
        for it in nalu.extra["fig3"]:
            words = it["words"].split()
            lines.append(f"*{it['number']}*")
            lines.append("")
            lines.append("| model | " + " | ".join(words) + " |")
            lines.append("|---|" + "---|" * len(words))
            for h in HEADS:
                r = by.get(h)
                if r is None:
                    continue
                f3 = {x["number"]: x for x in (r.extra or {}).get("fig3", [])}
                if it["number"] in f3:
                    lines.append(f"| {LABELS[h]} | " + " | ".join(f"{x:.1f}" for x in f3[it["number"]]["running"]) + " |")
            lines.append("")
        lines += figure_lines(_plot_fig3(by, out_dir), "running estimates after each token")
    return "\n".join(lines)


def memory_needs(config: registry.Config) -> List[Need]:
    """The dominant tensors of a run (checked before it starts: :mod:`..resources`)."""
    p = task_params(LanguageParams, config)
    E, N = float(len(p.lrs) * config.seeds), max(SPLIT_SIZES.values())

    def size(emb: int, hidden: int) -> float:
        weights = ((emb + hidden) * 4 * hidden + len(VOCAB) * emb) * FLOAT * ADAM
        return E * (weights + N * MAX_TOKENS * 4 * hidden * FLOAT * 2)

    return [Need("the largest model, its optimiser and its states over a split", "--hidden, --emb, --seeds, --lrs",
                 max(size(float(e), float(h)) for e, h in p.sizes))]


# Cost per seed-step relative to the static task (costs.estimated_cost), measured with
# `OMP_NUM_THREADS=1 python benchmarks/cost_factors.py --sequence` (paper configurations, CPU time
# against static's standard-nac-add in the same run; 2-core shared CPU, 1 thread; benchmarks/RESULTS.md
# sections 18 and 23). A configuration's steps count once for its two layer sizes (each trained that long).
EXPERIMENT = register_task(__name__, name=NAME, order=60, summarize=interval_summary, cost_factor=137.0,
                           help="language to number (Table 3, Fig. 3): embedding -> LSTM -> linear / NAC / NALU")
