"""The result of a split: who holds which training samples, and how non-iid that is (Zhang et al. Eq. 1).

:func:`fedml_ssfl.data.partition.build_split` builds a :class:`Split`; reports, the runtimes and the
deployment files read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_WHICH = ("all", "unlabeled", "labeled")


@dataclass
class Split:
    """Who holds which training samples.

    Attributes
    ----------
    server_labeled : torch.Tensor
        int64 indices into the train set: the server's labeled samples.
    server_val : torch.Tensor
        int64 indices of the server's validation set (disjoint from ``server_labeled``).
    client_unlabeled : list of torch.Tensor
        One int64 index tensor per client: sorted, except for streaming splits, where it is
        ordered by stage (sorted within each stage) so that every release is a prefix.
    client_labeled : list of torch.Tensor
        One per client; empty in the labels-at-server scenario.
    num_classes : int
        Number of classes ``d``.
    requested_r : float or None
        The requested non-iid level for method ``"r"``, else None.
    method, scenario : str
        How the split was built (for reports).
    client_stages : list of torch.Tensor or None
        Streaming splits: per client, the int64 stage id (0 .. T-1, non-decreasing) of each entry
        of ``client_unlabeled``; None when not streaming.
    num_stages : int
        T for streaming splits, 0 otherwise.
    rounds_per_stage : int
        Rounds between two stage releases (streaming splits).
    """

    server_labeled: torch.Tensor
    server_val: torch.Tensor
    client_unlabeled: list[torch.Tensor]
    client_labeled: list[torch.Tensor]
    num_classes: int
    requested_r: float | None = None
    method: str = "iid"
    scenario: str = "server"
    client_stages: list[torch.Tensor] | None = None
    num_stages: int = 0
    rounds_per_stage: int = 1

    @property
    def num_clients(self) -> int:
        """Number of clients K."""
        return len(self.client_unlabeled)

    @property
    def streaming(self) -> bool:
        """Whether the clients' unlabeled data arrives in stages."""
        return self.client_stages is not None

    def client_indices(self, client_id: int, which: str = "all") -> torch.Tensor:
        """One client's indices: ``"all"`` (unlabeled then labeled), ``"unlabeled"`` or ``"labeled"``."""
        if which not in _WHICH:
            raise ValueError(f"which must be one of {_WHICH}, got {which!r}")
        if which == "unlabeled":
            return self.client_unlabeled[client_id]
        if which == "labeled":
            return self.client_labeled[client_id]
        return torch.cat([self.client_unlabeled[client_id], self.client_labeled[client_id]])

    def released_stages(self, round_idx: int | None) -> int:
        """How many stages are out at round ``round_idx``: ``min(T, round_idx // rounds_per_stage + 1)``.

        ``T`` for ``round_idx=None``; 0 for a split that is not streaming.
        """
        if not self.streaming:
            return 0
        if round_idx is None:
            return self.num_stages
        if round_idx < 0:
            raise ValueError(f"round_idx must be >= 0, got {round_idx}")
        return min(self.num_stages, round_idx // self.rounds_per_stage + 1)

    def unlabeled_at(self, client_id: int, round_idx: int | None = None) -> torch.Tensor:
        """Client ``client_id``'s unlabeled indices visible at round ``round_idx``.

        Not streaming, or ``round_idx=None``: all of them. Streaming: the stages released so far
        (:meth:`released_stages`), a prefix of ``client_unlabeled[client_id]``, so a sample keeps
        its position from its release on.
        """
        unlabeled = self.client_unlabeled[client_id]
        if not self.streaming or round_idx is None:
            return unlabeled
        released = self.released_stages(round_idx)
        return unlabeled[: int((self.client_stages[client_id] < released).sum())]

    def stage_sizes(self, client_id: int) -> np.ndarray:
        """int64 ``(T,)``: how many unlabeled samples of the client each stage releases (empty if not streaming)."""
        if not self.streaming:
            return np.zeros(0, dtype=np.int64)
        return np.bincount(self.client_stages[client_id].numpy(), minlength=self.num_stages).astype(np.int64)

    def class_histograms(self, labels: torch.Tensor, which: str = "all") -> np.ndarray:
        """Per-client class counts.

        Parameters
        ----------
        labels : torch.Tensor
            The train labels the indices point into.
        which : {"all", "unlabeled", "labeled"}
            Which of each client's index sets to count.

        Returns
        -------
        numpy.ndarray
            int64 array ``(K, d)``.
        """
        y = as_numpy_labels(labels)
        rows = [
            np.bincount(y[self.client_indices(k, which).numpy()], minlength=self.num_classes)
            for k in range(self.num_clients)
        ]
        return np.stack(rows).astype(np.int64) if rows else np.zeros((0, self.num_classes), np.int64)

    def measured_r(self, labels: torch.Tensor) -> float:
        """The non-iid level R (Zhang et al. Eq. 1) of the clients' class distributions.

        Parameters
        ----------
        labels : torch.Tensor
            The train labels.

        Returns
        -------
        float
            :func:`non_iid_level` of :meth:`class_histograms` (all of each client's samples).
        """
        return non_iid_level(self.class_histograms(labels, "all"))


def non_iid_level(histograms: np.ndarray) -> float:
    """Zhang et al. Eq. 1: the mean pairwise total-variation distance of the clients' class distributions.

    ``R = 2 / (K (K - 1)) * sum_{k < m} ||P_k - P_m||_1 / 2`` with ``P_k`` the normalised row k.

    Parameters
    ----------
    histograms : numpy.ndarray
        ``(K, d)`` non-negative class counts (or probabilities), one row per client. Rows that sum
        to zero (clients without data) are left out.

    Returns
    -------
    float
        R in ``[0, 1]``; 0 when fewer than two clients have data.
    """
    h = np.asarray(histograms, dtype=np.float64)
    h = h[h.sum(axis=1) > 0]
    k = h.shape[0]
    if k < 2:
        return 0.0
    p = h / h.sum(axis=1, keepdims=True)
    tv_sum = sum(float(np.abs(p[i + 1 :] - p[i]).sum()) / 2.0 for i in range(k - 1))
    return 2.0 / (k * (k - 1)) * tv_sum


def as_numpy_labels(labels: torch.Tensor | np.ndarray) -> np.ndarray:
    """Labels as a flat int64 numpy array."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    return np.asarray(labels, dtype=np.int64).reshape(-1)
