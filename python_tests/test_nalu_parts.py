"""The intermediates of a NALU call (a, m, g) as differentiable outputs of the one fused forward,
and the optional gate bias g = sigmoid(x G + G_bias): values and gradients against the reference,
gradcheck, the module options (keep_parts, gate_bias)."""
import pytest
import torch

from nalu_cuda import NALU, functional, reference
from nalu_cuda.testing import rand_input, rand_params, tolerances

from .conftest import DEVICES

I, O, N, E = 5, 3, 7, 2

CASES = {
    "tied_input": dict(sep=False, gate="input", bias=False),
    "sep_input": dict(sep=True, gate="input", bias=False),
    "tied_independent": dict(sep=False, gate="independent", bias=False),
    "sep_input_bias": dict(sep=True, gate="input", bias=True),
    "tied_input_bias": dict(sep=False, gate="input", bias=True),
}


def _args(case, ensemble, dtype=torch.float64, device="cpu"):
    lead = (E,) if ensemble else ()
    mk = lambda *s: rand_params(lead + s, dtype=dtype, device=device).requires_grad_()  # noqa: E731
    W_hat, M_hat = mk(I, O), mk(I, O)
    W_hat_m, M_hat_m = (mk(I, O), mk(I, O)) if case["sep"] else (None, None)
    G = mk(I, O) if case["gate"] == "input" else mk(O)
    G_bias = mk(O) if case["bias"] else None
    x = rand_input(lead + (N, I), dtype=dtype, device=device).requires_grad_()
    return x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias


def _loss(y, a, m, g):
    """A loss that reaches every output on its own path (a gate regulariser, a path penalty, ...)."""
    return (y * y).sum() + 0.3 * (g * (1 - g)).sum() + (a.sin()).sum() + 0.1 * (m * m).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ensemble", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_parts_values_and_grads_match_the_reference(case, ensemble, device):
    c = CASES[case]
    for dtype in (torch.float64, torch.float32):
        x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias = _args(c, ensemble, dtype, device)
        leaves = [t for t in (x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias) if t is not None]
        outs = {}
        for name, fn in (("fused", functional.nalu_parts), ("ref", reference.nalu_parts)):
            res = fn(x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, c["gate"], G_bias=G_bias)
            grads = torch.autograd.grad(_loss(*res), leaves)
            outs[name] = (res, grads)
        rtol, atol = tolerances(dtype, I)
        for u, v in zip(outs["fused"][0], outs["ref"][0]):
            torch.testing.assert_close(u, v, rtol=rtol, atol=atol)
        rtol, atol = tolerances(dtype, I, grad=True)
        for u, v in zip(outs["fused"][1], outs["ref"][1]):
            torch.testing.assert_close(u, v, rtol=rtol, atol=atol)
        # y alone: nalu (with the bias) agrees with nalu_parts' y
        y = functional.nalu(x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, c["gate"], G_bias=G_bias)
        torch.testing.assert_close(y, outs["fused"][0][0], rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck(case):
    c = CASES[case]
    x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias = _args(c, ensemble=True)
    args = [t for t in (x, W_hat, M_hat, G, W_hat_m, M_hat_m, G_bias) if t is not None]

    def parts(*ts):
        it = iter(ts)
        x, W_hat, M_hat, G = next(it), next(it), next(it), next(it)
        W_hat_m, M_hat_m = (next(it), next(it)) if c["sep"] else (None, None)
        G_bias = next(it) if c["bias"] else None
        return functional.nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m, 1e-7, c["gate"], G_bias=G_bias)

    assert torch.autograd.gradcheck(parts, args)
    if c["bias"]:
        assert torch.autograd.gradcheck(lambda *ts: parts(*ts)[0], args)
    # create_graph=True through the parts: correct second derivatives, not a disconnected graph
    assert torch.autograd.gradgradcheck(parts, args)


def test_only_some_parts_get_gradients():
    """A loss on g alone (no gradient reaches y): the backward still runs, and matches the reference."""
    c = CASES["sep_input"]
    x, W_hat, M_hat, G, W_hat_m, M_hat_m, _ = _args(c, ensemble=False)
    got = torch.autograd.grad(functional.nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m)[3].sum(), [x, G, W_hat])
    want = torch.autograd.grad(reference.nalu_parts(x, W_hat, M_hat, G, W_hat_m, M_hat_m)[3].sum(), [x, G],
                               allow_unused=True)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v)
    assert torch.equal(got[2], torch.zeros_like(W_hat))  # g does not depend on W


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_module_keep_parts_and_gate_bias(backend):
    layer = NALU(I, O, tied=False, gate_bias=True, keep_parts=True, backend=backend, dtype=torch.float64)
    with torch.no_grad():
        layer.G_bias.copy_(rand_params((O,)))
    assert layer.parts is None and {n for n, _ in layer.named_parameters()} >= {"G_bias"}
    x = rand_input((N, I))
    y = layer(x)
    a, m, g = layer.parts
    torch.testing.assert_close(g, torch.sigmoid(x @ layer.G + layer.G_bias))
    torch.testing.assert_close(y, g * a + (1 - g) * m)
    (g * (1 - g)).sum().backward()  # a gate regulariser trains the gate and its bias
    assert layer.G.grad.abs().sum() > 0 and layer.G_bias.grad.abs().sum() > 0
    plain = NALU(I, O, tied=False, gate_bias=True, backend=backend, dtype=torch.float64)
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(plain(x), y, rtol=0, atol=0)
    assert plain.parts is None


def test_module_argument_errors():
    with pytest.raises(ValueError, match="nalu_cuda.NALU: argument 'gate_bias' needs gate='input'"):
        NALU(I, O, gate="independent", gate_bias=True)
    with pytest.raises(ValueError, match="nalu_cuda.NALU: argument 'keep_parts' must be a bool, got 1"):
        NALU(I, O, keep_parts=1)
    W_hat, M_hat, G = (rand_params((I, O)) for _ in range(3))
    with pytest.raises(ValueError, match=r"nalu_cuda.functional.nalu: argument 'G_bias' must have shape \[3\]"):
        functional.nalu(rand_input((N, I)), W_hat, M_hat, G, G_bias=torch.zeros(I))
    with pytest.raises(ValueError, match="argument 'G_bias' needs gate='input'"):
        reference.nalu(rand_input((N, I)), W_hat, M_hat, torch.zeros(O), gate="independent", G_bias=torch.zeros(O))


def test_compiles_fullgraph_with_parts_and_gate_bias():
    # aot_eager: the whole graph is traced (fullgraph) through the autograd.Function and the ops'
    # fakes, forward and backward; inductor's code generation (python_tests/test_compile.py runs it
    # on the plain path) would add about a minute on a small machine and test nothing of this.
    layer = NALU(I, O, tied=False, gate_bias=True, keep_parts=True, backend="fused", dtype=torch.float64)
    x = rand_input((N, I))

    def loss(x):
        y = layer(x)
        return (y * y).sum() + (layer.parts.g * (1 - layer.parts.g)).sum()

    want = loss(x)
    want_grads = torch.autograd.grad(want, list(layer.parameters()))
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(x)
    got_grads = torch.autograd.grad(got, list(layer.parameters()))
    torch.testing.assert_close(got, want)
    for u, v in zip(got_grads, want_grads):
        torch.testing.assert_close(u, v)


@pytest.mark.parametrize("device", DEVICES)
def test_parts_under_autocast_run_in_float32(device):
    low = torch.bfloat16
    layer = NALU(I, O, gate_bias=True, keep_parts=True, backend="fused").to(device)
    x = rand_input((N, I), dtype=torch.float32, device=device)
    with torch.autocast(device, dtype=low):
        y = layer(x.to(low))
    assert y.dtype == torch.float32 and all(t.dtype == torch.float32 for t in layer.parts)
    (y.sum() + layer.parts.g.sum()).backward()
    want = NALU(I, O, gate_bias=True, keep_parts=True, backend="reference").to(device)
    want.load_state_dict(layer.state_dict())
    y_want = want(x.to(low).float())
    (y_want.sum() + want.parts.g.sum()).backward()
    torch.testing.assert_close(y, y_want)
    for p, q in zip(layer.parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
