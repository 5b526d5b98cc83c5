"""Split a training set between the server and K clients (the result is a :class:`~fedml_ssfl.data.split.Split`).

Order of work (Zhang et al., Appendix A.2): a balanced labeled set for the server (``N_s / d`` per
class), then a balanced server validation set, then the rest shared among the K clients by one of
the methods below. In the labels-at-client scenario each client also holds a few labeled samples.

:func:`build_split` takes one :class:`~fedml_ssfl.data.partition_methods.PartitionOptions` (the
``data_args`` partition keys). The methods are the rows of
:data:`~fedml_ssfl.data.partition_methods.METHOD_TABLE` (name, options class, label scenarios,
streaming flag, description), each bound here to the function decorated ``@implements(name)``
(:data:`PARTITION_METHODS`); adding a method is one row there and one function here.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedml_ssfl.data.partition_methods import (
    METHOD_TABLE,
    METHODS,
    SCENARIOS,
    ClassSetOptions,
    DirichletOptions,
    ImbalancedOptions,
    LabelOptions,
    MethodInfo,
    PartitionOptions,
    RichPoorOptions,
    ROptions,
    ShardsOptions,
    method_info,
)
from fedml_ssfl.data.split import Split, as_numpy_labels, non_iid_level
from fedml_ssfl.seeding import numpy_rng

__all__ = [
    "METHODS",
    "PARTITION_METHODS",
    "SCENARIOS",
    "ClientPools",
    "PartitionMethod",
    "PartitionOptions",
    "Split",
    "balanced_counts",
    "build_split",
    "client_class_sets",
    "implements",
    "imbalance_profile",
    "imbalance_weights",
    "largest_remainder",
    "non_iid_level",
    "r_targets",
    "round_half_up",
]

FEDMATCH_PROFILE = (0.50, 0.15, 0.03, 0.02)
"""Class weights of FedMatch's imbalanced clients: main class, its two neighbours, any other, the opposite."""
_DIRICHLET_TRIES = 10


def round_half_up(x: float) -> int:
    """``floor(x + 0.5)``: how label ratios become counts (0.05 * 90 = 4.5 -> 5)."""
    return int(math.floor(x + 0.5 + 1e-9))


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


def balanced_counts(total: int, num_classes: int) -> np.ndarray:
    """``total // d`` per class, the remainder spread one each over the first classes."""
    counts = np.full(num_classes, total // num_classes, dtype=np.int64)
    counts[: total % num_classes] += 1
    return counts


def _validate(n: int, num_classes: int, num_clients: int, options: PartitionOptions) -> None:
    """Raise ValueError naming the config key for any impossible argument."""
    o = options
    if num_clients < 1:
        raise ValueError(f"train_args.client_num_in_total must be >= 1, got {num_clients}")
    if o.label_scenario not in SCENARIOS:
        raise ValueError(
            f"data_args.label_scenario: {o.label_scenario!r} is not one of {SCENARIOS} "
            "(server = labels-at-server, client = labels-at-client)"
        )
    method_info(o.partition_method)
    if o.num_server_labels < 0 or o.num_server_val < 0:
        raise ValueError("data_args.num_server_labels and data_args.num_server_val must be >= 0")
    if o.label_scenario == "server" and o.num_server_labels == 0:
        raise ValueError("data_args.num_server_labels must be > 0 when data_args.label_scenario is 'server'")
    if o.num_server_labels + o.num_server_val > n:
        raise ValueError(
            f"data_args.num_server_labels ({o.num_server_labels}) + "
            f"data_args.num_server_val ({o.num_server_val}) exceed the {n} training samples; "
            f"lower them to at most {n} together"
        )
    if o.labels_per_class_client < 0:
        raise ValueError(f"data_args.labels_per_class_client must be >= 0, got {o.labels_per_class_client}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    o.check(num_classes)


def _class_pools(y: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each class's indices, shuffled."""
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    return [rng.permutation(np.flatnonzero(y == c)) for c in range(num_classes)]


def server_sets(
    y: np.ndarray, num_classes: int, num_labels: int, num_val: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The server's labeled and validation sets of a training set, and what is left per class.

    Each class's indices are shuffled with ``rng`` (``numpy_rng(seed, "partition")``); the server
    takes ``num_labels`` samples balanced over the classes (``N_s / d`` each, the remainder to the
    first classes), then ``num_val`` more the same way. :func:`build_split` starts with exactly
    this, and a FedML script's server draws its labels from its global training set with it.

    Returns
    -------
    tuple
        (labeled indices, validation indices, per class the indices left in random order).

    Raises
    ------
    ValueError
        A label outside ``[0, num_classes)``, or a class too small for its share (naming the key).
    """
    pools = _class_pools(y, num_classes, rng)
    server, pools = _take_balanced(pools, num_labels, "data_args.num_server_labels")
    val, pools = _take_balanced(pools, num_val, "data_args.num_server_val")
    return server, val, pools


def client_label_share(
    y: np.ndarray, num_classes: int, ratio: float, per_class: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One client's samples split into (labeled, unlabeled) as a labels-at-client split labels them.

    ``ratio`` > 0 (``data_args.client_label_ratio``, FedSiam's gamma) labels
    ``round_half_up(ratio * n)`` of the ``n`` samples, stratified by class; else ``per_class``
    (``labels_per_class_client``) of every class the client holds. The rest are unlabeled.
    """
    part = np.arange(len(y), dtype=np.int64)
    quota = per_class if ratio <= 0 else _ratio_quota(part, y, num_classes, round_half_up(ratio * len(part)), rng)
    return _split_labeled(part, y, quota, rng)


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


# --------------------------------------------------------------------------------------------
# one function per row of partition_methods.METHOD_TABLE
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientPools:
    """What a partition method shares among the clients: the classes left after the server's sets.

    Attributes
    ----------
    pools : list of numpy.ndarray
        Per class, the int64 indices left, in random order.
    y : numpy.ndarray
        The train labels the indices point into.
    num_clients : int
        K.
    rng : numpy.random.Generator
        The split's stream, ``numpy_rng(seed, "partition")``, already past the class shuffles.
    labels_at_client : bool
        Whether the clients also get labeled sets (``data_args.label_scenario: client``).
    """

    pools: list[np.ndarray]
    y: np.ndarray
    num_clients: int
    rng: np.random.Generator
    labels_at_client: bool


Parts = tuple[list[np.ndarray], list[np.ndarray]]
"""Per client, the labeled and the unlabeled index arrays."""
MethodFunction = Callable[[ClientPools, Any], Parts]
"""``(pools, method options) -> (labeled, unlabeled)``; the options are the row's options class."""

_FUNCTIONS: dict[str, MethodFunction] = {}


def implements(*names: str) -> Callable[[MethodFunction], MethodFunction]:
    """Decorator: the function builds the split of the methods ``names`` (rows of ``METHOD_TABLE``)."""

    def register(fn: MethodFunction) -> MethodFunction:
        for name in names:
            method_info(name)  # a row must exist
            if name in _FUNCTIONS:
                raise ValueError(f"partition method {name!r} is implemented twice")
            _FUNCTIONS[name] = fn
        return fn

    return register


def _no_labels(k: int) -> list[np.ndarray]:
    return [np.zeros(0, np.int64) for _ in range(k)]


def _label_parts(data: ClientPools, parts: list[np.ndarray], ratios: list[float | None], per_class: int) -> Parts:
    """Split each client's part into (labeled, unlabeled), client by client.

    Client j labels ``round_half_up(ratios[j] * n_j)`` of its ``n_j`` samples, stratified by class
    (:func:`_ratio_quota`), or ``per_class`` of every class it holds where ``ratios[j]`` is None.
    """
    pairs = []
    for part, ratio in zip(parts, ratios):
        if ratio is None:
            quota = per_class
        else:
            quota = _ratio_quota(part, data.y, len(data.pools), round_half_up(ratio * len(part)), data.rng)
        pairs.append(_split_labeled(part, data.y, quota, data.rng))
    return [lab for lab, _ in pairs], [unl for _, unl in pairs]


def _then_label(data: ClientPools, parts: list[np.ndarray], options: LabelOptions) -> Parts:
    """The clients' parts as unlabeled data, labeled at the clients as ``options`` say.

    Labels at the server: no client labels. At the clients: ``client_label_ratio`` gamma > 0 of
    each client's data (stratified by class), else ``labels_per_class_client`` per class.
    """
    if not data.labels_at_client:
        return _no_labels(len(parts)), parts
    gamma = options.client_label_ratio
    ratios = [gamma if gamma > 0 else None] * data.num_clients
    return _label_parts(data, parts, ratios, options.labels_per_class_client)


@implements("iid", "batch_iid")
def _iid(data: ClientPools, options: LabelOptions) -> Parts:
    """``iid`` / FedMatch's ``batch_iid``: shuffle and deal evenly."""
    return _then_label(data, _partition_iid(data.pools, data.num_clients, data.rng), options)


@implements("r")
def _r(data: ClientPools, options: ROptions) -> Parts:
    """Zhang et al. Appendix A.2 (see :func:`r_targets`), rounded per class by largest remainder.

    Each class's counts sum to what is available. With K = d and balanced data the measured R
    equals the requested R up to rounding (each client's distribution is ``R [i = j] + (1 - R) q_i``,
    so every pair is at total-variation distance R). With K > d, clients sharing a main class have
    identical distributions, so the measured R is R times the fraction of client pairs with
    different main classes; with K < d, the main-class share ``R n_j`` of the classes that are
    nobody's main class is left unassigned (see :func:`r_targets`) and the measured R comes out
    below R. Always report :meth:`Split.measured_r`.
    """
    parts = _partition_r(data.pools, data.num_clients, data.rng, options.non_iid_r)
    return _then_label(data, parts, options)


@implements("dirichlet")
def _dirichlet(data: ClientPools, options: DirichletOptions) -> Parts:
    """Per class, proportions over clients ~ Dir(alpha)."""
    parts = _partition_dirichlet(data.pools, data.num_clients, data.rng, options.partition_alpha)
    return _then_label(data, parts, options)


@implements("shards")
def _shards(data: ClientPools, options: ShardsOptions) -> Parts:
    """Single-class shards, ``classes_per_client`` per client (never more classes)."""
    parts = _partition_shards(data.pools, data.num_clients, data.rng, options.classes_per_client)
    return _then_label(data, parts, options)


@implements("batch_noniid", "streaming_noniid")
def _imbalanced(data: ClientPools, options: ImbalancedOptions) -> Parts:
    """FedMatch's class-imbalanced clients (:func:`imbalance_weights`).

    Labels at the clients: ``labels_per_class_client`` per class per client, taken before the
    imbalanced unlabeled split (the authors' code). ``streaming_noniid`` is the same split; its
    row's streaming flag makes :func:`build_split` cut the unlabeled data into stages.
    """
    k = data.num_clients
    if data.labels_at_client:
        labeled, pools = _take_per_class_labels(data.pools, k, options.labels_per_class_client)
    else:
        labeled, pools = _no_labels(k), data.pools
    return labeled, _partition_imbalanced(pools, k, data.rng, options.imbalance_strength)


@implements("noniid_1")
def _noniid_1(data: ClientPools, options: ClassSetOptions) -> Parts:
    """FedSiam Non-IID-I: ``classes_per_client`` distinct classes per client (:func:`client_class_sets`)."""
    sets = client_class_sets(data.num_clients, len(data.pools), options.classes_per_client, data.rng)
    return _then_label(data, _partition_class_sets(data.pools, sets, data.rng), options)


@implements("noniid_2")
def _noniid_2_method(data: ClientPools, options: ClassSetOptions) -> Parts:
    """FedSiam Non-IID-II (labels at the clients only), see :func:`_noniid_2`."""
    return _noniid_2(
        data.pools,
        data.y,
        data.num_clients,
        data.rng,
        options.classes_per_client,
        options.labels_per_class_client,
        options.client_label_ratio,
    )


@implements("noniid_3")
def _noniid_3(data: ClientPools, options: RichPoorOptions) -> Parts:
    """FedSiam Non-IID-III (labels at the clients only): stratified iid, then label-rich and -poor clients.

    ``round_half_up(rich_client_fraction * K)`` clients, drawn at random, label ``rich_label_ratio``
    of their data and the others ``poor_label_ratio``, stratified by class.
    """
    k = data.num_clients
    parts = _deal_stratified(data.pools, k, data.rng)
    rich = set(data.rng.choice(k, round_half_up(options.rich_client_fraction * k), replace=False).tolist())
    ratios = [options.rich_label_ratio if j in rich else options.poor_label_ratio for j in range(k)]
    return _label_parts(data, parts, ratios, per_class=0)


@dataclass(frozen=True)
class PartitionMethod:
    """A row of the table with its function: what :func:`build_split` dispatches on."""

    info: MethodInfo
    function: MethodFunction


def _bind() -> dict[str, PartitionMethod]:
    missing = [m.name for m in METHOD_TABLE if m.name not in _FUNCTIONS]
    if missing:
        raise ImportError(f"partition methods {missing} have a row in METHOD_TABLE but no @implements function")
    return {m.name: PartitionMethod(m, _FUNCTIONS[m.name]) for m in METHOD_TABLE}


PARTITION_METHODS: dict[str, PartitionMethod] = _bind()
"""Every partition method by name: its row of ``METHOD_TABLE`` and its function."""


# --------------------------------------------------------------------------------------------
# the split
# --------------------------------------------------------------------------------------------


def build_split(
    labels: torch.Tensor,
    num_classes: int,
    options: PartitionOptions,
    *,
    num_clients: int,
    seed: int,
) -> Split:
    """Share a training set between the server and ``num_clients`` clients.

    Steps (Zhang et al. Appendix A.2): the server's labeled set (``N_s / d`` per class, remainder
    to the first classes), the server validation set (balanced the same way, disjoint), then the
    rest among the clients by the function of ``options.partition_method``
    (:data:`PARTITION_METHODS`), which also draws the clients' labeled sets in the
    labels-at-client scenario. A streaming method's unlabeled sets are then cut into stages.

    See the module docstring for each method in full and for how the labels-at-client labeled
    sets are drawn.

    Parameters
    ----------
    labels : torch.Tensor
        int64 train labels ``(N,)``.
    num_classes : int
        d.
    options : PartitionOptions
        The ``data_args`` partition keys (:func:`fedml_ssfl.config.partition_options` builds them
        from a config): label scenario, server set sizes, method and its options.
    num_clients : int
        K (``train_args.client_num_in_total``).
    seed : int
        Run seed; randomness comes from ``numpy_rng(seed, "partition")`` (and ``numpy_rng(seed,
        "partition", "stages")`` for the stages).

    Returns
    -------
    Split
        Sorted int64 index tensors into the train set (streaming unlabeled sets: ordered by stage).

    Raises
    ------
    ValueError
        An impossible combination; the message names the config key.
    """
    o = options
    y = as_numpy_labels(labels)
    _validate(len(y), num_classes, num_clients, o)
    method = PARTITION_METHODS[o.partition_method]
    rng = numpy_rng(seed, "partition")
    server, val, pools = server_sets(y, num_classes, o.num_server_labels, o.num_server_val, rng)
    pools = [p.astype(np.int64) for p in pools]
    method_options = method.info.options.of(o)
    data = ClientPools(pools, y, num_clients, rng, labels_at_client=o.label_scenario == "client")
    lab_parts, unl_parts = method.function(data, method_options)
    stages = None
    if method.info.streaming:
        stage_rng = numpy_rng(seed, "partition", "stages")
        staged = [_assign_stages(u, o.num_stages, stage_rng) for u in unl_parts]
        unlabeled = [torch.from_numpy(u) for u, _ in staged]
        stages = [torch.from_numpy(s) for _, s in staged]
    else:
        unlabeled = [_as_index(u) for u in unl_parts]
    requested_r = getattr(method_options, "non_iid_r", None)
    return Split(
        server_labeled=_as_index(server),
        server_val=_as_index(val),
        client_unlabeled=unlabeled,
        client_labeled=[_as_index(lab) for lab in lab_parts],
        num_classes=num_classes,
        requested_r=float(requested_r) if requested_r is not None else None,
        method=o.partition_method,
        scenario=o.label_scenario,
        client_stages=stages,
        num_stages=o.num_stages if stages is not None else 0,
        rounds_per_stage=o.rounds_per_stage,
    )
