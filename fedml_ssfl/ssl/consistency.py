"""Soft consistency losses and ramp-ups shared by UDA, FedMatch and FedSiam.

* :func:`kl_consistency`: ``KL(target || softmax(logits))`` per sample, optionally masked, the
  mean taken over the whole batch (masked-out samples count as zeros). UDA's consistency
  (Xie et al.), FedMatch's inter-client consistency (Jeong et al. Eq. 2, the KL term) and
  FedSiam's KL variant (Long et al. Eq. 5) all use it.
* :func:`softmax_mse`: FedSiam Eq. 4, ``1/m sum_i ||softmax(z_i) - p_i||^2``.
* :func:`sigmoid_rampup`: ``exp(-5 (1 - t)^2)`` for ``t = step / length`` clipped to [0, 1]
  (Laine & Aila; FedSiam's beta^k and Mean Teacher's consistency weight).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def _check(logits: torch.Tensor, target_probs: torch.Tensor, name: str) -> None:
    if logits.ndim != 2 or target_probs.shape != logits.shape:
        raise ValueError(
            f"{name}: expected (N, d) logits and (N, d) target probabilities, got "
            f"{tuple(logits.shape)} and {tuple(target_probs.shape)}"
        )


def kl_consistency(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``1/N sum_i m_i KL(p_i || softmax(z_i))`` with ``p`` = ``target_probs`` (no gradient).

    Parameters
    ----------
    logits : torch.Tensor
        (N, d) logits of the model being trained.
    target_probs : torch.Tensor
        (N, d) target distribution; detached here.
    mask : torch.Tensor, optional
        (N,) bool or float weights; None keeps every sample.

    Returns
    -------
    torch.Tensor
        A scalar; 0 for an empty batch.
    """
    _check(logits, target_probs, "kl_consistency")
    if logits.shape[0] == 0:
        return logits.sum()
    p = target_probs.detach()
    log_q = F.log_softmax(logits, dim=1)
    per_sample = (p * (torch.log(p.clamp_min(1e-12)) - log_q)).sum(dim=1)
    if mask is not None:
        per_sample = per_sample * mask.to(per_sample.dtype)
    return per_sample.mean()


def softmax_mse(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """FedSiam Eq. 4: ``1/N sum_i ||softmax(z_i) - p_i||_2^2`` with ``p`` detached (0 if empty)."""
    _check(logits, target_probs, "softmax_mse")
    if logits.shape[0] == 0:
        return logits.sum()
    diff = F.softmax(logits, dim=1) - target_probs.detach()
    return (diff * diff).sum(dim=1).mean()


def sigmoid_rampup(step: float, length: float) -> float:
    """``exp(-5 (1 - t)^2)`` with ``t = clip(step / length, 0, 1)``; 1 when ``length <= 0``."""
    if length <= 0:
        return 1.0
    t = min(max(step / length, 0.0), 1.0)
    return float(math.exp(-5.0 * (1.0 - t) ** 2))
