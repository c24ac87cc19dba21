"""The CUDA ops of the NAU and NMU (csrc/cuda/units_cuda*.{cpp,cu}) against the reference.

As python_tests/test_cuda.py: on a GPU when one is visible and the CUDA kernels are built, or on
the CPU emulator (``NALU_CUDA_LIBRARY=<csrc/cuda/emulation/build.py's library>
NALU_CUDA_TEST_EMULATION=1``, device "cpu"). Every dtype: float32/float64 against the float64
reference with the tolerances of ``nalu_cuda.testing``; float16/bfloat16 by the low-precision
rule (the fused error against a float64 reference of the same rounded inputs at most twice the
reference's own error in that dtype, plus about one rounding). Also: one to several rounds of 32
inputs and more than 32 rounds (the two-level exclusive products), zero factors, ensembles, the
chunked weight gradient, determinism run to run, empty inputs, and the input-size limit.
"""
from __future__ import annotations

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

ops = torch.ops.nalu_cuda
UNITS = {"nau": (R.nau, F.nau), "nmu": (R.nmu, F.nmu)}
LOW = (torch.float16, torch.bfloat16)
LOW_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

# (E or None, batch, I, O, what it covers)
SHAPES = [
    (None, (128,), 100, 2, "paper layer: 4 rounds of 32 inputs"),
    (None, (5,), 1, 1, "one input, 31 idle lanes"),
    (None, (3, 7), 32, 3, "exactly one round; two batch dims"),
    (3, (20,), 45, 5, "ensemble"),
    (None, (300,), 8, 1, "many rows: several weight-gradient chunks"),
    (None, (3,), 1100, 2, "35 rounds: more rounds than lanes"),
]
SHAPE_IDS = shape_ids(SHAPES)


def make(unit, E, batch, I, O):
    lead = () if E is None else (E,)
    x = testing.rand_input(lead + tuple(batch) + (I,), low=0.9, high=1.1)
    lo, hi = (-1.2, 1.2) if unit == "nau" else (0.0, 1.0)
    W = torch.rand(lead + (I, O), dtype=torch.float64) * (hi - lo) + lo
    if unit == "nau":
        W = W / max(1.0, I / 16) ** 0.5  # keeps the sums O(1) in float16
    gy = torch.randn(*x.shape[:-1], O, dtype=torch.float64)
    return x, W, gy


def run(fn, x, W, gy, dtype, device):
    x = x.to(device, dtype).requires_grad_()
    W = W.to(device, dtype).requires_grad_()
    y = fn(x, W)
    gx, gW = torch.autograd.grad(y, (x, W), gy.to(device, dtype))
    return [t.detach().double().cpu() for t in (y, gx, gW)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=["f64", "f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("unit", list(UNITS))
def test_cuda_matches_reference(unit, shape, dtype):
    E, batch, I, O, _ = shape
    x, W, gy = make(unit, E, batch, I, O)
    ref, fused = UNITS[unit]
    if dtype in LOW:  # the same rounded inputs on both sides
        x, W, gy = (t.to(dtype).double() for t in (x, W, gy))
    want = run(ref, x, W, gy, torch.float64, "cpu")
    got = run(fused, x, W, gy, dtype, DEV)
    names = ("y", "grad x", "grad W")
    if dtype in LOW:
        own = run(ref, x, W, gy, dtype, DEV)  # the reference's own error in this dtype
        for name, g, o, w in zip(names, got, own, want):
            scale = w.abs().max().item()
            err = (g - w).abs().max().item()
            ref_err = (o - w).abs().max().item()
            assert err <= 2 * ref_err + LOW_FLOOR[dtype] * max(scale, 1.0), (name, err, ref_err, scale)
        return
    for k, (name, g, w) in enumerate(zip(names, got, want)):
        rtol, atol = testing.tolerances(dtype, I, grad=k > 0)
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cuda_nmu_zero_factors_exact(dtype):
    N, I, O = 6, 70, 2
    x = testing.rand_input((N, I))
    W = torch.rand(I, O, dtype=torch.float64) * 0.5 + 0.25
    W[5, :] = 1.0
    x[:3, 5] = 0.0  # one zero factor in rows 0-2 (both outputs)
    W[40, 1] = 0.5
    x[1:, 40] = -1.0  # a second zero in rows 1-2 of output 1, the only one in rows 3-5
    gy = torch.randn(N, O, dtype=torch.float64)
    f = x[:, :, None] * W[None] + (1 - W[None])
    excl = torch.stack([torch.cat([f[:, :i], f[:, i + 1:]], 1).prod(1) for i in range(I)], 1)
    want = (f.prod(1), (gy[:, None] * W[None] * excl).sum(-1), (gy[:, None] * (x[:, :, None] - 1) * excl).sum(0))
    got = run(F.nmu, x, W, gy, dtype, DEV)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        rtol, atol = testing.tolerances(dtype, I, grad=True)
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("unit", list(UNITS))
def test_cuda_ensemble_equals_members_and_deterministic(unit):
    x, W, gy = make(unit, 3, (16,), 40, 2)
    fused = UNITS[unit][1]
    first = run(fused, x, W, gy, torch.float32, DEV)
    again = run(fused, x, W, gy, torch.float32, DEV)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for e in range(3):
        member = run(fused, x[e], W[e], gy[e], torch.float32, DEV)
        for a, b in zip(first, member):
            torch.testing.assert_close(a[e], b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("unit", list(UNITS))
def test_cuda_empty_and_skipped_grad_x(unit):
    for shape in [(0, 4), (5, 0)]:
        x = torch.randn(*shape, device=DEV)
        W = torch.rand(shape[1], 3, device=DEV)
        y = getattr(ops, f"{unit}_forward")(x, W)
        torch.testing.assert_close(y, UNITS[unit][0](x, W))
        gx, gW = getattr(ops, f"{unit}_backward")(torch.randn_like(y), x, W, True)
        assert gx.shape == x.shape and gW.shape == W.shape and not gW.any()
    x, W, gy = make(unit, None, (6,), 4, 2)
    gx, gW = getattr(ops, f"{unit}_backward")(gy.to(DEV), x.to(DEV), W.to(DEV), False)
    assert gx.shape == (0,) and gW.shape == W.shape


def test_cuda_nmu_input_limit():
    from_ = torch.ones(2, 8193, device=DEV)
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nmu_forward: the CUDA kernel takes at most 8192 inputs"):
        ops.nmu_forward(from_, torch.ones(8193, 1, device=DEV))


@pytest.mark.skipif(EMULATION, reason="needs a real GPU (running on the CUDA emulator)")
def test_cuda_wrong_device():
    x = torch.randn(4, 3, device="cuda")
    for unit in UNITS:
        with pytest.raises(RuntimeError, match=f"nalu_cuda::{unit}_forward: argument 'W' must be on the device of 'x'"):
            getattr(ops, f"{unit}_forward")(x, torch.randn(3, 2))
