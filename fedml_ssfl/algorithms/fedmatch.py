"""FedMatch: inter-client consistency and disjoint learning (Jeong et al., ICLR 2021).

Jeong et al., *Federated Semi-Supervised Learning with Inter-Client Consistency & Disjoint
Learning*, ICLR 2021. Both label scenarios (Algorithm 1: labels-at-client, Algorithm 2:
labels-at-server). Every trainable parameter is ``theta = sigma + psi``.

Equations (plain text; alpha() weak, A() strong augmentation, u an unlabeled sample)::

    (1)  inter-client consistency: 1/H sum_j KL( p_{h_j}(u) || p_{sigma + psi}(u) ),
         h_j = sigma + psi_{h_j} with the H helpers' psi (KD-tree over model embeddings, Sec. 3.1)
    (3)  y_hat = Max( 1(p_local(u)) + sum_j 1(p_{h_j}(u)) ), kept where max p_local(u) >= tau
    (2)  Phi = lambda_a CE(y_hat, p_{sigma + psi}(A(u))) + lambda_i * (1)
    (4)  L_s(sigma) = lambda_s CE(y, p_{sigma + psi*}(alpha(x)))                    psi frozen
    (5)  L_u(psi)   = Phi_{sigma* + psi} + lambda_L2 ||sigma* - psi||_2^2 + lambda_L1 ||psi||_1   sigma frozen
         server (Alg. 1 l. 10-11): sigma, psi = uniform means of the clients' reconstructed sigma_k, psi_k
         labels-at-server (Alg. 2): the server trains sigma by (4); clients train psi by (5) only
         messages: sparse deltas, |Delta| < c2s_threshold / s2c_threshold dropped (Sec. 3.2, App. B.1)

Defaults (Table 4, A.1): lambda_s 10, lambda_a = lambda_i 1e-2, lambda_L2 10, lambda_L1 1e-4
(client) / 1e-5 (server), tau 0.85, H 2 helpers every 10 rounds, B^U 100, plain SGD.

Deviations:

* psi starts at 0.2 x the initial sigma (the authors' code; the paper is silent).
* Phi is a mean over the whole unlabeled batch; the authors' over the confident samples is
  ``phi_average: confident``.
* The strong view is the package's RandAugment with cutout, stronger than the authors' (one strong
  view for every algorithm).
* Agreement ties go to the local model's class, then the larger summed probability (the authors':
  the lowest index).
* Helpers are sent in rounds ``r % helper_interval == 0`` (the authors': ``(r + 1) % 10``) and used
  that round only.
* Server-to-client deltas are against what the client last received, with error feedback (the
  authors': against its last trained weights), so both ends need only the messages.
* A delta denser than ~1/3 goes dense (``dense_fallback``): COO would be larger.
* The aggregated psi is hard-thresholded again at ``psi_threshold``.
* The config check warns when Eq. 5's L2 pull closes more than 20% of the sigma-psi gap a round
  (:func:`psi_pull`): momentum or a larger learning rate than the paper's makes it overshoot.

Provenance and details: docs/algorithms.md#fedmatch-jeong-et-al-2021
"""

from __future__ import annotations

import logging
import math
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from .. import seeding
from ..aggregation import weighted_average
from ..data.augment import normalize
from ..errors import ConfigError
from ..helper_selection import model_embedding, nearest_helpers, probe_input
from ..sparse import densify, density, hard_threshold, num_values, sparsify
from ..ssl import PseudoLabels, kl_consistency
from ..ssl.agreement import agreement_pseudo_labels
from ..stacked import TRUTH
from ..training import BatchStream, InputPipeline, cpu_state
from .base import AlgorithmConfig, ClientContext, ClientData, Message, client_records_state, message_nbytes
from .disjoint import DisjointJob, DisjointResult, run_disjoint, run_disjoint_stacked
from .global_model import GlobalModelAlgorithm, client_party
from .local_baselines import ClientModels
from .registry import register_algorithm

log = logging.getLogger(__name__)

SCENARIO_DEFAULTS: dict[str, dict[str, float]] = {
    "client": {"lambda_l1": 1e-4, "c2s_threshold": 5e-5, "psi_threshold": 5e-6},
    "server": {"lambda_l1": 1e-5, "c2s_threshold": 1e-5, "psi_threshold": 1e-5},
}
"""Per-scenario defaults of the keys left null (Table 4; docs/algorithms.md#fedmatch-jeong-et-al-2021)."""

SIGMA, PSI, HELPER = "sigma/", "psi/", "helper{}/"
"""Message key prefixes: ``sigma/<param>``, ``psi/<param>``, ``helper<j>/<param>``."""


EVALUATE_MODES = ("global", "local_mean")
EVAL_PARAMS = ("sigma+psi", "sigma", "psi")


@dataclass
class FedMatchConfig(AlgorithmConfig):
    """Hyper-parameters of FedMatch (Jeong et al. Eq. 1-5, Table 4, Appendix B.1).

    Attributes
    ----------
    lambda_s : float
        Weight of the supervised loss, Eq. 4 (10).
    lambda_a : float
        Weight of the agreement pseudo-label cross-entropy in Phi, Eq. 2 (1e-2).
    lambda_i : float
        Weight of the inter-client KL term in Phi, Eq. 1/2 (1e-2).
    lambda_l2 : float
        Weight of ``||sigma - psi||_2^2``, Eq. 5 (10).
    lambda_l1 : float or None
        Weight of ``||psi||_1``, Eq. 5; null: 1e-4 labels-at-client, 1e-5 labels-at-server.
    tau : float
        Local confidence threshold of the agreement pseudo-label, Eq. 3 (0.85, Appendix A.1; the
        authors' code: 0.75).
    num_helpers : int
        H, helpers per client (2); 0 disables the inter-client consistency.
    helper_interval : int
        Helpers are sent in rounds ``r % helper_interval == 0`` (10).
    psi_init_factor : float
        ``psi^0 = psi_init_factor * sigma^0`` (0.2, authors' code).
    c2s_threshold : float or None
        Client deltas drop ``|Delta| < c2s_threshold``; null: 5e-5 client / 1e-5 server.
    s2c_threshold : float or None
        Server deltas (and helpers) drop ``|Delta| < s2c_threshold``; null: ``c2s_threshold``.
    psi_threshold : float or None
        ``psi`` is hard-thresholded at this after training; null: 5e-6 client / 1e-5 server.
    s2c_deltas : bool
        Server-to-client deltas against per-client records (true) or full tensors (false).
    dense_fallback : bool
        Send a delta dense where that is smaller than sparse COO (true).
    server_steps : int or None
        Labels-at-server: the server's ``sigma`` steps per round; null: ``train_args.local_steps``.
    labeled_batch_size : int or None
        Labeled mini-batch size B^S; null: ``train_args.batch_size``.
    unlabeled_batch_size : int or None
        Unlabeled mini-batch size B^U (100, Table 4); null: ``train_args.batch_size``.
    momentum : float
        SGD momentum of the sigma and psi steps (0: plain SGD, the authors'). It multiplies the
        psi pull and makes it overshoot (see :func:`psi_pull`).
    probe_size : int
        Number of noise images the helper embedding is computed on (1).
    phi_average : str
        ``batch`` (default): Phi's two terms are means over the whole unlabeled batch (masked-out
        samples count as zeros). ``confident``: the authors' code, means over the samples whose
        agreement label is kept (Eq. 3's mask), which makes Phi larger by 1 / mask rate.
    evaluate : str
        The run's test accuracy: ``global`` (default; Table 1) the global model's; ``local_mean``
        (Table 2's "averaged local model accuracy") the mean over every client that has trained of
        its own local model ``sigma_k + psi_k`` as it last sent it (min and max are logged too).
    eval_params : str
        The parameters of every evaluated model (Fig. 6 (b), the decomposition's ablation):
        ``sigma+psi`` (default, theta), ``sigma`` (psi dropped) or ``psi`` (sigma dropped). Training and
        the exported model are unchanged.
    """

    lambda_s: float = 10.0
    lambda_a: float = 1e-2
    lambda_i: float = 1e-2
    lambda_l2: float = 10.0
    lambda_l1: float | None = None
    tau: float = 0.85
    num_helpers: int = 2
    helper_interval: int = 10
    psi_init_factor: float = 0.2
    c2s_threshold: float | None = None
    s2c_threshold: float | None = None
    psi_threshold: float | None = None
    s2c_deltas: bool = True
    dense_fallback: bool = True
    server_steps: int | None = None
    labeled_batch_size: int | None = None
    unlabeled_batch_size: int | None = 100
    momentum: float = 0.0
    probe_size: int = 1
    phi_average: str = "batch"
    evaluate: str = "global"
    eval_params: str = "sigma+psi"

    def check(self, cfg) -> None:
        """Cross-checks against the experiment config (raises :class:`ConfigError`)."""
        for key in ("lambda_s", "lambda_a", "lambda_i", "lambda_l2", "psi_init_factor"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"ssfl_args.{key}: {value} must be a finite number >= 0")
        for key in ("lambda_l1", "c2s_threshold", "s2c_threshold", "psi_threshold"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"ssfl_args.{key}: {value} must be a finite number >= 0 (or null for the default)")
        if not 0.0 <= self.tau <= 1.0:
            raise ConfigError(f"ssfl_args.tau: {self.tau} must lie in [0, 1]")
        if self.num_helpers < 0:
            raise ConfigError(f"ssfl_args.num_helpers: {self.num_helpers} must be >= 0 (0 disables helpers)")
        if self.helper_interval < 1:
            raise ConfigError(f"ssfl_args.helper_interval: {self.helper_interval} must be >= 1 (rounds)")
        if self.server_steps is not None and self.server_steps < 0:
            raise ConfigError(f"ssfl_args.server_steps: {self.server_steps} must be >= 0 (or null for T)")
        if self.labeled_batch_size is not None and self.labeled_batch_size < 1:
            raise ConfigError(
                f"ssfl_args.labeled_batch_size: {self.labeled_batch_size} must be >= 1 (or null for batch_size)"
            )
        if self.unlabeled_batch_size is not None and self.unlabeled_batch_size < 1:
            raise ConfigError(
                f"ssfl_args.unlabeled_batch_size: {self.unlabeled_batch_size} must be >= 1 (or null for batch_size)"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"ssfl_args.momentum: {self.momentum} must lie in [0, 1) (0: plain SGD, the authors')")
        if self.probe_size < 1:
            raise ConfigError(f"ssfl_args.probe_size: {self.probe_size} must be >= 1")
        if self.phi_average not in ("batch", "confident"):
            raise ConfigError(f"ssfl_args.phi_average: {self.phi_average!r} is not one of batch, confident")
        if self.evaluate not in EVALUATE_MODES:
            raise ConfigError(f"ssfl_args.evaluate: {self.evaluate!r} is not one of {', '.join(EVALUATE_MODES)}")
        if self.eval_params not in EVAL_PARAMS:
            raise ConfigError(f"ssfl_args.eval_params: {self.eval_params!r} is not one of {', '.join(EVAL_PARAMS)}")
        c = psi_pull(self.lambda_l2, cfg.train_args.learning_rate, cfg.train_args.local_steps, self.momentum)
        if c > PULL_WARNING:
            log.warning(
                "fedmatch: Eq. 5 pulls psi onto sigma by c = %.2f of the gap per client round (> %.1f; the authors' "
                "setting gives ~0.1), so each client round pulls the model away from the server's step. Lower "
                "ssfl_args.lambda_l2 (%g), train_args.learning_rate (%g), train_args.local_steps (%d) or "
                "ssfl_args.momentum (%g) so that c ~ 0.1",
                c,
                PULL_WARNING,
                self.lambda_l2,
                cfg.train_args.learning_rate,
                cfg.train_args.local_steps,
                self.momentum,
            )
        if cfg.data_args.label_scenario == "server" and cfg.data_args.num_server_labels <= 0:
            raise ConfigError(
                "data_args.num_server_labels: fedmatch labels-at-server trains sigma on the server's labels "
                "(Algorithm 2); set it > 0"
            )

    def resolved(self, key: str, scenario: str) -> float:
        """The value of ``key`` in ``scenario``: the configured one, or the scenario's default."""
        value = getattr(self, key)
        if value is not None:
            return float(value)
        if key == "s2c_threshold":
            return self.resolved("c2s_threshold", scenario)
        return SCENARIO_DEFAULTS[scenario][key]


PULL_WARNING = 0.2
"""The psi pull per client round (:func:`psi_pull`) above which the config check warns."""


def psi_pull(lambda_l2: float, lr: float, steps: int, momentum: float = 0.0) -> float:
    """The fraction of the gap ``sigma - psi`` that Eq. 5's L2 term closes in one client round.

    A plain SGD step on ``lambda_L2 ||sigma - psi||^2`` moves psi by ``2 lambda_L2 lr`` of the gap,
    so T steps close ``c = 1 - (1 - 2 lambda_L2 lr)^T``. Momentum scales the step by about
    ``1 / (1 - momentum)``. A step fraction ``2 lambda_L2 lr_eff >= 1`` overshoots sigma every step:
    then the step fraction itself is returned (``>= 1``).

    Returns
    -------
    float
        ``c`` (0.1 in the authors' setting; the config check warns above :data:`PULL_WARNING`).
    """
    step = 2.0 * lambda_l2 * lr / (1.0 - momentum)
    if step >= 1.0:
        return step  # every step overshoots sigma: reported as the step fraction itself
    return 1.0 - (1.0 - step) ** max(steps, 0)


def phi(
    logits_plain: torch.Tensor,
    logits_strong: torch.Tensor,
    helper_probs: Sequence[torch.Tensor],
    tau: float,
    average: str = "batch",
) -> tuple[torch.Tensor, torch.Tensor, PseudoLabels]:
    """Eq. 2's two terms on one unlabeled batch: agreement cross-entropy and inter-client KL.

    Parameters
    ----------
    logits_plain : torch.Tensor
        The local model's logits on the unaugmented inputs u (with gradient).
    logits_strong : torch.Tensor
        Its logits on the RandAugment view pi(u) (with gradient).
    helper_probs : sequence of torch.Tensor
        The frozen helpers' probabilities on u (may be empty: no KL term, a local vote).
    tau : float
        The local confidence threshold of Eq. 3.
    average : str
        ``batch`` (default): both terms are means over the whole batch, masked-out samples counting
        as zeros in the CE. ``confident`` (the authors' code): both are means over the confident
        samples only (the mask of Eq. 3; 0 when none is confident).

    Returns
    -------
    loss_agree : torch.Tensor
        ``CE(y_hat, p_local(pi(u)))`` with y_hat the agreement label of Eq. 3, averaged as ``average``
        says.
    loss_kl : torch.Tensor
        ``1/H sum_j KL(p_h_j(u) || p_local(u))`` (Eq. 1), averaged as ``average`` says, 0 without
        helpers.
    pseudo : PseudoLabels
        The agreement labels and their mask.
    """
    pl = agreement_pseudo_labels(logits_plain.detach().float().softmax(dim=1), helper_probs, tau)
    ce = F.cross_entropy(logits_strong, pl.labels, reduction="none")
    mask = pl.mask.to(ce.dtype)
    loss_agree = (ce * mask).mean()
    # the authors' code: means over the confident samples (a tensor factor: no branch on values, vmap-safe)
    scale = mask.numel() / mask.sum().clamp_min(1.0) if average == "confident" else None
    loss_kl = torch.zeros((), device=logits_plain.device)
    if helper_probs:
        kl_mask = pl.mask if scale is not None else None
        loss_kl = sum(kl_consistency(logits_plain, p, kl_mask) for p in helper_probs) / len(helper_probs)
    if scale is not None:
        loss_agree, loss_kl = loss_agree * scale, loss_kl * scale
    return loss_agree, loss_kl, pl


def psi_regularisers(sigma: dict[str, torch.Tensor], psi: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5's ``||sigma* - psi||_2^2`` (squared, sigma frozen) and ``||psi||_1``, summed over every tensor."""
    l2 = sum(((sigma[n].detach() - psi[n]) ** 2).sum() for n in psi)
    l1 = sum(psi[n].abs().sum() for n in psi)
    return l2, l1


@dataclass(frozen=True)
class FedMatchLoss:
    """Disjoint learning's two step losses (Eq. 4 and Eq. 5), for both training paths
    (:mod:`fedml_ssfl.algorithms.disjoint`): pure functions of ``sigma``, ``psi`` and the batch."""

    lambda_s: float
    lambda_a: float
    lambda_i: float
    lambda_l2: float
    lambda_l1: float
    tau: float
    phi_average: str = "batch"

    def sigma(self, net: Any, sigma: Any, psi: Any, batch: Any) -> torch.Tensor:
        """Eq. 4: ``lambda_s CE(y, p_{sigma + psi*}(y | alpha(x)))``, psi frozen."""
        w = {n: sigma[n] + psi[n].detach() for n in sigma}
        return self.lambda_s * F.cross_entropy(net(w, batch["x_lab"], True), batch["y_lab"])

    def psi(self, net: Any, sigma: Any, psi: Any, helpers: Sequence[Any], batch: Any) -> tuple:
        """Eq. 5: ``Phi_{sigma* + psi} + lambda_L2 ||sigma* - psi||^2 + lambda_L1 ||psi||_1``, sigma frozen.

        Phi (Eq. 2) from the local model in train mode on ``x_plain`` and ``x_strong`` (one pass) and
        the frozen helpers in eval mode on ``x_plain``.
        """
        x_plain = batch["x_plain"]
        n_b = x_plain.shape[0]
        helper_probs = []
        if helpers:  # frozen helpers sigma + psi_h on the unaugmented input
            with torch.no_grad():
                helper_probs = [net(hw, x_plain, False).float().softmax(dim=1) for hw in helpers]
        w = {n: sigma[n].detach() + psi[n] for n in psi}
        logits_plain, logits_strong = net(w, torch.cat([x_plain, batch["x_strong"]]), True).split(n_b)
        loss_a, loss_i, pl = phi(logits_plain, logits_strong, helper_probs, self.tau, self.phi_average)  # Eq. 2, 3
        l2, l1 = psi_regularisers(sigma, psi)
        loss_u = self.lambda_a * loss_a + self.lambda_i * loss_i + self.lambda_l2 * l2 + self.lambda_l1 * l1  # Eq. 5
        terms = {"loss_agree": loss_a, "loss_kl": loss_i, "l2": l2, "mask_rate": pl.mask.float().mean()}
        return loss_u, terms, pl


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class Layout:
    """Names and shapes of a model's trainable parameters and its state-dict buffers."""

    params: list[str]
    buffers: list[str]
    shapes: dict[str, torch.Size]
    order: list[str]  # state-dict key order


def model_layout(model: nn.Module) -> Layout:
    """The :class:`Layout` of ``model``: trainable parameters (decomposed) and buffers (not)."""
    state = model.state_dict()
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = [k for k in state if k not in set(params)]
    return Layout(params, buffers, {k: v.shape for k, v in state.items()}, list(state))


@register_algorithm
class FedMatch(GlobalModelAlgorithm):
    """FedMatch: ``theta = sigma + psi``, disjoint learning, agreement labels, helpers, sparse deltas."""

    name = "fedmatch"
    config_class = FedMatchConfig
    label_scenarios = ("server", "client")
    partial_replies = True  # replies carry sigma/psi deltas only for the parts a client trained
    stackable = True  # train_args.stack_clients: client_updates_stacked
    client_records = ("views", "client_psi")  # per seen client; spillable under device_args.state_memory_mb
    _layout: Layout | None = None  # cached by layout(); a FedML worker never runs setup()

    # ---- settings ------------------------------------------------------------------------
    @property
    def scenario(self) -> str:
        """``client`` (Algorithm 1) or ``server`` (Algorithm 2): the run's label scenario."""
        return self.server_data.label_scenario

    def setting(self, key: str) -> float:
        return self.config.resolved(key, self.scenario)

    def layout(self) -> Layout:
        """The model's layout (a pure function of ``model_fn``, cached)."""
        lay = self._layout
        if lay is None:
            model = self._scratch.get("client") or self.model_fn()
            self._scratch.setdefault("client", model)
            lay = self._layout = model_layout(model)
        return lay

    # ---- models --------------------------------------------------------------------------
    def module(self, slot: str, device: torch.device, buffers: dict[str, torch.Tensor]) -> nn.Module:
        """A reusable module on ``device`` holding ``buffers`` (its parameters are never used)."""
        model = self._scratch.get(slot)
        if model is None:
            model = self._scratch[slot] = self.model_fn()
        model.to(device)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name in buffers:
                    buf.copy_(buffers[name])
        return model

    def _refresh_global(self) -> None:
        lay = self.layout()
        theta = {n: self.sigma[n] + self.psi[n] for n in lay.params}
        self.global_state = {k: theta[k] if k in theta else self.buffers[k] for k in lay.order}

    # ---- server ----------------------------------------------------------------------------
    def setup(self) -> None:
        seeding.seed_everything(self.seed)
        model = self.model_fn()
        lay = self._layout = model_layout(model)
        state = cpu_state(model)
        factor = self.config.psi_init_factor
        self.sigma: dict[str, torch.Tensor] = {n: state[n] for n in lay.params}
        self.psi: dict[str, torch.Tensor] = {n: factor * state[n] for n in lay.params}
        self.buffers: dict[str, torch.Tensor] = {k: state[k] for k in lay.buffers}
        # per seen client (client_records: the runtime may swap these dicts for bounded stores)
        self.views: MutableMapping[int, dict[str, torch.Tensor]] = {}  # what each client holds (S2C records)
        self.client_psi: MutableMapping[int, dict[str, torch.Tensor]] = {}  # newest psi of each seen client
        self.embeddings: dict[int, torch.Tensor] = {}  # newest embedding of each seen client
        info = self.data_info
        probe = probe_input(self.seed, (info.in_channels, info.image_size, info.image_size), self.config.probe_size)
        self.probe = normalize(probe, info.mean, info.std)
        self.dense_bytes = message_nbytes(Message(weights=state))
        self._round: int | None = None
        self._sent: dict[int, tuple[int, int, int]] = {}  # this round: client -> (bytes, values, helpers)
        self._helper_plan: dict[int, list[int]] = {}
        self.local_models: dict[int, dict[str, torch.Tensor]] = {}  # evaluate: local_mean, each client's theta_k
        self._refresh_global()

    def eval_state(
        self, sigma: dict[str, torch.Tensor], psi: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A model's state dict from its parts, with ``eval_params``' parameters (theta, sigma or psi)."""
        lay, which = self.layout(), self.config.eval_params
        params = {
            n: sigma[n] + psi[n] if which == "sigma+psi" else (sigma[n] if which == "sigma" else psi[n])
            for n in lay.params
        }
        return {k: params[k] if k in params else buffers[k] for k in lay.order}

    def evaluation_models(self) -> Sequence[nn.Module]:
        """``evaluate: global``: the global model (with ``eval_params``' parameters); ``local_mean``: every
        client that has trained, its own local model (Table 2), or the global model before any has."""
        cfg = self.config
        if cfg.evaluate == "global" and cfg.eval_params == "sigma+psi":
            return [self.global_model()]
        if self._eval_model is None:
            self._eval_model = self.model_fn()
        if cfg.evaluate == "local_mean" and self.local_models:
            states = [self.local_models[k] for k in sorted(self.local_models)]
        else:
            states = [self.eval_state(self.sigma, self.psi, self.buffers)]
        return ClientModels(self._eval_model, states)

    def server_step(self, round_idx: int) -> None:
        """Labels-at-server (Algorithm 2, lines 4-8): train sigma on the server's labels, psi frozen."""
        steps = self.train.local_steps if self.config.server_steps is None else self.config.server_steps
        labeled = self.server_data.labeled_idx
        if self.scenario != "server" or steps == 0 or labeled.numel() == 0:
            return
        sigma, _, buffers, _ = self.disjoint_steps(
            self.sigma,
            self.psi,
            self.buffers,
            [],
            self.server_data.images,
            self.server_data.labels,
            labeled,
            labeled[:0],
            steps,
            round_idx,
            seeding.generator(self.seed, "fedmatch-server", round_idx),
            self.device,
            "the server",
            slot="server",
        )
        self.sigma = {n: t.cpu() for n, t in sigma.items()}
        self.buffers = {k: t.cpu() for k, t in buffers.items()}
        self._refresh_global()

    def _start_round(self, round_idx: int) -> None:
        """Per-round bookkeeping before the first message: byte counter and the helper plan."""
        self._round = round_idx
        self._sent = {}
        H = self.config.num_helpers
        if H > 0 and round_idx % self.config.helper_interval == 0:
            self._helper_plan = nearest_helpers(self.embeddings, H)
        else:
            self._helper_plan = {}

    def message_for(self, client_id: int, round_idx: int) -> Message:
        if self._round != round_idx:
            self._start_round(round_idx)
        lay = self.layout()
        thr = self.setting("s2c_threshold") if self.config.s2c_deltas else 0.0
        fallback = self.config.dense_fallback
        held = self.views.get(client_id) if self.config.s2c_deltas else None
        weights: dict[str, torch.Tensor] = {}
        record: dict[str, torch.Tensor] = {}
        for prefix, source in ((SIGMA, self.sigma), (PSI, self.psi)):
            for n in lay.params:
                key = prefix + n
                old = held[key] if held is not None else torch.zeros_like(source[n])
                enc = sparsify(source[n] - old, thr, fallback, owned=True)
                weights[key] = enc
                record[key] = old + densify(enc, lay.shapes[n])
        if self.config.s2c_deltas:
            self.views[client_id] = record
        for k in lay.buffers:
            weights[k] = self.buffers[k].clone()
        helpers = self._helper_plan.get(client_id, [])
        for j, h in enumerate(helpers):
            psi_h = self.client_psi[h]
            for n in lay.params:
                delta = densify(psi_h[n], lay.shapes[n]) - record[PSI + n]
                weights[HELPER.format(j) + n] = sparsify(delta, thr, fallback, owned=True)
        msg = Message(weights=weights, extras={"round": round_idx, "num_helpers": len(helpers)})
        values = sum(num_values(t) for key, t in weights.items() if key not in lay.buffers)
        self._sent[client_id] = (message_nbytes(msg), values, len(helpers))
        return msg

    def _reconstruct(self, base: dict[str, torch.Tensor], msg: Message | None, prefix: str) -> dict[str, torch.Tensor]:
        """A client's ``sigma`` or ``psi``: what it held plus its delta (none: what it held)."""
        lay = self.layout()
        out = {}
        for n in lay.params:
            t = base[prefix + n]
            enc = msg.weights.get(prefix + n) if msg is not None else None
            out[n] = t + densify(enc, lay.shapes[n]) if enc is not None else t
        return out

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        lay = self.layout()
        sigmas, psis, buffer_sets = [], [], []
        current = {**{SIGMA + n: t for n, t in self.sigma.items()}, **{PSI + n: t for n, t in self.psi.items()}}
        updated: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        for k in sorted(replies):
            msg = replies[k]
            if msg.is_empty:
                continue
            # what client k held: the S2C record (deltas), or the full tensors sent this round
            base = self.views[k] if self.config.s2c_deltas else current
            has_sigma = self.scenario == "client" and any(key.startswith(SIGMA) for key in msg.weights)
            has_psi = any(key.startswith(PSI) for key in msg.weights)
            sigma_k = self._reconstruct(base, msg if has_sigma else None, SIGMA)
            psi_k = self._reconstruct(base, msg if has_psi else None, PSI)
            bufs = {b: msg.weights[b] for b in lay.buffers if b in msg.weights}
            if has_sigma:
                sigmas.append(sigma_k)
            if has_psi:
                psis.append(psi_k)
            if bufs and len(bufs) == len(lay.buffers):
                buffer_sets.append(bufs)
            updated[k] = (sigma_k, psi_k, bufs or self.buffers)
        # Algorithm 1 lines 10-11 / Algorithm 2 line 15: uniform averages
        if sigmas:
            self.sigma = weighted_average(sigmas)
        if psis:
            self.psi = {n: hard_threshold(t, self.setting("psi_threshold")) for n, t in weighted_average(psis).items()}
        if buffer_sets:
            self.buffers = weighted_average(buffer_sets)
        self._refresh_global()
        for k, (sigma_k, psi_k, bufs) in updated.items():  # EmbedLocalModel (Algorithm 1 line 8)
            self.client_psi[k] = {n: sparsify(psi_k[n], 0.0) for n in lay.params}
            if self.config.evaluate == "local_mean":  # Table 2: the client's own model as it sent it
                self.local_models[k] = self.eval_state(sigma_k, psi_k, bufs)
            self.embeddings[k] = self.embed({n: sigma_k[n] + psi_k[n] for n in lay.params}, bufs)
        n_params = sum(t.numel() for t in self.sigma.values())
        up = [message_nbytes(m) for m in replies.values()]
        up_values = [
            sum(num_values(t) for key, t in m.weights.items() if key not in lay.buffers) for m in replies.values()
        ]
        sent = list(self._sent.values())
        psi_all = torch.cat([t.reshape(-1) for t in self.psi.values()])
        return {
            "clients_sent": float(len(updated)),
            # Table 1: mean bytes per client message / bytes of one dense model (FedAvg = 1)
            "s2c_cost": _mean([b for b, _, _ in sent]) / self.dense_bytes,
            "c2s_cost": _mean(up) / self.dense_bytes,
            # the authors' measure: values sent (no index bytes) / trainable parameters
            "s2c_ratio": _mean([v for _, v, _ in sent]) / n_params,
            "c2s_ratio": _mean(up_values) / n_params,
            "psi_density": density(psi_all),
            "helpers_sent": float(sum(1 for _, _, h in sent if h)),
            "seen_clients": float(len(self.embeddings)),
        }

    def embed(self, theta: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The helper embedding of the model ``theta``: softmax on the fixed noise probe (eval mode)."""
        model = self.module("embed", self.device, buffers)
        model.eval()
        weights = {n: t.to(self.device) for n, t in theta.items()}
        return model_embedding(lambda x: functional_call(model, weights, (x,)), self.probe.to(self.device))

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_state": dict(self.global_state),
            "sigma": dict(self.sigma),
            "psi": dict(self.psi),
            "buffers": dict(self.buffers),
            "views": client_records_state(self.views),
            "client_psi": client_records_state(self.client_psi),
            "embeddings": dict(self.embeddings),
            "local_models": {k: dict(v) for k, v in self.local_models.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sigma = dict(state["sigma"])
        self.psi = dict(state["psi"])
        self.buffers = dict(state["buffers"])
        self.views = {int(k): dict(v) for k, v in state["views"].items()}
        self.client_psi = {int(k): dict(v) for k, v in state["client_psi"].items()}
        self.embeddings = {int(k): v for k, v in state["embeddings"].items()}
        self.local_models = {int(k): dict(v) for k, v in state.get("local_models", {}).items()}
        self._round = None
        self._refresh_global()

    # ---- training (both sides) -----------------------------------------------------------------
    def step_loss(self) -> FedMatchLoss:
        """Eq. 4 and Eq. 5 with this run's weights."""
        cfg = self.config
        return FedMatchLoss(
            cfg.lambda_s, cfg.lambda_a, cfg.lambda_i, cfg.lambda_l2, self.setting("lambda_l1"), cfg.tau, cfg.phi_average
        )

    def disjoint_batches(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        labeled_idx: torch.Tensor,
        unlabeled_idx: torch.Tensor,
        gen: torch.Generator,
        device: torch.device,
    ) -> Any:
        """``draw(s)``: step ``s``'s batches from ``gen``: a labeled batch alpha(x) with its labels
        (``x_lab``, ``y_lab``) and an unlabeled batch, unaugmented and RandAugment-ed (``x_plain``,
        ``x_strong``; its labels under ``TRUTH``, diagnostics only), each where there is data."""
        cfg, train = self.config, self.train
        pipeline = InputPipeline(self.data_info, device)
        b_s, b_u = cfg.labeled_batch_size or train.batch_size, cfg.unlabeled_batch_size or train.batch_size
        stream_s = BatchStream(labeled_idx, b_s, gen) if labeled_idx.numel() else None
        stream_u = BatchStream(unlabeled_idx, b_u, gen) if unlabeled_idx.numel() else None

        def draw(s: int) -> dict[str, torch.Tensor]:
            batch: dict[str, torch.Tensor] = {}
            if stream_s is not None:
                b = next(stream_s)
                batch["x_lab"], batch["y_lab"] = pipeline.weak(images[b], gen), labels[b].to(device)
            if stream_u is not None:
                b = next(stream_u)
                raw = images[b]
                batch["x_plain"], batch["x_strong"] = pipeline.plain(raw), pipeline.strong(raw, gen)
                batch[TRUTH] = labels[b]
            return batch

        return draw

    def disjoint_steps(
        self,
        sigma: dict[str, torch.Tensor],
        psi: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        helpers: list[dict[str, torch.Tensor]],
        images: torch.Tensor,
        labels: torch.Tensor,
        labeled_idx: torch.Tensor,
        unlabeled_idx: torch.Tensor,
        steps: int,
        round_idx: int,
        gen: torch.Generator,
        device: torch.device,
        party: str,
        slot: str = "client",
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
        """``steps`` rounds of disjoint learning: a sigma step on a labeled batch (Eq. 4, psi frozen)
        and a psi step on an unlabeled batch (Eq. 5, sigma frozen), each where there is data.

        ``helpers`` are the helpers' full ``psi`` (their models are ``sigma + psi_h`` with the
        ``sigma`` given here, frozen). Returns the new ``sigma``, ``psi`` (on ``device``, not yet
        thresholded), buffers and step-mean metrics (:func:`~fedml_ssfl.algorithms.disjoint.run_disjoint`).
        """
        draw = self.disjoint_batches(images, labels, labeled_idx, unlabeled_idx, gen, device)
        job = DisjointJob(
            party, sigma, psi, buffers, helpers, draw, steps, bool(labeled_idx.numel()), bool(unlabeled_idx.numel())
        )
        model = self.module(slot, device, buffers)
        res = run_disjoint(job, model, self.step_loss(), self.train, self.config.momentum, round_idx)
        return res.sigma, res.psi, res.buffers, res.metrics

    # ---- client ----------------------------------------------------------------------------
    def receive(self, msg: Message, state: dict) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """Apply a server message to the client's held copy; returns it and the helpers' psi.

        With ``s2c_deltas`` the held copy lives in ``state["view"]`` (CPU tensors, keys
        ``sigma/<p>`` and ``psi/<p>``; zeros before the first message); otherwise it starts from
        zeros every round and nothing is stored.
        """
        lay = self.layout()
        held = state.get("view") if self.config.s2c_deltas else None
        view: dict[str, torch.Tensor] = {}
        for prefix in (SIGMA, PSI):
            for n in lay.params:
                key = prefix + n
                old = held[key] if held is not None else torch.zeros(lay.shapes[n])
                enc = msg.weights.get(key)
                view[key] = old + densify(enc, lay.shapes[n]) if enc is not None else old
        if self.config.s2c_deltas:
            state["view"] = view
        helpers = []
        for j in range(int(msg.extras.get("num_helpers", 0))):
            prefix = HELPER.format(j)
            helpers.append({n: view[PSI + n] + densify(msg.weights[prefix + n], lay.shapes[n]) for n in lay.params})
        return view, helpers

    def client_job(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> DisjointJob | Message:
        """The client's disjoint learning this round as a job, or the reply of a client with nothing to train.

        Applies the message to the client's held copy (:meth:`receive`). Labels-at-client: sigma
        trains on the client's labels; labels-at-server: never (Algorithm 2). psi trains on its
        unlabeled data.
        """
        lay = self.layout()
        view, helpers = self.receive(msg, state)
        train_sigma = self.scenario == "client" and data.num_labeled > 0
        train_psi = data.num_unlabeled > 0
        if not (train_sigma or train_psi):
            return Message(extras={"metrics": {"helpers": float(len(helpers))}})
        labeled = data.labeled_idx if train_sigma else data.labeled_idx[:0]
        gen = ctx.generator(data.client_id)
        return DisjointJob(
            party=client_party(data.client_id),
            sigma={n: view[SIGMA + n] for n in lay.params},
            psi={n: view[PSI + n] for n in lay.params},
            buffers={k: msg.weights[k] for k in lay.buffers if k in msg.weights},
            helpers=helpers,
            draw=self.disjoint_batches(data.images, data.labels, labeled, data.unlabeled_idx, gen, ctx.device),
            steps=self.train.local_steps,
            sigma_steps=train_sigma,
            psi_steps=train_psi,
        )

    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One local epoch (``train_args.epochs``): the unlabeled set at B^U, the batch each step draws
        (the authors' code counts a client epoch in unlabeled batches); without unlabeled data, the
        labeled set at B^S."""
        cfg, b = self.config, self.train.batch_size
        if data.num_unlabeled:
            return data.num_unlabeled, cfg.unlabeled_batch_size or b
        return data.num_labeled, cfg.labeled_batch_size or b

    def client_update(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        job = self.client_job(msg, data, state, ctx)
        if isinstance(job, Message):
            return job
        model = self.module("client", ctx.device, job.buffers)
        res = run_disjoint(job, model, self.step_loss(), self.train, self.config.momentum, ctx.round_idx)
        return self.client_reply(job, res, data)

    def client_updates_stacked(
        self, work: dict[int, tuple[Message, ClientData, dict]], ctx: ClientContext, max_stack: int = 0
    ) -> dict[int, Message]:
        """The round's clients' :meth:`client_update`, their disjoint learning trained together
        (:func:`~fedml_ssfl.algorithms.disjoint.run_disjoint_stacked`)."""
        replies: dict[int, Message] = {}
        jobs: dict[int, DisjointJob] = {}
        for k, (msg, data, state) in work.items():
            job = self.client_job(msg, data, state, ctx)
            if isinstance(job, Message):
                replies[k] = job
            else:
                jobs[k] = job
        if jobs:
            model = self.module("client", ctx.device, {})  # the architecture; every tensor is swapped in
            results = run_disjoint_stacked(
                list(jobs.values()), model, self.step_loss(), self.train, self.config.momentum, ctx.round_idx, max_stack
            )
            for (k, job), res in zip(jobs.items(), results):
                replies[k] = self.client_reply(job, res, work[k][1])
        return {k: replies[k] for k in work}

    def idle_reply(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        """The idle-client control: the client applies the message to its held copy (:meth:`receive`,
        so the S2C records of server and client stay equal) and sends back the ``sigma`` / ``psi`` it
        received: a zero delta (an empty sparse tensor) for each part it would have trained, its
        received buffers, and the trained reply's sample count. No training, no thresholding."""
        lay = self.layout()
        self.receive(msg, state)
        train_sigma = self.scenario == "client" and data.num_labeled > 0
        train_psi = data.num_unlabeled > 0
        if not (train_sigma or train_psi):
            return Message()
        c2s, fallback = self.setting("c2s_threshold"), self.config.dense_fallback
        weights: dict[str, torch.Tensor] = {}
        for prefix, trained in ((SIGMA, train_sigma), (PSI, train_psi)):
            if trained:
                for n in lay.params:
                    weights[prefix + n] = sparsify(torch.zeros(lay.shapes[n]), c2s, fallback, owned=True)
        weights.update({k: msg.weights[k] for k in lay.buffers if k in msg.weights})
        num = (data.num_labeled if train_sigma else 0) + (data.num_unlabeled if train_psi else 0)
        return Message(weights=weights, num_samples=num)

    def client_reply(self, job: DisjointJob, res: DisjointResult, data: ClientData) -> Message:
        """The sparse deltas of what the client trained (sigma, the hard-thresholded psi) and its buffers."""
        lay = self.layout()
        c2s = self.setting("c2s_threshold")
        fallback = self.config.dense_fallback
        metrics = dict(res.metrics)
        weights: dict[str, torch.Tensor] = {}
        if job.sigma_steps:
            for n in lay.params:
                weights[SIGMA + n] = sparsify(res.sigma[n].cpu() - job.sigma[n], c2s, fallback, owned=True)
        if job.psi_steps:
            psi_thr = self.setting("psi_threshold")
            kept = total = 0
            for n in lay.params:
                p = hard_threshold(res.psi[n].cpu(), psi_thr)
                kept += int((p != 0).sum())
                total += p.numel()
                weights[PSI + n] = sparsify(p - job.psi[n], c2s, fallback, owned=True)
            metrics["psi_density"] = kept / max(total, 1)
        for k, v in res.buffers.items():
            weights[k] = v.cpu()
        metrics["helpers"] = float(len(job.helpers))
        num = (data.num_labeled if job.sigma_steps else 0) + (data.num_unlabeled if job.psi_steps else 0)
        return Message(weights=weights, num_samples=num, extras={"metrics": metrics})
