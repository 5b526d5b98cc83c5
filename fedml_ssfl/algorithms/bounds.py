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
from typing import Any

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
    client_data : str
        ``all`` (default): every client sample with its true label (the upper bound); ``labeled``:
        the client's labeled samples only (FedSiam's FedAvg / FedAvg+ baselines, Sec. 4.1).
    augment : str
        The view the server and the clients train on: ``weak`` (default; FedSiam's FedAvg+, "data
        augmentation over FedAvg") or ``plain`` (the original images: FedSiam's FedAvg).
    fedsem_rounds : int or None
        FedSem (FedSiam's baseline; Table 3: R_G^1 = 30): rounds of its Phase 1, FedAvg on the clients'
        labeled samples; from this round on (Phase 2) each client also trains on its unlabeled samples
        with the argmax labels of the Phase 1 model (the global model at this round's start, sent to
        each client once, in eval mode on the original images). Needs ``client_data: labeled``.
    """

    include_server: bool = True
    client_data: str = "all"
    augment: str = "weak"
    fedsem_rounds: int | None = None

    def check(self, cfg) -> None:
        """Ranges of the keys (raises :class:`ConfigError`)."""
        if self.client_data not in ("all", "labeled"):
            raise ConfigError(f"ssfl_args.client_data: {self.client_data!r} is not one of all, labeled")
        if self.augment not in SERVER_ONLY_VIEWS:
            raise ConfigError(f"ssfl_args.augment: {self.augment!r} is not one of {', '.join(SERVER_ONLY_VIEWS)}")
        if self.fedsem_rounds is not None:
            if self.fedsem_rounds < 0:
                raise ConfigError(f"ssfl_args.fedsem_rounds: {self.fedsem_rounds} must be >= 0 (or null: no FedSem)")
            if self.client_data != "labeled":
                raise ConfigError(
                    "ssfl_args.fedsem_rounds: FedSem's Phase 1 trains on the clients' labels alone; "
                    "set ssfl_args.client_data: labeled"
                )


@register_algorithm
class FedAvgSL(JobAlgorithm):
    """FedAvg with fully labeled clients: the supervised upper bound."""

    name = "fedavg_sl"
    config_class = FedAvgSLConfig
    label_scenarios = ("server", "client")

    def setup(self) -> None:
        super().setup()
        self.labeler_state: dict[str, torch.Tensor] | None = None  # FedSem: the Phase 1 model
        self.labeler_sent: set[int] = set()  # FedSem: the clients it went to

    def _fedsem_phase2(self, round_idx: int) -> bool:
        rounds = self.config.fedsem_rounds
        return rounds is not None and round_idx >= rounds

    def server_step(self, round_idx: int) -> None:
        if self._fedsem_phase2(round_idx) and self.labeler_state is None:
            self.labeler_state = dict(self.global_state)  # the model Phase 1 ended with
        has_labels = self.server_data.labeled_idx.numel() > 0
        self._server_state = (
            self.train_on_server_labels(self.global_state, round_idx, augment=self.config.augment)
            if self.config.include_server and has_labels
            else None
        )

    def message_for(self, client_id: int, round_idx: int) -> Message:
        msg = self.broadcast(round_idx)
        if self._fedsem_phase2(round_idx) and client_id not in self.labeler_sent:
            msg.extras["labeler"] = self.labeler_state  # FedSem: pseudo-label with the Phase 1 model, once
            self.labeler_sent.add(client_id)
        return msg

    def _fedsem_labels(self, msg: Message, data: ClientData, state: dict, device: torch.device) -> torch.Tensor | None:
        """FedSem Phase 2: the client's unlabeled samples' argmax labels under the Phase 1 model (eval mode,
        original images), made once from the ``labeler`` the server sends and kept in ``state``."""
        if "fedsem_labels" not in state and msg.extras.get("labeler") is not None and data.num_unlabeled:
            model = self.scratch_model(msg.extras["labeler"], device, slot="labeler")
            model.eval()
            pipeline = InputPipeline(self.data_info, device)
            with torch.no_grad():
                preds = [
                    model(pipeline.plain(data.images[b])).argmax(dim=1).cpu() for b in data.unlabeled_idx.split(256)
                ]
            state["fedsem_labels"] = torch.cat(preds)
        return state.get("fedsem_labels")

    def _train_idx(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext):
        """The client's training indices and their labels (true, or FedSem's pseudo-labels)."""
        if self.config.client_data == "all":
            return torch.cat([data.unlabeled_idx, data.labeled_idx]), data.labels
        pseudo = self._fedsem_labels(msg, data, state, ctx.device) if self._fedsem_phase2(ctx.round_idx) else None
        if pseudo is None:
            return data.labeled_idx, data.labels
        labels = data.labels.clone()
        labels[data.unlabeled_idx] = pseudo  # the truth at these samples is never read for training
        return torch.cat([data.labeled_idx, data.unlabeled_idx]), labels

    def local_job(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> LocalJob | None:
        """T cross-entropy steps (``augment``'s view) on the client's ``client_data``, from the global model."""
        idx, labels = self._train_idx(msg, data, state, ctx)
        if idx.numel() == 0:
            return None
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen, party = ctx.generator(data.client_id), client_party(data.client_id)
        return supervised_job(
            pipeline, data.images, labels, idx, self.train, gen, party, msg.weights, augment=self.config.augment
        )

    def client_reply(self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict) -> Message:
        loss = result.metrics.get("loss", 0.0)
        if self.config.client_data == "all":
            samples = data.num_unlabeled + data.num_labeled
        else:  # FedAvg weighs by the samples trained on: the labels, and FedSem's pseudo-labelled ones
            samples = data.num_labeled + (data.num_unlabeled if "fedsem_labels" in state else 0)
        return Message(weights=result.weights, num_samples=samples, extras={"metrics": {"loss": loss}})

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "labeler_state": self.labeler_state,
            "labeler_sent": sorted(self.labeler_sent),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.labeler_state = state.get("labeler_state")
        self.labeler_sent = set(state.get("labeler_sent", []))

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        states = [m.weights for m in replies.values() if not m.is_empty]
        if self._server_state is not None:
            self.global_state = fedavg_with_server(self._server_state, states)
        elif states:
            self.global_state = weighted_average(states, [m.num_samples for m in replies.values() if not m.is_empty])
        return {}
