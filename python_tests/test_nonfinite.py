"""One NaN/inf semantics per op: the fused ops give what the reference (the specification) gives
for inputs holding NaN, +inf and -inf, in the output and in every gradient, element by element
(the NaN and inf masks equal, the finite values close), on the rowwise and the blas paths."""
import pytest
import torch

import nalu_cuda
from .conftest import DEVICES

LAYERS = {
    "nac": lambda I, O, **kw: nalu_cuda.NAC(I, O, **kw),
    "nac_mul": lambda I, O, **kw: nalu_cuda.NACMul(I, O, **kw),
    "nalu": lambda I, O, **kw: nalu_cuda.NALU(I, O, **kw),
    "nalu_sep_independent": lambda I, O, **kw: nalu_cuda.NALU(I, O, tied=False, gate="independent", **kw),
    "npu": lambda I, O, **kw: nalu_cuda.NPU(I, O, **kw),
    "real_npu": lambda I, O, **kw: nalu_cuda.RealNPU(I, O, **kw),
    "inalu": lambda I, O, **kw: nalu_cuda.INALU(I, O, **kw),
    "nau": lambda I, O, **kw: nalu_cuda.NAU(I, O, **kw),
    "nmu": lambda I, O, **kw: nalu_cuda.NMU(I, O, **kw),
}
SPECIALS = (float("nan"), float("inf"), float("-inf"))


def _forward_backward(layer, x, w):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * w).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _assert_same(got, want, what):
    for mask in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(mask(got), mask(want)), f"{what}: {mask.__name__} differs\nfused {got}\nreference {want}"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("O", [2, 20], ids=["rowwise", "blas"])
@pytest.mark.parametrize("unit", list(LAYERS))
def test_nonfinite_inputs_as_the_reference(unit, O, device):
    gen = torch.Generator().manual_seed(1234)
    I, N = 5, 12
    fused = LAYERS[unit](I, O, backend="fused", dtype=torch.float64).to(device)
    ref = LAYERS[unit](I, O, backend="reference", dtype=torch.float64).to(device)
    with torch.no_grad():
        for p in fused.parameters():  # small weights: exp() stays finite for finite inputs
            p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype).mul_(0.8).sub_(0.4))
    ref.load_state_dict(fused.state_dict())
    for trial in range(4):
        x = torch.rand(N, I, generator=gen, dtype=torch.float64).add_(0.5)
        x = x * torch.where(torch.rand(N, I, generator=gen) < 0.3, -1.0, 1.0).double()
        spots = torch.randperm(N * I, generator=gen)[: 2 + trial]
        for k, spot in enumerate(spots.tolist()):
            x.view(-1)[spot] = SPECIALS[(k + trial) % 3]
        x, w = x.to(device), torch.randn(N, O, generator=gen, dtype=torch.float64).to(device)
        for p, q in zip(fused.parameters(), ref.parameters()):
            p.grad = q.grad = None
        got, want = _forward_backward(fused, x, w), _forward_backward(ref, x, w)
        names = ["y", "grad x"] + [f"grad {n}" for n, _ in fused.named_parameters()]
        for name, g, r in zip(names, got, want):
            _assert_same(g, r, f"{unit} trial {trial}: {name}")
