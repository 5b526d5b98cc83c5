"""Training pieces every algorithm shares: batches, inputs, optimiser, the Eq. 9 schedule, the step loop.

:func:`run_steps` is the one local-step loop: it sets the learning rate, runs an algorithm's
step function (its losses from its batch), checks the loss is finite, takes the optimiser step
(``zero_grad``, ``backward``, optional gradient clipping, ``step``) and averages the step's
metrics, pseudo-label accuracy included. Every algorithm's client and server training goes
through it; :func:`supervised_steps` is the server's (and the supervised baselines') fine-tune on
labeled data, written once on top of it. Also FedProx's proximal term (:func:`proximal_term`).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .contract import DataInfo, TrainSettings, check_finite
from .data.augment import normalize, strong_augment, to_float, weak_augment
from .ssl.pseudo_label import PseudoLabels, label_hits


class BatchStream:
    """Endless mini-batches of indices: shuffled passes over ``idx``, one generator.

    Parameters
    ----------
    idx : torch.Tensor
        Indices to draw from (int64).
    batch_size : int
        Batch size; a pass shorter than this is served in full.
    generator : torch.Generator
        The only source of randomness.
    """

    def __init__(self, idx: torch.Tensor, batch_size: int, generator: torch.Generator):
        if idx.numel() == 0:
            raise ValueError("BatchStream: no samples to draw batches from")
        self.idx = idx
        self.batch_size = min(batch_size, idx.numel())
        self.generator = generator
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self._pos + self.batch_size > self._order.numel():
            self._order = self.idx[torch.randperm(self.idx.numel(), generator=self.generator)]
            self._pos = 0
        batch = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return batch


class InputPipeline:
    """Turns uint8 images into model inputs: weak/strong augmentation, then normalisation."""

    def __init__(self, info: DataInfo, device: torch.device):
        self.info = info
        self.device = device
        self._mean = info.mean
        self._std = info.std

    def raw(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float [0, 1] on the device, not yet normalised."""
        return to_float(images.to(self.device, non_blocking=True))

    def plain(self, images: torch.Tensor) -> torch.Tensor:
        """No augmentation (evaluation)."""
        return normalize(self.raw(images), self._mean, self._std)

    def weak(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """alpha(x): flip (where it suits the data) and pad-and-crop shift."""
        return normalize(weak_augment(self.raw(images), generator, flip=self.info.flip), self._mean, self._std)

    def strong(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A(x): RandAugment (2 ops, magnitude up to 10), then cutout."""
        return normalize(strong_augment(self.raw(images), generator, flip=self.info.flip), self._mean, self._std)


def make_optimizer(model: nn.Module, train: TrainSettings, nesterov: bool = False) -> torch.optim.SGD:
    """SGD with momentum and weight decay, as every paper here uses.

    ``nesterov`` switches on PyTorch's Nesterov momentum (``p -= lr * (d_p + m * buf)`` with
    ``buf = m * buf + d_p`` and ``d_p = grad + wd * p``), as Zhang et al.'s code uses; the
    default plain momentum is what every other caller gets.
    """
    return torch.optim.SGD(
        model.parameters(),
        lr=train.learning_rate,
        momentum=train.momentum,
        weight_decay=train.weight_decay,
        nesterov=nesterov,
    )


def momentum_buffers(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """The optimiser's momentum buffers as detached CPU copies keyed by parameter name.

    Parameters without a buffer (never stepped, or an optimiser without momentum) are left out,
    so the result can go into a client's persistent ``state`` or a checkpoint and come back
    through :func:`load_momentum_buffers` to continue the same momentum in a later round.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            out[name] = buf.detach().to("cpu", copy=True)
    return out


def load_momentum_buffers(optimizer: torch.optim.Optimizer, model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Seed ``optimizer`` with momentum buffers saved by :func:`momentum_buffers`.

    Each buffer is copied onto its parameter's device; names missing from ``buffers`` start
    without one (PyTorch then sets ``buf = d_p`` on the first step).

    Raises
    ------
    KeyError
        When ``buffers`` names a tensor the model does not have.
    """
    params = dict(model.named_parameters())
    for name, buf in buffers.items():
        if name not in params:
            raise KeyError(f"load_momentum_buffers: the model has no parameter '{name}'")
        p = params[name]
        optimizer.state[p]["momentum_buffer"] = buf.detach().to(device=p.device, dtype=p.dtype, copy=True)


def cosine_lr(train: TrainSettings, step: int) -> float:
    """The learning rate at local iteration ``step``: ``train.lr_schedule``.

    * ``cosine``, Zhang et al. Eq. 9: cosine decay with linear warm-up, floored at ``gamma * epsilon``,
      ``gamma_t = gamma * max(cos(pi * c * (t - w) / (total - w)), epsilon)``, where ``t`` counts
      local iterations (``round * T + s``), ``w = lr_warmup_rounds * T`` and ``total = comm_round *
      T``. During warm-up the rate grows linearly to ``gamma`` (Goyal et al., as the paper cites).
    * ``cosine_annealing``: PyTorch's ``CosineAnnealingLR`` to 0 (SemiFL's authors' schedule,
      stepped per round), ``gamma_t = gamma (1 + cos(pi (t - w) / (total - w))) / 2``, after the
      same warm-up; ``lr_cosine_c`` and ``lr_floor`` do not apply. (``cosine`` with c = 0.5 is
      ``cos(pi t / 2 total)``: another curve, 0.71 gamma at half-way where this one is 0.5 gamma.)
    * ``constant``: ``gamma``.
    """
    gamma = train.learning_rate
    if train.lr_schedule == "constant":
        return gamma
    total = max(train.comm_round * train.local_steps, 1)
    warm = train.lr_warmup_rounds * train.local_steps
    if step < warm:
        return gamma * (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
    if train.lr_schedule == "cosine_annealing":
        return gamma * (1.0 + math.cos(math.pi * frac)) / 2.0
    return gamma * max(math.cos(math.pi * train.lr_cosine_c * frac), train.lr_floor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """Load a (possibly CPU) state dict into ``model`` in place, strictly."""
    model.load_state_dict(weights, strict=True)
    return model


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the model's state dict (what goes into a message)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


@dataclass
class Step:
    """What an algorithm's step function returns for one local step.

    Attributes
    ----------
    loss : torch.Tensor
        The scalar to minimise (with gradient).
    metrics : dict[str, torch.Tensor or float]
        Diagnostics to average over the steps (tensors are read detached), e.g. the loss's terms
        or ``mask_rate``.
    pseudo : PseudoLabels, optional
        The step's pseudo-labels; with ``truth`` their accuracy where kept is pooled over the
        steps into ``pseudo_acc`` (a diagnostic: ``truth`` never reaches the loss).
    truth : torch.Tensor, optional
        The true labels of the pseudo-labelled samples (-1 where unknown, not counted).
    """

    loss: torch.Tensor
    metrics: Mapping[str, torch.Tensor | float] = field(default_factory=dict)
    pseudo: PseudoLabels | None = None
    truth: torch.Tensor | None = None


@dataclass
class Phase:
    """An optimiser and the step function whose loss it minimises, once per local step.

    ``step(item)`` gets the loop's item (the step index, or a batch when the loop runs over
    batches) and returns a :class:`Step`, or None to skip this optimiser this step. Its loss is
    averaged under ``loss_name``; ``clip_norm > 0`` clips the gradient's norm over the
    optimiser's parameters before the step.
    """

    optimizer: torch.optim.Optimizer
    step: Callable[[Any], Step | None]
    loss_name: str = "loss"
    clip_norm: float = 0.0


class MetricMeans:
    """Step sums of named metrics and pooled pseudo-label hits; :meth:`result` averages them."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.correct = 0
        self.counted = 0

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Add one step's ``value`` (a tensor is read detached) to the sum of ``name``."""
        value = float(value.detach()) if isinstance(value, torch.Tensor) else value
        self.sums[name] = self.sums.get(name, 0.0) + value

    def add_step(self, loss_name: str, out: Step) -> None:
        """Add a :class:`Step`: its loss under ``loss_name``, its metrics, its pseudo-label hits."""
        self.add(loss_name, out.loss)
        for name, value in out.metrics.items():
            self.add(name, value)
        if out.pseudo is not None and out.truth is not None:
            hit, counted = label_hits(out.pseudo.labels, out.truth, out.pseudo.mask)
            self.correct, self.counted = self.correct + hit, self.counted + counted

    def result(self, steps: int) -> dict[str, float]:
        """The step means, and ``pseudo_acc`` (kept pseudo-labels that were right) when any counted."""
        out = {k: v / steps for k, v in self.sums.items()}
        if self.counted:
            out["pseudo_acc"] = self.correct / self.counted
        return out


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``: every parameter's ``grad`` set to None, without the
    wrapper torch puts around ``zero_grad`` (a dynamo guard and a profiler range)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float) -> None:
    """``nn.utils.clip_grad_norm_(params, max_norm)`` (2-norm), bit for bit: the same foreach norms,
    norm of norms, ``max_norm / (total + 1e-6)`` clamped at 1 and foreach multiply. For gradients on one
    CPU or CUDA device and of one dtype it skips the per-call grouping by device and dtype (0.35 ->
    0.31 ms a step for cnn28 in a SemiFL round here); for float32 gradients on the CPU it also computes
    the coefficient on Python floats and skips the multiply by 1 (unclipped steps). Other gradients go
    to torch's own function."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    max_norm = float(max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    first = grads[0]
    if first.device.type not in ("cpu", "cuda") or any(
        type(g) is not torch.Tensor or g.device != first.device or g.dtype != first.dtype for g in grads
    ):
        nn.utils.clip_grad_norm_(params, max_norm)
        return
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    if first.device.type == "cpu" and first.dtype == torch.float32:
        # torch's coefficient ``max_norm / (total + 1e-6)`` clamped at 1 is, in float32, an add, a
        # reciprocal (``float / tensor``) and a multiply: each done here on Python floats and rounded
        # once to float32, which gives the float32 result (53 >= 2 * 24 + 2 bits), without four
        # tensor operations; a coefficient of 1 leaves the gradients as they are (x * 1 is x)
        coef = min(_f32(_f32(1.0 / _f32(float(total) + _f32(1e-6))) * _f32(max_norm)), 1.0)
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        return
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (beyond float32's range: infinity), as a Python float."""
    return array("f", (value,))[0]


def optimizer_step(
    optimizer: torch.optim.Optimizer, loss: torch.Tensor, round_idx: int, party: str, clip_norm: float = 0.0
) -> None:
    """One optimisation step on ``loss``: finiteness check, ``zero_grad``, ``backward``, clip, ``step``.

    Raises
    ------
    NonFiniteLossError
        When ``loss`` is NaN or infinite (nothing is changed then).
    """
    check_finite(loss, round_idx, party)
    clear_grads(optimizer)
    loss.backward()
    if clip_norm > 0:
        clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], clip_norm)
    optimizer.step()


def run_steps(
    phases: Phase | Sequence[Phase],
    steps: int | Iterable[Any],
    train: TrainSettings,
    round_idx: int,
    party: str,
    lr: Callable[[int], float] | str = "train",
    after_step: Callable[[int], None] | None = None,
    count_as: str | None = None,
) -> dict[str, float]:
    """The local-step loop every algorithm trains with; returns the step means of its metrics.

    For each step ``s`` (``steps`` of them, or one per item of an iterable, e.g. a client's epoch
    batches, consumed lazily) and each phase in order: set the phase's learning rate, call its
    step function, and take an :func:`optimizer_step` on the loss it returns. After the phases,
    ``after_step(s)`` (e.g. an EMA update). A step in which every phase returned None is not
    counted.

    Parameters
    ----------
    phases : Phase or sequence of Phase
        One optimiser and step function, or several run one after the other each step (e.g.
        FedMatch's sigma and psi).
    steps : int or iterable
        The number of steps (the step function gets the index), or the items to step over.
    train : TrainSettings
        The schedule's settings.
    round_idx : int
        The round (for the schedule and the error message of a non-finite loss).
    party : str
        Who trains, for the error message ("client 3", "the server").
    lr : callable or str
        ``"train"`` (default): Zhang et al. Eq. 9, :func:`cosine_lr` at the global local step
        ``round_idx * T + s``; a callable: ``lr(s)``; ``"optimizer"``: leave the rate the
        optimiser holds (a per-round constant the algorithm set).
    after_step : callable, optional
        Called with ``s`` after the step's optimiser steps.
    count_as : str, optional
        Also report the number of counted steps (a float) under this name.

    Returns
    -------
    dict[str, float]
        Means over the counted steps of each phase's loss (under its ``loss_name``), of every
        metric the steps returned, and ``pseudo_acc`` (pooled over the steps) when any
        pseudo-label with a known truth was kept.

    Raises
    ------
    NonFiniteLossError
        When a loss is NaN or infinite.
    """
    if lr not in ("train", "optimizer") and not callable(lr):
        raise ValueError(f"run_steps: lr must be 'train', 'optimizer' or a callable, got {lr!r}")
    phases = [phases] if isinstance(phases, Phase) else list(phases)
    items = range(steps) if isinstance(steps, int) else steps
    means = MetricMeans()
    taken = 0
    for s, item in enumerate(items):
        if lr == "optimizer":
            rate = None
        else:
            rate = lr(s) if callable(lr) else cosine_lr(train, round_idx * train.local_steps + s)
        took = False
        for phase in phases:
            if rate is not None:
                set_lr(phase.optimizer, rate)
            out = phase.step(item)
            if out is None:
                continue
            optimizer_step(phase.optimizer, out.loss, round_idx, party, phase.clip_norm)
            means.add_step(phase.loss_name, out)
            took = True
        if took:
            taken += 1
            if after_step is not None:
                after_step(s)
    metrics = means.result(taken)
    if count_as is not None:
        metrics[count_as] = float(taken)
    return metrics


def supervised_steps(
    model: nn.Module,
    pipeline: InputPipeline,
    images: torch.Tensor,
    labels: torch.Tensor,
    idx: torch.Tensor,
    train: TrainSettings,
    round_idx: int,
    generator: torch.Generator,
    party: str,
    steps: int | None = None,
    augment: str = "weak",
    loss_weight: float = 1.0,
    optimizer: torch.optim.Optimizer | None = None,
    batches: Iterable[torch.Tensor] | None = None,
    clip_norm: float = 0.0,
    after_step: Callable[[int], None] | None = None,
    lr: Callable[[int], float] | str = "train",
) -> float:
    """T steps of cross-entropy on labeled data (Zhang et al. Eq. 2); returns the mean loss.

    The supervised fine-tune, written once: the server's step of every algorithm that trains on
    its labels, and the supervised baselines' clients. Each step draws a batch of ``idx``
    (reshuffled passes, :class:`BatchStream`), or takes the next of ``batches`` when given (e.g.
    SemiFL's epochs; ``steps`` is then unused).

    ``augment`` is ``weak`` (alpha(x)) or ``plain`` (the original images); ``loss_weight``
    multiplies the cross-entropy (FedMatch Table 4's lambda_s). The returned mean is of the
    weighted loss. ``optimizer`` (over ``model``'s parameters) replaces the fresh
    :func:`make_optimizer` SGD, e.g. one whose momentum persists across rounds; its learning
    rate is set each step by :func:`cosine_lr` all the same, unless ``lr`` says otherwise
    (:func:`run_steps`). ``clip_norm`` and ``after_step`` are those of :class:`Phase` and
    :func:`run_steps`.
    """
    steps = train.local_steps if steps is None else steps
    model.train()
    opt = make_optimizer(model, train) if optimizer is None else optimizer
    if batches is None:
        stream = BatchStream(idx, train.batch_size, generator)
        batches = (next(stream) for _ in range(steps))

    def step(batch: torch.Tensor) -> Step:
        x = pipeline.weak(images[batch], generator) if augment == "weak" else pipeline.plain(images[batch])
        y = labels[batch].to(pipeline.device)
        return Step(loss_weight * nn.functional.cross_entropy(model(x), y))

    phase = Phase(opt, step, clip_norm=clip_norm)
    return run_steps(phase, batches, train, round_idx, party, lr=lr, after_step=after_step).get("loss", 0.0)


def proximal_term(
    model: nn.Module | Mapping[str, torch.Tensor], global_weights: dict[str, torch.Tensor], mu: float
) -> torch.Tensor:
    """FedProx's proximal term ``mu/2 * ||w - w^t||^2`` (Li et al. 2020, Eq. 2).

    The sum runs over the model's trainable parameters (buffers such as BatchNorm statistics
    are not trained and so not pulled). ``global_weights`` is the global model ``w^t`` the round
    started from, a state dict keyed like ``model.named_parameters()``; move it to the model's
    device once per round to avoid a copy per step. The FedMatch authors' code names a FedProx
    baseline but lacks this term; here it is real (Jeong et al. Table 4: mu = 1e-2). ``model`` may
    also be the parameters themselves by name (a functional step, :mod:`fedml_ssfl.stacked`).

    Returns
    -------
    torch.Tensor
        A scalar with gradient w.r.t. the parameters; exactly 0 when ``mu == 0``.

    Raises
    ------
    KeyError
        When ``global_weights`` lacks a trainable parameter's name.
    """
    named = model.named_parameters() if isinstance(model, nn.Module) else model.items()
    params = [(name, p) for name, p in named if p.requires_grad]
    if mu == 0 or not params:
        return torch.zeros((), device=params[0][1].device if params else None)
    total = torch.zeros((), device=params[0][1].device)
    for name, p in params:
        if name not in global_weights:
            raise KeyError(f"proximal_term: the global weights have no tensor '{name}'")
        ref = global_weights[name].to(device=p.device, dtype=p.dtype)
        total = total + (p - ref).pow(2).sum()
    return 0.5 * mu * total
