"""The fused ops against the reference (values and every gradient), gradcheck, opcheck."""
import math

import pytest
import torch

import nalu_cuda
from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_input, rand_params, run_reference_and_fused, tolerances

from .conftest import DEVICES, run_fresh_interpreter, shape_ids, unit_cases

ops = torch.ops.nalu_cuda

# (E or None, batch shape, I, O). O <= 16 takes the rowwise path, wider layers the BLAS path.
SHAPES = [
    (None, (1,), 1, 1),
    (None, (7,), 5, 3),
    (None, (128,), 100, 2),
    (None, (33,), 17, 16),
    (None, (33,), 17, 17),
    (None, (4, 6), 9, 2),
    (None, (), 6, 3),
    (None, (300,), 8, 1),
    (3, (9,), 6, 2),
    (2, (5,), 4, 20),
    (4, (2, 3), 5, 2),
]
SHAPE_IDS = shape_ids(SHAPES)

# name -> (reference fn, fused fn, needs G, separate weights, gate)
UNITS = {
    "nac": (R.nac, F.nac, False, False, None),
    "nac_mul": (R.nac_mul, F.nac_mul, False, False, None),
    "nalu": (R.nalu, F.nalu, True, False, "input"),
    "nalu_sep": (R.nalu, F.nalu, True, True, "input"),
    "nalu_indep": (R.nalu, F.nalu, True, False, "independent"),
    "nalu_sep_indep": (R.nalu, F.nalu, True, True, "independent"),
}


def make_args(unit, E, batch, I, O, dtype, device, scale=0.5):
    """Positional args (x, W_hat, M_hat[, G, W_hat_m, M_hat_m]) and kwargs for a unit."""
    _, _, needs_g, sep, gate = UNITS[unit]
    lead = () if E is None else (E,)
    x = rand_input(lead + tuple(batch) + (I,), dtype=dtype, device=device)
    W = rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device)
    M = rand_params(lead + (I, O), scale=1.0, dtype=dtype, device=device)
    args = [x, W, M]
    kwargs = {}
    if needs_g:
        gshape = lead + ((I, O) if gate == "input" else (O,))
        args.append(rand_params(gshape, scale=0.3, dtype=dtype, device=device))
        if sep:
            args.append(rand_params(lead + (I, O), scale=scale, dtype=dtype, device=device))
            args.append(rand_params(lead + (I, O), scale=1.0, dtype=dtype, device=device))
        kwargs["gate"] = gate
    return args, kwargs


def run_both(unit, args, kwargs):
    return run_reference_and_fused(*UNITS[unit][:2], args, **kwargs)


@unit_cases(UNITS, SHAPES)
def test_fused_matches_reference(unit, shape, dtype, device):
    E, batch, I, O = shape
    args, kwargs = make_args(unit, E, batch, I, O, dtype, device)
    y_ref, y_fused, a, b = run_both(unit, args, kwargs)
    rtol, atol = tolerances(dtype, I)
    torch.testing.assert_close(y_fused, y_ref, rtol=rtol, atol=atol)
    grtol, gatol = tolerances(dtype, I, grad=True)
    names = ["x", "W_hat", "M_hat", "G", "W_hat_m", "M_hat_m"]
    for name, p, q in zip(names, a, b):
        torch.testing.assert_close(q.grad, p.grad, rtol=grtol, atol=gatol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(None, (4,), 3, 2), (2, (3,), 3, 18)], ids=["rowwise", "blas-ensemble"])
@pytest.mark.parametrize("unit", list(UNITS))
def test_gradcheck(unit, shape, device):
    E, batch, I, O = shape
    args, kwargs = make_args(unit, E, batch, I, O, torch.float64, device)
    args = [t.requires_grad_() for t in args]
    fused_fn = UNITS[unit][1]
    assert torch.autograd.gradcheck(lambda *t: fused_fn(*t, **kwargs), tuple(args), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_nac_weight(device):
    W = rand_params((5, 3), scale=1.5, device=device).requires_grad_()
    M = rand_params((5, 3), scale=1.5, device=device).requires_grad_()
    assert torch.autograd.gradcheck(F.nac_weight, (W, M))
    torch.testing.assert_close(F.nac_weight(W, M), R.nac_weight(W, M))


def test_weight_construction_accuracy_float32():
    # tanh and sigmoid over their whole useful range, against float64.
    w = torch.linspace(-30, 30, 20001, dtype=torch.float64)
    m = torch.linspace(30, -30, 20001, dtype=torch.float64)
    got = F.nac_weight(w.float(), m.float()).double()
    want = R.nac_weight(w, m)
    rel = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel < 2e-6, rel
    # Gradients: 1 - tanh^2 cancels in float32 for |W_hat| > 9, in autograd's formula as in ours,
    # so hold the fused float32 error to (about) the float32 reference's own error.
    gw, gm = ops.nac_weight_backward(torch.ones_like(w).float(), w.float(), m.float())
    grads = {}
    for dt in (torch.float64, torch.float32):
        w_, m_ = w.to(dt).detach().requires_grad_(), m.to(dt).detach().requires_grad_()
        R.nac_weight(w_, m_).sum().backward()
        grads[dt] = (w_.grad.double(), m_.grad.double())
    for got, want, ref32 in zip((gw.double(), gm.double()), grads[torch.float64], grads[torch.float32]):
        err = (got - want).abs()
        ref_err = (ref32 - want).abs()
        assert err.max() <= 2 * ref_err.max() + 1e-9, (err.max(), ref_err.max())
        assert (err <= 1e-6 * want.abs() + 1e-7).all()


# The checks below run in a fresh interpreter (run_fresh_interpreter), where NALU_CUDA_CPU_ISA chooses
# the kernels' instruction set: it is chosen once per process.


def _log_exp_roundtrip_float32_wide_range():
    # W = tanh(20) * sigmoid(20) = 1 - 2e-9, so y = exp(log(|x| + eps)) ~ |x| + eps: the float32
    # exp and log primitives over 70 decades, including subnormal inputs, and values that overflow.
    x = torch.logspace(-40, 38, 4001, dtype=torch.float64)
    x = torch.cat([x, -x]).float().reshape(-1, 1)
    W = torch.full((1, 1), 20.0)
    M = torch.full((1, 1), 20.0)
    y = F.nac_mul(x, W, M, eps=1e-38).double()
    twenty = torch.tensor(20.0, dtype=torch.float64)
    w = torch.tanh(twenty) * torch.sigmoid(twenty)
    want = torch.exp(torch.log(x.double().abs() + 1e-38) * w)
    ok = want < 3e38
    rel = ((y[ok] - want[ok]).abs() / want[ok]).max().item()
    assert rel < 1e-5, rel
    assert torch.isinf(y[~ok]).all() or (~ok).sum() == 0


@pytest.mark.parametrize("isa_env", [None, "base"])
def test_log_exp_roundtrip_float32_wide_range(isa_env):
    run_fresh_interpreter(_log_exp_roundtrip_float32_wide_range, isa_env)


def _log_path_within_one_ulp_float32():
    # lx = log(|x| + eps) as each path computes it (lanes, rowwise, blas), against float64 libm's
    # log of the same float32 sum: within 1 ulp over 78 decades, for a normal eps (the fast positive-argument log)
    # and a subnormal one (the general log); inf and NaN pass through.
    x = torch.logspace(-40, 38, 6000, dtype=torch.float64)
    x = torch.cat([x, -x, torch.rand(1000, dtype=torch.float64) * 4 - 2]).float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    x = x[:x.numel() // 100 * 100]
    for eps in (1e-7, 1e-38):
        want = torch.log((x.abs() + torch.tensor(eps, dtype=torch.float32)).double())  # the sum in float32
        ulp = torch.nextafter(want.float(), torch.tensor(float("inf"))).double() - want.float().double()
        for I, O in ((1, 1), (100, 2), (100, 20)):
            xs = x.reshape(-1, I)
            _, lx = ops.nac_mul_forward(xs, torch.zeros(I, O), torch.zeros(I, O), eps)
            lx = lx.reshape(-1).double()
            fin = torch.isfinite(want)
            err = ((lx[fin] - want[fin]).abs() / ulp[fin]).max().item()
            assert err <= 1.0, (eps, I, O, err)
            assert (torch.equal(lx[~fin].isnan(), want[~fin].isnan())
                    and (lx[~fin] == want[~fin]).sum() == (want[~fin] == want[~fin]).sum())


@pytest.mark.parametrize("isa_env", [None, "base"])
def test_log_path_within_one_ulp_float32(isa_env):
    run_fresh_interpreter(_log_path_within_one_ulp_float32, isa_env)


def _baseline_isa_matches_reference():
    for unit in UNITS:
        for shape in [SHAPES[2], SHAPES[4], SHAPES[8]]:
            E, batch, I, O = shape
            args, kw = make_args(unit, E, batch, I, O, torch.float32, "cpu")
            yr, yf, a, b = run_both(unit, args, kw)
            rtol, atol = tolerances(torch.float32, I)
            grtol, gatol = tolerances(torch.float32, I, grad=True)
            torch.testing.assert_close(yf, yr, rtol=rtol, atol=atol)
            for p, q in zip(a, b):
                torch.testing.assert_close(q.grad, p.grad, rtol=grtol, atol=gatol)


def test_baseline_isa_matches_reference():
    # The kernels compiled for the default target (used on CPUs without AVX2) must agree too.
    run_fresh_interpreter(_baseline_isa_matches_reference, isa="base")


def _op_samples(device):
    """(op overload, args) covering every op, both paths, both gates, tied and separate, a gate bias
    and part gradients."""
    samples = []
    for (E, batch, I, O) in [(None, (5,), 4, 2), (2, (3,), 3, 18)]:
        lead = () if E is None else (E,)
        x = rand_input(lead + batch + (I,), device=device)
        W, M, Wm, Mm, G = (rand_params(lead + (I, O), device=device) for _ in range(5))
        g_ind = rand_params(lead + (O,), device=device)
        y_shape = lead + batch + (O,)
        gy = torch.randn(y_shape, dtype=torch.float64, device=device)
        samples.append((ops.nac_weight.default, (W, M)))
        samples.append((ops.nac_weight_backward.default, (torch.randn_like(W), W, M)))
        samples.append((ops.nac_forward.default, (x, W, M)))
        for need_x in (True, False):
            samples.append((ops.nac_backward.default, (gy, x, W, M, need_x)))
        y, lx = ops.nac_mul_forward(x, W, M, 1e-7)
        samples.append((ops.nac_mul_forward.default, (x, W, M, 1e-7)))
        samples.append((ops.nac_mul_backward.default, (gy, x, W, M, y, lx, 1e-7, True)))
        for wm, mm in [(None, None), (Wm, Mm)]:
            for gate_arg, input_gate in [(G, True), (g_ind, False)]:
                args = (x, W, M, wm, mm, gate_arg, 1e-7, input_gate)
                samples.append((ops.nalu_forward.default, args))
                y, a, m, g, lx, _r = ops.nalu_forward(*args)
                samples.append(
                    (ops.nalu_backward.default, (gy, x, W, M, wm, mm, gate_arg, a, m, g, lx, 1e-7, input_gate, True))
                )
        # the input gate's bias, and gradients reaching the kept parts (every one, or only grad_g)
        args = (x, W, M, Wm, Mm, G, 1e-7, True, g_ind)
        samples.append((ops.nalu_forward.default, args))
        y, a, m, g, lx, _r = ops.nalu_forward(*args)
        for parts in [(torch.randn_like(a), torch.randn_like(m), torch.randn_like(g)), (None, None, torch.randn_like(g))]:
            samples.append((ops.nalu_backward.default,
                            (gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, True, True, g_ind) + parts))
    # a column-major input: the fakes must report the kernels' contiguous results
    x_t = rand_input((5, 4), device=device).t()  # (4, 5), column-major
    W, M, G = (rand_params((5, 2), device=device) for _ in range(3))
    samples.append((ops.nac_mul_forward.default, (x_t, W, M, 1e-7)))
    samples.append((ops.nalu_forward.default, (x_t, W.t().contiguous().t(), M, None, None, G, 1e-7, True)))
    return samples


@pytest.mark.parametrize("unit", list(UNITS))
def test_cpu_results_do_not_depend_on_the_thread_count(unit):
    # Rows are split between threads at fixed boundaries and weight-gradient partials are summed
    # in a fixed order, so 1 and 2 threads must agree bit for bit (shapes big enough to split).
    before = torch.get_num_threads()
    try:
        for E, batch, I, O in [(3, (130,), 100, 2), (None, (1001,), 37, 3), (5, (77,), 9, 1), (2, (515,), 20, 16),
                               (7, (200,), 2, 1), (3, (130,), 8, 5)]:  # the last two: lanes variant
            args, kw = make_args(unit, E, batch, I, O, torch.float32, "cpu")
            gy = None
            runs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                b = [t.detach().clone().requires_grad_() for t in args]
                y = UNITS[unit][1](*b, **kw)
                gy = torch.randn_like(y) if gy is None else gy
                y.backward(gy)
                runs.append([y] + [t.grad for t in b])
            for one, two in zip(*runs):
                assert torch.equal(one, two), (unit, E, batch, I, O)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _op_samples(device):
        if op in (ops.nac_weight.default, ops.nac_forward.default, ops.nac_mul_forward.default, ops.nalu_forward.default):
            args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_ops_skip_what_is_not_asked(device):
    x = rand_input((6, 4), device=device)
    W, M, G = (rand_params((4, 2), device=device) for _ in range(3))
    y, a, m, g, lx, _r = ops.nalu_forward(x, W, M, None, None, G, 1e-7, True)
    gx, gw, gm, gwm, gmm, gG, gGb = ops.nalu_backward(torch.ones_like(y), x, W, M, None, None, G, a, m, g, lx, 1e-7,
                                                      True, False)
    assert gx.shape == (0,) and gwm.shape == (0,) and gmm.shape == (0,) and gGb.shape == (0,)
    assert gw.shape == W.shape and gG.shape == G.shape
    # the first layer of a network: x needs no gradient, the parameters do
    xr = x.clone()
    Wr = W.clone().requires_grad_()
    out = F.nalu(xr, Wr, M, G)
    out.sum().backward()
    assert xr.grad is None and Wr.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", list(UNITS))
def test_noncontiguous_expanded_and_empty_inputs(unit, device):
    args, kwargs = make_args(unit, None, (6,), 5, 3, torch.float64, device)
    ref_fn, fused_fn = UNITS[unit][:2]
    x = args[0]
    x_t = x.t().contiguous().t()  # same values, column-major
    assert not x_t.is_contiguous()
    x_exp = x[:1].expand(6, 5)  # stride 0 rows
    x_slice = rand_input((6, 10), device=device)[:, ::2]
    for xx in (x_t, x_exp, x_slice):
        torch.testing.assert_close(fused_fn(xx, *args[1:], **kwargs), ref_fn(xx, *args[1:], **kwargs))
    # empty batch: empty output; weight gradients are zero
    xe = x[:0].clone().requires_grad_()
    params = [t.clone().requires_grad_() for t in args[1:]]
    y = fused_fn(xe, *params, **kwargs)
    assert y.shape == (0, 3)
    y.sum().backward()
    assert xe.grad.shape == (0, 5)
    for p in params:
        assert torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("device", DEVICES)
def test_ensemble_with_empty_batch(device):
    args, kwargs = make_args("nalu_sep", 3, (0,), 4, 2, torch.float64, device)
    y_ref, y_fused, a, b = run_both("nalu_sep", args, kwargs)
    assert y_fused.shape == (3, 0, 2)
    torch.testing.assert_close(y_fused, y_ref)
    for p, q in zip(a[1:], b[1:]):
        torch.testing.assert_close(q.grad, p.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_inputs_follow_sign_zero_convention(device):
    # sign(0) = 0: a zero input gets no gradient through the log path, as in autograd.
    x = rand_input((5, 4), device=device)
    x[0, 1] = 0.0
    x[3, 2] = -0.0
    args, kwargs = make_args("nac_mul", None, (5,), 4, 2, torch.float64, device)
    args[0] = x
    y_ref, y_fused, a, b = run_both("nac_mul", args, kwargs)
    torch.testing.assert_close(y_fused, y_ref)
    torch.testing.assert_close(b[0].grad, a[0].grad)
    assert b[0].grad[0, 1] == 0 and b[0].grad[3, 2] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("O", [2, 20], ids=["rowwise", "blas"])
def test_nan_and_inf_propagate_like_reference(unit, O, device):
    args, kwargs = make_args(unit, None, (6,), 5, O, torch.float64, device)
    x = args[0]
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    x[4, 4] = float("-inf")
    y_ref, y_fused, a, b = run_both(unit, args, kwargs)
    torch.testing.assert_close(y_fused, y_ref, equal_nan=True)
    torch.testing.assert_close(b[0].grad, a[0].grad, equal_nan=True)
    for p, q in zip(a[1:], b[1:]):
        assert torch.isnan(q.grad).any() == torch.isnan(p.grad).any()


@pytest.mark.parametrize("device", DEVICES)
def test_ensemble_equals_members(device):
    E, B, I, O = 4, 7, 5, 2
    args, kwargs = make_args("nalu_sep", E, (B,), I, O, torch.float64, device)
    y = F.nalu(*args, **kwargs)
    for e in range(E):
        y_e = F.nalu(*[t[e] for t in args], **kwargs)
        torch.testing.assert_close(y[e], y_e, rtol=1e-12, atol=1e-12)


def test_autocast_cpu_runs_in_float32():
    x = rand_input((8, 5), dtype=torch.float32)
    W, M, G = (rand_params((5, 2), dtype=torch.float32) for _ in range(3))
    want = F.nalu(x, W, M, G)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.nalu(x.bfloat16(), W, M, G)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.nalu(x.bfloat16().float(), W, M, G))
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_all_ops_have_cpu_kernels_and_fakes():
    for name in nalu_cuda._ops.OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"nalu_cuda::{name}", "CPU"), name
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("nalu_cuda::")}
    assert registered == set(nalu_cuda._ops.OP_NAMES) | set(nalu_cuda._ops.TRAINING_OP_NAMES)
    assert nalu_cuda.has_extension()


def test_torch_function_modes_and_subclasses_see_the_ops():
    # Eager calls take a direct binding; where __torch_function__ applies they go through torch.ops.
    seen = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = rand_input((4, 3))
    W, M, G = (rand_params((3, 2)) for _ in range(3))
    with Record():
        y = F.nalu(x, W, M, G)
    assert any("nalu_forward" in s for s in seen), seen
    torch.testing.assert_close(y, R.nalu(x, W, M, G))


@pytest.mark.parametrize("unit", ["nac_mul", "nalu_sep"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("eps", [1e-7, "subnormal"])
def test_reference_zero_input_gradient_is_finite_for_any_eps(eps, dtype, unit):
    # d log(|x| + eps) / dx at x = 0 is sign(0) / eps = 0, also when 1 / eps overflows.
    if eps == "subnormal":
        eps = torch.finfo(dtype).tiny / 4
    args, kwargs = make_args(unit, None, (5,), 4, 3, dtype, "cpu")
    args[0][0, 1] = 0.0
    args[0][3, 2] = -0.0
    kwargs["eps"] = eps
    y_ref, y_fused, a, b = run_both(unit, args, kwargs)
    assert torch.isfinite(a[0].grad).all()
    if unit == "nac_mul":
        assert a[0].grad[0, 1] == 0 and a[0].grad[3, 2] == 0
    rtol, atol = tolerances(dtype, 4, grad=True)
    torch.testing.assert_close(y_fused, y_ref, rtol=rtol, atol=atol)
    for p, q in zip(a, b):
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "no-x-grad"])
@pytest.mark.parametrize("unit", list(UNITS))
def test_flop_counter_counts_what_the_reference_counts(unit, x_grad):
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    for fn in UNITS[unit][:2]:
        for shape in [(None, (6, 2), 5, 3), (3, (4,), 5, 20)]:
            args, kwargs = make_args(unit, *shape, torch.float64, "cpu")
            args = [t.requires_grad_(x_grad or i > 0) for i, t in enumerate(args)]
            with FlopCounterMode(display=False) as mode:
                fn(*args, **kwargs).sum().backward()
            counts.append(mode.get_total_flops())
    half = len(counts) // 2
    assert counts[half:] == counts[:half]
    assert all(c > 0 for c in counts)


# Module -> (flops of forward + backward in units of one matrix product x W (2 rows I O), without
# and with an x gradient; the same in flops per factor of a product reduction (_ops' rule:
# forward 3, backward 8, + 2 with the x gradient), which the reference counts 0 for).
FLOP_MODULES = {
    "NAU": (nalu_cuda.NAU, (2, 3), (0, 0)),
    "NMU": (nalu_cuda.NMU, (0, 0), (3 + 8, 3 + 8 + 2)),
    "NPU": (nalu_cuda.NPU, (4 + 8, 4 + 8), (0, 0)),  # the gate's gradient needs d lr, d k anyway
    "RealNPU": (nalu_cuda.RealNPU, (2 + 4, 2 + 4), (0, 0)),
    "INALU": (nalu_cuda.INALU, (2 + 2, 2 + 4), (3 + 8, 3 + 8)),  # msv: no x gradient (sign)
}


@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "no-x-grad"])
@pytest.mark.parametrize("module", list(FLOP_MODULES))
def test_flop_counter_counts_every_unit(module, x_grad):
    # The fused module's forward + backward: the formulas of _ops, the reference's matrix products
    # plus the product reductions' count.
    from torch.utils.flop_counter import FlopCounterMode

    cls, matmuls, per_factor = FLOP_MODULES[module]
    for E, batch, I, O in [(None, (6, 2), 5, 3), (3, (4,), 5, 20), (2, (2, 3), 7, 1)]:
        counts = {}
        for backend in ("fused", "reference"):
            layer = cls(I, O, ensemble=E, backend=backend, dtype=torch.float64)
            x = rand_input(((E,) if E else ()) + batch + (I,)).requires_grad_(x_grad)
            with FlopCounterMode(display=False) as mode:
                layer(x).sum().backward()
            counts[backend] = mode.get_total_flops()
        factors = (E or 1) * math.prod(batch) * I * O
        want = matmuls[x_grad] * 2 * factors + per_factor[x_grad] * factors
        assert counts["fused"] == want > 0, (E, batch, I, O, counts)
        assert counts["fused"] - counts["reference"] == per_factor[x_grad] * factors
