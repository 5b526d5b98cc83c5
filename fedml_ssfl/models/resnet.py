"""ResNet-18, CIFAR variant, with a selectable normalisation layer.

The CIFAR variant (He et al. 2016, as commonly used for 32x32 inputs) replaces the ImageNet
stem (7x7 stride-2 conv + max-pool) by a single 3x3 stride-1 conv, so a 32x32 input reaches
the last stage at 4x4. Zhang et al. train it with every BatchNorm replaced by
``GroupNorm(32, C)``; ``norm="gn"`` does the same.

State-dict layout (stable)::

    conv1, norm1                              stem
    layer{1..4}.{0,1}.conv1/norm1/conv2/norm2 BasicBlocks
    layer{2..4}.0.shortcut.{0,1}              1x1 projection conv + norm
    fc                                        classifier
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import make_norm
from .registry import register_model

GN_GROUPS = 32
"""GroupNorm groups used everywhere in the ResNet (all widths are multiples of 32)."""


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (projection shortcut when the shape changes).

    Parameters
    ----------
    in_planes : int
        Input channels.
    planes : int
        Output channels.
    stride : int
        Stride of the first conv (and of the shortcut projection).
    norm : str
        Normalisation kind, see :func:`~fedml_ssfl.models.norm.make_norm`.
    """

    def __init__(self, in_planes: int, planes: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(norm, planes, GN_GROUPS)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = make_norm(norm, planes, GN_GROUPS)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                make_norm(norm, planes, GN_GROUPS),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape (N, in_planes, H, W)."""
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (CIFAR stem) mapping (N, C, H, W) images to (N, num_classes) logits.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Input image channels.
    norm : str
        ``"bn"`` (BatchNorm2d) or ``"gn"`` (GroupNorm with 32 groups).

    Notes
    -----
    Four stages of two BasicBlocks each, widths 64/128/256/512, strides 1/2/2/2, then
    global average pooling and a linear classifier ``fc``. With ``in_channels=3`` and
    ``num_classes=10`` it has 11,173,962 trainable parameters for both ``"bn"`` and
    ``"gn"`` (both norms have a per-channel scale and shift). Global pooling is adaptive,
    so any input side works; 32 is the intended size. Weights use PyTorch's default
    initialisation, drawn from torch's global RNG.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, norm: str = "gn") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.norm1 = make_norm(norm, 64, GN_GROUPS)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_stage(64, 64, stride=1, norm=norm)
        self.layer2 = self._make_stage(64, 128, stride=2, norm=norm)
        self.layer3 = self._make_stage(128, 256, stride=2, norm=norm)
        self.layer4 = self._make_stage(256, 512, stride=2, norm=norm)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    @staticmethod
    def _make_stage(in_planes: int, planes: int, stride: int, norm: str) -> nn.Sequential:
        return nn.Sequential(
            BasicBlock(in_planes, planes, stride, norm),
            BasicBlock(planes, planes, 1, norm),
        )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled 512-d features before the classifier, shape (N, 512)."""
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(self.pool(out), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes) for images ``x`` of shape (N, C, H, W)."""
        return self.fc(self.features(x))


@register_model("resnet18", norms=("bn", "gn"), image_sizes=None, min_image_size=8)
def resnet18(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """ResNet-18, CIFAR variant (3x3 stem, no max-pool); 11,173,962 params for 3 -> 10."""
    del image_size  # adaptive pooling: the architecture does not depend on it
    return ResNet18(num_classes=num_classes, in_channels=in_channels, norm=norm)
