"""Machinery shared by algorithms that keep one global model on the server."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .. import seeding
from ..training import InputPipeline, cpu_state, load_weights, supervised_steps
from .base import Algorithm, Message


class GlobalModelAlgorithm(Algorithm):
    """An algorithm whose server holds one global model (``self.global_state``).

    Provides model construction, evaluation access, checkpoint state and the server's
    supervised step; subclasses write ``message_for``, ``aggregate`` and ``client_update``.
    """

    def setup(self) -> None:
        seeding.seed_everything(self.seed)
        self.global_state: dict[str, torch.Tensor] = cpu_state(self.model_fn())

    # ---- models ------------------------------------------------------------------------
    def scratch_model(self, weights: dict[str, torch.Tensor], device: torch.device, slot: str = "client") -> nn.Module:
        """A reusable model instance (one per slot) loaded with ``weights`` on ``device``."""
        model = self._scratch.get(slot)
        if model is None:
            model = self.model_fn()
            self._scratch[slot] = model
        model.to(device)
        return load_weights(model, weights)

    def global_model(self) -> nn.Module:
        if self._eval_model is None:
            self._eval_model = self.model_fn()
        self._eval_model.load_state_dict(self.global_state)
        return self._eval_model

    def server_supervised_steps(
        self, model: nn.Module, train: Any, round_idx: int, generator: torch.Generator, **options: Any
    ) -> float:
        """:func:`~fedml_ssfl.training.supervised_steps` of ``model`` on the server's labeled samples.

        The server's supervised fine-tune, for every algorithm that trains on its labels.
        ``train`` is the :class:`~fedml_ssfl.training.TrainSettings` to use; ``options`` (``party``
        -- default "the server" --, ``steps``, ``augment``, ``loss_weight``, ``optimizer``,
        ``batches``, ``clip_norm``, ``after_step``, ``lr``) are passed on. Returns the mean loss.
        """
        options.setdefault("party", "the server")
        d = self.server_data
        return supervised_steps(
            model,
            InputPipeline(self.data_info, self.device),
            d.images,
            d.labels,
            d.labeled_idx,
            train,
            round_idx,
            generator,
            **options,
        )

    def train_on_server_labels(
        self, weights: dict[str, torch.Tensor], round_idx: int, loss_weight: float = 1.0, augment: str = "weak"
    ) -> dict[str, torch.Tensor]:
        """T supervised steps on the server's labels from ``weights`` (Zhang et al. Eq. 2).

        ``loss_weight`` and ``augment`` are those of :func:`~fedml_ssfl.training.supervised_steps`.
        """
        model = self.scratch_model(weights, self.device, slot="server")
        gen = seeding.generator(self.seed, "server", round_idx)
        self.server_supervised_steps(model, self.train, round_idx, gen, augment=augment, loss_weight=loss_weight)
        return cpu_state(model)

    def broadcast(self, round_idx: int, weights: dict[str, torch.Tensor] | None = None, **extras: Any) -> Message:
        """A message carrying the global (or given) weights and the round index."""
        return Message(
            weights=dict(weights if weights is not None else self.global_state),
            extras={"round": round_idx, **extras},
        )

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"global_state": copy.deepcopy(self.global_state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_state = state["global_state"]


def client_party(client_id: int) -> str:
    """How a client is named in error messages."""
    return f"client {client_id}"
