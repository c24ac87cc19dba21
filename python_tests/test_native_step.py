"""The static task's native training step (``nalu_cuda::static_ensemble_step``, one call per step,
``csrc/experiments/cpu/ensemble_step.cpp``) against the autograd step it replaces
(``EnsembleTraining.eager_step``, the reference), for the models it implements (NAC+ -> NAC+,
NALU -> NALU, NAU -> NMU with its regulariser and projection).

Tolerances, after ``STEPS`` Adam steps (lr 1e-3) from the same start on the same batches: float64
1e-10 (absolute, on parameters of order 1), float32 ``F32_ATOL`` (the two paths sum in different
orders; Adam's normalised update turns a rounding difference of a gradient element near 0 into a
difference of up to ``lr`` per step in that parameter, which bounds it)."""
import copy

import pytest
import torch

from nalu_cuda import _ops
from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators, training_hooks
from nalu_cuda.experiments.parts.native_step import NATIVE_MODELS
from nalu_cuda.experiments.parts.training import (DataOptions, EnsembleTraining, EvalOptions, EvalSet, OptimOptions,
                                                  StepOptions, TrainOptions, UnitHooks)

pytestmark = pytest.mark.skipif(not _ops.has_kernel("cpu", "static_ensemble_step"),
                                reason="nalu_cuda built without the static step's CPU kernels")

E, B, I, STEPS = 5, 16, 12, 12
F32_ATOL = 2e-4
MODELS = tuple(NATIVE_MODELS)


def _batches(dtype, steps=STEPS, seed=0, bad=None):
    """Fresh random inputs every step, |x| in [0.5, 2] with random signs (away from 0 for the log
    path), targets a + b of two inputs per member; ``bad=(step, member)`` puts an Inf there."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(1, steps + 1):
        x = (torch.rand(E, B, I, generator=g, dtype=torch.float64) * 1.5 + 0.5)
        x = x * torch.where(torch.rand(E, B, I, generator=g) < 0.3, -1.0, 1.0).double()
        t = (x[..., :1] + x[..., 1:2]).clone()
        if bad is not None and k == bad[0]:
            x[bad[1], 0, 0] = float("inf")
        out[k] = (x.to(dtype), t.to(dtype))
    return out


def _model(name, dtype, seed=0):
    model = build_static_model(name, I, 2, ensemble=E)
    model.reset_parameters(member_generators(list(range(seed, seed + E))))
    return model.to(dtype)


def _train(model, batches, native, *, eval_every=1000, hooks=None, steps=STEPS):
    xv = torch.rand(8, I, dtype=next(model.parameters()).dtype) + 1
    val = EvalSet("valid", xv, torch.zeros(E, 8, 1, dtype=xv.dtype))
    options = TrainOptions(data=DataOptions(batch_fn=lambda k: batches[k]),
                           evaluation=EvalOptions(val=val, eval_every=eval_every), optim=OptimOptions(lr=1e-3),
                           units=UnitHooks(**(hooks or {})), step=StepOptions(native=native))
    training = EnsembleTraining(model, E, steps, options)
    result = training.run()
    return training, result


def _nmu_hooks(model):
    hooks = training_hooks(model, {"scale": None, "start": 0, "end": 6}, list(range(E)))  # the schedule ramps up
    assert set(hooks) == {"regularizer", "project"}
    return hooks


def _pair(name, dtype, batches, **kw):
    a, b = _model(name, dtype), _model(name, dtype)
    ha = _nmu_hooks(a) if name == "nmu" else None
    hb = _nmu_hooks(b) if name == "nmu" else None
    ta, ra = _train(a, batches, True, hooks=ha, **kw)
    tb, rb = _train(b, batches, False, hooks=hb, **kw)
    assert (ta.step_path, tb.step_path) == ("native", "autograd")
    return (a, ta, ra), (b, tb, rb)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, F32_ATOL)])
def test_native_step_matches_autograd(name, dtype, atol):
    batches = _batches(dtype)
    assert_trainings_match(*_pair(name, dtype, batches), dtype, atol, STEPS)


@pytest.mark.parametrize("name", MODELS)
def test_native_resident_step_logic_on_the_cpu(name, monkeypatch):
    """The resident step with the gradient kernel (native_step.native_resident_step, CUDA's path) run
    on the CPU, whose static_ensemble_grad kernel does the same work: the step's own logic (the
    device step counter, the flags, FlatAdam's resident step, the projection, the regulariser's
    schedule, the loss sums) against the autograd resident step, float64."""
    from nalu_cuda.experiments.parts import native_step

    monkeypatch.setattr(native_step, "RESIDENT_NATIVE_DEVICES", ("cuda", "cpu"))
    dtype = torch.float64
    batches = _batches(dtype)

    def train(native):
        model = _model(name, dtype)
        xv = torch.rand(8, I, dtype=dtype) + 1
        val = EvalSet("valid", xv, torch.zeros(E, 8, 1, dtype=dtype))
        hooks = _nmu_hooks(model) if name == "nmu" else {}
        options = TrainOptions(data=DataOptions(batch_fn=lambda k: batches[int(k)]),
                               evaluation=EvalOptions(val=val, eval_every=5), optim=OptimOptions(lr=1e-3),
                               units=UnitHooks(**hooks), step=StepOptions(resident=True, native=native))
        training = EnsembleTraining(model, E, STEPS, options)
        return model, training, training.run()

    native, autograd = train(True), train(False)
    assert (native[1].step_path, autograd[1].step_path) == ("resident-native", "resident")
    for _, training, _ in (native, autograd):
        training.opt.sync_step_count()  # (the resident step counts on the device)
    assert_trainings_match(native, autograd, dtype, 1e-10, STEPS)


def assert_trainings_match(native, autograd, dtype, atol, steps):
    """The native training ``(model, training, result)`` against the autograd one: parameters within
    ``atol``, no divergence, the same window losses and Adam moments up to rounding."""
    (a, ta, ra), (b, tb, rb) = native, autograd
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa - pb).abs().max().item() <= atol, k
    assert not ra.diverged.any() and not rb.diverged.any()
    torch.testing.assert_close(ra.final_loss, rb.final_loss, rtol=1e-9 if dtype == torch.float64 else 1e-4, atol=0)
    assert ta.opt.step_count == tb.opt.step_count == steps
    for buf in ("exp_avg", "exp_avg_sq"):  # float32: within 1e-3 of the buffer's largest element
        want = getattr(tb.opt, buf)
        scale = 1e-10 if dtype == torch.float64 else 1e-3 * want.abs().max().item()
        torch.testing.assert_close(getattr(ta.opt, buf), want, rtol=1e-8 if dtype == torch.float64 else 1e-3, atol=scale)


@pytest.mark.parametrize("name", MODELS)
def test_one_gradient_matches_autograd_float64(name):
    """The gradient op alone against autograd's gradient of the same objective (tight, float64)."""
    model = _model(name, torch.float64)
    x, t = _batches(torch.float64, steps=1)[1]
    weight = 0.7 if name == "nmu" else 0.0
    from nalu_cuda import regularizers as R
    from nalu_cuda.experiments.parts.optim import FlatAdam

    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E)
    diverged = torch.zeros(E, dtype=torch.bool)
    diverged[3] = True  # a diverged member takes a zero gradient
    loss = (model(x) - t).reshape(E, -1).pow(2).mean(1)
    objective = loss + (weight * R.sparsity(model, ensemble=True) if weight else 0)
    torch.where(diverged, torch.zeros_like(objective), objective).sum().backward()
    want = opt.grad.clone()
    got_loss = torch.ops.nalu_cuda.static_ensemble_grad(x, t, opt.flat, opt.grad, opt._native_step(E)[1],
                                                       diverged.clone(), name, getattr(model.net[0], "eps", 0.0),
                                                       weight)
    torch.testing.assert_close(opt.grad, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-12, atol=0)


def _op_args(name="nalu", dtype=torch.float64, E_=E, inputs=I, batch=B):
    model = build_static_model(name, inputs, 2, ensemble=E_).to(dtype)
    model.reset_parameters(member_generators(list(range(E_))))
    from nalu_cuda.experiments.parts.optim import FlatAdam

    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E_)
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(E_, batch, inputs, generator=g, dtype=dtype) + 0.5)
    return dict(x=x, target=x[..., :1] * 2, param=opt.flat, grad=opt.grad, exp_avg=opt.exp_avg,
                exp_avg_sq=opt.exp_avg_sq, segments=opt._native_step(E_)[1], diverged=torch.zeros(E_, dtype=torch.bool),
                freeze=False, model=name, eps=1e-7, reg_weight=0.0, lr=1e-3, beta1=0.9, beta2=0.999, adam_eps=1e-8,
                step=1)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_threads_give_the_same_bits(name, dtype):
    E_ = 7
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            args = _op_args(name, dtype, E_)
            if name == "nmu":
                args["reg_weight"] = 0.5
            for step in range(1, 4):
                args["step"] = step
                loss = torch.ops.nalu_cuda.static_ensemble_step(**args)
            results.append((loss, args["param"].clone(), args["grad"].clone(), args["exp_avg_sq"].clone()))
    finally:
        torch.set_num_threads(before)
    for u, v in zip(*results):
        assert torch.equal(u, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_buffers_kept_between_calls_give_the_same_bits(dtype):
    """Each thread keeps its step's buffers from call to call: a call made after calls of larger
    shapes and other units (stale contents everywhere) gives the bits of the same call made before."""
    def step(name, inputs, batch):
        args = _op_args(name, dtype, 3, inputs=inputs, batch=batch)
        loss = torch.ops.nalu_cuda.static_ensemble_step(**args)
        return [loss] + [args[k] for k in ("param", "grad", "exp_avg", "exp_avg_sq")]

    for name in MODELS:
        first = step(name, 9, 5)
        for other in MODELS:
            step(other, 40, 33)
        for u, v in zip(first, step(name, 9, 5)):
            assert torch.equal(u, v), name


def test_a_member_does_not_depend_on_the_ensemble():
    """Member e of an ensemble gets the bits of the same member trained alone."""
    full = _op_args("nalu", torch.float32, 4)
    loss = torch.ops.nalu_cuda.static_ensemble_step(**full)
    one = _op_args("nalu", torch.float32, 1)
    segs_full, segs_one = full["segments"], one["segments"]
    e = 2
    for (off, per), (off1, _) in zip(segs_full.tolist(), segs_one.tolist()):
        one["param"][off1:off1 + per] = _op_args("nalu", torch.float32, 4)["param"][off + e * per:off + (e + 1) * per]
    one["x"], one["target"] = full["x"][e:e + 1].clone(), full["target"][e:e + 1].clone()
    loss1 = torch.ops.nalu_cuda.static_ensemble_step(**one)
    assert torch.equal(loss1[0], loss[e])
    for (off, per), (off1, _) in zip(segs_full.tolist(), segs_one.tolist()):
        assert torch.equal(one["param"][off1:off1 + per], full["param"][off + e * per:off + (e + 1) * per])


def test_divergence_and_freezing_match_autograd():
    """A member whose input goes Inf at step 3 is diverged in both paths, frozen from the evaluation
    at step 4 on; the other members' parameters agree as in the float64 test."""
    batches = _batches(torch.float64, bad=(3, 1))
    (a, ta, ra), (b, tb, rb) = _pair("nalu", torch.float64, batches, eval_every=4)
    assert ra.diverged.tolist() == rb.diverged.tolist() == [False, True, False, False, False]
    for pa, pb in zip(a.parameters(), b.parameters()):
        keep = ~ra.diverged
        assert (pa[keep] - pb[keep]).abs().max().item() <= 1e-10


def test_eligibility_and_the_autograd_switch():
    batches = _batches(torch.float32, steps=2)
    for name in ("nalu-indgate", "nalu-separate", "nau", "relu"):  # models the native step does not implement
        training, _ = _train(_model(name, torch.float32), batches, True, steps=2)
        assert training.step_path == "autograd", name
    reference = build_static_model("nac", I, 2, ensemble=E, backend="reference")
    assert _train(reference, batches, True, steps=2)[0].step_path == "autograd"
    hooked = _model("nac", torch.float32)
    hooked.net[0].register_forward_hook(lambda *a: None)
    assert _train(hooked, batches, True, steps=2)[0].step_path == "autograd"
    nmu = _model("nmu", torch.float32)
    hooks = _nmu_hooks(nmu)
    hooks["project"] = lambda: None  # a projection of its own: not the one the native step does
    assert _train(nmu, batches, True, steps=2, hooks=hooks)[0].step_path == "autograd"
    assert _train(_model("nalu", torch.float32), batches, False, steps=2)[0].step_path == "autograd"


def test_the_step_flags_are_a_stored_option_only_off_the_native_default():
    from nalu_cuda.experiments.tasks.static import static_config

    default = static_config("nac", ["add"], 2, 10)
    assert "native" not in default.params
    assert static_config("nac", ["add"], 2, 10, native=True).fingerprint() == default.fingerprint()
    assert static_config("nac", ["add"], 2, 10, native=False).params["native"] is False
    assert ar.STEP_DEFAULTS["native"] is True
    import argparse

    parser = argparse.ArgumentParser()
    ar.add_step_arguments(parser)
    assert parser.parse_args([]).native is True
    assert parser.parse_args(["--native-step"]).native is True
    assert parser.parse_args(["--autograd-step"]).native is False


def _error(**changes):
    args = _op_args()
    args.update(changes)
    with pytest.raises(RuntimeError) as info:
        torch.ops.nalu_cuda.static_ensemble_step(**args)
    return str(info.value)


def test_bad_arguments_name_the_op_the_argument_what_was_expected_and_what_came():
    args = _op_args()
    msg = _error(x=args["x"].half())
    assert "static_ensemble_step: argument 'x' must be a contiguous float32 or float64 CPU tensor" in msg
    assert "Half" in msg
    msg = _error(target=torch.zeros(E, B, 2, dtype=torch.float64))
    assert "argument 'target' must be" in msg and f"[{E}, {B}, 1]" in msg and "[5, 16, 2]" in msg
    msg = _error(target=args["target"].float())
    assert "argument 'target'" in msg and "Float" in msg
    msg = _error(diverged=torch.zeros(E + 1, dtype=torch.bool))
    assert "argument 'diverged'" in msg and f"[{E}]" in msg and "[6]" in msg
    msg = _error(segments=args["segments"][:2])
    assert "argument 'segments'" in msg and "[6, 2]" in msg and "[2, 2]" in msg
    msg = _error(model="nalu-indgate")
    assert "argument 'model' must be one of" in msg and "'nalu-indgate'" in msg
    msg = _error(exp_avg=args["exp_avg"][:-1])
    assert "argument 'exp_avg'" in msg
    msg = _error(reg_weight=0.5)
    assert "argument 'reg_weight'" in msg and "0.5" in msg
    msg = _error(x=args["x"].to("meta"), target=args["target"].to("meta"))
    assert "static_ensemble_step: every tensor argument must be a CPU tensor" in msg and "'x' on meta" in msg
    grad_args = {k: args[k] for k in ("x", "target", "param", "grad", "segments", "diverged", "model", "eps",
                                      "reg_weight")}
    grad_args["grad"] = args["grad"][:-1]
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad: argument 'grad' must be .* got a Double cpu tensor "
                                           r"of shape \["):
        torch.ops.nalu_cuda.static_ensemble_grad(**grad_args)


# -- the batch drawn in the call (static_ensemble_step_drawn) -------------------------------------------------

def _stream(S, ops, rng, prefetch=False):
    from nalu_cuda.experiments.parts.uniform_stream import SumTargets, UniformStream

    masks = torch.stack([ar.subset_layout(s, I).mask() for s in range(S)])
    return UniformStream(list(range(S)), (B, I), ar.parse_range(rng), chunk=4, prefetch=prefetch,
                         transform=SumTargets(masks.numpy(), ops))


def _train_on(name, stream, ops, in_call, steps=STEPS):
    """The native step over `stream`'s batches: drawn in the call (`in_call`) or through batch_fn."""
    S = len(stream.seeds)
    E_ = S * len(ops)
    model = build_static_model(name, I, 2, ensemble=E_)
    model.reset_parameters(member_generators(list(range(E_))))
    hooks = training_hooks(model, {"scale": None, "start": 0, "end": 6}, list(range(E_))) if name == "nmu" else {}

    def batch_fn(k):
        x, t = stream.next()
        return (x if len(ops) == 1 else x.repeat(len(ops), 1, 1)), t

    if in_call:
        batch_fn.uniform_stream = stream
    xv = torch.rand(8, I) + 1
    options = TrainOptions(data=DataOptions(batch_fn=batch_fn),
                           evaluation=EvalOptions(val=EvalSet("valid", xv, torch.zeros(E_, 8, 1)), eval_every=1000),
                           optim=OptimOptions(lr=1e-3), units=UnitHooks(**hooks), step=StepOptions(native=True))
    training = EnsembleTraining(model, E_, steps, options)
    result = training.run()
    assert training.step_path == "native"
    return model, result


@pytest.mark.parametrize("name,ops,rng", [("nac", ["add"], [1, 2]), ("nalu", ["mul", "div", "root"], [0.5, 3]),
                                          ("nmu", ["sub", "squared"], [-2, 2])])
@pytest.mark.parametrize("started", [False, True])
def test_in_call_draw_is_the_stream_bit_for_bit(name, ops, rng, started):
    """The native step drawing each member's batch in the call trains to the same bits as the same
    step fed by UniformStream (same seeds, inputs and targets), and leaves the stream where the
    stream itself would be: its next batch is the same. `started`: the stream had drawn a chunk and
    one ahead (prefetch) before training, which the in-call step uses up first."""
    assert_in_call_draw_matches_the_stream(lambda prefetch: _stream(3, ops, rng, prefetch=prefetch),
                                           lambda stream, in_call: _train_on(name, stream, ops, in_call), started)


def assert_in_call_draw_matches_the_stream(make_stream, train_on, started):
    """Training on a stream from ``make_stream(prefetch)`` with its batches drawn in the call
    (``train_on(stream, in_call=True)``, returning ``(model, result)``) gives the bits of the same
    training fed through batch_fn, and leaves the stream where batch_fn's would be: the same next
    batch, and a stream resumed from its state_dict and the stream itself continue the same
    sequence. ``started``: the stream had drawn a chunk and one ahead (prefetch) before training."""
    ref, drawn = make_stream(False), make_stream(started)
    if started:
        ref.next(), drawn.next()
    try:
        a, ra = train_on(ref, in_call=False)
        b, rb = train_on(drawn, in_call=True)
        assert drawn._words is not None  # it did draw in the call
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
        assert torch.equal(ra.final_loss, rb.final_loss) and torch.equal(ra.diverged, rb.diverged)
        state = drawn.state_dict()
        want = ref.next()
        for u, v in zip(want, drawn.next()):
            assert torch.equal(u, v)
        fresh = make_stream(False)
        fresh.load_state_dict(state)  # a checkpoint taken after in-call steps resumes the stream exactly
        for u, v in zip(want, fresh.next()):
            assert torch.equal(u, v)
        for u, v in zip(ref.next(), drawn.next()):  # and drawing on continues the same sequence
            assert torch.equal(u, v)
    finally:
        ref.close(), drawn.close()


@pytest.mark.parametrize("name", MODELS)
def test_in_call_draw_against_autograd(name):
    """In-call drawing against the autograd reference on the same stream, float32 tolerance."""
    ref, drawn = _stream(E, ["add"], [1, 2]), _stream(E, ["add"], [1, 2])
    b, _ = _train_on(name, drawn, ["add"], in_call=True)
    a = build_static_model(name, I, 2, ensemble=E)
    a.reset_parameters(member_generators(list(range(E))))
    batches = {k: ref.next() for k in range(1, STEPS + 1)}
    hooks = _nmu_hooks(a) if name == "nmu" else None
    ta, _ = _train(a, batches, False, hooks=hooks)
    assert ta.step_path == "autograd"
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa - pb).abs().max().item() <= F32_ATOL, k


@pytest.mark.parametrize("name", MODELS)
def test_in_call_draw_threads_give_the_same_bits(name):
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            stream = _stream(7, ["add", "sub"], [1, 2])
            model, res = _train_on(name, stream, ["add", "sub"], in_call=True, steps=5)
            results.append([p.detach().clone() for p in model.parameters()] + [res.final_loss, stream._words.clone()])
    finally:
        torch.set_num_threads(before)
    for u, v in zip(*results):
        assert torch.equal(u, v)


def test_in_call_draw_bad_arguments():
    args = _op_args("nac", torch.float32)
    for k in ("x", "target"):
        args.pop(k)
    S = E
    args.update(state=torch.zeros(S, 4, dtype=torch.int64), weights=torch.zeros(S, I, 2, dtype=torch.float64),
                ops=[0], lo=1.0, hi=2.0, raw=True, batch=B)
    op = torch.ops.nalu_cuda.static_ensemble_step_drawn
    op(**args)  # well formed
    with pytest.raises(RuntimeError, match=r"static_ensemble_step_drawn: argument 'ops' must list operation codes "
                                           r"0 \.\. 5 .* got 9"):
        op(**{**args, "ops": [9]})
    with pytest.raises(RuntimeError, match=r"static_ensemble_step_drawn: argument 'state' must be a contiguous int64 "
                                           r"CPU tensor of shape \(S, 4\).* got a Float"):
        op(**{**args, "state": torch.zeros(S, 4)})
    with pytest.raises(RuntimeError, match=r"argument 'diverged' must have one flag per member, S \* len\(ops\) = 10"):
        op(**{**args, "ops": [0, 1]})
    with pytest.raises(RuntimeError, match=r"argument 'batch' must be >= 1 with batch \* I even .* got batch 3 for I = 3"):
        op(**{**args, "weights": torch.zeros(S, 3, 2, dtype=torch.float64), "batch": 3})
    with pytest.raises(RuntimeError, match=r"argument 'param' must be a contiguous float32 CPU tensor"):
        op(**{**args, "param": args["param"].double()})


def test_in_call_draw_falls_back_where_it_cannot():
    """A union of ranges or a float64 model: the native step takes batch_fn's batches."""
    from nalu_cuda.experiments.parts.native_step import in_call_stream
    from nalu_cuda.experiments.parts.uniform_stream import SumTargets, UniformStream

    masks = torch.stack([ar.subset_layout(s, I).mask() for s in range(E)])
    union = UniformStream(list(range(E)), (B, I), ar.parse_range([-2, -1, 1, 2]), chunk=4,
                          transform=SumTargets(masks.numpy(), ["add"]))
    plain = _stream(E, ["add"], [1, 2])

    def fn(k):
        return None

    for stream, dtype, members in ((union, torch.float32, E), (plain, torch.float64, E), (plain, torch.float32, 2 * E)):
        fn.uniform_stream = stream
        assert in_call_stream(fn, dtype, members) == (None, None)
    fn.uniform_stream = plain
    assert in_call_stream(fn, torch.float32, E)[0] is plain
