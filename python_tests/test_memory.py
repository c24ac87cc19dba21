"""Peak memory of a fused training step against the eager reference's (issue 11, memory item).

Each step runs in a fresh process that reports how far its resident set peaks above where the
step starts (VmHWM, reset through /proc/self/clear_refs after a first, warm-up step, so that
one-off allocations of libraries do not count). glibc's mmap threshold is fixed at 1 MiB there,
so every batch-sized tensor (8 MiB) goes straight to the kernel and back when freed: the peak is
the largest set of tensors alive at once.
"""
import os
import subprocess
import sys

import pytest

STEP = """
import sys
import torch
import nalu_cuda

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

torch.manual_seed(0)
backend, gate, B, I, O = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
layer = nalu_cuda.NALU(I, O, gate=gate, backend=backend)
x = torch.rand(B, I) + 0.5
gy = torch.randn(B, O)
for step in range(2):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident set
    start = status("VmRSS:")
    layer(x).backward(gy)
    layer.zero_grad(set_to_none=True)
print(status("VmHWM:") - start)
"""


def _peak_bytes(backend, gate, B, I, O):
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
    out = subprocess.run([sys.executable, "-c", STEP, backend, gate, str(B), str(I), str(O)], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("gate", ["input", "independent"])
def test_fused_nalu_step_peaks_at_most_three_quarters_of_the_reference(gate):
    # B x O = 16384 x 128 float32: 8 MiB per batch-sized tensor; the BLAS path (O > 16).
    shape = (16384, 128, 128)
    fused = _peak_bytes("fused", gate, *shape)
    reference = _peak_bytes("reference", gate, *shape)
    assert fused <= 0.75 * reference, f"fused peak {fused / 2**20:.0f} MiB, reference {reference / 2**20:.0f} MiB"
