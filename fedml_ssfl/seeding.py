"""Deterministic random streams derived from (seed, round, party).

Every random draw in a run comes from a generator built here from the run seed and the
place it is used, never from a global stream. Two consequences the runtimes rely on:

* a client's update depends only on (message, data, state, round, client id), so the local
  simulator and FedML processes produce the same model for the same seed;
* a run resumed from a checkpoint continues bit-for-bit, with no RNG state to restore.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(seed: int, *parts: int | str) -> int:
    """Mix a base seed with any number of tags into a 63-bit seed.

    Parameters
    ----------
    seed : int
        The run seed (``common_args.random_seed``).
    *parts : int or str
        Tags that name the use, e.g. ``("client", round_idx, client_id)``.

    Returns
    -------
    int
        A seed in ``[0, 2**63)``, stable across platforms and Python versions.
    """
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def generator(seed: int, *parts: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of the arguments."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *parts))
    return g


def numpy_rng(seed: int, *parts: int | str) -> np.random.Generator:
    """A NumPy ``Generator`` seeded with :func:`derive_seed` of the arguments."""
    return np.random.default_rng(derive_seed(seed, *parts))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch global streams (model initialisation uses them)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def global_stream(seed: int, *parts: int | str, device: torch.device | None = None) -> Iterator[None]:
    """Run a block with torch's global stream seeded from (seed, parts), restoring it after.

    Dropout (and anything else inside a model) draws from the global stream only. The runtimes
    wrap every server step, client update, aggregation and final step in this, so that even a
    dropout model's update is a pure function of (run seed, round, party): identical in both
    runtimes and after ``--resume``.
    """
    devices = []
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(seed, "global-stream", *parts))
        yield
