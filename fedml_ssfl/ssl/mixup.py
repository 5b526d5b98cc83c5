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
    return sample_mix_lambdas(a, 1, generator)[0]


def sample_mix_lambdas(a: float, count: int, generator: torch.Generator) -> list[float]:
    """``count`` independent draws of ``lambda_mix ~ Beta(a, a)`` from one NumPy stream seeded by one
    draw of ``generator`` (``count = 1`` is :func:`sample_mix_lambda`)."""
    if a <= 0:
        raise ValueError(f"sample_mix_lambda: Beta parameter must be > 0, got {a}")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return [float(v) for v in np.random.default_rng(seed).beta(a, a, size=count)]


def mix_inputs(x_a: torch.Tensor, x_b: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    """``lam * x_a + (1 - lam) * x_b`` (same shapes).

    ``lam`` is one float, or float64 ``(N,)``: one weight per sample (``1 - lam`` is taken in float64,
    as for a float, before either weight meets the images' dtype).
    """
    if x_a.shape != x_b.shape:
        raise ValueError(f"mix_inputs: shapes differ, {tuple(x_a.shape)} vs {tuple(x_b.shape)}")
    if isinstance(lam, torch.Tensor):
        shape = (-1,) + (1,) * (x_a.dim() - 1)
        weight_a, weight_b = (w.to(x_a.device, x_a.dtype).view(shape) for w in (lam, 1.0 - lam))
        return weight_a * x_a + weight_b * x_b
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
