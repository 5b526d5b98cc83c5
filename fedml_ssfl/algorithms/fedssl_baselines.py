"""The naive FL+SSL baselines of FedMatch: FedAvg / FedProx x FixMatch / UDA.

Jeong et al. (2021, Sec. 5 and A.1; Tables 1-2, "FedAvg-" and "FedProx-UDA/FixMatch") compare
FedMatch with the plain combination of a federated optimiser and a semi-supervised loss:

* FixMatch (Sohn et al. 2020, Sec. 2.2): ``l_s + lambda_u * l_u`` with ``l_u`` the cross-entropy of
  the confident (tau = 0.95) argmax of f(alpha(u)) on f(A(u)) (:func:`~fedml_ssfl.ssl.fixmatch_loss`);
* UDA (Xie et al. 2020): ``l_s + lambda_u * KL(softmax(f(alpha(u)) / T) || f(A(u)))`` kept
  where the unsharpened confidence reaches 0.8, T = 0.4 (:func:`~fedml_ssfl.ssl.uda_loss`),
  optionally with Training Signal Annealing on ``l_s``;
* FedAvg (McMahan et al. 2017): the clients' models averaged, weighted by their sample counts;
* FedProx (Li et al. 2020, the local objective h_k, Eq. 2): FedAvg whose clients add ``mu/2 ||w - w^t||^2``
  (:func:`~fedml_ssfl.training.proximal_term`, mu = 1e-2 as in Jeong et al. Table 4).

Both label scenarios, from the global model ``w^t`` each round:

* labels-at-client: each sampled client takes T = ``train_args.local_steps`` SGD steps on
  ``l_s`` over a batch of its labeled samples (weak augmentation) plus ``lambda_u * l_u`` over a
  batch of ``unlabeled_ratio * batch_size`` of its unlabeled samples (plus the proximal term);
  the server only aggregates, weighting client k by its sample count N_k (Jeong et al. Sec. 2);
* labels-at-server: the server takes T steps of cross-entropy on its labels
  (:meth:`~fedml_ssfl.algorithms.common.GlobalModelAlgorithm.train_on_server_labels`), the
  clients take T steps of ``lambda_u * l_u`` alone (plus the proximal term), and the server
  averages itself with the clients as one model (Zhang et al. Eq. 5), as ``fedavg_ssl`` does.

``include_server`` picks the server's part: unset, the server trains in labels-at-server and
only aggregates in labels-at-client; ``true`` in labels-at-client also trains the server on its
N_s labels and averages it in (a hybrid, not in the papers). A client without labeled samples
skips ``l_s``, one without unlabeled samples skips ``l_u``, one with neither sends nothing.

The four names share :class:`FedSSLBaseline`, parameterised by the unlabeled loss (the config
class: :class:`FixMatchConfig` or :class:`UDAConfig`) and the proximal coefficient (``mu``,
0 for FedAvg).

Deviations from the papers, all on purpose:

* unlabeled batch: FixMatch draws mu = 7 unlabeled per labeled sample and the FedMatch authors
  B_U/B_S = 100/10; the default here is ``unlabeled_ratio = 1`` (one unlabeled batch of
  ``batch_size`` per labeled batch) to keep CPU runs cheap: set it to 7 for FixMatch's ratio;
* FedMatch's authors pseudo-label the un-augmented image and fix tau = 0.85; here alpha(u) and
  FixMatch's tau = 0.95 (both configurable via ``threshold``; the view is not);
* FedMatch reports FedProx averaging uniformly; here FedProx aggregates exactly like FedAvg (by
  sample counts), so ``mu = 0`` reproduces FedAvg bit for bit and only the proximal term differs;
* the optimiser and schedule are the repository's (``train_args``: SGD with momentum, Eq. 9
  cosine), not FedMatch's SGD 1e-3 with adaptive decay; TSA (UDA) applies to the clients'
  labeled loss only, never to the server's supervised steps;
* the server's supervised steps carry no proximal term (it starts each round at ``w^t``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..aggregation import fedavg_with_server, weighted_average
from ..config import ConfigError
from ..ssl import PseudoLabels, fixmatch_loss, tsa_cross_entropy, tsa_threshold, uda_loss
from ..ssl.uda import TSA_SCHEDULES
from ..training import InputPipeline, cpu_state, semi_supervised_steps
from .base import Algorithm, AlgorithmConfig, ClientContext, ClientData, Message, TrainSettings
from .common import GlobalModelAlgorithm, client_party
from .registry import register_algorithm


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"ssfl_args.{key}: {value!r} is not allowed; it must be {allowed}")


# ---- configs -------------------------------------------------------------------------------------


@dataclass
class FixMatchConfig(AlgorithmConfig):
    """FixMatch's hyper-parameters (Sohn et al. Sec. 4).

    Attributes
    ----------
    threshold : float
        tau, the pseudo-label confidence threshold (0.95; FedMatch's authors used 0.85).
    lambda_u : float
        Weight of the unlabeled loss (1).
    unlabeled_ratio : int
        Unlabeled batch = ``unlabeled_ratio * train_args.batch_size`` (FixMatch's mu = 7; 1 here to
        keep runs cheap).
    """

    threshold: float = 0.95
    lambda_u: float = 1.0
    unlabeled_ratio: int = 1

    def check(self, cfg: Any) -> None:
        """Ranges of the keys."""
        _need(0.0 <= self.threshold <= 1.0, "threshold", self.threshold, "in [0, 1]")
        _need(self.lambda_u >= 0.0, "lambda_u", self.lambda_u, ">= 0")
        _need(self.unlabeled_ratio >= 1, "unlabeled_ratio", self.unlabeled_ratio, "an integer >= 1")

    def unlabeled_loss(
        self, logits_strong: torch.Tensor, logits_weak: torch.Tensor
    ) -> tuple[torch.Tensor, PseudoLabels]:
        """FixMatch's l_u (Sohn et al. Sec. 2.2)."""
        return fixmatch_loss(logits_strong, logits_weak, self.threshold)

    def labeled_loss(
        self, train: TrainSettings, num_classes: int
    ) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
        """The clients' supervised loss: None, i.e. plain cross-entropy."""
        return None


@dataclass
class UDAConfig(AlgorithmConfig):
    """UDA's hyper-parameters (Xie et al.: T = 0.4, beta = 0.8, lambda_u = 1).

    Attributes
    ----------
    temperature : float
        T, the sharpening temperature of the target (> 0; 1 = no sharpening).
    threshold : float
        beta, the confidence mask on the unsharpened prediction.
    lambda_u : float
        Weight of the consistency loss.
    tsa : str
        Training Signal Annealing on the clients' labeled loss: ``none`` (default), ``linear``,
        ``log`` or ``exp`` (FedMatch's authors' choice). Progress runs over the whole run,
        ``(round * T + step) / (comm_round * T)``.
    unlabeled_ratio : int
        Unlabeled batch = ``unlabeled_ratio * train_args.batch_size``.
    """

    temperature: float = 0.4
    threshold: float = 0.8
    lambda_u: float = 1.0
    tsa: str = "none"
    unlabeled_ratio: int = 1

    def check(self, cfg: Any) -> None:
        """Ranges of the keys."""
        _need(self.temperature > 0.0, "temperature", self.temperature, "> 0")
        _need(0.0 <= self.threshold <= 1.0, "threshold", self.threshold, "in [0, 1]")
        _need(self.lambda_u >= 0.0, "lambda_u", self.lambda_u, ">= 0")
        _need(self.tsa in TSA_SCHEDULES, "tsa", self.tsa, f"one of {', '.join(TSA_SCHEDULES)}")
        _need(self.unlabeled_ratio >= 1, "unlabeled_ratio", self.unlabeled_ratio, "an integer >= 1")

    def unlabeled_loss(
        self, logits_strong: torch.Tensor, logits_weak: torch.Tensor
    ) -> tuple[torch.Tensor, PseudoLabels]:
        """UDA's masked, sharpened KL consistency (Xie et al. 2020)."""
        return uda_loss(logits_strong, logits_weak, self.temperature, self.threshold)

    def labeled_loss(
        self, train: TrainSettings, num_classes: int
    ) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
        """The clients' supervised loss: cross-entropy, with TSA unless ``tsa`` is ``none``."""
        if self.tsa == "none":
            return None
        total = max(train.comm_round * train.local_steps, 1)
        schedule = self.tsa

        def loss(logits: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
            return tsa_cross_entropy(logits, labels, tsa_threshold(schedule, step / total, num_classes))

        return loss


def _check_federated(config: Any, cfg: Any) -> None:
    """The keys the federated variants add: ``include_server`` and (FedProx) ``mu``."""
    scenario = cfg.data_args.label_scenario
    if config.include_server is False and scenario == "server":
        raise ConfigError(
            "ssfl_args.include_server: false is not allowed with data_args.label_scenario 'server': the clients "
            "hold no labels there, so the server's training is the only supervision; leave it unset or true"
        )
    if config.include_server and cfg.data_args.num_server_labels == 0:
        raise ConfigError(
            "ssfl_args.include_server: true needs server labels, but data_args.num_server_labels is 0; "
            "leave include_server unset or give the server labels"
        )
    mu = getattr(config, "mu", 0.0)
    _need(mu >= 0.0, "mu", mu, ">= 0")


@dataclass
class FedAvgFixMatchConfig(FixMatchConfig):
    """``fedavg_fixmatch``: FixMatch's keys plus ``include_server``.

    Attributes
    ----------
    include_server : bool or None
        Unset (default): the server trains on its labels and is averaged in as one model in
        labels-at-server, and only aggregates in labels-at-client. True: it trains in both.
        False: it only aggregates (refused in labels-at-server).
    """

    include_server: bool | None = None

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        _check_federated(self, cfg)


@dataclass
class FedProxFixMatchConfig(FedAvgFixMatchConfig):
    """``fedprox_fixmatch``: ``fedavg_fixmatch``'s keys plus ``mu`` (FedProx's coefficient, 1e-2)."""

    mu: float = 0.01


@dataclass
class FedAvgUDAConfig(UDAConfig):
    """``fedavg_uda``: UDA's keys plus ``include_server`` (see :class:`FedAvgFixMatchConfig`)."""

    include_server: bool | None = None

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        _check_federated(self, cfg)


@dataclass
class FedProxUDAConfig(FedAvgUDAConfig):
    """``fedprox_uda``: ``fedavg_uda``'s keys plus ``mu`` (FedProx's coefficient, 1e-2)."""

    mu: float = 0.01


# ---- the shared client step ----------------------------------------------------------------------


def train_ssl_client(
    algo: Algorithm,
    model: torch.nn.Module,
    data: ClientData,
    ctx: ClientContext,
    anchor: dict[str, torch.Tensor] | None = None,
    mu: float = 0.0,
) -> dict[str, float]:
    """T steps of the configured FixMatch / UDA objective on one client (plus FedProx's term).

    ``algo.config`` must be a :class:`FixMatchConfig` or :class:`UDAConfig`; every random draw
    comes from ``ctx.generator(data.client_id)``. Returns the step-mean metrics of
    :func:`~fedml_ssfl.training.semi_supervised_steps`.
    """
    cfg = algo.config
    return semi_supervised_steps(
        model,
        InputPipeline(algo.data_info, ctx.device),
        data.images,
        data.labels,
        data.labeled_idx,
        data.unlabeled_idx,
        algo.train,
        ctx.round_idx,
        ctx.generator(data.client_id),
        client_party(data.client_id),
        unlabeled_loss=cfg.unlabeled_loss,
        lambda_u=cfg.lambda_u,
        unlabeled_ratio=cfg.unlabeled_ratio,
        labeled_loss=cfg.labeled_loss(algo.train, data.num_classes),
        anchor=anchor,
        mu=mu,
    )


# ---- the algorithm -------------------------------------------------------------------------------


class FedSSLBaseline(GlobalModelAlgorithm):
    """FedAvg / FedProx with a FixMatch or UDA client loss, in either label scenario.

    The unlabeled loss comes from the config class (:class:`FixMatchConfig` or
    :class:`UDAConfig`), the proximal coefficient from its ``mu`` (absent: 0, FedAvg).
    """

    label_scenarios = ("server", "client")

    @property
    def mu(self) -> float:
        """FedProx's mu; 0 for FedAvg."""
        return float(getattr(self.config, "mu", 0.0))

    @property
    def server_trains(self) -> bool:
        """Whether the server trains on its labels and is averaged in as one model this run."""
        if self.server_data.labeled_idx.numel() == 0:
            return False
        if self.config.include_server is not None:
            return bool(self.config.include_server)
        return self.server_data.label_scenario == "server"

    def setup(self) -> None:
        super().setup()
        self._server_state: dict[str, torch.Tensor] | None = None

    def server_step(self, round_idx: int) -> None:
        self._server_state = self.train_on_server_labels(self.global_state, round_idx) if self.server_trains else None

    def message_for(self, client_id: int, round_idx: int) -> Message:
        return self.broadcast(round_idx)

    def client_update(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        if data.num_labeled == 0 and data.num_unlabeled == 0:
            return Message()
        model = self.scratch_model(msg.weights, ctx.device)
        mu = self.mu
        metrics = train_ssl_client(self, model, data, ctx, anchor=msg.weights if mu else None, mu=mu)
        return Message(
            weights=cpu_state(model),
            num_samples=data.num_labeled + data.num_unlabeled,
            extras={"metrics": metrics},
        )

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        live = [m for m in replies.values() if not m.is_empty]
        if self._server_state is not None:
            self.global_state = fedavg_with_server(self._server_state, [m.weights for m in live])
        elif live:
            self.global_state = weighted_average([m.weights for m in live], [m.num_samples for m in live])
        return {}


@register_algorithm
class FedAvgFixMatch(FedSSLBaseline):
    """FedAvg-FixMatch (Jeong et al. Tables 1-2)."""

    name = "fedavg_fixmatch"
    config_class = FedAvgFixMatchConfig


@register_algorithm
class FedProxFixMatch(FedSSLBaseline):
    """FedProx-FixMatch (Jeong et al. Tables 1-2), with a real proximal term."""

    name = "fedprox_fixmatch"
    config_class = FedProxFixMatchConfig


@register_algorithm
class FedAvgUDA(FedSSLBaseline):
    """FedAvg-UDA (Jeong et al. Tables 1-2)."""

    name = "fedavg_uda"
    config_class = FedAvgUDAConfig


@register_algorithm
class FedProxUDA(FedSSLBaseline):
    """FedProx-UDA (Jeong et al. Tables 1-2), with a real proximal term."""

    name = "fedprox_uda"
    config_class = FedProxUDAConfig
