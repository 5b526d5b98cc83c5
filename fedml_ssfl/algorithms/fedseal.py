"""FedSEAL: self-ensemble and negative learning at unlabeled clients (Bian et al. 2021).

Bian et al., *FedSEAL: Semi-Supervised Federated Learning with Self-Ensemble Learning and Negative
Learning*, 2021. Labels-at-server: the server holds N_s labels and a validation set, the clients
unlabeled data only. ``w^0`` is bootstrapped on the server's labels (Sec. 4.1.3, ``bootstrap_steps``
of Eq. 3/4 under a cosine decay).

Equations (plain text; t = round, a() weak, A() strong augmentation; Algorithm 1)::

    (2)     server: w_bar = uniform average of the previous round's client models
    (3/4)   server: w^t <- server_steps SGD steps of CE(f(a(x); w_bar), y) on its labels
    (5)     tau_m = sum_val p_m(x) 1{pred(x) = m} / #{val : y = m}, clipped to [0, 1]; sent with w^t
    (8)     client, every round, sampled or not: p_bar^t = (t-1)/t p_bar^{t-1} + 1/t p(x; w^t)
    (9/10)  positive set:  y+ = argmax p_bar  where  p_bar_{y+} >= tau_{y+}
    (11/12) negative set:  not positive, some class m with p_bar_m <= theta; y- drawn uniformly
            among those classes
    (13-15) client loss: lambda CE(y+, f(A(x))) over positives - log(1 - f(x)_{y-}) over negatives,
            each the mean over its mini-batch; T = train_args.local_steps SGD steps
    lr:     train_args.learning_rate x lr_decay^t in round t, constant within the round

Paper defaults (Sec. 4, 5.2.1): theta 0.05, ``lr_decay`` 0.995. Ablations (Sec. 5.2):
``self_ensemble: false``, ``fixed_threshold``, ``negative_learning: false``.

Deviations:

* Epochs are steps (``server_steps``, default T; ``train_args.local_steps``); the paper gives no
  epoch or batch counts.
* lambda ramps 0.1 -> 1 over 10 rounds (``lambda_start``, ``lambda_end``, ``lambda_rampup_rounds``):
  the paper says only "small at first".
* The bootstrap's length (the run's whole server budget) and its cosine decay are this project's.
* The server's SGD uses ``train_args.momentum`` with a fresh buffer each round.
* Eq. 5 is clipped to 1; a class never predicted gets 0, a class absent from validation 1.
* ``lr_times_train_schedule: true`` also multiplies the rate by ``train_args.lr_schedule``.
* :meth:`FedSEAL.finalize` averages the last round's clients in with one more server update.

Provenance and details: docs/algorithms.md#fedseal-bian-et-al-2021
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import seeding
from ..aggregation import weighted_average
from ..errors import ConfigError
from ..ssl.negative import complementary_loss, sample_complementary_labels
from ..ssl.pseudo_label import kept_accuracy
from ..stacked import JobResult, LocalJob
from ..training import BatchStream, InputPipeline, cosine_lr, cpu_state
from .base import AlgorithmConfig, ClientContext, ClientData, Message
from .global_model import client_party
from .jobs import JobAlgorithm
from .registry import register_algorithm

PREDICT_BATCH = 512
"""Batch size of the no-gradient passes (ensemble, thresholds, pseudo-labels)."""


@torch.no_grad()
def predict_probs(
    model: nn.Module,
    pipeline: InputPipeline,
    images: torch.Tensor,
    idx: torch.Tensor,
    generator: torch.Generator | None = None,
    augment: str = "plain",
    batch_size: int = PREDICT_BATCH,
) -> torch.Tensor:
    """Softmax probabilities of ``model`` in eval mode on ``images[idx]``, as a CPU float tensor.

    ``augment`` is ``"plain"`` (no augmentation) or ``"weak"`` (alpha(x), drawing from
    ``generator``). The model's train/eval mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, idx.numel(), batch_size):
        batch = images[idx[start : start + batch_size]]
        x = pipeline.weak(batch, generator) if augment == "weak" else pipeline.plain(batch)
        out.append(model(x).float().softmax(dim=1).cpu())
    model.train(was_training)
    if not out:
        return torch.zeros(0, 0)
    return torch.cat(out)


def classwise_thresholds(probs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Bian et al. Eq. 5: ``tau_m = sum_i p_m(x_i) 1{f(x_i) = m} / sum_i 1{y_i = m}``, kept in [0, 1].

    Sec. 4.1.2: "tau_m^t in [0, 1] is the confidence threshold for class m". The ratio itself exceeds
    1 for a class the model predicts more often (and confidently) than it occurs in the validation
    set, and would then keep no positive of that class at all; it is clipped to 1 (a class whose
    samples all the folded models give probability 1 still passes). A class with no validation
    sample (denominator 0) gets 1 too; a class never predicted gets 0.

    Parameters
    ----------
    probs : torch.Tensor
        (N, d) probabilities of the validation samples under the current global model.
    labels : torch.Tensor
        (N,) true validation labels.
    num_classes : int
        d.

    Returns
    -------
    torch.Tensor
        (d,) float thresholds in [0, 1].
    """
    conf, pred = probs.max(dim=1)
    num = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, pred.cpu(), conf.double().cpu())
    den = torch.bincount(labels.cpu(), minlength=num_classes).double()
    tau = torch.where(den > 0, num / den.clamp_min(1), torch.ones_like(num))
    return tau.clamp(0.0, 1.0).float()  # Sec. 4.1.2: tau_m in [0, 1]


def update_ensemble(mean: torch.Tensor | None, count: int, probs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Bian et al. Eq. 8: ``p_bar^t = (t-1)/t p_bar^{t-1} + 1/t p(x; w^t)``, with ``t = count + 1``.

    Returns the new running mean (a new tensor) and the new count. A missing or mismatched
    ``mean`` (e.g. the first round) starts the ensemble at ``probs``.
    """
    probs = probs.detach().float().cpu()
    if mean is None or count <= 0 or mean.shape != probs.shape:
        return probs.clone(), 1
    t = count + 1
    return (t - 1) / t * mean + probs / t, t


@dataclass
class FilteredSets:
    """The positive (Eq. 10) and negative (Eq. 12) sets of one client, as masks over its samples."""

    pos_mask: torch.Tensor
    pos_labels: torch.Tensor
    neg_mask: torch.Tensor
    neg_labels: torch.Tensor


def filter_sets(
    ensemble: torch.Tensor,
    thresholds: torch.Tensor,
    theta: float,
    generator: torch.Generator,
    negative: bool = True,
) -> FilteredSets:
    """Bian et al. Eq. 9-12 on the ensemble probabilities ``ensemble`` (n, d).

    Positive: ``p_bar_{y+} >= tau_{y+}`` with ``y+ = argmax p_bar``. Negative: not positive and
    some ``p_bar_m <= theta``; ``y-`` drawn uniformly among those classes.
    """
    conf, pos_labels = ensemble.max(dim=1)
    pos_mask = conf >= thresholds.to(ensemble.device)[pos_labels]
    neg_labels, has_candidate = sample_complementary_labels(ensemble, theta, generator)
    neg_mask = has_candidate.to(pos_mask.device) & ~pos_mask
    if not negative:
        neg_mask = torch.zeros_like(pos_mask)
    return FilteredSets(pos_mask=pos_mask, pos_labels=pos_labels, neg_mask=neg_mask, neg_labels=neg_labels)


@dataclass
class FedSEALConfig(AlgorithmConfig):
    """Hyper-parameters of FedSEAL (Bian et al. Sec. 4 and 5.2).

    Attributes
    ----------
    theta : float
        Complementary threshold of Eq. 11/12 (paper: 0.05).
    server_steps : int or None
        Server SGD steps per round (E_s epochs in the paper); None: ``train_args.local_steps``.
    bootstrap_steps : int or None
        Steps of server-only training for ``w^0`` (Sec. 4.1.3); None: ``comm_round x
        server_steps``; 0 starts from a random model.
    lr_decay : float
        Per-round learning-rate decay factor (paper: 0.995): round t uses
        ``train_args.learning_rate x lr_decay^t``.
    lr_times_train_schedule : bool
        False (default, the paper): the per-round decay alone. True: the decay times
        ``train_args.lr_schedule`` evaluated at the round's start (e.g. cosine, for short runs).
    lambda_start, lambda_end : float
        Weight of the positive loss (Eq. 13) in the first round and after the ramp-up.
    lambda_rampup_rounds : int
        Rounds of the linear ramp from ``lambda_start`` to ``lambda_end`` (0: ``lambda_end``
        from the start).
    self_ensemble : bool
        Eq. 8 ensemble (default); false filters with the current global model only (Fig. 5).
    fixed_threshold : float or None
        None: class-wise thresholds of Eq. 5 (default). A number: that threshold for every
        class (Sec. 5.2.4's comparison); the validation set is then not needed.
    negative_learning : bool
        Use the negative set and loss (default); false trains on the positive set only.
    log_class_thresholds : bool
        Log each class's threshold tau_m^t of the round as ``threshold_c<m>`` in the round's metrics
        (default true; the paper's Fig. 4 shows them, the per-class mean confidence on the validation set,
        for the final model, whose values are the last checkpoint's ``thresholds``). False logs the mean only.
    """

    theta: float = 0.05
    server_steps: int | None = None
    bootstrap_steps: int | None = None
    lr_decay: float = 0.995
    lr_times_train_schedule: bool = False
    lambda_start: float = 0.1
    lambda_end: float = 1.0
    lambda_rampup_rounds: int = 10
    self_ensemble: bool = True
    fixed_threshold: float | None = None
    negative_learning: bool = True
    log_class_thresholds: bool = True

    def check(self, cfg) -> None:
        """Cross-checks against the experiment config (raises :class:`ConfigError`)."""
        if cfg.data_args.partition_method == "streaming_noniid":
            raise ConfigError(
                "data_args.partition_method: fedseal keeps a self-ensemble per client sample (Eq. 8) over a fixed "
                "local set and does not support data arriving in stages; use batch_noniid, or fedmatch for the "
                "streaming task"
            )
        if not 0.0 <= self.theta <= 1.0:
            raise ConfigError(f"ssfl_args.theta: {self.theta} must lie in [0, 1]")
        if not 0.0 < self.lr_decay <= 1.0:
            raise ConfigError(f"ssfl_args.lr_decay: {self.lr_decay} must lie in (0, 1]")
        for key in ("server_steps", "bootstrap_steps"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ConfigError(f"ssfl_args.{key}: {value} must be >= 0 (or null for the default)")
        for key in ("lambda_start", "lambda_end"):
            if getattr(self, key) < 0:
                raise ConfigError(f"ssfl_args.{key}: {getattr(self, key)} must be >= 0")
        if self.lambda_rampup_rounds < 0:
            raise ConfigError(f"ssfl_args.lambda_rampup_rounds: {self.lambda_rampup_rounds} must be >= 0")
        if self.fixed_threshold is not None and not 0.0 <= self.fixed_threshold <= 1.0:
            raise ConfigError(f"ssfl_args.fixed_threshold: {self.fixed_threshold} must lie in [0, 1] (or null)")
        if cfg.data_args.num_server_labels <= 0:
            raise ConfigError(
                "data_args.num_server_labels: fedseal trains the server on its labels "
                "(Eq. 3/4, bootstrapping); set it > 0"
            )
        if self.fixed_threshold is None and cfg.data_args.num_server_val <= 0:
            raise ConfigError(
                "data_args.num_server_val: fedseal computes its class-wise thresholds (Eq. 5) on the "
                "server's validation set, but it is 0; set data_args.num_server_val > 0 (the paper: 200 "
                "on Fashion-MNIST), or set ssfl_args.fixed_threshold"
            )

    def positive_weight(self, round_idx: int) -> float:
        """lambda of Eq. 13 in round ``round_idx``: a linear ramp from ``lambda_start`` to ``lambda_end``."""
        if self.lambda_rampup_rounds <= 0:
            return self.lambda_end
        frac = min(1.0, round_idx / self.lambda_rampup_rounds)
        return self.lambda_start + (self.lambda_end - self.lambda_start) * frac


@register_algorithm
class FedSEAL(JobAlgorithm):
    """FedSEAL: server training + Eq. 5 thresholds; clients self-ensemble, positive and negative sets."""

    name = "fedseal"
    config_class = FedSEALConfig

    # ---- schedule ------------------------------------------------------------------------
    @property
    def server_steps(self) -> int:
        steps = self.config.server_steps
        return self.train.local_steps if steps is None else steps

    def round_lr(self, round_idx: int) -> float:
        """The learning rate of round t (Sec. 5.2.1): ``learning_rate x lr_decay^t``.

        With ``lr_times_train_schedule`` the base is ``train_args.lr_schedule`` at the round's
        start instead of the constant ``learning_rate``.
        """
        base = self.train.learning_rate
        if self.config.lr_times_train_schedule:
            base = cosine_lr(self.train, round_idx * self.train.local_steps)
        return base * self.config.lr_decay**round_idx

    # ---- server ----------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.base_state: dict[str, torch.Tensor] = self.global_state
        self.thresholds = torch.ones(self.server_data.num_classes)
        self.bootstrapped = False

    def _server_train(self, weights: dict[str, torch.Tensor], round_idx: int) -> dict[str, torch.Tensor]:
        """Eq. 3/4: ``server_steps`` weak-augmentation SGD steps on the server's labels."""
        if self.server_steps == 0:
            return dict(weights)
        model = self.scratch_model(weights, self.device, slot="server")
        settings = dataclasses.replace(self.train, learning_rate=self.round_lr(round_idx), lr_schedule="constant")
        gen = seeding.generator(self.seed, "fedseal-server", round_idx)
        self.server_supervised_steps(model, settings, round_idx, gen, steps=self.server_steps)
        return cpu_state(model)

    def bootstrap(self) -> None:
        """Sec. 4.1.3: ``w^0`` from server-only training (cosine decay over the bootstrap steps)."""
        steps = self.config.bootstrap_steps
        steps = self.train.comm_round * self.server_steps if steps is None else steps
        if steps > 0:
            model = self.scratch_model(self.global_state, self.device, slot="server")
            settings = dataclasses.replace(
                self.train,
                local_steps=steps,
                comm_round=1,
                lr_schedule="cosine",
                lr_cosine_c=0.5,
                lr_warmup_rounds=0,
            )
            gen = seeding.generator(self.seed, "fedseal-bootstrap")
            self.server_supervised_steps(model, settings, 0, gen, party="the server (bootstrapping)", steps=steps)
            self.base_state = cpu_state(model)
        self.bootstrapped = True

    def update_thresholds(self) -> None:
        """Eq. 5 on the server's validation set (or the fixed threshold)."""
        d = self.server_data.num_classes
        if self.config.fixed_threshold is not None:
            self.thresholds = torch.full((d,), float(self.config.fixed_threshold))
            return
        model = self.scratch_model(self.global_state, self.device, slot="server")
        val = self.server_data.val_idx
        probs = predict_probs(model, InputPipeline(self.data_info, self.device), self.server_data.images, val)
        self.thresholds = classwise_thresholds(probs, self.server_data.labels[val], d)

    def server_step(self, round_idx: int) -> None:
        if not self.bootstrapped:
            self.bootstrap()
        self.global_state = self._server_train(self.base_state, round_idx)
        self.update_thresholds()

    def message_for(self, client_id: int, round_idx: int) -> Message:
        return self.broadcast(round_idx, thresholds=self.thresholds.clone())

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        live = [m.weights for m in replies.values() if not m.is_empty]
        # Eq. 2: uniform average of the clients' models; with no client model, keep w^t.
        self.base_state = weighted_average(live) if live else self.global_state
        finite = self.thresholds[torch.isfinite(self.thresholds)]
        metrics = {
            "clients_sent": float(len(live)),
            "threshold_mean": float(finite.mean()) if finite.numel() else float("nan"),
            "lambda": self.config.positive_weight(round_idx),
            "server_lr": self.round_lr(round_idx),
        }
        if self.config.log_class_thresholds:  # Fig. 4's values: the round's tau_m^t, the ones its clients filtered with
            metrics |= {f"threshold_c{m}": float(t) for m, t in enumerate(self.thresholds.tolist())}
        return metrics

    def finalize(self) -> None:
        """One more server update (Eq. 3/4) on the last clients' average: the final model."""
        last = self.train.comm_round - 1
        self.global_state = self._server_train(self.base_state, last)
        self.update_thresholds()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "base_state": dict(self.base_state),
            "thresholds": self.thresholds.clone(),
            "bootstrapped": self.bootstrapped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.base_state = state["base_state"]
        self.thresholds = state["thresholds"]
        self.bootstrapped = state["bootstrapped"]

    # ---- client ----------------------------------------------------------------------------
    def local_job(
        self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext
    ) -> LocalJob | Message | None:
        """Filter the client's samples (Eq. 8-12), then its T steps of Eq. 13-15 as a job.

        The received model's probabilities (eval mode, unaugmented) update the self-ensemble in
        ``state``; the ensemble and the round's thresholds give the positive and negative sets.
        A client with neither set replies with its filter metrics only; one without unlabeled
        data replies empty. The job trains at the round's rate (:meth:`round_lr`).
        """
        n = data.num_unlabeled
        if n == 0:
            return None
        cfg, round_idx = self.config, ctx.round_idx
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen = ctx.generator(data.client_id)
        ensemble = self._fold(msg, data, state, ctx)
        sets = filter_sets(ensemble, msg.extras["thresholds"], cfg.theta, gen, cfg.negative_learning)
        positions = torch.arange(n)
        pos, neg = positions[sets.pos_mask], positions[sets.neg_mask]
        truth = data.labels[data.unlabeled_idx]
        metrics: dict[str, float] = {
            "mask_rate": pos.numel() / n,
            "neg_rate": neg.numel() / n,
            "ensemble_size": float(state.get("ensemble_count", 1)),
        }
        pseudo_acc = kept_accuracy(sets.pos_labels, truth, sets.pos_mask)
        if pseudo_acc is not None:
            metrics["pseudo_acc"] = pseudo_acc
        neg_acc = kept_accuracy(sets.neg_labels, truth, sets.neg_mask)
        if neg_acc is not None:
            metrics["neg_label_acc"] = 1.0 - neg_acc  # a negative label is right when it is not the class
        if pos.numel() == 0 and neg.numel() == 0:
            return Message(extras={"metrics": metrics})
        return LocalJob(
            party=client_party(data.client_id),
            weights=msg.weights,
            draw=self._set_batches(data, sets, pos, neg, pipeline, gen),
            loss=PositiveNegativeLoss(cfg.positive_weight(round_idx)),
            steps=self.train.local_steps,
            lr=self.round_lr(round_idx),
            notes={"metrics": metrics},
        )

    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One local epoch: the client's unlabeled set at ``train_args.batch_size`` (its positive and
        negative batches are drawn from it)."""
        return data.num_unlabeled, self.train.batch_size

    def broadcasts_to_all(self) -> bool:
        """Algorithm 1 step 2: "All clients download global model w^t and confidence threshold vector
        tau^t from the server", sampled or not, so every client's self-ensemble folds every round's
        model (:meth:`client_receive`)."""
        return True

    def client_receive(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> None:
        """A client not sampled this round folds the downloaded ``w^t`` into its self-ensemble (Eq. 8)."""
        if data.num_unlabeled and self.config.self_ensemble:
            self._fold(msg, data, state, ctx)

    def _fold(self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext) -> torch.Tensor:
        """The received model's probabilities on the client's samples (eval mode, unaugmented); with
        ``self_ensemble`` folded into the client's ensemble (Eq. 8, in ``state``), which is returned,
        else the probabilities themselves."""
        model = self.scratch_model(msg.weights, ctx.device)
        probs = predict_probs(model, InputPipeline(self.data_info, ctx.device), data.images, data.unlabeled_idx)
        if not self.config.self_ensemble:
            return probs
        state["ensemble"], state["ensemble_count"] = update_ensemble(
            state.get("ensemble"), int(state.get("ensemble_count", 0)), probs
        )
        return state["ensemble"]

    def _set_batches(
        self,
        data: ClientData,
        sets: FilteredSets,
        pos: torch.Tensor,
        neg: torch.Tensor,
        pipeline: InputPipeline,
        gen: torch.Generator,
    ) -> Any:
        """``draw(s)``: a positive batch, strongly augmented, with ``y+`` (``x_pos``, ``y_pos``) and a
        negative batch, unaugmented, with ``y-`` (``x_neg``, ``y_neg``); each where its set is not empty."""
        bs, device = self.train.batch_size, pipeline.device
        pos_stream = BatchStream(pos, bs, gen) if pos.numel() else None
        neg_stream = BatchStream(neg, bs, gen) if neg.numel() else None

        def draw(s: int) -> dict[str, torch.Tensor]:
            batch: dict[str, torch.Tensor] = {}
            if pos_stream is not None:
                b = next(pos_stream)
                batch["x_pos"] = pipeline.strong(data.images[data.unlabeled_idx[b]], gen)
                batch["y_pos"] = sets.pos_labels[b].to(device)
            if neg_stream is not None:
                b = next(neg_stream)
                batch["x_neg"] = pipeline.plain(data.images[data.unlabeled_idx[b]])
                batch["y_neg"] = sets.neg_labels[b].to(device)
            return batch

        return draw

    def client_reply(
        self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict[str, Any]
    ) -> Message:
        metrics = {**job.notes["metrics"], **result.metrics}
        return Message(weights=result.weights, num_samples=data.num_unlabeled, extras={"metrics": metrics})


@dataclass(frozen=True)
class PositiveNegativeLoss:
    """A FedSEAL client's step loss (Eq. 13-15): ``lambda CE(y+, f(A(x)))`` on the positive batch plus
    ``-log(1 - f(x)_{y-})`` on the negative batch (:func:`~fedml_ssfl.ssl.negative.complementary_loss`),
    each the mean over its batch; a term whose set is empty is left out."""

    positive_weight: float

    def __call__(self, forward: Any, params: Any, consts: Any, batch: Any, s: int) -> tuple:
        loss = None
        if "x_pos" in batch:  # lambda CE(y+, f(A(x))) on the positive set
            loss = self.positive_weight * F.cross_entropy(forward(batch["x_pos"]), batch["y_pos"])
        if "x_neg" in batch:  # -log(1 - f(x)_{y-}) on the negative set
            negative = complementary_loss(forward(batch["x_neg"]), batch["y_neg"])
            loss = negative if loss is None else loss + negative
        return loss, {}
