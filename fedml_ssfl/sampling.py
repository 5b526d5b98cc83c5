"""The one seeded client sampler both runtimes use."""

from __future__ import annotations

import torch

from . import seeding


def sample_clients(seed: int, round_idx: int, num_clients: int, per_round: int) -> list[int]:
    """The C_k of K clients taking part in round ``round_idx`` (sorted ids).

    A pure function of its arguments, so the local simulator, every FedML process and a
    resumed run agree on it without sharing state. ``per_round >= num_clients`` selects all.
    """
    if per_round >= num_clients:
        return list(range(num_clients))
    g = seeding.generator(seed, "sample", round_idx)
    return sorted(torch.randperm(num_clients, generator=g)[:per_round].tolist())
