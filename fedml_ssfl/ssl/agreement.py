"""FedMatch's agreement-based pseudo-label (Jeong et al. 2021, Eq. 3).

``y_hat = Max( 1(p_local(y|u)) + sum_j 1(p_helper_j(y|u)) )``: every model (the local one and
its H helpers) casts one vote, the one-hot of its argmax; the label is the class with the most
votes. A sample is kept only where the local model's own confidence ``max p_local >= tau``
(Sec. 3.1: "we discard instances with low-confident predictions"; the authors' code thresholds
the local model, tau = 0.75). With no helpers the vote is the local model alone, i.e. plain
confidence-masked pseudo-labelling.

Ties (the paper does not say; with H = 2 three-way disagreements happen): the local model's
class wins when it is among the most-voted classes; otherwise the tied class with the largest
summed probability over all voters; if that ties too, the lowest class index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .pseudo_label import PseudoLabels


def agreement_pseudo_labels(
    local_probs: torch.Tensor, helper_probs: Sequence[torch.Tensor], threshold: float
) -> PseudoLabels:
    """Eq. 3: the majority vote of the local model and its helpers, masked by local confidence.

    Parameters
    ----------
    local_probs : torch.Tensor
        (N, d) probabilities of the local model on the unaugmented inputs.
    helper_probs : sequence of torch.Tensor
        H tensors (N, d): the helpers' probabilities on the same inputs (may be empty).
    threshold : float
        tau; samples whose local confidence is below it are masked out.

    Returns
    -------
    PseudoLabels
        ``labels`` (N,) the voted classes, ``confidence`` (N,) the local model's max
        probability, ``mask`` (N,) ``confidence >= tau``.
    """
    if local_probs.ndim != 2:
        raise ValueError(
            f"agreement_pseudo_labels: expected (N, d) local probabilities, got {tuple(local_probs.shape)}"
        )
    for j, p in enumerate(helper_probs):
        if p.shape != local_probs.shape:
            raise ValueError(
                f"agreement_pseudo_labels: helper {j} has shape {tuple(p.shape)}, the local model "
                f"{tuple(local_probs.shape)}"
            )
    local = local_probs.detach()
    d = local.shape[1]
    confidence, local_arg = local.max(dim=1)
    voters = [local, *(p.detach().to(local.device) for p in helper_probs)]
    classes = torch.arange(d, device=local.device)

    def one_hot(index: torch.Tensor) -> torch.Tensor:  # F.one_hot reads its values (.item()), which vmap refuses
        return (index.unsqueeze(1) == classes).to(torch.float64)

    votes = torch.zeros_like(local, dtype=torch.float64)
    prob_sum = torch.zeros_like(local, dtype=torch.float64)
    for p in voters:
        votes += one_hot(p.argmax(dim=1))
        prob_sum += p.to(torch.float64)
    # Lexicographic key: votes first, then "is the local model's class", then the summed
    # probability (< len(voters) + 1 = step); argmax takes the lowest index among exact ties.
    step = float(len(voters) + 1)
    local_bonus = one_hot(local_arg) * step
    key = votes * (2.0 * step) + local_bonus + prob_sum
    labels = key.argmax(dim=1)
    return PseudoLabels(labels=labels, confidence=confidence, mask=confidence >= threshold)
