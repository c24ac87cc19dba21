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
from .test_nalu_parts import CASES as PARTS_CASES, _args as parts_args

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


# ------------------------------------------------------------------------------------------------
# The regulariser from the NALU's own op: nalu_parts(..., gate_regularizer=True) -> (y, a, m, g, r),
# nalu_forward's r and nalu_backward's grad_gate_regularizer: one op and one autograd node.
# ------------------------------------------------------------------------------------------------

NALU_CASES = {name: PARTS_CASES[name] for name in ("tied_input", "sep_input_bias", "tied_independent")}


def nalu_args(case, E=None, dtype=torch.float64, device="cpu"):
    """test_nalu_parts' arguments: the positional ones of nalu_parts (with eps and the gate), and G_bias."""
    x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias = parts_args(NALU_CASES[case], E is not None, dtype, device)
    return (x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, NALU_CASES[case]["gate"]), G_bias


def leaves_of(args, G_bias):
    return [t for t in args[:6] + (G_bias,) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E", [None, 2])
@pytest.mark.parametrize("case", list(NALU_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_nalu_parts_regulariser_matches_the_two_ops_and_the_reference(dtype, case, E, device):
    args, G_bias = nalu_args(case, E, dtype, device)
    leaves = leaves_of(args, G_bias)
    y, a, m, g, r = functional.nalu_parts(*args, G_bias=G_bias, gate_regularizer=True)
    assert r.shape == () and r.dtype == dtype and r.grad_fn is g.grad_fn  # one node for all of them
    # the same values as nalu_parts and nalu_gate_regularizer, to the bit (the same kernels)
    y2, a2, m2, g2 = functional.nalu_parts(*args, G_bias=G_bias)
    for u, v in zip((y, a, m, g), (y2, a2, m2, g2)):
        assert torch.equal(u, v)
    assert torch.equal(r, functional.nalu_gate_regularizer(g2))
    # a loss on y and on the regulariser: the gradients of the two-op graph, to the bit
    w = 0.7
    got = torch.autograd.grad(y.sum() + w * r, leaves)
    want = torch.autograd.grad(y2.sum() + w * functional.nalu_gate_regularizer(g2), leaves)
    for u, v in zip(got, want):
        assert torch.equal(u, v)
    # and against the reference, with a loss on every part too
    ref = reference.nalu_parts(*[t.detach().double().cpu().requires_grad_() if isinstance(t, torch.Tensor) else t
                                 for t in args],
                               G_bias=None if G_bias is None else G_bias.detach().double().cpu().requires_grad_(),
                               gate_regularizer=True)
    assert len(ref) == 5
    rtol, atol = tolerances(dtype, fan_in=5)
    for u, v in zip((y, a, m, g, r), ref):
        torch.testing.assert_close(u.detach().cpu().double(), v.detach(), rtol=rtol, atol=atol)

    def loss(y, a, m, g, r):
        return (y * y).sum() + 0.3 * (g * (1 - g)).sum() + a.sin().sum() + 0.1 * (m * m).sum() + w * r

    args64 = [t.detach().double().cpu().requires_grad_() if isinstance(t, torch.Tensor) else t for t in args]
    b64 = None if G_bias is None else G_bias.detach().double().cpu().requires_grad_()
    want = torch.autograd.grad(loss(*reference.nalu_parts(*args64, G_bias=b64, gate_regularizer=True)),
                               leaves_of(tuple(args64), b64))
    got = torch.autograd.grad(loss(*functional.nalu_parts(*args, G_bias=G_bias, gate_regularizer=True)), leaves)
    rtol, atol = tolerances(dtype, fan_in=5, grad=True)
    for u, v in zip(got, want):
        torch.testing.assert_close(u.cpu().double(), v, rtol=rtol, atol=atol)


@pytest.mark.parametrize("E", [None, 2])
@pytest.mark.parametrize("case", list(NALU_CASES))
def test_nalu_parts_regulariser_gradcheck_and_gradgradcheck(case, E):
    args, G_bias = nalu_args(case, E)
    leaves = leaves_of(args, G_bias)
    c = NALU_CASES[case]

    def fn(*ts):
        it = iter(ts)
        x, W_hat, M_hat, G = next(it), next(it), next(it), next(it)
        W_hat_m, M_hat_m = (next(it), next(it)) if c["sep"] else (None, None)
        b = next(it) if c["bias"] else None
        return functional.nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, c["gate"], G_bias=b,
                                     gate_regularizer=True)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradcheck(lambda *ts: fn(*ts)[4], leaves)  # the regulariser alone
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("case", list(NALU_CASES))
def test_backward_op_folds_the_regulariser_gradient_into_grad_g(case):
    """nalu_backward(..., grad_gate_regularizer=gr) is nalu_backward with grad_g =
    nalu_gate_regularizer_backward(gr, g) (plus a given grad_g), to the bit; nalu_forward's r is
    nalu_gate_regularizer(g), and a (0,)-shaped tensor when not asked for."""
    args, G_bias = nalu_args(case, 2)
    x, W, M, G, Wm, Mm = (None if t is None else t.detach() for t in args[:6])
    Gb = None if G_bias is None else G_bias.detach()
    ig = NALU_CASES[case]["gate"] == "input"
    y, a, m, g, lx, r = ops.nalu_forward(x, W, M, Wm, Mm, G, 1e-7, ig, Gb, True)
    assert torch.equal(r, ops.nalu_gate_regularizer(g))
    assert ops.nalu_forward(x, W, M, Wm, Mm, G, 1e-7, ig, Gb)[5].shape == (0,)
    gy, gg = torch.randn_like(y), torch.randn_like(g)
    gr = torch.tensor(1.7, dtype=x.dtype)
    d = ops.nalu_gate_regularizer_backward(gr, g)
    got = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, ig, True, Gb, None, None, None, gr)
    want = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, ig, True, Gb, None, None, d)
    for u, v in zip(got, want):
        assert torch.equal(u, v)
    got = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, ig, True, Gb, None, None, gg, gr)
    want = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, ig, True, Gb, None, None, gg + d)
    for u, v in zip(got, want):
        assert torch.equal(u, v)


def test_opcheck_nalu_ops_with_the_regulariser():
    args, G_bias = nalu_args("sep_input_bias", None, torch.float32)
    x, W, M, G, Wm, Mm = args[:6]
    torch.library.opcheck(ops.nalu_forward, (x, W, M, Wm, Mm, G, 1e-7, True, G_bias, True))
    d = [t.detach() for t in (x, W, M, G, Wm, Mm, G_bias)]
    y, a, m, g, lx, r = ops.nalu_forward(d[0], d[1], d[2], d[4], d[5], d[3], 1e-7, True, d[6], True)
    torch.library.opcheck(ops.nalu_backward, (torch.randn_like(y), d[0], d[1], d[2], d[4], d[5], d[3], a, m, g, lx,
                                              1e-7, True, True, d[6], None, None, None, torch.tensor(0.5)))


def test_compiles_fullgraph_with_the_regulariser():
    args, G_bias = nalu_args("sep_input_bias")
    leaves = leaves_of(args, G_bias)

    def loss(x):
        y, a, m, g, r = functional.nalu_parts(x, *args[1:], G_bias=G_bias, gate_regularizer=True)
        return (y * y).sum() + r

    want = loss(args[0])
    want_grads = torch.autograd.grad(want, leaves)
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(args[0])
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want)
    for u, v in zip(got_grads, want_grads):
        torch.testing.assert_close(u, v)


@pytest.mark.parametrize("fake", [False, True], ids=["op", "fake"])
def test_backward_op_checks_the_regulariser_gradient(fake):
    args, G_bias = nalu_args("tied_input", None, torch.float32)
    x, W, M, G = (t.detach() for t in args[:4])
    y, a, m, g, lx, _r = ops.nalu_forward(x, W, M, None, None, G, 1e-7, True)
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else None

    def call(gr):
        ts = (y, x, W, M, G, a, m, g, lx, gr)
        if mode is not None:
            with mode:
                ts = [mode.from_tensor(t) for t in ts]
                return ops.nalu_backward(ts[0], ts[1], ts[2], ts[3], None, None, ts[4], ts[5], ts[6], ts[7], ts[8],
                                         1e-7, True, True, None, None, None, None, ts[9])
        return ops.nalu_backward(y, x, W, M, None, None, G, a, m, g, lx, 1e-7, True, True, None, None, None, None, gr)

    with pytest.raises(Exception, match=r"nalu_backward: argument 'grad_gate_regularizer' must have the "
                                        r"regulariser's shape \[\], got \[1\]"):
        call(torch.ones(1))
    with pytest.raises(Exception, match=r"nalu_backward: argument 'grad_gate_regularizer' must have the dtype"):
        call(torch.ones((), dtype=torch.float64))


def test_stable_nalu_regualizer_is_the_forwards_output():
    """StableNALULayer(nalu_gate='regualized') on the fused backend: regualizer()['g'] is the regulariser
    its forward's one op returned (the same node as the parts), equal to the separate op's value with
    the same gradients; before any forward 0; for parts it did not compute (set by other code), the
    separate op; after a weight change, still the last forward's (their stored gate's)."""
    torch.manual_seed(0)
    layer = compat.StableNALULayer(10, 3, nalu_gate="regualized", nalu_bias=True, nalu_two_nac=True).double()
    layer.reset_parameters()
    assert float(layer.regualizer()["g"]) == 0.0
    x = rand_input((16, 10))
    y = layer(x)
    r = layer.regualizer()["g"]
    g = layer.parts.g
    assert r.grad_fn is g.grad_fn is y.grad_fn
    assert torch.equal(r, functional.nalu_gate_regularizer(g))
    params = list(layer.parameters())
    got = torch.autograd.grad(y.sum() + r, params, retain_graph=True)
    want = torch.autograd.grad(y.sum() + functional.nalu_gate_regularizer(g), params, retain_graph=True)
    for u, v in zip(got, want):
        assert torch.equal(u, v)
    with torch.no_grad():  # their regualizer() reads the stored gate, not the weights
        layer.G.add_(0.5)
    assert layer.regualizer()["g"] is r
    other = layer.parts._replace(g=torch.sigmoid(torch.randn(16, 3, dtype=torch.float64)))
    object.__setattr__(layer, "parts", other)
    torch.testing.assert_close(layer.regualizer()["g"], torch.sum(other.g ** 2 * (1 - other.g) ** 2),
                               rtol=1e-12, atol=1e-14)
