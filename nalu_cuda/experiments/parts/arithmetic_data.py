"""The arithmetic tasks of Trask et al. (2018), Table 1, with Madsen & Johansen's (2020) protocol.

Static task: ``x`` in R^I (I = 100); ``a`` and ``b`` are sums of two overlapping subsets of ``x``
(each ``floor(subset_ratio * I)`` = 25 long, overlapping by ``floor(overlap_ratio * 25)`` = 12, at a
random offset drawn per seed); the target is ``op(a, b)``. Recurrent task: the same over a sequence
``x_1..x_T`` in R^10, ``a`` and ``b`` summing their subsets over every time step.

Everything random derives from integer seeds, so that a member of an ensemble sees exactly the
data and initialisation of a single run with its seed:

* the subset layout from ``seed`` (:func:`subset_layout`);
* the training stream from ``seed`` (:class:`.uniform_stream.UniformStream`, a numpy ``SFC64`` generator: about 4x
  faster than ``torch.rand`` here, which matters when 100 seeds each draw 128 x 100 inputs a step);
* the validation and test sets from fixed data seeds, shared by all members.

The success criterion (Madsen & Johansen 2020, Section 4): the extrapolation MSE, at the step with
the best validation MSE, is below the MSE of an *epsilon-perfect* solution, one whose used weights
are ``1 - eps`` and unused weights ``eps`` (eps = 1e-5), with the exact operation on top. The
threshold is estimated by Monte Carlo in float64 (:func:`mse_threshold`). Their R script
(``export/function_task_static_mse_expectation.r``) indexes ``a.start:a.end`` inclusively, so its
subsets are one element longer (26) than those of their data set (25); :func:`mse_threshold` with
``layout="madsen"`` reproduces their published thresholds, ``layout="task"`` (the default used for
the success criterion here) is the epsilon-perfect solution of the task actually trained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ..argtypes import non_negative_float
from .arithmetic_ops import (EPS_PERFECT, FLOAT32_MAX, OP_ALIASES, OP_SYMBOLS, OPS, PUBLISHED_THRESHOLDS,  # noqa: F401
                             Range, apply_op, as_range, canonical_op, check_targets, largest_target,
                             parse_range)
from .counter_stream import CounterStream
from .seeding import seed_for
from .uniform_stream import SumTargets, UniformStream

__all__ = [
    "OPS",
    "OP_SYMBOLS",
    "OP_ALIASES",
    "canonical_op",
    "Range",
    "parse_range",
    "as_range",
    "TaskParams",
    "task_defaults",
    "SubsetLayout",
    "subset_layout",
    "apply_op",
    "largest_target",
    "check_targets",
    "mse_threshold",
    "recurrent_mse_threshold",
    "PUBLISHED_THRESHOLDS",
    "EPS_PERFECT",
    "normalised_error",
    "seed_for",
]

# The six operations (names as in stable-nalu).
# The operations and ranges (OPS ... Range) live in .arithmetic_ops, below the training streams.


# The regulariser flags (--reg-scale/--reg-start/--reg-end); None, the model's published schedule,
# is left out of a configuration's stored parameters (configurations of earlier versions match).
REG_DEFAULTS: Dict[str, Optional[float]] = {"reg_scale": None, "reg_start": None, "reg_end": None}

# Data and step options of the static and recurrent tasks, stored in a configuration only when they
# differ from these defaults (so the configurations, fingerprints and results of the default CPU
# path stay as they were):
#   stream: "sfc64" (UniformStream: per-seed SFC64 streams drawn on the host, the published runs'
#           numbers) or "counter" (CounterStream: drawn on the training device, with the
#           device-resident step of train_ensemble; other numbers);
#   graph:  with the counter stream on CUDA, the step captured in a CUDA graph and replayed.
#   native: True (the default): the static and recurrent tasks' native one-call training step where the model has
#           one (parts/native_step.py; the autograd step's numbers up to float rounding); False
#           (--autograd-step): the autograd step, the reference.
STEP_DEFAULTS: Dict[str, Any] = {"stream": "sfc64", "graph": True, "native": True}
STREAMS = ("sfc64", "counter")


def training_stream(stream: str, seeds: Sequence[int], shape: Tuple[int, ...], interp: Range, device,
                    masks: Tensor, ops: Sequence[str], chunk: int):
    """The training data of the static and recurrent tasks, ``shape`` per seed and step: for
    ``stream="counter"`` a :class:`.counter_stream.CounterStream`, drawn on ``device`` from (seed,
    step) with its targets there too (nothing to prefetch, nothing to copy); else a prefetching
    :class:`.uniform_stream.UniformStream` (SFC64 on the host, ``chunk`` steps at a time) whose
    targets come from the subset ``masks`` and ``ops``."""
    if stream == "counter":
        return CounterStream(seeds, shape, interp, device=device, masks=masks, ops=ops)
    return UniformStream(seeds, shape, interp, chunk=chunk, prefetch=True, transform=SumTargets(masks.numpy(), ops))


def add_step_arguments(parser) -> None:
    """``--stream`` and ``--no-graph`` of the static and recurrent tasks."""
    parser.add_argument("--stream", choices=STREAMS, default="sfc64",
                        help="training data: sfc64 (default: per-seed SFC64 streams drawn on the host, the published "
                             "runs' numbers) or counter (per-seed counter-based streams, a hash of seed, step and index, "
                             "the same values on the CPU and CUDA, other numbers than sfc64's: on CUDA with a step that "
                             "never waits for the host; the static task's native step draws them in its call or kernel)")
    parser.add_argument("--no-graph", dest="graph", action="store_false",
                        help="with --stream counter on CUDA: run the step eagerly instead of replaying it as a CUDA graph")
    parser.add_argument("--autograd-step", dest="native", action="store_false", default=True,
                        help="train the static task's nac, nalu and nmu models and the recurrent task's nac and nalu "
                             "models with the autograd step (the reference) instead of the native one-call step, the "
                             "default on the CPU (the same numbers up to float rounding: benchmarks/RESULTS.md, section "
                             "20)")
    parser.add_argument("--native-step", dest="native", action="store_true", default=True,
                        help="the native one-call step (the default; kept for existing command lines)")


def add_model_op_arguments(parser, models: Sequence[str]) -> None:
    """``--model`` (one or more of ``models``) and ``--op`` of the static and recurrent tasks."""
    parser.add_argument("--model", nargs="+", default=["nac"], metavar="MODEL",
                        help=f"one or more of: {', '.join(models)} (default: nac)")
    parser.add_argument("--op", nargs="+", default=["add"], metavar="OP",
                        help=f"one or more of: {', '.join(OPS)}, or 'all' (default: add)")


def chosen_ops(args) -> List[str]:
    """The operations given to ``--op`` (``all``: every one of :data:`OPS`)."""
    return list(OPS) if [o.lower() for o in args.op] == ["all"] else args.op


def reg_step_options(args) -> Dict[str, Any]:
    """The regulariser and step options of the command line (:func:`add_reg_arguments`,
    :func:`add_step_arguments`), as configuration parameters."""
    return dict(reg_scale=args.reg_scale, reg_start=args.reg_start, reg_end=args.reg_end, stream=args.stream,
                graph=args.graph, native=args.native)


def step_params(params: Dict, task: str) -> None:
    """Validate ``stream`` in ``params`` in place and drop the step options left at their default."""
    if params.get("stream", "sfc64") not in STREAMS:
        raise ValueError(f"{task}: stream must be one of {STREAMS}, got {params['stream']!r}")
    for k, v in STEP_DEFAULTS.items():
        if params.get(k) == v:
            params.pop(k)


def add_reg_arguments(parser) -> None:
    """The regulariser flags of the static and recurrent tasks."""
    parser.add_argument("--reg-scale", type=non_negative_float, default=None, metavar="LAMBDA",
                        help="regulariser weight at full strength (default: the model's published value; "
                             "nau/nmu: 0.01/10, npu/realnpu: 1e-2, inalu: 1)")
    parser.add_argument("--reg-start", type=non_negative_float, default=None, metavar="STEP",
                        help="step at which the regulariser starts (default: published; nmu 1e6, nau 5e3)")
    parser.add_argument("--reg-end", type=non_negative_float, default=None, metavar="STEP",
                        help="step at which it reaches full strength (default: published; nmu 2e6, nau 5e4)")


def reg_params(params: Dict, check: Callable[[str, Dict], Any]) -> None:
    """Validate the regulariser overrides in ``params`` in place (``check(model, reg)`` raises on a
    bad combination) and drop the ones left at None."""
    reg = {k[4:]: params.get(k) for k in REG_DEFAULTS}
    check(params["model"], reg)
    for k in REG_DEFAULTS:
        if params.get(k) is None:
            params.pop(k, None)


@dataclass(frozen=True)
class TaskParams:
    """The parameters the static and recurrent tasks share, typed: one configuration's
    ``Config.params`` (JSON: ranges as lists) parsed once by :func:`..params.task_params`, with
    :func:`task_defaults` of the task's ``DEFAULTS``. A task subclasses it with its own fields."""

    model: str
    ops: Tuple[str, ...]
    interp: Range
    extrap: Range
    input_size: int
    subset_ratio: float
    overlap_ratio: float
    hidden: int
    lr: float
    batch: int
    eval_every: int
    n_valid: int
    n_test: int
    baseline_models: int
    seed_offset: int
    data_seed: int
    backend: str
    eps: float
    threshold_samples: int
    reg_scale: Optional[float]
    reg_start: Optional[float]
    reg_end: Optional[float]
    stream: str
    graph: bool
    native: bool

    @property
    def reg(self) -> Dict[str, Optional[float]]:
        """The regulariser overrides (None: the model's published value), for ``training_hooks``."""
        return {"scale": self.reg_scale, "start": self.reg_start, "end": self.reg_end}


def task_defaults(defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The defaults of a static or recurrent configuration's parameters: the task's ``DEFAULTS`` and
    the regulariser and step options that configurations store only when they differ."""
    return {**REG_DEFAULTS, **STEP_DEFAULTS, **defaults}


# ------------------------------------------------------------------------------------------------
# Subsets
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubsetLayout:
    """``a = sum(x[a_start:a_end])``, ``b = sum(x[b_start:b_end])`` (0-based, end exclusive)."""

    input_size: int
    a_start: int
    a_end: int
    b_start: int
    b_end: int

    def mask(self, dtype=torch.float32) -> Tensor:
        """``(input_size, 2)`` 0/1 matrix: ``x @ mask`` gives ``(a, b)``."""
        m = torch.zeros(self.input_size, 2, dtype=dtype)
        m[self.a_start:self.a_end, 0] = 1
        m[self.b_start:self.b_end, 1] = 1
        return m


def subset_sizes(input_size: int, subset_ratio: float, overlap_ratio: float) -> Tuple[int, int]:
    size = int(math.floor(subset_ratio * input_size))
    overlap = int(math.floor(overlap_ratio * size))
    if size < 1:
        raise ValueError(f"subset ratio {subset_ratio} of {input_size} inputs leaves an empty subset")
    if 2 * size - overlap > input_size:
        raise ValueError(f"two subsets of {size} overlapping by {overlap} do not fit in {input_size} inputs")
    return size, overlap


def subset_layout(seed: int, input_size: int, subset_ratio: float = 0.25, overlap_ratio: float = 0.5,
                  random_offset: bool = True) -> SubsetLayout:
    """Madsen & Johansen's layout: fixed sizes, an offset drawn from the seed (0 if not random)."""
    size, overlap = subset_sizes(input_size, subset_ratio, overlap_ratio)
    span = 2 * size - overlap
    start = 0
    if random_offset:
        start = int(np.random.default_rng(seed_for(seed, "subset")).integers(0, input_size - span + 1))
    return SubsetLayout(input_size, start, start + size, start + size - overlap, start + 2 * size - overlap)


# ------------------------------------------------------------------------------------------------
# Thresholds of the success criterion
# ------------------------------------------------------------------------------------------------


def normalised_error(mse: float, base: float) -> Optional[float]:
    """The paper's normalised error: ``100 * mse / base``, with ``base`` the mean MSE of randomly
    initialised models of the same architecture (100 = random, 0 = perfect); None where undefined."""
    if not (math.isfinite(mse) and base and math.isfinite(base) and base > 0):
        return None
    return 100.0 * mse / base


def _mc_chunks(samples: int, chunk: int):
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        yield n
        done += n


def mse_threshold(op: str, extrap: Range, input_size: int = 100, subset_ratio: float = 0.25,
                  overlap_ratio: float = 0.5, eps: float = EPS_PERFECT, samples: int = 1_000_000,
                  seed: int = 0, layout: str = "task") -> float:
    """MSE of the epsilon-perfect static solution on ``extrap``, by Monte Carlo in float64.

    The first layer has ``1 - eps`` on the subset weights and ``eps`` everywhere else; the exact
    operation is applied to its two outputs. ``layout="task"``: the subsets of the data
    (``floor(ratio * I)`` long); ``layout="madsen"``: one longer, as in Madsen & Johansen's R script
    that produced their published thresholds. Only the subset sizes matter (inputs are i.i.d.).
    """
    op = canonical_op(op)
    size, overlap = subset_sizes(input_size, subset_ratio, overlap_ratio)
    if layout == "madsen":
        a_len, b_len, overlap_len = size + 1, size + 1, overlap + 1
    elif layout == "task":
        a_len, b_len, overlap_len = size, size, overlap
    else:
        raise ValueError(f"layout must be 'task' or 'madsen', got {layout!r}")
    a_only, b_only = a_len - overlap_len, b_len - overlap_len
    rng = np.random.default_rng(seed_for(seed, f"threshold-{op}"))
    total = 0.0
    for n in _mc_chunks(samples, 50_000):
        x = extrap.sample(rng, (n, input_size))
        sa = x[:, :a_only].sum(1)
        so = x[:, a_only:a_only + overlap_len].sum(1)
        sb = x[:, a_only + overlap_len:a_only + overlap_len + b_only].sum(1)
        s = x.sum(1)
        a0, b0 = sa + so, sb + so
        # (1 - eps) on the used inputs and eps on the others: a_eps = a0 + eps (S - 2 a0)
        a1, b1 = a0 + eps * (s - 2 * a0), b0 + eps * (s - 2 * b0)
        err = apply_op(op, a1, b1) - apply_op(op, a0, b0)
        total += float(np.sum(err * err))
    return total / samples


def recurrent_mse_threshold(op: str, extrap: Range, length: int, input_size: int = 10,
                            subset_ratio: float = 0.25, overlap_ratio: float = 0.5,
                            eps: float = EPS_PERFECT, samples: int = 10_000, seed: int = 0) -> float:
    """The same for the recurrent task: an epsilon-perfect recurrent accumulator.

    ``h_t = x_t W_x + h_{t-1} W_h`` with ``W_x`` = ``1 - eps`` on the subsets and ``eps`` elsewhere,
    ``W_h`` = ``1 - eps`` on the diagonal and ``eps`` off it; the exact operation on ``h_T``.
    ``W_h`` has eigenvectors (1, 1) (eigenvalue 1) and (1, -1) (eigenvalue 1 - 2 eps), so
    ``h_T`` follows from the per-step sums without a loop over time.
    """
    op = canonical_op(op)
    size, overlap = subset_sizes(input_size, subset_ratio, overlap_ratio)
    rng = np.random.default_rng(seed_for(seed, f"rthreshold-{op}-{length}"))
    decay = (1 - 2 * eps) ** np.arange(length - 1, -1, -1, dtype=np.float64)  # weight of step t in h_T
    total = 0.0
    chunk = max(1, 2_000_000 // (length * input_size))
    for n in _mc_chunks(samples, chunk):
        x = extrap.sample(rng, (n, length, input_size))
        a_t = x[..., :size].sum(-1)
        b_t = x[..., size - overlap:2 * size - overlap].sum(-1)
        s_t = x.sum(-1)
        u1 = a_t + eps * (s_t - 2 * a_t)
        u2 = b_t + eps * (s_t - 2 * b_t)
        plus = (u1 + u2).sum(1)
        minus = ((u1 - u2) * decay).sum(1)
        h1, h2 = 0.5 * (plus + minus), 0.5 * (plus - minus)
        a0, b0 = a_t.sum(1), b_t.sum(1)
        err = apply_op(op, h1, h2) - apply_op(op, a0, b0)
        total += float(np.sum(err * err))
    return total / samples
