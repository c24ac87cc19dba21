"""The ensemble layers and recurrent cells of the sequence tasks (``parts.layers``,
``parts.sequence_models``), their optimiser and best-state keeper: equal to PyTorch's own layers
member by member, members independent, optimizer equal to torch's Adam."""
import math

import pytest
import torch
from torch import nn

from nalu_cuda.experiments.parts.layers import EnsembleCNN, EnsembleLinear, ensemble_gather
from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.parts.seeding import member_generators
from nalu_cuda.experiments.parts.sequence_models import (EnsembleGRU, EnsembleLSTM, EnsembleUGRNN, RecurrentArithmetic,
                                                          final_states, frozen_states)
from nalu_cuda.experiments.parts.training import BestState
from nalu_cuda.experiments.stats import mean_ci


def _gens(E):
    return member_generators(range(E), "test/layers")


@pytest.mark.parametrize("ours, theirs", [(EnsembleLSTM, nn.LSTM), (EnsembleGRU, nn.GRU)], ids=["lstm", "gru"])
def test_cell_matches_torch_per_member(ours, theirs):
    E, I, H = 3, 4, 5
    ens = ours(I, H, ensemble=E)
    ens.reset_parameters(_gens(E))
    x = torch.randn(E, 2, 7, I)
    out = ens(x)
    for e in range(E):
        ref = theirs(I, H, batch_first=True)
        with torch.no_grad():
            ref.weight_ih_l0.copy_(ens.x2h.weight[e].T)
            ref.weight_hh_l0.copy_(ens.h2h.weight[e].T)
            ref.bias_ih_l0.copy_(ens.x2h.bias[e])
            if ens.h2h.bias is None:  # the LSTM's state-to-gates layer has no bias of its own
                ref.bias_hh_l0.zero_()
            else:
                ref.bias_hh_l0.copy_(ens.h2h.bias[e])
        assert torch.allclose(out[e], ref(x[e])[0], atol=1e-6)


def test_ugrnn_update_rule():
    ens = EnsembleUGRNN(2, 3, ensemble=1)
    ens.reset_parameters(_gens(1))
    x = torch.randn(1, 1, 2, 2)
    out = ens(x)
    h = torch.zeros(3)
    for t in range(2):
        z = x[0, 0, t] @ ens.x2h.weight[0] + ens.x2h.bias[0] + h @ ens.h2h.weight[0]
        c, g = torch.tanh(z[:3]), torch.sigmoid(z[3:])
        h = g * h + (1 - g) * c
        assert torch.allclose(out[0, 0, t], h, atol=1e-6)


def test_recurrent_nac_with_identity_weights_counts_exactly():
    """A recurrent NAC with W = [[I], [I]] is an exact accumulator at any length."""
    rec = RecurrentArithmetic(3, 3, ensemble=1, kind="nac")
    with torch.no_grad():
        eye = torch.eye(3)
        W = torch.cat([eye, eye])  # (in + out, out)
        rec.cell.W_hat.copy_(torch.where(W > 0, torch.tensor(20.0), torch.tensor(0.0)).unsqueeze(0))
        rec.cell.M_hat.copy_(torch.where(W > 0, torch.tensor(40.0), torch.tensor(-40.0)).unsqueeze(0))
    lab = torch.randint(3, (1, 2, 1000))
    x = torch.nn.functional.one_hot(lab, 3).double()
    rec.double()
    out = rec(x)[:, :, -1]
    assert torch.allclose(out, x.sum(2), atol=1e-6)


def test_masked_steps_keep_the_state():
    ens = EnsembleLSTM(3, 4, ensemble=2)
    ens.reset_parameters(_gens(2))
    x = torch.randn(2, 1, 5, 3)
    mask = torch.tensor([[[True, True, False, False, False]]]).expand(2, 1, 5)
    out = ens(x, mask)
    assert torch.equal(out[:, :, 1], out[:, :, 4])
    assert torch.allclose(out[:, :, 1], ens(x[:, :, :2])[:, :, 1])


@pytest.mark.parametrize("masked", [False, True], ids=["whole-sequence", "step-by-step"])
def test_lstm_gradients_match_torch_per_member(masked):
    """The LSTM's written-out backward (whole sequence unmasked, one step at a time masked) gives
    torch's gradients."""
    E, I, H, T = 2, 3, 4, 6
    ens = EnsembleLSTM(I, H, ensemble=E).double()
    ens.reset_parameters(_gens(E))
    x = torch.randn(E, 2, T, I, dtype=torch.double, requires_grad=True)
    out = ens(x, torch.ones(E, 2, T, dtype=torch.bool) if masked else None)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), [x, ens.x2h.weight, ens.h2h.weight, ens.x2h.bias])
    for e in range(E):
        ref = nn.LSTM(I, H, batch_first=True).double()
        with torch.no_grad():
            ref.weight_ih_l0.copy_(ens.x2h.weight[e].T)
            ref.weight_hh_l0.copy_(ens.h2h.weight[e].T)
            ref.bias_ih_l0.copy_(ens.x2h.bias[e])
            ref.bias_hh_l0.zero_()
        xe = x[e].detach().requires_grad_()
        want = torch.autograd.grad((ref(xe)[0] * w[e]).sum(), [xe, ref.weight_ih_l0, ref.weight_hh_l0, ref.bias_ih_l0])
        assert torch.allclose(grads[0][e], want[0], atol=1e-10)
        assert torch.allclose(grads[1][e], want[1].T, atol=1e-10)
        assert torch.allclose(grads[2][e], want[2].T, atol=1e-10)
        assert torch.allclose(grads[3][e], want[3], atol=1e-10)


@pytest.mark.parametrize("cls", [EnsembleLSTM, EnsembleUGRNN, EnsembleGRU], ids=["lstm", "ugrnn", "gru"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-member", "shared"])
def test_forward_tokens_equals_projecting_every_token(cls, shared):
    """Projecting the embedding table once per row and gathering is the same function (and gradient)
    as embedding every token and projecting it; unmasked prefix-padded runs read at the last valid
    step equal the masked run."""
    E, V, D, H, B, T = 3, 7, 5, 4, 4, 6
    ens = cls(D, H, ensemble=E).double()
    ens.reset_parameters(_gens(E))
    table = torch.randn(E, V, D, dtype=torch.double, requires_grad=True)
    tokens = torch.randint(1, V, (B, T) if shared else (E, B, T))
    lengths = torch.tensor([6, 1, 3, 4])
    mask = torch.arange(T) < lengths.unsqueeze(1)  # (B, T), a prefix per row
    tokens = tokens * mask
    full = tokens.expand(E, B, T)
    want = ens(ensemble_gather(table, full), mask.expand(E, B, T))
    got = ens.forward_tokens(table, tokens)
    assert torch.allclose(frozen_states(got, mask), want, atol=1e-12)
    assert torch.allclose(final_states(got, mask), want[:, :, -1], atol=1e-12)
    w = torch.randn(E, B, H, dtype=torch.double)
    g_want = torch.autograd.grad((want[:, :, -1] * w).sum(), [table, *ens.parameters()])
    g_got = torch.autograd.grad((final_states(ens.forward_tokens(table, tokens), mask) * w).sum(), [table, *ens.parameters()])
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-12)


def test_members_do_not_depend_on_each_other_or_on_E():
    big = EnsembleCNN((8, 8), 4, ensemble=3, channels=(2, 3), hidden=5)
    big.reset_parameters(member_generators([0, 1, 2]))
    one = EnsembleCNN((8, 8), 4, ensemble=1, channels=(2, 3), hidden=5)
    one.reset_parameters(member_generators([2]))
    x = torch.rand(3, 6, 8, 8)
    y = big(x)
    assert torch.allclose(y[2], one(x[2:3])[0], atol=1e-6)
    x2 = x.clone()
    x2[0] += 1
    assert torch.equal(big(x2)[1:], y[1:])


def test_flat_adam_groups_and_member_learning_rates_equal_torch_adam():
    """A learning rate per member (weight) and one per group (bias): member e equals torch's Adam
    with its own learning rates."""
    torch.manual_seed(0)
    lin = EnsembleLinear(3, 2, ensemble=2)
    lin.reset_parameters(_gens(2))
    lrs, bias_lr = [0.01, 0.1], 0.03
    refs = []
    for e in range(2):
        w = nn.Parameter(lin.weight[e].detach().clone())
        b = nn.Parameter(lin.bias[e].detach().clone())
        refs.append((w, b, torch.optim.Adam([{"params": [w], "lr": lrs[e]}, {"params": [b], "lr": bias_lr}])))
    opt = FlatAdam([{"params": [lin.weight], "lr": lrs}, {"params": [lin.bias], "lr": bias_lr}], ensemble=2)
    for _ in range(5):
        x = torch.randn(2, 4, 3)
        opt.zero_grad()
        (lin(x) ** 2).sum().backward()
        opt.step()
        for e, (w, b, o) in enumerate(refs):
            o.zero_grad()
            ((x[e] @ w + b) ** 2).sum().backward()
            o.step()
    for e, (w, b, _) in enumerate(refs):
        assert torch.allclose(lin.weight[e], w, atol=1e-6) and torch.allclose(lin.bias[e], b, atol=1e-6)


def test_flat_adam_clips_per_member():
    lin = EnsembleLinear(2, 1, ensemble=2)
    opt = FlatAdam(lin.parameters(), 1.0, ensemble=2, clip=1.0)
    with torch.no_grad():
        lin.weight.grad.copy_(torch.tensor([[[30.0], [40.0]], [[0.3], [0.4]]]))
        lin.bias.grad.copy_(torch.tensor([[0.0], [0.0]]))
    opt.clip_grad_norm_()
    # member 0 (norm 50) is rescaled to norm 1, member 1 (norm 0.5) is left alone
    assert torch.allclose(lin.weight.grad.flatten(), torch.tensor([0.6, 0.8, 0.3, 0.4]), atol=1e-6)


def test_flat_adam_rejects_bad_learning_rates_and_shapes():
    lin = EnsembleLinear(2, 1, ensemble=2)
    with pytest.raises(ValueError, match="3 learning rates for 2 members"):
        FlatAdam(lin.parameters(), [0.1, 0.2, 0.3], ensemble=2)
    with pytest.raises(ValueError, match="no leading member dimension 3"):
        FlatAdam(EnsembleLinear(2, 1, ensemble=2).parameters(), 0.1, ensemble=3)
    with pytest.raises(ValueError, match="clip is per member"):
        FlatAdam(EnsembleLinear(2, 1, ensemble=2).parameters(), 0.1, clip=1.0)


def test_best_state_restores_per_member():
    lin = EnsembleLinear(2, 2, ensemble=3)
    lin.reset_parameters(_gens(3))
    best = BestState(lin, 3)
    first = lin.weight.detach().clone()
    best.update(torch.tensor([1.0, 1.0, 1.0]), 0)
    with torch.no_grad():
        lin.weight.add_(1)
    best.update(torch.tensor([0.5, 2.0, float("nan")]), 10)
    with torch.no_grad():
        lin.weight.add_(1)
    best.restore()
    assert torch.allclose(lin.weight[0], first[0] + 1)
    assert torch.equal(lin.weight[1], first[1]) and torch.equal(lin.weight[2], first[2])
    assert best.best_step.tolist() == [10, 0, 0]


def test_ensemble_gather():
    table = torch.arange(2 * 4 * 3).reshape(2, 4, 3)
    idx = torch.tensor([[3, 0], [1, 1]])
    out = ensemble_gather(table, idx)
    assert torch.equal(out[0], table[0, [3, 0]]) and torch.equal(out[1], table[1, [1, 1]])


def test_mean_ci():
    m, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and lo == pytest.approx(2 - 4.302653 / math.sqrt(3), rel=1e-5)
    assert mean_ci([5.0]) == (5.0, 5.0, 5.0)
    assert mean_ci([float("nan"), None]) == (None, None, None)


# ------------------------------------------------------------------------------------------------
# The ensemble LSTM's native sequence ops (csrc/experiments/cpu/lstm_sequence.cpp) against the
# torch version _LSTMSequence, the reference
# ------------------------------------------------------------------------------------------------

from nalu_cuda import _ops  # noqa: E402
from nalu_cuda.experiments.parts.sequence_models import _LSTMSequence, _LSTMSequenceNative, lstm_sequence  # noqa: E402

needs_native_lstm = pytest.mark.skipif(not _ops.has_kernel("cpu", "lstm_sequence_forward"),
                                       reason="native extension not built")


def _lstm_inputs(T, E, B, H, dtype, scale=0.5):
    xs = (torch.randn(T, E, B, 4 * H, dtype=dtype) * 2).requires_grad_()
    W = (torch.randn(E, H, 4 * H, dtype=dtype) * scale).requires_grad_()
    return xs, W


@needs_native_lstm
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(5, 3, 7, 4), (1, 2, 3, 1), (4, 2, 9, 10), (3, 1, 1, 3)],
                         ids=["T5-H4", "one-step-H1", "H10", "one-row-odd-H"])
def test_native_lstm_sequence_matches_the_torch_version(dtype, shape):
    """States and both gradients against _LSTMSequence, for fresh random inputs large enough to
    saturate some gates (float64 to rounding, float32 to a few ulp)."""
    torch.manual_seed(sum(shape))
    xs, W = _lstm_inputs(*shape, dtype)
    dhs = torch.randn(*shape[:3], shape[3], dtype=dtype)
    want = _LSTMSequence.apply(xs, W, True)
    want_g = torch.autograd.grad(want, (xs, W), dhs)
    got = _LSTMSequenceNative.apply(xs, W, True)
    got_g = torch.autograd.grad(got, (xs, W), dhs)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, **tol)
    with torch.no_grad():  # the forward without the saved rows gives the same states, bit for bit
        assert torch.equal(_LSTMSequenceNative.apply(xs, W, False), got)


@needs_native_lstm
def test_native_lstm_sequence_gradcheck():
    torch.manual_seed(1)
    xs, W = _lstm_inputs(3, 2, 4, 2, torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: _LSTMSequenceNative.apply(x, w, True), (xs, W))


@needs_native_lstm
def test_ensemble_lstm_takes_the_native_ops_and_matches_the_torch_version():
    """EnsembleLSTM on the CPU runs the native ops by default (native = False: the torch version);
    whole models agree, members stay independent, and 1 and 2 threads give the same bits."""
    torch.manual_seed(2)
    E, I, H = 3, 5, 6
    ens = EnsembleLSTM(I, H, ensemble=E).double()
    ens.reset_parameters(_gens(E))
    x = torch.randn(E, 4, 7, I, dtype=torch.double)
    out = ens(x)
    loss_native = (out ** 2).sum()
    g_native = torch.autograd.grad(loss_native, [ens.x2h.weight, ens.h2h.weight])
    ens.native = False
    out_ref = ens(x)
    g_ref = torch.autograd.grad((out_ref ** 2).sum(), [ens.x2h.weight, ens.h2h.weight])
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-13)
    for a, b in zip(g_native, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    ens.native = True
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ens(x)
        torch.set_num_threads(2)
        two = ens(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, out)


@needs_native_lstm
def test_lstm_sequence_falls_back_where_the_native_ops_do_not_run():
    xs, W = _lstm_inputs(2, 2, 3, 2, torch.float64)
    assert type(lstm_sequence(xs, W, True).grad_fn).__name__.startswith("_LSTMSequenceNative")
    assert type(lstm_sequence(xs, W, True, native=False).grad_fn).__name__.startswith("_LSTMSequence")
    assert not type(lstm_sequence(xs, W, True, native=False).grad_fn).__name__.startswith("_LSTMSequenceNative")
    half = lstm_sequence(xs.detach().bfloat16().requires_grad_(), W.detach().bfloat16(), True)
    assert not type(half.grad_fn).__name__.startswith("_LSTMSequenceNative")


@needs_native_lstm
def test_native_lstm_sequence_bad_arguments():
    ops = torch.ops.nalu_cuda
    xs, W = (t.detach() for t in _lstm_inputs(2, 3, 4, 5, torch.float32))
    with pytest.raises(RuntimeError, match=r"lstm_sequence_forward: argument 'W' must be a contiguous CPU tensor of xs's "
                                           r"dtype \(Float\) of shape \[E, H, 4 H\] .* got a Double cpu tensor"):
        ops.lstm_sequence_forward(xs, W.double(), True)
    with pytest.raises(RuntimeError, match=r"lstm_sequence_forward: argument 'xs' must be a contiguous float32 or "
                                           r"float64 CPU tensor of shape \[T, E, B, 4 H\].*got a Float cpu tensor of "
                                           r"shape \[3, 4, 20\]"):
        ops.lstm_sequence_forward(xs[0], W, True)
    with pytest.raises(RuntimeError, match=r"lstm_sequence_forward: argument 'W' .* with E = xs.size\(1\) = 3"):
        ops.lstm_sequence_forward(xs, W[:2].contiguous(), True)
    hs, saved = ops.lstm_sequence_forward(xs, W, True)
    _, nosave = ops.lstm_sequence_forward(xs, W, False)
    with pytest.raises(RuntimeError, match=r"lstm_sequence_backward: argument 'saved' must be .* of shape \[2, 3, 4, "
                                           r"30\] \(the forward's second result, run with save=True\), got .*\[0, 3, 4, 30\]"):
        ops.lstm_sequence_backward(torch.ones_like(hs), W, hs, nosave)
    with pytest.raises(RuntimeError, match=r"lstm_sequence_backward: argument 'grad_hs' must be .* \(hs's shape\)"):
        ops.lstm_sequence_backward(torch.ones(2, 3, 4, 6), W, hs, saved)
    with pytest.raises(RuntimeError, match=r"lstm_sequence_forward: every tensor argument must be a CPU tensor .*"
                                           r"EnsembleLSTM runs its torch version.*'xs' on meta"):
        ops.lstm_sequence_forward(xs.to("meta"), W.to("meta"), True)
