"""iNALU's published training (docs/units.md, daschloer/inalu): TensorFlow 1's RMSProp over the flat
buffers (:class:`FlatRMSProp`), 8 of every 10 steps on the weights and 2 on the gate, and the
regulariser minimised in extra steps of its own for the members it applies to."""
from __future__ import annotations

import pytest
import torch

import nalu_cuda
from nalu_cuda.experiments.parts import arithmetic_models as am
from nalu_cuda.experiments.parts.optim import FlatRMSProp
from nalu_cuda.experiments.parts.training import EvalSet, train_ensemble
from nalu_cuda.experiments.registry import Context


def _tf1_rmsprop(p, grads, lr, decay=0.9, eps=1e-10):
    """TensorFlow 1's ApplyRMSProp without momentum, written out: ms starts at 1, eps inside the root."""
    ms = torch.ones_like(p)
    for g in grads:
        ms = decay * ms + (1 - decay) * g * g
        p = p - lr * g / torch.sqrt(ms + eps)
    return p, ms


def test_flat_rmsprop_is_tensorflow_1s_update():
    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    start = w.detach().clone()
    grads = [torch.randn(3, 4, dtype=torch.float64) * s for s in (1.0, 0.01, 3.0, 1e-4)]
    opt = FlatRMSProp([w], 0.01, ensemble=3)
    for g in grads:
        opt.grad.copy_(g.reshape(-1))
        opt.step()
    want, ms = _tf1_rmsprop(start, grads, 0.01)
    torch.testing.assert_close(w.detach(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(opt.exp_avg_sq.view(3, 4), ms, rtol=1e-12, atol=0)
    # a restart puts the accumulator back to its initial 1, for those members only
    opt.reset_moments([1])
    assert (opt.exp_avg_sq.view(3, 4)[1] == 1).all() and (opt.exp_avg_sq.view(3, 4)[0] != 1).any()
    # checkpoint round trip
    other = FlatRMSProp([torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)], 0.01, ensemble=3)
    other.load_state_dict(opt.state_dict())
    assert other.step_count == opt.step_count and torch.equal(other.exp_avg_sq, opt.exp_avg_sq)


def test_flat_rmsprop_alternates_parts_and_masks_members():
    E = 2
    w = torch.randn(E, 3, requires_grad=True)
    g = torch.randn(E, 1, requires_grad=True)
    opt = FlatRMSProp([w, g], 0.01, ensemble=E, parts={"weights": [w], "gate": [g]}, alternate=(8, 10, "weights", "gate"))
    assert [opt.part_at(i) for i in range(12)] == ["weights"] * 8 + ["gate"] * 2 + ["weights"] * 2
    for i in range(10):
        before_w, before_g = w.detach().clone(), g.detach().clone()
        opt.grad.copy_(torch.randn(opt.grad.shape) + 0.5)
        opt.step()
        moved_w, moved_g = not torch.equal(w, before_w), not torch.equal(g, before_g)
        assert (moved_w, moved_g) == ((True, False) if i < 8 else (False, True)), i
    # an explicit part does not advance the alternation; members restrict the update
    count, before_w, ms = opt.step_count, w.detach().clone(), opt.exp_avg_sq.clone()
    opt.grad.fill_(1.0)
    opt.step(part="weights", members=torch.tensor([False, True]))
    assert opt.step_count == count
    assert torch.equal(w[0], before_w[0]) and not torch.equal(w[1], before_w[1])
    assert torch.equal(opt.exp_avg_sq.view(-1)[:3], ms[:3])
    with pytest.raises(ValueError, match="unknown part 'bias'"):
        opt.step(part="bias")
    with pytest.raises(ValueError, match="alternate must be"):
        FlatRMSProp([w], 0.01, ensemble=E, parts={"weights": [w]}, alternate=(8, 10, "weights", "gate"))
    with pytest.raises(ValueError, match="not one of the parameters"):
        FlatRMSProp([w], 0.01, ensemble=E, parts={"gate": [g]})


def _inalu_run(tmp_path, steps, regularizer=None, E=2):
    """Train iNALU -> iNALU with its hooks (no re-initialisation) on a * b of subsets of 6 inputs;
    ``regularizer(net)``: the regulariser hook to use instead of the published one."""
    torch.manual_seed(3)
    net = am.build_static_model("inalu", 6, 2, ensemble=E)
    net.reset_parameters(am.member_generators(range(E)))
    x = torch.rand(E, 32, 6) + 1
    t = x[..., :3].sum(-1, keepdim=True) * x[..., 3:].sum(-1, keepdim=True)
    hooks = am.training_hooks(net, None, list(range(E)))
    hooks.pop("reinit")
    if regularizer is not None:
        hooks["regularizer"] = regularizer(net)
    res = train_ensemble(net, E, lambda step: (x, t), steps, EvalSet("valid", x[0], t), eval_every=max(1, steps),
                         lr=0.01, ctx=Context(device="cpu", work_dir=str(tmp_path), progress=False), **hooks)
    return net, res


def test_inalu_trains_with_its_published_optimiser(tmp_path):
    """The hooks give RMSProp with the weight/gate alternation: after 8 steps only the weights have
    moved, after 10 the gate too; the learning rate is the published 1e-2 unless --lr is given."""
    net = am.build_static_model("inalu", 6, 2, ensemble=2)
    hooks = am.training_hooks(net, None, [0, 1])
    assert hooks["regularizer_steps"] == ("weights", "gate") and hooks["clip_value"] == 0.1
    assert am.default_lr("inalu", 1e-3) == 1e-2 and am.default_lr("nmu", 1e-3) == 1e-3
    from nalu_cuda.experiments.tasks import static
    assert static.static_config("inalu", ["mul"], 2, 10).params["lr"] == 1e-2
    assert static.static_config("inalu", ["mul"], 2, 10, lr=5e-3).params["lr"] == 5e-3
    assert static.static_config("nmu", ["mul"], 2, 10).params["lr"] == 1e-3
    nets = {}
    for steps in (0, 8, 10):
        nets[steps], _ = _inalu_run(tmp_path / str(steps), steps if steps else 1, regularizer=lambda net: lambda s, l: None)
    # (a 1-step run for "0": step 0 of the alternation updates the weights only)
    g0 = [m.G.detach() for m in nets[0].net]
    assert all(torch.equal(a, m.G) for a, m in zip(g0, nets[8].net))
    assert not all(torch.equal(a, m.G) for a, m in zip(g0, nets[10].net))
    assert not torch.equal(nets[0].net[0].W_hat, nets[8].net[0].W_hat)


def test_inalu_regulariser_runs_as_extra_steps_for_its_members(tmp_path):
    """The penalty is not added to the loss: members it applies to take extra steps on it alone,
    the others train exactly as without it."""
    def member0_only(net):
        def regularizer(step, loss):
            pen = sum(nalu_cuda.regularizers.inalu_regularizer(m, ensemble=True) for m in net.net)
            return torch.where(torch.tensor([True, False]), pen, torch.zeros_like(pen))
        return regularizer

    plain, _ = _inalu_run(tmp_path / "a", 12, regularizer=lambda net: lambda s, l: None)
    net, _ = _inalu_run(tmp_path / "b", 12, regularizer=member0_only)
    for a, b in zip(plain.net, net.net):
        for name in ("W_hat", "M_hat", "W_hat_m", "M_hat_m", "G"):
            pa, pb = getattr(a, name), getattr(b, name)
            assert torch.equal(pa[1], pb[1]), name          # member 1: untouched by the penalty
    assert not torch.equal(plain.net[0].W_hat[0], net.net[0].W_hat[0])  # member 0: extra steps
    x = torch.rand(2, 4, 6) + 1
    with pytest.raises(ValueError, match="must name parts of the optimiser"):
        train_ensemble(net, 2, lambda step: (x, x[..., :1]), 1, EvalSet("valid", x[0], x[..., :1]),
                       regularizer_steps=("weights",), regularizer=member0_only(net),
                       ctx=Context(device="cpu", work_dir=str(tmp_path / "c"), progress=False))
