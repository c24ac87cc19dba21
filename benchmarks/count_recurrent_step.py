"""``--calls`` calls of the recurrent step's gradient kernel (``nalu_cuda::recurrent_ensemble_grad``,
the whole step but Adam) at the decisive shape (E 200, B 128, T 10, I 10, H 2; float32 unless
``--dtype``; 1 thread), for counting its instructions with callgrind, which is stable where
timings on a shared machine are not; only the op's own kernel (grad_impl) is counted:

    valgrind --tool=callgrind --toggle-collect='*::grad_impl(*' \\
        python benchmarks/count_recurrent_step.py nalu
    # 'Collected' on valgrind's last line: instructions of --calls calls"""
from __future__ import annotations

import argparse

import torch

from nalu_cuda.experiments.parts.arithmetic_models import build_recurrent_model, member_generators
from nalu_cuda.experiments.parts.optim import FlatAdam

E, B, T, I, H = 200, 128, 10, 10, 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=["nac", "nalu"])
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = build_recurrent_model(args.model, I, H, ensemble=E)
    model.reset_parameters(member_generators(list(range(E))))
    model = model.to(dtype)
    opt = FlatAdam(model.parameters(), 1e-3, ensemble=E)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(E, B, T, I, generator=g, dtype=torch.float64) + 1).to(dtype)
    t = x[..., 0].sum(-1, keepdim=True) + x[..., 1].sum(-1, keepdim=True)
    eps = float(getattr(model.cell, "eps", 0.0))
    for _ in range(args.calls):
        torch.ops.nalu_cuda.recurrent_ensemble_grad(x, t, opt.flat, opt.grad, opt._native_step(E)[1],
                                                    torch.zeros(E, dtype=torch.bool), args.model, eps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
