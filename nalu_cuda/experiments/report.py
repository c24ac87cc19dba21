"""``report.md``: our numbers beside the published ones, and the plots.

Published figures come only from sources we can cite (``PAPER.md``): Trask et al. (2018) state
claims but their table values are not available here, so claims are checked against our numbers
by an explicit rule; Madsen & Johansen (2020) and Schlor et al. (2020, iNALU) give success rates.
"""
from __future__ import annotations

import math
import os
import traceback
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .registry import ConfigResult, all_experiments

__all__ = ["build_report", "md_table", "fmt_rate", "fmt_num", "fmt_ci", "plot_per_op", "figure_lines", "MADSEN_SUCCESS",
           "INALU_SUCCESS", "plt"]

# Madsen & Johansen (2020), static task, U[1,2] -> U[2,6], 100 seeds. Keys: (our model name, op).
MADSEN_SUCCESS: Dict[Tuple[str, str], float] = {
    ("nalu", "add"): 0.14, ("nalu", "sub"): 0.14, ("nalu", "mul"): 0.00, ("nalu", "div"): 0.00,
    ("nalu", "squared"): 0.00, ("nalu", "root"): 0.02,
    ("nac", "add"): 1.00, ("nac", "sub"): 1.00, ("nac", "div"): 0.00,
    ("nac-mul", "mul"): 0.31, ("nac-mul", "squared"): 0.77, ("nac-mul", "root"): 0.07, ("nac-mul", "div"): 0.00,
}
# Madsen & Johansen's Table 1 as UNITS.md gives it (100 seeds, 5e6 steps, U[1,2] -> U[2,6]): (op, our
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

# Schlor, Ring & Hotho (2020), 70 runs per cell, success = extrapolation MSE < 1e-5 (a different
# criterion from Madsen's), their NALU baseline.
INALU_SUCCESS: Dict[Tuple[str, str], float] = {
    ("nalu", "add"): 0.43, ("nalu", "sub"): 0.00, ("nalu", "mul"): 0.47, ("nalu", "div"): 0.00,
}


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def op_grid(n: int):
    """A figure with one panel per operation: ``n`` panels, up to 3 a row; the spare ones hidden."""
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt().subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for j in range(n, rows * cols):
        axes[j // cols][j % cols].axis("off")
    return fig, [axes[i // cols][i % cols] for i in range(n)]


def save_figure(fig, out_dir: str, name: str, dpi: int = 110) -> str:
    """Lay out, write ``out_dir/name`` and close ``fig``; returns ``name`` (for the report's link)."""
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=dpi)
    plt().close(fig)
    return name


def plot_per_op(curves: Sequence[Tuple[str, str, Sequence[float], Sequence[Optional[float]]]], out_dir: str,
                name: str, xlabel: str, ylabel: str = "median MSE", mark_x: Optional[float] = None,
                legend_size: int = 7) -> Optional[str]:
    """One log-log panel per operation: ``curves`` are ``(label, op, xs, ys)``; missing or
    non-positive ys are gaps; ``mark_x`` draws a dotted vertical line (the training point).
    Writes ``out_dir/name`` and returns ``name``, or None when there is nothing to draw."""
    from .parts.arithmetic_data import OP_SYMBOLS, OPS

    ops = [op for op in OPS if any(c[1] == op for c in curves)]
    if not ops:
        return None
    fig, panels = op_grid(len(ops))
    for op, ax in zip(ops, panels):
        for label, cop, xs, ys in curves:
            if cop == op:
                ax.plot(xs, [y if (y is not None and y > 0) else float("nan") for y in ys], marker="o", ms=3,
                        label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        if mark_x is not None:
            ax.axvline(mark_x, color="grey", lw=0.8, ls=":")
        ax.set_title(OP_SYMBOLS[op])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=legend_size)
    return save_figure(fig, out_dir, name)


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
        "training range only. Rates carry 95% Wilson intervals. *Normalised error* is the paper's scale: "
        "100 = the mean MSE of randomly initialised models of the same architecture, 0 = perfect. "
        "*Success* is Madsen & Johansen's criterion: extrapolation MSE at the best-validation step below "
        "that of an epsilon-perfect solution (eps = 1e-5). The values inside Trask et al.'s tables are not "
        "available to us, so their claims are checked instead, by the rule stated beside each.",
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


def claim_row(claim: str, rule: str, evidence: str, holds: Optional[bool], budget_explains: bool = False) -> List[str]:
    """One row of a claims table. ``budget_explains``: the run's budget (steps, seeds) is far below
    the published one and could explain a failure, which then reads "inconclusive at this budget";
    "does not hold" is kept for failures the budget cannot explain."""
    if holds is False and budget_explains:
        return [claim, rule, evidence, "**inconclusive at this budget**"]
    verdict = {True: "**holds**", False: "**does not hold**", None: "not tested here"}[holds]
    return [claim, rule, evidence, verdict]
