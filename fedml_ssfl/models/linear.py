"""FedML's ``model: lr``: multinomial logistic regression on the image's pixels.

FedML's MNIST examples (``model_args.model: "lr"``) train ``LogisticRegression(784, 10)`` on the
flattened 28x28 pixels. Here the same model takes the normalised images ``(N, C, s, s)`` every model
takes, flattens them and applies one linear layer: ``C * s * s`` inputs, ``num_classes`` logits (no
softmax: the losses take logits). It has no normalisation layer, so ``model_args.norm`` is ``none``.
"""

from __future__ import annotations

import torch
from torch import nn

from .registry import register_model


class LogisticRegression(nn.Module):
    """``(N, C, s, s)`` images -> ``(N, num_classes)`` logits through one ``nn.Linear`` on the flat pixels.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_features : int
        ``C * s * s``.
    """

    def __init__(self, num_classes: int, in_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.flatten(x, 1))


@register_model("lr", norms=("none",), image_sizes=None)
def lr(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """FedML's "lr": logistic regression on the flattened pixels (C x s x s -> classes), any size."""
    del norm  # validated by the registry: "none"
    return LogisticRegression(num_classes=num_classes, in_features=in_channels * image_size * image_size)
