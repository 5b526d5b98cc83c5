"""Hard pseudo-labels with a confidence mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PseudoLabels:
    """``labels`` = argmax, ``confidence`` = max probability, ``mask`` = confidence >= tau."""

    labels: torch.Tensor
    confidence: torch.Tensor
    mask: torch.Tensor

    @property
    def mask_rate(self) -> float:
        return float(self.mask.float().mean()) if self.mask.numel() else 0.0

    def accuracy(self, truth: torch.Tensor) -> float:
        """Accuracy of the kept pseudo-labels against ``truth`` (diagnostics only); nan if none counted."""
        acc = kept_accuracy(self.labels, truth, self.mask)
        return float("nan") if acc is None else acc


def label_hits(pred: torch.Tensor, truth: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[int, int]:
    """``(correct, counted)`` of ``pred`` against ``truth`` where ``mask`` holds and the truth is known.

    Diagnostics only. A deployed silo's unlabeled samples carry the label -1 (nobody knows their
    class), so they are not counted: a pseudo-label accuracy exists only in simulation.
    """
    truth = truth.to(pred.device)
    keep = truth >= 0 if mask is None else mask & (truth >= 0)
    return int((pred[keep] == truth[keep]).sum()), int(keep.sum())


def kept_accuracy(pred: torch.Tensor, truth: torch.Tensor, mask: torch.Tensor | None = None) -> float | None:
    """Accuracy of ``pred`` where ``mask`` holds and the truth is known (:func:`label_hits`).

    Diagnostics only. Returns None when nothing is counted (no kept sample with a known class),
    so that a caller can leave the metric out rather than log a nan.
    """
    correct, counted = label_hits(pred, truth, mask)
    return correct / counted if counted else None


def pseudo_labels(probs: torch.Tensor, threshold: float | torch.Tensor) -> PseudoLabels:
    """Pseudo-labels from class probabilities.

    Parameters
    ----------
    probs : torch.Tensor
        (N, d) probabilities.
    threshold : float or torch.Tensor
        A scalar tau, or a (d,) vector of class-wise thresholds applied to the predicted class.
    """
    confidence, labels = probs.max(dim=1)
    if isinstance(threshold, torch.Tensor) and threshold.ndim == 1:
        tau = threshold.to(probs.device)[labels]
    else:
        tau = threshold
    return PseudoLabels(labels=labels, confidence=confidence, mask=confidence >= tau)
