"""The time-tracking grid world of Trask et al. (2018), Fig. 5, as Gymnasium environments.

An agent (gray) and a target (red) sit on a 5x5 grid drawn as a 56x56 RGB frame. At the start of
an episode the agent is told an integer ``T``; it must step onto the target for the first time
exactly at step ``t = T`` (``t`` counts the actions taken, from 1). The episode ends when the agent
steps onto the target or, without arrival, at ``t = T + slack`` (no reward is possible after that).

* Actions (``Discrete(5)``), in the paper's order: 0 up, 1 down, 2 left, 3 right, 4 no-op. A move
  off the grid leaves the agent in place.
* Observation: ``{"frame": uint8 (3, 56, 56) (RGB, channels first), "instruction": float32 (1,) = T}``; the instruction
  is the same at every step of the episode (the agent must count the steps itself).
* Reward: ``m * max(0, 1 - |t - T| / slack)`` on arrival at step ``t``, 0 otherwise, ``m = 1``: the
  maximum reward only at ``t = T``, less the further the arrival is from ``T``. ``info["success"]``
  marks an arrival at exactly ``t = T``.
* Start: ``T ~ U{t_low, t_high}`` (the paper trains on ``U{5, 12}``), or ``reset(options={"T": k})``;
  agent and target on distinct cells drawn uniformly among the pairs at Manhattan distance ``<= T``,
  so that exact arrival is always possible.

:class:`GridWorldEnv` is one environment; :class:`GridWorldVectorEnv` steps ``num_envs`` of them as
numpy arrays (the batched implementation of the ``gymnasium.vector.VectorEnv`` API; autoreset
``DISABLED``: the episodes of a batch start together and a finished sub-environment keeps
returning its last observation with reward 0 and ``terminated=True`` until it is reset, also
through ``reset(options={"reset_mask": mask})``). Both share one set of dynamics (:class:`_Batch`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

__all__ = ["GridWorldEnv", "GridWorldVectorEnv", "ACTIONS", "MOVES", "GRID", "FRAME", "render_frames",
           "cell_bounds", "to_image", "positions", "set_positions", "ENV_ID", "MAX_T"]

GRID = 5
FRAME = 56
MAX_T = 10_000  # the largest instruction the observation space admits
ENV_ID = "nalu_cuda/TimeGridWorld-v0"
ACTIONS = ("up", "down", "left", "right", "no-op")
# (row, column) change of each action; rows grow downwards.
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1], [0, 0]], dtype=np.int64)
BACKGROUND = np.array([0, 0, 0], dtype=np.uint8)
GRID_LINE = np.array([40, 40, 40], dtype=np.uint8)
AGENT = np.array([128, 128, 128], dtype=np.uint8)
TARGET = np.array([255, 0, 0], dtype=np.uint8)


def cell_bounds(size: int = GRID, frame: int = FRAME) -> np.ndarray:
    """Pixel edges of the ``size`` cells along one side: ``size + 1`` values from 0 to ``frame``."""
    return np.round(np.linspace(0, frame, size + 1)).astype(np.int64)


def _pixel_cells(size: int, frame: int) -> np.ndarray:
    """For each pixel row (or column), its cell index, or ``size`` on a grid line (the 1-pixel rim
    at the start of every cell)."""
    b = cell_bounds(size, frame)
    out = np.full(frame, size, dtype=np.int64)
    for k in range(size):
        out[b[k] + 1:b[k + 1]] = k
    return out


def render_frames(agent: np.ndarray, target: np.ndarray, size: int = GRID, frame: int = FRAME) -> np.ndarray:
    """Frames ``(N, 3, frame, frame)`` uint8 (channels first, as convolutions take them) for cell
    indices ``agent``/``target`` ``(N,)`` (``row * size + col``).

    The colours are set on a ``(size + 1) x (size + 1)`` board per channel (the extra row and
    column hold the grid-line colour), then every pixel gathers the colour of its cell.
    """
    n = len(agent)
    board = np.empty((n, 3, size + 1, size + 1), dtype=np.uint8)
    board[:] = GRID_LINE[:, None, None]
    board[:, :, :size, :size] = BACKGROUND[:, None, None]
    rows = np.arange(n)
    board[rows, :, target // size, target % size] = TARGET
    board[rows, :, agent // size, agent % size] = AGENT
    pix = _pixel_cells(size, frame)
    flat = (pix[:, None] * (size + 1) + pix[None, :]).reshape(-1)
    return board.reshape(n, 3, -1)[:, :, flat].reshape(n, 3, frame, frame)


def to_image(frame: np.ndarray) -> np.ndarray:
    """A channels-first frame ``(3, H, W)`` as the ``(H, W, 3)`` image that renderers expect."""
    return np.ascontiguousarray(np.moveaxis(frame, 0, -1))


def _pairs(size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (agent cell, target cell) pair of distinct cells and its Manhattan distance."""
    cells = np.arange(size * size)
    a, t = np.meshgrid(cells, cells, indexing="ij")
    keep = a != t
    a, t = a[keep], t[keep]
    dist = np.abs(a // size - t // size) + np.abs(a % size - t % size)
    return a, t, dist


class _Batch:
    """The dynamics of ``n`` environments as arrays (positions as cell indices)."""

    def __init__(self, n: int, t_low: int, t_high: int, slack: int, size: int) -> None:
        if not 1 <= t_low <= t_high <= MAX_T:
            raise ValueError(f"gridworld: need 1 <= t_low <= t_high, got t_low={t_low}, t_high={t_high}")
        if slack < 1:
            raise ValueError(f"gridworld: slack must be at least 1, got {slack}")
        if size < 2:
            raise ValueError(f"gridworld: the grid needs at least 2x2 cells, got size={size}")
        self.n, self.t_low, self.t_high, self.slack, self.size = n, t_low, t_high, slack, size
        self.pair_agent, self.pair_target, self.pair_dist = _pairs(size)
        self.agent = np.zeros(n, dtype=np.int64)
        self.target = np.ones(n, dtype=np.int64)
        self.T = np.full(n, t_low, dtype=np.int64)
        self.t = np.zeros(n, dtype=np.int64)
        self.done = np.zeros(n, dtype=bool)

    def reset(self, rng: np.random.Generator, mask: np.ndarray, T: Optional[np.ndarray]) -> None:
        idx = np.flatnonzero(mask)
        if T is None:
            T_new = rng.integers(self.t_low, self.t_high + 1, size=len(idx))
        else:
            T_new = np.broadcast_to(np.asarray(T, dtype=np.int64), (self.n,))[idx]
            if len(T_new) and (T_new.min() < 1 or T_new.max() > MAX_T):
                raise ValueError(f"gridworld: the instruction T must be an integer in 1..{MAX_T}, "
                                 f"got {T_new.min()}..{T_new.max()}")
        for j, i in enumerate(idx):  # one draw per reset sub-environment among the reachable pairs
            ok = np.flatnonzero(self.pair_dist <= T_new[j])
            k = ok[rng.integers(len(ok))]
            self.agent[i], self.target[i] = self.pair_agent[k], self.pair_target[k]
        self.T[idx] = T_new
        self.t[idx] = 0
        self.done[idx] = False

    def step(self, action: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        action = np.asarray(action, dtype=np.int64).reshape(self.n)
        if np.any((action < 0) | (action >= len(MOVES))):
            raise ValueError(f"gridworld: actions must be in 0..{len(MOVES) - 1}, got {action.min()}..{action.max()}")
        live = ~self.done
        s = self.size
        row = np.clip(self.agent // s + MOVES[action, 0], 0, s - 1)
        col = np.clip(self.agent % s + MOVES[action, 1], 0, s - 1)
        self.agent = np.where(live, row * s + col, self.agent)
        self.t = self.t + live
        arrived = live & (self.agent == self.target)
        reward = np.where(arrived, np.maximum(0.0, 1.0 - np.abs(self.t - self.T) / self.slack), 0.0)
        success = arrived & (self.t == self.T)
        self.done = self.done | arrived | (self.t >= self.T + self.slack)
        return reward.astype(np.float32), arrived, success

    def observation(self) -> Dict[str, np.ndarray]:
        return {"frame": render_frames(self.agent, self.target, self.size),
                "instruction": self.T.astype(np.float32).reshape(self.n, 1)}

    def info(self, arrived: np.ndarray, success: np.ndarray) -> Dict[str, np.ndarray]:
        return {"t": self.t.copy(), "T": self.T.copy(), "arrived": arrived, "success": success}


def _single_spaces() -> Tuple[spaces.Dict, spaces.Discrete]:
    obs = spaces.Dict({
        "frame": spaces.Box(0, 255, (3, FRAME, FRAME), dtype=np.uint8),
        "instruction": spaces.Box(1.0, float(MAX_T), (1,), dtype=np.float32),
    })
    return obs, spaces.Discrete(len(ACTIONS))


class GridWorldEnv(gym.Env):
    """One time-tracking grid world (see the module docstring); ``render_mode="rgb_array"``."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, t_low: int = 5, t_high: int = 12, slack: int = 5, render_mode: Optional[str] = None) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"GridWorldEnv: render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.render_mode = render_mode
        self.observation_space, self.action_space = _single_spaces()
        self._b = _Batch(1, t_low, t_high, slack, GRID)

    def _obs(self) -> Dict[str, np.ndarray]:
        o = self._b.observation()
        return {"frame": o["frame"][0], "instruction": o["instruction"][0]}

    def reset(self, *, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None):
        super().reset(seed=seed)
        T = None if not options or options.get("T") is None else np.array([int(options["T"])])
        self._b.reset(self.np_random, np.ones(1, dtype=bool), T)
        return self._obs(), {"T": int(self._b.T[0])}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"GridWorldEnv.step: action must be an int in 0..{len(ACTIONS) - 1}, got {action!r}")
        if self._b.done[0]:
            raise RuntimeError("GridWorldEnv.step: the episode has ended; call reset() first")
        reward, arrived, success = self._b.step(np.array([action]))
        info = {k: v[0].item() for k, v in self._b.info(arrived, success).items()}
        return self._obs(), float(reward[0]), bool(self._b.done[0]), False, info

    def render(self):
        if self.render_mode == "rgb_array":
            return to_image(self._b.observation()["frame"][0])
        return None


class GridWorldVectorEnv(VectorEnv):
    """``num_envs`` grid worlds stepped as arrays (see the module docstring for the autoreset rule)."""

    metadata = {"render_modes": ["rgb_array"], "autoreset_mode": AutoresetMode.DISABLED}

    def __init__(self, num_envs: int, t_low: int = 5, t_high: int = 12, slack: int = 5,
                 render_mode: Optional[str] = None) -> None:
        if num_envs < 1:
            raise ValueError(f"GridWorldVectorEnv: num_envs must be positive, got {num_envs}")
        self.num_envs = num_envs
        self.render_mode = render_mode
        self.single_observation_space, self.single_action_space = _single_spaces()
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._b = _Batch(num_envs, t_low, t_high, slack, GRID)
        self._np_random: Optional[np.random.Generator] = None

    @property
    def slack(self) -> int:
        """Steps after ``T`` at which an episode without arrival ends."""
        return self._b.slack

    @property
    def done(self) -> np.ndarray:
        """Which sub-environments have finished their episode (a copy)."""
        return self._b.done.copy()

    def reset(self, *, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None):
        """``options``: ``"T"`` (int or ``(num_envs,)`` instructions), ``"reset_mask"`` (bool ``(num_envs,)``)."""
        if seed is not None or self._np_random is None:
            self._np_random, self._np_random_seed = gym.utils.seeding.np_random(seed)
        options = options or {}
        mask = np.asarray(options.get("reset_mask", np.ones(self.num_envs, dtype=bool)), dtype=bool)
        if mask.shape != (self.num_envs,):
            raise ValueError(f"GridWorldVectorEnv.reset: reset_mask must have shape ({self.num_envs},), "
                             f"got {mask.shape}")
        self._b.reset(self._np_random, mask, options.get("T"))
        return self._b.observation(), {"T": self._b.T.copy()}

    def step(self, actions):
        was_done = self._b.done.copy()
        reward, arrived, success = self._b.step(actions)
        terminated = self._b.done.copy()
        truncated = np.zeros(self.num_envs, dtype=bool)
        info = self._b.info(arrived, success)
        info["finished_before"] = was_done
        return self._b.observation(), reward, terminated, truncated, info

    def render(self) -> Optional[Tuple[np.ndarray, ...]]:
        if self.render_mode == "rgb_array":
            return tuple(to_image(f) for f in self._b.observation()["frame"])
        return None


def positions(env: GridWorldVectorEnv) -> Tuple[np.ndarray, np.ndarray]:
    """``(agent, target)`` cell indices of every sub-environment (for tests and renderings)."""
    return env._b.agent.copy(), env._b.target.copy()


def set_positions(env: GridWorldVectorEnv, agent: Sequence[int], target: Sequence[int]) -> None:
    """Place agent and target by cell index (``row * 5 + col``), for hand-written scenarios."""
    env._b.agent[:] = np.asarray(agent, dtype=np.int64)
    env._b.target[:] = np.asarray(target, dtype=np.int64)


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point=GridWorldEnv, vector_entry_point=GridWorldVectorEnv)
