"""The grid-world time-tracking experiment (Fig. 5): environment, agents, loss, CLI."""
import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from nalu_cuda import cli
from nalu_cuda.experiments.tasks import gridworld as gw
from nalu_cuda.experiments.parts import gridworld_agent as ga
from nalu_cuda.experiments import registry
from nalu_cuda.experiments.parts.gridworld_env import (ENV_ID, FRAME, GridWorldEnv, GridWorldVectorEnv, cell_bounds, positions,
                                                 render_frames, set_positions)
from nalu_cuda.experiments.parts.sequence_models import EnsembleLSTM, RecurrentArithmetic

UP, DOWN, LEFT, RIGHT, NOOP = range(5)


def cell(row, col):
    return row * 5 + col


def scripted(T, agent, target, actions):
    """One sub-environment with instruction T, the given positions, stepped through ``actions``."""
    env = GridWorldVectorEnv(1)
    env.reset(seed=0, options={"T": T})
    set_positions(env, [agent], [target])
    out = []
    for a in actions:
        obs, r, term, trunc, info = env.step(np.array([a]))
        out.append((float(r[0]), bool(term[0]), bool(info["success"][0]), int(positions(env)[0][0])))
    return out


def test_env_checker_passes():
    check_env(gym.make(ENV_ID, render_mode="rgb_array").unwrapped)
    check_env(GridWorldEnv(), skip_render_check=True)  # no spec to remake it with: the line above checks rendering


def test_arrival_exactly_at_T_gets_the_full_reward():
    steps = scripted(4, cell(0, 0), cell(0, 2), [NOOP, UP, RIGHT, RIGHT])  # UP at row 0 stays in place
    assert [s[3] for s in steps] == [cell(0, 0), cell(0, 0), cell(0, 1), cell(0, 2)]
    assert [s[0] for s in steps] == [0.0, 0.0, 0.0, 1.0]
    assert [s[1] for s in steps] == [False, False, False, True]
    assert steps[-1][2]


@pytest.mark.parametrize("T, expected", [(4, 1 - 2 / 5), (2, 1.0), (9, 0.0)])
def test_reward_falls_off_with_the_distance_from_T(T, expected):
    r, term, success, _ = scripted(T, cell(2, 2), cell(3, 3), [DOWN, RIGHT])[-1]
    assert term and r == pytest.approx(expected) and success == (T == 2)


def test_episode_ends_without_reward_at_T_plus_slack():
    steps = scripted(3, cell(4, 4), cell(0, 0), [DOWN] * 9)  # DOWN at the bottom row stays in place
    assert [s[1] for s in steps] == [False] * 7 + [True, True]  # ends at t = T + 5 = 8, then frozen
    assert all(s[0] == 0.0 and s[3] == cell(4, 4) for s in steps)


def test_single_env_matches_the_rules_and_refuses_steps_after_the_end():
    env = GridWorldEnv()
    obs, info = env.reset(seed=3, options={"T": 1})
    a, t = positions_of(obs["frame"])
    assert abs(a // 5 - t // 5) + abs(a % 5 - t % 5) == 1  # start within reach of T = 1
    assert obs["instruction"].tolist() == [1.0]
    move = next(m for m, d in ((UP, -5), (DOWN, 5), (LEFT, -1), (RIGHT, 1)) if a + d == t)
    obs, r, term, trunc, info = env.step(move)
    assert (r, term, trunc, info["success"], info["t"]) == (1.0, True, False, True, 1)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(NOOP)
    with pytest.raises(ValueError, match="action"):
        GridWorldEnv().step(7)


def positions_of(frame):
    """(agent, target) cells read back from the centre pixels of a (3, 56, 56) frame."""
    b = cell_bounds()
    centre = (b[:-1] + b[1:]) // 2
    colours = frame[:, centre][:, :, centre].reshape(3, 25).T  # (cell, rgb)
    agent = [c for c in range(25) if colours[c].tolist() == [128, 128, 128]]
    target = [c for c in range(25) if colours[c].tolist() == [255, 0, 0]]
    assert len(agent) == 1 and len(target) == 1
    return agent[0], target[0]


def test_vector_env_steps_sub_environments_independently():
    env = gym.make_vec(ENV_ID, num_envs=6, vectorization_mode="vector_entry_point")
    assert isinstance(env, GridWorldVectorEnv)
    obs, info = env.reset(seed=1, options={"T": np.array([1, 2, 3, 4, 5, 6])})
    assert obs in env.observation_space and obs["frame"].shape == (6, 3, FRAME, FRAME)
    assert obs["instruction"][:, 0].tolist() == [1, 2, 3, 4, 5, 6]
    a, t = positions(env)
    assert np.array_equal(obs["frame"], render_frames(a, t))
    dist = np.abs(a // 5 - t // 5) + np.abs(a % 5 - t % 5)
    assert (dist >= 1).all() and (dist <= np.arange(1, 7)).all()
    # each sub-environment against its own single-environment replay
    rng = np.random.default_rng(0)
    acts = rng.integers(0, 5, size=(12, 6))
    rows = [[] for _ in range(6)]
    for step in acts:
        _, r, term, _, _ = env.step(step)
        for i in range(6):
            rows[i].append((float(r[i]), bool(term[i])))
    for i in range(6):
        got = scripted(i + 1, int(a[i]), int(t[i]), acts[:, i])
        assert [(g[0], g[1]) for g in got] == rows[i]
    # a masked reset restarts only the chosen sub-environments
    before = positions(env)[0].copy()
    done = env.done
    env.reset(options={"reset_mask": np.array([True, False, False, False, False, False]), "T": 9})
    assert not env.done[0] and np.array_equal(env.done[1:], done[1:])
    assert np.array_equal(positions(env)[0][1:], before[1:])


def test_lstm_step_matches_the_sequence_lstm():
    torch.manual_seed(0)
    lstm = ga.SteppedLSTM(5, 4, ensemble=3)
    lstm.reset_parameters([torch.Generator().manual_seed(i) for i in range(3)])
    x = torch.randn(3, 2, 6, 5)
    want = EnsembleLSTM.forward(lstm, x)
    h = c = torch.zeros(3, 2, 4)
    for t in range(6):
        out, (h, c) = lstm.step(x[:, :, t], (h, c))
        torch.testing.assert_close(out, want[:, :, t])


@pytest.mark.parametrize("kind", ga.AGENTS)
def test_agent_shapes_and_members_are_independent(kind):
    E, B = 3, 4
    agent = ga.GridAgent(E, kind, hidden=8, features=8, conv=((2, 3, 1), (4, 3, 2)))
    agent.reset_parameters([0, 1, 2])
    env = GridWorldVectorEnv(E * B)
    obs, _ = env.reset(seed=0)
    frames = torch.from_numpy(obs["frame"]).reshape(E, B, 3, FRAME, FRAME)
    instr = torch.from_numpy(obs["instruction"]).reshape(E, B, 1)
    logits, value, state = agent.step(frames, instr, agent.initial_state(B))
    assert logits.shape == (E, B, 5) and value.shape == (E, B)
    assert state[0].shape == (E, B, 8) and state[2].shape == (E, B, 2 if kind == "nac" else 0)
    assert isinstance(agent.nac, RecurrentArithmetic) == (kind == "nac")
    with torch.no_grad():  # change member 1 only: members 0 and 2 must not notice
        for p in agent.parameters():
            p.view(E, -1)[1].add_(0.5)
    logits2, value2, _ = agent.step(frames, instr, agent.initial_state(B))
    torch.testing.assert_close(logits2[[0, 2]], logits[[0, 2]])
    torch.testing.assert_close(value2[[0, 2]], value[[0, 2]])
    assert not torch.allclose(logits2[1], logits[1])


def test_a2c_loss_equals_torchrl_a2c_loss_on_one_seed():
    """Our loss (every seed of an ensemble at once) against TorchRL's A2CLoss with its own GAE."""
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor, ValueOperator
    from torchrl.objectives import A2CLoss
    from torchrl.objectives.utils import ValueEstimators

    torch.manual_seed(0)
    B, L, F = 3, 6, 4
    gamma, lmbda, value_coef, entropy_coef = 0.9, 0.8, 0.5, 0.01
    feats = torch.randn(B, L + 1, F, dtype=torch.float64)
    pol, val = torch.nn.Linear(F, 5).double(), torch.nn.Linear(F, 1).double()
    actions = torch.randint(0, 5, (B, L))
    rewards = torch.rand(B, L, dtype=torch.float64)
    done = torch.zeros(B, L, dtype=torch.bool)
    done[:, -1] = True
    done[0, 2] = True  # row 0 holds two episodes
    params = list(pol.parameters()) + list(val.parameters())
    ours, _ = ga.a2c_loss(pol(feats[:, :L])[None], val(feats[:, :L]).squeeze(-1)[None], actions[None], rewards[None],
                          done[None], torch.ones(1, B, L, dtype=torch.bool), gamma=gamma, lmbda=lmbda,
                          value_coef=value_coef, entropy_coef=entropy_coef)
    g_ours = torch.autograd.grad(ours.sum(), params)

    actor = ProbabilisticActor(TensorDictModule(pol, in_keys=["obs"], out_keys=["logits"]), in_keys=["logits"],
                               distribution_class=torch.distributions.Categorical)
    loss = A2CLoss(actor, ValueOperator(val, in_keys=["obs"]), entropy_coeff=entropy_coef,
                   critic_coeff=0.5 * value_coef, loss_critic_type="l2")
    loss.make_value_estimator(ValueEstimators.GAE, gamma=gamma, lmbda=lmbda)
    td = TensorDict({"obs": feats[:, :L], "action": actions,
                     "next": {"obs": feats[:, 1:], "reward": rewards[..., None], "done": done[..., None],
                              "terminated": done[..., None]}}, batch_size=[B, L])
    out = loss(td)
    theirs = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
    g_theirs = torch.autograd.grad(theirs, params)
    # TorchRL's GAE runs its discounting in float32, hence the tolerance
    torch.testing.assert_close(ours[0], theirs, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


TINY = ["--seeds", "2", "--steps", "3", "--envs", "2", "--episodes", "1", "--eval-t-max", "13", "--no-progress"]


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["gridworld", *TINY, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {r["config"] for r in summary["records"]} == set(ga.AGENTS)
    result = json.loads((out / "runs" / "gridworld" / "nac" / "result.json").read_text())
    assert np.asarray(result["extra"]["successes"]).shape == (2, 13)
    report = (out / "report.md").read_text()
    assert "Grid-world time tracking" in report and "Rule:" in report and "Wilson" in report
    for name in ("gridworld_fig5.png", "gridworld_episodes.png", "gridworld_episodes.gif"):
        assert (out / name).stat().st_size > 0


def test_checkpoint_resume_continues_bit_for_bit(tmp_path):
    cfg = registry.Config("gridworld", "nac", 2, 4, {"agent": "nac", "envs": 2, "episodes": 1, "eval_t_max": 13,
                                                      "eval_every": 2, "n_val": 2, "hidden": 8, "features": 8})
    saved = []
    ctx = registry.Context(device="cpu", work_dir=str(tmp_path), progress=False, checkpoint_every_s=0.0,
                           save_checkpoint=lambda obj: saved.append(obj), log=lambda m: None)
    full = gw.run(cfg, ctx)
    mid = next(c for c in saved if c["step"] == 2)
    ctx2 = registry.Context(device="cpu", work_dir=str(tmp_path), progress=False, load_checkpoint=lambda: mid,
                            log=lambda m: None)
    resumed = gw.run(cfg, ctx2)
    assert resumed.records == full.records
    assert resumed.extra["successes"] == full.extra["successes"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit) as info:
        cli.main(["gridworld", "--agents", "dqn", "--out", "unused"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="t_low"):
        GridWorldVectorEnv(2, t_low=9, t_high=5)


def test_the_recurrent_nac_can_count_t_and_the_time_left():
    """With weights at +-1 and 0 (saturated W_hat, M_hat), the NAC agent's numerical state is
    (t, T - t) at every step t, for instructions far outside the training range too."""
    agent = ga.GridAgent(2, "nac", hidden=8, features=8, conv=((2, 3, 1), (4, 3, 2)))
    # rows: inputs (T, 1, u_{t-1}, v_{t-1}); columns: outputs (u_t, v_t)
    target = torch.tensor([[0.0, 1.0], [1.0, -1.0], [1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    cell = agent.nac.cell.double()
    with torch.no_grad():
        cell.W_hat.copy_(20 * target.expand(2, 4, 2))
        cell.M_hat.copy_(torch.where(target != 0, 20.0, -20.0).expand(2, 4, 2))
    T = torch.tensor([5.0, 12.0, 19.0, 250.0], dtype=torch.float64).reshape(1, 4, 1).expand(2, 4, 1)
    n = torch.zeros(2, 4, 2, dtype=torch.float64)
    for t in range(1, 30):
        n = cell(torch.cat([T, torch.ones_like(T), n], dim=-1))
        # tanh(20) * sigmoid(20) = 1 - 4e-9: exact up to that saturation
        torch.testing.assert_close(n[..., 0], torch.full((2, 4), float(t), dtype=torch.float64), rtol=0, atol=1e-5)
        torch.testing.assert_close(n[..., 1], T[..., 0] - t, rtol=0, atol=1e-5)
