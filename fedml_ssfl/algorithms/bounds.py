"""Baselines the papers compare against: the lower and upper bounds of SSFL.

* ``server_only``: the server's labels alone (Zhang et al. Eq. 2 every round, no clients).
  ``augment: plain`` trains on the original images (FedSEAL's "Server-SL w/o DA").
  The lower bound every SSFL method must beat.
* ``fedavg_sl``: FedAvg where clients hold the labels of all their data (the upper bound).
  Clients train cross-entropy with weak augmentation for T steps; by default the server also
  trains on its labels and is averaged in as one model, exactly as the SSFL benchmark's
  Eq. 5 does, so the only difference from ``fedavg_ssl`` is that clients have labels.
  ``include_server: false`` gives McMahan et al.'s FedAvg weighted by client sample counts.
  Its clients can train stacked (``train_args.stack_clients``, :mod:`.jobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..aggregation import fedavg_with_server, weighted_average
from ..errors import ConfigError
from ..stacked import JobResult, LocalJob, supervised_job
from ..training import InputPipeline
from .base import AlgorithmConfig, ClientContext, ClientData, Message
from .global_model import GlobalModelAlgorithm, client_party
from .jobs import JobAlgorithm
from .registry import register_algorithm

SERVER_ONLY_VIEWS = ("weak", "plain")


@dataclass
class ServerOnlyConfig(AlgorithmConfig):
    """Options of ``server_only`` (T steps per round of ``train_args``).

    Attributes
    ----------
    augment : str
        The view of the server's labeled images: ``weak`` (default, flip-and-shift, Zhang et al.'s
        alpha) or ``plain`` (the original images: FedSEAL's "Server-SL w/o DA", Table 2).
    """

    augment: str = "weak"

    def check(self, cfg) -> None:
        """Ranges of the keys (raises :class:`ConfigError`)."""
        if self.augment not in SERVER_ONLY_VIEWS:
            raise ConfigError(f"ssfl_args.augment: {self.augment!r} is not one of {', '.join(SERVER_ONLY_VIEWS)}")


@register_algorithm
class ServerOnly(GlobalModelAlgorithm):
    """Supervised training on the server's N_s labels alone; clients send and receive nothing."""

    name = "server_only"
    config_class = ServerOnlyConfig
    idle_clients_note = "has no clients to idle (server-only training: they send nothing already)"

    def server_step(self, round_idx: int) -> None:
        self.global_state = self.train_on_server_labels(self.global_state, round_idx, augment=self.config.augment)

    def message_for(self, client_id: int, round_idx: int) -> Message:
        return Message(extras={"round": round_idx})

    def client_update(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        return Message()

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        return {}


@dataclass
class FedAvgSLConfig(AlgorithmConfig):
    """Options of ``fedavg_sl``.

    Attributes
    ----------
    include_server : bool
        Server trains on its labels and counts as one model in a uniform average (Eq. 5);
        false: plain FedAvg over clients weighted by their sample counts.
    """

    include_server: bool = True


@register_algorithm
class FedAvgSL(JobAlgorithm):
    """FedAvg with fully labeled clients: the supervised upper bound."""

    name = "fedavg_sl"
    config_class = FedAvgSLConfig
    label_scenarios = ("server", "client")

    def server_step(self, round_idx: int) -> None:
        has_labels = self.server_data.labeled_idx.numel() > 0
        self._server_state = (
            self.train_on_server_labels(self.global_state, round_idx)
            if self.config.include_server and has_labels
            else None
        )

    def message_for(self, client_id: int, round_idx: int) -> Message:
        return self.broadcast(round_idx)

    def local_job(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> LocalJob | None:
        """T weakly augmented cross-entropy steps on all the client's samples, from the global model."""
        idx = torch.cat([data.unlabeled_idx, data.labeled_idx])
        if idx.numel() == 0:
            return None
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen, party = ctx.generator(data.client_id), client_party(data.client_id)
        return supervised_job(pipeline, data.images, data.labels, idx, self.train, gen, party, msg.weights)

    def client_reply(self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict) -> Message:
        loss = result.metrics.get("loss", 0.0)
        samples = data.num_unlabeled + data.num_labeled
        return Message(weights=result.weights, num_samples=samples, extras={"metrics": {"loss": loss}})

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        states = [m.weights for m in replies.values() if not m.is_empty]
        if self._server_state is not None:
            self.global_state = fedavg_with_server(self._server_state, states)
        elif states:
            self.global_state = weighted_average(states, [m.num_samples for m in replies.values() if not m.is_empty])
        return {}
