"""A task's parameters, typed: a configuration's ``params`` (a JSON dict) parsed once into a frozen
dataclass over its defaults.

A task declares its parameters as a ``@dataclass(frozen=True)`` whose fields carry the types and
defaults (a field without a default must come with every configuration, e.g. ``model``), and its
``run`` starts with ``p = task_params(<Task>Params, config)``. :func:`task_params` checks every key
and value once, with a :class:`ValueError` that names the task, the key, what was expected and
what came; after it the run reads ``p.lr``, ``p.eval_every``, ... with no casts.

Types understood: ``int``, ``float`` (an int is accepted and converted), ``str``, ``bool``,
``Optional[X]`` (JSON null or an ``X``), ``Tuple[X, ...]`` and ``Tuple[X, Y]`` (a JSON list, turned
into a tuple), ``Dict[K, V]`` (a JSON object), ``Any`` (taken as it is), and any class with a
``from_param(value)`` classmethod and a ``param_name`` (e.g. the arithmetic tasks' ``Range``, stored
as a JSON list). An ``int`` field takes an integral float (``1000.0``) as that int; ``bool`` is never
an int or a float here.

Defaults: a field's own default, or, for a task whose defaults are written into every configuration
it builds (the arithmetic tasks' ``DEFAULTS`` dicts, which the configurations' fingerprints hash), the
``defaults`` mapping given to :func:`task_params`; those are typed like the configuration's values.

Keys that are not a task's parameters: :data:`SETTING_KEYS`, read for every task by
:func:`.plugin.run_setting` (``backend`` by ``resolve_backend``, ``first_seed`` by ``seed_list``),
are type-checked and left out of the dataclass. Every other key must be a field: a stray key (a
typo, or ``seed_offset``, which only the seed-splittable arithmetic tasks honour) is an error
rather than a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Mapping, Optional, Type, TypeVar, Union

from .registry import Config

__all__ = ["SETTING_KEYS", "task_params"]

P = TypeVar("P")

# The keys of a configuration's params that every task accepts, read outside the task's own
# parameters (:func:`.plugin.run_setting`), with their types.
SETTING_KEYS: Dict[str, Any] = {"backend": Optional[str], "first_seed": int}


class _Mismatch(Exception):
    """A value (at ``where`` inside the parameter's value) is not of the declared type."""

    def __init__(self, value: Any, where: str) -> None:
        super().__init__(where)
        self.value, self.where = value, where


def type_name(tp: Any) -> str:
    """A declared type as the message of an error says it: ``list of int``, ``float or null``, ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if origin is Union:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + (" or null" if len(rest) < len(args) else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if hasattr(tp, "param_name"):
        return tp.param_name
    if origin in (dict, Mapping) or tp is dict:
        return "object" + (f" of {type_name(args[0])} -> {type_name(args[1])}" if args else "")
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str = "") -> Any:
    """``value`` as the declared type ``tp`` (lists to tuples, ints to floats), or :class:`_Mismatch`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union:
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except _Mismatch:
                pass
        raise _Mismatch(value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(value, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _Mismatch(value, where)
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch(value, where)
        kt, vt = args or (Any, Any)
        return {_convert(k, kt, f"{where}.{k}"): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if hasattr(tp, "from_param") and not isinstance(value, tp):
        try:
            return tp.from_param(value)
        except (ValueError, TypeError):
            raise _Mismatch(value, where) from None
    if isinstance(value, bool) and tp is not bool:
        raise _Mismatch(value, where)
    if tp is float and isinstance(value, (int, float)):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, tp):
        return value
    raise _Mismatch(value, where)


def _checked(task: str, key: str, value: Any, tp: Any) -> Any:
    try:
        return _convert(value, tp)
    except _Mismatch as m:
        inner = f" ({m.value!r} at {key}{m.where})" if m.where else ""
        raise ValueError(f"{task}: parameter {key!r} expects {type_name(tp)}, got {value!r}{inner}") from None


def task_params(cls: Type[P], config: Config, defaults: Mapping[str, Any] = {}) -> P:
    """``config.params`` as the frozen dataclass ``cls``: the defaults of ``cls`` (and ``defaults``,
    keyed by field name) overridden by the configuration's values, each converted to its field's
    declared type. Raises :class:`ValueError` for a key that is neither a field nor a
    :data:`SETTING_KEYS` key, a value of the wrong type, or a field without a default that the
    configuration lacks."""
    task = f"{config.experiment} {config.name}" if config.name else config.experiment
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: Dict[str, Any] = {}
    for key, value in {**{k: v for k, v in defaults.items() if k in fields}, **config.params}.items():
        if key in fields:
            values[key] = _checked(task, key, value, hints[key])
        elif key in SETTING_KEYS:
            _checked(task, key, value, SETTING_KEYS[key])
        else:
            known = ", ".join(sorted(set(fields) | set(SETTING_KEYS)))
            raise ValueError(f"{task}: unknown parameter {key!r} (value {value!r}); expected one of: {known}")
    missing = [n for n, f in fields.items() if n not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{task}: missing parameter(s) {', '.join(map(repr, missing))} "
                         f"({', '.join(type_name(hints[n]) for n in missing)}), which have no default")
    return cls(**values)
