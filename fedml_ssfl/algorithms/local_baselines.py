"""FedMatch's local-only baselines: Local-SL, Local-FixMatch, Local-UDA (no sharing at all).

Jeong et al., *Federated Semi-Supervised Learning with Inter-Client Consistency & Disjoint
Learning*, 2021 (Sec. 5, Tables 1-2). Labels-at-client only (Table 2 marks Local-* N/A in
labels-at-server). Each client trains its own model on its own data; nothing is aggregated.

Equations (plain text; the losses of :mod:`.fedssl_baselines`)::

    local_sl:        CE(f(a(x)), y) over all the client's samples with their true labels
                     (use_all_labels: false: its labeled samples only)
    local_fixmatch:  lambda_s l_s + lambda_u l_u, l_u FixMatch's (:class:`.FixMatchConfig`)
    local_uda:       lambda_s l_s + lambda_u l_u, l_u UDA's (:class:`.UDAConfig`)
    accuracy:        mean (min, max) over the K clients' models (FedMatch's "Local-" rows)

Protocol: a client keeps its model in its persistent ``state["model"]``; the server sends the common
initial model the first time a client is sampled (download bytes), every later message is empty.
A client replies ``Message(weights={}, extras={"eval_weights": ..., "metrics": ...})``: its model
travels only for evaluation, never counted as communication. :meth:`LocalBaseline.global_model`
(single-model evaluation, export) is the model of the client with the most samples (ties: the
lowest id): not a federated model, there is none.

Deviations: none from the losses; the server keeps a copy of every client model besides the
clients' own states, so a checkpoint holds the local models twice.

Provenance and details: docs/algorithms.md#local-only-baselines
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..stacked import JobResult, LocalJob, supervised_job
from ..training import InputPipeline
from .base import AlgorithmConfig, ClientContext, ClientData, Message
from .fedssl_baselines import FixMatchConfig, UDAConfig, ssl_client_job, ssl_epoch_data
from .global_model import client_party
from .jobs import JobAlgorithm
from .registry import register_algorithm

LOCAL_SCENARIO_NOTE = (
    "local baselines need labels at the clients (FedMatch Table 2 marks Local-* N/A in labels-at-server: the "
    "clients hold no labels there); for the server's labels alone use 'server_only'"
)


@dataclass
class LocalSLConfig(AlgorithmConfig):
    """``local_sl``.

    Attributes
    ----------
    use_all_labels : bool
        True (FedMatch's Local-SL, an upper bound): train on all the client's samples with their
        true labels, reading ``labels[unlabeled_idx]`` on purpose, as ``fedavg_sl`` does. False:
        on its labeled samples only.
    """

    use_all_labels: bool = True


@dataclass
class LocalFixMatchConfig(FixMatchConfig):
    """``local_fixmatch``: FixMatch's keys (see :class:`.FixMatchConfig`)."""


@dataclass
class LocalUDAConfig(UDAConfig):
    """``local_uda``: UDA's keys (see :class:`.UDAConfig`)."""


class ClientModels(Sequence[nn.Module]):
    """One model per client, each loaded on access into a single shared module.

    ``models[k]`` is the shared module holding client k's weights until the next access: use
    each model before taking the next (as the runtime's evaluation loop does).
    """

    def __init__(self, module: nn.Module, states: list[dict[str, torch.Tensor]]):
        self._module = module
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, k: int) -> nn.Module:  # type: ignore[override]
        self._module.load_state_dict(self._states[k])
        return self._module

    def __iter__(self) -> Iterator[nn.Module]:
        for k in range(len(self)):
            yield self[k]


class LocalBaseline(JobAlgorithm):
    """Each client trains its own model; the server only hands out the initial model once.

    ``global_state`` holds the common initial model; subclasses write :meth:`client_job`. The
    clients can train stacked (``train_args.stack_clients``, :mod:`.jobs`).
    """

    label_scenarios = ("client",)
    label_scenario_note: ClassVar[str] = LOCAL_SCENARIO_NOTE
    idle_clients_note: ClassVar[str] = (
        "has no server side: each client trains its own model, so idle clients would leave only the initial "
        "model (its local references are the control)"
    )

    def setup(self) -> None:
        super().setup()
        self.client_models: dict[int, dict[str, torch.Tensor]] = {}
        self.client_sizes: dict[int, int] = {}
        self.sent_init: set[int] = set()

    # ---- client ------------------------------------------------------------------------
    def num_train_samples(self, data: ClientData) -> int:
        """How many samples the client trains on (0: it has nothing to do, and sends nothing)."""
        raise NotImplementedError

    def client_job(self, weights: dict[str, torch.Tensor], data: ClientData, ctx: ClientContext) -> LocalJob:
        """T local steps on the client's own data from ``weights``, as a job."""
        raise NotImplementedError

    def local_job(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> LocalJob | None:
        """The client's own model (the initial one the first time) trained on its own data; None without data."""
        weights = state.get("model") or msg.weights
        if not weights:
            raise RuntimeError(
                f"{client_party(data.client_id)} has no model: its state holds none and the message carries none "
                "(the server sends the initial model with a client's first message only)"
            )
        state["model"] = dict(weights)
        if self.num_train_samples(data) == 0:
            return None
        return self.client_job(weights, data, ctx)

    def client_reply(self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict) -> Message:
        state["model"] = result.weights
        n = self.num_train_samples(data)
        return Message(num_samples=n, extras={"eval_weights": result.weights, "metrics": result.metrics})

    # ---- server ------------------------------------------------------------------------
    def message_for(self, client_id: int, round_idx: int) -> Message:
        if client_id in self.sent_init:
            return Message()
        self.sent_init.add(client_id)
        return Message(weights=dict(self.global_state))

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        for k, m in replies.items():
            weights = m.extras.get("eval_weights")
            if weights is not None:
                self.client_models[k] = weights
                self.client_sizes[k] = m.num_samples
        return {}

    def evaluation_models(self) -> ClientModels:
        """One model per client (K), the initial model for clients that never trained."""
        if self._eval_model is None:
            self._eval_model = self.model_fn()
        states = [self.client_models.get(k, self.global_state) for k in range(self.train.num_clients)]
        return ClientModels(self._eval_model, states)

    def global_model(self) -> nn.Module:
        """The model of the client with the most training samples (initial model before any)."""
        if self._eval_model is None:
            self._eval_model = self.model_fn()
        self._eval_model.load_state_dict(self._largest_client_state())
        return self._eval_model

    def _largest_client_state(self) -> dict[str, torch.Tensor]:
        if not self.client_models:
            return self.global_state
        best = min(self.client_models, key=lambda k: (-self.client_sizes.get(k, 0), k))
        return self.client_models[best]

    def state_dict(self) -> dict[str, Any]:
        # "global_state" is what global_model() returns, so that `fedml-ssfl export` ships a trained
        # client model; the common initial model is kept apart for resuming
        return {
            "global_state": dict(self._largest_client_state()),
            "initial_state": dict(self.global_state),
            "client_models": {k: dict(v) for k, v in self.client_models.items()},  # tensors are never changed in place
            "client_sizes": dict(self.client_sizes),
            "sent_init": sorted(self.sent_init),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_state = state["initial_state"]
        self.client_models = dict(state["client_models"])
        self.client_sizes = dict(state["client_sizes"])
        self.sent_init = set(state["sent_init"])


@register_algorithm
class LocalSL(LocalBaseline):
    """Local-SL: supervised training on the client's own samples, nothing shared."""

    name = "local_sl"
    config_class = LocalSLConfig

    def _indices(self, data: ClientData) -> torch.Tensor:
        if self.config.use_all_labels:
            return torch.cat([data.unlabeled_idx, data.labeled_idx])
        return data.labeled_idx

    def num_train_samples(self, data: ClientData) -> int:
        return int(self._indices(data).numel())

    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One local epoch: the samples it trains on at ``train_args.batch_size``."""
        return self.num_train_samples(data), self.train.batch_size

    def client_job(self, weights: dict[str, torch.Tensor], data: ClientData, ctx: ClientContext) -> LocalJob:
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen, party = ctx.generator(data.client_id), client_party(data.client_id)
        return supervised_job(pipeline, data.images, data.labels, self._indices(data), self.train, gen, party, weights)


class _LocalSSL(LocalBaseline):
    """Local FixMatch / UDA: the federated baselines' client step, without a server."""

    def num_train_samples(self, data: ClientData) -> int:
        return data.num_labeled + data.num_unlabeled

    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One local epoch, as the federated baselines' (:func:`ssl_epoch_data`): the unlabeled set at B^U."""
        return ssl_epoch_data(self, data)

    def client_job(self, weights: dict[str, torch.Tensor], data: ClientData, ctx: ClientContext) -> LocalJob:
        return ssl_client_job(self, data, ctx, weights)


@register_algorithm
class LocalFixMatch(_LocalSSL):
    """Local-FixMatch: FixMatch on the client's own data, nothing shared."""

    name = "local_fixmatch"
    config_class = LocalFixMatchConfig


@register_algorithm
class LocalUDA(_LocalSSL):
    """Local-UDA: UDA on the client's own data, nothing shared."""

    name = "local_uda"
    config_class = LocalUDAConfig
