"""The static task's gradient step on CUDA (``nalu_cuda::static_ensemble_grad``'s CUDA kernel,
``csrc/experiments/cuda/ensemble_step_kernels.cu``) against autograd through the pure-PyTorch
reference (:mod:`nalu_cuda.reference`) of the same two-layer ensemble model and objective, for the
three models it implements (NAC+ -> NAC+, NALU -> NALU, NAU -> NMU with Madsen's sparsity
regulariser), float32 and float64: each member's MSE, the gradient written over the flat buffer,
the divergence flags (a member flagged before takes a zero gradient; a member whose objective is
not finite is flagged), the same bits on a second call, and the argument checks.

As python_tests/test_cuda.py: on a GPU when one is visible and the kernel is built, or on the CPU
emulator (``NALU_CUDA_LIBRARY=<csrc/emulation/build.py's library> NALU_CUDA_TEST_EMULATION=1``,
device "cpu", the op called directly). The test of the trainer's native resident step (the kernel,
FlatAdam's resident step and the projection, captured as one CUDA graph) against its autograd
resident step needs a real GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

from nalu_cuda import _ops
from nalu_cuda import reference as ref
from nalu_cuda import regularizers as R

EMULATION = os.environ.get("NALU_CUDA_TEST_EMULATION") == "1"
DEV = "cpu" if EMULATION else "cuda"

pytestmark = pytest.mark.skipif(
    not EMULATION and (not torch.cuda.is_available() or not _ops.has_kernel("cuda", "static_ensemble_grad")),
    reason="needs a CUDA device and the CUDA kernels of nalu_cuda",
)
needs_gpu = pytest.mark.skipif(EMULATION, reason="needs a real GPU (running on the CUDA emulator)")

E, B, I, H = 4, 40, 37, 3  # I > 32: a warp's lanes take several inputs each; B * H > the block's warps
EPS = 1e-7
MODELS = ("nac", "nalu", "nmu")
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def _params(name, dtype, seed=0):
    """Each model's parameters in its layers' order, (E, In, Out), weights scaled so that exp()
    stays finite; the NAU's W partly outside [-1, 1] (its clamp passes no gradient there)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    if name == "nac":
        return [rnd(E, I, H, scale=0.7), rnd(E, I, H, scale=0.7), rnd(E, H, 1, scale=0.7), rnd(E, H, 1, scale=0.7)]
    if name == "nalu":
        return [rnd(E, I, H, scale=0.3), rnd(E, I, H, scale=0.3), rnd(E, I, H, scale=0.2),
                rnd(E, H, 1, scale=0.5), rnd(E, H, 1, scale=0.5), rnd(E, H, 1, scale=0.3)]
    w1 = (torch.rand(E, I, H, generator=g, dtype=torch.float64) * 2.4 - 1.2).to(dtype)
    w2 = (torch.rand(E, H, 1, generator=g, dtype=torch.float64)).to(dtype)
    return [w1, w2]


def _forward(name, ps, x):
    if name == "nac":
        return ref.nac(ref.nac(x, ps[0], ps[1]), ps[2], ps[3])
    if name == "nalu":
        return ref.nalu(ref.nalu(x, ps[0], ps[1], ps[2], eps=EPS), ps[3], ps[4], ps[5], eps=EPS)
    return ref.nmu(ref.nau(x, ps[0]), ps[1])


def _batch(dtype, seed=1):
    """|x| in [0.5, 1.5] with random signs (away from 0 for the log path), random targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(E, B, I, generator=g, dtype=torch.float64) + 0.5
    x = x * torch.where(torch.rand(E, B, I, generator=g) < 0.3, -1.0, 1.0).double()
    t = torch.randn(E, B, 1, generator=g, dtype=torch.float64)
    return x.to(dtype), t.to(dtype)


def _flat(ps):
    flat = torch.cat([p.reshape(-1) for p in ps])
    rows, off = [], 0
    for p in ps:
        rows.append([off, p.numel() // p.shape[0]])
        off += p.numel()
    return flat, torch.tensor(rows, dtype=torch.long)


def _flat_n(ps):
    """_flat's buffer on the device (segments stay on the host)."""
    flat, segments = _flat(ps)
    return flat.to(DEV), segments


def _reference(name, ps, x, t, weight, diverged):
    """Autograd through the reference: (loss (E,), the flat gradient, the flags after the step)."""
    leaves = [p.detach().clone().requires_grad_(True) for p in ps]
    loss = (_forward(name, leaves, x) - t).reshape(E, -1).pow(2).mean(1)
    objective = loss
    if weight:
        objective = loss + weight * (R.nau_sparsity(leaves[0], True) + R.nmu_sparsity(leaves[1], True))
    diverged = diverged | ~torch.isfinite(objective.detach())
    torch.where(diverged, torch.zeros_like(objective), objective).sum().backward()
    return loss.detach(), torch.cat([p.grad.reshape(-1) for p in leaves]), diverged


def _call(name, ps, x, t, weight, diverged):
    flat, segments = _flat(ps)
    grad = torch.full_like(flat, float("nan"), device=DEV)
    flags = diverged.clone().to(DEV)
    loss = torch.ops.nalu_cuda.static_ensemble_grad(x.to(DEV), t.to(DEV), flat.to(DEV), grad, segments, flags, name,
                                                    EPS, weight)
    return loss.cpu(), grad.cpu(), flags.cpu()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", MODELS)
def test_gradient_matches_reference(name, dtype):
    ps = _params(name, dtype)
    x, t = _batch(dtype)
    weight = 0.7 if name == "nmu" else 0.0
    diverged = torch.zeros(E, dtype=torch.bool)
    diverged[2] = True  # a member diverged before: zero gradient, its loss still reported
    want_loss, want_grad, want_flags = _reference(name, ps, x, t, weight, diverged)
    loss, grad, flags = _call(name, ps, x, t, weight, diverged)
    assert torch.equal(flags, want_flags)
    if dtype == torch.float64:
        torch.testing.assert_close(loss, want_loss, **TOL[dtype])
        torch.testing.assert_close(grad, want_grad, **TOL[dtype])
    else:
        # float32 against the float64 truth, within 8 times the float32 reference's own error: the
        # NALU's second layer divides by |h|, first-layer outputs that are sums cancelling to near 0,
        # so that two correct float32 summation orders differ by up to 3e-4 of the gradient's largest
        # element (measured: 1.5e-4 between the reference and the kernel on an H200, 7e-5 on the CPU,
        # where the reference itself is 2.7e-5 off); a wrong term is off by the gradient's own size.
        ps64 = [p.double() for p in ps]
        truth_loss, truth_grad, _ = _reference(name, ps64, x.double(), t.double(), weight, diverged)
        for got, want, truth in ((loss, want_loss, truth_loss), (grad, want_grad, truth_grad)):
            bound = 8 * (want.double() - truth).abs().max().item() + TOL[dtype]["atol"]
            assert (got.double() - truth).abs().max().item() <= bound
    assert grad.abs().sum() > 0 and not grad.isnan().any()
    _, segments = _flat(ps)
    off, per = segments[0].tolist()
    assert torch.all(grad[off + 2 * per: off + 3 * per] == 0)  # the diverged member's first parameter


@pytest.mark.parametrize("name", MODELS)
def test_same_bits_on_every_call(name):
    ps = _params(name, torch.float32, seed=5)
    x, t = _batch(torch.float32, seed=6)
    none = torch.zeros(E, dtype=torch.bool)
    weight = 0.3 if name == "nmu" else 0.0
    first, second = _call(name, ps, x, t, weight, none), _call(name, ps, x, t, weight, none)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ("nac", "nalu"))
def test_a_nonfinite_member_is_flagged_and_the_others_are_not_touched(name):
    dtype = torch.float64
    ps = _params(name, dtype, seed=2)
    x, t = _batch(dtype, seed=3)
    x[1, 0, 0] = float("inf")
    none = torch.zeros(E, dtype=torch.bool)
    want_loss, want_grad, want_flags = _reference(name, ps, x, t, 0.0, none)
    loss, grad, flags = _call(name, ps, x, t, 0.0, none)
    assert flags.tolist() == [False, True, False, False] == want_flags.tolist()
    assert not torch.isfinite(loss[1])
    _, segments = _flat(ps)
    for off, per in segments.tolist():  # the healthy members as the reference
        for e in (0, 2, 3):
            torch.testing.assert_close(grad[off + e * per: off + (e + 1) * per],
                                       want_grad[off + e * per: off + (e + 1) * per], **TOL[dtype])
    torch.testing.assert_close(loss[[0, 2, 3]], want_loss[[0, 2, 3]], **TOL[dtype])


# -- the batch drawn in the kernel (static_ensemble_grad_counter) ---------------------------------------------


def _counter_case(ops, lo, hi, step, name="nalu", S=3, seed=11):
    """A CounterStream over S seeds (subset masks, ``ops``) and a model of S * len(ops) members."""
    from nalu_cuda.experiments.parts.arithmetic_data import Range, subset_layout
    from nalu_cuda.experiments.parts.counter_stream import CounterStream

    masks = torch.stack([subset_layout(s, I, 0.25, 0.5).mask() for s in range(S)]).double()
    stream = CounterStream(list(range(seed, seed + S)), (B, I), Range(((lo, hi),)), device=DEV, masks=masks, ops=ops)
    g = torch.Generator().manual_seed(seed)
    E_ = S * len(ops)
    shapes = {"nac": [(I, H)] * 2 + [(H, 1)] * 2, "nalu": [(I, H)] * 3 + [(H, 1)] * 3}[name]
    ps = [(torch.randn(E_, *sh, generator=g, dtype=torch.float64) * 0.3).float() for sh in shapes]
    return stream, ps, torch.tensor(step, dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("name", ("nac", "nalu"))
@pytest.mark.parametrize("ops,lo,hi,step", [(("add",), 1.0, 2.0, 5), (("add", "mul", "div"), -3.0, 5.0, 7 + 2 ** 33)])
def test_drawn_batch_is_the_counter_streams_to_the_bit(name, ops, lo, hi, step):
    """The kernel that draws its batch gives the same bits as the kernel fed with CounterStream.draw's
    inputs and targets (the same values, the same sums in the same order)."""
    from nalu_cuda.experiments.parts.uniform_stream import TARGET_OP_CODES

    stream, ps, step_t = _counter_case(ops, lo, hi, step, name)
    flat, segments = _flat_n(ps)
    x, t = stream.draw(step_t)
    E_ = len(ops) * x.shape[0]
    x = x.repeat(len(ops), 1, 1).contiguous()
    flags = torch.zeros(E_, dtype=torch.bool, device=DEV)
    want_grad = torch.full_like(flat, float("nan"))
    want_flags = flags.clone()
    want = torch.ops.nalu_cuda.static_ensemble_grad(x, t, flat, want_grad, segments, want_flags, name, EPS, 0.0)
    grad = torch.full_like(flat, float("nan"))
    got = torch.ops.nalu_cuda.static_ensemble_grad_counter(
        stream.keys, step_t, stream.masks, [TARGET_OP_CODES.index(op) for op in ops], lo, hi, B, flat, grad, segments,
        flags, name, EPS, 0.0)
    assert torch.equal(got, want) and torch.equal(grad, want_grad) and torch.equal(flags, want_flags)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_drawn_batch_arguments_are_checked():
    stream, ps, step_t = _counter_case(("add",), 1.0, 2.0, 1)
    flat, segments = _flat_n(ps)
    op = torch.ops.nalu_cuda.static_ensemble_grad_counter
    args = dict(keys=stream.keys, step=step_t, masks=stream.masks, ops=[0], lo=1.0, hi=2.0, batch=B, param=flat,
                grad=torch.zeros_like(flat), segments=segments, diverged=torch.zeros(3, dtype=torch.bool, device=DEV),
                model="nalu", eps=EPS, reg_weight=0.0)
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad_counter: argument 'ops' must list operation codes"):
        op(**{**args, "ops": [9]})
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad_counter: arguments 'lo' and 'hi' must be finite"):
        op(**{**args, "hi": 1.0})
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad_counter: argument 'masks' must be .* float64"):
        op(**{**args, "masks": stream.masks.float()})
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad_counter: argument 'param' must be .* float32"):
        op(**{**args, "param": flat.double(), "grad": flat.double()})


def test_bad_arguments_name_the_op_and_the_argument():
    ps = _params("nalu", torch.float32)
    x, t = _batch(torch.float32)
    flat, segments = _flat(ps)
    flat, x, t = flat.to(DEV), x.to(DEV), t.to(DEV)
    grad = torch.zeros_like(flat)
    flags = torch.zeros(E, dtype=torch.bool, device=DEV)
    op = torch.ops.nalu_cuda.static_ensemble_grad
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'target' must be .* of shape \[4, 40, 1\]"):
        op(x, t[:, :-1], flat, grad, segments, flags, "nalu", EPS, 0.0)
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'grad' must be .* got a Double"):
        op(x, t, flat, grad.double(), segments, flags, "nalu", EPS, 0.0)
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'model' must be one of 'nac'"):
        op(x, t, flat, grad, segments, flags, "mlp", EPS, 0.0)
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'segments' row 1 must be"):
        bad = segments.clone()
        bad[1, 1] += 1
        op(x, t, flat, grad, bad, flags, "nalu", EPS, 0.0)
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'reg_weight' must be 0"):
        op(x, t, flat, grad, segments, flags, "nalu", EPS, 0.5)


@needs_gpu
def test_segments_on_the_gpu_are_refused():
    ps = _params("nac", torch.float32)
    x, t = _batch(torch.float32)
    flat, segments = _flat(ps)
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'segments' must be a contiguous int64 CPU"):
        torch.ops.nalu_cuda.static_ensemble_grad(x.cuda(), t.cuda(), flat.cuda(), torch.zeros_like(flat).cuda(),
                                                 segments.cuda(), torch.zeros(E, dtype=torch.bool, device="cuda"),
                                                 "nac", EPS, 0.0)


# graph=True needs a real GPU; on the emulator the trainer's native resident step runs on "cpu",
# the device whose kernels the emulator's library supplies.
GRAPHS = [False] if EMULATION else [False, True]


@pytest.fixture
def resident_native_here(monkeypatch):
    if EMULATION:
        from nalu_cuda.experiments.parts import native_step
        monkeypatch.setattr(native_step, "RESIDENT_NATIVE_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("name", MODELS)
def test_trainer_native_resident_step_matches_autograd(name, graph, resident_native_here):
    """train_ensemble(resident=True, native=True) takes the kernel ("resident-native") and ends where
    the autograd resident step ends, from the same start on the same batches, in float64. (Trajectories
    are compared over 20 steps at lr 1e-3: the NALU's 1/|h| near a cancelling first-layer output makes
    one member's trajectory amplify the two paths' last-bit differences about 100 times every 10 steps,
    to 1e-2 after 30 steps at lr 1e-2 in float64, which would measure chaos, not the kernel.)"""
    from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators, training_hooks
    from nalu_cuda.experiments.parts.training import (DataOptions, EnsembleTraining, EvalOptions, EvalSet,
                                                      OptimOptions, StepOptions, TrainOptions, UnitHooks)

    steps = 20
    xs = torch.rand(steps + 2, E, B, I, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.5
    xs = xs.to(DEV)
    ts = (xs[..., :1] + xs[..., 1:2]).contiguous()

    def batch_fn(k):  # k: the step on the device (a graph replays the same index_select)
        k = k.reshape(1)
        return xs.index_select(0, k)[0], ts.index_select(0, k)[0]

    def train(native):
        model = build_static_model(name, I, H, ensemble=E)
        model.reset_parameters(member_generators(list(range(E))))
        model.to(DEV).double()
        hooks = training_hooks(model) if name == "nmu" else {}
        if graph:  # (a graph freezes host-side schedules: the trainer refuses a regulariser there)
            hooks.pop("regularizer", None)
        val = EvalSet("valid", xs[0, 0, :8], torch.zeros(E, 8, 1, device=DEV, dtype=torch.float64))
        options = TrainOptions(data=DataOptions(batch_fn=batch_fn), evaluation=EvalOptions(val=val, eval_every=steps),
                               optim=OptimOptions(lr=1e-3), units=UnitHooks(**hooks),
                               step=StepOptions(resident=True, graph=graph, native=native))
        training = EnsembleTraining(model, E, steps, options)
        training.run()
        return training, [p.detach().cpu() for p in model.parameters()]

    native, got = train(True)
    autograd, want = train(False)
    assert native.step_path == "resident-native" and autograd.step_path == "resident"
    assert all(p.dtype == torch.float64 for p in got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert torch.equal(native.diverged.cpu(), autograd.diverged.cpu())


@pytest.mark.parametrize("graph", GRAPHS)
def test_trainer_counter_stream_drawn_in_the_kernel(graph, resident_native_here):
    """With batch_fn naming its CounterStream (as the static task's resident step does), the native
    resident step draws in the kernel, and trains to the bit as the native step fed the stream's draws
    (float32, the stream's dtype; the native step against autograd: the float64 test above). The
    stream is made for the device named "cuda", the parameters live on "cuda:0": the same device."""
    from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators
    from nalu_cuda.experiments.parts.training import (DataOptions, EnsembleTraining, EvalOptions, EvalSet,
                                                      OptimOptions, StepOptions, TrainOptions)

    ops, steps = ("add", "sub"), 40
    stream, _, _ = _counter_case(ops, 1.0, 2.0, 1, S=E // 2)

    def train(drawn):
        def batch_fn(k):
            x, t = stream.draw(k)
            return x.repeat(len(ops), 1, 1), t

        if drawn:
            batch_fn.counter_stream = stream
        model = build_static_model("nalu", I, H, ensemble=E)
        model.reset_parameters(member_generators(list(range(E))))
        model.to(DEV if EMULATION else "cuda:0")
        xv = torch.rand(8, I, generator=torch.Generator().manual_seed(3)).to(DEV) + 1
        val = EvalSet("valid", xv, torch.zeros(E, 8, 1, device=DEV))
        options = TrainOptions(data=DataOptions(batch_fn=batch_fn), evaluation=EvalOptions(val=val, eval_every=steps),
                               optim=OptimOptions(lr=1e-2), step=StepOptions(resident=True, graph=graph, native=True))
        training = EnsembleTraining(model, E, steps, options)
        result = training.run()
        assert training.batch_in_kernel == result.batch_in_kernel == drawn  # drawn in the kernel, or fed
        return training, [p.detach().cpu() for p in model.parameters()]

    drawn, got = train(True)
    fed, want = train(False)
    assert drawn.step_path == fed.step_path == "resident-native"
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(drawn.diverged.cpu(), fed.diverged.cpu())
