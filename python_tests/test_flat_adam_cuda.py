"""The CUDA kernel of FlatAdam's resident step (csrc/experiments/cuda/flat_adam_kernels.cu, the op
``nalu_cuda::flat_adam_step_resident``) against ``FlatAdam.step_resident``'s tensor ops.

Several steps of random gradients over several parameters (one of them grouped, ``(E * C, ...)``),
with a frozen member, a NaN in one member and an Inf in another, float32 and float64, both forms of
the moment's lerp (weight below and above 1/2), and members long enough that several blocks scan
each one for NaN/Inf: the buffers agree with the tensor ops to within a few roundings, the returned
flags and the zeroed gradients exactly, and the step count on the device is incremented.

As python_tests/test_cuda.py: on a GPU when one is visible and the kernel is built, or on the CPU
emulator (``NALU_CUDA_LIBRARY=<csrc/cuda/emulation/build.py's library> NALU_CUDA_TEST_EMULATION=1``,
device "cpu", the op called directly); the tests of FlatAdam's own routing and of CUDA-graph capture
need a real GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

import nalu_cuda
from nalu_cuda import _ops
from nalu_cuda.experiments.parts.optim import FlatAdam

EMULATION = os.environ.get("NALU_CUDA_TEST_EMULATION") == "1"
DEV = "cpu" if EMULATION else "cuda"

pytestmark = pytest.mark.skipif(
    not EMULATION and (not torch.cuda.is_available() or not _ops.has_kernel("cuda", "flat_adam_step_resident")),
    reason="needs a CUDA device and the CUDA kernels of nalu_cuda",
)
needs_gpu = pytest.mark.skipif(EMULATION, reason="needs a real GPU (running on the CUDA emulator)")

E = 4


def _params(dtype, long_members=False):
    """Parameters of an ensemble of E: (E, ...), a grouped (E * 2, ...) one, and a bias."""
    g = torch.Generator().manual_seed(1)
    shapes = [(E, 5, 3), (E * 2, 3), (E, 1)]
    if long_members:
        shapes.append((E, 9000))  # 9000 per member: several scan blocks per member
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype=dtype, device=DEV))
            for s in shapes]


def _pair(dtype, lr=0.01, betas=(0.9, 0.999), long_members=False):
    a = FlatAdam(_params(dtype, long_members), lr, betas, ensemble=E)
    b = FlatAdam(_params(dtype, long_members), lr, betas, ensemble=E)
    b.native_resident = False  # the tensor ops
    return a, b


def _kernel_step(opt: FlatAdam, frozen):
    """The kernel's step: through FlatAdam on a GPU; on the emulator (CPU tensors, where FlatAdam keeps
    its tensor ops) the op itself, with the segments FlatAdam would pass."""
    if not EMULATION:
        assert opt._resident_native(E) is not None, "FlatAdam did not take the CUDA kernel"
        return opt.step_resident(frozen)
    if opt._step_t is None:
        opt._step_t = torch.full((), float(opt.step_count), dtype=torch.float64)
    segs = torch.tensor([[off, k // E] for off, k, _ in opt._views], dtype=torch.long)
    return torch.ops.nalu_cuda.flat_adam_step_resident(opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq, segs,
                                                       frozen, opt._step_t, opt.lr, opt.beta1, opt.beta2, opt.eps)


def _set_grads(opts, step, dtype, poison):
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) for p in opts[0].params]
    for (param, member, value) in poison.get(step, ()):
        grads[param].view(E, -1)[member, -1] = value
    for opt in opts:
        opt.zero_grad()
        for p, gr in zip(opt.params, grads):
            p.grad.copy_(gr)


def _close(got, want, dtype, what):
    tiny = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=8 * tiny, atol=8 * tiny * float(want.abs().max().clamp(min=1e-3)),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.99)], ids=["lerp_small", "lerp_large"])
@pytest.mark.parametrize("long_members", [False, True], ids=["short", "long"])
def test_kernel_matches_tensor_ops(dtype, betas, long_members):
    a, b = _pair(dtype, betas=betas, long_members=long_members)
    frozen = torch.zeros(E, dtype=torch.bool, device=DEV)
    frozen[1] = True
    # step -> (parameter, member, value): a NaN in member 2, an Inf in member 0 (the last parameter,
    # with long members the last element of a member's last scan block), both at once.
    last = len(a.params) - 1
    poison = {2: [(0, 2, float("nan"))], 4: [(last, 0, float("inf"))],
              5: [(1, 3, float("-inf")), (2, 2, float("nan"))]}
    want_flags = {2: [2], 4: [0], 5: [2, 3]}
    for step in range(1, 7):
        _set_grads((a, b), step, dtype, poison)
        got = _kernel_step(a, frozen)
        want = b.step_resident(frozen)
        assert got.dtype == torch.bool and got.shape == (E,) and got.device == frozen.device
        assert torch.equal(got, want), f"step {step}: nonfinite {got} vs {want}"
        assert sorted(torch.nonzero(got).flatten().tolist()) == want_flags.get(step, [])
        assert torch.equal(a.grad, b.grad), f"step {step}: the zeroed gradients differ"
        assert float(a._step_t) == float(b._step_t) == step
        for name in ("flat", "exp_avg", "exp_avg_sq"):
            _close(getattr(a, name), getattr(b, name), dtype, f"step {step} {name}")
    # a frozen member never moved (it started with zero moments), the others did
    start = FlatAdam(_params(dtype, long_members), ensemble=E).flat
    moved = (a.flat != start).view(-1)
    for off, k, _ in a._views:
        rows = moved[off:off + k].view(E, -1)
        assert not rows[1].any() and rows[0].any() and rows[3].any()


def test_rows_of_frozen_and_nonfinite_members_get_zero_gradients():
    a, _ = _pair(torch.float64)
    _set_grads((a,), 1, torch.float64, {1: [(0, 3, float("nan"))]})
    before = a.grad.clone()
    frozen = torch.tensor([False, True, False, False], device=DEV)
    flags = _kernel_step(a, frozen)
    assert flags.tolist() == [False, False, False, True]
    for off, k, _ in a._views:
        got, was = a.grad[off:off + k].view(E, -1), before[off:off + k].view(E, -1)
        assert torch.equal(got[[0, 2]], was[[0, 2]])
        assert not got[[1, 3]].any()


def test_step_count_is_the_devices():
    a, b = _pair(torch.float32)
    a.step_count = b.step_count = 7  # e.g. resumed
    frozen = torch.zeros(E, dtype=torch.bool, device=DEV)
    for step in (8, 9):
        _set_grads((a, b), step, torch.float32, {})
        _kernel_step(a, frozen)
        b.step_resident(frozen)
        assert float(a._step_t) == step and a._step_t.dtype == torch.float64
        _close(a.flat, b.flat, torch.float32, f"step {step}")
    a.sync_step_count()
    assert a.step_count == 9


def _args(n=12, E_=3, dtype=torch.float32):
    f = lambda: torch.zeros(n, dtype=dtype, device=DEV)  # noqa: E731
    return dict(param=f(), grad=f(), exp_avg=f(), exp_avg_sq=f(),
                segments=torch.tensor([[0, n // E_]], dtype=torch.long, device=DEV),
                frozen=torch.zeros(E_, dtype=torch.bool, device=DEV),
                step_t=torch.zeros((), dtype=torch.float64, device=DEV), lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)


# each change is built when the test runs (DEV may be a CUDA device that a CPU machine lacks)
@pytest.mark.parametrize("change, message", [
    (lambda: dict(param=torch.zeros(12, dtype=torch.float16, device=DEV)),
     "argument 'param' must be a contiguous 1-D float32 or float64"),
    (lambda: dict(param=torch.zeros(12, 2, device=DEV)[:, 0]), "argument 'param' must be a contiguous 1-D"),
    (lambda: dict(grad=torch.zeros(11, device=DEV)), "argument 'grad' must be a contiguous Float tensor"),
    (lambda: dict(exp_avg=torch.zeros(12, dtype=torch.float64, device=DEV)), "argument 'exp_avg' must be"),
    (lambda: dict(exp_avg_sq=torch.zeros(24, device=DEV)[::2]), "got a non-contiguous"),
    (lambda: dict(frozen=torch.zeros(3, dtype=torch.uint8, device=DEV)),
     "argument 'frozen' must be a contiguous 1-D bool tensor"),
    (lambda: dict(frozen=torch.zeros(0, dtype=torch.bool, device=DEV)), "one flag per member (at least one)"),
    (lambda: dict(segments=torch.zeros(2, 3, dtype=torch.long, device=DEV)),
     "argument 'segments' must be a contiguous int64 tensor of shape (P, 2)"),
    (lambda: dict(segments=torch.zeros(2, 2, dtype=torch.int32, device=DEV)), "argument 'segments' must be"),
    (lambda: dict(step_t=torch.zeros((), dtype=torch.float32, device=DEV)),
     "argument 'step_t' must be a float64 tensor of one element"),
], ids=["param_dtype", "param_strided", "grad_size", "exp_avg_dtype", "exp_avg_sq_strided", "frozen_dtype",
        "no_members", "segments_shape", "segments_dtype", "step_dtype"])
def test_errors_name_the_argument(change, message):
    args = _args()
    args.update(change())  # built here, not at collection: without CUDA the module only skips
    with pytest.raises(RuntimeError, match="flat_adam_step_resident: ") as info:
        torch.ops.nalu_cuda.flat_adam_step_resident(**args)
    assert message in str(info.value)


@needs_gpu
def test_cpu_tensors_are_refused():
    # every tensor on the CPU: the dispatcher picks the op's error kernel (a CUDA one among them would
    # select the CUDA kernel, whose checks name the argument on the wrong device)
    args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in _args().items()}
    with pytest.raises(RuntimeError, match="argument 'param' must be a CUDA tensor, got a tensor on cpu"):
        torch.ops.nalu_cuda.flat_adam_step_resident(**args)


@needs_gpu
def test_a_tensor_on_another_device_is_named():
    args = _args()
    args.update(frozen=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"argument 'frozen' must be a contiguous 1-D bool tensor on cuda:0 "
                                           r"\(param's device\), got a Bool tensor on cpu"):
        torch.ops.nalu_cuda.flat_adam_step_resident(**args)


@needs_gpu
def test_flat_adam_takes_the_kernel_only_where_it_applies():
    assert FlatAdam(_params(torch.float32), ensemble=E)._resident_native(E) is not None
    assert FlatAdam(_params(torch.float32), ensemble=E, clip=1.0)._resident_native(E) is None
    per_member = [{"params": _params(torch.float32)[:1], "lr": [0.1, 0.2, 0.3, 0.4]}]
    assert FlatAdam(per_member, ensemble=E)._resident_native(E) is None
    assert FlatAdam(_params(torch.float16), ensemble=E)._resident_native(E) is None
    assert nalu_cuda._ops.has_kernel("cuda", "flat_adam_step_resident")


@needs_gpu
def test_cuda_graph_replays_the_kernel_step():
    a, b = _pair(torch.float32)
    frozen = torch.zeros(E, dtype=torch.bool, device=DEV)
    frozen[2] = True
    flags = torch.zeros(E, dtype=torch.bool, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps: the segments and the step count are made here
        for step in range(1, 3):
            _set_grads((a, b), step, torch.float32, {})
            flags.copy_(a.step_resident(frozen))
            b.step_resident(frozen)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flags.copy_(a.step_resident(frozen))
    for step in range(3, 6):
        _set_grads((a, b), step, torch.float32, {4: [(0, 0, float("nan"))]})
        graph.replay()
        want = b.step_resident(frozen)
        torch.cuda.synchronize()
        assert torch.equal(flags, want)
        assert float(a._step_t) == float(b._step_t) == step
        _close(a.flat, b.flat, torch.float32, f"replay {step}")
