"""Wide ResNets WRN-28-2 and WRN-28-8 (Zagoruyko & Komodakis 2016), as SemiFL and FixMatch use.

``WRN-d-k``: a 3x3 stem conv to 16 channels, three groups of ``n = (d - 4) / 6`` pre-activation
blocks (norm, ReLU, 3x3 conv, norm, ReLU, 3x3 conv) of widths ``16k, 32k, 64k`` with strides
1, 2, 2, a final norm + ReLU, global average pooling and the classifier ``fc``. A block whose
width changes has a 1x1 projection shortcut (no norm), taking the pre-activated input.

Diao et al. use WRN-28-2 for CIFAR-10 and SVHN and WRN-28-8 for CIFAR-100. With BatchNorm the
running statistics are what SemiFL's static BatchNorm (sBN) recomputes on the server.

Parameter count (trainable), for ``C`` input channels, ``K`` classes and widths
``w = (16, 16k, 32k, 64k)``::

    144 C                                        stem
    + sum over groups g of [ 2 w_{g-1} + 9 w_{g-1} w_g + 2 w_g + 9 w_g^2 + w_{g-1} w_g ]   first block
                          + (n - 1) [ 4 w_g + 18 w_g^2 ]                                 other blocks
    + 2 w_3 + (w_3 + 1) K                        final norm + classifier

(the shortcut term ``w_{g-1} w_g`` appears only where the width changes, which is every group
for k >= 2). WRN-28-2 on CIFAR-10: 1,467,610; WRN-28-8 on CIFAR-100: 23,401,012.
"""

from __future__ import annotations

import torch
from torch import nn

from .norm import make_norm
from .registry import register_model

WRN_GN_GROUPS = 16
"""GroupNorm groups for ``norm="gn"`` (every width is a multiple of 16)."""


class WideBlock(nn.Module):
    """Pre-activation basic block: norm-ReLU-conv3x3-norm-ReLU-conv3x3 plus the shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int, norm: str) -> None:
        super().__init__()
        self.norm1 = make_norm(norm, in_planes, WRN_GN_GROUPS)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm2 = make_norm(norm, planes, WRN_GN_GROUPS)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        # in place: each ReLU's input is a norm layer's own output, which nothing else reads (the
        # shortcut takes ``x`` or the activated ``pre``), so no copy is made; the same values and
        # gradients bit for bit, with one activation-sized buffer less per ReLU. Without a norm layer
        # ("none", not registered) the first ReLU's input would be ``x`` itself, needed by the shortcut.
        self.relu = nn.ReLU(inplace=not isinstance(self.norm1, nn.Identity))
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape (N, in_planes, H, W)."""
        pre = self.relu(self.norm1(x))
        out = self.conv2(self.relu(self.norm2(self.conv1(pre))))
        return out + (self.shortcut(pre) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    """WRN-``depth``-``widen`` mapping (N, C, H, W) images to (N, num_classes) logits.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Input image channels.
    depth : int
        Total depth d; ``(d - 4)`` must be divisible by 6 (28 gives 4 blocks per group).
    widen : int
        Widening factor k.
    norm : str
        ``"bn"`` (BatchNorm2d) or ``"gn"`` (GroupNorm with 16 groups).

    Notes
    -----
    State-dict layout: ``conv1``; ``block{1,2,3}.{0..n-1}.norm1/conv1/norm2/conv2[/shortcut]``;
    ``norm``; ``fc``. Weights use PyTorch's default initialisation, from torch's global RNG.
    """

    def __init__(
        self, num_classes: int, in_channels: int = 3, depth: int = 28, widen: int = 2, norm: str = "bn"
    ) -> None:
        super().__init__()
        if (depth - 4) % 6 != 0 or depth < 10:
            raise ValueError(f"WideResNet depth must be 6n + 4 with n >= 1, got {depth}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.block1 = self._group(widths[0], widths[1], n, 1, norm)
        self.block2 = self._group(widths[1], widths[2], n, 2, norm)
        self.block3 = self._group(widths[2], widths[3], n, 2, norm)
        self.norm = make_norm(norm, widths[3], WRN_GN_GROUPS)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[3], num_classes)

    @staticmethod
    def _group(in_planes: int, planes: int, n: int, stride: int, norm: str) -> nn.Sequential:
        blocks = [WideBlock(in_planes, planes, stride, norm)]
        blocks += [WideBlock(planes, planes, 1, norm) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features before the classifier, shape (N, 64k)."""
        out = self.block3(self.block2(self.block1(self.conv1(x))))
        return torch.flatten(self.pool(self.relu(self.norm(out))), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes)."""
        return self.fc(self.features(x))


@register_model("wrn28_2", norms=("bn", "gn"), image_sizes=None, min_image_size=8)
def wrn28_2(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """Wide ResNet 28-2 (1.47M parameters on CIFAR-10), SemiFL's CIFAR-10/SVHN backbone."""
    del image_size  # global average pooling: any side >= 8 works
    return WideResNet(num_classes=num_classes, in_channels=in_channels, depth=28, widen=2, norm=norm)


@register_model("wrn28_8", norms=("bn", "gn"), image_sizes=None, min_image_size=8)
def wrn28_8(*, num_classes: int, in_channels: int, image_size: int, norm: str) -> nn.Module:
    """Wide ResNet 28-8 (23.4M parameters on CIFAR-100), SemiFL's CIFAR-100 backbone."""
    del image_size
    return WideResNet(num_classes=num_classes, in_channels=in_channels, depth=28, widen=8, norm=norm)
