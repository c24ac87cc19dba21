"""Checks that the installed nalu_cuda was built with its CUDA kernels (for CI; no GPU needed).

    python .ci/check_cuda_build.py
    NALU_CUDA_LIBRARY=build-cmake/libnalu_cuda_ops.so python .ci/check_cuda_build.py   # CMake build

Imports nalu_cuda with NALU_CUDA_REQUIRE_EXT=1 (a missing or broken extension is an error, not a
fallback to the reference path), then asserts that the build reports CUDA and that every op of the
schema (csrc/ops/*/schema.cpp, csrc/experiments/schema.cpp) has a kernel for the CUDA dispatch key, and, the layer ops, for CPU,
Autograd (forward ops) and AutocastCUDA. Exits non-zero with the list of what is missing.
"""
from __future__ import annotations

import os
import sys


def main() -> int:
    os.environ["NALU_CUDA_REQUIRE_EXT"] = "1"
    import torch

    try:
        import nalu_cuda
    except ModuleNotFoundError:  # not installed: use the checkout (an in-place build)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import nalu_cuda
    from nalu_cuda import _ops

    info = nalu_cuda.build_info()
    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} has no CUDA (torch.version.cuda is None)")
    if "library" in info:
        # Loaded from NALU_CUDA_LIBRARY (the CMake build): no build info; the kernels below decide.
        print(f"library {info['library']} (NALU_CUDA_LIBRARY): checking its registered kernels only")
    elif info.get("cuda") is not True:
        problems.append(f"nalu_cuda.build_info()['cuda'] is {info.get('cuda')!r}, expected True (build: {info})")

    # Every op the library defines, not only the names the Python side knows about.
    schema_ops = sorted(
        s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("nalu_cuda::")
    )
    known = set(_ops.OP_NAMES) | set(_ops.TRAINING_OP_NAMES)
    if sorted(set(schema_ops)) != sorted(known):
        problems.append(f"ops in the schema {sorted(set(schema_ops))} differ from nalu_cuda._ops.OP_NAMES + "
                        f"TRAINING_OP_NAMES {sorted(known)}")
    forward_ops = {"nac_weight", "nac_forward", "nac_mul_forward", "nalu_forward"}
    for op in sorted(set(schema_ops) | known):
        if op in _ops.TRAINING_OP_NAMES:
            # each for its devices: flat_adam_step_resident CUDA (FlatAdam uses tensor ops elsewhere),
            # the static and recurrent steps CPU (static_ensemble_*, recurrent_ensemble_*, the in-call
            # draws static_ensemble_step_drawn and recurrent_ensemble_step_drawn included; on CUDA the
            # resident step; the ensemble LSTM lstm_sequence_*, whose CUDA version is torch ops), the
            # static gradient step both (static_ensemble_grad) and its in-kernel draw CUDA only
            keys = ["CPU"] if op.startswith(("static_ensemble_", "recurrent_ensemble_", "lstm_sequence_")) else ["CUDA"]
            keys = {"static_ensemble_grad": ["CPU", "CUDA"], "static_ensemble_grad_counter": ["CUDA"]}.get(op, keys)
        else:
            keys = ["CUDA", "CPU", "AutocastCUDA"] + (["Autograd"] if op in forward_ops else [])
        for key in keys:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"nalu_cuda::{op}", key):
                problems.append(f"nalu_cuda::{op} has no {key} kernel")
    if not nalu_cuda.has_cuda_kernels():
        problems.append("nalu_cuda.has_cuda_kernels() is False")
    cuda_dtypes = sorted(str(dt) for dev, dt in _ops.KERNEL_DTYPES if dev == "cuda")
    want = sorted(str(dt) for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16))
    if cuda_dtypes != want:
        problems.append(f"KERNEL_DTYPES for cuda is {cuda_dtypes}, expected {want}")

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), nalu_cuda build {info}")
    print(f"ops: {', '.join(schema_ops)}")
    print(f"GPU visible: {torch.cuda.is_available()}")
    if problems:
        print("FAILED:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("OK: every nalu_cuda op has CUDA, CPU and autocast kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
