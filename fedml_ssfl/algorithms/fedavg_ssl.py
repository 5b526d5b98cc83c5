"""The SSFL benchmark of Zhang et al. (2020): consistency loss at the clients, FedAvg or grouping.

Zhang et al., *Benchmarking Semi-supervised Federated Learning*, 2020. Labels-at-server. Every
round, from the global model w_avg, the server and the C_k sampled clients each take T SGD steps.

Equations (plain text; alpha() weak, A() strong augmentation; w_s server, w_k client)::

    (2)  server: CE(f(alpha(x); w_s), y) on its N_s labels
    (3)  client, self_training: y_bar = argmax f(alpha(x)) (model in eval mode) where max >= tau;
         CE(f(alpha(x)), y_bar) on the train-mode forward
    (6)  client, crl: y_bar = argmax f(alpha(x)) where max >= tau;  CE(f(A(x)), y_bar)
    (4/5) fedavg:   w_avg = (w_s + sum_k w_k) / (C_k + 1)   (uniform, the server one model)
    (7)  grouping: S groups; w_avg,i = average of w_s and group i's clients;
         w_avg = mean_i w_avg,i; group i starts its next round from w_avg,i
    (8)  weight diversity, logged: sum_i ||g_i||^2 / ||sum_i g_i||^2, g_i = w_i - w_i^start,
         over the classifier layer (weight_diversity_fc) and over all parameters
    (9)  learning rate: train_args.lr_schedule (cosine with warm-up)

Paper defaults: tau 0.95, S 2, ``user_loss: crl``, training from a random model.

Deviations (where the paper is silent, the authors' code decides; the other way is an option):

* Nesterov SGD whose momentum buffers persist per party across rounds and in checkpoints
  (``nesterov``, ``persistent_momentum``).
* Only parameters are averaged: each model keeps its BatchNorm statistics, the evaluated model the
  server's (``average_buffers: true`` averages every floating tensor).
* Groups are contiguous blocks of client ids, ``k * S // K`` (``regroup: random`` redraws them);
  a group with no sampled client is left out of the mean; the code's ``-H`` mode is not implemented.
* ``bootstrap_steps`` (default 0): the server first trains the random model on its labels at the
  constant base rate, as FedSEAL bootstraps.

Provenance and details: docs/algorithms.md#fedavg_ssl-the-ssfl-benchmark-zhang-et-al-2020
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import seeding
from ..aggregation import fedavg_with_server, grouping_average, weight_diversity
from ..errors import ConfigError
from ..models.head import find_classifier, head_keys
from ..ssl import masked_consistency_loss
from ..stacked import TRUTH, JobResult, LocalJob
from ..training import (
    BatchStream,
    InputPipeline,
    cpu_state,
    load_momentum_buffers,
    make_optimizer,
    momentum_buffers,
)
from .base import AlgorithmConfig, ClientContext, ClientData, Message
from .global_model import client_party
from .jobs import JobAlgorithm
from .registry import register_algorithm


@dataclass
class FedAvgSSLConfig(AlgorithmConfig):
    """Hyper-parameters of the SSFL benchmark (Zhang et al. Sec. 3.3, 4, Appendix A.3).

    Attributes
    ----------
    user_loss : str
        ``crl`` (Eq. 6, default) or ``self_training`` (Eq. 3).
    averaging : str
        ``fedavg`` (Eq. 4/5, default) or ``grouping`` (Eq. 7).
    num_groups : int
        S, the number of groups for ``grouping`` (paper: 2 on CIFAR-10/SVHN, 5 on EMNIST).
    regroup : str
        ``fixed`` (contiguous blocks of client ids, the authors' code) or ``random`` (new
        groups every round).
    threshold : float
        tau, the pseudo-label confidence threshold (0.95).
    nesterov : bool
        Nesterov momentum (default True: the authors' code; the paper only says "SGD with
        momentum"). False: plain momentum.
    persistent_momentum : bool
        Momentum buffers persist per party across rounds (default True: the authors' code; the
        paper is silent). False: every party starts each round with a fresh optimiser.
    average_buffers : bool
        False (default, the authors' code; the paper is silent): only parameters are averaged,
        every model keeps its own BatchNorm statistics. True: all floating tensors are averaged.
    bootstrap_steps : int
        Server-only SGD steps on the labels before round 0 (default 0: the paper's random start;
        > 0 is an option beyond the paper, FedSEAL Sec. 4.1.3's bootstrapping).
    """

    user_loss: str = "crl"
    averaging: str = "fedavg"
    num_groups: int = 2
    regroup: str = "fixed"
    threshold: float = 0.95
    nesterov: bool = True
    persistent_momentum: bool = True
    average_buffers: bool = False
    bootstrap_steps: int = 0

    def check(self, cfg) -> None:
        """Cross-checks against the experiment config (raises :class:`ConfigError`)."""
        choices = {
            "user_loss": ("crl", "self_training"),
            "averaging": ("fedavg", "grouping"),
            "regroup": ("fixed", "random"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"ssfl_args.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"ssfl_args.threshold: {self.threshold} must lie in [0, 1]")
        if self.num_groups < 1:
            raise ConfigError("ssfl_args.num_groups: must be >= 1")
        if self.bootstrap_steps < 0:
            raise ConfigError(
                f"ssfl_args.bootstrap_steps: {self.bootstrap_steps} must be >= 0 (0 = the paper's random start)"
            )
        if self.nesterov and cfg.train_args.momentum <= 0:
            raise ConfigError(
                f"ssfl_args.nesterov: Nesterov momentum needs train_args.momentum > 0 (it is "
                f"{cfg.train_args.momentum}); set ssfl_args.nesterov: false or a positive momentum"
            )
        ck = cfg.train_args.client_num_per_round
        if self.averaging == "grouping" and self.num_groups > ck:
            raise ConfigError(
                f"ssfl_args.num_groups (S={self.num_groups}) is larger than train_args.client_num_per_round "
                f"(C_k={ck}); every group needs a client: set S <= C_k"
            )


@dataclass(frozen=True)
class ConsistencyStepLoss:
    """One client step's Eq. 6 (CRL: ``weak`` and ``strong`` in the batch) or Eq. 3 (self-training: ``weak``).

    CRL puts alpha(x) and A(x) through the model in one forward pass; the weak half gives the
    pseudo-label (kept where its confidence reaches ``threshold``), the strong half is trained on
    it. Self-training pseudo-labels and trains on the same alpha(x): the pseudo-label ``y_bar`` of
    Eq. 3 comes from the model in eval mode (``forward.eval``: BatchNorm on its running statistics,
    as the authors' code labels with ``model.eval()``), the loss from the train-mode forward of
    the same view. A pure step loss (:data:`~fedml_ssfl.stacked.StepLoss`).
    """

    threshold: float

    def __call__(self, forward: Callable, params: Any, consts: Any, batch: Any, s: int) -> tuple:
        if "strong" in batch:
            logits_weak, logits_train = forward(torch.cat([batch["weak"], batch["strong"]])).chunk(2)
        else:
            logits_weak = forward.eval(batch["weak"])  # Eq. 3's y_bar: the authors label in eval mode, first
            logits_train = forward(batch["weak"])  # (then the train-mode pass moves the BN statistics)
        loss, pl = masked_consistency_loss(logits_train, logits_weak.detach().softmax(dim=1), self.threshold)
        pseudo = {"pseudo_labels": pl.labels, "pseudo_confidence": pl.confidence, "pseudo_mask": pl.mask}
        return loss, {"metrics": {"mask_rate": pl.mask.float().mean()}, **pseudo}


@register_algorithm
class FedAvgSSL(JobAlgorithm):
    """Zhang et al.'s SSFL: CRL or self-training on clients, FedAvg or grouping on the server."""

    name = "fedavg_ssl"
    config_class = FedAvgSSLConfig
    _param_names: list[str] | None = None  # the model's parameter names, found on first use (client or server)
    _head: list[str] | None = None  # the classifier head's parameter names, found on first use (a forward pass)

    def setup(self) -> None:
        super().setup()
        self.group_states: dict[int, dict[str, torch.Tensor]] = {}
        self.server_momentum: dict[str, torch.Tensor] = {}
        self.bootstrapped = self.config.bootstrap_steps == 0

    # ---- shared ------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        """State-dict keys of the model's parameters (what is averaged by default)."""
        if self._param_names is None:
            with torch.random.fork_rng(devices=[]):  # building a model must not move the seeded streams
                self._param_names = [name for name, _ in self.model_fn().named_parameters()]
        return self._param_names

    def head_names(self) -> list[str]:
        """The parameters of the model's classifier head, whatever it is called (a forward pass finds it)."""
        if self._head is None:
            with torch.random.fork_rng(devices=[]):
                model = self.model_fn()
            prefix = find_classifier(model, self.data_info.in_channels, self.data_info.image_size)
            self._head = head_keys(self.parameter_names(), prefix)
        return self._head

    def optimizer(self, model: nn.Module, buffers: dict[str, torch.Tensor]) -> torch.optim.SGD:
        """SGD (Nesterov by default) continuing the momentum ``buffers`` when they persist."""
        opt = make_optimizer(model, self.train, nesterov=self.config.nesterov)
        if self.config.persistent_momentum:
            load_momentum_buffers(opt, model, buffers)
        return opt

    def group_of(self, client_id: int, chosen: list[int], round_idx: int) -> int:
        """The group of ``client_id`` this round: fixed contiguous id blocks, or a seeded deal."""
        s = self.config.num_groups
        if self.config.regroup == "fixed":
            return client_id * s // max(self.train.num_clients, 1)
        order = sorted(chosen)
        perm = torch.randperm(len(order), generator=seeding.generator(self.seed, "groups", round_idx)).tolist()
        return perm.index(order.index(client_id)) % s

    # ---- server ------------------------------------------------------------------------
    def bootstrap(self) -> None:
        """``w^0`` from ``bootstrap_steps`` server-only steps (an option; FedSEAL Sec. 4.1.3).

        The server's own optimiser at the constant base rate gamma; with persistent momentum
        its buffers carry on into round 0, so the bootstrap is a server-only prefix of the run.
        """
        steps = self.config.bootstrap_steps
        model = self.scratch_model(self.global_state, self.device, slot="server")
        settings = dataclasses.replace(self.train, local_steps=steps, comm_round=1, lr_schedule="constant")
        opt = self.optimizer(model, {})
        gen = seeding.generator(self.seed, "bootstrap")
        self.server_supervised_steps(
            model, settings, 0, gen, party="the server (bootstrapping)", steps=steps, optimizer=opt
        )
        if self.config.persistent_momentum:
            self.server_momentum = momentum_buffers(opt, model)
        self.global_state = cpu_state(model)
        self.bootstrapped = True

    def server_step(self, round_idx: int) -> None:
        """Eq. 2: T supervised steps from ``w_avg`` on the server's labels (momentum kept)."""
        if not self.bootstrapped:
            self.bootstrap()
        model = self.scratch_model(self.global_state, self.device, slot="server")
        opt = self.optimizer(model, self.server_momentum)
        gen = seeding.generator(self.seed, "server", round_idx)
        self.server_supervised_steps(model, self.train, round_idx, gen, optimizer=opt)
        if self.config.persistent_momentum:
            self.server_momentum = momentum_buffers(opt, model)
        self._server_state = cpu_state(model)

    def message_for(self, client_id: int, round_idx: int) -> Message:
        if self.config.averaging == "grouping" and self.config.regroup == "fixed":
            g = self.group_of(client_id, [client_id], round_idx)
            return self.broadcast(round_idx, self.group_states.get(g), group=g)
        return self.broadcast(round_idx)

    # ---- client ------------------------------------------------------------------------
    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One local epoch: the client's unlabeled set at ``train_args.batch_size`` (the batch a step draws)."""
        return data.num_unlabeled, self.train.batch_size

    def local_job(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> LocalJob | None:
        """T steps of Eq. 6 (CRL) or Eq. 3 (self-training) from the received model, as a job.

        ``state`` holds the client's momentum buffers (``persistent_momentum``) and its own
        BatchNorm statistics (``average_buffers: false``), both carried to its next round
        (:meth:`client_reply`). None for a client without unlabeled data.
        """
        if data.num_unlabeled == 0:
            return None
        cfg = self.config
        weights = dict(msg.weights)
        if not cfg.average_buffers:
            weights.update(state.get("buffers", {}))  # the client's own BN statistics, not the server's
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen = ctx.generator(data.client_id)
        stream = BatchStream(data.unlabeled_idx, self.train.batch_size, gen)
        crl = cfg.user_loss == "crl"

        def draw(s: int) -> dict[str, torch.Tensor]:
            batch = next(stream)
            out = {"weak": pipeline.weak(data.images[batch], gen), TRUTH: data.labels[batch]}
            if crl:
                out["strong"] = pipeline.strong(data.images[batch], gen)
            return out

        momentum = state.get("momentum", {}) if cfg.persistent_momentum else {}
        return LocalJob(
            client_party(data.client_id),
            weights,
            draw,
            ConsistencyStepLoss(cfg.threshold),
            self.train.local_steps,
            momentum=momentum,
            nesterov=cfg.nesterov,
        )

    def client_reply(self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict) -> Message:
        """The trained model; the client keeps its momentum and its own BatchNorm statistics."""
        cfg = self.config
        if cfg.persistent_momentum:
            state["momentum"] = result.momentum
        out = result.weights
        if not cfg.average_buffers:
            params = set(self.parameter_names())
            own = {k: v.clone() for k, v in out.items() if k not in params}
            if own:
                state["buffers"] = own
        return Message(weights=out, num_samples=data.num_unlabeled, extras={"metrics": result.metrics})

    # ---- server ------------------------------------------------------------------------
    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        live = {k: m for k, m in replies.items() if not m.is_empty}
        before = self.global_state
        params = self.parameter_names()
        keys = None if self.config.average_buffers else params
        participants = [self._server_state, *(m.weights for m in live.values())]
        # Eq. 8's g_i from where each party started: the server from w_avg, a client from what it was
        # sent (its group's w_avg,i under fixed grouping): read before the group averages are replaced
        starts = [before, *(self._sent_start(k, round_idx) for k in live)]
        if self.config.averaging == "grouping":
            chosen = sorted(live)
            groups: dict[int, list] = {g: [] for g in range(self.config.num_groups)}
            for k in chosen:
                groups[self.group_of(k, chosen, round_idx)].append(live[k].weights)
            used = [g for g in groups if groups[g]]
            if used:
                avgs, self.global_state = grouping_average(self._server_state, [groups[g] for g in used], keys=keys)
                self.group_states = dict(zip(used, avgs))
            else:
                self.global_state = self._server_state
        else:
            self.global_state = fedavg_with_server(self._server_state, [m.weights for m in live.values()], keys=keys)
        head = self.head_names()
        metrics = {"weight_diversity": weight_diversity(before, participants, params, starts)}
        if head:  # a model whose head a forward pass cannot find has no such figure (not a NaN)
            metrics["weight_diversity_fc"] = weight_diversity(before, participants, head, starts)
        return metrics

    def _sent_start(self, client_id: int, round_idx: int) -> dict[str, torch.Tensor]:
        """The weights ``client_id`` received this round (:meth:`message_for`), without building a message."""
        if self.config.averaging == "grouping" and self.config.regroup == "fixed":
            g = self.group_of(client_id, [client_id], round_idx)
            return self.group_states.get(g, self.global_state)
        return self.global_state

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "group_states": dict(self.group_states),
            "server_momentum": dict(self.server_momentum),
            "bootstrapped": self.bootstrapped,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.group_states = state.get("group_states", {})
        self.server_momentum = state.get("server_momentum", {})
        self.bootstrapped = state.get("bootstrapped", True)
