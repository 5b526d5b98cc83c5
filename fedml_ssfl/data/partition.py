"""Split a training set between the server and K clients, and measure how non-iid the split is.

Order of work (Zhang et al., Appendix A.2): a balanced labeled set for the server (``N_s / d`` per
class), then a balanced server validation set, then the rest shared among the K clients by one of
four methods: ``iid``, ``r`` (Zhang et al.'s non-iid level R), ``dirichlet`` or ``shards``. In the
labels-at-client scenario each client then keeps a few labeled samples per class it holds.

Everything random comes from ``fedml_ssfl.seeding.numpy_rng(seed, "partition")``: the same seed
gives the same split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedml_ssfl.seeding import numpy_rng

METHODS = ("iid", "r", "dirichlet", "shards")
SCENARIOS = ("server", "client")
_WHICH = ("all", "unlabeled", "labeled")
_DIRICHLET_TRIES = 10


def _empty_index() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


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
        One int64 index tensor per client.
    client_labeled : list of torch.Tensor
        One per client; empty in the labels-at-server scenario.
    num_classes : int
        Number of classes ``d``.
    requested_r : float or None
        The requested non-iid level for method ``"r"``, else None.
    method, scenario : str
        How the split was built (for reports).
    """

    server_labeled: torch.Tensor
    server_val: torch.Tensor
    client_unlabeled: list[torch.Tensor]
    client_labeled: list[torch.Tensor]
    num_classes: int
    requested_r: float | None = None
    method: str = "iid"
    scenario: str = "server"

    @property
    def num_clients(self) -> int:
        """Number of clients K."""
        return len(self.client_unlabeled)

    def client_indices(self, client_id: int, which: str = "all") -> torch.Tensor:
        """One client's indices: ``"all"`` (unlabeled then labeled), ``"unlabeled"`` or ``"labeled"``."""
        if which not in _WHICH:
            raise ValueError(f"which must be one of {_WHICH}, got {which!r}")
        if which == "unlabeled":
            return self.client_unlabeled[client_id]
        if which == "labeled":
            return self.client_labeled[client_id]
        return torch.cat([self.client_unlabeled[client_id], self.client_labeled[client_id]])

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
    if method == "shards" and classes_per_client < 1:
        raise ValueError(f"data_args.classes_per_client must be >= 1, got {classes_per_client}")
    if labels_per_class_client < 0:
        raise ValueError(f"data_args.labels_per_class_client must be >= 0, got {labels_per_class_client}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")


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


def _dirichlet_once(
    pools: list[np.ndarray], k: int, rng: np.random.Generator, alpha: float
) -> list[np.ndarray]:
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


def _partition_dirichlet(
    pools: list[np.ndarray], k: int, rng: np.random.Generator, alpha: float
) -> list[np.ndarray]:
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


def _partition_shards(
    pools: list[np.ndarray], k: int, rng: np.random.Generator, per_client: int
) -> list[np.ndarray]:
    """Cut each class into single-class shards (``K * classes_per_client`` in all) and deal each
    client ``classes_per_client`` of them at random, so no client holds more classes than that."""
    sizes = np.array([len(p) for p in pools])
    shard_counts = _shards_per_class(sizes, k * per_client)
    shards = [s for pool, c in zip(pools, shard_counts) if c > 0 for s in np.array_split(pool, c)]
    order = rng.permutation(len(shards))
    return [
        np.concatenate(
            [shards[i] for i in order[j * per_client : (j + 1) * per_client]] or [np.zeros(0, np.int64)]
        )
        for j in range(k)
    ]


def _labels_at_client(
    part: np.ndarray, y: np.ndarray, per_class: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into (labeled, unlabeled): ``per_class`` labeled of each class it holds."""
    shuffled = rng.permutation(part)
    labels = y[shuffled]
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order)) - np.searchsorted(sorted_labels, sorted_labels, side="left")
    is_labeled = rank < per_class
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
) -> Split:
    """Share a training set between the server and ``num_clients`` clients.

    Steps: the server's labeled set (``N_s / d`` per class, remainder to the first classes), the
    server validation set (balanced the same way, disjoint), then the rest among the clients:

    - ``"iid"``: shuffle and deal evenly.
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

    In the labels-at-client scenario each client then keeps ``labels_per_class_client`` labeled
    samples of every class it holds (all of them if fewer); the rest of its share is unlabeled.

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
    method : {"iid", "r", "dirichlet", "shards"}
        Client partition method.
    non_iid_r : float
        R in ``[0, 1]`` for method ``"r"``.
    alpha : float
        Dirichlet concentration.
    classes_per_client : int
        Shards per client for method ``"shards"``.
    labels_per_class_client : int
        Labeled samples per class per client (labels-at-client).

    Returns
    -------
    Split
        Sorted int64 index tensors into the train set.

    Raises
    ------
    ValueError
        An impossible combination; the message names the config key.
    """
    y = _as_numpy_labels(labels)
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
    )
    rng = numpy_rng(seed, "partition")
    pools = _class_pools(y, num_classes, rng)
    server, pools = _take_balanced(pools, num_server_labels, "data_args.num_server_labels")
    val, pools = _take_balanced(pools, num_server_val, "data_args.num_server_val")
    parts = _client_parts(pools, num_clients, rng, method, non_iid_r, alpha, classes_per_client)
    if scenario == "client":
        pairs = [_labels_at_client(p, y, labels_per_class_client, rng) for p in parts]
        labeled = [_as_index(lab) for lab, _ in pairs]
        unlabeled = [_as_index(unl) for _, unl in pairs]
    else:
        labeled = [_empty_index() for _ in parts]
        unlabeled = [_as_index(p) for p in parts]
    return Split(
        server_labeled=_as_index(server),
        server_val=_as_index(val),
        client_unlabeled=unlabeled,
        client_labeled=labeled,
        num_classes=num_classes,
        requested_r=float(non_iid_r) if method == "r" else None,
        method=method,
        scenario=scenario,
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
    """Dispatch to the partition method."""
    pools = [p.astype(np.int64) for p in pools]
    if method == "iid":
        return _partition_iid(pools, k, rng)
    if method == "r":
        return _partition_r(pools, k, rng, non_iid_r)
    if method == "dirichlet":
        return _partition_dirichlet(pools, k, rng, alpha)
    return _partition_shards(pools, k, rng, classes_per_client)
