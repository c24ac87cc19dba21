"""The experiments' op (``csrc/experiments/``, kind "training", not a layer): the fake of
``flat_adam_step_resident``, the resident Adam step of ``experiments.parts.optim.FlatAdam``, a CUDA
kernel only (``csrc/experiments/cuda/flat_adam_cuda.cpp``; other devices get an error, FlatAdam
tensor ops). No wrapper: FlatAdam calls the op itself.
"""
from __future__ import annotations

import torch

from . import _common


def _register_fakes() -> None:
    @torch.library.register_fake("nalu_cuda::flat_adam_step_resident")
    def _(param, grad, exp_avg, exp_avg_sq, segments, frozen, step_t, lr, beta1, beta2, eps):
        return frozen.new_empty(frozen.shape, dtype=torch.bool)


if _common.ops is not None and torch._C._jit_get_schemas_for_operator("nalu_cuda::flat_adam_step_resident"):
    _register_fakes()  # (a library built before the op has none)
