"""``--calls`` training steps of the recurrent task's native step at the decisive shape (E 200 =
2 ops x 100 seeds, B 128, T 10, I 10, H 2; float32 unless ``--dtype``; 1 thread), for counting
their instructions with callgrind, which is stable where timings on a shared machine are not.

``--data fixed`` (the default): ``nalu_cuda::recurrent_ensemble_grad`` (the step but Adam) on one
fixed batch; only the op's own kernel (grad_impl) is counted:

    valgrind --tool=callgrind --toggle-collect='*::grad_impl(*' \\
        python benchmarks/count_recurrent_step.py nalu
    # 'Collected' on valgrind's last line: instructions of --calls calls

``--data stream``: each step the task's data as its ``batch_fn`` made it before the in-call draw
(the SFC64 stream's next batch and targets, chunk 8, no background thread, x repeated for the
second op) and ``nalu_cuda::recurrent_ensemble_step``; ``--data drawn``: each step
``nalu_cuda::recurrent_ensemble_step_drawn`` (the batch and targets drawn in the call, once per
seed). Count the whole process twice and take the difference per step (the Python work of the
stream included), e.g.

    PYTHONHASHSEED=0 valgrind --tool=callgrind python benchmarks/count_recurrent_step.py nac --data drawn --calls 8
    PYTHONHASHSEED=0 valgrind --tool=callgrind python benchmarks/count_recurrent_step.py nac --data drawn --calls 24
    # (I refs at 24 - I refs at 8) / 16: instructions per step (callgrind_annotate on both: per function)

(``--toggle-collect`` on the drawn op's kernel does not work: the compiler inlines it into the op.)"""
from __future__ import annotations

import argparse

import torch

from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts.arithmetic_models import build_recurrent_model, member_generators
from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.parts.uniform_stream import SumTargets, UniformStream

OPS, S, B, T, I, H = ("add", "sub"), 100, 128, 10, 10, 2
E = len(OPS) * S


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=["nac", "nalu"])
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--data", choices=["fixed", "stream", "drawn"], default="fixed")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    if args.data != "fixed" and dtype != torch.float32:
        ap.error("--data stream and drawn train float32 models (the stream's dtype)")
    model = build_recurrent_model(args.model, I, H, ensemble=E)
    model.reset_parameters(member_generators(list(range(E))))
    model = model.to(dtype)
    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E)
    segments = opt._native_step(E)[1]
    eps = float(getattr(model.cell, "eps", 0.0))
    diverged = torch.zeros(E, dtype=torch.bool)
    if args.data == "fixed":
        g = torch.Generator().manual_seed(0)
        x = (torch.rand(E, B, T, I, generator=g, dtype=torch.float64) + 1).to(dtype)
        t = x[..., 0].sum(-1, keepdim=True) + x[..., 1].sum(-1, keepdim=True)
        for _ in range(args.calls):
            torch.ops.nalu_cuda.recurrent_ensemble_grad(x, t, opt.flat, opt.grad, segments, diverged, args.model, eps)
        return 0
    seeds = list(range(S))
    masks = torch.stack([ar.subset_layout(s, I).mask() for s in seeds])
    stream = UniformStream(seeds, (B, T, I), ar.parse_range([1, 2]), chunk=8,
                           transform=SumTargets(masks.numpy(), list(OPS)))
    draw = stream.in_call_draw()
    buffers = (opt.flat, opt.grad, opt.exp_avg, opt.exp_avg_sq, segments, diverged, False, args.model, eps)
    for step in range(1, args.calls + 1):
        adam = (opt.lr, opt.beta1, opt.beta2, opt.eps, step)
        if args.data == "stream":
            x, t = stream.next()
            torch.ops.nalu_cuda.recurrent_ensemble_step(x.repeat(len(OPS), 1, 1, 1), t, *buffers, *adam)
        else:
            torch.ops.nalu_cuda.recurrent_ensemble_step_drawn(
                stream.draw_words(), draw["weights"], draw["ops"], draw["lo"], draw["hi"], draw["raw"], B, T,
                *buffers, *adam)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
