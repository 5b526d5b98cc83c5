"""The algorithm contract shared by every SSFL method and both runtimes.

An algorithm is a pure server side and a pure client side that talk only through
:class:`Message` objects. Runtimes (``runtime/local.py``, ``runtime/fedml_backend.py``) sample
clients, move messages, count bytes, evaluate, log and checkpoint; algorithms never import a
runtime.

Round protocol, driven by the runtime::

    algo.setup()                                   # once, server side
    for r in rounds:
        chosen = sampler(r)                        # runtime, seeded
        algo.server_step(r)                        # server's own supervised work
        msgs = {k: algo.message_for(k, r) for k in chosen}
        replies = {k: algo.client_update(msgs[k], data[k], state[k], ctx(k, r)) for k in chosen}
        metrics = algo.aggregate(replies, r)       # returns per-round metrics to log
        evaluate(algo.global_model())
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .. import seeding


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
    """The optimisation settings from ``train_args`` that algorithms share."""

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


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or infinite; names the round and the party."""

    def __init__(self, round_idx: int, party: str, value: float):
        self.round_idx = round_idx
        self.party = party
        super().__init__(
            f"non-finite loss {value} in round {round_idx} on {party}; the run stopped and the last "
            "good checkpoint was kept. Lower train_args.learning_rate or check the data."
        )


def check_finite(loss: torch.Tensor, round_idx: int, party: str) -> None:
    """Raise :class:`NonFiniteLossError` when ``loss`` is NaN or infinite."""
    value = float(loss.detach())
    if not math.isfinite(value):
        raise NonFiniteLossError(round_idx, party, value)


@dataclass
class AlgorithmConfig:
    """Base of every algorithm's hyper-parameter dataclass (``ssfl_args`` minus ``algorithm``)."""


class Algorithm:
    """Base class: a server side and a client side joined only by :class:`Message`.

    Parameters
    ----------
    config : AlgorithmConfig
        The algorithm's own hyper-parameters.
    model_fn : callable
        Builds a fresh model (same architecture every call).
    server_data : ServerData
        The server's labeled and validation sets (empty index tensors where it has none).
    data_info : DataInfo
        Dataset facts (classes, normalisation, whether flips suit the data).
    train : TrainSettings
        Shared optimisation settings.
    device : torch.device
        Where the server trains.
    seed : int
        The run seed; every random stream derives from it.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    label_scenarios: ClassVar[tuple[str, ...]] = ("server",)

    def __init__(
        self,
        config: AlgorithmConfig,
        model_fn: Callable[[], nn.Module],
        server_data: ServerData,
        data_info: DataInfo,
        train: TrainSettings,
        device: torch.device,
        seed: int,
    ) -> None:
        self.config = config
        self.model_fn = model_fn
        self.server_data = server_data
        self.data_info = data_info
        self.train = train
        self.device = device
        self.seed = seed
        self._scratch: dict[str, nn.Module] = {}  # reusable model instances, per side
        self._eval_model: nn.Module | None = None

    # ---- server side -------------------------------------------------------------------
    def setup(self) -> None:
        """Initialise server state (bootstrap models, thresholds)."""

    def server_step(self, round_idx: int) -> None:
        """The server's own supervised work for this round (before messages go out)."""

    def message_for(self, client_id: int, round_idx: int) -> Message:
        """What the server sends to ``client_id`` this round."""
        raise NotImplementedError

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        """Fold the clients' replies into the server state; return metrics to log."""
        raise NotImplementedError

    def global_model(self) -> nn.Module:
        """The model to evaluate and export."""
        raise NotImplementedError

    def evaluation_models(self) -> list[nn.Module]:
        """The models whose mean test accuracy is the run's accuracy. Default: the global model.

        Algorithms without one global model (the local-only baselines) return one model per
        client; the runtime then logs the mean, min and max accuracy over them.
        """
        return [self.global_model()]

    def finalize(self) -> None:
        """Work after the last round (e.g. a final fine-tune). Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the server side."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        raise NotImplementedError

    # ---- client side -------------------------------------------------------------------
    def client_update(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> Message:
        """A pure function of (message, local data, the client's own state, context).

        Must not read server attributes other than the immutable construction arguments
        (``config``, ``model_fn``, ``data_info``, ``train``). ``state`` is the client's own
        persistent dict, mutated in place.
        """
        raise NotImplementedError
