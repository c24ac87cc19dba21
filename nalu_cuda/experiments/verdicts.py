"""One verdict rule for every claim the report checks (every task's report section uses :func:`verdict`).

A claim gets one of:

* **holds** / **does not hold**: the outcome is final. It is final when more training could not
  change it (a claim that a model *succeeds*, once it succeeded; a claim that a model *fails*, once
  it succeeded anyway), when the run's budget reached the published one (at least as many seeds AND
  at least as many steps: :meth:`Budget.covers`), or when the outcome is structural (the
  architecture cannot do otherwise, whatever the training; the report says why).
* **inconclusive at this budget** (with both budgets beside it, and what the published one would
  cost on one CPU core: :mod:`.costs`), otherwise: a failure that more
  seeds or more steps could overturn is not evidence against a claim, and an observed failure is
  not evidence for a claim that a model fails.
* **not tested here**: the cells the claim needs did not run.

The published budget of a claim is what the experiment's ``paper`` profile runs (its
``profile_configs("paper")``: the published seeds and steps, where a paper states them), found
by :func:`published_budget`, or what the experiment declares instead (its ``published_budget``: the
static task's is Madsen & Johansen's 100 seeds x 5e6 steps).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Tuple

from .costs import estimated_hours, fmt_hours
from .registry import get

__all__ = ["Budget", "verdict", "published_budget", "run_budget", "fmt_steps", "VERDICT_RULE",
           "HOLDS", "DOES_NOT_HOLD", "INCONCLUSIVE", "NOT_TESTED"]

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_TESTED = ("holds", "does not hold", "inconclusive at this budget",
                                                  "not tested here")

VERDICT_RULE = (
    "**Verdicts** (one rule for every claim): *holds* / *does not hold* where the outcome is final, i.e. more "
    "training could not change it (a model that should succeed did; a model that should fail succeeded anyway), "
    "or the run's budget reached the published one (at least as many seeds and at least as many steps), or the "
    "outcome is structural (the architecture cannot do otherwise; the reason is given). Otherwise the verdict is "
    "*inconclusive at this budget*, with our budget and the published one beside it: a failure that more seeds "
    "or steps could overturn is evidence neither against a claim that a model succeeds nor for a claim that it "
    "fails.")


def fmt_steps(steps: float) -> str:
    """``5e3``, ``1.5e6``, ``300`` (a step count as a short number)."""
    steps = float(steps)
    if steps < 1000:
        return f"{steps:g}"
    exp = len(str(int(steps))) - 1
    mant = steps / 10 ** exp
    return f"{mant:.2g}e{exp}"


@dataclass(frozen=True)
class Budget:
    """Seeds x steps of a run (the largest over the cells a claim looks at) or of a publication."""

    seeds: int
    steps: float
    # A published budget's cost: estimated hours on one CPU core to run the claim's configurations of
    # the experiment's ``paper`` profile (:mod:`.costs`); None where unknown. Not part of ``covers``.
    hours: Optional[float] = field(default=None, compare=False)

    def covers(self, other: "Budget") -> bool:
        """At least ``other``'s seeds and at least its steps."""
        return self.seeds >= other.seeds and self.steps >= other.steps

    def __str__(self) -> str:
        return f"{self.seeds} seeds x {fmt_steps(self.steps)} steps"

    def short(self) -> str:
        return f"{self.seeds} x {fmt_steps(self.steps)}"


def run_budget(cells: Iterable[Any]) -> Optional[Budget]:
    """The budget a claim was tested at: the fewest seeds and the fewest steps over its ``cells``
    (summary dicts with ``seeds``/``steps``, or :class:`~.registry.Config` / ``ConfigResult``s); a
    claim is only as well tested as its weakest cell."""
    seeds, steps = [], []
    for c in cells:
        c = getattr(c, "config", c)
        get = c.get if isinstance(c, dict) else (lambda k, c=c: getattr(c, k, None))
        if get("seeds") is not None and get("steps") is not None:
            seeds.append(int(get("seeds")))
            steps.append(float(get("steps")))
    return Budget(min(seeds), min(steps)) if seeds else None


@functools.lru_cache(maxsize=None)
def _paper_budgets(experiment: str) -> Tuple[Tuple[Tuple[str, ...], int, float], ...]:
    try:
        cfgs = get(experiment).profile_configs("paper")
    except Exception:  # unknown experiment or no paper profile: no published budget
        return ()
    out = []
    for c in cfgs:
        p = c.params or {}
        keys = tuple(str(p[k]) for k in ("model", "agent", "head", "final") if p.get(k) is not None) + (c.name,)
        out.append((keys, int(c.seeds), float(c.steps), estimated_hours([c])))
    return tuple(out)


def published_budget(experiment: str, models: Sequence[str] = ()) -> Optional[Budget]:
    """The published budget of a claim about ``models`` (model/agent/head names, or configuration
    names) of ``experiment``: the largest seeds and steps of its ``paper`` profile's configurations
    of those models (of all of them where none matches); None where the experiment has no paper
    profile; what the experiment declares as its ``published_budget`` where it does."""
    try:
        declared = get(experiment).published_budget
    except ValueError:  # unknown experiment: its paper profile's, none
        declared = None
    rows = _paper_budgets(experiment)
    chosen = [r for r in rows if any(m in r[0] for m in models)] or list(rows)
    hours = sum(r[3] for r in chosen) if chosen else None
    if declared is not None:
        return Budget(*declared, hours=hours)
    if not rows:
        return None
    return Budget(max(r[1] for r in chosen), max(r[2] for r in chosen), hours=hours)


def verdict(holds: Optional[bool], budget: Optional[Budget], published: Optional[Budget], *,
            negative: bool = False, budget_bound: Optional[bool] = None, structural: Optional[str] = None,
            bold: bool = True) -> str:
    """The verdict of a claim by :data:`VERDICT_RULE`.

    ``holds``: what the rule applied to our numbers says (None: not tested). ``negative``: the claim
    is that something *fails*, so an observed "holds" is what more training could overturn.
    ``budget_bound`` overrides that judgement (whether more seeds or steps could change this
    outcome). ``structural``: why the outcome cannot depend on the budget (then it is final, and
    the reason is printed beside it). ``budget``: ours (:func:`run_budget`); ``published``:
    :func:`published_budget`.
    """
    b = (lambda t: f"**{t}**") if bold else (lambda t: t)
    if holds is None:
        return NOT_TESTED
    word = HOLDS if holds else DOES_NOT_HOLD
    if budget_bound is None:
        budget_bound = holds if negative else not holds
    if not budget_bound:
        return b(word)
    if structural:
        return f"{b(word)} (structural: {structural})"
    if budget is not None and published is not None and budget.covers(published):
        return f"{b(word)} (at the published budget: {budget}; published {published.short()})"
    ours = "budget unknown" if budget is None else str(budget)
    pub = "no published budget" if published is None else f"published {published.short()}"
    if published is not None and published.hours is not None:
        pub += f", which would take {fmt_hours(published.hours)} on one CPU core"
    return f"{b(INCONCLUSIVE)} ({ours}; {pub})"
