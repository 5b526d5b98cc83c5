"""Evaluation of a model on a labeled set."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .contract import DataInfo
from .training import InputPipeline


def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    info: DataInfo,
    device: torch.device,
    batch_size: int = 1000,
) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` (eval mode, no augmentation; inference mode, which
    skips autograd's version counting: the same numbers as ``no_grad``, a little faster).

    Returns
    -------
    dict
        ``{"acc": float in [0, 1], "loss": float}``.
    """
    was_training = model.training
    model.to(device).eval()
    pipeline = InputPipeline(info, device)
    correct, loss, n = 0, 0.0, int(labels.numel())
    with torch.inference_mode():  # after the move: parameters moved in here would be inference tensors
        for start in range(0, n, batch_size):
            x = pipeline.plain(images[start : start + batch_size])
            y = labels[start : start + batch_size].to(device)
            logits = model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return {"acc": correct / max(n, 1), "loss": loss / max(n, 1)}
