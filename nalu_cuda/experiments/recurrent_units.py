"""Ensemble building blocks shared by the digit, language, program and parity experiments.

Every layer here holds ``E`` independent models ("members", one per seed) in one set of tensors
with a leading ``E`` dimension, like the ``ensemble=E`` mode of :class:`nalu_cuda.NAC` and
:class:`nalu_cuda.NALU`: inputs are ``(E, ..., in)`` and member ``e`` only ever sees ``x[e]`` and
its own weights. On a small CPU the cost of a training step is dominated by per-op overhead, so
training ``E`` seeds as one ensemble costs little more than training one.

* :class:`EnsembleLinear`, :class:`EnsembleEmbedding`, :class:`EnsembleCNN` (grouped convolutions).
* Recurrent cells :class:`EnsembleLSTM`, :class:`EnsembleGRU`, :class:`EnsembleUGRNN` (Collins et al.
  2017, "update-gate RNN") and :class:`RecurrentArithmetic` (a NAC or NALU applied to
  ``concat(x_t, h_{t-1})`` at every step, the paper's recurrent NAC / NALU).
* :class:`EnsembleAdam`: Adam with a per-member learning rate and per-member gradient clipping,
  so members never influence each other.
* :class:`BestState`: per-member snapshot of the parameters at the best validation loss.
* :func:`mean_ci`: mean and 95% Student-t interval over seeds.

Initialisation follows PyTorch's defaults per member (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``), drawn
from one ``torch.Generator`` per member so that member ``e`` does not depend on ``E``.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nalu_cuda

__all__ = [
    "member_generators",
    "EnsembleLinear",
    "EnsembleEmbedding",
    "EnsembleCNN",
    "EnsembleLSTM",
    "EnsembleGRU",
    "EnsembleUGRNN",
    "RecurrentArithmetic",
    "make_recurrent",
    "RECURRENT_KINDS",
    "EnsembleAdam",
    "BestState",
    "mean_ci",
    "ensemble_gather",
]


def member_generators(seeds: Sequence[int], salt: int = 0) -> List[torch.Generator]:
    """One CPU generator per member, seeded from ``(seed, salt)``; the salt separates model parts."""
    return [torch.Generator().manual_seed(int(s) * 1_000_003 + int(salt)) for s in seeds]


def _uniform_(t: Tensor, bound: float, gens: Sequence[torch.Generator]) -> None:
    with torch.no_grad():
        for e, g in enumerate(gens):
            t[e].copy_(torch.empty(t[e].shape).uniform_(-bound, bound, generator=g))


def ensemble_gather(table: Tensor, index: Tensor) -> Tensor:
    """``out[e, ...] = table[e, index[e, ...]]`` for ``table (E, N, ...)`` and ``index (E, ...)``."""
    E = table.shape[0]
    flat = index.reshape(E, -1)
    rows = torch.arange(E, device=table.device).unsqueeze(1).expand_as(flat)
    out = table[rows, flat]
    return out.reshape(*index.shape, *table.shape[2:])


class EnsembleLinear(nn.Module):
    """``y = x W + b`` per member; ``W`` is ``(E, in, out)`` (the (in, out) layout of the library)."""

    def __init__(self, ensemble: int, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.ensemble, self.in_features, self.out_features = ensemble, in_features, out_features
        self.weight = nn.Parameter(torch.empty(ensemble, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(ensemble, out_features)) if bias else None

    def reset_parameters(self, gens: Sequence[torch.Generator]) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        _uniform_(self.weight, bound, gens)
        if self.bias is not None:
            _uniform_(self.bias, bound, gens)

    def forward(self, x: Tensor) -> Tensor:
        E = self.ensemble
        flat = x.reshape(E, -1, self.in_features)
        if self.bias is None:
            y = torch.bmm(flat, self.weight)
        else:
            y = torch.baddbmm(self.bias.unsqueeze(1), flat, self.weight)
        return y.reshape(*x.shape[:-1], self.out_features)


class EnsembleEmbedding(nn.Module):
    """Token embeddings per member: ``tokens (E, ...)`` of ids give ``(E, ..., dim)``; N(0, 1) init."""

    def __init__(self, ensemble: int, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ensemble, num_embeddings, dim))

    def reset_parameters(self, gens: Sequence[torch.Generator]) -> None:
        with torch.no_grad():
            for e, g in enumerate(gens):
                self.weight[e].copy_(torch.randn(self.weight[e].shape, generator=g))

    def forward(self, tokens: Tensor) -> Tensor:
        return ensemble_gather(self.weight, tokens)


class EnsembleCNN(nn.Module):
    """A small CNN per member, run as grouped convolutions: conv3x3-ReLU-maxpool twice, then
    ``hidden`` ReLU units (if ``hidden > 0``) and a linear layer to ``out_features``.

    Input ``(E, N, H, W)`` (each member its own images), output ``(E, N, out_features)``.
    ``final=False`` drops the last linear layer (the output is then the ``hidden`` features), for
    models whose final layer is built elsewhere (the parity ablation).
    """

    def __init__(self, ensemble: int, image_shape: Tuple[int, int], out_features: int, *,
                 channels: Tuple[int, int] = (8, 16), hidden: int = 0, final: bool = True) -> None:
        super().__init__()
        E = ensemble
        c1, c2 = channels
        self.ensemble, self.channels = E, channels
        self.conv1 = nn.Conv2d(E, E * c1, 3, padding=1, groups=E)
        self.conv2 = nn.Conv2d(E * c1, E * c2, 3, padding=1, groups=E)
        h, w = image_shape
        h, w = h // 2 // 2, w // 2 // 2
        if h < 1 or w < 1:
            raise ValueError(f"EnsembleCNN: images of shape {image_shape} are too small (need at least 4x4)")
        self.flat = c2 * h * w
        self.hidden_layer = EnsembleLinear(E, self.flat, hidden) if hidden > 0 else None
        feat = hidden if hidden > 0 else self.flat
        self.out_features = out_features if final else feat
        self.head = EnsembleLinear(E, feat, out_features) if final else None

    def reset_parameters(self, gens: Sequence[torch.Generator]) -> None:
        E = self.ensemble
        for conv in (self.conv1, self.conv2):
            fan_in = conv.in_channels // E * 9
            bound = 1.0 / math.sqrt(fan_in)
            w = conv.weight.view(E, -1, *conv.weight.shape[1:])
            b = conv.bias.view(E, -1)
            _uniform_(w, bound, gens)
            _uniform_(b, bound, gens)
        for lin in (self.hidden_layer, self.head):
            if lin is not None:
                lin.reset_parameters(gens)

    def features(self, images: Tensor) -> Tensor:
        """The input of the final layer: ``(E, N, H, W)`` -> ``(E, N, hidden or flat)``."""
        E, N, H, W = images.shape
        x = images.transpose(0, 1)  # (N, E, H, W): member e is input channel e
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.reshape(N, E, self.flat).transpose(0, 1)  # (E, N, flat)
        if self.hidden_layer is not None:
            x = F.relu(self.hidden_layer(x))
        return x

    def forward(self, images: Tensor) -> Tensor:
        x = self.features(images)
        return x if self.head is None else self.head(x)


# ------------------------------------------------------------------------------------------------
# Recurrent cells. All take x of shape (E, B, T, in) and an optional mask (E or 1, B, T) of valid
# steps (a masked step leaves the state unchanged), and return every step's output (E, B, T, H).
# ------------------------------------------------------------------------------------------------


class _Recurrent(nn.Module):
    hidden_size: int

    @staticmethod
    def _mask_steps(mask: Optional[Tensor], T: int) -> List[Optional[Tensor]]:
        """Per-step masks ``(E or 1, B, 1)``; ``unbind`` (not indexing) keeps backward linear in T."""
        if mask is None:
            return [None] * T
        return list(mask.unsqueeze(-1).unbind(2))

    @staticmethod
    def _mask_step(m: Optional[Tensor], new: Tensor, old: Tensor) -> Tensor:
        return new if m is None else torch.where(m, new, old)


class _GatedCell(_Recurrent):
    """A cell with ``x2h`` (input to ``GATES`` blocks of ``hidden_size``, with bias) and ``h2h``
    (state to the same, bias when ``H2H_BIAS``), initialised as PyTorch's RNNs: U(-1/sqrt(H), 1/sqrt(H))."""

    GATES: int
    H2H_BIAS: bool

    def __init__(self, ensemble: int, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.x2h = EnsembleLinear(ensemble, input_size, self.GATES * hidden_size)
        self.h2h = EnsembleLinear(ensemble, hidden_size, self.GATES * hidden_size, bias=self.H2H_BIAS)

    def reset_parameters(self, gens: Sequence[torch.Generator]) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for lin in (self.x2h, self.h2h):
            _uniform_(lin.weight, bound, gens)
            if lin.bias is not None:
                _uniform_(lin.bias, bound, gens)


class EnsembleLSTM(_GatedCell):
    """LSTM (PyTorch's gate equations) per member; ``output_sum=True`` also returns the running sum."""

    GATES, H2H_BIAS = 4, False

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        E, B, T, _ = x.shape
        H = self.hidden_size
        xp = self.x2h(x)  # (E, B, T, 4H), all steps at once
        h = x.new_zeros(E, B, H)
        c = x.new_zeros(E, B, H)
        outs = []
        for xt, mt in zip(xp.unbind(2), self._mask_steps(mask, T)):
            gates = xt + self.h2h(h)
            i, f, g, o = gates.chunk(4, dim=-1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            c = self._mask_step(mt, c_new, c)
            h = self._mask_step(mt, h_new, h)
            outs.append(h)
        return torch.stack(outs, dim=2)


class EnsembleGRU(_GatedCell):
    """GRU (PyTorch's gate equations) per member."""

    GATES, H2H_BIAS = 3, True

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        E, B, T, _ = x.shape
        H = self.hidden_size
        xp = self.x2h(x)
        h = x.new_zeros(E, B, H)
        outs = []
        for xt, mt in zip(xp.unbind(2), self._mask_steps(mask, T)):
            xr, xz, xn = xt.chunk(3, dim=-1)
            hr, hz, hn = self.h2h(h).chunk(3, dim=-1)
            r = torch.sigmoid(xr + hr)
            z = torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h = self._mask_step(mt, (1 - z) * n + z * h, h)
            outs.append(h)
        return torch.stack(outs, dim=2)


class EnsembleUGRNN(_GatedCell):
    """Update-gate RNN (Collins, Sohl-Dickstein, Sussillo 2017), the paper's UGRNN baseline:
    ``c = tanh(W_c [x, h] + b_c)``, ``g = sigmoid(W_g [x, h] + b_g)``, ``h = g h + (1 - g) c``."""

    GATES, H2H_BIAS = 2, False

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        E, B, T, _ = x.shape
        H = self.hidden_size
        xp = self.x2h(x)
        h = x.new_zeros(E, B, H)
        outs = []
        for xt, mt in zip(xp.unbind(2), self._mask_steps(mask, T)):
            zc, zg = (xt + self.h2h(h)).chunk(2, dim=-1)
            g = torch.sigmoid(zg)
            h = self._mask_step(mt, g * h + (1 - g) * torch.tanh(zc), h)
            outs.append(h)
        return torch.stack(outs, dim=2)


class RecurrentArithmetic(_Recurrent):
    """The paper's recurrent NAC / NALU: ``h_t = cell(concat(x_t, h_{t-1}))``, ``h_0 = 0``.

    ``kind`` is ``"nac"`` (:class:`nalu_cuda.NAC`) or ``"nalu"`` (:class:`nalu_cuda.NALU`, the
    paper's tied weights and input-dependent gate); ``backend`` goes to the layer. The state is the
    output: there is no read-out layer, so a count or a sum lives in one linear unit of ``h``.
    """

    def __init__(self, ensemble: int, input_size: int, hidden_size: int, kind: str = "nac",
                 backend: str = "auto", **nalu_kwargs) -> None:
        super().__init__()
        self.hidden_size, self.kind = hidden_size, kind
        if kind == "nac":
            self.cell = nalu_cuda.NAC(input_size + hidden_size, hidden_size, ensemble=ensemble, backend=backend)
        elif kind == "nalu":
            self.cell = nalu_cuda.NALU(input_size + hidden_size, hidden_size, ensemble=ensemble, backend=backend,
                                       **nalu_kwargs)
        else:
            raise ValueError(f"RecurrentArithmetic: kind must be 'nac' or 'nalu', got {kind!r}")

    def reset_parameters(self, gens: Sequence[torch.Generator]) -> None:
        self.cell.reset_parameters(list(gens))

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, h0: Optional[Tensor] = None) -> Tensor:
        E, B, T, _ = x.shape
        h = x.new_zeros(E, B, self.hidden_size) if h0 is None else h0
        outs = []
        for xt, mt in zip(x.unbind(2), self._mask_steps(mask, T)):
            h = self._mask_step(mt, self.cell(torch.cat([xt, h], dim=-1)), h)
            outs.append(h)
        return torch.stack(outs, dim=2)


RECURRENT_KINDS = ("lstm", "gru", "ugrnn", "nac", "nalu")


def make_recurrent(kind: str, ensemble: int, input_size: int, hidden_size: int, backend: str = "auto") -> _Recurrent:
    """A recurrent layer by name (``RECURRENT_KINDS``)."""
    if kind == "lstm":
        return EnsembleLSTM(ensemble, input_size, hidden_size)
    if kind == "gru":
        return EnsembleGRU(ensemble, input_size, hidden_size)
    if kind == "ugrnn":
        return EnsembleUGRNN(ensemble, input_size, hidden_size)
    if kind in ("nac", "nalu"):
        return RecurrentArithmetic(ensemble, input_size, hidden_size, kind=kind, backend=backend)
    raise ValueError(f"unknown recurrent kind {kind!r}; expected one of {RECURRENT_KINDS}")


# ------------------------------------------------------------------------------------------------
# Optimisation and model selection
# ------------------------------------------------------------------------------------------------


class EnsembleAdam:
    """Adam on ensemble parameters with a learning rate per member.

    Every parameter must hold the ``E`` members in member-major order along its first dimension:
    shape ``(E, ...)``, or ``(E * C, ...)`` for grouped-convolution weights. ``lr``: a float or a
    sequence of ``E`` floats. ``clip``: if given, each member's gradient (over all its parameters)
    is rescaled to norm at most ``clip``, independently of the other members.
    """

    def __init__(self, params: Iterable[nn.Parameter], ensemble: int, lr, betas=(0.9, 0.999), eps: float = 1e-8,
                 clip: Optional[float] = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.E = ensemble
        for p in self.params:
            if p.dim() == 0 or p.shape[0] % ensemble:
                raise ValueError(f"EnsembleAdam: parameter of shape {tuple(p.shape)} has no leading member dim {ensemble}")
        lr_t = torch.as_tensor(lr, dtype=torch.float32).flatten()
        if lr_t.numel() == 1:
            lr_t = lr_t.expand(ensemble)
        if lr_t.numel() != ensemble:
            raise ValueError(f"EnsembleAdam: {lr_t.numel()} learning rates for {ensemble} members")
        self.lr = lr_t.clone()
        self.b1, self.b2 = betas
        self.eps = eps
        self.clip = clip
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        if not self.params:
            return
        E = self.E
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(E, -1) for p in self.params]
        if self.clip is not None:
            sq = sum(g.pow(2).sum(1) for g in grads)
            scale = (self.clip / (sq.sqrt() + 1e-12)).clamp(max=1.0)
            grads = [g * scale.unsqueeze(1) for g in grads]
        c1 = 1 - self.b1 ** self.t
        c2 = 1 - self.b2 ** self.t
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m2, v2, p2 = m.view(E, -1), v.view(E, -1), p.data.view(E, -1)
            m2.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v2.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            denom = (v2 / c2).sqrt_().add_(self.eps)
            lr = self.lr.to(device=p.device, dtype=p.dtype).unsqueeze(1)
            p2.sub_(lr * (m2 / c1) / denom)

    def state_dict(self) -> Dict:
        return {"t": self.t, "m": [m.clone() for m in self.m], "v": [v.clone() for v in self.v], "lr": self.lr.clone()}

    def load_state_dict(self, state: Dict) -> None:
        self.t = int(state["t"])
        for dst, src in zip(self.m, state["m"]):
            dst.copy_(src)
        for dst, src in zip(self.v, state["v"]):
            dst.copy_(src)
        self.lr = state["lr"].clone()


class BestState:
    """Per-member copy of the parameters at each member's best validation loss so far."""

    def __init__(self, module: nn.Module, ensemble: int) -> None:
        self.module = module
        self.E = ensemble
        self.best = torch.full((ensemble,), math.inf)
        self.best_step = torch.zeros(ensemble, dtype=torch.long)
        self.saved = {k: v.detach().clone() for k, v in module.state_dict().items()}

    @torch.no_grad()
    def update(self, val_loss: Tensor, step: int) -> Tensor:
        """Record members whose ``val_loss`` (E,) improved (non-finite never does); returns the mask."""
        val_loss = val_loss.detach().float().cpu()
        better = torch.isfinite(val_loss) & (val_loss < self.best)
        if bool(better.any()):
            self.best = torch.where(better, val_loss, self.best)
            self.best_step = torch.where(better, torch.full_like(self.best_step, step), self.best_step)
            for k, v in self.module.state_dict().items():
                if v.dim() == 0:
                    continue
                m = self._member_mask(better, v)
                self.saved[k] = torch.where(m, v.detach(), self.saved[k])
        return better

    def _member_mask(self, better: Tensor, v: Tensor) -> Tensor:
        if v.shape[0] == self.E:
            return better.to(v.device).reshape(self.E, *([1] * (v.dim() - 1)))
        # grouped-conv tensors: (E * C, ...) with member-major channel blocks
        per = v.shape[0] // self.E
        return better.to(v.device).repeat_interleave(per).reshape(v.shape[0], *([1] * (v.dim() - 1)))

    @torch.no_grad()
    def restore(self) -> None:
        """Load the best parameters into the module (members never improved keep their initial ones)."""
        self.module.load_state_dict(self.saved)

    def state_dict(self) -> Dict:
        return {"best": self.best.clone(), "best_step": self.best_step.clone(),
                "saved": {k: v.clone() for k, v in self.saved.items()}}

    def load_state_dict(self, state: Dict) -> None:
        self.best = state["best"].clone()
        self.best_step = state["best_step"].clone()
        self.saved = {k: v.clone() for k, v in state["saved"].items()}


def mean_ci(values: Iterable[float], level: float = 0.95) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    """Mean over seeds and its Student-t interval (``(mean, lo, hi)``; non-finite values dropped)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return (None, None, None)
    n = len(vals)
    mean = sum(vals) / n
    if n == 1:
        return (mean, mean, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    try:
        from scipy.stats import t as student_t

        q = float(student_t.ppf(0.5 + level / 2, n - 1))
    except Exception:  # scipy comes with scikit-learn; this is only a fallback
        q = 1.959963984540054
    half = q * sd / math.sqrt(n)
    return (mean, mean - half, mean + half)
