"""The static task's native step with the counter stream on the CPU (``--stream counter``):
``nalu_cuda::static_ensemble_step_counter`` and the CPU kernel of ``static_ensemble_grad_counter``
(``csrc/experiments/cpu/ensemble_step.cpp``) compute each member's batch in the call from (seed,
step, index), the values of :class:`~nalu_cuda.experiments.parts.counter_stream.CounterStream`
(``csrc/experiments/counter_draw.h``). Checked: the same bits as the same ops fed with the stream's
inputs and targets (loss, parameters, gradient, Adam's moments, flags), for the three models, one
and three target ops, a step above 2^32 and batches that do not fill whole lane vectors; the trainer
takes this step for a CounterStream on the CPU and trains to the bits of the step fed the stream's
batches, and to the autograd step's numbers within float32's tolerance; threads give the same bits;
bad arguments name the op and the argument. (The CUDA kernel's draw is checked against the same
stream in ``python_tests/test_native_step_cuda.py``.)"""
import pytest
import torch

from nalu_cuda import _ops
from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators, training_hooks
from nalu_cuda.experiments.parts.counter_stream import CounterStream
from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.parts.training import (DataOptions, EnsembleTraining, EvalOptions, EvalSet, OptimOptions,
                                                  StepOptions, TrainOptions, UnitHooks)
from nalu_cuda.experiments.parts.uniform_stream import TARGET_OP_CODES

pytestmark = pytest.mark.skipif(not _ops.has_kernel("cpu", "static_ensemble_step_counter"),
                                reason="nalu_cuda built without the static step's CPU kernels")

I, H, EPS = 21, 2, 1e-7
MODELS = ("nac", "nalu", "nmu")
F32_ATOL = 2e-4  # as python_tests/test_native_step.py: float32 paths that sum in other orders, after Adam steps


def _stream(S, ops, lo=1.0, hi=2.0, B=13, seed=5):
    masks = torch.stack([ar.subset_layout(s, I, 0.25, 0.5).mask() for s in range(S)]).double()
    return CounterStream(list(range(seed, seed + S)), (B, I), ar.Range(((lo, hi),)), masks=masks, ops=ops)


def _optimiser(name, E, seed=0):
    model = build_static_model(name, I, H, ensemble=E)
    model.reset_parameters(member_generators(list(range(seed, seed + E))))
    return FlatAdam(model.parameters(), 1e-3, ensemble=E)


def _codes(ops):
    return [TARGET_OP_CODES.index(op) for op in ops]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("ops,lo,hi,step,B", [(("add",), 1.0, 2.0, 5, 13), (("add", "mul", "div"), -3.0, 5.0, 7 + 2 ** 33, 8),
                                              (("sub", "squared"), 0.5, 3.0, 1, 1)])
def test_the_drawn_batch_is_the_counter_streams_to_the_bit(name, ops, lo, hi, step, B):
    """Both ops against the same ops fed with CounterStream.draw's inputs and targets: the same bits
    (B x I = 273, 168, 21: whole lane vectors and a remainder, whole vectors only, less than two)."""
    S = 3
    stream = _stream(S, ops, lo, hi, B)
    E = S * len(ops)
    x, t = stream.draw(step)
    x = x.repeat(len(ops), 1, 1).contiguous()
    reg = 0.5 if name == "nmu" else 0.0

    fed, drawn = _optimiser(name, E), _optimiser(name, E)
    segments = fed._native_step(E)[1]
    flags = [torch.zeros(E, dtype=torch.bool) for _ in range(4)]
    want = torch.ops.nalu_cuda.static_ensemble_grad(x, t, fed.flat, fed.grad, segments, flags[0], name, EPS, reg)
    got = torch.ops.nalu_cuda.static_ensemble_grad_counter(
        stream.keys, torch.tensor(step), stream.masks, _codes(ops), lo, hi, B, drawn.flat, drawn.grad, segments,
        flags[1], name, EPS, reg)
    assert torch.equal(got, want) and torch.equal(drawn.grad, fed.grad) and torch.equal(flags[1], flags[0])
    assert torch.isfinite(drawn.grad).all() and drawn.grad.abs().sum() > 0

    for adam_step in (1, 2):  # the whole step: gradient, Adam, flags (and the NMU model's projection)
        want = torch.ops.nalu_cuda.static_ensemble_step(
            x, t, fed.flat, fed.grad, fed.exp_avg, fed.exp_avg_sq, segments, flags[2], False, name, EPS, reg, 1e-3,
            0.9, 0.999, 1e-8, adam_step)
        got = torch.ops.nalu_cuda.static_ensemble_step_counter(
            stream.keys, step, stream.masks, _codes(ops), lo, hi, B, drawn.flat, drawn.grad, drawn.exp_avg,
            drawn.exp_avg_sq, segments, flags[3], False, name, EPS, reg, 1e-3, 0.9, 0.999, 1e-8, adam_step)
        assert torch.equal(got, want) and torch.equal(flags[3], flags[2])
        for buf in ("flat", "grad", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(drawn, buf), getattr(fed, buf)), buf


def _train(name, stream, ops, mode, steps=12, eval_every=5):
    """The static task's training loop over ``stream``: ``mode`` "drawn" (batch_fn names the stream:
    the native step draws in the call), "fed" (the native step on batch_fn's batches) or "autograd"."""
    S = stream.keys.shape[0]
    E = S * len(ops)
    model = build_static_model(name, I, H, ensemble=E)
    model.reset_parameters(member_generators(list(range(E))))
    hooks = training_hooks(model, {"scale": None, "start": 0, "end": 6}, list(range(E))) if name == "nmu" else {}

    def batch_fn(k):
        x, t = stream.draw(k)
        return x.repeat(len(ops), 1, 1), t

    if mode == "drawn":
        batch_fn.counter_stream = stream
    xv = torch.rand(8, I, generator=torch.Generator().manual_seed(3)) + 1
    options = TrainOptions(data=DataOptions(batch_fn=batch_fn),
                           evaluation=EvalOptions(val=EvalSet("valid", xv, torch.zeros(E, 8, 1)), eval_every=eval_every),
                           optim=OptimOptions(lr=1e-2), units=UnitHooks(**hooks),
                           step=StepOptions(native=mode != "autograd"))
    training = EnsembleTraining(model, E, steps, options)
    result = training.run()
    assert training.step_path == ("autograd" if mode == "autograd" else "native")
    assert training.batch_in_kernel == result.batch_in_kernel == (mode == "drawn")
    return model, result


@pytest.mark.parametrize("name", MODELS)
def test_the_trainer_draws_the_counter_stream_in_the_call(name):
    ops = ("add", "sub")
    stream = _stream(3, ops)
    (drawn, rd), (fed, rf), (auto, _) = (_train(name, stream, ops, mode) for mode in ("drawn", "fed", "autograd"))
    for a, b, c in zip(drawn.parameters(), fed.parameters(), auto.parameters()):
        assert torch.equal(a, b)
        assert (a - c).abs().max().item() <= F32_ATOL
    assert torch.equal(rd.final_loss, rf.final_loss) and torch.equal(rd.diverged, rf.diverged)
    assert torch.isfinite(rd.final_loss).all()


def test_threads_give_the_same_bits():
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model, res = _train("nalu", _stream(7, ("add", "mul")), ("add", "mul"), "drawn", steps=5)
            results.append([p.detach().clone() for p in model.parameters()] + [res.final_loss])
    finally:
        torch.set_num_threads(before)
    for u, v in zip(*results):
        assert torch.equal(u, v)


def test_the_resident_step_on_the_cpu_draws_in_the_kernel(monkeypatch):
    """The resident step's logic (CUDA's path) on the CPU, whose static_ensemble_grad_counter kernel now
    draws the batch too: the same bits as the resident step fed the stream's batches."""
    from nalu_cuda.experiments.parts import native_step

    monkeypatch.setattr(native_step, "RESIDENT_NATIVE_DEVICES", ("cuda", "cpu"))
    ops = ("add",)
    stream = _stream(4, ops)
    runs = []
    for drawn in (True, False):
        model = build_static_model("nalu", I, H, ensemble=4)
        model.reset_parameters(member_generators(list(range(4))))

        def batch_fn(k):
            return stream.draw(k)

        if drawn:
            batch_fn.counter_stream = stream
        xv = torch.rand(8, I, generator=torch.Generator().manual_seed(3)) + 1
        options = TrainOptions(data=DataOptions(batch_fn=batch_fn),
                               evaluation=EvalOptions(val=EvalSet("valid", xv, torch.zeros(4, 8, 1)), eval_every=5),
                               optim=OptimOptions(lr=1e-2), step=StepOptions(resident=True, native=True))
        training = EnsembleTraining(model, 4, 12, options)
        result = training.run()
        assert training.step_path == "resident-native" and result.batch_in_kernel == drawn
        runs.append([p.detach().clone() for p in model.parameters()] + [result.final_loss])
    for u, v in zip(*runs):
        assert torch.equal(u, v)


def test_the_static_task_with_the_counter_stream_takes_the_native_step(tmp_path):
    from nalu_cuda.experiments import registry
    from nalu_cuda.experiments.tasks import static

    cfg = static.static_config("nalu", ["add", "mul"], 2, 30, stream="counter", eval_every=10, n_valid=64, n_test=64,
                               baseline_models=2, threshold_samples=1000)
    out = static.run(cfg, registry.Context(device="cpu", work_dir=str(tmp_path), progress=False))
    assert out.extra["step_path"] == "native" and out.extra["batch_in_kernel"]
    assert len(out.records) == 4


def _op_args(S=3, ops=("add",)):
    stream = _stream(S, ops)
    E = S * len(ops)
    opt = _optimiser("nac", E)
    return dict(keys=stream.keys, data_step=3, masks=stream.masks, ops=_codes(ops), lo=1.0, hi=2.0, batch=13,
                param=opt.flat, grad=opt.grad, exp_avg=opt.exp_avg, exp_avg_sq=opt.exp_avg_sq,
                segments=opt._native_step(E)[1], diverged=torch.zeros(E, dtype=torch.bool), freeze=False, model="nac",
                eps=EPS, reg_weight=0.0, lr=1e-3, beta1=0.9, beta2=0.999, adam_eps=1e-8, step=1)


def test_bad_arguments_name_the_op_the_argument_what_was_expected_and_what_came():
    args = _op_args()
    op = torch.ops.nalu_cuda.static_ensemble_step_counter
    op(**args)  # well formed
    cases = [
        ({"ops": [9]}, r"static_ensemble_step_counter: argument 'ops' must list operation codes 0 \.\. 5 .* got 9"),
        ({"ops": []}, r"argument 'ops' must list 1 to 16 operation codes, got 0"),
        ({"hi": 1.0}, r"arguments 'lo' and 'hi' must be finite with lo < hi in float32, got 1, 1"),
        ({"lo": float("nan")}, r"arguments 'lo' and 'hi' must be finite"),
        ({"batch": 0}, r"argument 'batch' must be at least 1, got 0"),
        ({"keys": args["keys"][:, :1].contiguous()},
         r"argument 'keys' must be a contiguous int64 CPU tensor of shape \(S, 2\) .* got a Long cpu tensor of shape \[3, 1\]"),
        ({"masks": args["masks"].float()}, r"argument 'masks' must be a contiguous float64 CPU tensor of shape \(3, I, 2\)"),
        ({"masks": args["masks"][:2].contiguous()}, r"argument 'masks' must be .* of shape \(3, I, 2\)"),
        ({"param": args["param"].double()}, r"argument 'param' must be a contiguous float32 CPU tensor"),
        ({"diverged": torch.zeros(4, dtype=torch.bool)}, r"argument 'diverged' must be .* of shape \[3\]"),
        ({"model": "npu"}, r"argument 'model' must be one of 'nac'"),
        ({"step": 0}, r"argument 'step' must be at least 1"),
        ({"exp_avg": args["exp_avg"][:-1]}, r"argument 'exp_avg' must be a contiguous CPU tensor like param"),
    ]
    for change, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(**{**args, **change})
    grad_args = {k: v for k, v in args.items() if k not in ("exp_avg", "exp_avg_sq", "freeze", "lr", "beta1", "beta2",
                                                             "adam_eps", "step", "data_step")}
    grad = torch.ops.nalu_cuda.static_ensemble_grad_counter
    grad(**grad_args, step=torch.tensor(3))
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad_counter: argument 'step' must be a contiguous int64 "
                                           r"CPU tensor of one element"):
        grad(**grad_args, step=torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match=r"static_ensemble_grad_counter: argument 'keys' must be a contiguous int64 "
                                           r"CPU tensor"):
        grad(**{**grad_args, "keys": args["keys"].float()}, step=torch.tensor(3))
