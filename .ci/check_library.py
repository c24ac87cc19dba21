"""Smoke check of a native library loaded through NALU_CUDA_LIBRARY (the CMake build):
every op is registered and the fused layers match the reference. Used by .ci/run."""
import os
import sys

import torch

import nalu_cuda
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_input, rand_params


def main() -> int:
    assert os.environ.get("NALU_CUDA_LIBRARY"), "set NALU_CUDA_LIBRARY to the library to check"
    assert nalu_cuda.has_extension(), "library not loaded"
    for name in nalu_cuda._ops.OP_NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"nalu_cuda::{name}", "CPU"), name
    for E, O in [(None, 2), (3, 20)]:
        lead = () if E is None else (E,)
        x = rand_input(lead + (16, 5))
        params = [rand_params(lead + (5, O)).requires_grad_() for _ in range(3)]
        y = nalu_cuda.functional.nalu(x, *params)
        y.sum().backward()
        grads = [p.grad.clone() for p in params]
        ref = [p.detach().clone().requires_grad_() for p in params]
        y_ref = R.nalu(x, *ref)
        y_ref.sum().backward()
        torch.testing.assert_close(y, y_ref)
        for g, p in zip(grads, ref):
            torch.testing.assert_close(g, p.grad)
    print(f"ok: {os.path.basename(os.environ['NALU_CUDA_LIBRARY'])} matches the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
