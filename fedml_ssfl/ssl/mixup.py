"""Mixup (Zhang et al. 2018) as SemiFL uses it (Diao et al. Eq. 5, Algorithm 1).

``lambda_mix ~ Beta(a, a)``, ``x_mix = lambda_mix x_fix + (1 - lambda_mix) x_mix``, and the
loss is the same convex combination of the two cross-entropies against both label sets.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F


def sample_mix_lambda(a: float, generator: torch.Generator) -> float:
    """One draw of ``lambda_mix ~ Beta(a, a)``, reproducible from ``generator``.

    torch's Beta sampler takes no generator, so a NumPy stream is seeded from one draw of
    ``generator``: the result depends on the generator's state only.
    """
    if a <= 0:
        raise ValueError(f"sample_mix_lambda: Beta parameter must be > 0, got {a}")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return float(np.random.default_rng(seed).beta(a, a))


def mix_inputs(x_a: torch.Tensor, x_b: torch.Tensor, lam: float) -> torch.Tensor:
    """``lam * x_a + (1 - lam) * x_b`` (same shapes)."""
    if x_a.shape != x_b.shape:
        raise ValueError(f"mix_inputs: shapes differ, {tuple(x_a.shape)} vs {tuple(x_b.shape)}")
    return lam * x_a + (1.0 - lam) * x_b


def mixup_loss(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> torch.Tensor:
    """Diao et al. Eq. 5, L_mix: ``lam * CE(logits, y_a) + (1 - lam) * CE(logits, y_b)``.

    Parameters
    ----------
    logits : torch.Tensor
        (N, d) logits of the mixed inputs.
    y_a, y_b : torch.Tensor
        (N,) int64 labels of the two mixed batches (SemiFL: y_fix and y_mix).
    lam : float
        The mixing weight of ``y_a``.
    """
    return lam * F.cross_entropy(logits, y_a) + (1.0 - lam) * F.cross_entropy(logits, y_b)
