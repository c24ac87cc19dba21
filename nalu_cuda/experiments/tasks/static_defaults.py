"""The static task's defaults, below both :mod:`.static` (the task) and :mod:`.static_report` (its
report), which read them."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["DEFAULTS", "RANGE_SCALES"]

DEFAULTS: Dict[str, Any] = dict(
    interp=[[1.0, 2.0]], extrap=[[2.0, 6.0]], input_size=100, subset_ratio=0.25, overlap_ratio=0.5, hidden=2,
    lr=1e-3, batch=128, eval_every=1000, n_valid=10_000, n_test=10_000, baseline_models=100, seed_offset=0,
    data_seed=0, backend="auto", eps=1e-7, threshold_samples=1_000_000, threshold_layout="task",
    lr_milestones=[], lr_gamma=0.1,
)

# The range scales of the error-vs-range plot.
RANGE_SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
