"""The nn.Modules: parameters, backends, state_dict, ensembles, initialisation, fallback."""
import os
import subprocess
import sys

import pytest
import torch

import nalu_cuda
from nalu_cuda import NAC, NALU, NACMul
from nalu_cuda.testing import rand_input

from .conftest import DEVICES

MODULES = {
    "nac": lambda **kw: NAC(6, 3, **kw),
    "nac_mul": lambda **kw: NACMul(6, 3, **kw),
    "nalu": lambda **kw: NALU(6, 3, **kw),
    "nalu_sep_indep": lambda **kw: NALU(6, 3, tied=False, gate="independent", **kw),
}


def test_parameter_names_and_shapes():
    assert {n: tuple(p.shape) for n, p in NAC(4, 2).named_parameters()} == {"W_hat": (4, 2), "M_hat": (4, 2)}
    assert {n: tuple(p.shape) for n, p in NACMul(4, 2, ensemble=3).named_parameters()} == {
        "W_hat": (3, 4, 2), "M_hat": (3, 4, 2)}
    assert {n: tuple(p.shape) for n, p in NALU(4, 2).named_parameters()} == {
        "W_hat": (4, 2), "M_hat": (4, 2), "G": (4, 2)}
    assert {n: tuple(p.shape) for n, p in NALU(4, 2, tied=False, gate="independent", ensemble=5).named_parameters()} == {
        "W_hat": (5, 4, 2), "M_hat": (5, 4, 2), "W_hat_m": (5, 4, 2), "M_hat_m": (5, 4, 2), "G": (5, 2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODULES))
def test_backends_agree_and_share_state_dict(name, device):
    fused = MODULES[name](backend="fused").to(device).double()
    ref = MODULES[name](backend="reference").to(device).double()
    assert fused.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(fused.state_dict())
    x = rand_input((10, 6), device=device)
    yf, yr = fused(x), ref(x)
    torch.testing.assert_close(yf, yr)
    yf.square().sum().backward()
    yr.square().sum().backward()
    for (n, p), q in zip(fused.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{n}: {m}")
    # and back, through a saved file
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    again = MODULES[name](backend="auto").to(device).double()
    again.load_state_dict(state)
    torch.testing.assert_close(again(x), yr)


@pytest.mark.parametrize("name", list(MODULES))
def test_ensemble_equals_members_trained_one_by_one(name):
    E = 3
    seeds = [11, 22, 33]
    ens = MODULES[name](ensemble=E).double()
    ens.reset_parameters([torch.Generator().manual_seed(s) for s in seeds])
    singles = []
    for s in seeds:
        m = MODULES[name]().double()
        m.reset_parameters(torch.Generator().manual_seed(s))
        singles.append(m)
    x = rand_input((E, 8, 6))
    for e, m in enumerate(singles):
        for (n, p), q in zip(ens.named_parameters(), m.parameters()):
            torch.testing.assert_close(p[e], q, msg=lambda msg: f"init {n}: {msg}")
    # one SGD step each way: the ensemble's member e follows single model e exactly
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    ens(x).square().mean(dim=(1, 2)).sum().backward()
    opt.step()
    for e, m in enumerate(singles):
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x[e]).square().mean().backward()
        o.step()
        torch.testing.assert_close(ens(x)[e], m(x[e]), rtol=1e-10, atol=1e-12)


def test_reset_parameters_is_reproducible_and_documented_bounds():
    a, b = NALU(10, 4), NALU(10, 4)
    a.reset_parameters(torch.Generator().manual_seed(3))
    b.reset_parameters(torch.Generator().manual_seed(3))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    r = min(0.5, (3 * 2 / 14) ** 0.5)
    assert a.W_hat.abs().max() <= r and a.M_hat.abs().max() <= r
    assert a.G.abs().max() <= (6 / 14) ** 0.5
    assert torch.equal(NALU(10, 4, gate="independent").G, torch.zeros(4))
    with pytest.raises(ValueError, match="expected 2 generators"):
        NAC(3, 2, ensemble=2).reset_parameters([torch.Generator()])


def test_effective_weights_and_repr():
    m = NALU(5, 2, tied=False, ensemble=4, gate="independent", eps=1e-6)
    torch.testing.assert_close(m.W, torch.tanh(m.W_hat) * torch.sigmoid(m.M_hat))
    torch.testing.assert_close(m.W_m, torch.tanh(m.W_hat_m) * torch.sigmoid(m.M_hat_m))
    r = repr(m)
    assert "in_features=5" in r and "ensemble=4" in r and "tied=False" in r and "gate='independent'" in r
    assert "eps=1e-06" in r and "backend='auto'" in r


def test_auto_backend_choice():
    m = NALU(4, 2)
    assert m.use_fused(torch.ones(3, 4)) and m.use_fused(torch.ones(3, 4, dtype=torch.float64))
    # no CPU kernel for bfloat16: auto uses the reference, "fused" says so clearly
    xb = rand_input((3, 4), dtype=torch.bfloat16)
    assert not m.use_fused(xb)
    y = m.bfloat16()(xb)
    assert y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nalu_forward: the CPU kernel supports dtypes Float, Double, got BFloat16"):
        NALU(4, 2, backend="fused").bfloat16()(xb)


def test_training_a_nac_on_addition_extrapolates():
    # a + b from 2 of 4 inputs; trained on [1, 2], tested on [2, 6].
    torch.manual_seed(1)
    m = NAC(4, 1)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    target = torch.tensor([1.0, 1.0, 0.0, 0.0])
    for _ in range(1000):
        x = torch.rand(64, 4) + 1
        loss = (m(x).squeeze(-1) - x @ target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # the saturating weights approach {0, 1} slowly; after 1000 steps they are within 0.1
    assert (m.W.detach().squeeze(-1) - target).abs().max() < 0.1, m.W
    x = torch.rand(1000, 4) * 4 + 2
    rel = ((m(x).squeeze(-1) - x @ target).abs() / (x @ target)).max()
    assert rel < 0.15, rel


def _run(code, **env):
    full_env = dict(os.environ, **env)
    full_env.pop("NALU_CUDA_REQUIRE_EXT", None)
    full_env.update(env)
    return subprocess.run([sys.executable, "-W", "default", "-c", code], env=full_env, capture_output=True, text=True)


def test_missing_extension_falls_back_with_one_warning():
    code = (
        "import torch, warnings\n"
        "import nalu_cuda\n"
        "assert not nalu_cuda.has_extension()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    a = nalu_cuda.NALU(3, 2); b = nalu_cuda.NAC(3, 2)\n"
        "    y = a(torch.rand(4, 3) + 1)\n"
        "assert len([x for x in w if 'native extension not available' in str(x.message)]) == 1, [str(x.message) for x in w]\n"
        "try:\n"
        "    nalu_cuda.NALU(3, 2, backend='fused')\n"
        "except RuntimeError as e:\n"
        "    assert \"backend='fused' needs the native extension\" in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    out = _run(code, NALU_CUDA_LIBRARY="/nonexistent/libnalu_cuda_ops.so")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr + out.stdout


def test_require_ext_turns_a_missing_extension_into_an_error():
    out = _run("import nalu_cuda", NALU_CUDA_LIBRARY="/nonexistent/libnalu_cuda_ops.so", NALU_CUDA_REQUIRE_EXT="1")
    assert out.returncode != 0
    assert "NALU_CUDA_REQUIRE_EXT=1 forbids falling back" in out.stderr
