"""Blocks of seeds: one configuration's seeds trained as several smaller ensembles, merged into the
result a single run of the whole configuration writes.

A block of seeds ``[lo, hi)`` of configuration ``C`` is itself a configuration (:func:`block_config`):
``C`` with ``hi - lo`` seeds from ``seed_offset + lo``, named ``<C.name>/seeds-<lo>-<hi>``, so it lives in
``runs/<experiment>/<C.name>/seeds-<lo>-<hi>/`` (its ``result.json``, its checkpoint), is run by
:func:`.runner.run_one` like any configuration, and is resumed, refused or overwritten by the same
rules. Only the merged ``result.json`` of ``C`` is a result of the run (the summary, CSVs and report
never see a block); the block directories are removed once it is written.

Which experiments split: those whose members are independent streams, which declare their merge
rules (``merges`` of their :class:`~.registry.Experiment`, gathered in :data:`MERGES`): ``static``,
``identity`` and ``recurrent``. Their seeds are ``seed_offset + 0 .. seeds - 1``, every member
draws its own data stream and initialisation from its own seed (:class:`.parts.uniform_stream.UniformStream`,
:func:`.parts.seeding.member_generators`), the loss is a sum over members and Adam is elementwise,
divergence is handled per member, the random-model baselines and success thresholds use fixed seeds of
their own, and a member's evaluation does not depend on the ensemble's size
(:func:`.parts.training.evaluate_mse`). So a block's per-seed records are, bit for bit, those of the
same seeds in the whole ensemble (tested for all three). What does depend on the whole ensemble is a few
configuration-level ``extra`` fields (medians and means over the members for the plots); the tasks store
the per-member values they come from, and the merge recomputes them in the same way. The other
experiments (parity, programs, language, digits, gridworld) stay whole: they have no ``seed_offset``,
and some share data or evaluation across members.

Merging (:func:`merge`): the records of a configuration are op-major (every op's seeds in order); the
blocks' records are interleaved back into that order; the summary is recomputed from all records by
the experiment's own ``summarize``; each ``extra`` field is merged by the rule the experiment declares
(the rules are here: :func:`same`, :func:`total`, :func:`union`, :func:`history`, :func:`median_curve`,
:func:`concat`, :func:`member_curve`; a field with no rule must be equal in every block, else the merge
stops with a :class:`RunError`). The blocks run in :func:`.runner.run_blocks`.
"""
from __future__ import annotations

import math
import os
import re
import shutil
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .integrity import config_dir, damaged, load_result, result_problem
from .outdir import RunError
from .registry import Config, RunOutput, all_experiments, get

__all__ = ["MERGES", "splittable", "is_block", "block_config", "even_blocks", "layout", "on_disk", "merge",
           "nonfinite", "remove_blocks", "same", "total", "union", "history", "median_curve", "concat",
           "member_curve"]

Range = Tuple[int, int]
_BLOCK_DIR = re.compile(r"^seeds-(\d+)-(\d+)$")


def is_block(cfg: Config) -> bool:
    return "/" in cfg.name


def block_config(cfg: Config, lo: int, hi: int) -> Config:
    """Seeds ``[lo, hi)`` of ``cfg`` as a configuration of its own."""
    if not 0 <= lo < hi <= cfg.seeds:
        raise ValueError(f"seed block [{lo}, {hi}) outside the {cfg.seeds} seeds of {cfg.key}")
    params = dict(cfg.params, seed_offset=int(cfg.params.get("seed_offset", 0)) + lo)
    return Config(cfg.experiment, f"{cfg.name}/seeds-{lo}-{hi}", hi - lo, cfg.steps, params)


def even_blocks(lo: int, hi: int, k: int) -> List[Range]:
    """``[lo, hi)`` in ``k`` blocks of sizes differing by at most one (the larger first)."""
    n = hi - lo
    k = max(1, min(k, n))
    out, pos = [], lo
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        out.append((pos, pos + size))
        pos += size
    return out


def layout(seeds: int, done: Sequence[Range], started: Sequence[Range], blocks_for: Callable[[int, int], int]) -> List[Range]:
    """The blocks of a configuration of ``seeds`` seeds: the ``done`` blocks, then the ``started`` ones
    (checkpointed), as long as they do not overlap what is kept already; every gap ``[lo, hi)`` left
    is split into ``blocks_for(lo, hi)`` even blocks."""
    kept: List[Range] = []
    for lo, hi in list(sorted(set(done))) + list(sorted(set(started))):
        if 0 <= lo < hi <= seeds and all(hi <= a or lo >= b for a, b in kept):
            kept.append((lo, hi))
    out: List[Range] = []
    pos = 0
    for lo, hi in sorted(kept) + [(seeds, seeds)]:
        if lo > pos:
            out += even_blocks(pos, lo, blocks_for(pos, lo))
        if hi > lo:
            out.append((lo, hi))
        pos = hi
    return out


def _block_dirs(out_dir: str, cfg: Config) -> List[Tuple[Range, str]]:
    d = config_dir(out_dir, cfg)
    found = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        m = _BLOCK_DIR.match(name)
        if m and os.path.isdir(os.path.join(d, name)):
            found.append(((int(m.group(1)), int(m.group(2))), os.path.join(d, name)))
    return found


def on_disk(out_dir: str, cfg: Config) -> Tuple[List[Range], List[Range], List[str]]:
    """The blocks of ``cfg`` in ``out_dir``: finished (a valid result of this very block), started (a
    checkpoint), and the files of blocks that belong to other settings (damaged, or another fingerprint)."""

    done, started, foreign = [], [], []
    for (lo, hi), d in _block_dirs(out_dir, cfg):
        rp, ck = os.path.join(d, "result.json"), os.path.join(d, "checkpoint.pt")
        fits = 0 <= lo < hi <= cfg.seeds
        if os.path.exists(rp):
            data, problem = load_result(rp)
            if fits and problem is None and data["fingerprint"] == block_config(cfg, lo, hi).fingerprint():
                done.append((lo, hi))
            else:
                foreign.append(rp)
        elif os.path.exists(ck):
            (started if fits else foreign).append((lo, hi) if fits else ck)
    return done, started, foreign


def remove_blocks(out_dir: str, cfg: Config) -> None:
    """Remove the block directories of ``cfg``; the damaged files kept in one stay (and so does it)."""
    for _, d in _block_dirs(out_dir, cfg):
        if not any(".damaged" in name for name in os.listdir(d)):
            shutil.rmtree(d, ignore_errors=True)
            continue
        for name in ("result.json", "checkpoint.pt"):
            if os.path.exists(os.path.join(d, name)):
                os.unlink(os.path.join(d, name))


def check_existing(cfg: Config, out_dir: str, *, resume: bool, overwrite: bool, log) -> None:
    """The runner's rules for the blocks of ``cfg`` in ``out_dir`` (see :func:`.runner._existing`); with
    ``resume``, a damaged result of a block is moved aside (a warning to ``log``) and the block rerun."""
    if overwrite:
        remove_blocks(out_dir, cfg)
        return
    for (lo, hi), d in _block_dirs(out_dir, cfg) if resume else []:
        rp = os.path.join(d, "result.json")
        problem = load_result(rp)[1] if os.path.exists(rp) and 0 <= lo < hi <= cfg.seeds else None
        if problem is not None:
            damaged(rp, "result file", problem, block_config(cfg, lo, hi), resume, log)
    done, started, foreign = on_disk(out_dir, cfg)
    if foreign:
        raise RunError(f"{foreign[0]} (a block of seeds of {cfg.key}) is damaged or holds results of other settings "
                       "of this configuration. Use another --out, --resume to recompute a damaged one, or --overwrite "
                       "to replace them")
    if (done or started) and not resume:
        raise RunError(f"{cfg.key} has finished or started blocks of seeds in {out_dir} (from a sharded run): pass "
                       "--resume to continue from them, or --overwrite to recompute")


def nonfinite(records: Sequence[Dict[str, Any]]) -> List[List[Any]]:
    """``[index, key, "nan" | "inf" | "-inf"]`` of every non-finite float of the records (a block's
    ``result.json`` keeps them: JSON has null for all three, and a summary may tell them apart)."""
    return [[i, k, repr(v)] for i, r in enumerate(records) for k, v in r.items()
            if isinstance(v, float) and not math.isfinite(v)]


# -- merging: the rules an experiment declares for the fields of its ``extra`` -------------------------


def _regroup(parts: Sequence[Sequence[Any]], sizes: Sequence[int], groups: int) -> List[Any]:
    """Member-ordered lists of the blocks (each ``groups`` runs of its seeds) in the whole ensemble's order."""
    return [v for g in range(groups) for part, n in zip(parts, sizes) for v in part[g * n:(g + 1) * n]]


def floats(values: Sequence[Any]) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)


def same(key: str, values: Sequence[Any], ctx) -> Any:
    if any(v != values[0] for v in values[1:]):
        raise RunError(f"cannot merge the seed blocks of {ctx['key']}: extra field {key!r} differs between blocks")
    return values[0]


def total(key, values, ctx):
    return sum(values)


def union(key, values, ctx):
    return {k: v for d in values for k, v in d.items()}


def history(key, values, ctx):
    """Rows ``[step, member values...]``: the steps are the same in every block."""
    rows = []
    for block_rows in zip(*values):
        same(key, [r[0] for r in block_rows], ctx)
        rows.append([block_rows[0][0]] + _regroup([r[1:] for r in block_rows], ctx["sizes"], ctx["groups"]))
    if len({len(v) for v in values}) > 1:
        raise RunError(f"cannot merge the seed blocks of {ctx['key']}: {key!r} has different lengths")
    return rows


def median_curve(axis: str) -> Callable:
    """``{axis: points, "median_mse": {op: per point}, "member_mse": [per point: per member]}``: the
    median over the members of each op that did not diverge and have a finite value (as the tasks'
    ``_range_curve`` / ``_length_curve`` compute it)."""

    def merge_curve(key, values, ctx):
        points = same(key, [v[axis] for v in values], ctx)
        members = [_regroup([v["member_mse"][j] for v in values], ctx["sizes"], ctx["groups"])
                   for j in range(len(points))]
        S, diverged = sum(ctx["sizes"]), torch.tensor(ctx["diverged"])
        med: Dict[str, List[Optional[float]]] = {op: [] for op in ctx["ops"]}
        for vals in members:
            mse = floats(vals)
            for j, op in enumerate(ctx["ops"]):
                m = mse[j * S:(j + 1) * S][~diverged[j * S:(j + 1) * S]]
                m = m[torch.isfinite(m)]
                med[op].append(float(m.median()) if m.numel() else None)
        return {axis: points, "median_mse": med, "member_mse": members}

    return merge_curve


def member_curve(curve: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """A derived field (``derived_merges``): ``curve(per-member rows, diverged)`` over the merged
    per-member rows of its source field (e.g. the identity task's mean absolute error curve)."""

    def merge_members(key, values, ctx):
        rows = [r for v in values for r in v]
        return curve(torch.stack([floats(r) for r in rows]), torch.tensor(ctx["diverged"])).tolist()

    return merge_members


def concat(key, values, ctx):
    return [v for part in values for v in part]


class _Merges(Mapping):
    """Per experiment that splits: how each field of ``extra`` merges (its ``merges``, declared by the
    experiment itself; a field not named must be the same in every block)."""

    def _declared(self) -> Dict[str, Dict[str, Callable]]:
        return {e.name: e.merges for e in all_experiments() if e.merges is not None}

    def __getitem__(self, name: str) -> Dict[str, Callable]:
        return self._declared()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._declared())

    def __len__(self) -> int:
        return len(self._declared())


MERGES: Mapping[str, Dict[str, Callable]] = _Merges()


def splittable(cfg: Config) -> bool:
    return cfg.experiment in MERGES and cfg.seeds > 1 and not is_block(cfg)


def merge(cfg: Config, parts: Sequence[Tuple[Range, Dict[str, Any]]]) -> Tuple[RunOutput, float, str]:
    """The blocks' ``result.json`` data (covering ``[0, cfg.seeds)``) -> the whole configuration's
    output, its training time (the blocks' sum) and its device(s)."""

    parts = sorted(parts, key=lambda p: p[0][0])
    pos = 0
    for (lo, hi), data in parts:
        problem = result_problem(data)  # results gathered from other ranks are checked here
        if problem is not None:
            raise RunError(f"cannot merge the seed blocks of {cfg.key}: the result of block [{lo}, {hi}) is "
                           f"damaged ({problem})")
        if lo != pos or data["fingerprint"] != block_config(cfg, lo, hi).fingerprint():
            raise RunError(f"cannot merge the seed blocks of {cfg.key}: block [{lo}, {hi}) does not fit")
        pos = hi
    if pos != cfg.seeds:
        raise RunError(f"cannot merge the seed blocks of {cfg.key}: they cover {pos} of its {cfg.seeds} seeds")
    sizes = [hi - lo for (lo, hi), _ in parts]
    blocks_records = []
    for _, data in parts:
        recs = [dict(r) for r in data["records"]]
        for i, k, v in data.get("nonfinite", []):
            recs[i][k] = float(v)
        blocks_records.append(recs)
    groups = len(blocks_records[0]) // sizes[0]
    if any(len(r) != groups * n for r, n in zip(blocks_records, sizes)):
        raise RunError(f"cannot merge the seed blocks of {cfg.key}: their records are not {groups} per seed")
    records = _regroup(blocks_records, sizes, groups)
    ctx = {"key": cfg.key, "sizes": sizes, "groups": groups, "ops": list(cfg.params.get("ops", [None])),
           "diverged": [bool(r.get("diverged")) for r in records]}
    exp = get(cfg.experiment)
    rules, derived = exp.merges or {}, exp.derived_merges
    extra: Dict[str, Any] = {}
    keys = list(parts[0][1].get("extra", {}))
    for key in keys:
        if key not in derived:
            values = [data.get("extra", {}).get(key) for _, data in parts]
            extra[key] = rules.get(key, same)(key, values, ctx)
    for key in keys:
        if key in derived:
            source, rule = derived[key]
            extra[key] = rule(key, [data["extra"][source] for _, data in parts], ctx)
    extra = {k: extra[k] for k in keys}  # the order a single run writes
    wall = sum(float(data.get("wall_s", 0.0)) for _, data in parts)
    device = ", ".join(dict.fromkeys(str(data.get("device", "")) for _, data in parts))
    return RunOutput(records, extra), wall, device

