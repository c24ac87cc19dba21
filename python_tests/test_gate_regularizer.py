"""The gate regulariser as one fused op: ``nalu_gate_regularizer(g, per_member)`` = ``sum(g^2 (1 - g)^2)``
(stable-nalu's ``nalu_gate='regualized'``) and its backward ``grad 2 g (1 - g) (1 - 2 g)``.

Values and gradients against :func:`nalu_cuda.reference.nalu_gate_regularizer` (float32 and float64,
plain and per member, empty gates), float64 gradcheck and gradgradcheck (the differentiable backward
under ``create_graph``), ``opcheck``, the gradient reaching a NALU's parameters through
:func:`nalu_cuda.functional.nalu_parts`' gate, stable-nalu's ``StableNALULayer.regualizer()`` on
both backends, and the errors. Gates are drawn fresh per test: sigmoids of random pre-activations,
so every value is strictly inside (0, 1), as a gate's is.
"""
import pytest
import torch

from nalu_cuda import compat, functional, reference
from nalu_cuda.testing import rand_input, rand_params, tolerances

from .conftest import DEVICES

ops = torch.ops.nalu_cuda

CASES = {"plain": ((128, 2), False), "plain_3d": ((4, 16, 3), False), "members": ((4, 16, 3), True),
         "members_1d": ((5,), True), "empty": ((0, 3), False), "no_members": ((0, 3), True),
         "empty_members": ((3, 0), True)}


def gate(shape, dtype, device="cpu"):
    return torch.sigmoid(torch.randn(shape, dtype=torch.float64) * 2).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_reference(case, dtype, device):
    shape, per_member = CASES[case]
    g = gate(shape, dtype, device).requires_grad_()
    g_ref = g.detach().double().cpu().requires_grad_()
    r = functional.nalu_gate_regularizer(g, per_member)
    r_ref = reference.nalu_gate_regularizer(g_ref, per_member)
    assert r.shape == r_ref.shape == ((shape[0],) if per_member else ())
    assert r.dtype == dtype
    rtol, atol = tolerances(dtype, fan_in=max(1, g.numel()))
    torch.testing.assert_close(r.detach().cpu().double(), r_ref.detach(), rtol=rtol, atol=atol)
    if g.numel():
        assert float(r_ref.detach().sum()) > 0  # a real value, not 0 == 0
    w = torch.randn(r_ref.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad((r * w.to(dtype=dtype, device=device)).sum(), g)
    (grad_ref,) = torch.autograd.grad((r_ref * w).sum(), g_ref)
    rtol, atol = tolerances(dtype, grad=True)
    torch.testing.assert_close(grad.cpu().double(), grad_ref, rtol=rtol, atol=atol)


def test_known_values():
    g = torch.tensor([[0.5, 0.0], [1.0, 0.25]], dtype=torch.float64, requires_grad=True)
    r = functional.nalu_gate_regularizer(g)
    # 0.5^2 0.5^2 = 1/16; 0 at 0 and 1; 0.25^2 0.75^2 = 9/256
    assert float(r.detach()) == pytest.approx(1 / 16 + 9 / 256, abs=1e-15)
    (grad,) = torch.autograd.grad(r, g)
    # 2 g (1 - g) (1 - 2 g): 0 at 0.5, 0 and 1; at 0.25: 2 * 0.25 * 0.75 * 0.5 = 0.1875
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [0.0, 0.1875]], dtype=torch.float64))
    members = functional.nalu_gate_regularizer(g.detach(), per_member=True)
    torch.testing.assert_close(members, torch.tensor([1 / 16, 9 / 256], dtype=torch.float64))


@pytest.mark.parametrize("per_member", [False, True])
def test_gradcheck_and_gradgradcheck(per_member):
    g = gate((3, 5, 2), torch.float64).requires_grad_()
    fn = lambda t: functional.nalu_gate_regularizer(t, per_member)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (g,))
    assert torch.autograd.gradgradcheck(fn, (g,))


@pytest.mark.parametrize("per_member", [False, True])
def test_opcheck(per_member):
    g = gate((4, 6), torch.float32).requires_grad_()
    torch.library.opcheck(ops.nalu_gate_regularizer, (g, per_member))
    grad = torch.randn((4,) if per_member else ())
    torch.library.opcheck(ops.nalu_gate_regularizer_backward, (grad, g.detach(), per_member))


@pytest.mark.parametrize("E", [None, 3])
def test_reaches_the_nalu_parameters_through_the_kept_gate(E):
    """The regulariser on nalu_parts' g: its gradient enters the fused backward as grad_g."""
    lead = () if E is None else (E,)
    x = rand_input(lead + (37, 10))
    t = {n: rand_params(lead + (10, 2)).requires_grad_() for n in ("W_hat", "M_hat", "G")}
    t["G_bias"] = rand_params(lead + (2,)).requires_grad_()
    names = sorted(t)

    def grads(mod):
        y, _a, _m, g = mod.nalu_parts(x, t["W_hat"], t["M_hat"], t["G"], G_bias=t["G_bias"])
        loss = y.sum() + mod.nalu_gate_regularizer(g, E is not None).sum()
        return torch.autograd.grad(loss, [t[n] for n in names])

    for name, u, v in zip(names, grads(functional), grads(reference)):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_stable_nalu_gate_regualizer_uses_it(backend):
    """StableNALULayer(nalu_gate='regualized').regualizer()['g'] is their sum(g^2 (1 - g)^2) of the last
    call's gate, with its gradient, on the fused and the reference backend."""
    torch.manual_seed(0)
    layer = compat.StableNALULayer(10, 3, nalu_gate="regualized", nalu_bias=True, backend=backend).double()
    layer.reset_parameters()
    x = rand_input((16, 10))
    layer(x)
    g = layer.parts.g
    r = layer.regualizer()["g"]
    torch.testing.assert_close(r, torch.sum(g ** 2 * (1 - g) ** 2), rtol=1e-12, atol=1e-12)
    params = [layer.G, layer.G_bias]
    got = torch.autograd.grad(r, params)
    y_ref, _a, _m, g_ref = reference.nalu_parts(x, layer.W_hat, layer.M_hat, layer.G, layer.W_hat_m, layer.M_hat_m,
                                                layer.eps, G_bias=layer.G_bias)
    want = torch.autograd.grad(torch.sum(g_ref ** 2 * (1 - g_ref) ** 2), params)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fake", [False, True], ids=["op", "fake"])
def test_errors_name_the_op_and_argument(fake):
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else None

    def call(fn, *args):
        if mode is None:
            return fn(*args)
        with mode:
            return fn(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])

    with pytest.raises(Exception, match=r"nalu_gate_regularizer: argument 'g' must be a floating-point tensor, "
                                        r"got dtype (Long|torch.int64)"):
        call(ops.nalu_gate_regularizer, torch.ones(3, dtype=torch.int64), False)
    with pytest.raises(Exception, match=r"nalu_gate_regularizer: argument 'g' must have a leading member "
                                        r"dimension \(E, \.\.\.\) with per_member=True, got shape \[\]"):
        call(ops.nalu_gate_regularizer, torch.tensor(0.5), True)
    with pytest.raises(Exception, match=r"nalu_gate_regularizer_backward: argument 'grad' must have the "
                                        r"regulariser's shape \[3\], got \[2\]"):
        call(ops.nalu_gate_regularizer_backward, torch.ones(2), gate((3, 4), torch.float32), True)
    with pytest.raises(Exception, match=r"nalu_gate_regularizer_backward: argument 'grad' must have the dtype of "
                                        r"'g'"):
        call(ops.nalu_gate_regularizer_backward, torch.ones((), dtype=torch.float64), gate((3, 4), torch.float32),
             False)


def test_cpu_kernel_dtypes_are_named():
    with pytest.raises(RuntimeError, match=r"nalu_gate_regularizer: the CPU kernel supports dtypes Float, Double, "
                                           r"got Half"):
        functional.nalu_gate_regularizer(gate((3,), torch.float16))


def test_reference_refuses_per_member_without_members():
    with pytest.raises(ValueError, match=r"reference.nalu_gate_regularizer: argument 'g' must have a leading member"):
        reference.nalu_gate_regularizer(torch.tensor(0.5), per_member=True)
