"""ResNet-9 without BatchNorm: FedMatch's backbone (Jeong et al. 2021, Appendix A.2, Table 3).

The architecture is the classic ResNet-9 of Page / Myrtle.ai ("How to train your ResNet"), which
is what FedMatch's Table 3 lists layer by layer, except that FedMatch's version has no BatchNorm
(docs/algorithms.md#models-the-papers-used). Layers, for a 32x32 input::

    prep    conv 3x3 C->64,    relu                          32x32
    layer1  conv 3x3 64->128,  relu, max-pool 2              32 -> 16
    res1    [conv 3x3 128->128, relu] x 2, added to its input 16x16
    layer2  conv 3x3 128->256, relu, max-pool 2              16 -> 8
    layer3  conv 3x3 256->512, relu, max-pool 2              8 -> 4
    res3    [conv 3x3 512->512, relu] x 2, added to its input 4x4
    pool    global max over the spatial dims                 4x4 -> 1x1  (Table 3's 4x4 "Pool 4")
    fc      512 -> num_classes                               (the softmax is in the loss)

``norm="none"`` (the default, FedMatch's) puts nothing between a conv and its ReLU and gives every
conv a bias; ``norm="gn"`` inserts ``GroupNorm(32, C)`` after every conv (and drops the conv
biases). Any square input side >= 8 works: three 2x2 max-pools need at least 8, and the global
max-pool equals Table 3's 4x4 pool at 32x32 (for larger inputs it pools the whole map).

Weights follow the "variance scaling" initialisation the paper names (TensorFlow's default
``VarianceScaling``: scale 1, fan-in, a normal truncated at two standard deviations, with TF's
correction of the standard deviation for the truncation), biases start at zero; everything is
drawn from torch's global RNG. Myrtle's final logit scaling (x 0.125) is not used (FedMatch does
not mention it).

Parameter count (trainable), ``C`` input channels, ``K`` classes::

    convs   9 * (64 C + 64*128 + 2*128^2 + 128*256 + 256*512 + 2*512^2) = 576 C + 6,561,792
    biases  2,240 (norm none: the 8 conv biases) or 4,480 (norm gn: the GroupNorm affines)
    fc      513 K

CIFAR-10 (C=3, K=10): 6,570,890 with ``norm="none"``, 6,573,130 with ``norm="gn"``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .norm import make_norm
from .pooling import MaxPool2x2
from .registry import register_model

RESNET9_GN_GROUPS = 32
"""GroupNorm groups for ``norm="gn"`` (every width is a multiple of 32), Zhang et al.'s GN(32, C)."""

_TRUNC_STD_CORRECTION = 0.87962566103423978
"""Standard deviation of a unit normal truncated to [-2, 2]; TF divides by it so the draw keeps its variance."""


def variance_scaling_(weight: torch.Tensor) -> torch.Tensor:
    """In place: TF's default ``VarianceScaling`` init (scale 1, fan-in, truncated normal).

    ``std = sqrt(1 / fan_in) / 0.8796`` (the correction for truncating at two standard deviations),
    values cut at ``+-2 std``.
    """
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / _TRUNC_STD_CORRECTION
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


class ConvBlock(nn.Sequential):
    """conv 3x3 (pad 1) -> norm -> ReLU; the conv has a bias only when ``norm`` is ``"none"``."""

    def __init__(self, c_in: int, c_out: int, norm: str) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=norm == "none"),
            make_norm(norm, c_out, RESNET9_GN_GROUPS),
            nn.ReLU(inplace=True),
        )


class Residual(nn.Module):
    """``x + block2(block1(x))`` with two width-preserving :class:`ConvBlock` s."""

    def __init__(self, channels: int, norm: str) -> None:
        super().__init__()
        self.block1 = ConvBlock(channels, channels, norm)
        self.block2 = ConvBlock(channels, channels, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + block2(block1(x))``, same shape as ``x``."""
        return x + self.block2(self.block1(x))


class ResNet9(nn.Module):
    """FedMatch's ResNet-9 (Table 3), (N, C, H, W) -> (N, num_classes) logits; see the module docstring.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Input image channels.
    norm : str
        ``"none"`` (FedMatch's, no normalisation) or ``"gn"`` (GroupNorm(32, C) after every conv).

    Notes
    -----
    State-dict layout: ``prep.0`` (conv); ``layer{1,2,3}.0.0`` (conv, then the max-pool at ``.1``);
    ``res{1,3}.block{1,2}.0`` (conv); with ``gn`` the norms sit at ``.1`` of each conv block; ``fc``.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, norm: str = "none") -> None:
        super().__init__()
        self.prep = ConvBlock(in_channels, 64, norm)
        self.layer1 = nn.Sequential(ConvBlock(64, 128, norm), MaxPool2x2())
        self.res1 = Residual(128, norm)
        self.layer2 = nn.Sequential(ConvBlock(128, 256, norm), MaxPool2x2())
        self.layer3 = nn.Sequential(ConvBlock(256, 512, norm), MaxPool2x2())
        self.res3 = Residual(512, norm)
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                variance_scaling_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The 512-d globally max-pooled features before the classifier, shape (N, 512)."""
        out = self.res1(self.layer1(self.prep(x)))
        out = self.res3(self.layer3(self.layer2(out)))
        return torch.amax(out, dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes)."""
        return self.fc(self.features(x))


@register_model("resnet9", norms=("none", "gn"), image_sizes=None, min_image_size=8)
def resnet9(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """FedMatch's ResNet-9 without BatchNorm (6.57M parameters on CIFAR-10), any side >= 8."""
    del image_size  # global max-pooling: any side >= 8 works
    return ResNet9(num_classes=num_classes, in_channels=in_channels, norm=norm)
