"""Training pieces every algorithm shares: batches, inputs, optimiser, the Eq. 9 schedule.

Also FedProx's proximal term and the FixMatch / UDA local step loop of the naive FL+SSL
baselines (:func:`proximal_term`, :func:`semi_supervised_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .algorithms.base import DataInfo, TrainSettings
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
    """Zhang et al. Eq. 9: cosine decay with linear warm-up, floored at ``gamma * epsilon``.

    ``gamma_t = gamma * max(cos(pi * c * (t - w) / (total - w)), epsilon)`` where ``t`` counts
    local iterations (``round * T + s``), ``w = lr_warmup_rounds * T`` and
    ``total = comm_round * T``. During warm-up the rate grows linearly to ``gamma``
    (Goyal et al., as the paper cites).
    """
    gamma = train.learning_rate
    if train.lr_schedule == "constant":
        return gamma
    total = max(train.comm_round * train.local_steps, 1)
    warm = train.lr_warmup_rounds * train.local_steps
    if step < warm:
        return gamma * (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
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
) -> float:
    """T steps of cross-entropy on labeled data (Zhang et al. Eq. 2); returns the mean loss.

    ``augment`` is ``weak`` (alpha(x)) or ``plain`` (the original images); ``loss_weight``
    multiplies the cross-entropy (FedMatch Table 4's lambda_s). The returned mean is of the
    weighted loss. ``optimizer`` (over ``model``'s parameters) replaces the fresh
    :func:`make_optimizer` SGD, e.g. one whose momentum persists across rounds; its learning
    rate is set each step by :func:`cosine_lr` all the same.
    """
    from .algorithms.base import check_finite

    steps = train.local_steps if steps is None else steps
    model.train()
    opt = make_optimizer(model, train) if optimizer is None else optimizer
    stream = BatchStream(idx, train.batch_size, generator)
    total = 0.0
    for s in range(steps):
        set_lr(opt, cosine_lr(train, round_idx * train.local_steps + s))
        batch = next(stream)
        x = pipeline.weak(images[batch], generator) if augment == "weak" else pipeline.plain(images[batch])
        y = labels[batch].to(pipeline.device)
        loss = loss_weight * nn.functional.cross_entropy(model(x), y)
        check_finite(loss, round_idx, party)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total / max(steps, 1)


def proximal_term(model: nn.Module, global_weights: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's proximal term ``mu/2 * ||w - w^t||^2`` (Li et al. 2020, Eq. 2).

    The sum runs over the model's trainable parameters (buffers such as BatchNorm statistics
    are not trained and so not pulled). ``global_weights`` is the global model ``w^t`` the round
    started from, a state dict keyed like ``model.named_parameters()``; move it to the model's
    device once per round to avoid a copy per step. The FedMatch authors' code names a FedProx
    baseline but lacks this term; here it is real (Jeong et al. Table 4: mu = 1e-2).

    Returns
    -------
    torch.Tensor
        A scalar with gradient w.r.t. the parameters; exactly 0 when ``mu == 0``.

    Raises
    ------
    KeyError
        When ``global_weights`` lacks a trainable parameter's name.
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if mu == 0 or not params:
        return torch.zeros((), device=params[0][1].device if params else None)
    total = torch.zeros((), device=params[0][1].device)
    for name, p in params:
        if name not in global_weights:
            raise KeyError(f"proximal_term: the global weights have no tensor '{name}'")
        ref = global_weights[name].to(device=p.device, dtype=p.dtype)
        total = total + (p - ref).pow(2).sum()
    return 0.5 * mu * total


def semi_supervised_steps(
    model: nn.Module,
    pipeline: InputPipeline,
    images: torch.Tensor,
    labels: torch.Tensor,
    labeled_idx: torch.Tensor,
    unlabeled_idx: torch.Tensor,
    train: TrainSettings,
    round_idx: int,
    generator: torch.Generator,
    party: str,
    unlabeled_loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, PseudoLabels]] | None = None,
    lambda_u: float = 1.0,
    unlabeled_batch_size: int | None = None,
    labeled_loss: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    anchor: dict[str, torch.Tensor] | None = None,
    mu: float = 0.0,
    lambda_s: float = 1.0,
    weak_view: str = "weak",
) -> dict[str, float]:
    """T local steps of ``lambda_s l_s + lambda_u l_u (+ FedProx term)``: FixMatch / UDA on one client.

    Each step draws a labeled batch of ``batch_size`` (view ``weak_view``, target: its labels)
    and an unlabeled batch of ``unlabeled_batch_size`` (default ``batch_size``) shown twice, as
    the weak view and as A(u). ``weak_view`` is ``weak`` (flip-and-shift alpha, FixMatch) or
    ``plain`` (the original images, as FedMatch's authors ran FixMatch and UDA, Appendix A.1).
    All views go through the model in one forward pass, as in FixMatch's code, so normalisation
    layers see one batch. ``unlabeled_loss(logits_strong, logits_weak)`` returns the unlabeled
    loss and its pseudo-labels; the weak logits are handed over detached. A half with no samples
    (or, for the unlabeled half, no ``unlabeled_loss``) is skipped. ``labeled_idx`` is the only
    place labels are read for training; ``labels`` at ``unlabeled_idx`` only feed the
    ``pseudo_acc`` diagnostic.

    Parameters
    ----------
    labeled_loss : callable, optional
        ``(logits, labels, step) -> loss`` with ``step = round_idx * T + s`` the global local
        iteration (for UDA's TSA); default plain cross-entropy.
    anchor, mu : dict, float
        FedProx: add :func:`proximal_term` towards ``anchor`` (the round's global weights) with
        coefficient ``mu``; skipped when ``anchor`` is None or ``mu == 0``.
    lambda_s : float
        Weight of the labeled loss (FedMatch Table 4: 10 for every method).

    Returns
    -------
    dict[str, float]
        Step means of ``loss``, ``loss_x`` (weighted by ``lambda_s``), ``loss_u``, ``mask_rate``,
        ``prox`` (those that apply) and ``pseudo_acc`` (accuracy of the kept pseudo-labels, when
        any was kept).

    Raises
    ------
    ValueError
        When neither half has anything to train on.
    """
    from .algorithms.base import check_finite

    use_x = labeled_idx.numel() > 0
    use_u = unlabeled_idx.numel() > 0 and unlabeled_loss is not None
    if not (use_x or use_u):
        raise ValueError(f"semi_supervised_steps: {party} has no labeled and no usable unlabeled samples")
    device = pipeline.device
    model.train()
    opt = make_optimizer(model, train)
    stream_x = BatchStream(labeled_idx, train.batch_size, generator) if use_x else None
    if weak_view not in ("weak", "plain"):
        raise ValueError(f"semi_supervised_steps: weak_view {weak_view!r} is not 'weak' or 'plain'")
    view = pipeline.weak if weak_view == "weak" else (lambda imgs, gen: pipeline.plain(imgs))
    stream_u = BatchStream(unlabeled_idx, unlabeled_batch_size or train.batch_size, generator) if use_u else None
    prox_on = anchor is not None and mu != 0
    if prox_on:
        anchor = {k: v.to(device) for k, v in anchor.items()}
    if labeled_loss is None:

        def labeled_loss(logits: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
            return nn.functional.cross_entropy(logits, y)

    sums: dict[str, float] = {}
    correct = kept = 0
    steps = train.local_steps
    for s in range(steps):
        step = round_idx * train.local_steps + s
        set_lr(opt, cosine_lr(train, step))
        views, y, batch_u = [], None, None
        if stream_x is not None:
            batch_x = next(stream_x)
            views.append(view(images[batch_x], generator))
            y = labels[batch_x].to(device)
        if stream_u is not None:
            batch_u = next(stream_u)
            views.append(view(images[batch_u], generator))
            views.append(pipeline.strong(images[batch_u], generator))
        logits = model(torch.cat(views))
        parts: dict[str, torch.Tensor] = {}
        n_x = 0
        if y is not None:
            n_x = y.numel()
            parts["loss_x"] = lambda_s * labeled_loss(logits[:n_x], y, step)
        pl = None
        if batch_u is not None:
            logits_weak, logits_strong = logits[n_x:].chunk(2)
            parts["loss_u"], pl = unlabeled_loss(logits_strong, logits_weak.detach())
        loss = parts.get("loss_x", torch.zeros((), device=device)) + lambda_u * parts.get(
            "loss_u", torch.zeros((), device=device)
        )
        if prox_on:
            parts["prox"] = proximal_term(model, anchor, mu)
            loss = loss + parts["prox"]
        check_finite(loss, round_idx, party)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach())
        if pl is not None:
            sums["mask_rate"] = sums.get("mask_rate", 0.0) + pl.mask_rate
            hit, counted = label_hits(pl.labels, labels[batch_u], pl.mask)
            correct, kept = correct + hit, kept + counted
    metrics = {k: v / steps for k, v in sums.items()}
    if kept:
        metrics["pseudo_acc"] = correct / kept
    return metrics
