"""FedSiam's two local models (Long et al. 2021, Sec. 4.1, Table 1).

``fedsiam_mnist_cnn`` -- the MNIST CNN, 21,840 parameters
    Table 1 rows 1-4, the classic two-conv MNIST net (the paper cites it as [20])::

        conv1   5x5 C->10 (valid), max-pool 2, relu        28 -> 24 -> 12
        conv2   5x5 10->20 (valid), max-pool 2, relu       12 -> 8 -> 4
        flatten (20*4*4 = 320)
        dense   320 -> 50, relu
        fc      50 -> num_classes                          (Table 1's softmax is in the loss)

    Trainable parameters: ``250 C + 21,080 + 51 K``, exactly **21,840** for MNIST (C=1, K=10).
    28x28 inputs only (the 320 inputs of ``dense`` fix the side). Table 1 lists no ReLU after the
    convolutions and no dropout; the ReLU after each pool is the classic net's (without it the two
    convs would be linear). No dropout, as in Table 1. No normalisation layers (``norm="none"``).

``fedsiam_cifar_cnn`` -- the CIFAR-10 / SVHN CNN, 5,852,170 parameters
    Table 1 rows 1-9, six 3x3 convs (padding 1, all with a bias) and three linear layers::

        conv1  3x3 C->32,    norm, relu
        conv2  3x3 32->64,   relu, max-pool 2                       32 -> 16
        conv3  3x3 64->128,  norm, relu
        conv4  3x3 128->128, relu, max-pool 2, dropout 0.05         16 -> 8
        conv5  3x3 128->256, norm, relu
        conv6  3x3 256->256, relu, max-pool 2                       8 -> 4
        flatten (256*4*4 = 4096)
        dense1 4096 -> 1024, relu, dropout 0.1
        dense2 1024 -> 512,  relu, dropout 0.1
        fc     512 -> num_classes

    The three norms are Table 1's BatchNorms with ``norm="bn"`` (the paper's), GroupNorm(32, C)
    with ``norm="gn"`` (same parameter count), Identity with ``norm="none"``. Trainable
    parameters at 32x32: ``288 C + 1,125,216 + 832 (bn/gn affines) + 4,720,128 + 513 K``, exactly
    **5,852,170** for CIFAR-10 with ``bn`` or ``gn`` (3 channels, 10 classes; convs 1,126,080 +
    norms 832 + linears 4,725,258), and 5,851,338 with ``none``. The count was matched to the
    paper's 5,852,170 by this layer list: it needs the conv biases and the BatchNorm affines.

    Any side >= 8 is accepted (the three pools floor the side to ``s // 8``; ``dense1`` takes
    ``256 * (s // 8)^2`` inputs), so the count above holds at 32x32 only; at 8x8 ``dense1`` has
    256 inputs (1,920,010 parameters with ``bn``), which keeps the registry-wide tests cheap.

Hidden linear layers are named ``dense*`` so that only the classifier's keys start with ``fc``.
Weights use PyTorch's default initialisation, from torch's global RNG.
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import make_norm
from .pooling import MaxPool2x2
from .registry import register_model

FEDSIAM_GN_GROUPS = 32
"""GroupNorm groups for ``fedsiam_cifar_cnn`` with ``norm="gn"`` (widths 32, 128, 256)."""


class FedSiamMNISTCNN(nn.Module):
    """FedSiam's MNIST CNN (Table 1), (N, C, 28, 28) -> (N, num_classes); see the module docstring."""

    def __init__(self, num_classes: int, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.maxpool = MaxPool2x2()
        self.relu = nn.ReLU(inplace=True)
        self.dense = nn.Linear(320, 50)
        self.fc = nn.Linear(50, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The 50-d hidden features before the classifier, shape (N, 50)."""
        out = self.relu(self.maxpool(self.conv1(x)))
        out = self.relu(self.maxpool(self.conv2(out)))
        return self.relu(self.dense(torch.flatten(out, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes)."""
        return self.fc(self.features(x))


class FedSiamCIFARCNN(nn.Module):
    """FedSiam's CIFAR-10 / SVHN CNN (Table 1), (N, C, s, s) -> (N, num_classes); see the module docstring.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Input image channels.
    image_size : int
        Input side s (>= 8); ``dense1`` takes ``256 * (s // 8)^2`` inputs (4096 at 32x32).
    norm : str
        ``"bn"`` (Table 1), ``"gn"`` or ``"none"`` after conv1, conv3 and conv5.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, norm: str = "bn") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
        self.norm1 = make_norm(norm, 32, FEDSIAM_GN_GROUPS)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.norm3 = make_norm(norm, 128, FEDSIAM_GN_GROUPS)
        self.conv4 = nn.Conv2d(128, 128, 3, padding=1)
        self.conv5 = nn.Conv2d(128, 256, 3, padding=1)
        self.norm5 = make_norm(norm, 256, FEDSIAM_GN_GROUPS)
        self.conv6 = nn.Conv2d(256, 256, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = MaxPool2x2()
        self.drop_conv = nn.Dropout(0.05)
        side = image_size // 8
        self.dense1 = nn.Linear(256 * side * side, 1024)
        self.dense2 = nn.Linear(1024, 512)
        self.drop_dense = nn.Dropout(0.1)
        self.fc = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The 512-d hidden features before the last dropout and the classifier, shape (N, 512)."""
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.maxpool(self.relu(self.conv2(out)))
        out = self.relu(self.norm3(self.conv3(out)))
        out = self.drop_conv(self.maxpool(self.relu(self.conv4(out))))
        out = self.relu(self.norm5(self.conv5(out)))
        out = self.maxpool(self.relu(self.conv6(out)))
        out = self.drop_dense(self.relu(self.dense1(torch.flatten(out, 1))))
        return self.relu(self.dense2(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes)."""
        return self.fc(self.drop_dense(self.features(x)))


@register_model("fedsiam_mnist_cnn", norms=("none",), image_sizes=(28,))
def fedsiam_mnist_cnn(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """FedSiam's MNIST CNN (Table 1): 2 conv 5x5 + 2 linear, 21,840 parameters, 28x28 only."""
    del image_size, norm  # validated by the registry: 28 and "none"
    return FedSiamMNISTCNN(num_classes=num_classes, in_channels=in_channels)


@register_model("fedsiam_cifar_cnn", norms=("bn", "gn", "none"), image_sizes=None, min_image_size=8)
def fedsiam_cifar_cnn(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """FedSiam's CIFAR/SVHN CNN (Table 1): 6 conv + 3 linear, 5,852,170 parameters at 32x32 (bn/gn)."""
    return FedSiamCIFARCNN(num_classes=num_classes, in_channels=in_channels, image_size=image_size, norm=norm)
