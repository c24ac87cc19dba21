"""torch.compile(fullgraph=True) of models built from the modules: no graph breaks, same results."""
import pytest
import torch

import nalu_cuda
from nalu_cuda.testing import assert_compiled_matches_eager, rand_input

from .conftest import DEVICES

pytestmark = pytest.mark.compile


class Stack(torch.nn.Module):
    """Every unit and variant in one graph: NAC -> NALU(tied, input gate) -> NALU(separate,
    independent gate) -> NACMul, as an ensemble of 3."""

    def __init__(self, E=3):
        super().__init__()
        self.nac = nalu_cuda.NAC(8, 6, ensemble=E)
        self.nalu = nalu_cuda.NALU(6, 4, ensemble=E)
        self.nalu2 = nalu_cuda.NALU(4, 20, tied=False, gate="independent", ensemble=E)
        self.mul = nalu_cuda.NACMul(20, 2, ensemble=E)

    def forward(self, x):
        return self.mul(self.nalu2(self.nalu(self.nac(x)).abs() + 0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_backward(device):
    model = Stack().to(device).double()
    for p in model.parameters():  # keep exp() of the multiplicative paths modest
        p.data.mul_(0.5)
    x = rand_input((3, 16, 8), device=device)
    assert_compiled_matches_eager(model, x)
    # and the fused ops are really in the graph (not the reference fallback)
    assert all(m.use_fused(x) for m in (model.nac, model.nalu))
