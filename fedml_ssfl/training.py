"""Training pieces every algorithm shares: batches, inputs, optimiser, the Eq. 9 schedule."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from .algorithms.base import DataInfo, TrainSettings
from .data.augment import normalize, strong_augment, to_float, weak_augment


class BatchStream:
    """Endless mini-batches of indices: shuffled passes over ``idx``, one generator.

    Parameters
    ----------
    idx : torch.Tensor
        Indices to draw from (int64).
    batch_size : int
        Batch size; a pass shorter than this is served in full.
    generator : torch.Generator
        The only source of randomness.
    """

    def __init__(self, idx: torch.Tensor, batch_size: int, generator: torch.Generator):
        if idx.numel() == 0:
            raise ValueError("BatchStream: no samples to draw batches from")
        self.idx = idx
        self.batch_size = min(batch_size, idx.numel())
        self.generator = generator
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self._pos + self.batch_size > self._order.numel():
            self._order = self.idx[torch.randperm(self.idx.numel(), generator=self.generator)]
            self._pos = 0
        batch = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return batch


class InputPipeline:
    """Turns uint8 images into model inputs: weak/strong augmentation, then normalisation."""

    def __init__(self, info: DataInfo, device: torch.device):
        self.info = info
        self.device = device
        self._mean = info.mean
        self._std = info.std

    def raw(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float [0, 1] on the device, not yet normalised."""
        return to_float(images.to(self.device, non_blocking=True))

    def plain(self, images: torch.Tensor) -> torch.Tensor:
        """No augmentation (evaluation)."""
        return normalize(self.raw(images), self._mean, self._std)

    def weak(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """alpha(x): flip (where it suits the data) and pad-and-crop shift."""
        return normalize(
            weak_augment(self.raw(images), generator, flip=self.info.flip), self._mean, self._std
        )

    def strong(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A(x): RandAugment (2 ops, magnitude up to 10), then cutout."""
        return normalize(
            strong_augment(self.raw(images), generator, flip=self.info.flip), self._mean, self._std
        )


def make_optimizer(model: nn.Module, train: TrainSettings) -> torch.optim.SGD:
    """SGD with momentum and weight decay, as every paper here uses."""
    return torch.optim.SGD(
        model.parameters(), lr=train.learning_rate, momentum=train.momentum, weight_decay=train.weight_decay
    )


def cosine_lr(train: TrainSettings, step: int) -> float:
    """Zhang et al. Eq. 9: cosine decay with linear warm-up, floored at ``gamma * epsilon``.

    ``gamma_t = gamma * max(cos(pi * c * (t - w) / (total - w)), epsilon)`` where ``t`` counts
    local iterations (``round * T + s``), ``w = lr_warmup_rounds * T`` and
    ``total = comm_round * T``. During warm-up the rate grows linearly to ``gamma``
    (Goyal et al., as the paper cites).
    """
    gamma = train.learning_rate
    if train.lr_schedule == "constant":
        return gamma
    total = max(train.comm_round * train.local_steps, 1)
    warm = train.lr_warmup_rounds * train.local_steps
    if step < warm:
        return gamma * (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
    return gamma * max(math.cos(math.pi * train.lr_cosine_c * frac), train.lr_floor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """Load a (possibly CPU) state dict into ``model`` in place, strictly."""
    model.load_state_dict(weights, strict=True)
    return model


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the model's state dict (what goes into a message)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def supervised_steps(
    model: nn.Module,
    pipeline: InputPipeline,
    images: torch.Tensor,
    labels: torch.Tensor,
    idx: torch.Tensor,
    train: TrainSettings,
    round_idx: int,
    generator: torch.Generator,
    party: str,
    steps: int | None = None,
    augment: str = "weak",
) -> float:
    """T steps of cross-entropy on labeled data (Zhang et al. Eq. 2); returns the mean loss."""
    from .algorithms.base import check_finite

    steps = train.local_steps if steps is None else steps
    model.train()
    opt = make_optimizer(model, train)
    stream = BatchStream(idx, train.batch_size, generator)
    total = 0.0
    for s in range(steps):
        set_lr(opt, cosine_lr(train, round_idx * train.local_steps + s))
        batch = next(stream)
        x = pipeline.weak(images[batch], generator) if augment == "weak" else pipeline.plain(images[batch])
        y = labels[batch].to(pipeline.device)
        loss = nn.functional.cross_entropy(model(x), y)
        check_finite(loss, round_idx, party)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total / max(steps, 1)
