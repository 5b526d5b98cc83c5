"""Normalisation layers selected by name (``model_args.norm``).

Federated learning on non-IID clients is where the choice matters: BatchNorm's running
statistics are averaged across clients whose feature distributions differ, while GroupNorm
has no running statistics at all. Zhang et al. replace every BatchNorm with GroupNorm for
this reason; both are available here so the two can be compared.
"""

from __future__ import annotations

from torch import nn

NORM_KINDS: tuple[str, ...] = ("bn", "gn", "none")
"""Every value :func:`make_norm` understands."""


def make_norm(kind: str, channels: int, groups: int = 32) -> nn.Module:
    """Build a normalisation layer for a 4-D (N, C, H, W) feature map.

    Parameters
    ----------
    kind : str
        ``"bn"`` for :class:`torch.nn.BatchNorm2d`, ``"gn"`` for :class:`torch.nn.GroupNorm`,
        ``"none"`` for :class:`torch.nn.Identity`.
    channels : int
        Number of channels ``C`` of the feature map.
    groups : int, optional
        Number of groups for ``"gn"`` (default 32). The layer uses
        ``min(groups, channels)`` groups, and ``channels`` must be divisible by that number.
        Ignored for ``"bn"`` and ``"none"``.

    Returns
    -------
    torch.nn.Module
        The layer. ``"bn"`` and ``"gn"`` both carry a per-channel affine transform
        (``2 * channels`` trainable parameters); ``"bn"`` also carries running statistics
        buffers; ``"none"`` has neither.

    Raises
    ------
    ValueError
        If ``kind`` is not one of :data:`NORM_KINDS`, ``channels`` or ``groups`` is not
        positive, or ``channels`` is not divisible by the number of groups.
    """
    if channels < 1:
        raise ValueError(f"channels must be positive, got {channels}")
    if kind == "bn":
        return nn.BatchNorm2d(channels)
    if kind == "gn":
        if groups < 1:
            raise ValueError(f"groups must be positive, got {groups}")
        num_groups = min(groups, channels)
        if channels % num_groups != 0:
            raise ValueError(
                f"GroupNorm needs channels divisible by the number of groups: {channels} channels, {num_groups} groups"
            )
        return nn.GroupNorm(num_groups, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; expected one of {', '.join(map(repr, NORM_KINDS))}")
