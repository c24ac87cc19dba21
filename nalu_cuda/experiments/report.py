"""``report.md``: our numbers beside the published ones, and the plots.

Published figures come only from sources we can cite (``docs/paper.md``): Trask et al. (2018) state
claims but their table values are not available here, so claims are checked against our numbers
by an explicit rule; Madsen & Johansen (2020) and Schlor et al. (2020, iNALU) give success rates.
"""
from __future__ import annotations

import math
import os
import traceback
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .registry import ConfigResult, all_experiments
from .verdicts import VERDICT_RULE, Budget, published_budget, run_budget, verdict

__all__ = ["build_report", "md_table", "fmt_rate", "fmt_num", "fmt_ci", "fmt_ratio", "plot_per_op", "figure_lines",
           "MADSEN_SUCCESS", "INALU_SUCCESS", "plt", "line_styles", "claim_row", "how_to_read",
           "LEARNED_R2", "LEARNED_KEPT_RULE", "Generalisation", "generalisation", "generalisation_claim"]

# Madsen & Johansen (2020), static task, U[1,2] -> U[2,6], 100 seeds. Keys: (our model name, op).
MADSEN_SUCCESS: Dict[Tuple[str, str], float] = {
    ("nalu", "add"): 0.14, ("nalu", "sub"): 0.14, ("nalu", "mul"): 0.00, ("nalu", "div"): 0.00,
    ("nalu", "squared"): 0.00, ("nalu", "root"): 0.02,
    ("nac", "add"): 1.00, ("nac", "sub"): 1.00, ("nac", "div"): 0.00,
    ("nac-mul", "mul"): 0.31, ("nac-mul", "squared"): 0.77, ("nac-mul", "root"): 0.07, ("nac-mul", "div"): 0.00,
}
# Madsen & Johansen's Table 1 as docs/paper.md gives it (100 seeds, 5e6 steps, U[1,2] -> U[2,6]): (op, our
# model name, success, +CI, -CI, median solved-at step, sparsity error); None where not published.
MADSEN_TABLE1: List[Tuple[str, str, float, Optional[float], Optional[float], Optional[float], Optional[float]]] = [
    ("mul", "nmu", 0.98, 0.01, 0.05, 1.4e6, 4.2e-7),
    ("mul", "nac-mul", 0.31, 0.10, 0.08, 2.8e6, 5.8e-4),
    ("mul", "nalu", 0.00, None, None, None, None),
    ("add", "nau", 1.00, None, None, 1.8e4, 3.2e-5),
    ("add", "nac", 1.00, None, None, 2.5e5, 2.3e-1),
    ("add", "linear", 1.00, None, None, 6.1e4, 2.5e-1),
    ("add", "nalu", 0.14, 0.08, 0.05, 1.5e6, 1.7e-1),
    ("sub", "nau", 1.00, None, None, 5.0e3, 6.6e-2),
    ("sub", "nac", 1.00, None, None, 9.0e3, 2.3e-1),
    ("sub", "linear", 0.07, 0.07, 0.04, 3.3e6, 1.8e-1),
    ("sub", "nalu", 0.14, 0.08, 0.05, 1.9e6, 2.1e-1),
    ("div", "nmu", 0.00, None, None, None, None),
    ("squared", "nmu", 1.00, None, None, 1.2e6, None),
    ("root", "nmu", 0.00, None, None, None, None),
]
MADSEN_SUCCESS.update({(model, op): rate for op, model, rate, *_ in MADSEN_TABLE1})
MADSEN_STEPS = 5_000_000
MADSEN_SEEDS = 100   # Madsen & Johansen's published budget: 100 seeds x 5e6 steps (the verdicts' reference)

# Schlor, Ring & Hotho (2020), 70 runs per cell, success = extrapolation MSE < 1e-5 (a different
# criterion from Madsen's), their NALU baseline.
INALU_SUCCESS: Dict[Tuple[str, str], float] = {
    ("nalu", "add"): 0.43, ("nalu", "sub"): 0.00, ("nalu", "mul"): 0.47, ("nalu", "div"): 0.00,
}


def plt():
    import matplotlib  # local: matplotlib is slow to import, and only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#7f7f7f", "#bcbd22", "#000000", "#aec7e8", "#98df8a", "#ff9896", "#c5b0d5", "#6b3d00")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "8", "H", "1")


def line_styles(n: int) -> List[Dict[str, Any]]:
    """``n`` distinct plot styles (colour AND marker differ between any two of up to 16 lines; beyond
    that the pairs repeat with a dashed line): keyword arguments for ``ax.plot``."""
    out = []
    for i in range(n):
        k = i % len(_COLOURS)
        out.append({"color": _COLOURS[k], "marker": _MARKERS[k], "ls": "-" if i < len(_COLOURS) else "--"})
    return out


def how_to_read(text: str) -> List[str]:
    """An experiment section's own short "how to read" paragraph (Markdown lines)."""
    return [f"*How to read this section:* {text}", ""]


def op_grid(n: int):
    """A figure with one panel per operation: ``n`` panels, up to 3 a row; the spare ones hidden."""
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt().subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    return fig, [axes[i // cols][i % cols] for i in range(n)]


def save_figure(fig, out_dir: str, name: str, dpi: int = 110, layout: bool = True) -> str:
    """Lay out (unless ``layout`` is False: a figure laid out by hand), write ``out_dir/name`` and
    close ``fig``; returns ``name`` (for the report's link)."""
    if layout:
        fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=dpi)
    plt().close(fig)
    return name


def plot_per_op(curves: Sequence[Tuple[str, str, Sequence[float], Sequence[Optional[float]]]], out_dir: str,
                name: str, xlabel: str, ylabel: str = "median MSE", mark_x: Optional[float] = None,
                legend_size: int = 7, title: Optional[str] = None, mark_label: Optional[str] = None,
                bands: Optional[Dict[str, Tuple[float, float, str]]] = None,
                hlines: Optional[Dict[str, Tuple[float, float, float, str]]] = None,
                xticks: Optional[Sequence[float]] = None, ops: Sequence[str] = (),
                op_titles: Optional[Dict[str, str]] = None) -> Optional[str]:
    """One log-log panel per operation: ``curves`` are ``(label, op, xs, ys)``; missing or
    non-positive ys are gaps; ``mark_x`` draws a dotted vertical line (the training point,
    ``mark_label`` its legend entry); ``bands[op] = (x0, x1, label)`` shades an x range and
    ``hlines[op] = (y, x0, x1, label)`` draws a dashed level (e.g. the success threshold over the
    range it applies to); ``xticks`` labels those x values plainly; ``title`` is the figure's title (what is plotted). Every label keeps one
    colour and marker in every panel. Writes ``out_dir/name`` and returns ``name``, or None when
    there is nothing to draw. ``ops``: the order of the panels (default: as the curves first name
    them); ``op_titles``: each panel's title (default: the op's name); the arithmetic tasks' are
    :func:`.parts.arithmetic_plots.plot_per_op`'s."""
    ops = [op for op in (ops or dict.fromkeys(c[1] for c in curves)) if any(c[1] == op for c in curves)]
    if not ops:
        return None
    labels = list(dict.fromkeys(c[0] for c in curves))
    style = dict(zip(labels, line_styles(len(labels))))
    fig, panels = op_grid(len(ops))
    for op, ax in zip(ops, panels):
        if bands and op in bands:
            x0, x1, lab = bands[op]
            ax.axvspan(x0, x1, color="0.9", zorder=0, label=lab)
        for label, cop, xs, ys in curves:
            if cop == op:
                ax.plot(xs, [y if (y is not None and y > 0) else float("nan") for y in ys], ms=4, lw=1.1,
                        label=label, **style[label])
        ax.set_xscale("log")
        ax.set_yscale("log")
        if mark_x is not None:
            ax.axvline(mark_x, color="grey", lw=0.8, ls=":", label=mark_label)
        if hlines and op in hlines:
            y, x0, x1, lab = hlines[op]
            if y and y > 0:
                ax.hlines(y, x0, x1, colors="k", linestyles="--", lw=1.2, label=lab, zorder=5)
        if xticks:
            ax.set_xticks(list(xticks))
            ax.set_xticklabels([f"{x:g}" for x in xticks], fontsize=7)
            ax.minorticks_off()
        ax.set_title((op_titles or {}).get(op, op))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    # One legend for all panels, below them, where it hides no curve and no threshold.
    handles: Dict[str, Any] = {}
    for ax in panels:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    ncol = min(5, max(1, len(handles)))
    rows = -(-len(handles) // ncol)
    height = fig.get_size_inches()[1]
    bottom = (0.08 + 0.2 * rows) / height
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=legend_size + 1,
                   frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 0.95 if title else 1))
    return save_figure(fig, out_dir, name, layout=False)


def fmt_num(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return "nan"
    if f == 0:
        return "0"
    if abs(f) >= 1e4 or abs(f) < 1e-3:
        return f"{f:.{max(1, digits - 1)}e}"
    return f"{f:.{digits}g}"


def fmt_rate(s: Dict[str, Any], key: str = "success") -> str:
    rate = s.get(f"{key}_rate" if key != "diverged" else "divergence_rate")
    if rate is None:
        return "-"
    ci = s.get(f"{key}_ci" if key != "diverged" else "divergence_ci") or [math.nan, math.nan]
    count = s.get(f"{key}_count" if key != "diverged" else "divergence_count")
    n = s.get("n_records")
    return f"{100 * rate:.0f}% ({count}/{n}) [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def fmt_ratio(v: Optional[float]) -> str:
    """An MSE / success-threshold ratio (below 1 = solved), with the verdict it implies."""
    if v is None:
        return "-"
    f = float(v)
    if not math.isfinite(f):
        return "nan"
    return f"{fmt_num(f)} ({'solved' if f < 1 else 'failed'})"


def fmt_ci(summary: Dict[str, Any], key: str, pct: bool = False, digits: int = 3) -> str:
    """``mean [lo, hi]`` of a summary key (``pct``: as percentages)."""
    m = summary.get(f"{key}_mean")
    ci = summary.get(f"{key}_ci") or [None, None]
    if m is None:
        return fmt_num(None)
    if pct:
        lo, hi = ci
        if lo is None:
            return f"{100 * m:.1f}%"
        return f"{100 * m:.1f}% [{100 * max(0.0, lo):.1f}, {100 * min(1.0, hi):.1f}]"
    if ci[0] is None or ci[0] == ci[1]:
        return fmt_num(m, digits)
    return f"{fmt_num(m, digits)} [{fmt_num(ci[0], digits)}, {fmt_num(ci[1], digits)}]"


def figure_lines(path: Optional[str], alt: str) -> List[str]:
    """The Markdown lines that show a written figure (none when no figure was written)."""
    return [f"![{alt}]({path})", ""] if path else []


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out) + "\n"


def _fmt_time(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def build_report(by_exp: Dict[str, List[ConfigResult]], out_dir: str, meta: Dict[str, Any]) -> str:
    lines = ["# nalu_cuda: reproduction report", ""]
    cmd = meta.get("command")
    if cmd:
        lines += [f"Command: `{cmd}`", ""]
    info = [f"generated {meta.get('generated')}", f"nalu_cuda {meta.get('nalu_cuda')}",
            f"torch {meta.get('torch')}", f"native extension: {meta.get('native_extension')}",
            f"device: {meta.get('device', 'cpu')}", f"machine: {meta.get('machine')}",
            f"training wall time of the configurations below: {_fmt_time(meta.get('total_wall_s', 0.0))}"]
    if meta.get("invocation_wall_s") is not None:
        info.append(f"wall time of the command (this invocation, with setup and reports): "
                    f"{_fmt_time(meta['invocation_wall_s'])}")
    if meta.get("ranks"):
        shards = meta.get("shards") or []
        info.append(f"sharded over {meta['ranks']} ranks ({meta.get('backend')}; "
                    + ", ".join(f"rank {s['rank']}: {s['configs']} configurations on {s['device']}" for s in shards) + ")")
    if meta.get("profile"):
        info.insert(0, f"profile: **{meta['profile']}**")
    lines += ["- " + "\n- ".join(info), ""]
    lines += [
        "How to read this report: every configuration trains all of its seeds as one ensemble (each seed "
        "with its own initialisation and data stream). Model selection uses validation data from the "
        "training range only. Every rate (success, accuracy, divergence) carries a 95% Wilson interval, "
        "which stays inside [0, 1]; means of continuous quantities (errors) carry 95% Student-t intervals "
        "over seeds. The values inside Trask et al.'s tables are not available to us, so their claims are "
        "checked instead, by the rule stated beside each; each section says how to read its own numbers.",
        "",
        VERDICT_RULE,
        "",
    ]
    known = {e.name: e for e in all_experiments()}
    order = [e.name for e in all_experiments()] + sorted(set(by_exp) - set(known))
    for name in order:
        if name not in by_exp:
            continue
        exp = known.get(name)
        results = by_exp[name]
        try:
            section = exp.report_section(results, out_dir) if exp is not None else ""
        except Exception as exc:  # one broken section must not lose the rest of the report
            section = (f"_The report section of `{name}` failed: {type(exc).__name__}: {exc}_\n\n```\n"
                       f"{traceback.format_exc(limit=4)}```\n")
        if exp is None:
            section = f"## {name}\n\n_(experiment not registered in this installation; raw results only)_\n"
        lines += [section.rstrip(), ""]
    return "\n".join(lines) + "\n"


def claim_row(claim: str, rule: str, evidence: str, holds: Optional[bool], *, cells: Sequence[Any] = (),
              experiment: Optional[str] = None, models: Sequence[str] = (), budget: Optional[Budget] = None,
              published: Optional[Budget] = None, negative: bool = False, budget_bound: Optional[bool] = None,
              structural: Optional[str] = None) -> List[str]:
    """One row of a claims table, its verdict by the one rule (:func:`.verdicts.verdict`). The run's
    budget is ``budget`` or that of ``cells`` (:func:`.verdicts.run_budget`); the published one is
    ``published`` or ``experiment``'s for ``models`` (:func:`.verdicts.published_budget`)."""
    if budget is None:
        budget = run_budget(cells)
    if published is None and experiment is not None:
        published = published_budget(experiment, models)
    return [claim, rule, evidence, verdict(holds, budget, published, negative=negative, budget_bound=budget_bound,
                                           structural=structural)]


# ------------------------------------------------------------------------------------------------
# Learned / kept: the one rule of the sequence tasks whose outputs are numbers (digits, programs)
# ------------------------------------------------------------------------------------------------

LEARNED_R2 = 0.8  # validation R^2 from which a model counts as having learned its training range

LEARNED_KEPT_RULE = (
    f"a model has *learned* its training range when its validation R^2 = 1 - MSE / Var(target) is at least "
    f"{LEARNED_R2}; it *keeps* a longer length or a larger domain when its relative error there is at most twice "
    "that of the training range (or within 0.05 of it); a model that did not learn cannot be judged outside")


def keeps(err_train: Optional[float], err_out: Optional[float]) -> Optional[bool]:
    """Whether a relative error outside the training range keeps that of the training range
    (:data:`LEARNED_KEPT_RULE`); None where either is unknown."""
    if err_train is None or err_out is None or not math.isfinite(err_train):
        return None
    return math.isfinite(err_out) and err_out <= max(2.0 * err_train, err_train + 0.05)


class Generalisation:
    """One model's measurement by :data:`LEARNED_KEPT_RULE`: its validation R^2, its relative error in
    the training range and at each range outside it (``outs``: (label, error, kept))."""

    def __init__(self, label: str, r2: Optional[float], err_train: Optional[float],
                 outs: Sequence[Tuple[str, Optional[float]]]):
        self.label, self.r2, self.err_train = label, r2, err_train
        self.outs = [(name, err, keeps(err_train, err)) for name, err in outs]

    @property
    def learned(self) -> Optional[bool]:
        return None if self.r2 is None else self.r2 >= LEARNED_R2

    @property
    def kept_all(self) -> bool:
        return bool(self.learned) and all(k for _, _, k in self.outs)

    @property
    def lost_all(self) -> bool:
        return bool(self.learned) and all(k is False for _, _, k in self.outs)

    def evidence(self) -> str:
        r2 = "R^2 ?" if self.r2 is None else f"R^2 {self.r2:.2f}"
        if self.learned is False:
            return f"{self.label}: {r2} (did not learn)"
        outs = ", ".join(f"{fmt_num(e)} ({n}{', kept' if k else ''})" for n, e, k in self.outs)
        return f"{self.label}: {r2}; {fmt_num(self.err_train)} -> {outs}"


def generalisation(result: ConfigResult, label: str, train_key: str,
                   out_keys: Sequence[Tuple[str, str]]) -> Generalisation:
    """:class:`Generalisation` of ``result``: R^2 from its validation MSE (``interp_mse_mean``) and the
    validation target's variance (its ``extra["val_target_var"]``); relative errors from the
    summary's ``<key>_mean`` (``train_key``, and each ``(label, key)`` of ``out_keys``)."""
    s = result.summary
    var, mse = (result.extra or {}).get("val_target_var"), s.get("interp_mse_mean")
    r2 = None if not var or mse is None else 1.0 - float(mse) / float(var)
    return Generalisation(label, r2, s.get(f"{train_key}_mean"),
                          [(name, s.get(f"{key}_mean")) for name, key in out_keys])


def generalisation_claim(claim: str, models: Sequence[Tuple[Generalisation, ConfigResult]], *, extrapolates: bool,
                         experiment: Optional[str] = None, published: Optional[Budget] = None,
                         missing: Sequence[str] = ()) -> List[str]:
    """A claims-table row (:func:`claim_row`) for "these models learn their training range and keep
    (``extrapolates``) / lose (not ``extrapolates``) every range outside it". A model that kept a range
    where the claim says it fails makes the verdict final; a model that did not learn leaves the claim
    to the budget (more training could make it learn). ``missing``: the claim's models that did not run
    (then it is not tested here). ``published``: the published budget, else ``experiment``'s."""
    gens = [g for g, _ in models]
    if not gens or missing:
        return claim_row(claim, "", "; ".join([g.evidence() for g in gens] + [f"{m}: not run" for m in missing]),
                         None)
    learned = all(g.learned for g in gens)
    if extrapolates:
        holds, bound = all(g.kept_all for g in gens), None
        rule = "every model learned the training range and keeps every range outside it"
    else:
        holds = all(g.lost_all for g in gens)
        bound = holds or not learned
        rule = "every model learned the training range and keeps no range outside it"
    return claim_row(claim, rule, "; ".join(g.evidence() for g in gens), holds, cells=[r for _, r in models],
                     experiment=experiment, models=[r.config.params.get("model", "") for _, r in models],
                     published=published, budget_bound=bound)
