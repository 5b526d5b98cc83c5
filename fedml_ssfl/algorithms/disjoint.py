"""FedMatch's disjoint learning (Jeong et al. 2021, Sec. 3.2) for one client, alone or stacked.

A :class:`DisjointJob` is one party's local training: it starts from ``sigma`` and ``psi`` (the
model's weights are ``sigma + psi``; ``torch.func.functional_call`` runs the model on them), holds
the frozen helpers' ``psi`` and draws step ``s``'s batches with ``draw(s)``. Each local step is a
sigma step (Eq. 4, psi frozen) on the labeled batch, then a psi step (Eq. 5, sigma frozen) on the
unlabeled batch, each with its own SGD (sigma: ``train_args.weight_decay``; psi: none; both with
FedMatch's ``ssfl_args.momentum``, 0 by default) at Eq. 9's rate of Zhang et al. The step losses
are one object that both trainers call (the :class:`DisjointLoss` protocol; FedMatch's
:class:`~fedml_ssfl.algorithms.fedmatch.FedMatchLoss`):

* :func:`run_disjoint`: ``torch.optim.SGD`` through :func:`~fedml_ssfl.training.run_steps`, one
  client after another (and the server's sigma steps in labels-at-server);
* :func:`run_disjoint_stacked`: a round's clients together, their ``sigma``, ``psi``, buffers,
  helpers and batches stacked along a client dimension, each phase's gradient by
  ``torch.func.vmap`` of ``torch.func.grad_and_value`` and the SGD step written out
  (:func:`~fedml_ssfl.stacked.sgd_update`), as :mod:`fedml_ssfl.stacked` does for one-phase jobs.

The results are equal up to floating-point summation order (``tests/test_stacked.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..contract import TrainSettings, check_finite
from ..models.layout import inputs_keep_strides
from ..ssl.pseudo_label import PseudoLabels
from ..stacked import (
    StackedMeans,
    refuse_random_layers,
    sgd_update,
    split_truth,
    stack_groups,
    stack_trees,
    tree_shapes,
)
from ..training import Phase, Step, cosine_lr, run_steps

Net = Callable[[Mapping[str, torch.Tensor], torch.Tensor, bool], torch.Tensor]
"""``net(weights, x, train_mode)``: the model's output on ``x`` with the parameters ``weights``."""


class DisjointLoss(Protocol):
    """The two step losses of disjoint learning, pure functions of the weights and the batch."""

    def sigma(self, net: Net, sigma: Mapping, psi: Mapping, batch: Mapping) -> torch.Tensor:
        """Eq. 4 on the labeled batch (``x_lab``, ``y_lab``), psi frozen."""
        ...

    def psi(
        self, net: Net, sigma: Mapping, psi: Mapping, helpers: Sequence[Mapping], batch: Mapping
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], PseudoLabels]:
        """Eq. 5 on the unlabeled batch (``x_plain``, ``x_strong``), sigma frozen: the loss, its terms
        (scalar tensors) and the pseudo-labels; ``helpers`` are the helpers' full weights."""
        ...


@dataclass
class DisjointJob:
    """One party's disjoint learning, described so that it trains alone or stacked with others.

    Attributes
    ----------
    party : str
        Who trains, for error messages ("client 3", "the server").
    sigma, psi : dict[str, torch.Tensor]
        Where the two parts start, by parameter name.
    buffers : dict[str, torch.Tensor]
        The model's buffers (BatchNorm statistics, if any); train-mode passes update them.
    helpers : list of dict
        The frozen helpers' ``psi``; helper ``j`` runs as ``sigma + psi_j`` with the starting
        ``sigma`` (Algorithm 1, line 14), in eval mode, without gradient.
    draw : callable
        ``draw(s)``: step ``s``'s batches, ``x_lab``/``y_lab`` (where sigma trains) and
        ``x_plain``/``x_strong`` (where psi trains) with their true labels under
        :data:`~fedml_ssfl.stacked.TRUTH` (diagnostics only).
    steps : int
        Local steps.
    sigma_steps, psi_steps : bool
        Whether the sigma and the psi phase run.
    """

    party: str
    sigma: dict[str, torch.Tensor]
    psi: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    helpers: list[dict[str, torch.Tensor]]
    draw: Callable[[int], dict[str, Any]]
    steps: int
    sigma_steps: bool
    psi_steps: bool


@dataclass
class DisjointResult:
    """The trained ``sigma`` and ``psi``, the buffers and the step means of a :class:`DisjointJob`."""

    sigma: dict[str, torch.Tensor]
    psi: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    metrics: dict[str, float]


def _optimiser_settings(train: TrainSettings, momentum: float) -> tuple[TrainSettings, TrainSettings]:
    """(sigma's, psi's) SGD settings: FedMatch's momentum, weight decay for sigma only."""
    sigma = dataclasses.replace(train, momentum=momentum)
    return sigma, dataclasses.replace(sigma, weight_decay=0.0)


def run_disjoint(
    job: DisjointJob, model: nn.Module, loss: DisjointLoss, train: TrainSettings, momentum: float, round_idx: int
) -> DisjointResult:
    """Train ``job`` one step after another with ``torch.optim.SGD`` (``model`` holds its buffers).

    Raises
    ------
    NonFiniteLossError
        When a loss is NaN or infinite.
    """
    device = next(model.parameters()).device
    names = list(job.sigma)
    sig = {n: job.sigma[n].to(device).clone().requires_grad_(True) for n in names}
    ps = {n: job.psi[n].to(device).clone().requires_grad_(True) for n in names}
    helper_w = [{n: job.sigma[n].to(device) + h[n].to(device) for n in names} for h in job.helpers]
    drawn: dict[int, dict[str, Any]] = {}

    def batch(s: int) -> dict[str, Any]:  # one draw a step, shared by its two phases
        if s not in drawn:
            drawn.clear()
            drawn[s] = job.draw(s)
        return drawn[s]

    def net(weights: Mapping[str, torch.Tensor], x: torch.Tensor, train_mode: bool) -> torch.Tensor:
        model.train(train_mode)
        return functional_call(model, dict(weights), (x,))

    def sigma_step(s: int) -> Step:  # Eq. 4: sigma learns from labels, psi frozen
        return Step(loss.sigma(net, sig, ps, batch(s)))

    def psi_step(s: int) -> Step:  # Eq. 5: psi learns from unlabeled data, sigma frozen
        b, truth = split_truth(batch(s))
        loss_u, terms, pl = loss.psi(net, sig, ps, helper_w, b)
        return Step(loss_u, terms, pseudo=pl, truth=truth)

    train_s, train_p = _optimiser_settings(train, momentum)
    phases = []
    if job.sigma_steps:
        opt_s = torch.optim.SGD(
            list(sig.values()), lr=train.learning_rate, momentum=train_s.momentum, weight_decay=train_s.weight_decay
        )
        phases.append(Phase(opt_s, sigma_step, "loss_s"))
    if job.psi_steps:
        opt_p = torch.optim.SGD(list(ps.values()), lr=train.learning_rate, momentum=train_p.momentum)
        phases.append(Phase(opt_p, psi_step, "loss_u"))
    metrics = run_steps(phases, job.steps, train, round_idx, job.party)
    new_buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if k in job.buffers}
    detached = {n: t.detach() for n, t in sig.items()}, {n: t.detach() for n, t in ps.items()}
    return DisjointResult(*detached, new_buffers, metrics)


def _signature(job: DisjointJob, first: Mapping[str, Any]) -> tuple:
    """What disjoint jobs must share to train in one stack."""
    return (job.steps, job.sigma_steps, job.psi_steps, len(job.helpers), tree_shapes(dict(first)))


def run_disjoint_stacked(
    jobs: Sequence[DisjointJob],
    model: nn.Module,
    loss: DisjointLoss,
    train: TrainSettings,
    momentum: float,
    round_idx: int,
    max_stack: int = 0,
) -> list[DisjointResult]:
    """Train ``jobs`` together, stacked along a client dimension; one result per job, in order.

    ``model`` (on the training device) gives the architecture; its tensors are not used. Jobs are
    grouped by what a stack must share (steps, phases, helper count, batch shapes; at most
    ``max_stack`` to a stack when > 0); each draws its batches in its own order, as alone.

    Raises
    ------
    ConfigError
        When the model has dropout.
    NonFiniteLossError
        When a client's loss is NaN or infinite (the first such client in ``jobs``' order).
    """
    refuse_random_layers(model)
    firsts = [job.draw(0) for job in jobs]
    results: list[DisjointResult | None] = [None] * len(jobs)
    for members in stack_groups(jobs, firsts, max_stack, signature=_signature):
        with inputs_keep_strides():  # vmap cannot restride to channels_last (models/layout.py)
            trained = _disjoint_group(
                [jobs[i] for i in members], [firsts[i] for i in members], model, loss, train, momentum, round_idx
            )
        for i, res in zip(members, trained):
            results[i] = res
    return results  # type: ignore[return-value]


def _disjoint_group(
    jobs: Sequence[DisjointJob],
    first: list[dict[str, Any]],
    model: nn.Module,
    loss: DisjointLoss,
    train: TrainSettings,
    momentum: float,
    round_idx: int,
) -> list[DisjointResult]:
    """Train jobs that share a :func:`_signature` as one stack."""
    device = next(model.parameters()).device
    lead = jobs[0]
    names = list(lead.sigma)
    sig = {n: stack_trees([j.sigma[n] for j in jobs], device) for n in names}
    ps = {n: stack_trees([j.psi[n] for j in jobs], device) for n in names}
    bufs = {k: stack_trees([j.buffers[k] for j in jobs], device) for k in lead.buffers}
    helpers = {
        str(h): {n: stack_trees([j.sigma[n] + j.helpers[h][n] for j in jobs], device) for n in names}
        for h in range(len(lead.helpers))
    }
    train_s, train_p = _optimiser_settings(train, momentum)
    moms_s: dict[str, torch.Tensor] = {}
    moms_p: dict[str, torch.Tensor] = {}
    means = StackedMeans(len(jobs), device)

    def net_with(buffers: dict[str, torch.Tensor]) -> Net:
        def net(weights: Mapping[str, torch.Tensor], x: torch.Tensor, train_mode: bool) -> torch.Tensor:
            model.train(train_mode)
            return functional_call(model, (dict(weights), buffers), (x,))

        return net

    def sigma_objective(s_: dict, p_: dict, b_: dict, batch: dict) -> torch.Tensor:
        return loss.sigma(net_with(b_), s_, p_, batch)

    def psi_objective(p_: dict, s_: dict, b_: dict, hw: dict, batch: dict) -> tuple:
        loss_u, terms, pl = loss.psi(net_with(b_), s_, p_, [hw[str(h)] for h in range(len(hw))], batch)
        return loss_u, {"metrics": terms, "pseudo_labels": pl.labels, "pseudo_mask": pl.mask}

    sigma_grad = vmap(grad_and_value(sigma_objective), randomness="error")
    psi_grad = vmap(grad_and_value(psi_objective, has_aux=True), randomness="error")

    def check(values: torch.Tensor) -> None:
        if not bool(torch.isfinite(values).all()):
            for i, job in enumerate(jobs):
                check_finite(values[i], round_idx, job.party)

    for s in range(lead.steps):
        drawn = first if s == 0 else [j.draw(s) for j in jobs]
        split = [split_truth(b) for b in drawn]
        batch = stack_trees([b for b, _ in split], device)
        truth = stack_trees([t for _, t in split], device) if split[0][1] is not None else None
        rate = cosine_lr(train, round_idx * train.local_steps + s)
        if lead.sigma_steps:  # Eq. 4, psi frozen
            grads, loss_s = sigma_grad(sig, ps, bufs, batch)
            check(loss_s)
            sgd_update(sig, grads, moms_s, rate, train_s, False)
            means.add("loss_s", loss_s)
        if lead.psi_steps:  # Eq. 5 with the sigma just updated, frozen
            grads, (loss_u, aux) = psi_grad(ps, sig, bufs, helpers, batch)
            check(loss_u)
            sgd_update(ps, grads, moms_p, rate, train_p, False)
            means.add("loss_u", loss_u)
            for name, value in aux["metrics"].items():
                means.add(name, value)
            if truth is not None:
                means.add_pseudo(aux, truth)
    metrics = means.results(lead.steps)
    out = []
    for i in range(len(jobs)):
        out.append(
            DisjointResult(
                sigma={n: t[i].detach().to("cpu").clone() for n, t in sig.items()},
                psi={n: t[i].detach().to("cpu").clone() for n, t in ps.items()},
                buffers={k: t[i].detach().to("cpu").clone() for k, t in bufs.items()},
                metrics=metrics[i],
            )
        )
    return out


__all__ = ["DisjointJob", "DisjointLoss", "DisjointResult", "run_disjoint", "run_disjoint_stacked"]
