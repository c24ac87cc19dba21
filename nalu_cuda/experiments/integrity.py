"""Results and checkpoints that prove their integrity: every ``result.json`` and checkpoint is
sealed (:func:`seal`: its configuration's fingerprint and a sha256 ``checksum`` of its content) and
checked before it is trusted (:func:`result_problem`, :func:`load_checkpoint`); a damaged file is
moved aside, never deleted (:func:`keep_damaged`); a checkpoint's fields are checked against what
the run saves (:class:`CheckpointState`). The rules are in :mod:`nalu_cuda.experiments.runner`'s
docstring."""
from __future__ import annotations

import hashlib
import json
import numbers
import os
from typing import Any, Dict, Optional, Tuple

import torch

from .outdir import RunError
from .registry import Config

__all__ = ["checksum", "seal", "seal_problem", "result_problem", "load_result", "keep_damaged", "CheckpointState",
           "load_checkpoint", "read_checkpoint", "config_dir", "result_path", "checkpoint_path", "read_result",
           "damaged"]


# Where a configuration's files live in ``--out DIR`` (the layout: :mod:`.runner`'s docstring).
def config_dir(out_dir: str, cfg: Config) -> str:
    return os.path.join(out_dir, "runs", cfg.experiment, cfg.name)


def result_path(out_dir: str, cfg: Config) -> str:
    return os.path.join(config_dir(out_dir, cfg), "result.json")


def checkpoint_path(out_dir: str, cfg: Config) -> str:
    return os.path.join(config_dir(out_dir, cfg), "checkpoint.pt")


_RESULT_FIELDS = (("fingerprint", str), ("config", dict), ("records", list))
_CONFIG_FIELDS = (("experiment", str), ("name", str), ("seeds", int), ("steps", int))


def checksum(payload: Any) -> str:
    """sha256 of ``payload``'s content: JSON-like values as canonical JSON (sorted keys), tensors as
    their dtype, shape and bytes; equal for a payload and what ``json``/``torch.load`` read back."""
    h = hashlib.sha256()

    def feed(o: Any) -> None:
        try:  # a JSON subtree in one C call (most of a history)
            h.update(b"J" + json.dumps(o, sort_keys=True, separators=(",", ":")).encode())
            return
        except (TypeError, ValueError):
            pass
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            h.update(b"{%d" % len(o))
            for k in sorted(o, key=repr):
                feed(k)
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(b"[%d" % len(o))
            for v in o:
                feed(v)
        else:
            h.update(f"{type(o).__name__}:{o!r};".encode())

    feed(payload)
    return h.hexdigest()


def seal(payload: Dict[str, Any]) -> Dict[str, Any]:
    """``payload`` with its ``checksum`` (every ``result.json`` and checkpoint is written sealed)."""
    body = {k: v for k, v in payload.items() if k != "checksum"}
    return {**body, "checksum": checksum(body)}


def seal_problem(data: Dict[str, Any], config: Any) -> Optional[str]:
    """What makes a parsed, sealed file (result or checkpoint) untrustworthy: no checksum, one that
    does not match its content, or a fingerprint that is not its configuration's."""
    if "checksum" not in data:
        return "it has no checksum, so it cannot be verified: written by a nalu-cuda before result version 2, or edited"
    if data["checksum"] != checksum({k: v for k, v in data.items() if k != "checksum"}):
        return "its checksum does not match its content: edited or corrupted since it was written"
    try:
        own = Config.from_dict(config).fingerprint()
    except (TypeError, ValueError, KeyError, AttributeError):
        return "its field 'config' is not a configuration"
    if data.get("fingerprint") != own:
        return f"its fingerprint {data.get('fingerprint')} is not that of its configuration ({own})"
    return None


def result_problem(data: Any) -> Optional[str]:
    """What makes a parsed ``result.json`` unusable (``None`` when nothing does)."""
    if not isinstance(data, dict):
        return f"expected a JSON object, found {type(data).__name__}"
    for fields, d, prefix in ((_RESULT_FIELDS, data, ""), (_CONFIG_FIELDS, data.get("config"), "config.")):
        for key, typ in fields:
            if key not in d:
                return f"field '{prefix}{key}' is missing"
            if not isinstance(d[key], typ):
                return f"field '{prefix}{key}' is a {type(d[key]).__name__}, not a {typ.__name__}"
    if not isinstance(data["config"].get("params", {}), dict):
        return "field 'config.params' is not an object"
    if not all(isinstance(r, dict) for r in data["records"]):
        return "field 'records' holds something other than objects"
    summaries = data.get("summaries", [])
    if not isinstance(summaries, list) or not all(isinstance(r, dict) for r in summaries):
        return "field 'summaries' is not a list of objects"
    if not isinstance(data.get("extra", {}), dict):
        return "field 'extra' is not an object"
    if not isinstance(data.get("wall_s", 0.0), (int, float)):
        return "field 'wall_s' is not a number"
    return seal_problem(data, data["config"])


def load_result(path: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(data, None)`` for a usable result file, ``(None, what is wrong)`` for a damaged one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"unreadable: {exc}"
    problem = result_problem(data)
    return (None, problem) if problem else (data, None)


def read_result(path: str) -> Dict[str, Any]:
    """A valid ``result.json``'s data (a :class:`RunError` naming what is wrong otherwise)."""
    data, problem = load_result(path)
    if problem is not None:
        raise RunError(f"result file {path} is damaged ({problem})")
    return data


def damaged(path: str, what: str, problem: str, cfg: Config, resume: bool, log) -> None:
    """The rule for a damaged result or checkpoint of ``cfg``: without ``resume`` a :class:`RunError`;
    with it, the file is moved aside (:func:`keep_damaged`) and ``cfg`` recomputed, with a warning."""
    name = os.path.basename(path)
    if not resume:
        raise RunError(f"{what} {path} is damaged ({problem}): pass --resume to recompute {cfg.key} (the damaged "
                       f"file is kept as {name}.damaged), or --overwrite to recompute every configuration of this run")
    kept = keep_damaged(path)
    log(f"warning: {what} {path} is damaged ({problem}); recomputing {cfg.key} (the damaged file is kept as "
        f"{os.path.basename(kept)})")


def keep_damaged(path: str) -> str:
    """Move the damaged file ``path`` aside, to ``<path>.damaged`` (``.damaged-2``, ... when taken):
    returns that name. Nothing is ever deleted."""
    target, n = path + ".damaged", 1
    while os.path.lexists(target):
        n += 1
        target = f"{path}.damaged-{n}"
    os.replace(path, target)
    return target


_FIX = "delete it, or rerun with --overwrite to start this configuration again"


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    if isinstance(v, dict):
        return "a dictionary"
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)}"
    return "None" if v is None else f"a {type(v).__name__} ({v!r:.40})"


def _mismatch(got: Any, like: Any) -> Optional[Tuple[str, str, str]]:
    """``(sub-field, expected, got)`` where ``got`` first differs from the structure of ``like``: the
    same kinds, tensors of the same shape and dtype, dictionaries with the same keys, lists of the same
    length. ``like`` None: None or a number; ``like`` a type: any value of it."""
    if isinstance(like, type):
        ok = isinstance(got, like) and not (like is int and isinstance(got, bool))
        names = {int: "an integer", dict: "a dictionary", list: "a list"}
        return None if ok else ("", names.get(like, f"a {like.__name__}"), _describe(got))
    if isinstance(like, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.shape == like.shape and got.dtype == like.dtype
        return None if ok else ("", _describe(like), _describe(got))
    if isinstance(like, dict) or isinstance(like, (list, tuple)):
        if isinstance(like, dict) != isinstance(got, dict) or not isinstance(got, (dict, list, tuple)):
            return "", _describe(like), _describe(got)
        keys = list(like) if isinstance(like, dict) else range(len(like))
        if isinstance(got, dict) and set(got) != set(like):
            k = next(k for k in list(like) + list(got) if (k in like) != (k in got))
            return f".{k}", (_describe(like[k]) if k in like else "no such field"), \
                ("missing" if k in like else _describe(got[k]))
        if not isinstance(got, dict) and len(got) != len(like):
            return "", _describe(like), _describe(got)
        for k in keys:
            m = _mismatch(got[k], like[k])
            if m is not None:
                return (f".{k}" if isinstance(like, dict) else f"[{k}]") + m[0], m[1], m[2]
        return None
    if like is None:
        ok = got is None or (isinstance(got, numbers.Real) and not isinstance(got, bool))
        return None if ok else ("", "None or a number", _describe(got))
    kind = bool if isinstance(like, bool) else numbers.Integral if isinstance(like, numbers.Integral) else \
        numbers.Real if isinstance(like, numbers.Real) else type(like)
    ok = isinstance(got, kind) and (kind is bool or not isinstance(got, bool))
    names = {numbers.Integral: "an integer", numbers.Real: "a number"}
    return None if ok else ("", names.get(kind, f"a {kind.__name__}"), _describe(got))


class CheckpointState(dict):
    """A checkpoint's state. Its fields are read through :meth:`field`, which checks them, so a field
    that is missing or not what this run saves is a :class:`RunError` naming the file, the field, what
    was expected and what came, not an error from deep inside an experiment's resume code. ``path``:
    the file (None: a state an experiment was given directly)."""

    def __init__(self, data: dict, path: Optional[str] = None, where: str = "state") -> None:
        super().__init__({k: CheckpointState(v, path, f"{where}.{k}") if type(v) is dict else v
                          for k, v in data.items()})
        self._path, self._where = path, where

    def error(self, field: str, expected: str, got: str) -> RunError:
        """The :class:`RunError` for this state's ``field`` (``.key...``): ``got`` where ``expected``."""
        what = f"checkpoint {self._path}" if self._path else "the checkpoint"
        return RunError(f"{what}: field '{self._where}{field}' is {got}, expected {expected} (edited, or written "
                        f"by another version of nalu-cuda); {_FIX}")

    def __missing__(self, key):
        raise self.error(f".{key}", "a value", "missing")

    def field(self, key: str, like: Any = object, within: Optional[Tuple[float, float]] = None) -> Any:
        """The field ``key``, of the structure of ``like`` (see :func:`_mismatch`); ``within=(lo, hi)``:
        a number, or every element of a tensor, in ``[lo, hi]``."""
        value = self[key]
        m = _mismatch(value, like)
        if m is not None:
            raise self.error(f".{key}{m[0]}", m[1], m[2])
        if within is not None:
            lo, hi = within
            t = value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=torch.float64)
            if t.numel() and not (bool((t >= lo).all()) and bool((t <= hi).all())):
                shown = f"values from {t.min().item()} to {t.max().item()}" if t is value else repr(value)
                raise self.error(f".{key}", f"within [{lo}, {hi}]", shown)
        return value


def load_checkpoint(ck: str, fp: str) -> Tuple[Optional[CheckpointState], Optional[str]]:
    """``(state, None)`` for a usable checkpoint, ``(None, what is wrong)`` for a damaged one; one of
    other settings (a sound file whose fingerprint is not ``fp``) is a :class:`RunError`."""
    try:
        data = torch.load(ck, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, garbage, wrong format
        return None, f"unreadable: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if not isinstance(data, dict):
        return None, f"expected a dictionary, found {type(data).__name__}"
    problem = seal_problem(data, data.get("config"))
    if problem is not None:
        return None, problem
    if data["fingerprint"] != fp:
        raise RunError(f"checkpoint {ck} belongs to a different configuration (fingerprint {data['fingerprint']}, "
                       f"this run {fp}); the settings changed since it was written. Use another --out, or "
                       "--overwrite to discard it")
    if not isinstance(data.get("state"), dict):
        raise RunError(f"checkpoint {ck} has no field 'state' holding a dictionary (written by another version of "
                       f"nalu-cuda); {_FIX}")
    return CheckpointState(data["state"], ck), None


def read_checkpoint(ck: str, fp: str) -> CheckpointState:
    state, problem = load_checkpoint(ck, fp)
    if problem is not None:
        raise RunError(f"checkpoint {ck} is damaged ({problem}); rerun with --resume to recompute it (the damaged "
                       f"file is kept), or {_FIX}")
    return state
