"""Small CNNs for 28x28 images: a fast CPU baseline and the EMNIST CNN of Reddi et al.

``cnn28``
    Three 3x3 conv blocks and global average pooling; cheap enough for CPU-only runs on
    MNIST-5k. Supports ``bn``, ``gn`` and ``none``.
``emnist_cnn``
    The CNN of Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), used by Zhang et
    al. on EMNIST. No normalisation layers; 28x28 inputs only.
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import make_norm
from .pooling import MaxPool2x2
from .registry import register_model

CNN28_GN_GROUPS = 8
"""GroupNorm groups used by :class:`CNN28` (its widths are all multiples of 8)."""


class CNN28(nn.Module):
    """Fast three-block CNN for small images, (N, C, H, W) -> (N, num_classes) logits.

    Layers (``s`` = input side)::

        conv1  3x3 C->16, pad 1   norm1  relu  max-pool 2    s   -> s/2
        conv2  3x3 16->32, pad 1  norm2  relu  max-pool 2    s/2 -> s/4
        conv3  3x3 32->64, pad 1  norm3  relu  global avg-pool
        fc     64 -> num_classes

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Input image channels (1 for grayscale, 3 for RGB).
    norm : str
        ``"bn"`` (BatchNorm2d), ``"gn"`` (GroupNorm with 8 groups, i.e. 2/4/8 channels per
        group for widths 16/32/64) or ``"none"`` (Identity).

    Notes
    -----
    Convs carry a bias only for ``norm="none"`` (a norm's shift makes it redundant).
    Trainable parameters for ``C`` input channels and ``K`` classes:
    ``144*C + 23,264 + 65*K`` with ``bn`` or ``gn`` (224 affine parameters) and
    ``144*C + 23,152 + 65*K`` with ``none`` (112 conv biases instead). Exact counts:

    =============  =========  ===========
    C, K           bn / gn    none
    =============  =========  ===========
    1, 10 (MNIST)  24,058     23,946
    3, 10          24,346     24,234
    =============  =========  ===========

    About 1.9 M multiply-adds per 28x28 image, so it trains quickly on a CPU.
    Weights use PyTorch's default initialisation, drawn from torch's global RNG.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, norm: str = "gn") -> None:
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=bias)
        self.norm1 = make_norm(norm, 16, CNN28_GN_GROUPS)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=bias)
        self.norm2 = make_norm(norm, 32, CNN28_GN_GROUPS)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1, bias=bias)
        self.norm3 = make_norm(norm, 64, CNN28_GN_GROUPS)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = MaxPool2x2()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled 64-d features before the classifier, shape (N, 64)."""
        out = self.maxpool(self.relu(self.norm1(self.conv1(x))))
        out = self.maxpool(self.relu(self.norm2(self.conv2(out))))
        out = self.relu(self.norm3(self.conv3(out)))
        return torch.flatten(self.pool(out), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes) for images ``x`` of shape (N, C, H, W)."""
        return self.fc(self.features(x))


class EMNISTCNN(nn.Module):
    """CNN of Reddi et al. (2020) for 28x28 EMNIST, (N, C, 28, 28) -> (N, num_classes).

    Layers::

        conv1   3x3 C->32 (valid)   relu                 28 -> 26
        conv2   3x3 32->64 (valid)  relu  max-pool 2     26 -> 24 -> 12
        dropout 0.25, flatten (64*12*12 = 9216)
        dense   9216 -> 128         relu  dropout 0.5
        fc      128 -> num_classes

    Parameters
    ----------
    num_classes : int
        Number of output logits (62 for EMNIST ByClass, 47 for Balanced).
    in_channels : int
        Input image channels (1 for EMNIST).

    Notes
    -----
    Trainable parameters: ``288*C + 1,198,304 + 129*K``; for ``in_channels=1`` that is
    1,206,590 with 62 classes and 1,204,655 with 47. The hidden linear layer is named
    ``dense`` (not ``fc1``) so that only the classifier's keys start with ``fc``.
    No normalisation layers. Weights use PyTorch's default initialisation, drawn from
    torch's global RNG.
    """

    def __init__(self, num_classes: int, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = MaxPool2x2()
        self.dropout1 = nn.Dropout(0.25)
        self.dense = nn.Linear(9216, 128)
        self.dropout2 = nn.Dropout(0.5)
        self.fc = nn.Linear(128, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """128-d hidden features before the final dropout and classifier, shape (N, 128)."""
        out = self.relu(self.conv1(x))
        out = self.maxpool(self.relu(self.conv2(out)))
        out = torch.flatten(self.dropout1(out), 1)
        return self.relu(self.dense(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes) for images ``x`` of shape (N, C, 28, 28)."""
        return self.fc(self.dropout2(self.features(x)))


@register_model("cnn28", norms=("bn", "gn", "none"), image_sizes=None, min_image_size=8)
def cnn28(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """Fast 3-block CNN for 28x28 (any side >= 8), grayscale or RGB; CPU default."""
    del image_size  # global average pooling: the architecture does not depend on it
    return CNN28(num_classes=num_classes, in_channels=in_channels, norm=norm)


@register_model("emnist_cnn", norms=("none",), image_sizes=(28,))
def emnist_cnn(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """EMNIST CNN of Reddi et al. (2020), 28x28 only, no normalisation layers."""
    del image_size, norm  # validated by the registry: 28 and "none"
    return EMNISTCNN(num_classes=num_classes, in_channels=in_channels)
