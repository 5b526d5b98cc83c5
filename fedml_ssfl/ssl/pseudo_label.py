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
        """Accuracy of the kept pseudo-labels against ``truth`` (diagnostics only); nan if none kept."""
        if not bool(self.mask.any()):
            return float("nan")
        return float((self.labels[self.mask] == truth[self.mask].to(self.labels.device)).float().mean())


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
