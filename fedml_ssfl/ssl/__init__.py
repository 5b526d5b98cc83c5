"""Shared semi-supervised pieces: pseudo-labels, masked consistency losses."""

from .losses import masked_consistency_loss
from .pseudo_label import PseudoLabels, pseudo_labels

__all__ = ["PseudoLabels", "masked_consistency_loss", "pseudo_labels"]
