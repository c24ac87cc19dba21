"""Bad input gets a clear error naming the op, the argument, what was expected and what came."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nalu_cuda
from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_input, rand_params

ops = torch.ops.nalu_cuda


def p(*shape, dtype=torch.float32):
    return rand_params(shape, dtype=dtype)


def x_(*shape, dtype=torch.float32):
    return rand_input(shape, dtype=dtype)


CASES = [
    # (callable, expected message regex)
    (lambda: F.nac(x_(4, 3), p(3), p(3)),
     r"nalu_cuda::nac_forward: argument 'W_hat' must have shape \(in, out\) or \(E, in, out\), got \[3\]"),
    (lambda: F.nac(x_(4, 3), p(2, 3, 4, 5), p(2, 3, 4, 5)),
     r"nalu_cuda::nac_forward: argument 'W_hat' must have shape \(in, out\) or \(E, in, out\), got \[2, 3, 4, 5\]"),
    (lambda: F.nac(x_(4, 5), p(3, 2), p(3, 2)),
     r"nalu_cuda::nac_forward: argument 'x' must have shape \(\.\.\., in\) = \(\.\.\., 3\) to match 'W_hat' \[3, 2\], got \[4, 5\]"),
    (lambda: F.nac(x_(4, 3), p(3, 2), p(3, 1)),
     r"nalu_cuda::nac_forward: argument 'M_hat' must have the shape of 'W_hat' \[3, 2\], got \[3, 1\]"),
    (lambda: F.nac_mul(x_(5, 4, 3), p(4, 3, 2), p(4, 3, 2)),
     r"nalu_cuda::nac_mul_forward: argument 'x' must have shape \(E, \.\.\., in\) = \(4, \.\.\., 3\) to match ensemble weights 'W_hat' \[4, 3, 2\], got \[5, 4, 3\]"),
    (lambda: F.nac_mul(x_(3), p(4, 3, 2), p(4, 3, 2)),
     r"nalu_cuda::nac_mul_forward: argument 'x' must have shape \(E, \.\.\., in\)"),
    (lambda: F.nac(torch.ones(4, 3, dtype=torch.int64), p(3, 2), p(3, 2)),
     r"nalu_cuda::nac_forward: argument 'x' must be a floating-point tensor, got dtype Long"),
    (lambda: F.nac(x_(4, 3), p(3, 2, dtype=torch.float64), p(3, 2, dtype=torch.float64)),
     r"nalu_cuda::nac_forward: argument 'W_hat' must have the dtype of 'x' \(Float\), got Double"),
    (lambda: F.nac(x_(4, 3), p(3, 2), p(3, 2, dtype=torch.float64)),
     r"nalu_cuda::nac_forward: argument 'M_hat' must have the dtype of 'W_hat' \(Float\), got Double"),
    (lambda: F.nac(x_(4, 3, dtype=torch.float16), p(3, 2, dtype=torch.float16), p(3, 2, dtype=torch.float16)),
     r"nalu_cuda::nac_forward: the CPU kernel supports dtypes Float, Double, got Half"),
    (lambda: F.nac_mul(x_(4, 3), p(3, 2), p(3, 2), eps=0.0),
     r"nalu_cuda::nac_mul_forward: argument 'eps' must be a positive finite number, got 0"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), eps=-1.0),
     r"nalu_cuda::nalu_forward: argument 'eps' must be a positive finite number, got -1"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), eps=float("nan")),
     r"nalu_cuda::nalu_forward: argument 'eps' must be a positive finite number, got nan"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 3)),
     r"nalu_cuda::nalu_forward: argument 'G' of an input-dependent gate must have the shape of 'W_hat' \[3, 2\], got \[3, 3\]"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), gate="independent"),
     r"nalu_cuda::nalu_forward: argument 'G' of an input-independent gate must have shape \(out,\) = \[2\], got \[3, 2\]"),
    (lambda: F.nalu(x_(5, 4, 3), p(5, 3, 2), p(5, 3, 2), p(2), gate="independent"),
     r"nalu_cuda::nalu_forward: argument 'G' of an input-independent gate must have shape \(E, out\) = \[5, 2\], got \[2\]"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), None, p(3, 2)),
     r"nalu_cuda::nalu_forward: separate multiplicative weights need both 'W_hat_m' and 'M_hat_m', got only 'M_hat_m'"),
    (lambda: nalu_cuda.reference.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), p(3, 2), None),
     r"nalu_cuda.reference.nalu: give both 'W_hat_m' and 'M_hat_m'"),
    (lambda: ops.nalu_forward(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), None, p(3, 2), 1e-7, True),
     r"nalu_cuda::nalu_forward: separate multiplicative weights need both 'W_hat_m' and 'M_hat_m', got only 'W_hat_m'"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), p(3, 1), p(3, 1)),
     r"nalu_cuda::nalu_forward: argument 'W_hat_m' must have the shape of 'W_hat' \[3, 2\], got \[3, 1\]"),
    (lambda: F.nalu(x_(4, 3), p(3, 2), p(3, 2), p(3, 2), gate="sigmoid"),
     r"nalu_cuda.functional.nalu: argument 'gate' must be one of \('input', 'independent'\), got 'sigmoid'"),
    (lambda: F.nac_weight(p(3, 2), p(2, 3)),
     r"nalu_cuda::nac_weight: argument 'M_hat' must have the shape of 'W_hat' \[3, 2\], got \[2, 3\]"),
    (lambda: ops.nac_backward(torch.ones(4, 3), x_(4, 3), p(3, 2), p(3, 2), True),
     r"nalu_cuda::nac_backward: argument 'grad_y' must have shape \[4, 2\], got \[4, 3\]"),
    (lambda: ops.nac_mul_backward(torch.ones(4, 2), x_(4, 3), p(3, 2), p(3, 2), torch.ones(4, 2), torch.ones(4, 2), 1e-7, True),
     r"nalu_cuda::nac_mul_backward: argument 'lx' must have shape \[4, 3\], got \[4, 2\]"),
    (lambda: ops.nac_weight_backward(torch.ones(3, 3), p(3, 2), p(3, 2)),
     r"nalu_cuda::nac_weight_backward: argument 'grad_W' must have shape \[3, 2\], got \[3, 3\]"),
]


@pytest.mark.parametrize("fn,pattern", CASES, ids=[str(i) for i in range(len(CASES))])
def test_op_errors(fn, pattern):
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        fn()


MODULE_CASES = [
    (lambda: nalu_cuda.NALU(3, 2, gate="sigmoid"), r"nalu_cuda.NALU: argument 'gate' must be one of \('input', 'independent'\), got 'sigmoid'"),
    (lambda: nalu_cuda.NAC(3, 2, backend="cuda"), r"nalu_cuda.NAC: argument 'backend' must be one of \('auto', 'fused', 'reference'\), got 'cuda'"),
    (lambda: nalu_cuda.NACMul(3, 2, eps=0), r"nalu_cuda.NACMul: argument 'eps' must be a positive finite number, got 0"),
    (lambda: nalu_cuda.NACMul(3, 2, eps=True), r"nalu_cuda.NACMul: argument 'eps' must be a positive finite number, got True"),
    (lambda: nalu_cuda.NALU(3, 2, eps=True), r"nalu_cuda.NALU: argument 'eps' must be a positive finite number, got True"),
    (lambda: nalu_cuda.NALU(0, 2), r"nalu_cuda.NALU: argument 'in_features' must be a positive int, got 0"),
    (lambda: nalu_cuda.NAC(3, 2.5), r"nalu_cuda.NAC: argument 'out_features' must be a positive int, got 2.5"),
    (lambda: nalu_cuda.NAC(3, 2, ensemble=0), r"nalu_cuda.NAC: argument 'ensemble' must be a positive int, got 0"),
    (lambda: nalu_cuda.NALU(3, 2, tied="yes"), r"nalu_cuda.NALU: argument 'tied' must be a bool, got 'yes'"),
    (lambda: nalu_cuda.NALU(3, 2)(x_(4, 5)), r"nalu_cuda::nalu_forward: argument 'x' must have shape \(\.\.\., in\) = \(\.\.\., 3\)"),
    (lambda: nalu_cuda.NALU(3, 2, ensemble=4)(x_(3, 5, 3)), r"to match ensemble weights 'W_hat' \[4, 3, 2\], got \[3, 5, 3\]"),
]


@pytest.mark.parametrize("fn,pattern", MODULE_CASES, ids=[str(i) for i in range(len(MODULE_CASES))])
def test_module_errors(fn, pattern):
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        fn()


def test_fake_kernels_give_the_same_errors():
    # torch.compile runs the Python fakes first: they must reject bad input the same way.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(RuntimeError, match=r"nalu_cuda::nac_forward: argument 'x' must have shape \(\.\.\., in\) = \(\.\.\., 3\)"):
            ops.nac_forward(torch.empty(4, 5), torch.empty(3, 2), torch.empty(3, 2))
        with pytest.raises(RuntimeError, match=r"nalu_cuda::nalu_forward: argument 'eps' must be a positive finite number"):
            ops.nalu_forward(torch.empty(4, 3), torch.empty(3, 2), torch.empty(3, 2), None, None, torch.empty(3, 2), 0.0, True)
        y, a, m, g, lx, _r = ops.nalu_forward(torch.empty(7, 4, 3), torch.empty(7, 3, 2), torch.empty(7, 3, 2), None, None,
                                          torch.empty(7, 2), 1e-7, False)
        assert y.shape == (7, 4, 2) and g.shape == (7, 2) and lx.shape == (7, 4, 3)


def test_mixed_devices_are_rejected():
    # "meta" stands in for a second device on machines without a GPU (test_cuda.py covers cuda).
    x = x_(4, 3)
    W, M = p(3, 2).to("meta"), p(3, 2).to("meta")
    with pytest.raises(RuntimeError, match=r"nalu_cuda::nac_forward: argument 'W_hat' must be on the device of 'x' \(cpu\), got meta"):
        ops.nac_forward(x, W, M)
    with pytest.raises(RuntimeError, match=r"argument 'G' must be on the device of 'x' \(cpu\), got meta"):
        ops.nalu_forward(x, p(3, 2), p(3, 2), None, None, p(3, 2).to("meta"), 1e-7, True)


@pytest.mark.parametrize("backend", ["auto", "reference", "fused"])
@pytest.mark.parametrize("layer", ["NAC", "NACMul", "NALU"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32],
                         ids=["f16", "bf16", "f64", "i64", "i32"])
def test_input_dtype_other_than_the_parameters_is_named(dtype, layer, backend):
    module = getattr(nalu_cuda, layer)(3, 2, backend=backend)  # float32 parameters
    x = torch.ones(4, 3, dtype=dtype)
    if dtype.is_floating_point:
        pattern = (rf"nalu_cuda.{layer}: argument 'x' must have the dtype of the layer's parameters "
                   rf"\(torch.float32\), got {dtype}")
    else:
        pattern = rf"nalu_cuda.{layer}: argument 'x' must be a floating-point tensor, got dtype {dtype}"
    with pytest.raises(ValueError, match=pattern):
        module(x)


def test_autocast_still_takes_low_precision_inputs():
    x = rand_input((4, 3)).bfloat16()
    for layer in ("NAC", "NACMul", "NALU"):
        module = getattr(nalu_cuda, layer)(3, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        assert y.shape == (4, 2) and torch.isfinite(y).all()


@pytest.mark.parametrize("layer", ["NACMul", "NALU", "NPU", "RealNPU", "INALU"])
def test_eps_of_any_real_number_type(layer):
    np = pytest.importorskip("numpy")
    x = x_(4, 3)
    want = getattr(nalu_cuda, layer)(3, 2, eps=1e-7)
    for eps in (np.float32(1e-7), np.float64(1e-7), 1e-7):
        got = getattr(nalu_cuda, layer)(3, 2, eps=eps)
        got.load_state_dict(want.state_dict())
        assert isinstance(got.eps, float) and got.eps == float(eps)
        torch.testing.assert_close(got(x), want(x), rtol=1e-6, atol=1e-6)
    assert getattr(nalu_cuda, layer)(3, 2, eps=1).eps == 1.0
    assert getattr(nalu_cuda, layer)(3, 2, eps=1e-50, dtype=torch.float64).eps == 1e-50
    for bad in (True, np.bool_(True), float("inf"), float("nan"), -1e-7, np.float32("nan"), "1e-7", None):
        with pytest.raises(ValueError, match=rf"nalu_cuda.{layer}: argument 'eps' must be a positive finite number"):
            getattr(nalu_cuda, layer)(3, 2, eps=bad)


EPS_OPS = {  # name: (fused op, reference, the other arguments after x)
    "nac_mul": (F.nac_mul, R.nac_mul, lambda dt: (p(3, 2, dtype=dt), p(3, 2, dtype=dt))),
    "nalu": (F.nalu, R.nalu, lambda dt: (p(3, 2, dtype=dt), p(3, 2, dtype=dt), p(3, 2, dtype=dt))),
    "npu": (F.npu, R.npu, lambda dt: (p(3, 2, dtype=dt), p(3, 2, dtype=dt), torch.full((3,), 0.5, dtype=dt))),
    "inalu": (F.inalu, R.inalu, lambda dt: (*(p(3, 2, dtype=dt) for _ in range(4)), torch.zeros(2, dtype=dt))),
}


@pytest.mark.parametrize("op", list(EPS_OPS))
@pytest.mark.parametrize("eps,there", [(1e-50, "0"), (1e39, "inf")])
def test_eps_is_checked_in_the_precision_it_is_used_in(op, eps, there):
    # A float64 eps that float32 rounds to 0 (or inf) is refused by both paths for float32 and
    # float16/bfloat16 inputs (computed in float32), and taken as it is for float64.
    fused, ref, rest = EPS_OPS[op]
    x = torch.tensor([[0.0, 1.5, 2.0]])
    pattern = (rf"argument 'eps' must be a positive finite number in float32 \(the precision the op computes in "
               rf"for tensors of dtype float32\), got {re.escape(repr(eps))}, which is {there} there")
    with pytest.raises(RuntimeError, match=rf"nalu_cuda::{op}_forward: " + pattern):
        fused(x, *rest(torch.float32), eps=eps)
    with pytest.raises(ValueError, match=rf"nalu_cuda.reference.{op}: " + pattern):
        ref(x, *rest(torch.float32), eps=eps)
    if eps < 1:  # float64: 1e-50 is a positive normal number there
        args = rest(torch.float64)
        torch.testing.assert_close(fused(x.double(), *args, eps=eps), ref(x.double(), *args, eps=eps))


def test_tiny_eps_gives_finite_input_gradients_at_zero_in_float64():
    x = torch.tensor([[0.0, 1.5, 2.0]], dtype=torch.float64, requires_grad=True)
    W, M, G = (p(3, 2, dtype=torch.float64) for _ in range(3))
    F.nalu(x, W, M, G, eps=1e-50).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad[0, 0] != 0  # the additive path's gradient at x = 0


def test_omega_is_checked_in_the_precision_it_is_used_in():
    x, args = x_(4, 3), EPS_OPS["inalu"][2](torch.float32)
    with pytest.raises(RuntimeError, match=r"nalu_cuda::inalu_forward: argument 'omega' must be a finite number in "
                                           r"float32 .*got 1e\+39, which is inf there"):
        F.inalu(x, *args, omega=1e39)
    with pytest.raises(ValueError, match=r"nalu_cuda.INALU: argument 'omega' must be a finite number in float32"):
        nalu_cuda.INALU(3, 2, omega=-1e39)


def test_reference_gate_bias_with_an_empty_ensemble():
    W, M, G = (torch.zeros(0, 3, 2) for _ in range(3))
    y = R.nalu(torch.zeros(0, 4, 3), W, M, G, G_bias=torch.zeros(0, 2))
    assert y.shape == (0, 4, 2)


@pytest.mark.parametrize("layer", ["NAC", "NACMul", "NALU"])
def test_torch_jit_script_gives_a_clear_error(layer):
    module = getattr(nalu_cuda, layer)(3, 2)
    message = rf"nalu_cuda.{layer}: torch.jit.script is not supported .* use torch.compile or torch.export"
    with pytest.raises(RuntimeError, match=message):
        torch.jit.script(module)
    with pytest.raises(RuntimeError, match=message):  # inside a container too
        torch.jit.script(torch.nn.Sequential(torch.nn.Identity(), module))
    # the alternatives the message names work
    x = x_(4, 3)
    traced = torch.jit.trace(module, (x,))
    torch.testing.assert_close(traced(x), module(x))
    exported = torch.export.export(module, (x,))
    torch.testing.assert_close(exported.module()(x), module(x))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_setup_refuses_a_compiler_whose_libraries_carry_libstdcxx(tmp_path):
    """setup.py's compiler check: a g++ that links libstdc++ statically into shared libraries (an
    extension built so crashes in its first error message, beside torch's libstdc++) is refused
    before the build, naming the compiler and the remedy; the plain g++ passes."""
    root = Path(__file__).resolve().parents[1]
    wrapper = tmp_path / "g++"
    wrapper.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    for cxx, refused in ((str(wrapper), True), ("g++", False)):
        r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, capture_output=True, text=True,
                           env={**os.environ, "CXX": cxx})
        if refused:
            assert r.returncode != 0
            assert f"the C++ compiler '{cxx}'" in r.stderr and "own copy of libstdc++" in r.stderr
            assert "CXX=/usr/bin/g++ CC=/usr/bin/gcc" in r.stderr
        else:
            assert r.returncode == 0, r.stderr[-2000:]
            assert r.stdout.strip().splitlines()[-1] == "nalu_cuda"
