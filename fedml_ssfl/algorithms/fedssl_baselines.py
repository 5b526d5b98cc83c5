"""FedMatch's naive FL+SSL baselines: FedAvg / FedProx x FixMatch / UDA.

Jeong et al., *Federated Semi-Supervised Learning with Inter-Client Consistency & Disjoint
Learning*, 2021 (Sec. 5, A.1; Tables 1-2). Both label scenarios, from the global model w^t each
round; the four names share :class:`FedSSLBaseline`, parameterised by the unlabeled loss
(:class:`FixMatchConfig` or :class:`UDAConfig`) and the proximal coefficient ``mu`` (0: FedAvg).

Equations (plain text; a() the weak view, A() the strong view, T = train_args.local_steps)::

    client loss:  lambda_s l_s + lambda_u l_u  (+ mu/2 ||w - w^t||^2 for FedProx, Li et al. Eq. 2)
    FixMatch:     l_u = mean_b 1(max q_b >= tau) CE(argmax q_b, f(A(u_b))),  q_b = f(a(u_b))
                  (Sohn et al. Sec. 2.2; :func:`~fedml_ssfl.ssl.fixmatch_loss`)
    UDA:          l_u = mean_b 1(max q_b >= 0.8) KL(softmax(z_b / 0.4) || f(A(u_b))),  z_b the logits
                  of a(u_b); TSA on l_s (Xie et al.; :func:`~fedml_ssfl.ssl.uda_loss`)
    labels-at-client: T steps at each client; the server averages weighted by sample counts N_k
    labels-at-server, server_protocol: sequential (FedMatch Algorithm 2): the server takes T steps of
                  lambda_s CE on its labels, broadcasts; clients take T steps of lambda_u l_u;
                  w^{t+1} = the clients' weighted average (the server not one of them)
    labels-at-server, server_protocol: parallel (Zhang et al. Eq. 5): the server's T steps run beside
                  the clients' from w^t and the server is averaged in as one model

Defaults are FedMatch's (Table 4, A.1): lambda_s 10, lambda_u 1, B^U 100, tau 0.85, UDA's TSA on the
exponential schedule, the original image as the weak view (``weak_view: weak`` for flip-and-shift),
mu 1e-2. ``include_server: true`` in labels-at-client also trains the server (not in the papers).

Deviations:

* FedProx aggregates by sample counts like FedAvg (FedMatch: uniform), so ``mu: 0`` is FedAvg.
* The optimiser and schedule are ``train_args`` (FedMatch: SGD 1e-3, adaptive decay on a
  validation loss); TSA applies to the clients' labeled loss only; the server has no proximal term.
* The strong view is the package's RandAugmentMC, stronger than FedMatch's authors' RandAugment.

Provenance and details: docs/algorithms.md#fedavg--fedprox-x-fixmatch--uda
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ..aggregation import fedavg_with_server, weighted_average
from ..errors import ConfigError
from ..ssl import PseudoLabels, fixmatch_loss, tsa_cross_entropy, tsa_threshold, uda_loss
from ..ssl.uda import TSA_SCHEDULES
from ..stacked import TRUTH, JobResult, LocalJob
from ..training import BatchStream, InputPipeline, proximal_term
from .base import Algorithm, AlgorithmConfig, ClientContext, ClientData, Message, TrainSettings
from .global_model import client_party
from .jobs import JobAlgorithm
from .registry import register_algorithm


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"ssfl_args.{key}: {value!r} is not allowed; it must be {allowed}")


# ---- configs -------------------------------------------------------------------------------------


def _check_common(config: Any) -> None:
    """The keys FixMatch and UDA share."""
    _need(config.lambda_s >= 0.0, "lambda_s", config.lambda_s, ">= 0")
    _need(config.lambda_u >= 0.0, "lambda_u", config.lambda_u, ">= 0")
    batch = config.unlabeled_batch_size
    _need(batch is None or batch >= 1, "unlabeled_batch_size", batch, "an integer >= 1 (null: train_args.batch_size)")
    _need(config.weak_view in WEAK_VIEWS, "weak_view", config.weak_view, f"one of {', '.join(WEAK_VIEWS)}")


WEAK_VIEWS = ("plain", "weak")
"""``plain``: the original image (FedMatch A.1); ``weak``: flip-and-shift (FixMatch)."""


@dataclass
class FixMatchConfig(AlgorithmConfig):
    """FixMatch's hyper-parameters as FedMatch ran them (Jeong et al. Table 4, Appendix A.1).

    Attributes
    ----------
    threshold : float
        tau, the pseudo-label confidence threshold (0.85, FedMatch A.1; FixMatch's own paper: 0.95).
    lambda_s : float
        Weight of the labeled loss (10, Table 4).
    lambda_u : float
        Weight of the unlabeled loss (1, Table 4).
    unlabeled_batch_size : int or None
        Unlabeled mini-batch B^U (100, Table 4); null: ``train_args.batch_size``.
    weak_view : str
        The view pseudo-labels and labeled batches use: ``plain`` (the original image, A.1) or
        ``weak`` (flip-and-shift, FixMatch's alpha).
    """

    threshold: float = 0.85
    lambda_s: float = 10.0
    lambda_u: float = 1.0
    unlabeled_batch_size: int | None = 100
    weak_view: str = "plain"

    def check(self, cfg: Any) -> None:
        """Ranges of the keys."""
        _need(0.0 <= self.threshold <= 1.0, "threshold", self.threshold, "in [0, 1]")
        _check_common(self)

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
    """UDA's hyper-parameters (Xie et al.: T = 0.4, beta = 0.8) as FedMatch ran them (Table 4, A.1).

    Attributes
    ----------
    temperature : float
        T, the sharpening temperature of the target (> 0; 1 = no sharpening).
    threshold : float
        beta, the confidence mask on the unsharpened prediction.
    lambda_s : float
        Weight of the labeled loss (10, Table 4).
    lambda_u : float
        Weight of the consistency loss (1, Table 4).
    tsa : str
        Training Signal Annealing on the clients' labeled loss: ``exp`` (default, FedMatch A.1),
        ``linear``, ``log`` or ``none``. Progress runs over the whole run,
        ``(round * T + step) / (comm_round * T)``.
    unlabeled_batch_size : int or None
        Unlabeled mini-batch B^U (100, Table 4); null: ``train_args.batch_size``.
    weak_view : str
        The view targets and labeled batches use: ``plain`` (the original image, A.1; UDA's own
        choice too) or ``weak`` (flip-and-shift).
    """

    temperature: float = 0.4
    threshold: float = 0.8
    lambda_s: float = 10.0
    lambda_u: float = 1.0
    tsa: str = "exp"
    unlabeled_batch_size: int | None = 100
    weak_view: str = "plain"

    def check(self, cfg: Any) -> None:
        """Ranges of the keys."""
        _need(self.temperature > 0.0, "temperature", self.temperature, "> 0")
        _need(0.0 <= self.threshold <= 1.0, "threshold", self.threshold, "in [0, 1]")
        _need(self.tsa in TSA_SCHEDULES, "tsa", self.tsa, f"one of {', '.join(TSA_SCHEDULES)}")
        _check_common(self)

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
    """The keys the federated variants add: ``include_server`` and ``server_protocol`` (FedProx checks ``mu``)."""
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
    protocol = config.server_protocol
    _need(protocol in SERVER_PROTOCOLS, "server_protocol", protocol, f"one of {', '.join(SERVER_PROTOCOLS)}")


SERVER_PROTOCOLS = ("sequential", "parallel")
"""``sequential``: the server trains, then broadcasts, the clients are averaged (FedMatch Sec. 5);
``parallel``: the server trains beside the clients and is averaged in as one model (Zhang et al. Eq. 5)."""


@dataclass
class FedAvgFixMatchConfig(FixMatchConfig):
    """``fedavg_fixmatch``: FixMatch's keys plus ``include_server``.

    Attributes
    ----------
    include_server : bool or None
        Unset (default): the server trains on its labels in labels-at-server and only aggregates
        in labels-at-client. True: it trains in both. False: it only aggregates (refused in
        labels-at-server).
    server_protocol : str
        Where the server trains: ``sequential`` (default, FedMatch Sec. 5: train, then broadcast
        the trained model; average the clients) or ``parallel`` (Zhang et al. Eq. 5: train beside
        the clients from the same global model; average the server in as one model).
    """

    include_server: bool | None = None
    server_protocol: str = "sequential"

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        _check_federated(self, cfg)


@dataclass
class FedProxFixMatchConfig(FedAvgFixMatchConfig):
    """``fedprox_fixmatch``: ``fedavg_fixmatch``'s keys plus ``mu`` (FedProx's coefficient, 1e-2)."""

    mu: float = 0.01

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        _need(self.mu >= 0.0, "mu", self.mu, ">= 0")


@dataclass
class FedAvgUDAConfig(UDAConfig):
    """``fedavg_uda``: UDA's keys plus ``include_server`` and ``server_protocol`` (see
    :class:`FedAvgFixMatchConfig`)."""

    include_server: bool | None = None
    server_protocol: str = "sequential"

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        _check_federated(self, cfg)


@dataclass
class FedProxUDAConfig(FedAvgUDAConfig):
    """``fedprox_uda``: ``fedavg_uda``'s keys plus ``mu`` (FedProx's coefficient, 1e-2)."""

    mu: float = 0.01

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        _need(self.mu >= 0.0, "mu", self.mu, ">= 0")


# ---- the shared client step ----------------------------------------------------------------------


@dataclass
class SSLStepLoss:
    """One local step's ``lambda_s l_s + lambda_u l_u (+ FedProx's term)`` from its batch: FixMatch / UDA.

    A pure step loss (:data:`~fedml_ssfl.stacked.StepLoss`): all views of the batch (``x``, the
    labeled weak view with targets ``y``; ``u_weak`` and ``u_strong``, the unlabeled views) go
    through the model in one forward pass, as in FixMatch's code, so normalisation layers see one
    batch; the unlabeled loss gets the weak logits detached; a half absent from the batch is
    skipped. FedProx's :func:`~fedml_ssfl.training.proximal_term` pulls towards
    ``consts["anchor"]`` when the job carries one.

    Attributes
    ----------
    config : FixMatchConfig or UDAConfig
        The losses, their weights.
    train : TrainSettings
        T and the run length (UDA's TSA progress).
    num_classes : int
        K (UDA's TSA threshold).
    round_idx : int
        The round (TSA progress).
    mu : float
        FedProx's coefficient (used with an anchor).
    """

    config: Any
    train: TrainSettings
    num_classes: int
    round_idx: int
    mu: float = 0.0

    def __call__(self, forward: Callable, params: Any, consts: Any, batch: Any, s: int) -> tuple:
        cfg, train = self.config, self.train
        logits = forward(torch.cat([batch[k] for k in ("x", "u_weak", "u_strong") if k in batch]))
        parts: dict[str, torch.Tensor] = {}
        n_x = 0
        if "y" in batch:
            n_x = batch["y"].shape[0]
            labeled_loss = cfg.labeled_loss(train, self.num_classes) or _cross_entropy
            step = self.round_idx * train.local_steps + s
            parts["loss_x"] = cfg.lambda_s * labeled_loss(logits[:n_x], batch["y"], step)
        pl = None
        if "u_weak" in batch:
            logits_weak, logits_strong = logits[n_x:].chunk(2)
            parts["loss_u"], pl = cfg.unlabeled_loss(logits_strong, logits_weak.detach())
        zero = torch.zeros((), device=logits.device)
        loss = parts.get("loss_x", zero) + cfg.lambda_u * parts.get("loss_u", zero)
        if "anchor" in consts:
            parts["prox"] = proximal_term(params, consts["anchor"], self.mu)
            loss = loss + parts["prox"]
        metrics = {k: v.detach() for k, v in parts.items()}
        if pl is None:
            return loss, {"metrics": metrics}
        metrics["mask_rate"] = pl.mask.float().mean()
        pseudo = {"pseudo_labels": pl.labels, "pseudo_confidence": pl.confidence, "pseudo_mask": pl.mask}
        return loss, {"metrics": metrics, **pseudo}


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def ssl_epoch_data(algo: Algorithm, data: ClientData) -> tuple[int, int]:
    """One local epoch of a FixMatch / UDA client (``train_args.epochs``): its unlabeled set at B^U
    (``unlabeled_batch_size``), the set a step draws its large batch from (Jeong et al. count an
    epoch on the unlabeled batch); a client without unlabeled data: its labeled set at B."""
    if data.num_unlabeled:
        return data.num_unlabeled, algo.config.unlabeled_batch_size or algo.train.batch_size
    return data.num_labeled, algo.train.batch_size


def ssl_client_job(
    algo: Algorithm,
    data: ClientData,
    ctx: ClientContext,
    weights: dict[str, torch.Tensor],
    anchor: dict[str, torch.Tensor] | None = None,
    mu: float = 0.0,
) -> LocalJob:
    """T local steps of ``lambda_s l_s + lambda_u l_u (+ FedProx's term)`` on one client, as a job.

    ``algo.config`` must be a :class:`FixMatchConfig` or :class:`UDAConfig` (the losses, weights,
    unlabeled batch size and weak view); every random draw comes from
    ``ctx.generator(data.client_id)``. Each step draws a labeled batch of ``batch_size`` (the
    weak view; target: its labels) and an unlabeled batch of ``unlabeled_batch_size`` shown
    twice, as the weak view and as A(u); the loss is :class:`SSLStepLoss`. ``labeled_idx`` is the
    only place labels are read for training; the labels at ``unlabeled_idx`` only feed the
    ``pseudo_acc`` diagnostic. ``anchor`` and ``mu``: FedProx's
    :func:`~fedml_ssfl.training.proximal_term` towards ``anchor`` (the round's global weights),
    skipped when ``anchor`` is None or ``mu == 0``. The job starts from ``weights``.

    Raises
    ------
    ValueError
        When the client has neither labeled nor unlabeled samples.
    """
    cfg, train, device = algo.config, algo.train, ctx.device
    images, labels, gen = data.images, data.labels, ctx.generator(data.client_id)
    party = client_party(data.client_id)
    if data.num_labeled == 0 and data.num_unlabeled == 0:
        raise ValueError(f"ssl_client_job: {party} has no labeled and no unlabeled samples")
    pipeline = InputPipeline(algo.data_info, device)
    stream_x = BatchStream(data.labeled_idx, train.batch_size, gen) if data.num_labeled else None
    view = pipeline.weak if cfg.weak_view == "weak" else (lambda imgs, gen: pipeline.plain(imgs))
    unlabeled_batch = cfg.unlabeled_batch_size or train.batch_size
    stream_u = BatchStream(data.unlabeled_idx, unlabeled_batch, gen) if data.num_unlabeled else None
    prox_on = anchor is not None and mu != 0

    def draw(s: int) -> dict[str, torch.Tensor]:
        batch = {}
        if stream_x is not None:
            batch_x = next(stream_x)
            batch["x"] = view(images[batch_x], gen)
            batch["y"] = labels[batch_x].to(device)
        if stream_u is not None:
            batch_u = next(stream_u)
            batch["u_weak"] = view(images[batch_u], gen)
            batch["u_strong"] = pipeline.strong(images[batch_u], gen)
            batch[TRUTH] = labels[batch_u]
        return batch

    loss = SSLStepLoss(cfg, train, data.num_classes, ctx.round_idx, mu if prox_on else 0.0)
    consts = {"anchor": dict(anchor)} if prox_on else {}
    return LocalJob(party, weights, draw, loss, train.local_steps, consts=consts)


# ---- the algorithm -------------------------------------------------------------------------------


class FedSSLBaseline(JobAlgorithm):
    """FedAvg / FedProx with a FixMatch or UDA client loss, in either label scenario.

    The unlabeled loss comes from the config class (:class:`FixMatchConfig` or
    :class:`UDAConfig`), the proximal coefficient from its ``mu`` (absent: 0, FedAvg).
    """

    label_scenarios = ("server", "client")

    @property
    def mu(self) -> float:
        """FedProx's mu; 0 for FedAvg (:class:`FedProxFixMatch` and :class:`FedProxUDA` read their config's)."""
        return 0.0

    @property
    def server_trains(self) -> bool:
        """Whether the server trains on its labels this run."""
        if self.server_data.labeled_idx.numel() == 0:
            return False
        if self.config.include_server is not None:
            return bool(self.config.include_server)
        return self.server_data.label_scenario == "server"

    def setup(self) -> None:
        super().setup()
        self._server_state: dict[str, torch.Tensor] | None = None

    def server_step(self, round_idx: int) -> None:
        """The server's ``lambda_s`` cross-entropy steps: before the broadcast (sequential) or beside
        the clients, kept aside to be averaged in (parallel)."""
        self._server_state = None
        if not self.server_trains:
            return
        cfg = self.config
        trained = self.train_on_server_labels(self.global_state, round_idx, cfg.lambda_s, cfg.weak_view)
        if cfg.server_protocol == "sequential":
            self.global_state = trained  # FedMatch Algorithm 2 lines 4-8: the broadcast model
        else:
            self._server_state = trained  # Zhang et al. Eq. 5: one more model in the average

    def message_for(self, client_id: int, round_idx: int) -> Message:
        return self.broadcast(round_idx)

    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """:func:`ssl_epoch_data`: the unlabeled set at B^U."""
        return ssl_epoch_data(self, data)

    def local_job(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> LocalJob | None:
        """:func:`ssl_client_job` from the received model (FedProx: anchored to it); None without data."""
        if data.num_labeled == 0 and data.num_unlabeled == 0:
            return None
        mu = self.mu
        return ssl_client_job(self, data, ctx, msg.weights, anchor=msg.weights if mu else None, mu=mu)

    def client_reply(self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict) -> Message:
        return Message(
            weights=result.weights,
            num_samples=data.num_labeled + data.num_unlabeled,
            extras={"metrics": result.metrics},
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

    @property
    def mu(self) -> float:
        """FedProx's mu (``ssfl_args.mu``)."""
        return float(self.config.mu)


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

    @property
    def mu(self) -> float:
        """FedProx's mu (``ssfl_args.mu``)."""
        return float(self.config.mu)
