"""The static and recurrent tasks' training steps as one native call per step: the static task's
(``nalu_cuda::static_ensemble_step``, ``csrc/experiments/cpu/ensemble_step.cpp``) for the models
it implements, :data:`NATIVE_MODELS`, and the recurrent task's (``nalu_cuda::recurrent_ensemble_step``,
``csrc/experiments/cpu/recurrent_step.cpp``) for its :class:`~.arithmetic_models.RecurrentNet`
models :data:`RECURRENT_NATIVE_MODELS` (NAC and NALU: the cell over ``concat(x_t, h_{t-1})`` from
the learned ``h0``, the output layer on the last state, backpropagation through time in the call;
:func:`recurrent_layers` says which qualify, ``python_tests/test_recurrent_native_step.py`` tests it).

One call does what :meth:`.training.EnsembleTraining.eager_step` does with autograd for these
models: the forward through both layers, each member's MSE, the divergence check of the objective,
the backward into :class:`~.optim.FlatAdam`'s flat gradient buffer, FlatAdam's own fused CPU step
(the same C++ function its :meth:`~.optim.FlatAdam.step_ensemble` calls), and for the NMU model
Madsen's sparsity regulariser (its schedule's weight computed here, on the host, per step) and the
projection. Members are split over the intra-op threads (``torch.set_num_threads``), each member
whole on one thread: the same bits for any number of threads.

:func:`native_step` says whether a training run can take it: the model one of these (as
:func:`.arithmetic_models.build_static_model` builds them, not ``backend="reference"``), on the
CPU in float32 or float64, trained by a plain :class:`~.optim.FlatAdam` (one learning rate, no
clipping) over exactly the model's parameters, from ``batch_fn`` (not resident), with no module or
parameter hooks and none of the trainer's hooks but the ones :func:`.arithmetic_models.training_hooks`
builds for the model. Otherwise the autograd step runs, which is also the reference the native step
is tested against (``python_tests/test_native_step.py``). The native step runs with
``train_ensemble(native=True)``: the static and recurrent tasks' default (``--autograd-step`` forces
the autograd step; ``train_ensemble``'s own default stays the autograd step). The recurrent step
has the same conditions, with no unit hooks at all (its NAC and NALU models have none) and no
clipping (``--clip`` keeps the autograd step).

Data made where it is used: where ``batch_fn`` names its :class:`~.uniform_stream.UniformStream`
(the static and recurrent tasks' do; :func:`in_call_stream` says when it applies), the step does not
call ``batch_fn``: the batches are drawn inside the call, in the threads that train on them, from
the seeds' SFC64 states, with the targets in the same pass, exactly the values the stream would have
given, and the stream draws nothing ahead any more. The static step
(``nalu_cuda::static_ensemble_step_drawn``) draws each seed's batch ``(B, I)`` once, the recurrent one
(``nalu_cuda::recurrent_ensemble_step_drawn``) each seed's batch ``(B, T, I)`` once, and each trains the
seed's members of every op on it (where ``batch_fn`` would repeat it per op). Values the stream
had drawn already (the rest of a chunk, the chunk drawn ahead) are used first, through ``batch_fn``.
Where ``batch_fn`` names its :class:`~.counter_stream.CounterStream` instead (``--stream counter``:
:func:`in_kernel_counter_stream`), the static step (``nalu_cuda::static_ensemble_step_counter``)
computes each member's batch in the call from (seed, step, index), the stream's values to the bit
(and the CUDA kernel's: ``csrc/experiments/counter_draw.h`` is the one definition), eight inputs per
lane vector, with the targets from the same values. Otherwise (float64 models, a union of ranges,
a batch of an odd number of values, another ``batch_fn``) the step takes ``batch_fn``'s batches as
before.

On CUDA (the resident step, ``train_ensemble(resident=True, native=True)``, which the static task
runs on a GPU): :func:`native_resident_step` takes the gradient from ``nalu_cuda::static_ensemble_grad``'s
CUDA kernel (``csrc/experiments/cuda/ensemble_step_kernels.cu``, one block per member) instead of
autograd, then FlatAdam's resident CUDA step and the projection: three launches and nothing read
back, which ``graph=True`` captures as one CUDA graph. Where ``batch_fn`` names its
:class:`~.counter_stream.CounterStream` (:func:`in_kernel_counter_stream`), the kernel
(``static_ensemble_grad_counter``) draws the batch itself: each input is computed from (seed, step,
index) where the kernel reads it and never stored, the targets in the same pass, the same bits as
the stream's. Its numbers are the autograd resident step's to float rounding (``python_tests/test_native_step_cuda.py``; its kernel is checked on the CUDA
emulator without a GPU).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

import nalu_cuda
from nalu_cuda import _ops

__all__ = ["NATIVE_MODELS", "RECURRENT_NATIVE_MODELS", "native_step", "native_resident_step", "model_layers",
           "recurrent_layers", "in_call_stream", "in_kernel_counter_stream"]

# The devices whose resident step takes static_ensemble_grad (a test adds "cpu", whose kernel does
# the same work, to check the step's logic without a GPU).
RESIDENT_NATIVE_DEVICES = ("cuda",)
# model name -> the layer classes of its two layers
NATIVE_MODELS = {"nac": ("NAC", "NAC"), "nalu": ("NALU", "NALU"), "nmu": ("NAU", "NMU")}
# the recurrent task's models (RecurrentNet): model name -> the class of its cell and output layer
RECURRENT_NATIVE_MODELS = {"nac": "NAC", "nalu": "NALU"}


def _native_layer(layer, cls: str) -> bool:
    """``layer`` is a ``nalu_cuda.<cls>`` the native steps implement: not ``backend="reference"``; a
    NALU with tied weights, an input gate, no gate bias and no kept parts."""
    if type(layer) is not getattr(nalu_cuda, cls) or layer.backend == "reference":
        return False
    return cls != "NALU" or (layer.tied and layer.gate == "input" and layer.G_bias is None and not layer.keep_parts)


def model_layers(model) -> Optional[Tuple[str, list]]:
    """``(name, [first, second])`` for a static model the native step implements, else None."""
    name = getattr(model, "model", None)
    net = getattr(model, "net", None)
    if name not in NATIVE_MODELS or not isinstance(net, torch.nn.Sequential) or len(net) != 2:
        return None
    layers = list(net)
    if not all(_native_layer(layer, cls) for layer, cls in zip(layers, NATIVE_MODELS[name])):
        return None
    return name, layers


def recurrent_layers(model) -> Optional[Tuple[str, list]]:
    """``(name, [cell, out])`` for a :class:`~.arithmetic_models.RecurrentNet` the native recurrent
    step implements (one learned state ``h0`` ``(E, 1, H)``, a cell ``I + H -> H``, an output layer
    ``H -> 1``), else None."""
    from .arithmetic_models import RecurrentNet

    name = getattr(model, "model", None)
    if type(model) is not RecurrentNet or name not in RECURRENT_NATIVE_MODELS:
        return None
    cell, out, H = model.cell, model.out, model.hidden
    if not (_native_layer(cell, RECURRENT_NATIVE_MODELS[name]) and _native_layer(out, RECURRENT_NATIVE_MODELS[name])):
        return None
    if (tuple(model.h0.shape) != (model.ensemble, 1, H) or cell.out_features != H or cell.in_features <= H
            or (out.in_features, out.out_features) != (H, 1)):
        return None
    return name, [cell, out]


def _hooked(model) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in model.modules()) or any(p._backward_hooks for p in model.parameters())


def _units_match(name: str, model, units) -> bool:
    """The trainer's unit hooks are those the native step implements for ``name``: none (NAC, NALU);
    the NMU model's regulariser and projection as :func:`.arithmetic_models.training_hooks` built them."""
    if units.clip_value is not None or units.reinit is not None or units.regularizer_steps:
        return False
    if name != "nmu":
        return units.regularizer is None and units.project is None
    reg_ok = units.regularizer is None or getattr(units.regularizer, "native_sparsity", (None,))[0] is model
    return reg_ok and getattr(units.project, "native_projection", None) is model


def _plain_adam(opt, E: int) -> bool:
    """Whether ``opt``'s fused CPU step applies with one learning rate for every member and no clip:
    the optimiser step the native training steps run inside their call (they take neither)."""
    fused = opt._native_step(E)
    return fused is not None and fused[2] is None and fused[3] == 0.0


def _trains_exactly(model, opt) -> bool:
    """``opt`` trains exactly ``model``'s parameters, in float32 or float64, and no hook sees them."""
    params = list(model.parameters())
    return (opt.flat.dtype in (torch.float32, torch.float64) and not _hooked(model) and len(params) == len(opt.params)
            and all(a is b for a, b in zip(params, opt.params)))


def _overridden(training, base: type, step_hook: str) -> bool:
    """Whether ``training``'s class overrides one of the trainer's hooks a native step replaces."""
    return any(getattr(type(training), hook) is not getattr(base, hook)
               for hook in ("training_loss", "loss_penalty", "clip_gradients", "after_step", "gradients", step_hook))


def _model_eps(name: str, layers) -> Optional[float]:
    """The NALU's eps (one for both layers, else None: the native steps take one), 0 for the others."""
    eps = float(getattr(layers[0], "eps", 0.0))
    return None if name == "nalu" and layers[1].eps != eps else eps


def native_step(training, base: type) -> Optional[Callable[[int], None]]:
    """The native step of an :class:`~.training.EnsembleTraining` (a function of the step), or None
    where it does not apply (see the module docstring). ``base`` is ``EnsembleTraining`` itself
    (passed in, so that this module does not import the trainer that imports it): a subclass
    that overrides one of its step hooks keeps the autograd step."""
    from .optim import FlatAdam

    o, model, opt, E = training.options, training.model, training.opt, training.E
    found, kernel = model_layers(model), "static_ensemble_step"
    if found is None:
        found, kernel = recurrent_layers(model), "recurrent_ensemble_step"
    if (found is None or not o.step.native or o.step.resident or o.data.batch_fn is None or type(opt) is not FlatAdam
            or not _ops.has_kernel("cpu", kernel) or getattr(model, "ensemble", None) != E):
        return None
    name, layers = found
    if (opt.flat.device.type != "cpu" or not _trains_exactly(model, opt) or not _plain_adam(opt, E)
            or not _units_match(name, model, o.units)):
        return None
    if _overridden(training, base, "eager_step"):
        return None
    eps = _model_eps(name, layers)
    if eps is None:
        return None
    segments = opt._native_step(E)[1]
    if kernel == "recurrent_ensemble_step":
        return _recurrent_step(training, name, eps, segments)
    schedule = getattr(o.units.regularizer, "native_sparsity", (None, None))[1]
    op = torch.ops.nalu_cuda.static_ensemble_step
    stream, draw = in_call_stream(o.data.batch_fn, opt.flat.dtype, E)
    counter = in_kernel_counter_stream(o.data.batch_fn, opt.flat, E, "static_ensemble_step_counter")
    training.batch_in_kernel = counter is not None

    def step(k: int) -> None:
        weight = float(schedule.weight(k)) if schedule is not None else 0.0
        opt.step_count += 1
        words = stream.draw_words() if draw is not None else None
        if counter is not None:  # the counter stream's batch of step k, drawn in the call
            c = counter
            loss = torch.ops.nalu_cuda.static_ensemble_step_counter(
                c["keys"], k, c["masks"], c["ops"], c["lo"], c["hi"], c["batch"], opt.flat, opt.grad, opt.exp_avg,
                opt.exp_avg_sq, segments, training.diverged, training.any_diverged, name, eps, weight, opt.lr,
                opt.beta1, opt.beta2, opt.eps, opt.step_count)
        elif words is not None:  # the batch drawn in the call, as the stream would have drawn it
            loss = torch.ops.nalu_cuda.static_ensemble_step_drawn(
                words, draw["weights"], draw["ops"], draw["lo"], draw["hi"], draw["raw"], draw["batch"], opt.flat,
                opt.grad, opt.exp_avg, opt.exp_avg_sq, segments, training.diverged, training.any_diverged, name, eps,
                weight, opt.lr, opt.beta1, opt.beta2, opt.eps, opt.step_count)
        else:
            x, target = o.data.batch_fn(k)
            loss = op(x.contiguous(), target.contiguous(), opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq, segments,
                      training.diverged, training.any_diverged, name, eps, weight, opt.lr, opt.beta1, opt.beta2,
                      opt.eps, opt.step_count)
        training.loss_acc.add_(loss.double())

    return step


def native_resident_step(training, base: type) -> Optional[Callable[[Optional[int]], None]]:
    """The static task's resident step on CUDA as native kernels (a function of the step, None
    under a CUDA graph), or None where it does not apply: :meth:`~.training.EnsembleTraining.resident_step`
    for the models of :data:`NATIVE_MODELS` with the gradient from ``nalu_cuda::static_ensemble_grad``'s
    CUDA kernel (one block per member: the forward through both layers, the MSE, the objective's
    finiteness, the backward into the flat gradient buffer) instead of autograd, then FlatAdam's
    resident step (``flat_adam_step_resident``) and, for the NMU model, the projection. Nothing is
    read back to the host, so ``graph=True`` captures the whole step as one CUDA graph. The same
    conditions as :func:`native_step` (on CUDA, with the CUDA kernels built; a NMU model's regulariser
    schedule needs the step, so under a graph it keeps the autograd step, as the trainer's graph
    does); ``python_tests/test_native_step_cuda.py`` tests it against the autograd resident step."""
    from .optim import FlatAdam

    o, model, opt, E = training.options, training.model, training.opt, training.E
    found = model_layers(model)
    dev = opt.flat.device.type
    if (found is None or not o.step.native or not o.step.resident or o.data.batch_fn is None
            or type(opt) is not FlatAdam or getattr(model, "ensemble", None) != E or dev not in RESIDENT_NATIVE_DEVICES
            or not _ops.has_kernel(dev, "static_ensemble_grad")):
        return None
    name, layers = found
    if not _trains_exactly(model, opt) or not _units_match(name, model, o.units):
        return None
    schedule = getattr(o.units.regularizer, "native_sparsity", (None, None))[1]
    eps = _model_eps(name, layers)
    if eps is None or _overridden(training, base, "resident_step") or (o.step.graph and schedule is not None):
        return None
    segments = opt.member_segments(E)  # on the host: the kernel's launch arguments
    project = o.units.project
    op = torch.ops.nalu_cuda.static_ensemble_grad
    counter = in_kernel_counter_stream(o.data.batch_fn, opt.flat, E)
    training.batch_in_kernel = counter is not None

    def step(k: Optional[int]) -> None:
        weight = float(schedule.weight(k)) if schedule is not None else 0.0
        if counter is not None:  # the batch drawn inside the kernel, never stored
            c = counter
            loss = torch.ops.nalu_cuda.static_ensemble_grad_counter(
                c["keys"], training.data_step, c["masks"], c["ops"], c["lo"], c["hi"], c["batch"], opt.flat, opt.grad,
                segments, training.diverged, name, eps, weight)
        else:
            x, target = o.data.batch_fn(training.data_step)
            loss = op(x.contiguous(), target.contiguous(), opt.flat, opt.grad, segments, training.diverged, name, eps,
                      weight)
        training.diverged.bitwise_or_(opt.step_resident(training.diverged))
        if project is not None:
            with torch.no_grad():
                project()
        training.loss_acc.add_(loss.double())
        training.data_step.add_(1)

    return step


def in_kernel_counter_stream(batch_fn, flat: torch.Tensor, E: int,
                             op: str = "static_ensemble_grad_counter") -> Optional[dict]:
    """The arguments of ``op`` (``static_ensemble_grad_counter``, the resident step's;
    ``static_ensemble_step_counter``, the CPU step's) where ``batch_fn`` names the
    :class:`~.counter_stream.CounterStream` it draws from (``batch_fn.counter_stream``, as the static
    task sets it) and the kernel can draw its batch itself: float32, one interval, inputs ``(B, I)``
    with subset masks and target ops for ``E = S * len(ops)`` members, the stream and ``op``'s
    kernel on the parameters' device. Else None (``batch_fn``'s batches are used)."""
    from .counter_stream import CounterStream
    from .uniform_stream import TARGET_OP_CODES

    stream = getattr(batch_fn, "counter_stream", None)
    if (type(stream) is not CounterStream or flat.dtype != torch.float32 or len(stream.range.intervals) != 1
            or len(stream.shape) != 2 or stream.masks is None or not stream.ops
            or any(op not in TARGET_OP_CODES for op in stream.ops) or stream.keys.shape[0] * len(stream.ops) != E
            or stream.keys.device != flat.device or not _ops.has_kernel(flat.device.type, op)):
        return None
    lo, hi = stream.range.intervals[0]
    return {"keys": stream.keys, "masks": stream.masks, "ops": [TARGET_OP_CODES.index(op) for op in stream.ops],
            "lo": float(lo), "hi": float(hi), "batch": stream.shape[0]}


def _recurrent_step(training, name: str, eps: float, segments: torch.Tensor) -> Callable[[int], None]:
    """The recurrent task's native step: drawn in the call where ``batch_fn`` names its stream
    (:func:`in_call_stream`, ``nalu_cuda::recurrent_ensemble_step_drawn``: each seed's batch once,
    its members of every op trained on it), else ``batch_fn``'s ``x`` ``(E, B, T, I)`` (or
    ``(B, T, I)``, the same for every member) and targets ``(E, B, 1)``."""
    o, opt, E = training.options, training.opt, training.E
    op = torch.ops.nalu_cuda.recurrent_ensemble_step
    stream, draw = in_call_stream(o.data.batch_fn, opt.flat.dtype, E, recurrent=True)

    def step(k: int) -> None:
        opt.step_count += 1
        words = stream.draw_words() if draw is not None else None
        if words is not None:  # the batch drawn in the call, as the stream would have drawn it
            loss = torch.ops.nalu_cuda.recurrent_ensemble_step_drawn(
                words, draw["weights"], draw["ops"], draw["lo"], draw["hi"], draw["raw"], draw["batch"],
                draw["length"], opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq, segments, training.diverged,
                training.any_diverged, name, eps, opt.lr, opt.beta1, opt.beta2, opt.eps, opt.step_count)
        else:
            x, target = o.data.batch_fn(k)
            if x.dim() == 3:
                x = x.unsqueeze(0).expand(E, *x.shape)
            loss = op(x.contiguous(), target.contiguous(), opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq, segments,
                      training.diverged, training.any_diverged, name, eps, opt.lr, opt.beta1, opt.beta2, opt.eps,
                      opt.step_count)
        training.loss_acc.add_(loss.double())

    return step


def in_call_stream(batch_fn, dtype: torch.dtype, E: int, recurrent: bool = False):
    """``(stream, draw)`` where the native step can draw ``batch_fn``'s batches itself: ``batch_fn``
    names its :class:`~.uniform_stream.UniformStream` (attribute ``uniform_stream``, as the static
    and recurrent tasks' do), the model is float32 (the stream's dtype), the ensemble is the
    stream's seeds times its ops, the stream allows it
    (:meth:`~.uniform_stream.UniformStream.in_call_draw`) and its inputs are the step's: ``(B, I)``
    for the static step, ``(B, T, I)`` for the recurrent one (``recurrent``); else ``(None, None)``:
    the step calls ``batch_fn``."""
    from .uniform_stream import UniformStream

    stream = getattr(batch_fn, "uniform_stream", None)
    kernel = "recurrent_ensemble_step_drawn" if recurrent else "static_ensemble_step_drawn"
    if not isinstance(stream, UniformStream) or dtype != torch.float32 or not _ops.has_kernel("cpu", kernel):
        return None, None
    draw = stream.in_call_draw()
    if draw is None or (draw["length"] is not None) != recurrent or len(stream.seeds) * len(draw["ops"]) != E:
        return None, None
    return stream, draw
