"""FedMatch's helper agents, server side (Jeong et al. 2021, Sec. 3.1).

The server represents each client's model by its prediction on one fixed arbitrary input (the
paper: random Gaussian noise), ``m^l = p_theta^l(y | a)``, keeps the newest embedding of every
client that has sent an update, builds a KD-tree over them (``scipy.spatial.cKDTree``) and
gives each such client its H nearest *other* clients as helpers. Clients the server has not
heard from yet get no helpers.

* :func:`probe_input`: the fixed noise input (pixel space), drawn from the run's seeded stream.
* :func:`model_embedding`: softmax outputs of a model on the probe, flattened.
* :func:`nearest_helpers`: client id -> its H nearest other clients by Euclidean distance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from . import seeding


def probe_input(seed: int, shape: tuple[int, int, int], count: int = 1) -> torch.Tensor:
    """``count`` random-noise images of ``shape`` (C, H, W) in pixel space ``[0, 1]``, fixed by the seed.

    Gaussian noise with mean and standard deviation 0.5, clipped to ``[0, 1]`` (the authors draw
    a truncated normal image); normalise it like the data before feeding a model. Drawn from
    ``seeding.generator(seed, "fedmatch-probe")``, so every run and resume sees the same input.
    """
    gen = seeding.generator(seed, "fedmatch-probe")
    return (0.5 + 0.5 * torch.randn((count, *shape), generator=gen)).clamp_(0.0, 1.0)


@torch.no_grad()
def model_embedding(forward: Callable[[torch.Tensor], torch.Tensor], probe: torch.Tensor) -> torch.Tensor:
    """``softmax(forward(probe))`` flattened to one CPU float64 vector (length count x d)."""
    logits = forward(probe)
    return logits.float().softmax(dim=1).reshape(-1).to("cpu", torch.float64)


def nearest_helpers(embeddings: Mapping[int, torch.Tensor], num_helpers: int) -> dict[int, list[int]]:
    """Each client's ``num_helpers`` nearest other clients by embedding distance (KD-tree).

    Parameters
    ----------
    embeddings : mapping of int to torch.Tensor
        client id -> 1-D embedding (all the same length); only these clients are considered.
    num_helpers : int
        H. A client gets ``min(H, number of other clients)`` helpers, nearest first.

    Returns
    -------
    dict[int, list[int]]
        client id -> helper ids (never the client itself). Equal distances keep the order the
        KD-tree returns, which is deterministic for the same embeddings.
    """
    from scipy.spatial import cKDTree  # late: only the server needs scipy here

    ids = sorted(embeddings)
    out: dict[int, list[int]] = {k: [] for k in ids}
    if num_helpers <= 0 or len(ids) < 2:
        return out
    points = np.stack([embeddings[k].detach().cpu().double().numpy().reshape(-1) for k in ids])
    tree = cKDTree(points)
    k = min(num_helpers + 1, len(ids))
    _, found = tree.query(points, k=k)
    found = np.asarray(found).reshape(len(ids), k)
    for row, client in enumerate(ids):
        others = [ids[j] for j in found[row].tolist() if ids[j] != client]
        out[client] = others[:num_helpers]
    return out
