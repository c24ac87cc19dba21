"""The native training steps' kernels give the same bits under every instruction set they are built
for (``csrc/experiments/cpu/step_kernels_per_isa.h``: base, AVX2 and, where the processor has it,
AVX-512): the static step (NAC, NALU, NMU models; float32 and float64; inputs that do not fill whole
lane vectors, and the static task's own shape; its batch drawn from the counter stream in the call), the recurrent step and the LSTM sequence kernels.
Each instruction set is chosen once per process (``NALU_CUDA_CPU_ISA``), so each runs in a fresh
interpreter and saves what it computed."""
import sys

import pytest
import torch

from nalu_cuda import _ops

from .conftest import run_fresh_interpreter

pytestmark = pytest.mark.skipif(not (_ops.has_kernel("cpu", "static_ensemble_step")
                                     and _ops.has_kernel("cpu", "recurrent_ensemble_step")
                                     and _ops.has_kernel("cpu", "lstm_sequence_forward")),
                                reason="nalu_cuda built without the native steps' CPU kernels")


def _static(name, dtype, E, B, I, reg_weight=0.0):
    from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators
    from nalu_cuda.experiments.parts.optim import FlatAdam

    model = build_static_model(name, I, 2, ensemble=E)
    model.reset_parameters(member_generators(list(range(E))))
    model = model.to(dtype)
    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E)
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(1, 4):
        x = (torch.rand(E, B, I, generator=g, dtype=dtype) * 1.5 + 0.5)
        x = x * torch.where(torch.rand(E, B, I, generator=g) < 0.3, -1.0, 1.0).to(dtype)
        loss = torch.ops.nalu_cuda.static_ensemble_step(
            x, x[..., :1] + x[..., 1:2], opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq, opt._native_step(E)[1],
            torch.zeros(E, dtype=torch.bool), False, name, 1e-7, reg_weight, 1e-3, 0.9, 0.999, 1e-8, step)
        out.append(loss)
    return out + [opt.flat.clone(), opt.grad.clone(), opt.exp_avg_sq.clone()]


def _static_counter(name, S=3, B=13, I=21):
    """The static step drawing its batch from the counter stream (static_ensemble_step_counter): B x I
    = 273, whole lane vectors and a remainder; two target ops."""
    from nalu_cuda.experiments.parts import arithmetic_data as ar
    from nalu_cuda.experiments.parts.arithmetic_models import build_static_model, member_generators
    from nalu_cuda.experiments.parts.counter_stream import CounterStream
    from nalu_cuda.experiments.parts.optim import FlatAdam

    masks = torch.stack([ar.subset_layout(s, I, 0.25, 0.5).mask() for s in range(S)]).double()
    stream = CounterStream(list(range(S)), (B, I), ar.Range(((-1.0, 3.0),)), masks=masks, ops=("add", "mul"))
    E = 2 * S
    model = build_static_model(name, I, 2, ensemble=E)
    model.reset_parameters(member_generators(list(range(E))))
    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E)
    out = []
    for step in range(1, 4):
        out.append(torch.ops.nalu_cuda.static_ensemble_step_counter(
            stream.keys, step, stream.masks, [0, 2], -1.0, 3.0, B, opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq,
            opt._native_step(E)[1], torch.zeros(E, dtype=torch.bool), False, name, 1e-7,
            0.5 if name == "nmu" else 0.0, 1e-3, 0.9, 0.999, 1e-8, step))
    return out + [opt.flat.clone(), opt.grad.clone(), opt.exp_avg_sq.clone()]


def isa_results(path: str) -> None:
    """What the steps compute here, saved to ``path`` (run in a fresh interpreter per instruction set)."""
    sys.path.insert(0, ".")
    from python_tests import test_recurrent_native_step as rec

    torch.set_num_threads(1)
    out = {}
    for name in ("nac", "nalu", "nmu"):
        for dtype in (torch.float32, torch.float64):
            out[f"static/{name}/{dtype}"] = _static(name, dtype, E=5, B=13, I=21, reg_weight=0.5 if name == "nmu" else 0.0)
        out[f"static/{name}/task-shape"] = _static(name, torch.float32, E=3, B=128, I=100)
        out[f"static-counter/{name}"] = _static_counter(name)
    for name in ("nac", "nalu"):
        for dtype in (torch.float32, torch.float64):
            _, args = rec._op_args(name, dtype)
            losses = []
            for step in range(1, 4):
                args["step"] = step
                losses.append(torch.ops.nalu_cuda.recurrent_ensemble_step(**args))
            out[f"recurrent/{name}/{dtype}"] = losses + [args["param"].clone(), args["grad"].clone()]
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(5)
        T, E, B, H = 6, 3, 9, 13
        xs = torch.randn(T, E, B, 4 * H, generator=g, dtype=dtype)
        W = torch.randn(E, H, 4 * H, generator=g, dtype=dtype) * 0.3
        hs, saved = _ops.ops.lstm_sequence_forward(xs, W, True)
        dxs, dW = _ops.ops.lstm_sequence_backward(torch.randn(hs.shape, generator=g, dtype=dtype), W, hs, saved)
        out[f"lstm/{dtype}"] = [hs, dxs, dW]
    torch.save(out, path)


def test_instruction_sets_give_the_same_bits(tmp_path):
    runs = {}
    for isa in ("base", "avx2", None):  # None: the best the processor has (AVX-512 where it has it)
        path = tmp_path / f"{isa or 'best'}.pt"
        run_fresh_interpreter(f"from python_tests.test_step_isa import isa_results\nisa_results({str(path)!r})\n", isa=isa)
        runs[isa or "best"] = torch.load(path)
    ref = runs.pop("base")
    assert len(ref) == 3 * 4 + 2 * 2 + 2
    for isa, got in runs.items():
        assert got.keys() == ref.keys()
        for key, tensors in ref.items():
            for k, (u, v) in enumerate(zip(tensors, got[key])):
                assert torch.equal(u, v), f"{isa} against base: {key}, result {k}"
