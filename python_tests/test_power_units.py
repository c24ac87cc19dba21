"""NPU, RealNPU and iNALU: the fused ops against the reference (values and every gradient),
gradcheck, opcheck, compile, ensembles, edge inputs, layouts, bad inputs, modules, regularisers."""
import math

import numpy as np
import pytest
import torch

import nalu_cuda
from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda import regularizers as RP
from nalu_cuda.testing import assert_compiled_matches_eager, rand_input, rand_params, run_reference_and_fused, tolerances

from .conftest import DEVICES, UNIT_SHAPES, shape_ids, unit_cases

ops = torch.ops.nalu_cuda

SHAPES = UNIT_SHAPES
SHAPE_IDS = shape_ids(SHAPES)

# name -> (reference fn, fused fn, parameter names after x)
UNITS = {
    "npu": (R.npu, F.npu, ("W_r", "W_i", "g")),
    "real_npu": (R.real_npu, F.real_npu, ("W_r", "g")),
    "inalu": (R.inalu, F.inalu, ("W_hat", "M_hat", "W_hat_m", "M_hat_m", "G")),
}


def make_args(unit, E, batch, I, O, dtype, device, x=None):
    """(x, *params) for a unit: gates inside (0, 1) away from the clamp's ends, weights modest."""
    lead = () if E is None else (E,)
    if x is None:
        x = rand_input(lead + tuple(batch) + (I,), dtype=dtype, device=device)
    if unit in ("npu", "real_npu"):
        W_r = rand_params(lead + (I, O), scale=0.5, dtype=dtype, device=device)
        g = (torch.rand(lead + (I,), dtype=dtype) * 0.8 + 0.1).to(device)
        if unit == "real_npu":
            return [x, W_r, g]
        return [x, W_r, rand_params(lead + (I, O), scale=0.3, dtype=dtype, device=device), g]
    params = [rand_params(lead + (I, O), scale=s, dtype=dtype, device=device) for s in (0.5, 1.0, 0.5, 1.0)]
    return [x] + params + [rand_params(lead + (O,), scale=0.5, dtype=dtype, device=device)]


def run_both(unit, args, **kw):
    return run_reference_and_fused(*UNITS[unit][:2], args, **kw)


def assert_both_close(unit, args, dtype, I, **kw):
    y_ref, y_fused, a, b = run_both(unit, args, **kw)
    rtol, atol = tolerances(dtype, I)
    torch.testing.assert_close(y_fused, y_ref, rtol=rtol, atol=atol)
    grtol, gatol = tolerances(dtype, I, grad=True)
    for name, p, q in zip(("x",) + UNITS[unit][2], a, b):
        torch.testing.assert_close(q.grad, p.grad, rtol=grtol, atol=gatol, msg=lambda m: f"grad {name}: {m}")


@unit_cases(UNITS, SHAPES)
def test_fused_matches_reference(unit, shape, dtype, device):
    E, batch, I, O = shape
    assert_both_close(unit, make_args(unit, E, batch, I, O, dtype, device), dtype, I)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(None, (4,), 3, 2), (2, (3,), 3, 5)], ids=["plain", "ensemble"])
@pytest.mark.parametrize("unit", list(UNITS))
def test_gradcheck(unit, shape, device):
    E, batch, I, O = shape
    args = [t.requires_grad_() for t in make_args(unit, E, batch, I, O, torch.float64, device)]
    assert torch.autograd.gradcheck(UNITS[unit][1], tuple(args), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for unit, op in (("npu", ops.npu_forward), ("real_npu", ops.npu_forward), ("inalu", ops.inalu_forward)):
        for E in (None, 2):
            args = make_args(unit, E, (5,), 4, 3, torch.float64, device)
            args = [t.requires_grad_() for t in args]
            if unit == "npu":
                full = args + [1e-7]
            elif unit == "real_npu":
                full = [args[0], args[1], None, args[2], 1e-7]
            else:
                full = args + [1e-7, 20.0]
            torch.library.opcheck(op, tuple(full))


@pytest.mark.parametrize("unit", list(UNITS))
def test_negative_and_zero_inputs(unit):
    # Exact zeros (sign(0) = 0: no gradient through |x|, r = g eps + 1 - g for the NPU, the floor
    # eps for iNALU's log) among negative and positive inputs.
    x = rand_input((40, 6))
    x[::3, 1] = 0.0
    x[5, :] = 0.0
    x[:, 4] = -x[:, 4].abs()
    args = make_args(unit, None, (40,), 6, 3, torch.float64, "cpu", x=x)
    assert_both_close(unit, args, torch.float64, 6)


def test_npu_gate_clamp_outside_unit_interval():
    # g < 0 and g > 1 act as 0 and 1 in the forward; their gradient is cut by the clamp.
    for unit in ("npu", "real_npu"):
        args = make_args(unit, None, (16,), 5, 2, torch.float64, "cpu")
        args[-1] = torch.tensor([-0.4, 0.0, 0.5, 1.0, 1.7], dtype=torch.float64)
        assert_both_close(unit, args, torch.float64, 5)
        _, _, _, b = run_both(unit, args)
        assert b[-1].grad[0] == 0 and b[-1].grad[4] == 0


def test_npu_computes_a_quotient():
    # W_r = [1, -1], g = 1: y = x0 / x1 with the sign from cos(pi k), for negative inputs too.
    x = rand_input((50, 2))
    W_r = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    g = torch.ones(2, dtype=torch.float64)
    y = F.real_npu(x, W_r, g, eps=1e-12)
    torch.testing.assert_close(y[:, 0], x[:, 0] / x[:, 1], rtol=1e-9, atol=1e-9)


def test_npu_is_the_real_part_of_a_complex_power():
    # y = Re exp((log r + i k) (W_r + i W_i)): the reference and the fused op against torch.complex.
    x, W_r, W_i, g = make_args("npu", None, (20,), 4, 3, torch.float64, "cpu")
    gc = g.clamp(0, 1)
    z = torch.complex(torch.log(gc * (x.abs() + 1e-7) + 1 - gc), gc * math.pi * (x < 0).double())
    want = torch.exp(z @ torch.complex(W_r, W_i)).real
    torch.testing.assert_close(R.npu(x, W_r, W_i, g), want)
    torch.testing.assert_close(F.npu(x, W_r, W_i, g), want)


def test_inalu_omega_clipping_active():
    # omega below some of the exponents: m = exp(omega) there and no gradient through u.
    args = make_args("inalu", None, (32,), 6, 3, torch.float64, "cpu")
    args[0] = args[0] * 4
    u = R.log_abs(args[0], 0) @ R.nac_weight(args[3], args[4])
    v = u.flatten().sort().values
    omega = float(v[v.numel() // 2 - 1] + v[v.numel() // 2]) / 2  # between two exponents, never at one
    assert (u > omega).any() and (u < omega).any()
    assert_both_close("inalu", args, torch.float64, 6, omega=omega)


def test_inalu_sign_product_exact_with_a_zero_factor():
    # W_m = 1 exactly (tanh(40) = sigmoid(40) = 1 in float64) and x = 0 give the factor
    # 0 * 1 + 1 - 1 = 0: msv = 0 for that output, and its backward must use exclusive products
    # (dividing msv by the zero factor would give 0 / 0 = NaN); torch.prod's backward is exact too.
    I, O = 4, 2
    x = rand_input((10, I))
    x[:, 0] = 0.0
    W_hat_m = rand_params((I, O))
    M_hat_m = rand_params((I, O))
    W_hat_m[0, 0] = 40.0
    M_hat_m[0, 0] = 40.0
    args = [x, rand_params((I, O)), rand_params((I, O)), W_hat_m, M_hat_m, rand_params((O,))]
    assert_both_close("inalu", args, torch.float64, I)
    _, _, _, msv, _ = ops.inalu_forward(*args, 1e-7, 20.0)
    assert (msv[:, 0] == 0).all() and (msv[:, 1] != 0).all()
    _, _, _, b = run_both("inalu", args)
    assert all(torch.isfinite(t.grad).all() for t in b)


@pytest.mark.parametrize("unit", list(UNITS))
def test_layouts(unit):
    # Every argument transposed, sliced or expanded: same results as contiguous copies.
    args = make_args(unit, None, (12,), 5, 3, torch.float64, "cpu")
    odd = []
    for t in args:
        if t.dim() == 2:
            odd.append(t.t().contiguous().t())  # column-major
        else:
            odd.append(torch.stack([t, t], -1)[..., 0])  # stride 2
    assert not any(t.is_contiguous() for t in odd if t.dim() == 2)
    torch.testing.assert_close(UNITS[unit][1](*odd), UNITS[unit][0](*args))
    y_ref, y_fused, a, b = run_both(unit, odd)
    for p, q in zip(a, b):
        torch.testing.assert_close(q.grad, p.grad)
    # and the ensemble layout with a sliced x
    args = make_args(unit, 2, (6,), 4, 2, torch.float64, "cpu")
    x = torch.cat([args[0], args[0]], -1)[..., ::2]
    torch.testing.assert_close(UNITS[unit][1](x, *args[1:]), UNITS[unit][0](x, *args[1:]))


def test_results_do_not_depend_on_thread_count():
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(3)
            out = []
            for unit in UNITS:
                args = make_args(unit, 2, (300,), 40, 20, torch.float32, "cpu")
                _, y, _, b = run_both(unit, args)
                out += [y] + [t.grad for t in b]
            results.append(out)
    finally:
        torch.set_num_threads(before)
    for p, q in zip(*results):
        assert torch.equal(p, q)


def test_double_backward_raises():
    for unit in UNITS:
        args = [t.requires_grad_() for t in make_args(unit, None, (4,), 3, 2, torch.float64, "cpu")]
        y = UNITS[unit][1](*args)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(y.sum(), args, create_graph=True)


# ------------------------------------------------------------------------------------------------
# Bad inputs: the op, the argument, what was expected, what came.
# ------------------------------------------------------------------------------------------------

def _npu_args(**over):
    a = dict(x=torch.randn(4, 3), W_r=torch.randn(3, 2), W_i=torch.randn(3, 2), g=torch.rand(3), eps=1e-7)
    a.update(over)
    return a


@pytest.mark.parametrize("over, pattern", [
    (dict(x=torch.randn(4, 5)), r"npu_forward: argument 'x' must have shape \(\.\.\., in\) = \(\.\.\., 3\)"),
    (dict(W_r=torch.randn(3)), r"argument 'W_r' must have shape \(in, out\) or \(E, in, out\), got \[3\]"),
    (dict(W_i=torch.randn(2, 3)), r"argument 'W_i' must have the shape of 'W_r' \[3, 2\], got \[2, 3\]"),
    (dict(g=torch.rand(3, 2)), r"argument 'g' \(the relevance gate\) must have shape \(in,\) = \[3\], got \[3, 2\]"),
    (dict(g=torch.rand(3).double()), r"argument 'g' must have the dtype of 'x'"),
    (dict(x=torch.randn(4, 3, dtype=torch.float16)), r"argument 'W_r' must have the dtype of 'x'"),
    (dict(eps=0.0), r"argument 'eps' must be a positive finite number, got 0"),
    (dict(eps=math.inf), r"argument 'eps' must be a positive finite number"),
])
def test_npu_bad_inputs(over, pattern):
    a = _npu_args(**over)
    with pytest.raises(RuntimeError, match=pattern):
        ops.npu_forward(a["x"], a["W_r"], a["W_i"], a["g"], a["eps"])
    # the fake says the same (torch.compile traces with it)
    with pytest.raises(RuntimeError, match=pattern), torch._subclasses.FakeTensorMode() as mode:
        fa = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
        ops.npu_forward(fa["x"], fa["W_r"], fa["W_i"], fa["g"], fa["eps"])


def test_npu_bad_dtype_and_saved():
    x = torch.randn(4, 3, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"npu_forward: the CPU kernel supports dtypes Float, Double, got Half"):
        ops.npu_forward(x, torch.randn(3, 2).half(), None, torch.rand(3).half(), 1e-7)
    a = _npu_args()
    y, s, lr = ops.npu_forward(a["x"], a["W_r"], a["W_i"], a["g"], 1e-7)
    with pytest.raises(RuntimeError, match=r"npu_backward: argument 'lr' must have shape \[4, 3\], got \[4, 2\]"):
        ops.npu_backward(y, a["x"], a["W_r"], a["W_i"], a["g"], y, s, s, 1e-7, True)
    with pytest.raises(RuntimeError, match=r"argument 'x' must have shape \(E, \.\.\., in\) = \(2, \.\.\., 3\)"):
        ops.npu_forward(torch.randn(3, 4, 3), torch.randn(2, 3, 2), None, torch.rand(2, 3), 1e-7)


def test_inalu_bad_inputs():
    x, W = torch.randn(4, 3), torch.randn(3, 2)
    G = torch.randn(2)
    with pytest.raises(RuntimeError, match=r"inalu_forward: argument 'G' of an input-independent gate must have "
                                           r"shape \(out,\) = \[2\], got \[3, 2\]"):
        ops.inalu_forward(x, W, W, W, W, torch.randn(3, 2), 1e-7, 20.0)
    with pytest.raises(RuntimeError, match=r"inalu_forward: argument 'W_hat_m' must have the shape of 'W_hat'"):
        ops.inalu_forward(x, W, W, torch.randn(3, 3), torch.randn(3, 3), G, 1e-7, 20.0)
    with pytest.raises(RuntimeError, match=r"inalu_forward: argument 'omega' must be a finite number, got inf"):
        ops.inalu_forward(x, W, W, W, W, G, 1e-7, math.inf)
    with pytest.raises(RuntimeError, match=r"inalu_forward: argument 'eps' must be a positive finite number"):
        ops.inalu_forward(x, W, W, W, W, G, -1.0, 20.0)
    y, a, u, msv, lx = ops.inalu_forward(x, W, W, W, W, G, 1e-7, 20.0)
    with pytest.raises(RuntimeError, match=r"inalu_backward: argument 'msv' must have shape \[4, 2\], got \[4, 3\]"):
        ops.inalu_backward(y, x, W, W, W, W, G, a, u, lx, lx, 1e-7, 20.0, True)


@pytest.mark.parametrize("cls, kwargs, pattern", [
    (nalu_cuda.NPU, dict(eps=0), r"nalu_cuda.NPU: argument 'eps' must be a positive finite number, got 0"),
    (nalu_cuda.RealNPU, dict(ensemble=0), r"nalu_cuda.RealNPU: argument 'ensemble' must be a positive int, got 0"),
    (nalu_cuda.INALU, dict(omega=math.nan), r"nalu_cuda.INALU: argument 'omega' must be a finite number, got nan"),
    (nalu_cuda.INALU, dict(backend="gpu"), r"nalu_cuda.INALU: argument 'backend' must be one of"),
])
def test_module_bad_arguments(cls, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        cls(3, 2, **kwargs)


@pytest.mark.parametrize("unit", ["npu", "real_npu", "inalu"])
def test_autocast_runs_the_ops_in_float32(unit):
    # Under torch.autocast the ops cast float16/bfloat16 arguments to float32 once and return float32.
    fn = {"npu": F.npu, "real_npu": F.real_npu, "inalu": F.inalu}[unit]
    I, O = 5, 2
    x = rand_input((8, I), dtype=torch.float32)
    if unit == "inalu":
        args = [rand_params((I, O), dtype=torch.float32) for _ in range(4)] + [rand_params((O,), dtype=torch.float32)]
    else:
        args = [rand_params((I, O), scale=0.3, dtype=torch.float32)]
        if unit == "npu":
            args.append(rand_params((I, O), scale=0.3, dtype=torch.float32))
        args.append(torch.rand(I))
    params = [a.requires_grad_() for a in args]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(x.bfloat16(), *params)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, fn(x.bfloat16().float(), *params))
    got.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [nalu_cuda.NPU, nalu_cuda.RealNPU, nalu_cuda.INALU])
def test_module_fused_equals_reference_and_ensemble_members(cls):
    E, I, O = 3, 5, 2
    gens = [torch.Generator().manual_seed(10 + e) for e in range(E)]
    ens = cls(I, O, ensemble=E, dtype=torch.float64)
    ens.reset_parameters(gens)
    x = rand_input((E, 7, I)) * 0.5 + 0.6 * torch.sign(rand_input((E, 7, I)))
    y = ens(x)
    ref = cls(I, O, ensemble=E, backend="reference", dtype=torch.float64)
    ref.load_state_dict(ens.state_dict())
    torch.testing.assert_close(y, ref(x))
    for e in range(E):
        one = cls(I, O, dtype=torch.float64)
        one.reset_parameters(torch.Generator().manual_seed(10 + e))
        for (name, p), q in zip(one.named_parameters(), [dict(ens.named_parameters())[n] for n, _ in
                                                           one.named_parameters()]):
            assert torch.equal(p, q[e]), name
        torch.testing.assert_close(one(x[e]), y[e])
    assert ens.use_fused(x) and not ref.use_fused(x)


def test_published_initialisation():
    torch.manual_seed(0)
    npu = nalu_cuda.NPU(300, 200)
    bound = math.sqrt(6 / 500)
    assert npu.W_r.abs().max() <= bound and npu.W_r.abs().max() > 0.95 * bound
    assert (npu.W_i == 0).all() and (npu.g == 0.5).all()
    assert nalu_cuda.RealNPU(3, 2).W_i is None
    inalu = nalu_cuda.INALU(300, 200)
    for p, mean in ((inalu.W_hat, 1.0), (inalu.W_hat_m, 1.0), (inalu.M_hat, -1.0), (inalu.M_hat_m, -1.0)):
        assert abs(p.mean().item() - mean) < 0.01 and abs(p.std().item() - 0.1) < 0.01
    assert inalu.G.shape == (200,) and abs(inalu.G.std().item() - 0.1) < 0.03


def test_npu_project_clamps_the_gate():
    m = nalu_cuda.NPU(4, 2, ensemble=2)
    with torch.no_grad():
        m.g.copy_(torch.tensor([[-1.0, 0.3, 1.5, 0.0], [2.0, 1.0, -0.1, 0.7]]))
    m.project_()
    assert torch.equal(m.g, torch.tensor([[0.0, 0.3, 1.0, 0.0], [1.0, 1.0, 0.0, 0.7]]))


@pytest.mark.compile
def test_compile_fullgraph_forward_backward():
    model = torch.nn.Sequential(nalu_cuda.INALU(6, 4, ensemble=2), nalu_cuda.NPU(4, 3, ensemble=2),
                                nalu_cuda.RealNPU(3, 2, ensemble=2)).double()
    assert_compiled_matches_eager(model, rand_input((2, 8, 6)))


# ------------------------------------------------------------------------------------------------
# Regularisers
# ------------------------------------------------------------------------------------------------

def test_npu_l1_and_schedule():
    assert [RP.npu_l1_beta(t) for t in (0, 9_999, 10_000, 25_000, 10**6)] == [1e-4, 1e-4, 1e-3, 1e-2, 1e-2]
    assert RP.npu_l1_beta(30_000, beta_start=1e-7, beta_end=1e-6) == 1e-6
    m = nalu_cuda.NPU(3, 2, ensemble=2)
    torch.testing.assert_close(RP.npu_l1(m), m.W_r.abs().sum() + m.W_i.abs().sum())
    torch.testing.assert_close(RP.npu_l1(m, ensemble=True), m.W_r.abs().sum((1, 2)) + m.W_i.abs().sum((1, 2)))
    r = nalu_cuda.RealNPU(3, 2)
    torch.testing.assert_close(RP.npu_l1(r), r.W_r.abs().sum())


def test_inalu_regularizer_and_rules():
    m = nalu_cuda.INALU(3, 2)
    with torch.no_grad():
        m.W_hat.fill_(5.0)     # min(-5, 5) + 20 = 15
        m.M_hat.fill_(-30.0)   # max(-10, 0) = 0
        m.W_hat_m.fill_(0.0)   # 20
        m.M_hat_m.fill_(25.0)  # 0
        m.G.fill_(-1.0)        # 19
    assert RP.inalu_regularizer(m).item() == pytest.approx((15 + 0 + 20 + 0 + 19) / 20)
    assert RP.inalu_regularizer_active(11, 0.5) and not RP.inalu_regularizer_active(10, 0.5)
    assert not RP.inalu_regularizer_active(11, 1.0)
    flat = list(np.full(10_001, 5.0))
    assert RP.inalu_stalled(flat) and not RP.inalu_stalled(flat[:10_000])
    assert not RP.inalu_stalled(list(np.linspace(10, 2, 20_000)))  # still falling
    assert not RP.inalu_stalled(list(np.full(20_000, 0.5)))  # converged below 1
    e = nalu_cuda.INALU(3, 2, ensemble=3)
    before = [p.detach().clone() for p in e.parameters()]
    RP.inalu_reinitialize_(e, members=[1], generator=torch.Generator().manual_seed(0))
    for p, q in zip(before, e.parameters()):
        assert torch.equal(p[0], q[0]) and torch.equal(p[2], q[2]) and not torch.equal(p[1], q[1])
        assert q[1].abs().max() <= 2


@pytest.mark.parametrize("mag", [1e20, 1e30])
def test_inalu_float32_gradients_at_huge_inputs_match_float64(mag):
    # Both paths in float32 against the reference in float64, every gradient of a weighted sum, with
    # |x| far beyond the training ranges (the exponent then mostly clipped at omega). Each call gets
    # fresh leaf tensors: `t.to(torch.float32)` of a float32 tensor is `t` itself, whose .grad
    # would accumulate across calls.
    gen = torch.Generator().manual_seed(7)
    I, O, N = 4, 3, 8
    params = [torch.randn(I, O, generator=gen, dtype=torch.float64) * 0.5 for _ in range(4)]
    params.append(torch.randn(O, generator=gen, dtype=torch.float64))
    x = (torch.rand(N, I, generator=gen, dtype=torch.float64) + 0.5) * mag
    x = x * torch.where(torch.rand(N, I, generator=gen) < 0.5, -1.0, 1.0).double()
    w = torch.randn(N, O, generator=gen, dtype=torch.float64)

    def grads(fn, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in [x, *params]]
        (fn(*leaves) * w.to(dtype)).sum().backward()
        return [t.grad.double() for t in leaves]

    want = grads(R.inalu, torch.float64)
    for fn in (R.inalu, F.inalu):
        for g, r in zip(grads(fn, torch.float32), want):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * float(r.abs().max()))
