"""The CUDA kernels of the NPU / RealNPU and iNALU (csrc/cuda/power_cuda*) against the reference.

* float32 / float64: fused values and every gradient against the float64 reference, with the
  tolerances of ``nalu_cuda.testing``.
* float16 / bfloat16 (float32 math): the fused result's error against a float64 reference from
  the same rounded inputs is at most twice the error of the reference run in that dtype, plus a
  floor of about one rounding of the largest value (as python_tests/test_cuda.py).
* float64 gradcheck, opcheck, ensembles, the sign product's chunked backward (many rows),
  determinism, and the errors for wrong devices and too many inputs.

Without a GPU, ``csrc/cuda/emulation/build.py`` builds these ops for the CPU on the CUDA emulator;
``NALU_CUDA_LIBRARY=<that library> NALU_CUDA_TEST_EMULATION=1`` runs this module on them.
"""
from __future__ import annotations

import os

import pytest
import torch

import nalu_cuda
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_input, rand_params, tolerances
from .conftest import shape_ids

EMULATION = os.environ.get("NALU_CUDA_TEST_EMULATION") == "1"
DEV = "cpu" if EMULATION else "cuda"

pytestmark = pytest.mark.skipif(
    not EMULATION and (not torch.cuda.is_available() or not nalu_cuda._ops.has_kernel("cuda", "npu_forward")),
    reason="needs a CUDA device and the CUDA kernels of nalu_cuda",
)
needs_gpu = pytest.mark.skipif(EMULATION, reason="needs a real GPU (running on the CUDA emulator)")

ops = torch.ops.nalu_cuda
LOW = (torch.float16, torch.bfloat16)
LOW_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

SHAPES = [
    (None, (128,), 100, 2),
    (None, (4, 37), 7, 3),
    (3, (50,), 20, 5),
    (None, (600,), 12, 2),  # the sign product's backward in 3 row chunks
    (2, (40,), 30, 20),
]
SHAPE_IDS = shape_ids(SHAPES)


def make(unit, E, batch, I, O, dtype=torch.float64):
    lead = () if E is None else (E,)
    x = rand_input(lead + tuple(batch) + (I,), dtype=dtype)
    if unit in ("npu", "real_npu"):
        W_r = rand_params(lead + (I, O), scale=0.5 / max(1.0, I / 20), dtype=dtype)
        g = torch.rand(lead + (I,), dtype=dtype) * 0.8 + 0.1
        W_i = None if unit == "real_npu" else rand_params(lead + (I, O), scale=0.3 / max(1.0, I / 20), dtype=dtype)
        return [x, W_r, W_i, g]
    ps = [rand_params(lead + (I, O), scale=s, dtype=dtype) for s in (0.5, 1.0, 0.5 / max(1.0, I / 20), 1.0)]
    return [x] + ps + [rand_params(lead + (O,), scale=0.5, dtype=dtype)]


def ref_fn(unit):
    return R.inalu if unit == "inalu" else R.npu


def fused(unit, args):
    if unit == "inalu":
        return ops.inalu_forward(*args, 1e-7, 20.0)[0]
    return ops.npu_forward(*args, 1e-7)[0]


def run(fn, args, gy=None):
    ins = [a.detach().clone().requires_grad_() if a is not None else None for a in args]
    y = fn(ins)
    if gy is None:
        gy = torch.randn_like(y)
    (y * gy).sum().backward()
    return y, [a.grad if a is not None else None for a in ins], gy


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("unit", ["npu", "real_npu", "inalu"])
def test_matches_reference(unit, shape, dtype):
    E, batch, I, O = shape
    args = [a.to(DEV) if a is not None else None for a in make(unit, E, batch, I, O, dtype)]
    y_f, g_f, gy = run(lambda t: fused(unit, t), args)
    y_r, g_r, _ = run(lambda t: ref_fn(unit)(*t), args, gy)
    rtol, atol = tolerances(dtype, I)
    torch.testing.assert_close(y_f, y_r, rtol=rtol, atol=atol)
    grtol, gatol = tolerances(dtype, I, grad=True)
    for k, (p, q) in enumerate(zip(g_f, g_r)):
        if q is not None:
            torch.testing.assert_close(p, q, rtol=grtol, atol=gatol, msg=lambda m: f"grad {k}: {m}")


@pytest.mark.parametrize("dtype", LOW, ids=["f16", "bf16"])
@pytest.mark.parametrize("unit", ["npu", "real_npu", "inalu"])
def test_low_precision_rule(unit, dtype):
    args64 = make(unit, 2, (64,), 10, 3)
    low = [a.to(dtype) if a is not None else None for a in args64]
    rounded = [a.double() if a is not None else None for a in low]  # the same rounded inputs
    gy = torch.randn(2, 64, 3, dtype=torch.float64)
    want, want_g, _ = run(lambda t: ref_fn(unit)(*t), rounded, gy)
    same, same_g, _ = run(lambda t: ref_fn(unit)(*t), [a.to(DEV) if a is not None else None for a in low],
                          gy.to(dtype).to(DEV))
    got, got_g, _ = run(lambda t: fused(unit, t), [a.to(DEV) if a is not None else None for a in low],
                        gy.to(dtype).to(DEV))
    floor = LOW_FLOOR[dtype]
    for f, r, w in [(got, same, want)] + list(zip(got_g, same_g, want_g)):
        if w is None:
            continue
        err = (f.double().cpu() - w).abs().max().item()
        ref_err = (r.double().cpu() - w).abs().max().item()
        assert err <= 2 * ref_err + floor * max(1.0, w.abs().max().item()), (err, ref_err)


@pytest.mark.parametrize("unit", ["npu", "real_npu", "inalu"])
def test_gradcheck(unit):
    args = [a.to(DEV).requires_grad_() if a is not None else None for a in make(unit, 2, (3,), 3, 2)]
    present = [a for a in args if a is not None]

    def fn(*t):
        it = iter(t)
        return fused(unit, [next(it) if a is not None else None for a in args])

    assert torch.autograd.gradcheck(fn, tuple(present), eps=1e-6, atol=1e-6)


def test_opcheck():
    for unit in ("npu", "real_npu", "inalu"):
        args = [a.to(DEV).requires_grad_() if a is not None else None for a in make(unit, 2, (5,), 4, 3)]
        if unit == "inalu":
            torch.library.opcheck(ops.inalu_forward, tuple(args) + (1e-7, 20.0))
        else:
            torch.library.opcheck(ops.npu_forward, tuple(args) + (1e-7,))


def test_deterministic_and_zero_factor():
    # Same bits twice, and an exactly zero factor (W_m = 1/2, x < 0) in the chunked backward.
    args = [a.to(DEV) for a in make("inalu", None, (700,), 6, 2, torch.float32)]
    args[0][:, 0] = -args[0][:, 0].abs()
    args[3][0, 0] = 0.5493061443340549  # atanh(1/2)
    args[4][0, 0] = 40.0
    a1 = run(lambda t: fused("inalu", t), args)
    a2 = run(lambda t: fused("inalu", t), args, a1[2])
    assert torch.equal(a1[0], a2[0]) and all(torch.equal(p, q) for p, q in zip(a1[1], a2[1]))
    assert torch.isfinite(a1[1][3]).all()


def test_errors():
    x = torch.randn(4, 3, device=DEV)
    with pytest.raises(RuntimeError, match=r"npu_forward: argument 'g' \(the relevance gate\) must have shape"):
        ops.npu_forward(x, torch.randn(3, 2, device=DEV), None, torch.rand(2, device=DEV), 1e-7)
    # too many inputs for the sign product's shared memory (float64: 48 KiB / (4 * 8 bytes))
    I = 1600
    x = rand_input((2, I)).to(DEV)
    W = torch.zeros(I, 1, dtype=torch.float64, device=DEV)
    G = torch.zeros(1, dtype=torch.float64, device=DEV)
    y, a, u, msv, lx = ops.inalu_forward(x, W, W, W, W, G, 1e-7, 20.0)
    with pytest.raises(RuntimeError, match=r"inalu_backward: the CUDA kernel takes at most 1536 inputs"):
        ops.inalu_backward(torch.ones_like(y), x, W, W, W, W, G, a, u, msv, lx, 1e-7, 20.0, True)


@needs_gpu
def test_wrong_device():
    x = torch.randn(4, 3, device="cuda")
    with pytest.raises(RuntimeError, match=r"npu_forward: argument 'W_r' must be on the device of 'x'"):
        ops.npu_forward(x, torch.randn(3, 2), None, torch.rand(3, device="cuda"), 1e-7)
