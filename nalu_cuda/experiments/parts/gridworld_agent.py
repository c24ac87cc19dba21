"""The grid-world task's agent (Trask et al. 2018, Section 4.5, Fig. 5): the A3C-style actor-critic
(strided-convolution encoder, an LSTM over the features and T, optionally a recurrent NAC beside
it), as one batched model of ``E`` seeds, its advantage actor-critic loss, and the episode driver
``play`` over :class:`~.gridworld_env.GridWorldVectorEnv` (the task itself: ``tasks.gridworld``)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gridworld_env import ACTIONS, FRAME, GridWorldVectorEnv, positions
from .layers import EnsembleLinear
from .seeding import member_generators
from .sequence_models import EnsembleLSTM, RecurrentArithmetic

GREY = (0.299, 0.587, 0.114)  # ITU-R 601 luma weights for the grey-scale frame

AGENTS = ("a3c", "nac")

__all__ = ["GridAgent", "ConvEncoder", "SteppedLSTM", "a2c_loss", "play", "evaluate_by_T", "episode_seed", "AGENTS", "GREY"]


class SteppedLSTM(EnsembleLSTM):
    """:class:`EnsembleLSTM` one step at a time (an agent acts before it sees the next frame)."""

    def step(self, x: Tensor, state: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """``x (E, B, in)``, ``state = (h, c)`` each ``(E, B, H)``; PyTorch's LSTM equations."""
        h, c = self.cell_step(self.x2h(x), state)
        return h, (h, c)


class ConvEncoder(nn.Module):
    """The frame encoder of ``E`` members: strided convolutions with ReLU (grouped: member ``e`` owns
    channel block ``e``), then ``features`` ReLU units. ``layers``: ``(channels, kernel, stride)``
    per convolution. Unlike :class:`EnsembleCNN` there is no max-pooling, which would blur where
    the agent and the target are (the A3C encoder of Mnih et al. 2016 has none either).
    Input ``(E, B, H, W)``, output ``(E, B, features)``."""

    def __init__(self, ensemble: int, side: int, layers: Sequence[Sequence[int]], features: int) -> None:
        super().__init__()
        self.E = ensemble
        convs, c_in = [], 1
        for c, k, stride in layers:
            convs.append(nn.Conv2d(ensemble * c_in, ensemble * c, k, stride=stride, padding=k // 2 if stride == 1 else
                                   (k - stride + 1) // 2, groups=ensemble))
            c_in = c
            side = (side + 2 * convs[-1].padding[0] - k) // stride + 1
        self.convs = nn.ModuleList(convs)
        self.flat = c_in * side * side
        self.out = EnsembleLinear(self.flat, features, ensemble=ensemble)

    def reset_parameters(self, gens: Sequence[torch.Generator]) -> None:
        """PyTorch's default per member: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases."""
        with torch.no_grad():
            for conv in self.convs:
                w = conv.weight.view(self.E, -1, *conv.weight.shape[1:])
                b = conv.bias.view(self.E, -1)
                bound = 1.0 / math.sqrt(w[0, 0].numel())
                for e, g in enumerate(gens):
                    w[e].copy_(torch.empty(w[e].shape).uniform_(-bound, bound, generator=g))
                    b[e].copy_(torch.empty(b[e].shape).uniform_(-bound, bound, generator=g))
        self.out.reset_parameters(gens)

    def forward(self, images: Tensor) -> Tensor:
        E, B, H, W = images.shape
        x = images.transpose(0, 1)  # (B, E, H, W): member e is input channel e
        for conv in self.convs:
            x = F.relu(conv(x))
        return F.relu(self.out(x.reshape(B, E, self.flat).transpose(0, 1)))


class GridAgent(nn.Module):
    """``E`` actor-critics in one model (see the module docstring); ``kind`` is ``a3c`` or ``nac``."""

    def __init__(self, ensemble: int, kind: str, *, hidden: int = 64, features: int = 64,
                 conv: Sequence[Sequence[int]] = ((16, 3, 1), (32, 3, 2)), pool: int = 4, nac_size: int = 2,
                 backend: str = "auto") -> None:
        super().__init__()
        if kind not in AGENTS:
            raise ValueError(f"gridworld: agent must be one of {AGENTS}, got {kind!r}")
        if pool < 1 or FRAME % pool:
            raise ValueError(f"gridworld: pool must divide the frame size {FRAME}, got {pool}")
        self.E, self.kind, self.pool = ensemble, kind, pool
        side = FRAME // pool
        self.encoder = ConvEncoder(ensemble, side, conv, features)
        self.lstm = SteppedLSTM(features + 1, hidden, ensemble=ensemble)
        self.nac = RecurrentArithmetic(2, nac_size, ensemble=ensemble, kind="nac", backend=backend) if kind == "nac" else None
        head_in = hidden + (nac_size if self.nac is not None else 0)
        self.policy = EnsembleLinear(head_in, len(ACTIONS), ensemble=ensemble)
        self.value = EnsembleLinear(head_in, 1, ensemble=ensemble)
        self.register_buffer("grey", torch.tensor(GREY) / 255.0, persistent=False)

    def reset_parameters(self, seeds: Sequence[int]) -> None:
        for name, part in (("encoder", self.encoder), ("lstm", self.lstm), ("nac", self.nac), ("policy", self.policy),
                           ("value", self.value)):
            if part is not None:
                part.reset_parameters(member_generators(seeds, f"gridworld/{name}"))

    def initial_state(self, batch: int) -> Tuple[Tensor, ...]:
        p = self.policy.weight
        zeros = lambda n: p.new_zeros(self.E, batch, n)  # noqa: E731
        n = zeros(self.nac.hidden_size) if self.nac is not None else zeros(0)
        return zeros(self.lstm.hidden_size), zeros(self.lstm.hidden_size), n

    def frames(self, frames: Tensor) -> Tensor:
        """uint8 ``(E, B, 3, 56, 56)`` -> grey-scale in [0, 1], average-pooled: ``(E, B, 56/pool, 56/pool)``
        (the luma weights over the channels, one channel plane at a time, then the mean over pool x
        pool pixels; a 1x1 convolution did the same several times slower on CPU)."""
        E, B = frames.shape[:2]
        x = frames.reshape(E * B, 3, FRAME, FRAME)
        w = self.grey
        y = x[:, 0].to(w.dtype) * w[0]
        for ch in (1, 2):
            y.addcmul_(x[:, ch].to(w.dtype), w[ch])
        if self.pool > 1:
            y = F.avg_pool2d(y.unsqueeze(1), self.pool).squeeze(1)
        side = FRAME // self.pool
        return y.reshape(E, B, side, side)

    def step(self, frames: Tensor, instruction: Tensor, state: Tuple[Tensor, ...]):
        """One step of every episode: frames ``(E, B, 3, 56, 56)`` uint8, instruction ``(E, B, 1)``.
        Returns logits ``(E, B, 5)``, values ``(E, B)`` and the next state."""
        h, c, n = state
        x = torch.cat([self.encoder(self.frames(frames)), instruction], dim=-1)
        out, (h, c) = self.lstm.step(x, (h, c))
        if self.nac is not None:
            n = self.nac.cell(torch.cat([instruction, torch.ones_like(instruction), n], dim=-1))
            out = torch.cat([out, n], dim=-1)
        return self.policy(out), self.value(out).squeeze(-1), (h, c, n)


def a2c_loss(logits: Tensor, values: Tensor, actions: Tensor, rewards: Tensor, done: Tensor, mask: Tensor, *,
             gamma: float, lmbda: float, value_coef: float, entropy_coef: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per-member A2C loss ``(E,)`` of whole episodes.

    ``logits (E, B, L, 5)``, ``values``, ``rewards``, ``done`` (the step ended the episode) and
    ``mask`` (the step belongs to the episode) ``(E, B, L)``, ``actions (E, B, L)``. Every term is a
    mean over the member's valid steps. Advantages: TorchRL's GAE on the detached values.
    """
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    v = values.detach()
    next_v = torch.cat([v[..., 1:], torch.zeros_like(v[..., :1])], dim=-1)
    adv, ret = generalized_advantage_estimate(gamma, lmbda, v.unsqueeze(-1), next_v.unsqueeze(-1),
                                              rewards.unsqueeze(-1), done.unsqueeze(-1), time_dim=-2)
    adv, ret = adv.squeeze(-1), ret.squeeze(-1)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.to(logits.dtype)
    count = m.sum((1, 2)).clamp(min=1)
    mean = lambda t: (t * m).sum((1, 2)) / count  # noqa: E731
    policy_loss = -mean(logp * adv)
    value_loss = 0.5 * mean((ret - values) ** 2)
    ent = mean(entropy)
    loss = policy_loss + value_coef * value_loss - entropy_coef * ent
    return loss, {"policy": policy_loss.detach(), "value": value_loss.detach(), "entropy": ent.detach()}


def episode_seed(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen))


def play(model: GridAgent, env: GridWorldVectorEnv, *, seed: int, T: Optional[np.ndarray] = None, greedy: bool = False,
         act_gen: Optional[torch.Generator] = None, record: bool = False) -> Dict[str, Any]:
    """Play one episode in each of the ``E * B`` sub-environments of ``env`` (member ``e`` owns
    sub-environments ``e * B .. e * B + B - 1``) until all have ended.

    Returns per-step tensors ``(E, B, L)``: logits ``(E, B, L, 5)``, values, actions, rewards, done,
    mask; and per episode ``arrived_at`` (step of arrival, 0 for none) and ``success`` ``(E, B)``.
    ``record``: also the agent's cells per step (``(E, B, L + 1)``) and the target cells.
    """
    E = model.E
    B = env.num_envs // E
    device = model.policy.weight.device
    obs, info = env.reset(seed=seed, options=None if T is None else {"T": T})
    max_len = int(info["T"].max()) + env.slack
    state = model.initial_state(B)
    out: Dict[str, List[Tensor]] = {k: [] for k in ("logits", "values", "actions", "rewards", "done", "mask")}
    arrived_at = np.zeros(env.num_envs, dtype=np.int64)
    success = np.zeros(env.num_envs, dtype=bool)
    cells = [positions(env)[0]] if record else None
    target = positions(env)[1] if record else None
    for t in range(1, max_len + 1):
        frames = torch.from_numpy(obs["frame"]).to(device).reshape(E, B, 3, FRAME, FRAME)
        instr = torch.from_numpy(obs["instruction"]).to(device=device, dtype=model.policy.weight.dtype).reshape(E, B, 1)
        logits, value, state = model.step(frames, instr, state)
        if greedy:
            a = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.detach().float(), -1).reshape(E * B, -1).cpu()
            a = torch.multinomial(probs, 1, generator=act_gen).reshape(E, B).to(device)
        live = ~env.done
        obs, reward, terminated, _, step_info = env.step(a.reshape(-1).cpu().numpy())
        arrived_at = np.where(step_info["arrived"], t, arrived_at)
        success |= step_info["success"]
        for k, val in (("logits", logits), ("values", value), ("actions", a)):
            out[k].append(val)
        for k, val in (("rewards", reward), ("done", terminated & live), ("mask", live)):
            out[k].append(torch.from_numpy(np.asarray(val)).to(device).reshape(E, B))
        if record:
            cells.append(positions(env)[0])
        if terminated.all():
            break
    res: Dict[str, Any] = {k: torch.stack(v, dim=2) for k, v in out.items()}
    res["rewards"] = res["rewards"].to(model.policy.weight.dtype)
    res["arrived_at"] = torch.from_numpy(arrived_at).reshape(E, B)
    res["success"] = torch.from_numpy(success).reshape(E, B)
    res["T"] = torch.from_numpy(info["T"]).reshape(E, B)
    if record:
        res["cells"] = np.stack(cells, axis=1).reshape(E, B, -1)
        res["target"] = target.reshape(E, B)
    return res


@torch.no_grad()
def evaluate_by_T(model: GridAgent, Ts: Sequence[int], episodes: int, *, seed: int, slack: int = 5,
                  chunk: int = 4096) -> np.ndarray:
    """Greedy successes per member and instruction: ``(E, len(Ts))`` counts out of ``episodes``."""
    E = model.E
    Ts = [int(t) for t in Ts]
    jobs = np.repeat(np.asarray(Ts, dtype=np.int64), episodes)  # every member plays the same list
    counts = np.zeros((E, len(Ts)), dtype=np.int64)
    per = max(1, chunk // E)
    for start in range(0, len(jobs), per):
        part = jobs[start:start + per]
        env = GridWorldVectorEnv(E * len(part), t_low=min(Ts), t_high=max(Ts), slack=slack)
        res = play(model, env, seed=seed + start, T=np.tile(part, E), greedy=True)
        succ = res["success"].numpy()
        for j, T in enumerate(part):
            counts[:, Ts.index(int(T))] += succ[:, j]
    return counts
