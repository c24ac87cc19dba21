"""What the static and recurrent tasks make of a trained ensemble: the per-seed records and the
per-operation summaries (both tasks train ``len(ops) x seeds`` members as one ensemble, member
``k`` on operation ``ops[k // seeds]``)."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..registry import Config, default_summary
from . import arithmetic_data as ar
from .arithmetic_models import sparsity_error
from .training import EvalSet, TrainResult, evaluate_mse

__all__ = ["ensemble_members", "run_members", "final_errors", "member_records", "per_op_summaries"]


def ensemble_members(ops: Sequence[str], seed_offset: int, seeds: int) -> Tuple[List[int], List[int]]:
    """The seeds of a configuration (``seed_offset`` on) and the seed of every member: member
    ``k`` trains operation ``ops[k // seeds]`` with seed ``seeds[k % seeds]``."""
    own = [seed_offset + s for s in range(seeds)]
    return own, [s for _ in ops for s in own]


def run_members(p, cfg: Config) -> Tuple[List[str], int, List[int], List[int], int]:
    """What a static or recurrent run starts from, once torch's global generator is seeded with 0:
    ``(ops, S, seeds, member_seeds, E)``, the operations and the number of seeds of the typed
    parameters ``p`` and ``cfg``, the seeds and every member's seed (:func:`ensemble_members`), and
    the number of members."""
    torch.manual_seed(0)
    ops, S = p.ops, cfg.seeds
    seeds, member_seeds = ensemble_members(ops, p.seed_offset, S)
    return ops, S, seeds, member_seeds, len(member_seeds)


def final_errors(model: nn.Module, res: TrainResult, test_i: EvalSet, test_x: EvalSet,
                 E: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Load each member's best-validation parameters; their interpolation and extrapolation MSE
    and sparsity error (None for models without one), per member."""
    model.load_state_dict(res.best_state)
    return evaluate_mse(model, test_i, E), evaluate_mse(model, test_x, E), sparsity_error(model, E)


def member_records(model_name: str, ops: Sequence[str], member_seeds: Sequence[int], res: TrainResult,
                   errors, base: Dict[str, tuple], thresholds: Dict[str, float],
                   ranges: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """One record per member: success (Madsen's criterion), divergence, solved-at, best step, the
    MSEs and the paper's normalised errors (``base``: per op, the random models' (interp, extrap)
    MSE), sparsity error, threshold. ``ranges`` (e.g. ``interp``/``extrap`` names) follow ``op``."""
    interp_mse, extrap_mse, sparsity = errors
    S = len(member_seeds) // len(ops)
    records = []
    for k, seed in enumerate(member_seeds):
        op = ops[k // S]
        im, xm = float(interp_mse[k]), float(extrap_mse[k])
        records.append({
            "seed": seed, "model": model_name, "op": op, **(ranges or {}),
            "success": bool(math.isfinite(xm) and xm < thresholds[op]), "diverged": bool(res.diverged[k]),
            "solved_at": int(res.solved_at[k]) if int(res.solved_at[k]) >= 0 else None,
            "best_step": int(res.best_step[k]), "valid_mse": float(res.best_val[k]),
            "interp_mse": im, "extrap_mse": xm,
            "interp_error": ar.normalised_error(im, base[op][0]),
            "extrap_error": ar.normalised_error(xm, base[op][1]),
            "sparsity_error": None if sparsity is None else float(sparsity[k]),
            "threshold": thresholds[op], "final_train_loss": float(res.final_loss[k]),
        })
    return records


def per_op_summaries(cfg: Config, records: List[Dict[str, Any]], extra: Dict[str, Any], drop: Sequence[str],
                     more: Callable[[str], Dict[str, Any]] = lambda op: {}) -> List[Dict[str, Any]]:
    """One summary record per operation: the default summary of its members, without the
    parameters in ``drop``, with the op, the ranges, the threshold, ``more(op)`` and the seeds."""
    p = cfg.params
    out = []
    for op in p["ops"]:
        recs = [r for r in records if r["op"] == op]
        s = default_summary(cfg, recs)
        for k in drop:
            s.pop(k, None)
        s.update({"op": op, "interp": str(ar.as_range(p["interp"])), "extrap": str(ar.as_range(p["extrap"])),
                  "threshold": extra["thresholds"][op], **more(op), "seeds": len(recs)})
        out.append(s)
    return out
