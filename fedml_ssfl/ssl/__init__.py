"""Shared semi-supervised pieces: pseudo-labels, masked and soft consistency losses, ramp-ups."""

from .consistency import kl_consistency, sigmoid_rampup, softmax_mse
from .losses import masked_consistency_loss
from .pseudo_label import PseudoLabels, pseudo_labels

__all__ = [
    "PseudoLabels",
    "kl_consistency",
    "masked_consistency_loss",
    "pseudo_labels",
    "sigmoid_rampup",
    "softmax_mse",
]
