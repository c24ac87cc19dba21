"""The device-resident training step: counter-based streams drawn on the device, the Adam step with
its step count on the device, a step that never reads a tensor back to the host (what a CUDA
graph needs), resume, and the static task's ``--stream counter``."""
import copy

import numpy as np
import pytest
import torch

from nalu_cuda.experiments import registry
from nalu_cuda.experiments.parts import training
from nalu_cuda.experiments.parts.arithmetic_data import Range, apply_op, subset_layout
from nalu_cuda.experiments.parts.arithmetic_models import build_static_model
from nalu_cuda.experiments.parts.counter_stream import CounterStream, hash32
from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.parts.seeding import member_generators
from nalu_cuda.experiments.parts.training import EvalSet, train_ensemble
from nalu_cuda.experiments.tasks import static
from nalu_cuda.experiments.tasks.static import static_config

CUDA = torch.cuda.is_available()


def _lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_hash32_is_lowbias32():
    xs = torch.randint(0, 2 ** 32, (3000,), dtype=torch.int64)
    xs[:3] = torch.tensor([0, 1, 2 ** 32 - 1])
    assert [int(h) for h in hash32(xs)] == [_lowbias32(int(x)) for x in xs]


def test_counter_stream_members_ranges_and_steps():
    r = Range(((1.0, 2.0),))
    big = CounterStream([4, 7, 9], (64, 10), r)
    one = CounterStream([7], (64, 10), r)
    x = big.inputs(12)
    assert x.shape == (3, 64, 10) and x.dtype == torch.float32
    assert torch.equal(one.inputs(12)[0], x[1])                       # a member's draw is its own
    assert torch.equal(big.inputs(torch.tensor(12)), x)                  # an int or a tensor step
    assert not torch.equal(big.inputs(13), x)                            # every step new
    assert not torch.equal(x[0], x[2])
    assert float(x.min()) >= 1.0 and float(x.max()) < 2.0
    many = CounterStream([1], (200_000,), r).inputs(0).double().flatten()
    hist = torch.histc(many, bins=10, min=1.0, max=2.0) / many.numel()
    assert float((hist - 0.1).abs().max()) < 0.005                      # uniform
    assert abs(float(torch.corrcoef(torch.stack([many[:-1], many[1:]]))[0, 1])) < 0.01


def test_counter_stream_union_of_intervals_in_proportion_to_length():
    r = Range(((-3.0, -1.0), (1.0, 7.0)))                               # lengths 2 and 6
    x = CounterStream([0], (100_000,), r).inputs(5).flatten()
    neg = x < 0
    assert abs(float(neg.float().mean()) - 0.25) < 0.01
    assert float(x[neg].min()) >= -3.0 and float(x[neg].max()) < -1.0
    assert float(x[~neg].min()) >= 1.0 and float(x[~neg].max()) < 7.0


def test_counter_stream_targets_are_the_static_tasks():
    seeds, I, ops = [0, 1], 20, ("add", "mul")
    masks = torch.stack([subset_layout(s, I, 0.25, 0.5).mask() for s in seeds])
    st = CounterStream(seeds, (8, I), Range(((1.0, 2.0),)), masks=masks, ops=ops)
    x, t = st.draw(3)
    ab = torch.bmm(x.double(), masks.double())
    want = torch.cat([apply_op(op, ab[..., 0], ab[..., 1]) for op in ops], 0).unsqueeze(-1).float()
    assert t.shape == (4, 8, 1) and torch.equal(t, want)


def test_resident_adam_step_is_adams_and_freezes_members():
    torch.manual_seed(0)
    E = 3
    w1 = torch.nn.Parameter(torch.randn(E, 4, 2))
    w2 = torch.nn.Parameter(w1.detach().clone())
    a, b = FlatAdam([w1], 0.01, ensemble=E), FlatAdam([w2], 0.01, ensemble=E)
    none = torch.zeros(E, dtype=torch.bool)
    for _ in range(5):
        g = torch.randn(E, 4, 2)
        w1.grad.copy_(g)
        w2.grad.copy_(g)
        a.step()
        assert not b.step_resident(none).any()
    torch.testing.assert_close(w2, w1, rtol=1e-6, atol=1e-7)
    # member 1 frozen, member 2 non-finite: neither takes its gradient, and 2 is reported
    before = w2.detach().clone()
    b.exp_avg.zero_()
    w2.grad.copy_(torch.ones(E, 4, 2))
    w2.grad[2, 0, 0] = float("nan")
    bad = b.step_resident(torch.tensor([False, True, False]))
    assert bad.tolist() == [False, False, True]
    assert torch.isfinite(w2).all()
    assert torch.equal(w2[1], before[1]) and torch.equal(w2[2], before[2]) and not torch.equal(w2[0], before[0])
    assert b.state_dict()["step"] == 6                                   # the device's count, read at checkpoints


def _resident_setup(seeds=(0, 1), I=10, steps=60, ops=("add",)):
    masks = torch.stack([subset_layout(s, I, 0.25, 0.5).mask() for s in seeds])
    stream = CounterStream(seeds, (16, I), Range(((1.0, 2.0),)), masks=masks, ops=ops)
    E = len(seeds) * len(ops)
    model = build_static_model("nac", I, 2, ensemble=E)
    model.reset_parameters(member_generators([s for _ in ops for s in seeds]))
    x = torch.rand(64, I, generator=torch.Generator().manual_seed(5)) + 1
    ab = torch.bmm(x.double().unsqueeze(0).expand(len(seeds), 64, I), masks.double())
    val = EvalSet("valid", x, torch.cat([apply_op(op, ab[..., 0], ab[..., 1]) for op in ops], 0).unsqueeze(-1).float())

    def batch_fn(step):
        x, t = stream.draw(step)
        return (x if len(ops) == 1 else x.repeat(len(ops), 1, 1)), t

    return model, E, batch_fn, val


class _NoHostReads:
    """Fails any read of a tensor's value on the host while active: what a CUDA graph cannot hold."""

    NAMES = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")

    def __enter__(self):
        self.mp = pytest.MonkeyPatch()
        for name in self.NAMES:
            def fail(*a, _name=name, **k):
                raise AssertionError(f"the resident step read a tensor on the host (Tensor.{_name})")
            self.mp.setattr(torch.Tensor, name, fail)

    def __exit__(self, *exc):
        self.mp.undo()


def test_resident_step_reads_nothing_back(monkeypatch):
    model, E, batch_fn, val = _resident_setup()
    guard = _NoHostReads()
    calls = []
    real = training._ResidentStep.__call__

    def guarded(self, step):
        with guard:
            real(self, step)
        calls.append(step)

    monkeypatch.setattr(training._ResidentStep, "__call__", guarded)
    res = train_ensemble(model, E, batch_fn, 30, val, eval_every=10, lr=0.05, resident=True,
                         project=lambda: None, clip_value=100.0)
    assert calls == list(range(1, 31))
    assert bool(torch.isfinite(res.best_val).all()) and not bool(res.diverged.any())


def test_resident_training_learns_and_resumes_bit_for_bit():
    model, E, batch_fn, val = _resident_setup()
    full = train_ensemble(model, E, batch_fn, 60, val, eval_every=20, lr=0.05, resident=True)
    assert full.history["valid"][-1][1] < 0.1 * full.history["valid"][0][1]  # it learns a + b
    saved = {}

    def save(obj):
        if obj["step"] == 20:
            saved["ck"] = copy.deepcopy(obj)

    model2, _, batch_fn2, _ = _resident_setup()
    ctx = registry.Context(device="cpu", work_dir=".", progress=False, save_checkpoint=save, checkpoint_every_s=0.0)
    train_ensemble(model2, E, batch_fn2, 60, val, eval_every=20, lr=0.05, resident=True, ctx=ctx)
    model3, _, batch_fn3, _ = _resident_setup()
    ctx = registry.Context(device="cpu", work_dir=".", progress=False, load_checkpoint=lambda: saved["ck"],
                           log=lambda m: None)
    resumed = train_ensemble(model3, E, batch_fn3, 60, val, eval_every=20, lr=0.05, resident=True, ctx=ctx)
    assert resumed.history["valid"] == full.history["valid"]
    for k, v in full.best_state.items():
        assert torch.equal(v, resumed.best_state[k]), k


def test_graph_needs_resident_and_no_host_schedules():
    model, E, batch_fn, val = _resident_setup()
    with pytest.raises(ValueError, match="graph=True needs resident=True"):
        train_ensemble(model, E, batch_fn, 2, val, graph=True)
    with pytest.raises(ValueError, match="cannot take a regularizer"):
        train_ensemble(model, E, batch_fn, 2, val, resident=True, graph=True, regularizer=lambda s, l: None)


def test_graph_on_cpu_is_the_eager_resident_step():
    """graph=True captures only on CUDA; on the CPU the same step runs eagerly (same numbers)."""
    runs = []
    for graph in (False, True):
        model, E, batch_fn, val = _resident_setup()
        runs.append(train_ensemble(model, E, batch_fn, 20, val, eval_every=10, lr=0.05, resident=True, graph=graph))
    assert runs[0].history == runs[1].history


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_graph_replay_equals_eager_on_cuda():
    runs = []
    for graph in (False, True):
        model, E, batch_fn, val = _resident_setup(steps=40)
        model.cuda()
        val = EvalSet(val.name, val.x.cuda(), val.targets.cuda())
        st = CounterStream([0, 1], (16, 10), Range(((1.0, 2.0),)), device="cuda",
                           masks=torch.stack([subset_layout(s, 10, 0.25, 0.5).mask() for s in (0, 1)]), ops=("add",))
        runs.append(train_ensemble(model, E, lambda step: st.draw(step), 40, val, eval_every=10, lr=0.05,
                                   resident=True, graph=graph))
    for a, b in zip(runs[0].history["valid"], runs[1].history["valid"]):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_static_stream_option(tmp_path):
    default = static_config("nac", ["add"], 2, 10)
    assert "stream" not in default.params and "graph" not in default.params  # fingerprints as before
    assert static_config("nac", ["add"], 2, 10, stream="sfc64", graph=True).fingerprint() == default.fingerprint()
    cfg = static_config("nac", ["add", "sub"], 2, 40, stream="counter", eval_every=20, n_valid=200, n_test=200,
                        baseline_models=4, threshold_samples=10_000)
    assert cfg.params["stream"] == "counter"
    with pytest.raises(ValueError, match="stream must be one of"):
        static_config("nac", ["add"], 2, 10, stream="philox")
    out = static.run(cfg, registry.Context(device="cpu", work_dir=str(tmp_path), progress=False))
    assert len(out.records) == 4 and all(np.isfinite(r["interp_mse"]) for r in out.records)


def test_resident_step_kernel_is_cuda_only():
    # The fused resident step (csrc/experiments/cuda/flat_adam_kernels.cu) runs on CUDA tensors only: on CPU
    # FlatAdam keeps its tensor ops, and the op says what it needs.
    import nalu_cuda

    E = 2
    w = torch.nn.Parameter(torch.randn(E, 3))
    opt = FlatAdam([w], 0.01, ensemble=E)
    assert opt._resident_native(E) is None
    if not nalu_cuda.has_extension():
        pytest.skip("the native extension is not built")
    z = torch.zeros(6)
    with pytest.raises(RuntimeError, match="flat_adam_step_resident: argument 'param' must be a CUDA tensor, "
                                           "got a tensor on cpu"):
        torch.ops.nalu_cuda.flat_adam_step_resident(z, z, z, z, torch.tensor([[0, 3]]), torch.zeros(E, dtype=torch.bool),
                                                    torch.zeros((), dtype=torch.float64), 0.01, 0.9, 0.999, 1e-8)


def test_counter_stream_sequence_targets_are_the_recurrent_tasks():
    seeds, I, ops = [3, 4], 12, ("add", "sub")
    masks = torch.stack([subset_layout(s, I, 0.25, 0.5).mask() for s in seeds])
    st = CounterStream(seeds, (5, 7, I), Range(((1.0, 2.0),)), masks=masks, ops=ops)
    x, t = st.draw(2)
    assert x.shape == (2, 5, 7, I) and t.shape == (4, 5, 1)
    ab = torch.bmm(x.double().sum(-2), masks.double())
    want = torch.cat([apply_op(op, ab[..., 0], ab[..., 1]) for op in ops], 0).unsqueeze(-1).float()
    assert torch.equal(t, want)


def test_recurrent_stream_option(tmp_path):
    from nalu_cuda.experiments.tasks import recurrent
    from nalu_cuda.experiments.tasks.recurrent import recurrent_config

    default = recurrent_config("nac", ["add"], 2, 10)
    assert "stream" not in default.params and "graph" not in default.params
    cfg = recurrent_config("nac", ["add"], 2, 30, stream="counter", eval_every=10, n_valid=64, n_test=64,
                           n_extrap=16, baseline_models=4, threshold_samples=10_000, extrap_length=20,
                           curve_lengths=[10, 20])
    assert cfg.params["stream"] == "counter"
    out = recurrent.run(cfg, registry.Context(device="cpu", work_dir=str(tmp_path), progress=False))
    assert len(out.records) == 2 and all(np.isfinite(r["interp_mse"]) for r in out.records)
