"""The ensemble layers every experiment model is built from.

Every layer holds ``E`` independent models ("members", one per seed) in one set of tensors with a
leading ``E`` dimension (``ensemble=E``), like the ``ensemble=E`` mode of :class:`nalu_cuda.NAC`
and :class:`nalu_cuda.NALU`; ``ensemble=None`` (where offered) is one plain model. Inputs are
``(E, ..., in)`` and member ``e`` only ever sees ``x[e]`` and its own weights. On a small CPU a
training step costs mostly per-op overhead, so ``E`` seeds as one ensemble cost little more than one.

One signature: ``Layer(<sizes>, *, ensemble=...)``; ``reset_parameters(generators)`` initialises
member ``e`` from ``generators[e]`` (see :func:`.seeding.member_generators`), PyTorch's default
initialisation per member, so a member equals the single model made with the same generator.

* :class:`EnsembleLinear` (``W`` is ``([E,] in, out)``, the library's (in, out) layout),
  :class:`EnsembleEmbedding`, :class:`EnsembleCNN` (grouped convolutions);
* :class:`GatedCell`: the base of the LSTM / GRU / UGRNN cells of every task;
* :func:`ensemble_gather`: per-member table lookup.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Generators", "member_slices", "lead_shape", "EnsembleLinear", "EnsembleEmbedding", "EnsembleCNN", "GatedCell",
           "ensemble_gather"]

Generators = Union[None, torch.Generator, Sequence[torch.Generator]]


def member_slices(ensemble: Optional[int], generator: Generators):
    """``[(index, generator)]``, one per member, as in nalu_cuda's layers: index ``()`` for a plain
    module; one generator (or None) serves every member in turn."""
    if ensemble is None:
        if isinstance(generator, (list, tuple)):
            if len(generator) != 1:
                raise ValueError(f"a plain model takes one generator, got {len(generator)}")
            generator = generator[0]
        return [((), generator)]
    if generator is None or isinstance(generator, torch.Generator):
        return [((e,), generator) for e in range(ensemble)]
    gens = list(generator)
    if len(gens) != ensemble:
        raise ValueError(f"expected {ensemble} generators (one per member), got {len(gens)}")
    return [((e,), g) for e, g in enumerate(gens)]


def lead_shape(ensemble: Optional[int]) -> Tuple[int, ...]:
    """The leading shape of a parameter: ``()`` for a plain module, ``(E,)`` for an ensemble."""
    return () if ensemble is None else (ensemble,)


def _bmm(x: Tensor, W: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x W (+ bias)``: plain (W ``(I, O)``) or per member (W ``(E, I, O)``, x ``(E, ..., I)``)."""
    if W.dim() == 2:
        return F.linear(x, W.t(), bias) if bias is not None else x @ W
    E, I, O = W.shape
    x3 = x.reshape(E, -1, I)
    out = torch.baddbmm(bias.unsqueeze(1), x3, W) if bias is not None else torch.bmm(x3, W)
    return out.reshape(*x.shape[:-1], O)


class EnsembleLinear(nn.Module):
    """``y = x W + b`` with ``W`` of shape ``([E,] in, out)``; PyTorch's default initialisation."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, ensemble: Optional[int] = None):
        super().__init__()
        self.in_features, self.out_features, self.ensemble = in_features, out_features, ensemble
        self.weight = nn.Parameter(torch.empty(*lead_shape(ensemble), in_features, out_features))
        self.bias = nn.Parameter(torch.empty(*lead_shape(ensemble), out_features)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform(a=sqrt(5)), as nn.Linear
        for idx, g in member_slices(self.ensemble, generator):
            self.weight[idx].uniform_(-bound, bound, generator=g)
            if self.bias is not None:
                self.bias[idx].uniform_(-bound, bound, generator=g)

    def forward(self, x: Tensor) -> Tensor:
        return _bmm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        ens = "" if self.ensemble is None else f", ensemble={self.ensemble}"
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}{ens}"


def ensemble_gather(table: Tensor, index: Tensor) -> Tensor:
    """``out[e, ...] = table[e, index[e, ...]]`` for ``table (E, N, ...)`` and ``index (E, ...)``."""
    E = table.shape[0]
    flat = index.reshape(E, -1)
    rows = torch.arange(E, device=table.device).unsqueeze(1).expand_as(flat)
    out = table[rows, flat]
    return out.reshape(*index.shape, *table.shape[2:])


class EnsembleEmbedding(nn.Module):
    """Token embeddings per member: ``tokens (E, ...)`` of ids give ``(E, ..., dim)``; N(0, 1) init."""

    def __init__(self, num_embeddings: int, dim: int, *, ensemble: int) -> None:
        super().__init__()
        self.ensemble = ensemble
        self.weight = nn.Parameter(torch.empty(ensemble, num_embeddings, dim))

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        for idx, g in member_slices(self.ensemble, generator):
            self.weight[idx].copy_(torch.randn(self.weight[idx].shape, generator=g))

    def forward(self, tokens: Tensor) -> Tensor:
        return ensemble_gather(self.weight, tokens)


class EnsembleCNN(nn.Module):
    """A small CNN per member, run as grouped convolutions: conv3x3-ReLU-maxpool twice, then
    ``hidden`` ReLU units (if ``hidden > 0``) and a linear layer to ``out_features``.

    Input ``(E, N, H, W)`` (each member its own images), output ``(E, N, out_features)``.
    ``final=False`` drops the last linear layer (the output is then the ``hidden`` features), for
    models whose final layer is built elsewhere (the parity ablation).
    """

    def __init__(self, image_shape: Tuple[int, int], out_features: int, *, ensemble: int,
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
        self.hidden_layer = EnsembleLinear(self.flat, hidden, ensemble=E) if hidden > 0 else None
        feat = hidden if hidden > 0 else self.flat
        self.out_features = out_features if final else feat
        self.head = EnsembleLinear(feat, out_features, ensemble=E) if final else None

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        E = self.ensemble
        for conv in (self.conv1, self.conv2):
            bound = 1.0 / math.sqrt(conv.in_channels // E * 9)  # fan_in of one member's kernel
            w = conv.weight.view(E, -1, *conv.weight.shape[1:])
            b = conv.bias.view(E, -1)
            for t in (w, b):
                for idx, g in member_slices(E, generator):
                    t[idx].uniform_(-bound, bound, generator=g)
        for lin in (self.hidden_layer, self.head):
            if lin is not None:
                lin.reset_parameters(generator)

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


class GatedCell(nn.Module):
    """The base of every gated recurrent cell: ``x2h`` (input to ``GATES`` blocks of ``hidden_size``,
    with bias) and ``h2h`` (state to the same, with bias when ``H2H_BIAS``), initialised as
    PyTorch's RNNs, U(-1/sqrt(H), 1/sqrt(H)), drawing each member's tensors in ``INIT_ORDER``.
    Subclasses set ``GATES`` (and may override ``H2H_BIAS`` and ``INIT_ORDER``) and write
    ``forward``."""

    GATES: int
    H2H_BIAS: bool = False
    INIT_ORDER: Tuple[str, ...] = ("x2h.weight", "x2h.bias", "h2h.weight", "h2h.bias")

    def __init__(self, input_size: int, hidden_size: int, *, ensemble: Optional[int] = None) -> None:
        super().__init__()
        self.hidden_size, self.ensemble = hidden_size, ensemble
        self.x2h = EnsembleLinear(input_size, self.GATES * hidden_size, ensemble=ensemble)
        self.h2h = EnsembleLinear(hidden_size, self.GATES * hidden_size, bias=self.H2H_BIAS, ensemble=ensemble)

    @torch.no_grad()
    def reset_parameters(self, generator: Generators = None) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        params = dict(self.named_parameters())
        tensors = [params[name] for name in self.INIT_ORDER if name in params]
        for idx, g in member_slices(self.ensemble, generator):
            for t in tensors:
                t[idx].uniform_(-bound, bound, generator=g)
