"""Typed task parameters (:func:`nalu_cuda.experiments.params.task_params`): defaults, JSON lists to
tuples, declared types applied once, clear errors; every profile of the sequence tasks parses."""
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import pytest

from nalu_cuda.experiments.params import SETTING_KEYS, task_params
from nalu_cuda.experiments.registry import Config
from nalu_cuda.experiments.tasks import digits, gridworld, language, parity, programs


@dataclass(frozen=True)
class ToyParams:
    model: str
    lr: float = 0.01
    steps_per_eval: int = 10
    sizes: Tuple[Tuple[int, int], ...] = ((4, 2),)
    lengths: Tuple[int, ...] = (1, 10)
    scale: Optional[float] = None
    counts: Optional[Dict[Any, int]] = None


def cfg(**params) -> Config:
    return Config("toy", "one", 2, 10, params)


def test_defaults_and_required_field():
    p = task_params(ToyParams, cfg(model="nac"))
    assert p == ToyParams("nac")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.lr = 1.0
    with pytest.raises(ValueError, match=r"toy one: missing parameter\(s\) 'model' \(str\)"):
        task_params(ToyParams, cfg(lr=0.1))


def test_lists_become_tuples_and_types_apply_once():
    p = task_params(ToyParams, cfg(model="nac", lr=1, steps_per_eval=50.0, sizes=[[8, 3], [8, 5]], lengths=[2],
                                   scale=10, counts={"10": 4}))
    assert p.sizes == ((8, 3), (8, 5)) and isinstance(p.sizes[0], tuple)
    assert p.lengths == (2,)
    assert p.lr == 1.0 and type(p.lr) is float
    assert p.steps_per_eval == 50 and type(p.steps_per_eval) is int
    assert p.scale == 10.0 and type(p.scale) is float
    assert p.counts == {"10": 4}
    assert task_params(ToyParams, cfg(model="nac", scale=None)).scale is None


@pytest.mark.parametrize("key, value, expected", [
    ("lr", "fast", "expects float, got 'fast'"),
    ("steps_per_eval", 2.5, "expects int, got 2.5"),
    ("steps_per_eval", True, "expects int, got True"),
    ("model", 3, "expects str, got 3"),
    ("lengths", [1, "a"], r"expects list of int, got \[1, 'a'\] \('a' at lengths\[1\]\)"),
    ("sizes", [[8, 3, 1]], r"expects list of \[int, int\], got \[\[8, 3, 1\]\] \(\[8, 3, 1\] at sizes\[0\]\)"),
    ("scale", "x", "expects float or null, got 'x'"),
])
def test_wrong_type_names_task_key_expected_and_value(key, value, expected):
    params = {"model": "nac", key: value}
    with pytest.raises(ValueError, match=rf"^toy one: parameter '{key}' {expected}"):
        task_params(ToyParams, cfg(**params))


def test_unknown_key_and_setting_keys():
    with pytest.raises(ValueError, match=r"^toy one: unknown parameter 'learning_rate' \(value 0\.1\); "
                                         r"expected one of: backend, counts, first_seed, lengths, lr, model"):
        task_params(ToyParams, cfg(model="nac", learning_rate=0.1))
    # seed_offset is honoured only by the seed-splittable arithmetic tasks: elsewhere it is an error
    with pytest.raises(ValueError, match="unknown parameter 'seed_offset'"):
        task_params(ToyParams, cfg(model="nac", seed_offset=3))
    # the keys run_setting reads are accepted (type-checked) and stay out of the dataclass
    assert set(SETTING_KEYS) == {"backend", "first_seed"}
    assert task_params(ToyParams, cfg(model="nac", backend="reference", first_seed=5)) == ToyParams("nac")
    with pytest.raises(ValueError, match="parameter 'first_seed' expects int, got '5'"):
        task_params(ToyParams, cfg(model="nac", first_seed="5"))


TASKS = [(digits, digits.DigitsParams), (language, language.LanguageParams), (programs, programs.ProgramsParams),
         (parity, parity.ParityParams), (gridworld, gridworld.GridworldParams)]


@pytest.mark.parametrize("module, cls", TASKS, ids=[m.NAME for m, _ in TASKS])
def test_every_profile_of_the_sequence_tasks_parses(module, cls):
    for profile in ("quick", "paper"):
        for c in module.profile_configs(profile):
            p = task_params(cls, c)
            for key, value in c.params.items():  # every key lands in its field, lists as tuples
                got = getattr(p, key)
                assert got == (tuple(tuple(v) if isinstance(v, list) else v for v in value)
                               if isinstance(value, list) else value), key
