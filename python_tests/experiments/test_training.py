"""Ensemble training: members equal single runs, divergence stays in its member, real learning."""

import pytest
import torch

import nalu_cuda
from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts.arithmetic_models import build_recurrent_model, build_static_model, member_generators
from nalu_cuda.experiments.registry import Context
from nalu_cuda.experiments.tasks.static import run as run_static, static_config
from nalu_cuda.experiments.parts.training import EvalSet, train_ensemble

CTX = Context(device="cpu", work_dir=".", progress=False)
SMALL = dict(eval_every=50, n_valid=300, n_test=300, baseline_models=5, threshold_samples=5_000)


def _by(records, key="seed"):
    return {(r["op"], r[key]): r for r in records}


@pytest.mark.parametrize("model", ["nalu", "relu6"])
def test_ensemble_members_equal_single_runs(model):
    """Seeds 0..2 (two operations each) as one ensemble equal runs of one seed each.

    Bit for bit in training (same losses); evaluation sums in chunks that depend on E, hence the
    1e-9 tolerance there. NALU is the sharp test: its exp path amplifies any 1-ulp difference.
    """
    ens = run_static(static_config(model, ["add", "mul"], 3, 100, **SMALL), CTX).records
    for s in (0, 2):
        single = run_static(static_config(model, ["add", "mul"], 1, 100, seed_offset=s, **SMALL), CTX).records
        for r in single:
            e = _by(ens)[(r["op"], s)]
            assert e["best_step"] == r["best_step"]
            if model == "nalu":  # the fused kernels: bit for bit
                assert e["final_train_loss"] == r["final_train_loss"]
            else:  # torch.baddbmm's BLAS may round differently for another batch count
                assert e["final_train_loss"] == pytest.approx(r["final_train_loss"], rel=1e-6)
            for k in ("valid_mse", "interp_mse", "extrap_mse"):
                assert e[k] == pytest.approx(r[k], rel=1e-9 if model == "nalu" else 1e-5), (model, r["op"], s, k)


def test_member_initialisation_matches_single_model():
    ens = build_static_model("nalu-separate", 100, 2, ensemble=3)
    ens.reset_parameters(member_generators([5, 6, 7]))
    one = build_static_model("nalu-separate", 100, 2, ensemble=1)
    one.reset_parameters(member_generators([6]))
    for (k, a), (_, b) in zip(ens.state_dict().items(), one.state_dict().items()):
        assert torch.equal(a[1], b[0]), k
    rec = build_recurrent_model("lstm", 10, 4, ensemble=2)
    rec.reset_parameters(member_generators([1, 2]))
    rec1 = build_recurrent_model("lstm", 10, 4, ensemble=1)
    rec1.reset_parameters(member_generators([2]))
    x = torch.rand(7, 5, 10)
    assert torch.allclose(rec(x)[1], rec1(x)[0], atol=1e-6)


def test_divergent_member_does_not_poison_the_others():
    E = 3

    def make():
        m = build_static_model("nalu", 10, 2, ensemble=E)
        m.reset_parameters(member_generators(range(E)))
        return m

    torch.manual_seed(0)
    x = torch.rand(E, 64, 10) + 1
    t = x[..., :3].sum(-1, keepdim=True) * x[..., 3:6].sum(-1, keepdim=True)
    val = EvalSet("valid", torch.rand(100, 10) + 1, None)
    val.targets = (val.x[:, :3].sum(-1, keepdim=True) * val.x[:, 3:6].sum(-1, keepdim=True)).expand(E, 100, 1)

    clean, bad = make(), make()
    with torch.no_grad():
        bad.net[0].W_hat[1].fill_(float("nan"))  # member 1 is broken from the start
    r_clean = train_ensemble(clean, E, lambda s: (x, t), 60, val, eval_every=20, lr=1e-2)
    r_bad = train_ensemble(bad, E, lambda s: (x, t), 60, val, eval_every=20, lr=1e-2)
    assert r_bad.diverged.tolist() == [False, True, False]
    assert not r_clean.diverged.any()
    for e in (0, 2):
        for (k, a), (_, b) in zip(clean.state_dict().items(), bad.state_dict().items()):
            assert torch.equal(a[e], b[e]), k
        assert r_clean.best_val[e] == r_bad.best_val[e]


def test_nac_learns_addition_and_extrapolates_relu6_does_not():
    """A few hundred steps: the paper's normalised error (100 = random init) tells them apart."""
    nac = run_static(static_config("nac", ["add"], 3, 400, lr=1e-2, **SMALL), CTX).records
    mlp = run_static(static_config("relu6", ["add"], 3, 400, lr=1e-2, **SMALL), CTX).records
    for r in nac:
        assert r["extrap_error"] < 1.0 and r["interp_error"] < 1.0
    for r in mlp:
        assert r["extrap_error"] > 20.0
        assert r["extrap_mse"] > 5 * r["interp_mse"]
        assert not r["success"]


def test_nac_solves_subtraction_by_madsens_criterion():
    recs = run_static(static_config("nac", ["sub"], 3, 400, lr=3e-2, input_size=10, **SMALL), CTX).records
    assert all(r["success"] and r["solved_at"] is not None and not r["diverged"] for r in recs)
    assert all(r["solved_at"] <= 400 for r in recs)


def test_records_have_the_standard_keys():
    recs = run_static(static_config("nalu", ["div"], 2, 30, **SMALL), CTX).records
    for r in recs:
        for k in ("seed", "success", "diverged", "solved_at", "best_step", "interp_error", "extrap_error",
                  "interp_mse", "extrap_mse", "sparsity_error", "threshold"):
            assert k in r
        assert r["threshold"] == pytest.approx(ar.PUBLISHED_THRESHOLDS["div"], rel=0.3)


# ------------------------------------------------------------------------------------------------
# FlatAdam's fused CPU step (csrc/cpu/flat_adam.cpp)
# ------------------------------------------------------------------------------------------------

_fused_adam = getattr(nalu_cuda._ops.fast, "flat_adam_step", None)
needs_fused_adam = pytest.mark.skipif(_fused_adam is None, reason="native extension not built")


def _adam_pair(E, dtype, fused: bool, lr=1e-2):
    from nalu_cuda.experiments.parts import optim

    torch.manual_seed(3)
    shapes = [(E, 7, 3), (E, 2), (E,), (E, 37)]  # member runs of 21, 2, 1 and 37 (vector body + remainder)
    params = [torch.randn(s, dtype=dtype).requires_grad_() for s in shapes]
    opt = optim.FlatAdam(params, lr=lr)
    if not fused:
        opt._native_step = lambda E: None
    return params, opt


@needs_fused_adam
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adam_matches_torch_adam_and_the_tensor_ops(dtype):
    E = 5
    params, opt = _adam_pair(E, dtype, fused=True)
    ref = [p.detach().clone().requires_grad_() for p in params]
    torch_opt = torch.optim.Adam(ref, lr=1e-2)
    ops_params, ops_opt = _adam_pair(E, dtype, fused=False)
    for step in range(40):
        grads = [torch.randn_like(p) * (10.0 ** (step % 5 - 2)) for p in params]
        for p, q, r, g in zip(params, ops_params, ref, grads):
            p.grad.copy_(g)
            q.grad.copy_(g)
            r.grad = g.clone()
        none = torch.zeros(E, dtype=torch.bool)
        assert not opt.step_ensemble(none, False).any()
        assert not ops_opt.step_ensemble(none, False).any()
        torch_opt.step()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    for p, q, r in zip(params, ops_params, ref):
        torch.testing.assert_close(p, r, **tol)
        torch.testing.assert_close(p, q, **tol)


@needs_fused_adam
def test_fused_adam_member_equals_a_one_member_run():
    # Member 3 of an ensemble of 6 gets exactly the update of a one-member run with its values,
    # wherever its elements fall in the vector body or remainder of the loops.
    E, m = 6, 3
    params, opt = _adam_pair(E, torch.float32, fused=True)
    single = [p.detach()[m:m + 1].clone().requires_grad_() for p in params]
    sopt = type(opt)(single, lr=1e-2)
    for _ in range(25):
        grads = [torch.randn_like(p) for p in params]
        opt.zero_grad()
        sopt.zero_grad()
        for p, s, g in zip(params, single, grads):
            p.grad.copy_(g)
            s.grad.copy_(g[m:m + 1])
        opt.step_ensemble(torch.zeros(E, dtype=torch.bool), False)
        sopt.step_ensemble(torch.zeros(1, dtype=torch.bool), False)
    for p, s in zip(params, single):
        assert torch.equal(p.detach()[m:m + 1], s.detach())


@needs_fused_adam
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tensor-ops"])
def test_adam_flags_and_freezes_nonfinite_members(fused):
    E = 4
    params, opt = _adam_pair(E, torch.float32, fused=fused)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad.copy_(torch.randn_like(p))
    params[1].grad[2, 1] = float("nan")
    params[3].grad[0, 36] = float("inf")
    frozen = torch.tensor([False, True, False, False])
    bad = opt.step_ensemble(frozen, freeze_nonfinite=True)
    assert bad.tolist() == [True, False, True, False]
    for p, b in zip(params, before):
        for e in range(E):
            moved = not torch.equal(p.detach()[e], b[e])
            assert moved == (e == 3), (e, p.shape)  # members 0 and 2 (non-finite) and 1 (frozen) stay
        assert torch.isfinite(p).all()
    # without freeze_nonfinite the NaN reaches member 2's moments and parameters (and only theirs)
    params, opt = _adam_pair(E, torch.float32, fused=fused)
    for p in params:
        p.grad.copy_(torch.randn_like(p))
    params[0].grad[2, 0, 0] = float("nan")
    assert opt.step_ensemble(torch.zeros(E, dtype=torch.bool), False).tolist() == [False, False, True, False]
    assert torch.isnan(params[0].detach()[2, 0, 0]) and torch.isfinite(params[0].detach()[[0, 1, 3]]).all()


@needs_fused_adam
def test_fused_adam_bad_arguments():
    buf = torch.zeros(10)
    segs = torch.tensor([[0, 5]])
    frozen = torch.zeros(2, dtype=torch.bool)
    ok = (buf, buf.clone(), buf.clone(), buf.clone(), segs, frozen, False, 1e-3, 0.9, 0.999, 1e-8, 1)
    _fused_adam(*ok)
    with pytest.raises(RuntimeError, match=r"flat_adam_step: exp_avg must be a contiguous 1-D CPU tensor like param"):
        _fused_adam(buf, buf, torch.zeros(10, dtype=torch.float64), *ok[3:])
    with pytest.raises(RuntimeError, match=r"segment 0 = \(offset 1, per_member 5\) runs past the buffer of 10"):
        _fused_adam(*ok[:4], torch.tensor([[1, 5]]), *ok[5:])
    with pytest.raises(RuntimeError, match=r"frozen must be a contiguous 1-D bool CPU tensor"):
        _fused_adam(*ok[:5], torch.zeros(2), *ok[6:])
    with pytest.raises(RuntimeError, match=r"step must be at least 1, got 0"):
        _fused_adam(*ok[:-1], 0)


def _member_lr_pair(E, dtype, fused: bool, clip):
    """Two parameters of E members with a learning rate per member and the clip, as the sequence
    tasks train (language: two learning rates x seeds, clip 100)."""
    from nalu_cuda.experiments.parts import optim

    torch.manual_seed(5)
    params = [torch.randn(s, dtype=dtype).requires_grad_() for s in [(E, 7, 3), (E, 37)]]
    lrs = [1e-3 * 3 ** e for e in range(E)]
    opt = optim.FlatAdam(params, lrs, ensemble=E, clip=clip)
    if not fused:
        opt._native_step = lambda E: None
    return params, opt


@needs_fused_adam
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
def test_fused_adam_member_learning_rates_and_clip_match_the_tensor_ops(dtype, clip):
    """The fused step with a learning rate per member and the per-member clip (FlatAdam's lr_member
    and clip) against the tensor ops: the same flags, the same parameters to rounding, and the fused
    step is the one taken."""
    E = 4
    params, opt = _member_lr_pair(E, dtype, True, clip)
    ops_params, ops_opt = _member_lr_pair(E, dtype, False, clip)
    assert opt._native_step(E) is not None and ops_opt._native_step(E) is None
    frozen = torch.tensor([False, False, True, False])
    for step in range(30):
        # large gradients (clipped) on some steps, small ones (not clipped) on others; a NaN once
        grads = [torch.randn_like(p) * (10.0 if step % 3 == 0 else 0.01) for p in params]
        if step == 7:
            grads[1][1, 3] = float("nan")
        for p, q, g in zip(params, ops_params, grads):
            p.grad.copy_(g)
            q.grad.copy_(g)
        bad = opt.step_ensemble(frozen, True)
        assert torch.equal(bad, ops_opt.step_ensemble(frozen, True))
        assert bad.tolist() == [False, step == 7, False, False]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    for p, q in zip(params, ops_params):
        torch.testing.assert_close(p, q, **tol)
        assert torch.isfinite(p).all()
    start = _member_lr_pair(E, dtype, True, clip)[0]
    assert all(torch.equal(p.detach()[2], q.detach()[2]) for p, q in zip(params, start))  # the frozen member never moved


@needs_fused_adam
def test_fused_adam_clip_rescales_to_the_norm():
    """One step from zero moments moves each element by lr * sign(g) whatever the scale of g, so the
    clip is seen in the moments: the first moment is (1 - beta1) * the clipped gradient."""
    E = 2
    params, opt = _member_lr_pair(E, torch.float64, True, 1.0)
    g = [torch.zeros_like(p) for p in params]
    g[0][0, 0, 0], g[0][0, 1, 0], g[1][1, 0] = 30.0, 40.0, 0.25  # member 0: norm 50; member 1: norm 0.25
    for p, gg in zip(params, g):
        p.grad.copy_(gg)
    opt.step_ensemble(torch.zeros(E, dtype=torch.bool), False)
    m = opt.exp_avg[:21 * E].view(E, 7, 3)
    assert torch.allclose(m[0, 0, 0], torch.tensor(0.1 * 0.6, dtype=torch.float64), rtol=1e-12)
    assert torch.allclose(m[0, 1, 0], torch.tensor(0.1 * 0.8, dtype=torch.float64), rtol=1e-12)
    assert torch.allclose(opt.exp_avg[21 * E:].view(E, 37)[1, 0], torch.tensor(0.025, dtype=torch.float64), rtol=1e-12)


@needs_fused_adam
def test_fused_adam_member_lr_and_clip_bad_arguments():
    buf = torch.zeros(10)
    ok = (buf, buf.clone(), buf.clone(), buf.clone(), torch.tensor([[0, 5]]), torch.zeros(2, dtype=torch.bool), False,
          1e-3, 0.9, 0.999, 1e-8, 1)
    _fused_adam(*ok, lr_member=torch.tensor([1e-3, 1e-2], dtype=torch.float64), clip=1.0)
    with pytest.raises(RuntimeError, match=r"flat_adam_step: lr_member must be a contiguous 1-D float64 CPU tensor of "
                                           r"2 learning rates \(one per member\), got a Float cpu tensor of shape \[2\]"):
        _fused_adam(*ok, lr_member=torch.tensor([1e-3, 1e-2]))
    with pytest.raises(RuntimeError, match=r"flat_adam_step: clip must be a finite number .* got nan"):
        _fused_adam(*ok, clip=float("nan"))


@needs_fused_adam
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adam_threads_give_the_same_bits(dtype, clip):
    """Buffers large enough to be split over two threads (E = 9 members of 3 segments, 25,000 elements
    each): one thread and two give the same parameters, moments and flags (a member with a NaN, a
    frozen member, a learning rate per member), over several steps."""
    E, sizes = 9, (12_000, 7, 12_993)
    segments, off = [], 0
    for per in sizes:
        segments.append([off, per])
        off += E * per
    segments = torch.tensor(segments)
    frozen = torch.zeros(E, dtype=torch.bool)
    frozen[4] = True
    lrs = torch.linspace(1e-3, 5e-3, E, dtype=torch.float64)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(7)
            p = torch.randn(off, generator=g, dtype=torch.float64).to(dtype)
            m, v = torch.zeros_like(p), torch.zeros_like(p)
            out = []
            for step in range(1, 5):
                grad = (torch.randn(off, generator=g, dtype=torch.float64) * 3).to(dtype)
                if step == 2:
                    grad[segments[2, 0] + 6 * sizes[2] + 5] = float("nan")  # member 6's last segment
                out.append(_fused_adam(p, grad, m, v, segments, frozen, True, 1e-3, 0.9, 0.999, 1e-8, step, lrs, clip))
            results.append(out + [p, m, v])
    finally:
        torch.set_num_threads(before)
    assert results[0][1].tolist() == [k == 6 for k in range(E)]
    for a, b in zip(*results):
        assert torch.equal(a, b)
