"""Second derivatives through the fused ops (create_graph=True): gradgradcheck, Hessian-vector
products against the reference, and the plain backward still taking the fused backward op."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_params

from .conftest import DEVICES
from .test_ops import UNITS, make_args

# (E or None, batch shape, I, O): the rowwise path, the BLAS path, an ensemble.
SHAPES = [(None, (4,), 3, 2), (None, (3,), 3, 17), (2, (2, 2), 3, 2)]
SHAPE_IDS = ["rowwise", "blas", "ensemble"]


def unit_shape_device_cases(fn):
    """Parametrize a test ``(unit, shape, device)`` over UNITS, SHAPES and DEVICES."""
    fn = pytest.mark.parametrize("unit", list(UNITS))(fn)
    fn = pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)(fn)
    return pytest.mark.parametrize("device", DEVICES)(fn)


def float64_args(unit, shape, device):
    """``make_args`` of ``unit`` for a SHAPES entry, in float64."""
    E, batch, I, O = shape
    return make_args(unit, E, batch, I, O, torch.float64, device)


@unit_shape_device_cases
def test_gradgradcheck(unit, shape, device):
    args, kwargs = float64_args(unit, shape, device)
    args = tuple(t.requires_grad_() for t in args)
    fused_fn = UNITS[unit][1]
    assert torch.autograd.gradgradcheck(lambda *t: fused_fn(*t, **kwargs), args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_gradgradcheck_nac_weight(device):
    W = rand_params((4, 3), scale=1.5, device=device).requires_grad_()
    M = rand_params((4, 3), scale=1.5, device=device).requires_grad_()
    assert torch.autograd.gradgradcheck(F.nac_weight, (W, M))


def _hvp(fn, args, kwargs, gy, v):
    """(first gradients, Hessian-vector product) of sum(fn(args) * gy) for every argument."""
    args = [t.detach().clone().requires_grad_() for t in args]
    loss = (fn(*args, **kwargs) * gy).sum()
    grads = torch.autograd.grad(loss, args, create_graph=True)
    return grads, torch.autograd.grad(grads, args, grad_outputs=v)


@unit_shape_device_cases
def test_hessian_vector_product_matches_reference(unit, shape, device):
    args, kwargs = float64_args(unit, shape, device)
    ref_fn, fused_fn = UNITS[unit][:2]
    gy = torch.randn_like(ref_fn(*args, **kwargs))
    v = [torch.randn_like(t) for t in args]
    g_ref, hv_ref = _hvp(ref_fn, args, kwargs, gy, v)
    g_fused, hv_fused = _hvp(fused_fn, args, kwargs, gy, v)
    for name, got, want in zip(("x", "W_hat", "M_hat", "G", "W_hat_m", "M_hat_m"), g_fused, g_ref):
        torch.testing.assert_close(got, want, msg=lambda m: f"first derivative {name}: {m}")
    for name, got, want in zip(("x", "W_hat", "M_hat", "G", "W_hat_m", "M_hat_m"), hv_fused, hv_ref):
        torch.testing.assert_close(got, want, msg=lambda m: f"Hessian-vector product {name}: {m}")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("unit", ["nac", "nac_mul", "nalu"])
def test_only_create_graph_takes_the_composite_backward(unit):
    op = {"nac": "nalu_cuda::nac_backward", "nac_mul": "nalu_cuda::nac_mul_backward",
          "nalu": "nalu_cuda::nalu_backward"}[unit]
    args, kwargs = make_args(unit, None, (5,), 4, 3, torch.float64, "cpu")
    args = [t.requires_grad_() for t in args]
    y = UNITS[unit][1](*args, **kwargs)
    with _RecordOps() as plain:
        torch.autograd.grad(y.sum(), args, retain_graph=True)
    with _RecordOps() as composite:
        torch.autograd.grad(y.sum(), args, create_graph=True)
    assert op in plain.names
    assert op not in composite.names


def test_gradient_penalty_trains_the_weights():
    # A WGAN-style penalty on |dy/dx| reaches the weights only through the second derivative.
    torch.manual_seed(1)
    x = torch.rand(16, 3, dtype=torch.float64) + 0.5
    params = [rand_params((3, 2)).requires_grad_() for _ in range(3)]
    for fn in (R.nalu, F.nalu):
        p = [t.detach().clone().requires_grad_() for t in params]
        xx = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(xx, *p).sum(), xx, create_graph=True)
        penalty = (gx.norm(dim=1) - 1).pow(2).mean()
        grads = torch.autograd.grad(penalty, p)
        if fn is R.nalu:
            want = grads
        else:
            for got, w in zip(grads, want):
                assert got.abs().max() > 0
                torch.testing.assert_close(got, w)
