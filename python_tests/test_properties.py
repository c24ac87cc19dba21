"""Property-based tests: the fused ops against the reference over shapes (zero sizes and ensembles
included), dtypes, gates, tied and separate weights, and inputs from zero to large magnitudes.

Errors are measured normwise (the largest error against the largest value of the result), since
a sum over inputs of mixed sign and magnitudes up to 1e6 can cancel to anything. The float32
bound is the flash-attention rule: the fused op may be at most about twice as far from a float64
evaluation of the reference as the float32 reference itself is.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nalu_cuda import functional as F
from nalu_cuda import reference as R
from nalu_cuda.testing import rand_params

from .test_ops import UNITS

PROFILE = settings(max_examples=60, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    unit = draw(st.sampled_from(list(UNITS)))
    E = draw(st.one_of(st.none(), st.integers(1, 3)))
    batch = tuple(draw(st.lists(st.integers(0, 5), min_size=0 if E is None else 1, max_size=2)))
    I = draw(st.integers(1, 12))
    O = draw(st.integers(1, 20))  # O <= 16 takes the rowwise path, wider the BLAS path
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    # |x| = 10^U(lo, hi) with random signs, a share of exact zeros.
    lo = draw(st.integers(-6, 6))
    hi = draw(st.integers(lo, 6))
    zeros = draw(st.sampled_from([0.0, 0.2, 1.0]))
    eps = draw(st.sampled_from([1e-7, 1e-3, 1e-10, 1e-40]))  # 1e-40: subnormal in float32
    seed = draw(st.integers(0, 2**31 - 1))
    return unit, E, batch, I, O, dtype, (lo, hi, zeros), eps, seed


def make_inputs(unit, E, batch, I, O, dtype, values, eps, seed):
    lo, hi, zeros = values
    gen = torch.Generator().manual_seed(seed)
    lead = () if E is None else (E,)
    shape = lead + batch + (I,)
    x = 10 ** (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo)
    x = x * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    x = torch.where(torch.rand(shape, generator=gen) < zeros, 0.0, x)
    # Weights scaled so that |u| = |lx W_m| stays below ~40: exp(u) finite in float32 (an inf on
    # both sides would "match"). |W| <= |W_hat| for W = tanh(W_hat) sigmoid(M_hat).
    L = max(abs(torch.log(torch.tensor(eps))).item(), abs(torch.log(x.abs() + eps)).max().item() if x.numel() else 1)
    scale = min(0.5, 10.0 / (I * L))
    _, _, needs_g, sep, gate = UNITS[unit]
    args = [x, rand_params(lead + (I, O), scale=scale, generator=gen), rand_params(lead + (I, O), generator=gen)]
    kwargs = {"eps": eps} if unit != "nac" else {}
    if needs_g:
        # a gate logit x G of order 1 whatever the scale of x
        gscale = 1.0 / (I * 10.0 ** hi)
        args.append(rand_params(lead + ((I, O) if gate == "input" else (O,)), scale=gscale, generator=gen))
        if sep:
            args += [rand_params(lead + (I, O), scale=scale, generator=gen), rand_params(lead + (I, O), generator=gen)]
        kwargs["gate"] = gate
    return [t.to(dtype) for t in args], kwargs


def forward_backward(fn, args, kwargs, gy_seed):
    args = [t.detach().clone().requires_grad_() for t in args]
    y = fn(*args, **kwargs)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(gy_seed), dtype=torch.float64).to(y.dtype)
    grads = torch.autograd.grad(y, args, gy, allow_unused=True)
    return [y] + [torch.zeros_like(t) if g is None else g for g, t in zip(grads, args)]


def assert_normwise_close(got, ref_lo, ref_hi, dtype, what):
    assert got.shape == ref_hi.shape and got.dtype == dtype, what
    if got.numel() == 0:
        return
    got, ref_lo = got.double(), ref_lo.double()
    scale = ref_hi.abs().max().item()
    assert torch.isfinite(ref_hi).all(), what
    assert torch.isfinite(got).all(), what
    err = (got - ref_hi).abs().max().item()
    if dtype == torch.float64:
        bound = 1e-9 * scale + 1e-300
    else:
        bound = 2 * (ref_lo - ref_hi).abs().max().item() + 1e-5 * scale + 1e-30
    assert err <= bound, f"{what}: normwise error {err:.3g} > {bound:.3g} (largest |value| {scale:.3g})"


@PROFILE
@given(cases())
def test_fused_matches_reference_everywhere(case):
    unit, E, batch, I, O, dtype, values, eps, seed = case
    args, kwargs = make_inputs(*case)
    ref_fn, fused_fn = UNITS[unit][:2]
    got = forward_backward(fused_fn, args, kwargs, seed)
    ref_lo = forward_backward(ref_fn, args, kwargs, seed)
    ref_hi = forward_backward(ref_fn, [t.double() for t in args], kwargs, seed)
    names = ("y", "grad x", "grad W_hat", "grad M_hat", "grad G", "grad W_hat_m", "grad M_hat_m")
    for name, g, lo, hi in zip(names, got, ref_lo, ref_hi):
        assert_normwise_close(g, lo, hi, dtype, f"{name} of {unit} E={E} batch={batch} I={I} O={O} {dtype}")


@PROFILE
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.float64]), st.integers(1, 6), st.integers(1, 6))
def test_nac_weight_matches_reference(seed, dtype, rows, cols):
    gen = torch.Generator().manual_seed(seed)
    W, M = (rand_params((rows, cols), scale=3.0, generator=gen).to(dtype) for _ in range(2))
    torch.testing.assert_close(F.nac_weight(W, M), R.nac_weight(W, M))
