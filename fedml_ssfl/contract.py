"""The data types every layer shares: messages, data views, run context, settings, the loss check.

The bottom layer of the package (beside :mod:`.seeding` and :mod:`.atomic`): it imports nothing
of the package but :mod:`.seeding`. :mod:`.training` and :mod:`.metrics` build on it;
:mod:`.algorithms.base` re-exports it with the algorithm classes, so an algorithm imports all of
its contract from one place; runtimes move :class:`Message` objects and hand
:class:`ClientContext` objects to clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import seeding


@dataclass
class Message:
    """What travels between server and client, both ways.

    Attributes
    ----------
    weights : dict[str, torch.Tensor]
        Model tensors (dense, or sparse COO tensors for sparse deltas).
    extras : dict[str, Any]
        Anything else: thresholds, group id, FSM vectors, client metrics.
    num_samples : int
        Number of samples the sender trained on (for weighted averaging).
    """

    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 0

    @property
    def is_empty(self) -> bool:
        """True when the message carries no weights (e.g. a client with nothing to send)."""
        return not self.weights


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor occupies on the wire: values (+ indices when sparse)."""
    if t.is_sparse:
        t = t.coalesce()
        return t.values().numel() * t.values().element_size() + t.indices().numel() * t.indices().element_size()
    return t.numel() * t.element_size()


def _value_nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return tensor_nbytes(v)
    if isinstance(v, dict):
        return sum(_value_nbytes(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_value_nbytes(x) for x in v)
    if isinstance(v, (int, float, bool)):
        return 8
    if isinstance(v, str):
        return len(v.encode())
    return 0


DIAGNOSTIC_EXTRAS = ("metrics", "eval_weights")
"""``extras`` keys that are logging, not protocol: ``metrics`` (client diagnostics) and
``eval_weights`` (a model a client hands to the simulator only so that it can be tested, e.g. the
local-only baselines' private models). Neither is counted as communication."""


def message_nbytes(msg: Message) -> int:
    """Bytes of a message's payload: every tensor in ``weights`` and ``extras``.

    Keys in :data:`DIAGNOSTIC_EXTRAS` are not counted: they are logging, not protocol.
    """
    extras = {k: v for k, v in msg.extras.items() if k not in DIAGNOSTIC_EXTRAS}
    return sum(tensor_nbytes(t) for t in msg.weights.values()) + _value_nbytes(extras)


@dataclass
class ClientData:
    """A client's view of the data: index arrays into the shared uint8 training tensor.

    ``labels`` is the full label tensor; an algorithm may read ``labels[labeled_idx]`` for
    training and ``labels[unlabeled_idx]`` only for diagnostics (pseudo-label accuracy), never
    for training.
    """

    client_id: int
    images: torch.Tensor
    labels: torch.Tensor
    unlabeled_idx: torch.Tensor
    labeled_idx: torch.Tensor
    num_classes: int

    @property
    def num_unlabeled(self) -> int:
        return int(self.unlabeled_idx.numel())

    @property
    def num_labeled(self) -> int:
        return int(self.labeled_idx.numel())


@dataclass
class ServerData:
    """The server's labeled training set and validation set (indices into ``images``).

    ``label_scenario`` is the run's ``data_args.label_scenario``: in labels-at-client the server
    may still hold a few labels (``num_server_labels``), and algorithms decide from the scenario
    whether the server trains on them.
    """

    images: torch.Tensor
    labels: torch.Tensor
    labeled_idx: torch.Tensor
    val_idx: torch.Tensor
    num_classes: int
    label_scenario: str = "server"


@dataclass
class DataInfo:
    """What an algorithm needs to know about the dataset to build inputs."""

    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool


@dataclass
class ClientContext:
    """Per-call context a runtime hands to ``client_update``: no server state in here."""

    round_idx: int
    device: torch.device
    seed: int

    def generator(self, client_id: int) -> torch.Generator:
        """The client's random stream for this round (same in every runtime)."""
        return seeding.generator(self.seed, "client", self.round_idx, client_id)


@dataclass
class TrainSettings:
    """The optimisation settings from ``train_args`` that algorithms share.

    ``local_steps`` is T, the steps a party takes per round. With ``epochs`` E > 0 (FedML's local
    epochs) each party's T is E passes over its own data (:func:`epoch_steps`): the server's in
    these settings, each client's in the settings its update runs under
    (:meth:`fedml_ssfl.algorithms.base.Algorithm.client_train`).
    """

    local_steps: int = 16
    batch_size: int = 64
    learning_rate: float = 0.03
    momentum: float = 0.9
    weight_decay: float = 1e-4
    comm_round: int = 30
    lr_schedule: str = "cosine"
    lr_cosine_c: float = 0.4375
    lr_warmup_rounds: int = 0
    lr_floor: float = 1e-4
    num_clients: int = 1  # K (train_args.client_num_in_total)
    idle_clients: bool = False  # train_args.idle_clients: the control where clients send back what they received
    epochs: int = 0  # train_args.epochs: E local epochs per round (0: every client takes local_steps)


def epoch_steps(epochs: int, samples: int, batch_size: int) -> int:
    """T for ``epochs`` passes over ``samples`` at ``batch_size``: ``E x ceil(n / B)``, at least E.

    A party with no samples still takes E steps (one per epoch), as a party of one batch would.
    """
    return epochs * max(1, math.ceil(samples / max(1, batch_size)))


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or infinite; names the round and the party."""

    def __init__(self, round_idx: int, party: str, value: float):
        self.round_idx = round_idx
        self.party = party
        super().__init__(
            f"non-finite loss {value} in round {round_idx + 1} on {party}; the run stopped and the last "
            "good checkpoint was kept. Lower train_args.learning_rate or check the data."
        )


def check_finite(loss: torch.Tensor, round_idx: int, party: str) -> None:
    """Raise :class:`NonFiniteLossError` when ``loss`` is NaN or infinite."""
    value = float(loss.detach())
    if not math.isfinite(value):
        raise NonFiniteLossError(round_idx, party, value)
