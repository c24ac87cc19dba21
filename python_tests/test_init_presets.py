"""nalu_cuda.init_presets: the table of initialisations every module draws from."""
import math

import pytest
import torch

from nalu_cuda import NAC, NALU, NAU, NMU, NACMul, init_presets

PRESETS = list(init_presets.PRESETS)
MODULES = {
    "nac": lambda **kw: NAC(6, 3, **kw),
    "nac_mul": lambda **kw: NACMul(6, 3, **kw),
    "nalu": lambda **kw: NALU(6, 3, **kw),
    "nalu_sep_bias": lambda **kw: NALU(6, 3, tied=False, gate_bias=True, **kw),
    "nalu_indep": lambda **kw: NALU(6, 3, gate="independent", **kw),
}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(MODULES))
def test_member_e_with_generator_e_equals_a_plain_layer(name, preset):
    seeds = [11, 12, 13]
    ens = MODULES[name](ensemble=3, init=preset)
    ens.reset_parameters([torch.Generator().manual_seed(s) for s in seeds])
    for e, s in enumerate(seeds):
        plain = MODULES[name](init=preset)
        plain.reset_parameters(torch.Generator().manual_seed(s))
        for (n, p), q in zip(ens.named_parameters(), plain.parameters()):
            assert torch.equal(p[e], q), (n, e)


def test_default_is_stable_nalu_and_unchanged():
    """The default draws U(-r, r), r = min(0.5, sqrt(3) sqrt(2 / (in + out))), then a Glorot gate, in
    (in, out) order: existing seeds give the numbers they gave before presets existed."""
    layer = NALU(6, 3, tied=False)
    assert layer.init == "stable-nalu"
    layer.reset_parameters(torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    r, gb = min(0.5, math.sqrt(3 * 2 / 9)), math.sqrt(6 / 9)
    want = [torch.empty(6, 3).uniform_(-r, r, generator=gen) for _ in range(4)]
    want.append(torch.empty(6, 3).uniform_(-gb, gb, generator=gen))
    for p, w in zip(layer.parameters(), want):
        assert torch.equal(p, w)


@pytest.mark.parametrize("preset, nac_bound, gate_bound", [
    ("stable-nalu", min(0.5, math.sqrt(3 * 2 / 102)), math.sqrt(6 / 102)),
    ("stable-nalu-nac", init_presets.nac_optimal_bound(100, 2), math.sqrt(6 / 102)),
    ("kaiming", math.sqrt(6 / 100), 1 / math.sqrt(100)),
])
def test_bounds(preset, nac_bound, gate_bound):
    layer = NALU(100, 2, gate_bias=True, init=preset)
    for p, bound in ((layer.W_hat, nac_bound), (layer.M_hat, nac_bound), (layer.G, gate_bound)):
        assert p.abs().max() <= bound
        assert p.abs().max() > 0.8 * bound  # 200 draws reach near the bound
    assert torch.equal(layer.G_bias, torch.zeros(2))
    assert torch.equal(NALU(100, 2, gate="independent", init=preset).G, torch.zeros(2))


def test_unknown_preset_and_missing_role():
    with pytest.raises(ValueError, match=r"nalu_cuda.NAC: argument 'init' must be one of .*got 'xavier'"):
        NAC(2, 2, init="xavier")
    init_presets.register("nac-only", "nac", init_presets.PRESETS["stable-nalu"]["nac"])
    try:
        NAC(2, 2, init="nac-only")  # has every role a NAC needs
        with pytest.raises(ValueError, match="preset 'nac-only' has no rule for parameters of role 'gate'"):
            NALU(2, 2, init="nac-only")
    finally:
        del init_presets.PRESETS["nac-only"]


@pytest.mark.parametrize("Unit, preset", [(U, p) for U in (NAU, NMU) for p in ("stable-nalu", "stable-nalu-nac")])
def test_nau_nmu_presets(Unit, preset):
    """NAU / NMU draw ``W`` from the table (roles "nau", "nmu"): the default in (in, out) order, as
    before presets had these roles; "stable-nalu-nac" the same distribution in stable-nalu's (out, in)
    order; members of an ensemble as plain layers."""
    layer = Unit(6, 3, init=preset)
    assert layer.init == preset
    layer.reset_parameters(torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    low, high = (-min(0.5, math.sqrt(3 * 2 / 9)), min(0.5, math.sqrt(3 * 2 / 9))) if Unit is NAU else (0.25, 0.75)
    shape = (6, 3) if preset == "stable-nalu" else (3, 6)
    want = torch.empty(shape).uniform_(low, high, generator=gen)
    assert torch.equal(layer.W, want if preset == "stable-nalu" else want.t())
    ens = Unit(6, 3, ensemble=2, init=preset)
    ens.reset_parameters([torch.Generator().manual_seed(s) for s in (1, 2)])
    for e, s in enumerate((1, 2)):
        layer.reset_parameters(torch.Generator().manual_seed(s))
        assert torch.equal(ens.W[e], layer.W)


def test_nau_nmu_preset_without_their_role():
    with pytest.raises(ValueError, match="preset 'kaiming' has no rule for parameters of role 'nau'"):
        NAU(2, 2, init="kaiming")
    with pytest.raises(ValueError, match="role 'nmu'"):
        NMU(2, 2, init="kaiming")
