"""A FedML script's own model as the algorithms' model factory.

A FedML script builds its ``nn.Module`` and passes it to ``FedMLRunner``; the algorithms need a
factory of fresh copies (the global model, the clients' working copies, EMA / target nets,
FedMatch's ``sigma + psi``). :func:`script_model_factory` checks the module once
(:func:`~fedml_ssfl.models.head.check_classifier`: it must map the data's images to logits of its
class count) and returns a factory of deep copies on the CPU, in training mode, with the script's
initial weights. Where the script's data are flat vectors (FedML's MNIST ``lr`` data), the
algorithms still handle them as images (augmentation needs pixels) and each copy flattens its input
back to the vectors the module was written for, in a forward pre-hook.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .head import check_classifier


def _reshape_input(shape: tuple[int, ...], _module: nn.Module, args: tuple) -> tuple:
    x, *rest = args
    return (x.reshape(x.shape[0], *shape), *rest)


def script_model_factory(
    module: nn.Module, num_classes: int, in_channels: int, image_size: int, sample_shape: tuple[int, ...]
) -> Callable[[], nn.Module]:
    """Fresh copies of ``module`` for the algorithms, after checking it can be trained on the data.

    Parameters
    ----------
    module : nn.Module
        The script's model, as it passed it (left untouched).
    num_classes, in_channels, image_size : int
        What the data holds.
    sample_shape : tuple of int
        One sample as the script's loaders give it: ``(C, s, s)``, ``(s, s)`` or ``(C * s * s,)``.

    Raises
    ------
    ConfigError
        The module does not map the data to ``(N, num_classes)`` logits, has no trainable parameter,
        or no layer with parameters produces the logits (one line naming what is missing).
    """
    template = copy.deepcopy(module).to("cpu").train()
    if tuple(sample_shape) != (in_channels, image_size, image_size):
        template.register_forward_pre_hook(partial(_reshape_input, tuple(sample_shape)))
    check_classifier(template, num_classes, in_channels, image_size, f"the script's model {type(module).__name__}")

    def build() -> nn.Module:
        with torch.no_grad():
            return copy.deepcopy(template)

    return build


def script_model_name(module: nn.Module) -> str:
    """How ``model_args.model`` records a script's model: ``script:<class name>`` (not a registry name)."""
    return f"{SCRIPT_MODEL_PREFIX}{type(module).__name__}"


SCRIPT_MODEL_PREFIX = "script:"
"""``model_args.model`` of a run that trained a FedML script's own module: ``script:<class name>``."""
