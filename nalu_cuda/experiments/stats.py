"""Statistics over the seeds of one configuration: every summary and report uses these.

* :func:`wilson_interval`: the 95% Wilson score interval of a rate (success, divergence), as
  Madsen & Johansen report it.
* :func:`mean_ci`: the mean over seeds and its 95% Student-t interval, for continuous quantities
  only (errors, MAEs); :func:`rate_ci`: the mean of a per-seed rate (accuracy, success fraction)
  and its bounded interval (a Wilson interval at the seeds' effective sample size; :func:`is_rate_key`
  says which keys are rates). A rate's interval never leaves [0, 1].
* :func:`median` / :func:`mean` over the finite values.
* :func:`default_summary`: a configuration's ``summary.json`` record from its per-seed records;
  :func:`interval_summary` adds ``<key>_mean`` / ``<key>_ci`` for every numeric per-seed key.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, List, Optional, Protocol, Tuple


class ConfigLike(Protocol):
    """What a summary reads of a configuration (a :class:`.registry.Config`; this module sits below the
    registry, which builds on it)."""

    experiment: str
    name: str
    seeds: int
    steps: int
    params: Dict[str, Any]

__all__ = ["wilson_interval", "mean_ci", "rate_ci", "is_rate_key", "median", "mean", "finite", "default_summary", "interval_summary"]




def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple:
    """The 95% Wilson score interval of a binomial rate (what Madsen & Johansen report)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, round(centre - half, 12)), min(1.0, round(centre + half, 12)))


def finite(values) -> List[float]:
    out = []
    for v in values:
        if v is None:
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


def median(values) -> Optional[float]:
    vals = sorted(finite(values))
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])


def mean(values) -> Optional[float]:
    vals = finite(values)
    return sum(vals) / len(vals) if vals else None


def default_summary(config: ConfigLike, records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``summary.json`` record: identity, parameters, and statistics of the standard keys.

    Rates come with 95% Wilson intervals (``*_ci``); errors with median and mean over seeds
    (non-finite values, e.g. of diverged seeds, are left out of means and medians and counted by
    ``divergence_rate`` instead).
    """
    n = len(records)
    out: Dict[str, Any] = {"experiment": config.experiment, "config": config.name, "seeds": config.seeds,
                           "steps": config.steps}
    for k, v in config.params.items():
        out.setdefault(k, v)
    for key, rate in (("success", "success_rate"), ("diverged", "divergence_rate")):
        # Once any seed reports the key, a seed without it counts as False (over all n seeds).
        if n and any(r.get(key) is not None for r in records):
            k = sum(bool(r.get(key)) for r in records)
            out[rate] = k / n
            out[rate.replace("_rate", "_count")] = k
            out[rate.replace("rate", "ci")] = list(wilson_interval(k, n))
    if any("solved_at" in r for r in records):
        solved = [r.get("solved_at") for r in records if r.get("success") and r.get("solved_at") is not None]
        out["solved_at_median"] = median(solved)
    for key in ("interp_error", "extrap_error", "interp_mse", "extrap_mse", "sparsity_error", "accuracy"):
        if any(key in r for r in records):
            vals = [r.get(key) for r in records]
            out[f"{key}_median"] = median(vals)
            out[f"{key}_mean"] = mean(vals)
    # Madsen & Johansen report the sparsity error over the successful seeds only.
    sp = mean(r.get("sparsity_error") for r in records if r.get("success"))
    if sp is not None:
        out["sparsity_error_solved_mean"] = sp
    out["n_records"] = n
    return out


def mean_ci(values: Iterable[float], level: float = 0.95) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """Mean over seeds and its Student-t interval (``(mean, lo, hi)``; non-finite values dropped)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return (None, None, None)
    n = len(vals)
    mean = sum(vals) / n
    if n == 1:
        return (mean, mean, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    try:
        from scipy.stats import t as student_t  # local: scipy is slow to import and only this needs it

        q = float(student_t.ppf(0.5 + level / 2, n - 1))
    except Exception:  # scipy comes with scikit-learn; this is only a fallback
        q = 1.959963984540054
    half = q * sd / math.sqrt(n)
    return (mean, mean - half, mean + half)


def rate_ci(values: Iterable[float], level: float = 0.95) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """Mean over seeds of a per-seed rate in [0, 1] and its bounded 95% interval (``(mean, lo, hi)``;
    non-finite values dropped).

    The Wilson score interval with the effective number of trials that matches the observed spread
    between seeds (``n_eff = n p (1 - p) / s^2``, at least 1) and the Student-t quantile of ``n - 1``
    degrees of freedom: away from 0 and 1 it is the Student-t interval of the mean, near them it
    bends inside [0, 1] instead of crossing it (a Student-t interval over 2 seeds' rates can reach
    [-0.65, 0.80]). One seed, or seeds that all agree, give a point, as the Student-t interval does."""
    vals = [min(1.0, max(0.0, float(v))) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return (None, None, None)
    n = len(vals)
    p = sum(vals) / n
    var = sum((v - p) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    if var <= 0 or max(vals) == min(vals):
        return (p, p, p)
    n_eff = max(1.0, n * p * (1 - p) / var)
    z = _t_quantile(level, n - 1)
    denom = 1 + z * z / n_eff
    centre = (p + z * z / (2 * n_eff)) / denom
    half = z * math.sqrt(p * (1 - p) / n_eff + z * z / (4 * n_eff * n_eff)) / denom
    return (p, min(p, max(0.0, round(centre - half, 12))), max(p, min(1.0, round(centre + half, 12))))


def _t_quantile(level: float, dof: int) -> float:
    try:
        from scipy.stats import t as student_t  # local: scipy is slow to import and only this needs it

        return float(student_t.ppf(0.5 + level / 2, dof))
    except Exception:  # scipy comes with scikit-learn; this is only a fallback
        return 1.959963984540054


# Per-seed keys that are rates in [0, 1]: accuracies, success fractions, error rates (1 - accuracy).
_RATE_KEY = re.compile(r"^(accuracy|error)(_.*)?$|(^|_)(acc|success|rate)(_|$)")


def is_rate_key(key: str, values: Iterable[Any] = ()) -> bool:
    """Whether a per-seed key is a rate (its summary interval is then :func:`rate_ci`'s, not a
    Student-t one): its name says so (``accuracy``, ``error``, ``acc_*``, ``*_success*``, ...) and
    every finite value lies in [0, 1]."""
    if not _RATE_KEY.search(key):
        return False
    return all(0.0 <= v <= 1.0 for v in finite(values))


_SKIP = {"seed", "best_step", "diverged", "success", "solved_at"}


def interval_summary(config: ConfigLike, records: List[Dict[str, Any]], extra: Dict[str, Any]) -> Dict[str, Any]:
    """The registry's default summary plus ``<key>_mean`` and ``<key>_ci`` for every numeric per-seed
    key: a rate's (:func:`is_rate_key`) is the bounded :func:`rate_ci` interval, any other key's the
    95% Student-t interval over seeds (non-finite values left out; ``<key>_n`` says how many
    counted; ``<key>_ci_kind`` says which interval it is)."""
    out = default_summary(config, records)
    keys = []
    for r in records:
        for k, v in r.items():
            if k in _SKIP or k in keys or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            keys.append(k)
    for k in keys:
        vals = [r.get(k) for r in records]
        rate = is_rate_key(k, vals)
        m, lo, hi = (rate_ci if rate else mean_ci)(vals)
        out[f"{k}_mean"] = m
        out[f"{k}_ci"] = [lo, hi]
        out[f"{k}_ci_kind"] = "wilson" if rate else "student-t"
        out[f"{k}_n"] = sum(1 for r in records if isinstance(r.get(k), (int, float)) and math.isfinite(r[k]))
    if records and any("diverged" in r for r in records):
        out["diverged_count"] = sum(bool(r.get("diverged")) for r in records)
    return out
