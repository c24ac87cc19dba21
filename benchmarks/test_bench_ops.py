"""pytest-benchmark cases for the NALU layer at the paper's shape (B=128, I=100, O=2):

    python -m pytest benchmarks/test_bench_ops.py --benchmark-only

Not part of the test suite (python_tests/); the full comparison with ratios, torch.compile and
the larger shapes is benchmarks/bench_ops.py.
"""
import pytest
import torch

import nalu_cuda
from nalu_cuda.testing import rand_input


@pytest.fixture(scope="module")
def layers():
    torch.set_num_threads(1)  # one thread: stable timings on a shared machine
    torch.manual_seed(0)
    fused = nalu_cuda.NALU(100, 2, backend="fused")
    ref = nalu_cuda.NALU(100, 2, backend="reference")
    ref.load_state_dict(fused.state_dict())
    x = rand_input((128, 100), dtype=torch.float32, low=1.0, high=2.0)
    dy = torch.randn(128, 2)
    torch.testing.assert_close(fused(x), ref(x), rtol=1e-5, atol=1e-6)
    return {"fused": fused, "reference": ref}, x, dy


@pytest.mark.parametrize("provider", ["fused", "reference"])
def test_forward(benchmark, layers, provider):
    mods, x, _ = layers
    with torch.no_grad():
        benchmark(mods[provider], x)


@pytest.mark.parametrize("provider", ["fused", "reference"])
def test_forward_backward(benchmark, layers, provider):
    mods, x, dy = layers

    def step():
        mods[provider](x).backward(dy)

    benchmark(step)
