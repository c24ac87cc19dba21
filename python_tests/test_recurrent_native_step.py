"""The recurrent task's native training step (``nalu_cuda::recurrent_ensemble_step``, one call per
step, ``csrc/experiments/cpu/recurrent_step.cpp``) against the autograd step it replaces
(``EnsembleTraining.eager_step``, the reference), for the models it implements: RecurrentNet 'nac'
(NAC+ cell, NAC+ output) and 'nalu' (NALU cell and output: tied weights, input gate).

Tolerances, after ``STEPS`` Adam steps (lr 1e-3) from the same start on the same batches: float64
1e-10 (absolute, on parameters of order 1), float32 ``F32_ATOL``, as ``test_native_step.py`` and for
the same reason (the two paths sum in different orders; Adam's normalised update turns a rounding
difference of a gradient element near 0 into a difference of up to ``lr`` per step in that
parameter, which bounds it)."""
import contextlib
import math

import pytest
import torch

from nalu_cuda import _ops
from nalu_cuda.experiments.parts.arithmetic_models import build_recurrent_model, member_generators
from nalu_cuda.experiments.parts.native_step import RECURRENT_NATIVE_MODELS
from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.parts.training import (DataOptions, EnsembleTraining, EvalOptions, EvalSet, OptimOptions,
                                                  StepOptions, TrainOptions)

from .test_native_step import F32_ATOL, assert_in_call_draw_matches_the_stream, assert_trainings_match

pytestmark = pytest.mark.skipif(not _ops.has_kernel("cpu", "recurrent_ensemble_step"),
                                reason="nalu_cuda built without the recurrent step's CPU kernels")

I, H, STEPS = 4, 2, 12
MODELS = tuple(RECURRENT_NATIVE_MODELS)
SHAPES = [(5, 16, 10), (3, 7, 1), (2, 33, 4), (2, 1, 3)]  # (E, B, T): B a multiple of the lane width, not, 1


def _batches(dtype, E, B, T, steps=STEPS, seed=0, bad=None, inputs=I):
    """Fresh random inputs every step, |x| in [0.5, 1.5] with random signs (away from 0 for the log
    path), targets the sums over time of inputs 0 and 1 (a + b) per member; ``bad=(step, member,
    value)`` puts ``value`` into that member's first input of that step."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(1, steps + 1):
        x = torch.rand(E, B, T, inputs, generator=g, dtype=torch.float64) + 0.5
        x = x * torch.where(torch.rand(E, B, T, inputs, generator=g) < 0.3, -1.0, 1.0).double()
        t = (x[..., 0] + x[..., 1]).sum(-1, keepdim=True)
        if bad is not None and k == bad[0]:
            x[bad[1], 0, 0, 0] = bad[2]
        out[k] = (x.to(dtype), t.to(dtype))
    return out


def _model(name, dtype, E, seed=0, inputs=I, **kw):
    """The task's model, its weights drawn per member and h0 (zero at initialisation) drawn in
    [0.5, 1] so that the NALU's log path sees no zero state."""
    model = build_recurrent_model(name, inputs, H, ensemble=E, **kw)
    model.reset_parameters(member_generators(list(range(seed, seed + E))))
    with torch.no_grad():
        model.h0.copy_(torch.rand(model.h0.shape, generator=torch.Generator().manual_seed(seed + 7)) * 0.5 + 0.5)
    return model.to(dtype)


def _train(model, batches, native, E, *, eval_every=1000, steps=STEPS, clip=None, lr=1e-3):
    dtype = next(model.parameters()).dtype
    T = batches[1][0].shape[2]
    xv = torch.rand(8, T, I, dtype=dtype) + 1
    val = EvalSet("valid", xv, torch.zeros(E, 8, 1, dtype=dtype), shared=True)
    options = TrainOptions(data=DataOptions(batch_fn=lambda k: batches[k]),
                           evaluation=EvalOptions(val=val, eval_every=eval_every), optim=OptimOptions(lr=lr, clip=clip),
                           step=StepOptions(native=native))
    training = EnsembleTraining(model, E, steps, options)
    return training, training.run()


def _pair(name, dtype, batches, E, **kw):
    a, b = _model(name, dtype, E), _model(name, dtype, E)
    ta, ra = _train(a, batches, True, E, **kw)
    tb, rb = _train(b, batches, False, E, **kw)
    assert (ta.step_path, tb.step_path) == ("native", "autograd")
    return (a, ta, ra), (b, tb, rb)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, F32_ATOL)])
@pytest.mark.parametrize("E,B,T", SHAPES)
def test_native_step_matches_autograd(name, dtype, atol, E, B, T):
    batches = _batches(dtype, E, B, T)
    native, autograd = _pair(name, dtype, batches, E)
    assert_trainings_match(native, autograd, dtype, atol, STEPS)
    start = _model(name, dtype, E).state_dict()
    for k, p in native[0].named_parameters():  # it did train
        assert (p - start[k]).abs().max().item() > 10 * atol, k


def _op_args(name="nalu", dtype=torch.float64, E=5, B=16, T=6, seed=3, inputs=I):
    model = _model(name, dtype, E, inputs=inputs)
    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E)
    x, t = _batches(dtype, E, B, T, steps=1, seed=seed, inputs=inputs)[1]
    return model, dict(x=x, target=t, param=opt.flat, grad=opt.grad, exp_avg=opt.exp_avg, exp_avg_sq=opt.exp_avg_sq,
                       segments=opt._native_step(E)[1], diverged=torch.zeros(E, dtype=torch.bool), freeze=False,
                       model=name, eps=float(getattr(model.cell, "eps", 0.0)), lr=1e-3, beta1=0.9, beta2=0.999,
                       adam_eps=1e-8, step=1)


def _grad_args(args):
    return {k: args[k] for k in ("x", "target", "param", "grad", "segments", "diverged", "model", "eps")}


@pytest.mark.parametrize("name", MODELS)
def test_one_gradient_matches_autograd_float64(name):
    """The gradient op alone against autograd's gradient of the same objective (tight, float64),
    every parameter (h0, the cell's, the output layer's) and a diverged member's zero gradient."""
    model, args = _op_args(name)
    diverged = torch.zeros(5, dtype=torch.bool)
    diverged[3] = True
    loss = (model(args["x"]) - args["target"]).reshape(5, -1).pow(2).mean(1)
    torch.where(diverged, torch.zeros_like(loss), loss).sum().backward()
    want = args["grad"].clone()
    assert all(p.grad.abs().max() > 0 for p in model.parameters())
    args["grad"].fill_(float("nan"))  # every element is written
    got = torch.ops.nalu_cuda.recurrent_ensemble_grad(**{**_grad_args(args), "diverged": diverged.clone()})
    torch.testing.assert_close(args["grad"], want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, loss.detach(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T,inputs", [(9, 3, 3), (17, 1, 5), (4, 7, 2)])
def test_gradient_with_rows_and_values_not_in_whole_lane_blocks(name, dtype, B, T, inputs):
    """x's T * inputs values per row and B rows that are not whole blocks of the lane width (8
    floats, 4 doubles) for its transposition into the batch-major layout: the op's gradient
    against autograd's."""
    model, args = _op_args(name, dtype, E=2, B=B, T=T, inputs=inputs)
    loss = (model(args["x"]) - args["target"]).reshape(2, -1).pow(2).mean(1)
    loss.sum().backward()
    want = args["grad"].clone()
    args["grad"].fill_(float("nan"))
    got = torch.ops.nalu_cuda.recurrent_ensemble_grad(**_grad_args(args))
    rtol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(args["grad"], want, rtol=0, atol=rtol * want.abs().max().item())
    torch.testing.assert_close(got, loss.detach(), rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B", [1, 5, 8, 13])
def test_padding_lanes_stay_out_of_the_sums(dtype, B):
    """The kernels hold the rows in whole lane vectors; the padding lanes past B see the log path's
    log(eps) and, with every cell weight -1, an exp that overflows in float32 (Inf, and NaN in its
    gradient), which must reach neither the MSE nor a gradient: the op's gradient against
    autograd's, finite."""
    model, args = _op_args("nalu", dtype, E=3, B=B, T=4)
    with torch.no_grad():
        model.cell.W_hat.fill_(-20.0)
        model.cell.M_hat.fill_(20.0)
    opt = FlatAdam(model.parameters(), 1e-3, ensemble=3)
    args.update(param=opt.flat, grad=opt.grad, segments=opt._native_step(3)[1])
    loss = (model(args["x"]) - args["target"]).reshape(3, -1).pow(2).mean(1)
    loss.sum().backward()
    want = args["grad"].clone()
    assert torch.isfinite(want).all()
    got = torch.ops.nalu_cuda.recurrent_ensemble_grad(**_grad_args(args))
    rtol = 1e-10 if dtype == torch.float64 else 1e-3  # (relative to the largest: float32 sums of large terms,
    # the autograd step and the earlier row-major kernels 1.3e-4 apart on the loss at B = 13)
    torch.testing.assert_close(args["grad"], want, rtol=0, atol=rtol * want.abs().max().item())
    torch.testing.assert_close(got, loss.detach(), rtol=rtol, atol=0)


@contextlib.contextmanager
def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_threads_give_the_same_bits(name, dtype):
    def three_steps(threads):
        with _threads(threads):
            _, args = _op_args(name, dtype, E=7)
            for step in (1, 2, 3):
                loss = torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "step": step})
        return [loss] + [args[k] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "diverged")]

    for u, v in zip(three_steps(1), three_steps(2)):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_work_space_kept_between_calls_gives_the_same_bits(dtype):
    """Each thread keeps its work space from call to call: a call made after calls of larger shapes
    and the other unit (stale contents everywhere) gives the bits of the same call made before."""
    def step(name, B, T, inputs):
        _, args = _op_args(name, dtype, E=3, B=B, T=T, inputs=inputs)
        loss = torch.ops.nalu_cuda.recurrent_ensemble_step(**args)
        return [loss] + [args[k] for k in ("param", "grad", "exp_avg", "exp_avg_sq")]

    for name in MODELS:
        first = step(name, 5, 3, 2)
        for other in MODELS:
            step(other, 21, 7, 6)
        for u, v in zip(first, step(name, 5, 3, 2)):
            assert torch.equal(u, v), name


def test_a_member_does_not_depend_on_the_ensemble():
    """Member e of an ensemble gets the bits of the same member trained alone."""
    _, full = _op_args("nalu", torch.float32, E=4)
    start = full["param"].clone()
    loss = torch.ops.nalu_cuda.recurrent_ensemble_step(**full)
    _, one = _op_args("nalu", torch.float32, E=1)
    e = 2
    rows = list(zip(full["segments"].tolist(), one["segments"].tolist()))
    for (off, per), (off1, _) in rows:
        one["param"][off1:off1 + per] = start[off + e * per:off + (e + 1) * per]
    one["x"], one["target"] = full["x"][e:e + 1].clone(), full["target"][e:e + 1].clone()
    loss1 = torch.ops.nalu_cuda.recurrent_ensemble_step(**one)
    assert torch.equal(loss1[0], loss[e])
    for (off, per), (off1, _) in rows:
        assert torch.equal(one["param"][off1:off1 + per], full["param"][off + e * per:off + (e + 1) * per])


@pytest.mark.parametrize("name,value", [("nalu", math.inf), ("nac", 1e200)])
def test_divergence_and_freezing_match_autograd(name, value):
    """A member whose input is Inf (or huge: its MSE overflows, its gradient stays finite) at step 3
    is diverged in both paths, frozen from the evaluation at step 4 on; the parameters agree as in
    the float64 test (the diverged member's too where they stay finite)."""
    E = 5
    batches = _batches(torch.float64, E, 8, 5, bad=(3, 1, value))
    (a, ta, ra), (b, tb, rb) = _pair(name, torch.float64, batches, E, eval_every=4)
    assert ra.diverged.tolist() == rb.diverged.tolist() == [False, True, False, False, False]
    keep = ~ra.diverged if math.isinf(value) else torch.ones(E, dtype=torch.bool)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert (pa[keep] - pb[keep]).abs().max().item() <= 1e-10
    if not math.isinf(value):  # frozen after the evaluation: the member kept the parameters it had then
        assert torch.isfinite(torch.cat([p.flatten() for p in a.parameters()])).all()


def test_eligibility_and_the_autograd_switch():
    E = 3
    batches = _batches(torch.float32, E, 8, 4, steps=2)
    for name in ("nalu-indgate", "nalu-separate", "nac-mul"):  # models the native step does not implement
        assert _train(_model(name, torch.float32, E), batches, True, E, steps=2)[0].step_path == "autograd", name
    assert _train(_model("nac", torch.float32, E, backend="reference"), batches, True, E,
                  steps=2)[0].step_path == "autograd"
    hooked = _model("nalu", torch.float32, E)
    hooked.cell.register_forward_hook(lambda *a: None)
    assert _train(hooked, batches, True, E, steps=2)[0].step_path == "autograd"
    assert _train(_model("nac", torch.float32, E), batches, True, E, steps=2, clip=1.0)[0].step_path == "autograd"
    # a learning rate per member: FlatAdam's fused step takes it, the native training step (one rate) does not
    assert _train(_model("nac", torch.float32, E), batches, True, E, steps=2,
                  lr=[1e-3, 2e-3, 3e-3])[0].step_path == "autograd"
    assert _train(_model("nac", torch.float32, E), batches, False, E, steps=2)[0].step_path == "autograd"
    assert _train(_model("nac", torch.float32, E), batches, True, E, steps=2)[0].step_path == "native"


def test_shared_inputs_are_every_members_inputs():
    """batch_fn giving x (B, T, I) for all members (RecurrentNet takes it): the same step as x copied."""
    E = 3
    batches = _batches(torch.float64, E, 8, 4, steps=3)
    shared = {k: (x[0], t) for k, (x, t) in batches.items()}
    copied = {k: (x[0].expand(E, *x[0].shape).contiguous(), t) for k, (x, t) in batches.items()}
    a, b = _model("nalu", torch.float64, E), _model("nalu", torch.float64, E)
    assert _train(a, shared, True, E, steps=3)[0].step_path == "native"
    _train(b, copied, True, E, steps=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_the_recurrent_task_native_and_autograd_agree():
    """A short run of the recurrent task (float32) both ways: the same successes and divergences;
    for the NAC close losses and errors. Not for the NALU: its float32 training here is chaotic (the
    float32 gradients of both paths are about 1% off the float64 one at the task's initialisation,
    the zero initial state taking the log path's log(eps)), so after a few hundred steps at this
    rate the two trajectories differ by far more than their rounding."""
    from nalu_cuda.experiments.registry import Context
    from nalu_cuda.experiments.tasks.recurrent import recurrent_config, run

    small = dict(eval_every=100, n_valid=100, n_test=100, n_extrap=30, baseline_models=2, threshold_samples=200,
                 extrap_length=40, curve_lengths=[10, 40], lr=3e-2)
    ctx = Context(device="cpu", work_dir=".", progress=False)
    with _threads(1):  # tiny models: a second thread only slows the autograd step on a busy machine
        for name in MODELS:
            cfgs = [recurrent_config(name, ["add", "sub"], 3, 300, native=native, **small) for native in (True, False)]
            assert "native" not in cfgs[0].params and cfgs[1].params["native"] is False
            native, autograd = (run(cfg, ctx).records for cfg in cfgs)
            for key in ("op", "seed", "success", "diverged"):
                assert [r[key] for r in native] == [r[key] for r in autograd], (name, key)
            if name == "nac":
                for u, v in zip(native, autograd):
                    for key in ("final_train_loss", "extrap_mse"):
                        assert u[key] == pytest.approx(v[key], rel=1e-2, abs=1e-6), (name, key)


def _error(**changes):
    _, args = _op_args()
    args.update(changes)
    with pytest.raises(RuntimeError) as info:
        torch.ops.nalu_cuda.recurrent_ensemble_step(**args)
    return str(info.value)


def test_bad_arguments_name_the_op_the_argument_what_was_expected_and_what_came():
    _, args = _op_args()  # E 5, B 16, T 6, nalu: 7 segments
    msg = _error(x=args["x"][0])
    assert ("recurrent_ensemble_step: argument 'x' must be a contiguous float32 or float64 CPU tensor of shape "
            "(E, B, len, I), got a Double cpu tensor of shape [16, 6, 4]") in msg
    assert "Half" in _error(x=args["x"].half(), target=args["target"].half())
    with pytest.raises(RuntimeError, match=r"argument 'target' must be a contiguous CPU tensor of x's dtype \(Double\) "
                                           r"of shape \[5, 16, 1\], got a Double cpu tensor of shape \[5, 16, 2\]"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "target": torch.zeros(5, 16, 2, dtype=torch.float64)})
    with pytest.raises(RuntimeError, match=r"argument 'target' .* got a Float cpu tensor"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "target": args["target"].float()})
    with pytest.raises(RuntimeError, match=r"argument 'param' must be a contiguous CPU tensor of x's dtype \(Double\)"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "param": args["param"].float()})
    msg = _error(diverged=torch.zeros(6, dtype=torch.bool))
    assert "argument 'diverged'" in msg and "[5]" in msg and "[6]" in msg
    msg = _error(segments=args["segments"][:5])
    assert "argument 'segments' must be a contiguous int64 CPU tensor of shape [7, 2]" in msg and "[5, 2]" in msg
    bad_rows = args["segments"].clone()
    bad_rows[1, 1] = 7
    with pytest.raises(RuntimeError, match=r"argument 'segments' row 1 must be \(offset, 12\) inside param's .* got "
                                           r"\(10, 7\)"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "segments": bad_rows})
    with pytest.raises(RuntimeError, match=r"argument 'model' must be 'nac' .* or 'nalu' .* got 'nmu'"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "model": "nmu"})
    with pytest.raises(RuntimeError, match=r"argument 'exp_avg' must be a contiguous CPU tensor like param"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "exp_avg": args["exp_avg"][:-1]})
    with pytest.raises(RuntimeError, match=r"argument 'step' must be at least 1"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "step": 0})
    with pytest.raises(RuntimeError, match=r"argument 'eps' must be a finite number >= 0, got nan"):
        torch.ops.nalu_cuda.recurrent_ensemble_step(**{**args, "eps": math.nan})
    msg = _error(x=args["x"].to("meta"), target=args["target"].to("meta"))
    assert "recurrent_ensemble_step: every tensor argument must be a CPU tensor" in msg and "'x' on meta" in msg
    with pytest.raises(RuntimeError, match=r"recurrent_ensemble_grad: argument 'grad' must be .* got a Double cpu tensor "
                                           r"of shape \["):
        torch.ops.nalu_cuda.recurrent_ensemble_grad(**{**_grad_args(args), "grad": args["grad"][:-1]})
    with pytest.raises(RuntimeError, match=r"recurrent_ensemble_grad: every tensor argument must be a CPU tensor.*"
                                           r"'param' on meta"):
        torch.ops.nalu_cuda.recurrent_ensemble_grad(**{**_grad_args(args), "param": args["param"].to("meta")})


# -- the batch drawn in the call (recurrent_ensemble_step_drawn) ----------------------------------------------

DI = 10  # the task's input size: subset layouts as the task draws them
drawn = pytest.mark.skipif(not _ops.has_kernel("cpu", "recurrent_ensemble_step_drawn"),
                           reason="nalu_cuda built without the recurrent step's in-call draw")


def _stream(S, ops, rng, B=8, T=5, chunk=4, prefetch=False, seed0=0):
    from nalu_cuda.experiments.parts import arithmetic_data as ar
    from nalu_cuda.experiments.parts.uniform_stream import SumTargets, UniformStream

    seeds = list(range(seed0, seed0 + S))
    masks = torch.stack([ar.subset_layout(s, DI).mask() for s in seeds])
    return UniformStream(seeds, (B, T, DI), ar.parse_range(rng), chunk=chunk, prefetch=prefetch,
                         transform=SumTargets(masks.numpy(), ops))


def _train_on(name, stream, ops, in_call, steps=STEPS):
    """The native step over `stream`'s batches (x repeated per op, as the task's batch_fn does):
    drawn in the call (`in_call`: batch_fn names its stream) or through batch_fn."""
    E_ = len(stream.seeds) * len(ops)
    model = _model(name, torch.float32, E_, inputs=DI)

    def batch_fn(k):
        x, t = stream.next()
        return (x if len(ops) == 1 else x.repeat(len(ops), 1, 1, 1)), t

    if in_call:
        batch_fn.uniform_stream = stream
    xv = torch.rand(8, stream.shape[1], DI) + 1
    options = TrainOptions(data=DataOptions(batch_fn=batch_fn),
                           evaluation=EvalOptions(val=EvalSet("valid", xv, torch.zeros(E_, 8, 1), shared=True),
                                                  eval_every=1000),
                           optim=OptimOptions(lr=1e-2), step=StepOptions(native=True))
    training = EnsembleTraining(model, E_, steps, options)
    result = training.run()
    assert training.step_path == "native"
    return model, result


CASES = [("nac", ["add", "sub"], [1, 2], 8, 5), ("nalu", ["mul", "div", "root"], [0.5, 3], 13, 2),
         ("nac", ["squared"], [-2, 2], 3, 4), ("nalu", ["add"], [1, 2], 16, 1)]  # (name, ops, range, B, T)


@drawn
@pytest.mark.parametrize("name,ops,rng,B,T", CASES)
def test_drawn_op_is_the_step_on_the_streams_batch(name, ops, rng, B, T):
    """One call of the drawn op against recurrent_ensemble_step on the stream's own batch (x
    repeated per op, the stream's targets): the same loss, parameters, gradient, moments and flags
    bit for bit, and the SFC64 states advanced exactly as the stream's generators (chunk 1: one batch)."""
    S = 3
    ref, src = _stream(S, ops, rng, B=B, T=T, chunk=1), _stream(S, ops, rng, B=B, T=T, chunk=1)
    draw = src.in_call_draw()
    assert draw is not None and (draw["batch"], draw["length"]) == (B, T)
    E_ = S * len(ops)
    for step in (1, 2, 3):  # fresh batches every call, the buffers carried over as in training
        if step == 1:
            _, want = _op_args(name, torch.float32, E=E_, B=B, T=T, inputs=DI)
            _, got = _op_args(name, torch.float32, E=E_, B=B, T=T, inputs=DI)
            words = src.draw_words()
        x, t = ref.next()
        want.update(x=x.repeat(len(ops), 1, 1, 1).contiguous(), target=t.contiguous(), step=step)
        loss_want = torch.ops.nalu_cuda.recurrent_ensemble_step(**want)
        args = {k: v for k, v in got.items() if k not in ("x", "target")}
        loss_got = torch.ops.nalu_cuda.recurrent_ensemble_step_drawn(
            state=words, weights=draw["weights"], ops=draw["ops"], lo=draw["lo"], hi=draw["hi"], raw=draw["raw"],
            batch=B, length=T, **{**args, "step": step})
        assert torch.equal(loss_got, loss_want)
        for k in ("param", "grad", "exp_avg", "exp_avg_sq", "diverged"):
            assert torch.equal(got[k], want[k]), k
        ref_words = torch.tensor([list(bg.state["state"]["state"].view("int64")) for bg in ref._bitgens])
        assert torch.equal(words, ref_words)
    assert got["grad"].abs().max() > 0


@drawn
@pytest.mark.parametrize("name,ops,rng", [("nac", ["add", "sub"], [1, 2]), ("nalu", ["mul", "div", "root"], [0.5, 3]),
                                          ("nac", ["sub", "squared"], [-2, 2])])
@pytest.mark.parametrize("started", [False, True])
def test_drawn_step_trains_as_the_stream_bit_for_bit(name, ops, rng, started):
    """The native step drawing each seed's batch in the call trains to the bits of the same step fed
    by the stream through batch_fn, and leaves the stream where the stream itself would be
    (test_native_step.assert_in_call_draw_matches_the_stream: the next batch, state_dict, resume).
    `started`: the stream had drawn a chunk and one ahead (prefetch) before training, which the
    in-call step uses up first."""
    assert_in_call_draw_matches_the_stream(lambda prefetch: _stream(3, ops, rng, prefetch=prefetch),
                                           lambda stream, in_call: _train_on(name, stream, ops, in_call), started)


@drawn
@pytest.mark.parametrize("name", MODELS)
def test_drawn_step_threads_give_the_same_bits(name):
    """7 seeds x 2 ops, the seeds split unevenly over 2 threads: the same bits as 1 thread."""
    results = []
    for threads in (1, 2):
        with _threads(threads):
            stream = _stream(7, ["add", "sub"], [1, 2], B=9, T=4)
            model, res = _train_on(name, stream, ["add", "sub"], in_call=True, steps=5)
            results.append([p.detach().clone() for p in model.parameters()] + [res.final_loss, stream._words.clone()])
    for u, v in zip(*results):
        assert torch.equal(u, v)


def _drawn_args(name="nac", S=3, ops=(0, 1), B=8, T=5):
    _, args = _op_args(name, torch.float32, E=S * len(ops), B=B, T=T, inputs=DI)
    for k in ("x", "target"):
        args.pop(k)
    args.update(state=torch.zeros(S, 4, dtype=torch.int64), weights=torch.zeros(S, DI, 2, dtype=torch.float64),
                ops=list(ops), lo=1.0, hi=2.0, raw=True, batch=B, length=T)
    return args


@drawn
def test_drawn_bad_arguments_name_the_op_the_argument_what_was_expected_and_what_came():
    op = torch.ops.nalu_cuda.recurrent_ensemble_step_drawn
    args = _drawn_args()
    op(**args)  # well formed
    name = r"recurrent_ensemble_step_drawn: "

    def fails(pattern, **changes):
        with pytest.raises(RuntimeError, match=name + pattern):
            op(**{**args, **changes})

    fails(r"argument 'ops' must list operation codes 0 \.\. 5 \(add, sub, mul, div, squared, root\), got 6", ops=[0, 6])
    fails(r"argument 'ops' must name at least one operation, got none", ops=[])
    fails(r"argument 'state' must be a contiguous int64 CPU tensor of shape \(S, 4\) .* got a Float cpu tensor of "
          r"shape \[3, 4\]", state=torch.zeros(3, 4))
    fails(r"argument 'state' .* got a Long cpu tensor of shape \[3, 5\]", state=torch.zeros(3, 5, dtype=torch.int64))
    fails(r"argument 'weights' must be a contiguous float64 CPU tensor of shape \(3, I, 2\) .* got a Double cpu tensor "
          r"of shape \[2, 10, 2\]", weights=torch.zeros(2, DI, 2, dtype=torch.float64))
    fails(r"argument 'diverged' must have one flag per member, S \* len\(ops\) = 9, got a Bool cpu tensor of shape "
          r"\[6\]", ops=[0, 1, 2])
    fails(r"arguments 'batch' and 'length' must be >= 1 with batch \* length \* I even \(a step's draw ends on a whole "
          r"64-bit word\), got batch 3, length 5 for I = 9",
          weights=torch.zeros(3, 9, 2, dtype=torch.float64), batch=3)
    fails(r"arguments 'batch' and 'length' .* got batch 0, length 5", batch=0)
    fails(r"arguments 'batch' and 'length' .* got batch 8, length 0", length=0)
    fails(r"arguments 'lo' and 'hi' must be finite, got 1, inf", hi=math.inf, raw=False)
    fails(r"argument 'param' must be a contiguous float32 CPU tensor \(the drawn inputs' dtype\) of one dimension",
          param=args["param"].double())
    fails(r"argument 'model' must be 'nac' .* or 'nalu' .* got 'nmu'", model="nmu")
    fails(r"argument 'segments' row 1 must be \(offset, 26\) inside param's .* I = 11, hidden 2, got \(\d+, 24\)",
          weights=torch.zeros(3, 11, 2, dtype=torch.float64))  # (the model's inputs are 10)
    fails(r"argument 'exp_avg' must be a contiguous CPU tensor like param", exp_avg=args["exp_avg"][:-1])
    fails(r"argument 'step' must be at least 1", step=0)
    fails(r"every tensor argument must be a CPU tensor .*'state' on meta", state=args["state"].to("meta"))


@drawn
def test_drawn_step_falls_back_where_it_cannot():
    """The recurrent step draws only (B, T, I) streams, the static one only (B, I); a float64 model,
    a union of ranges, an ensemble that is not the stream's seeds x ops, or a batch of an odd number
    of values: batch_fn's batches."""
    from nalu_cuda.experiments.parts import arithmetic_data as ar
    from nalu_cuda.experiments.parts.native_step import in_call_stream
    from nalu_cuda.experiments.parts.uniform_stream import SumTargets, UniformStream

    S = 3

    def stream(shape, rng=(1, 2)):
        masks = torch.stack([ar.subset_layout(s, shape[-1]).mask() for s in range(S)]).numpy()
        return UniformStream(list(range(S)), shape, ar.parse_range(list(rng)), chunk=2,
                             transform=SumTargets(masks, ["add", "sub"]))

    def fn(k):
        return None

    plain, flat, odd = stream((8, 5, DI)), stream((8, DI)), stream((3, 1, 11))  # odd: 33 values a batch
    assert odd.in_call_draw() is None and stream((3, 2, 11)).in_call_draw() is not None
    for s, dtype, members, recurrent in ((plain, torch.float32, 2 * S, False), (flat, torch.float32, 2 * S, True),
                                         (plain, torch.float64, 2 * S, True), (plain, torch.float32, S, True),
                                         (stream((8, 5, DI), (-2, -1, 1, 2)), torch.float32, 2 * S, True),
                                         (odd, torch.float32, 2 * S, True)):
        fn.uniform_stream = s
        assert in_call_stream(fn, dtype, members, recurrent=recurrent) == (None, None)
    for s, recurrent in ((plain, True), (flat, False)):
        fn.uniform_stream = s
        assert in_call_stream(fn, torch.float32, 2 * S, recurrent=recurrent)[0] is s


def _equal(u, v):
    """Records equal, bit for bit: NaN equals NaN, inside lists and dicts too."""
    if isinstance(u, float) and isinstance(v, float):
        return u == v or (math.isnan(u) and math.isnan(v))
    if isinstance(u, (list, tuple)) and isinstance(v, (list, tuple)):
        return len(u) == len(v) and all(_equal(a, b) for a, b in zip(u, v))
    if isinstance(u, dict) and isinstance(v, dict):
        return u.keys() == v.keys() and all(_equal(u[k], v[k]) for k in u)
    return u == v


@drawn
def test_the_recurrent_task_is_unchanged_by_the_drawn_step(monkeypatch):
    """A short run of the recurrent task (float32, both models, 2 ops) with the batches drawn in the
    call gives the records of the same run with the native step fed by the task's batch_fn (the
    path before the in-call draw), bit for bit."""
    from nalu_cuda.experiments.parts import native_step
    from nalu_cuda.experiments.registry import Context
    from nalu_cuda.experiments.tasks.recurrent import recurrent_config, run

    small = dict(eval_every=50, n_valid=100, n_test=100, n_extrap=30, baseline_models=2, threshold_samples=200,
                 extrap_length=40, curve_lengths=[10, 40], lr=3e-2)
    ctx = Context(device="cpu", work_dir=".", progress=False)
    real = native_step.in_call_stream
    used = []

    def recording(*args, **kw):
        found = real(*args, **kw)
        used.append(found[0] is not None)
        return found

    def off(*args, **kw):
        used.append(False)
        return None, None

    with _threads(1):
        for name in MODELS:
            cfg = recurrent_config(name, ["add", "sub"], 3, 120, **small)
            records = []
            for patch in (recording, off):
                monkeypatch.setattr(native_step, "in_call_stream", patch)
                records.append(run(cfg, ctx).records)
            assert used[-2:] == [True, False], used
            drawn_records, fed = records
            assert len(drawn_records) == len(fed) == 6
            for u, v in zip(drawn_records, fed):
                assert u.keys() == v.keys()
                for key in u:
                    assert _equal(u[key], v[key]), (name, key, u[key], v[key])


@drawn
def test_the_recurrent_task_resumed_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    """The recurrent task with the drawn step, killed after its third checkpoint (step 60) and
    resumed: the records of the run that was not interrupted (the streams' states come back from the
    checkpoint and the drawing continues from them)."""
    from nalu_cuda.experiments import runner
    from nalu_cuda.experiments.parts import native_step
    from nalu_cuda.experiments.tasks.recurrent import recurrent_config

    from .experiments.test_cli import interrupted_at_third_checkpoint

    real, drew = native_step.in_call_stream, []

    def recording(*args, **kw):
        found = real(*args, **kw)
        drew.append(found[0])
        return found

    monkeypatch.setattr(native_step, "in_call_stream", recording)
    cfg = recurrent_config("nac", ["add", "sub"], 3, 120, eval_every=20, n_valid=100, n_test=100, n_extrap=30,
                           baseline_models=2, threshold_samples=200, extrap_length=40, curve_lengths=[10, 40], lr=3e-2)
    with _threads(1):
        ref = runner.run_one(cfg, str(tmp_path / "a"), progress=False, log=lambda m: None)
        b = str(tmp_path / "b")
        interrupted_at_third_checkpoint(cfg, b, monkeypatch)
        logs = []
        res = runner.run_one(cfg, b, progress=False, resume=True, checkpoint_every_s=0, log=logs.append)
    assert any("resumed at step 60" in m for m in logs)
    assert len(drew) == 3 and all(stream is not None for stream in drew)  # every run drew in the call
    assert len(res.records) == 6
    for u, v in zip(res.records, ref.records):
        assert u.keys() == v.keys()
        for key in u:
            assert key == "wall_s" or _equal(u[key], v[key]), (key, u[key], v[key])
