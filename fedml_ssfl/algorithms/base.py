"""The algorithm contract shared by every SSFL method and both runtimes.

An algorithm is a pure server side and a pure client side that talk only through
:class:`Message` objects. Runtimes (``runtime/local.py``, ``runtime/fedml/``) sample clients,
move messages, count bytes, evaluate, log and checkpoint; algorithms never import a runtime.

The shared data types (:class:`Message`, :class:`ClientData`, :class:`ServerData`,
:class:`DataInfo`, :class:`ClientContext`, :class:`TrainSettings`, :func:`check_finite`) live in
:mod:`fedml_ssfl.contract`, the package's bottom layer, and are re-exported here. This module adds
the two classes an algorithm subclasses: :class:`AlgorithmConfig` and :class:`Algorithm`, which
declares the whole contract, every hook and flag a runtime or the config check reads, with its
default.

Round protocol, driven by the runtime::

    algo.setup()                                   # once, server side
    for r in rounds:
        chosen = sampler(r)                        # runtime, seeded
        algo.server_step(r)                        # server's own supervised work
        msgs = {k: algo.message_for(k, r) for k in chosen}
        replies = {k: algo.run_client_update(msgs[k], data[k], state[k], ctx(k, r)) for k in chosen}
        if algo.broadcasts_to_all():               # every other client receives the round's model too
            for k in others: algo.run_client_receive(algo.message_for(k, r), data[k], state[k], ctx(k, r))
        metrics = algo.aggregate(replies, r)       # returns per-round metrics to log
        evaluate(algo.global_model())

The runtimes call the ``run_*`` methods, which apply ``train_args.idle_clients`` (the idle-client
control, :meth:`Algorithm.idle_reply`) before handing over to the algorithm's own
:meth:`Algorithm.client_update` / :meth:`Algorithm.client_updates_stacked` /
:meth:`Algorithm.client_receive`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..contract import (
    DIAGNOSTIC_EXTRAS,
    ClientContext,
    ClientData,
    DataInfo,
    Message,
    NonFiniteLossError,
    ServerData,
    TrainSettings,
    check_finite,
    epoch_steps,
    message_nbytes,
    tensor_nbytes,
)

__all__ = [
    "DIAGNOSTIC_EXTRAS",
    "Algorithm",
    "AlgorithmConfig",
    "ClientContext",
    "ClientData",
    "DataInfo",
    "Message",
    "NonFiniteLossError",
    "ServerData",
    "TrainSettings",
    "check_finite",
    "message_nbytes",
    "tensor_nbytes",
]


@dataclass
class AlgorithmConfig:
    """Base of every algorithm's hyper-parameter dataclass (``ssfl_args`` minus ``algorithm``)."""

    def check(self, cfg: Any) -> None:
        """Cross-check the hyper-parameters against the whole experiment config.

        Called by :func:`fedml_ssfl.config.validate` after the sections are built, with the
        :class:`~fedml_ssfl.config.ExperimentConfig`; raise
        :class:`~fedml_ssfl.config.ConfigError` naming the offending key and the fix. Default:
        nothing to check.
        """


def client_records_state(records: MutableMapping[int, dict]) -> Any:
    """One of :attr:`Algorithm.client_records` as :meth:`Algorithm.state_dict` writes it.

    A plain dict is copied, ``{client id: dict(record)}`` (the layout of every checkpoint without a
    state budget); a runtime's bounded store is returned as it is, never read through (that would
    load every spilled record): the runtime's checkpoint writes its resident records inline and its
    spilled ones as files.
    """
    if type(records) is dict:
        return {k: dict(v) for k, v in records.items()}
    return records


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
    """The registry name (``ssfl_args.algorithm``)."""
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    """The dataclass ``ssfl_args`` (minus ``algorithm``) is built into."""
    label_scenarios: ClassVar[tuple[str, ...]] = ("server",)
    """The ``data_args.label_scenario`` values the algorithm supports."""
    label_scenario_note: ClassVar[str] = ""
    """Added to the config error for an unsupported label scenario (why, and what to use); empty:
    nothing to add."""
    partial_replies: ClassVar[bool] = False
    """True when a client's reply may carry only some of the model's keys (e.g. FedMatch's sigma or
    psi deltas alone): the FedML runtime then does not refuse a dense reply for missing keys."""
    requires_all_replies: ClassVar[bool] = False
    """True when a round cannot go on without every chosen client's reply: the FedML runtime then
    fails the run on a malformed reply instead of counting it as an empty one."""
    client_records: ClassVar[tuple[str, ...]] = ()
    """Attributes of the server side that hold one record per client it has seen (a
    ``MutableMapping[int, dict]``, a plain dict after :meth:`setup` / :meth:`load_state_dict`), written
    by :meth:`state_dict` under the key of the same name through :func:`client_records_state`. Under
    ``device_args.state_memory_mb`` the runtime replaces each, after :meth:`setup` /
    :meth:`load_state_dict`, by a bounded store (:class:`~fedml_ssfl.client_state.ClientStateStore`)
    whose records beyond the budget spill to disk, and checkpoints those by file. The algorithm uses
    them as mappings only (get, set, delete); a record read may be changed in place only until the
    next access to the same mapping (the store's contract)."""
    stackable: ClassVar[bool] = False
    """True when :meth:`client_updates_stacked` trains a round's clients together
    (``train_args.stack_clients``); the config check refuses the option otherwise."""
    idle_clients_note: ClassVar[str] = ""
    """Non-empty when ``train_args.idle_clients`` means nothing for the algorithm (it has no server side
    to keep, or its clients send nothing anyway): the config check refuses the switch with this reason."""

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

    def broadcasts_to_all(self) -> bool:
        """True when every client, sampled or not, receives each round's message (:meth:`message_for`)
        and folds it into its state (:meth:`client_receive`), e.g. FedSEAL's Algorithm 1 step 2 ("all
        clients download the global model"). The runtimes then build a message for every client not
        sampled, count it as server-to-client traffic, and deliver it. Default: False."""
        return False

    # ---- what a runtime calls for a client ----------------------------------------------------
    def run_client_update(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> Message:
        """A sampled client's turn: :meth:`client_update` under the client's own settings
        (:meth:`client_train`), or under ``train_args.idle_clients`` the idle-client control's
        :meth:`idle_reply` (the client leaves its data and its state alone)."""
        if self.train.idle_clients:
            return self.idle_reply(msg, data, state, ctx)
        with self.client_settings(data):
            return self.client_update(msg, data, state, ctx)

    def run_client_updates_stacked(
        self, work: dict[int, tuple[Message, ClientData, dict[str, Any]]], ctx: ClientContext, max_stack: int = 0
    ) -> dict[int, Message]:
        """A round's sampled clients together (:meth:`client_updates_stacked`), or their idle replies.

        Clients are stacked with those that take the same number of steps (:meth:`client_train`:
        with ``train_args.epochs`` each client's own T), each group under its own settings, so that
        every client trains as it would alone; the replies come back in ``work``'s order.
        """
        if self.train.idle_clients:
            return {k: self.idle_reply(msg, data, state, ctx) for k, (msg, data, state) in work.items()}
        groups: dict[int, dict[int, tuple[Message, ClientData, dict[str, Any]]]] = {}
        for k, item in work.items():
            groups.setdefault(self.client_train(item[1]).local_steps, {})[k] = item
        replies: dict[int, Message] = {}
        for group in groups.values():
            with self.client_settings(next(iter(group.values()))[1]):
                replies.update(self.client_updates_stacked(group, ctx, max_stack))
        return {k: replies[k] for k in work}

    def run_client_receive(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> None:
        """A client not sampled this round receives the round's message (:meth:`broadcasts_to_all`):
        :meth:`client_receive` under the client's own settings; nothing under
        ``train_args.idle_clients`` (idle clients do no work; the message is still built and counted,
        so the traffic is the trained run's)."""
        if not self.train.idle_clients:
            with self.client_settings(data):
                self.client_receive(msg, data, state, ctx)

    # ---- a client's local epochs ----------------------------------------------------------
    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One local epoch of this client (``train_args.epochs``): (samples it passes over, batch size).

        Default: every sample the client holds, labeled and unlabeled, at ``train_args.batch_size``.
        Algorithms whose client epoch is over another set or batch (the unlabeled set at B^U, ...)
        override this; docs/algorithms.md "Local epochs" gives each algorithm's rule.
        """
        return data.num_labeled + data.num_unlabeled, self.train.batch_size

    def client_train(self, data: ClientData) -> TrainSettings:
        """The settings a client's update runs under: :attr:`train`, with ``train_args.epochs`` E > 0
        its ``local_steps`` set to the client's own T = E x ceil(n / B) (:meth:`epoch_data`: n and B of
        the data it holds this round). ``epochs: 0``: :attr:`train` itself (every client takes
        ``train_args.local_steps``)."""
        if self.train.epochs <= 0:
            return self.train
        samples, batch = self.epoch_data(data)
        return dataclasses.replace(self.train, local_steps=epoch_steps(self.train.epochs, samples, batch))

    @contextmanager
    def client_settings(self, data: ClientData) -> Iterator[TrainSettings]:
        """:attr:`train` is the client's own settings (:meth:`client_train`) inside the block: the
        client code reads ``self.train.local_steps`` (its steps and Eq. 9's schedule position) as its
        own T. The runtimes' ``run_*`` methods wrap the client side in it."""
        base = self.train
        self.train = self.client_train(data)
        try:
            yield self.train
        finally:
            self.train = base

    # ---- client side -------------------------------------------------------------------
    def idle_reply(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> Message:
        """The idle-client control's reply (``train_args.idle_clients``): the model the client received.

        Default: the received ``weights`` as they came, with the sample count a trained reply would
        carry (:meth:`reply_samples`), no metrics and no other extras; the client's ``state`` is left
        as it was. An algorithm whose reply is not the received weights (deltas, partial uploads)
        overrides this to send what "the model I received" means in its own message format, so
        that the server's path (aggregation, records, traffic accounting) runs unchanged.
        """
        return Message(weights=dict(msg.weights), num_samples=self.reply_samples(data))

    def reply_samples(self, data: ClientData) -> int:
        """The ``num_samples`` a client's reply carries (what weighted averaging weighs it by).
        Default: its unlabeled and labeled samples."""
        return data.num_unlabeled + data.num_labeled

    def client_receive(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> None:
        """A client not sampled this round receives the round's message and may update its ``state``
        (only for an algorithm whose :meth:`broadcasts_to_all` is True). Default: nothing."""

    def client_update(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> Message:
        """A pure function of (message, local data, the client's own state, context).

        Must not read server attributes other than the immutable construction arguments
        (``config``, ``model_fn``, ``data_info``, ``train``). ``state`` is the client's own
        persistent dict, mutated in place.
        """
        raise NotImplementedError

    def client_updates_stacked(
        self, work: dict[int, tuple[Message, ClientData, dict[str, Any]]], ctx: ClientContext, max_stack: int = 0
    ) -> dict[int, Message]:
        """Every chosen client's :meth:`client_update` of one round, trained together (stacked).

        ``work`` maps each client id to its (message, data, state); the replies come back in the
        same order and equal what :meth:`client_update` gives one client after another (up to
        floating-point summation order). ``max_stack > 0``: at most that many clients in one stack.
        Only for algorithms with :attr:`stackable`.
        """
        raise NotImplementedError(f"{self.name} does not train clients stacked")
