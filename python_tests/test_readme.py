"""Every code block of README.md runs as written.

* ```python blocks: each runs in a fresh namespace, in an empty temporary directory (so a block
  must make the files it reads).
* A block that needs another codebase is marked on the line above its fence with
  ``<!-- readme-test: needs NAME -->``; it runs in a test of its own against a small stand-in of
  that codebase (its modules and a checkpoint of it), listed in ``STAND_INS``. A marker without a
  stand-in fails.
* ```bash blocks: every ``nalu-cuda`` / ``python -m nalu_cuda`` / ``torchrun ... -m nalu_cuda``
  command line parses (``cli.build_parser().parse_args``) and builds its configurations; a
  ``--device`` value is read as ``cpu`` (the device itself is probed at run time).
"""
import os
import re
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nalu_cuda import cli

from .test_compat import _ExtendedTorchModule  # stable-nalu's base class, re-implemented once

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"<!--\s*readme-test:\s*needs\s+(\S+)\s*-->")


def _blocks():
    """``(line, language, code, needs)`` of every fenced block (``needs``: the marker's name or None)."""
    lines = README.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        above = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.search(above)
        out.append((start + 1, lang, "\n".join(lines[start + 1:j]) + "\n", marker.group(1) if marker else None))
        i = j + 1
    return out


PYTHON = [(line, code) for line, lang, code, needs in _blocks() if lang == "python" and needs is None]
MARKED = {needs: code for line, lang, code, needs in _blocks() if needs is not None}


def _run(code: str, where: Path, name: str) -> dict:
    ns = {"__name__": f"readme_{name}"}
    cwd = os.getcwd()
    os.chdir(where)
    try:
        exec(compile(code, f"README.md:{name}", "exec"), ns)
    finally:
        os.chdir(cwd)
    return ns


@pytest.mark.parametrize("line, code", PYTHON, ids=[f"line{line}" for line, _ in PYTHON])
def test_python_block_runs(line, code, tmp_path):
    torch.manual_seed(0)
    _run(code, tmp_path, f"line{line}")


def test_the_readme_has_its_blocks():
    assert len(PYTHON) >= 2 and set(MARKED) == set(STAND_INS), (sorted(MARKED), sorted(STAND_INS))


# ------------------------------------------------------------------------------------------------
# Stand-ins of the codebases the migration examples come from
# ------------------------------------------------------------------------------------------------


def _module(name: str, monkeypatch, **attrs) -> types.ModuleType:
    """A stand-in module ``name`` holding ``attrs``; its classes name it as their home for the test
    only (``monkeypatch`` restores ``__module__`` afterwards: test_compat's classes are shared with
    other tests), and it holds each class under its own name too, where pickle looks it up."""
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        if isinstance(v, type):
            monkeypatch.setattr(v, "__module__", name)
            setattr(mod, v.__qualname__, v)
        setattr(mod, k, v)
    return mod


class _KzNAC(nn.Module):
    """kevinzakka/NALU-pytorch's NeuralAccumulatorCell: weights (out, in)."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.W_hat = nn.Parameter(torch.randn(out_dim, in_dim))
        self.M_hat = nn.Parameter(torch.randn(out_dim, in_dim))

    def forward(self, x):
        return F.linear(x, torch.tanh(self.W_hat) * torch.sigmoid(self.M_hat))


class _KzNALUCell(nn.Module):
    """Their NeuralArithmeticLogicUnitCell (eps 1e-10, an input gate G of shape (out, in))."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.eps = 1e-10
        self.G = nn.Parameter(torch.randn(out_dim, in_dim))
        self.nac = _KzNAC(in_dim, out_dim)

    def forward(self, x):
        a = self.nac(x)
        g = torch.sigmoid(F.linear(x, self.G))
        m = torch.exp(self.nac(torch.log(torch.abs(x) + self.eps)))
        return g * a + (1 - g) * m


class _KzNALU(nn.Module):
    """Their models.NALU(num_layers, in_dim, hidden_dim, out_dim)."""

    def __init__(self, num_layers, in_dim, hidden_dim, out_dim):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.model = nn.Sequential(*[_KzNALUCell(dims[i], dims[i + 1]) for i in range(num_layers)])

    def forward(self, x):
        return self.model(x)


def _kevinzakka(tmp_path, monkeypatch):
    models = _module("models", monkeypatch, NALU=_KzNALU, NeuralArithmeticLogicUnitCell=_KzNALUCell,
                     NeuralAccumulatorCell=_KzNAC)
    monkeypatch.setitem(sys.modules, "models", models)
    torch.manual_seed(1)
    theirs = models.NALU(2, 2, 2, 1).double()
    torch.save(theirs, tmp_path / "nalu.pt")
    return theirs


class _SnNAC(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.W_hat = nn.Parameter(torch.randn(out_features, in_features))
        self.M_hat = nn.Parameter(torch.randn(out_features, in_features))


class _SnNALULayer(nn.Module):
    """stable-nalu's NALULayer with its defaults: one NAC (nac_add), an input gate G_add (out, in)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.nac_add = _SnNAC(in_features, out_features)
        self.G_add = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, x):
        W = torch.tanh(self.nac_add.W_hat) * torch.sigmoid(self.nac_add.M_hat)
        g = torch.sigmoid(F.linear(x, self.G_add))
        return g * F.linear(x, W) + (1 - g) * torch.exp(F.linear(torch.log(torch.abs(x) + 1e-7), W))


class _SnGeneralizedLayer(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.layer = _SnNALULayer(in_features, out_features)


class _SnNetwork(nn.Module):
    """Their SimpleFunctionStaticNetwork: layer_1 (100 -> 2), layer_2 (2 -> 1)."""

    def __init__(self):
        super().__init__()
        self.layer_1 = _SnGeneralizedLayer(100, 2)
        self.layer_2 = _SnGeneralizedLayer(2, 1)


def _stable_nalu(tmp_path, monkeypatch):
    pkg = _module("stable_nalu", monkeypatch)
    pkg.__path__ = []
    abstract = _module("stable_nalu.abstract", monkeypatch, ExtendedTorchModule=_ExtendedTorchModule)
    layer = _module("stable_nalu.layer", monkeypatch)
    layer.__path__ = []
    generalized = _module("stable_nalu.layer.generalized", monkeypatch, unit_name_to_layer_class={},
                          unit_name_to_cell_class={})
    network = _module("stable_nalu.network", monkeypatch, SimpleFunctionStaticNetwork=_SnNetwork,
                      GeneralizedLayer=_SnGeneralizedLayer, NALULayer=_SnNALULayer, NACLayer=_SnNAC)
    pkg.abstract, pkg.layer, pkg.network, layer.generalized = abstract, layer, network, generalized
    for mod in (pkg, abstract, layer, generalized, network):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    torch.manual_seed(2)
    theirs = network.SimpleFunctionStaticNetwork()
    torch.save(theirs, tmp_path / "their_model.pt")
    return theirs


STAND_INS = {"kevinzakka/NALU-pytorch": _kevinzakka, "stable-nalu": _stable_nalu}


@pytest.mark.filterwarnings("ignore:nalu_cuda.compat.from_kevinzakka:UserWarning")  # their eps: the block uses it
def test_kevinzakka_block_runs_against_a_stand_in(tmp_path, monkeypatch):
    theirs = _kevinzakka(tmp_path, monkeypatch)
    ns = _run(MARKED["kevinzakka/NALU-pytorch"], tmp_path, "kevinzakka")
    x = torch.rand(16, 2, dtype=torch.float64) * 4 + 0.5
    with torch.no_grad():
        torch.testing.assert_close(ns["ours"].double()(x), theirs(x), rtol=1e-6, atol=1e-8)


def test_stable_nalu_block_runs_against_a_stand_in(tmp_path, monkeypatch):
    theirs = _stable_nalu(tmp_path, monkeypatch)
    ns = _run(MARKED["stable-nalu"], tmp_path, "stable_nalu")
    generalized = sys.modules["stable_nalu.layer.generalized"]
    assert {"NAC", "NALU"} <= set(generalized.unit_name_to_layer_class)
    x = torch.rand(8, 100) + 1
    with torch.no_grad():
        torch.testing.assert_close(ns["layer"](x), theirs.layer_1.layer(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Shell blocks: every command line of the nalu-cuda tool parses and builds its configurations
# ------------------------------------------------------------------------------------------------


def _command_lines():
    found = []
    for line, lang, code, _ in _blocks():
        if lang not in ("bash", "sh", "shell"):
            continue
        for text in code.replace("\\\n", " ").splitlines():
            text = text.split(" # ")[0].split("  #")[0].strip()
            for part in re.split(r"&&|;|\|\|", text):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                for k, w in enumerate(words):
                    if w == "nalu-cuda" and k == 0 or (w == "nalu_cuda" and k > 0 and words[k - 1] == "-m"):
                        found.append((line, part.strip(), words[k + 1:]))
                        break
    return found


COMMANDS = _command_lines()


@pytest.mark.parametrize("line, text, argv", COMMANDS, ids=[f"line{c[0]}-{i}" for i, c in enumerate(COMMANDS)])
def test_command_line_parses(line, text, argv):
    argv = list(argv)
    for i, w in enumerate(argv[:-1]):
        if w == "--device":
            argv[i + 1] = "cpu"
    args = cli.build_parser().parse_args(argv)
    if args._experiment != "__list__":
        assert cli._configs(args), text


def test_the_readme_has_command_lines():
    commands = {" ".join(argv[:1]) for _, _, argv in COMMANDS}
    assert {"reproduce", "list", "static", "gridworld"} <= commands, commands


def test_time_claims_agree():
    """The length of ``reproduce --profile quick``: one statement, in ``reproduce -h`` and the README."""
    text = README.read_text()
    assert cli.REPRODUCE_QUICK_TIME in text
    assert "about 21 min" not in text and "about 20 minutes for every" not in text
