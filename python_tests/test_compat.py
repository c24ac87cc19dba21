"""nalu_cuda.compat: converters from and to kevinzakka/NALU-pytorch, stable-nalu and the nn.Linear
layout, checked against small re-implementations of each codebase's published forward (their
(out, in) layout, F.linear, their formulas), in float64, both ways; and the stable-nalu units."""
import math

import pytest
import torch
import torch.nn.functional as F

from nalu_cuda import NAC, NALU, compat, init_presets
from nalu_cuda.testing import rand_input, rand_params

I, O = 5, 3


def _leaf(*shape):
    return rand_params(shape).requires_grad_()


# --- their forwards, as published (weights (out, in), y = F.linear(x, W)) ---------------------------


def kevinzakka_nac(sd, x):
    W = torch.tanh(sd["W_hat"]) * torch.sigmoid(sd["M_hat"])
    return F.linear(x, W)


def kevinzakka_nalu(sd, x, eps=1e-10):
    W = torch.tanh(sd["nac.W_hat"]) * torch.sigmoid(sd["nac.M_hat"])
    a = F.linear(x, W)
    g = torch.sigmoid(F.linear(x, sd["G"]))
    m = torch.exp(F.linear(torch.log(torch.abs(x) + eps), W))
    return g * a + (1 - g) * m


def stable_nalu_nalu(sd, x, eps=1e-7):
    g = torch.sigmoid(F.linear(x, sd["G_add"], sd.get("bias_add")))
    W_add = torch.tanh(sd["nac_add.W_hat"]) * torch.sigmoid(sd["nac_add.M_hat"])
    mul = "nac_mul" if "nac_mul.W_hat" in sd else "nac_add"
    W_mul = torch.tanh(sd[f"{mul}.W_hat"]) * torch.sigmoid(sd[f"{mul}.M_hat"])
    a = F.linear(x, W_add)
    m = torch.exp(F.linear(torch.log(torch.abs(x) + eps), W_mul))
    return g * a + (1 - g) * m


def _their_sd(keys):
    return {k: (_leaf(O) if k.startswith("bias") else _leaf(O, I)) for k in keys}


def _check_theirs_to_ours(theirs, their_forward, to_ours, to_theirs, layer):
    """Their parameters -> ours: same y, and our gradients mapped back equal theirs."""
    x = rand_input((7, I))
    y_theirs = their_forward(theirs, x)
    y_theirs.pow(2).sum().backward()
    layer.load_state_dict(to_ours(theirs))
    y = layer(x)
    y.pow(2).sum().backward()
    torch.testing.assert_close(y, y_theirs, rtol=1e-12, atol=1e-13)
    grads = to_theirs({n: p.grad for n, p in layer.named_parameters()})
    assert grads.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(grads[k], theirs[k].grad, rtol=1e-11, atol=1e-12)
    # and back: the round trip is exact
    back = to_theirs(layer.state_dict())
    for k in theirs:
        assert torch.equal(back[k], theirs[k].detach())


def _check_ours_to_theirs(layer, their_forward, to_theirs):
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(rand_params(p.shape))
    x = rand_input((7, I))
    theirs = to_theirs(layer.state_dict())
    torch.testing.assert_close(their_forward(theirs, x), layer(x), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_kevinzakka_nalu_both_ways(backend):
    theirs = _their_sd(["G", "nac.W_hat", "nac.M_hat"])
    _check_theirs_to_ours(theirs, kevinzakka_nalu, compat.from_kevinzakka, compat.to_kevinzakka,
                          NALU(I, O, eps=1e-10, backend=backend, dtype=torch.float64))
    _check_ours_to_theirs(NALU(I, O, eps=1e-10, backend=backend, dtype=torch.float64), kevinzakka_nalu,
                          compat.to_kevinzakka)


def test_kevinzakka_nac_both_ways_and_prefix():
    theirs = _their_sd(["W_hat", "M_hat"])
    _check_theirs_to_ours(theirs, kevinzakka_nac, compat.from_kevinzakka, compat.to_kevinzakka,
                          NAC(I, O, dtype=torch.float64))
    _check_ours_to_theirs(NAC(I, O, dtype=torch.float64), kevinzakka_nac, compat.to_kevinzakka)
    # their stacks (NALU(num_layers, ...)) keep layer i under "model.i."
    stack = {"model.0.G": theirs["W_hat"], "model.0.nac.W_hat": theirs["W_hat"], "model.0.nac.M_hat": theirs["M_hat"],
             "model.1.G": theirs["M_hat"]}
    ours = compat.from_kevinzakka(stack, prefix="model.0.")
    assert ours.keys() == {"W_hat", "M_hat", "G"} and ours["G"].shape == (I, O)
    assert compat.to_kevinzakka(ours, prefix="model.0.").keys() == {"model.0.G", "model.0.nac.W_hat",
                                                                     "model.0.nac.M_hat"}


@pytest.mark.parametrize("two_nac", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_stable_nalu_both_ways(two_nac, bias, backend):
    keys = ["G_add", "nac_add.W_hat", "nac_add.M_hat"] + (["nac_mul.W_hat", "nac_mul.M_hat"] if two_nac else [])
    theirs = _their_sd(keys + (["bias_add"] if bias else []))
    kw = dict(tied=not two_nac, gate_bias=bias, backend=backend, dtype=torch.float64)
    _check_theirs_to_ours(theirs, stable_nalu_nalu, compat.from_stable_nalu, compat.to_stable_nalu, NALU(I, O, **kw))
    _check_ours_to_theirs(NALU(I, O, **kw), stable_nalu_nalu, compat.to_stable_nalu)


def test_stable_nalu_nac_and_first_nalu_layout():
    theirs = _their_sd(["W_hat", "M_hat"])
    _check_theirs_to_ours(theirs, kevinzakka_nac, compat.from_stable_nalu, compat.to_stable_nalu,
                          NAC(I, O, dtype=torch.float64))
    # stable-nalu's first NALULayer stored kevinzakka's keys (nac.W_hat, nac.M_hat, G)
    first = {k: v.detach() for k, v in _their_sd(["G", "nac.W_hat", "nac.M_hat"]).items()}
    assert all(torch.equal(u, v) for u, v in zip(compat.from_stable_nalu(first).values(),
                                                  compat.from_kevinzakka(first).values()))


def test_linear_layout_both_ways():
    for layer in (NALU(I, O, tied=False, gate_bias=True, dtype=torch.float64),
                  NALU(I, O, gate="independent", ensemble=2, dtype=torch.float64)):
        sd = layer.state_dict()
        lin = compat.to_linear_layout(sd)
        assert lin["W_hat"].shape[-2:] == (O, I) and lin["G"].shape == (sd["G"].shape if sd["G"].dim() < sd["W_hat"].dim()
                                                                        else lin["W_hat"].shape)
        back = compat.from_linear_layout(lin)
        assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    nac = NAC(I, O, dtype=torch.float64)
    lin = compat.to_linear_layout(nac.state_dict())
    x = rand_input((4, I))
    torch.testing.assert_close(kevinzakka_nac(lin, x), nac(x), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("convert, sd, match", [
    (compat.from_stable_nalu, {"G_add": 1, "G_mul": 1, "nac_add.W_hat": 1, "nac_add.M_hat": 1}, "second gate"),
    (compat.from_stable_nalu, {"G_add": 1, "nac_add.W_hat": 1, "nac_add.M_hat": 1, "nac_mul.W_hat": 1}, "mnac"),
    (compat.from_stable_nalu, {"G_add": 1, "nac_add.W_hat": 1, "nac_add.M_hat": 1, "extra": 1}, "extra"),
    (compat.from_kevinzakka, {"G": 1, "nac.W_hat": 1, "nac.M_hat": 1, "bias": 1}, "bias"),
    (compat.from_kevinzakka, {"W_hat": 1}, "prefix 'layer.'"),
])
def test_refuses_what_has_no_counterpart(convert, sd, match):
    sd = {k: torch.zeros(O, I) for k in sd}
    with pytest.raises(ValueError, match=match):
        convert(sd, prefix="layer." if "prefix" in match else "")


def test_to_refuses_what_has_no_counterpart():
    with pytest.raises(ValueError, match="separate multiplicative weights"):
        compat.to_kevinzakka(NALU(I, O, tied=False).state_dict())
    with pytest.raises(ValueError, match="gate bias"):
        compat.to_kevinzakka(NALU(I, O, gate_bias=True).state_dict())
    for to in (compat.to_kevinzakka, compat.to_stable_nalu):
        with pytest.raises(ValueError, match="input-independent gate"):
            to(NALU(I, O, gate="independent").state_dict())
        with pytest.raises(ValueError, match="ensemble"):
            to(NALU(I, O, ensemble=2).state_dict())


# --- initialisation as theirs ---------------------------------------------------------------------


def test_kaiming_preset_draws_kevinzakkas_numbers():
    torch.manual_seed(3)  # their NALU cell: NAC(W_hat, M_hat: kaiming_uniform_), then G (a=sqrt(5))
    W_hat, M_hat, G = torch.empty(O, I), torch.empty(O, I), torch.empty(O, I)
    torch.nn.init.kaiming_uniform_(W_hat)
    torch.nn.init.kaiming_uniform_(M_hat)
    torch.nn.init.kaiming_uniform_(G, a=math.sqrt(5))
    torch.manual_seed(3)
    ours = NALU(I, O, init="kaiming")
    want = compat.from_kevinzakka({"G": G, "nac.W_hat": W_hat, "nac.M_hat": M_hat})
    assert all(torch.equal(ours.state_dict()[k], want[k]) for k in want)
    assert W_hat.abs().max() <= math.sqrt(6 / I) and G.abs().max() <= 1 / math.sqrt(I)


@pytest.mark.parametrize("two_nac, bias", [(False, False), (True, True)])
def test_stable_nalu_unit_registers_and_draws_their_numbers(two_nac, bias):
    state = torch.random.get_rng_state()
    unit = compat.StableNALULayer(I, O, writer=object(), name="nalu", nalu_two_nac=two_nac, nalu_bias=bias,
                                  regualizer_z=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # construction draws nothing, as theirs
    torch.manual_seed(5)  # their reset_parameters: nac_add, nac_mul (two_nac), G_add (xavier), bias_add = 0
    r = init_presets.nac_optimal_bound(I, O)
    mats = [torch.empty(O, I).uniform_(-r, r) for _ in range(4 if two_nac else 2)]
    G_add = torch.nn.init.xavier_uniform_(torch.empty(O, I), gain=torch.nn.init.calculate_gain("sigmoid"))
    theirs = {"nac_add.W_hat": mats[0], "nac_add.M_hat": mats[1], "G_add": G_add}
    if two_nac:
        theirs.update({"nac_mul.W_hat": mats[2], "nac_mul.M_hat": mats[3]})
    if bias:
        theirs["bias_add"] = torch.zeros(O)
    torch.manual_seed(5)
    unit.reset_parameters()
    want = compat.from_stable_nalu(theirs)
    assert unit.state_dict().keys() == want.keys()
    assert all(torch.equal(unit.state_dict()[k], want[k]) for k in want)


def test_nac_optimal_bound_matches_scipy_bisect():
    import scipy.optimize

    def variance(r):
        return (1 - math.tanh(r) / r) * (r - math.tanh(r / 2)) / (2 * r) if r else 0.0

    for fan_in, fan_out in [(2, 2), (100, 2), (2, 1), (10, 10)]:
        fan = max(fan_in + fan_out, 5)
        want = scipy.optimize.bisect(lambda r: fan * variance(r) - 2, 0, 10)
        assert init_presets.nac_optimal_bound(fan_in, fan_out) == pytest.approx(want, rel=1e-11)


def test_stable_nalu_unit_gate_regulariser_trains_the_gate():
    unit = compat.StableNALULayer(I, O, nalu_gate="regualized", dtype=torch.float64)
    unit.reset_parameters()
    y = unit(rand_input((6, I)))
    assert unit.G.dtype == torch.float64
    reg = unit.regualizer()
    assert set(reg) == {"g"}
    g = unit.parts.g
    torch.testing.assert_close(reg["g"], torch.sum(g ** 2 * (1 - g) ** 2))
    (y.sum() * 0 + reg["g"]).backward()
    assert unit.G.grad is not None and unit.G.grad.abs().sum() > 0
    assert compat.StableNALULayer(I, O).regualizer() == {}


@pytest.mark.parametrize("kw, match", [
    (dict(nalu_two_gate=True), "second gate"),
    (dict(nalu_mul="mnac"), "nalu_mul='mnac'"),
    (dict(nalu_gate="gumbel"), "nalu_gate='gumbel'"),
])
def test_stable_nalu_unit_refuses_options_without_counterpart(kw, match):
    with pytest.raises(ValueError, match=match):
        compat.StableNALULayer(I, O, **kw)


def test_stable_nac_unit():
    unit = compat.StableNACLayer(I, O, writer=None, name="nac_add")
    torch.manual_seed(1)
    unit.reset_parameters()
    r = init_presets.nac_optimal_bound(I, O)
    torch.manual_seed(1)
    W_hat, M_hat = torch.empty(O, I).uniform_(-r, r), torch.empty(O, I).uniform_(-r, r)
    assert torch.equal(unit.W_hat, W_hat.t()) and torch.equal(unit.M_hat, M_hat.t())
    assert unit.regualizer({"z": 1}) == {"z": 1}


class _Writer:
    """stable-nalu's DummySummaryWriter, as far as the units use it."""

    def __init__(self, path=""):
        self.path, self.scalars = path, {}

    def namespace(self, name):
        return _Writer(f"{self.path}/{name}")

    def add_scalar(self, key, value, **kw):
        self.scalars[key] = value


class _ExtendedTorchModule(torch.nn.Module):
    """stable-nalu's ExtendedTorchModule (stable_nalu/abstract/_extended_torch_module.py), re-implemented:
    regularisers are collected from children of this class only."""

    def __init__(self, default_name, *args, writer=None, name=None, **kwargs):
        super().__init__()
        self.writer = (writer or _Writer()).namespace(default_name if name is None else name)

    def regualizer(self, merge_in=None):
        out = dict(merge_in or {})
        for module in self.children():
            if isinstance(module, _ExtendedTorchModule):
                for k, v in module.regualizer().items():
                    out[k] = out.get(k, 0) + v
        return out


def test_stable_nalu_units_join_their_regulariser_recursion():
    NACLayer, NALULayer = compat.stable_nalu_units(_ExtendedTorchModule)

    class GeneralizedLayer(_ExtendedTorchModule):  # how stable-nalu builds a registered unit
        def __init__(self, Layer, **kw):
            super().__init__("layer", **kw)
            self.layer = Layer(I, O, writer=self.writer, nalu_gate="regualized", regualizer_z=0)

        def forward(self, x):
            return self.layer(x)

    net = GeneralizedLayer(NALULayer, writer=_Writer("run"))
    assert isinstance(net.layer, _ExtendedTorchModule) and isinstance(net.layer, NALU)
    assert net.layer.writer.path == "run/layer/nalu"
    assert net.layer.state_dict().keys() == compat.StableNALULayer(I, O).state_dict().keys()
    net.layer.reset_parameters()
    net(rand_input((6, I)).float())
    g = net.layer.parts.g
    torch.testing.assert_close(net.regualizer()["g"], torch.sum(g ** 2 * (1 - g) ** 2))
    nac = GeneralizedLayer(NACLayer).layer
    assert isinstance(nac, NAC) and nac.writer.path == "/layer/nac" and net.regualizer().keys() == {"g"}
