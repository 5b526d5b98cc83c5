"""Shared semi-supervised pieces every algorithm builds on.

Pseudo-labels with a confidence mask; the FixMatch loss (Sohn et al.) and UDA's sharpened KL
consistency (Xie et al.); FedMatch's agreement pseudo-label (Jeong et al. Eq. 3); soft
consistency losses (KL, softmax MSE) and the sigmoid ramp-up; mixup and complementary labels.
"""

from .agreement import agreement_pseudo_labels
from .consistency import kl_consistency, sigmoid_rampup, softmax_mse
from .fixmatch import FIXMATCH_THRESHOLD, fixmatch_loss
from .losses import masked_consistency_loss
from .pseudo_label import PseudoLabels, pseudo_labels
from .uda import TSA_SCHEDULES, UDA_TEMPERATURE, UDA_THRESHOLD, sharpen, tsa_cross_entropy, tsa_threshold, uda_loss

__all__ = [
    "FIXMATCH_THRESHOLD",
    "TSA_SCHEDULES",
    "UDA_TEMPERATURE",
    "UDA_THRESHOLD",
    "PseudoLabels",
    "agreement_pseudo_labels",
    "fixmatch_loss",
    "kl_consistency",
    "masked_consistency_loss",
    "pseudo_labels",
    "sharpen",
    "sigmoid_rampup",
    "softmax_mse",
    "tsa_cross_entropy",
    "tsa_threshold",
    "uda_loss",
]
