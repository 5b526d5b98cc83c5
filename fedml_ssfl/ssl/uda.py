"""UDA: unsupervised data augmentation for consistency training (Xie et al. 2020).

Equations (plain text; u unlabeled, A() strong augmentation, z the logits of the target's view)::

    target    p~ = softmax(z / T), T = 0.4, without gradient          (sharpening)
    mask      1(max softmax(z) >= beta), beta = 0.8                    (unsharpened confidence)
    loss      mean over the whole batch of mask * KL(p~ || p(y | A(u)))  (masked samples count 0)
    objective CE(labeled) + lambda_u loss, lambda_u = 1
    TSA       at progress t in [0, 1], a labeled sample whose correct-class probability exceeds
              eta_t = alpha_t (1 - 1/K) + 1/K leaves the supervised loss; alpha_t = t (linear),
              1 - exp(-5 t) (log) or exp(5 (t - 1)) (exp)

Which view gives the target is the caller's (:func:`uda_loss` takes its logits): the baselines'
``weak_view`` (docs/algorithms.md#fedavg--fedprox-x-fixmatch--uda).

Deviation: UDA's code keeps samples strictly above beta; here the mask is ``>= beta``, as for
FixMatch's tau.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from .consistency import kl_consistency
from .pseudo_label import PseudoLabels, pseudo_labels

UDA_TEMPERATURE = 0.4
"""T, UDA's softmax temperature for sharpening the target."""

UDA_THRESHOLD = 0.8
"""beta, UDA's confidence-mask threshold (on the unsharpened prediction)."""

TSA_SCHEDULES = ("none", "linear", "log", "exp")
"""Training Signal Annealing schedules: ``none`` switches TSA off."""


def sharpen(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / T)``: T < 1 sharpens, T = 1 is the plain softmax.

    Raises
    ------
    ValueError
        When ``temperature`` is not positive.
    """
    if temperature <= 0:
        raise ValueError(f"sharpen: the temperature must be > 0, got {temperature}")
    return F.softmax(logits / temperature, dim=1)


def uda_loss(
    logits_strong: torch.Tensor,
    logits_weak: torch.Tensor,
    temperature: float = UDA_TEMPERATURE,
    threshold: float = UDA_THRESHOLD,
) -> tuple[torch.Tensor, PseudoLabels]:
    """UDA's consistency loss with confidence masking and sharpening (Xie et al. 2020).

    ``1/N sum_i 1(max softmax(z_i) >= beta) * KL(softmax(z_i / T) || softmax(s_i))`` with ``z``
    the (detached) logits on the clean view and ``s`` those on A(u).

    Parameters
    ----------
    logits_strong : torch.Tensor
        (N, d) logits on the strongly augmented views; the gradient flows through these.
    logits_weak : torch.Tensor
        (N, d) logits on the clean (here: weakly augmented) views; detached here.
    temperature : float
        T for sharpening the target.
    threshold : float
        beta: the mask keeps samples whose unsharpened confidence is >= beta.

    Returns
    -------
    (torch.Tensor, PseudoLabels)
        The scalar loss and the argmax / confidence / mask of the unsharpened prediction (the
        argmax only serves diagnostics: UDA's target is the soft distribution).
    """
    z = logits_weak.detach()
    pl = pseudo_labels(F.softmax(z, dim=1), threshold)
    return kl_consistency(logits_strong, sharpen(z, temperature), pl.mask), pl


def tsa_threshold(schedule: str, progress: float, num_classes: int) -> float:
    """eta_t of Training Signal Annealing: ``alpha_t (1 - 1/K) + 1/K``; 1 for ``none``.

    Parameters
    ----------
    schedule : str
        One of :data:`TSA_SCHEDULES`.
    progress : float
        t, the fraction of training done (clipped to [0, 1]).
    num_classes : int
        K.
    """
    t = min(max(progress, 0.0), 1.0)
    if schedule == "none":
        return 1.0
    if schedule == "linear":
        alpha = t
    elif schedule == "log":
        alpha = 1.0 - math.exp(-5.0 * t)
    elif schedule == "exp":
        alpha = math.exp(5.0 * (t - 1.0))
    else:
        raise ValueError(f"tsa_threshold: unknown schedule {schedule!r}; choose one of {', '.join(TSA_SCHEDULES)}")
    return alpha * (1.0 - 1.0 / num_classes) + 1.0 / num_classes


def tsa_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, threshold: float) -> torch.Tensor:
    """Cross-entropy over the labeled samples TSA keeps: correct-class probability <= eta_t.

    The mean runs over the kept samples (0 when none is kept), as in UDA's code. With
    ``threshold >= 1`` every sample is kept and this is the plain cross-entropy.
    """
    per_sample = F.cross_entropy(logits, labels, reduction="none")
    if threshold >= 1.0:
        return per_sample.mean()
    with torch.no_grad():
        correct = F.softmax(logits, dim=1).gather(1, labels.view(-1, 1)).squeeze(1)
        keep = (correct <= threshold).to(per_sample.dtype)
    return (per_sample * keep).sum() / keep.sum().clamp_min(1.0)
