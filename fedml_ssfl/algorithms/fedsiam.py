"""FedSiam: a siamese online/target net per client with adaptive layer upload (Long et al. 2021).

Long et al., *FedSiam: Towards Adaptive Federated Semi-Supervised Learning*, 2021.
Both label scenarios; variants ``pi`` / ``mt`` / ``d`` (``d`` labels-at-client only, Sec. 4.3).

Equations (plain text; s = online net, t = target net, k = client, j = layer)::

    (4)  J = 1/(n'+m') sum_i || f(x_i + eta; theta_s) - f(x_i + eta'; theta_t) ||^2  (consistency: mse)
    (5)  J = 1/(n'+m') sum_i KL( f(x_i + eta'; theta_t) || f(x_i + eta; theta_s) )  (consistency: kl)
    (6)  L = cross-entropy of f(x; theta_s) on the client's labeled batch
    (7)  client loss, labels-at-client:  L + beta^k J
    (8)  labels-at-server: the server minimises L on its labels, a client beta^k J
    (9)  theta_t <- alpha theta_t + (1 - alpha) theta_s       after every SGD step
         alpha = min(1 - 1/(c + 1), alpha_max),  beta^k = beta_max * sigmoid_rampup(c, phi_l)
    (10) FSM[j] = || theta_t[j] - theta_s[j] || / || theta_s[j] ||
         boundary b = Quantile(Lambda, 1 - tau) over the window Lambda of recent FSM values;
         online layer j is uploaded iff tau > 0 and FSM[j] >= b (the target always is)
    (11) linear:    tau = 0 for R_g <= phi_g, else -2 (1 - mu) R_G / (R_G - phi_g)^2 (R_g - R_G)
    (12) rectangle: tau = (1 - mu) R_G / (varphi_g - phi_g) for phi_g < R_g < varphi_g, else 0
    (2)  server: FedAvg (sample-weighted) of the targets, and of the online nets with each
         missing layer borrowed from that client's target

    variant  tau              alpha
    pi       0                0 (target = online)
    mt       1                the ramp above
    d        Eq. 11 / 12      0 while R_g <= phi_g, then the ramp

Deviations:

* c counts local epochs as the authors' code does (``c = p E + e + 1``; a round's T steps are one
  epoch when ``local_epochs`` is null): the paper does not say what the ramp counts.
* tau is the fraction of online layers sent (boundary = the (1 - tau)-quantile, not the tau-quantile
  of Sec. 3.3.2): the only reading where Pi sends one model and MT two, as Table 4 says.
* Eq. 11's values above 1 are clipped to 1.
* beta_max (not in the paper) defaults to 1/C for mse, 1 for kl: the authors' effective weight.
* The labels-at-server server minimises L only; the authors' server adds a consistency term.
* Targets are synchronised from the global target each round (``target_sync: false`` keeps them).
* eta, eta' are two draws of the weak augmentation (Eq. 4 leaves the perturbation open).

Provenance and details: docs/algorithms.md#fedsiam-long-et-al-2021
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import seeding
from ..aggregation import Scratch, dense_layout, weighted_average
from ..errors import ConfigError
from ..ssl.consistency import kl_consistency, sigmoid_rampup, softmax_mse
from ..ssl.ema import ema_pairs, ema_update
from ..stacked import Follower, JobResult, LocalJob
from ..training import BatchStream, InputPipeline, cosine_lr, cpu_state
from .base import AlgorithmConfig, ClientContext, ClientData, Message
from .global_model import client_party
from .jobs import JobAlgorithm
from .registry import register_algorithm

VARIANTS = ("pi", "mt", "d")
DEFAULT_VARIANT = {"client": "d", "server": "mt"}
"""``variant: null``: FedSiam-D where the paper runs it, MT at the server (Sec. 4.3, Table 6)."""
RAMP_UNITS = ("epoch", "step")
BETA_RAMP_UNITS = ("epoch", "round")
CONSISTENCY_LOSSES = ("mse", "kl")
TAU_SCHEDULES = ("linear", "rectangle")
EVAL_NETS = ("online", "target")
DEFAULT_PHI_G = {"linear": 3, "rectangle": 10}
"""Table 4: the first tipping point phi_g of each quantile curve."""

ONLINE_PREFIX = "online/"
"""Message keys of online-net tensors; the model's own keys carry the target net."""

FSM_EPS = 1e-12
"""Floor of the FSM denominator (a layer whose online weights are all zero)."""


# ---- Eq. 9: the EMA target ------------------------------------------------------------------------
def ema_alpha(t: int, alpha_max: float) -> float:
    """The Mean-Teacher ramp of Eq. 9's alpha: ``min(1 - 1/(t + 1), alpha_max)``.

    ``t`` is the ramp counter: the client's local-epoch counter ``p E + e + 1``
    (:func:`epoch_counter`, ``ramp_unit: epoch``), its step just taken (``ramp_unit: step``,
    1 for the first: alpha 0.5) or the server's global step ``u T + s`` (0 for the first: 0).
    """
    return min(1.0 - 1.0 / (t + 1), alpha_max)


def epoch_counter(participation: int, epochs: int, epoch: int) -> int:
    """The authors' ramp counter ``user_epoch * local_ep + iter + 1`` (``Update.py``).

    ``participation`` is the client's round count including this one (1 on its first round),
    ``epochs`` its local epochs per round (``E``; 1 when a round is ``train_args.local_steps``
    steps) and ``epoch`` the 0-based local epoch: ``c = p E + e + 1``.
    """
    return participation * epochs + epoch + 1


# ---- Eq. 10: layer-level divergence -----------------------------------------------------------------
def layer_groups(keys: Iterable[str]) -> dict[str, list[str]]:
    """The model's layers: state keys grouped by their module (the key without its last part).

    ``["conv1.weight", "norm1.weight", "norm1.bias", "fc.weight"]`` ->
    ``{"conv1": ["conv1.weight"], "norm1": ["norm1.weight", "norm1.bias"], "fc": ["fc.weight"]}``,
    in the order the layers first appear.
    """
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(k.rsplit(".", 1)[0] if "." in k else k, []).append(k)
    return groups


@torch.no_grad()
def fsm(
    target: Mapping[str, torch.Tensor], online: Mapping[str, torch.Tensor], groups: Mapping[str, list[str]]
) -> torch.Tensor:
    """Eq. 10 per layer: ``||theta_t[j] - theta_s[j]|| / ||theta_s[j]||`` (float64, CPU, shape (V,)).

    The norms run over all floating tensors of the layer together; integer buffers are left
    out. A layer with no floating tensor scores 0; a zero online layer divides by ``1e-12``.
    """
    out = torch.zeros(len(groups), dtype=torch.float64)
    floats = [online[k] for keys in groups.values() for k in keys if online[k].is_floating_point()]
    scratch = Scratch.for_tensors(floats, 3)  # reused float64 buffers, not fresh ones per tensor (issue 15)
    for j, keys in enumerate(groups.values()):
        num = den = 0.0
        for k in keys:
            s, t = online[k].detach(), target[k].detach()
            if not s.is_floating_point():
                continue
            if dense_layout([s, t]):
                s64, d, sq = scratch.like(0, s).copy_(s), scratch.like(1, s), scratch.like(2, s)
                d.copy_(t).sub_(s64)
                num += float(torch.mul(d, d, out=sq).sum())
                den += float(torch.mul(s64, s64, out=sq).sum())
            else:  # mixed layouts: fresh tensors, as the formula reads
                s64 = s.to(torch.float64)
                d = t.to(torch.float64) - s64
                num += float((d * d).sum())
                den += float((s64 * s64).sum())
        out[j] = math.sqrt(num) / max(math.sqrt(den), FSM_EPS) if num > 0 else 0.0
    return out


# ---- Eq. 11 / 12 and Sec. 3.3.2: tau and the boundary ---------------------------------------------
def linear_tau(r_g: int, r_total: int, phi_g: int, mu: float) -> float:
    """Eq. 11 (unclipped): 0 for ``R_g <= phi_g``, else ``-2 (1 - mu) R_G / (R_G - phi_g)^2 (R_g - R_G)``."""
    if r_g <= phi_g:
        return 0.0
    return -2.0 * (1.0 - mu) * r_total / (r_total - phi_g) ** 2 * (r_g - r_total)


def rectangle_tau(r_g: int, r_total: int, phi_g: int, varphi_g: int, mu: float) -> float:
    """Eq. 12 (unclipped): ``(1 - mu) R_G / (varphi_g - phi_g)`` for ``phi_g < R_g < varphi_g``, else 0."""
    if r_g <= phi_g or r_g >= varphi_g:
        return 0.0
    return (1.0 - mu) * r_total / (varphi_g - phi_g)


def quantile_boundary(values: torch.Tensor, tau: float) -> float:
    """The FSM boundary for an online upload rate ``tau`` (Sec. 3.3.2): ``Quantile(Lambda, 1 - tau)``.

    A client uploads an online layer iff ``tau > 0`` and its FSM is ``>=`` the boundary, so a
    fraction ``tau`` of the window's values lies at or above it. ``tau >= 1`` or an empty window
    give 0 (every FSM passes); ``tau <= 0`` gives ``inf`` (none does).
    """
    if tau <= 0:
        return math.inf
    if tau >= 1 or values.numel() == 0:
        return 0.0
    return float(torch.quantile(values.to(torch.float64), 1.0 - tau))


class FSMWindow:
    """The server's window ``Lambda`` of the FSM values of the last ``rounds`` rounds (Sec. 3.3.2)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = max(1, int(rounds))
        self.per_round: list[torch.Tensor] = []

    def push(self, values: torch.Tensor) -> None:
        """Add one round's values (all clients' FSM vectors, any shape); drop the oldest round."""
        self.per_round.append(values.detach().reshape(-1).to("cpu", torch.float64))
        del self.per_round[: -self.rounds]

    def values(self) -> torch.Tensor:
        if not self.per_round:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(self.per_round)

    def boundary(self, tau: float) -> float:
        return quantile_boundary(self.values(), tau)

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "per_round": [v.clone() for v in self.per_round]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = state["rounds"]
        self.per_round = [v.clone() for v in state["per_round"]]


# ---- config ----------------------------------------------------------------------------------------
@dataclass
class FedSiamConfig(AlgorithmConfig):
    """Hyper-parameters of FedSiam (Long et al. Sec. 3, Tables 2 and 4).

    The paper's shared settings go in ``train_args``: K = 100 clients, B = 10 per round,
    ``learning_rate: 0.01``, ``momentum: 0.9``, ``weight_decay: 1e-4``, batch 10,
    ``lr_schedule: constant``; R_L = 5 local epochs is ``local_epochs: 5`` here; its labeled
    fraction gamma = 0.1 is ``data_args.client_label_ratio: 0.1`` (labels-at-client) and
    R_G = 50 rounds ``train_args.comm_round: 50``.

    Attributes
    ----------
    variant : str or None
        ``d`` (FedSiam-D: tau by the schedule, alpha 0 until ``phi_g``), ``mt`` (tau = 1, alpha
        ramped) or ``pi`` (tau = 0, alpha = 0); None: ``d`` in labels-at-client, ``mt`` in
        labels-at-server. ``d`` is refused in labels-at-server (Sec. 4.3).
    consistency : str
        ``mse`` (Eq. 4, default; the paper's choice for MNIST/SVHN) or ``kl`` (Eq. 5).
    tau_schedule : str
        FedSiam-D's quantile curve: ``linear`` (Eq. 11, default; MNIST/SVHN) or ``rectangle``
        (Eq. 12; CIFAR-10).
    phi_g : int or None
        First tipping point in rounds; None: 3 for linear, 10 for rectangle (Table 4).
    varphi_g : int
        Second tipping point of the rectangle curve (Table 4: 40).
    mu : float
        Target reduction of the online net's communication (Table 4: 0.5); tau averages 1 - mu.
    window_rounds : int or None
        Rounds of FSM values the server keeps (Sec. 3.3.2); None: ``phi_g`` (at least 1).
    alpha_max : float
        Cap of the EMA decay ramp (Table 4: 0.999).
    ramp_unit : str
        What the alpha ramp of Eq. 9 counts on a client: ``epoch`` (default, the authors' local
        epoch counter :func:`epoch_counter`) or ``step`` (the client's SGD steps).
    beta_max : float or None
        Consistency weight after the ramp-up (not given in the paper); None: the authors'
        effective weight, ``1 / C`` for ``mse`` (their MSE divides Eq. 4's class sum by the C
        classes) and 1 for ``kl`` (:meth:`beta_weight`).
    beta_rampup : int
        Length phi_l of the sigmoid ramp-up of beta^k (Table 4: 10), in ``beta_ramp_unit``;
        0: no ramp.
    beta_ramp_unit : str
        What the beta ramp counts: ``epoch`` (default, the authors' local epoch counter, as the
        alpha ramp) or ``round`` (the global round index).
    consistency_on_labeled : bool
        Apply J to the labeled batch as well (Eq. 4/5 sum over n' + m'; default true).
    target_sync : bool
        Clients start from the global target each round (default); false keeps each client's
        own target net in its state.
    local_epochs : int or None
        Passes over the client's unlabeled data per round; None: ``train_args.local_steps``
        steps, counted as one local epoch by the ramps.
    eval_net : str
        Which global net is evaluated and exported: ``online`` (the paper's G) or ``target``.
    """

    variant: str | None = None
    consistency: str = "mse"
    tau_schedule: str = "linear"
    phi_g: int | None = None
    varphi_g: int = 40
    mu: float = 0.5
    window_rounds: int | None = None
    alpha_max: float = 0.999
    ramp_unit: str = "epoch"
    beta_max: float | None = None
    beta_rampup: int = 10
    beta_ramp_unit: str = "epoch"
    consistency_on_labeled: bool = True
    target_sync: bool = True
    local_epochs: int | None = None
    eval_net: str = "online"

    def resolve_variant(self, label_scenario: str) -> str:
        """Fill ``variant: null`` for ``label_scenario``; refuse FedSiam-D at the server (Sec. 4.3)."""
        if self.variant is None:
            self.variant = DEFAULT_VARIANT.get(label_scenario, "d")
        if self.variant == "d" and label_scenario == "server":
            raise ConfigError(
                "ssfl_args.variant: d (FedSiam-D) does not fit labels-at-server (Long et al. Sec. 4.3 "
                "evaluates only Pi and MT there); set ssfl_args.variant to pi or mt"
            )
        return self.variant

    def check(self, cfg) -> None:
        """Cross-checks against the experiment config (raises :class:`ConfigError`)."""
        for key, allowed in (
            ("variant", (*VARIANTS, None)),
            ("consistency", CONSISTENCY_LOSSES),
            ("tau_schedule", TAU_SCHEDULES),
            ("eval_net", EVAL_NETS),
            ("ramp_unit", RAMP_UNITS),
            ("beta_ramp_unit", BETA_RAMP_UNITS),
        ):
            value = getattr(self, key)
            if value not in allowed:
                names = ", ".join(a for a in allowed if a is not None)
                raise ConfigError(f"ssfl_args.{key}: {value!r} is not allowed; choose one of {names}")
        for key in ("mu", "alpha_max"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"ssfl_args.{key}: {value} must lie in [0, 1]")
        if self.beta_max is not None and self.beta_max < 0:
            raise ConfigError(f"ssfl_args.beta_max: {self.beta_max} must be >= 0 (or null for the authors' weight)")
        for key in ("beta_rampup", "varphi_g"):
            if getattr(self, key) < 0:
                raise ConfigError(f"ssfl_args.{key}: {getattr(self, key)} must be >= 0")
        if self.phi_g is not None and self.phi_g < 0:
            raise ConfigError(f"ssfl_args.phi_g: {self.phi_g} must be >= 0 (or null for the default)")
        for key in ("window_rounds", "local_epochs"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"ssfl_args.{key}: {value} must be >= 1 (or null for the default)")
        if self.tau_schedule == "rectangle" and self.varphi_g <= self.first_tipping_point:
            raise ConfigError(
                f"ssfl_args.varphi_g: {self.varphi_g} must be larger than ssfl_args.phi_g "
                f"({self.first_tipping_point}) for the rectangle curve (Eq. 12)"
            )
        d = cfg.data_args
        self.resolve_variant(d.label_scenario)
        if d.label_scenario == "server" and d.num_server_labels <= 0:
            raise ConfigError(
                "data_args.num_server_labels: fedsiam in labels-at-server trains the global model on the "
                "server's labels (Eq. 8); set it > 0"
            )
        if d.label_scenario == "client":
            client_labels = (
                d.labels_per_class_client > 0 or d.client_label_ratio > 0 or d.partition_method == "noniid_3"
            )
            if not client_labels:
                raise ConfigError(
                    "data_args.labels_per_class_client: fedsiam in labels-at-client needs labeled client "
                    "data for L (Eq. 7); set it > 0, or data_args.client_label_ratio > 0 (the paper's gamma)"
                )

    # ---- schedules -------------------------------------------------------------------------------
    @property
    def first_tipping_point(self) -> int:
        """phi_g, resolved (Table 4: 3 for the linear curve, 10 for the rectangle)."""
        return DEFAULT_PHI_G[self.tau_schedule] if self.phi_g is None else self.phi_g

    @property
    def window_length(self) -> int:
        """Rounds in the server's FSM window (Sec. 3.3.2: phi_g)."""
        return self.window_rounds if self.window_rounds is not None else max(1, self.first_tipping_point)

    def tau(self, round_idx: int, total_rounds: int) -> float:
        """The online upload rate of round ``round_idx`` (0-based; ``R_g = round_idx + 1``), in [0, 1]."""
        if self.variant == "pi":
            return 0.0
        if self.variant == "mt":
            return 1.0
        r_g, phi = round_idx + 1, self.first_tipping_point
        if self.tau_schedule == "linear":
            value = linear_tau(r_g, total_rounds, phi, self.mu)
        else:
            value = rectangle_tau(r_g, total_rounds, phi, self.varphi_g, self.mu)
        return min(1.0, max(0.0, value))

    def ema_active(self, round_idx: int) -> bool:
        """Whether alpha > 0 in round ``round_idx``: never for Pi, always for MT, after phi_g for D."""
        if self.variant == "pi":
            return False
        if self.variant == "mt":
            return True
        return round_idx + 1 > self.first_tipping_point

    def alpha(self, round_idx: int, t: int) -> float:
        """Eq. 9's alpha in round ``round_idx`` at ramp counter ``t`` (:func:`ema_alpha`)."""
        return ema_alpha(t, self.alpha_max) if self.ema_active(round_idx) else 0.0

    def beta_weight(self, num_classes: int) -> float:
        """``beta_max`` resolved: the authors' ``1 / C`` for ``mse``, 1 for ``kl`` when null."""
        if self.beta_max is not None:
            return self.beta_max
        return 1.0 / num_classes if self.consistency == "mse" else 1.0

    def beta(self, counter: int, num_classes: int) -> float:
        """beta^k of Eq. 7/8 at ramp counter ``counter`` (epoch counter or round index)."""
        return self.beta_weight(num_classes) * sigmoid_rampup(counter, self.beta_rampup)


# ---- the algorithm -----------------------------------------------------------------------------------
@register_algorithm
class FedSiam(JobAlgorithm):
    """FedSiam: siamese clients, FSM layer selection, FedAvg of targets and (partly borrowed) online nets.

    Server state: ``global_state`` (the global online net G, broadcast and evaluated),
    ``global_target``, their aggregates before the server's supervised step, and the FSM window.
    """

    name = "fedsiam"
    config_class = FedSiamConfig
    label_scenarios = ("server", "client")

    # ---- server ----------------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.config.resolve_variant(self.server_data.label_scenario)
        self.global_target: dict[str, torch.Tensor] = dict(self.global_state)
        self.agg_online: dict[str, torch.Tensor] = dict(self.global_state)
        self.agg_target: dict[str, torch.Tensor] = dict(self.global_state)
        self.layers = layer_groups(self.global_state.keys())
        self.window = FSMWindow(self.config.window_length)
        self.server_trains = self.server_data.label_scenario == "server" and self.server_data.labeled_idx.numel() > 0
        self.tau_now, self.boundary_now = 0.0, math.inf
        self.server_alpha = 0.0

    @property
    def sends_online(self) -> bool:
        """Whether messages carry the online net (not for Pi, whose online net is its target)."""
        return self.config.variant != "pi"

    def _ensure_scratch(self, *slots: str) -> None:
        """Build missing scratch models before the seeded block (initialisation draws from the global RNG)."""
        for slot in slots:
            if slot not in self._scratch:
                self._scratch[slot] = self.model_fn()

    def _server_update(self, round_idx: int, update_idx: int) -> None:
        """Eq. 8, first line, on the aggregated online net; Eq. 9 on the global target after each step.

        ``train_args.local_steps`` weak-augmentation cross-entropy steps on the server's labels
        (:func:`~fedml_ssfl.training.supervised_steps`). After step ``s`` the global target takes
        ``alpha = min(1 - 1/(q + 1), alpha_max)`` with ``q = update_idx * T + s`` (the authors'
        server counter, 0 on the first server step); Pi's alpha is 0 (target = online).
        """
        self._ensure_scratch("server", "server_target")
        T = self.train.local_steps
        online = self.scratch_model(self.agg_online, self.device, slot="server")
        target = self.scratch_model(self.agg_target, self.device, slot="server_target")
        gen = seeding.generator(self.seed, "server", round_idx)
        pairs = ema_pairs(target, online)

        def after_step(s: int) -> None:
            self.server_alpha = self.config.alpha(round_idx, update_idx * T + s)
            ema_update(pairs, self.server_alpha)  # Eq. 9 on the global pair

        self.server_supervised_steps(online, self.train, round_idx, gen, after_step=after_step)  # L, Eq. 8
        self.global_state, self.global_target = cpu_state(online), cpu_state(target)

    def server_step(self, round_idx: int) -> None:
        self.tau_now = self.config.tau(round_idx, self.train.comm_round)
        self.boundary_now = self.window.boundary(self.tau_now)
        if self.server_trains:
            self._server_update(round_idx, round_idx)

    def message_for(self, client_id: int, round_idx: int) -> Message:
        weights = dict(self.global_target)
        if self.sends_online:
            weights.update({ONLINE_PREFIX + k: v for k, v in self.global_state.items()})
        boundary = self.boundary_now if math.isfinite(self.boundary_now) else 0.0
        return Message(weights=weights, extras={"round": round_idx, "tau": self.tau_now, "boundary": boundary})

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        live = [m for m in replies.values() if not m.is_empty]
        metrics: dict[str, float] = {"clients_sent": float(len(live)), "tau": self.tau_now}
        if self.server_trains:
            metrics["server_alpha"] = self.server_alpha
        if self.config.variant == "d" and 0.0 < self.tau_now:
            metrics["boundary"] = self.boundary_now
        if self.config.variant == "d":
            vectors = [m.extras["fsm"] for m in live if "fsm" in m.extras]
            self.window.push(torch.cat(vectors) if vectors else torch.zeros(0))
            metrics["window_values"] = float(self.window.values().numel())
        if not live:
            return metrics
        keys = list(self.global_state)
        counts = [m.num_samples for m in live]
        targets = [{k: m.weights[k] for k in keys} for m in live]
        # Sec. 3.3: a layer a client did not upload from its online net is borrowed from its target
        onlines = [{k: m.weights.get(ONLINE_PREFIX + k, m.weights[k]) for k in keys} for m in live]
        self.agg_target = weighted_average(targets, counts)
        self.agg_online = weighted_average(onlines, counts) if self.sends_online else dict(self.agg_target)
        if not self.server_trains:
            self.global_state, self.global_target = dict(self.agg_online), dict(self.agg_target)
        uploaded = sum(sum(1 for ks in self.layers.values() if ONLINE_PREFIX + ks[0] in m.weights) for m in live)
        metrics["online_frac"] = uploaded / (len(live) * len(self.layers))
        fsm_means = [m.extras["metrics"]["fsm_mean"] for m in live if "fsm_mean" in m.extras.get("metrics", {})]
        if fsm_means:
            metrics["fsm_mean"] = sum(fsm_means) / len(fsm_means)
        return metrics

    def finalize(self) -> None:
        """Labels-at-server: one more server update on the last round's aggregate (the final G)."""
        if self.server_trains:
            self._server_update(self.train.comm_round - 1, self.train.comm_round)

    def global_model(self) -> nn.Module:
        if self._eval_model is None:
            self._eval_model = self.model_fn()
        weights = self.global_target if self.config.eval_net == "target" else self.global_state
        self._eval_model.load_state_dict(weights)
        return self._eval_model

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "global_target": dict(self.global_target),
            "agg_online": dict(self.agg_online),
            "agg_target": dict(self.agg_target),
            "window": self.window.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_target = state["global_target"]
        self.agg_online = state["agg_online"]
        self.agg_target = state["agg_target"]
        self.window.load_state_dict(state["window"])

    # ---- client ----------------------------------------------------------------------------------
    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One ``train_args.epochs`` epoch, as ``local_epochs`` counts one: the unlabeled set (the
        labeled one when it has none) at ``train_args.batch_size``."""
        return data.num_unlabeled or data.num_labeled, self.train.batch_size

    def local_epochs(self, data: ClientData) -> tuple[int, int]:
        """(E, steps per local epoch) this round.

        ``local_epochs`` passes over the client's unlabeled data (labeled when it has none), or,
        with ``local_epochs: null``, one epoch of ``train_args.local_steps`` steps (with
        ``train_args.epochs`` E: E epochs of the client's own ceil(n / B) steps, :meth:`epoch_data`).
        """
        if self.config.local_epochs is None:
            if self.train.epochs > 0:  # the client's settings (client_train): local_steps = E x per epoch
                return self.train.epochs, self.train.local_steps // self.train.epochs
            return 1, self.train.local_steps
        n = data.num_unlabeled or data.num_labeled
        return self.config.local_epochs, math.ceil(n / min(self.train.batch_size, n))

    def local_steps(self, data: ClientData) -> int:
        """Steps this round: ``train_args.local_steps``, or ``local_epochs`` passes over the main data."""
        epochs, per_epoch = self.local_epochs(data)
        return epochs * per_epoch

    def local_job(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> LocalJob | None:
        """The client's local training (Eq. 7 / 8 with Eq. 9 after every step) as a job.

        The online net starts from the received online net (the target for Pi, which sends
        none), its :class:`~fedml_ssfl.stacked.Follower` is the target (the received one, or the
        client's own with ``target_sync: false``) with each step's alpha; the loss is
        :class:`SiameseLoss` with each step's beta^k in ``consts["beta"]``; the rate follows
        ``train_args.lr_schedule`` across the round's steps.
        """
        if data.num_labeled + data.num_unlabeled == 0:
            return None
        cfg, round_idx = self.config, ctx.round_idx
        target_w = {k: v for k, v in msg.weights.items() if not k.startswith(ONLINE_PREFIX)}
        online_w = {k[len(ONLINE_PREFIX) :]: v for k, v in msg.weights.items() if k.startswith(ONLINE_PREFIX)}
        if not cfg.target_sync and "target" in state:
            target_w = state["target"]
        epochs, per_epoch = self.local_epochs(data)
        steps, T = epochs * per_epoch, self.train.local_steps
        t0 = int(state.get("steps", 0))
        participation = int(state.get("participations", 0)) + 1  # the authors' user_epoch
        # the ramp counter of each step, constant within a local epoch
        counters = [epoch_counter(participation, epochs, s // per_epoch) for s in range(steps)]
        num_classes = self.data_info.num_classes
        betas = [cfg.beta(c if cfg.beta_ramp_unit == "epoch" else round_idx, num_classes) for c in counters]
        alphas = [cfg.alpha(round_idx, c if cfg.ramp_unit == "epoch" else t0 + s + 1) for s, c in enumerate(counters)]
        return LocalJob(
            party=client_party(data.client_id),
            weights=online_w or target_w,
            draw=self._siamese_views(data, ctx),
            loss=SiameseLoss(cfg.consistency, cfg.consistency_on_labeled),
            steps=steps,
            consts={"beta": torch.tensor(betas, dtype=torch.float32)},
            lr=tuple(cosine_lr(self.train, round_idx * T + (s * T) // steps) for s in range(steps)),
            follower=Follower(target_w, torch.tensor(alphas, dtype=torch.float64)),  # Eq. 9 after every step
            notes={"beta": betas[-1], "alpha": alphas[-1], "counter": counters[-1], "steps_total": t0 + steps},
        )

    def _siamese_views(self, data: ClientData, ctx: ClientContext) -> Any:
        """``draw(s)``: a labeled and an unlabeled batch, each with two weak views (x + eta, x + eta').

        ``x_online``: the labeled then the unlabeled views for the online net; ``x_target``: the
        other views (of the labeled batch too with ``consistency_on_labeled``) for the target;
        ``y``: the labeled batch's labels. Drawn from the client's stream in that order.
        """
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen = ctx.generator(data.client_id)
        bs = self.train.batch_size
        lab_stream = BatchStream(data.labeled_idx, bs, gen) if data.num_labeled else None
        unl_stream = BatchStream(data.unlabeled_idx, bs, gen) if data.num_unlabeled else None
        on_labeled = self.config.consistency_on_labeled

        def draw(s: int) -> dict[str, torch.Tensor]:
            batch: dict[str, torch.Tensor] = {}
            x_online, x_target = [], []
            if lab_stream is not None:
                b = next(lab_stream)
                raw = data.images[b]
                x_online.append(pipeline.weak(raw, gen))  # x + eta
                if on_labeled:
                    x_target.append(pipeline.weak(raw, gen))  # x + eta'
                batch["y"] = data.labels[b].to(ctx.device)
            if unl_stream is not None:
                raw = data.images[next(unl_stream)]
                x_online.append(pipeline.weak(raw, gen))
                x_target.append(pipeline.weak(raw, gen))
            batch["x_online"] = torch.cat(x_online)
            if x_target:
                batch["x_target"] = torch.cat(x_target)
            return batch

        return draw

    def idle_reply(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> Message:
        """The idle-client control: the received target net and online net, uploaded by the same rule
        as a trained pair (Sec. 3.3.2: the target, and the online layers whose FSM of the received pair
        reaches the boundary; FedSiam-D's FSM vector too), with the trained reply's sample count. The
        client's counters and own target are left as they were."""
        if data.num_labeled + data.num_unlabeled == 0:
            return Message()
        target = {k: v for k, v in msg.weights.items() if not k.startswith(ONLINE_PREFIX)}
        online = {k[len(ONLINE_PREFIX) :]: v for k, v in msg.weights.items() if k.startswith(ONLINE_PREFIX)}
        weights, divergence, _ = self._upload(msg, target, online or target)
        extras: dict[str, Any] = {"fsm": divergence.float()} if self.config.variant == "d" else {}
        return Message(weights=weights, num_samples=data.num_labeled + data.num_unlabeled, extras=extras)

    def _upload(
        self, msg: Message, target_state: dict[str, torch.Tensor], online_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """What a client uploads (Sec. 3.3.2): its whole target net under the model's keys, and each online
        layer whose FSM (Eq. 10) reaches the round's boundary under ``online/<key>``. Returns the weights,
        the FSM vector and the number of online layers uploaded."""
        groups = layer_groups(target_state.keys())
        divergence = fsm(target_state, online_state, groups)  # Eq. 10
        tau, boundary = float(msg.extras.get("tau", 0.0)), float(msg.extras.get("boundary", 0.0))
        weights = dict(target_state)
        uploaded = 0
        if any(k.startswith(ONLINE_PREFIX) for k in msg.weights) and tau > 0:
            for j, keys in enumerate(groups.values()):
                if tau >= 1 or float(divergence[j]) >= boundary:  # Sec. 3.3.2
                    weights.update({ONLINE_PREFIX + k: online_state[k] for k in keys})
                    uploaded += 1
        return weights, divergence, uploaded

    def client_reply(
        self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict[str, Any]
    ) -> Message:
        """The target net, the online layers with FSM >= boundary (Eq. 10, Sec. 3.3.2), the counters."""
        cfg, notes = self.config, job.notes
        state["steps"] = notes["steps_total"]
        state["participations"] = int(state.get("participations", 0)) + 1
        target_state, online_state = result.follower, result.weights
        if not cfg.target_sync:
            state["target"] = target_state
        groups = layer_groups(target_state.keys())
        weights, divergence, uploaded = self._upload(msg, target_state, online_state)
        metrics = dict(result.metrics)
        metrics.update(
            beta=notes["beta"],
            alpha=notes["alpha"],
            ramp_counter=float(notes["counter"]),
            steps_total=float(notes["steps_total"]),
            fsm_mean=float(divergence.mean()),
            fsm_max=float(divergence.max()),
            online_frac=uploaded / len(groups),
        )
        extras: dict[str, Any] = {"metrics": metrics}
        if cfg.variant == "d":
            extras["fsm"] = divergence.float()
        return Message(weights=weights, num_samples=data.num_labeled + data.num_unlabeled, extras=extras)


@dataclass(frozen=True)
class SiameseLoss:
    """A FedSiam client's step loss, Eq. 7 (labels-at-client) / Eq. 8 (labels-at-server).

    ``L`` (Eq. 6): cross-entropy of the online net's output on the labeled views ``x_online[:n']``
    against ``y`` (when the batch has labels); ``J`` (Eq. 4 ``mse`` / Eq. 5 ``kl``): the
    consistency between the online outputs (all of them with ``on_labeled``, else the unlabeled
    ones) and the target's probabilities on ``x_target`` (``forward.follower``, no gradient);
    loss ``L + beta^k J`` with ``beta^k = consts["beta"][s]``.
    """

    consistency: str
    on_labeled: bool

    def __call__(self, forward: Any, params: Any, consts: Any, batch: Any, s: int) -> tuple:
        logits = forward(batch["x_online"])
        n_sup = batch["y"].shape[0] if "y" in batch else 0
        loss, metrics = None, {}
        if n_sup:
            ce = F.cross_entropy(logits[:n_sup], batch["y"])  # L, Eq. 6
            loss, metrics["ce"] = ce, ce
        if "x_target" in batch:
            probs = F.softmax(forward.follower(batch["x_target"]).float(), dim=1)
            consistency = softmax_mse if self.consistency == "mse" else kl_consistency  # read at call time
            j = consistency(logits if self.on_labeled else logits[n_sup:], probs)  # J, Eq. 4/5
            weighted = consts["beta"][s] * j
            loss = weighted if loss is None else loss + weighted
            metrics["consistency"] = j
        else:
            metrics["consistency"] = torch.zeros_like(loss)
        return loss, {"metrics": metrics}
