"""Evaluation of a model on a labeled set."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .contract import DataInfo
from .training import InputPipeline

EVAL_BATCH_SIZE = 100
"""The default evaluation batch (``validation_args.eval_batch_size``): the fastest on a CPU for every shipped
model. Measured per 1,000 test images with one torch thread (``benchmarks/eval_batch.py``, results in
``benchmarks/results/eval_batch.json``): WRN-28-2 at 32x32 in channels_last 2.2 CPU s at batch 100 against
3.1 at 250 and 4.8 at 1000; cnn28 and FedSiam's and the EMNIST CNNs likewise fastest at 50 to 250 (2 to 3x
slower at 1000). A big batch's activations outgrow the CPU's caches and are fresh allocations each time.
The batch changes no prediction (each image is computed alone: BatchNorm uses its running statistics in
evaluation); the mean loss may differ in its last bits (another summation order)."""


def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    info: DataInfo,
    device: torch.device,
    batch_size: int = EVAL_BATCH_SIZE,
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
