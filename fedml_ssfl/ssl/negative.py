"""Complementary ("negative") labels and their loss (FedSEAL, Bian et al. Eq. 11, 12, 15).

A complementary label names a class the sample is believed *not* to belong to. Training on it
pushes that class's probability down with ``-log(1 - p_{y-})`` (Kim et al.'s negative learning),
which carries useful information long before positive pseudo-labels are reliable.
"""

from __future__ import annotations

import torch


def complementary_loss(logits: torch.Tensor, neg_labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Bian et al. Eq. 15: ``l(y-, 1 - f(x)) = -log(1 - softmax(logits)_{y-})``.

    Computed stably in log space: ``log(1 - p_j) = logsumexp(z without z_j) - logsumexp(z)``, so
    a very confident wrong class gives a large finite loss rather than ``inf``.

    Parameters
    ----------
    logits : torch.Tensor
        (N, d) logits.
    neg_labels : torch.Tensor
        (N,) int64 complementary labels.
    reduction : str
        ``"mean"`` (default), ``"sum"`` or ``"none"``.

    Returns
    -------
    torch.Tensor
        The loss (a scalar, or (N,) for ``"none"``). An empty batch gives 0 for ``"mean"``.
    """
    if logits.ndim != 2 or neg_labels.shape != logits.shape[:1]:
        raise ValueError(
            f"complementary_loss: expected (N, d) logits and (N,) labels, got "
            f"{tuple(logits.shape)} and {tuple(neg_labels.shape)}"
        )
    log_all = torch.logsumexp(logits, dim=1)
    others = logits.scatter(1, neg_labels.view(-1, 1), float("-inf"))
    per_sample = log_all - torch.logsumexp(others, dim=1)
    if reduction == "none":
        return per_sample
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "mean":
        return per_sample.mean() if per_sample.numel() else per_sample.sum()
    raise ValueError(f"complementary_loss: unknown reduction {reduction!r}")


def sample_complementary_labels(
    probs: torch.Tensor, theta: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bian et al. Eq. 11: one class with probability ``<= theta``, drawn uniformly at random.

    Parameters
    ----------
    probs : torch.Tensor
        (N, d) class probabilities (FedSEAL: the self-ensemble, Eq. 8).
    theta : float
        The complementary threshold (paper: 0.05).
    generator : torch.Generator
        The only source of randomness (CPU).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``labels`` (N,) int64 and ``has_candidate`` (N,) bool: whether any class qualified. Where
        none did, the label is meaningless (0).
    """
    candidates = probs.detach().cpu() <= theta
    scores = torch.rand(candidates.shape, generator=generator)
    scores = torch.where(candidates, scores, torch.full_like(scores, -1.0))
    return scores.argmax(dim=1), candidates.any(dim=1)
