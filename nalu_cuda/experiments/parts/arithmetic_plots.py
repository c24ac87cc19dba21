"""The arithmetic tasks' per-operation plots: :func:`.report.plot_per_op` with their operations' order
and symbols (:data:`.arithmetic_ops.OPS`, :data:`.arithmetic_ops.OP_SYMBOLS`)."""
from __future__ import annotations

from typing import Any, Optional

from .. import report
from .arithmetic_ops import OP_SYMBOLS, OPS

__all__ = ["plot_per_op"]


def plot_per_op(*args: Any, **kwargs: Any) -> Optional[str]:
    """:func:`.report.plot_per_op` (same arguments), one panel per operation in :data:`OPS`' order,
    titled with its symbol (``a + b``, ...)."""
    return report.plot_per_op(*args, ops=OPS, op_titles=OP_SYMBOLS, **kwargs)
