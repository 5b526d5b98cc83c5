"""SemiFL: alternate training of a labeled server and unlabeled clients (Diao et al. 2022).

Diao et al., *SemiFL: Semi-Supervised Federated Learning for Unlabeled Clients with Alternate
Training*, 2022. Labels-at-server. Each round t (Algorithm 1): the server fine-tunes, sets
static BatchNorm, broadcasts; the clients train; the server averages; after the last round one more
fine-tune (:meth:`SemiFL.finalize`).

Equations (plain text; alpha() weak, A() strong augmentation; Algorithm 1)::

    (1)  server: W_g <- E epochs of SGD on CE(f(alpha(x)), y) over its labels, batch B_s
    (2)  client m: y_hat_i = argmax f(alpha(x_i); W_g), once a round, model in eval mode
    (3)  fix set = { (x_i, y_hat_i) : max f(alpha(x_i); W_g) >= tau }   (empty: the client sends nothing)
    (4)  mix set = |fix| samples drawn with replacement from all its pseudo-labeled data
    (5)  lambda_mix ~ Beta(a, a);  x_mix = lambda_mix x_fix + (1 - lambda_mix) x_mix
         L_fix = CE(f(A(x_fix)), y_fix)
         L_mix = lambda_mix CE(f(alpha(x_mix)), y_fix) + (1 - lambda_mix) CE(f(alpha(x_mix)), y_mix)
    (6)  one SGD step on L_fix + lambda L_mix, E epochs (or T steps) of batch B_m
         server: W_s = 1/M_t sum_m W_m, applied as an SGD step of lr server_lr, momentum
         server_momentum on the gradient W_g - W_s (server_momentum 0: the plain average)
         sBN: BatchNorm running statistics recomputed as the exact pooled mean and variance
         of per-layer sums (sum, sum of squares, count) of the chosen data

Defaults where the paper defers to its appendix (the authors' code): tau 0.95, a 0.75, E 5,
lambda 1 (the text), gradient clipping to 1, Nesterov momentum 0.9, server momentum 0.5.
``sbn``: ``federated`` (server data when the model goes out, then server + client sums for the
evaluated model), ``server``, ``all_data_nonfederated`` (the authors': reads every client's images),
``off``. Table 2 switches, as the authors ran them: ``fine_tune: false`` (the parallel server weighs
1/2 in the average, ``parallel_server_weight``), ``pseudo_labels: batch`` (L_fix alone on each batch's
confident samples, ``batch_loss``), ``final_fine_tune``.

Deviations:

* sBN is federated by default: per-layer sums leave a client, not its images (the authors pool
  every image on the server).
* Gradient clipping and the server momentum are the authors' code's (the paper has neither).
* The strong view is the package's RandAugment with cutout, not the authors' own RandAugment.
* Mixup mixes the raw images, then augments the mixture, as Eq. 5 writes (the authors mix the
  augmented tensors).
* A client's views are drawn a chunk of steps at a time (:data:`VIEW_CHUNK_VALUES`): the same
  equations, another order of random numbers, one augmentation call per chunk.
* ``server_steps`` and ``local_epochs: null`` replace epochs by a fixed number of steps.
* The sBN pass runs at ``sbn_batch_size`` (default: the clients' training batch; the authors' 250,
  which the paper configs set).
* ``pseudo_labels: batch`` forwards only the confident samples' strong view in train mode (the authors
  also run the batch's weak view through the model in train mode, which moves BatchNorm's running
  statistics but no loss).
* The learning rate is ``train_args.lr_schedule`` once per round (the authors: cosine annealing,
  ``lr_schedule: cosine_annealing``); the final fine-tune uses the last round's rate.

Provenance and details: docs/algorithms.md#semifl-diao-et-al-2022
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import seeding
from ..aggregation import Scratch, dense_layout, weighted_average
from ..errors import ConfigError
from ..ssl.mixup import mix_inputs, mixup_loss, sample_mix_lambdas
from ..ssl.pseudo_label import PseudoLabels, kept_accuracy, pseudo_labels
from ..stacked import LocalJob, run_stacked
from ..training import (
    BatchStream,
    InputPipeline,
    Phase,
    Step,
    cosine_lr,
    cpu_state,
    load_momentum_buffers,
    momentum_buffers,
    run_steps,
)
from .base import AlgorithmConfig, ClientContext, ClientData, Message, TrainSettings
from .fedseal import predict_probs
from .global_model import GlobalModelAlgorithm, client_party
from .registry import register_algorithm

log = logging.getLogger(__name__)

SBN_MODES = ("federated", "server", "all_data_nonfederated", "off")
BATCH_LOSSES = ("fix", "fix_mix")

VIEW_CHUNK_VALUES = 2**20
"""A client's steps have their augmented views made together in chunks of about this many input values
(4 MiB of float32 per view): :meth:`SemiFL._global_label_steps`."""
BNSums = dict[str, dict[str, torch.Tensor]]


# ---- static BatchNorm ------------------------------------------------------------------------
def bn_layers(model: nn.Module) -> dict[str, _BatchNorm]:
    """The model's BatchNorm layers by module name (empty for GroupNorm models)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}


@torch.no_grad()
def bn_sums(
    model: nn.Module, pipeline: InputPipeline, images: torch.Tensor, idx: torch.Tensor, batch_size: int
) -> BNSums:
    """Per-BN-layer ``sum``, ``sumsq`` and ``count`` of the layer's inputs over ``images[idx]``.

    One pass in train mode (each batch normalised by its own statistics, as in training), on
    unaugmented inputs, without gradients. Sums are per channel, in float64; ``count`` is the
    number of values per channel (N x H x W). The model's buffers and mode are left unchanged.
    """
    layers = bn_layers(model)
    if not layers or idx.numel() == 0:
        return {}
    sums: BNSums = {}
    saved = {k: v.clone() for k, v in model.state_dict().items() if not v.is_floating_point() or "running" in k}

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().to(torch.float64, copy=True)  # our own copy: squared in place below
            dims = [d for d in range(x.ndim) if d != 1]
            entry = sums.setdefault(name, {"sum": 0.0, "sumsq": 0.0, "count": 0.0})
            entry["count"] = entry["count"] + float(x.numel() // x.shape[1])
            entry["sum"] = entry["sum"] + x.sum(dim=dims).cpu()
            entry["sumsq"] = entry["sumsq"] + x.mul_(x).sum(dim=dims).cpu()  # x * x without a second buffer

        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    was_training = model.training
    model.train()
    try:
        for start in range(0, idx.numel(), batch_size):
            model(pipeline.plain(images[idx[start : start + batch_size]]))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        model.load_state_dict(saved, strict=False)
    return {
        k: {"sum": v["sum"], "sumsq": v["sumsq"], "count": torch.tensor(v["count"], dtype=torch.float64)}
        for k, v in sums.items()
    }


def merge_bn_sums(parts: list[BNSums]) -> BNSums:
    """Add per-layer sums from several parties (layers missing from a party add nothing)."""
    out: BNSums = {}
    for part in parts:
        for name, entry in part.items():
            if name not in out:
                out[name] = {k: v.clone() for k, v in entry.items()}
            else:
                for k in ("sum", "sumsq", "count"):
                    out[name][k] = out[name][k] + entry[k]
    return out


def apply_bn_sums(state: dict[str, torch.Tensor], sums: BNSums) -> dict[str, torch.Tensor]:
    """A copy of ``state`` whose BN running statistics are the mean and biased variance in ``sums``."""
    out = dict(state)
    for name, entry in sums.items():
        count = float(entry["count"])
        if count <= 0:
            continue
        mean = entry["sum"] / count
        var = (entry["sumsq"] / count - mean * mean).clamp_min(0.0)
        key_mean, key_var = f"{name}.running_mean", f"{name}.running_var"
        if key_mean in out:
            out[key_mean] = mean.to(out[key_mean].dtype)
            out[key_var] = var.to(out[key_var].dtype)
    return out


# ---- server momentum -------------------------------------------------------------------------
def server_momentum_step(
    global_state: dict[str, torch.Tensor],
    avg_state: dict[str, torch.Tensor],
    buffer: dict[str, torch.Tensor],
    lr: float,
    momentum: float,
    param_keys: set[str],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One server SGD step on the pseudo-gradient ``g = w_global - w_avg`` (PyTorch SGD's rule).

    For each parameter: ``buf = g`` the first time, else ``buf = momentum * buf + g``; then
    ``w_new = w_global - lr * buf``. With ``lr = 1`` and ``momentum = 0`` this is ``w_avg``.
    Buffers that are not parameters (BN statistics, counters) are taken from ``avg_state``.

    Returns
    -------
    (dict, dict)
        The new global state and the new momentum buffer (inputs are not modified).
    """
    new_state: dict[str, torch.Tensor] = {}
    new_buf: dict[str, torch.Tensor] = {}
    scratch = Scratch.for_tensors(global_state.values(), 3)  # reused float64 buffers (issue 15)
    for k, w in global_state.items():
        if k in param_keys and w.is_floating_point():
            old = buffer.get(k)
            if dense_layout([w, avg_state[k], *([old] if old is not None else [])]):
                # the same element-wise float64 arithmetic in place: g, then buf, then w - lr * buf
                g, b, w64 = scratch.like(0, w), scratch.like(1, w), scratch.like(2, w)
                w64.copy_(w)
                g.copy_(w64).sub_(b.copy_(avg_state[k]))
                buf = g if old is None else b.copy_(old).mul_(momentum).add_(g)
                new_buf[k] = buf.to(w.dtype, copy=True)  # copies even for float64: g, b, w64 are scratch views
                new_state[k] = w64.sub_(g.mul_(lr) if old is None else b.mul_(lr)).to(w.dtype, copy=True)
            else:  # mixed layouts: fresh tensors, as the formula reads
                g = w.double() - avg_state[k].double()
                buf = g if old is None else momentum * old.double() + g
                new_buf[k] = buf.to(w.dtype)
                new_state[k] = (w.double() - lr * buf).to(w.dtype)
        else:
            new_state[k] = avg_state[k].clone()
    return new_state, new_buf


# ---- fix and mix sets ------------------------------------------------------------------------
@dataclass
class FixMixSets:
    """Positions (into the client's unlabeled samples) and labels of the fix and mix sets.

    ``pseudo`` holds every sample's pseudo-label, its confidence, and the fix set as its mask.
    """

    fix: torch.Tensor
    fix_labels: torch.Tensor
    mix: torch.Tensor
    mix_labels: torch.Tensor
    pseudo: PseudoLabels


def fix_mix_sets(probs: torch.Tensor, threshold: float, generator: torch.Generator) -> FixMixSets:
    """Diao et al. Eq. 3 and 4: fix = samples with ``max prob >= threshold``; mix = ``|fix|`` draws
    with replacement from all samples, each with its (unthresholded) pseudo-label."""
    pl = pseudo_labels(probs, threshold)
    fix = torch.nonzero(pl.mask).flatten()
    mix = torch.randint(0, probs.shape[0], (fix.numel(),), generator=generator) if fix.numel() else fix
    return FixMixSets(fix=fix, fix_labels=pl.labels[fix], mix=mix, mix_labels=pl.labels[mix], pseudo=pl)


def epoch_batches(
    idx: torch.Tensor, batch_size: int, epochs: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Algorithm 1's epochs: each "randomly split [the] data into batches of size B".

    Every epoch draws a fresh permutation of ``idx`` and cuts it into ``ceil(n / B)`` batches,
    the last one shorter when B does not divide n, so each epoch visits every index once.
    """
    if batch_size < 1:
        raise ValueError(f"epoch_batches: batch_size must be >= 1, got {batch_size}")
    for _ in range(epochs):
        yield from idx[torch.randperm(idx.numel(), generator=generator)].split(batch_size)


@dataclass
class SemiFLConfig(AlgorithmConfig):
    """Hyper-parameters of SemiFL (Diao et al. Algorithm 1, Sec. 3.4, Table 2).

    "paper" marks a value the paper's text gives, "code" one taken from the authors' code where
    the text is silent (see the module docstring).

    Attributes
    ----------
    threshold : float
        tau of Eq. 3, the fix set's confidence threshold (code: 0.95).
    mixup_alpha : float
        a of ``lambda_mix ~ Beta(a, a)`` (code: 0.75).
    loss_lambda : float
        lambda weighting L_mix in Eq. 6 (paper: 1).
    clip_norm : float
        Gradient-norm clipping on the clients and in the server's fine-tune (code: 1); 0
        disables it (the paper clips nothing).
    server_lr, server_momentum : float
        The server SGD on ``w_global - w_avg`` (code: 1 and 0.5). ``server_momentum: 0`` with
        ``server_lr: 1`` is Algorithm 1's plain average.
    nesterov : bool
        Nesterov momentum for the client and the server fine-tune SGD (code: true; the server
        momentum step above is plain, as in the code).
    server_epochs : int
        E of ServerUpdate: epochs over the server's labeled set per round, each a random split
        into batches of B_s (``server_batch_size``) (paper: E epochs; code: 5). 0 skips the
        fine-tune.
    server_batch_size : int or None
        B_s, the server's batch size (Algorithm 1: "server and client respective batch sizes B_s
        and B_m"); None: ``train_args.batch_size``, which is always B_m, the clients' (code: B_s =
        10 up to 1,000 labels, else 250; B_m = 10).
    persistent_optimizer : bool
        False (default): every party starts each round with a fresh SGD (Algorithm 1 writes plain
        steps ``W <- W - eta grad``). True: the authors' code, which keeps each client's and the
        server's optimiser across rounds: a client's momentum buffers live in its state
        (``state["momentum"]``), the server fine-tune's in the checkpoint.
    server_steps : int or None
        None (default): ``server_epochs`` epochs. An integer: that many steps per round instead
        (batches drawn from reshuffled passes), e.g. to fine-tune longer on a tiny label set.
    local_epochs : int or None
        E of ClientUpdate: epochs over the fix set (and the equal-size mix set) per round
        (paper: E epochs; code: 5). None: ``train_args.local_steps`` steps instead.
    fine_tune : bool
        Table 2's "fine-tune global model with labeled data" (true); false: the server trains in
        parallel on the model it sends and its result enters the average (``parallel_server_weight``).
    parallel_server_weight : float or None
        With ``fine_tune: false``, the parallel server model's weight in the average, the M_t
        clients sharing the rest equally (code: 1/2, the authors' ``update_parallel``; the server
        alone when no client sends). None: the server is one of M_t + 1 equal models.
    pseudo_labels : str
        Table 2's "generate pseudo-labels with global model": ``global`` (default) or ``batch``.
    batch_loss : str
        With ``pseudo_labels: batch``, the client's loss on each batch's confident samples: ``fix``
        (default; the authors' fix-batch ablation, L_fix = CE(f(A(x)), y_hat) only) or ``fix_mix``
        (L_fix + lambda L_mix of Eq. 6 within the batch).
    final_fine_tune : bool
        Fine-tune (+ sBN) once more after the last round (paper, Algorithm 1: true).
    sbn : str
        ``federated`` (default), ``server``, ``all_data_nonfederated`` (code) or ``off`` (see
        the module docstring).
    sbn_batch_size : int or None
        The batch of the sBN pass (each batch is normalised by its own statistics in that pass, so
        the deeper layers' sums depend on it): None, ``train_args.batch_size`` (B_m); the authors'
        code: 250.
    """

    threshold: float = 0.95
    mixup_alpha: float = 0.75
    loss_lambda: float = 1.0
    clip_norm: float = 1.0
    server_lr: float = 1.0
    server_momentum: float = 0.5
    nesterov: bool = True
    server_epochs: int = 5
    server_batch_size: int | None = None
    persistent_optimizer: bool = False
    server_steps: int | None = None
    local_epochs: int | None = 5
    fine_tune: bool = True
    parallel_server_weight: float | None = 0.5
    pseudo_labels: str = "global"
    batch_loss: str = "fix"
    final_fine_tune: bool = True
    sbn: str = "federated"
    sbn_batch_size: int | None = None

    def check(self, cfg) -> None:
        """Cross-checks against the experiment config (raises :class:`ConfigError`)."""
        choices = {"pseudo_labels": ("global", "batch"), "sbn": SBN_MODES, "batch_loss": BATCH_LOSSES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"ssfl_args.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"ssfl_args.threshold: {self.threshold} must lie in [0, 1]")
        for key in ("mixup_alpha", "server_lr"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"ssfl_args.{key}: {getattr(self, key)} must be > 0")
        for key in ("loss_lambda", "clip_norm"):
            if getattr(self, key) < 0:
                raise ConfigError(f"ssfl_args.{key}: {getattr(self, key)} must be >= 0")
        w = self.parallel_server_weight
        if w is not None and not (math.isfinite(w) and 0.0 < w < 1.0):
            raise ConfigError(
                f"ssfl_args.parallel_server_weight: {w} must lie in (0, 1) (or null: one of M_t + 1 equal models)"
            )
        if not 0.0 <= self.server_momentum < 1.0:
            raise ConfigError(f"ssfl_args.server_momentum: {self.server_momentum} must lie in [0, 1)")
        if self.server_epochs < 0:
            raise ConfigError(
                f"ssfl_args.server_epochs: {self.server_epochs} must be >= 0 (0 skips the server's fine-tune)"
            )
        if self.server_batch_size is not None and self.server_batch_size < 1:
            raise ConfigError(
                f"ssfl_args.server_batch_size: {self.server_batch_size} must be >= 1 "
                "(or null for train_args.batch_size)"
            )
        if self.sbn_batch_size is not None and self.sbn_batch_size < 1:
            raise ConfigError(
                f"ssfl_args.sbn_batch_size: {self.sbn_batch_size} must be >= 1 (or null for train_args.batch_size)"
            )
        if self.server_steps is not None and self.server_steps < 0:
            raise ConfigError(
                f"ssfl_args.server_steps: {self.server_steps} must be >= 0 (or null for ssfl_args.server_epochs epochs)"
            )
        if self.local_epochs is not None and self.local_epochs < 1:
            raise ConfigError(
                f"ssfl_args.local_epochs: {self.local_epochs} must be >= 1 (or null for train_args.local_steps steps)"
            )
        if self.nesterov and cfg.train_args.momentum <= 0:
            raise ConfigError("ssfl_args.nesterov: Nesterov SGD needs train_args.momentum > 0; set nesterov: false")
        if cfg.data_args.num_server_labels <= 0:
            raise ConfigError("data_args.num_server_labels: semifl fine-tunes on the server's labels; set it > 0")
        if cfg.train_args.stack_clients and (self.pseudo_labels != "global" or self.local_epochs is not None):
            raise ConfigError(
                "train_args.stack_clients: semifl trains clients stacked only with ssfl_args.pseudo_labels: global "
                "and ssfl_args.local_epochs: null (T steps of one batch shape); set train_args.stack_clients: false"
            )


@dataclass(frozen=True)
class FixMixLoss:
    """A client step's ``L_fix + lambda L_mix`` (Eq. 5/6) on its views, as a pure step loss
    (:data:`~fedml_ssfl.stacked.StepLoss`): ``batch`` holds ``x_strong`` = A(x_fix), ``x_weak`` =
    alpha(x_mix) of the mixed inputs, ``y_fix``, ``y_mix`` and the step's ``lam``."""

    loss_lambda: float

    def __call__(self, forward: Callable, params: Any, consts: Any, batch: Any, s: int) -> tuple:
        loss_fix = F.cross_entropy(forward(batch["x_strong"]), batch["y_fix"])
        loss_mix = mixup_loss(forward(batch["x_weak"]), batch["y_fix"], batch["y_mix"], batch["lam"])
        return loss_fix + self.loss_lambda * loss_mix, {"metrics": {"mix_lambda": batch["lam"]}}


@register_algorithm
class SemiFL(GlobalModelAlgorithm):
    """SemiFL: server fine-tune + sBN, then fix/mix pseudo-label training on clients, server momentum."""

    name = "semifl"
    config_class = SemiFLConfig
    stackable: ClassVar[bool] = True  # pseudo_labels: global, local_epochs: null (SemiFLConfig.check)

    # ---- helpers ---------------------------------------------------------------------------
    @property
    def server_batch_size(self) -> int:
        """B_s: ``server_batch_size``, else ``train_args.batch_size``."""
        return self.config.server_batch_size or self.train.batch_size

    @property
    def sbn_batch_size(self) -> int:
        """The sBN pass's batch: ``sbn_batch_size``, else ``train_args.batch_size``."""
        return self.config.sbn_batch_size or self.train.batch_size

    @property
    def server_steps(self) -> int:
        """Fine-tune steps per round: ``server_steps``, else ``server_epochs`` x batches of B_s per epoch."""
        if self.config.server_steps is not None:
            return self.config.server_steps
        n = self.server_data.labeled_idx.numel()
        return self.config.server_epochs * math.ceil(n / self.server_batch_size) if n else 0

    def _server_batches(self, gen: torch.Generator) -> Iterator[torch.Tensor]:
        """The fine-tune's batches of B_s labeled indices (ServerUpdate of Algorithm 1)."""
        idx, bs = self.server_data.labeled_idx, self.server_batch_size
        if self.config.server_steps is None:
            return epoch_batches(idx, bs, self.config.server_epochs, gen)
        stream = BatchStream(idx, bs, gen)
        return (next(stream) for _ in range(self.config.server_steps))

    def round_lr(self, round_idx: int) -> float:
        """``train_args.lr_schedule`` at the start of round ``round_idx``, for the whole round."""
        return cosine_lr(self.train, min(round_idx, self.train.comm_round - 1) * self.train.local_steps)

    def make_sgd(self, model: nn.Module, lr: float) -> torch.optim.SGD:
        t: TrainSettings = self.train
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            nesterov=self.config.nesterov and t.momentum > 0,
        )

    def _fine_tune(self, weights: dict[str, torch.Tensor], round_idx: int, tag: str) -> dict[str, torch.Tensor]:
        """ServerUpdate (Eq. 1): ``server_epochs`` epochs (or ``server_steps`` steps) of weak-
        augmentation SGD on the server's labels, gradients clipped to ``clip_norm`` (code)."""
        model = self.scratch_model(weights, self.device, slot="server")
        if self.server_steps == 0:
            return cpu_state(model)
        gen = seeding.generator(self.seed, "semifl-server", tag, round_idx)
        opt = self.make_sgd(model, self.round_lr(round_idx))
        persistent = self.config.persistent_optimizer  # the parallel server's too (the authors' one server SGD)
        if persistent:
            load_momentum_buffers(opt, model, self.fine_tune_momentum)
        self.server_supervised_steps(
            model,
            self.train,
            round_idx,
            gen,
            optimizer=opt,
            batches=self._server_batches(gen),
            clip_norm=self.config.clip_norm,
            lr="optimizer",
        )
        if persistent:
            self.fine_tune_momentum = momentum_buffers(opt, model)
        return cpu_state(model)

    def _server_bn_sums(self, weights: dict[str, torch.Tensor]) -> BNSums:
        """sBN sums of ``weights`` over the data the ``sbn`` mode lets the server read."""
        mode = self.config.sbn
        if mode == "off":
            return {}
        sd = self.server_data
        if mode == "all_data_nonfederated":
            idx = torch.arange(sd.images.shape[0])
        else:
            idx = torch.cat([sd.labeled_idx, sd.val_idx])
        model = self.scratch_model(weights, self.device, slot="server")
        return bn_sums(model, InputPipeline(self.data_info, self.device), sd.images, idx, self.sbn_batch_size)

    def _with_sbn(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._server_sums = self._server_bn_sums(weights)
        return apply_bn_sums(weights, self._server_sums)

    # ---- server ----------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.base_state: dict[str, torch.Tensor] = self.global_state
        self.momentum_buffer: dict[str, torch.Tensor] = {}
        self.fine_tune_momentum: dict[str, torch.Tensor] = {}  # persistent_optimizer: the fine-tune SGD's buffers
        self.param_keys = {name for name, _ in self.model_fn().named_parameters()}
        self._server_sums: BNSums = {}
        self._parallel_state: dict[str, torch.Tensor] | None = None
        if self.config.sbn == "all_data_nonfederated":
            log.warning(
                "semifl: sbn=all_data_nonfederated reads every client's images on the server "
                "(the authors' code); this is not federated learning"
            )

    def server_step(self, round_idx: int) -> None:
        if self.config.fine_tune:
            sent = self._fine_tune(self.base_state, round_idx, "round")
            self._parallel_state = None
        else:
            sent = self.base_state
            self._parallel_state = self._fine_tune(self.base_state, round_idx, "parallel")
        self.global_state = self._with_sbn(sent)

    def message_for(self, client_id: int, round_idx: int) -> Message:
        return self.broadcast(round_idx)

    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        live = [m for m in replies.values() if not m.is_empty]
        states = [m.weights for m in live]
        weights = [1.0] * len(states)
        if self._parallel_state is not None:
            states.append(self._parallel_state)
            w = self.config.parallel_server_weight
            # the authors' update_parallel: the server 1/2, the clients 1/(2 M_t) each (the server alone: 1)
            weights = [(1.0 - w) / len(live)] * len(live) + [w] if w is not None and live else [1.0] * len(states)
        sent = self.global_state
        if states:
            avg = weighted_average(states, weights)
            self.base_state, self.momentum_buffer = server_momentum_step(
                sent,
                avg,
                self.momentum_buffer,
                self.config.server_lr,
                self.config.server_momentum,
                self.param_keys,
            )
        else:  # nobody sent a model: keep the broadcast model, leave the momentum untouched
            self.base_state = dict(sent)
        if self.config.sbn == "federated" and self._server_sums:
            client_sums = [m.extras["bn_sums"] for m in live if m.extras.get("bn_sums")]
            if client_sums:
                self.global_state = apply_bn_sums(sent, merge_bn_sums([self._server_sums, *client_sums]))
        return {"clients_sent": float(len(live))}

    def finalize(self) -> None:
        """After the last round: fine-tune the last average once more and update sBN (Algorithm 1)."""
        final = self.base_state
        if self.config.final_fine_tune:
            final = self._fine_tune(final, self.train.comm_round - 1, "final")
        self.global_state = self._with_sbn(final)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "base_state": dict(self.base_state),
            "momentum_buffer": dict(self.momentum_buffer),
            "fine_tune_momentum": dict(self.fine_tune_momentum),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.base_state = state["base_state"]
        self.momentum_buffer = state["momentum_buffer"]
        self.fine_tune_momentum = state.get("fine_tune_momentum", {})

    # ---- client ----------------------------------------------------------------------------
    def epoch_data(self, data: ClientData) -> tuple[int, int]:
        """One ``train_args.epochs`` epoch (with ``local_epochs: null``): the client's unlabeled set
        at ``train_args.batch_size`` (Algorithm 1's ClientUpdate epochs pass over the client's data,
        all of it unlabeled)."""
        return data.num_unlabeled, self.train.batch_size

    def client_update(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        n = data.num_unlabeled
        if n == 0:
            return Message()
        model = self.scratch_model(msg.weights, ctx.device)
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen = ctx.generator(data.client_id)
        extras = self._sbn_extras(model, pipeline, data)
        if self.config.pseudo_labels == "global":
            metrics, trained = self._train_global_labels(model, pipeline, data, gen, ctx, state)
        else:
            metrics, trained = self._train_batch_labels(model, pipeline, data, gen, ctx, state)
        if not trained:
            return Message(extras={"metrics": metrics})
        extras["metrics"] = metrics
        return Message(weights=cpu_state(model), num_samples=n, extras=extras)

    def _sbn_extras(self, model: nn.Module, pipeline: InputPipeline, data: ClientData) -> dict[str, Any]:
        """The reply's ``bn_sums`` under ``sbn: federated`` (the received model's statistics of the data)."""
        if self.config.sbn != "federated":
            return {}
        sums = bn_sums(model, pipeline, data.images, data.unlabeled_idx, self.sbn_batch_size)
        return {"bn_sums": sums} if sums else {}

    def client_updates_stacked(
        self, work: dict[int, tuple[Message, ClientData, dict]], ctx: ClientContext, max_stack: int = 0
    ) -> dict[int, Message]:
        """The round's clients' :meth:`client_update`, their fix + mix steps trained together.

        Each client pseudo-labels and makes its views as alone (the same draws from its own stream);
        its T steps become a :class:`~fedml_ssfl.stacked.LocalJob` with :class:`FixMixLoss` at the
        round's fixed rate (Nesterov SGD, clipped), and :func:`~fedml_ssfl.stacked.run_stacked`
        trains the jobs. Needs ``pseudo_labels: global`` and ``local_epochs: null`` (the config check).
        """
        replies = {k: Message() for k in work}
        jobs: list[LocalJob] = []
        pending: list[tuple[int, int, dict[str, Any], dict[str, Any]]] = []
        model = None
        for k, (msg, data, state) in work.items():
            if data.num_unlabeled == 0:
                continue
            model = self.scratch_model(msg.weights, ctx.device)
            pipeline = InputPipeline(self.data_info, ctx.device)
            gen = ctx.generator(data.client_id)
            extras = self._sbn_extras(model, pipeline, data)
            metrics, sets = self._global_labels(model, pipeline, data, gen)
            if sets is None:
                replies[k] = Message(extras={"metrics": metrics})
                continue
            jobs.append(self._fix_mix_job(msg, data, sets, pipeline, gen, ctx, state))
            pending.append((k, data.num_unlabeled, metrics, extras))
        if jobs:
            for (k, n, metrics, extras), res in zip(
                pending, run_stacked(jobs, model, self.train, ctx.round_idx, max_stack)
            ):
                if self.config.persistent_optimizer:
                    work[k][2]["momentum"] = res.momentum
                metrics.update(res.metrics)
                metrics["local_steps"] = float(self.train.local_steps)
                replies[k] = Message(weights=res.weights, num_samples=n, extras={**extras, "metrics": metrics})
        return replies

    def _fix_mix_job(
        self,
        msg: Message,
        data: ClientData,
        sets: FixMixSets,
        pipeline: InputPipeline,
        gen: torch.Generator,
        ctx: ClientContext,
        state: dict[str, Any],
    ) -> LocalJob:
        """A client's T fix + mix steps (:meth:`_global_label_steps`) as a job for the stacked path."""
        steps = self._global_label_steps(pipeline, data, sets, gen)

        def draw(s: int) -> dict[str, torch.Tensor]:
            y_fix, y_mix, (lam, x_strong, x_weak) = next(steps)
            device = x_strong.device
            lam_t = torch.tensor(lam, dtype=x_strong.dtype, device=device)
            return {
                "x_strong": x_strong,
                "x_weak": x_weak,
                "y_fix": y_fix.to(device),
                "y_mix": y_mix.to(device),
                "lam": lam_t,
            }

        return LocalJob(
            party=client_party(data.client_id),
            weights=msg.weights,
            draw=draw,
            loss=FixMixLoss(self.config.loss_lambda),
            steps=self.train.local_steps,
            momentum=state.get("momentum", {}) if self.config.persistent_optimizer else {},
            nesterov=self.config.nesterov and self.train.momentum > 0,
            clip_norm=self.config.clip_norm,
            lr=self.round_lr(ctx.round_idx),
        )

    def _step(
        self,
        model: nn.Module,
        pipeline: InputPipeline,
        images: torch.Tensor,
        fix_idx: torch.Tensor,
        y_fix: torch.Tensor,
        mix_idx: torch.Tensor,
        y_mix: torch.Tensor,
        gen: torch.Generator,
    ) -> Step:
        """One local step's loss, ``L_fix + lambda L_mix`` (Eq. 5/6), and its ``mix_lambda``.

        Draws ``lambda_mix``, then A(x_fix), then alpha(x_mix) from ``gen`` (:meth:`_views` of one step).
        """
        ((lam, x_strong, x_weak),) = self._views(pipeline, images, [(fix_idx, mix_idx)], gen)
        return self._loss(model, x_strong, x_weak, y_fix, y_mix, lam)

    def _views(
        self,
        pipeline: InputPipeline,
        images: torch.Tensor,
        steps: list[tuple[torch.Tensor, torch.Tensor]],
        gen: torch.Generator,
    ) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
        """Each step's ``(lambda_mix, A(x_fix), alpha(x_mix))`` for ``steps`` of ``(fix_idx, mix_idx)``
        (Eq. 5): ``x_mix = lambda_mix x_fix + (1 - lambda_mix) x_mix`` with the step's own ``lambda_mix``.

        Made together: the steps' ``lambda_mix`` (:func:`sample_mix_lambdas`), then A of all their fix
        images, then alpha of all their mixtures, each one call, all drawn from ``gen`` in that order.
        """
        sizes = [int(fix.numel()) for fix, _ in steps]
        lams = sample_mix_lambdas(self.config.mixup_alpha, len(steps), gen)
        x_fix = pipeline.raw(images[torch.cat([fix for fix, _ in steps])])  # strong copies it before changing it
        x_strong = pipeline.strong(x_fix, gen)
        weights = torch.tensor(lams, dtype=torch.float64).repeat_interleave(torch.tensor(sizes))
        mixed = mix_inputs(x_fix, pipeline.raw(images[torch.cat([mix for _, mix in steps])]), weights)
        x_weak = pipeline.weak(mixed, gen)
        return list(zip(lams, x_strong.split(sizes), x_weak.split(sizes)))

    def _loss(
        self,
        model: nn.Module,
        x_strong: torch.Tensor,
        x_weak: torch.Tensor,
        y_fix: torch.Tensor,
        y_mix: torch.Tensor,
        lam: float,
    ) -> Step:
        """``L_fix + lambda L_mix`` (Eq. 5/6) on a step's views (:meth:`_views`): :class:`FixMixLoss`."""
        batch = {"x_strong": x_strong, "x_weak": x_weak, "lam": lam}
        batch |= {"y_fix": y_fix.to(x_strong.device), "y_mix": y_mix.to(x_weak.device)}
        loss, aux = FixMixLoss(self.config.loss_lambda)(model, {}, {}, batch, 0)
        return Step(loss, aux["metrics"])

    def _train(
        self,
        model: nn.Module,
        step: Callable[[Any], Step | None],
        batches: Iterable[Any],
        ctx: ClientContext,
        party: str,
        state: dict[str, Any],
    ) -> dict[str, float]:
        """Client SGD (Nesterov, the round's rate, clipped gradients) over ``batches``; with
        ``persistent_optimizer`` continuing the momentum buffers in ``state`` and saving them back."""
        model.train()
        opt = self.make_sgd(model, self.round_lr(ctx.round_idx))
        if self.config.persistent_optimizer:
            load_momentum_buffers(opt, model, state.get("momentum", {}))
        phase = Phase(opt, step, clip_norm=self.config.clip_norm)
        metrics = run_steps(phase, batches, self.train, ctx.round_idx, party, lr="optimizer", count_as="local_steps")
        if self.config.persistent_optimizer:
            state["momentum"] = momentum_buffers(opt, model)
        return metrics

    def _train_global_labels(
        self,
        model: nn.Module,
        pipeline: InputPipeline,
        data: ClientData,
        gen: torch.Generator,
        ctx: ClientContext,
        state: dict[str, Any],
    ) -> tuple[dict[str, float], bool]:
        """Pseudo-label once with the received model (Eq. 2-4), then train on fix + mix."""
        metrics, sets = self._global_labels(model, pipeline, data, gen)
        if sets is None:
            return metrics, False

        def step(item: tuple[torch.Tensor, torch.Tensor, tuple[float, torch.Tensor, torch.Tensor]]) -> Step:
            y_fix, y_mix, (lam, x_strong, x_weak) = item
            return self._loss(model, x_strong, x_weak, y_fix, y_mix, lam)

        steps = self._global_label_steps(pipeline, data, sets, gen)
        metrics.update(self._train(model, step, steps, ctx, client_party(data.client_id), state))
        return metrics, True

    def _global_labels(
        self, model: nn.Module, pipeline: InputPipeline, data: ClientData, gen: torch.Generator
    ) -> tuple[dict[str, float], FixMixSets | None]:
        """Pseudo-label the client's data once with the received model (Eq. 2-4): the fix and mix sets
        (None when nothing is confident) and the metrics (mask rate, pseudo-label accuracies)."""
        n = data.num_unlabeled
        probs = predict_probs(model, pipeline, data.images, data.unlabeled_idx, gen, augment="weak")
        sets = fix_mix_sets(probs, self.config.threshold, gen)
        truth = data.labels[data.unlabeled_idx]
        metrics: dict[str, float] = {"mask_rate": sets.fix.numel() / n}
        acc_all = kept_accuracy(probs.argmax(dim=1), truth)
        if acc_all is not None:
            metrics["pseudo_acc_all"] = acc_all
        if sets.fix.numel() == 0:
            return metrics, None
        acc = kept_accuracy(sets.pseudo.labels, truth, sets.pseudo.mask)
        if acc is not None:
            metrics["pseudo_acc"] = acc
        return metrics, sets

    def _global_label_steps(
        self, pipeline: InputPipeline, data: ClientData, sets: FixMixSets, gen: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple[float, torch.Tensor, torch.Tensor]]]:
        """Each step's ``(y_fix, y_mix, views)``: the batches of :meth:`_fix_mix_batches`, their
        views made (:meth:`_views`) a chunk of steps at a time, as the steps come to them.

        A chunk is as many steps as make about :data:`VIEW_CHUNK_VALUES` input values (at least one):
        one strong and one weak call per chunk instead of one per step (16 steps of 64 MNIST images:
        one chunk). The chunks depend on the batch size and image shape only, so a config draws
        the same views on any machine.
        """
        ux = data.unlabeled_idx
        values = self.train.batch_size * math.prod(data.images.shape[1:])
        per_chunk = max(1, VIEW_CHUNK_VALUES // max(values, 1))
        batches = self._fix_mix_batches(sets.fix.numel(), gen)
        while chunk := list(itertools.islice(batches, per_chunk)):
            steps = [(ux[sets.fix[fb]], ux[sets.mix[mb]]) for fb, mb in chunk]
            views = self._views(pipeline, data.images, steps, gen)
            for (fb, mb), step_views in zip(chunk, views):
                yield sets.fix_labels[fb], sets.mix_labels[mb], step_views

    def _fix_mix_batches(self, n_fix: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Pairs of equal-size batches of positions into the fix and the mix set.

        ``local_epochs`` E: E epochs, each splitting both sets at random into batches of
        ``train_args.batch_size`` (Algorithm 1, ClientUpdate). None: ``train_args.local_steps``
        steps from reshuffled passes.
        """
        positions, bs = torch.arange(n_fix), self.train.batch_size
        if self.config.local_epochs is None:
            fix_stream, mix_stream = BatchStream(positions, bs, gen), BatchStream(positions, bs, gen)
            for _ in range(self.train.local_steps):
                yield next(fix_stream), next(mix_stream)
            return
        for _ in range(self.config.local_epochs):
            fix_order = positions[torch.randperm(n_fix, generator=gen)]
            mix_order = positions[torch.randperm(n_fix, generator=gen)]
            yield from zip(fix_order.split(bs), mix_order.split(bs))

    def _train_batch_labels(
        self,
        model: nn.Module,
        pipeline: InputPipeline,
        data: ClientData,
        gen: torch.Generator,
        ctx: ClientContext,
        state: dict[str, Any],
    ) -> tuple[dict[str, float], bool]:
        """Table 2 ablation: pseudo-label each batch with the model being trained, then train on the
        batch's confident samples (``batch_loss``: L_fix alone, the authors', or L_fix + lambda L_mix)."""
        bs = self.train.batch_size
        if self.config.local_epochs is None:
            stream = BatchStream(data.unlabeled_idx, bs, gen)
            batches: Iterator[torch.Tensor] = (next(stream) for _ in range(self.train.local_steps))
        else:
            batches = epoch_batches(data.unlabeled_idx, bs, self.config.local_epochs, gen)
        seen = kept = 0

        def step(b: torch.Tensor) -> Step | None:
            nonlocal seen, kept
            probs = predict_probs(model, pipeline, data.images, b, gen, augment="weak")
            sets = fix_mix_sets(probs, self.config.threshold, gen)
            seen += b.numel()
            if sets.fix.numel() == 0:
                return None  # no confident sample: no step
            kept += sets.fix.numel()
            model.train()
            if self.config.batch_loss == "fix":  # the authors' fix-batch: L_fix = CE(f(A(x)), y_hat) only
                x_strong = pipeline.strong(pipeline.raw(data.images[b[sets.fix]]), gen)
                loss = F.cross_entropy(model(x_strong), sets.fix_labels.to(x_strong.device))
                return Step(loss, {}, pseudo=sets.pseudo, truth=data.labels[b])
            out = self._step(
                model, pipeline, data.images, b[sets.fix], sets.fix_labels, b[sets.mix], sets.mix_labels, gen
            )
            return Step(out.loss, out.metrics, pseudo=sets.pseudo, truth=data.labels[b])  # pooled into pseudo_acc

        trained = self._train(model, step, batches, ctx, client_party(data.client_id), state)
        metrics: dict[str, float] = {"mask_rate": kept / max(seen, 1)}
        if not trained["local_steps"]:
            return metrics, False
        metrics.update(trained)
        return metrics, True
