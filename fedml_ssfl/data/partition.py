"""Split a training set between the server and K clients, and measure how non-iid the split is.

Order of work (Zhang et al., Appendix A.2): a balanced labeled set for the server (``N_s / d`` per
class), then a balanced server validation set, then the rest shared among the K clients by one of
the methods below. In the labels-at-client scenario each client also holds a few labeled samples.

Client partition methods (``data_args.partition_method``)
---------------------------------------------------------
``iid``
    Shuffle and deal evenly.
``r``
    Zhang et al.'s non-iid level R (Appendix A.2), see :func:`r_targets`.
``dirichlet``
    Per class, proportions over clients ~ Dir(``partition_alpha``).
``shards``
    Single-class shards, ``classes_per_client`` per client (at most that many classes; two shards
    may come from the same class).
``batch_iid``
    FedMatch's Batch-IID (Jeong et al. Sec. 5): the same split as ``iid`` under FedMatch's name.
    Labels-at-client: ``labels_per_class_client`` (FedMatch: 5) labeled per class per client.
``batch_noniid``
    FedMatch's Batch-NonIID (class-imbalanced clients). Client k has the main class ``j = k mod d``
    and the class profile of the FedMatch authors' code, generalised to d classes by the circular
    distance ``delta`` between a class and j: weight 0.50 for ``delta = 0``, 0.15 for ``delta = 1``
    (both neighbours), 0.02 for the opposite class (``delta = d / 2``, d even, d > 2) and 0.03 for
    every other class, normalised to sum 1 (for d = 10 exactly the authors' ten
    ``ten_types_of_class_imbalanced_dist`` rows). ``imbalance_strength`` s mixes it with the
    uniform distribution: ``p_k = s * profile_k + (1 - s) / d`` (s = 1, the default, is the authors'
    profile: largest / smallest class 25; s = 0 is balanced), see :func:`imbalance_weights`. Each
    class's pool is shared among the clients in proportion to ``p_k(c)`` (largest-remainder
    rounding), so every sample is assigned and every client holds every class; with K a multiple
    of d and balanced classes each client gets ``N / K`` samples with class proportions ``p_k``,
    the authors' construction. Labels-at-client: as in the authors' code, the labeled set stays
    balanced (``labels_per_class_client`` per class per client, taken before the imbalanced
    unlabeled split); only the unlabeled data is imbalanced.
``streaming_noniid``
    FedMatch's Streaming-NonIID: exactly the ``batch_noniid`` split (same seed, same sets), and
    each client's unlabeled data is cut at random into ``num_stages`` (T = 10) chunks whose sizes
    differ by at most one. Stage ``s`` (0-based) is released at round ``s * rounds_per_stage``
    (10); a round sees every stage released so far (cumulative), see :meth:`Split.unlabeled_at`.
    The labeled data (client or server) is there from round 0.
``noniid_1``
    FedSiam's Non-IID-I (Long et al. Sec. 4.1): each client holds exactly ``classes_per_client``
    (2) *distinct* classes, labeled and unlabeled alike, drawn at random but so that every class
    is held by the same number of clients (see :func:`client_class_sets`); each class is dealt
    evenly over its holders. Also
    FedSiam's labels-at-server non-IID setting ("each client only contains 2 random categories of
    unlabeled data"); ``shards`` with ``classes_per_client: 2`` is the looser variant (at most 2).
``noniid_2``
    FedSiam's Non-IID-II, labels-at-client only: the labeled data of each client comes from its
    ``classes_per_client`` (2) distinct classes, its unlabeled data from all classes (stratified
    iid: each client holds ``n_c / K`` of every class c, +-1, and ``N / K`` in all, +-1).
``noniid_3``
    FedSiam's Non-IID-III, labels-at-client only: a stratified iid split (as for ``noniid_2``'s
    unlabeled data, so every client holds every class), then ``rich_client_fraction``
    (10%) of the clients, drawn at random, label ``rich_label_ratio`` (55%) of their data and the
    others ``poor_label_ratio`` (5%); the mean is 10%, FedSiam's gamma = 0.1.

Labels at the clients (``label_scenario: client``)
--------------------------------------------------
Except for ``batch_noniid`` / ``streaming_noniid`` (always per class) and ``noniid_3`` (its own
ratios), a client's labeled set is either ``labels_per_class_client`` samples of every class it
holds (``client_label_ratio: 0``, the default; FedMatch) or, with ``client_label_ratio`` gamma > 0
(FedSiam: 0.1, 0.15, 0.2), ``round_half_up(gamma * n_k)`` of its ``n_k`` samples, stratified by
class (per-class quotas proportional to its class counts, largest remainder). ``noniid_2`` draws
its labels before the unlabeled split: ``round_half_up(gamma * N / K)`` per client (N = what is
left after the server's sets) spread evenly over the client's classes, or
``labels_per_class_client`` of each of them. FedSiam's settings
map as: IID = ``iid`` + gamma; Non-IID-I = ``noniid_1`` + gamma; Non-IID-II = ``noniid_2`` + gamma;
Non-IID-III = ``noniid_3``. FedSiam's labels-at-server settings: ``label_scenario: server`` with
``num_server_labels`` = gamma * N (class-balanced here; FedSiam shuffles and cuts) and ``iid``
(IID) or ``noniid_1`` / ``shards`` with ``classes_per_client: 2`` (Non-IID).

Everything random comes from ``fedml_ssfl.seeding.numpy_rng(seed, "partition")`` (and
``numpy_rng(seed, "partition", "stages")`` for the streaming stages): the same seed gives the same
split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedml_ssfl.config import CHOICES
from fedml_ssfl.seeding import numpy_rng

METHODS = CHOICES["data_args.partition_method"]
"""The partition methods (config.py's list of allowed ``data_args.partition_method`` values)."""
SCENARIOS = ("server", "client")
CLIENT_ONLY_METHODS = ("noniid_2", "noniid_3")
"""Methods that only make sense with labels at the clients."""
IMBALANCED_METHODS = ("batch_noniid", "streaming_noniid")
"""FedMatch's class-imbalanced methods (labeled data per class, never by ratio)."""
STREAMING_METHODS = ("streaming_noniid",)
"""Methods whose unlabeled data arrives in stages."""
CLASS_SET_METHODS = ("noniid_1", "noniid_2")
"""Methods giving each client ``classes_per_client`` distinct classes."""
FEDMATCH_PROFILE = (0.50, 0.15, 0.03, 0.02)
"""Class weights of FedMatch's imbalanced clients: main class, its two neighbours, any other, the opposite."""
_WHICH = ("all", "unlabeled", "labeled")
_DIRICHLET_TRIES = 10


def round_half_up(x: float) -> int:
    """``floor(x + 0.5)``: how label ratios become counts (0.05 * 90 = 4.5 -> 5)."""
    return int(math.floor(x + 0.5 + 1e-9))


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
        y = _as_numpy_labels(labels)
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


def largest_remainder(targets: np.ndarray, total: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Round non-negative real ``targets`` to integers that sum to ``total``.

    Parameters
    ----------
    targets : numpy.ndarray
        Real targets; ``total`` should be close to their sum.
    total : int
        The required sum.
    rng : numpy.random.Generator, optional
        Breaks ties between equal fractional parts at random; without it, lower indices win.

    Returns
    -------
    numpy.ndarray
        int64 counts: the floors, plus one for the largest fractional parts until the sum is ``total``.
    """
    targets = np.asarray(targets, dtype=np.float64)
    counts = np.floor(targets + 1e-9).astype(np.int64)
    missing = int(total - counts.sum())
    if missing > 0:
        frac = np.round(targets - counts, 9)  # equal fractions tie exactly despite float noise
        tiebreak = rng.random(len(targets)) if rng is not None else np.arange(len(targets))
        order = np.lexsort((tiebreak, -frac))
        counts[order[:missing]] += 1
    return counts


# --------------------------------------------------------------------------------------------
# validation and the server's share
# --------------------------------------------------------------------------------------------


def _as_numpy_labels(labels: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    return np.asarray(labels, dtype=np.int64).reshape(-1)


def balanced_counts(total: int, num_classes: int) -> np.ndarray:
    """``total // d`` per class, the remainder spread one each over the first classes."""
    counts = np.full(num_classes, total // num_classes, dtype=np.int64)
    counts[: total % num_classes] += 1
    return counts


def check_method_options(
    *,
    method: str,
    scenario: str,
    classes_per_client: int = 2,
    client_label_ratio: float = 0.0,
    imbalance_strength: float = 1.0,
    num_stages: int = 10,
    rounds_per_stage: int = 10,
    rich_client_fraction: float = 0.1,
    rich_label_ratio: float = 0.55,
    poor_label_ratio: float = 0.05,
    num_classes: int | None = None,
) -> None:
    """Check the options of the FedMatch / FedSiam methods, and that they go with the method and scenario.

    Data-independent (the config validation calls it too); ``num_classes`` None skips the check
    of ``classes_per_client`` against the number of classes.

    Raises
    ------
    ValueError
        Naming the config key(s) and the fix.
    """
    for key, value in (
        ("client_label_ratio", client_label_ratio),
        ("imbalance_strength", imbalance_strength),
        ("rich_client_fraction", rich_client_fraction),
        ("rich_label_ratio", rich_label_ratio),
        ("poor_label_ratio", poor_label_ratio),
    ):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"data_args.{key} must be in [0, 1], got {value}")
    for key, value in (("num_stages", num_stages), ("rounds_per_stage", rounds_per_stage)):
        if value < 1:
            raise ValueError(f"data_args.{key} must be >= 1, got {value}")
    if method in CLIENT_ONLY_METHODS and scenario != "client":
        raise ValueError(
            f"data_args.partition_method {method!r} is a labels-at-client setting (FedSiam "
            f"{'Non-IID-II' if method == 'noniid_2' else 'Non-IID-III'}); set data_args.label_scenario: client. "
            "For FedSiam's labels-at-server non-IID setting (2 classes of unlabeled data per client) use "
            "partition_method noniid_1 (exactly 2 distinct classes) or shards, with data_args.classes_per_client: 2"
        )
    if client_label_ratio > 0:
        if scenario != "client":
            raise ValueError(
                "data_args.client_label_ratio (gamma, the labeled fraction of each client's data) needs "
                "data_args.label_scenario: client; with labels at the server set data_args.num_server_labels "
                "(gamma * N) instead and data_args.client_label_ratio: 0"
            )
        if method in IMBALANCED_METHODS:
            raise ValueError(
                f"data_args.client_label_ratio is not used by FedMatch's {method!r}: its clients hold "
                "data_args.labels_per_class_client labels per class; set data_args.client_label_ratio: 0"
            )
        if method == "noniid_3":
            raise ValueError(
                "data_args.client_label_ratio is not used by 'noniid_3', whose clients label "
                "data_args.rich_label_ratio or data_args.poor_label_ratio of their data; "
                "set data_args.client_label_ratio: 0"
            )
    if method in CLASS_SET_METHODS and num_classes is not None and classes_per_client > num_classes:
        raise ValueError(
            f"data_args.classes_per_client ({classes_per_client}) exceeds the {num_classes} classes; "
            f"{method!r} gives each client that many distinct classes, so use at most {num_classes}"
        )


def _validate(
    n: int,
    num_classes: int,
    num_clients: int,
    scenario: str,
    method: str,
    num_server_labels: int,
    num_server_val: int,
    non_iid_r: float,
    alpha: float,
    classes_per_client: int,
    labels_per_class_client: int,
    **method_options: float,
) -> None:
    """Raise ValueError naming the config key for any impossible argument."""
    if num_clients < 1:
        raise ValueError(f"train_args.client_num_in_total must be >= 1, got {num_clients}")
    if scenario not in SCENARIOS:
        raise ValueError(
            f"data_args.label_scenario: {scenario!r} is not one of {SCENARIOS} "
            "(server = labels-at-server, client = labels-at-client)"
        )
    if method not in METHODS:
        raise ValueError(f"data_args.partition_method: unknown method {method!r}; use one of {METHODS}")
    if num_server_labels < 0 or num_server_val < 0:
        raise ValueError("data_args.num_server_labels and data_args.num_server_val must be >= 0")
    if scenario == "server" and num_server_labels == 0:
        raise ValueError("data_args.num_server_labels must be > 0 when data_args.label_scenario is 'server'")
    if num_server_labels + num_server_val > n:
        raise ValueError(
            f"data_args.num_server_labels ({num_server_labels}) + "
            f"data_args.num_server_val ({num_server_val}) exceed the {n} training samples; "
            f"lower them to at most {n} together"
        )
    if method == "r" and not 0.0 <= non_iid_r <= 1.0:
        raise ValueError(f"data_args.non_iid_r must be in [0, 1], got {non_iid_r}")
    if method == "dirichlet" and not alpha > 0:
        raise ValueError(f"data_args.partition_alpha must be > 0, got {alpha}")
    if method in ("shards", *CLASS_SET_METHODS) and classes_per_client < 1:
        raise ValueError(f"data_args.classes_per_client must be >= 1, got {classes_per_client}")
    if labels_per_class_client < 0:
        raise ValueError(f"data_args.labels_per_class_client must be >= 0, got {labels_per_class_client}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    check_method_options(
        method=method,
        scenario=scenario,
        classes_per_client=classes_per_client,
        num_classes=num_classes,
        **method_options,
    )


def _class_pools(y: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's indices, shuffled."""
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    return [rng.permutation(np.flatnonzero(y == c)) for c in range(num_classes)]


def _take_balanced(pools: list[np.ndarray], total: int, key: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Take ``total`` samples, balanced over classes, from the front of the pools."""
    need = balanced_counts(total, len(pools))
    short = [c for c, (p, k) in enumerate(zip(pools, need)) if len(p) < k]
    if short:
        c = short[0]
        raise ValueError(
            f"{key}: class {c} has only {len(pools[c])} samples left but the server needs {need[c]} of it "
            f"({total} balanced over {len(pools)} classes); lower {key}"
        )
    taken = np.concatenate([p[:k] for p, k in zip(pools, need)]) if pools else np.zeros(0, np.int64)
    return taken, [p[k:] for p, k in zip(pools, need)]


# --------------------------------------------------------------------------------------------
# the four client partition methods; each maps class pools to a list of K index arrays
# --------------------------------------------------------------------------------------------


def _partition_iid(pools: list[np.ndarray], k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle everything and deal it evenly (sizes differ by at most one)."""
    everything = rng.permutation(np.concatenate(pools))
    return list(np.array_split(everything, k))


def r_targets(available: np.ndarray, num_clients: int, r: float) -> np.ndarray:
    """Zhang et al. Appendix A.2 real-valued targets: how many samples of class i client k gets.

    Client k's main class is ``j = k mod d``; ``m_j`` clients share main class j; ``q`` is the
    class distribution of what is left (``q_j = n_j / sum n``). A client with main class j gets
    ``n_j R / m_j`` of class j plus ``n_i q_j (1 - R) / m_j`` of every class i.

    Parameters
    ----------
    available : numpy.ndarray
        ``n``: samples left per class, shape ``(d,)``.
    num_clients : int
        K.
    r : float
        The requested non-iid level R.

    Returns
    -------
    numpy.ndarray
        ``(K, d)`` real targets; each class's column sums to ``n_i`` when K >= d. When K < d, ``q`` is
        renormalised over the classes that are some client's main class (so the ``(1 - R)`` share of
        every class is still handed out in full), and the main-class share ``R n_j`` of a class with
        ``m_j = 0`` stays unassigned.
    """
    n = np.asarray(available, dtype=np.float64)
    d = n.size
    main = np.arange(num_clients) % d
    m = np.bincount(main, minlength=d).astype(np.float64)
    weight = np.where(m > 0, n, 0.0)
    q = weight / weight.sum() if weight.sum() > 0 else np.zeros(d)
    targets = np.outer(q[main] * (1.0 - r) / m[main], n)
    targets[np.arange(num_clients), main] += n[main] * r / m[main]
    return targets


def _partition_r(pools: list[np.ndarray], k: int, rng: np.random.Generator, r: float) -> list[np.ndarray]:
    """Zhang et al.'s R partition with per-class largest-remainder rounding.

    Ties between equal fractional parts go to lower client ids: in trials this kept the measured R
    closer to the requested one than random tie-breaking (rounding error shrinks as 1 / n_j).
    """
    n = np.array([len(p) for p in pools])
    targets = r_targets(n, k, r)
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c, pool in enumerate(pools):
        col = targets[:, c]
        counts = largest_remainder(col, min(len(pool), int(round(col.sum()))))
        # counts may sum to less than the pool (K < d): the tail stays unassigned
        for client, chunk in enumerate(np.split(pool[: counts.sum()], np.cumsum(counts)[:-1])):
            parts[client].append(chunk)
    return [np.concatenate(p) for p in parts]


def _dirichlet_once(pools: list[np.ndarray], k: int, rng: np.random.Generator, alpha: float) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for pool in pools:
        props = rng.dirichlet(np.full(k, alpha))
        cuts = (np.cumsum(props)[:-1] * len(pool)).astype(np.int64)
        for client, chunk in enumerate(np.split(pool, cuts)):
            parts[client].append(chunk)
    return [np.concatenate(p) for p in parts]


def _fill_empty(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Move one sample from the largest client to each empty one (deterministic last resort)."""
    parts = list(parts)
    for i in range(len(parts)):
        if len(parts[i]) == 0:
            donor = int(np.argmax([len(p) for p in parts]))
            if len(parts[donor]) < 2:
                break
            parts[i], parts[donor] = parts[donor][-1:], parts[donor][:-1]
    return parts


def _partition_dirichlet(pools: list[np.ndarray], k: int, rng: np.random.Generator, alpha: float) -> list[np.ndarray]:
    """Per class, proportions over clients drawn from Dir(alpha); redrawn (up to 10 times) if a
    client is left empty, after which one sample is moved from the largest client to each empty one."""
    total = sum(len(p) for p in pools)
    parts = _dirichlet_once(pools, k, rng, alpha)
    for _ in range(_DIRICHLET_TRIES):
        if total < k or min(len(p) for p in parts) > 0:
            break
        parts = _dirichlet_once(pools, k, rng, alpha)
    return _fill_empty(parts)


def _shards_per_class(sizes: np.ndarray, num_shards: int) -> np.ndarray:
    """How many single-class shards each class is cut into (about proportional to its size)."""
    nonempty = sizes > 0
    if num_shards < nonempty.sum():
        # not enough shards for every class: the largest classes get one each
        order = np.argsort(-sizes, kind="stable")[:num_shards]
        counts = np.zeros_like(sizes)
        counts[order] = 1
        return counts
    extra = num_shards - int(nonempty.sum())
    counts = nonempty.astype(np.int64)
    if extra and sizes.sum() > 0:
        counts += largest_remainder(sizes * extra / sizes.sum(), extra)
    return counts


def _partition_shards(pools: list[np.ndarray], k: int, rng: np.random.Generator, per_client: int) -> list[np.ndarray]:
    """Cut each class into single-class shards (``K * classes_per_client`` in all) and deal each
    client ``classes_per_client`` of them at random, so no client holds more classes than that."""
    sizes = np.array([len(p) for p in pools])
    shard_counts = _shards_per_class(sizes, k * per_client)
    shards = [s for pool, c in zip(pools, shard_counts) if c > 0 for s in np.array_split(pool, c)]
    order = rng.permutation(len(shards))
    return [
        np.concatenate([shards[i] for i in order[j * per_client : (j + 1) * per_client]] or [np.zeros(0, np.int64)])
        for j in range(k)
    ]


# --------------------------------------------------------------------------------------------
# FedMatch's class-imbalanced clients
# --------------------------------------------------------------------------------------------


def imbalance_profile(num_classes: int) -> np.ndarray:
    """The class distribution of FedMatch's imbalanced client whose main class is 0, for d classes.

    By circular distance ``delta`` from the main class: 0.50 (``delta = 0``), 0.15 (``delta = 1``),
    0.02 (the opposite class, ``delta = d / 2`` for even d > 2), 0.03 (any other), normalised to
    sum 1. For d = 10: ``[.50, .15, .03, .03, .03, .02, .03, .03, .03, .15]``, the authors' type 0.
    """
    main, neighbour, other, opposite = FEDMATCH_PROFILE
    c = np.arange(num_classes)
    delta = np.minimum(c, num_classes - c)
    w = np.full(num_classes, other)
    if num_classes % 2 == 0 and num_classes > 2:
        w[delta == num_classes // 2] = opposite
    w[delta == 1] = neighbour
    w[0] = main
    return w / w.sum()


def imbalance_weights(num_clients: int, num_classes: int, strength: float = 1.0) -> np.ndarray:
    """``(K, d)`` class distributions of FedMatch's imbalanced clients.

    Row k is :func:`imbalance_profile` rolled to main class ``k mod d``, mixed with the uniform
    distribution: ``strength * profile + (1 - strength) / d``.
    """
    profile = imbalance_profile(num_classes)
    rows = np.stack([np.roll(profile, k % num_classes) for k in range(num_clients)])
    return strength * rows + (1.0 - strength) / num_classes


def _partition_imbalanced(
    pools: list[np.ndarray], k: int, rng: np.random.Generator, strength: float
) -> list[np.ndarray]:
    """Each class's pool shared among the clients in proportion to :func:`imbalance_weights`."""
    w = imbalance_weights(k, len(pools), strength)
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c, pool in enumerate(pools):
        col = w[:, c]
        counts = largest_remainder(col / col.sum() * len(pool), len(pool), rng)
        for client, chunk in enumerate(np.split(pool, np.cumsum(counts)[:-1])):
            parts[client].append(chunk)
    return [np.concatenate(p) for p in parts]


def _take_per_class_labels(
    pools: list[np.ndarray], k: int, per_class: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``per_class`` labeled samples of every class for each of the k clients, taken from the pools first."""
    need = k * per_class
    for c, pool in enumerate(pools):
        if len(pool) < need:
            raise ValueError(
                f"data_args.labels_per_class_client: class {c} has only {len(pool)} samples left but {k} clients "
                f"x {per_class} labels need {need}; lower data_args.labels_per_class_client (or "
                "num_server_labels / num_server_val)"
            )
    labeled = [
        np.concatenate([pool[j * per_class : (j + 1) * per_class] for pool in pools]) if pools else np.zeros(0)
        for j in range(k)
    ]
    return [lab.astype(np.int64) for lab in labeled], [pool[need:] for pool in pools]


def _assign_stages(unlabeled: np.ndarray, num_stages: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Cut a client's unlabeled indices at random into T chunks (sizes differ by at most one).

    Returns the indices ordered by (stage, index) and the stage of each.
    """
    unlabeled = np.sort(unlabeled)
    stage = np.empty(len(unlabeled), dtype=np.int64)
    for s, chunk in enumerate(np.array_split(rng.permutation(len(unlabeled)), num_stages)):
        stage[chunk] = s
    order = np.lexsort((unlabeled, stage))
    return unlabeled[order], stage[order]


# --------------------------------------------------------------------------------------------
# FedSiam's class sets and label ratios
# --------------------------------------------------------------------------------------------


def client_class_sets(num_clients: int, num_classes: int, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """``(K, m)``: each client's ``m = per_client`` distinct classes, every class used equally often.

    Clients go in blocks of d. In each block a random permutation ``sigma`` of the classes and
    ``m - 1`` distinct random offsets ``0 < o_1 < ... < o_{m-1} < d`` are drawn; client i of the
    block holds ``sigma[(i + o) mod d]`` for ``o`` in ``(0, o_1, ..., o_{m-1})``. The offsets
    differ, so the m classes are distinct, and each class is held by exactly m clients of every
    full block. In a last, partial block (K not a multiple of d) some classes are held by fewer
    clients; with K < d some may be held by nobody (their samples stay unassigned).
    """
    sets = np.empty((num_clients, per_client), dtype=np.int64)
    for start in range(0, num_clients, num_classes):
        sigma = rng.permutation(num_classes)
        extra = np.sort(rng.choice(np.arange(1, num_classes), per_client - 1, replace=False))
        offsets = np.concatenate([[0], extra]).astype(np.int64)
        for i in range(min(num_classes, num_clients - start)):
            sets[start + i] = sigma[(i + offsets) % num_classes]
    return sets


def _holders(sets: np.ndarray, c: int) -> np.ndarray:
    """Client ids holding class c, ascending."""
    return np.flatnonzero((sets == c).any(axis=1))


def _partition_class_sets(pools: list[np.ndarray], sets: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's pool dealt evenly (+-1, at random) over the clients holding it."""
    parts: list[list[np.ndarray]] = [[] for _ in range(len(sets))]
    for c, pool in enumerate(pools):
        holders = _holders(sets, c)
        if len(holders) == 0:
            continue
        for client, chunk in zip(rng.permutation(holders), np.array_split(pool, len(holders))):
            parts[client].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


def _deal_stratified(pools: list[np.ndarray], k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Stratified iid: every class dealt evenly over all k clients.

    The (already shuffled) class pools are laid end to end and dealt round-robin, sample i to
    client ``perm[i mod k]`` (``perm`` a random permutation): each client gets ``n_c / k`` (+-1) of
    every class c and ``N / k`` (+-1) samples in all.
    """
    everything = np.concatenate(pools) if pools else np.zeros(0, np.int64)
    owner = rng.permutation(k)[np.arange(len(everything)) % k]
    return [everything[owner == j] for j in range(k)]


def _ratio_quota(part: np.ndarray, y: np.ndarray, num_classes: int, count: int, rng: np.random.Generator):
    """Per-class labeled quotas summing to ``count``, proportional to the part's class counts."""
    if len(part) == 0:
        return np.zeros(num_classes, dtype=np.int64)
    hist = np.bincount(y[part], minlength=num_classes)
    return largest_remainder(hist * count / len(part), count, rng)


def _noniid_2(
    pools: list[np.ndarray],
    y: np.ndarray,
    k: int,
    rng: np.random.Generator,
    per_client: int,
    labels_per_class: int,
    ratio: float,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """FedSiam Non-IID-II: labeled from each client's class set, unlabeled from every class.

    Labeled counts: ``round_half_up(ratio * N / K)`` per client, spread over its classes by largest
    remainder (``ratio > 0``, N = what is left after the server's sets), or ``labels_per_class``
    of each of its classes (``ratio = 0``). The rest of every class is then dealt evenly over all
    clients.
    """
    d = len(pools)
    sets = client_class_sets(k, d, per_client, rng)
    quota = np.zeros((k, d), dtype=np.int64)
    if ratio > 0:
        total = round_half_up(ratio * sum(len(p) for p in pools) / k)
        for j in range(k):
            quota[j, sets[j]] = largest_remainder(np.full(per_client, total / per_client), total, rng)
        key = "data_args.client_label_ratio"
    else:
        for j in range(k):
            quota[j, sets[j]] = labels_per_class
        key = "data_args.labels_per_class_client"
    demand = quota.sum(axis=0)
    labeled: list[list[np.ndarray]] = [[] for _ in range(k)]
    rest = []
    for c, pool in enumerate(pools):
        if demand[c] > len(pool):
            raise ValueError(
                f"{key}: the clients holding class {c} need {demand[c]} labeled samples of it but only {len(pool)} "
                f"are left; lower {key}"
            )
        for client, chunk in zip(range(k), np.split(pool[: demand[c]], np.cumsum(quota[:, c])[:-1])):
            labeled[client].append(chunk)
        rest.append(pool[demand[c] :])
    unlabeled = _deal_stratified(rest, k, rng)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in labeled], unlabeled


def _split_labeled(
    part: np.ndarray, y: np.ndarray, quota: int | np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into (labeled, unlabeled): the first ``quota`` of each class, at random.

    ``quota`` is one count for every class, or an array of per-class counts.
    """
    shuffled = rng.permutation(part)
    labels = y[shuffled]
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order)) - np.searchsorted(sorted_labels, sorted_labels, side="left")
    limit = quota if np.isscalar(quota) else np.asarray(quota)[labels]
    is_labeled = rank < limit
    return shuffled[is_labeled], shuffled[~is_labeled]


def _as_index(array: np.ndarray) -> torch.Tensor:
    """Sorted int64 index tensor."""
    return torch.from_numpy(np.sort(np.asarray(array, dtype=np.int64)))


def build_split(
    labels: torch.Tensor,
    num_classes: int,
    *,
    num_clients: int,
    seed: int,
    scenario: str = "server",
    num_server_labels: int = 50,
    num_server_val: int = 0,
    method: str = "iid",
    non_iid_r: float = 0.4,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    labels_per_class_client: int = 5,
    client_label_ratio: float = 0.0,
    imbalance_strength: float = 1.0,
    num_stages: int = 10,
    rounds_per_stage: int = 10,
    rich_client_fraction: float = 0.1,
    rich_label_ratio: float = 0.55,
    poor_label_ratio: float = 0.05,
) -> Split:
    """Share a training set between the server and ``num_clients`` clients.

    Steps: the server's labeled set (``N_s / d`` per class, remainder to the first classes), the
    server validation set (balanced the same way, disjoint), then the rest among the clients:

    - ``"iid"`` (and ``"batch_iid"``): shuffle and deal evenly.
    - ``"r"``: Zhang et al. Appendix A.2 (see :func:`r_targets`), rounded per class by largest
      remainder so each class's counts sum to what is available. With K = d and balanced data the
      measured R equals the requested R up to rounding (each client's distribution is
      ``R [i = j] + (1 - R) q_i``, so every pair is at total-variation distance R). With K > d,
      clients sharing a main class have identical distributions, so the measured R is R times the
      fraction of client pairs with different main classes; with K < d, the main-class share
      ``R n_j`` of the classes that are nobody's main class is left unassigned (see
      :func:`r_targets`) and the measured R comes out below R. Always report
      :meth:`Split.measured_r`.
    - ``"dirichlet"``: per class, proportions over clients ~ Dir(alpha).
    - ``"shards"``: single-class shards, ``classes_per_client`` per client (never more classes).
    - ``"batch_noniid"`` / ``"streaming_noniid"``: FedMatch's class-imbalanced clients
      (:func:`imbalance_weights`); streaming adds ``num_stages`` release stages per client.
    - ``"noniid_1"`` / ``"noniid_2"`` / ``"noniid_3"``: FedSiam's Non-IID-I/II/III.

    See the module docstring for each method in full and for how the labels-at-client labeled
    sets are drawn (``labels_per_class_client`` per class, or ``client_label_ratio`` of each
    client's data).

    Parameters
    ----------
    labels : torch.Tensor
        int64 train labels ``(N,)``.
    num_classes : int
        d.
    num_clients : int
        K (``train_args.client_num_in_total``).
    seed : int
        Run seed; randomness comes from ``numpy_rng(seed, "partition")``.
    scenario : {"server", "client"}
        Labels-at-server or labels-at-client (``data_args.label_scenario``).
    num_server_labels : int
        N_s; 0 is allowed in the labels-at-client scenario only.
    num_server_val : int
        Size of the server validation set.
    method : str
        Client partition method, one of :data:`METHODS`.
    non_iid_r : float
        R in ``[0, 1]`` for method ``"r"``.
    alpha : float
        Dirichlet concentration.
    classes_per_client : int
        Shards per client (``"shards"``); distinct classes per client (``"noniid_1"``, ``"noniid_2"``).
    labels_per_class_client : int
        Labeled samples per class per client (labels-at-client, ``client_label_ratio`` 0).
    client_label_ratio : float
        FedSiam's gamma: the labeled fraction of each client's data (labels-at-client); 0 uses
        ``labels_per_class_client``.
    imbalance_strength : float
        s in ``[0, 1]`` for the FedMatch imbalanced methods (1: the authors' profile).
    num_stages, rounds_per_stage : int
        Streaming: T stages, stage s released at round ``s * rounds_per_stage``.
    rich_client_fraction, rich_label_ratio, poor_label_ratio : float
        ``"noniid_3"``: the fraction of label-rich clients and the two label ratios.

    Returns
    -------
    Split
        Sorted int64 index tensors into the train set (streaming unlabeled sets: ordered by stage).

    Raises
    ------
    ValueError
        An impossible combination; the message names the config key.
    """
    y = _as_numpy_labels(labels)
    options = dict(
        client_label_ratio=client_label_ratio,
        imbalance_strength=imbalance_strength,
        num_stages=num_stages,
        rounds_per_stage=rounds_per_stage,
        rich_client_fraction=rich_client_fraction,
        rich_label_ratio=rich_label_ratio,
        poor_label_ratio=poor_label_ratio,
    )
    _validate(
        len(y),
        num_classes,
        num_clients,
        scenario,
        method,
        num_server_labels,
        num_server_val,
        non_iid_r,
        alpha,
        classes_per_client,
        labels_per_class_client,
        **options,
    )
    rng = numpy_rng(seed, "partition")
    pools = _class_pools(y, num_classes, rng)
    server, pools = _take_balanced(pools, num_server_labels, "data_args.num_server_labels")
    val, pools = _take_balanced(pools, num_server_val, "data_args.num_server_val")
    pools = [p.astype(np.int64) for p in pools]
    k = num_clients
    client = scenario == "client"
    if method in IMBALANCED_METHODS:
        if client:
            lab_parts, pools = _take_per_class_labels(pools, k, labels_per_class_client)
        else:
            lab_parts = [np.zeros(0, np.int64) for _ in range(k)]
        unl_parts = _partition_imbalanced(pools, k, rng, imbalance_strength)
    elif method == "noniid_2":
        lab_parts, unl_parts = _noniid_2(
            pools, y, k, rng, classes_per_client, labels_per_class_client, client_label_ratio
        )
    else:
        parts = _client_parts(pools, k, rng, method, non_iid_r, alpha, classes_per_client)
        if not client:
            lab_parts, unl_parts = [np.zeros(0, np.int64) for _ in parts], parts
        else:
            if method == "noniid_3":
                rich = set(rng.choice(k, round_half_up(rich_client_fraction * k), replace=False).tolist())
                ratios = [rich_label_ratio if j in rich else poor_label_ratio for j in range(k)]
            else:
                ratios = [client_label_ratio] * k
            pairs = []
            for part, ratio in zip(parts, ratios):
                if ratio > 0 or method == "noniid_3":
                    quota = _ratio_quota(part, y, num_classes, round_half_up(ratio * len(part)), rng)
                else:
                    quota = labels_per_class_client
                pairs.append(_split_labeled(part, y, quota, rng))
            lab_parts, unl_parts = [lab for lab, _ in pairs], [unl for _, unl in pairs]
    stages = None
    if method in STREAMING_METHODS:
        stage_rng = numpy_rng(seed, "partition", "stages")
        staged = [_assign_stages(u, num_stages, stage_rng) for u in unl_parts]
        unlabeled = [torch.from_numpy(u) for u, _ in staged]
        stages = [torch.from_numpy(s) for _, s in staged]
    else:
        unlabeled = [_as_index(u) for u in unl_parts]
    return Split(
        server_labeled=_as_index(server),
        server_val=_as_index(val),
        client_unlabeled=unlabeled,
        client_labeled=[_as_index(lab) for lab in lab_parts],
        num_classes=num_classes,
        requested_r=float(non_iid_r) if method == "r" else None,
        method=method,
        scenario=scenario,
        client_stages=stages,
        num_stages=num_stages if stages is not None else 0,
        rounds_per_stage=rounds_per_stage,
    )


def _client_parts(
    pools: list[np.ndarray],
    k: int,
    rng: np.random.Generator,
    method: str,
    non_iid_r: float,
    alpha: float,
    classes_per_client: int,
) -> list[np.ndarray]:
    """Dispatch to the partition method (those that split all of each client's data at once)."""
    pools = [p.astype(np.int64) for p in pools]
    if method in ("iid", "batch_iid"):
        return _partition_iid(pools, k, rng)
    if method == "noniid_3":
        return _deal_stratified(pools, k, rng)
    if method == "r":
        return _partition_r(pools, k, rng, non_iid_r)
    if method == "dirichlet":
        return _partition_dirichlet(pools, k, rng, alpha)
    if method == "noniid_1":
        return _partition_class_sets(pools, client_class_sets(k, len(pools), classes_per_client, rng), rng)
    return _partition_shards(pools, k, rng, classes_per_client)
