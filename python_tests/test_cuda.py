"""The CUDA kernels (csrc/cuda/) against the reference (nalu_cuda.reference) and the CPU kernels.

Every op, both CUDA paths (the one-pass "rowwise" kernels for layers with out <= 16 whose weights fit
in shared memory, and the blas path for wider layers), every dtype:

* float32 / float64: fused values and gradients against the float64 reference and against the CPU
  kernels, with the tolerances of ``nalu_cuda.testing``.
* float16 / bfloat16: the low-precision rule: the fused result's error against a float64 reference
  (computed from the same, rounded, inputs) is at most twice the error of the reference run in the
  same dtype, plus a floor of about one rounding of the largest value.

Also: float64 ``gradcheck``, ``torch.library.opcheck``, ``torch.compile(fullgraph=True)`` forward
and backward, CUDA graph capture and replay (and ``mode="reduce-overhead"``), autocast, ensembles
against their members, non-contiguous, empty and > 2^31-element inputs, determinism of the
rowwise-path weight gradients, and the errors for tensors on the wrong device.

Inputs are drawn fresh per test, bounded away from 0 (``testing.rand_input``) with weights scaled so
exp() stays finite (``testing.rand_params``).

Without a GPU, ``csrc/cuda/emulation/build.py`` builds these same CUDA ops and kernels for the CPU on
a CUDA emulator; with ``NALU_CUDA_LIBRARY=<that library> NALU_CUDA_TEST_EMULATION=1`` this module
runs on them (device "cpu"; the tests that need a real GPU skip).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import nalu_cuda
from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda import testing
from .conftest import shape_ids

EMULATION = os.environ.get("NALU_CUDA_TEST_EMULATION") == "1"
DEV = "cpu" if EMULATION else "cuda"

pytestmark = pytest.mark.skipif(
    not EMULATION and (not torch.cuda.is_available() or not nalu_cuda.has_cuda_kernels()),
    reason="needs a CUDA device and the CUDA kernels of nalu_cuda",
)
needs_gpu = pytest.mark.skipif(EMULATION, reason="needs a real GPU (running on the CUDA emulator)")

EPS = 1e-7
LOW = (torch.float16, torch.bfloat16)
# About one rounding of the largest value: the floor of the low-precision rule.
LOW_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

# kind -> (op family, gate, separate weights)
KINDS = {
    "nac": ("nac", None, False),
    "nac_mul": ("nac_mul", None, False),
    "nalu_input_tied": ("nalu", "input", False),
    "nalu_input_sep": ("nalu", "input", True),
    "nalu_indep_tied": ("nalu", "independent", False),
    "nalu_indep_sep": ("nalu", "independent", True),
}

# (E or None, batch dims, I, O, what it covers)
SHAPES = [
    (None, (128,), 100, 2, "paper layer; rowwise path, 2-launch backward"),
    (None, (16,), 2, 1, "tiny; rowwise path, 2 lanes per row, 1-launch backward"),
    (None, (4, 37), 7, 3, "two batch dims; 8 lanes"),
    (None, (300,), 64, 1, "many row blocks"),
    (3, (50,), 20, 5, "ensemble; 8 outputs in registers"),
    (2, (33,), 9, 16, "ensemble; widest rowwise layer"),
    (None, (64,), 40, 24, "blas path (out > 16)"),
    (2, (40,), 30, 20, "blas path, ensemble"),
    (None, (8,), 3000, 4, "blas path (weights exceed shared memory)"),
]
SHAPE_IDS = shape_ids(SHAPES)


def _dev():
    return torch.device(DEV)


def make_inputs(kind, E, batch, I, O, *, scale=None):
    """Float64 CPU tensors for one call: x, W_hat, M_hat [, W_hat_m, M_hat_m] [, G].

    The default weight scale shrinks with I so that u = lx W_m stays O(1) and exp(u) is finite even
    in float16."""
    family, gate, sep = KINDS[kind]
    if scale is None:
        scale = 0.5 * min(1.0, math.sqrt(64.0 / max(I, 1)))
    lead = () if E is None else (E,)
    t = {
        "x": testing.rand_input(lead + tuple(batch) + (I,)),
        "W_hat": testing.rand_params(lead + (I, O), scale=scale),
        "M_hat": testing.rand_params(lead + (I, O), scale=scale),
    }
    if family == "nalu":
        if sep:
            t["W_hat_m"] = testing.rand_params(lead + (I, O), scale=scale)
            t["M_hat_m"] = testing.rand_params(lead + (I, O), scale=scale)
        t["G"] = testing.rand_params(lead + ((I, O) if gate == "input" else (O,)), scale=scale)
    return t


def call(kind, mod, t):
    """The layer of `kind` through `mod` (nalu_cuda.functional or nalu_cuda.reference)."""
    family, gate, _ = KINDS[kind]
    if family == "nac":
        return mod.nac(t["x"], t["W_hat"], t["M_hat"])
    if family == "nac_mul":
        return mod.nac_mul(t["x"], t["W_hat"], t["M_hat"], EPS)
    return mod.nalu(t["x"], t["W_hat"], t["M_hat"], t["G"], t.get("W_hat_m"), t.get("M_hat_m"), EPS, gate)


def prepare(t, dtype, device):
    return {k: v.to(device=device, dtype=dtype).detach().requires_grad_(True) for k, v in t.items()}


def run(kind, mod, t, dtype, device, gy):
    """y and the gradients of (y * gy).sum() w.r.t. every input, for inputs cast to dtype/device."""
    ts = prepare(t, dtype, device)
    y = call(kind, mod, ts)
    names = sorted(ts)
    grads = torch.autograd.grad(y, [ts[n] for n in names], gy.to(device=device, dtype=dtype))
    return y.detach(), dict(zip(names, grads))


def assert_low_precision(fused, ref_dt, ref64, dtype, what):
    fused, ref_dt, ref64 = fused.double().cpu(), ref_dt.double().cpu(), ref64.double().cpu()
    assert fused.shape == ref64.shape, what
    if ref64.numel() == 0:
        return
    assert torch.isfinite(ref64).all(), f"{what}: the float64 reference is not finite (bad test inputs)"
    assert torch.isfinite(ref_dt).all(), f"{what}: the {dtype} reference overflows (bad test inputs)"
    err_fused = (fused - ref64).abs().max().item()
    err_ref = (ref_dt - ref64).abs().max().item()
    floor = LOW_FLOOR[dtype] * max(1.0, ref64.abs().max().item())
    assert err_fused <= 2 * err_ref + floor, (
        f"{what} ({dtype}): fused error {err_fused:.3g} > 2 x reference error {err_ref:.3g} + {floor:.3g}"
    )


def assert_close(actual, expected, dtype, what, grad=False):
    rtol, atol = (testing.GRAD_TOLERANCES if grad else testing.TOLERANCES)[dtype]
    # Sums over I (and, for weight gradients, over the batch) are reordered between kernels.
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol * 10, atol=atol * 10,
                               msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------
# Values and gradients, every op, both paths, every dtype
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_layer_matches_reference(kind, shape, dtype):
    E, batch, I, O, _ = shape
    t = make_inputs(kind, E, batch, I, O)
    y_shape = ((E,) if E is not None else ()) + tuple(batch) + (O,)
    gy = torch.randn(y_shape, dtype=torch.float64)
    dev = _dev()
    y, g = run(kind, F, t, dtype, dev, gy)
    assert y.dtype == dtype and y.device.type == DEV and y.shape == y_shape
    if dtype in LOW:
        # The float64 reference sees the inputs as rounded to dtype.
        t_rounded = {k: v.to(dtype).double() for k, v in t.items()}
        gy_rounded = gy.to(dtype).double()
        y64, g64 = run(kind, R, t_rounded, torch.float64, dev, gy_rounded)
        y_dt, g_dt = run(kind, R, t, dtype, dev, gy)
        assert_low_precision(y, y_dt, y64, dtype, "y")
        for n in g64:
            assert_low_precision(g[n], g_dt[n], g64[n], dtype, f"grad {n}")
        return
    y64, g64 = run(kind, R, t, torch.float64, dev, gy)
    assert_close(y, y64, dtype, "y (cuda vs reference)")
    for n in g64:
        assert_close(g[n], g64[n], dtype, f"grad {n} (cuda vs reference)", grad=True)
    if EMULATION:
        return  # the emulated ops are the CPU kernels of this process
    # The CPU kernels on the same inputs.
    y_cpu, g_cpu = run(kind, F, t, dtype, torch.device("cpu"), gy)
    assert_close(y, y_cpu, dtype, "y (cuda vs cpu)")
    for n in g_cpu:
        assert_close(g[n], g_cpu[n], dtype, f"grad {n} (cuda vs cpu)", grad=True)


@pytest.mark.parametrize("O", [2, 24], ids=["rowwise", "blas"])
@pytest.mark.parametrize("gate", ["input", "independent"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "sep"])
def test_nalu_forward_saved_values(O, gate, tied):
    """nalu_forward's extra results: a = x W, m = exp(lx W_m), g, lx = log(|x| + eps)."""
    kind = f"nalu_{'input' if gate == 'input' else 'indep'}_{'tied' if tied else 'sep'}"
    t = {k: v.to(DEV) for k, v in make_inputs(kind, 2, (33,), 12, O).items()}
    y, a, m, g, lx, _r = torch.ops.nalu_cuda.nalu_forward(
        t["x"], t["W_hat"], t["M_hat"], t.get("W_hat_m"), t.get("M_hat_m"), t["G"], EPS, gate == "input")
    W = R.nac_weight(t["W_hat"], t["M_hat"])
    Wm = W if tied else R.nac_weight(t["W_hat_m"], t["M_hat_m"])
    lx_ref = R.log_abs(t["x"], EPS)
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lx, lx_ref, **tol)
    torch.testing.assert_close(a, torch.bmm(t["x"], W), **tol)
    torch.testing.assert_close(m, torch.exp(torch.bmm(lx_ref, Wm)), **tol)
    g_ref = torch.sigmoid(torch.bmm(t["x"], t["G"])) if gate == "input" else torch.sigmoid(t["G"])
    torch.testing.assert_close(g, g_ref, **tol)
    torch.testing.assert_close(y, R.nalu(t["x"], t["W_hat"], t["M_hat"], t["G"], t.get("W_hat_m"),
                                         t.get("M_hat_m"), EPS, gate), **tol)


@pytest.mark.parametrize("E,O", [(None, 2), (2, 3), (None, 24), (2, 20)],
                         ids=["rowwise", "rowwise-ensemble", "blas", "blas-ensemble"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "sep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gate_bias_and_part_gradients(E, O, tied, dtype):
    """The input gate's bias (nalu_forward's G_bias) and the gradients reaching the kept a, m, g
    (nalu_backward's grad_a, grad_m, grad_g: nalu_parts with a gate regulariser) on both CUDA paths,
    against the float64 reference; the rowwise path with more than one block per member too."""
    kind = f"nalu_input_{'tied' if tied else 'sep'}"
    t = make_inputs(kind, E, (70,), 12, O)
    lead = () if E is None else (E,)
    t["G_bias"] = testing.rand_params(lead + (O,))
    names = sorted(t)
    gy = torch.randn(lead + (70, O), dtype=torch.float64)

    def loss_and_grads(mod, dtype, device):
        ts = prepare(t, dtype, device)
        y, a, m, g = mod.nalu_parts(ts["x"], ts["W_hat"], ts["M_hat"], ts["G"], ts.get("W_hat_m"), ts.get("M_hat_m"),
                                    EPS, "input", G_bias=ts["G_bias"])
        loss = (y * gy.to(device=device, dtype=dtype)).sum() + (g ** 2 * (1 - g) ** 2).sum() + 0.1 * (a * m).sum()
        return [y, a, m, g], torch.autograd.grad(loss, [ts[n] for n in names])

    outs, grads = loss_and_grads(F, dtype, DEV)
    outs_ref, grads_ref = loss_and_grads(R, torch.float64, "cpu")
    for what, u, v in zip("yamg", outs, outs_ref):
        assert_close(u.detach(), v.detach(), dtype, what)
    for what, u, v in zip(names, grads, grads_ref):
        assert_close(u, v, dtype, f"grad {what}", grad=True)


@pytest.mark.parametrize("per_member", [False, True], ids=["sum", "per-member"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_gate_regularizer(per_member, dtype):
    """nalu_gate_regularizer and its backward (ATen ops on g's device, float32 for float16/bfloat16)
    against the float64 reference; a gradient through nalu_parts' gate."""
    g64 = torch.sigmoid(torch.randn(3, 40, 2, dtype=torch.float64) * 2)
    g = g64.to(device=DEV, dtype=dtype).requires_grad_()
    g_ref = g.detach().double().cpu().requires_grad_()
    r = F.nalu_gate_regularizer(g, per_member)
    r_ref = R.nalu_gate_regularizer(g_ref, per_member)
    assert r.dtype == dtype and r.device.type == torch.device(DEV).type and r.shape == r_ref.shape
    w = torch.randn(r_ref.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad((r * w.to(device=DEV, dtype=dtype)).sum(), g)
    (grad_ref,) = torch.autograd.grad((r_ref * w).sum(), g_ref)
    if dtype in LOW:  # one rounding of the result and of each gradient element
        torch.testing.assert_close(r.detach().double().cpu(), r_ref.detach(), rtol=1e-2, atol=LOW_FLOOR[dtype])
        torch.testing.assert_close(grad.double().cpu(), grad_ref, rtol=1e-2, atol=LOW_FLOOR[dtype])
    else:
        assert_close(r.detach(), r_ref.detach(), dtype, "value")
        assert_close(grad, grad_ref, dtype, "grad", grad=True)


def _uniform(shape, low, high):
    return torch.rand(shape, dtype=torch.float64) * (high - low) + low


@pytest.mark.parametrize("O", [2, 24], ids=["rowwise", "blas"])
@pytest.mark.parametrize("kind", ["nalu_input_tied", "nalu_indep_sep"])
def test_float16_overflowing_m_keeps_gradients_finite(kind, O):
    """float16: u = lx W_m between 11.2 and 14.6 overflows m = exp(u) (max 65504 in float16) while
    g is close to 1, so y stays finite; the saved m saturates at 65504, so the backward is finite."""
    _, gate, sep = KINDS[kind]
    I = 4
    big = lambda: _uniform((I, O), 2.5, 3.5)  # noqa: E731  tanh * sigmoid in [0.92, 0.97]
    t = {"x": _uniform((64, I), 20.0, 40.0)}  # lx in [3.0, 3.7]
    if sep:
        t.update(W_hat=testing.rand_params((I, O)), M_hat=testing.rand_params((I, O)), W_hat_m=big(), M_hat_m=big())
    else:
        t.update(W_hat=big(), M_hat=big())
    t["G"] = _uniform((I, O), 0.1, 0.15) if gate == "input" else _uniform((O,), 8.0, 9.0)  # 1 - g < 4e-4
    dtype, dev = torch.float16, _dev()
    h = {k: v.to(device=dev, dtype=dtype) for k, v in t.items()}
    _, _, m, _, _, _r = torch.ops.nalu_cuda.nalu_forward(h["x"], h["W_hat"], h["M_hat"], h.get("W_hat_m"),
                                                    h.get("M_hat_m"), h["G"], EPS, gate == "input")
    r = {k: v.double() for k, v in h.items()}
    Wm = R.nac_weight(r["W_hat_m"], r["M_hat_m"]) if sep else R.nac_weight(r["W_hat"], r["M_hat"])
    over = torch.exp(R.log_abs(r["x"], EPS) @ Wm) > 65504
    assert over.float().mean() > 0.5, "bad test inputs: m should overflow float16 for most entries"
    assert torch.isfinite(m).all() and (m[over] == 65504).all(), "the saved m is not saturated at 65504"
    gy = torch.randn(64, O, dtype=torch.float64)
    y, g = run(kind, F, t, dtype, dev, gy)
    # The float32 reference from the same rounded inputs: m fits in float32.
    y32, g32 = run(kind, R, {k: v.to(dtype).double() for k, v in t.items()}, torch.float32, dev, gy.to(dtype).double())
    assert torch.isfinite(y32).all() and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), y32, rtol=2e-2, atol=1e-2)
    for n, v in g.items():
        assert torch.isfinite(v).all(), f"grad {n} is not finite: {v}"
    if sep:  # dW = x^T (g dy) does not involve m
        torch.testing.assert_close(g["W_hat"].float(), g32["W_hat"], rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("O", [2, 24], ids=["rowwise", "blas"])
def test_nac_mul_forward_saved_values_and_backward_flags(O):
    t = {k: v.to(DEV) for k, v in make_inputs("nac_mul", None, (20,), 6, O).items()}
    y, lx = torch.ops.nalu_cuda.nac_mul_forward(t["x"], t["W_hat"], t["M_hat"], EPS)
    torch.testing.assert_close(lx, R.log_abs(t["x"], EPS), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, R.nac_mul(t["x"], t["W_hat"], t["M_hat"], EPS), rtol=1e-10, atol=1e-12)
    gy = torch.randn_like(y)
    gx, gw, gm = torch.ops.nalu_cuda.nac_mul_backward(gy, t["x"], t["W_hat"], t["M_hat"], y, lx, EPS, False)
    assert gx.shape == (0,) and gx.device == y.device
    gx2, gw2, gm2 = torch.ops.nalu_cuda.nac_mul_backward(gy, t["x"], t["W_hat"], t["M_hat"], y, lx, EPS, True)
    assert gx2.shape == t["x"].shape
    torch.testing.assert_close(gw, gw2, rtol=0, atol=0)
    torch.testing.assert_close(gm, gm2, rtol=0, atol=0)


@pytest.mark.parametrize("O", [2, 24], ids=["rowwise", "blas"])
def test_nalu_backward_empty_gradients(O):
    """Tied weights and compute_grad_x=False give (0,)-shaped gradients, as on the CPU."""
    t = {k: v.to(DEV) for k, v in make_inputs("nalu_input_tied", None, (10,), 5, O).items()}
    y, a, m, g, lx, _r = torch.ops.nalu_cuda.nalu_forward(t["x"], t["W_hat"], t["M_hat"], None, None, t["G"], EPS, True)
    out = torch.ops.nalu_cuda.nalu_backward(torch.randn_like(y), t["x"], t["W_hat"], t["M_hat"], None, None, t["G"],
                                            a, m, g, lx, EPS, True, False)
    gx, gw, gm, gwm, gmm, gG, gGb = out
    assert gx.shape == (0,) and gwm.shape == (0,) and gmm.shape == (0,) and gGb.shape == (0,)
    assert gw.shape == t["W_hat"].shape and gG.shape == t["G"].shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_nac_weight_ops(dtype):
    """The weight construction and its backward are elementwise: any shape."""
    for shape in [(7, 3), (4, 50, 40), (11,), (2, 3, 4, 5), (0, 3)]:
        W_hat = testing.rand_params(shape, scale=1.0).to(DEV, dtype)
        M_hat = testing.rand_params(shape, scale=1.0).to(DEV, dtype)
        gW = torch.randn(shape, dtype=torch.float64).to(DEV, dtype)
        W = torch.ops.nalu_cuda.nac_weight(W_hat, M_hat)
        gw, gm = torch.ops.nalu_cuda.nac_weight_backward(gW, W_hat, M_hat)
        w64, m64 = W_hat.double().requires_grad_(), M_hat.double().requires_grad_()
        W64 = R.nac_weight(w64, m64)
        gw64, gm64 = torch.autograd.grad(W64, [w64, m64], gW.double())
        if dtype in LOW:
            wd, md = W_hat.clone().requires_grad_(), M_hat.clone().requires_grad_()
            Wd = R.nac_weight(wd, md)
            gwd, gmd = torch.autograd.grad(Wd, [wd, md], gW)
            assert_low_precision(W, Wd, W64, dtype, "W")
            assert_low_precision(gw, gwd, gw64, dtype, "grad W_hat")
            assert_low_precision(gm, gmd, gm64, dtype, "grad M_hat")
        else:
            assert_close(W, W64, dtype, "W")
            assert_close(gw, gw64, dtype, "grad W_hat", grad=True)
            assert_close(gm, gm64, dtype, "grad M_hat", grad=True)
        # Through autograd (the C++ autograd of nac_weight).
        wa, ma = W_hat.clone().requires_grad_(), M_hat.clone().requires_grad_()
        Wa = F.nac_weight(wa, ma)
        ga, gb = torch.autograd.grad(Wa, [wa, ma], gW)
        torch.testing.assert_close(Wa, W, rtol=0, atol=0)
        torch.testing.assert_close(ga, gw, rtol=0, atol=0)
        torch.testing.assert_close(gb, gm, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Gradient checks and opcheck
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("O", [3, 17], ids=["rowwise", "blas"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_gradcheck_float64(kind, O):
    t = prepare(make_inputs(kind, 2, (4,), 3, O), torch.float64, _dev())
    names = sorted(t)

    def fn(*args):
        return call(kind, F, dict(zip(names, args)))

    assert torch.autograd.gradcheck(fn, tuple(t[n] for n in names))


def test_gradcheck_nac_weight_float64():
    w = testing.rand_params((3, 4), scale=1.0).to(DEV).requires_grad_()
    m = testing.rand_params((3, 4), scale=1.0).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(F.nac_weight, (w, m))


def _opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("O", [3, 17], ids=["rowwise", "blas"])
@pytest.mark.parametrize("ensemble", [None, 2], ids=["plain", "ensemble"])
def test_opcheck(O, ensemble):
    dev = _dev()
    ops = torch.ops.nalu_cuda
    I = 5

    def inputs(kind, grad):
        return {k: v.to(dev).requires_grad_(grad) for k, v in make_inputs(kind, ensemble, (6,), I, O).items()}

    W = inputs("nac", False)
    _opcheck(ops.nac_weight.default, (W["W_hat"].requires_grad_(), W["M_hat"].requires_grad_()))
    W = inputs("nac", False)
    _opcheck(ops.nac_weight_backward.default, (torch.randn_like(W["W_hat"]), W["W_hat"], W["M_hat"]))

    t = inputs("nac", True)
    _opcheck(ops.nac_forward.default, (t["x"], t["W_hat"], t["M_hat"]))
    t = inputs("nac", False)
    y = ops.nac_forward(t["x"], t["W_hat"], t["M_hat"])
    for gx in (True, False):
        _opcheck(ops.nac_backward.default, (torch.randn_like(y), t["x"], t["W_hat"], t["M_hat"], gx))

    t = inputs("nac_mul", True)
    _opcheck(ops.nac_mul_forward.default, (t["x"], t["W_hat"], t["M_hat"], EPS))
    t = inputs("nac_mul", False)
    y, lx = ops.nac_mul_forward(t["x"], t["W_hat"], t["M_hat"], EPS)
    for gx in (True, False):
        _opcheck(ops.nac_mul_backward.default, (torch.randn_like(y), t["x"], t["W_hat"], t["M_hat"], y, lx, EPS, gx))

    for kind in ("nalu_input_tied", "nalu_input_sep", "nalu_indep_tied", "nalu_indep_sep"):
        input_gate = KINDS[kind][1] == "input"
        t = inputs(kind, True)
        args = (t["x"], t["W_hat"], t["M_hat"], t.get("W_hat_m"), t.get("M_hat_m"), t["G"], EPS, input_gate)
        _opcheck(ops.nalu_forward.default, args)
        t = inputs(kind, False)
        args = (t["x"], t["W_hat"], t["M_hat"], t.get("W_hat_m"), t.get("M_hat_m"), t["G"], EPS, input_gate)
        y, a, m, g, lx, _r = ops.nalu_forward(*args)
        for gx in (True, False):
            _opcheck(ops.nalu_backward.default,
                     (torch.randn_like(y),) + args[:6] + (a, m, g, lx, EPS, input_gate, gx))


# ------------------------------------------------------------------------------------------------
# torch.compile, CUDA graphs
# ------------------------------------------------------------------------------------------------


def _fwd_bwd(fn, t, gy):
    names = sorted(t)
    y = fn(*[t[n] for n in names])
    grads = torch.autograd.grad(y, [t[n] for n in names], gy)
    return [y] + list(grads)


@pytest.mark.parametrize("kind,O", [("nalu_input_tied", 2), ("nalu_indep_sep", 24), ("nac_mul", 1)])
def test_compile_fullgraph(kind, O):
    torch._dynamo.reset()
    t = prepare(make_inputs(kind, None, (64,), 10, O), torch.float32, _dev())
    names = sorted(t)

    def fn(*args):
        return call(kind, F, dict(zip(names, args)))

    gy = torch.randn(64, O, device=DEV)
    eager = _fwd_bwd(fn, t, gy)
    compiled = _fwd_bwd(torch.compile(fn, fullgraph=True), t, gy)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@needs_gpu
def test_compile_reduce_overhead():
    torch._dynamo.reset()
    kind = "nalu_input_sep"
    t = prepare(make_inputs(kind, 3, (40,), 12, 2), torch.float32, _dev())
    names = sorted(t)

    def fn(*args):
        y = call(kind, F, dict(zip(names, args)))
        return (y * y).sum()

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up runs, then graph replays
        for v in t.values():
            v.grad = None
        loss = compiled(*[t[n] for n in names])
        loss.backward()
        got = [loss.detach().clone()] + [t[n].grad.clone() for n in names]
    for v in t.values():
        v.grad = None
    loss = fn(*[t[n] for n in names])
    loss.backward()
    want = [loss.detach()] + [t[n].grad for n in names]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@needs_gpu
@pytest.mark.parametrize("kind,E,N,O", [
    ("nalu_input_tied", None, 300, 2),   # rowwise path, backward with a workspace (2 launches)
    ("nalu_indep_sep", 2, 16, 3),        # rowwise path, 1-launch backward
    ("nalu_input_sep", 2, 40, 20),       # blas path
    ("nac_mul", None, 50, 24),
])
def test_cuda_graph_capture_replay(kind, E, N, O):
    dev = _dev()
    t = prepare(make_inputs(kind, E, (N,), 16, O), torch.float32, dev)
    names = sorted(t)
    params = [t[n] for n in names]
    gy_shape = ((E,) if E else ()) + (N, O)
    static_gy = torch.randn(gy_shape, device=dev)

    def step():
        y = call(kind, F, t)
        y.backward(static_gy)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()

    for _ in range(2):
        fresh = make_inputs(kind, E, (N,), 16, O)
        with torch.no_grad():
            for n in names:
                t[n].copy_(fresh[n])
            static_gy.copy_(torch.randn(gy_shape))
        graph.replay()
        torch.cuda.synchronize()
        got = [static_y.clone()] + [t[n].grad.clone() for n in names]
        ref = prepare(fresh, torch.float32, dev)
        y = call(kind, F, ref)
        want = [y.detach()] + list(torch.autograd.grad(y, [ref[n] for n in names], static_gy))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Autocast
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["nac", "nac_mul", "nalu_input_sep", "nalu_indep_tied"])
def test_autocast_runs_float32(kind, cast, param_dtype):
    """Under autocast every op runs in float32 and returns float32; gradients reach the parameters
    in their own dtype."""
    t = make_inputs(kind, None, (32,), 10, 2)
    ts = prepare(t, param_dtype, _dev())
    names = sorted(ts)
    gy = torch.randn(32, 2, device=DEV)
    with torch.autocast(DEV, dtype=cast):
        y = call(kind, F, ts)
    assert y.dtype == torch.float32
    grads = torch.autograd.grad(y, [ts[n] for n in names], gy)
    for n, g in zip(names, grads):
        assert g.dtype == param_dtype, n
    # The same computation in float32 outside autocast, from the (possibly rounded) inputs.
    t32 = {k: v.to(param_dtype).float() for k, v in t.items()}
    y32, g32 = run(kind, R, t32, torch.float32, _dev(), gy.cpu())
    torch.testing.assert_close(y, y32, rtol=1e-5, atol=1e-5)
    for n, g in zip(names, grads):
        tol = dict(rtol=1e-5, atol=1e-5) if param_dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(g.float(), g32[n].to(param_dtype).float(), **tol)


def test_autocast_backward_op_float32():
    t = {k: v.to(DEV).half() for k, v in make_inputs("nalu_input_tied", None, (8,), 4, 2).items()}
    with torch.autocast(DEV, dtype=torch.float16):
        y, a, m, g, lx, _r = torch.ops.nalu_cuda.nalu_forward(t["x"], t["W_hat"], t["M_hat"], None, None, t["G"], EPS,
                                                          True)
        out = torch.ops.nalu_cuda.nalu_backward(torch.ones_like(y), t["x"], t["W_hat"], t["M_hat"], None, None,
                                                t["G"], a, m, g, lx, EPS, True, True)
    assert all(v.dtype == torch.float32 for v in (y, a, m, g, lx))
    assert all(v.dtype == torch.float32 for v in out)


# ------------------------------------------------------------------------------------------------
# Ensembles, layouts, empty and huge inputs, determinism
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("O", [2, 20], ids=["rowwise", "blas"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_ensemble_matches_members(kind, O):
    E = 4
    t = make_inputs(kind, E, (3, 11), 9, O)
    gy = torch.randn(E, 3, 11, O, dtype=torch.float64)
    y, g = run(kind, F, t, torch.float32, _dev(), gy)
    for e in range(E):
        te = {k: v[e] for k, v in t.items()}
        ye, ge = run(kind, F, te, torch.float32, _dev(), gy[e])
        torch.testing.assert_close(y[e], ye, rtol=1e-5, atol=1e-6)
        for n in ge:
            torch.testing.assert_close(g[n][e], ge[n], rtol=1e-4, atol=1e-5)


def _noncontiguous(v):
    """The same values in a transposed (non-contiguous) layout."""
    if v.dim() < 2:
        return v.repeat_interleave(2)[::2]
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("O", [2, 20], ids=["rowwise", "blas"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_noncontiguous_inputs(kind, O):
    t = make_inputs(kind, 2, (13,), 6, O)
    gy = torch.randn(2, 13, O, dtype=torch.float64)
    y_ref, g_ref = run(kind, F, t, torch.float32, _dev(), gy)
    ts = {k: _noncontiguous(v.float().to(DEV)).requires_grad_() for k, v in t.items()}
    assert not ts["x"].is_contiguous() and not ts["W_hat"].is_contiguous()
    names = sorted(ts)
    y = call(kind, F, ts)
    gy_nc = _noncontiguous(gy.float().to(DEV))
    assert not gy_nc.is_contiguous()
    grads = torch.autograd.grad(y, [ts[n] for n in names], gy_nc)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    for n, g in zip(names, grads):
        torch.testing.assert_close(g, g_ref[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch,I,O", [
    ((0,), 5, 3), ((2, 0), 5, 3), ((0,), 5, 20), ((4,), 0, 3), ((4,), 5, 0), ((7,), 0, 20),
])
def test_empty_inputs(kind, batch, I, O):
    t = make_inputs(kind, None, batch, I, O)
    gy = torch.randn(tuple(batch) + (O,), dtype=torch.float64)
    y, g = run(kind, F, t, torch.float64, _dev(), gy)
    y_ref, g_ref = run(kind, R, t, torch.float64, _dev(), gy)
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref)
    for n in g_ref:
        assert g[n].shape == g_ref[n].shape, n
        torch.testing.assert_close(g[n], g_ref[n], msg=n)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("E,N,O", [(2, 0, 3), (2, 0, 20), (0, 4, 3), (0, 4, 20)])
def test_empty_ensembles(kind, E, N, O):
    """No rows, or no members (the reference cannot reshape these): empty outputs, zero gradients."""
    t = make_inputs(kind, E, (N,), 5, O)
    gy = torch.randn(E, N, O, dtype=torch.float64)
    y, g = run(kind, F, t, torch.float64, _dev(), gy)
    assert y.shape == (E, N, O)
    for n, v in t.items():
        assert g[n].shape == v.shape, n
        assert torch.all(g[n] == 0), n


@pytest.mark.parametrize("O", [2, 20], ids=["rowwise", "blas"])
@pytest.mark.parametrize("kind", ["nalu_input_sep", "nalu_indep_tied", "nac_mul"])
def test_backward_deterministic(kind, O):
    """The same call twice gives bitwise the same gradients (no atomics on either path)."""
    t = make_inputs(kind, 2, (700,), 50, O)
    gy = torch.randn(2, 700, O, dtype=torch.float64)
    _, g1 = run(kind, F, t, torch.float32, _dev(), gy)
    _, g2 = run(kind, F, t, torch.float32, _dev(), gy)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


@needs_gpu
@pytest.mark.parametrize("I,O", [(2, 1), (1024, 17)], ids=["rowwise", "blas"])
def test_more_than_2_31_elements(I, O):
    """64-bit indexing: x with more than 2^31 elements; checked on the rows past 2^31 elements."""
    n_rows = (2**31) // I + 3
    need = n_rows * I * 2 * 4 + n_rows * O * 2 * 3  # x, lx, dx, grad (half) and y, dy
    free, _ = torch.cuda.mem_get_info()
    if free < need * 1.5:
        pytest.skip(f"needs about {need * 1.5 / 2**30:.0f} GiB of free GPU memory")
    dev = _dev()
    dtype = torch.float16
    t = make_inputs("nac_mul", None, (4,), I, O)
    W_hat, M_hat = t["W_hat"].to(dev, dtype), t["M_hat"].to(dev, dtype)
    x = torch.empty(n_rows, I, device=dev, dtype=dtype).uniform_(0.5, 1.5)
    tail = slice(n_rows - 3, n_rows)
    y, lx = torch.ops.nalu_cuda.nac_mul_forward(x, W_hat, M_hat, EPS)
    gy = torch.zeros_like(y)
    gy[tail] = torch.randn(3, O, device=dev, dtype=dtype)
    gx, gw, gm = torch.ops.nalu_cuda.nac_mul_backward(gy, x, W_hat, M_hat, y, lx, EPS, True)
    # Only the tail rows carry gradient: the reference on them alone gives the same result.
    xt = x[tail].clone()
    del x, lx
    tt = {"x": xt.double().cpu(), "W_hat": W_hat.double().cpu(), "M_hat": M_hat.double().cpu()}
    y64, g64 = run("nac_mul", R, tt, torch.float64, dev, gy[tail].double().cpu())
    y_dt, g_dt = run("nac_mul", R, {k: v.to(dtype) for k, v in tt.items()}, dtype, dev, gy[tail].double().cpu())
    assert_low_precision(y[tail], y_dt, y64, dtype, "y (tail rows)")
    assert_low_precision(gx[tail], g_dt["x"], g64["x"], dtype, "grad x (tail rows)")
    assert_low_precision(gw, g_dt["W_hat"], g64["W_hat"], dtype, "grad W_hat")
    assert_low_precision(gm, g_dt["M_hat"], g64["M_hat"], dtype, "grad M_hat")


# ------------------------------------------------------------------------------------------------
# Modules, errors
# ------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_modules_use_cuda_kernels(dtype):
    for layer in (nalu_cuda.NAC(10, 2), nalu_cuda.NACMul(10, 2), nalu_cuda.NALU(10, 2, tied=False),
                  nalu_cuda.NALU(10, 2, gate="independent", ensemble=3)):
        layer = layer.to(DEV, dtype)
        shape = (3, 16, 10) if layer.ensemble else (16, 10)
        x = testing.rand_input(shape, dtype=dtype, device=DEV)
        assert layer.use_fused(x)
        y = layer(x)
        assert y.dtype == dtype and y.device.type == "cuda"
        y.float().sum().backward()
        assert all(p.grad is not None and p.grad.dtype == dtype for p in layer.parameters())


@needs_gpu
def test_mixed_devices_name_the_argument():
    t = {k: v.float() for k, v in make_inputs("nalu_input_sep", None, (4,), 3, 2).items()}
    x = t["x"].to(DEV)
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nac_forward: argument 'W_hat' must be on the device of 'x'"):
        F.nac(x, t["W_hat"], t["M_hat"])
    with pytest.raises(RuntimeError, match=r"argument 'M_hat' must be on the device of 'W_hat'"):
        F.nac(x, t["W_hat"].to(DEV), t["M_hat"])
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nalu_forward: argument 'G' must be on the device of 'x'"):
        F.nalu(x, t["W_hat"].to(DEV), t["M_hat"].to(DEV), t["G"])
    with pytest.raises(RuntimeError, match=r"argument 'W_hat_m' must be on the device of 'x'"):
        F.nalu(x, t["W_hat"].to(DEV), t["M_hat"].to(DEV), t["G"].to(DEV), t["W_hat_m"], t["M_hat_m"])
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nac_mul_forward: argument 'W_hat' must be on the device"):
        F.nac_mul(t["x"], t["W_hat"].to(DEV), t["M_hat"].to(DEV))
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nac_weight: argument 'M_hat' must be on the device"):
        F.nac_weight(t["W_hat"].to(DEV), t["M_hat"])
    # Backward ops: a gradient or saved tensor on the wrong device.
    xc, wc, mc = x, t["W_hat"].to(DEV), t["M_hat"].to(DEV)
    y, lx = torch.ops.nalu_cuda.nac_mul_forward(xc, wc, mc, EPS)
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nac_mul_backward: argument 'grad_y' must be on the device"):
        torch.ops.nalu_cuda.nac_mul_backward(torch.ones_like(y).cpu(), xc, wc, mc, y, lx, EPS, True)
    with pytest.raises(RuntimeError, match=r"argument 'lx' must be on the device of 'x'"):
        torch.ops.nalu_cuda.nac_mul_backward(torch.ones_like(y), xc, wc, mc, y, lx.cpu(), EPS, True)
    if torch.cuda.device_count() > 1:
        with pytest.raises(RuntimeError, match=r"argument 'W_hat' must be on the device of 'x'"):
            F.nac(x, wc.to("cuda:1"), mc.to("cuda:1"))


def test_half_given_separate_weights_are_an_error():
    t = {k: v.to(DEV) for k, v in make_inputs("nalu_input_sep", None, (4,), 3, 2).items()}
    for given in ("W_hat_m", "M_hat_m"):
        sep = {"W_hat_m": None, "M_hat_m": None, given: t[given]}
        with pytest.raises(RuntimeError, match=rf"separate multiplicative weights need both 'W_hat_m' and "
                                               rf"'M_hat_m', got only '{given}'"):
            F.nalu(t["x"], t["W_hat"], t["M_hat"], t["G"], sep["W_hat_m"], sep["M_hat_m"])


@needs_gpu
def test_same_messages_as_cpu():
    """Shape, dtype and eps errors come from the shared checks: the CPU and CUDA ops agree."""
    t = {k: v.float() for k, v in make_inputs("nalu_input_tied", None, (4,), 3, 2).items()}
    bad_calls = [
        lambda d: F.nac(t["x"].to(d), t["W_hat"][:2].to(d), t["M_hat"][:2].to(d)),
        lambda d: F.nac_mul(t["x"].to(d), t["W_hat"].to(d), t["M_hat"].to(d), -1.0),
        lambda d: F.nalu(t["x"].to(d), t["W_hat"].to(d), t["M_hat"].to(d), t["G"][:, :1].to(d)),
        lambda d: F.nac(t["x"].to(d).int(), t["W_hat"].to(d), t["M_hat"].to(d)),
        lambda d: F.nalu(t["x"].to(d), t["W_hat"].to(d), t["M_hat"].to(d), t["G"].to(d), None, t["M_hat"].to(d)),
        lambda d: F.nac_weight(t["W_hat"].to(d), t["M_hat"][:1].to(d)),
    ]
    for bad in bad_calls:
        messages = []
        for d in ("cpu", "cuda"):
            with pytest.raises(RuntimeError) as info:
                bad(d)
            messages.append(str(info.value).splitlines()[0])
        assert messages[0] == messages[1]
