"""Local training as a job: one client alone (:func:`run_job`), or many clients stacked (:func:`run_stacked`).

A :class:`LocalJob` describes one client's local training so that it can run either way with the
same code:

* ``draw(s)`` makes step ``s``'s batch: a dict of tensors (the inputs, already augmented, and their
  targets). It is the only place the client's random stream is read, so calling it for
  s = 0, 1, ... gives the same batches whether the client trains alone or beside others. The
  batch may carry the true labels of its unlabeled samples under :data:`TRUTH`; they are taken out
  before the loss sees the batch and only count the pseudo-labels that were right (a diagnostic).
* ``loss(forward, params, consts, batch, s)`` is a pure function: the scalar loss and an ``aux``
  dict (``aux["metrics"]``: scalar tensors to average over the steps; ``pseudo_labels``,
  ``pseudo_confidence`` and ``pseudo_mask`` for the pseudo-label accuracy). ``forward(x)`` is the
  model's output on ``x``, ``params`` the trainable parameters by name (e.g. for FedProx's term),
  ``consts`` the job's constant tensors (e.g. the round's global weights, a per-step weight read as
  ``consts["beta"][s]``). No Python decision may depend on a tensor's values, and no random draw
  may happen inside (dropout is refused).
* ``weights``, ``momentum``: where the client starts (a state dict; its optimiser's momentum
  buffers, empty for a fresh optimiser).
* ``lr``: the learning rate of every step (e.g. SemiFL's rate fixed for the round), one rate per
  step (a tuple), or None for Eq. 9's rate at each step.
* ``follower``: optionally a second net that follows the trained one by an EMA after every step
  (FedSiam's target net, Eq. 9): the loss reads its output through ``forward.follower(x)``
  (:class:`Follower`, :class:`StepNets`).

:func:`run_job` trains a model in place with :func:`~fedml_ssfl.training.run_steps` and
``torch.optim.SGD`` (:func:`~fedml_ssfl.training.make_optimizer`): the one-after-another path.

:func:`run_stacked` trains several jobs at once: their parameters, buffers (BatchNorm statistics
included), momentum buffers and batches are stacked along a new leading client dimension,
``torch.func.vmap`` maps ``torch.func.grad_and_value`` of the loss (through
``torch.func.functional_call``) over it, and the SGD step (momentum, Nesterov, weight decay,
gradient clipping) is written out on the stacked tensors exactly as ``torch.optim.SGD`` and
``clip_grad_norm_`` compute it. The learning rate of step ``s`` is Eq. 9's, as in
:func:`~fedml_ssfl.training.run_steps` (``lr="train"``), unless the job gives a fixed rate or one
per step (``lr``). A job's :class:`Follower` is a second stacked set of parameters and buffers,
updated after each step by :func:`~fedml_ssfl.ssl.ema.ema_update_stacked` with each client's decay.
Results equal the one-after-another path's up to floating-point summation order (batched
GroupNorm and linear layers add in another order): about 1e-7 a step, below 1e-6 after the
tests' rounds (``tests/test_stacked.py``). Over long runs a value within rounding of a ReLU's or
max-pool's decision now and then falls the other way, that step's gradient differs by up to ~1e-3
in a few weights, and the paths drift apart (1e-4 to 6e-4 after 60 steps; changing torch's thread
count moves the one-after-another path by up to 5e-4 alike: ``benchmarks/stacked_clients.py``,
docs/performance.md).

Jobs that cannot share a stack (another batch shape, e.g. a client with fewer samples than the
batch size; another step count, loss, rate, set of momentum buffers, or a follower where the other
has none) are put in separate groups, each
trained stacked; nothing is padded or masked, so no step is wasted and none is approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from .contract import TrainSettings, check_finite
from .errors import ConfigError
from .models.layout import inputs_keep_strides
from .ssl.ema import ema_pairs, ema_update, ema_update_stacked
from .ssl.pseudo_label import PseudoLabels
from .training import (
    BatchStream,
    InputPipeline,
    MetricMeans,
    Phase,
    Step,
    cosine_lr,
    cpu_state,
    load_momentum_buffers,
    make_optimizer,
    momentum_buffers,
    run_steps,
)

TRUTH = "truth"
"""Batch key of the true labels of a step's unlabeled samples (diagnostics only; never reaches the loss)."""

Tree = Any
"""A tensor or a dict of trees (what a batch or ``consts`` holds)."""

StepLoss = Callable[[Callable[[torch.Tensor], torch.Tensor], Mapping[str, torch.Tensor], Tree, Tree, int], tuple]
"""``loss(forward, params, consts, batch, s) -> (loss, aux)``, see the module docstring."""


@dataclass
class Follower:
    """A net that follows the trained one by an exponential moving average (FedSiam's target, Eq. 9).

    It starts from ``weights`` and runs in train mode without gradient (its BatchNorm statistics
    move with the batches it sees); the step loss reads its output through
    ``forward.follower(x)`` (:class:`StepNets`). After step ``s`` each floating state tensor
    becomes ``alphas[s] f + (1 - alphas[s]) theta`` of the trained net's, integer buffers are
    copied (:func:`~fedml_ssfl.ssl.ema.ema_update`; ``alphas[s] = 0`` copies).

    Attributes
    ----------
    weights : dict[str, torch.Tensor]
        The state dict the follower starts from.
    alphas : torch.Tensor
        float64, shape (steps,): the EMA decay after each step (per client, so not shared by a stack).
    """

    weights: dict[str, torch.Tensor]
    alphas: torch.Tensor


class StepNets:
    """What a step loss calls as ``forward``: ``forward(x)`` is the trained net's output on ``x``,
    ``forward.eval(x)`` the same net's in eval mode (BatchNorm on its running statistics, dropout
    off) without gradient, ``forward.follower(x)`` the job's :class:`Follower`'s (without gradient)."""

    def __init__(
        self,
        net: Callable[[torch.Tensor], torch.Tensor],
        follower: Callable | None = None,
        module: nn.Module | None = None,
    ) -> None:
        self._net, self._follower, self._module = net, follower, module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._net(x)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """The trained net's output on ``x`` in eval mode, detached; the module's mode is restored."""
        if self._module is None:
            raise ValueError("forward.eval: no module to switch to eval mode (StepNets(module=None))")
        was_training = self._module.training
        self._module.eval()
        try:
            return self._net(x).detach()
        finally:
            self._module.train(was_training)

    def follower(self, x: torch.Tensor) -> torch.Tensor:
        if self._follower is None:
            raise ValueError("forward.follower: this job has no Follower (LocalJob.follower is None)")
        with torch.no_grad():
            return self._follower(x)


@dataclass
class LocalJob:
    """One client's local training, described so that it runs alone or stacked with others.

    Attributes
    ----------
    party : str
        Who trains, for error messages ("client 3").
    weights : dict[str, torch.Tensor]
        The state dict the client starts from (parameters and buffers).
    draw : callable
        ``draw(s)``: step ``s``'s batch, a dict of tensors (see the module docstring).
    loss : callable
        The pure step loss (see :data:`StepLoss`). Jobs stacked together share it: it must compare
        equal across them (a bound method, or a dataclass of the hyper-parameters).
    steps : int
        The number of local steps.
    momentum : dict[str, torch.Tensor]
        Momentum buffers to continue, by parameter name (empty: a fresh optimiser).
    nesterov : bool
        Nesterov momentum.
    clip_norm : float
        > 0: clip the gradient's norm (over all parameters) before each step.
    consts : dict
        Constant tensors handed to ``loss`` (e.g. FedProx's anchor), per client.
    loss_name : str
        The name the loss is averaged under.
    lr : float or tuple of float, optional
        The learning rate of every step, or of each step (a tuple of ``steps`` rates); None
        (default): Eq. 9's rate at each step.
    follower : Follower, optional
        A net that follows the trained one by an EMA after each step (FedSiam's target).
    notes : dict
        What the algorithm keeps from building the job for its reply (e.g. FedSiam's ramp values
        of the last step); the trainers ignore it.
    """

    party: str
    weights: dict[str, torch.Tensor]
    draw: Callable[[int], dict[str, Tree]]
    loss: StepLoss
    steps: int
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    nesterov: bool = False
    clip_norm: float = 0.0
    consts: dict[str, Tree] = field(default_factory=dict)
    loss_name: str = "loss"
    lr: float | tuple[float, ...] | None = None
    follower: Follower | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def rate(self, train: TrainSettings, round_idx: int, s: int) -> float:
        """Step ``s``'s learning rate: the job's own, or Eq. 9's at the global local step."""
        if self.lr is None:
            return cosine_lr(train, round_idx * train.local_steps + s)
        return self.lr[s] if isinstance(self.lr, tuple) else self.lr


@dataclass
class JobResult:
    """What a job ends with: CPU copies of the weights and momentum buffers, the step means, and the
    follower's weights (None without a follower)."""

    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    metrics: dict[str, float]
    follower: dict[str, torch.Tensor] | None = None


# ---- one job alone -----------------------------------------------------------------------------


def _tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Tree) -> Tree:
    if isinstance(tree, Mapping):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def split_truth(batch: Mapping[str, Tree]) -> tuple[dict[str, Tree], torch.Tensor | None]:
    """A batch without its :data:`TRUTH` entry, and that entry (None when absent)."""
    batch = dict(batch)
    return batch, batch.pop(TRUTH, None)


def job_step(job: LocalJob, model: nn.Module, follower: nn.Module | None = None) -> Callable[[int], Step]:
    """The step function of ``job`` on ``model`` (for :class:`~fedml_ssfl.training.Phase`).

    ``follower``: the model holding the job's :class:`Follower` (when it has one).
    """
    device = next(model.parameters()).device
    consts = _tree_map(lambda t: t.to(device), job.consts)
    params = dict(model.named_parameters())  # the optimiser updates them in place
    nets = StepNets(model, follower, module=model)

    def step(s: int) -> Step:
        batch, truth = split_truth(job.draw(s))
        loss, aux = job.loss(nets, params, consts, batch, s)
        pseudo = None
        if "pseudo_mask" in aux:
            pseudo = PseudoLabels(aux["pseudo_labels"], aux["pseudo_confidence"], aux["pseudo_mask"])
        return Step(loss, aux.get("metrics", {}), pseudo=pseudo, truth=truth)

    return step


def run_job(
    job: LocalJob, model: nn.Module, train: TrainSettings, round_idx: int, follower: nn.Module | None = None
) -> JobResult:
    """Train ``model`` (which must hold ``job.weights``) through ``job``, one step after another.

    SGD from :func:`~fedml_ssfl.training.make_optimizer` continuing ``job.momentum``, the steps by
    :func:`~fedml_ssfl.training.run_steps` at Eq. 9's learning rate (or the job's ``lr``). A job
    with a :class:`Follower` needs ``follower``, a model holding ``job.follower.weights``; after
    each step it follows ``model`` by :func:`~fedml_ssfl.ssl.ema.ema_update`.

    Raises
    ------
    NonFiniteLossError
        When a loss is NaN or infinite.
    """
    if (job.follower is None) != (follower is None):
        has = "has a" if job.follower else "has no"
        raise ValueError(f"run_job: {job.party}'s job {has} follower; pass a follower model exactly when it has one")
    model.train()
    opt = make_optimizer(model, train, nesterov=job.nesterov)
    if job.momentum:
        load_momentum_buffers(opt, model, job.momentum)
    phase = Phase(opt, job_step(job, model, follower), loss_name=job.loss_name, clip_norm=job.clip_norm)
    after_step = None
    if follower is not None:
        follower.train()
        pairs, alphas = ema_pairs(follower, model), job.follower.alphas.tolist()

        def after_step(s: int) -> None:
            ema_update(pairs, alphas[s])  # FedSiam Eq. 9

    rate = lambda s: job.rate(train, round_idx, s)  # noqa: E731
    metrics = run_steps(phase, job.steps, train, round_idx, job.party, lr=rate, after_step=after_step)
    return JobResult(
        weights=cpu_state(model),
        momentum=momentum_buffers(opt, model),
        metrics=metrics,
        follower=cpu_state(follower) if follower is not None else None,
    )


@dataclass(frozen=True)
class CrossEntropyLoss:
    """The supervised step loss: ``loss_weight`` x cross-entropy of ``forward(batch["x"])`` on ``batch["y"]``."""

    loss_weight: float = 1.0

    def __call__(self, forward: Callable, params: Mapping, consts: Tree, batch: Tree, s: int) -> tuple:
        return self.loss_weight * F.cross_entropy(forward(batch["x"]), batch["y"]), {}


def supervised_job(
    pipeline: InputPipeline,
    images: torch.Tensor,
    labels: torch.Tensor,
    idx: torch.Tensor,
    train: TrainSettings,
    generator: torch.Generator,
    party: str,
    weights: dict[str, torch.Tensor],
    augment: str = "weak",
    loss_weight: float = 1.0,
) -> LocalJob:
    """T steps of cross-entropy on labeled ``idx`` as a :class:`LocalJob`.

    The same batches, views and loss as :func:`~fedml_ssfl.training.supervised_steps` draws from
    ``generator`` (reshuffled passes of ``train.batch_size``; ``augment`` ``weak`` or ``plain``).
    """
    stream = BatchStream(idx, train.batch_size, generator)

    def draw(s: int) -> dict[str, torch.Tensor]:
        batch = next(stream)
        x = pipeline.weak(images[batch], generator) if augment == "weak" else pipeline.plain(images[batch])
        return {"x": x, "y": labels[batch].to(pipeline.device)}

    return LocalJob(party, weights, draw, CrossEntropyLoss(loss_weight), train.local_steps)


# ---- many jobs stacked --------------------------------------------------------------------------


def refuse_random_layers(model: nn.Module) -> None:
    """Raise :class:`ConfigError` when ``model`` draws random numbers in training (dropout).

    One-after-another training draws each client's dropout masks from its own seeded stream;
    stacked training cannot draw them the same way.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ConfigError(
                f"train_args.stack_clients: the model has dropout ({name}), whose random masks stacked clients "
                "cannot draw as one-after-another training does; set train_args.stack_clients: false or use a "
                "model without dropout"
            )


def stack_trees(trees: Sequence[Tree], device: torch.device) -> Tree:
    """Stack equal-shaped trees along a new leading dimension, on ``device``."""
    if isinstance(trees[0], Mapping):
        return {k: stack_trees([t[k] for t in trees], device) for k in trees[0]}
    return torch.stack(list(trees)).to(device)  # one copy to the device for host-side tensors


def tree_shapes(tree: Tree) -> Any:
    """The shapes and dtypes of a tree's tensors, comparable with ``==`` (what a stack must share)."""
    if isinstance(tree, Mapping):
        return tuple((k, tree_shapes(tree[k])) for k in sorted(tree))
    return (tuple(tree.shape), tree.dtype)


def _signature(job: LocalJob, first: Mapping[str, Tree]) -> tuple:
    """What jobs must share to train in one stack (compared with ``==``)."""
    return (
        job.steps,
        job.nesterov,
        job.clip_norm,
        job.loss_name,
        job.loss,
        job.lr,
        tuple(sorted(job.momentum)),
        job.follower is None,
        tree_shapes(dict(first)),
        tree_shapes(job.consts),
    )


def stack_groups(
    jobs: Sequence[Any],
    firsts: Sequence[Mapping[str, Tree]],
    max_stack: int = 0,
    signature: Callable[[Any, Mapping[str, Tree]], tuple] = _signature,
) -> list[list[int]]:
    """Indices of ``jobs`` grouped by what a stack must share, in first-appearance order.

    ``firsts`` are the jobs' step-0 batches (their shapes decide). ``max_stack > 0`` splits a
    group into stacks of at most that many jobs (memory; CPU caches); 0: no limit.
    ``signature(job, first)`` is what jobs of one stack must share (for :class:`LocalJob`: steps,
    optimiser settings, loss, rates, momentum buffers, whether it has a follower, batch and
    constant shapes).
    """
    keys: list[tuple] = []
    groups: list[list[int]] = []
    for i, (job, first) in enumerate(zip(jobs, firsts)):
        key = signature(job, first)
        for g, other in enumerate(keys):
            if other == key:
                groups[g].append(i)
                break
        else:
            keys.append(key)
            groups.append([i])
    if max_stack > 0:
        groups = [g[i : i + max_stack] for g in groups for i in range(0, len(g), max_stack)]
    return groups


class StackedMeans:
    """:class:`~fedml_ssfl.training.MetricMeans` for C clients at once: sums kept on the device in float64."""

    def __init__(self, clients: int, device: torch.device) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.correct = torch.zeros(clients, dtype=torch.long, device=device)
        self.counted = torch.zeros(clients, dtype=torch.long, device=device)

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64)
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def add_pseudo(self, aux: Mapping[str, torch.Tensor], truth: torch.Tensor) -> None:
        truth = truth.to(self.correct.device)
        keep = aux["pseudo_mask"] & (truth >= 0)
        self.correct += ((aux["pseudo_labels"] == truth) & keep).sum(dim=1)
        self.counted += keep.sum(dim=1)

    def results(self, steps: int) -> list[dict[str, float]]:
        sums = {k: v.cpu().tolist() for k, v in self.sums.items()}
        correct, counted = self.correct.cpu().tolist(), self.counted.cpu().tolist()
        out = []
        for i in range(len(correct)):
            # the same float64 sums MetricMeans keeps; MetricMeans.result divides them alike
            means = MetricMeans()
            means.sums = {k: v[i] for k, v in sums.items()}
            means.correct, means.counted = correct[i], counted[i]
            out.append(means.result(steps))
        return out


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """``clip_grad_norm_`` per client: scale each client's gradients so their joint 2-norm is <= max_norm."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()], dim=1)
    total = torch.linalg.vector_norm(norms, dim=1)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {n: g * coef.view(-1, *[1] * (g.ndim - 1)) for n, g in grads.items()}


@torch.no_grad()
def sgd_update(
    params: dict[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    lr: float,
    train: TrainSettings,
    nesterov: bool,
) -> None:
    """One ``torch.optim.SGD`` step on stacked tensors, in place (dampening 0, not maximising).

    ``d = g + wd * p``; with momentum ``m > 0``: ``buf = d`` at first (a parameter missing from
    ``buffers``), else ``buf = m * buf + d``, and ``d = d + m * buf`` (Nesterov) or ``d = buf``;
    then ``p -= lr * d``. Elementwise, so each client's slice gets exactly its own SGD step.
    """
    wd, m = train.weight_decay, train.momentum
    for name, p in params.items():
        d = grads[name]
        if wd != 0:
            d = d.add(p, alpha=wd)
        if m != 0:
            buf = buffers.get(name)
            if buf is None:
                buf = buffers[name] = d.clone()
            else:
                buf.mul_(m).add_(d)
            d = d.add(buf, alpha=m) if nesterov else buf
        p.add_(d, alpha=-lr)


def _train_group(
    jobs: Sequence[LocalJob], first: list[dict[str, Tree]], model: nn.Module, train: TrainSettings, round_idx: int
) -> list[JobResult]:
    """Train jobs that share a :func:`_signature` as one stack."""
    device = next(model.parameters()).device
    lead = jobs[0]
    state_keys = list(model.state_dict().keys())
    param_names = [n for n, _ in model.named_parameters()]
    buffer_names = [k for k in state_keys if k not in set(param_names)]
    params = {n: stack_trees([j.weights[n] for j in jobs], device) for n in param_names}
    buffers = {n: stack_trees([j.weights[n] for j in jobs], device) for n in buffer_names}
    moms = {n: stack_trees([j.momentum[n] for j in jobs], device) for n in param_names if n in lead.momentum}
    consts = stack_trees([j.consts for j in jobs], device) if lead.consts else {}
    # the followers' params and buffers, and their decays (C, steps); empty without followers
    f_params: dict[str, torch.Tensor] = {}
    f_buffers: dict[str, torch.Tensor] = {}
    alphas, pairs = None, []
    if lead.follower is not None:
        f_params = {n: stack_trees([j.follower.weights[n] for j in jobs], device) for n in param_names}
        f_buffers = {n: stack_trees([j.follower.weights[n] for j in jobs], device) for n in buffer_names}
        alphas = torch.stack([j.follower.alphas for j in jobs]).to(device)
        pairs = [((f_params | f_buffers)[k], (params | buffers)[k]) for k in state_keys]
    means = StackedMeans(len(jobs), device)
    step_now = 0

    def objective(p: dict, b: dict, c: dict, batch: dict, fp: dict, fb: dict) -> tuple:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, (p, b), (x,))

        def follower(x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, (fp, fb), (x,))

        nets = StepNets(forward, follower if lead.follower else None, module=model)
        return lead.loss(nets, p, c, batch, step_now)

    grad_fn = vmap(grad_and_value(objective, has_aux=True), randomness="error")
    for s in range(lead.steps):
        step_now = s
        drawn = first if s == 0 else [j.draw(s) for j in jobs]
        split = [split_truth(b) for b in drawn]
        batch = stack_trees([b for b, _ in split], device)
        truth = stack_trees([t for _, t in split], device) if split[0][1] is not None else None
        rate = lead.rate(train, round_idx, s)
        grads, (loss, aux) = grad_fn(params, buffers, consts, batch, f_params, f_buffers)
        if not bool(torch.isfinite(loss).all()):
            for i, job in enumerate(jobs):
                check_finite(loss[i], round_idx, job.party)
        if lead.clip_norm > 0:
            grads = _clip(grads, lead.clip_norm)
        sgd_update(params, grads, moms, rate, train, lead.nesterov)
        if alphas is not None:
            ema_update_stacked(pairs, alphas[:, s])  # each client's follower, its own decay (FedSiam Eq. 9)
        means.add(lead.loss_name, loss)
        for name, value in aux.get("metrics", {}).items():
            means.add(name, value)
        if "pseudo_mask" in aux and truth is not None:
            means.add_pseudo(aux, truth)
    metrics = means.results(lead.steps)
    out = []
    for i in range(len(jobs)):
        weights = {k: (params[k] if k in params else buffers[k])[i].detach().to("cpu").clone() for k in state_keys}
        momentum = {n: moms[n][i].to("cpu").clone() for n in param_names if n in moms}
        follower = {k: t[i].detach().to("cpu").clone() for k, (t, _) in zip(state_keys, pairs)} if pairs else None
        out.append(JobResult(weights=weights, momentum=momentum, metrics=metrics[i], follower=follower))
    return out


def run_stacked(
    jobs: Sequence[LocalJob], model: nn.Module, train: TrainSettings, round_idx: int, max_stack: int = 0
) -> list[JobResult]:
    """Train ``jobs`` together, stacked along a client dimension; one :class:`JobResult` per job, in order.

    ``model`` (on the training device) gives the architecture; its own tensors are not used or
    changed (``functional_call`` swaps each client's in). Jobs are grouped by :func:`stack_groups`
    (at most ``max_stack`` to a stack when > 0) and each group trains as one stack; each job draws
    its batches in its own order, as alone.

    Raises
    ------
    ConfigError
        When the model has dropout (:func:`refuse_random_layers`).
    NonFiniteLossError
        When a client's loss is NaN or infinite (the first such client in ``jobs``' order).
    """
    refuse_random_layers(model)
    model.train()
    firsts = [job.draw(0) for job in jobs]
    results: list[JobResult | None] = [None] * len(jobs)
    for members in stack_groups(jobs, firsts, max_stack):
        with inputs_keep_strides():  # vmap cannot restride to channels_last (models/layout.py)
            trained = _train_group([jobs[i] for i in members], [firsts[i] for i in members], model, train, round_idx)
        for i, res in zip(members, trained):
            results[i] = res
    return results  # type: ignore[return-value]


__all__ = [
    "TRUTH",
    "CrossEntropyLoss",
    "Follower",
    "StackedMeans",
    "StepNets",
    "JobResult",
    "LocalJob",
    "StepLoss",
    "job_step",
    "refuse_random_layers",
    "run_job",
    "run_stacked",
    "sgd_update",
    "split_truth",
    "stack_groups",
    "stack_trees",
    "supervised_job",
    "tree_shapes",
]
