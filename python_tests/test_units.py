"""NAU and NMU: the fused ops against the reference (values and every gradient), gradcheck and
double backward in float64, opcheck, torch.compile, ensembles, zero factors, memory layouts, thread
counts, bad input; the modules (initialisation, projection) and the regularisers."""
import pytest
import torch

import nalu_cuda
from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda import regularizers
from nalu_cuda.testing import assert_compiled_matches_eager, rand_input, tolerances

from .conftest import DEVICES, UNIT_SHAPES, shape_ids, unit_cases

ops = torch.ops.nalu_cuda

UNITS = {"nau": (R.nau, F.nau), "nmu": (R.nmu, F.nmu)}

SHAPES = UNIT_SHAPES
SHAPE_IDS = shape_ids(SHAPES)


def rand_weights(unit, shape, dtype=torch.float64, device="cpu"):
    """NAU: U(-1.2, 1.2) (some outside the clamp); NMU: U(-0.2, 1.2) around the projected range,
    which keeps products of |factors| <= 1.7 finite."""
    lo, hi = (-1.2, 1.2) if unit == "nau" else (-0.2, 1.2)
    return (torch.rand(*shape, dtype=dtype) * (hi - lo) + lo).to(device)


def make_args(unit, E, batch, I, O, dtype, device):
    lead = () if E is None else (E,)
    x = rand_input(lead + tuple(batch) + (I,), dtype=dtype, device=device)
    return x, rand_weights(unit, lead + (I, O), dtype, device)


def grads(fn, x, W, gy=None):
    x, W = x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    y = fn(x, W)
    if gy is None:
        gy = torch.randn_like(y)
    y.backward(gy)
    return y, x.grad, W.grad, gy


def assert_matches(unit, x, W, dtype, I):
    ref, fused = UNITS[unit]
    y_ref, gx_ref, gW_ref, gy = grads(ref, x, W)
    y, gx, gW, _ = grads(fused, x, W, gy)
    torch.testing.assert_close(y, y_ref, **dict(zip(("rtol", "atol"), tolerances(dtype, I))))
    rtol, atol = tolerances(dtype, I, grad=True)
    torch.testing.assert_close(gx, gx_ref, rtol=rtol, atol=atol, msg=lambda m: f"grad x: {m}")
    torch.testing.assert_close(gW, gW_ref, rtol=rtol, atol=atol, msg=lambda m: f"grad W: {m}")


@unit_cases(UNITS, SHAPES)
def test_fused_matches_reference(unit, shape, dtype, device):
    E, batch, I, O = shape
    x, W = make_args(unit, E, batch, I, O, dtype, device)
    assert_matches(unit, x, W, dtype, I)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", list(UNITS))
def test_nau_boundary_and_nmu_projected_weights(unit, device):
    # The projected ranges' ends: NAU's clamp passes the gradient at W = +-1 (as torch.clamp does);
    # NMU with weights exactly 0 and 1 (identity factor and x itself).
    x = rand_input((11, 6), device=device)
    W = torch.tensor([[-1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.5], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64,
                     device=device)
    assert_matches(unit, x, W, torch.float64, 6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", list(UNITS))
def test_gradcheck_and_double_backward(unit, device):
    for E, batch, I, O in [(None, (4,), 3, 2), (2, (3,), 4, 3)]:
        x, W = make_args(unit, E, batch, I, O, torch.float64, device)
        if unit == "nau":  # finite differences across the clamp's kinks are meaningless
            W = W.clamp(-0.9, 0.9)
        args = (x.requires_grad_(), W.requires_grad_())
        fn = UNITS[unit][1]
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)
        assert torch.autograd.gradgradcheck(fn, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", list(UNITS))
def test_opcheck(unit, device):
    # One ensemble call (plain layers share every code path but the shape check, tested above);
    # opcheck's fake-tensor and AOT checks take seconds per call.
    E, batch, I, O = 2, (3,), 4, 2
    x, W = make_args(unit, E, batch, I, O, torch.float64, device)
    torch.library.opcheck(getattr(ops, f"{unit}_forward"), (x.requires_grad_(), W.requires_grad_()))
    gy = torch.randn(*x.shape[:-1], O, dtype=torch.float64, device=device)
    for need_x in (True, False):
        torch.library.opcheck(getattr(ops, f"{unit}_backward"), (gy, x.detach(), W.detach(), need_x))


@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_nau_nmu_model(device):
    # Madsen & Johansen's "NMU model" (NAU -> NMU), as an ensemble of 3, compiled without graph breaks.
    model = torch.nn.Sequential(nalu_cuda.NAU(6, 4, ensemble=3), nalu_cuda.NMU(4, 2, ensemble=3)).to(device).double()
    x = rand_input((3, 16, 6), device=device)
    assert_compiled_matches_eager(model, x)
    assert all(m.use_fused(x) for m in model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", list(UNITS))
def test_ensemble_equals_members(unit, device):
    # E = 8 takes the CPU NMU backward's one-pass schedule (a task per member), a single member of
    # this size the split one: both must give the same bits.
    E, N, I, O = 8, 350, 70, 3
    x, W = make_args(unit, E, (2, N), I, O, torch.float64, device)
    fn = UNITS[unit][1]
    y, gx, gW, gy = grads(fn, x, W)
    exact = unit == "nmu" and device == "cpu"
    for e in range(E):
        for got, want in zip((y[e], gx[e], gW[e]), grads(fn, x[e], W[e], gy[e])[:3]):
            if exact:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def exclusive_products(x, W):
    """float64 E[n, i, o] = prod_{k != i} (W[k, o] x[n, k] + 1 - W[k, o]) by explicit loops over the
    factors: no division, so exact for zero factors (independent of the kernels and of torch.prod)."""
    f = x[:, :, None] * W[None] + (1 - W[None])  # (N, I, O)
    N, I, O = f.shape
    out = torch.ones_like(f)
    for i in range(I):
        for k in range(I):
            if k != i:
                out[:, i] *= f[:, k]
    return f, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_nmu_zero_factors_exact(dtype, device):
    N, I, O = 9, 40, 3
    x = rand_input((N, I), dtype=torch.float64)
    W = torch.rand(I, O, dtype=torch.float64) * 0.5 + 0.25
    # Exact zeros: W = 1 with x = 0, and W = 0.5 with x = -1; one zero in some products (their
    # gradient is the product of the others, not 0/0), two in others (every gradient 0 but none NaN).
    W[3, :] = 1.0
    x[:4, 3] = 0.0
    W[17, 1] = 0.5
    x[2:6, 17] = -1.0
    W[35, 2] = 1.0
    x[5:, 35] = 0.0
    f, excl = exclusive_products(x, W)
    assert (f == 0).any(dim=1).any() and ((f == 0).sum(dim=1) >= 2).any()
    gy = torch.randn(N, O, dtype=torch.float64)
    want_y = f.prod(dim=1)
    want_gx = (gy[:, None, :] * W[None] * excl).sum(-1)
    want_gW = (gy[:, None, :] * (x[:, :, None] - 1) * excl).sum(0)
    y, gx, gW, _ = grads(F.nmu, x.to(dtype).to(device), W.to(dtype).to(device), gy.to(dtype).to(device))
    for got, want in ((y, want_y), (gx, want_gx), (gW, want_gW)):
        assert torch.isfinite(got).all()
        rtol, atol = tolerances(dtype, I, grad=True)
        torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=atol)
    assert (y.cpu()[want_y == 0] == 0).all()


LAYOUTS = {
    "transposed": lambda shape: (shape[:-2] + (shape[-1], shape[-2]), lambda t: t.transpose(-1, -2)),
    "sliced": lambda shape: (shape[:-1] + (2 * shape[-1],), lambda t: t[..., ::2]),
    "expanded": lambda shape: ((1,) + shape[1:], lambda t: t.expand(*shape)),
    "offset": lambda shape: ((torch.Size(shape).numel() + 5,), lambda t: t[5:].view(*shape)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arg", ["x", "W", "grad_y"])
@pytest.mark.parametrize("unit", list(UNITS))
def test_layouts(unit, arg, layout, device):
    for E in (None, 2):
        lead = () if E is None else (E,)
        shapes = {"x": lead + (6, 5), "W": lead + (5, 3), "grad_y": lead + (6, 3)}
        leaf_shape, view = LAYOUTS[layout](shapes[arg])
        leaf = (rand_input(leaf_shape) if arg == "x" else
                rand_weights(unit, leaf_shape) if arg == "W" else torch.randn(leaf_shape, dtype=torch.float64))
        leaf = leaf.to(device)
        args = {k: (view(leaf) if k == arg else None) for k in shapes}
        x = args["x"] if arg == "x" else rand_input(shapes["x"], device=device)
        W = args["W"] if arg == "W" else rand_weights(unit, shapes["W"], device=device)
        gy = args["grad_y"] if arg == "grad_y" else torch.randn(shapes["grad_y"], dtype=torch.float64, device=device)
        ref, fused = UNITS[unit]
        y_ref, gx_ref, gW_ref, _ = grads(ref, x.contiguous(), W.contiguous(), gy.contiguous())
        # The leaf itself (not a contiguous copy) goes to the fused op.
        xf = x.detach().requires_grad_() if arg != "x" else x
        y, gx, gW, _ = grads(fused, xf, W, gy)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(gW, gW_ref, rtol=1e-9, atol=1e-11)
        gx2, gW2 = getattr(ops, f"{unit}_backward")(gy, x.detach(), W.detach(), True)
        torch.testing.assert_close(gx2, gx_ref, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(gW2, gW_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("E", [3, 9])
def test_same_result_for_any_thread_count(unit, E):
    x, W = make_args(unit, E, (700,), 33, 5, torch.float32, "cpu")  # E = 3: the split schedule
    gy = torch.randn(E, 700, 5)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            y = getattr(ops, f"{unit}_forward")(x, W)
            results.append((y,) + tuple(getattr(ops, f"{unit}_backward")(gy, x, W, True)))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


@pytest.mark.parametrize("unit", list(UNITS))
def test_empty_and_grad_x_skipped(unit):
    for shape in [(0, 4), (5, 0)]:
        x = torch.randn(*shape, dtype=torch.float64)
        W = torch.rand(shape[1], 3, dtype=torch.float64)
        y = getattr(ops, f"{unit}_forward")(x, W)
        torch.testing.assert_close(y, UNITS[unit][0](x, W))
        gx, gW = getattr(ops, f"{unit}_backward")(torch.randn_like(y), x, W, True)
        assert gx.shape == x.shape and gW.shape == W.shape
    x, W = make_args(unit, None, (6,), 4, 2, torch.float64, "cpu")
    gx, gW = getattr(ops, f"{unit}_backward")(torch.randn(6, 2, dtype=torch.float64), x, W, False)
    assert gx.shape == (0,) and gW.shape == W.shape


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("E,rows,I,O", [(5, 61, 40, 2), (3, 13, 7, 3), (2, 9, 100, 16)],
                         ids=["ensemble-rows", "lanes", "widest-rowwise"])
def test_nau_ops_against_reference_clamp_edges(E, rows, I, O, dtype):
    # The NAU's fused rowwise kernels (O <= 16; rows not a multiple of the unroll), with weights
    # inside, at and beyond the clamp's ends, and the backward with and without grad x.
    x = rand_input((E, rows, I), dtype=dtype)
    W = rand_weights("nau", (E, I, O), dtype) * 1.5
    W.view(-1)[::7] = 1.0
    W.view(-1)[3::7] = -1.0
    gy = torch.randn(E, rows, O, dtype=dtype)
    y_ref, gx_ref, gW_ref, _ = grads(R.nau, x, W, gy)
    tol = dict(zip(("rtol", "atol"), tolerances(dtype, I, grad=True)))
    torch.testing.assert_close(ops.nau_forward(x, W), y_ref, **tol)
    for need_x in (True, False):
        gx, gW = ops.nau_backward(gy, x, W, need_x)
        torch.testing.assert_close(gW, gW_ref, **tol)
        assert (gW[W.abs() > 1] == 0).all()
        if need_x:
            torch.testing.assert_close(gx, gx_ref, **tol)
        else:
            assert gx.shape == (0,)


BAD = [
    # (description, x, W, grad_y or None, expected message fragment)
    ("W rank", torch.randn(4, 3), torch.randn(3), None, "argument 'W' must have shape (in, out) or (E, in, out), got [3]"),
    ("x width", torch.randn(4, 5), torch.randn(3, 2), None, "argument 'x' must have shape (..., in) = (..., 3)"),
    ("ensemble x", torch.randn(2, 4, 3), torch.randn(3, 3, 2), None, "argument 'x' must have shape (E, ..., in) = (3, ..., 3)"),
    ("W dtype", torch.randn(4, 3), torch.randn(3, 2, dtype=torch.float64), None, "argument 'W' must have the dtype of 'x'"),
    ("int x", torch.ones(4, 3, dtype=torch.int64), torch.randn(3, 2), None, "argument 'x' must be a floating-point tensor"),
    ("W device", torch.randn(4, 3), torch.randn(3, 2, device="meta"), None, "argument 'W' must be on the device of 'x'"),
    ("grad_y shape", torch.randn(4, 3), torch.randn(3, 2), torch.randn(4, 3), "argument 'grad_y' must have shape [4, 2]"),
    ("half on CPU", torch.randn(4, 3).half(), torch.randn(3, 2).half(), None, "the CPU kernel supports dtypes"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("unit", list(UNITS))
def test_bad_input(unit, case):
    _, x, W, gy, msg = case
    if gy is None:
        name = f"{unit}_forward"
        call = lambda: getattr(ops, name)(x, W)  # noqa: E731
    else:
        name = f"{unit}_backward"
        call = lambda: getattr(ops, name)(gy, x, W, True)  # noqa: E731
    with pytest.raises(RuntimeError) as info:
        call()
    assert f"nalu_cuda::{name}" in str(info.value) and msg in str(info.value), str(info.value)
    # The fake (torch.compile's view of the op) agrees, on meta tensors.
    if case[0] not in ("W device", "half on CPU"):
        with pytest.raises(RuntimeError, match=f"nalu_cuda::{name}"):
            if gy is None:
                getattr(ops, name)(x.to("meta"), W.to("meta"))
            else:
                getattr(ops, name)(gy.to("meta"), x.to("meta"), W.to("meta"), True)


# ---------------------------------------------------------------------------------------------
# Modules and regularisers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [nalu_cuda.NAU, nalu_cuda.NMU])
def test_module_init_ensemble_members_and_backends(cls):
    I, O, E = 30, 4, 3
    gens = [torch.Generator().manual_seed(10 + e) for e in range(E)]
    ens = cls(I, O, ensemble=E)
    ens.reset_parameters(gens)
    for e in range(E):
        single = cls(I, O)
        single.reset_parameters(torch.Generator().manual_seed(10 + e))
        assert torch.equal(ens.W[e], single.W)
    big = cls(200, 300)
    if cls is nalu_cuda.NAU:
        r = min(0.5, 3 ** 0.5 * (2 / 500) ** 0.5)
        lo, hi = -r, r
    else:
        lo, hi = 0.25, 0.75
    assert big.W.min() >= lo and big.W.max() <= hi
    assert big.W.min() < lo + 0.01 and big.W.max() > hi - 0.01
    x = rand_input((E, 8, I)).float()
    ref = cls(I, O, ensemble=E, backend="reference")
    ref.load_state_dict(ens.state_dict())
    torch.testing.assert_close(ens(x), ref(x), rtol=1e-5, atol=1e-5)
    assert ens.use_fused(x) and not ref.use_fused(x)


def test_projection_and_optimizer_hook():
    model = torch.nn.Sequential(nalu_cuda.NAU(4, 3), nalu_cuda.NMU(3, 1))
    with torch.no_grad():
        model[0].W.mul_(10)
        model[1].W.mul_(10).sub_(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = nalu_cuda.project_after_step(opt, model)
    loss = model(rand_input((8, 4)).float()).square().mean()
    loss.backward()
    opt.step()
    assert model[0].W.min() >= -1 and model[0].W.max() <= 1 and (model[0].W.abs() == 1).any()
    assert model[1].W.min() >= 0 and model[1].W.max() <= 1
    handle.remove()
    with torch.no_grad():
        model[1].W.fill_(2.0)
    opt.zero_grad()
    opt.step()
    assert (model[1].W == 2.0).all()  # the hook is gone
    with pytest.raises(ValueError, match="must contain at least one NAU or NMU"):
        nalu_cuda.project_after_step(opt, torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs,msg", [
    ({"in_features": 0}, "argument 'in_features' must be a positive int"),
    ({"ensemble": 0}, "argument 'ensemble' must be a positive int"),
    ({"backend": "gpu"}, "argument 'backend' must be one of"),
])
@pytest.mark.parametrize("cls", [nalu_cuda.NAU, nalu_cuda.NMU])
def test_module_bad_arguments(cls, kwargs, msg):
    args = {"in_features": 3, "out_features": 2, **kwargs}
    with pytest.raises(ValueError, match=msg):
        cls(args.pop("in_features"), args.pop("out_features"), **args)


def test_regularizers_and_schedule():
    W = torch.tensor([[-1.0, -0.7, 0.0], [0.25, 0.5, 1.3]])
    torch.testing.assert_close(regularizers.nau_sparsity(W), torch.tensor([0.0, 0.3, 0.0, 0.25, 0.5, -0.3]).mean())
    torch.testing.assert_close(regularizers.nmu_sparsity(W), torch.tensor([1.0, 0.7, 0.0, 0.25, 0.5, 0.3]).mean())
    torch.testing.assert_close(regularizers.sparsity_error(W), torch.tensor(0.5))
    assert regularizers.sparsity_error([W[:, :2], W[:, 2:]]).item() == pytest.approx(0.5)
    torch.testing.assert_close(regularizers.sparsity_error(torch.stack([W, W.clamp(-1, 0)]), ensemble=True),
                               torch.tensor([0.5, 0.3]))
    assert [regularizers.schedule(t, 10, 20) for t in (0, 10, 15, 20, 99)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    nmu = regularizers.PUBLISHED_SCHEDULES["nmu"]
    assert (nmu.scale, nmu.start, nmu.end) == (10.0, 1e6, 2e6) and nmu.weight(1.5e6) == 5.0
    nau = regularizers.PUBLISHED_SCHEDULES["nau"]
    assert (nau.scale, nau.start, nau.end) == (0.01, 5e3, 5e4)
    model = torch.nn.Sequential(nalu_cuda.NAU(3, 2), nalu_cuda.NMU(2, 1))
    torch.testing.assert_close(regularizers.sparsity(model),
                               regularizers.nau_sparsity(model[0].W) + regularizers.nmu_sparsity(model[1].W))
    regularizers.sparsity(model).backward()
    assert model[0].W.grad is not None and model[1].W.grad is not None
    with pytest.raises(ValueError, match="'end' must be greater than 'start'"):
        regularizers.schedule(1, 5, 5)
    with pytest.raises(ValueError, match="'scale' must be a finite number >= 0"):
        regularizers.RegularizerSchedule(-1.0, 0, 1)


@pytest.mark.parametrize("unit", list(UNITS))
def test_autocast_runs_in_float32(unit):
    x, W = make_args(unit, None, (8,), 5, 3, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = UNITS[unit][1](x.bfloat16(), W)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, UNITS[unit][1](x.bfloat16().float(), W))
