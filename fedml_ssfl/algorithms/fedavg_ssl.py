"""The SSFL benchmark of Zhang et al. (2020): consistency loss, FedAvg or grouping.

Labels-at-server. Every round, from the global model ``w_avg``:

* the server takes T SGD steps on its N_s labels (Eq. 2, weak augmentation alpha);
* each of the C_k sampled clients takes T steps on its unlabeled data with the user loss
  ``crl`` (Eq. 6: pseudo-label = argmax f(alpha(x)) kept where max prob >= tau, cross-entropy on
  f(A(x))) or ``self_training`` (Eq. 3: the same loss on alpha(x));
* the server averages itself with the clients: ``fedavg`` (Eq. 4/5, uniform, the server
  counting as one model), or ``grouping`` (Eq. 7: S groups each average with the server, the
  global model is the mean of the S group averages, and group i receives its own ``w_avg,i``
  next round).

The learning rate follows Eq. 9 (``train_args.lr_*``). Each round logs the weight diversity of
Eq. 8 (``sum ||g_i||^2 / ||sum g_i||^2`` with ``g_i = w_i - w_avg``) over the classifier layer,
as the authors plot it, and over the whole model.

Defaults follow the paper: tau = 0.95, S = 2, CRL. Grouping is fixed by client id
(``client_id mod S``) as in the authors' code; ``regroup: random`` redraws groups each round.
Where the paper is silent: a group with no sampled client this round is the server model
alone by Eq. 7 and is left out of the global mean (it would only pull toward w_s), and a client
whose group has no average yet receives the global model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import seeding
from ..aggregation import fedavg_with_server, grouping_average, weight_diversity
from ..config import ConfigError
from ..ssl import masked_consistency_loss
from ..training import BatchStream, InputPipeline, cosine_lr, cpu_state, make_optimizer, set_lr
from .base import AlgorithmConfig, ClientContext, ClientData, Message, check_finite
from .common import GlobalModelAlgorithm, client_party
from .registry import register_algorithm


@dataclass
class FedAvgSSLConfig(AlgorithmConfig):
    """Hyper-parameters of the SSFL benchmark (Zhang et al. Sec. 3.3, 4).

    Attributes
    ----------
    user_loss : str
        ``crl`` (Eq. 6, default) or ``self_training`` (Eq. 3).
    averaging : str
        ``fedavg`` (Eq. 4/5, default) or ``grouping`` (Eq. 7).
    num_groups : int
        S, the number of groups for ``grouping`` (paper: 2 on CIFAR-10/SVHN, 5 on EMNIST).
    regroup : str
        ``fixed`` (client_id mod S, the authors' code) or ``random`` (new groups every round).
    threshold : float
        tau, the pseudo-label confidence threshold (0.95).
    """

    user_loss: str = "crl"
    averaging: str = "fedavg"
    num_groups: int = 2
    regroup: str = "fixed"
    threshold: float = 0.95

    def check(self, cfg) -> None:
        """Cross-checks against the experiment config."""
        choices = {
            "user_loss": ("crl", "self_training"),
            "averaging": ("fedavg", "grouping"),
            "regroup": ("fixed", "random"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"ssfl_args.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}"
                )
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"ssfl_args.threshold: {self.threshold} must lie in [0, 1]")
        if self.num_groups < 1:
            raise ConfigError("ssfl_args.num_groups: must be >= 1")
        ck = cfg.train_args.client_num_per_round
        if self.averaging == "grouping" and self.num_groups > ck:
            raise ConfigError(
                f"ssfl_args.num_groups (S={self.num_groups}) is larger than train_args.client_num_per_round "
                f"(C_k={ck}); every group needs a client: set S <= C_k"
            )


@register_algorithm
class FedAvgSSL(GlobalModelAlgorithm):
    """Zhang et al.'s SSFL: CRL or self-training on clients, FedAvg or grouping on the server."""

    name = "fedavg_ssl"
    config_class = FedAvgSSLConfig

    def setup(self) -> None:
        super().setup()
        self.group_states: dict[int, dict[str, torch.Tensor]] = {}

    def group_of(self, client_id: int, chosen: list[int], round_idx: int) -> int:
        """The group of ``client_id`` this round (fixed by id, or a seeded random deal)."""
        s = self.config.num_groups
        if self.config.regroup == "fixed":
            return client_id % s
        order = sorted(chosen)
        perm = torch.randperm(
            len(order), generator=seeding.generator(self.seed, "groups", round_idx)
        ).tolist()
        return perm.index(order.index(client_id)) % s

    def server_step(self, round_idx: int) -> None:
        self._server_state = self.train_on_server_labels(self.global_state, round_idx)

    def message_for(self, client_id: int, round_idx: int) -> Message:
        if self.config.averaging == "grouping" and self.config.regroup == "fixed":
            g = self.group_of(client_id, [client_id], round_idx)
            return self.broadcast(round_idx, self.group_states.get(g), group=g)
        return self.broadcast(round_idx)

    # ---- client ------------------------------------------------------------------------
    def client_update(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        if data.num_unlabeled == 0:
            return Message()
        model = self.scratch_model(msg.weights, ctx.device)
        model.train()
        pipeline = InputPipeline(self.data_info, ctx.device)
        gen = ctx.generator(data.client_id)
        opt = make_optimizer(model, self.train)
        stream = BatchStream(data.unlabeled_idx, self.train.batch_size, gen)
        party = client_party(data.client_id)
        loss_sum = mask_sum = correct = kept = 0.0
        for s in range(self.train.local_steps):
            set_lr(opt, cosine_lr(self.train, ctx.round_idx * self.train.local_steps + s))
            batch = next(stream)
            weak = pipeline.weak(data.images[batch], gen)
            if self.config.user_loss == "crl":
                logits = model(torch.cat([weak, pipeline.strong(data.images[batch], gen)]))
                logits_weak, logits_train = logits.chunk(2)
            else:
                logits_weak = logits_train = model(weak)
            loss, pl = masked_consistency_loss(
                logits_train, logits_weak.detach().softmax(dim=1), self.config.threshold
            )
            check_finite(loss, ctx.round_idx, party)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach())
            mask_sum += pl.mask_rate
            n_kept = int(pl.mask.sum())
            if n_kept:
                truth = data.labels[batch].to(pl.labels.device)
                correct += float((pl.labels[pl.mask] == truth[pl.mask]).sum())
                kept += n_kept
        steps = self.train.local_steps
        metrics = {"loss": loss_sum / steps, "mask_rate": mask_sum / steps}
        if kept:
            metrics["pseudo_acc"] = correct / kept
        return Message(weights=cpu_state(model), num_samples=data.num_unlabeled, extras={"metrics": metrics})

    # ---- server ------------------------------------------------------------------------
    def aggregate(self, replies: dict[int, Message], round_idx: int) -> dict[str, float]:
        live = {k: m for k, m in replies.items() if not m.is_empty}
        before = self.global_state
        participants = [self._server_state, *(m.weights for m in live.values())]
        if self.config.averaging == "grouping":
            chosen = sorted(live)
            groups: dict[int, list] = {g: [] for g in range(self.config.num_groups)}
            for k in chosen:
                groups[self.group_of(k, chosen, round_idx)].append(live[k].weights)
            used = [g for g in groups if groups[g]]
            if used:
                avgs, self.global_state = grouping_average(self._server_state, [groups[g] for g in used])
                self.group_states = dict(zip(used, avgs))
            else:
                self.global_state = self._server_state
        else:
            self.global_state = fedavg_with_server(self._server_state, [m.weights for m in live.values()])
        fc = [k for k in before if k.startswith("fc.")]
        return {
            "weight_diversity": weight_diversity(before, participants),
            "weight_diversity_fc": weight_diversity(before, participants, fc) if fc else float("nan"),
        }

    def state_dict(self) -> dict:
        return {**super().state_dict(), "group_states": dict(self.group_states)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.group_states = state.get("group_states", {})
