"""Helpers shared by the test suite and the benchmarks: which devices and dtypes to run on, and
how to draw inputs that keep every check meaningful.

* ``devices()``: "cpu", plus "cuda" when a GPU is visible and the CUDA kernels are built.
* ``dtypes(device)``: the dtypes the fused kernels take on that device.
* ``rand_input``: values bounded away from 0 (finite differences across |x| = 0 are meaningless)
  with random signs; ``rand_params``: weights scaled so exp() of the multiplicative path stays
  finite (an inf on both sides would "match").
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _ops

__all__ = ["devices", "dtypes", "rand_input", "rand_params", "tolerances", "TOLERANCES", "GRAD_TOLERANCES",
           "assert_compiled_matches_eager", "run_reference_and_fused"]

# (rtol, atol) for fused-vs-reference comparisons of one-input layers, per dtype (values, then
# gradients). Use ``tolerances(dtype, fan_in)``: both sides round a sum over the I inputs in a
# different order, so the float32 bounds grow with I.
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
}
GRAD_TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-9, 1e-11),
    torch.float32: (1e-4, 1e-5),
}


def tolerances(dtype: torch.dtype, fan_in: int = 1, *, grad: bool = False) -> Tuple[float, float]:
    """(rtol, atol) for comparing a fused result with the reference for a layer with ``fan_in`` inputs.

    The reference and the kernels sum the I products (or I logs, before exp()) in different orders;
    in float32 that reordering alone moves a result by a few ulps of the largest partial sum, which
    relative to a result that nearly cancels is far more than 1e-5 once I reaches ~100. The
    relative tolerance stays (1e-5 for values, 1e-4 for gradients); the absolute floor, which only
    matters for such small results, grows with I. float64 has margin to spare and is not scaled.
    """
    rtol, atol = (GRAD_TOLERANCES if grad else TOLERANCES)[dtype]
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        atol = atol * max(1.0, fan_in / 16.0)
    return rtol, atol


def devices() -> List[str]:
    out = ["cpu"]
    if torch.cuda.is_available() and _ops.has_kernel("cuda"):
        out.append("cuda")
    return out


def dtypes(device: str) -> List[torch.dtype]:
    return sorted({dt for dev, dt in _ops.KERNEL_DTYPES if dev == device}, key=str)


def rand_input(shape: Sequence[int], *, dtype=torch.float64, device="cpu", low: float = 0.5, high: float = 1.5,
               generator: Optional[torch.Generator] = None) -> Tensor:
    """Uniform magnitudes in [low, high] with random signs."""
    mag = torch.rand(*shape, dtype=dtype, generator=generator) * (high - low) + low
    sign = torch.randint(0, 2, tuple(shape), generator=generator).to(dtype) * 2 - 1
    return (mag * sign).to(device)


def rand_params(shape: Sequence[int], *, scale: float = 0.5, dtype=torch.float64, device="cpu",
                generator: Optional[torch.Generator] = None) -> Tensor:
    """Normal weights times ``scale`` (|W| = |tanh * sigmoid| < 1 keeps exp(lx W) modest)."""
    return (torch.randn(*shape, dtype=dtype, generator=generator) * scale).to(device)


def assert_compiled_matches_eager(model: torch.nn.Module, x: torch.Tensor) -> None:
    """``torch.compile(model, fullgraph=True)`` (no graph break allowed) gives the eager output and
    the eager parameter gradients of ``sum(y ** 2)``."""
    torch._dynamo.reset()
    y_c = torch.compile(model, fullgraph=True)(x)
    y_c.square().sum().backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_e = model(x)
    y_e.square().sum().backward()
    torch.testing.assert_close(y_c, y_e)
    for g_c, p in zip(grads_c, model.parameters()):
        torch.testing.assert_close(g_c, p.grad)


def run_reference_and_fused(ref_fn, fused_fn, args: Sequence[torch.Tensor], **kwargs):
    """``ref_fn`` and ``fused_fn`` on copies of ``args`` (leaves that require grad), each
    back-propagated from the same random ``grad_y``; returns ``(y_ref, y_fused, ref_args,
    fused_args)`` (the gradients in ``.grad``)."""
    a = [t.detach().clone().requires_grad_() for t in args]
    b = [t.detach().clone().requires_grad_() for t in args]
    y_ref = ref_fn(*a, **kwargs)
    y_fused = fused_fn(*b, **kwargs)
    gy = torch.randn_like(y_ref)
    (y_ref * gy).sum().backward()
    (y_fused * gy).sum().backward()
    return y_ref, y_fused, a, b
