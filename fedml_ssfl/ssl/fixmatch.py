"""FixMatch's unlabeled loss (Sohn et al. 2020, Sec. 2.2: the losses l_s and l_u).

FixMatch predicts on a weakly augmented view alpha(u), keeps the argmax as a hard pseudo-label
where the prediction's confidence reaches tau, and trains the prediction on a strongly
augmented view A(u) towards it::

    l_u = 1/(mu B) sum_b 1(max(q_b) >= tau) * H(argmax(q_b), p_m(y | A(u_b)))
    l   = l_s + lambda_u * l_u

with ``q_b = p_m(y | alpha(u_b))`` taken without gradient. The mean runs over the whole
unlabeled batch (masked-out samples count as zeros), exactly as in the paper; it is the same
loss as the SSFL benchmark's CRL (Zhang et al. Eq. 6), so it is built on
:func:`~fedml_ssfl.ssl.losses.masked_consistency_loss`.

Defaults are the paper's: tau = 0.95, lambda_u = 1. FedMatch's baselines run it at tau = 0.85 on
the un-augmented image (docs/algorithms.md#fedavg--fedprox-x-fixmatch--uda).
"""

from __future__ import annotations

import torch

from .losses import masked_consistency_loss
from .pseudo_label import PseudoLabels

FIXMATCH_THRESHOLD = 0.95
"""tau, FixMatch's confidence threshold (Sohn et al. Sec. 4)."""


def fixmatch_loss(
    logits_strong: torch.Tensor, logits_weak: torch.Tensor, threshold: float = FIXMATCH_THRESHOLD
) -> tuple[torch.Tensor, PseudoLabels]:
    """FixMatch's unlabeled loss l_u (Sohn et al. Sec. 2.2).

    Parameters
    ----------
    logits_strong : torch.Tensor
        (N, d) logits on the strongly augmented views A(u); the gradient flows through these.
    logits_weak : torch.Tensor
        (N, d) logits on the weakly augmented views alpha(u); detached here (the target).
    threshold : float
        tau: a pseudo-label is kept where its softmax confidence is >= tau.

    Returns
    -------
    (torch.Tensor, PseudoLabels)
        The scalar loss (mean over all N samples, masked-out ones counting as zero) and the
        pseudo-labels with their mask.
    """
    return masked_consistency_loss(logits_strong, logits_weak.detach().softmax(dim=1), threshold)
