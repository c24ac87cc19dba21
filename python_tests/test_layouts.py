"""Layout fuzz: every argument of every fused op, in every memory layout a user can hand over
(transposed, sliced with a step, expanded with stride 0, at a storage offset), against the
reference with the same values. A kernel that reads through a pointer of the wrong (or a freed)
buffer shows up here as a wrong value or gradient.

The forward ops are reached through :mod:`nalu_cuda.functional` (so the backward op gets a
non-contiguous ``grad_y`` too); the backward ops' saved tensors are checked directly against a
call with contiguous copies.
"""

import pytest
import torch

from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_input, rand_params, tolerances

from .conftest import DEVICES, run_fresh_interpreter

ops = torch.ops.nalu_cuda

# unit -> (reference, fused, arg names, gate, separate weights)
UNITS = {
    "nac": (R.nac, F.nac, ("x", "W_hat", "M_hat"), None),
    "nac_mul": (R.nac_mul, F.nac_mul, ("x", "W_hat", "M_hat"), None),
    "nalu": (R.nalu, F.nalu, ("x", "W_hat", "M_hat", "G"), "input"),
    "nalu_indep": (R.nalu, F.nalu, ("x", "W_hat", "M_hat", "G"), "independent"),
    "nalu_sep": (R.nalu, F.nalu, ("x", "W_hat", "M_hat", "G", "W_hat_m", "M_hat_m"), "input"),
    "nalu_sep_indep": (R.nalu, F.nalu, ("x", "W_hat", "M_hat", "G", "W_hat_m", "M_hat_m"), "independent"),
}

# (E or None, rows, I, O): rowwise (O <= 16; lanes variant I <= 8, and wide I), blas (O > 16), ensembles.
SHAPES = [(None, 9, 5, 2), (None, 6, 12, 3), (3, 7, 4, 2), (2, 5, 6, 18)]
SHAPE_IDS = [f"E{e}-N{n}-I{i}-O{o}" for e, n, i, o in SHAPES]


def _values(name, shape, dtype):
    if name == "x":
        return rand_input(shape, dtype=dtype)
    return rand_params(shape, scale=1.0 if name.startswith("M") else 0.4, dtype=dtype)


# Each layout: (leaf shape from the wanted shape, view of the leaf with the wanted shape).
def _transposed(shape):
    if len(shape) < 2:
        return None
    leaf = list(shape)
    leaf[-1], leaf[-2] = leaf[-2], leaf[-1]
    return tuple(leaf), lambda t: t.transpose(-1, -2)


def _sliced(shape):
    return tuple(shape[:-1]) + (2 * shape[-1],), lambda t: t[..., ::2]


def _expanded(shape):
    return (1,) + tuple(shape[1:]), lambda t: t.expand(*shape)


def _offset(shape):
    n = 1
    for d in shape:
        n *= d
    return (n + 5,), lambda t: t[5:].view(*shape)


LAYOUTS = {"transposed": _transposed, "sliced": _sliced, "expanded": _expanded, "offset": _offset}


def _shapes(unit, E, N, I, O):
    gate = UNITS[unit][3]
    lead = () if E is None else (E,)
    out = {"x": lead + (N, I), "W_hat": lead + (I, O), "M_hat": lead + (I, O), "W_hat_m": lead + (I, O),
           "M_hat_m": lead + (I, O)}
    out["G"] = lead + ((I, O) if gate == "input" else (O,))
    return out


def _call(unit, fn, args):
    names, gate = UNITS[unit][2], UNITS[unit][3]
    kw = dict(zip(names, args))
    if gate is not None:
        kw["gate"] = gate
    return fn(**kw)


def _check(unit, shape, arg, layout, dtype, device, grad_layout=None):
    E, N, I, O = shape
    names = UNITS[unit][2]
    shapes = _shapes(unit, E, N, I, O)
    leaves_ref, leaves_fused, views_ref, views_fused = [], [], [], []
    for name in names:
        want = shapes[name]
        spec = LAYOUTS[layout](want) if name == arg else None
        if spec is None:
            leaf_shape, view = want, (lambda t: t)
        else:
            leaf_shape, view = spec
        leaf = _values(name, leaf_shape, dtype).to(device)
        a, b = leaf.clone().requires_grad_(), leaf.clone().requires_grad_()
        leaves_ref.append(a)
        leaves_fused.append(b)
        views_ref.append(view(a).contiguous())
        views_fused.append(view(b))
        if spec is not None:
            assert not views_fused[-1].is_contiguous() or views_fused[-1].storage_offset() > 0, (arg, layout)
    y_ref = _call(unit, UNITS[unit][0], views_ref)
    y_fused = _call(unit, UNITS[unit][1], views_fused)
    gy = torch.randn_like(y_ref)
    gy_fused = gy
    if grad_layout is not None:
        leaf_shape, view = LAYOUTS[grad_layout](tuple(gy.shape))
        buf = torch.randn(leaf_shape, dtype=dtype, device=device)
        gy_fused = view(buf)
        gy = gy_fused.contiguous()
    y_ref.backward(gy)
    y_fused.backward(gy_fused)
    rtol, atol = tolerances(dtype, I)
    grtol, gatol = tolerances(dtype, I, grad=True)
    torch.testing.assert_close(y_fused, y_ref, rtol=rtol, atol=atol, msg=lambda m: f"y ({arg}, {layout}): {m}")
    for name, a, b in zip(names, leaves_ref, leaves_fused):
        torch.testing.assert_close(b.grad, a.grad, rtol=grtol, atol=gatol,
                                   msg=lambda m, name=name: f"grad {name} ({arg}, {layout}): {m}")


def _possible(unit, arg, layout, shape):
    """A 1-D gate (independent, no ensemble) has no transpose."""
    return not (layout == "transposed" and arg == "G" and UNITS[unit][3] == "independent" and shape[0] is None)


CASES = [(u, a, lay) for u in UNITS for a in UNITS[u][2] for lay in LAYOUTS]
FULL_CASES = [(u, a, lay, s) for u, a, lay in CASES for s in SHAPES if _possible(u, a, lay, s)]
FULL_IDS = [f"{u}-{a}-{lay}-{sid}" for u, a, lay, s in FULL_CASES for sid in [SHAPE_IDS[SHAPES.index(s)]]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("unit,arg,layout,shape", FULL_CASES, ids=FULL_IDS)
def test_argument_layout_matches_reference(unit, arg, layout, shape, dtype, device):
    _check(unit, shape, arg, layout, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "offset"])
@pytest.mark.parametrize("unit", list(UNITS))
def test_grad_y_layout_matches_reference(unit, layout, device):
    _check(unit, SHAPES[2], "x", "offset", torch.float64, device, grad_layout=layout)
    _check(unit, SHAPES[3], "x", "offset", torch.float64, device, grad_layout=layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("gate", ["input", "independent"])
@pytest.mark.parametrize("O", [2, 18], ids=["rowwise", "blas"])
def test_backward_op_saved_tensor_layouts(gate, layout, O, device):
    """nalu_backward with each saved tensor (a, m, g, lx) and grad_y non-contiguous equals the
    call with contiguous copies, bit for bit."""
    E, N, I = 2, 6, 5
    x = rand_input((E, N, I), device=device)
    W, M, Wm, Mm = (rand_params((E, I, O), device=device) for _ in range(4))
    G = rand_params((E, I, O) if gate == "input" else (E, O), device=device)
    y, a, m, g, lx, _r = ops.nalu_forward(x, W, M, Wm, Mm, G, 1e-7, gate == "input")
    gy = torch.randn_like(y)
    want = ops.nalu_backward(gy, x, W, M, Wm, Mm, G, a, m, g, lx, 1e-7, gate == "input", True)
    saved = {"gy": gy, "a": a, "m": m, "g": g, "lx": lx}
    for key, t in saved.items():
        if t.numel() == 0:
            continue
        leaf_shape, view = LAYOUTS[layout](tuple(t.shape))
        buf = torch.empty(leaf_shape, dtype=t.dtype, device=device).normal_()
        v = view(buf)
        if layout == "expanded":
            t = v.contiguous()  # stride 0 changes the values: compare with a contiguous copy of them
            saved[key] = t
        else:
            v.copy_(t)
        args = dict(saved, **{key: v})
        got = ops.nalu_backward(args["gy"], x, W, M, Wm, Mm, G, args["a"], args["m"], args["g"], args["lx"],
                                1e-7, gate == "input", True)
        ref = ops.nalu_backward(saved["gy"], x, W, M, Wm, Mm, G, saved["a"], saved["m"], saved["g"],
                                saved["lx"], 1e-7, gate == "input", True)
        for i, (p, q) in enumerate(zip(got, ref)):
            assert torch.equal(p, q), (key, layout, i)
    assert len(want) == 7  # grad_G_bias: (0,) without a gate bias


def test_layouts_under_baseline_isa():
    """The same fuzz on the baseline (non-AVX2) kernels, in a fresh interpreter."""
    code = (
        "import torch\n"
        "from python_tests.test_layouts import FULL_CASES, _check\n"
        "for unit, arg, layout, shape in FULL_CASES:\n"
        "    _check(unit, shape, arg, layout, torch.float32, 'cpu')\n"
        "print('ok')\n"
    )
    run_fresh_interpreter(code, isa="base")
