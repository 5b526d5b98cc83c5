"""The exponential moving average of a net's weights (Mean Teacher; FedSiam Eq. 9).

``theta_t <- alpha theta_t + (1 - alpha) theta_s`` on every floating state tensor (parameters and
BatchNorm running statistics), integer buffers (``num_batches_tracked``) copied. One pair of nets
(:func:`ema_update`), or C clients' nets stacked along a leading dimension, each with its own
alpha (:func:`ema_update_stacked`, for :mod:`fedml_ssfl.stacked`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def ema_pairs(target: nn.Module, online: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target tensor, online tensor) for every state entry, sharing the models' storage."""
    t_state, o_state = target.state_dict(), online.state_dict()
    return [(t_state[k], o_state[k]) for k in t_state]


@torch.no_grad()
def ema_update(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], alpha: float) -> None:
    """Eq. 9 in place: ``theta_t <- alpha theta_t + (1 - alpha) theta_s`` for floating tensors.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are copied; ``alpha = 0`` copies all.
    """
    for t, s in pairs:
        if alpha == 0.0 or not t.is_floating_point():
            t.copy_(s)
        else:
            t.mul_(alpha).add_(s, alpha=1.0 - alpha)


@torch.no_grad()
def ema_update_stacked(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], alphas: torch.Tensor) -> None:
    """:func:`ema_update` of C stacked nets at once, client ``i`` with its own ``alphas[i]``.

    ``pairs`` hold tensors with a leading client dimension of size C; ``alphas`` is a float64
    tensor of shape (C,). Each client's slice gets ``t * alpha + s * (1 - alpha)``, equal to the
    one-client update up to rounding (alpha and ``1 - alpha`` are rounded to the tensor's dtype as
    there; the multiply-add may round differently); alpha = 0 gives ``s`` exactly, the copy.
    Integer buffers are copied.
    """
    factors: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # (alpha, 1 - alpha) per dtype
    for t, s in pairs:
        if not t.is_floating_point():
            t.copy_(s)
            continue
        if t.dtype not in factors:
            factors[t.dtype] = alphas.to(t.dtype), (1.0 - alphas).to(t.dtype)
        keep, take = factors[t.dtype]
        shape = (-1,) + (1,) * (t.ndim - 1)
        t.mul_(keep.view(shape)).addcmul_(s, take.view(shape))


__all__ = ["ema_pairs", "ema_update", "ema_update_stacked"]
