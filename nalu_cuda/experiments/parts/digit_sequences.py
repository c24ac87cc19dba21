"""The model of the digits task: digit images -> CNN -> code -> recurrent layer, an ensemble of
``E`` members; the targets of digit sequences (counts or sums), the fixed test sequences, and the
CNN's pre-training as a single-image classifier. See :mod:`..tasks.digits`."""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import EnsembleCNN, EnsembleLinear, ensemble_gather
from .optim import FlatAdam
from .seeding import member_generators
from .sequence_models import ARITHMETIC_KINDS, make_recurrent

__all__ = ["TASKS", "MODELS", "output_dim", "sequence_targets", "fixed_sequences", "DigitSequenceModel",
           "pretrain_cnn"]

TASKS = ("counting", "addition")
MODELS = ("nac", "nau", "nalu", "lstm", "gru")


def output_dim(task: str) -> int:
    return 10 if task == "counting" else 1


def sequence_targets(task: str, labels: Tensor) -> Tensor:
    """Targets of digit sequences ``labels (..., T)``: counts ``(..., 10)`` or sums ``(..., 1)``."""
    if task == "counting":
        return F.one_hot(labels, 10).sum(-2).to(torch.float32)
    if task == "addition":
        return labels.sum(-1, keepdim=True).to(torch.float32)
    raise ValueError(f"digits: task must be one of {TASKS}, got {task!r}")


def fixed_sequences(n_images: int, n: int, length: int, seed: int) -> Tensor:
    """``n`` sequences of ``length`` image indices, the same for every model and member."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(n_images, (n, length), generator=g)


class DigitSequenceModel(nn.Module):
    """CNN per image -> recurrent layer -> output, ``E`` members."""

    def __init__(self, ensemble: int, image_shape, task: str, model: str, *, hidden: int = 32, code: int = 10,
                 channels=(8, 16), cnn_hidden: int = 64, backend: str = "auto", out_scale: float = 1.0) -> None:
        super().__init__()
        self.out_scale = float(out_scale)
        if model not in MODELS:
            raise ValueError(f"digits: model must be one of {MODELS}, got {model!r}")
        out = output_dim(task)
        self.kind = model
        self.cnn = EnsembleCNN(tuple(image_shape), 10, ensemble=ensemble, channels=tuple(channels), hidden=cnn_hidden)
        self.code = EnsembleLinear(10, code, ensemble=ensemble)
        if model in ARITHMETIC_KINDS:
            self.rec = make_recurrent(model, ensemble, code, out, backend=backend)
            self.readout = None
        else:
            self.rec = make_recurrent(model, ensemble, code, hidden)
            self.readout = EnsembleLinear(hidden, out, ensemble=ensemble)

    def reset_parameters(self, seeds: Sequence[int]) -> None:
        self.cnn.reset_parameters(member_generators(seeds, "digits/cnn"))
        with torch.no_grad():  # identity on the class probabilities (code >= 10: extra units start at 0)
            self.code.weight.zero_()
            self.code.bias.zero_()
            self.code.weight[:, :, :10].copy_(torch.eye(10, self.code.weight.shape[-1])[:, :10])
        self.rec.reset_parameters(member_generators(seeds, "digits/recurrent"))
        if self.readout is not None:
            self.readout.reset_parameters(member_generators(seeds, "digits/readout"))

    def arith_parameters(self) -> List[nn.Parameter]:
        return list(self.rec.parameters()) if self.kind in ARITHMETIC_KINDS else []

    def encode(self, images: Tensor) -> Tensor:
        """``(E, N, H, W)`` -> codes ``(E, N, code)``."""
        return self.code(torch.softmax(self.cnn(images), dim=-1))

    def aggregate(self, codes: Tensor) -> Tensor:
        """Codes of sequences ``(E, B, T, code)`` -> outputs ``(E, B, out)`` after the last step."""
        h = self.rec(codes)[:, :, -1]
        return (h if self.readout is None else self.readout(h)) * self.out_scale


def pretrain_cnn(cnn: EnsembleCNN, images: Tensor, labels: Tensor, seeds: Sequence[int], steps: int, lr: float,
                 batch: int = 64) -> float:
    """Train the CNN (class scores) as a digit classifier on single images, cross-entropy; the code
    and recurrent layers are untouched. Returns the last batch's accuracy averaged over members."""
    E = len(seeds)
    opt = FlatAdam(cnn.parameters(), lr, ensemble=E)
    gens = member_generators(seeds, "digits/pretrain-data")
    acc = float("nan")
    for _ in range(steps):
        idx = torch.stack([torch.randint(len(labels), (batch,), generator=g) for g in gens]).to(images.device)
        logits = cnn(ensemble_gather(images.unsqueeze(0).expand(E, *images.shape), idx))
        y = labels[idx]
        loss = F.cross_entropy(logits.reshape(-1, 10), y.reshape(-1), reduction="none").reshape(E, -1).mean(1)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        acc = float((logits.argmax(-1) == y).float().mean())
    return acc
