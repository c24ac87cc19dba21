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

# from_kevinzakka warns about their eps on every NALU it converts; test_kevinzakka_eps_* check the warning
pytestmark = pytest.mark.filterwarnings("ignore:nalu_cuda.compat.from_kevinzakka:UserWarning")


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
    unit = compat.StableNALULayer(I, O, writer=_Writer(), name="nalu", nalu_two_nac=two_nac, nalu_bias=bias,
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
    assert set(reg) == {"g", "z"} and reg["z"] == 0  # their NAC's z is always there (0 without regualizer_z)
    g = unit.parts.g
    torch.testing.assert_close(reg["g"], torch.sum(g ** 2 * (1 - g) ** 2))
    (y.sum() * 0 + reg["g"]).backward()
    assert unit.G.grad is not None and unit.G.grad.abs().sum() > 0
    assert compat.StableNALULayer(I, O).regualizer() == {"z": 0}


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
    """stable-nalu's SummaryWriterNamespace, as far as the units use it: every call is recorded in the
    root's ``calls`` as ``(method, namespace/tag, value, kwargs)``; ``add_histogram`` raises on a NaN
    as theirs does, on every step."""

    def __init__(self, path="", calls=None):
        self.path, self.calls = path, ([] if calls is None else calls)

    def namespace(self, name):
        return _Writer(f"{self.path}/{name}", self.calls)

    def _record(self, method, tag, value, **kw):
        self.calls.append((method, f"{self.path}/{tag}", value, kw))

    def add_scalar(self, tag, value, **kw):
        self._record("add_scalar", tag, value, **kw)

    def add_summary(self, tag, value, **kw):
        self._record("add_summary", tag, value, **kw)

    def add_tensor(self, tag, value, **kw):
        self._record("add_tensor", tag, value, **kw)

    def add_histogram(self, tag, value, **kw):
        if torch.isnan(value).any():
            raise ValueError("nan detected")
        self._record("add_histogram", tag, value, **kw)

    def tags(self):
        return [(m, t) for m, t, _, _ in self.calls]

    def value(self, method, tag):
        return [v for m, t, v, _ in self.calls if (m, t) == (method, tag)]


class _ExtendedTorchModule(torch.nn.Module):
    """stable-nalu's ExtendedTorchModule (stable_nalu/abstract/_extended_torch_module.py), re-implemented:
    regularisers are collected from children of this class only."""

    def __init__(self, default_name, *args, writer=None, name=None, **kwargs):
        super().__init__()
        self.writer = (writer or _Writer()).namespace(default_name if name is None else name)
        self.allow_random = True

    def regualizer(self, merge_in=None):
        out = dict(merge_in or {})
        for module in self.children():
            if isinstance(module, _ExtendedTorchModule):
                for k, v in module.regualizer().items():
                    out[k] = out.get(k, 0) + v
        return out

    def optimize(self, loss):
        for module in self.children():
            if isinstance(module, _ExtendedTorchModule):
                module.optimize(loss)

    def log_gradients(self):
        for module in self.children():
            if isinstance(module, _ExtendedTorchModule):
                module.log_gradients()

    def _set_random(self, flag):
        self.allow_random = flag
        for module in self.children():
            if isinstance(module, _ExtendedTorchModule):
                module._set_random(flag)


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
    assert isinstance(nac, NAC) and nac.writer.path == "/layer/nac" and net.regualizer().keys() == {"g", "z"}


# --- issue 29: regualizer_z, the writer, pickling, NAU / NMU units, cells, kevinzakka's eps ---------
# Their formulas, written from stable_nalu/functional/{regualizer_nau_z,regualizer_nmu_z,regualizer,
# sparsity_error,mnac}.py and stable_nalu/layer/{nac,_abstract_nalu,re_regualized_linear_nac,
# re_regualized_linear_mnac,_abstract_recurrent_cell}.py; W is theirs, (out, in).


def their_nau_z(W, inputs):
    x_mean = torch.mean(torch.cat(inputs, dim=0), dim=0, keepdim=True)
    return torch.mean((1 - torch.abs(W)) * (0 - x_mean) ** 2)


def their_nmu_z(W, inputs):
    x_mean = torch.mean(torch.cat(inputs, dim=0), dim=0, keepdim=True)
    return torch.mean((1 - W) * (1 - x_mean) ** 2)


def their_sparsity_error(W):
    return torch.max(torch.min(torch.abs(W), torch.abs(1 - torch.abs(W))))


def their_nac_w(sd, pre=""):
    return torch.tanh(sd[pre + "W_hat"]) * torch.sigmoid(sd[pre + "M_hat"])


def their_nau(sd, x):  # ReRegualizedLinearNACLayer.forward
    return F.linear(x, torch.clamp(sd["W"], -1.0, 1.0))


def their_mnac(sd, x, clamp=True):  # ReRegualizedLinearMNACLayer.forward, mnac(x, W, mode='prod')
    W = torch.clamp(sd["W"], 0.0, 1.0) if clamp else sd["W"]
    out_size, in_size = W.size()
    x = x.view(x.size(0), in_size, 1)
    W = W.t().view(1, in_size, out_size)
    return torch.prod(x * W + 1 - W, -2)


def their_rerl_regualizers(W, inputs, mnac, shape="squared", oob="regualized", z=1):
    if mnac:
        bias = (torch.mean(W ** 2 * (1 - W) ** 2) if shape == "squared"
                else torch.mean(torch.min(torch.abs(W), torch.abs(1 - W))))
        out = torch.relu(torch.abs(W - 0.5 - 0) - 0.5 + 0)
        zz = their_nmu_z(W, inputs) if z else 0
    else:
        bias = (torch.mean(W ** 2 * (1 - torch.abs(W)) ** 2) if shape == "squared"
                else torch.mean(torch.min(torch.abs(W), torch.abs(1 - torch.abs(W)))))
        out = torch.relu(torch.abs(W) - 1)
        zz = their_nau_z(W, inputs) if z else 0
    out = 0 if oob == "clip" else torch.mean(out ** 2 if shape == "squared" else out)
    return {"W": bias, "z": zz, "W-OOB": out}


def _wide(layer, scale=1.5):
    """Parameters drawn wide (some of a NAU's / NMU's W out of range), float64."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(rand_params(p.shape) * scale)
    return layer


def _close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)


def test_regualizer_z_nac_against_their_formula():
    unit = _wide(compat.StableNACLayer(I, O, regualizer_z=1, dtype=torch.float64))
    xs = [rand_input((4, I)), rand_input((6, I))]
    for x in xs:
        unit(x)
    W = their_nac_w(compat.to_stable_nalu(unit))
    reg = unit.regualizer()
    _close(reg["z"], their_nau_z(W, xs))
    assert torch.equal(reg["z"], their_nau_z(W, xs))  # same elementwise order, same reduction order
    reg["z"].backward()
    assert unit.W_hat.grad.abs().sum() > 0
    unit.optimize(None)  # their optimize(): the stored inputs go
    assert unit.regualizer()["z"] == 0
    x = rand_input((3, I))
    unit(x)
    _close(unit.regualizer()["z"], their_nau_z(W, [x]))
    # regualizer_z=0 stores nothing and gives 0, as their RegualizerNAUZ(zero=True)
    plain = compat.StableNACLayer(I, O, dtype=torch.float64)
    plain(x)
    assert plain.regualizer() == {"z": 0} and plain._z_inputs == [[]]


def test_regualizer_z_skips_no_random_forwards():
    Layers = compat.stable_nalu_layers(_ExtendedTorchModule)
    unit = Layers["NAC"](I, O, regualizer_z=1, dtype=torch.float64)
    x = rand_input((4, I))
    unit._set_random(False)  # their model.no_random(): the test-set forwards
    unit(x)
    assert unit._z_inputs == [[]]
    unit._set_random(True)
    unit(x)
    assert len(unit._z_inputs[0]) == 1


@pytest.mark.parametrize("two_nac", [False, True])
def test_regualizer_z_nalu_against_their_formula(two_nac):
    unit = _wide(compat.StableNALULayer(I, O, regualizer_z=1, nalu_two_nac=two_nac, dtype=torch.float64), 1.0)
    xs = [rand_input((4, I)), rand_input((5, I))]
    for x in xs:
        unit(x)
    sd = compat.to_stable_nalu(unit)
    logs = [torch.log(torch.abs(x) + 1e-7) for x in xs]
    if two_nac:  # nac_add sees x, nac_mul sees log(|x| + eps): one z each, summed by their recursion
        want = their_nau_z(their_nac_w(sd, "nac_add."), xs) + their_nau_z(their_nac_w(sd, "nac_mul."), logs)
    else:  # one NAC, called on x and (reuse=True) on log(|x| + eps), storing both
        want = their_nau_z(their_nac_w(sd, "nac_add."), [xs[0], logs[0], xs[1], logs[1]])
    _close(unit.regualizer()["z"], want)


@pytest.mark.parametrize("mnac", [False, True])
@pytest.mark.parametrize("shape", ["squared", "linear"])
@pytest.mark.parametrize("oob", ["regualized", "clip"])
def test_nau_nmu_units_regualizers_against_theirs(mnac, shape, oob):
    Unit = compat.StableNMULayer if mnac else compat.StableNAULayer
    unit = _wide(Unit(I, O, regualizer_z=1, regualizer_shape=shape, nac_oob=oob, dtype=torch.float64))
    if mnac:
        with torch.no_grad():
            unit.W.add_(0.5)
    xs = [rand_input((4, I)), rand_input((2, I))]
    for x in xs:
        y = unit(x)
    sd = compat.to_stable_nalu(unit)
    fwd = (lambda s, v: their_mnac(s, v, clamp=oob == "regualized")) if mnac else their_nau
    torch.testing.assert_close(y, fwd(sd, xs[-1]), rtol=1e-12, atol=1e-13)
    reg, want = unit.regualizer(), their_rerl_regualizers(sd["W"], xs, mnac, shape, oob)
    assert list(reg) == ["W", "z", "W-OOB"]
    for k in want:
        _close(reg[k], want[k])
    unit.optimize(None)
    assert unit._z_inputs == [[]]
    low, high = (0.0, 1.0) if mnac else (-1.0, 1.0)
    outside = ((unit.W < low) | (unit.W > high)).any().item()
    assert outside == (oob == "regualized")  # 'clip': their optimize() clamps W


# --- the writer ------------------------------------------------------------------------------------


def test_writer_nac_and_nalu_tags_as_theirs():
    Layers = compat.stable_nalu_layers(_ExtendedTorchModule)
    w = _Writer("run")
    nac = Layers["NAC"](I, O, writer=w, name="layer_1", dtype=torch.float64)
    nac.reset_parameters()
    x = rand_input((4, I))
    nac(x)
    W = their_nac_w(compat.to_stable_nalu(nac))
    assert w.tags() == [("add_histogram", "run/layer_1/W"), ("add_tensor", "run/layer_1/W"),
                        ("add_scalar", "run/layer_1/W/sparsity_error")]
    assert torch.equal(w.value("add_tensor", "run/layer_1/W")[0], W.detach())  # their (out, in) layout
    _close(w.value("add_scalar", "run/layer_1/W/sparsity_error")[0], their_sparsity_error(W))
    assert w.calls[2][3] == {"verbose_only": False}  # logged in default (non-verbose) runs

    for two_nac, bias in [(False, False), (True, True)]:
        w = _Writer("run")
        nalu = Layers["NALU"](I, O, writer=w, name="layer_2", nalu_two_nac=two_nac, nalu_bias=bias,
                              dtype=torch.float64)
        nalu.reset_parameters()
        y = nalu(x)
        sd = compat.to_stable_nalu(nalu)
        g = torch.sigmoid(F.linear(x, sd["G_add"], sd.get("bias_add")))
        naces = ["nac_add", "nac_mul"] if two_nac else ["nac", "nac"]
        want = [("add_histogram", "run/layer_2/gate"), ("add_scalar", "run/layer_2/gate/mean")]
        for n in naces:
            want += [("add_histogram", f"run/layer_2/{n}/W"), ("add_tensor", f"run/layer_2/{n}/W"),
                     ("add_scalar", f"run/layer_2/{n}/W/sparsity_error")]
        want += [("add_histogram", "run/layer_2/add"), ("add_histogram", "run/layer_2/mul")]
        assert w.tags() == want
        _close(w.value("add_scalar", "run/layer_2/gate/mean")[0], torch.mean(g))
        torch.testing.assert_close(w.value("add_histogram", "run/layer_2/gate")[0], g.detach())
        W_mul = their_nac_w(sd, "nac_mul." if two_nac else "nac_add.")
        assert torch.equal(w.value("add_tensor", f"run/layer_2/{naces[1]}/W")[-1], W_mul.detach())
        torch.testing.assert_close(y, stable_nalu_nalu(sd, x), rtol=1e-12, atol=1e-13)  # keep_parts: same y

        # regualizer/* and log_gradients (their ExtendedTorchModule's): first row of each (out, in) grad
        w.calls.clear()
        y.pow(2).sum().backward()
        nalu.regualizer()
        nalu.log_gradients()
        params = [("G_add", nalu.G), ("bias_add", nalu.G_bias)] if bias else [("G_add", nalu.G)]
        want = [("add_scalar", f"run/layer_2/{n}/regualizer/z") for n in naces[:2 if two_nac else 1]]
        for name, _ in params:
            want += [("add_summary", f"run/layer_2/{name}/grad"), ("add_histogram", f"run/layer_2/{name}/grad")]
        for n in naces[:2 if two_nac else 1]:
            for name in ("W_hat", "M_hat"):
                tag = f"run/layer_2/{n}/{name}/grad"
                want += [("add_summary", tag), ("add_histogram", tag)]
        assert w.tags() == want
        assert torch.equal(w.value("add_summary", "run/layer_2/G_add/grad")[0], nalu.G.grad.t()[0])


@pytest.mark.parametrize("unit_name", ["ReRegualizedLinearNAC", "ReRegualizedLinearMNAC"])
def test_writer_nau_nmu_tags_as_theirs(unit_name):
    w = _Writer("run")
    unit = compat.stable_nalu_layers(_ExtendedTorchModule)[unit_name](I, O, writer=w, name="layer_1",
                                                                        dtype=torch.float64)
    unit.reset_parameters()
    unit(rand_input((4, I))).sum().backward()
    unit.regualizer()
    unit.log_gradients()
    t = "run/layer_1/"
    assert w.tags() == [("add_histogram", t + "W"), ("add_tensor", t + "W"), ("add_scalar", t + "W/sparsity_error"),
                        ("add_scalar", t + "regualizer/W"), ("add_scalar", t + "regualizer/z"),
                        ("add_scalar", t + "regualizer/W-OOB"), ("add_summary", t + "W/grad"),
                        ("add_histogram", t + "W/grad")]
    assert torch.equal(w.value("add_tensor", t + "W")[0], unit.W.detach().t())
    assert torch.equal(w.value("add_summary", t + "W/grad")[0], unit.W.grad.t()[0])


def test_writer_nan_check_and_quiet_steps():
    Layers = compat.stable_nalu_layers(_ExtendedTorchModule)
    nalu = Layers["NALU"](I, O, writer=_Writer())
    nalu.reset_parameters()
    x = rand_input((4, I)).float()
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="nan detected"):  # their histogram's check, on the gate
        nalu(x)

    class Quiet(_Writer):  # their SummaryWriterNamespace off its log step: histograms still check NaN
        def namespace(self, name):
            return Quiet(f"{self.path}/{name}", self.calls)

        def is_log_iteration(self):
            return False

        def is_logging_enabled(self):
            return True

        def is_verbose(self, verbose_only):
            return True

    q = Quiet()
    nac = Layers["NAC"](I, O, writer=q)
    nac(rand_input((4, I)).float())
    assert [m for m, _ in q.tags()] == ["add_histogram", "add_tensor"]  # no scalar computed
    # their DummySummaryWriter (writer=None in their code) gets nothing, and the NALU keeps no parts
    DummySummaryWriter = type("DummySummaryWriter", (_Writer,), {"namespace": lambda self, n: self})
    d = DummySummaryWriter()
    quiet = Layers["NALU"](I, O, writer=d)
    quiet(rand_input((4, I)).float())
    assert d.calls == [] and quiet.parts is None


# --- pickling: torch.save(model), their save_model ------------------------------------------------


class _Generalized(_ExtendedTorchModule):
    """Their GeneralizedLayer / SimpleFunctionStaticNetwork, as far as construction goes."""

    def __init__(self, writer=None):
        super().__init__("network", writer=writer)
        layers = compat.stable_nalu_layers(_ExtendedTorchModule)
        cells = compat.stable_nalu_cells(_ExtendedTorchModule)
        kw = dict(eps=1e-7, nac_oob="regualized", regualizer_shape="squared", regualizer_z=1, mnac_epsilon=0,
                  nalu_bias=False, nalu_two_nac=True, nalu_two_gate=False, nalu_mul="normal", nalu_gate="regualized")
        self.layer_1 = layers["ReRegualizedLinearNAC"](I, O, writer=self.writer, name="layer_1", **kw)
        self.layer_2 = layers["NALU"](O, O, writer=self.writer, name="layer_2", **kw)
        self.layer_3 = layers["ReRegualizedLinearMNAC"](O, 1, writer=self.writer, name="layer_3", **kw)
        self.cell = cells["NAC"](1, 2, writer=self.writer, name="recurrent_layer", **kw)
        for m in (self.layer_1, self.layer_2, self.layer_3, self.cell):
            m.reset_parameters()

    def forward(self, x):
        z = self.layer_3(self.layer_2(self.layer_1(x)))
        return self.cell(z, torch.zeros(z.shape[0], 2))


def test_built_units_pickle_with_torch_save(tmp_path):
    torch.manual_seed(0)
    net = _Generalized(writer=_Writer("run"))
    x = torch.rand(6, I) + 0.5
    y = net(x)
    net.regualizer()
    path = tmp_path / "model.pth"
    torch.save(net, path)  # what their save_model does at the end of every run
    back = torch.load(path, weights_only=False)
    for name in ("layer_1", "layer_2", "layer_3", "cell"):
        assert type(getattr(back, name)) is type(getattr(net, name))  # the same built classes
    assert type(back.cell.op) is compat.stable_nalu_layers(_ExtendedTorchModule)["NAC"]
    assert back.layer_2.writer.path == "run/network/layer_2" and back.layer_2._nac_writers[1].path.endswith("nac_mul")
    torch.testing.assert_close(back(x), y, rtol=0, atol=0)
    assert back.state_dict().keys() == net.state_dict().keys()
    import copy
    copy.deepcopy(back.layer_1)
    # and in a fresh interpreter, where nothing has built the classes yet
    import subprocess
    import sys
    code = ("import torch, sys; m = torch.load(sys.argv[1], weights_only=False); "
            "print(type(m.layer_2).__name__, type(m.cell).__name__, float(m(torch.full((2, 5), 0.75)).sum()))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["StableNALULayer", "NACCell"]
    assert float(out.stdout.split()[2]) == pytest.approx(float(net(torch.full((2, 5), 0.75)).sum().detach()), rel=1e-6)


def test_built_classes_are_built_once_per_base():
    a, b = compat.stable_nalu_units(_ExtendedTorchModule), compat.stable_nalu_units(_ExtendedTorchModule)
    assert a == b and a == (compat.stable_nalu_layers(_ExtendedTorchModule)["NAC"],
                            compat.stable_nalu_layers(_ExtendedTorchModule)["NALU"])
    assert set(compat.stable_nalu_layers(_ExtendedTorchModule)) == set(compat.STABLE_NALU_UNIT_NAMES) == {
        "NAC", "NALU", "ReRegualizedLinearNAC", "ReRegualizedLinearMNAC"}
    with pytest.raises(ValueError, match="ExtendedTorchModule"):
        compat.stable_nalu_layers(object())


# --- NAU / NMU: converters, init, units -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_stable_nalu_nau_nmu_converters_both_ways(backend):
    from nalu_cuda import NAU, NMU
    theirs = {"W": _leaf(O, I)}
    _check_theirs_to_ours(theirs, their_nau, compat.from_stable_nalu, compat.to_stable_nalu,
                          NAU(I, O, backend=backend, dtype=torch.float64))
    _check_ours_to_theirs(NAU(I, O, backend=backend, dtype=torch.float64), their_nau, compat.to_stable_nalu)
    # the plain NMU uses W as it is: their MNAC with nac_oob='clip' (W kept in [0, 1] by optimize())
    theirs = {"W": (torch.rand(O, I, dtype=torch.float64)).requires_grad_()}
    unclamped = lambda sd, x: their_mnac(sd, x, clamp=False)  # noqa: E731
    _check_theirs_to_ours(theirs, unclamped, compat.from_stable_nalu, compat.to_stable_nalu,
                          NMU(I, O, backend=backend, dtype=torch.float64))
    # the unit clamps as their default nac_oob='regualized' does
    theirs = {"W": (torch.rand(O, I, dtype=torch.float64) * 1.6 - 0.3).requires_grad_()}
    _check_theirs_to_ours(theirs, their_mnac, compat.from_stable_nalu, compat.to_stable_nalu,
                          compat.StableNMULayer(I, O, backend=backend, dtype=torch.float64))
    # in a whole model, under their prefix
    model = {"layer_1.layer.W": torch.zeros(O, I), "layer_2.layer.W": torch.ones(1, O)}
    assert compat.from_stable_nalu(model, prefix="layer_2.layer.")["W"].shape == (O, 1)


def test_stable_nalu_nau_refusals():
    from nalu_cuda import NAU
    with pytest.raises(ValueError, match="ReRegualizedLinearNALU.*prefix='nac_add.'"):
        compat.from_stable_nalu({"G_add": torch.zeros(O, I), "nac_add.W": torch.zeros(O, I)})
    with pytest.raises(ValueError, match="'W' .*NAU / NMU.*kevinzakka"):
        compat.to_kevinzakka({"W": torch.zeros(I, O)})
    with pytest.raises(ValueError, match="a NAU has no counterpart in kevinzakka"):
        compat.to_kevinzakka(NAU(I, O))
    with pytest.raises(ValueError, match="ensemble"):
        compat.to_stable_nalu(NAU(I, O, ensemble=2))
    with pytest.raises(ValueError, match="mnac_epsilon"):
        compat.StableNMULayer(I, O, mnac_epsilon=0.1)
    with pytest.raises(ValueError, match="mnac_normalized"):
        compat.StableNMULayer(I, O, mnac_normalized=True)
    with pytest.raises(ValueError, match="nac_oob='sometimes'"):
        compat.StableNAULayer(I, O, nac_oob="sometimes")


@pytest.mark.parametrize("fan", [(I, O), (100, 2), (2, 1)])
def test_nau_nmu_init_draws_their_numbers(fan):
    from nalu_cuda import NAU, NMU
    i, o = fan
    torch.manual_seed(9)  # their ReRegualizedLinearNACLayer.reset_parameters
    std = math.sqrt(2.0 / (i + o))
    r = min(0.5, math.sqrt(3.0) * std)
    W_nau = torch.nn.init.uniform_(torch.empty(o, i), -r, r)
    torch.manual_seed(9)  # their ReRegualizedLinearMNACLayer.reset_parameters
    r = min(0.25, math.sqrt(3.0) * math.sqrt(0.25))
    W_nmu = torch.nn.init.uniform_(torch.empty(o, i), 0.5 - r, 0.5 + r)
    for Layer, want in ((NAU, W_nau), (NMU, W_nmu)):
        torch.manual_seed(9)
        assert torch.equal(Layer(i, o, init="stable-nalu-nac").W, want.t())
        torch.manual_seed(9)
        assert torch.equal(compat.from_stable_nalu({"W": want})["W"], Layer(i, o, init="stable-nalu-nac").W)
    for Unit, want in ((compat.StableNAULayer, W_nau), (compat.StableNMULayer, W_nmu)):
        state = torch.random.get_rng_state()
        unit = Unit(i, o)
        assert torch.equal(torch.random.get_rng_state(), state)  # construction draws nothing, as theirs
        torch.manual_seed(9)
        unit.reset_parameters()
        assert torch.equal(unit.W, want.t())


# --- recurrent cells -------------------------------------------------------------------------------


@pytest.mark.parametrize("unit_name", ["NAC", "NALU", "ReRegualizedLinearNAC", "ReRegualizedLinearMNAC"])
def test_cells_are_their_abstract_recurrent_cell(unit_name):
    Cell = compat.stable_nalu_cells(_ExtendedTorchModule)[unit_name]
    w = _Writer("run")
    cell = Cell(I, 2, writer=w, name="recurrent_layer", regualizer_z=1, dtype=torch.float64)
    cell.reset_parameters()
    assert isinstance(cell, _ExtendedTorchModule) and isinstance(cell.op, _ExtendedTorchModule)
    assert (cell.op.in_features, cell.op.out_features) == (I + 2, 2)
    assert all(k.startswith("op.") for k in cell.state_dict())
    x, h = rand_input((4, I)), rand_input((4, 2))
    if unit_name == "ReRegualizedLinearMNAC":
        x, h = x.abs() + 0.5, h.abs() + 0.5
    y = cell(x, h)
    xh = torch.cat((x, h), dim=1)
    sd = compat.to_stable_nalu(cell.op)
    want = {"NAC": lambda: kevinzakka_nac(sd, xh), "NALU": lambda: stable_nalu_nalu(sd, xh),
            "ReRegualizedLinearNAC": lambda: their_nau(sd, xh), "ReRegualizedLinearMNAC": lambda: their_mnac(sd, xh)}
    torch.testing.assert_close(y, want[unit_name](), rtol=1e-12, atol=1e-13)
    assert w.tags()[0][1].startswith("run/recurrent_layer/recurrent_layer/")  # their namespaces: cell, then op
    assert "z" in cell.regualizer()  # their recursion reaches the op
    cell.optimize(None)
    assert cell.op._z_inputs[0] == []


# --- kevinzakka's eps ------------------------------------------------------------------------------


def test_kevinzakka_eps_warns_and_the_helpers_carry_it():
    theirs = {k: v.detach() for k, v in _their_sd(["G", "nac.W_hat", "nac.M_hat"]).items()}
    with pytest.warns(UserWarning, match=r"eps=1e-10.*NALU\(in_features, out_features, eps=1e-10\)"):
        compat.from_kevinzakka(theirs)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.from_kevinzakka({"W_hat": theirs["G"], "M_hat": theirs["G"]})  # a NAC has no eps: no warning
        layer = compat.kevinzakka_layer(theirs)
        second = {"W_hat": _leaf(2, O).detach(), "M_hat": _leaf(2, O).detach()}  # their models.NALU: model.i.
        stack = compat.kevinzakka_model({**{f"model.0.{k}": v for k, v in theirs.items()},
                                         **{f"model.1.{k}": v for k, v in second.items()}})
    assert isinstance(layer, NALU) and layer.eps == compat.KEVINZAKKA_EPS == 1e-10
    assert layer.W_hat.dtype == torch.float64
    x = rand_input((7, I))
    x[0] = 0.0  # where eps decides the multiplicative path
    torch.testing.assert_close(layer(x), kevinzakka_nalu(theirs, x), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(stack(x), kevinzakka_nac(second, kevinzakka_nalu(theirs, x)), rtol=1e-12, atol=1e-13)
    assert isinstance(stack[1], NAC) and len(stack) == 2
    # the trap the warning is about: the same weights under nalu_cuda's default eps compute another function
    default = NALU(I, O, dtype=torch.float64)
    default.load_state_dict(compat.from_kevinzakka(theirs))
    assert not torch.allclose(default(x)[0], layer(x)[0])
