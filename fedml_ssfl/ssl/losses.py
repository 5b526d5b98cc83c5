"""Consistency losses."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .pseudo_label import PseudoLabels, pseudo_labels


def masked_consistency_loss(
    logits: torch.Tensor, target_probs: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, PseudoLabels]:
    """Zhang et al. Eq. 6 (CRL) and Eq. 3 (self-training), the FixMatch-style loss.

    ``L = 1/N sum_i 1(max(y_i) >= tau) * CE(argmax(y_i), logits_i)`` where ``y_i`` are
    ``target_probs`` (the prediction on the weakly augmented input, no gradient). The mean runs
    over the whole batch: masked-out samples count as zeros. For CRL ``logits`` come from the
    strongly augmented input A(x); for self-training from the same weak input alpha(x).

    Returns
    -------
    (torch.Tensor, PseudoLabels)
        The scalar loss and the pseudo-labels with their mask.
    """
    pl = pseudo_labels(target_probs.detach(), threshold)
    per_sample = F.cross_entropy(logits, pl.labels, reduction="none")
    return (per_sample * pl.mask.to(per_sample.dtype)).mean(), pl
