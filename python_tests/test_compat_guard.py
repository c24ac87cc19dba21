"""The guard against loading another codebase's (out, in) state dict into a nalu_cuda layer without
nalu_cuda.compat (their parameter names are ours, transposed), and the converters' error messages."""
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nalu_cuda import NAC, NACMul, NALU, NAU, NPU, compat
from nalu_cuda.testing import rand_input, rand_params

# from_kevinzakka's warning about their eps (1e-10) is tested in test_compat.py
pytestmark = pytest.mark.filterwarnings("ignore:nalu_cuda.compat.from_kevinzakka:UserWarning")


class TheirNAC(nn.Module):
    """kevinzakka/NALU-pytorch's NeuralAccumulatorCell: (out, in) weights, y = F.linear(x, W)."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.W_hat = nn.Parameter(rand_params((out_dim, in_dim)))
        self.M_hat = nn.Parameter(rand_params((out_dim, in_dim)))

    def forward(self, x):
        return F.linear(x, torch.tanh(self.W_hat) * torch.sigmoid(self.M_hat))


class TheirNALU(nn.Module):
    """kevinzakka/NALU-pytorch's NeuralArithmeticLogicUnitCell (eps 1e-10)."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.G = nn.Parameter(rand_params((out_dim, in_dim)))
        self.nac = TheirNAC(in_dim, out_dim)

    def forward(self, x):
        a = self.nac(x)
        g = torch.sigmoid(F.linear(x, self.G))
        m = torch.exp(self.nac(torch.log(torch.abs(x) + 1e-10)))
        return g * a + (1 - g) * m


class TheirStack(nn.Module):
    """Their models.NALU: layers under 'model.i.'."""

    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(TheirNALU(2, 3), TheirNALU(3, 2))


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# --- the guard ------------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [True, False])
def test_their_square_checkpoint_is_refused_and_names_compat(strict):
    theirs = TheirNAC(2, 2).double()
    with pytest.raises(RuntimeError, match=r"nalu_cuda\.compat\.from_kevinzakka.*mark_nalu_cuda"):
        NAC(2, 2, dtype=torch.float64).load_state_dict(theirs.state_dict(), strict=strict)
    with pytest.raises(RuntimeError, match="from_kevinzakka"):  # also after a save/load
        NAC(2, 2, dtype=torch.float64).load_state_dict(_roundtrip(theirs.state_dict()))
    # their NALU (keys nac.* differ from ours, but the gate G has our name)
    with pytest.raises(RuntimeError, match="another module class"):
        NALU(2, 2, dtype=torch.float64).load_state_dict(TheirNALU(2, 2).double().state_dict(), strict=False)


def test_refused_load_leaves_the_layer_as_it_was():
    ours = NAC(2, 2, dtype=torch.float64)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(RuntimeError):
        ours.load_state_dict(TheirNAC(2, 2).double().state_dict())
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("their, ours", [(TheirNAC, NAC), (TheirNALU, lambda i, o, **kw: NALU(i, o, eps=1e-10, **kw))])
def test_converted_checkpoint_loads_and_computes_theirs(their, ours):
    theirs = their(2, 2).double()
    layer = ours(2, 2, dtype=torch.float64)
    converted = compat.from_kevinzakka(theirs)  # the module itself, or its state dict
    layer.load_state_dict(converted)
    layer.load_state_dict(_roundtrip(compat.from_kevinzakka(theirs.state_dict())))
    x = rand_input((6, 2))
    torch.testing.assert_close(layer(x), theirs(x), rtol=1e-12, atol=1e-13)


def test_transposed_shape_points_to_compat():
    with pytest.raises(RuntimeError, match=r"transpose of this layer's \[5, 3\].*from_kevinzakka"):
        NAC(5, 3).load_state_dict({"W_hat": torch.zeros(3, 5), "M_hat": torch.zeros(3, 5)})
    with pytest.raises(RuntimeError, match="from_kevinzakka"):  # with their metadata
        NAC(5, 3).load_state_dict(TheirNAC(5, 3).state_dict())


def test_our_state_dicts_load():
    makers = [lambda: NAC(3, 3), lambda: NACMul(3, 3), lambda: NALU(3, 3, tied=False, gate_bias=True),
              lambda: NAU(3, 3), lambda: NPU(3, 3), lambda: NALU(3, 3, ensemble=2)]
    for make in makers:
        sd = make().state_dict()
        assert sd._metadata[""]["nalu_cuda"] == "(in, out)"
        make().load_state_dict(_roundtrip(sd))
    net = nn.Sequential(NAC(3, 3), nn.Linear(3, 3), NALU(3, 3), nn.Sequential(NACMul(3, 3)))
    sd = _roundtrip(net.state_dict())
    assert sd._metadata["3.0"]["nalu_cuda_layer"] == "NACMul"
    again = nn.Sequential(NAC(3, 3), nn.Linear(3, 3), NALU(3, 3), nn.Sequential(NACMul(3, 3)))
    again.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), net.state_dict().values()))
    again.load_state_dict(sd, strict=False, assign=True)
    # a key-by-key copy (no metadata: best-state snapshots, torch.distributed.checkpoint) loads
    again.load_state_dict({k: v.clone() for k, v in net.state_dict().items()})
    # a whole model with their layers is refused at the layer, with its prefix
    mixed = nn.Sequential(nn.Linear(3, 3), TheirNAC(3, 3))
    with pytest.raises(RuntimeError, match=r"nalu_cuda\.NAC: the keys under '1\.'"):
        nn.Sequential(nn.Linear(3, 3), NAC(3, 3)).load_state_dict(mixed.state_dict())


def test_mark_nalu_cuda_declares_a_state_dict_ours():
    ours = NAC(2, 2)
    old = ours.state_dict()  # as a version that did not mark wrote it
    for entry in old._metadata.values():
        entry.pop("nalu_cuda"), entry.pop("nalu_cuda_layer")
    with pytest.raises(RuntimeError, match="mark_nalu_cuda"):
        NAC(2, 2).load_state_dict(old)
    marked = compat.mark_nalu_cuda(old)
    assert marked._metadata[""] == {"version": 1, "nalu_cuda": "(in, out)"}
    layer = NAC(2, 2)
    layer.load_state_dict(_roundtrip(marked))
    assert torch.equal(layer.W_hat, ours.W_hat)
    # a plain dict (a builtin dict takes no attributes) and a whole model's
    plain = {"W_hat": ours.W_hat.detach(), "M_hat": ours.M_hat.detach()}
    NAC(2, 2).load_state_dict(compat.mark_nalu_cuda(plain))
    net = compat.mark_nalu_cuda({"0.W_hat": plain["W_hat"], "0.M_hat": plain["M_hat"]})
    assert set(net._metadata) == {"", "0"}
    nn.Sequential(NAC(2, 2)).load_state_dict(net)


def test_converted_for_them_is_refused_here():
    layer = NALU(2, 2)
    for to in (compat.to_kevinzakka, compat.to_linear_layout):
        out = to(NAC(2, 2))
        with pytest.raises(RuntimeError, match=r"\(out, in\) \(written by nalu_cuda\.compat\.to_\*\)"):
            NAC(2, 2).load_state_dict(out)
    back = compat.from_linear_layout(compat.to_linear_layout(layer))
    assert back._metadata[""]["nalu_cuda_layer"] == "NALU"
    NALU(2, 2).load_state_dict(back)
    with pytest.raises(ValueError, match="layout already"):
        compat.from_kevinzakka(NAC(2, 2).state_dict())
    with pytest.raises(ValueError, match="written by a nalu_cuda.compat.to_"):
        compat.to_stable_nalu(compat.to_kevinzakka(NAC(2, 2)))


# --- NACMul has no counterpart ----------------------------------------------------------------------


@pytest.mark.parametrize("to, peer", [(compat.to_kevinzakka, "only NAC and NALU"),
                                      (compat.to_stable_nalu, r"MNAC computes prod")])
def test_nacmul_is_refused(to, peer):
    mul = NACMul(2, 3)
    for arg in (mul, mul.state_dict(), _roundtrip(mul.state_dict())):
        with pytest.raises(ValueError, match=f"NACMul.*no counterpart.*{peer}"):
            to(arg)
    with pytest.raises(ValueError, match="a NPU has no counterpart"):
        to(NPU(2, 3))


# --- the converters' messages -----------------------------------------------------------------------


def test_missing_key_is_named():
    with pytest.raises(ValueError, match=r"missing key\(s\) \['nac.M_hat'\].*their NALU cell"):
        compat.from_kevinzakka({"G": torch.zeros(3, 2), "nac.W_hat": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['M_hat'\]"):
        compat.from_kevinzakka({"W_hat": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['nac_add.M_hat'\]"):
        compat.from_stable_nalu({"G_add": torch.zeros(3, 2), "nac_add.W_hat": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['M_hat'\]"):
        compat.to_kevinzakka({"W_hat": torch.zeros(2, 3)})


def test_whole_model_without_or_with_a_wrong_prefix_names_the_prefixes():
    sd = TheirStack().state_dict()
    for prefix in ("", "model.", "net.0."):
        with pytest.raises(ValueError, match=r"prefixes 'model\.0\.', 'model\.1\.': pass prefix='model\.0\.'"):
            compat.from_kevinzakka(sd, prefix=prefix)
    ours = compat.from_kevinzakka(sd, prefix="model.1.")
    assert ours["G"].shape == (3, 2)
    with pytest.raises(ValueError, match=r"prefixes 'model\.0\.'"):
        compat.from_stable_nalu(sd)
    with pytest.raises(ValueError, match=r"prefixes '0\.', '1\.': pass one layer"):
        compat.to_kevinzakka(nn.Sequential(NAC(2, 2), NAC(2, 2)))


def test_a_module_is_accepted_and_other_objects_are_named():
    theirs = TheirNALU(2, 3)
    a, b = compat.from_kevinzakka(theirs), compat.from_kevinzakka(theirs.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    layer = NALU(2, 3)
    assert compat.to_kevinzakka(layer).keys() == compat.to_kevinzakka(layer.state_dict()).keys()
    with pytest.raises(ValueError, match="expected a state dict .* or an nn.Module, got list"):
        compat.from_kevinzakka([1, 2])
    with pytest.raises(ValueError, match=r"key 'model' holds a OrderedDict.*pass checkpoint\['model'\]"):
        compat.from_stable_nalu({"model": TheirNAC(2, 2).state_dict(), "epoch": 3})


class TheirNAU(nn.Module):
    """stable-nalu's ReRegualizedLinearNACLayer: W (out, in), y = F.linear(x, clamp(W, -1, 1))."""

    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.W = nn.Parameter(rand_params((out_dim, in_dim)))

    def forward(self, x):
        return F.linear(x, torch.clamp(self.W, -1.0, 1.0))


def test_their_nau_checkpoint_is_refused_then_converts():
    theirs = TheirNAU(2, 2).double()
    with pytest.raises(RuntimeError, match="from_stable_nalu"):
        NAU(2, 2, dtype=torch.float64).load_state_dict(theirs.state_dict())
    with pytest.raises(RuntimeError, match="transpose"):  # built by hand: no metadata, shape transposed
        NAU(3, 2, dtype=torch.float64).load_state_dict({"W": rand_params((2, 3))})
    layer = NAU(2, 2, dtype=torch.float64)
    layer.load_state_dict(_roundtrip(compat.from_stable_nalu(theirs)))
    x = rand_input((6, 2))
    torch.testing.assert_close(layer(x), theirs(x), rtol=1e-12, atol=1e-13)
    with pytest.raises(RuntimeError, match=r"\(out, in\)"):  # to_stable_nalu's output is theirs
        layer.load_state_dict(compat.to_stable_nalu(layer))
    assert torch.equal(compat.to_stable_nalu(layer)["W"], theirs.W.detach())
