"""The NALU's gate bias and kept parts as arguments of the native ops: ``nalu_forward(..., G_bias)``
and ``nalu_backward(..., G_bias, grad_a, grad_m, grad_g)``.

Every kernel path (CPU: rowwise, lanes, blas; the CUDA paths in test_cuda.py), float32 and float64,
plain and ensemble layers: values and every gradient (``G_bias``'s the batch sum of the gate's
pre-activation gradient) against :mod:`nalu_cuda.reference`, with a loss on ``y`` and on the kept
``a``, ``m``, ``g`` (stable-nalu's gate regulariser among them); the op-level gradients with and
without part gradients; float64 gradcheck; the checks (wrong shape, dtype, device of ``G_bias`` or a
part gradient, ``G_bias`` with an input-independent gate), in the native op and in its fake.
Inputs are drawn fresh per test, bounded away from 0 (``testing.rand_input``), weights scaled so
that exp() stays finite (``testing.rand_params``).
"""
import pytest
import torch

from nalu_cuda import NALU, functional, reference
from nalu_cuda.testing import rand_input, rand_params, tolerances

from .conftest import DEVICES

ops = torch.ops.nalu_cuda

# (E or None, batch shape, I, O) -> the CPU path it takes (layer_types.h: rowwise O <= 16, lanes also I <= 8)
SHAPES = {
    "rowwise": (None, (37,), 100, 2),
    "rowwise_ens": (3, (2, 9), 12, 3),
    "lanes": (None, (70,), 2, 1),
    "lanes_ens": (2, (65,), 4, 2),
    "blas": (None, (11,), 9, 20),
    "blas_ens": (2, (3, 4), 7, 18),
}


def _params(shape, sep, dtype, device):
    E, batch, I, O = shape
    lead = () if E is None else (E,)
    mk = lambda *s: rand_params(lead + s, dtype=dtype, device=device).requires_grad_()  # noqa: E731
    W_hat, M_hat, G = mk(I, O), mk(I, O), mk(I, O)
    W_hat_m, M_hat_m = (mk(I, O), mk(I, O)) if sep else (None, None)
    G_bias = mk(O)
    x = rand_input(lead + batch + (I,), dtype=dtype, device=device).requires_grad_()
    return x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias


def _leaves(args):
    return [t for t in args if t is not None]


def _call(fn, args):
    x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias = args
    return fn(x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, "input", G_bias=G_bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sep", [False, True], ids=["tied", "sep"])
@pytest.mark.parametrize("path", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_values_and_gradients_match_the_reference(path, sep, dtype, device):
    shape = SHAPES[path]
    args = _params(shape, sep, dtype, device)
    leaves = _leaves(args)
    E, batch, I, O = shape
    gy = torch.randn(((E,) if E else ()) + batch + (O,), dtype=dtype, device=device)
    results = {}
    for name, fn in (("fused", functional.nalu_parts), ("ref", reference.nalu_parts)):
        y, a, m, g = _call(fn, args)
        plain = torch.autograd.grad((y * gy).sum(), leaves, retain_graph=True)
        # y, and a loss on the kept parts: stable-nalu's gate regulariser, a path penalty each
        loss = (y * gy).sum() + (g ** 2 * (1 - g) ** 2).sum() + 0.3 * a.square().sum() + 0.1 * m.sum()
        results[name] = ((y, a, m, g), plain, torch.autograd.grad(loss, leaves))
    rtol, atol = tolerances(dtype, I)
    for u, v in zip(results["fused"][0], results["ref"][0]):
        torch.testing.assert_close(u, v, rtol=rtol, atol=atol)
    rtol, atol = tolerances(dtype, I, grad=True)
    for which in (1, 2):
        for u, v in zip(results["fused"][which], results["ref"][which]):
            torch.testing.assert_close(u, v, rtol=rtol, atol=atol)
    # the plain call takes the same op: y equal to the bit
    y = _call(functional.nalu, args)
    assert torch.equal(y, results["fused"][0][0])


@pytest.mark.parametrize("path", ["rowwise", "lanes_ens", "blas_ens"])
def test_backward_op_gradient_of_the_bias_and_the_parts(path):
    """The op-level contract: G_bias's gradient is the batch sum of dz = (a - m) dy g (1 - g)
    (+ grad_g g (1 - g)); part gradients add da += grad_a, du += grad_m m, dz += grad_g g (1 - g);
    without part gradients the other gradients equal the plain call's to the bit."""
    E, batch, I, O = SHAPES[path]
    args = [t.detach() for t in _params(SHAPES[path], True, torch.float64, "cpu")]
    x, W, M, G, Wm, Mm, Gb = args
    y, a, m, g, lx, _r = ops.nalu_forward(x, W, M, Wm, Mm, G, 1e-7, True, Gb)
    gy, ga, gm, gg = (torch.randn_like(y) for _ in range(4))
    base = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, True, True, Gb)
    assert len(base) == 7 and base[6].shape == Gb.shape
    dims = tuple(range(1 if E else 0, y.dim() - 1))
    dz = (a - m) * gy * g * (1 - g)
    torch.testing.assert_close(base[6], dz.sum(dims))
    no_bias = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, True, True)
    assert no_bias[6].shape == (0,)
    with_parts = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, True, True, Gb, ga, gm, gg)
    # the same as a grad_y-only call of the reference's differentiable parts
    leaves = [t.clone().requires_grad_() for t in args]
    outs = reference.nalu_parts(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], 1e-7, "input",
                                G_bias=leaves[6])
    want = torch.autograd.grad(outs, leaves, (gy, ga, gm, gg))
    got = [with_parts[i] for i in (0, 1, 2, 5, 3, 4, 6)]  # in the order x, W, M, G, Wm, Mm, Gb
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v)
    # grad_a alone: only the additive path's gradients (and x's) change
    only_a = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, True, True, Gb, ga)
    for i in (3, 4, 5, 6):
        assert torch.equal(only_a[i], base[i]), i


def test_independent_gate_part_gradient():
    """An input-independent gate's g has G's shape; its grad_g adds grad_g g (1 - g) to grad_G."""
    x = rand_input((2, 6, 5))
    W, M = rand_params((2, 5, 3)), rand_params((2, 5, 3))
    G = rand_params((2, 3))
    y, a, m, g, lx, _r = ops.nalu_forward(x, W, M, None, None, G, 1e-7, False)
    gy, gg = torch.randn_like(y), torch.randn_like(g)
    base = ops.nalu_backward(gy, x, W, M, None, None, G, a, m, g, lx, 1e-7, False, True)
    got = ops.nalu_backward(gy, x, W, M, None, None, G, a, m, g, lx, 1e-7, False, True, None, None, None, gg)
    torch.testing.assert_close(got[5], base[5] + gg * g * (1 - g))
    for i in (0, 1, 2):
        assert torch.equal(got[i], base[i])


@pytest.mark.parametrize("path", ["rowwise_ens", "lanes", "blas"])
@pytest.mark.parametrize("sep", [False, True], ids=["tied", "sep"])
def test_gradcheck(path, sep):
    args = _params(SHAPES[path], sep, torch.float64, "cpu")
    leaves = _leaves(args)
    has_sep = args[4] is not None

    def parts(*ts):
        it = iter(ts)
        x, W_hat, M_hat, G = next(it), next(it), next(it), next(it)
        W_hat_m, M_hat_m = (next(it), next(it)) if has_sep else (None, None)
        return functional.nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, "input", G_bias=next(it))

    assert torch.autograd.gradcheck(parts, leaves)
    assert torch.autograd.gradcheck(lambda *ts: parts(*ts)[0], leaves)


def test_module_uses_the_native_bias_without_concatenation():
    """NALU(gate_bias=True) runs one nalu_forward with G_bias: no torch.cat of x in the forward."""
    layer = NALU(5, 3, gate_bias=True, backend="fused", dtype=torch.float64)
    x = rand_input((7, 5))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x).sum().backward()
    names = {e.name for e in prof.events()}
    assert "nalu_cuda::nalu_forward" in names and "nalu_cuda::nalu_backward" in names
    assert "aten::cat" not in names


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    E, I, O, N = 2, 5, 3, 4
    x = rand_input((E, N, I), device=device)
    W = rand_params((E, I, O), device=device)
    G = rand_params((E, I, O), device=device)
    Gb = rand_params((E, O), device=device)
    op = "nalu_cuda::nalu_forward"
    cases = [
        (rand_params((O,), device=device), r"argument 'G_bias' must have shape \(E, out\) = \[2, 3\], got \[3\]"),
        (rand_params((E, I), device=device), r"argument 'G_bias' must have shape \(E, out\) = \[2, 3\], got \[2, 5\]"),
        (Gb.float(), r"argument 'G_bias' must have the dtype of 'x' \(Double\), got Float"),
        (Gb.to(torch.int64), r"argument 'G_bias' must be a floating-point tensor"),
    ]
    if device != "cpu":
        cases.append((Gb.cpu(), r"argument 'G_bias' must be on the device of 'x'"))
    for bad, msg in cases:
        with pytest.raises(RuntimeError, match=op + ": " + msg):
            ops.nalu_forward(x, W, W, None, None, G, 1e-7, True, bad)
        # the fake (torch.compile's shapes): the shape messages are the native op's, the dtype ones name torch's dtypes
        with pytest.raises(RuntimeError, match=msg if "shape" in msg else op + ": argument 'G_bias'"):
            with torch._subclasses.FakeTensorMode() as mode:
                fx = mode.from_tensor(x)
                ops.nalu_forward(fx, mode.from_tensor(W), mode.from_tensor(W), None, None, mode.from_tensor(G), 1e-7,
                                 True, mode.from_tensor(bad))
    # a bias with an input-independent gate
    with pytest.raises(RuntimeError, match=op + ": argument 'G_bias' needs an input-dependent gate"):
        ops.nalu_forward(x, W, W, None, None, rand_params((E, O), device=device), 1e-7, False, Gb)
    # the backward op: the bias's checks, and a part gradient of the wrong shape
    y, a, m, g, lx, _r = ops.nalu_forward(x, W, W, None, None, G, 1e-7, True, Gb)
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nalu_backward: argument 'G_bias' must have shape"):
        ops.nalu_backward(y, x, W, W, None, None, G, a, m, g, lx, 1e-7, True, True, Gb[0])
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nalu_backward: argument 'grad_g'"):
        ops.nalu_backward(y, x, W, W, None, None, G, a, m, g, lx, 1e-7, True, True, Gb, None, None, g[0])
    # the Python wrapper's own check names the wrapper
    with pytest.raises(ValueError, match=r"nalu_cuda.functional.nalu_parts: argument 'G_bias' needs gate='input'"):
        functional.nalu_parts(x, W, W, G[:, 0], G_bias=Gb, gate="independent")
